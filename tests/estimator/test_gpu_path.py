"""The CUDA target traces on fake CUDA tensors where a GPU is present, and falls back to CPU fakes.

Without a GPU the fallback is what can be checked: pretending CUDA is available makes the fake CUDA
trace fail (CPU torch cannot run backward on CUDA fakes), which must be logged and must give the
same estimate as the CPU-fake path. On a machine with a GPU the real path runs.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import memguard
import memguard.estimator.gpus


def _model_and_batch():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    return model, torch.randn(16, 32)


def _loss(m, b):
    return m(b).square().mean()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback path is what a CPU-only machine can check")
def test_cuda_target_falls_back_to_cpu_fakes_when_cuda_tracing_fails(monkeypatch, caplog):
    model, batch = _model_and_batch()
    expected = memguard.estimate(model, batch, loss_fn=_loss, gpu="A100-80GB", precision="bf16-mixed")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with caplog.at_level(logging.WARNING, logger="memguard"):
        got = memguard.estimate(model, batch, loss_fn=_loss, gpu="A100-80GB", precision="bf16-mixed")
    assert got == expected
    assert any("tracing on CPU fake tensors instead" in r.getMessage() for r in caplog.records)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_target_traces_on_the_gpu_without_allocating(caplog, monkeypatch):
    model, batch = _model_and_batch()
    before = torch.cuda.memory_allocated()
    with caplog.at_level(logging.WARNING, logger="memguard"):
        est = memguard.estimate(model, batch, loss_fn=_loss, precision="bf16-mixed")
    assert torch.cuda.memory_allocated() == before
    assert not any("instead" in r.getMessage() for r in caplog.records)
    # Linear, ReLU, Linear under bf16 autocast allocate the same on CUDA as memguard's CPU-fake
    # emulation of CUDA autocast says: both paths give the same estimate
    spec = memguard.estimator.gpus.current_gpu()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(memguard.estimator.gpus, "current_gpu", lambda index=0: spec)  # same GPU constants
    emulated = memguard.estimate(model, batch, loss_fn=_loss, precision="bf16-mixed")
    assert est.peak_bytes == emulated.peak_bytes
    assert est.context_bytes == emulated.context_bytes > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback path is what a CPU-only machine can check")
def test_a_failed_cuda_trace_leaves_no_mode_on_the_callers_stack(monkeypatch):
    # the fake-CUDA attempt enters the unmodelled-kernel finder (a TorchFunctionMode) before CUDA
    # autocast fails to start on a CPU-only torch; the finder must not stay active after the fallback
    from torch.overrides import _get_current_function_mode_stack

    model, batch = _model_and_batch()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    memguard.estimate(model, batch, loss_fn=_loss, gpu="A100-80GB", precision="bf16-mixed")
    assert _get_current_function_mode_stack() == []
