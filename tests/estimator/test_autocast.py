"""Tests of the CUDA autocast emulation (``memguard.estimator._autocast``).

The expected dtypes are CUDA autocast's documented policy (torch.amp docs, "CUDA Ops that can
autocast to float16" / "CUDA Ops that can autocast to float32", and ATen/autocast_mode.h):
matmul-like ops (linear, matmul, bmm, conv, SDPA) run in the lower precision; softmax,
log_softmax, layer_norm, exp, pow, losses and reductions like sum produce float32; other ops
(relu, gelu, add) run in whatever dtype they receive; only float32 inputs are cast, integer and
float64 tensors are left alone; casts of leaf tensors that require grad (weights) are cached.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import memguard
from memguard.estimator._autocast import FP32, FP32_SET_DTYPE, LOWER, CudaAutocastEmulation

LOW = [torch.bfloat16, torch.float16]


def rand(*shape, seed=0, **kw):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), **kw)


class CastCounter(TorchDispatchMode):
    """Counts dtype conversions (aten._to_copy) below autograd."""

    def __init__(self):
        super().__init__()
        self.casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default:
            self.casts += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("low", LOW)
def test_lower_precision_ops(low):
    x, w, b = rand(4, 8), rand(16, 8, requires_grad=True), rand(16)
    with CudaAutocastEmulation(low):
        assert F.linear(x, w, b).dtype == low
        assert (x @ w.t()).dtype == low  # Tensor.__matmul__ is matmul
        assert torch.matmul(x, w.t()).dtype == low
        assert torch.bmm(x[None], w.t()[None]).dtype == low
        assert F.conv1d(x[None], rand(3, 4, 2)).dtype == low
        q = x[None, None]
        assert F.scaled_dot_product_attention(q, q, q).dtype == low


@pytest.mark.parametrize("low", LOW)
def test_fp32_ops_upcast_low_precision_inputs(low):
    y = rand(4, 16).to(low)
    with CudaAutocastEmulation(low):
        assert F.softmax(y, -1).dtype == torch.float32  # SET_OPT_DTYPE: asked for an fp32 result
        assert y.softmax(-1).dtype == torch.float32
        assert F.log_softmax(y, -1).dtype == torch.float32
        assert y.sum().dtype == torch.float32
        assert F.layer_norm(y, (16,)).dtype == torch.float32  # FP32 list
        assert torch.exp(y).dtype == torch.float32
        assert y.pow(2).dtype == torch.float32
        assert F.mse_loss(y, rand(4, 16)).dtype == torch.float32
        assert F.cross_entropy(y, torch.tensor([0, 1, 2, 3])).dtype == torch.float32


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_follows_the_composite_under_autocast(smoothing):
    # LossNLL.cpp: log_softmax with the input's own dtype (autocast leaves a given dtype alone),
    # then nll_loss, which autocast runs in fp32 (AT_FORALL_FP32)
    logits = rand(8, 10).to(torch.bfloat16).requires_grad_()
    target = torch.arange(8)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with CudaAutocastEmulation(torch.bfloat16):
            emulated = F.cross_entropy(logits, target, label_smoothing=smoothing)
    logp = F.log_softmax(logits.detach(), 1)
    expected = F.nll_loss(logp.float(), target)
    if smoothing:
        expected = (1 - smoothing) * expected + smoothing * (-logp.float().sum(1)).mean() / 10
    assert emulated.dtype == torch.float32
    assert torch.allclose(emulated, expected, rtol=1e-3)
    # what backward keeps of the logits' size: the 16-bit log-probabilities and their fp32 copy
    big = sorted(str(t.dtype) for t in saved if t.shape == (8, 10))
    assert big == ["torch.bfloat16", "torch.float32"]


def test_other_ops_keep_their_input_dtype():
    y = rand(4, 16).to(torch.bfloat16)
    with CudaAutocastEmulation(torch.bfloat16):
        assert torch.relu(y).dtype == torch.bfloat16
        assert F.gelu(y).dtype == torch.bfloat16
        assert (y + y).dtype == torch.bfloat16
        assert F.embedding(torch.tensor([0, 1]), rand(16, 8)).dtype == torch.float32  # not cast by autocast


def test_only_float32_is_cast():
    with CudaAutocastEmulation(torch.bfloat16):
        assert F.linear(rand(2, 3).double(), rand(4, 3).double()).dtype == torch.float64
        ints = torch.ones(2, 2, dtype=torch.long)
        assert torch.mm(ints, ints).dtype == torch.long


def test_promote_ops_use_the_widest_dtype():
    y = rand(4, 16).to(torch.bfloat16)
    with CudaAutocastEmulation(torch.bfloat16):
        assert torch.addcmul(rand(4, 16), y, y).dtype == torch.float32


def test_weight_casts_are_cached_until_cleared():
    w = rand(16, 8, requires_grad=True)  # a leaf that requires grad: a weight
    x = rand(4, 8)
    mode = CudaAutocastEmulation(torch.bfloat16)
    with mode, CastCounter() as counter:
        F.linear(x, w)
        F.linear(x, w)
    # x is cast twice (activations are not cached), w once
    assert counter.casts == 3
    mode.clear_cache()
    with mode, CastCounter() as counter:
        F.linear(x, w)
    assert counter.casts == 2  # the cache was emptied: w is cast again


def test_no_caching_after_forward():
    w = rand(16, 8, requires_grad=True)
    mode = CudaAutocastEmulation(torch.bfloat16)
    mode.caching = False  # set by the tracer for checkpoint recomputation in backward
    with mode, CastCounter() as counter:
        F.linear(rand(4, 8), w)
        F.linear(rand(4, 8), w)
    assert counter.casts == 4


def test_non_leaf_tensors_are_not_cached():
    w = rand(16, 8, requires_grad=True) * 1.0  # not a leaf
    with CudaAutocastEmulation(torch.bfloat16), CastCounter() as counter:
        F.linear(rand(4, 8), w)
        F.linear(rand(4, 8), w)
    assert counter.casts == 4


def test_op_lists_are_disjoint_and_hold_the_usual_suspects():
    assert not (LOWER & FP32) and not (LOWER & FP32_SET_DTYPE) and not (FP32 & FP32_SET_DTYPE)
    assert {"linear", "matmul", "conv2d", "bmm", "baddbmm", "scaled_dot_product_attention"} <= LOWER
    assert {"layer_norm", "group_norm", "mse_loss", "nll_loss", "exp", "pow"} <= FP32
    assert {"softmax", "log_softmax", "sum", "cumsum"} <= FP32_SET_DTYPE


def test_gradients_flow_through_emulated_casts():
    w = rand(16, 8, requires_grad=True)
    with CudaAutocastEmulation(torch.bfloat16):
        loss = F.linear(rand(4, 8), w).softmax(-1).sum()
    loss.backward()
    assert w.grad is not None and w.grad.dtype == torch.float32  # the cast's backward returns fp32


# ------------------------------------------------------------------------ inside estimate
SEEN: list = []  # module level: the estimate traces a deep copy of the model


class Probe(nn.Module):
    """Records the dtype of a few intermediate results every time it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x):
        h = self.lin(x)
        s = torch.softmax(h, -1)
        n = self.norm(h)
        SEEN.append((h.dtype, s.dtype, n.dtype))
        return (s * n).float().mean()


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Probe()

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.inner, x, use_reentrant=False)


def _dtypes(device, precision, ckpt=False):
    SEEN.clear()
    model = Checkpointed() if ckpt else Probe()
    memguard.estimate(model, rand(8, 16), device=device, precision=precision)
    return list(SEEN)


def test_estimate_applies_cuda_autocast_on_the_cuda_target():
    bf16, fp32 = torch.bfloat16, torch.float32
    # linear in bf16; softmax and layer_norm upcast to fp32 as CUDA autocast does
    assert _dtypes("cuda", "bf16-mixed") == [(bf16, fp32, fp32)]
    assert _dtypes("cuda", "16-mixed") == [(torch.float16, fp32, fp32)]
    assert _dtypes("cuda", "32-true") == [(fp32, fp32, fp32)]
    assert _dtypes("cuda", "bf16-true") == [(bf16, bf16, bf16)]  # no autocast: everything in bf16


def test_estimate_uses_cpu_autocast_on_the_cpu_target():
    (linear, _, _), = _dtypes("cpu", "bf16-mixed")
    assert linear == torch.bfloat16


def test_checkpoint_recomputation_follows_the_same_policy():
    seen = _dtypes("cuda", "bf16-mixed", ckpt=True)
    # forward once, then recomputed once in backward, with the same dtypes both times
    assert len(seen) == 2 and seen[0] == seen[1] == (torch.bfloat16, torch.float32, torch.float32)


def test_cuda_target_activations_reflect_fp32_softmax():
    """Under CUDA autocast the softmax output is fp32 (4 bytes) where CPU autocast keeps bf16, so
    the CUDA target's forward must hold more bytes for a softmax-heavy model."""

    class Soft(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 512)

        def forward(self, x):
            return torch.softmax(self.lin(x), -1).pow(2).mean()

    x = rand(256, 64)
    cuda = memguard.estimate(Soft(), x, device="cuda", precision="bf16-mixed")
    cpu = memguard.estimate(Soft(), x, device="cpu", precision="bf16-mixed")
    assert cuda.phase_peaks["forward"] > cpu.phase_peaks["forward"]
