"""Price a trace on its target: from one traced step's allocations to an :class:`~memguard.Estimate`.

:func:`estimate_from_trace` scales the trace's model states to one rank (ZeRO and DDP through
:func:`~memguard.estimator._sharding.model_state_factors`; an FSDP2 trace is one rank's already),
scans the scaled timeline for its peak (:mod:`memguard.estimator._analysis`) and, for the CUDA
target, replays it through the caching-allocator model with cuBLAS's workspaces
(:mod:`memguard.estimator._cuda`). The training estimate (:func:`memguard.estimate`), the
evaluation estimate (:mod:`memguard.estimator._eval_step`) and the planner's probes all price
their traces here.
"""

from __future__ import annotations

from memguard.estimator._analysis import Timeline, scaled_events, scan
from memguard.estimator._cuda import ROUND_LARGE
from memguard.estimator._dtypes import dtype_note
from memguard.estimator._result import Category, Estimate
from memguard.estimator._sharding import TracedStates, ZeroBuckets, ZeroSetup, model_state_factors
from memguard.estimator._targets import Target, cudnn_text, stack_of, traced_precision
from memguard.vocab import round_up

def estimate_from_trace(trace, target: Target, *, micro_batch_size=0, checkpointed=0, limit_bytes=None,
                        zero_config=None, zero_precision=None) -> tuple[Estimate, Timeline]:
    """Turn a trace into an :class:`Estimate` for one target (sharding, allocator, workspaces).

    Args:
        trace: the :class:`~memguard.estimator._trace.Trace` of one step.
        target: the :class:`~memguard.estimator._targets.Target` it is priced for.
        micro_batch_size: the traced batch's dim 0, as the estimate records it.
        checkpointed: the blocks memguard checkpointed, as the estimate records it.
        limit_bytes: see below (CUDA only).
        zero_config: see below (DeepSpeed only).

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
    parameters are left out (see :func:`~memguard.estimator._sharding.model_state_factors`).
    ``zero_precision`` (a :class:`~memguard.estimator._deepspeed_precision.ZeroPrecision`, from the
    config): bf16 masters, ``torch_autocast``'s fp32 weights and buckets, the buffers' dtypes; None:
    what ``target.precision`` means without a config (``"bf16-true"``: bf16 masters and states).

    Returns the estimate and the scaled :class:`~memguard.estimator._analysis.Timeline`.
    """
    target = target.resolved()
    if target.strategy in ("fsdp2", "fsdp1"):  # FSDP1 ran in the trace as FSDP2 does: one rank's already
        from memguard.estimator._fsdp2 import fsdp2_factors

        factors = fsdp2_factors(target.offload_optimizer)
    else:
        factors = _zero_factors(trace, target, zero_config, zero_precision)
        if factors.bucket_in_backward:
            trace = _allocate_at_phase(trace, ZERO_BUFFERS, "backward", factors.bucket_in_backward)
        if factors.partition_at_first_reduce:
            trace = _allocate_at_first_reduce(trace, factors)
        if factors.gathered_in_passes:
            trace = _allocate_at_phase(trace, ZERO_GATHERED, "forward", factors.gathered_in_passes)
            trace = _release_at_phase(trace, (ZERO_GATHERED,), "optimizer")
        if factors.release_grads_at_step:
            trace = _release_at_phase(trace, ("grads", ZERO_BUFFERS), "optimizer",
                                      allocate=factors.grads_at_end_of_backward)
    return _estimate_from_factors(trace, factors, target, micro_batch_size=micro_batch_size,
                                  checkpointed=checkpointed, limit_bytes=limit_bytes)


def _zero_factors(trace, target: Target, zero_config=None, zero_precision=None):
    from memguard.estimator._deepspeed_precision import ZeroPrecision
    from memguard.estimator._trace import OPTIMIZER_TEMPORARIES

    totals = _category_totals(trace)
    allocated = {h for h, nbytes in trace.events if nbytes > 0}
    buffer_handles = {h for h in trace.buffer_handles if h in allocated}
    buffers = sum(trace.sizes[h] for h in buffer_handles)
    param_sizes = [trace.sizes[h] for h, c in enumerate(trace.category)
                   if c == "params" and h not in buffer_handles]
    item = trace.trainable_param_bytes / trace.num_trainable_params if trace.num_trainable_params else 4
    precision, zero_stage = target.precision, target.zero_stage
    zp = zero_precision or ZeroPrecision(master_bytes=2 if precision == "bf16-true" else 4)  # to_config's mapping
    buffer_bytes = zp.buffer_bytes
    if buffer_bytes is None and zero_stage >= 1:
        # DeepSpeed casts parameters only: buffers keep the user's dtypes (engine.py _cast_module_mixed_precision)
        buffer_bytes = trace.buffer_source_bytes if buffers else 0
    traced = TracedStates(
        params=totals.get("params", 0),
        grads=totals.get("grads", 0),
        optimizer=totals.get("optimizer", 0),
        num_params=trace.num_params,
        num_trainable=trace.num_trainable_params,
        largest_layer=trace.largest_layer_params,
        temporaries=totals.get(OPTIMIZER_TEMPORARIES, 0),
        largest_param_bytes=max(param_sizes, default=0),
        activations=totals.get("activations", 0),
        param_numels=tuple(int(b // item) for b in param_sizes) if item else (),
        trainable_param_bytes=trace.trainable_param_bytes,
        buffers=buffers,
        grads_at_start=any(trace.category[h] == "grads" and nbytes > 0
                           for h, nbytes in trace.events[:trace.phase_starts.get("forward", 0)]),
    )
    setup = ZeroSetup(
        zero_stage=zero_stage,
        world_size=target.world_size,
        sixteen_bit=precision != "32-true" and not zp.autocast,  # torch_autocast keeps fp32 weights
        offload_optimizer=target.offload_optimizer,
        state_scale=2.0 if traced_precision(precision, zero_stage) != precision and not zp.autocast else 1.0,
        buckets=None if zero_config is None else ZeroBuckets.from_config(zero_config),
        gloo=target.device == "cpu",  # torch.distributed's CPU backend
        master_bytes=zp.master_bytes,
        comm_dtype_bytes=zp.comm_dtype_bytes,
        buffer_bytes=buffer_bytes,
    )
    return model_state_factors(traced, setup)


def _allocate_at_first_reduce(trace, factors):
    """A copy of ``trace`` with ZeRO-2's partition block (:data:`ZERO_BUFFERS`) allocated right after
    the backward gradient that overflows the reduce bucket: DeepSpeed's hook for it reduces the bucket
    (reduce_independent_p_g_buckets_and_remove_grads: ``bucket.elements + param.numel() >
    self.reduce_bucket_size``) and copy_grads_in_partition allocates the partition."""
    import dataclasses

    start = trace.phase_starts.get("backward")
    end = trace.phase_starts.get("optimizer", len(trace.events))
    if start is None:
        return trace
    item = trace.trainable_param_bytes / trace.num_trainable_params if trace.num_trainable_params else 4
    elements, at, count = 0, None, 0
    for i in range(start, end):
        handle, nbytes = trace.events[i]
        if nbytes > 0 and trace.category[handle] == "grads":
            numel = int(nbytes // item)
            if count and elements + numel > factors.first_reduce_elements:
                at = i + 1
                break
            elements += numel
            count += 1
    if at is None:
        return trace
    handle = len(trace.sizes)
    nbytes = factors.partition_at_first_reduce
    return dataclasses.replace(
        trace, events=trace.events[:at] + [(handle, nbytes)] + trace.events[at:],
        sizes=trace.sizes + [nbytes], category=trace.category + [ZERO_BUFFERS],
        phase_starts={k: v + (1 if v >= at else 0) for k, v in trace.phase_starts.items()})


#: The category of the blocks put into a trace for DeepSpeed's own buffers (unscaled; reported as grads).
ZERO_BUFFERS = "zero_buffers"
#: ZeRO-3's gathered parameters put into a trace (unscaled; reported as params).
ZERO_GATHERED = "zero_gathered"


def _allocate_at_phase(trace, category: str, phase: str, nbytes: int, *, end_of_previous: bool = False):
    """A copy of ``trace`` with one more ``category`` block of ``nbytes`` allocated where ``phase``
    begins (``end_of_previous``: as the last event of the phase before it); never freed unless a
    later :func:`_release_at_phase` frees it."""
    import dataclasses

    at = trace.phase_starts.get(phase)
    if at is None or nbytes <= 0:
        return trace
    handle = len(trace.sizes)
    return dataclasses.replace(
        trace, events=trace.events[:at] + [(handle, nbytes)] + trace.events[at:],
        sizes=trace.sizes + [nbytes], category=trace.category + [category],
        phase_starts={k: v + (1 if v > at or (end_of_previous and v == at) else 0)
                      for k, v in trace.phase_starts.items()})


def _release_at_phase(trace, categories: tuple[str, ...], phase: str, allocate: int = 0):
    """A copy of ``trace`` whose blocks of ``categories`` live when ``phase`` begins are freed right
    there (their later frees dropped): DeepSpeed ZeRO-1/2 frees the module's gradients and its
    buckets before its optimizer step runs (see ``model_state_factors``). ``allocate``: bytes of one
    more :data:`ZERO_BUFFERS` block allocated just before (ZeRO-1's partition copy, made when backward
    ends), freed with the others."""
    import dataclasses

    at = trace.phase_starts.get(phase)
    if at is None:
        return trace
    if allocate > 0:
        trace = _allocate_at_phase(trace, ZERO_BUFFERS, phase, allocate, end_of_previous=True)
        at += 1
    live: dict[int, int] = {}
    for handle, nbytes in trace.events[:at]:
        if trace.category[handle] in categories:
            if nbytes > 0:
                live[handle] = nbytes
            else:
                live.pop(handle, None)
    if not live:
        return trace
    frees = [(h, -n) for h, n in live.items()]
    later = [(h, n) for h, n in trace.events[at:] if not (h in live and n < 0)]
    starts = {}
    for name, start in trace.phase_starts.items():
        if start <= at:
            starts[name] = start
        else:  # later phases: shifted by the frees put in and the ones dropped before them
            before = sum(1 for h, n in trace.events[at:start] if h in live and n < 0)
            starts[name] = start + len(frees) - before
    return dataclasses.replace(trace, events=trace.events[:at] + frees + later, phase_starts=starts)


def _estimate_from_factors(trace, factors, target: Target, *, micro_batch_size, checkpointed, limit_bytes):
    device, precision, zero_stage, world_size, spec = (target.device, target.precision, target.zero_stage,
                                                       target.world_size, target.gpu)
    offload_optimizer, strategy = target.offload_optimizer, target.strategy
    extra = {"grads": factors.extra_grads, "params": factors.extra_params}
    timeline = _fold_optimizer_temporaries(scan(trace, factors.as_dict(), extra))
    if getattr(factors, "gathered_share", 0.0):
        timeline = _fold_gathered_params(timeline, factors.gathered_share, trace.phase_of(timeline.peak_index))
    breakdown = dict(timeline.breakdown)
    allocated_peak = timeline.peak_bytes
    context = 0
    peak = timeline.peak_bytes
    notes: tuple[str, ...] = ()
    upper_extra, unbounded = 0, ()
    if device == "cuda":
        constant = sum(extra.values())
        cap = None if limit_bytes is None else max(0, limit_bytes - round_up(constant, ROUND_LARGE))
        reserved, allocated_peak, workspace, notes = _cuda_reserved(trace, factors.as_dict(), spec, cap)
        reserved += round_up(constant, ROUND_LARGE)  # constant buffers: their own segments, kRoundLarge-rounded
        allocated_peak += constant
        breakdown[Category.WORKSPACE] = workspace
        breakdown[Category.ALLOCATOR_OVERHEAD] = max(0, reserved - timeline.peak_bytes - workspace)
        peak = sum(breakdown.values())
        context = spec.context_bytes
        if getattr(trace, "unmodelled", None):  # kernels without a rule: named, and bounded where a bound exists
            from memguard.estimator._cuda import allocator_config
            from memguard.estimator._unmodelled import upper_bound

            bound = upper_bound(trace.unmodelled, allocator_config())
            upper_extra, unbounded = bound.extra_bytes, bound.unbounded
            notes = notes + bound.notes
    if strategy == "fsdp2":
        from memguard.estimator._fsdp2 import FSDP2_NOTE, describe_stage

        notes = notes + (FSDP2_NOTE.format(stage=zero_stage, what=describe_stage(zero_stage), world=world_size),)
    dtypes = dtype_note(getattr(trace, "param_dtypes", ()), precision, strategy, zero_stage)
    if dtypes is not None:  # parameters of several dtypes (PEFT's float32 adapters on a 16-bit base)
        notes = notes + (dtypes,)
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
        peak_upper_bytes=int(peak + upper_extra),
        unbounded_workspaces=unbounded,
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

    from memguard.estimator._fsdp2 import fold_categories
    from memguard.estimator._trace import OPTIMIZER_TEMPORARIES

    def fold(bd):
        bd = fold_categories(bd)
        if ZERO_BUFFERS in bd:
            bd["grads"] = bd.get("grads", 0) + bd.pop(ZERO_BUFFERS)
        if ZERO_GATHERED in bd:
            bd["params"] = bd.get("params", 0) + bd.pop(ZERO_GATHERED)
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
    from memguard.estimator._cuda import (
        BLAS_HANDLES_PER_TRAINING_STEP,
        allocator_config,
        blas_workspace_allocations,
        blas_workspace_config,
        simulate,
    )

    version = "{}.{}".format(*stack_of(spec).torch)  # the target's torch (torch_version=), else the installed one
    config = allocator_config(torch_version=version)
    ws_config = blas_workspace_config(spec.vendor)
    per_handle = [n for n in blas_workspace_allocations(spec.compute_capability, version, vendor=spec.vendor,
                                                          cublas_workspace_config=ws_config) if n]
    notes = list(config.notes)
    stack = getattr(spec, "stack", None)
    if stack is not None:
        cudnn = "none" if stack.cudnn is None else cudnn_text(stack.cudnn)
        cuda = "ROCm" if stack.cuda is None else "CUDA {}.{}".format(*stack.cuda)
        notes.append(f"target stack: torch {version}, {cuda}, cuDNN {cudnn} (torch_version=, cuda_version=, "
                     "cudnn_version=)")
    if ws_config is not None:
        notes.append(f"BLAS workspace setting {ws_config!r} read: {sum(per_handle)} bytes per handle")
    sizes = [n for _ in range(BLAS_HANDLES_PER_TRAINING_STEP) for n in per_handle]
    scaled = scaled_events(trace, factors)
    forward = trace.phase_starts.get("forward", 0)
    at = sum(1 for _, n in scaled[:forward] if n)  # the forward's start once zero-size events are dropped
    events = [(h, n) for h, n in scaled if n]
    first = len(trace.sizes)
    events[at:at] = [(first + i, n) for i, n in enumerate(sizes)]
    # allocations on side streams (FSDP2's) come from their streams' own free blocks (_cuda.simulate)
    sim = simulate(events, limit_bytes=limit_bytes, config=config, streams=getattr(trace, "streams", None))
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
