"""``memguard.estimate``: the peak memory of one training step, without a GPU."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from memguard.batch import first_dim
from memguard.errors import ConfigError
from memguard.estimator.analysis import scaled_events, scan
from memguard.estimator.result import Estimate
from memguard.estimator.sharding import model_state_factors
from memguard.estimator.trace import TraceSpec, trace_step
from memguard.estimator.cuda import ROUND_LARGE
from memguard.vocab import ALL_BLOCKS, PRECISIONS, Device, Precision, precision_spec, round_up

__all__ = [
    "estimate",
    "evaluate",
    "run_trace",
    "trace_spec",
    "Precision",
    "Device",
    "PRECISIONS",
    "check_common",
    "traced_precision",
    "unwrap_model",
    "STRATEGIES",
    "check_strategy",
    "resolve_strategy",
]

#: The data-parallel strategies memguard estimates: DDP (no sharding), DeepSpeed ZeRO, FSDP2.
STRATEGIES: tuple[str, ...] = ("ddp", "deepspeed", "fsdp2")


def check_strategy(*, strategy: Any, zero_stage: Any, offload_optimizer: Any = False, problems: list[str]) -> None:
    """Append a sentence to ``problems`` for each invalid combination of ``strategy`` and its options.

    ``strategy=None`` is today's meaning (DDP, or DeepSpeed when ``zero_stage >= 1``); "ddp" means
    no sharding (``zero_stage=0``); "deepspeed" needs a ZeRO stage >= 1; "fsdp2" takes
    ``zero_stage`` as its sharding level 1-3.
    """
    stage_ok = isinstance(zero_stage, int) and not isinstance(zero_stage, bool) and 0 <= zero_stage <= 3
    if strategy is not None and strategy not in STRATEGIES:
        problems.append(f"strategy={strategy!r} is not one of None, {', '.join(map(repr, STRATEGIES))}")
        return
    if strategy == "ddp":
        if stage_ok and zero_stage != 0:
            problems.append(f"strategy='ddp' does not shard: zero_stage={zero_stage} needs strategy='deepspeed' "
                            "or 'fsdp2' (or pass zero_stage=0)")
        if offload_optimizer:
            problems.append("strategy='ddp' cannot offload the optimizer: use strategy='deepspeed' with "
                            "zero_stage >= 1, or 'fsdp2' (CPUOffloadPolicy)")
    elif strategy == "deepspeed":
        if stage_ok and zero_stage == 0:
            problems.append("strategy='deepspeed' needs zero_stage 1, 2 or 3 (ZeRO off is strategy='ddp')")
    elif strategy == "fsdp2":
        if stage_ok and zero_stage == 0:
            problems.append("strategy='fsdp2' needs zero_stage 1, 2 or 3 (its sharding level: 3 = "
                            "reshard_after_forward=True, 2 = False, 1 = False with gradient sync on the last "
                            "micro-batch only); zero_stage=0 is strategy='ddp'")
        import torch.distributed as dist

        if not dist.is_available():
            problems.append("strategy='fsdp2' needs torch.distributed, which this torch build lacks")
    elif offload_optimizer and stage_ok and zero_stage == 0:
        problems.append("offload_optimizer=True needs zero_stage >= 1 (ZeRO-Offload)")


def resolve_strategy(strategy: str | None, zero_stage: int) -> str:
    """The strategy a request means: ``None`` is DDP without ZeRO, DeepSpeed with it."""
    if strategy is not None:
        return strategy
    return "deepspeed" if zero_stage >= 1 else "ddp"

def check_common(
    *, precision: Any = "32-true", zero_stage: Any = 0, world_size: Any = 1, device: Any = "cuda", problems: list[str]
) -> None:
    """Append a sentence to ``problems`` for each invalid target argument."""
    if precision not in PRECISIONS:  # full names only: an Estimate records exactly what was asked
        problems.append(f"precision={precision!r} is not one of {', '.join(PRECISIONS)}")
    if not (isinstance(zero_stage, int) and 0 <= zero_stage <= 3):
        problems.append(f"zero_stage={zero_stage!r} must be 0, 1, 2 or 3")
    if not (isinstance(world_size, int) and world_size >= 1):
        problems.append(f"world_size={world_size!r} must be an integer >= 1 (the number of data-parallel ranks)")
    if device not in ("cuda", "cpu"):
        problems.append(f"device={device!r} must be 'cuda' or 'cpu'")


def target_gpu(device: str, gpu: Any, problems: list[str]) -> Any:
    """The catalog entry the CUDA target uses (``gpu``, else the current device, else the generic one);
    None on the CPU. Problems (an unknown name, ``gpu=`` on the CPU) are appended to ``problems``."""
    if device == "cuda":
        from memguard.estimator.gpus import GENERIC, current_gpu, get_gpu

        try:
            return get_gpu(gpu) if gpu is not None else (current_gpu() or GENERIC)
        except ConfigError as exc:
            problems.extend(exc.problems)
    elif gpu is not None:
        problems.append(f"gpu={gpu!r} only applies to device='cuda'; drop it or set device='cuda'")
    return None


def target_cpu(device: str, cpu: Any, problems: list[str]):
    """The :class:`~memguard.estimator.cpu_kernels.CpuTarget` of the CPU target (``cpu`` named, or
    this host), None for the CUDA target; a bad ``cpu`` is added to ``problems``."""
    from memguard.estimator.cpu_kernels import CpuTarget

    if device != "cpu":
        if cpu is not None:
            problems.append(f"cpu={cpu!r} only applies to device='cpu'; drop it or set device='cpu'")
        return None
    return CpuTarget.named(cpu, problems)


def unwrap_model(model: Any) -> Any:
    """The model inside DistributedDataParallel, DataParallel and similar wrappers (their ``.module``),
    and inside ``torch.compile``'s ``OptimizedModule`` (its ``_orig_mod``: the eager module is traced)."""
    while isinstance(model, nn.Module):
        inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            inner = model.__dict__.get("_orig_mod") or model._modules.get("_orig_mod")
        if not isinstance(inner, nn.Module):
            return model
        model = inner
    return model


def estimate(
    model: nn.Module,
    batch: Any,
    *,
    optimizer: torch.optim.Optimizer | Callable[[Any], torch.optim.Optimizer] | None = None,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    device: Device = "cuda",
    precision: Precision = "32-true",
    zero_stage: int = 0,
    world_size: int = 1,
    gpu: str | None = None,
    activation_checkpointing: int | bool = 0,
    grad_accum_steps: int = 1,
    offload_optimizer: bool = False,
    keep_outputs: bool = False,
    train: bool = True,
    strategy: str | None = None,
    cpu: str | None = None,
) -> Estimate:
    """Predict the peak memory of one steady-state training step (or, with ``train=False``, evaluation step).

    The step is forward, loss, backward, ``optimizer.step()`` and ``zero_grad(set_to_none=True)``,
    traced on fake tensors: the model is never moved, mutated or really allocated, and the global
    RNG state is left as it was. Build large models on the ``meta`` device.

    Args:
        model: the model, on any device (``meta`` included). A DDP wrapper is unwrapped.
        batch: one example micro-batch: a tensor, or any nesting of mappings (``dict``, HF's
            ``BatchEncoding``), tuples and lists of tensors, batch dim 0 (see :mod:`memguard.batch`).
        optimizer: an optimizer instance (its class and hyperparameters are reused), a callable
            ``params -> Optimizer``, or None for ``torch.optim.AdamW``.
        loss_fn: ``loss_fn(model, batch) -> scalar``; None calls the model with the batch and uses
            ``output.loss`` or a scalar output.
        device: the target, ``"cuda"`` or ``"cpu"``.
        precision: Lightning's names: ``"32-true"``, ``"16-mixed"``, ``"bf16-mixed"``,
            ``"16-true"``, ``"bf16-true"``.
        zero_stage: the sharding level 0-3. Under DeepSpeed (``strategy=None`` or ``"deepspeed"``) the
            ZeRO stage: model states per rank follow DeepSpeed's estimators. Under ``"fsdp2"``:
            3 = ``reshard_after_forward=True``, 2 = ``False``, 1 = ``False`` with gradient sync only
            on the last micro-batch.
        world_size: data-parallel ranks (DDP gradient buckets are added when > 1 without ZeRO).
        gpu: a catalog name (see ``memguard.estimator.gpus``) for the CUDA target's constants;
            None uses the current device if there is one, else generic constants.
        activation_checkpointing: checkpoint this many of the model's repeated blocks (True: all).
        grad_accum_steps: > 1 means gradients are already allocated when a micro-batch starts.
        offload_optimizer: ZeRO-Offload: optimizer state lives in host memory. Under ``"fsdp2"``:
            ``CPUOffloadPolicy`` (sharded parameters, gradients and optimizer state on the host).
        keep_outputs: model a hand-written loop ``out = model(**batch); out.loss.backward();
            opt.step()`` whose output object stays alive through backward, the optimizer step and
            the next step's forward (on a GPT-2-style language model the logits add about a sixth
            to the peak). False models ``memguard.step``, Lightning and the HF ``Trainer``, which
            drop the output once they have the loss. The output is whatever the model (the module
            passed in) returns, captured with a forward hook, so any ``loss_fn`` works.
        train: True (default) estimates a training step. False estimates an evaluation step: the
            model in ``eval()`` mode, one forward under ``no_grad`` whose outputs are kept (the logits
            a metric needs), no backward or optimizer step; ``loss_fn`` is then
            ``fn(model, batch) -> outputs``, an ``optimizer`` means its state is resident during
            evaluation (validation inside a training run; None: parameters only), and gradients are
            not resident (``zero_grad(set_to_none=True)``). See :mod:`memguard.estimator.evaluation`.
        strategy: None (today's meaning: DDP, or DeepSpeed when ``zero_stage >= 1``), ``"ddp"``,
            ``"deepspeed"`` or ``"fsdp2"``. ``"fsdp2"`` traces rank 0 of a real FSDP2 step
            (``fully_shard`` on each repeated block, then the root) over a fake process group of
            ``world_size`` ranks (:mod:`memguard.estimator.fsdp2`); there ``*-mixed`` precisions mean
            ``MixedPrecisionPolicy(param_dtype=bf16|fp16, reduce_dtype=fp32)`` with no autocast
            (said in ``Estimate.notes``).
        cpu: for ``device="cpu"``, the CPU whose kernel paths are modelled: None or ``"host"``
            (this process's CPU at the instruction-set level its oneDNN runs, ``ONEDNN_MAX_CPU_ISA``
            included), or a level such as ``"avx2"``, ``"avx512_core"``, ``"avx512_core_bf16"``,
            ``"avx512_core_fp16"``, ``"avx512_core_amx"`` (see :mod:`memguard.estimator.cpu_kernels`:
            16-bit matmuls and convolutions take oneDNN, with its reorders and scratchpads, only
            where the CPU supports the type).

    Returns:
        An :class:`~memguard.Estimate`.

    Raises:
        ConfigError: invalid arguments (all listed at once), or a model/batch/loss that cannot be
            traced (the message says which call failed and how to pass ``loss_fn``); under
            ``"fsdp2"`` also a model FSDP2 cannot shard, or a default process group that exists
            already (plan before ``init_process_group``).

    Known limitations:
        On a machine without a GPU the CUDA target is traced on CPU fake tensors: autocast
        follows CUDA's op lists through memguard's emulation, functions with a rule in the CUDA
        kernel model (:mod:`memguard.estimator.cuda_kernels`) allocate what CUDA's kernels
        allocate for the target GPU, other functions allocate what the CPU's kernels allocate,
        and kernel-internal workspaces other than cuBLAS's are not counted. The CUDA estimate
        reads ``PYTORCH_CUDA_ALLOC_CONF`` and ``CUBLAS_WORKSPACE_CONFIG`` from the environment
        (see ``Estimate.notes``).
    """
    if train is False:
        from memguard.estimator.evaluation import estimate_eval

        if strategy not in (None, "ddp"):
            raise ConfigError(f"strategy={strategy!r} is not modelled for an evaluation step (train=False): "
                              "evaluation is estimated unsharded; drop strategy=")

        return estimate_eval(
            model, batch, fn=loss_fn, device=device, precision=precision, world_size=world_size, gpu=gpu,
            optimizer=optimizer, optimizer_state=optimizer is not None, keep_outputs=keep_outputs,
            zero_stage=zero_stage, activation_checkpointing=activation_checkpointing,
            grad_accum_steps=grad_accum_steps, offload_optimizer=offload_optimizer, cpu=cpu,
        )
    problems: list[str] = []
    if train is not True:
        problems.append(f"train={train!r} must be True (a training step) or False (an evaluation step)")
    check_common(precision=precision, zero_stage=zero_stage, world_size=world_size, device=device, problems=problems)
    if not isinstance(model, nn.Module):
        problems.append(f"model must be a torch.nn.Module, got {type(model).__name__}")
    model = unwrap_model(model)
    micro = first_dim(batch)
    if micro is None:
        problems.append(
            "batch must be a tensor or a mapping/tuple/list holding at least one tensor with a batch "
            f"dimension, got {type(batch).__name__}"
        )
    if not isinstance(keep_outputs, bool):
        problems.append(f"keep_outputs={keep_outputs!r} must be True or False")
    if isinstance(model, nn.Module) and not any(p.requires_grad for p in model.parameters()):
        problems.append("the model has no trainable parameters (every parameter has requires_grad=False)")
    if not (isinstance(grad_accum_steps, int) and grad_accum_steps >= 1):
        problems.append(f"grad_accum_steps={grad_accum_steps!r} must be an integer >= 1")
    check_strategy(strategy=strategy, zero_stage=zero_stage, offload_optimizer=offload_optimizer, problems=problems)
    spec = target_gpu(device, gpu, problems)
    cpu_target = target_cpu(device, cpu, problems)
    if problems:
        raise ConfigError(problems)

    blocks = activation_checkpointing
    if blocks is True:
        blocks = ALL_BLOCKS
    strategy = resolve_strategy(strategy, zero_stage)
    trace = run_trace(
        model, batch, optimizer=optimizer, loss_fn=loss_fn, device=device,
        precision=traced_precision(precision, zero_stage, strategy),
        checkpoint_blocks=int(blocks or 0), grads_present=grad_accum_steps > 1, keep_outputs=keep_outputs,
        gpu=spec, fsdp2=fsdp2_layout(strategy, precision, zero_stage, world_size, offload_optimizer, device),
        cpu=cpu_target,
    )
    from memguard.estimator.blocks import find_blocks

    checkpointed = min(int(blocks or 0), len(find_blocks(model)))
    est, _ = evaluate(
        trace, device=device, precision=precision, zero_stage=zero_stage, world_size=world_size, spec=spec,
        offload_optimizer=offload_optimizer, micro_batch_size=int(micro or 0), checkpointed=checkpointed,
        strategy=strategy,
    )
    return est


def fsdp2_layout(strategy: str, precision: str, zero_stage: int, world_size: int, offload: bool, device: str):
    """The :class:`~memguard.estimator.fsdp2.FSDP2Layout` of an FSDP2 target, or None for other strategies
    (the CPU target's collectives run on gloo, CUDA's on NCCL)."""
    if strategy != "fsdp2":
        return None
    from memguard.estimator.fsdp2 import FSDP2Layout

    spec = precision_spec(precision)
    return FSDP2Layout(world_size=world_size, zero_stage=zero_stage, mp_dtype=spec.autocast_dtype, offload=offload,
                       backend="gloo" if device == "cpu" else "nccl")


def traced_precision(precision: str, zero_stage: int, strategy: str | None = None) -> str:
    """The precision a step is traced in: DeepSpeed's 16-bit modes (ZeRO >= 1) keep 16-bit weights
    and use no autocast, so ``*-mixed`` under ZeRO is traced as ``*-true``. Under FSDP2 the
    precision is traced as named: the mixed-precision policy is applied by FSDP2 itself in the trace
    (fp32 sharded weights, no autocast; see :func:`fsdp2_layout`)."""
    if strategy == "fsdp2":
        return precision
    if zero_stage >= 1 and precision.endswith("-mixed"):
        return precision.replace("-mixed", "-true")
    return precision


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
        model, batch, optimizer, loss_fn: as for :func:`estimate`.
        device: ``"cuda"`` or ``"cpu"``.
        precision: a precision name (see :mod:`memguard.vocab`), as traced
            (:func:`traced_precision`).
        checkpoint_blocks: checkpoint this many repeated blocks (:data:`memguard.vocab.ALL_BLOCKS`: all).
        grads_present: gradients exist when the step starts (gradient accumulation).
        keep_blocks: keep only this many repeated blocks (the planner's probes), or None.
        count_flops: count forward and backward FLOPs.
        keep_outputs: the loop keeps the model's output alive (see :func:`estimate`).
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

        from memguard.estimator.fsdp2 import trace_fsdp2_step

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


def evaluate(trace, *, device, precision, zero_stage, world_size, spec, offload_optimizer=False,
             micro_batch_size=0, checkpointed=0, limit_bytes=None, strategy=None, zero_config=None):
    """Turn a trace into an :class:`Estimate` for one target (sharding, allocator, workspaces).

    With ``limit_bytes`` (CUDA only) the allocator model runs under that cap: like the real
    allocator it releases cached segments before failing, so ``peak_bytes`` is what
    ``max_memory_reserved`` would show on a device of that size, and an allocation that cannot
    be served even then makes ``peak_bytes`` exceed the limit.

    Under ``strategy="fsdp2"`` the trace is already one rank's (FSDP2 ran in it): nothing is
    scaled, except that ``CPUOffloadPolicy`` moves the sharded parameters, gradients, optimizer
    state and the optimizer step to the host.

    Under DeepSpeed, ``zero_config`` (the config's ``zero_optimization`` block, or the whole config)
    gives the bucket sizes the engine allocates and ZeRO-3's persistence threshold and reuse
    distance (DeepSpeed's defaults for absent keys); without it the buckets and persistent
    parameters are left out (see :func:`~memguard.estimator.sharding.model_state_factors`).

    Returns the estimate and the scaled :class:`~memguard.estimator.analysis.Timeline`.
    """
    strategy = resolve_strategy(strategy, zero_stage)
    if strategy == "fsdp2":
        from memguard.estimator.fsdp2 import fsdp2_factors

        factors = fsdp2_factors(offload_optimizer)
    else:
        factors = _zero_factors(trace, precision=precision, zero_stage=zero_stage, world_size=world_size,
                                offload_optimizer=offload_optimizer, zero_config=zero_config)
    return _evaluate(trace, factors, device=device, precision=precision, zero_stage=zero_stage,
                     world_size=world_size, spec=spec, offload_optimizer=offload_optimizer,
                     micro_batch_size=micro_batch_size, checkpointed=checkpointed, limit_bytes=limit_bytes,
                     strategy=strategy)


def _zero_factors(trace, *, precision, zero_stage, world_size, offload_optimizer, zero_config=None):
    from memguard.estimator.sharding import ZeroBuckets
    from memguard.estimator.trace import OPTIMIZER_TEMPORARIES

    totals = _category_totals(trace)
    param_sizes = [trace.sizes[h] for h, c in enumerate(trace.category) if c == "params"]
    item = trace.trainable_param_bytes / trace.num_trainable_params if trace.num_trainable_params else 4
    return model_state_factors(
        zero_stage=zero_stage,
        world_size=world_size,
        traced_params=totals.get("params", 0),
        traced_grads=totals.get("grads", 0),
        traced_optimizer=totals.get("optimizer", 0),
        num_params=trace.num_params,
        num_trainable=trace.num_trainable_params,
        largest_layer=trace.largest_layer_params,
        sixteen_bit=precision != "32-true",
        offload_optimizer=offload_optimizer,
        state_scale=2.0 if traced_precision(precision, zero_stage) != precision else 1.0,
        buckets=None if zero_config is None else ZeroBuckets.from_config(zero_config),
        traced_temporaries=totals.get(OPTIMIZER_TEMPORARIES, 0),
        largest_param_bytes=max(param_sizes, default=0),
        traced_activations=totals.get("activations", 0),
        param_numels=tuple(int(b // item) for b in param_sizes) if item else (),
        trainable_param_bytes=trace.trainable_param_bytes,
    )


def _evaluate(trace, factors, *, device, precision, zero_stage, world_size, spec, offload_optimizer,
              micro_batch_size, checkpointed, limit_bytes, strategy):
    extra = {"grads": factors.extra_grads, "params": factors.extra_params}
    timeline = _fold_optimizer_temporaries(scan(trace, factors.as_dict(), extra))
    if getattr(factors, "gathered_share", 0.0):
        timeline = _fold_gathered_params(timeline, factors.gathered_share, trace.phase_of(timeline.peak_index))
    breakdown = dict(timeline.breakdown)
    allocated_peak = timeline.peak_bytes
    context = 0
    peak = timeline.peak_bytes
    notes: tuple[str, ...] = ()
    if device == "cuda":
        constant = sum(extra.values())
        cap = None if limit_bytes is None else max(0, limit_bytes - round_up(constant, ROUND_LARGE))
        reserved, allocated_peak, workspace, notes = _cuda_reserved(trace, factors.as_dict(), spec, cap)
        reserved += round_up(constant, ROUND_LARGE)  # constant buffers: their own segments, kRoundLarge-rounded
        allocated_peak += constant
        breakdown["workspace"] = workspace
        breakdown["allocator_overhead"] = max(0, reserved - timeline.peak_bytes - workspace)
        peak = sum(breakdown.values())
        context = spec.context_bytes
    if strategy == "fsdp2":
        from memguard.estimator.fsdp2 import FSDP2_NOTE, describe_stage

        notes = notes + (FSDP2_NOTE.format(stage=zero_stage, what=describe_stage(zero_stage), world=world_size),)
    model_state = sum(breakdown.get(c, 0) for c in ("params", "grads", "optimizer"))
    est = Estimate(
        peak_bytes=int(peak),
        breakdown={k: int(v) for k, v in breakdown.items() if k},
        context_bytes=int(context),
        peak_phase=trace.phase_of(timeline.peak_index),
        allocated_peak_bytes=int(allocated_peak),
        device=device,
        precision=precision,
        zero_stage=zero_stage,
        world_size=world_size,
        gpu=spec.name if spec is not None else None,
        micro_batch_size=int(micro_batch_size),
        activation_checkpointing=checkpointed,
        offload_optimizer=offload_optimizer,
        num_params=trace.num_params,
        num_trainable_params=trace.num_trainable_params,
        model_state_bytes=int(model_state),
        phase_peaks=timeline.phase_peaks,
        notes=notes,
        strategy=strategy,
    )
    return est, timeline


def _fold_gathered_params(tl, share, peak_phase):
    """ZeRO-3: report the gathered parameters, which the scaled activations carry (see
    ``model_state_factors``), as "params", in forward and backward (where DeepSpeed gathers; the
    few activation bytes left in the optimizer step stay activations)."""
    import dataclasses

    gathering = ("forward", "backward")

    def fold(bd, phase):
        bd = dict(bd)
        if phase not in gathering:
            return bd
        moved = int(round(bd.get("activations", 0) * share))
        if moved:
            bd["activations"] -= moved
            bd["params"] = bd.get("params", 0) + moved
        return bd

    return dataclasses.replace(
        tl, breakdown=fold(tl.breakdown, peak_phase),
        phase_breakdowns={k: fold(v, k) for k, v in (tl.phase_breakdowns or {}).items()},
    )


def _fold_optimizer_temporaries(tl):
    """Report the optimizer step's temporaries as plain "temporaries" (and FSDP2's unsharded
    parameters and gradients as "params" and "grads")."""
    import dataclasses

    from memguard.estimator.fsdp2 import fold_categories
    from memguard.estimator.trace import OPTIMIZER_TEMPORARIES

    def fold(bd):
        bd = fold_categories(bd)
        extra = bd.pop(OPTIMIZER_TEMPORARIES, 0)
        if extra or "temporaries" in bd:
            bd["temporaries"] = bd.get("temporaries", 0) + extra
        return bd

    return dataclasses.replace(
        tl, breakdown=fold(tl.breakdown),
        phase_breakdowns={k: fold(v) for k, v in (tl.phase_breakdowns or {}).items()},
    )


def _cuda_reserved(trace, factors, spec, limit_bytes=None) -> tuple[int, int, int, tuple[str, ...]]:
    """Replay the (scaled) trace through the caching-allocator model.

    The BLAS workspaces (one per handle: the forward's thread and the autograd thread) already
    exist in a steady-state step; they are fed in as never-freed allocations where the forward
    starts. ``PYTORCH_CUDA_ALLOC_CONF`` and ``CUBLAS_WORKSPACE_CONFIG`` are read from the
    environment as the real allocator and cuBLAS would read them. Returns (peak reserved, peak
    allocated, workspace bytes, notes on the settings read); under ``limit_bytes``, a request that
    cannot be served reports a reserved peak just over the limit.
    """
    from memguard.estimator.cuda import (
        BLAS_HANDLES_PER_TRAINING_STEP,
        allocator_config,
        blas_workspace_allocations,
        blas_workspace_config,
        simulate,
    )

    config = allocator_config()
    ws_config = blas_workspace_config(spec.vendor)
    per_handle = [n for n in blas_workspace_allocations(spec.compute_capability, torch.__version__, vendor=spec.vendor,
                                                          cublas_workspace_config=ws_config) if n]
    notes = list(config.notes)
    if ws_config is not None:
        notes.append(f"BLAS workspace setting {ws_config!r} read: {sum(per_handle)} bytes per handle")
    sizes = [n for _ in range(BLAS_HANDLES_PER_TRAINING_STEP) for n in per_handle]
    scaled = scaled_events(trace, factors)
    forward = trace.phase_starts.get("forward", 0)
    at = sum(1 for _, n in scaled[:forward] if n)  # the forward's start once zero-size events are dropped
    events = [(h, n) for h, n in scaled if n]
    first = len(trace.sizes)
    events[at:at] = [(first + i, n) for i, n in enumerate(sizes)]
    sim = simulate(events, limit_bytes=limit_bytes, config=config)
    reserved = sim.peak_reserved
    if sim.oom:
        reserved = max(reserved, limit_bytes + sim.oom_request)
    return reserved, sim.peak_allocated, sum(sizes), tuple(notes)


def _category_totals(trace) -> dict[str, int]:
    """Largest live bytes each category reaches (params/optimizer at rest, grads after backward)."""
    live: dict[str, int] = {}
    best: dict[str, int] = {}
    for handle, nbytes in trace.events:
        c = trace.category[handle]
        live[c] = live.get(c, 0) + nbytes
        if live[c] > best.get(c, 0):
            best[c] = live[c]
    return best
