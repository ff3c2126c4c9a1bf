"""Batches whose shape changes through the Accelerate hooks and the Lightning callback.

Both front-ends run their batches through the guard core, so each shape keeps its own micro-batch
there too. The model raises the CPU allocator's message when a micro-batch holds more than 1,024
positions (samples x length), so 16 samples of 64 tokens fit and of 512 tokens only 2.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from memguard.estimator._result import Estimate
from memguard.planner._plan import Plan

LIMIT = 16 * 64
LENGTHS = [64, 64, 512, 64, 512, 64]


def _oom_if_too_big(x: torch.Tensor) -> None:
    from torch._subclasses.fake_tensor import is_fake

    if not is_fake(x) and x.shape[0] * x.shape[1] > LIMIT:  # real batches only: memguard plans on fake ones  # the message of c10/core/impl/alloc_cpu.cpp
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")


class Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _oom_if_too_big(x)
        return self.fc2(torch.relu(self.fc1(x))).mean()


def _plan(micro: int, accum: int) -> Plan:
    est = Estimate(peak_bytes=1 << 20, breakdown={"params": 1 << 10}, context_bytes=0, peak_phase="backward",
                   allocated_peak_bytes=1 << 20, device="cpu", precision="32-true", zero_stage=0, world_size=1,
                   gpu=None, micro_batch_size=micro)
    return Plan(micro_batch_size=micro, grad_accum_steps=accum, world_size=1, global_batch_size=micro * accum,
                precision="32-true", activation_checkpointing=False, zero_stage=0, budget_bytes=1 << 30,
                estimate=est, device="cpu")


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="needs accelerate")
@pytest.mark.parametrize("accum, expected", [
    # one batch per step: the 512-token batches run at 2 (16 -> 8 -> 4 -> 2 on the first), the others at 16
    (1, [16, 16, 2, 16, 2, 16]),
    # two batches per step: within a step the micro-batch never grows again (an OOM replays the step's
    # earlier batches at the current size), so the 64-token batch after a 512-token one runs at 2 too
    (2, [16, 16, 2, 2, 2, 2]),
])
def test_accelerate_hooks_keep_a_micro_batch_per_shape(accum: int, expected: list[int]) -> None:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from memguard.integrations.accelerate import prepare, status, step

    AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accum)
    model = Tokens()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = prepare(accelerator, model, opt, plan=_plan(16, accum), loss_fn=lambda m, b: m(b))
    sizes = []
    for length in LENGTHS:
        step(accelerator, model, opt, torch.randn(16, length, 8))
        sizes.append(status(model).micro_batch_size)
    assert sizes == expected
    st = status(model)
    assert {str(k): v for k, v in st.micro_batch_sizes.items()} == {"batch[*,64,8]": 16, "batch[*,512,8]": 2}
    assert st.oom_retries == 3  # only the first 512-token batch halved, three times
    AcceleratorState._reset_state(True)


_PL = next((name for name in ("lightning.pytorch", "pytorch_lightning")
            if importlib.util.find_spec(name.split(".")[0]) is not None), None)


@pytest.mark.skipif(_PL is None, reason="needs Lightning")
def test_lightning_callback_keeps_a_micro_batch_per_shape(tmp_path) -> None:
    pl = importlib.import_module(_PL)
    from torch.utils.data import DataLoader, Dataset

    from memguard.integrations.lightning import MemguardCallback

    class Sequences(Dataset):
        def __len__(self) -> int:
            return 16 * len(LENGTHS)

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.randn(LENGTHS[i // 16], 8, generator=torch.Generator().manual_seed(i))

    sizes: list[int] = []

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Tokens()
            self.batch_size = 16

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.net(batch)

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            sizes.append(callback.status().micro_batch_size)

        def configure_optimizers(self):  # noqa: ANN201
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(Sequences(), batch_size=self.batch_size, collate_fn=torch.stack)

    callback = MemguardCallback(plan=_plan(16, 1))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
                         default_root_dir=str(tmp_path))
    trainer.fit(Lit())
    # as for the Accelerate hooks with one batch per step: 512 tokens at 2, 64 tokens back at 16
    assert sizes == [16, 16, 2, 16, 2, 16]
    st = callback.status()
    assert {str(k): v for k, v in st.micro_batch_sizes.items()} == {"batch[*,64,8]": 16, "batch[*,512,8]": 2}
    assert st.oom_retries == 3
