"""Recognising an out-of-memory error, and giving its memory back.

An OOM surfaces in many shapes: ``torch.OutOfMemoryError`` from the CUDA/HIP/XPU caching
allocators, a plain ``RuntimeError`` from the CPU allocator, from cuBLAS/cuDNN/MIOpen handles that
could not allocate a workspace, from a CUDA runtime call that failed with
``cudaErrorMemoryAllocation``, or from a oneDNN (MKL-DNN) primitive on the CPU.
:func:`is_oom_error` recognises all of them by type and, where the type is a generic
``RuntimeError``, by the message; a oneDNN failure, whose message does not say why it failed, counts
only when the process is also out of memory (see :func:`_onednn_out_of_memory`).

:func:`release_exception` and :func:`free_memory` are what the guard does after an OOM: drop the
local variables of the failed frames (they hold the partial autograd graph), collect reference
cycles and return cached blocks to the device. :class:`Halvings` is the one rule by which both
OOM loops (training's :class:`memguard.guard._window.MicroBatchWindow` and evaluation's
:func:`memguard.guard._evaluate.split_eval`) halve the micro-batch after one, and when they stop.
"""

from __future__ import annotations

import errno
import gc
import logging
import mmap
import re
import sys
import traceback
from dataclasses import dataclass
from types import TracebackType

import torch

logger = logging.getLogger("memguard")

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


# oneDNN's failures as PyTorch raises them. oneDNN's C++ API throws ``dnnl::error(status, message)``
# from ``error::wrap_c_api`` (include/oneapi/dnnl/dnnl_common.hpp), but ``what()`` returns the message
# alone; ideep and aten/src/ATen/native/mkldnn let it propagate, and torch's CATCH_ALL_ERRORS
# (torch/csrc/Exceptions.h) turns any std::exception into ``RuntimeError(e.what())``, so the
# ``dnnl_status_t`` (``dnnl_out_of_memory`` = 1, ``dnnl_unimplemented`` = 3, ...) never reaches
# Python. The autograd engine rethrows the same exception from backward, so the text is unchanged
# there too. Each pattern is paired with how much free memory oneDNN could have lacked when that call
# failed for memory: the failure counts as an OOM only while the process cannot map that much more.
# Observed (torch 2.13, oneDNN 3.12, tests/guard/test_onednn_oom.py): a new bfloat16 convolution under
# RLIMIT_AS 0-192 KiB above VmSize raises "could not create a primitive", forward and in backward.
_ONEDNN_SMALL = 4 << 20  # only metadata is allocated: a few KiB of descriptors, plus malloc's heap growth
_ONEDNN_LARGE = 64 << 20  # JIT code buffers (256 KiB each, growing), library scratchpads, data buffers
_ONEDNN_FAILURES = [
    # dnnl.hpp, every primitive_desc constructor (3.0-3.4: "... for a convolution forward propagation
    # primitive"; 3.5+: "... for the convolution forward propagation primitive. Run workload with ...").
    # Nearly always dnnl_unimplemented (no implementation for these shapes, data types or ISA) or
    # dnnl_invalid_arguments; dnnl_out_of_memory only when allocating the descriptor itself fails.
    (re.compile(r"could not create a primitive descriptor for (?:a|the) "), _ONEDNN_SMALL),
    # dnnl.hpp primitive::primitive(c_pd), wrapping dnnl_primitive_create (also "... from a cache
    # blob"): dnnl_out_of_memory when the library-mode scratchpad cannot be allocated
    # (src/common/primitive_iface.cpp) or a JIT kernel's first code buffer cannot be mapped
    # (Xbyak::ERR_CANT_ALLOC in src/cpu/x64/jit_generator.hpp create_kernel), but dnnl_runtime_error
    # when that buffer cannot grow while the kernel is generated (getCode() returns null), and other
    # statuses for failures that have nothing to do with memory.
    (re.compile(r"could not create a primitive(?! descriptor)"), _ONEDNN_LARGE),
    # dnnl.hpp primitive::execute, wrapping dnnl_primitive_execute (scratchpad, nested primitives).
    (re.compile(r"could not execute a primitive"), _ONEDNN_LARGE),
    # dnnl.hpp memory::memory: dnnl_memory_create_v2 allocates the buffer for DNNL_MEMORY_ALLOCATE.
    (re.compile(r"could not create a memory object"), _ONEDNN_LARGE),
    # ideep include/ideep/tensor.hpp reset_internal ("could not create a memory": dnnl_memory_create on
    # a buffer torch allocated) and dnnl.hpp memory::desc ("could not create a memory descriptor ...").
    (re.compile(r"could not create a memory(?! object)"), _ONEDNN_SMALL),
]


def _cannot_map(nbytes: int) -> bool:
    """Whether the process cannot map ``nbytes`` more of memory right now.

    The probe asks the kernel for a private, writable anonymous mapping of ``nbytes`` and unmaps it at
    once, without touching a page: the limits that refuse it are those that refused what oneDNN could
    not get
    (``RLIMIT_AS``, ``RLIMIT_DATA``, the commit limit under ``vm.overcommit_memory=2``; on Windows a
    pagefile-backed section, charged against the commit limit). Two system calls, no RAM used.

    Args:
        nbytes: how much memory to ask for.

    Returns:
        True when the mapping is refused for lack of memory; False when it succeeds, or when it fails
        for another reason (then memory is not known to be short).
    """
    try:
        if sys.platform == "win32":
            probe = mmap.mmap(-1, nbytes)
        else:
            probe = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except MemoryError:
        return True
    except OSError as e:
        # ENOMEM; on Windows ERROR_NOT_ENOUGH_MEMORY (8) or ERROR_COMMITMENT_LIMIT (1455)
        return e.errno == errno.ENOMEM or getattr(e, "winerror", None) in (8, 1455)
    except (ValueError, TypeError, AttributeError):  # no anonymous mappings here: cannot tell
        return False
    probe.close()
    return False


def _onednn_out_of_memory(message: str) -> bool:
    """Whether ``message`` is a oneDNN failure and the process is out of memory, so it is likely the cause.

    PyTorch's text of a oneDNN failure does not carry its status (see ``_ONEDNN_FAILURES``): "could not
    create a primitive" is what both a JIT code buffer that could not be mapped under a memory cap and
    an internal error look like. The failure is therefore counted as an OOM only when a probe shows
    that the process cannot map the amount of memory that call might have needed (``_cannot_map``),
    so an unsupported configuration in a process with memory to spare propagates unchanged. The probe
    runs only when a oneDNN message matched, that is, only on such an exception.
    """
    for pattern, needed in _ONEDNN_FAILURES:
        if pattern.search(message):
            return _cannot_map(needed)
    return False


def is_oom_error(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation failure that a smaller micro-batch might avoid.

    True for ``torch.OutOfMemoryError`` (CUDA, ROCm, XPU), Python's ``MemoryError``, and a
    ``RuntimeError`` whose message is one of the allocation failures of the CPU allocator, a CUDA or
    HIP runtime call, cuBLAS/hipBLAS/rocBLAS, cuDNN/MIOpen, cuSOLVER, cuSPARSE or cuFFT. A
    ``RuntimeError`` from a oneDNN primitive ("could not create a primitive", "could not execute a
    primitive", ...) counts when the process cannot map the memory that call may have needed at the
    time it is classified: its message does not say whether memory or an unsupported configuration
    was the cause. An error raised ``from`` an OOM (its ``__cause__``) counts as well.

    Args:
        exc: any exception.

    Returns:
        True when the exception is an out-of-memory error.

    Known limitations:
        Library failures are recognised by message, so a library that rewords its message is missed
        (the error then propagates unchanged, which is safe). ``CUDNN_STATUS_INTERNAL_ERROR`` without
        a sub-code is sometimes an OOM in old cuDNN versions but is not treated as one. A oneDNN
        failure is judged by the memory left when it is classified: one that needed more than 64 MiB
        (a huge library-mode scratchpad) while more was free is missed, and a oneDNN failure of
        another kind in a process that is within 64 MiB (4 MiB for a primitive descriptor) of its
        memory limit is taken for an OOM, so the guard retries it with smaller micro-batches. Only
        host memory is probed: a oneDNN failure on an XPU device is not recognised. In oneDNN 3.12
        and earlier, a thread on which a JIT code buffer could not be mapped fails every later new
        JIT primitive with "could not create a primitive", whatever memory is free (Xbyak's
        thread-local error is never cleared; oneDNN PR #5907 fixes it): the guard therefore turns
        oneDNN off before it retries (:func:`turn_off_onednn_after`).
    """
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
            return True
        if isinstance(e, RuntimeError):
            message = str(e)
            if _OOM_MESSAGES.search(message) or _onednn_out_of_memory(message):
                return True
        e = e.__cause__
    return False


def _onednn_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it was raised from) is one of oneDNN's failures (``_ONEDNN_FAILURES``)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, RuntimeError) and any(p.search(str(e)) for p, _ in _ONEDNN_FAILURES):
            return True
        e = e.__cause__
    return False


def turn_off_onednn_after(exc: BaseException) -> bool:
    """After an OOM inside oneDNN, run the rest of the process on ATen's own CPU kernels.

    When oneDNN cannot map a JIT code buffer, Xbyak records the error in a thread-local flag that
    oneDNN 3.12 and earlier never clear (fixed upstream by oneDNN PR #5907): every later *new*
    primitive on that thread fails with "could not create a primitive", whatever memory is free, so
    a retry at a smaller micro-batch (new shapes, new primitives) would fail the same way. Turning
    ``torch.backends.mkldnn`` off makes every op take ATen's kernels, which generate no code; the
    CPU target's estimates follow (:class:`memguard.estimator._cpu_kernels.CpuTarget` reads the
    flag). Logged at WARNING, once.

    Args:
        exc: an error the guard has recognised as an OOM (:func:`is_oom_error`).

    Returns:
        True when oneDNN was on and is now off.
    """
    if not torch.backends.mkldnn.enabled or not _onednn_failure(exc):
        return False
    torch.backends.mkldnn.enabled = False
    logger.warning(
        "oneDNN could not build a CPU kernel for lack of memory (%s); oneDNN cannot build kernels on this "
        "thread again (a sticky JIT error, fixed after oneDNN 3.12), so memguard turned torch.backends.mkldnn "
        "off for the rest of this process: ATen's own CPU kernels run from now on (slower for 16-bit matmuls "
        "and convolutions), and memguard's CPU estimates follow them", oom_summary(exc))
    return True


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


def released_oom(exc: BaseException) -> str:
    """The one-line summary of an OOM, once the memory its traceback holds is released; any other error
    is raised again.

    For ``except Exception as exc: summary = released_oom(exc)``, where only an OOM is handled.
    """
    if not is_oom_error(exc):
        raise exc
    summary = oom_summary(exc)
    release_exception(exc)
    return summary


def free_memory() -> None:
    """Collect reference cycles and, when CUDA is initialised, return cached blocks to the driver."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@dataclass
class Halvings:
    """The halvings of one OOM loop (one training window, one evaluation call) and when they stop.

    After an OOM at ``failed`` samples the next micro-batch is ``failed // 2``, unless halving cannot
    help: one sample does not split, and at most ``max_retries`` halvings run (None: no limit).

    Attributes:
        max_retries: the most halvings (None: until one sample fails).
        done: halvings so far.
    """

    max_retries: int | None
    done: int = 0

    def stop(self, failed: int) -> str | None:
        """Why an OOM at ``failed`` samples ends the loop: ``"one sample"``, ``"max_retries"``, or None (halve)."""
        if failed <= 1:
            return "one sample"
        if self.max_retries is not None and self.done >= self.max_retries:
            return "max_retries"
        return None

    def halve(self, failed: int) -> int:
        """Count one halving; the micro-batch after an OOM at ``failed`` samples (at least 2)."""
        self.done += 1
        return failed // 2
