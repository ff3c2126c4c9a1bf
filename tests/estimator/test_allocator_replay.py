"""Invariants of the caching-allocator replay, fixed and expandable segments (property tests).

The rules are those of ``c10/cuda/CUDACachingAllocator.cpp`` (cited in
``memguard/estimator/_cuda_allocator.py`` and ``_cuda_expandable.py``). Each property below is a
rule of the real allocator that a replay bug would break:

* no request is served by new memory (a new segment, or newly mapped pages) while a cached free
  block of its stream and pool could serve it (``get_free_block`` comes before ``alloc_block``);
* free neighbours always coalesce (``free_block`` -> ``try_merge_blocks``), and blocks tile their
  segment exactly;
* reserved >= allocated >= requested, and the reported peaks are the maxima of what was seen;
* with fixed segments the replay equals a plain transcription of the rules (:class:`_Reference`).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from memguard.estimator._cuda import (
    LARGE_BUFFER,
    MIN_BLOCK_SIZE,
    SMALL_BUFFER,
    SMALL_SIZE,
    CachingAllocatorModel,
    allocator_config,
    allocator_model,
    round_size,
    segment_size,
    simulate,
)
from memguard.estimator._cuda_expandable import ExpandableSegmentsModel

MiB = 1 << 20
EXPANDABLE = allocator_config("expandable_segments:True", torch_version="2.13")

# Sizes that exercise every rule: small-pool requests (<= 1 MiB), large ones under 10 MiB (20 MiB
# segments), large ones rounded to 2 MiB, and sizes a few bytes off the boundaries.
_sizes = st.one_of(
    st.integers(1, 4096),
    st.integers(1, SMALL_SIZE + 4096),
    st.integers(SMALL_SIZE, 12 * MiB),
    st.integers(10 * MiB - 2, 10 * MiB + 2),
    st.sampled_from([12 * MiB, 18 * MiB, 32 * MiB, 48 * MiB]),
)
# An op: ("a", size, stream) allocates, ("f", k) frees the k-th live allocation (mod the live count),
# ("r",) releases the cache (torch.cuda.empty_cache), which leaves unmapped holes in expandable segments.
_ops = st.lists(
    st.one_of(st.tuples(st.just("a"), _sizes, st.integers(0, 1)), st.tuples(st.just("f"), st.integers(0, 1 << 16)),
              st.tuples(st.just("a"), _sizes, st.integers(0, 1)), st.tuples(st.just("f"), st.integers(0, 1 << 16)),
              st.just(("r",))),
    min_size=1, max_size=60,
)
RELEASE = -1  # the handle of an empty_cache event


def _events(ops):
    """(handle, nbytes, stream) events from ops: every free names a live handle."""
    live, out, nxt = [], [], 0
    for op in ops:
        if op[0] == "r":
            out.append((RELEASE, 0, 0))
        elif op[0] == "a":
            out.append((nxt, op[1], op[2]))
            live.append((nxt, op[1]))
            nxt += 1
        elif live:
            h, n = live.pop(op[1] % len(live))
            out.append((h, -n, 0))
    return out


def _free_blocks(model):
    """{(stream, small): sorted [(size, addr)]} of every free mapped block, read from the block records."""
    found = {}
    for addr, (size, _prev, _next, small, alloc, stream) in model._blocks.items():
        if alloc is False:
            found.setdefault((stream, small), []).append((size, addr))
    return {k: sorted(v) for k, v in found.items()}


def _check_structure(model):
    """Blocks tile their segments, free neighbours are merged, free lists match the records,
    and reserved counts exactly the mapped bytes."""
    blocks = model._blocks
    mapped = 0
    for addr, (size, prev, nxt, _small, alloc, _stream) in blocks.items():
        assert size > 0
        if nxt is not None:
            assert blocks[nxt][1] == addr and addr + size == nxt  # contiguous, doubly linked
            # free_block / map_block: two free mapped neighbours are always one block
            assert not (alloc is False and blocks[nxt][4] is False)
        if prev is not None:
            assert blocks[prev][2] == addr
        if alloc != 2:  # mapped (2 is the expandable model's unmapped marker)
            mapped += size
    assert mapped == model.reserved
    listed = {}
    for stream, (small_list, large_list) in model._pools.items():
        for small, free_list in ((True, small_list), (False, large_list)):
            assert free_list == sorted(free_list)
            if free_list:
                listed[(stream, small)] = list(free_list)
    assert listed == _free_blocks(model)


def _replay_checked(events, model):
    """Replay ``events`` through ``model`` checking every invariant after every event; returns the
    (max reserved, max allocated) seen."""
    max_res = max_alloc = 0
    for handle, nbytes, stream in events:
        if handle == RELEASE:
            before = model.reserved
            assert model.empty_cache() == before - model.reserved >= 0
        elif nbytes < 0:
            before = model.reserved
            model.free(handle, -nbytes)
            assert model.reserved == before  # freeing never returns memory to the driver
        else:
            size = round_size(nbytes, model._config)
            small = size <= SMALL_SIZE
            fits = [b for b in _free_blocks(model).get((stream, small), []) if b[0] >= size]
            before_res, before_alloc = model.reserved, model.allocated
            if not model.malloc(handle, nbytes, stream):
                # out of memory: only under a cap, only when nothing cached fits, and only after the
                # release of every cached segment or page (release_cached_blocks) still leaves no room
                assert model._limit is not None and not fits and model.allocated == before_alloc
                assert model.reserved + segment_size(size) > model._limit
                _check_structure(model)
                break
            grown = model.reserved - before_res
            # the property of issue 33: new memory only when no cached block of this stream and pool fits
            assert grown <= 0 or not fits, (nbytes, fits[:3])  # (a capped retry may release first)
            got = model.allocated - before_alloc
            if isinstance(model, ExpandableSegmentsModel):
                # should_split (expandable): any remainder of 512 B or more is split off
                assert size <= got < size + MIN_BLOCK_SIZE
                page = SMALL_BUFFER if small else LARGE_BUFFER
                assert grown < size + page  # map_block maps only the missing pages
            else:
                # should_split: small pool splits at >= 512 B left, large pool at > 1 MiB left
                assert size <= got < size + (MIN_BLOCK_SIZE if small else SMALL_SIZE + 1)
                assert grown == 0 or (not fits and model.reserved - segment_size(size) <= before_res)
        _check_structure(model)
        assert model.reserved >= model.allocated >= model._requested >= 0
        max_res, max_alloc = max(max_res, model.reserved), max(max_alloc, model.allocated)
        assert (model.peak_reserved, model.peak_allocated) == (max_res, max_alloc)
    return max_res, max_alloc


_limits = st.one_of(st.none(), st.integers(20 * MiB, 200 * MiB))


@settings(max_examples=150, deadline=None)
@given(_ops, _limits)
def test_fixed_segments_keep_the_allocators_invariants(ops, limit):
    _replay_checked(_events(ops), CachingAllocatorModel(limit_bytes=limit))


@settings(max_examples=150, deadline=None)
@given(_ops, _limits)
def test_expandable_segments_keep_the_allocators_invariants(ops, limit):
    _replay_checked(_events(ops), ExpandableSegmentsModel(limit_bytes=limit, config=EXPANDABLE))


@settings(max_examples=100, deadline=None)
@given(_ops)
def test_freeing_everything_lets_empty_cache_release_everything(ops):
    # release_cached_blocks: every fixed segment is one free block again once all is freed (frees
    # coalesce), so all is cudaFree'd; with expandable segments every whole free page is unmapped, and
    # with nothing allocated every mapped byte sits in whole pages (pages are mapped whole)
    for model in (CachingAllocatorModel(), ExpandableSegmentsModel(config=EXPANDABLE)):
        events = _events(ops)
        live = {}
        for h, n, s in events:
            if h == RELEASE:
                continue
            live[h] = n
            if n < 0:
                del live[h]
        events += [(h, -n, 0) for h, n in live.items()]
        _replay_checked(events, model)
        assert model.allocated == 0
        model.empty_cache()
        assert model.reserved == 0
        _check_structure(model)


class _Reference:
    """The fixed-segment rules written out plainly: segments in cudaMalloc order (increasing
    addresses), each a list of [size, allocated, stream] blocks in address order."""

    def __init__(self, limit=None):
        self.segs, self.live, self.limit = [], {}, limit
        self.reserved = self.allocated = self.peak_res = self.peak_alloc = 0
        self.count = 0

    def malloc(self, h, n, stream):
        size = round_size(n)
        small = size <= SMALL_SIZE
        # get_free_block: smallest fitting free block of the same pool and stream, then lowest address
        best = None
        for si, (seg_small, blocks) in enumerate(self.segs):
            off = 0
            for bi, (bsize, alloc, bstream) in enumerate(blocks):
                if seg_small == small and not alloc and bstream == stream and bsize >= size:
                    key = (bsize, si, off)
                    if best is None or key < best[0]:
                        best = (key, si, bi)
                off += bsize
        if best is None:
            seg = segment_size(size)
            if self.limit is not None and self.reserved + seg > self.limit:
                self.release()
                if self.reserved + seg > self.limit:
                    return False
            self.segs.append((small, [[seg, False, stream]]))
            self.count += 1
            self.reserved += seg
            si, bi = len(self.segs) - 1, 0
        else:
            _, si, bi = best
        blocks = self.segs[si][1]
        blk = blocks[bi]
        rest = blk[0] - size
        if (rest >= MIN_BLOCK_SIZE) if small else (rest > SMALL_SIZE):  # should_split
            blocks.insert(bi + 1, [rest, False, stream])
            blk[0] = size
        blk[1] = True
        self.live[h] = blk
        self.allocated += blk[0]
        self.peak_res, self.peak_alloc = max(self.peak_res, self.reserved), max(self.peak_alloc, self.allocated)
        return True

    def release(self):
        # release_cached_blocks: cudaFree every segment that is one free block
        self.segs = [s for s in self.segs if not (len(s[1]) == 1 and not s[1][0][1])]
        self.reserved = sum(b[0] for s in self.segs for b in s[1])

    def free(self, h):
        blk = self.live.pop(h)
        blk[1] = False
        self.allocated -= blk[0]
        for _small, blocks in self.segs:
            i = next((i for i, b in enumerate(blocks) if b is blk), None)
            if i is None:
                continue
            # free_block: merge with the free previous and next blocks of the same segment
            if i + 1 < len(blocks) and not blocks[i + 1][1]:
                blk[0] += blocks.pop(i + 1)[0]
            if i > 0 and not blocks[i - 1][1]:
                blocks[i - 1][0] += blocks.pop(i)[0]
            return


@settings(max_examples=150, deadline=None)
@given(_ops, st.one_of(st.none(), st.integers(20 * MiB, 200 * MiB)))
def test_fixed_segments_replay_equals_the_rules_written_out(ops, limit):
    events = _events(ops)
    ref = _Reference(limit)
    for h, n, s in events:
        if h == RELEASE:
            ref.release()
        elif n < 0:
            ref.free(h)
        elif not ref.malloc(h, n, s):
            break
    model = CachingAllocatorModel(limit_bytes=limit)
    for h, n, s in events:
        if h == RELEASE:
            model.empty_cache()
        elif n < 0:
            model.free(h, -n)
        elif not model.malloc(h, n, s):
            break
    got = model.result()
    assert (got.peak_reserved, got.peak_allocated, got.num_segments) == (ref.peak_res, ref.peak_alloc, ref.count)
    assert (got.final_reserved, got.final_allocated) == (ref.reserved, ref.allocated)


def _backward_like(n_layers, act, grad):
    """Forward saves one activation of ``act`` bytes per layer; backward frees them last to first and
    allocates a weight gradient of ``grad`` bytes after each free (the pattern of a Llama MLP:
    ``act`` = batch * seq * intermediate * 2 B, ``grad`` = hidden * intermediate * 2 B)."""
    events = [(i, act) for i in range(n_layers)]
    for i in reversed(range(n_layers)):
        events += [(i, -act), (n_layers + i, grad)]
    return events


def test_fixed_segments_cannot_reuse_smaller_freed_activations():
    # A 3B Llama at batch 4: seq 512 gives 32 MiB MLP activations (4 * 512 * 8192 * 2 B) and 48 MiB
    # weight gradients (3072 * 8192 * 2 B). Each activation >= 10 MiB is its own segment rounded to
    # 2 MiB (get_allocation_size); a freed 32 MiB segment cannot hold 48 MiB and segments never merge,
    # so every gradient is a new cudaMalloc: 28 * (32 + 48) MiB reserved.
    short = simulate(_backward_like(28, 32 * MiB, 48 * MiB))
    assert short.peak_reserved == 28 * (32 + 48) * MiB
    # allocated peaks when every gradient exists: the freed activations' 28 * 32 MiB are the gap
    assert short.peak_allocated == 28 * 48 * MiB
    # seq 768: the activation is 4 * 768 * 8192 * 2 B = 48 MiB, the gradient's size: each freed
    # activation segment serves the next gradient exactly, nothing new is reserved in backward
    even = simulate(_backward_like(28, 48 * MiB, 48 * MiB))
    assert even.peak_reserved == 28 * 48 * MiB == even.peak_allocated


def test_expandable_segments_merge_the_freed_activations():
    # With expandable_segments the activations lie side by side in one segment and freed neighbours
    # merge. Forward maps 900 MiB: 20 MiB pages (kLargeBuffer), every 5 activations fill 8 pages
    # exactly, the last 3 take 5 pages and leave 4 MiB free at the end. Backward: the last activation
    # merges with that free end (36 MiB), so the first gradient maps 12 MiB more; from then on two
    # freed activations merge into a 64 MiB hole that every other gradient fits (leaving a 16 MiB
    # sliver between gradients), while the other 14 gradients extend the end: 900 + 12 + 14 * 48 =
    # 1584 MiB, mapped in whole pages from the free end each time: 1600 MiB (80 pages).
    fixed = simulate(_backward_like(28, 32 * MiB, 48 * MiB))
    grown = simulate(_backward_like(28, 32 * MiB, 48 * MiB), config=EXPANDABLE)
    assert grown.peak_reserved == 1600 * MiB
    assert grown.peak_allocated == fixed.peak_allocated == 28 * 48 * MiB
    assert fixed.peak_reserved == 2240 * MiB  # 28 * (32 + 48) MiB, as above


def test_expandable_pages_are_unmapped_and_mapped_again_in_place():
    model = ExpandableSegmentsModel(config=EXPANDABLE)
    model.malloc(0, 50 * MiB)  # maps 3 pages of 20 MiB: [0, 50) allocated, [50, 60) free
    model.malloc(1, 8 * MiB)  # [50, 58) from the free end, [58, 60) free
    assert model.reserved == 60 * MiB
    model.free(0)
    # unmap_block: the whole pages inside the free [0, 50) are [0, 40); [40, 50) stays mapped and free
    assert model.empty_cache() == 40 * MiB and model.reserved == 20 * MiB
    # find_expandable_block: the unmapped [0, 40) and the free [40, 50) after it hold 45 MiB; map_block
    # maps [0, 40) again and merges it with [40, 50), so nothing new is reserved beyond the 40 MiB
    model.malloc(2, 45 * MiB)
    assert model.reserved == 60 * MiB and model._live[2][0] == model._live[1][0] - 50 * MiB
    _check_structure(model)


def test_expandable_best_fit_passes_over_a_block_that_could_grow():
    model = ExpandableSegmentsModel(config=EXPANDABLE)
    model.malloc(0, 12 * MiB)  # maps [0, 20): [0, 12) allocated, [12, 20) free
    model.malloc(1, 8 * MiB)  # fills [12, 20)
    model.malloc(2, 30 * MiB)  # maps [20, 60): [20, 50) allocated, [50, 60) free, unmapped space after it
    model.free(0)  # [0, 12) free between the segment's start and a live block
    start = model._live[1][0] - 12 * MiB
    # get_free_block: the smallest fitting block is the free end (10 MiB), but its expandable size
    # (10 MiB + the unmapped space after it) exceeds the 12 MiB hole's, so the hole serves the request
    model.malloc(3, 10 * MiB)
    assert model._live[3][0] == start
    _check_structure(model)


def test_allocator_model_follows_the_config():
    assert type(allocator_model()) is CachingAllocatorModel
    assert type(allocator_model(config=EXPANDABLE)) is ExpandableSegmentsModel
    assert type(allocator_model(config=allocator_config("expandable_segments:False"))) is CachingAllocatorModel


def test_estimate_replays_expandable_segments_when_the_environment_sets_them(monkeypatch):
    # The public path: PYTORCH_CUDA_ALLOC_CONF is read at pricing time (allocator_config) and picks the
    # model. Six Linear(2048, 2048) layers in fp32: 16 MiB weight gradients, 12 MiB activations
    # (1536 x 2048 x 4 B), so with fixed segments no freed activation segment can hold a gradient and
    # backward reserves new segments (the 3B Llama's pattern at 512 tokens, scaled down); with
    # expandable segments freed neighbours merge and the reserved peak is lower.
    import torch
    from torch import nn

    import memguard

    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(6)])
    batch = torch.ones(1536, 2048, device="meta")

    def run():
        return memguard.estimate(model, batch, loss_fn=lambda m, b: m(b).float().pow(2).mean(), gpu="A100-80GB",
                                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), torch_version="2.13")

    fixed = run()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    grown = run()
    assert any("expandable_segments:True read" in n for n in grown.notes)
    assert grown.peak_bytes < fixed.peak_bytes
    assert grown.peak_bytes >= grown.allocated_peak_bytes
