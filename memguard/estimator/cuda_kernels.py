"""CUDA's kernels, modelled on CPU fake tensors: allocate what the CUDA kernel would allocate.

Without a GPU the CUDA target is traced on CPU fake tensors, and wherever CUDA and the CPU pick
different kernels (dropout masks, attention backends, ...), the trace would record the CPU's memory.
A *rule* replaces one torch function, while tracing for CUDA, by code that allocates (and saves for
backward) what CUDA's kernel allocates for the target GPU and the installed torch version; rules are
usually a ``torch.autograd.Function`` whose forward and backward create fake tensors of the sizes
the CUDA kernels create. Every rule cites the PyTorch source it follows.

:class:`CudaKernelModel` is a ``TorchFunctionMode`` that routes each registered function to its
rule; rules register themselves with :func:`cuda_rule`. :func:`modelled_op_memory` measures one op
as the trace records it, with or without the model (tests and ``benchmarks/gpu_kernels.py``).

Known limitations:
    A rule acts on the Python-level function it is registered for; code that reaches the same
    ATen op another way (C++ composites, a rule of another family that runs library code with
    the mode off) keeps the CPU's kernel. Values never matter, so rules only create tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

from memguard.estimator.cuda import parse_torch_version

__all__ = ["CudaTarget", "Rule", "cuda_rule", "CudaKernelModel", "RULES", "load_rules", "OpMemory", "modelled_op_memory"]


@dataclass(frozen=True)
class CudaTarget:
    """The GPU a trace models: what CUDA's kernel choices depend on.

    Attributes:
        capability: the compute capability ``(major, minor)``, e.g. ``(8, 0)`` for an A100.
        torch_version: the installed torch's ``(major, minor)``, whose kernels are modelled.
        vendor: ``"nvidia"`` or ``"amd"`` (ROCm builds choose other attention kernels).
        sm_count: streaming multiprocessors, where a kernel's choice depends on them (layer-norm
            weight gradients, :func:`memguard.estimator.cuda_rules.layer_norm_partial_rows`);
            None when unknown (the SM-dependent paths are then not modelled).
        conv_workspace_bytes: a bound on each cuDNN convolution workspace, or None to read
            ``CUDNN_CONV_WSCAP_DBG`` (see :func:`memguard.estimator.cuda_rules.conv_workspace_cap_bytes`).
    """

    capability: tuple[int, int] = (8, 0)
    torch_version: tuple[int, int] = (2, 13)
    vendor: str = "nvidia"
    sm_count: int | None = None
    conv_workspace_bytes: int | None = None

    @classmethod
    def for_spec(cls, spec: Any = None, **overrides: Any) -> "CudaTarget":
        """The target for a catalog GPU (``memguard.estimator.gpus.GPUSpec``, or None for the
        generic one) and the installed torch; ``overrides`` replace single fields."""
        fields: dict[str, Any] = {"torch_version": parse_torch_version(None)}
        if spec is not None:
            fields["capability"] = tuple(spec.compute_capability)
            fields["vendor"] = spec.vendor
        fields.update(overrides)
        return cls(**fields)


#: A rule: ``rule(target, func, args, kwargs) -> result`` runs instead of ``func(*args, **kwargs)``.
Rule = Callable[[CudaTarget, Callable, tuple, dict], Any]

#: The registered rules, by the torch function they replace.
RULES: dict[Callable, Rule] = {}


def cuda_rule(*funcs: Callable) -> Callable[[Rule], Rule]:
    """Register the decorated rule for each of ``funcs`` (torch functions as
    ``__torch_function__`` sees them, e.g. ``torch.nn.functional.dropout``)."""

    def register(rule: Rule) -> Rule:
        for f in funcs:
            RULES[f] = rule
        return rule

    return register


class CudaKernelModel(TorchFunctionMode):
    """Run each registered torch function through its CUDA rule.

    Inside a rule the mode is off (``TorchFunctionMode`` pops itself while handling a call), so a
    rule may call the function it replaces, or any other, without recursion.

    Args:
        target: the GPU and torch version to model.
    """

    def __init__(self, target: CudaTarget) -> None:
        super().__init__()
        self.target = target

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rule = RULES.get(func)
        if rule is not None:
            return rule(self.target, func, args, kwargs)
        return func(*args, **kwargs)



def load_rules() -> None:
    """Register every rule (importing the rule modules registers them; repeated calls are free)."""
    from memguard.estimator import cuda_attention, cuda_rules  # noqa: F401 - imported for registration


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
            (a :class:`~memguard.estimator.cpu_kernels.CpuTarget`), as the CPU target's trace does.

    The backward is driven by a pre-built gradient of ``op``'s output's shape (``ones``), so
    the measured bytes are the op's own.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memguard.estimator.trace import Trace, Recorder

    load_rules()
    trace = Trace()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        inputs = make_inputs("cpu")
        recorder = Recorder(trace, None if kernel_model else cpu_target)
        with recorder:
            for t in inputs:
                if isinstance(t, torch.Tensor):
                    recorder.register(t, "inputs")
            ctx = CudaKernelModel(target or CudaTarget.for_spec()) if kernel_model else _NoMode()
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
