"""Tests of the bounds on CUDA ``topk``'s radix-select buffers and on scatter's deterministic path.

The figures are worked out by hand from native/cuda/TensorTopK.cu (``should_use_multiblock``,
``get_items_per_thread``, the buffers ``mbtopk::launch`` takes from the caching allocator),
native/cuda/TensorTopK.cpp (``topk_out_cuda``'s sort of the results) and
native/TensorAdvancedIndexing.cpp ``_scatter_via_index_put`` (the sorting ``index_put_``), as written
beside each; the end-to-end tests check that an estimate names them, adds exactly their allocator
segments to ``peak_upper_bytes`` and leaves ``peak_bytes`` as it was.
"""

from __future__ import annotations

import torch
from torch import nn

import memguard
from memguard.estimator._cuda_kernels import UNMODELLED_OPS
from aten_recording import H100, UNKNOWN, record_unmodelled as _record  # this folder is on sys.path under pytest
from memguard.estimator._unmodelled import (
    cub_radix_sort_bytes,
    index_put_sort_bytes,
    sort_workspace_bytes,
    topk_items_per_thread,
    topk_should_use_multiblock,
    topk_workspace_bytes,
)

MiB = 1 << 20



# --------------------------------------------------------------------------------------------
# topk
# --------------------------------------------------------------------------------------------


def test_should_use_multiblock_follows_the_heuristic():
    assert topk_should_use_multiblock(8192, 50257)  # > 4000 slices, >= 400 long
    assert not topk_should_use_multiblock(8192, 399)
    assert topk_should_use_multiblock(1, 20000) and not topk_should_use_multiblock(1, 19999)
    assert not topk_should_use_multiblock(100, 4999) and topk_should_use_multiblock(100, 5000)


def test_vocabulary_topk_on_an_h100():
    # [8192, 50257] float32, k=10: 8192 slices take mbtopk. items_per_thread = ceil(8192 x 50257 /
    # (132 SMs x 6 blocks x 256)) = ceil(2030.6) -> clamped to 64; blocks a slice ceil(50257 / 16384) = 4,
    # num_blocks 32768. kthValues 8192 x 4, ks_to_find 2 x 8192 x 4, desired 2 x 8192 x 4 (uint32 radix),
    # counts 32768 x 256 x 2, digit_cum_sum 8192 x 256 x 4, withinKCounts and kthCounts 32768 x 4; the
    # scan by key: tile status (32768 + 32) x 16 = 524800 (+ 256 for the queue word) and keys
    # 4 x 32769 = 131076 -> 131328 aligned. k = 10 sorts in place.
    assert topk_items_per_thread(8192, 50257, 132) == 64
    assert topk_workspace_bytes((8192, 50257), 1, 10, 4, sm_count=132) == (
        32768, 65536, 65536, 16_777_216, 8_388_608, 131072, 131072, 524800 + 256 + 131328)


def test_vocabulary_topk_without_an_sm_count_takes_the_most_blocks():
    # 4 items a thread: ceil(50257 / 1024) = 50 blocks a slice, 409600 blocks: counts 409600 x 512 = 200 MiB
    allocs = topk_workspace_bytes((8192, 50257), 1, 10, 4)
    assert allocs[3] == 200 * MiB and allocs[5] == allocs[6] == 409600 * 4
    assert allocs[7] == (409600 + 32) * 16 + 256 + (4 * 409601 + 252)  # keys 1638404 -> 1638656
    assert sum(allocs) > sum(topk_workspace_bytes((8192, 50257), 1, 10, 4, sm_count=132))


def test_long_1d_topk_takes_the_multi_block_path():
    # [1_000_000] float32, k=100, H100: items_per_thread ceil(1e6 / 202752) = 5, blocks ceil(1e6 / 1280) = 782:
    # counts 782 x 512 = 400384, digit_cum_sum 1024, withinK/kthCounts 3128 each, scan: (782 + 32) x 16
    # = 13024 -> 13056, + 256, keys 4 x 783 = 3132 -> 3328
    assert topk_workspace_bytes((1_000_000,), 0, 100, 4, sm_count=132) == (
        4, 8, 8, 400384, 1024, 3128, 3128, 13056 + 256 + 3328)
    # a non-contiguous input is first copied (launch_gather_topk_kernel's self.contiguous())
    assert topk_workspace_bytes((1_000_000,), 0, 100, 4, contiguous=False, sm_count=132)[0] == 4_000_000
    # a short one (one slice under 20000) runs sbtopk: nothing
    assert topk_workspace_bytes((19_999,), 0, 100, 4, sm_count=132) == ()


def test_rocm_sorts_a_long_1d_input():
    # should_use_sort on ROCm: 1-D, >= 10000 elements: at::cuda::sort's values and int64 indices, and its sort
    assert topk_workspace_bytes((1_000_000,), 0, 100, 4, vendor="amd") == (
        4_000_000, 8_000_000) + sort_workspace_bytes((1_000_000,), 0, 4)
    # 8_000_000 (the int64 index array of nsort) + the CUB pairs sort of 1e6 float keys with int64 values
    assert sort_workspace_bytes((1_000_000,), 0, 4) == (8_000_000, cub_radix_sort_bytes(1_000_000, 4, 8))


def test_sorted_results_past_4096_are_sorted_with_buffers():
    # [64, 100000], k=5000, sorted: the selection (mbtopk, 64 slices: 32 items a thread, 13 blocks a slice)
    # is small; the sort of the [64, 5000] values: sortedIndices 320000 x 8, sortedValues 320000 x 4, and
    # Sort.cu's full-sort path (64 segments): two int2 arrays of 320000 x 8 and the key buffer and CUB
    # sort of 320000 float/int2 pairs
    allocs = topk_workspace_bytes((64, 100_000), 1, 5000, 4, sm_count=132)
    assert allocs == (2_560_000, 1_280_000) + sort_workspace_bytes((64, 5000), 1, 4)
    assert allocs == (2_560_000, 1_280_000, 2_560_000, 2_560_000, 1_280_000, cub_radix_sort_bytes(320000, 4, 8))
    # unsorted: the selection only
    unsorted = topk_workspace_bytes((64, 100_000), 1, 5000, 4, sorted=False, sm_count=132)
    assert unsorted == (256, 512, 512, 64 * 13 * 512, 64 * 1024, 64 * 13 * 4, 64 * 13 * 4,
                        (832 + 32) * 16 + 256 + 3584)  # keys 4 x 833 = 3332 -> 3584


def test_the_recorder_reports_topk_by_aten_op():
    entries = _record(H100, lambda: torch.empty(8192, 50257).topk(10))
    assert [(e.op, e.bound_bytes) for e in entries] == [
        ("topk k=10 of [8192, 50257] float32 along dim 1",
         sum(topk_workspace_bytes((8192, 50257), 1, 10, 4, sm_count=132)))]
    (unknown,) = _record(UNKNOWN, lambda: torch.topk(torch.empty(8192, 50257), 10, dim=-1))
    assert "SM count is unknown" in unknown.detail
    assert _record(H100, lambda: torch.empty(8192, 256).topk(10)) == []  # sbtopk, in place


class _TopK(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(256, 50257, bias=False)  # no bias: no bias-gradient reduction

    def forward(self, x):
        return self.proj(x).topk(10, dim=-1).values


def _loss(m, b):
    return m(b).sum()


def test_estimate_names_topk_and_bounds_it(monkeypatch):
    x = torch.randn(8192, 256)
    est = memguard.estimate(_TopK(), x, loss_fn=_loss, device="cuda", gpu="H100-80GB")
    notes = [n for n in est.notes if "topk k=10 of [8192, 50257] float32" in n]
    assert len(notes) == 1 and "TensorTopK.cu" in notes[0] and "in peak_upper_bytes" in notes[0]
    # the catalog's 132 SMs: six requests of at most 1 MiB (2 MiB small segments each), counts of 16 MiB
    # (a 16 MiB segment) and digit_cum_sum of 8 MiB (a 20 MiB segment): 48 MiB. The loss's sum of
    # [8192, 10] is smaller.
    assert est.peak_upper_bytes == est.peak_bytes + 48 * MiB
    monkeypatch.delitem(UNMODELLED_OPS, torch.ops.aten.topk.default)
    plain = memguard.estimate(_TopK(), x, loss_fn=_loss, device="cuda", gpu="H100-80GB")
    assert plain.peak_bytes == est.peak_bytes and plain.peak_upper_bytes < est.peak_upper_bytes
    assert not any("topk" in n for n in plain.notes)


# --------------------------------------------------------------------------------------------
# scatter under deterministic algorithms
# --------------------------------------------------------------------------------------------


def _scatters():
    x = torch.zeros(64, 1000)
    idx = torch.zeros(64, 100, dtype=torch.long)
    x.scatter_add(1, idx, torch.ones(64, 100))  # src dense as viewed: no copy
    x.scatter_add(1, idx, torch.ones(64, 1000))  # src_view [64, 100] of strides (1000, 1): copied
    x.scatter_add(1, torch.zeros(1, 100, dtype=torch.long).expand(64, 100), torch.ones(64, 100))  # broadcast
    x.scatter_reduce(1, idx, torch.ones(64, 100), "amax")  # not a sum: not taken
    torch.scatter(x, 1, idx, torch.ones(64, 100))  # scatter with src: index_put_ without accumulate


def test_deterministic_scatter_is_bounded_only_when_the_flag_is_set():
    assert _record(H100, _scatters) == []
    torch.use_deterministic_algorithms(True)
    try:
        entries = _record(H100, _scatters)
    finally:
        torch.use_deterministic_algorithms(False)
    # 6400 linear indices: four int64 arrays of 51200 B and CUB's pairs sort: bins 8 passes x 256 x 8 =
    # 16384, lookback ceil(6400 / 256) = 25 x 2048 = 51200, keys and values 51200 each, counters 512
    sort6400 = (51200,) * 4 + (16384 + 51200 + 51200 + 51200 + 512,)
    assert index_put_sort_bytes(6400) == sort6400
    assert [(e.op.split(" into")[0], e.allocations) for e in entries] == [
        ("scatter_add.default", sort6400),
        ("scatter_add.default", (6400 * 4,) + sort6400),
        # one index along dim 1 (100 of them), moved to the front: copies of self (64000 x 4) and values
        ("scatter_add.default", (256_000, 25_600) + index_put_sort_bytes(100)),
        ("scatter.src", sort6400),
    ]
    assert all("deterministic" in e.mechanism and "_scatter_via_index_put" in e.source for e in entries)


class _Scatter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 100_000, bias=False)

    def forward(self, x):
        idx = torch.zeros(x.shape[0], 100_000, dtype=torch.long)
        return torch.zeros(x.shape[0], 16).scatter_add(1, idx, self.proj(x))


def test_estimate_bounds_a_deterministic_scatter_add():
    x = torch.randn(64, 64)
    plain = memguard.estimate(_Scatter(), x, loss_fn=_loss, device="cuda", gpu="H100-80GB")
    assert not any("scatter" in n for n in plain.notes)
    torch.use_deterministic_algorithms(True)
    try:
        det = memguard.estimate(_Scatter(), x, loss_fn=_loss, device="cuda", gpu="H100-80GB")
    finally:
        torch.use_deterministic_algorithms(False)
    notes = [n for n in det.notes if "scatter_add.default into [64, 16] float32" in n]
    assert len(notes) == 1 and "use_deterministic_algorithms" in notes[0]
    assert det.peak_bytes == plain.peak_bytes
    # 6.4M indices: four int64 arrays of 51,200,000 B (25 x 2 MiB segments each) and the CUB sort of 6.4M
    # int64 pairs: bins 16384, lookback 25000 x 2048, keys and values 51,200,000 each, counters 512 =
    # 153,616,896 B (a 148 MiB segment): 348 MiB
    assert index_put_sort_bytes(6_400_000) == (51_200_000,) * 4 + (153_616_896,)
    assert det.peak_upper_bytes == det.peak_bytes + 348 * MiB


def test_gathers_backward_scatters_deterministically_only_with_the_flag():
    def step():
        w = torch.zeros(64, 1000, requires_grad=True)
        w.gather(1, torch.zeros(64, 100, dtype=torch.long)).sum().backward()

    assert not any("scatter" in e.mechanism for e in _record(H100, step))
    torch.use_deterministic_algorithms(True)
    try:
        entries = [e for e in _record(H100, step) if "scatter" in e.mechanism]
    finally:
        torch.use_deterministic_algorithms(False)
    # gather_backward: zeros [64, 1000] scatter_add_ of the [64, 100] gradient (ones expanded: strides 0, 0,
    # not dense as viewed, so copied): 6400 linear indices
    assert [e.allocations for e in entries] == [(6400 * 4,) + index_put_sort_bytes(6400)]


def test_index_put_without_accumulate_sorts_only_under_deterministic_algorithms():
    from memguard.estimator._unmodelled import index_put, index_put_op

    x, idx, v = torch.zeros(1000, 8), torch.zeros(300, dtype=torch.long), torch.ones(300, 8)
    aten_put = torch.ops.aten.index_put_.default
    assert index_put_op(H100, aten_put, (x, [idx], v), {}, x) == []
    torch.use_deterministic_algorithms(True)
    try:
        (entry,) = index_put_op(H100, aten_put, (x, [idx], v), {}, x)
        # the torch-function finder names only accumulating calls: the ATen one sees this call too
        assert index_put(H100, (x, (idx,), v), {}) == []
    finally:
        torch.use_deterministic_algorithms(False)
    assert entry.allocations == index_put_sort_bytes(300) and "deterministic" in entry.op
