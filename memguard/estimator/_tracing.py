"""Trace one step for a resolved target: the :class:`~memguard.estimator._trace.TraceSpec` a target
and precision trace with (:func:`trace_spec`), and :func:`run_trace`, which picks the tracer.

For the CUDA target on a machine with a GPU the step is traced on fake CUDA tensors, and falls
back to CPU fake tensors (CUDA's autocast emulated, CUDA's kernels modelled) where that fails or no
GPU exists; the CPU target is traced on CPU fakes with its CPU's kernel paths; FSDP2 traces rank 0
of a real FSDP2 step (:mod:`memguard.estimator._fsdp2_trace`). The trace is priced into an
:class:`~memguard.Estimate` by :mod:`memguard.estimator._pricing`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from memguard.errors import ConfigError
from memguard.estimator._trace import TraceSpec, trace_step
from memguard.vocab import precision_spec

def fsdp2_layout(strategy: str, precision: str, zero_stage: int, world_size: int, offload: bool, device: str):
    """The :class:`~memguard.estimator._fsdp2.FSDP2Layout` of an FSDP2 target, or None for other strategies
    (the CPU target's collectives run on gloo, CUDA's on NCCL)."""
    if strategy != "fsdp2":
        return None
    from memguard.estimator._fsdp2 import FSDP2Layout

    spec = precision_spec(precision)
    return FSDP2Layout(world_size=world_size, zero_stage=zero_stage, mp_dtype=spec.autocast_dtype, offload=offload,
                       backend="gloo" if device == "cpu" else "nccl")


def fsdp1_layout(strategy: str, precision: str, zero_stage: int, world_size: int, device: str, options=None):
    """The :class:`~memguard.estimator._fsdp1.FSDP1Layout` of an FSDP1 target (``*-mixed`` and ``*-true``
    16-bit precisions: ``MixedPrecision`` in that dtype), or None for other strategies."""
    if strategy != "fsdp1":
        return None
    from memguard.estimator._fsdp1 import fsdp1_layout as layout_of

    spec = precision_spec(precision)
    return layout_of(spec.autocast_dtype or spec.param_dtype, zero_stage, world_size, device, options)


@dataclass(frozen=True)
class TraceRequest:
    """What :func:`run_trace` traces (arguments already validated): the target's device and kernel
    models, the precision as traced, and the step's knobs.

    Attributes:
        device: ``"cuda"`` or ``"cpu"``.
        precision: a precision name (see :mod:`memguard.vocab`), as traced
            (:func:`~memguard.estimator._targets.traced_precision`).
        checkpoint_blocks: checkpoint this many repeated blocks (:data:`memguard.vocab.ALL_BLOCKS`: all).
        grads_present: gradients exist when the step starts (gradient accumulation).
        keep_blocks: keep only this many repeated blocks (the planner's probes), or None.
        count_flops: count forward and backward FLOPs.
        keep_outputs: the loop keeps the model's output alive (see :func:`memguard.estimate`).
        gpu: the CUDA target's :class:`~memguard.estimator.gpus.GPUSpec`; None = generic. Decides
            the kernels modelled on CPU fakes; ignored for ``device="cpu"``.
        cpu: the CPU target's :class:`~memguard.estimator._cpu_kernels.CpuTarget`; None = this host.
        fsdp2: an :class:`~memguard.estimator._fsdp2.FSDP2Layout` to trace rank 0 of an FSDP2 job
            (always on CPU fake tensors, with its mixed-precision policy in place of autocast), or None.
    """

    device: str
    precision: str
    checkpoint_blocks: int = 0
    grads_present: bool = False
    keep_blocks: int | None = None
    count_flops: bool = False
    keep_outputs: bool = False
    gpu: Any = None
    cpu: Any = None
    fsdp2: Any = None
    fsdp1: Any = None  # an FSDP1Layout (memguard.estimator._fsdp1): rank 0 of an FSDP1 job, as fsdp2


#: The blocks every trace in this context keeps (:func:`keeping_blocks`), or None.
_KEEP_BLOCKS: contextvars.ContextVar[int | None] = contextvars.ContextVar("memguard_keep_blocks", default=None)


@contextlib.contextmanager
def keeping_blocks(n: int) -> Iterator[None]:
    """Every step traced in this context keeps only the model's first ``n`` repeated blocks, as the
    planner's probes do (``TraceRequest.keep_blocks``), whichever public entry point traces it: the
    layout planner's short verification (:mod:`memguard.planner._layouts`) calls
    ``memguard.estimate(..., layout=...)`` so. The user's model is not touched: the trace's private
    copy leaves the other blocks out (:func:`memguard.estimator._trace._fake_model`)."""
    token = _KEEP_BLOCKS.set(n)
    try:
        yield
    finally:
        _KEEP_BLOCKS.reset(token)


def trace_spec(request: TraceRequest, *, on_gpu: bool = False) -> TraceSpec:
    """The :class:`~memguard.estimator._trace.TraceSpec` that :func:`run_trace` traces ``request`` with
    (its ``fsdp2`` aside).

    Args:
        request: what to trace.
        on_gpu: the CUDA target traced on fake CUDA tensors (a GPU is present); False traces
            the CUDA target on CPU fakes, with CUDA's autocast emulated and CUDA's kernels
            modelled for ``request.gpu`` (None = generic).
    """
    device, precision, gpu, cpu = request.device, request.precision, request.gpu, request.cpu
    p = precision_spec(precision)
    common = dict(
        param_dtype=p.param_dtype, autocast_dtype=p.autocast_dtype, loss_scale=p.loss_scale,
        checkpoint_blocks=request.checkpoint_blocks, grads_present=request.grads_present,
        keep_blocks=request.keep_blocks if request.keep_blocks is not None else _KEEP_BLOCKS.get(),
        count_flops=request.count_flops, keep_outputs=request.keep_outputs,
    )
    if device != "cuda":
        from memguard.estimator._cpu_kernels import CpuTarget

        return TraceSpec(device="cpu", cpu_target=cpu if cpu is not None else CpuTarget.host(), **common)
    if on_gpu:
        return TraceSpec(device="cuda", **common)
    return TraceSpec(
        device="cpu",
        foreach=True,  # torch.optim defaults to foreach on CUDA tensors (optim/optimizer.py _default_to_fused_or_foreach)
        cuda_autocast=True,
        cuda_target=cuda_target(gpu),
        **common,
    )


def cuda_target(gpu: Any = None):
    """The :class:`~memguard.estimator._cuda_kernels.CudaTarget` of a GPU spec (None = generic):
    its compute capability and vendor, and the installed torch's version (whose kernels run)."""
    from memguard.estimator._cuda_kernels import CudaTarget
    from memguard.estimator.gpus import GENERIC

    return CudaTarget.for_spec(gpu if gpu is not None else GENERIC)


def run_trace(model, batch, request: TraceRequest, *, optimizer, loss_fn):
    """Trace one step as ``request`` says (arguments already validated).

    For the CUDA target on a machine with a GPU the step is traced on fake CUDA tensors, so
    CUDA's own autocast and kernel selection apply (nothing is allocated on the device); if that
    fails for a reason other than the model itself, it falls back to CPU fake tensors with
    CUDA's autocast emulated and CUDA's kernels modelled, as on machines without a GPU.

    Args:
        model, batch, optimizer, loss_fn: as for :func:`memguard.estimate`.
        request: the device, precision, kernel models and knobs (:class:`TraceRequest`).

    Returns:
        A :class:`~memguard.estimator._trace.Trace`.

    Raises:
        ConfigError: the model, batch or loss cannot be traced.
    """
    from memguard.estimator._nf4 import twin_4bit_layers

    model = twin_4bit_layers(model)  # bitsandbytes' 4-bit layers are traced as their twins
    if request.fsdp1 is not None:
        from memguard.estimator._fsdp1_trace import trace_fsdp1_step

        # FSDP1's MixedPrecision casts; no autocast (Lightning's FSDPPrecision adds CUDA autocast: not modelled)
        spec = dataclasses.replace(trace_spec(request), autocast_dtype=None, cuda_autocast=False)
        return trace_fsdp1_step(model, batch, spec, request.fsdp1, optimizer=optimizer, loss_fn=loss_fn)
    fsdp2 = request.fsdp2
    if fsdp2 is not None:
        from memguard.estimator._fsdp2_trace import trace_fsdp2_step

        spec = trace_spec(request)
        if fsdp2.mp_dtype is not None:  # the policy casts; no autocast (GradScaler's scaling stays)
            spec = dataclasses.replace(spec, autocast_dtype=None, cuda_autocast=False)
        return trace_fsdp2_step(model, batch, spec, fsdp2, optimizer=optimizer, loss_fn=loss_fn)
    if request.device == "cuda" and torch.cuda.is_available():
        try:
            return trace_step(model, batch, trace_spec(request, on_gpu=True), optimizer=optimizer, loss_fn=loss_fn)
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of the GPU path: use the CPU path
            import logging

            logging.getLogger("memguard").warning(
                "memguard: tracing on fake CUDA tensors failed (%s: %s); tracing on CPU fake tensors instead",
                type(exc).__name__, exc,
            )
    return trace_step(model, batch, trace_spec(request), optimizer=optimizer, loss_fn=loss_fn)
