"""The device memory of a CUDA training step: the caching allocator's replay and what lives outside it.

:func:`simulate` replays a trace's allocation events through the caching-allocator model of
:mod:`memguard.estimator._cuda_allocator` (fixed segments, the default) or
:mod:`memguard.estimator._cuda_expandable` (``expandable_segments:True``); the names of both are
re-exported here.

Outside the allocator's tensor traffic, cuBLAS workspaces are allocated through the caching
allocator (they count in ``memory_reserved``), while the CUDA context and library handles
are not (they only show in ``nvidia-smi`` / ``torch.cuda.mem_get_info``):
:func:`blas_workspace_allocations`, :func:`cublas_workspace_bytes` and
:data:`DEFAULT_CONTEXT_BYTES` give those sizes.
"""

from __future__ import annotations

import re
from typing import Iterable, Literal

from memguard.errors import ConfigError
from memguard.estimator._cuda_allocator import (  # noqa: F401  (re-exported: the allocator model's public names)
    LARGE_BUFFER, MIN_BLOCK_SIZE, MIN_LARGE_ALLOC, ROUND_LARGE, ROUNDUP_INTERVALS, SMALL_BUFFER, SMALL_SIZE,
    AllocatorConfig, AllocatorResult, CachingAllocatorModel, _MiB, allocator_config, parse_torch_version,
    round_size, segment_size,
)
from memguard.estimator._cuda_expandable import ExpandableSegmentsModel


def simulate(
    events: Iterable[tuple[int, int]], *, limit_bytes: int | None = None, config: AllocatorConfig | None = None,
    streams: "dict[int, int] | None" = None,
) -> AllocatorResult:
    """Replay allocation events through the allocator model ``config`` names (:func:`allocator_model`).

    With ``streams`` naming allocations made on side streams, the events are one step of a loop
    whose earlier steps made the same requests: the side streams' segments obtained in one replay
    are cached (reserved, free) when the step is replayed again, and the second replay is the
    result. Those segments can serve only their own stream's requests, so what the step frees on a
    side stream (FSDP2's sharded gradients, freed by ``zero_grad`` before the next forward on the
    reduce-scatter stream that allocated them, ``_fsdp_collectives.py`` ``foreach_reduce``) stays
    reserved while the default stream's peak is reached. The default stream's own state at the
    step's start is what the events themselves allocate (as without side streams).

    Args:
        events: ``(handle, nbytes)`` pairs in time order; ``nbytes > 0`` allocates that many
            bytes under ``handle``; ``nbytes < 0`` frees the block of ``handle`` (its value is
            minus the size allocated); ``nbytes == 0`` is a no-op.
        limit_bytes: cap on reserved bytes; the replay stops at the first request that cannot
            be served, and the result has ``oom=True``.
        config: ``PYTORCH_CUDA_ALLOC_CONF`` options (:func:`allocator_config`); None = defaults.
        streams: handle -> stream (a positive id) for the allocations not made on the default
            stream; None or empty: every allocation is on the default stream.

    Returns:
        The allocator statistics, see :class:`AllocatorResult`.

    Raises:
        ConfigError: an event frees a handle that is not live, frees it with a size that is not
            minus its allocated size, or allocates a handle that is already live; or
            ``limit_bytes`` is not a positive int.
    """
    if not streams:
        model = allocator_model(limit_bytes=limit_bytes, config=config)
        malloc = model.malloc
        free = model.free
        for handle, nbytes in events:
            if nbytes < 0:
                free(handle, -nbytes)
            elif not malloc(handle, nbytes):
                break
        return model.result()
    events = list(events)
    first = _replay(events, limit_bytes, config, streams, ())
    if first.result().oom:
        return first.result()
    return _replay(events, limit_bytes, config, streams, first.side_stream_segments()).result()


def allocator_model(*, limit_bytes: int | None = None, config: AllocatorConfig | None = None) -> CachingAllocatorModel:
    """The allocator model ``config`` asks for: :class:`ExpandableSegmentsModel` under
    ``expandable_segments:True``, else :class:`CachingAllocatorModel` (fixed segments)."""
    if config is not None and config.expandable_segments:
        return ExpandableSegmentsModel(limit_bytes=limit_bytes, config=config)
    return CachingAllocatorModel(limit_bytes=limit_bytes, config=config)


def _replay(events, limit_bytes, config, streams, cached) -> CachingAllocatorModel:
    model = allocator_model(limit_bytes=limit_bytes, config=config)
    for stream, nbytes, small in cached:
        model.cache_segment(nbytes, small, stream)
    malloc = model.malloc
    free = model.free
    side = streams.get
    for handle, nbytes in events:
        if nbytes < 0:
            free(handle, -nbytes)
        elif not malloc(handle, nbytes, side(handle, 0)):
            break
    return model



# ================================================================================ workspaces

#: One cuBLAS workspace exists per (cuBLAS handle, stream) pair
#: (``aten/src/ATen/cuda/CublasHandlePool.cpp``, ``cublas_handle_stream_to_workspace``), and
#: handles are per thread (``DeviceThreadHandlePool``). A training step on one stream uses two
#: threads: the Python thread runs the forward, the autograd engine's device thread runs the
#: backward, so two workspaces are allocated by the end of the first step.
BLAS_HANDLES_PER_TRAINING_STEP = 2

#: CUDA context plus cuBLAS/cuDNN handles and lazily loaded kernels, in bytes; not part of
#: ``memory_reserved``. PyTorch maintainers quote ~300 MB (pytorch/pytorch#107667) to ~400 MB
#: (pytorch/pytorch#109888) for the bare context with CUDA >= 11.7 lazy module loading, more
#: than 1 GB with eager loading; a training step adds the cuBLAS/cuDNN kernels it loads.
#: 512 MiB is a typical figure; measure the real one with
#: :func:`memguard.estimator.gpus.measure_context_bytes`.
DEFAULT_CONTEXT_BYTES = 512 * _MiB

# CublasHandlePool.cpp parseChosenWorkspaceSize: ":4096:2:16:8" default = 2 x 4096 KiB + 8 x 16 KiB.
_CUBLAS_DEFAULT = 4096 * 1024 * 2 + 16 * 1024 * 8
# CublasHandlePool.cpp parseChosenWorkspaceSize: 4096 KiB x 8 = 32 MiB on Hopper (and Blackwell).
_CUBLAS_32MB = 4096 * 8 * 1024
# CublasHandlePool.cpp parseCUDABlasLtWorkspaceSize: 1024 KiB when not unified (pytorch#73328).
_CUBLASLT_DEFAULT = 1024 * 1024
# CublasHandlePool.cpp (ROCm): hipBLAS 32 MiB default, 128 MiB for gfx94x/gfx95x.
_HIPBLAS_DEFAULT = 32 * _MiB
_HIPBLAS_GFX94 = 128 * _MiB
# CublasHandlePool.cpp (ROCm) parseCUDABlasLtWorkspaceSize: 76 MiB for hipBLASLt.
_HIPBLASLT_DEFAULT = 76 * _MiB


def _parse_workspace_config(config: str) -> int:
    # CublasHandlePool.cpp parseChosenWorkspaceSize: sum of SIZE KiB x COUNT over ":SIZE:COUNT".
    pairs = re.findall(r":([0-9]+):([0-9]+)", config)
    if not pairs:
        raise ConfigError(
            f"CUBLAS_WORKSPACE_CONFIG {config!r} has no ':SIZE:COUNT' pair; use e.g. ':4096:8'"
        )
    return sum(int(size) * 1024 * int(count) for size, count in pairs)


def blas_workspace_allocations(
    compute_capability: tuple[int, int],
    torch_version: str | None = None,
    *,
    vendor: Literal["nvidia", "amd"] = "nvidia",
    cublas_workspace_config: str | None = None,
) -> tuple[int, ...]:
    """Persistent BLAS workspaces PyTorch allocates for one (handle, stream) pair.

    They are allocated through the caching allocator on the first matmul of a handle on a
    stream and kept until ``torch._C._cuda_clearCublasWorkspaces()``, so they count in
    ``torch.cuda.memory_reserved`` and ``memory_allocated`` (pytorch/pytorch#95668 shows the
    8519680 bytes on an A10G). Feed each size to the allocator model as a never-freed
    allocation, once per handle (see :data:`BLAS_HANDLES_PER_TRAINING_STEP`): at the first
    matmul of the forward and at the first matmul of the backward.

    The defaults by version, from ``aten/src/ATen/cuda/CublasHandlePool.cpp`` and its history:

    * cuBLAS: ``:4096:2:16:8`` = 8519680 B since torch 2.0 (pytorch/pytorch#89027), 32 MiB on
      compute capability 9.x, and on 10.x / 12.x since torch 2.11 (pytorch/pytorch#175344);
      before 2.0 cuBLAS managed its workspace itself, outside the caching allocator.
    * cuBLASLt: a separate persistent 1 MiB per handle and stream in torch 2.8-2.10
      (pytorch/pytorch#156495); from 2.11 the cuBLAS workspace is reused
      (``TORCH_CUBLASLT_UNIFIED_WORKSPACE``, on by default, pytorch/pytorch#168175). Before
      2.8 the cuBLASLt workspace was a transient 1 MiB per call, not a persistent allocation.
    * ROCm: hipBLAS 32 MiB (128 MiB on gfx94x/gfx95x, compute capability 9.4/9.5) through the
      caching allocator since torch 2.6 (pytorch/pytorch#138791); hipBLASLt a separate 76 MiB
      per handle and stream since 2.8.

    Args:
        compute_capability: ``(major, minor)`` of the device.
        torch_version: torch version of the training machine; None = the installed torch.
        vendor: ``"nvidia"`` or ``"amd"`` (ROCm).
        cublas_workspace_config: the ``CUBLAS_WORKSPACE_CONFIG`` value in effect, if any
            (``":SIZE_KIB:COUNT"`` pairs); it overrides the default cuBLAS size.

    Returns:
        Sizes in allocation order: ``(cublas,)`` or ``(cublas, cublaslt)``; empty when the
        workspace is not allocated through the caching allocator.

    Raises:
        ConfigError: an unparsable ``torch_version`` or ``cublas_workspace_config``, an unknown
            ``vendor`` or a malformed ``compute_capability``.

    Known limitations:
        Version boundaries come from the merge dates of the pull requests named above and may
        be off by one release. ``CUBLASLT_WORKSPACE_SIZE`` and ``torch.backends.cuda.
        cublas_workspace_size()`` overrides are not read. Forks of torch can differ.
    """
    problems = []
    if vendor not in ("nvidia", "amd"):
        problems.append(f"vendor must be 'nvidia' or 'amd', got {vendor!r}")
    if (
        not isinstance(compute_capability, tuple)
        or len(compute_capability) != 2
        or not all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in compute_capability
        )
    ):
        problems.append(
            f"compute_capability must be a (major, minor) tuple of ints, got {compute_capability!r}"
        )
    version = (0, 0)
    try:
        version = parse_torch_version(torch_version)
    except ConfigError as exc:
        problems.extend(exc.problems)
    if problems:
        raise ConfigError(problems)
    major, minor = compute_capability

    if vendor == "amd":
        if version < (2, 6):
            return ()
        if cublas_workspace_config is not None:
            hipblas = _parse_workspace_config(cublas_workspace_config)
        else:
            hipblas = _HIPBLAS_GFX94 if (major, minor) in ((9, 4), (9, 5)) else _HIPBLAS_DEFAULT
        return (hipblas, _HIPBLASLT_DEFAULT) if version >= (2, 8) else (hipblas,)

    if version < (2, 0):
        return ()
    if cublas_workspace_config is not None:
        cublas = _parse_workspace_config(cublas_workspace_config)
    elif major == 9 or (major in (10, 12) and version >= (2, 11)):
        cublas = _CUBLAS_32MB
    else:
        cublas = _CUBLAS_DEFAULT
    if (2, 8) <= version < (2, 11):
        return (cublas, _CUBLASLT_DEFAULT)
    return (cublas,)


def cublas_workspace_bytes(
    compute_capability: tuple[int, int],
    torch_version: str | None = None,
    *,
    vendor: Literal["nvidia", "amd"] = "nvidia",
    cublas_workspace_config: str | None = None,
) -> int:
    """Bytes of persistent BLAS workspace per (handle, stream): cuBLAS plus a separate cuBLASLt one.

    The sum of :func:`blas_workspace_allocations`; see there for sources and version rules.
    These bytes are allocated through the caching allocator, so they count in
    ``torch.cuda.memory_reserved``. A training step holds
    :data:`BLAS_HANDLES_PER_TRAINING_STEP` of them.

    Examples: A100 (8, 0) with torch 2.4: 8519680; H100 (9, 0): 33554432; A100 with torch
    2.9: 8519680 + 1048576.

    Raises:
        ConfigError: see :func:`blas_workspace_allocations`.
    """
    return sum(
        blas_workspace_allocations(
            compute_capability,
            torch_version,
            vendor=vendor,
            cublas_workspace_config=cublas_workspace_config,
        )
    )


def blas_workspace_config(vendor: Literal["nvidia", "amd"] = "nvidia") -> str | None:
    """The BLAS workspace setting in the environment, read as PyTorch reads it, or None.

    ``CUBLAS_WORKSPACE_CONFIG``; on ROCm also ``HIPBLAS_WORKSPACE_CONFIG`` and then
    ``ROCBLAS_WORKSPACE_CONFIG`` (aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize).
    """
    import os

    names = ["CUBLAS_WORKSPACE_CONFIG"] + (["HIPBLAS_WORKSPACE_CONFIG", "ROCBLAS_WORKSPACE_CONFIG"] if vendor == "amd" else [])
    return next((os.environ[n] for n in names if os.environ.get(n)), None)
