"""Tests of the CUDA kernel rules (``memguard.estimator._cuda_rules``) against PyTorch's source.

Each expected byte count is derived from the CUDA kernel the rule follows (files under
``aten/src/ATen/native/``, torch 2.13) and the tensors autograd saves
(``tools/autograd/derivatives.yaml``): fp32 is 4 bytes an element, fp16/bf16 2, bool 1, int64 8.
Every op is run on CPU fake tensors with and without :class:`CudaKernelModel`, so each test also
shows what the CPU trace records instead.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memguard.estimator import _cuda_kernels as cuda_kernels
from memguard.estimator._cuda_kernels import CudaKernelModel, CudaTarget
from memguard.estimator._op_memory import modelled_op_memory
from memguard.estimator._trace import load_rules
from memguard.estimator._cuda_rules import (
    EMBEDDING_SORT_THRESHOLD,
    conv_workspace_cap_bytes,
    cuda_optimizer_path,
    embedding_backward_temporaries,
    layer_norm_partial_rows,
)

load_rules()
A100 = CudaTarget(capability=(8, 0), sm_count=108)
MiB = 1 << 20  # A100: 108 SMs (NVIDIA A100 datasheet)


def leaf(*shape, dtype=torch.float32):
    def make(device):
        return (torch.randn(*shape, device=device, dtype=dtype, requires_grad=True),)

    return make


def cuda_and_cpu(op, make, target=A100):
    return modelled_op_memory(op, make, target), modelled_op_memory(op, make, kernel_model=False)


# ---------------------------------------------------------------------------------------------
# dropout (Dropout.cpp is_fused_kernel_acceptable -> cuda/Dropout.cu native_dropout)
# ---------------------------------------------------------------------------------------------


def test_dropout_keeps_a_bool_mask_on_cuda_and_an_input_dtype_noise_on_cpu():
    n = 64 * 128
    cuda, cpu = cuda_and_cpu(lambda x: F.dropout(x, 0.1), leaf(64, 128))
    # CUDA: output (4n) + bool mask (n), the mask saved; CPU: noise (4n, saved) + output (4n)
    assert cuda.forward_kept == 4 * n + n
    assert cpu.forward_kept == 4 * n + 4 * n
    # backward: one gradient like grad (dropout_backward_cuda's empty_like), then the mask is freed
    assert cuda.backward_peak == 4 * n
    assert cuda.backward_kept == 4 * n - n


def test_dropout_module_and_torch_dropout_take_the_rule():
    n = 32 * 16
    module = modelled_op_memory(lambda x: nn.Dropout(0.5)(x), leaf(32, 16), A100)
    aten = modelled_op_memory(lambda x: torch.dropout(x, 0.5, True), leaf(32, 16), A100)
    assert module.forward_kept == aten.forward_kept == 4 * n + n


@pytest.mark.parametrize("op", [
    lambda x: F.dropout(x, 0.1, training=False),  # evaluation: no kernel at all
    lambda x: F.dropout(x, 0.0),  # p == 0 returns the input
    lambda x: F.dropout(x.clone(), 0.1, inplace=True),  # dropout_ keeps _dropout_impl on CUDA
    lambda x: F.dropout(x, 1.0),  # p == 1 multiplies by zeros on both devices
])
def test_dropout_paths_that_cuda_shares_with_the_cpu_are_unchanged(op):
    cuda, cpu = cuda_and_cpu(op, leaf(8, 8))
    assert cuda == cpu


def test_dropout_outputs_keep_shape_dtype_and_gradient_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), CudaKernelModel(A100):
        x = torch.randn(3, 5, dtype=torch.bfloat16, requires_grad=True)
        y = F.dropout(x, 0.2)
        y.sum().backward()
    assert y.shape == x.shape and y.dtype == x.dtype
    assert x.grad.shape == x.shape and x.grad.dtype == x.dtype


# ---------------------------------------------------------------------------------------------
# softmax / log_softmax (SoftMax.cpp: Half + dtype=Float on CUDA -> half_to_float)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [F.log_softmax, F.softmax])
def test_half_input_with_float_result_skips_the_fp32_copy(fn):
    n = 16 * 256
    cuda, cpu = cuda_and_cpu(lambda x: fn(x, -1, dtype=torch.float32), leaf(16, 256, dtype=torch.float16))
    # CUDA: only the fp32 result (saved); CPU: a transient fp32 copy of the input, then the result
    assert cuda.forward_peak == 4 * n and cuda.forward_kept == 4 * n
    assert cpu.forward_peak == 8 * n and cpu.forward_kept == 4 * n
    # backward: CUDA writes the fp16 gradient directly (2n) and frees the saved result;
    # the CPU computes an fp32 gradient and casts it (4n + 2n live at once)
    assert cuda.backward_peak == 2 * n
    assert cpu.backward_peak == 6 * n


def test_bfloat16_softmax_is_not_fused():
    cuda, cpu = cuda_and_cpu(lambda x: F.softmax(x, -1, dtype=torch.float32), leaf(4, 32, dtype=torch.bfloat16))
    assert cuda == cpu  # SoftMax.cpp tests ScalarType::Half only


def test_cross_entropy_is_the_same_composite_on_both_devices():
    # LossNLL.cpp cross_entropy_loss: log_softmax(self, dim, self.scalar_type()) then nll_loss
    def make(device):
        return (torch.randn(32, 100, device=device, requires_grad=True), torch.randint(0, 100, (32,), device=device))

    cuda, cpu = cuda_and_cpu(lambda x, t: F.cross_entropy(x, t), make)
    assert cuda == cpu
    assert cuda.forward_kept >= 32 * 100 * 4  # the saved log-probabilities


# ---------------------------------------------------------------------------------------------
# layer norm / RMS norm (cuda/layer_norm_kernel.cu)
# ---------------------------------------------------------------------------------------------


def test_layer_norm_stats_are_fp32_for_bf16_inputs():
    m, n = 32, 64
    cuda, cpu = cuda_and_cpu(lambda x: F.layer_norm(x, (n,)), leaf(m, n, dtype=torch.bfloat16))
    # CUDA: Y (2mn) + mean and rstd of M acc-type (fp32) values; the CPU keeps bf16 stats
    assert cuda.forward_kept == 2 * m * n + 2 * 4 * m
    assert cpu.forward_kept == 2 * m * n + 2 * 2 * m


def test_rms_norm_keeps_one_fp32_value_per_row_on_cuda():
    m, n = 64, 128
    cuda, cpu = cuda_and_cpu(lambda x: F.rms_norm(x, (n,)), leaf(m, n))
    # _fused_rms_norm_cuda: Y (4mn) and rstd (4m); backward (_fused_rms_norm_backward_cuda, no
    # weight) writes dX only, then rstd is freed. The fp32 composite saves the same in forward
    # (input and rstd) but its backward runs the chain of elementwise gradients.
    assert cuda.forward_kept == cpu.forward_kept == 4 * m * n + 4 * m
    assert cuda.backward_peak == 4 * m * n
    assert cuda.backward_kept == 4 * m * n - 4 * m
    assert cpu.backward_peak > 2 * cuda.backward_peak


def test_rms_norm_bf16_keeps_no_fp32_copy_on_cuda():
    m, n = 64, 128

    def make(device):
        return (torch.randn(m, n, device=device, dtype=torch.bfloat16, requires_grad=True),
                torch.randn(n, device=device, dtype=torch.bfloat16, requires_grad=True))

    cuda, cpu = cuda_and_cpu(lambda x, w: F.rms_norm(x, (n,), w), make)
    # CUDA: Y in bf16 (2mn) and fp32 rstd (4m). The composite (layer_norm.cpp rms_norm_composite)
    # saves the fp32 upcast of the input and the fp32 normalised product (4mn each) on top
    assert cuda.forward_kept == 2 * m * n + 4 * m
    assert cpu.forward_kept >= cuda.forward_kept + 8 * m * n


def test_rms_norm_rule_applies_from_the_fused_kernels_torch_version_only():
    m, n = 64, 128

    def make(device):
        return (torch.randn(m, n, device=device, dtype=torch.bfloat16, requires_grad=True),
                torch.randn(n, device=device, dtype=torch.bfloat16, requires_grad=True))

    def fn(x, w):
        return F.rms_norm(x, (n,), w)

    old = modelled_op_memory(fn, make, CudaTarget(capability=(8, 0), torch_version=(2, 7)))
    new = modelled_op_memory(fn, make, CudaTarget(capability=(8, 0), torch_version=(2, 8)))
    # before the fused CUDA kernel the composite runs on CUDA as on the CPU: its fp32 copies stay
    assert new.forward_kept == 2 * m * n + 4 * m
    assert old.forward_kept >= new.forward_kept + 8 * m * n


@pytest.mark.parametrize("version, kept_mib", [
    # layer_norm.cpp rms_norm, 2.4-2.6: fp32 upcast (128 MiB, saved by pow and mul), the product cast
    # back to bf16 (64, saved by mul(weight)), the bf16 output (64)
    ((2, 4), 256), ((2, 6), 256),
    # 2.7 (pytorch/pytorch#147203): mul(weight) in fp32 saves the fp32 product (128) instead
    ((2, 7), 320),
    # 2.8+: _fused_rms_norm_cuda keeps the output and one fp32 rstd a row (8192 x 4 B)
    ((2, 8), 64), ((2, 13), 64),
])
def test_rms_norm_on_8192x4096_bf16_keeps_what_each_torch_release_kept(version, kept_mib):
    m, n = 8192, 4096

    def make(device):
        return (torch.randn(m, n, device=device, dtype=torch.bfloat16, requires_grad=True),
                torch.randn(n, device=device, dtype=torch.bfloat16, requires_grad=True))

    got = modelled_op_memory(lambda x, w: F.rms_norm(x, (n,), w), make, CudaTarget(capability=(8, 0), torch_version=version))
    rstd = 4 * m  # the [8192, 1] fp32 rstd: saved by the fused kernel, and by the composite's mul
    assert got.forward_kept == kept_mib * MiB + rstd


def test_rms_norm_module_with_weight_backward_allocates_dx_and_dgamma():
    m, n = 16, 32

    def make(device):
        return (torch.randn(m, n, device=device, requires_grad=True),
                torch.randn(n, device=device, requires_grad=True))

    cuda = modelled_op_memory(lambda x, w: F.rms_norm(x, (n,), w), make, A100)
    assert cuda.backward_peak == 4 * m * n + 4 * n  # dX and dgamma (empty_like each)


def test_rms_norm_with_mismatched_weight_dtype_keeps_the_composite():
    def make(device):
        return (torch.randn(8, 16, device=device, dtype=torch.bfloat16, requires_grad=True),
                torch.randn(16, device=device, requires_grad=True))

    cuda, cpu = cuda_and_cpu(lambda x, w: F.rms_norm(x, (16,), w), make)
    assert cuda == cpu  # layer_norm.cpp rms_norm_symint: dtype mismatch -> rms_norm_composite


@pytest.mark.parametrize("m,n,sms,rows", [
    (70_000, 8, 108, 2188),  # blocks.x = 1, blocks.y = min(32768, ceil(70000/32) = 2188)
    (100_000, 768, 108, 1365),  # blocks.x = 24: min(32768 // 24 = 1365, 3125)
    (100_000, 4096, 108, 0),  # N/32 = 128 is not < 108/2: the single-pass kernel
    (65_536, 8, 108, 0),  # M must exceed 64 * 1024
    (70_000, 8, None, 0),  # SM count unknown: not modelled
])
def test_layer_norm_partial_rows_follow_launch_gamma_beta_backward(m, n, sms, rows):
    assert layer_norm_partial_rows(m, n, sms) == rows


def test_layer_norm_backward_allocates_the_partial_buffers():
    m, n = 70_000, 8

    def make(device):
        return (torch.randn(m, n, device=device, requires_grad=True),
                torch.randn(n, device=device, requires_grad=True), torch.randn(n, device=device, requires_grad=True))

    cuda = modelled_op_memory(lambda x, w, b: F.layer_norm(x, (n,), w, b), make, A100)
    partial = 2188 * n * 4  # dgamma_blocks and dbeta_blocks, weight dtype (fp32)
    assert partial in cuda.allocations
    assert cuda.allocations.count(partial) == 2
    # ROCm's launch is not replayed: no partial buffers there even with a compute-unit count (the
    # unmodelled finder bounds them instead)
    rocm = modelled_op_memory(lambda x, w, b: F.layer_norm(x, (n,), w, b), make,
                              CudaTarget(capability=(9, 4), vendor="amd", sm_count=304))
    assert partial not in rocm.allocations


# ---------------------------------------------------------------------------------------------
# embedding (cuda/Embedding.cu, cuda/EmbeddingBackwardKernel.cu)
# ---------------------------------------------------------------------------------------------


def test_embedding_backward_temporaries_follow_the_sort_path():
    n, v, d = 4000, 50, 8
    temps = {name: (shape, dtype) for name, shape, dtype in embedding_backward_temporaries(n, v, d, torch.float16)}
    max_segments = min(n, v)  # 50
    max_partial = n // 10 + max_segments  # NROWS_PER_THREAD = 10 -> 450
    assert temps["sorted_indices"] == ((n,), torch.int64)
    assert temps["orig_indices"] == ((n,), torch.int64)
    assert temps["segment_offsets"] == ((n,), torch.int64)
    assert temps["partials_per_segment"] == ((max_segments,), torch.int64)
    assert temps["partial_segment_offset"] == ((max_partial,), torch.int64)
    assert temps["grad_weight_per_segment"] == ((max_partial, d), torch.float32)  # acc type for fp16
    assert "count" not in temps


def test_embedding_backward_small_batches_take_the_feature_kernel():
    assert embedding_backward_temporaries(EMBEDDING_SORT_THRESHOLD, 100, 8, torch.float32) == []
    assert embedding_backward_temporaries(10, 100, 8, torch.float32, scale_grad_by_freq=True) != []


def test_embedding_rule_records_the_cuda_backward():
    n, v, d = 4000, 50, 8

    def make(device):
        return (torch.randint(0, v, (n,), device=device), torch.randn(v, d, device=device, requires_grad=True))

    cuda, cpu = cuda_and_cpu(lambda i, w: F.embedding(i, w), make)
    assert cuda.forward_kept == cpu.forward_kept == n * d * 4  # the output; the indices are inputs
    temps = embedding_backward_temporaries(n, v, d, torch.float32)
    grad_weight = v * d * 4
    # the CPU records grad_weight alone; CUDA adds every temporary except ``range``, which is freed
    # after the sort, before grad_weight exists
    live_together = sum(math.prod(s) * dt.itemsize for name, s, dt in temps if name != "range")
    assert cpu.backward_peak == grad_weight
    assert cuda.backward_peak == grad_weight + live_together
    assert cuda.backward_kept == cpu.backward_kept == grad_weight


# ---------------------------------------------------------------------------------------------
# convolutions (the CUDNN_CONV_WSCAP_DBG cap; the workspaces are in test_unmodelled.py)
# ---------------------------------------------------------------------------------------------


def test_conv_workspace_cap_comes_from_the_target_or_the_environment(monkeypatch):
    monkeypatch.delenv("CUDNN_CONV_WSCAP_DBG", raising=False)
    assert conv_workspace_cap_bytes(CudaTarget()) is None
    monkeypatch.setenv("CUDNN_CONV_WSCAP_DBG", "16")  # MiB
    assert conv_workspace_cap_bytes(CudaTarget()) == 16 << 20
    assert conv_workspace_cap_bytes(CudaTarget(conv_workspace_bytes=4096)) == 4096


def test_a_cap_bounds_the_workspace_but_does_not_enter_the_replay(monkeypatch):
    # the workspace is the execution plan's choice (cudnn/Conv_v8.cpp run_conv_plan): no rule
    # replays it, capped or not; _unmodelled lists it and bounds it by the cap in peak_upper_bytes
    monkeypatch.delenv("CUDNN_CONV_WSCAP_DBG", raising=False)

    def make(device):
        return (torch.randn(2, 3, 8, 8, device=device, requires_grad=True),
                torch.randn(4, 3, 3, 3, device=device, requires_grad=True))

    def op(x, w):
        return F.conv2d(x, w, padding=1)

    assert F.conv2d not in cuda_kernels.RULES
    capped = modelled_op_memory(op, make, CudaTarget(conv_workspace_bytes=1 << 20))
    assert capped == modelled_op_memory(op, make, CudaTarget()) == modelled_op_memory(op, make, kernel_model=False)


# ---------------------------------------------------------------------------------------------
# optimizers (torch/optim/optimizer.py _default_to_fused_or_foreach; adam.py _multi_tensor_adam)
# ---------------------------------------------------------------------------------------------


class _Subclass(torch.Tensor):
    """A plain tensor subclass (as quantized or wrapper parameters are): not in _foreach_supported_types."""


def _lr(x):
    return torch.tensor(x)


# (optimizer factory, path on CUDA, why: torch 2.13's torch/optim sources)
OPTIMIZER_PATHS = [
    (lambda p: torch.optim.AdamW(p), "foreach"),  # None/None -> _default_to_fused_or_foreach -> foreach
    (lambda p: torch.optim.AdamW(p, fused=True), "fused"),
    (lambda p: torch.optim.AdamW(p, foreach=False), "for-loop"),
    (lambda p: torch.optim.LBFGS(p), "for-loop"),  # no foreach implementation
    # adam.py adam(): "Do not flip on foreach for the unsupported case where lr is a Tensor and capturable=False"
    (lambda p: torch.optim.Adam(p, lr=_lr(0.01)), "for-loop"),
    (lambda p: torch.optim.AdamW(p, lr=_lr(0.01)), "for-loop"),  # AdamW subclasses Adam
    (lambda p: torch.optim.Adam(p, lr=_lr(0.01), capturable=True), "foreach"),  # capturable: CUDA params only
    # sgd.py and the others keep foreach with a Tensor lr
    (lambda p: torch.optim.SGD(p, lr=_lr(0.01), momentum=0.9), "foreach"),
    (lambda p: torch.optim.RMSprop(p, lr=_lr(0.01)), "foreach"),
    # _default_to_fused_or_foreach(differentiable=True) -> (False, False)
    (lambda p: torch.optim.Adam(p, differentiable=True), "for-loop"),
    # _adafactor.py: `if foreach:` -> None takes _single_tensor_adafactor
    (lambda p: torch.optim.Adafactor(p), "for-loop"),
    # type(p) in _foreach_supported_types ([Tensor, Parameter]): a subclass parameter takes the for-loop
    (lambda p: torch.optim.AdamW([nn.Parameter(_Subclass(torch.zeros(4)))]), "for-loop"),
    # param groups decide one by one
    (lambda p: torch.optim.Adam([{"params": p}, {"params": [nn.Parameter(torch.zeros(2))], "foreach": False}]), "mixed"),
]


@pytest.mark.parametrize("make, expected", OPTIMIZER_PATHS)
def test_optimizer_paths_follow_torchs_choice(make, expected):
    assert cuda_optimizer_path(make([nn.Parameter(torch.zeros(4))]), A100) == expected


# the rows a CPU run of the installed torch can replay (not fused, capturable, differentiable (its step
# needs non-leaf parameters), LBFGS or mixed groups)
_REPLAYABLE = [OPTIMIZER_PATHS[i] for i in (0, 2, 4, 5, 7, 8, 10, 11)]


@pytest.mark.parametrize("make, expected", _REPLAYABLE)
def test_optimizer_paths_match_the_installed_torch(make, expected, monkeypatch):
    # run the installed torch's own step on CPU tensors with the CPU counted as a foreach device
    # (torch.optim.optimizer._get_foreach_kernels_supported_devices: ["cuda", ...] -> + "cpu"), and
    # see which implementation it calls: _multi_tensor_* or _single_tensor_*
    import importlib

    import torch.optim.optimizer as opt_base

    real = opt_base._get_foreach_kernels_supported_devices
    monkeypatch.setattr(opt_base, "_get_foreach_kernels_supported_devices", lambda: [*real(), "cpu"])
    called = set()
    for mod in ("adam", "sgd", "rmsprop", "_adafactor"):
        module = importlib.import_module(f"torch.optim.{mod}")
        for name in dir(module):
            if name.startswith(("_multi_tensor_", "_single_tensor_")):
                fn = getattr(module, name)
                kind = "foreach" if name.startswith("_multi") else "for-loop"
                monkeypatch.setattr(module, name, (lambda f, k: lambda *a, **kw: (called.add(k), f(*a, **kw))[1])(fn, kind))
    optimizer = make([nn.Parameter(torch.zeros(4))])
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = torch.ones_like(p)
    optimizer.step()
    assert called == {expected}
    assert cuda_optimizer_path(optimizer, A100) == expected


def test_foreach_adamw_step_temporaries_are_one_parameter_sized_list():
    # _multi_tensor_adam: exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs) is the only
    # parameter-sized output list of the step; lerp_/mul_/addcmul_/div_/add_/addcdiv_ act in place
    from memguard.estimator._trace import OPTIMIZER_TEMPORARIES, trace_step

    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))
    trace = trace_step(model, torch.randn(4, 16), loss_fn=lambda m, b: m(b).sum(), foreach=True)
    start, end = trace.phase_starts["optimizer"], trace.phase_starts["zero_grad"]
    live = peak = 0
    for handle, nbytes in trace.events[start:end]:
        if trace.category[handle] == OPTIMIZER_TEMPORARIES:
            live += nbytes
            peak = max(peak, live)
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    # plus 4-byte bias-correction scalars at most (step tensors are 0-dim fp32)
    assert param_bytes <= peak <= param_bytes + 4 * 16


# ---------------------------------------------------------------------------------------------
# the CPU target and the registry
# ---------------------------------------------------------------------------------------------


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.norm = nn.LayerNorm(16)
        self.rms = nn.RMSNorm(16)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(16, 50)

    def forward(self, ids):
        h = self.drop(self.rms(self.norm(self.emb(ids))))
        return F.cross_entropy(self.head(h).flatten(0, 1), ids.flatten())


def test_cpu_target_trace_is_unchanged_by_the_rules(monkeypatch):
    from memguard.estimator._trace import trace_step

    ids = torch.randint(0, 50, (2, 8))
    with_rules = trace_step(_Tiny(), ids, device="cpu")
    monkeypatch.setattr(cuda_kernels, "RULES", {})
    without = trace_step(_Tiny(), ids, device="cpu")
    assert with_rules.events == without.events
    assert with_rules.category == without.category


def test_every_rule_module_registers_and_rules_are_callables():
    names = {getattr(f, "__qualname__", repr(f)) for f in cuda_kernels.RULES}
    for expected in ("dropout", "log_softmax", "layer_norm", "rms_norm", "embedding"):
        assert any(expected in n for n in names), expected
    assert all(callable(r) for r in cuda_kernels.RULES.values())


def test_target_for_a_catalog_gpu():
    import dataclasses

    from memguard.estimator.gpus import GENERIC, get_gpu

    spec = get_gpu("H100-80GB")
    target = CudaTarget.for_spec(spec)  # the catalog's SM count (H100 SXM5: 132)
    assert target.capability == (9, 0) and target.vendor == "nvidia" and target.sm_count == 132
    assert CudaTarget.for_spec(spec, sm_count=114).sm_count == 114  # an override still wins
    assert CudaTarget.for_spec(GENERIC).sm_count is None  # the generic GPU's count is unknown
    assert CudaTarget.for_spec(dataclasses.replace(spec, name="mine", sm_count=None)).sm_count is None


def _estimate_as(spec, monkeypatch, *args, **kwargs):
    """``memguard.estimate(..., device="cuda")`` with ``spec`` as the CUDA target's GPU (a spec
    that is not in the catalog, as a user may build one)."""
    import importlib

    import memguard

    api = importlib.import_module("memguard.estimator.api")
    with monkeypatch.context() as m:
        m.setattr(api, "target_gpu", lambda device, gpu, problems, **kw: spec)
        return memguard.estimate(*args, device="cuda", **kwargs)


class _Norm(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(n)

    def forward(self, x):
        return self.norm(x)


def test_h100_estimate_allocates_the_layer_norm_partial_buffers(monkeypatch):
    import dataclasses

    import memguard
    from memguard.estimator.gpus import get_gpu

    m, n = 100_000, 768
    x = torch.randn(m, n)

    def loss(model, batch):  # sum: an expanded gradient, made contiguous by the backward (no dX)
        return model(batch).sum()

    h100 = memguard.estimate(_Norm(n), x, loss_fn=loss, device="cuda", gpu="H100-80GB")
    unknown = _estimate_as(dataclasses.replace(get_gpu("H100-80GB"), name="my-h100", sm_count=None), monkeypatch,
                           _Norm(n), x, loss_fn=loss)
    # 132 SMs: N / 32 = 24 < 66 and M > 64 Ki, blocks.y = min(32768 // 24, ceil(M / 32)) = 1365 rows
    rows = layer_norm_partial_rows(m, n, 132)
    assert rows == 1365
    # the two [1365, 768] fp32 buffers (4,193,280 B, already 512-byte multiples) and the [768] results of
    # their .sum(0), live with the gradients empty_like made, at the backward's peak
    assert h100.allocated_peak_bytes - unknown.allocated_peak_bytes == 2 * rows * n * 4 + 2 * n * 4
    # the two 4 MiB requests share one new 20 MiB segment (CUDACachingAllocator: 1-10 MiB requests)
    assert h100.peak_bytes - unknown.peak_bytes == 20 * MiB
    assert not any("weight-gradient partial buffers" in note for note in h100.notes)
    assert any("weight-gradient partial buffers (the GPU's SM count is unknown" in note for note in unknown.notes)
    assert unknown.peak_upper_bytes >= h100.peak_upper_bytes  # the bound covers what the rule allocates


# ---------------------------------------------------------------------------------------------
# through memguard's tracer and estimate
# ---------------------------------------------------------------------------------------------


class _DropNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.drop = nn.Dropout(0.5)
        self.down = nn.Linear(64, 1)

    def forward(self, x):
        return self.down(self.drop(torch.relu(self.up(x)))).sum()


def _live_when_backward_starts(trace) -> int:
    return sum(n for _, n in trace.events[: trace.phase_starts["backward"]])


def test_tracer_with_a_cuda_target_keeps_bool_dropout_masks():
    from memguard.estimator._trace import trace_step

    torch.manual_seed(0)
    model, x = _DropNet(), torch.randn(16, 32)
    plain = trace_step(model, x, device="cpu")
    cuda = trace_step(model, x, device="cpu", cuda_target=A100)
    # the only difference before backward: a [16, 64] mask of 1 byte instead of 4 (fp32 noise)
    assert _live_when_backward_starts(plain) - _live_when_backward_starts(cuda) == 16 * 64 * 3


def test_cpu_estimate_is_unchanged_by_the_rules(monkeypatch):
    import memguard

    ids = torch.randint(0, 50, (2, 8))
    with_rules = memguard.estimate(_Tiny(), ids, device="cpu")
    monkeypatch.setattr(cuda_kernels, "RULES", {})
    without = memguard.estimate(_Tiny(), ids, device="cpu")
    assert with_rules.peak_bytes == without.peak_bytes
    assert dict(with_rules.breakdown) == dict(without.breakdown)


def test_cuda_estimate_applies_the_rules(monkeypatch):
    import memguard

    torch.manual_seed(0)
    x = torch.randn(1024, 32)
    with_rules = memguard.estimate(_DropNet(), x, device="cuda", gpu="A100-80GB")
    monkeypatch.setattr(cuda_kernels, "RULES", {})
    without = memguard.estimate(_DropNet(), x, device="cuda", gpu="A100-80GB")
    # the [1024, 64] dropout mask: 1 byte instead of 4 per element (each a 512-byte-rounded block)
    assert without.allocated_peak_bytes - with_rules.allocated_peak_bytes == 1024 * 64 * 3


class _Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.fc(self.norm(x)))


class _Stack(nn.Module):
    def __init__(self, dim: int = 64, blocks: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(dim) for _ in range(blocks))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def test_rules_run_again_in_checkpoint_recomputation():
    # the recomputed forward of a checkpointed block must take the same rules (bool masks, fp32
    # stats), so checkpointing lowers the CUDA-target peak and every storage is freed by the end
    from memguard.estimator._trace import trace_step

    torch.manual_seed(0)
    model, x = _Stack(), torch.randn(200, 64)

    def peak_and_end(trace):
        live = peak = 0
        for _, n in trace.events:
            live += n
            peak = max(peak, live)
        return peak, live

    full = trace_step(model, x, device="cpu", cuda_target=A100)
    ckpt = trace_step(model, x, device="cpu", cuda_target=A100, checkpoint_blocks=4)
    assert peak_and_end(ckpt)[0] < peak_and_end(full)[0]
    assert peak_and_end(ckpt)[1] == peak_and_end(full)[1]  # the same state after the step
    backward = ckpt.events[ckpt.phase_starts["backward"]:ckpt.phase_starts["optimizer"]]
    mask = 200 * 64  # one bool [200, 64] mask per recomputed block (an fp32 noise would be 4x)
    assert sum(1 for _, n in backward if n == mask) == 4


# ---------------------------------------------------------------------------------------------
# cuBLAS operands (cuda/Blas.cpp prepare_matrix_for_cublas)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape, strides, copied", [
    ((6, 16), (0, 0), True),  # sum()'s expanded gradient: overlapping, neither layout -> clone
    ((6, 16), (16, 1), False),  # row-major dense
    ((6, 16), (1, 6), False),  # column-major dense (a transposed view)
    ((6, 16), (32, 1), False),  # row-major with a larger leading dimension (a slice)
    ((6, 16), (1, 0), True),  # stride(1) = 0 < size(0): no usable leading dimension
])
def test_cublas_copies_operands_it_cannot_read_in_place(shape, strides, copied):
    from memguard.estimator._cuda_rules import cublas_needs_copy

    t = torch.empty_strided(shape, strides, device="meta")
    assert cublas_needs_copy(t) is copied


def test_sum_backward_through_a_linear_layer_materialises_the_gradient_in_both_matmuls():
    # linear(x).sum() on x [N, D], W [V, D]: the backward's mm(grad [N, V] stride 0, W) and
    # mm(grad^T [V, N] stride 0, x) each clone the expanded gradient (N*V*4 bytes), allocated after
    # the mm's output and freed when it returns; the CPU trace's fake mm records no such buffer
    n, d, v = 24, 8, 40

    def make(device):
        return (torch.randn(n, d, device=device, requires_grad=True),
                torch.randn(v, d, device=device, requires_grad=True))

    cuda, cpu = cuda_and_cpu(lambda x, w: F.linear(x, w).sum(), make)
    grad_x, grad_w, clone = 4 * n * d, 4 * v * d, 4 * n * v
    assert cuda.backward_peak == cpu.backward_peak + clone
    assert cuda.backward_peak >= grad_x + grad_w + clone


def test_mean_backward_hands_matmuls_a_dense_gradient():
    # mean_backward (FunctionsManual.cpp): sum_backward(grad) / n is a dense tensor: no copy
    def make(device):
        return (torch.randn(24, 8, device=device, requires_grad=True),
                torch.randn(40, 8, device=device, requires_grad=True))

    cuda, cpu = cuda_and_cpu(lambda x, w: F.linear(x, w).mean(), make)
    assert cuda.backward_peak == cpu.backward_peak


def _optimizer_phase_peak(trace) -> int:
    """The most bytes live during the optimizer phase, replaying the trace's events."""
    start, end = trace.phase_starts["optimizer"], trace.phase_starts["zero_grad"]
    live = sum(n for _, n in trace.events[:start])
    peak = live
    for _, n in trace.events[start:end]:
        live += n
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("opt_cls", [torch.optim.Adam, torch.optim.AdamW])
def test_foreach_adam_before_torch_2_1_keeps_an_out_of_place_denom(opt_cls):
    # torch 2.0 _multi_tensor_adam(w): denom = torch._foreach_add(exp_avg_sq_sqrt, eps), a second
    # parameter-sized list while the square roots live (pytorch/pytorch#97712); torch 2.1+
    # (pytorch/pytorch#104898): torch._foreach_add_(exp_avg_sq_sqrt, eps). So a 2.0 target's step
    # peaks one parameter-sized list (every parameter's bytes) higher
    from memguard.estimator._trace import trace_step

    def peak(version):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 40))
        trace = trace_step(model, torch.randn(4, 64), loss_fn=lambda m, b: m(b).square().mean(), device="cpu",
                           foreach=True, cuda_target=CudaTarget(capability=(8, 0), torch_version=version),
                           optimizer=lambda p: opt_cls(p, lr=1e-3))
        return _optimizer_phase_peak(trace)

    param_bytes = 4 * (64 * 96 + 96 + 96 * 40 + 40)
    assert peak((2, 0)) - peak((2, 1)) == param_bytes
    assert peak((2, 1)) == peak((2, 13))


def test_sgd_and_fused_adam_take_no_denom_mode():
    from memguard.estimator._cuda_rules import _OutOfPlaceAdamDenom, cuda_optimizer_step_mode

    p = [nn.Parameter(torch.zeros(3))]
    old = CudaTarget(capability=(8, 0), torch_version=(2, 0))
    assert isinstance(cuda_optimizer_step_mode(torch.optim.Adam(p, foreach=True), old), _OutOfPlaceAdamDenom)
    assert not isinstance(cuda_optimizer_step_mode(torch.optim.SGD(p, lr=0.1, foreach=True), old), _OutOfPlaceAdamDenom)
    assert not isinstance(cuda_optimizer_step_mode(torch.optim.Adam(p, foreach=False), old), _OutOfPlaceAdamDenom)
    assert not isinstance(cuda_optimizer_step_mode(torch.optim.Adam(p, foreach=True), A100), _OutOfPlaceAdamDenom)
