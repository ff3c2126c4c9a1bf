"""The rules of PyTorch's CUDA caching allocator, replayed block by block.

The estimator traces a training step on fake CPU tensors and records storage allocations and
frees in time order. :func:`memguard.estimator._cuda.simulate` replays those events through
:class:`CachingAllocatorModel`, a re-implementation of the default behaviour of
``c10/cuda/CUDACachingAllocator.cpp`` (``expandable_segments`` off; with it on,
:mod:`memguard.estimator._cuda_expandable`), and reports what ``torch.cuda.max_memory_reserved()``
and ``torch.cuda.max_memory_allocated()`` would say.

The rules reproduced (constants from ``CUDACachingAllocator.cpp``):

* every request is rounded up to a multiple of 512 B (``kMinBlockSize``), minimum 512 B;
* rounded requests of at most 1 MiB (``kSmallSize``) use the *small* pool, larger ones the
  *large* pool; a block never moves between pools;
* a request is served by the smallest cached free block of its pool that fits (ties: lowest
  address); if none fits, a new segment is obtained with ``cudaMalloc``: 2 MiB
  (``kSmallBuffer``) for the small pool, 20 MiB (``kLargeBuffer``; ``large_segment_size_mb``
  in torch 2.13) for large requests under 10 MiB (``kMinLargeAlloc``), otherwise the request
  rounded up to 2 MiB (``kRoundLarge``);
* the block found is split, the front part being handed out, when the remainder is at least
  512 B (small pool) or more than 1 MiB (large pool); otherwise the whole block is handed out
  and counts as allocated (so ``max_memory_allocated`` can exceed the rounded request);
* a freed block merges with free neighbours of its own segment; segments are never returned to
  the driver, so reserved bytes only grow;
* a block belongs to the stream it was allocated on and only serves requests of that stream
  (``BlockComparatorSize`` orders free blocks by stream first and ``get_free_block`` takes a block of
  the request's stream only); freeing it, from whichever stream, returns it to its own stream's free
  blocks (``free_block``, no ``record_stream`` events modelled). A trace with allocations on side
  streams (FSDP2's all-gather copy-in and reduce-scatter streams) is replayed for a steady-state
  step: the step after one identical step, whose side-stream segments are still cached
  (:func:`memguard.estimator._cuda.simulate`);
* with a memory cap (``limit_bytes``, what ``torch.cuda.set_per_process_memory_fraction``
  sets), a ``cudaMalloc`` that would exceed the cap first releases every cached segment that
  is entirely free (``release_cached_blocks``) and retries once; if it still does not fit,
  the allocation is an out-of-memory error.

What lives outside the allocator's tensor traffic (cuBLAS workspaces, the CUDA context) is in
:mod:`memguard.estimator._cuda`.
"""

from __future__ import annotations

import functools
import logging
import re
from bisect import bisect_left, insort
from dataclasses import dataclass

from memguard.errors import ConfigError

logger = logging.getLogger("memguard")

_MiB = 1 << 20

# c10/cuda/CUDACachingAllocator.cpp, kMinBlockSize: all sizes are rounded to at least 512 bytes.
MIN_BLOCK_SIZE = 512
# c10/cuda/CUDACachingAllocator.cpp, kSmallSize: largest "small" allocation is 1 MiB.
SMALL_SIZE = 1 * _MiB
# c10/cuda/CUDACachingAllocator.cpp, kSmallBuffer: "small" allocations are packed in 2 MiB blocks.
SMALL_BUFFER = 2 * _MiB
# CUDACachingAllocator.cpp, kLargeBuffer: "large" allocations may be packed in 20 MiB blocks.
LARGE_BUFFER = 20 * _MiB
# CUDACachingAllocator.cpp, kMinLargeAlloc: allocations between 1 and 10 MiB may use kLargeBuffer.
MIN_LARGE_ALLOC = 10 * _MiB
# c10/cuda/CUDACachingAllocator.cpp, kRoundLarge: round up large allocations to 2 MiB.
ROUND_LARGE = 2 * _MiB


def round_size(nbytes: int, config: "AllocatorConfig | None" = None) -> int:
    """Size of the block a request of ``nbytes`` occupies (``round_size`` in the allocator).

    With ``roundup_power2_divisions`` in ``config`` (``PYTORCH_CUDA_ALLOC_CONF``), sizes are
    rounded up to the next of that many equal divisions of their power-of-two interval.
    """
    if nbytes < MIN_BLOCK_SIZE:
        return MIN_BLOCK_SIZE
    divisions = config.divisions_for(nbytes) if config is not None else 0
    # CUDACachingAllocator.cpp round_size: power-2 divisions when configured and size > kMinBlockSize * divisions
    if divisions > 1 and nbytes > MIN_BLOCK_SIZE * divisions:
        return _roundup_power2_next_division(nbytes, divisions)
    # CUDACachingAllocator.cpp round_size: kMinBlockSize * ceil(size / kMinBlockSize).
    return -(-nbytes // MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE


def _roundup_power2_next_division(size: int, divisions: int) -> int:
    # CUDACachingAllocator.cpp roundup_power2_next_division: split [2^k, 2^(k+1)) into
    # `divisions` equal steps and round up to the next step (1200 with 4 divisions -> 1280).
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    rounded = size & ~(step - 1)
    return size if rounded == size else rounded + step


#: c10/core/AllocatorConfig.cpp: roundup_power2_divisions has one entry per power-of-two interval
#: from 1 MiB (kRoundUpPowerOfTwoStart) to 64 GiB (kRoundUpPowerOfTwoEnd), 16 in all.
ROUNDUP_INTERVALS = 16


@dataclass(frozen=True)
class AllocatorConfig:
    """The ``PYTORCH_CUDA_ALLOC_CONF`` options the allocator model follows.

    Attributes:
        roundup_power2_divisions: divisions per size interval (index ``i`` covers sizes in
            ``[2^i MiB, 2^(i+1) MiB)``, index 0 everything below 2 MiB, the last everything from
            32 GiB); 0 or 1 = plain 512-byte rounding (the default).
        max_split_size: blocks at least this large are never split, and requests below it never
            take one (``max_split_size_mb``); None = unlimited (the default).
        max_non_split_rounding_size: a request of at least ``max_split_size`` may take a cached
            block at most this much larger (``max_non_split_rounding_mb``; default 20 MiB, in
            torch 2.13 ``large_segment_size``).
        large_segment_size: the segment a large request under 10 MiB gets when no cached block
            fits (``large_segment_size_mb``, torch 2.13; default 20 MiB, ``kLargeBuffer``).
        expandable_segments: ``expandable_segments:True``: each stream's pool is one segment that
            maps 2 MiB (small pool) or 20 MiB (large pool) pages as it grows
            (:mod:`memguard.estimator._cuda_expandable`).
        notes: one sentence per option that was read, or set but not modelled.
    """

    roundup_power2_divisions: tuple[int, ...] = (0,) * ROUNDUP_INTERVALS
    max_split_size: int | None = None
    # c10/core/AllocatorConfig.cpp: max_non_split_rounding_size_ defaults to kLargeBuffer
    # (torch 2.13: to large_segment_size_, 20 MiB unless large_segment_size_mb is set)
    max_non_split_rounding_size: int = 20 * _MiB
    # c10/core/AllocatorConfig.h (torch 2.13): large_segment_size_{20971520}, kLargeBuffer before
    large_segment_size: int = LARGE_BUFFER
    # c10/cuda/CUDAAllocatorConfig.h: expandable_segments_ defaults to false
    expandable_segments: bool = False
    notes: tuple[str, ...] = ()

    def divisions_for(self, size: int) -> int:
        """``roundup_power2_divisions(size)`` of c10/core/AllocatorConfig.cpp."""
        # index = log2(size) - log2(1 MiB), clamped to [0, 15]
        index = min(max(size.bit_length() - 1 - 20, 0), ROUNDUP_INTERVALS - 1)
        return self.roundup_power2_divisions[index]


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def allocator_config(conf: str | None = None, torch_version: str | None = None) -> AllocatorConfig:
    """Read ``PYTORCH_CUDA_ALLOC_CONF`` the way the caching allocator of ``torch_version`` does.

    Like ``CUDAAllocatorConfig::instance()`` (c10/cuda/CUDAAllocatorConfig.h) the variable is
    ``PYTORCH_CUDA_ALLOC_CONF``, else ``PYTORCH_HIP_ALLOC_CONF`` (ROCm), else
    ``PYTORCH_ALLOC_CONF``; the options and their syntax are ``AllocatorConfig::parseArgs``'s
    (c10/core/AllocatorConfig.cpp). Modelled: ``roundup_power2_divisions`` (a number, or a list
    ``[256:1,512:2,>:4]`` of interval-in-MiB:divisions pairs; what ``>`` covers changed in torch
    2.9), ``max_split_size_mb``, ``max_non_split_rounding_mb`` and, for torch 2.13,
    ``large_segment_size_mb`` and ``expandable_segments``. Set but not modelled (said in ``notes``):
    ``garbage_collection_threshold``, a non-native ``backend`` and
    ``large_segment_size_mb`` for a torch older than 2.13.

    Args:
        conf: the option string; None reads the environment.
        torch_version: the torch of the training machine, e.g. ``"2.8.0"``; None = the installed one.

    Raises:
        ConfigError: a value the real allocator would also reject (every problem listed).
    """
    if conf is None:
        import os

        env = os.environ
        conf = env.get("PYTORCH_CUDA_ALLOC_CONF") or env.get("PYTORCH_HIP_ALLOC_CONF") or env.get("PYTORCH_ALLOC_CONF") or ""
    return _parse_allocator_config(conf, parse_torch_version(torch_version))


@functools.lru_cache(maxsize=32)
def _parse_allocator_config(conf: str, version: tuple[int, int] = (2, 13)) -> AllocatorConfig:
    text = conf.replace(" ", "")
    # the options are comma-separated key:value pairs; a list value [a:b,c:d] holds commas itself
    items = re.findall(r"([^,:\[\]]+):(\[[^\]]*\]|[^,]*)", text)
    problems: list[str] = []
    notes: list[str] = []
    divisions = [0] * ROUNDUP_INTERVALS
    max_split: int | None = None
    large_segment = LARGE_BUFFER
    expandable = False
    for key, value in items:
        if key != "large_segment_size_mb":
            continue
        if version < (2, 13):
            notes.append(f"PYTORCH_CUDA_ALLOC_CONF large_segment_size_mb:{value} is not modelled for torch "
                         f"{version[0]}.{version[1]} (it was read in torch 2.13's allocator; a torch without "
                         "it rejects the option at the first CUDA allocation): segments stay 20 MiB")
        # AllocatorConfig.cpp parseLargeSegmentSize (torch 2.13): "must be > " kMinLargeAlloc / 1 MiB = 10
        elif not value.isdigit() or int(value) <= 10:
            problems.append(f"large_segment_size_mb:{value} must be a whole number of MiB > 10 (the allocator's minimum)")
        else:
            large_segment = int(value) * _MiB
            notes.append(f"PYTORCH_CUDA_ALLOC_CONF large_segment_size_mb:{value} read: requests between 1 and "
                         f"10 MiB take {value} MiB segments")
    # torch 2.13 parses large_segment_size_mb first, wherever it stands, and then defaults
    # max_non_split_rounding_size to it and takes it as the minimum of both *_mb options below
    # (checked against the 2.13 libc10: "max_split_size_mb too small, must be >= 64" after large_segment_size_mb:64)
    non_split = large_segment
    least = large_segment // _MiB

    def mib_option(key: str, value: str) -> int | None:
        # AllocatorConfig.cpp parseMaxSplitSize / parseMaxNonSplitRoundingSize: >= kLargeBuffer / 1 MiB
        # (torch 2.13: >= large_segment_size_ / 1 MiB)
        if not value.isdigit() or int(value) < least:
            problems.append(f"{key}:{value} must be a whole number of MiB >= {least} (the allocator's minimum)")
            return None
        return int(value) * _MiB

    for key, value in items:
        if key == "max_split_size_mb":
            max_split = mib_option(key, value)
            if max_split is not None:
                notes.append(f"PYTORCH_CUDA_ALLOC_CONF max_split_size_mb:{value} read: blocks of "
                             f"{value} MiB or more are not split")
        elif key == "max_non_split_rounding_mb":
            got = mib_option(key, value)
            if got is not None:
                non_split = got
                notes.append(f"PYTORCH_CUDA_ALLOC_CONF max_non_split_rounding_mb:{value} read")
        elif key == "roundup_power2_divisions":
            if _parse_divisions(value, divisions, problems, after_last=version >= (2, 9)):
                notes.append(f"PYTORCH_CUDA_ALLOC_CONF roundup_power2_divisions:{value} read: sizes are "
                             "rounded to power-of-two divisions")
        elif key == "expandable_segments":
            # c10/core/AllocatorConfig.cpp AcceleratorAllocatorConfig::parseExpandableSegments: toBool(value)
            expandable = value in ("True", "true")
            if expandable:
                notes.append(
                    "PYTORCH_CUDA_ALLOC_CONF expandable_segments:True read: each stream's pool grows one segment "
                    "page by page (2 MiB small, 20 MiB large pages) and large blocks split down to 512 B"
                )
        elif key == "garbage_collection_threshold":
            notes.append(
                f"PYTORCH_CUDA_ALLOC_CONF garbage_collection_threshold:{value} is not modelled; it only acts "
                "under set_per_process_memory_fraction, where it can lower reserved bytes"
            )
        elif key == "backend" and value != "native":
            notes.append(
                f"PYTORCH_CUDA_ALLOC_CONF backend:{value} replaces the caching allocator; the prediction models "
                "the native one"
            )
    if problems:
        raise ConfigError([f"PYTORCH_CUDA_ALLOC_CONF={conf!r}: {p}" for p in problems])
    return AllocatorConfig(
        roundup_power2_divisions=tuple(divisions), max_split_size=max_split,
        max_non_split_rounding_size=non_split, large_segment_size=large_segment, expandable_segments=expandable,
        notes=tuple(notes),
    )


def _parse_divisions(value: str, divisions: list[int], problems: list[str], after_last: bool = True) -> bool:
    """Fill ``divisions`` from a ``roundup_power2_divisions`` value (parseRoundUpPower2Divisions);
    return False (and add a problem) when it is malformed. ``after_last``: a ``>`` entry fills the
    intervals after the last one named (torch >= 2.9), not from that one on (torch < 2.9)."""
    if not value.startswith("["):  # one number for every interval ("kept for backwards compatibility")
        if not (value.isdigit() and _power_of_two(int(value))):
            problems.append(f"roundup_power2_divisions:{value} must be a power of two")
            return False
        divisions[:] = [int(value)] * ROUNDUP_INTERVALS
        return True
    first, last = True, 0
    for pair in filter(None, value.strip("[]").split(",")):
        interval, _, count = pair.partition(":")
        if not count.isdigit() or not (int(count) == 0 or _power_of_two(int(count))):
            problems.append(f"roundup_power2_divisions entry {pair!r}: divisions must be 0 or a power of two")
            return False
        n = int(count)
        if interval == ">":
            # torch >= 2.9, c10/core/AllocatorConfig.cpp AcceleratorAllocatorConfig::
            # parseRoundUpPower2Divisions: std::fill from last_index + 1 (checked against the 2.13
            # libc10: [256:1,512:2,>:8] keeps 2 at index 9); torch < 2.9, c10/cuda/
            # CUDAAllocatorConfig.cpp: from last_index, so the last interval named takes ">"'s value
            start = last + 1 if after_last else last
            divisions[start:] = [n] * (ROUNDUP_INTERVALS - start)
            continue
        if not (interval.isdigit() and _power_of_two(int(interval))):
            problems.append(f"roundup_power2_divisions entry {pair!r}: the interval (MiB) must be a power of two")
            return False
        index = min(int(interval).bit_length() - 1, ROUNDUP_INTERVALS - 1)
        if first:  # the first entry also covers every smaller interval
            divisions[:index] = [n] * index
            first = False
        divisions[index] = n
        last = index
    return True


def segment_size(rounded: int, config: "AllocatorConfig | None" = None) -> int:
    """Bytes ``cudaMalloc`` is asked for when no cached block fits (``get_allocation_size``)."""
    if rounded <= SMALL_SIZE:
        return SMALL_BUFFER
    if rounded < MIN_LARGE_ALLOC:
        # get_allocation_size: kLargeBuffer; torch 2.13: AcceleratorAllocatorConfig::large_segment_size()
        # (as quoted from the 2.13-era CUDACachingAllocator.cpp; the CUDA source itself was not read)
        return config.large_segment_size if config is not None else LARGE_BUFFER
    return -(-rounded // ROUND_LARGE) * ROUND_LARGE


@dataclass(frozen=True)
class AllocatorResult:
    """What the caching allocator's statistics would report after replaying a trace.

    Attributes:
        peak_reserved: max over time of bytes held in segments (``torch.cuda.max_memory_reserved``).
        peak_allocated: max over time of allocated block bytes, sizes after rounding and after
            unsplit remainders (``torch.cuda.max_memory_allocated``).
        peak_requested: max over time of requested, unrounded bytes
            (``memory_stats()["requested_bytes.all.peak"]``).
        num_segments: segments ever created (``cudaMalloc`` calls).
        oom: with ``limit_bytes`` only: a request could not be served even after releasing
            every fully free cached segment.
        oom_request: requested bytes of the first request that failed (0 if none).
        allocated_at_peak_reserved: allocated block bytes at the moment reserved bytes first
            reached ``peak_reserved``; ``peak_reserved - allocated_at_peak_reserved`` is what the
            allocator held beyond live blocks at its peak.
        peak_reserved_event: index (0-based, counting every event) of the event at which
            reserved bytes first reached their peak; -1 when nothing was ever reserved.
        peak_allocated_event: index of the event at which allocated bytes first reached their
            peak; -1 when nothing was ever allocated.
        final_reserved: reserved bytes after the last event replayed.
        final_allocated: allocated bytes after the last event replayed.
        num_events: events replayed (up to and including the failed one on OOM).
    """

    peak_reserved: int
    peak_allocated: int
    peak_requested: int
    num_segments: int
    oom: bool
    oom_request: int
    allocated_at_peak_reserved: int = 0
    peak_reserved_event: int = -1
    peak_allocated_event: int = -1
    final_reserved: int = 0
    final_allocated: int = 0
    num_events: int = 0


# Fields of a block record (a list, mutated in place; one dict lookup per block access).
_SIZE, _PREV, _NEXT, _SMALL, _ALLOC, _STREAM = 0, 1, 2, 3, 4, 5


class CachingAllocatorModel:
    """Replays allocations and frees the way PyTorch's CUDA caching allocator serves them.

    Each block is a record ``[size, prev_address, next_address, is_small, allocated, stream]`` keyed
    by a virtual address; segments get increasing addresses, so "lowest address" ties break
    towards older segments. Free blocks of each pool and stream are kept in a sorted list of
    ``(size, address)`` pairs, which is the order of the allocator's ``BlockComparatorSize`` (stream,
    then size, then address).

    Args:
        limit_bytes: cap on reserved bytes, like ``torch.cuda.set_per_process_memory_fraction``;
            None means unlimited (segments are always obtained).
        config: the ``PYTORCH_CUDA_ALLOC_CONF`` options to follow (:func:`allocator_config`);
            None = the defaults.

    Raises:
        ConfigError: ``limit_bytes`` is not a positive int.

    Known limitations:
        No ``record_stream`` (a block freed while another stream still uses it is reusable at
        once), no CUDA graph pools; ``garbage_collection_threshold`` is not modelled
        (``expandable_segments`` is :class:`~memguard.estimator._cuda_expandable.ExpandableSegmentsModel`). Under a cap with ``max_split_size_mb``
        the real allocator first frees just enough oversize cached blocks
        (``release_available_cached_blocks``); the model releases every free segment at once.
        Real ``cudaMalloc`` can also fail below the cap when other processes hold memory.
    """

    def __init__(self, *, limit_bytes: int | None = None, config: AllocatorConfig | None = None) -> None:
        if limit_bytes is not None and (
            isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int) or limit_bytes <= 0
        ):
            raise ConfigError(
                f"limit_bytes must be a positive int number of bytes or None, got {limit_bytes!r}"
            )
        self._limit = limit_bytes
        self._config = config
        self._max_split = config.max_split_size if config is not None and config.max_split_size else None
        self._blocks: dict[int, list] = {}
        self._free_small: list[tuple[int, int]] = []
        self._free_large: list[tuple[int, int]] = []
        # free blocks per stream: (small pool, large pool); stream 0, the default, is the two above
        self._pools: dict[int, tuple[list[tuple[int, int]], list[tuple[int, int]]]] = {
            0: (self._free_small, self._free_large)}
        self._segments: list[tuple[int, int, bool]] = []  # (stream, bytes, small) of each cudaMalloc
        self._live: dict[int, tuple[int, int]] = {}  # handle -> (address, requested bytes)
        self._empty: set[int] = set()  # handles of zero-byte requests (nullptr, nothing to free)
        self._next_addr = 0
        self._reserved = 0
        self._allocated = 0
        self._requested = 0
        self._peak_reserved = 0
        self._peak_allocated = 0
        self._peak_requested = 0
        self._alloc_at_peak_reserved = 0
        self._peak_reserved_event = -1
        self._peak_allocated_event = -1
        self._num_segments = 0
        self._events = 0
        self._oom = False
        self._oom_request = 0

    # ----------------------------------------------------------------------------- state
    @property
    def reserved(self) -> int:
        """Bytes currently held in segments (``torch.cuda.memory_reserved``)."""
        return self._reserved

    @property
    def allocated(self) -> int:
        """Bytes of blocks currently handed out (``torch.cuda.memory_allocated``)."""
        return self._allocated

    @property
    def peak_reserved(self) -> int:
        """Max of :attr:`reserved` so far (``torch.cuda.max_memory_reserved``)."""
        return self._peak_reserved

    @property
    def peak_allocated(self) -> int:
        """Max of :attr:`allocated` so far (``torch.cuda.max_memory_allocated``)."""
        return self._peak_allocated

    @property
    def live_handles(self) -> int:
        """Number of handles currently holding a block."""
        return len(self._live)

    def result(self) -> AllocatorResult:
        """The statistics so far, as an :class:`AllocatorResult`."""
        return AllocatorResult(
            peak_reserved=self._peak_reserved,
            peak_allocated=self._peak_allocated,
            peak_requested=self._peak_requested,
            num_segments=self._num_segments,
            oom=self._oom,
            oom_request=self._oom_request,
            allocated_at_peak_reserved=self._alloc_at_peak_reserved,
            peak_reserved_event=self._peak_reserved_event,
            peak_allocated_event=self._peak_allocated_event,
            final_reserved=self._reserved,
            final_allocated=self._allocated,
            num_events=self._events,
        )

    # ----------------------------------------------------------------------------- malloc
    def malloc(self, handle: int, nbytes: int, stream: int = 0) -> bool:
        """Allocate ``nbytes`` under ``handle`` on ``stream``.

        Args:
            handle: an id for the allocation, unique among live allocations.
            nbytes: requested bytes; 0 is a no-op, as the allocator returns a null pointer.
            stream: the stream the request is made on (0: the default stream); only free blocks
                of that stream serve it.

        Returns:
            True when served; False on an out-of-memory error (only with ``limit_bytes``), in
            which case nothing is allocated under ``handle`` and :attr:`result` reports it.

        Raises:
            ConfigError: ``nbytes`` is negative, or ``handle`` already holds a live block.
        """
        event = self._events
        self._events = event + 1
        if nbytes <= 0:
            if nbytes == 0:
                self._empty.add(handle)
                return True
            raise ConfigError(
                f"malloc of handle {handle} asked for {nbytes} bytes; sizes must be >= 0 "
                "(use free() to release a block)"
            )
        if handle in self._live:
            raise ConfigError(
                f"handle {handle} is allocated twice without a free in between; every "
                "allocation event needs a handle that is not live"
            )
        if self._config is None:
            # CUDACachingAllocator.cpp round_size: multiple of kMinBlockSize, at least kMinBlockSize.
            size = -(-nbytes // MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE  # >= MIN_BLOCK_SIZE as nbytes > 0
        else:
            size = round_size(nbytes, self._config)
        small = size <= SMALL_SIZE  # CUDACachingAllocator.cpp get_pool: size <= kSmallSize
        pools = self._pools.get(stream)
        if pools is None:
            pools = self._pools[stream] = ([], [])
        free_list = pools[0] if small else pools[1]
        blocks = self._blocks
        max_split = self._max_split

        # get_free_block: lower_bound on (size, address) = smallest fitting block, lowest address.
        i = bisect_left(free_list, (size, -1))
        if i < len(free_list) and max_split is not None:
            found = free_list[i][0]
            # get_free_block: no oversize block (>= max_split_size) for a request below it, and an
            # oversize request takes a block at most max_non_split_rounding_size larger
            if (size < max_split <= found) or (
                size >= max_split and found >= size + self._config.max_non_split_rounding_size
            ):
                i = len(free_list)
        if i < len(free_list):
            bsize, addr = free_list.pop(i)
            blk = blocks[addr]
        else:
            seg = segment_size(size, self._config)
            limit = self._limit
            if limit is not None and self._reserved + seg > limit:
                # malloc: alloc_block fails -> release_cached_blocks -> alloc_block(isRetry).
                self._release_cached_blocks()
                if self._reserved + seg > limit:
                    if not self._oom:
                        self._oom = True
                        self._oom_request = nbytes
                    logger.debug(
                        "allocator model: out of memory on a %d-byte request (segment %d, "
                        "reserved %d, limit %d)", nbytes, seg, self._reserved, limit,
                    )
                    return False
            addr = self._next_addr
            self._next_addr = addr + seg
            blk = [seg, None, None, small, False, stream]
            blocks[addr] = blk
            bsize = seg
            self._num_segments += 1
            self._segments.append((stream, seg, small))
            reserved = self._reserved + seg
            self._reserved = reserved
            if reserved > self._peak_reserved:
                self._peak_reserved = reserved
                self._peak_reserved_event = event
                # allocated is updated below; remember to record it after the block is counted
                self._alloc_at_peak_reserved = -1

        remaining = bsize - size
        # CUDACachingAllocator.cpp should_split: small pool >= kMinBlockSize; large pool > kSmallSize
        # and the request below max_split_size.
        if (remaining >= MIN_BLOCK_SIZE) if small else (
            remaining > SMALL_SIZE and (max_split is None or size < max_split)
        ):
            rest = addr + size
            nxt = blk[_NEXT]
            blocks[rest] = [remaining, addr, nxt, small, False, stream]
            if nxt is not None:
                blocks[nxt][_PREV] = rest
            blk[_NEXT] = rest
            blk[_SIZE] = size
            insort(free_list, (remaining, rest))
            bsize = size
        blk[_ALLOC] = True
        self._live[handle] = (addr, nbytes)

        allocated = self._allocated + bsize
        self._allocated = allocated
        if allocated > self._peak_allocated:
            self._peak_allocated = allocated
            self._peak_allocated_event = event
        if self._alloc_at_peak_reserved < 0:
            self._alloc_at_peak_reserved = allocated
        requested = self._requested + nbytes
        self._requested = requested
        if requested > self._peak_requested:
            self._peak_requested = requested
        return True

    # ----------------------------------------------------------------------------- free
    def free(self, handle: int, nbytes: int | None = None) -> None:
        """Free the block of ``handle`` and merge it with free neighbours of its segment.

        Args:
            handle: a handle given to :meth:`malloc`.
            nbytes: if given, the size the caller believes was allocated; checked against the
                recorded request to catch inconsistent traces.

        Raises:
            ConfigError: ``handle`` holds no live block, or ``nbytes`` disagrees with the
                size it was allocated with.
        """
        self._events += 1
        live = self._live.pop(handle, None)
        if live is None:
            if handle in self._empty:
                self._empty.discard(handle)
                return
            raise ConfigError(
                f"free of handle {handle}, which holds no live allocation; every free event "
                "must follow an allocation of the same handle"
            )
        addr, requested = live
        if nbytes is not None and nbytes != requested:
            self._live[handle] = live
            raise ConfigError(
                f"free of handle {handle} says {nbytes} bytes but it was allocated with "
                f"{requested}; free events must carry minus the allocated size"
            )
        blocks = self._blocks
        blk = blocks[addr]
        self._allocated -= blk[_SIZE]
        self._requested -= requested
        blk[_ALLOC] = False
        free_list = self._pools[blk[_STREAM]][0 if blk[_SMALL] else 1]

        # free_block -> try_merge_blocks(block, prev) then (block, next).
        prev = blk[_PREV]
        if prev is not None:
            pb = blocks[prev]
            if not pb[_ALLOC]:
                _remove(free_list, pb[_SIZE], prev)
                pb[_SIZE] += blk[_SIZE]
                nxt = blk[_NEXT]
                pb[_NEXT] = nxt
                if nxt is not None:
                    blocks[nxt][_PREV] = prev
                del blocks[addr]
                addr, blk = prev, pb
        nxt = blk[_NEXT]
        if nxt is not None:
            nb = blocks[nxt]
            if not nb[_ALLOC]:
                _remove(free_list, nb[_SIZE], nxt)
                blk[_SIZE] += nb[_SIZE]
                after = nb[_NEXT]
                blk[_NEXT] = after
                if after is not None:
                    blocks[after][_PREV] = addr
                del blocks[nxt]
        insort(free_list, (blk[_SIZE], addr))

    # ----------------------------------------------------------------------------- release
    def empty_cache(self) -> int:
        """Release every cached segment that is entirely free (``torch.cuda.empty_cache``).

        Returns:
            The bytes released.
        """
        return self._release_cached_blocks()

    def _release_cached_blocks(self) -> int:
        # CUDACachingAllocator.cpp release_blocks: free every block with no prev and no next,
        # i.e. a whole segment that is not split.
        # (every stream's: release_blocks walks the whole pool)
        released = 0
        blocks = self._blocks
        for free_list in (fl for pools in self._pools.values() for fl in pools):
            kept = []
            for size, addr in free_list:
                blk = blocks[addr]
                if blk[_PREV] is None and blk[_NEXT] is None:
                    del blocks[addr]
                    released += size
                else:
                    kept.append((size, addr))
            if len(kept) != len(free_list):
                free_list[:] = kept
        self._reserved -= released
        return released

    def cache_segment(self, nbytes: int, small: bool, stream: int) -> None:
        """Add a free segment of ``nbytes`` to ``stream``'s cache, as an earlier step that obtained
        it with ``cudaMalloc`` and freed its blocks leaves it (it counts as reserved)."""
        addr = self._next_addr
        self._next_addr = addr + nbytes
        self._blocks[addr] = [nbytes, None, None, small, False, stream]
        pools = self._pools.get(stream)
        if pools is None:
            pools = self._pools[stream] = ([], [])
        insort(pools[0] if small else pools[1], (nbytes, addr))
        self._num_segments += 1
        self._segments.append((stream, nbytes, small))
        self._reserved += nbytes
        if self._reserved > self._peak_reserved:
            self._peak_reserved = self._reserved
            self._alloc_at_peak_reserved = self._allocated

    def cached_free_blocks(self) -> list[tuple[int, bool, int]]:
        """``(stream, is_small, bytes)`` of every cached free block now (mapped ones only), largest first."""
        return sorted(((stream, small, size) for stream, pools in self._pools.items()
                       for small, free_list in zip((True, False), pools) for size, _ in free_list),
                      key=lambda b: -b[2])

    def side_stream_segments(self) -> list[tuple[int, int, bool]]:
        """``(stream, bytes, small)`` of every segment obtained for a stream other than the default."""
        return [seg for seg in self._segments if seg[0] != 0]


def _remove(free_list: list[tuple[int, int]], size: int, addr: int) -> None:
    i = bisect_left(free_list, (size, addr))
    del free_list[i]



def parse_torch_version(torch_version: str | None) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string such as ``"2.5.1+cu124"``; None = the installed torch.

    Raises:
        ConfigError: not a version string.
    """
    if torch_version is None:
        import torch

        torch_version = torch.__version__
    m = re.match(r"\s*(\d+)\.(\d+)", str(torch_version))
    if m is None:
        raise ConfigError(
            f"torch_version {torch_version!r} is not a version like '2.5.1'; pass "
            "torch.__version__ of the training machine, or None for the installed torch"
        )
    return int(m.group(1)), int(m.group(2))

