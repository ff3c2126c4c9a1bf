"""Tests of the CPU ground-truth measurement on tiny, hand-checkable models."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `benchmarks`

from benchmarks.ground_truth import (  # noqa: E402
    PHASES,
    default_loss,
    live_state_bytes,
    measure_cpu_peak,
    measure_repeated,
)

IN, HIDDEN, OUT = 64, 256, 32
FP32 = 4  # bytes per float32 element


@pytest.fixture(autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))


def _mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def _batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, IN, generator=g), torch.randn(n, OUT, generator=g)


def _param_bytes() -> int:
    # two Linear layers: weight + bias each
    return FP32 * (IN * HIDDEN + HIDDEN + HIDDEN * OUT + OUT)


def _measure(n: int, steps: int = 2):
    model = _mlp()
    return measure_cpu_peak(model, _batch(n), _mse, torch.optim.AdamW(model.parameters()), steps=steps)


def test_peak_is_at_least_the_model_states_and_the_batch():
    n = 128
    gt = _measure(n)
    params = _param_bytes()
    batch = FP32 * n * (IN + OUT)
    # during backward of the steady step: params + grads + Adam exp_avg + exp_avg_sq (4 x params,
    # Kingma & Ba 2015 keep two moments) + the batch are all live
    lower = 4 * params + batch
    assert gt.steady_peak_bytes >= lower
    # activations of this MLP are a few (n x HIDDEN) fp32 tensors; 8 of them is a generous cap
    assert gt.steady_peak_bytes <= lower + 8 * FP32 * n * HIDDEN + (1 << 16)
    assert gt.peak_bytes == max(gt.step_peaks)
    assert gt.steady_peak_bytes == gt.step_peaks[-1]
    assert gt.peak_phase in PHASES


def test_baseline_and_end_accounting_are_exact():
    n = 32
    gt = _measure(n)
    params = _param_bytes()
    batch = FP32 * n * (IN + OUT)
    # before step 1: no grads, no optimizer state
    assert gt.baseline_bytes == params + batch
    # after the last zero_grad(set_to_none=True): params, exp_avg, exp_avg_sq, and one fp32
    # scalar `step` tensor per parameter tensor (torch.optim.AdamW, capturable=False)
    assert gt.end_bytes == 3 * params + batch + 4 * FP32
    # nothing allocated during the steps stays live outside model/batch/optimizer
    assert gt.residual_bytes == 0
    # only the loss is live on top of the state when zero_grad ends; mse_loss returns a 0-dim
    # view whose storage is its whole unreduced (n x OUT) buffer, so measure that storage here
    loss_storage = nn.functional.mse_loss(torch.zeros(n, OUT), torch.zeros(n, OUT)).untyped_storage().nbytes()
    assert gt.phase_end_bytes["zero_grad"] == gt.end_bytes + loss_storage


def test_first_step_creates_optimizer_state_lazily():
    gt = _measure(64, steps=3)
    assert len(gt.step_peaks) == 3
    # step 2 holds from its start the Adam state that step 1 creates only inside optimizer.step()
    assert gt.step_peaks[1] >= gt.step_peaks[0]
    assert gt.step_peaks[1] == gt.step_peaks[2]  # steady state repeats exactly
    assert set(gt.phase_peaks) == set(PHASES)


def test_larger_batch_gives_larger_peak():
    small, large = _measure(32), _measure(512)
    # the batch alone grows by 480 x (IN + OUT) fp32 values
    assert large.steady_peak_bytes - small.steady_peak_bytes >= FP32 * 480 * (IN + OUT)


def test_repeated_measurements_agree():
    results, spread = measure_repeated(lambda: (_mlp(), _batch(64), _mse), torch.optim.AdamW, repeats=2)
    assert len(results) == 2
    # one thread, paused cyclic GC: frees happen at the same points every time
    assert spread <= results[0].steady_peak_bytes // 1000


def test_live_state_counts_tied_weights_once():
    emb = nn.Embedding(100, 16)
    head = nn.Linear(16, 100, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head})
    assert live_state_bytes(model, torch.zeros(0)) == FP32 * 100 * 16


class _Returns(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))
        self.kind = kind

    def forward(self, x, y=None):
        total = (self.w * x).sum() + (0 if y is None else y.sum())
        if self.kind == "dict":
            return {"loss": total, "logits": x}
        if self.kind == "vector":
            return self.w * x
        return total


def test_default_loss_calls_the_model_like_the_estimator():
    x, y = torch.ones(3), torch.full((3,), 2.0)
    assert default_loss(_Returns("scalar"), x).item() == 3.0  # tensor -> model(x)
    assert default_loss(_Returns("scalar"), (x, y)).item() == 9.0  # tuple -> model(*batch)
    assert default_loss(_Returns("scalar"), {"x": x, "y": y}).item() == 9.0  # dict -> model(**batch)
    assert default_loss(_Returns("dict"), [x]).item() == 3.0  # output["loss"]
    with pytest.raises(TypeError, match="loss_fn"):
        default_loss(_Returns("vector"), x)


def test_refuses_non_cpu_and_bad_steps():
    with torch.device("meta"):
        model = _mlp()
    with pytest.raises(ValueError, match="CPU"):
        measure_cpu_peak(model, _batch(4), _mse, torch.optim.SGD(model.parameters()))
    model = _mlp()
    with pytest.raises(ValueError, match="steps"):
        measure_cpu_peak(model, _batch(4), _mse, torch.optim.SGD(model.parameters()), steps=0)
