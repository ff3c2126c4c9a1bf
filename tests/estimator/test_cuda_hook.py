"""The CUDA target traced on CPU fakes runs forward and backward under the CUDA kernel model.

A rule registered here (and removed afterwards) records every call it receives, which shows: the
target it is given (the GPU spec's compute capability and vendor, the installed torch's version);
that it sees inputs already cast by the autocast emulation (real CUDA autocast casts before the
kernel runs); that checkpointed blocks recompute under it in backward; and that the CPU target
never reaches it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memguard
from memguard.estimator._cuda import parse_torch_version
from memguard.estimator._cuda_kernels import RULES, CudaTarget
from memguard.estimator._targets import usual_stack
from memguard.estimator._trace import load_rules


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return x + torch.relu(self.lin(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _loss(model, batch):
    return model(batch).float().square().mean()


@pytest.fixture
def calls():
    """Route ``F.linear`` to a recording rule for the test's duration, restoring any real rule."""
    load_rules()  # first, so that a real rule for F.linear is the one restored afterwards
    seen: list[tuple[CudaTarget, torch.dtype]] = []

    def rule(target, func, args, kwargs):
        seen.append((target, args[0].dtype))
        return func(*args, **kwargs)

    previous = RULES.get(F.linear)
    RULES[F.linear] = rule
    try:
        yield seen
    finally:
        if previous is None:
            RULES.pop(F.linear, None)
        else:
            RULES[F.linear] = previous


def _estimate(**kw):
    torch.manual_seed(0)
    return memguard.estimate(Net(), torch.randn(8, 16), loss_fn=_loss, **kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the CUDA target traces CUDA's own kernels")
def test_rules_see_the_target_gpu_and_autocast_inputs(calls):
    _estimate(device="cuda", gpu="H100-80GB", precision="bf16-mixed")
    # three blocks, one linear each, in forward; the H100 is compute capability 9.0 with 132 SMs (catalog)
    assert len(calls) == 3
    # with the installed torch and its default wheel's CUDA and cuDNN (no torch_version= given)
    host = usual_stack(parse_torch_version(None), "nvidia", (9, 0))
    assert {t for t, _ in calls} == {CudaTarget(capability=(9, 0), torch_version=host.torch, vendor="nvidia",
                                                cuda_version=host.cuda, cudnn_version=host.cudnn, sm_count=132)}
    # linear is on CUDA autocast's lower-precision list: the kernel receives bf16 inputs
    assert {d for _, d in calls} == {torch.bfloat16}


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the CUDA target traces CUDA's own kernels")
def test_checkpoint_recomputation_runs_under_the_kernel_model(calls):
    _estimate(device="cuda", gpu="MI300X", precision="bf16-mixed", activation_checkpointing=True)
    # 3 calls in forward + 3 again when backward recomputes the checkpointed blocks, still cast
    assert len(calls) == 6
    assert {d for _, d in calls} == {torch.bfloat16}
    assert {t.vendor for t, _ in calls} == {"amd"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the CUDA target traces CUDA's own kernels")
def test_fp32_and_generic_gpu(calls):
    _estimate(device="cuda", precision="32-true")
    # gpu=None is the generic GPU, whose constants are the A100's (capability 8.0)
    assert [t.capability for t, _ in calls] == [(8, 0)] * 3
    assert {d for _, d in calls} == {torch.float32}


def test_the_cpu_target_never_reaches_the_kernel_model(calls):
    _estimate(device="cpu", precision="bf16-mixed")
    assert calls == []
