"""Tests of the cross-block staging buffers of ATen's CUDA reductions (native/cuda/Reduce.cuh).

Every expected figure is worked out by hand from Reduce.cuh ``setReduceConfig`` (block shape,
vectorisation, the split over warps and over blocks) and ``ReduceConfig::global_memory_size`` /
``semaphore_size``, as written in the comment beside it; the end-to-end tests check that an
estimate names a Linear bias gradient's ``sum`` (run by autograd, below any torch function), adds
exactly its allocator segments to ``peak_upper_bytes`` and leaves ``peak_bytes`` as it was.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memguard
from memguard.estimator import _trace, _tracing
from memguard.estimator._cuda_kernels import UNMODELLED_OPS, CudaTarget
from aten_recording import H100, UNKNOWN, record_unmodelled as _record  # this folder is on sys.path under pytest
from memguard.estimator._unmodelled import (
    MAX_THREADS_PER_SM,
    reduce_iter,
    reduce_kernel,
    reduce_workspace,
    reduce_workspace_bytes,
    set_reduce_config,
)

MiB = 1 << 20

T4 = CudaTarget(capability=(7, 5), sm_count=40)  # T4: 40 SMs, 1024 threads an SM
SUM32 = reduce_kernel("sum", torch.float32, (torch.float32,))


# --------------------------------------------------------------------------------------------
# the iterator and the config
# --------------------------------------------------------------------------------------------


def test_the_iterator_puts_reduced_dims_first_and_coalesces():
    # [16384, 4096] over dim 0: reversed order gives (4096, 16384); the output's stride-0 dim moves first
    it = reduce_iter((16384, 4096), (0,), 4)
    assert it.shape == (16384, 4096) and it.strides == ((0, 4), (16384, 4))
    # [8, 512, 768] over (0, 1): the two reduced dims coalesce into one of 4096
    it = reduce_iter((8, 512, 768), (0, 1), 4)
    assert it.shape == (4096, 768) and it.strides == ((0, 4), (3072, 4))
    # a full reduction coalesces to one dimension
    assert reduce_iter((16, 32, 8), (0, 1, 2), 4).shape == (4096,)


def test_column_sum_config_follows_set_reduce_config():
    # sum(0) of [16384, 4096] fp32, H100: not along the fastest dim (input strides 16384 B reduced, 4 B
    # kept), unit stride: vectorise along output, get_output_vec_size = 4, dim0 = 4096 / 4 = 1024,
    # dim1 = 16384. max_num_threads = 512 / 4 = 128: block 32 x 4. output_mult[0]: step_output 32;
    # values_per_thread 16384 >= min(4 * 16, 256): split over warps, step_input 4, 4096 values a
    # thread; grid div_up(1024, 32) = 32 <= 132 SMs x (2048 / 128) = 2112: ctas = max(min(66, 256), 16) = 66
    cfg = set_reduce_config(reduce_iter((16384, 4096), (0,), 4), 4, 4, sm_count=132, threads_per_sm=2048)
    assert (cfg.block_width, cfg.block_height, cfg.output_vec_size) == (32, 4, 4)
    assert cfg.grid_x == 32 and cfg.ctas_per_output == 66
    assert cfg.global_memory_size() == 4 * 4096 * 66 * 32 * 4 == 138_412_032  # about 132 MiB
    assert cfg.semaphore_size() == 4 * 32


@pytest.mark.parametrize(
    "shape, dims, kernel, target, expected",
    [
        # the case above, and without an SM count: ctas = div_up(4096, 16) = 256 -> 512 MiB
        ((16384, 4096), (0,), SUM32, H100, (138_412_032, 128)),
        ((16384, 4096), (0,), SUM32, UNKNOWN, (4 * 4096 * 256 * 128, 128)),
        # T4: 1024 / 128 = 8 blocks an SM, 320 in all: ctas = max(min(div_up(320, 32) = 10, 256), 16) = 16
        ((16384, 4096), (0,), SUM32, T4, (4 * 4096 * 16 * 128, 128)),
        # sum() of 1e8 fp32 (along the fastest dim, one reduced dim, >= 128: vectorise along input,
        # dim0 = 25e6): block 512 x 1, input_mult[0], step_input 512, values_per_thread 195313; the
        # warp split (threshold 16) multiplies by 1; grid 1 <= 132 x 4 = 528:
        # ctas = max(min(528, div_up(195313, 16) = 12208), div_up(195313, 256) = 763) = 763. The
        # block-x reduction stores one value per block: 4 B x 1 output x 763
        ((100_000_000,), (0,), SUM32, H100, (4 * 763, 4)),
        # ... and with no SM count ctas = 12208: 48,832 B
        ((100_000_000,), (0,), SUM32, UNKNOWN, (4 * 12208, 4)),
        # a Linear bias gradient over 4096 tokens of 1024 features: grid div_up(256, 32) = 8, 1024
        # values a thread: ctas = max(min(264, 64), 4) = 64, any SM count >= 8 / 16 gives the same
        ((4096, 1024), (0,), SUM32, H100, (4 * 1024 * 64 * 128, 32)),
        ((8, 512, 1024), (0, 1), SUM32, UNKNOWN, (4 * 1024 * 64 * 128, 32)),
        # the same gradient over 128 tokens: 128 / 4 = 32 values a thread < 256: no split
        ((128, 1024), (0,), SUM32, UNKNOWN, ()),
        # a row sum along the fastest dim ([64, 100000] over dim 1): block 32 x 16, 196 values a thread
        ((64, 100_000), (1,), SUM32, UNKNOWN, ()),
        # bf16 -> bf16 sum: arg_t is float, so the buffer is as for fp32
        ((16384, 4096), (0,), reduce_kernel("sum", torch.bfloat16, (torch.bfloat16,)), H100, (138_412_032, 128)),
        # amax of bf16: arg_t = scalar_t, 2 bytes
        ((16384, 4096), (0,), reduce_kernel("values", torch.bfloat16, (torch.bfloat16,)), H100,
         (2 * 4096 * 66 * 128, 128)),
        # var over dim 0: WelfordData<float, int32_t> (mean, m2, n, nf), 16 bytes
        ((16384, 4096), (0,), reduce_kernel("welford", torch.float32, (torch.float32,)), H100,
         (16 * 4096 * 66 * 128, 128)),
    ],
)
def test_staging_bounds(shape, dims, kernel, target, expected):
    assert reduce_workspace_bytes(shape, dims, kernel, target) == expected


def test_an_unaligned_view_loses_the_output_vectorisation():
    # x[:, 1:].sum(0) of [16384, 4096]: the input starts 1 element past an aligned address, so
    # get_output_vec_size gives 1; dim0 = 4095: block 32 x 16 (512 threads), step_output 32,
    # 1024 values a thread; grid div_up(4095, 32) = 128 <= 132 x 4 = 528: ctas = max(min(5, 64), 4) = 5
    got = reduce_workspace_bytes((16384, 4095), (0,), SUM32, H100, strides=(4096, 1), offset=1)
    assert got == (4 * 4095 * 5 * 32, 4 * 128)


def test_a_reduction_along_the_fastest_dim_of_a_transposed_tensor_does_not_split():
    # [4096, 16384].t() summed over its dim 0 (stride 1): block 32 x 16, 32 values a thread
    assert reduce_workspace_bytes((16384, 4096), (0,), SUM32, UNKNOWN, strides=(1, 16384)) == ()


def test_a_64_bit_input_is_reduced_in_parts_with_an_accumulation_buffer():
    # [65536, 65536] bf16 summed over dim 0 into bf16: 2**32 elements need 64-bit indexing. The
    # output cannot accumulate (bf16 -> bf16) and is narrower than arg_t (float): an
    # AccumulationBuffer of 65536 outputs x 4 B. SplitUntil32Bit halves the reduced dim (the widest
    # extent) until numel and every byte offset fit in int32: four parts of [16384, 65536] (the
    # input's last offset, 16383 x 131072 + 65535 x 2, is INT32_MAX - 1). Each: vec 4, block 32 x 4,
    # grid div_up(16384, 32) = 512, 4096 values a thread: ctas = max(min(div_up(2112, 512) = 5, 256), 16) = 16
    kernel = reduce_kernel("sum", torch.bfloat16, (torch.bfloat16,))
    assert not kernel.can_accumulate_in_output
    assert reduce_workspace_bytes((65536, 65536), (0,), kernel, H100) == (65536 * 4, 4 * 65536 * 16 * 128, 4 * 512)
    # no SM count: ctas = div_up(4096, 16) = 256
    assert reduce_workspace_bytes((65536, 65536), (0,), kernel, UNKNOWN) == (65536 * 4, 4 * 65536 * 256 * 128, 4 * 512)
    # an fp32 output accumulates in place: no accumulation buffer
    assert len(reduce_workspace_bytes((65536, 65536), (0,), SUM32, H100)) == 2


def test_the_split_grows_with_the_sm_count_up_to_the_unknown_bound():
    it = reduce_iter((16384, 4096), (0,), 4)
    sizes = [sum(reduce_workspace(it, SUM32, CudaTarget(capability=(9, 0), sm_count=n))[0]) for n in (1, 16, 132, 1000)]
    assert sizes[0] == 0  # one SM: 16 blocks of 128 threads, fewer than the grid of 32: no split
    assert sizes == sorted(sizes)
    assert sizes[-1] <= sum(reduce_workspace(it, SUM32, UNKNOWN)[0]) == 4 * 4096 * 256 * 128 + 128
    # a capability not tabled takes the most threads an SM has (2048): the H100 figure at 132 SMs
    assert reduce_workspace(it, SUM32, CudaTarget(capability=(12, 1), sm_count=132))[0][0] == 138_412_032
    assert MAX_THREADS_PER_SM[(9, 0)] == 2048


def test_rocm_takes_its_constants_and_no_sm_count():
    # USE_ROCM: min_values_per_thread 128, at least 64 CTAs; warp 64: block 64 x 2 (128 threads).
    # step_output 64, 8192 values a thread after the warp split; grid div_up(1024, 64) = 16:
    # ctas = max(max(div_up(8192, 128) = 64, div_up(8192, 256) = 32), 64) = 64 (no threads-per-CU table)
    amd = CudaTarget(capability=(9, 4), vendor="amd", sm_count=304)
    assert reduce_workspace_bytes((16384, 4096), (0,), SUM32, amd) == (4 * 4096 * 64 * 64 * 4, 4 * 16)


# --------------------------------------------------------------------------------------------
# the ATen-level finder
# --------------------------------------------------------------------------------------------


def test_the_recorder_reports_reductions_by_aten_op():
    def step():
        x = torch.empty(16384, 4096)
        x.sum(0)
        torch.var_mean(x, 0)
        x.amax(0)
        x[:128].sum(0)  # 128 rows: no split

    entries = _record(H100, step)
    assert [e.op for e in entries] == ["sum.dim_IntList of [16384, 4096] float32 over dims [0]",
                                       "var_mean.correction of [16384, 4096] float32 over dims [0]",
                                       "amax.default of [16384, 4096] float32 over dims [0]"]
    assert [e.allocations for e in entries] == [(138_412_032, 128), (16 * 4096 * 66 * 128, 128), (138_412_032, 128)]
    assert entries[0].detail == "ctas_per_output = 66 at 132 SMs"
    (unknown,) = _record(UNKNOWN, lambda: torch.empty(16384, 4096).sum(0))
    assert unknown.allocations == (4 * 4096 * 256 * 128, 128) and "SM count is unknown" in unknown.detail


def test_a_backward_reduction_is_seen():
    """A bias gradient is ``sum.dim_IntList`` inside autograd: no torch function is called for it."""
    def step():
        lin = nn.Linear(1024, 64)
        lin(torch.empty(4096, 1024)).sum().backward()

    entries = _record(UNKNOWN, step)
    # forward: sum() of [4096, 64] (262144 values: block 512, 512 values a thread, ctas div_up(512, 16)
    # = 32 at most: 4 B x 32). Backward: the bias gradient sums sum()'s gradient, ones expanded to
    # [4096, 64] (strides 0, 0): the fastest-moving stride is 0, not 4, so nothing is vectorised;
    # dim0 = 64: block 32 x 16, step_output 32, 4096 / 16 = 256 values a thread, grid div_up(64, 32) = 2,
    # ctas div_up(256, 16) = 16: 4 B x 64 outputs x 16 x block.x 32, and 4 B x 2 semaphores
    assert [(e.op, e.allocations) for e in entries] == [
        ("sum.default of [4096, 64] float32 over dims [0, 1]", (4 * 32, 4)),
        ("sum.dim_IntList of [4096, 64] float32 over dims [0]", (4 * 64 * 16 * 32, 4 * 2)),
    ]


def test_the_cpu_target_reports_nothing():
    assert _record(None, lambda: torch.empty(16384, 4096).sum(0)) == []


# --------------------------------------------------------------------------------------------
# end to end
# --------------------------------------------------------------------------------------------


def _loss(m, b):
    return m(b).square().mean()


def test_estimate_names_a_bias_gradient_and_bounds_it(monkeypatch):
    x = torch.randn(4096, 1024)
    est = memguard.estimate(nn.Linear(1024, 256), x, loss_fn=_loss, device="cuda", gpu="H100-80GB")
    # the catalog's 132 SMs (2048 threads an SM). Bias gradient: [4096, 256] over dim 0, a 32 x 16
    # block, grid div_up(64, 32) = 2, 1024 values a thread: ctas = min(div_up(132 x 4, 2) = 264,
    # div_up(1024, 16) = 64) = 64, the largest split too -> 4 x 256 x 64 x 32 x 4 = 8 MiB (a large
    # request under 10 MiB: a new 20 MiB segment) and 8 B of semaphores (a 2 MiB small segment).
    # The loss's mean of 1,048,576 values: 2048 a thread, ctas 128: 512 B and 4 B (two 2 MiB segments)
    bias = [n for n in est.notes if "sum.dim_IntList of [4096, 256] float32 over dims [0]" in n]
    assert len(bias) == 1 and "8.00 MiB requested (22.00 MiB of new segments)" in bias[0]
    assert "ctas_per_output = 64 at 132 SMs" in bias[0]
    assert "in peak_upper_bytes" in bias[0] and "Reduce.cuh" in bias[0]
    assert any("mean.default of [4096, 256] float32" in n for n in est.notes)
    assert est.peak_upper_bytes == est.peak_bytes + 22 * MiB
    # the bound is not in the point estimate: without the ATen-level finders, the same peak
    monkeypatch.setattr(_trace, "UNMODELLED_OPS", {})
    plain = memguard.estimate(nn.Linear(1024, 256), x, loss_fn=_loss, device="cuda", gpu="H100-80GB")
    assert plain.peak_bytes == est.peak_bytes and plain.peak_upper_bytes == plain.peak_bytes


def test_estimate_with_an_sm_count_takes_the_gpus_split(monkeypatch):
    import dataclasses

    from memguard.estimator.gpus import get_gpu

    x = torch.randn(16384, 64)
    est = memguard.estimate(nn.Linear(64, 4096), x, loss_fn=_loss, device="cuda", gpu="H100-80GB")
    # the catalog's 132 SMs: the bias gradient is sum(0) of [16384, 4096]: 138,412,032 B (a 132 MiB
    # segment, rounded to 2 MiB) with 128 B of semaphores (a 2 MiB segment)
    assert any("sum.dim_IntList of [16384, 4096] float32 over dims [0]" in n and "ctas_per_output = 66" in n
               for n in est.notes)
    assert est.peak_upper_bytes == est.peak_bytes + 132 * MiB + 2 * MiB
    # a spec without an SM count (a user's GPU) keeps the largest split, the bound
    spec = dataclasses.replace(get_gpu("H100-80GB"), name="my-h100", sm_count=None)
    monkeypatch.setattr(_tracing, "cuda_target", lambda gpu=None: CudaTarget.for_spec(spec))
    unknown = memguard.estimate(nn.Linear(64, 4096), x, loss_fn=_loss, device="cuda", gpu="H100-80GB")
    bias = [n for n in unknown.notes if "sum.dim_IntList of [16384, 4096] float32 over dims [0]" in n]
    # ctas_per_output = div_up(4096 values a thread, 16) = 256: 4 x 4096 x 256 x 32 x 4 = 512 MiB
    assert len(bias) == 1 and "SM count is unknown" in bias[0] and "ctas_per_output = 256" in bias[0]
    assert unknown.peak_bytes == est.peak_bytes
    assert unknown.peak_upper_bytes == unknown.peak_bytes + 512 * MiB + 2 * MiB


def test_cpu_estimates_list_no_reductions():
    est = memguard.estimate(nn.Linear(1024, 256), torch.randn(4096, 1024), loss_fn=_loss, device="cpu")
    assert est.peak_upper_bytes == est.peak_bytes and not any("not modelled" in n for n in est.notes)


def test_every_registered_reduction_is_an_aten_overload():
    assert torch.ops.aten.sum.dim_IntList in UNMODELLED_OPS and torch.ops.aten.linalg_vector_norm.default in UNMODELLED_OPS
    assert all(isinstance(op, torch._ops.OpOverload) for op in UNMODELLED_OPS)
