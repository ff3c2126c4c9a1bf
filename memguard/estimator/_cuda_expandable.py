"""The caching allocator with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, block by block.

With expandable segments (``c10/cuda/CUDACachingAllocator.cpp``, Note [Expandable Segments]) each
stream's small and large pool is one reserved virtual address range whose physical pages are
mapped as the pool grows: 2 MiB pages (``kSmallBuffer``) for the small pool, 20 MiB
(``kLargeBuffer``) for the large one (``find_expandable_block``). The rules this model follows
beyond :class:`~memguard.estimator._cuda_allocator.CachingAllocatorModel`'s:

* a request no cached block serves maps pages at the lowest address where enough free or unmapped
  address space follows (``find_expandable_block``): normally the end of the mapped range, and a
  free block just before it is extended rather than left behind (``try_allocate_expandable_block``,
  ``map_block`` merges the new pages with their free neighbours); only the missing bytes, rounded up
  to whole pages, are mapped;
* best fit ranks a free block followed by unmapped space by the size it could grow to, so such a
  block is passed over for the next larger free block (``get_free_block``);
* any block splits when at least 512 B remain, in both pools (``should_split``);
* releasing cached memory (on a capped ``cudaMalloc`` failure, or ``empty_cache``) unmaps every whole
  page inside each free block (``release_blocks`` -> ``unmap_block``, ``ExpandableSegment::unmap``).

Free blocks of one segment are neighbours in one address range, so they merge where fixed segments
(one ``cudaMalloc`` each) never could; what stays unusable is a free hole between live blocks that is
smaller than the request, and the part of a page past the last live block.

Known limitations: the large pool's page is ``kLargeBuffer`` as in the source read (whether torch
2.13's ``large_segment_size_mb`` changes it was not checked); the address space is taken as unbounded (the real one is 1 1/8 of the GPU's memory,
after which a second segment starts); under a cap, the retry follows ``release_cached_blocks`` (every
free page unmapped), as without expandable segments; no IPC or peer mappings.
"""

from __future__ import annotations

from bisect import bisect_left, insort

from memguard.errors import ConfigError
from memguard.estimator._cuda_allocator import (
    LARGE_BUFFER,
    MIN_BLOCK_SIZE,
    SMALL_BUFFER,
    SMALL_SIZE,
    AllocatorConfig,
    CachingAllocatorModel,
    round_size,
    segment_size,
)

# Fields of a block record, as in _cuda_allocator (size, prev, next, small, allocated, stream).
_SIZE, _PREV, _NEXT, _SMALL, _ALLOC, _STREAM = 0, 1, 2, 3, 4, 5
# _ALLOC of a block whose address range has no physical pages (Block::mapped == false). It is truthy,
# so CachingAllocatorModel.free never merges a freed block into it (try_merge_blocks: dst->mapped !=
# src->mapped -> no merge), exactly as it never merges into an allocated block.
_UNMAPPED = 2
# The virtual range each segment reserves, in bytes; far beyond any GPU's memory (the real one is
# totalGlobalMem * 9 / 8, CUDACachingAllocator.cpp find_expandable_block).
_ADDRESS_SPACE = 1 << 46


class ExpandableSegmentsModel(CachingAllocatorModel):
    """:class:`CachingAllocatorModel` under ``expandable_segments:True`` (same interface).

    :attr:`~CachingAllocatorModel.reserved` counts mapped pages; ``num_segments`` in
    :meth:`result` counts page mappings (``stats.num_device_alloc``).
    """

    def __init__(self, *, limit_bytes: int | None = None, config: AllocatorConfig | None = None) -> None:
        super().__init__(limit_bytes=limit_bytes, config=config)
        self._unmapped: dict[tuple[int, bool], list[int]] = {}  # (stream, small) -> sorted addresses
        self._mapped: dict[tuple[int, bool], int] = {}  # (stream, small) -> mapped bytes now

    # ----------------------------------------------------------------------------- malloc
    def malloc(self, handle: int, nbytes: int, stream: int = 0) -> bool:
        """See :meth:`CachingAllocatorModel.malloc`."""
        event = self._events
        self._events = event + 1
        if nbytes <= 0:
            if nbytes == 0:
                self._empty.add(handle)
                return True
            raise ConfigError(f"malloc of handle {handle} asked for {nbytes} bytes; sizes must be >= 0 "
                              "(use free() to release a block)")
        if handle in self._live:
            raise ConfigError(f"handle {handle} is allocated twice without a free in between; every "
                              "allocation event needs a handle that is not live")
        size = round_size(nbytes, self._config)
        small = size <= SMALL_SIZE  # CUDACachingAllocator.cpp get_pool: size <= kSmallSize
        pools = self._pools.get(stream)
        if pools is None:
            pools = self._pools[stream] = ([], [])
        free_list = pools[0] if small else pools[1]
        addr = self._free_block(free_list, size)
        if addr is None:
            limit = self._limit
            # alloc_block: set_fraction && total_allocated_memory + alloc_size > allowed -> fail, then
            # release_cached_blocks and retry (malloc)
            if limit is not None and self._reserved + segment_size(size, self._config) > limit:
                self._release_cached_blocks()
                if self._reserved + segment_size(size, self._config) > limit:
                    if not self._oom:
                        self._oom = True
                        self._oom_request = nbytes
                    return False
            addr = self._grow(free_list, size, stream, small, event)
        blk = self._blocks[addr]
        remaining = blk[_SIZE] - size
        # should_split: with expandable segments, remaining >= kMinBlockSize in both pools
        if remaining >= MIN_BLOCK_SIZE:
            rest = addr + size
            nxt = blk[_NEXT]
            self._blocks[rest] = [remaining, addr, nxt, small, False, stream]
            if nxt is not None:
                self._blocks[nxt][_PREV] = rest
            blk[_NEXT] = rest
            blk[_SIZE] = size
            insort(free_list, (remaining, rest))
        blk[_ALLOC] = True
        self._live[handle] = (addr, nbytes)
        self._count(blk[_SIZE], nbytes, event)
        return True

    def _free_block(self, free_list: list[tuple[int, int]], size: int) -> int | None:
        """``get_free_block``: the address of the cached block that serves ``size``, taken off the list."""
        i = bisect_left(free_list, (size, -1))
        n = len(free_list)
        if i == n:
            return None
        # get_free_block: while the next block's expandable size is smaller, prefer it
        grow = self._expandable_size
        while i + 1 < n and grow(free_list[i + 1]) < grow(free_list[i]):
            i += 1
        found = free_list[i][0]
        max_split = self._max_split
        # get_free_block: the max_split_size rules, as without expandable segments
        if max_split is not None and ((size < max_split <= found) or (
                size >= max_split and found >= size + self._config.max_non_split_rounding_size)):
            return None
        return free_list.pop(i)[1]

    def _expandable_size(self, entry: tuple[int, int]) -> int:
        # get_free_block expandable_size: b->size + (b->next && !b->next->mapped ? b->next->size : 0)
        size, addr = entry
        nxt = self._blocks[addr][_NEXT]
        if nxt is not None and self._blocks[nxt][_ALLOC] is _UNMAPPED:
            return size + self._blocks[nxt][_SIZE]
        return size

    def _count(self, bsize: int, nbytes: int, event: int) -> None:
        allocated = self._allocated + bsize
        self._allocated = allocated
        if allocated > self._peak_allocated:
            self._peak_allocated = allocated
            self._peak_allocated_event = event
        if self._alloc_at_peak_reserved < 0:
            self._alloc_at_peak_reserved = allocated
        self._requested += nbytes
        if self._requested > self._peak_requested:
            self._peak_requested = self._requested

    # ----------------------------------------------------------------------------- mapping
    def _grow(self, free_list: list[tuple[int, int]], size: int, stream: int, small: bool, event: int) -> int:
        """``try_allocate_expandable_block``: map pages until a free block of ``size`` exists; its address."""
        blocks = self._blocks
        cand = self._find_expandable(stream, small, size)
        if blocks[cand][_ALLOC] is _UNMAPPED:
            cand = self._map(cand, min(blocks[cand][_SIZE], size), free_list, event)
        while blocks[cand][_SIZE] < size:
            # invariant (try_allocate_expandable_block): free -> unmapped -> *
            nxt = blocks[cand][_NEXT]
            cand = self._map(nxt, min(size - blocks[cand][_SIZE], blocks[nxt][_SIZE]), free_list, event)
        _remove(free_list, blocks[cand][_SIZE], cand)
        return cand

    def _find_expandable(self, stream: int, small: bool, size: int) -> int:
        """``find_expandable_block``: the lowest address with ``size`` free or unmapped bytes after it."""
        blocks = self._blocks
        key = (stream, small)
        for addr in self._unmapped.get(key, ()):
            prev = blocks[addr][_PREV]
            start = prev if prev is not None and blocks[prev][_ALLOC] is False else addr
            room, b = 0, start
            while room < size and b is not None and blocks[b][_ALLOC] is not True:
                room += blocks[b][_SIZE]
                b = blocks[b][_NEXT]
            if room >= size:
                return start
        # a new segment: all of its address space unmapped, page-aligned (LARGE_BUFFER is a multiple
        # of both page sizes)
        base = -(-self._next_addr // LARGE_BUFFER) * LARGE_BUFFER
        self._next_addr = base + _ADDRESS_SPACE
        blocks[base] = [_ADDRESS_SPACE, None, None, small, _UNMAPPED, stream]
        insort(self._unmapped.setdefault(key, []), base)
        self._mapped.setdefault(key, 0)
        return base

    def _map(self, addr: int, nbytes: int, free_list: list[tuple[int, int]], event: int) -> int:
        """``map_block``: back the first ``nbytes`` (rounded up to pages) of the unmapped block at ``addr``
        with memory and merge them with free neighbours; returns the address of the merged free block."""
        blocks = self._blocks
        blk = blocks[addr]
        small, stream = blk[_SMALL], blk[_STREAM]
        # ExpandableSegment::map: whole pages, segmentRight(ptr + size); pages are 2 MiB (small pool)
        # or 20 MiB (large pool), find_expandable_block's segment_size
        page = SMALL_BUFFER if small else LARGE_BUFFER
        mapped = min(-(-nbytes // page) * page, blk[_SIZE])
        unmapped = self._unmapped[(stream, small)]
        del unmapped[bisect_left(unmapped, addr)]
        if mapped < blk[_SIZE]:
            rest = addr + mapped
            nxt = blk[_NEXT]
            blocks[rest] = [blk[_SIZE] - mapped, addr, nxt, small, _UNMAPPED, stream]
            if nxt is not None:
                blocks[nxt][_PREV] = rest
            blk[_NEXT] = rest
            blk[_SIZE] = mapped
            insort(unmapped, rest)
        blk[_ALLOC] = False
        # map_block: try_merge_blocks(to_map, prev) then (to_map, next), free mapped neighbours only
        prev = blk[_PREV]
        if prev is not None and blocks[prev][_ALLOC] is False:
            _remove(free_list, blocks[prev][_SIZE], prev)
            addr = self._absorb_next(prev)
        nxt = blocks[addr][_NEXT]
        if nxt is not None and blocks[nxt][_ALLOC] is False:
            _remove(free_list, blocks[nxt][_SIZE], nxt)
            self._absorb_next(addr)
        insort(free_list, (blocks[addr][_SIZE], addr))
        self._mapped[(stream, small)] += mapped
        self._num_segments += 1  # stats.num_device_alloc++ per map
        reserved = self._reserved + mapped
        self._reserved = reserved
        if reserved > self._peak_reserved:
            self._peak_reserved = reserved
            self._peak_reserved_event = event
            self._alloc_at_peak_reserved = -1  # set once the request is counted (_count)
        return addr

    def _absorb_next(self, addr: int) -> int:
        """Merge the block after ``addr`` into it (``try_merge_blocks``); returns ``addr``."""
        blocks = self._blocks
        blk = blocks[addr]
        nxt = blk[_NEXT]
        nb = blocks.pop(nxt)
        blk[_SIZE] += nb[_SIZE]
        blk[_NEXT] = nb[_NEXT]
        if nb[_NEXT] is not None:
            blocks[nb[_NEXT]][_PREV] = addr
        return addr

    # ----------------------------------------------------------------------------- release
    def _release_cached_blocks(self) -> int:
        # release_cached_blocks -> release_blocks: unmap_block of every free block of every pool
        released = 0
        for pools in self._pools.values():
            for free_list in pools:
                for size, addr in list(free_list):
                    released += self._unmap(free_list, size, addr)
        self._reserved -= released
        return released

    def _unmap(self, free_list: list[tuple[int, int]], size: int, addr: int) -> int:
        """``unmap_block``: unmap the whole pages inside the free block at ``addr``; bytes unmapped."""
        blocks = self._blocks
        blk = blocks[addr]
        small, stream = blk[_SMALL], blk[_STREAM]
        page = SMALL_BUFFER if small else LARGE_BUFFER
        # ExpandableSegment::unmap: pages from segmentRight(ptr) to segmentLeft(ptr + size)
        begin = -(-addr // page) * page
        end = (addr + size) // page * page
        if begin >= end:
            return 0
        _remove(free_list, size, addr)
        if begin > addr:  # the part before the first whole page stays a free block
            blocks[addr] = [begin - addr, blk[_PREV], begin, small, False, stream]
            insort(free_list, (begin - addr, addr))
            prev = addr
        else:
            del blocks[addr]
            prev = blk[_PREV]
            if prev is not None:
                blocks[prev][_NEXT] = begin
        nxt = blk[_NEXT]
        if end < addr + size:  # and the part after the last whole page
            blocks[end] = [addr + size - end, begin, nxt, small, False, stream]
            if nxt is not None:
                blocks[nxt][_PREV] = end
            insort(free_list, (addr + size - end, end))
            nxt = end
        elif nxt is not None:
            blocks[nxt][_PREV] = begin
        blocks[begin] = [end - begin, prev, nxt, small, _UNMAPPED, stream]
        unmapped = self._unmapped[(stream, small)]
        # unmap_block: try_merge_blocks with unmapped neighbours
        if nxt is not None and blocks[nxt][_ALLOC] is _UNMAPPED:
            del unmapped[bisect_left(unmapped, nxt)]
            self._absorb_next(begin)
        if prev is not None and blocks[prev][_ALLOC] is _UNMAPPED:
            self._absorb_next(prev)
        else:
            insort(unmapped, begin)
        self._mapped[(stream, small)] -= end - begin
        return end - begin

    # ----------------------------------------------------------------------------- steady state
    def cache_segment(self, nbytes: int, small: bool, stream: int) -> None:
        """Map ``nbytes`` in ``stream``'s segment and leave them free, as an earlier step leaves them."""
        pools = self._pools.get(stream)
        if pools is None:
            pools = self._pools[stream] = ([], [])
        free_list = pools[0] if small else pools[1]
        addr = self._find_expandable(stream, small, nbytes)
        if self._blocks[addr][_ALLOC] is _UNMAPPED:
            self._map(addr, nbytes, free_list, -1)
        self._alloc_at_peak_reserved = self._allocated

    def side_stream_segments(self) -> list[tuple[int, int, bool]]:
        """``(stream, mapped bytes, small)`` of each side stream's segment now."""
        return [(stream, n, small) for (stream, small), n in self._mapped.items() if stream != 0 and n]


def _remove(free_list: list[tuple[int, int]], size: int, addr: int) -> None:
    del free_list[bisect_left(free_list, (size, addr))]
