"""Trace one step for a resolved target: the :class:`~memguard.estimator.trace.TraceSpec` a target
and precision trace with (:func:`trace_spec`), and :func:`run_trace`, which picks the tracer.

For the CUDA target on a machine with a GPU the step is traced on fake CUDA tensors, and falls
back to CPU fake tensors (CUDA's autocast emulated, CUDA's kernels modelled) where that fails or no
GPU exists; the CPU target is traced on CPU fakes with its CPU's kernel paths; FSDP2 traces rank 0
of a real FSDP2 step (:mod:`memguard.estimator.fsdp2_trace`). The trace is priced into an
:class:`~memguard.Estimate` by :mod:`memguard.estimator.pricing`.
"""

from __future__ import annotations

from typing import Any

import torch

from memguard.errors import ConfigError
from memguard.estimator.trace import TraceSpec, trace_step
from memguard.vocab import precision_spec

__all__ = ["trace_spec", "run_trace", "cuda_target", "fsdp2_layout"]


def fsdp2_layout(strategy: str, precision: str, zero_stage: int, world_size: int, offload: bool, device: str):
    """The :class:`~memguard.estimator.fsdp2.FSDP2Layout` of an FSDP2 target, or None for other strategies
    (the CPU target's collectives run on gloo, CUDA's on NCCL)."""
    if strategy != "fsdp2":
        return None
    from memguard.estimator.fsdp2 import FSDP2Layout

    spec = precision_spec(precision)
    return FSDP2Layout(world_size=world_size, zero_stage=zero_stage, mp_dtype=spec.autocast_dtype, offload=offload,
                       backend="gloo" if device == "cpu" else "nccl")


def trace_spec(
    *,
    device: str,
    precision: str,
    checkpoint_blocks: int = 0,
    grads_present: bool = False,
    keep_blocks: int | None = None,
    count_flops: bool = False,
    keep_outputs: bool = False,
    gpu: Any = None,
    on_gpu: bool = False,
    cpu: Any = None,
) -> TraceSpec:
    """The :class:`~memguard.estimator.trace.TraceSpec` that :func:`run_trace` traces with.

    Args:
        on_gpu: the CUDA target traced on fake CUDA tensors (a GPU is present); False traces
            the CUDA target on CPU fakes, with CUDA's autocast emulated and CUDA's kernels
            modelled for ``gpu`` (a :class:`~memguard.estimator.gpus.GPUSpec`; None = generic).
        cpu: the CPU target's :class:`~memguard.estimator.cpu_kernels.CpuTarget`; None = this host.
        The other arguments: see :func:`run_trace`.
    """
    p = precision_spec(precision)
    common = dict(
        param_dtype=p.param_dtype, autocast_dtype=p.autocast_dtype, loss_scale=p.loss_scale,
        checkpoint_blocks=checkpoint_blocks, grads_present=grads_present, keep_blocks=keep_blocks,
        count_flops=count_flops, keep_outputs=keep_outputs,
    )
    if device != "cuda":
        from memguard.estimator.cpu_kernels import CpuTarget

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
    """The :class:`~memguard.estimator.cuda_kernels.CudaTarget` of a GPU spec (None = generic):
    its compute capability and vendor, and the installed torch's version (whose kernels run)."""
    from memguard.estimator.cuda_kernels import CudaTarget
    from memguard.estimator.gpus import GENERIC

    return CudaTarget.for_spec(gpu if gpu is not None else GENERIC)


def run_trace(model, batch, *, optimizer, loss_fn, device, precision, checkpoint_blocks=0, grads_present=False,
              keep_blocks=None, count_flops=False, keep_outputs=False, gpu=None, fsdp2=None, cpu=None):
    """Trace one step for ``device`` and ``precision`` (arguments already validated).

    For the CUDA target on a machine with a GPU the step is traced on fake CUDA tensors, so
    CUDA's own autocast and kernel selection apply (nothing is allocated on the device); if that
    fails for a reason other than the model itself, it falls back to CPU fake tensors with
    CUDA's autocast emulated and CUDA's kernels modelled, as on machines without a GPU.

    Args:
        model, batch, optimizer, loss_fn: as for :func:`memguard.estimate`.
        device: ``"cuda"`` or ``"cpu"``.
        precision: a precision name (see :mod:`memguard.vocab`), as traced
            (:func:`traced_precision`).
        checkpoint_blocks: checkpoint this many repeated blocks (:data:`memguard.vocab.ALL_BLOCKS`: all).
        grads_present: gradients exist when the step starts (gradient accumulation).
        keep_blocks: keep only this many repeated blocks (the planner's probes), or None.
        count_flops: count forward and backward FLOPs.
        keep_outputs: the loop keeps the model's output alive (see :func:`memguard.estimate`).
        gpu: the CUDA target's :class:`~memguard.estimator.gpus.GPUSpec`; None = generic. Decides
            the kernels modelled on CPU fakes; ignored for ``device="cpu"``.
        fsdp2: an :class:`~memguard.estimator.fsdp2.FSDP2Layout` to trace rank 0 of an FSDP2 job
            (always on CPU fake tensors, with its mixed-precision policy in place of autocast), or None.

    Returns:
        A :class:`~memguard.estimator.trace.Trace`.

    Raises:
        ConfigError: the model, batch or loss cannot be traced.
    """
    kwargs = dict(
        device=device, precision=precision, checkpoint_blocks=checkpoint_blocks, grads_present=grads_present,
        keep_blocks=keep_blocks, count_flops=count_flops, keep_outputs=keep_outputs, gpu=gpu, cpu=cpu,
    )
    if fsdp2 is not None:
        import dataclasses

        from memguard.estimator.fsdp2_trace import trace_fsdp2_step

        spec = trace_spec(**kwargs)
        if fsdp2.mp_dtype is not None:  # the policy casts; no autocast (GradScaler's scaling stays)
            spec = dataclasses.replace(spec, autocast_dtype=None, cuda_autocast=False)
        return trace_fsdp2_step(model, batch, spec, fsdp2, optimizer=optimizer, loss_fn=loss_fn)
    if device == "cuda" and torch.cuda.is_available():
        try:
            return trace_step(model, batch, trace_spec(on_gpu=True, **kwargs), optimizer=optimizer, loss_fn=loss_fn)
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of the GPU path: use the CPU path
            import logging

            logging.getLogger("memguard").warning(
                "memguard: tracing on fake CUDA tensors failed (%s: %s); tracing on CPU fake tensors instead",
                type(exc).__name__, exc,
            )
    return trace_step(model, batch, trace_spec(**kwargs), optimizer=optimizer, loss_fn=loss_fn)
