"""OOM detection: real allocator failures, and the vendor messages matched by text."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from memguard.guard._oom import Halvings, is_oom_error, oom_summary, release_exception


def _real_cpu_oom() -> BaseException:
    try:
        torch.empty(1 << 62, dtype=torch.uint8)  # 4 EiB: no machine has it, the CPU allocator really fails
    except BaseException as exc:  # noqa: BLE001 - we want whatever the allocator raised
        return exc
    raise AssertionError("allocating 4 EiB succeeded")


def test_real_cpu_allocator_failure_is_oom() -> None:
    exc = _real_cpu_oom()
    assert type(exc) is RuntimeError and "DefaultCPUAllocator" in str(exc)
    assert is_oom_error(exc)
    assert "DefaultCPUAllocator" in oom_summary(exc)


def test_real_python_memory_error_is_oom() -> None:
    with pytest.raises(MemoryError) as info:
        bytearray(1 << 62)
    assert is_oom_error(info.value)


@pytest.mark.parametrize(
    "exc, expected",
    [
        # The exception type torch raises for the CUDA/HIP/XPU caching allocators.
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
        # Older torch raised a plain RuntimeError with the allocator's text.
        (RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity)"), True),
        # ROCm builds say HIP instead of CUDA.
        (RuntimeError("HIP out of memory. Tried to allocate 1.00 GiB"), True),
        # A CUDA runtime call (not the caching allocator) failing with cudaErrorMemoryAllocation.
        (RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"), True),
        # Windows' CPU allocator wording.
        (RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 8 bytes."), True),
        # cuBLAS could not allocate its workspace (the usual text of CUDA_CHECK on cublasCreate/matmul).
        (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), True),
        # cuDNN's allocation failure, old and cuDNN 9 names.
        (RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"), True),
        (RuntimeError("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED"), True),
        # ROCm's libraries.
        (RuntimeError("hipblas error: HIPBLAS_STATUS_ALLOC_FAILED"), True),
        (RuntimeError("miopenStatusAllocFailed"), True),
        (RuntimeError("MPS backend out of memory (MPS allocated: 1.00 GB)"), True),
        # Not OOMs: a shape bug, a CUDA error of another kind, cuDNN's ambiguous internal error.
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x4)"), False),
        (RuntimeError("CUDA error: device-side assert triggered"), False),
        (RuntimeError("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR"), False),
        # The right words in a type that is not an allocation failure: user code, not the allocator.
        (ValueError("CUDA out of memory"), False),
        (KeyError("out of memory"), False),
    ],
)
def test_classification(exc: BaseException, expected: bool) -> None:
    assert is_oom_error(exc) is expected


def test_cause_chain_counts() -> None:
    oom = _real_cpu_oom()
    try:
        raise ValueError("wrapped by a framework") from oom
    except ValueError as wrapped:
        assert is_oom_error(wrapped)
    try:
        try:
            raise oom
        except RuntimeError:
            raise ValueError("handled, then another error")  # implicit __context__, not an OOM cause
    except ValueError as other:
        assert not is_oom_error(other)


def test_release_exception_frees_the_failed_frames_tensors() -> None:
    class Marker:
        pass

    def forward() -> None:
        activation = Marker()  # stands for a saved activation held by the failed frame
        ref.append(weakref.ref(activation))
        torch.empty(1 << 62, dtype=torch.uint8)

    ref: list = []
    try:
        forward()
    except RuntimeError as exc:
        kept = exc  # keep the exception alive, as a logger or a framework might
        release_exception(exc)
    gc.collect()
    assert ref[0]() is None
    assert is_oom_error(kept)


def test_both_oom_loops_halve_by_one_rule() -> None:
    halvings = Halvings(max_retries=2)
    assert halvings.stop(12) is None and halvings.halve(12) == 6
    assert halvings.stop(6) is None and halvings.halve(6) == 3
    assert halvings.stop(3) == "max_retries" and halvings.done == 2
    assert Halvings(max_retries=None).stop(1) == "one sample"
