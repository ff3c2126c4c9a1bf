"""Tests of the CUDA kernels memguard has no rule for: their bounds, their notes, the upper bound.

The bounds are checked against numbers worked out by hand from the formulas each function cites
(CUB's ``dispatch_radix_sort.cuh`` onesweep allocation list, ATen's ``cuda/Sort.cu`` paths,
``cuda/layer_norm_kernel.cu``, ``cuda/group_norm_kernel.cu``); the end-to-end tests check that an
estimate names them and that ``peak_upper_bytes`` adds exactly the allocator segments of the
largest one.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import memguard
from memguard.estimator._cuda_kernels import RULES, UNMODELLED, CudaTarget
from memguard.estimator._cuda_rules import layer_norm_partial_rows
from memguard.estimator._trace import load_rules
from memguard.estimator._unmodelled import (
    Unmodelled,
    cache_info_largest,
    cub_radix_sort_bytes,
    cudnn_benchmark_workspace_bytes,
    cub_scan_bytes,
    embedding_backward_workspace_bytes,
    group_norm_backward_bytes,
    layer_norm_partial_bytes,
    scan_workspace_bytes,
    sort_workspace_bytes,
    upper_bound,
)

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

load_rules()


# --------------------------------------------------------------------------------------------
# the formulas
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n, key, value, expected",
    [
        # n=10000, int64 pairs: bins 1 portion x 8 passes x 256 digits x 8 B = 16384; lookback
        # ceil(10000/256)=40 blocks x 256 x 8 = 81920; keys and values 80000 B each, aligned to 256:
        # 80128 each; counters 1 x 64 x 8 = 512 -> 16384 + 81920 + 2 * 80128 + 512
        (10_000, 8, 8, 16384 + 81920 + 2 * 80128 + 512),
        # n=4096, int64 pairs: bins 16384; lookback 16 x 2048 = 32768; keys, values 32768 each;
        # counters 512 -> 115200 (the embedding backward of 4096 indices)
        (4096, 8, 8, 16384 + 32768 + 2 * 32768 + 512),
        # n=262144 float32 keys, int64 values: bins 4 passes x 256 x 8 = 8192; lookback 1024 x 2048 =
        # 2 MiB; keys 1 MiB; values 2 MiB; counters 32 x 8 = 256
        (262_144, 4, 8, 8192 + 2 * MiB + MiB + 2 * MiB + 256),
        # keys only (SortKeys): no value buffer
        (4096, 8, 0, 16384 + 32768 + 32768 + 512),
        (0, 8, 8, 0),
    ],
)
def test_cub_radix_sort_bound(n, key, value, expected):
    assert cub_radix_sort_bytes(n, key, value) == expected


def test_cub_scan_bound():
    # (4096 tiles + 32 padding) x 16-byte TxnWord = 66048 (a multiple of 256), plus an aligned 8-byte word
    assert cub_scan_bytes(4096, 8) == 66048 + 256
    # 16-byte values: status + partial + inclusive = 33 bytes a tile: (100 + 32) x 33 = 4356 -> 4608
    assert cub_scan_bytes(100, 16) == 4608 + 256


@pytest.mark.parametrize(
    "shape, dim, expected",
    [
        # a slice of 4096 sorts in place (Sort.h should_use_small_sort): nothing extra
        ((64, 4096), 1, ()),
        # one segment of 8192 float32: an int64 index array of 8192 and radix_sort_pairs<float, int64>(8192)
        ((8192,), 0, (8192 * 8, cub_radix_sort_bytes(8192, 4, 8))),
        # 16 segments (< 128): two int2 arrays of n, then the larger of the float/int2 pair sort (with
        # its n-key output buffer) and the int64 key sort
        ((16, 8192), 1, (16 * 8192 * 8, 16 * 8192 * 8, 16 * 8192 * 4, cub_radix_sort_bytes(16 * 8192, 4, 8))),
        # 256 segments: a reverse-index array of n and the segmented sort's key and value buffers
        ((256, 8192), 1, (256 * 8192 * 8, 256 * 8192 * 4 + 256 * 8192 * 8)),
    ],
)
def test_sort_paths(shape, dim, expected):
    assert sort_workspace_bytes(shape, dim, 4) == expected


def test_sort_along_an_outer_dim_counts_the_dense_copies():
    inner = sort_workspace_bytes((8192, 2), 0, 4, dense_innermost=True)
    outer = sort_workspace_bytes((8192, 2), 0, 4, dense_innermost=False)
    n = 8192 * 2
    assert outer == (n * 4, n * 4, n * 8) + inner  # input, values and indices copied dense (cuda/Sort.cpp)


def test_embedding_backward_bound_is_the_sort():
    # the sort (115200) exceeds the scans' tile state (66304) at 4096 indices
    assert embedding_backward_workspace_bytes(4096) == (115200,)


def test_layer_norm_partials_match_the_rule_where_the_rule_can_decide():
    # [70000, 64]: blocks.x = 2, rows = min(32768 / 2, ceil(70000 / 32) = 2188) = 2188 of 64 fp32
    assert layer_norm_partial_bytes(70_000, 64, 2, 4) == (2188 * 64 * 4, 2188 * 64 * 4)
    assert layer_norm_partial_rows(70_000, 64, 132) == 2188  # the rule allocates the same rows on an H100
    assert layer_norm_partial_bytes(60_000, 64, 2, 4) == ()  # M <= 64 Ki rows: one kernel, no partials


def test_group_norm_backward_scratch():
    # [8, 32, 16, 16], 8 groups, fp32: ds, db, c1 [8, 32] fp32 = 1024 B each; c2, c3 [8, 8] = 256 B each
    assert group_norm_backward_bytes(8, 32, 8, 4) == (1024, 1024, 1024, 256, 256)
    assert group_norm_backward_bytes(8, 32, 8, 4, input_grad=False) == (1024, 1024)


# --------------------------------------------------------------------------------------------
# the finders: what reports, and that a rule's own buffers are never counted twice
# --------------------------------------------------------------------------------------------


def _fake(*shape, dtype=torch.float32, grad=False):
    with FakeTensorMode():
        t = torch.empty(shape, dtype=dtype)
    return t.requires_grad_() if grad else t


def test_layer_norm_reports_only_without_an_sm_count():
    assert F.layer_norm in RULES  # the rule allocates the partial buffers when it knows the SM count
    x, w, b = _fake(70_000, 64), _fake(64, grad=True), _fake(64, grad=True)
    finder = UNMODELLED[F.layer_norm]
    assert finder(CudaTarget(sm_count=132), (x, (64,), w, b), {}) == []
    (entry,) = finder(CudaTarget(sm_count=None), (x, (64,), w, b), {})
    # two [2188, 64] fp32 partial buffers, then the two .sum(0) that reduce them: their [64] outputs
    # and the staging of one (Reduce.cuh, the largest split: 4-wide output vectors, a 16 x 8 block,
    # div_up(2188, 8) = 274 values a thread -> ctas_per_output = div_up(274, 16) = 18; staging
    # 4 B x 64 outputs x 18 x 16 lanes x 4, one 4-byte semaphore)
    assert entry.allocations == (2188 * 64 * 4,) * 2 + (64 * 4,) * 2 + (4 * 64 * 18 * 16 * 4, 4)
    assert "SM count is unknown" in entry.mechanism


def test_layer_norm_on_rocm_lists_the_bound_with_a_compute_unit_count():
    # ROCm's launch is not replayed (the rule takes no SM count there): the bound, as without a count
    x, w, b = _fake(70_000, 64), _fake(64, grad=True), _fake(64, grad=True)
    (entry,) = UNMODELLED[F.layer_norm](CudaTarget(capability=(9, 4), vendor="amd", sm_count=304), (x, (64,), w, b), {})
    assert entry.allocations[:2] == (2188 * 64 * 4,) * 2 and "ROCm" in entry.mechanism


def test_embedding_reports_only_on_the_sorting_path():
    weight = _fake(1000, 64, grad=True)
    finder = UNMODELLED[F.embedding]
    assert finder(CudaTarget(), (_fake(3072, dtype=torch.int64), weight), {}) == []  # the feature kernel
    (entry,) = finder(CudaTarget(), (_fake(4096, dtype=torch.int64), weight), {})
    assert entry.allocations == (115200,)
    assert finder(CudaTarget(), (_fake(4096, dtype=torch.int64), weight), {"sparse": True}) == []


def test_rnn_is_unbounded():
    (entry,) = UNMODELLED[torch.lstm](CudaTarget(), (_fake(5, 2, 4),), {})
    assert not entry.bounded and entry.bound_bytes is None and "cuDNN" in entry.mechanism


def test_upper_bound_takes_the_largest_entry_in_new_segments():
    small = Unmodelled("a", "op a", (100 * KiB,), True, "src")  # <= 1 MiB: one 2 MiB small segment
    large = Unmodelled("b", "op b", (2 * MiB, 5 * MiB), True, "src")  # each 1-10 MiB: a 20 MiB segment
    huge = Unmodelled("c", "op c", (), False, "src")
    bound = upper_bound([small, large, large, huge])
    assert bound.extra_bytes == 40 * MiB
    assert bound.unbounded == ("c: op c",)
    assert any("op b (2 calls)" in n for n in bound.notes)


# --------------------------------------------------------------------------------------------
# end to end
# --------------------------------------------------------------------------------------------


class EmbeddingLM(nn.Module):
    def __init__(self, vocab: int = 1000, dim: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.emb(tokens)).flatten(0, 1), tokens.flatten())


class LSTMSorter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(16, 32, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(x)
        values, _ = torch.sort(h.flatten())  # 8 x 512 x 32 = 131072 fp32 in one segment
        return values[-8:].sum()


def test_estimate_names_the_embedding_backward_and_bounds_it():
    tokens = torch.randint(0, 1000, (8, 512))  # 4096 indices > 3072: the sorting backward
    est = memguard.estimate(EmbeddingLM(), tokens, device="cuda", gpu="A100-80GB")
    notes = [n for n in est.notes if "embedding backward" in n]
    assert len(notes) == 1 and "112.50 KiB" in notes[0]
    # 115200 B rounds to a small-pool block: at most one new 2 MiB segment (kSmallBuffer). The head's
    # bias gradient (sum over 4096 tokens of [4096, 1000]) splits over blocks with a staging buffer of
    # 4 B x 1000 outputs x 64 CTAs x 32 lanes x 4 (vectorised) = 32,768,000 B (a 32 MiB segment) and
    # 32 B of semaphores (a 2 MiB one): the larger entry, 34 MiB, is the bound
    assert any("sum.dim_IntList of [4096, 1000] float32 over dims [0]" in n for n in est.notes)
    assert est.peak_upper_bytes == est.peak_bytes + 34 * MiB
    assert est.unbounded_workspaces == ()
    d = est.to_dict()
    assert d["peak_upper_bytes"] == est.peak_upper_bytes
    assert memguard.Estimate.from_dict(d) == est


def test_estimate_with_an_lstm_and_a_sort():
    x = torch.randn(8, 512, 16)
    est = memguard.estimate(LSTMSorter(), x, loss_fn=lambda m, b: m(b), device="cuda", gpu="A100-80GB")
    assert len(est.unbounded_workspaces) == 1 and "cuDNN RNN" in est.unbounded_workspaces[0]
    n = 8 * 512 * 32
    # the sort: an int64 index array of n (1 MiB) and the pair sort's storage (bins 8192, lookback
    # 512 x 2048 = 1 MiB, keys 512 KiB, values 1 MiB, counters 256). A 1 MiB request is still a small
    # one (kSmallSize): at most a new 2 MiB segment; the 2.5 MiB one at most a new 20 MiB segment
    assert sort_workspace_bytes((n,), 0, 4) == (n * 8, 8192 + MiB + 512 * KiB + MiB + 256)
    assert est.peak_upper_bytes == est.peak_bytes + 2 * MiB + 20 * MiB
    assert any("torch.sort" in n and "in peak_upper_bytes" in n for n in est.notes)
    assert any("unbounded" in n and "cuDNN" in n for n in est.notes)


def test_cpu_estimates_have_no_unmodelled_kernels():
    est = memguard.estimate(EmbeddingLM(), torch.randint(0, 1000, (8, 512)), device="cpu")
    assert est.peak_upper_bytes == est.peak_bytes and est.unbounded_workspaces == ()
    assert not any("not modelled" in n for n in est.notes)


def test_old_dicts_load_with_the_peak_as_upper_bound():
    est = memguard.estimate(EmbeddingLM(), torch.randint(0, 1000, (2, 16)), device="cpu")
    d = est.to_dict()
    del d["peak_upper_bytes"], d["unbounded_workspaces"]
    assert memguard.Estimate.from_dict(d).peak_upper_bytes == est.peak_bytes


def test_plan_fits_on_the_upper_bound():
    """A budget between the peak and the upper bound of the whole batch: the plan must not take it."""
    tokens = torch.randint(0, 1000, (8, 512))
    model = EmbeddingLM()
    whole = memguard.estimate(model, tokens, device="cuda", gpu="A100-80GB")
    budget = (whole.peak_bytes + whole.peak_upper_bytes) // 2
    plan = memguard.plan(model, tokens, global_batch_size=8, gpu="A100-80GB", budget_bytes=budget, headroom=0.0,
                         precision="32-true", activation_checkpointing=False, zero_stage=0)
    assert plan.estimate.peak_upper_bytes <= plan.usable_bytes
    assert plan.micro_batch_size < 8  # the whole batch fits its peak but not its upper bound


def test_the_finder_mode_of_the_gpu_path_reports_without_replacing():
    """On a GPU host the CUDA target is traced on fake CUDA tensors without the kernel model; the finder
    mode reports the same entries and leaves every call as it is (run here on CPU tensors)."""
    from memguard.estimator._unmodelled import UnmodelledFinder

    x = torch.randn(8192)
    with UnmodelledFinder(CudaTarget()) as finder:
        values, _ = torch.sort(x)
    assert torch.equal(values, torch.sort(x).values)  # the call ran unchanged
    (entry,) = finder.unmodelled
    assert entry.allocations == sort_workspace_bytes((8192,), 0, 4)


def test_backward_workspaces_are_not_reported_without_a_backward():
    # an evaluation step runs under no_grad: the embedding's backward never sorts
    weight = _fake(1000, 64, grad=True)
    with torch.no_grad():
        assert UNMODELLED[F.embedding](CudaTarget(), (_fake(4096, dtype=torch.int64), weight), {}) == []
    est = memguard.estimate(EmbeddingLM(), torch.randint(0, 1000, (8, 512)), device="cuda", gpu="A100-80GB",
                            train=False)
    assert est.peak_upper_bytes == est.peak_bytes
    assert not any("embedding backward" in n for n in est.notes)


def test_index_put_sort_bound():
    # 1000 indices: four int64 arrays (linearIndex, sorted, orig, range) of 8000 B, and the pair sort:
    # bins 16384, lookback ceil(1000/256)=4 blocks x 2048 = 8192, keys and values 8000 -> 8192 each
    # (256-aligned), counters 512
    from memguard.estimator._unmodelled import index_put_sort_bytes

    assert index_put_sort_bytes(1000) == (8000, 8000, 8000, 8000, 16384 + 8192 + 8192 + 8192 + 512)


def test_advanced_indexing_reports_its_backward_sort():
    from memguard.estimator._unmodelled import UnmodelledFinder, index_put_sort_bytes

    x = torch.randn(64, 10, requires_grad=True)
    rows, cols = torch.arange(64), torch.zeros(64, dtype=torch.int64)
    with UnmodelledFinder(CudaTarget()) as finder:
        x[rows, cols].sum()  # backward: index_put_ accumulating 64 values (the sorting kernel on CUDA)
        x[:, 0].sum()  # basic indexing: a view, no index_put_ in its backward
        torch.zeros(5).index_put_((torch.tensor([0, 1]),), torch.ones(2), accumulate=True)
        torch.zeros(5).index_put_((torch.tensor([0, 1]),), torch.ones(2))  # no accumulate: no sort
    assert [e.allocations for e in finder.unmodelled] == [index_put_sort_bytes(64), index_put_sort_bytes(2)]


# --------------------------------------------------------------------------------------------
# cuDNN convolution workspaces
# --------------------------------------------------------------------------------------------


def test_cache_info_reports_free_memory_or_a_larger_cached_block():
    # CUDACachingAllocator::cacheInfo: cudaMemGetInfo's free memory first, then any larger free cached block
    assert cache_info_largest(3 * GiB, 1 * GiB) == 3 * GiB
    assert cache_info_largest(512 * MiB, 2 * GiB) == 2 * GiB


@pytest.mark.parametrize(
    "candidates, max_block, allocatable, api, expected",
    [
        # Conv_v8.cpp generate_and_filter_plans: plans up to the largest block (2 GiB) are kept; the
        # largest kept one (700 MiB) is allocated; the 5 GiB plan is dropped
        ([0, 3 * MiB, 700 * MiB, 5 * GiB], 2 * GiB, None, "v8", 700 * MiB),
        # ... and halved on each OOM while the allocator cannot give it: 700 -> 350 -> 175 MiB
        ([0, 3 * MiB, 700 * MiB, 5 * GiB], 2 * GiB, 200 * MiB, "v8", 175 * MiB),
        # a plan exactly at the largest block is kept (curr_workspace_size <= max_block_size)
        ([2 * GiB], 2 * GiB, None, "v8", 2 * GiB),
        # Conv_v7.cpp getMaxWorkspaceSize: zero and larger-than-block sizes are skipped, the largest left taken
        ([0, 64 * MiB, 96 * MiB, 4 * GiB], 1 * GiB, None, "v7", 96 * MiB),
        # no workspace wanted by any candidate: nothing allocated
        ([0, 0], 1 * GiB, None, "v7", 0),
        # under CUDNN_CONV_WSCAP_DBG=64 every candidate is at most the cap: the search takes at most the cap
        ([0, 16 * MiB, 64 * MiB], 8 * GiB, None, "v8", 64 * MiB),
    ],
)
def test_benchmark_search_workspace_follows_torchs_rule(candidates, max_block, allocatable, api, expected):
    assert cudnn_benchmark_workspace_bytes(candidates, max_block, allocatable, api) == expected


def test_benchmark_search_refuses_a_workspace_of_a_tebibyte():
    # allocate_workspace / generate_and_filter_plans: "Not enough memory for workspace!" at >= 1 TiB
    with pytest.raises(MemoryError):
        cudnn_benchmark_workspace_bytes([1 << 40], 1 << 41)
    with pytest.raises(ValueError):
        cudnn_benchmark_workspace_bytes([MiB], GiB, api="v6")


def test_conv_entry_names_each_cudnn_call_and_is_unbounded_without_a_cap(monkeypatch):
    monkeypatch.delenv("CUDNN_CONV_WSCAP_DBG", raising=False)
    x, w = _fake(2, 3, 8, 8, grad=True), _fake(4, 3, 3, 3, grad=True)
    (entry,) = UNMODELLED[F.conv2d](CudaTarget(), (x, w), {"padding": 1})
    assert entry.op == "conv2d (forward, backward data, backward filter)"
    assert not entry.bounded and entry.bound_bytes is None and "cuDNN convolution" in entry.mechanism
    assert "CUDNN_CONV_WSCAP_DBG" in entry.detail and "OutOfMemoryError" in entry.detail
    # a frozen first layer: the input needs no gradient, so no backward-data call
    (first,) = UNMODELLED[F.conv2d](CudaTarget(), (_fake(2, 3, 8, 8), w), {})
    assert first.op == "conv2d (forward, backward filter)"
    with torch.no_grad():  # evaluation: the forward alone
        (fwd,) = UNMODELLED[F.conv_transpose2d](CudaTarget(), (x, _fake(3, 4, 3, 3, grad=True)), {})
    assert fwd.op == "conv_transpose2d (forward)"


def test_conv_entry_is_bounded_by_the_cap(monkeypatch):
    monkeypatch.delenv("CUDNN_CONV_WSCAP_DBG", raising=False)
    x, w = _fake(2, 3, 8, 8, grad=True), _fake(4, 3, 3, 3, grad=True)
    (entry,) = UNMODELLED[F.conv2d](CudaTarget(conv_workspace_bytes=32 * MiB), (x, w), {})
    assert entry.bounded and entry.allocations == (32 * MiB,)  # one workspace live at a time
    monkeypatch.setenv("CUDNN_CONV_WSCAP_DBG", "64")
    (entry,) = UNMODELLED[F.conv3d](CudaTarget(), (_fake(1, 3, 4, 8, 8, grad=True), _fake(4, 3, 3, 3, 3)), {})
    assert entry.allocations == (64 * MiB,)


def test_conv_entry_follows_the_cudnn_flags(monkeypatch):
    monkeypatch.delenv("CUDNN_CONV_WSCAP_DBG", raising=False)
    x, w = _fake(2, 3, 8, 8, grad=True), _fake(4, 3, 3, 3, grad=True)
    with torch.backends.cudnn.flags(enabled=True, benchmark=True):
        (entry,) = UNMODELLED[F.conv2d](CudaTarget(), (x, w), {})
    assert "cudnn.benchmark" in entry.mechanism and "up to all free memory" in entry.detail
    with torch.backends.cudnn.flags(enabled=False):  # ATen's own kernels: not cuDNN's workspace
        assert UNMODELLED[F.conv2d](CudaTarget(), (x, w), {}) == []
    (miopen,) = UNMODELLED[F.conv2d](CudaTarget(vendor="amd"), (x, w), {})
    assert "MIOpen" in miopen.mechanism and not miopen.bounded


class TinyConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 16, 3, padding=1)
        self.c2 = nn.Conv2d(16, 16, 3, padding=1)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.c2(self.c1(x).relu()).mean((2, 3)))


def test_estimate_lists_conv_workspaces_and_bounds_them_only_under_a_cap(monkeypatch):
    monkeypatch.delenv("CUDNN_CONV_WSCAP_DBG", raising=False)
    x = torch.randn(8, 3, 32, 32)

    def loss(m, b):
        return m(b).sum()

    free = memguard.estimate(TinyConvNet(), x, loss_fn=loss, device="cuda", gpu="A100-80GB")
    # the first layer's input needs no gradient (no backward-data call), the second's does
    assert free.unbounded_workspaces == ("cuDNN convolution workspace: conv2d (forward, backward filter)",
                                         "cuDNN convolution workspace: conv2d (forward, backward data, backward filter)")
    assert free.peak_upper_bytes == free.peak_bytes
    monkeypatch.setenv("CUDNN_CONV_WSCAP_DBG", "64")
    capped = memguard.estimate(TinyConvNet(), x, loss_fn=loss, device="cuda", gpu="A100-80GB")
    assert capped.peak_bytes == free.peak_bytes  # the cap is a bound, not a model: not in the point estimate
    # 64 MiB is a large request (> 10 MiB): rounded to 2 MiB, one segment of its own
    assert capped.peak_upper_bytes == capped.peak_bytes + 64 * MiB
    assert capped.unbounded_workspaces == ()


# --------------------------------------------------------------------------------------------
# cumsum / cumprod
# --------------------------------------------------------------------------------------------


def test_scan_bound_only_for_a_single_scan():
    # ScanUtils.cuh scan_dim: one scan over the whole tensor -> cuda::cub::inclusive_scan; its tile
    # status (n + 32) x 16 B, 256-aligned, plus the 8-byte grid word aligned to 256
    n = 100_000
    assert scan_workspace_bytes(n, n, 4) == (-(-(n + 32) * 16 // 256) * 256 + 256,)
    assert scan_workspace_bytes(8 * 1000, 1000, 4) == ()  # rows: ATen's block scan, no temporaries
    assert scan_workspace_bytes(8 * 1000, 1000, 4, contiguous=False) == (8 * 1000 * 4,)  # expect_contiguous


def test_cumsum_reports_the_cub_scan():
    (entry,) = UNMODELLED[torch.cumsum](CudaTarget(), (_fake(100_000, grad=True), 0), {})
    assert entry.bounded and entry.allocations == scan_workspace_bytes(100_000, 100_000, 4)
    assert "and its backward" in entry.op
    assert UNMODELLED[torch._C.TensorBase.cumsum](CudaTarget(), (_fake(8, 1000), -1), {}) == []
    torch.use_deterministic_algorithms(True)
    try:
        (det,) = UNMODELLED[torch.cumsum](CudaTarget(), (_fake(1000), 0), {})
    finally:
        torch.use_deterministic_algorithms(False)
    assert not det.bounded and "deterministic" in det.mechanism
