"""CUDA's kernels, modelled on CPU fake tensors: allocate what the CUDA kernel would allocate.

Without a GPU the CUDA target is traced on CPU fake tensors, and wherever CUDA and the CPU pick
different kernels (dropout masks, attention backends, ...), the trace would record the CPU's memory.
A *rule* replaces one torch function, while tracing for CUDA, by code that allocates (and saves for
backward) what CUDA's kernel allocates for the target GPU and the installed torch version; rules are
usually a ``torch.autograd.Function`` whose forward and backward create fake tensors of the sizes
the CUDA kernels create. Every rule cites the PyTorch source it follows.

:class:`CudaKernelModel` is a ``TorchFunctionMode`` that routes each registered function to its
rule; rules register themselves with :func:`cuda_rule` when their modules (:mod:`~memguard.estimator._cuda_rules`,
:mod:`~memguard.estimator._cuda_attention`) are imported, which :func:`memguard.estimator._trace.load_rules`
does before a trace turns the model on. This module is the registry the rule modules import and
imports none of them; :mod:`memguard.estimator._op_memory` measures one op as the trace records it.

Known limitations:
    A rule acts on the Python-level function it is registered for; code that reaches the same
    ATen op another way (C++ composites, a rule of another family that runs library code with
    the mode off) keeps the CPU's kernel. Values never matter, so rules only create tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch.overrides import TorchFunctionMode


@dataclass(frozen=True)
class CudaTarget:
    """The GPU a trace models: what CUDA's kernel choices depend on.

    Attributes:
        capability: the compute capability ``(major, minor)``, e.g. ``(8, 0)`` for an A100.
        torch_version: the target's torch ``(major, minor)``, whose kernels are modelled (the
            trace runs the installed torch; rules that changed between releases follow this one).
        vendor: ``"nvidia"`` or ``"amd"`` (ROCm builds choose other attention kernels).
        sm_count: streaming multiprocessors (``multiProcessorCount``; AMD: compute units), where a
            kernel's choice depends on them (layer-norm weight gradients,
            :func:`memguard.estimator._cuda_rules.layer_norm_partial_rows`; a reduction's split over
            blocks, :func:`memguard.estimator._unmodelled.set_reduce_config`); None when unknown (the
            SM-dependent paths are then bounded: :mod:`memguard.estimator._unmodelled`).
        conv_workspace_bytes: a bound on each cuDNN convolution workspace, or None to read
            ``CUDNN_CONV_WSCAP_DBG`` (see :func:`memguard.estimator._cuda_rules.conv_workspace_cap_bytes`);
            it bounds ``Estimate.peak_upper_bytes`` (:func:`memguard.estimator._unmodelled.conv_workspace`).
        cuda_version: the CUDA toolkit of the target's torch build ``(major, minor)``; None on ROCm.
        cudnn_version: ``torch.backends.cudnn.version()`` of that build (e.g. 91002); None when
            unknown or on ROCm (cuDNN attention is then never chosen).
    """

    capability: tuple[int, int] = (8, 0)
    torch_version: tuple[int, int] = (2, 13)
    vendor: str = "nvidia"
    sm_count: int | None = None
    conv_workspace_bytes: int | None = None
    cuda_version: tuple[int, int] | None = None
    cudnn_version: int | None = None

    @classmethod
    def for_spec(cls, spec: Any = None, **overrides: Any) -> "CudaTarget":
        """The target for a catalog GPU (``memguard.estimator.gpus.GPUSpec``, or None for the
        generic one) and its software stack (``spec.stack``; None: the installed torch and its
        default wheel's CUDA and cuDNN, :func:`memguard.estimator._targets.stack_of`), with its
        ``sm_count`` (None for a spec without one, such as ``GENERIC`` or a user's spec made before
        the field existed); ``overrides`` replace single fields."""
        from memguard.estimator._targets import stack_of

        stack = stack_of(spec)
        fields: dict[str, Any] = {"torch_version": stack.torch, "cuda_version": stack.cuda,
                                  "cudnn_version": stack.cudnn}
        if spec is not None:
            fields["capability"] = tuple(spec.compute_capability)
            fields["vendor"] = spec.vendor
            fields["sm_count"] = getattr(spec, "sm_count", None)
        fields.update(overrides)
        return cls(**fields)


#: A rule: ``rule(target, func, args, kwargs) -> result`` runs instead of ``func(*args, **kwargs)``.
Rule = Callable[[CudaTarget, Callable, tuple, dict], Any]

#: The registered rules, by the torch function they replace.
RULES: dict[Callable, Rule] = {}

#: Functions whose CUDA kernels allocate memory no rule replays: ``finder(target, args, kwargs)`` lists
#: it (:mod:`memguard.estimator._unmodelled` registers them; :class:`CudaKernelModel` collects them).
UNMODELLED: dict[Callable, Callable[[CudaTarget, tuple, dict], list]] = {}

#: ATen ops (``torch.ops.aten.*`` overloads) whose CUDA kernels allocate memory no rule replays, seen
#: below autograd, so that the reductions a backward runs itself (a bias gradient's ``sum``) are seen
#: too: ``finder(target, op, args, kwargs, outputs)`` lists it. The trace's recorder
#: (:class:`memguard.estimator._trace.Recorder`) calls it after each such op while it traces for CUDA
#: (:mod:`memguard.estimator._unmodelled` registers them).
UNMODELLED_OPS: dict[Any, Callable[..., list]] = {}


def cuda_rule(*funcs: Callable) -> Callable[[Rule], Rule]:
    """Register the decorated rule for each of ``funcs`` (torch functions as
    ``__torch_function__`` sees them, e.g. ``torch.nn.functional.dropout``)."""

    def register(rule: Rule) -> Rule:
        for f in funcs:
            RULES[f] = rule
        return rule

    return register


#: ATen-level rules: ``op -> rule(target, args, fake_outputs, replay)``, run by the trace's recorder
#: (:class:`memguard.estimator._trace.Recorder`) after each such op on the CUDA target, to record the
#: buffers the CUDA kernel allocates and frees inside the call (a
#: :class:`memguard.estimator._cpu_kernels.Replay`), for ops that autograd calls itself (a backward's
#: ``mm``) where no torch function is there to replace.
CUDA_OP_RULES: dict[Any, Callable[..., None]] = {}


def cuda_op_rule(*ops: Any) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Register the decorated ATen-level rule for each of ``ops`` (``torch.ops.aten.*`` overloads)."""

    def register(rule: Callable[..., None]) -> Callable[..., None]:
        for op in ops:
            CUDA_OP_RULES[op] = rule
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
        self.unmodelled: list = []  # what UNMODELLED's finders reported, in call order

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        finder = UNMODELLED.get(func)
        if finder is not None:
            self.unmodelled.extend(finder(self.target, args, kwargs))
        rule = RULES.get(func)
        if rule is not None:
            return rule(self.target, func, args, kwargs)
        return func(*args, **kwargs)
