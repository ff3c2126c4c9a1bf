"""Tests of GPU sizing (``fit_gpus``): one fit per GPU, and more memory never needs more GPUs."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from memguard import ConfigError, Plan
from memguard.estimator.gpus import get_gpu
from memguard.planner.api import GpuFit, fit_gpus

# ~1.0e9 parameters (60 x Linear(4096, 4096), 16.8M each) on meta: 16 bytes/param of mixed-
# precision Adam states (ZeRO paper) = 16 GB, too much for one 16 GB-class GPU, comfortable on 80 GB.
LAYERS, WIDTH = 60, 4096
GPUS = ["T4", "V100-32GB", "A100-40GB", "A100-80GB", "H200"]


def _loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).float().pow(2).mean()


@pytest.fixture(scope="module")
def job():
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    return model, torch.empty(1, WIDTH, device="meta")


@pytest.fixture(scope="module")
def fits(job) -> list[GpuFit]:
    model, batch = job
    return fit_gpus(model, batch, global_batch_size=64, gpus=GPUS, max_gpus=16, loss_fn=_loss,
                    precision="16-mixed", activation_checkpointing=False)


def _usable(name: str) -> int:
    g = get_gpu(name)
    return g.memory_bytes - g.context_bytes


def test_one_fit_per_gpu(fits):
    assert sorted(f.gpu for f in fits) == sorted(GPUS)
    for f in fits:
        if f.count is None:
            assert f.plan is None and f.reason
            continue
        p = f.plan
        assert isinstance(p, Plan)
        assert p.gpu == f.gpu and p.world_size == f.count
        assert p.micro_batch_size * p.grad_accum_steps * p.world_size == 64
        assert f.count & (f.count - 1) == 0 and 64 % f.count == 0  # powers of two dividing the global batch
        assert p.estimate.peak_bytes <= p.usable_bytes
    json.dumps([f.to_dict() for f in fits])  # JSON-ready


def test_more_memory_never_needs_more_gpus(fits):
    count = {f.gpu: (f.count if f.count is not None else float("inf")) for f in fits}
    for a in GPUS:
        for b in GPUS:
            if _usable(a) >= _usable(b):
                assert count[a] <= count[b], (a, count[a], b, count[b])
    # the job is sized so the answer is not trivial: the smallest GPU needs more than one
    assert count["T4"] > 1
    assert count["H200"] == 1


def test_fits_are_sorted_cheapest_first(fits):
    keys = [(f.count is None, f.count or 0, get_gpu(f.gpu).memory_bytes) for f in fits]
    assert keys == sorted(keys)


def test_no_fit_within_max_gpus_says_why(job):
    model, batch = job
    (f,) = fit_gpus(model, batch, global_batch_size=64, gpus=["T4"], max_gpus=1, loss_fn=_loss,
                    precision="16-mixed", activation_checkpointing=False)
    assert f.count is None and f.plan is None
    assert f.reason


@pytest.mark.parametrize("option", ["gpu", "world_size", "budget_bytes", "device"])
def test_options_fit_gpus_chooses_itself_are_refused(job, option):
    model, batch = job
    with pytest.raises(ConfigError, match=option):
        fit_gpus(model, batch, global_batch_size=64, gpus=["T4"], loss_fn=_loss, **{option: 1})


def test_unknown_gpu_is_a_config_error(job):
    model, batch = job
    with pytest.raises(ConfigError):
        fit_gpus(model, batch, global_batch_size=64, gpus=["NOT-A-GPU"], loss_fn=_loss)
