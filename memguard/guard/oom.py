"""Recognising an out-of-memory error, and giving its memory back.

An OOM surfaces in many shapes: ``torch.OutOfMemoryError`` from the CUDA/HIP/XPU caching
allocators, a plain ``RuntimeError`` from the CPU allocator, from cuBLAS/cuDNN/MIOpen handles that
could not allocate a workspace, or from a CUDA runtime call that failed with
``cudaErrorMemoryAllocation``. :func:`is_oom_error` recognises all of them by type and, where the
type is a generic ``RuntimeError``, by the message.

:func:`release_exception` and :func:`free_memory` are what the guard does after an OOM: drop the
local variables of the failed frames (they hold the partial autograd graph), collect reference
cycles and return cached blocks to the device.
"""

from __future__ import annotations

import gc
import re
import traceback
from types import TracebackType

import torch

__all__ = ["is_oom_error", "release_exception", "free_memory", "oom_summary"]

# Each pattern is a fragment of an error message that PyTorch or a vendor library produces when an
# allocation fails; the source of each is named on its line.
_OOM_MESSAGES = re.compile(
    "|".join(
        [
            r"\b(?:CUDA|HIP|XPU|MTIA) out of memory",  # c10 caching allocators' OutOfMemoryError text
            r"MPS backend out of memory",  # aten/src/ATen/mps/MPSAllocator.mm
            r"CUDA error: out of memory",  # C10_CUDA_CHECK of cudaErrorMemoryAllocation
            r"HIP error: out of memory",  # the same check in ROCm builds (hipified)
            r"hipErrorOutOfMemory",  # HIP runtime error name
            r"DefaultCPUAllocator: (?:can't allocate memory|not enough memory)",  # c10/core/impl/alloc_cpu.cpp
            r"CUBLAS_STATUS_ALLOC_FAILED",  # cuBLAS status enum (cublas_api.h)
            r"HIPBLAS_STATUS_ALLOC_FAILED",  # hipBLAS status enum
            r"rocblas_status_memory_error",  # rocBLAS status enum
            r"CUDNN_STATUS_ALLOC_FAILED",  # cuDNN status enum (cudnn_graph.h / cudnn.h)
            r"CUDNN_STATUS_INTERNAL_ERROR_(?:HOST|DEVICE)_ALLOCATION_FAILED",  # cuDNN 9 status sub-codes
            r"miopenStatusAllocFailed",  # MIOpen status enum (ROCm's cuDNN)
            r"CUSOLVER_STATUS_ALLOC_FAILED",  # cuSOLVER status enum
            r"CUSPARSE_STATUS_ALLOC_FAILED",  # cuSPARSE status enum
            r"CUFFT_ALLOC_FAILED",  # cuFFT result enum
        ]
    )
)


def is_oom_error(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation failure that a smaller micro-batch might avoid.

    True for ``torch.OutOfMemoryError`` (CUDA, ROCm, XPU), Python's ``MemoryError``, and a
    ``RuntimeError`` whose message is one of the allocation failures of the CPU allocator, a CUDA or
    HIP runtime call, cuBLAS/hipBLAS/rocBLAS, cuDNN/MIOpen, cuSOLVER, cuSPARSE or cuFFT. An error
    raised ``from`` an OOM (its ``__cause__``) counts as well.

    Args:
        exc: any exception.

    Returns:
        True when the exception is an out-of-memory error.

    Known limitations:
        Library failures are recognised by message, so a library that rewords its message is missed
        (the error then propagates unchanged, which is safe). ``CUDNN_STATUS_INTERNAL_ERROR`` without
        a sub-code is sometimes an OOM in old cuDNN versions but is not treated as one.
    """
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
            return True
        if isinstance(e, RuntimeError) and _OOM_MESSAGES.search(str(e)):
            return True
        e = e.__cause__
    return False


def oom_summary(exc: BaseException, limit: int = 200) -> str:
    """The first line of an OOM's message, shortened to ``limit`` characters, for log lines."""
    text = str(exc).strip().splitlines()
    first = text[0] if text else type(exc).__name__
    return first if len(first) <= limit else first[: limit - 3] + "..."


def release_exception(exc: BaseException) -> None:
    """Drop the local variables of every finished frame in ``exc``'s traceback (and its causes).

    The frames of a forward or backward that failed still hold the activations and the partial
    autograd graph through their locals; clearing them lets that memory go as soon as the exception
    itself is dropped. Frames that are still executing are left alone (``traceback.clear_frames``
    skips them).
    """
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        tb: TracebackType | None = e.__traceback__
        if tb is not None:
            traceback.clear_frames(tb)
        e = e.__cause__ or e.__context__


def free_memory() -> None:
    """Collect reference cycles and, when CUDA is initialised, return cached blocks to the driver."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
