"""One op's memory as the trace records it, with or without CUDA's kernel model: the test harness.

:func:`modelled_op_memory` runs one op (forward, then backward) on CPU fake tensors under the
trace's :class:`~memguard.estimator._trace.Recorder`, either through
:class:`~memguard.estimator._cuda_kernels.CudaKernelModel` (what the CUDA target's trace records
for it) or as the CPU runs it, and reports the bytes it allocates relative to its inputs
(:class:`OpMemory`). The rule tests and ``benchmarks/gpu_kernels.py`` compare it with what the
real kernels allocate. It sits above the trace and the rule registry, which never import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from memguard.estimator._cuda_kernels import CudaKernelModel, CudaTarget
from memguard.estimator._trace import Recorder, Trace, load_rules

@dataclass(frozen=True)
class OpMemory:
    """What one op (forward, then backward) allocates, as byte counts relative to its inputs.

    Attributes:
        forward_peak: most bytes live at once during the forward, above the inputs.
        forward_kept: bytes still live after the forward (outputs and what autograd saved).
        backward_peak: most bytes live at once during the backward, above the state it started in.
        backward_kept: bytes left by the backward (input gradients, minus the saved tensors freed).
        allocations: every allocation's size in order, forward then backward (model only).
    """

    forward_peak: int
    forward_kept: int
    backward_peak: int
    backward_kept: int
    allocations: tuple[int, ...] = ()


def _signed_walk(sizes: list[int]) -> tuple[int, int]:
    live = peak = 0
    for n in sizes:
        live += n
        peak = max(peak, live)
    return peak, live


def modelled_op_memory(
    op: Callable[..., torch.Tensor],
    make_inputs: Callable[[str], tuple],
    target: CudaTarget | None = None,
    *,
    kernel_model: bool = True,
    round_to: int = 1,
    cpu_target: Any = None,
) -> OpMemory:
    """Run ``op`` on CPU fake tensors, under :class:`CudaKernelModel` (or, with
    ``kernel_model=False``, as the CPU runs it), and measure it as the trace records it.

    Args:
        op: called as ``op(*inputs)``; must return one tensor.
        make_inputs: ``make_inputs(device)`` builds the op's inputs (leaves that need gradients
            already have ``requires_grad``).
        target: the GPU modelled; the default :class:`CudaTarget`.
        round_to: round each allocation up to a multiple of this (512 matches the CUDA caching
            allocator's ``kMinBlockSize``, as ``torch.cuda.memory_allocated`` counts).
        cpu_target: with ``kernel_model=False``, replay this CPU's kernel paths
            (a :class:`~memguard.estimator._cpu_kernels.CpuTarget`), as the CPU target's trace does.

    The backward is driven by a pre-built gradient of ``op``'s output's shape (``ones``), so
    the measured bytes are the op's own.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    load_rules()
    trace = Trace()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        inputs = make_inputs("cpu")
        target = (target or CudaTarget.for_spec()) if kernel_model else None
        recorder = Recorder(trace, None if kernel_model else cpu_target, target)
        with recorder:
            for t in inputs:
                if isinstance(t, torch.Tensor):
                    recorder.register(t, "inputs")
            ctx = CudaKernelModel(target) if kernel_model else _NoMode()
            start = len(trace.events)
            with ctx:
                out = op(*inputs)
            mid = len(trace.events)
            grad = torch.ones_like(out)
            after_grad = len(trace.events)
            with ctx:
                torch.autograd.backward(out, grad)
            end = len(trace.events)
            del grad
    events = trace.events

    def rounded(n: int) -> int:
        size = -(-abs(n) // round_to) * round_to
        return size if n > 0 else -size

    fwd = [rounded(n) for _, n in events[start:mid]]
    bwd = [rounded(n) for _, n in events[after_grad:end]]
    fpeak, fkept = _signed_walk(fwd)
    bpeak, bkept = _signed_walk(bwd)
    allocs = tuple(n for n in fwd + bwd if n > 0)
    return OpMemory(fpeak, fkept, bpeak, bkept, allocs)


class _NoMode:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
