"""Tests of the caching-allocator model and the workspace/context constants.

Expected values are computed by hand from the rules of c10/cuda/CUDACachingAllocator.cpp:
512 B rounding, small pool <= 1 MiB in 2 MiB segments, 20 MiB segments for large requests
under 10 MiB, larger ones rounded to 2 MiB, best fit, split rules, merging on free.
"""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memguard.errors import ConfigError
from memguard.estimator._cuda import (
    BLAS_HANDLES_PER_TRAINING_STEP,
    DEFAULT_CONTEXT_BYTES,
    LARGE_BUFFER,
    SMALL_BUFFER,
    AllocatorResult,
    CachingAllocatorModel,
    allocator_config,
    blas_workspace_allocations,
    blas_workspace_config,
    cublas_workspace_bytes,
    round_size,
    segment_size,
    simulate,
)

KiB = 1 << 10
MiB = 1 << 20

try:
    import torch

    HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover - torch is a hard dependency
    HAS_CUDA = False


# ------------------------------------------------------------------------------ rounding
@pytest.mark.parametrize(
    "nbytes, rounded",
    [
        (1, 512),  # below kMinBlockSize -> kMinBlockSize
        (512, 512),  # already a multiple of 512
        (513, 1024),  # next multiple of 512
        (1000, 1024),
        (MiB + 1, MiB + 512),  # rounding only to 512, even for large requests
    ],
)
def test_round_size(nbytes, rounded):
    assert round_size(nbytes) == rounded


@pytest.mark.parametrize(
    "rounded, seg",
    [
        (512, 2 * MiB),  # small pool -> kSmallBuffer
        (MiB, 2 * MiB),  # exactly kSmallSize is still small
        (MiB + 512, 20 * MiB),  # large pool, < kMinLargeAlloc -> kLargeBuffer
        (10 * MiB - 512, 20 * MiB),  # just under kMinLargeAlloc
        (10 * MiB, 10 * MiB),  # >= kMinLargeAlloc: round to 2 MiB, already a multiple
        (11 * MiB, 12 * MiB),  # round up to 2 MiB
        (19 * MiB + 512, 20 * MiB),
    ],
)
def test_segment_size(rounded, seg):
    assert segment_size(rounded) == seg


# ------------------------------------------------------------------------------ hand-computed
@pytest.mark.parametrize(
    "events, reserved, allocated, segments",
    [
        # 1 KiB: small pool, one 2 MiB segment; allocated is the rounded 1 KiB.
        ([(0, KiB)], 2 * MiB, KiB, 1),
        # Two small requests share one 2 MiB segment (split while remainder >= 512 B).
        ([(0, KiB), (1, 1000)], 2 * MiB, 2 * KiB, 1),
        # 5 MiB: large request < 10 MiB -> 20 MiB segment.
        ([(0, 5 * MiB)], 20 * MiB, 5 * MiB, 1),
        # A second 5 MiB reuses the split remainder of the same segment.
        ([(0, 5 * MiB), (1, 5 * MiB)], 20 * MiB, 10 * MiB, 1),
        # 11 MiB -> 12 MiB segment; remainder 1 MiB is not > kSmallSize, so not split: the whole
        # 12 MiB counts as allocated.
        ([(0, 11 * MiB)], 12 * MiB, 12 * MiB, 1),
        # Two 1 MiB (= kSmallSize) requests fill one 2 MiB small segment; a third needs another.
        ([(0, MiB), (1, MiB), (2, MiB)], 4 * MiB, 3 * MiB, 2),
        # 1 MiB + 1 B rounds to 1 MiB + 512 -> large pool -> 20 MiB segment.
        ([(0, MiB + 1)], 20 * MiB, MiB + 512, 1),
        # Pools never share: a freed 20 MiB large segment cannot serve a 1 KiB request.
        ([(0, 5 * MiB), (0, -5 * MiB), (1, KiB)], 22 * MiB, 5 * MiB, 2),
        # Freeing and reallocating smaller splits the cached 12 MiB segment (remainder
        # 8 MiB > 1 MiB); the 8 MiB remainder then serves an 8 MiB request: still one segment.
        ([(0, 12 * MiB), (0, -12 * MiB), (1, 4 * MiB), (2, 8 * MiB)], 12 * MiB, 12 * MiB, 1),
        # A zero-byte request is a no-op (the allocator returns nullptr).
        ([(0, 0), (1, KiB)], 2 * MiB, KiB, 1),
    ],
)
def test_hand_computed(events, reserved, allocated, segments):
    r = simulate(events)
    assert r.peak_reserved == reserved
    assert r.peak_allocated == allocated
    assert r.num_segments == segments
    assert not r.oom


def test_adjacent_frees_merge():
    # 20 MiB segment split into A(6) B(6) C(6) + free tail 2 MiB. Freeing A and B merges them
    # into one 12 MiB block, which serves a 10 MiB request (needs >= 10 MiB) without a new
    # segment; unmerged, the largest free block would be 6 MiB.
    m = CachingAllocatorModel()
    for h in range(3):
        assert m.malloc(h, 6 * MiB)
    m.free(0)
    m.free(1)
    assert m.malloc(3, 10 * MiB)
    assert m.reserved == 20 * MiB
    assert m.result().num_segments == 1
    # 10 MiB from the merged 12 MiB leaves 2 MiB > 1 MiB, so it is split: allocated = 10 + 6.
    assert m.allocated == 16 * MiB


def test_three_way_merge_makes_segment_releasable():
    # Free A, C, then B: B merges with both neighbours (and the tail), restoring the whole
    # 20 MiB segment, which empty_cache() can then release.
    m = CachingAllocatorModel()
    for h in range(3):
        m.malloc(h, 6 * MiB)
    m.free(0)
    m.free(2)
    assert m.empty_cache() == 0  # segment still split around B
    m.free(1)
    assert m.allocated == 0
    assert m.empty_cache() == 20 * MiB
    assert m.reserved == 0
    assert m.peak_reserved == 20 * MiB  # peaks never go down


def test_best_fit_takes_smallest_block():
    # Two cached segments, 12 MiB and 16 MiB, both free. A 10 MiB request takes the 12 MiB one
    # (best fit), so a following 16 MiB request still fits in the other: no third segment.
    m = CachingAllocatorModel()
    m.malloc(0, 16 * MiB)
    m.malloc(1, 12 * MiB)
    m.free(0)
    m.free(1)
    m.malloc(2, 10 * MiB)
    m.malloc(3, 16 * MiB)
    assert m.result().num_segments == 2
    assert m.reserved == 28 * MiB


def test_requested_and_allocated_at_peak():
    r = simulate([(0, 5 * MiB + 1), (1, 100)])
    # requested is unrounded; allocated is rounded to 512 B.
    assert r.peak_requested == 5 * MiB + 1 + 100
    assert r.peak_allocated == 5 * MiB + 512 + 512
    # The 100 B request opened a 2 MiB small segment at event 1: reserved peaks there.
    assert r.peak_reserved == 22 * MiB
    assert r.peak_reserved_event == 1
    assert r.allocated_at_peak_reserved == 5 * MiB + 512 + 512


def test_peak_moments_differ():
    # Allocated peaks at event 0 (5 MiB in a 20 MiB segment); after the free, a 100 B request
    # opens a 2 MiB small segment, so reserved peaks at event 2 with only 512 B allocated.
    r = simulate([(0, 5 * MiB), (0, -5 * MiB), (1, 100)])
    assert (r.peak_allocated, r.peak_allocated_event) == (5 * MiB, 0)
    assert (r.peak_reserved, r.peak_reserved_event) == (22 * MiB, 2)
    assert r.allocated_at_peak_reserved == 512
    assert r.final_allocated == 512 and r.final_reserved == 22 * MiB


def test_workspace_remainder_is_reused_unsplit():
    # The 8519680-byte cuBLAS workspace takes a 20 MiB segment and leaves 12451840 B free; an
    # 11 MiB request fits there and leaves 917504 B (<= 1 MiB), so it gets the whole block:
    # allocated reaches the full 20 MiB segment.
    r = simulate([(0, 8519680), (1, 11 * MiB)])
    assert r.peak_reserved == LARGE_BUFFER
    assert r.peak_allocated == LARGE_BUFFER
    assert r.num_segments == 1


# ------------------------------------------------------------------------------ limit mode
def test_limit_releases_cached_segments_then_fits():
    # 12 MiB segment cached and free; a 24 MiB request would need 12 + 24 > 30 MiB, so the
    # allocator releases the free 12 MiB segment and retries: 24 MiB fits.
    r = simulate([(0, 12 * MiB), (0, -12 * MiB), (1, 24 * MiB)], limit_bytes=30 * MiB)
    assert not r.oom
    assert r.num_segments == 2
    assert r.final_reserved == 24 * MiB
    assert r.peak_reserved == 24 * MiB


def test_limit_keeps_split_segments():
    # Segment 1 (20 MiB) holds a live 5 MiB block; segment 2 (12 MiB) is free. A 16 MiB request
    # fits neither free block (15 MiB, 12 MiB): 32 + 16 > 40 MiB -> release: only segment 2 is
    # entirely free, segment 1 is split and stays. 20 + 16 = 36 <= 40: served.
    events = [(0, 5 * MiB), (1, 12 * MiB), (1, -12 * MiB), (2, 16 * MiB)]
    r = simulate(events, limit_bytes=40 * MiB)
    assert not r.oom
    assert r.final_reserved == 36 * MiB
    assert r.peak_reserved == 36 * MiB


def test_limit_reports_oom_and_stops():
    # 24 MiB live, nothing cached: 24 + 10 > 30 MiB even after releasing -> OOM on the 10 MiB
    # request; the replay stops there, so the later event is not counted.
    events = [(0, 24 * MiB), (1, 10 * MiB), (2, KiB)]
    r = simulate(events, limit_bytes=30 * MiB)
    assert r.oom
    assert r.oom_request == 10 * MiB
    assert r.num_events == 2
    assert r.final_reserved == 24 * MiB


def test_model_oom_returns_false_and_keeps_state():
    m = CachingAllocatorModel(limit_bytes=4 * MiB)
    assert m.malloc(0, 3 * MiB) is False  # 3 MiB needs a 20 MiB segment > 4 MiB
    assert m.reserved == 0 and m.allocated == 0
    assert m.malloc(1, KiB) is True  # small segment of 2 MiB still fits
    r = m.result()
    assert r.oom and r.oom_request == 3 * MiB  # the first failure is kept


def test_unlimited_never_ooms():
    r = simulate([(i, 100 * MiB) for i in range(50)])
    assert not r.oom and r.peak_reserved == 5000 * MiB


# ------------------------------------------------------------------------------ bad input
def test_free_of_unknown_handle_raises():
    with pytest.raises(ConfigError, match="holds no live allocation"):
        simulate([(0, KiB), (1, -KiB)])


def test_double_free_raises():
    with pytest.raises(ConfigError, match="holds no live allocation"):
        simulate([(0, KiB), (0, -KiB), (0, -KiB)])


def test_double_malloc_raises():
    with pytest.raises(ConfigError, match="allocated twice"):
        simulate([(0, KiB), (0, KiB)])


def test_free_size_mismatch_raises():
    with pytest.raises(ConfigError, match="minus the allocated size"):
        simulate([(0, KiB), (0, -2 * KiB)])


def test_zero_byte_handle_can_be_freed():
    m = CachingAllocatorModel()
    m.malloc(7, 0)
    m.free(7)  # no-op, not an error
    assert m.reserved == 0


@pytest.mark.parametrize("limit", [0, -1, 1.5, True, "1GB"])
def test_bad_limit_raises(limit):
    with pytest.raises(ConfigError, match="limit_bytes"):
        CachingAllocatorModel(limit_bytes=limit)


def test_negative_malloc_raises():
    with pytest.raises(ConfigError, match=">= 0"):
        CachingAllocatorModel().malloc(0, -5)


# ------------------------------------------------------------------------------ reference model
class _NaiveAllocator:
    """An independent, deliberately simple statement of the same rules: each segment is a list
    of [offset, size, allocated] blocks; best fit is a linear scan over all segments."""

    def __init__(self):
        self.segments = []  # (base, small, blocks)
        self.next_base = 0
        self.live = {}
        self.reserved = self.allocated = 0
        self.peak_reserved = self.peak_allocated = 0
        self.count = 0

    def malloc(self, handle, nbytes):
        size = max(512, (nbytes + 511) // 512 * 512)
        small = size <= MiB
        best = None
        for seg in self.segments:
            base, seg_small, blocks = seg
            if seg_small != small:
                continue
            for i, (off, bsize, used) in enumerate(blocks):
                if not used and bsize >= size:
                    key = (bsize, base + off)
                    if best is None or key < best[0]:
                        best = (key, seg, i)
        if best is None:
            if small:
                seg_bytes = 2 * MiB
            elif size < 10 * MiB:
                seg_bytes = 20 * MiB
            else:
                seg_bytes = (size + 2 * MiB - 1) // (2 * MiB) * (2 * MiB)
            seg = (self.next_base, small, [[0, seg_bytes, False]])
            self.next_base += seg_bytes
            self.segments.append(seg)
            self.count += 1
            self.reserved += seg_bytes
            self.peak_reserved = max(self.peak_reserved, self.reserved)
            i = 0
        else:
            _, seg, i = best
        blocks = seg[2]
        off, bsize, _ = blocks[i]
        rest = bsize - size
        if (rest >= 512) if small else (rest > MiB):
            blocks[i] = [off, size, True]
            blocks.insert(i + 1, [off + size, rest, False])
        else:
            blocks[i] = [off, bsize, True]
        self.live[handle] = (seg, off)
        self.allocated += blocks[i][1]
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, handle):
        seg, off = self.live.pop(handle)
        blocks = seg[2]
        i = next(j for j, b in enumerate(blocks) if b[0] == off)
        self.allocated -= blocks[i][1]
        blocks[i][2] = False
        # merge runs of free blocks
        merged = []
        for b in blocks:
            if merged and not merged[-1][2] and not b[2]:
                merged[-1][1] += b[1]
            else:
                merged.append(list(b))
        blocks[:] = merged


def _random_trace(rng: random.Random, n: int):
    sizes = [
        lambda: rng.randint(1, 4 * KiB),
        lambda: rng.randint(1, MiB),
        lambda: rng.randint(MiB - 600, MiB + 600),
        lambda: rng.randint(MiB, 12 * MiB),
        lambda: rng.randint(8 * MiB, 64 * MiB),
    ]
    events, live, handle = [], [], 0
    for _ in range(n):
        if live and rng.random() < 0.45:
            h, nb = live.pop(rng.randrange(len(live)))
            events.append((h, -nb))
        else:
            nb = rng.choice(sizes)()
            events.append((handle, nb))
            live.append((handle, nb))
            handle += 1
    return events


@pytest.mark.parametrize("seed", range(6))
def test_matches_naive_reference(seed):
    events = _random_trace(random.Random(seed), 600)
    ref = _NaiveAllocator()
    for h, nb in events:
        if nb > 0:
            ref.malloc(h, nb)
        else:
            ref.free(h)
    r = simulate(events)
    assert (r.peak_reserved, r.peak_allocated, r.num_segments) == (
        ref.peak_reserved,
        ref.peak_allocated,
        ref.count,
    )
    assert r.final_allocated == ref.allocated


def _check_structure(m: CachingAllocatorModel) -> None:
    # Walk every segment through the prev/next links: sizes add up to reserved, no two adjacent
    # free blocks (merging is complete), free lists hold exactly the free blocks, sorted.
    blocks = m._blocks
    heads = [a for a, b in blocks.items() if b[1] is None]
    total = 0
    free_seen = set()
    for head in heads:
        addr, prev_free = head, False
        while addr is not None:
            size, _, nxt, _, alloc, _stream = blocks[addr]
            total += size
            assert not (prev_free and not alloc), "adjacent free blocks were not merged"
            if nxt is not None:
                assert nxt == addr + size and blocks[nxt][1] == addr
            if not alloc:
                free_seen.add((size, addr))
            prev_free = not alloc
            addr = nxt
    assert total == m.reserved
    lists = [fl for pools in m._pools.values() for fl in pools]
    listed = [b for fl in lists for b in fl]
    assert set(listed) == free_seen and len(listed) == len(free_seen)
    assert all(fl == sorted(fl) for fl in lists)


@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.booleans(), st.integers(0, 40 * MiB), st.integers(0, 10**6)),
        max_size=120,
    ),
    limit=st.one_of(st.none(), st.integers(2 * MiB, 200 * MiB)),
)
def test_invariants_hold(ops, limit):
    m = CachingAllocatorModel(limit_bytes=limit)
    live: dict[int, int] = {}
    handle = 0
    for is_free, nbytes, pick in ops:
        if is_free and live:
            h = sorted(live)[pick % len(live)]
            m.free(h, live.pop(h))  # every freed handle is live
        else:
            # two streams in turn (pick's parity): the invariants hold per stream and overall
            if m.malloc(handle, nbytes, pick % 2) and nbytes > 0:
                live[handle] = nbytes
            handle += 1
        assert m.allocated <= m.reserved
        assert m.allocated >= sum(round_size(n) for n in live.values())
        if limit is not None:
            assert m.reserved <= limit
        r = m.result()
        assert r.peak_reserved >= r.peak_allocated >= r.peak_requested
        assert r.peak_reserved >= m.reserved
    _check_structure(m)
    for h in list(live):
        m.free(h, live.pop(h))
    assert m.allocated == 0 and m.live_handles == 0
    _check_structure(m)
    m.empty_cache()
    assert m.reserved == 0  # with nothing live, every segment merges back whole


def test_result_is_frozen():
    r = simulate([(0, KiB)])
    assert isinstance(r, AllocatorResult)
    with pytest.raises(AttributeError):
        r.peak_reserved = 0  # type: ignore[misc]


# ------------------------------------------------------------------------------ workspaces
@pytest.mark.parametrize(
    "cc, version, expected",
    [
        # :4096:2:16:8 default (2 x 4 MiB + 8 x 16 KiB) since torch 2.0, pytorch#89027.
        ((8, 0), "2.4.0", 8519680),
        # 32 MiB on Hopper (major 9).
        ((9, 0), "2.4.1+cu121", 32 * MiB),
        # 2.8-2.10: separate persistent cuBLASLt workspace of 1 MiB (pytorch#156495).
        ((8, 0), "2.9.1", 8519680 + MiB),
        ((9, 0), "2.10.0", 32 * MiB + MiB),
        # 2.11+: unified cuBLAS/cuBLASLt workspace (pytorch#168175): no separate Lt bytes.
        ((8, 0), "2.13.0+cpu", 8519680),
        # Blackwell (10.x, 12.x): 32 MiB only from 2.11 (pytorch#175344).
        ((10, 0), "2.10.0", 8519680 + MiB),
        ((10, 0), "2.11.0", 32 * MiB),
        ((12, 0), "2.13.0", 32 * MiB),
        # Turing keeps the default.
        ((7, 5), "2.5.0", 8519680),
        # Before 2.0 cuBLAS managed its workspace outside the caching allocator.
        ((7, 0), "1.13.1", 0),
    ],
)
def test_cublas_workspace_bytes(cc, version, expected):
    assert cublas_workspace_bytes(cc, version) == expected


@pytest.mark.parametrize(
    "cc, version, expected",
    [
        # gfx942 (MI300X, cc 9.4): hipBLAS 128 MiB + hipBLASLt 76 MiB from 2.8.
        ((9, 4), "2.13.0", (128 * MiB, 76 * MiB)),
        # gfx90a (MI250, cc 9.0): hipBLAS 32 MiB; 2.6-2.7 has no persistent hipBLASLt one.
        ((9, 0), "2.7.0", (32 * MiB,)),
        # before 2.6 rocBLAS managed its own memory.
        ((9, 4), "2.5.0", ()),
    ],
)
def test_rocm_workspaces(cc, version, expected):
    assert blas_workspace_allocations(cc, version, vendor="amd") == expected


def test_workspace_allocation_order():
    assert blas_workspace_allocations((8, 0), "2.9.0") == (8519680, MiB)


@pytest.mark.parametrize(
    "config, expected",
    [
        (":4096:8", 32 * MiB),  # 4096 KiB x 8
        (":16:8", 128 * KiB),  # the deterministic-mode setting
        (":4096:2:16:8", 8519680),  # the default spelled out
    ],
)
def test_cublas_workspace_config(config, expected):
    assert cublas_workspace_bytes((8, 0), "2.13.0", cublas_workspace_config=config) == expected


def test_installed_torch_version_is_default():
    # None reads torch.__version__; the installed torch must parse and give the same answer
    assert cublas_workspace_bytes((8, 0)) == cublas_workspace_bytes((8, 0), torch.__version__)
    assert cublas_workspace_bytes((9, 0)) == 32 * MiB  # Hopper: 32 MiB on every torch >= 2.0


def test_workspace_bad_arguments_listed_together():
    with pytest.raises(ConfigError) as info:
        cublas_workspace_bytes((8,), "two", vendor="intel")  # type: ignore[arg-type]
    assert len(info.value.problems) == 3


def test_workspace_bad_config():
    with pytest.raises(ConfigError, match="SIZE:COUNT"):
        cublas_workspace_bytes((8, 0), "2.13", cublas_workspace_config="big")


def test_constants():
    assert BLAS_HANDLES_PER_TRAINING_STEP == 2
    # 300-1300 MB by CUDA version and GPU (pytorch#107667, #109888).
    assert 256 * MiB <= DEFAULT_CONTEXT_BYTES <= 1300 * MiB
    assert SMALL_BUFFER == 2 * MiB


# ------------------------------------------------------------------------------ PYTORCH_CUDA_ALLOC_CONF
@pytest.mark.parametrize(
    "size, divisions, expected",
    [
        # the allocator's own example (CUDACachingAllocator.cpp): 1200 in 4 divisions of [1024, 2048)
        (1200 * 1024, 4, 1280 * 1024),
        (1024 * 1024, 4, 1024 * 1024),  # a power of two stays
        (1281 * 1024, 4, 1536 * 1024),
        (3 * MiB + 1, 2, 4 * MiB),  # [2, 4) MiB in halves: the next step is 4 MiB
        (1000, 4, 1024),  # small: 512-byte rounding (size <= kMinBlockSize * divisions = 2048)
    ],
)
def test_roundup_power2_divisions(size, divisions, expected):
    assert round_size(size, allocator_config(f"roundup_power2_divisions:{divisions}")) == expected


@pytest.mark.parametrize(
    "version, expected, rounded_600",
    [
        # c10/core/AllocatorConfig.cpp (torch >= 2.9): "256" is interval index log2(256) = 8 and also
        # fills every smaller one; "512" sets index 9; ">" fills from last_index + 1 = 10 on, so
        # 600 MiB (index 9) has 2 divisions of [512, 1024) MiB: 768 MiB
        ("2.13", (1,) * 9 + (2,) + (8,) * 6, 768 * MiB),
        ("2.9", (1,) * 9 + (2,) + (8,) * 6, 768 * MiB),
        # c10/cuda/CUDAAllocatorConfig.cpp (torch < 2.9): ">" fills from last_index = 9 on, over
        # 512's 2: 8 divisions of [512, 1024) MiB put 600 MiB at 640 MiB
        ("2.8", (1,) * 9 + (8,) * 7, 640 * MiB),
    ],
)
def test_roundup_power2_divisions_list_follows_the_allocator_parser(version, expected, rounded_600):
    cfg = allocator_config("roundup_power2_divisions:[256:1,512:2,>:8]", torch_version=version)
    assert cfg.roundup_power2_divisions == expected
    assert cfg.divisions_for(300 * MiB) == 1  # index log2(300 MiB) - 20 = 8
    assert round_size(600 * MiB, cfg) == rounded_600
    assert "roundup_power2_divisions" in cfg.notes[0]


def test_a_lone_greater_than_entry_skips_the_first_interval_from_torch_2_9():
    # last_index starts at 0: from 2.9 ">" alone fills from index 1, leaving sizes under 2 MiB alone
    assert allocator_config("roundup_power2_divisions:[>:8]", torch_version="2.13").roundup_power2_divisions == (0,) + (8,) * 15
    assert allocator_config("roundup_power2_divisions:[>:8]", torch_version="2.8").roundup_power2_divisions == (8,) * 16


_LIBC10_DIVISIONS = textwrap.dedent(
    """
    import ctypes, os, sys, torch
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    f = lib._ZN3c1016CachingAllocator26AcceleratorAllocatorConfig24roundup_power2_divisionsEm
    f.restype, f.argtypes = ctypes.c_size_t, [ctypes.c_size_t]
    for conf in sys.argv[1:]:
        torch._C._accelerator_setAllocatorSettings(conf)
        print(",".join(str(f((1 << 20) << i)) for i in range(16)))
    """
)


def test_roundup_power2_divisions_match_the_installed_allocator():
    # the installed torch's own parser (libc10's AcceleratorAllocatorConfig, torch >= 2.9, which
    # CPU builds ship too) against memguard's reading of the same strings
    confs = ["roundup_power2_divisions:[256:1,512:2,>:8]", "roundup_power2_divisions:[64:8,256:4,1024:4,>:1]",
             "roundup_power2_divisions:[>:8]", "roundup_power2_divisions:[1:2,>:8]", "roundup_power2_divisions:4"]
    if tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 9):
        pytest.skip("the allocator config moved to c10/core (AcceleratorAllocatorConfig) in torch 2.9")
    run = subprocess.run([sys.executable, "-c", _LIBC10_DIVISIONS, *confs], capture_output=True, text=True, timeout=120)
    if run.returncode != 0:
        pytest.skip(f"libc10 does not export AcceleratorAllocatorConfig::roundup_power2_divisions: {run.stderr[-200:]}")
    theirs = [tuple(int(x) for x in line.split(",")) for line in run.stdout.split()]
    assert theirs == [allocator_config(c).roundup_power2_divisions for c in confs]


def test_large_segment_size_sets_the_segment_of_mid_sized_requests():
    cfg = allocator_config("large_segment_size_mb:64", torch_version="2.13")
    # AllocatorConfig.h (2.13): large_segment_size_ replaces kLargeBuffer in get_allocation_size for
    # large requests under kMinLargeAlloc (10 MiB); small ones keep 2 MiB, >= 10 MiB their 2 MiB rounding
    assert cfg.large_segment_size == 64 * MiB
    assert segment_size(5 * MiB, cfg) == 64 * MiB
    assert segment_size(MiB, cfg) == 2 * MiB
    assert segment_size(12 * MiB, cfg) == 12 * MiB
    assert simulate([(0, 5 * MiB), (1, 5 * MiB)], config=cfg).peak_reserved == 64 * MiB  # one segment, split
    # parseArgs (2.13, checked against its libc10): max_non_split_rounding_size defaults to it
    assert cfg.max_non_split_rounding_size == 64 * MiB
    assert "64 MiB segments" in cfg.notes[0]
    # a torch before 2.13 is not known to have the option: said in the notes, segments stay 20 MiB
    old = allocator_config("large_segment_size_mb:64", torch_version="2.8")
    assert old.large_segment_size == 20 * MiB and "not modelled" in old.notes[0]


@pytest.mark.parametrize(
    "conf",
    [
        "large_segment_size_mb:10",  # parseLargeSegmentSize: "must be > 10 MB" (kMinLargeAlloc / 1 MiB)
        # the *_mb minimum becomes large_segment_size, wherever large_segment_size_mb stands
        # (2.13's libc10: "max_split_size_mb too small, must be >= 64")
        "max_split_size_mb:40,large_segment_size_mb:64",
        "large_segment_size_mb:64,max_non_split_rounding_mb:30",
    ],
)
def test_large_segment_size_values_the_allocator_rejects(conf):
    with pytest.raises(ConfigError):
        allocator_config(conf, torch_version="2.13")


def test_max_split_size_keeps_small_requests_out_of_big_blocks():
    cfg = allocator_config("max_split_size_mb:20")
    # a 40 MiB block is freed; a 12 MiB request would split it by default, but with
    # max_split_size 20 MiB it may not take an oversize block and gets its own segment
    events = [(0, 40 * MiB), (0, -40 * MiB), (1, 12 * MiB)]
    assert simulate(events).peak_reserved == 40 * MiB
    assert simulate(events, config=cfg).peak_reserved == 40 * MiB + 12 * MiB  # 12 MiB >= kMinLargeAlloc: rounded to 2 MiB
    # an oversize request takes a cached block at most max_non_split_rounding_size (20 MiB) larger,
    # and does not split it: all of it counts as allocated
    assert simulate([(0, 40 * MiB), (0, -40 * MiB), (1, 30 * MiB)], config=cfg).peak_allocated == 40 * MiB
    assert simulate([(0, 60 * MiB), (0, -60 * MiB), (1, 30 * MiB)], config=cfg).peak_reserved == 90 * MiB


def test_allocator_config_notes_and_errors():
    assert allocator_config("") == allocator_config("expandable_segments:False")  # the defaults, no notes
    assert allocator_config("").notes == ()
    expandable = allocator_config("expandable_segments:True")  # modelled now (_cuda_expandable), and said so
    assert expandable.expandable_segments and "expandable_segments:True read" in expandable.notes[0]
    assert len(allocator_config("max_split_size_mb:128,garbage_collection_threshold:0.6").notes) == 2
    assert "replaces the caching allocator" in allocator_config("backend:cudaMallocAsync").notes[0]
    # values the real allocator rejects at start-up are errors, all listed
    with pytest.raises(ConfigError) as info:
        allocator_config("max_split_size_mb:8,roundup_power2_divisions:3")
    assert len(info.value.problems) == 2


def test_the_environment_is_read_as_the_allocator_reads_it(monkeypatch):
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:64")
    assert allocator_config().max_split_size == 64 * MiB
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:32")  # takes precedence
    assert allocator_config().max_split_size == 32 * MiB
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert blas_workspace_config() is None
    monkeypatch.setenv("HIPBLAS_WORKSPACE_CONFIG", ":1024:1")
    assert blas_workspace_config() is None  # hipBLAS's name is read on ROCm only
    assert blas_workspace_config("amd") == ":1024:1"


def test_estimate_reads_the_workspace_setting_and_says_so(monkeypatch):
    import memguard

    nn = torch.nn
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "CUBLAS_WORKSPACE_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    model, batch = nn.Linear(64, 64), torch.ones(8, 64)
    plain = memguard.estimate(model, batch, loss_fn=lambda m, b: m(b).sum(), gpu="A100-80GB")
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # 32 MiB per handle instead of 8519680 B
    big = memguard.estimate(model, batch, loss_fn=lambda m, b: m(b).sum(), gpu="A100-80GB")
    assert plain.notes == ()
    assert big.breakdown["workspace"] - plain.breakdown["workspace"] == BLAS_HANDLES_PER_TRAINING_STEP * (32 * MiB - 8519680)
    assert "':4096:8'" in big.notes[0] and str(32 * MiB) in big.notes[0]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert any("expandable_segments" in n for n in memguard.estimate(model, batch, loss_fn=lambda m, b: m(b).sum()).notes)


# ------------------------------------------------------------------------------ real GPU
_GPU_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    sizes = json.loads(sys.argv[1])
    live = {}
    for h, n in sizes:
        if n > 0:
            live[h] = torch.empty(n, dtype=torch.uint8, device="cuda")
        else:
            del live[h]
    torch.cuda.synchronize()
    print(json.dumps([torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()]))
    """
)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_matches_real_allocator():
    import json

    events = _random_trace(random.Random(123), 300)
    out = subprocess.run(
        [sys.executable, "-c", _GPU_SCRIPT, json.dumps(events)],
        capture_output=True, text=True, check=True, timeout=120,
        env={**__import__("os").environ, "PYTORCH_CUDA_ALLOC_CONF": ""},
    )
    reserved, allocated = json.loads(out.stdout.strip().splitlines()[-1])
    r = simulate(events)
    assert (r.peak_reserved, r.peak_allocated) == (reserved, allocated)


_WORKSPACE_SCRIPT = textwrap.dedent(
    """
    import json, torch
    a = torch.ones(64, 64, device="cuda")
    before = torch.cuda.memory_allocated()
    (a @ a).sum().item()
    after = torch.cuda.memory_allocated()
    p = torch.cuda.get_device_properties(0)
    print(json.dumps([after - before, p.major, p.minor]))
    """
)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cublas_workspace_on_device():
    import json
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("CUBLAS_WORKSPACE_CONFIG",)}
    out = subprocess.run(
        [sys.executable, "-c", _WORKSPACE_SCRIPT], capture_output=True, text=True,
        check=True, timeout=120, env=env,
    )
    grown, major, minor = json.loads(out.stdout.strip().splitlines()[-1])
    # After the matmul only the 64x64 result was freed and the 1-element sum may linger:
    # growth beyond the workspace is at most one 512 B block.
    vendor = "amd" if torch.version.hip else "nvidia"
    expected = blas_workspace_allocations((major, minor), torch.__version__, vendor=vendor)[0]
    assert expected <= grown <= expected + 512


_TWO_HANDLES_SCRIPT = textwrap.dedent(
    """
    import json, torch
    lin = torch.nn.Linear(64, 64, device="cuda")
    x = torch.randn(32, 64, device="cuda", requires_grad=True)
    lin(x).sum().backward()  # forward matmul on this thread, backward on autograd's device thread
    torch.cuda.synchronize()
    sizes = [
        b["requested_size"]
        for seg in torch.cuda.memory_snapshot()
        for b in seg["blocks"]
        if b["state"] == "active_allocated"
    ]
    p = torch.cuda.get_device_properties(0)
    print(json.dumps([sizes, p.major, p.minor]))
    """
)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_training_step_holds_two_workspaces():
    import json
    import os

    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    out = subprocess.run(
        [sys.executable, "-c", _TWO_HANDLES_SCRIPT], capture_output=True, text=True,
        check=True, timeout=120, env=env,
    )
    sizes, major, minor = json.loads(out.stdout.strip().splitlines()[-1])
    vendor = "amd" if torch.version.hip else "nvidia"
    workspace = blas_workspace_allocations((major, minor), torch.__version__, vendor=vendor)[0]
    # No tensor of this step is workspace-sized (all are <= 64 x 64 x 4 B = 16 KiB).
    assert sizes.count(workspace) == BLAS_HANDLES_PER_TRAINING_STEP


def test_a_block_serves_only_its_own_stream():
    # CUDACachingAllocator.cpp: free blocks are ordered by (stream, size, address) and
    # get_free_block takes one of the request's stream only; free_block returns a block to the
    # free blocks of the stream it was allocated on
    m = CachingAllocatorModel()
    assert m.malloc(1, 64 * MiB, stream=1)
    m.free(1, 64 * MiB)
    assert m.reserved == 64 * MiB
    assert m.malloc(2, 64 * MiB, stream=0)  # the default stream cannot take stream 1's segment
    assert m.reserved == 128 * MiB
    assert m.malloc(3, 64 * MiB, stream=1)  # stream 1 reuses its own
    assert m.reserved == 128 * MiB
    m.free(2, 64 * MiB)
    m.free(3, 64 * MiB)
    _check_structure(m)
    assert m.empty_cache() == 128 * MiB  # release_cached_blocks walks every stream's blocks


def test_side_stream_segments_stay_cached_in_a_steady_state_step():
    # one step: the default stream's activations peak (handle 2) after a side-stream buffer of the
    # previous step was freed (handles 4/5 allocated late on stream 1 and freed at the end, like
    # FSDP2's sharded gradients on the reduce-scatter stream, freed by zero_grad before the next
    # forward). One replay alone shares nothing, so the peak is the default stream's; in the steady
    # state stream 1's segment from the step before is still reserved at the default stream's peak
    events = [(1, 100 * MiB), (2, 300 * MiB), (2, -300 * MiB), (4, 200 * MiB), (4, -200 * MiB), (1, -100 * MiB)]
    plain = simulate(events)
    assert plain.peak_reserved == 400 * MiB  # handle 4 reuses the freed activations' segment
    steady = simulate(events, streams={4: 1})
    assert steady.peak_reserved == 600 * MiB  # 200 MiB cached for stream 1 + 400 MiB of the default
    assert steady.peak_allocated == plain.peak_allocated == 400 * MiB
    # no side streams named: the plain replay
    assert simulate(events, streams={}) == plain
