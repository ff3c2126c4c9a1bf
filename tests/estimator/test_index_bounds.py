"""Tests of the bounds on CUDA's deterministic indexing (``x[index] = v``, ``index_add``, ``index_copy``)
and on ``torch._foreach_norm``'s per-tensor partials.

The figures are worked out by hand, as written beside each, from native/cuda/Indexing.cu
(``index_put_with_sort_kernel``: ``self.contiguous()``, ``makeLinearIndex``'s int32 conversions and
``transposeToFront``, ``computeLinearIndex``, ``expandedValue``, ``src.contiguous()``, the sort;
``index_add_cuda_impl``'s ``source * alpha``), native/TensorAdvancedIndexing.cpp (``_index_put_impl_``,
``index_copy_out``), native/cuda/ForeachReduceOp.cu (``output_per_tensor``) and CUB's
``dispatch_radix_sort.cuh`` (bins, lookback, key and value buffers, counters, each 256-byte aligned).
The end-to-end tests check that an estimate names them, adds exactly their allocator segments to
``peak_upper_bytes`` and names nothing without ``torch.use_deterministic_algorithms(True)``.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import memguard
from memguard.estimator._cuda_kernels import UNMODELLED_OPS, CudaTarget
from aten_recording import H100, record_unmodelled as _record  # this folder is on sys.path under pytest
from memguard.estimator._unmodelled import (
    FOREACH_CHUNK_SIZE,
    cub_radix_sort_bytes,
    foreach_norm,
    foreach_norm_partials_bytes,
    index_put_sort_bytes,
    reduce_kernel,
    reduce_workspace_bytes,
    sorting_index_put_bytes,
)

MiB = 1 << 20

OLD = CudaTarget(capability=(8, 0), sm_count=108, torch_version=(2, 4))  # before the one-element skip
OLDER = CudaTarget(capability=(8, 0), sm_count=108, torch_version=(2, 2))  # before the inf-norm fast path

# 300 indices: four int64 arrays of 2400 B (linearIndex, sorted_indices, orig_indices, range) and CUB's
# pairs sort of 300 int64 keys and values: bins 1 portion x 8 passes x 256 digits x 8 B = 16384, lookback
# ceil(300 / 256) = 2 blocks x 256 x 8 = 4096, keys and values 2400 B each -> 2560 (256-aligned), counters
# 1 x 64 x 8 = 512: 16384 + 4096 + 2560 + 2560 + 512 = 26112
SORT300 = (2400,) * 4 + (26112,)
# 100 indices: 800 B arrays; bins 16384, lookback 1 x 2048, keys and values 800 -> 1024 each, counters 512
SORT100 = (800,) * 4 + (16384 + 2048 + 1024 + 1024 + 512,)
# one index: 8 B arrays; bins 16384, lookback 2048, keys and values 8 -> 256 each, counters 512
SORT1 = (8,) * 4 + (16384 + 2048 + 256 + 256 + 512,)


def test_hand_counted_sorts():
    assert cub_radix_sort_bytes(300, 8, 8) == 26112
    assert index_put_sort_bytes(300) == SORT300
    assert index_put_sort_bytes(100) == SORT100
    assert index_put_sort_bytes(1) == SORT1


# --------------------------------------------------------------------------------------------
# the sorting index_put_, as index_put_with_sort_kernel writes its buffers
# --------------------------------------------------------------------------------------------


def _idx(n, itemsize=8):
    return ((n,), (1,), itemsize)


def test_sorting_index_put_of_a_full_contiguous_value_is_the_sort():
    # x [1000, 8] float32 contiguous, x[idx] = v with idx of 300 int64, v [300, 8] contiguous:
    # nElemBefore 1, sliceSize 8, v has 1 x 300 x 8 elements already: no copy. Phase 1 (computeLinearIndex):
    # the remainder and the stride product, 2 x 2400 B (the max/min of 300 values fit one block: no
    # staging); phase 2, the sort, is larger
    assert sorting_index_put_bytes((1000, 8), True, 4, [_idx(300)], 2400, True, H100) == SORT300


def test_sorting_index_put_expands_a_broadcast_value():
    # v of shape [8] broadcast to [300, 8]: expandedValue = v.expand(vals_shape).contiguous(), a copy of
    # 1 x 300 x 8 float32 = 9600 B, live with the sort
    assert sorting_index_put_bytes((1000, 8), True, 4, [_idx(300)], 8, True, H100) == (9600,) + SORT300


def test_sorting_index_put_copies_a_non_contiguous_self():
    # self [1000, 10] transposed from [10, 1000]: self.contiguous(), 10000 x 4 = 40000 B, held through both
    # phases; the value [300, 10] is full and contiguous
    assert sorting_index_put_bytes((1000, 10), False, 4, [_idx(300)], 3000, True, H100) == (40000,) + SORT300


def test_sorting_index_put_with_int32_indices_on_non_adjacent_dims():
    # self [64, 10, 32] float32, x[i, :, j] = v with i, j 100 int32 each and v [100, 10]:
    # makeLinearIndex converts each index to int64 (2 x 800 B, live until it returns); the indexed dims 0 and
    # 2 are not adjacent, so transposeToFront permutes self to [64, 32, 10] (strides 320, 1, 32: not
    # contiguous), nElemBefore 1, sliceSize 10. Phase 1 at the second index: the conversions, linearIndex
    # (800) and the second remainder and product (800 each): 5 x 800 = 4000 B. Phase 2: src.contiguous()
    # of the permuted self, 64 x 10 x 32 x 4 = 81920 B, and the sort of 100 indices (v already holds
    # 1 x 100 x 10 contiguous elements: no copy)
    parts = [_idx(100, 4), None, _idx(100, 4)]
    assert sorting_index_put_bytes((64, 10, 32), True, 4, parts, 1000, True, H100) == (81920,) + SORT100


def test_sorting_index_put_takes_the_larger_phase():
    # int32 indices of [1000, 1000] (1e6 broadcast elements each) over every dimension of a contiguous self
    # (sliceSize 1) with a full contiguous float32 value. Phase 2: 4 x 8,000,000 B and CUB's sort of 1e6 pairs
    # (bins 16384, lookback ceil(1e6 / 256) = 3907 blocks x 2048 = 8,001,536, keys and values 8,000,000 each
    # (multiples of 256), counters 512): 56,018,432 B. With two indices phase 1 holds the two int64
    # conversions (2 x 8e6) and, at the second index, linearIndex, remainder and product (3 x 8e6): 40e6 B,
    # so phase 2 is returned; a one-element value adds its expansion, 1e6 x 4 B
    big = ((1000, 1000), (1000, 1), 4)
    sort_1e6 = (8_000_000,) * 4 + (16384 + 8_001_536 + 8_000_000 + 8_000_000 + 512,)
    assert sorting_index_put_bytes((1000, 1000), True, 4, [big, big], 1_000_000, True, H100) == sort_1e6
    assert sorting_index_put_bytes((1000, 1000), True, 4, [big, big], 1, True, H100) == (4_000_000,) + sort_1e6
    # with five such indices (a 5-D self) phase 1 holds 5 conversions + 3 = 8 x 8e6 = 64e6 B > 56,018,432
    assert sorting_index_put_bytes((100,) * 5, True, 4, [big] * 5, 1_000_000, True, H100) == (8_000_000,) * 8


def test_sorting_index_put_of_no_indices_allocates_nothing():
    assert sorting_index_put_bytes((1000, 8), True, 4, [((0,), (1,), 8)], 0, True, H100) == ()
    assert sorting_index_put_bytes((1000, 8), True, 4, [None], 8000, True, H100) == ()


# --------------------------------------------------------------------------------------------
# x[index] = v
# --------------------------------------------------------------------------------------------


def _setitems():
    x = torch.zeros(1000, 8)
    idx = torch.zeros(300, dtype=torch.long)
    x[idx] = torch.ones(300, 8)  # the sort of 300 indices
    x[idx] = torch.ones(8)  # broadcast: expanded and copied
    x[idx] = 0.0  # one element: no sort from INDEX_PUT_ONE_VALUE_UNSORTED_SINCE
    y = torch.zeros(10, 1000).t()
    y[idx] = torch.ones(300, 10)  # non-contiguous self: copied
    z = torch.zeros(64, 10, 32)
    i32 = torch.zeros(100, dtype=torch.int32)
    z[i32, :, i32] = torch.ones(100, 10)  # int32, non-adjacent: converted, permuted and copied
    x[:, 0] = 1.0  # basic indexing: no index_put_ at all


def test_setitem_is_named_only_under_deterministic_algorithms():
    assert [e for e in _record(H100, _setitems, False) if "index_put" in e.mechanism] == []
    entries = _record(H100, _setitems, True)
    assert [e.allocations for e in entries] == [
        SORT300,
        (9600,) + SORT300,
        (40000,) + SORT300,
        (81920,) + SORT100,
    ]
    for e in entries:
        assert e.op.startswith("index_put_.default under deterministic algorithms into")
        assert "deterministic index_put_'s sort" in e.mechanism and e.bounded
        assert "index_put_with_sort_kernel" in e.source and "x[index] = v calls it" in e.detail


def test_setitem_of_one_value_sorts_on_older_targets():
    # torch before INDEX_PUT_ONE_VALUE_UNSORTED_SINCE sorts for x[idx] = 0.0 too: the 0-dim value expanded
    # to 300 x 8 float32 = 9600 B
    def step():
        torch.zeros(1000, 8)[torch.zeros(300, dtype=torch.long)] = 0.0

    assert _record(H100, step, True) == []
    (entry,) = _record(OLD, step, True)
    assert entry.allocations == (9600,) + SORT300 and "one-element value" in entry.detail


def test_explicit_index_put_without_accumulate_is_named_once():
    def step():
        x = torch.zeros(1000, 8)
        x.index_put_((torch.zeros(300, dtype=torch.long),), torch.ones(300, 8))
        torch.index_put(x, (torch.zeros(300, dtype=torch.long),), torch.ones(300, 8))

    entries = _record(H100, step, True)
    assert [(e.op.split(" ")[0], e.allocations) for e in entries] == [("index_put_.default", SORT300),
                                                                      ("index_put.default", SORT300)]


# --------------------------------------------------------------------------------------------
# index_add and index_copy
# --------------------------------------------------------------------------------------------


def test_index_add_scales_the_source_and_sorts():
    def step():
        x = torch.zeros(1000, 8)
        x.index_add_(0, torch.zeros(300, dtype=torch.int32), torch.ones(300, 8))
        w = torch.zeros(16, 1000)
        w.index_add_(1, torch.zeros(300, dtype=torch.long), torch.ones(300, 16).t())

    assert _record(H100, step, False) == []
    first, second = _record(H100, step, True)
    # index.to(kLong) of 300 int32: 2400 B; source * alpha: 300 x 8 float32 = 9600 B; then the accumulating
    # sort of 300 indices into the contiguous x (the scaled source is full and contiguous)
    assert first.allocations == (2400, 9600) + SORT300
    # along dim 1 of [16, 1000]: source [16, 300] transposed (dense, not contiguous), so source * alpha keeps
    # its layout (19200 B) and expandedValue copies it (nElemBefore 16 x 300 x sliceSize 1 x 4 = 19200 B)
    assert second.allocations == (19200, 19200) + SORT300
    assert first.op == ("index_add_.default under deterministic algorithms into [1000, 8] float32 along dim 0 "
                        "at 300 indices")
    assert "index_add_cuda_impl" in first.source and "deterministic index_add" in first.mechanism


def test_index_select_backward_runs_a_deterministic_index_add():
    def step():
        w = torch.zeros(1000, 64, requires_grad=True)
        w.index_select(0, torch.zeros(300, dtype=torch.long)).sum().backward()

    assert not any("index_add" in e.mechanism for e in _record(H100, step, False))
    entries = [e for e in _record(H100, step, True) if "index_add" in e.mechanism]
    # index_select_backward: zeros [1000, 64] .index_add(0, index, grad); the gradient of sum() is ones
    # expanded to [300, 64] (strides 0): source * alpha is a new contiguous 300 x 64 x 4 = 76800 B, then
    # the sort of 300 indices
    assert [e.allocations for e in entries] == [(76800,) + SORT300]
    assert entries[0].op.startswith("index_add.default under deterministic algorithms")


def test_index_copy_sorts_without_accumulating():
    def step():
        x = torch.zeros(1000, 8)
        x.index_copy_(0, torch.zeros(300, dtype=torch.long), torch.ones(300, 8))
        torch.index_copy(torch.zeros(1000), 0, torch.zeros(1, dtype=torch.long), torch.ones(1))

    assert _record(H100, step, False) == []
    # index_copy_out: result.index_put_(indices, source, false): the sort of 300 indices; the one-element
    # source of the second call is not sorted by torch 2.13 (value_.numel() > 1) ...
    (entry,) = _record(H100, step, True)
    assert entry.allocations == SORT300 and "index_copy_out" in entry.source
    assert entry.op.startswith("index_copy_.default under deterministic algorithms into [1000, 8] float32")
    # ... but is by older releases: one index, a 1-element contiguous value (no copy)
    assert [e.allocations for e in _record(OLD, step, True)] == [SORT300, SORT1]


# --------------------------------------------------------------------------------------------
# _foreach_norm
# --------------------------------------------------------------------------------------------


def test_foreach_norm_partials():
    # max_chunks_per_tensor = ceil(1,000,000 / 65536) = 16 (15 x 65536 = 983,040 < 1e6); three tensors:
    # 3 x 16 partials of float (the opmath type of float32 and of bfloat16) = 192 B; float64 output: 384 B
    assert FOREACH_CHUNK_SIZE == 65536
    assert foreach_norm_partials_bytes([1_000_000, 64, 90_000], torch.float32) == 192
    assert foreach_norm_partials_bytes([1_000_000, 64, 90_000], torch.bfloat16) == 192
    assert foreach_norm_partials_bytes([1_000_000, 64, 90_000], torch.float64) == 384
    assert foreach_norm_partials_bytes([], torch.float32) == 0


def test_foreach_norm_entry_follows_the_fast_path():
    op = torch.ops.aten._foreach_norm.Scalar
    ts = [torch.zeros(1000, 1000), torch.zeros(64), torch.zeros(300, 300)]
    (entry,) = foreach_norm(H100, op, (ts, 2), {}, None)
    assert entry.allocations == (192,) and "output_per_tensor" in entry.mechanism
    assert entry.op == "_foreach_norm (ord=2) of 3 tensors, the largest of 1000000 elements"
    assert "ForeachReduceOp.cu" in entry.source
    # dtype=float64 outputs: partials of double
    assert foreach_norm(H100, op, (ts, 2, torch.float64), {}, None)[0].allocations == (384,)
    # the infinity norm is on the fast path from torch 2.3 (pytorch#118441)
    assert foreach_norm(H100, op, (ts, math.inf), {}, None)[0].allocations == (192,)
    assert UNMODELLED_OPS[op] is foreach_norm
    # _foreach_powsum (torch 2.13) shares foreach_tensor_norm_cuda_internal: the same partials for ord 1 and 2
    powsum = torch.ops.aten._foreach_powsum.Scalar
    (entry,) = foreach_norm(H100, powsum, (ts, 1), {}, None)
    assert entry.allocations == (192,) and entry.mechanism.startswith("_foreach_powsum's per-tensor partials")
    assert UNMODELLED_OPS[powsum] is foreach_norm
    (entry,) = foreach_norm(H100, powsum, (ts, math.inf), {}, None)  # no inf fast path: not read, unbounded
    assert not entry.bounded


def test_foreach_norm_slow_path_lists_the_largest_reduction():
    # ord 3 (and inf before torch 2.3, or a non-dense tensor) takes foreach_tensor_norm_slow: one
    # linalg_vector_norm a tensor; the largest staging is the [1000, 1000] tensor's
    op = torch.ops.aten._foreach_norm.Scalar
    ts = [torch.zeros(1000, 1000), torch.zeros(64)]
    staging = reduce_workspace_bytes((1000, 1000), (0, 1), reduce_kernel("sum", torch.float32, (torch.float32,)),
                                     H100)
    assert staging  # 1e6 values into one output split over blocks on 132 SMs
    for target, ord_ in ((H100, 3), (OLDER, math.inf)):
        (entry,) = foreach_norm(target, op, (ts, ord_), {}, None)
        assert entry.allocations == staging and "slow path" in entry.mechanism
    (entry,) = foreach_norm(H100, op, ([torch.zeros(1000, 2000)[:, :1000], torch.zeros(64)], 2), {}, None)
    assert "slow path" in entry.mechanism


# --------------------------------------------------------------------------------------------
# end to end
# --------------------------------------------------------------------------------------------


def _loss(model, batch):
    return model(batch).sum()


class _SetItem(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 256, bias=False)

    def forward(self, x):
        out = torch.zeros(2 * x.shape[0], 256)
        out[torch.arange(x.shape[0]) * 2] = self.proj(x)
        return out


def _entries_of(est, what):
    return [n for n in est.notes if what in n]


def test_estimate_bounds_a_deterministic_setitem():
    x = torch.randn(4096, 64)
    plain = memguard.estimate(_SetItem(), x, loss_fn=_loss, device="cuda", gpu="H100-80GB")
    assert _entries_of(plain, "index_put") == []
    torch.use_deterministic_algorithms(True)
    try:
        det = memguard.estimate(_SetItem(), x, loss_fn=_loss, device="cuda", gpu="H100-80GB")
    finally:
        torch.use_deterministic_algorithms(False)
    (note,) = _entries_of(det, "index_put_.default under deterministic algorithms into [8192, 256] float32")
    assert "use_deterministic_algorithms" in note and "in peak_upper_bytes" in note
    assert det.peak_bytes == plain.peak_bytes
    # 4096 indices, a full contiguous value: four int64 arrays of 32768 B and CUB's sort of 4096 pairs
    # (115200 B): each at most 1 MiB, so at most one new 2 MiB segment each: 10 MiB, larger than the loss's
    # sum over 2M values (its staging and semaphores, a 2 MiB segment each)
    assert index_put_sort_bytes(4096) == (32768,) * 4 + (115200,)
    assert det.peak_upper_bytes - det.peak_bytes == 10 * MiB
    assert plain.peak_upper_bytes - plain.peak_bytes < 10 * MiB


class _ClipAdamW(torch.optim.AdamW):
    """AdamW whose step clips the gradients first, as a training loop calls ``clip_grad_norm_``."""

    def __init__(self, params, foreach_clip: bool | None = True) -> None:
        super().__init__(params)
        self.foreach_clip = foreach_clip

    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"]]
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=self.foreach_clip)
        return super().step(closure)


def test_estimate_names_foreach_norm_of_clip_grad_norm():
    model = nn.Linear(1024, 1024, bias=False)
    x = torch.randn(8, 1024)
    est = memguard.estimate(model, x, optimizer=lambda p: _ClipAdamW(p), loss_fn=_loss, device="cuda",
                            gpu="H100-80GB")
    (note,) = _entries_of(est, "_foreach_norm (ord=2) of 1 tensors")
    assert "per-tensor partials" in note and "in peak_upper_bytes" in note
    # the weight gradient of 1,048,576 elements: 16 chunks of 65536, 16 float partials = 64 B: one request,
    # at most a new 2 MiB segment
    assert foreach_norm_partials_bytes([1024 * 1024], torch.float32) == 64
    # nothing else is listed (no bias, the loss's sum over 8192 values does not split): the bound is that segment
    assert [n for n in est.notes if "not modelled" in n and "_foreach_norm" not in n] == []
    assert est.peak_upper_bytes - est.peak_bytes == 2 * MiB


def test_clip_grad_norm_without_foreach_takes_the_per_tensor_path_in_a_trace():
    # foreach=None: torch.utils._foreach_utils._has_foreach_support refuses the trace's fake tensors, so
    # clip_grad_norm_ runs linalg_vector_norm a tensor and no _foreach_norm is traced (see the module)
    model = nn.Linear(1024, 1024, bias=False)
    est = memguard.estimate(model, torch.randn(8, 1024), optimizer=lambda p: _ClipAdamW(p, None), loss_fn=_loss,
                            device="cuda", gpu="H100-80GB")
    assert _entries_of(est, "_foreach_norm") == []


@pytest.mark.parametrize("op", ["index_put_", "index_put", "_index_put_impl_", "index_add", "index_add_",
                                "index_copy", "index_copy_"])
def test_ops_are_registered_at_aten_level(op):
    assert getattr(torch.ops.aten, op).default in UNMODELLED_OPS
