"""memguard.prepare(..., strategy="fsdp2") on a 1-rank gloo group in this process (the 2-rank runs with real
OOMs are in test_fsdp2_recovery.py)."""

from __future__ import annotations

import copy
import socket

import pytest
import torch
import torch.distributed as dist
from torch import nn

import memguard
from memguard.errors import ConfigError
from memguard.guard import guard_status, prepare, step

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return ((self.head(x).squeeze(-1) - y) ** 2).mean()


def _batch(n: int = 8) -> dict:
    g = torch.Generator().manual_seed(3)
    return {"x": torch.randn(n, 8, generator=g), "y": torch.randn(n, generator=g)}


@pytest.fixture
def group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_fixed_micro_batch_shards_repoints_the_optimizer_and_matches_plain_training(group) -> None:
    from torch.distributed.fsdp import FSDPModule

    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert prepare(model, opt, strategy="fsdp2", micro_batch_size=2) == (model, opt)
    assert isinstance(model, FSDPModule) and all(isinstance(b, FSDPModule) for b in model.blocks)
    # the optimizer now steps the sharded parameters (FSDP2 replaced them)
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in model.parameters()}
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        loss = step(model, opt, _batch())
        ref_loss = ref(**_batch())
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        # four micro-batches of 2 weighted by 1/4 against one batch of 8: fp32 reordering only
        assert loss == pytest.approx(ref_loss.item(), rel=1e-5)
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6)  # the same fp32 reordering bound
    status = guard_status(model)
    assert status.micro_batch_size == 2 and status.steps == 2 and status.precision == "32-true"


def test_planning_on_the_first_step_then_sharding(group) -> None:
    from torch.distributed.fsdp import FSDPModule

    model = Net()
    opt = torch.optim.AdamW(model.parameters())
    prepare(model, opt, strategy="fsdp2", budget_bytes=1 << 30, device="cpu", precision="32-true")
    assert not isinstance(model, FSDPModule)  # nothing to shard by until the plan is known
    step(model, opt, _batch())
    plan = guard_status(model).plan
    assert isinstance(model, FSDPModule) and plan is not None and plan.zero_stage in (1, 2, 3)
    assert plan.micro_batch_size * plan.grad_accum_steps == 8  # 1 GiB holds the whole batch of 8
    assert len(opt.state) == len(list(model.parameters()))  # AdamW stepped the sharded parameters


def test_an_already_sharded_model_keeps_its_layout(group) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = Net()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for b in model.blocks:
        fully_shard(b, reshard_after_forward=False, mp_policy=mp)
    fully_shard(model, reshard_after_forward=False, mp_policy=mp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prepare(model, opt, strategy="fsdp2", micro_batch_size=4)
    # reshard_after_forward=False is sharding level 2 (or 1); the bf16 policy is bf16-mixed
    guard = memguard.guard._core.guard_of(model, "")
    assert guard.constraints.zero_stages == (2, 1) and guard.constraints.precisions == ("bf16-mixed",)
    assert step(model, opt, _batch()) > 0


def test_user_mistakes_are_listed_together() -> None:
    assert not dist.is_initialized()
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError) as err:
        prepare(model, opt, strategy="fsdp2", grad_scaler=torch.amp.GradScaler("cpu"), precision="16-mixed")
    text = "\n".join(err.value.problems)
    assert "init_process_group" in text and "grad_scaler=" in text and "16-mixed" in text
    with pytest.raises(ConfigError, match="to_config"):
        prepare(model, opt, strategy="deepspeed")


def test_clipping_under_fsdp2_clips_the_dtensor_gradients_once_per_step(group) -> None:
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prepare(model, opt, strategy="fsdp2", micro_batch_size=2, max_grad_norm=0.01, clip_grad_value=0.002,
            verbose=False)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        step(model, opt, _batch())
        ref(**_batch()).backward()
        norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01))
        torch.nn.utils.clip_grad_value_(ref.parameters(), 0.002)
        ref_opt.step()
        ref_opt.zero_grad()
    assert guard_status(model).grad_norm == pytest.approx(norm, rel=1e-5) and norm > 0.01
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6)
