"""``memguard.plan(..., train=False)``: the largest evaluation micro-batch that fits a budget.

An evaluation step has no gradients, optimizer step or accumulation, so the only knob is how many
samples one forward takes. The plan answers that with the :class:`~memguard.Plan` every front-end
already reads, meaning:

* ``micro_batch_size``: the most samples per forward (the eval micro-batch);
* ``grad_accum_steps = 1`` and ``global_batch_size = micro_batch_size x world_size``: a Plan
  describes one forward per rank, so its invariant holds for any eval batch size; an eval batch of
  ``N`` samples runs as ``ceil(N / micro_batch_size)`` forwards (:mod:`memguard.guard.evaluate`),
  the outputs concatenated;
* ``reasons["mode"]`` says it is an evaluation plan, ``reasons["micro_batch_size"]`` how many
  forwards an eval batch of ``eval_batch_size`` takes, and ``reasons["planned_shape"]`` the shape
  planned for when ``max_shape`` was given.

How: the step is traced at two micro-batches; every tensor's size is affine in the micro-batch, so
the two traces give the trace at any micro-batch (:func:`memguard.planner.probe.interpolate_trace`),
which the device model turns into a peak (the CUDA caching allocator replayed, not extrapolated).
The largest micro-batch whose predicted peak fits the usable budget is found by bisection (the peak
grows with the micro-batch) and verified with one full trace; a miss steps down.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from torch import nn

from memguard.batch import first_dim, resize_batch
from memguard.errors import ConfigError, InfeasiblePlanError
from memguard.planner.plan import Plan
from memguard.planner.request import DEFAULT_HEADROOM, PlanRequest
from memguard.vocab import PRECISIONS, format_bytes

__all__ = ["plan_eval", "plan_eval_for", "EVAL_MODE_REASON"]

log = logging.getLogger("memguard")

#: ``Plan.reasons["mode"]`` of an evaluation plan.
EVAL_MODE_REASON = ("evaluation (train=False): one forward under no_grad per micro-batch, outputs kept; "
                    "no gradients, optimizer step or accumulation")
_MAX_VERIFY = 6  # full traces after the bisection before giving up (as the training search)


def plan_eval(
    model: nn.Module,
    batch: Any,
    *,
    eval_batch_size: int | None = None,
    gpu: str | None = None,
    budget_bytes: int | None = None,
    world_size: int = 1,
    device: str = "cuda",
    precision: str = "32-true",
    fn: Callable[[nn.Module, Any], Any] | None = None,
    optimizer: Any = None,
    optimizer_state: bool = False,
    grads_present: bool = False,
    keep_outputs: bool = False,
    headroom: float = DEFAULT_HEADROOM,
    max_shape: Any = None,
) -> Plan:
    """Plan the evaluation micro-batch: the most samples per forward that fit the budget.

    Args:
        model, batch: the model and one example evaluation batch (other sizes are made along dim 0).
        eval_batch_size: the evaluation loader's batch per rank, the largest micro-batch considered;
            None: the example batch's size.
        gpu, budget_bytes, world_size, device, headroom: the target and budget, as for
            :func:`memguard.plan`.
        precision: the precision the evaluation runs in (one name: the training run's).
        fn, optimizer, optimizer_state, grads_present, keep_outputs: what the step runs and what is
            resident, as for :func:`memguard.estimator.eval_step.estimate_eval`.
        max_shape: plan for this worst-case shape (see :mod:`memguard.data`).

    Returns:
        A :class:`~memguard.Plan` as described in the module docstring, verified with one full trace.

    Raises:
        ConfigError: bad arguments, all listed at once.
        InfeasiblePlanError: not even one sample fits; ``.closest`` is the one-sample plan.
    """
    from memguard.data import planning_batch
    from memguard.estimator.pricing import estimate_from_trace
    from memguard.estimator.targets import Target, unwrap_model
    from memguard.estimator.tracing import TraceRequest
    from memguard.estimator.eval_step import _eval_problems, eval_trace

    problems: list[str] = []
    example = first_dim(batch)
    if example is None:
        problems.append("batch must hold at least one tensor with a batch dimension (dim 0)")
    n = eval_batch_size if eval_batch_size is not None else example
    if eval_batch_size is not None and not (isinstance(eval_batch_size, int) and eval_batch_size >= 1):
        problems.append(f"eval_batch_size={eval_batch_size!r} must be a positive int (the eval loader's batch per rank)")
    if precision not in PRECISIONS:
        problems.append(f"precision={precision!r} must be one of {', '.join(PRECISIONS)} (the precision the "
                        "evaluation runs in)")
    problems.extend(_eval_problems(zero_stage=0, optimizer_state=optimizer_state, grads_present=grads_present,
                                   keep_outputs=keep_outputs, activation_checkpointing=0, grad_accum_steps=1,
                                   offload_optimizer=False, optimizer=optimizer))
    # the request only resolves the target and budget; its batch fields are not used
    request = PlanRequest(global_batch_size=world_size if isinstance(world_size, int) and world_size >= 1 else 1,
                          gpu=gpu, budget_bytes=budget_bytes, world_size=world_size, device=device,
                          precision=precision if precision in PRECISIONS else None, headroom=headroom)
    problems.extend(request.problems())
    worst, shape_reason = batch, None
    if max_shape is not None and example is not None:
        try:
            worst, shape_reason = planning_batch(batch, max_shape)
        except ConfigError as exc:
            problems.extend(exc.problems)
    if problems:
        raise ConfigError(problems)
    space = request.resolve()
    spec = space.spec if device == "cuda" else None
    model = unwrap_model(model)
    usable = space.usable_bytes

    traces: dict[int, Any] = {}

    def trace_at(m: int):
        if m not in traces:
            request = TraceRequest(device=device, precision=precision, grads_present=grads_present,
                                   keep_outputs=keep_outputs, gpu=spec)
            traces[m] = eval_trace(model, resize_batch(worst, example, m), request, fn=fn, optimizer=optimizer,
                                   optimizer_state=optimizer_state)
        return traces[m]

    def estimate(tr, m: int):
        from memguard.estimator.eval_step import EVAL_NOTE, _with_ddp_buckets
        import dataclasses

        est, _ = estimate_from_trace(tr, Target(device=device, precision=precision, world_size=world_size, gpu=spec),
                                     micro_batch_size=m)
        return _with_ddp_buckets(dataclasses.replace(est, notes=(EVAL_NOTE, *est.notes)), tr, world_size,
                                 grads_present)

    from memguard.planner.probe import interpolate_trace

    m0 = max(1, min(example, n))
    m1 = 2 * m0

    def predicted(m: int) -> int:
        return estimate(interpolate_trace(trace_at(m0), m0, trace_at(m1), m1, m), m).peak_bytes

    lo, hi = 0, n  # the largest m in [1, n] whose prediction fits (0: none)
    if predicted(1) <= usable:
        lo = 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if predicted(mid) <= usable:
                lo = mid
            else:
                hi = mid - 1
    m = lo
    for _ in range(_MAX_VERIFY):
        if m < 1:
            break
        est = estimate(trace_at(m), m)
        if est.peak_bytes <= usable:
            return _eval_plan(m, est, n=n, world_size=world_size, budget=space.budget_bytes, headroom=headroom,
                              device=device, spec=spec, precision=precision, shape_reason=shape_reason)
        log.info("memguard: eval micro-batch %d predicted to fit but verified at %s; trying %d", m,
                 format_bytes(est.peak_bytes), m - 1)
        m -= 1
    one = estimate(trace_at(1), 1)
    closest = _eval_plan(1, one, n=n, world_size=world_size, budget=space.budget_bytes, headroom=headroom,
                         device=device, spec=spec, precision=precision, shape_reason=shape_reason)
    raise InfeasiblePlanError(
        f"no evaluation micro-batch fits {format_bytes(usable)} usable per rank: one sample needs "
        f"{format_bytes(one.peak_bytes)} ({format_bytes(one.model_state_bytes)} of it parameters and other resident "
        "state)", closest=closest,
        suggestions=["evaluate in a 16-bit precision", "a shorter sequence (max_shape)",
                     "drop the optimizer state during evaluation (optimizer_state=False)"])


def _eval_plan(m: int, est: Any, *, n: int, world_size: int, budget: int, headroom: float, device: str, spec: Any,
               precision: str, shape_reason: str | None) -> Plan:
    forwards = -(-n // m)
    reasons = {
        "mode": EVAL_MODE_REASON,
        "micro_batch_size": (f"{m}: the most samples per forward predicted to fit; an eval batch of {n} runs as "
                             f"{forwards} forward{'s' if forwards != 1 else ''} whose outputs are concatenated"),
        "precision": f"{precision}: the evaluation's precision, as given",
    }
    if shape_reason is not None:
        reasons["planned_shape"] = shape_reason
    return Plan(micro_batch_size=m, grad_accum_steps=1, world_size=world_size, global_batch_size=m * world_size,
                precision=precision, activation_checkpointing=False, zero_stage=0, budget_bytes=int(budget),
                estimate=est, device=device,
                gpu=spec.name if (spec is not None and device == "cuda" and spec.memory_bytes) else None,
                headroom=float(headroom), reasons=reasons)


def plan_eval_for(model: nn.Module, batch: Any, *, global_batch_size: Any, gpu: Any = None, budget_bytes: Any = None,
                  world_size: Any = 1, device: Any = "cuda", optimizer: Any = None, loss_fn: Any = None,
                  precision: Any = None, activation_checkpointing: Any = None, zero_stage: Any = None,
                  offload_optimizer: Any = False, headroom: Any = DEFAULT_HEADROOM, make_batch: Any = None,
                  cache: Any = False, keep_outputs: Any = False, max_shape: Any = None, **ignored: Any) -> Plan:
    """:func:`memguard.plan`'s arguments with ``train=False``, handed to :func:`plan_eval`.

    ``global_batch_size`` is the evaluation batch over all ranks; ``loss_fn`` is the step's
    ``fn(model, batch) -> outputs``; an ``optimizer`` means its state is resident (validation inside a
    training run). Knobs that only a training step has must be left at their defaults.

    Raises:
        ConfigError: a training-only knob was set, or as :func:`plan_eval` (all listed at once).
        InfeasiblePlanError: as :func:`plan_eval`.
    """
    problems = []
    for name, value, default in (("activation_checkpointing", activation_checkpointing, (None, False)),
                                 ("zero_stage", zero_stage, (None, 0)), ("offload_optimizer", offload_optimizer,
                                                                         (None, False)),
                                 ("make_batch", make_batch, (None,)), ("cache", cache, (False,))):
        if not any(value is d for d in default):
            problems.append(f"{name}={value!r} does not apply to an evaluation plan (train=False); drop it")
    problems.extend(f"{k}={v!r} does not apply to an evaluation plan (train=False); drop it"
                    for k, v in ignored.items() if v is not None)
    if isinstance(precision, (list, tuple)):
        problems.append(f"precision={precision!r}: an evaluation plan takes one precision, the one evaluation runs in")
    if not (isinstance(global_batch_size, int) and global_batch_size >= 1):
        problems.append(f"global_batch_size={global_batch_size!r} must be a positive int (the evaluation batch "
                        "over all ranks)")
    elif isinstance(world_size, int) and world_size >= 1 and global_batch_size % world_size:
        problems.append(f"global_batch_size={global_batch_size} is not divisible by world_size={world_size}")
    if problems:
        raise ConfigError(problems)
    per_rank = global_batch_size // world_size if isinstance(world_size, int) and world_size >= 1 else global_batch_size
    return plan_eval(model, batch, eval_batch_size=per_rank, gpu=gpu, budget_bytes=budget_bytes,
                     world_size=world_size, device=device, precision=precision or "32-true", fn=loss_fn,
                     optimizer=optimizer, optimizer_state=optimizer is not None, keep_outputs=keep_outputs,
                     headroom=headroom, max_shape=max_shape)
