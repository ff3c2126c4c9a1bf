"""Evaluation sizing (``memguard.plan(..., train=False)``): the most samples per forward that fit.

An evaluation step has no gradients, optimizer step or accumulation, so the only knob is how many
samples one forward takes. The plan answers that with the :class:`~memguard.Plan` every front-end
already reads, meaning:

* ``micro_batch_size``: the most samples per forward (the eval micro-batch);
* ``grad_accum_steps = 1`` and ``global_batch_size = micro_batch_size x world_size``: a Plan
  describes one forward per rank, so its invariant holds for any eval batch size; an eval batch of
  ``N`` samples runs as ``ceil(N / micro_batch_size)`` forwards (:mod:`memguard.guard._evaluate`),
  the outputs concatenated;
* ``reasons["mode"]`` says it is an evaluation plan, ``reasons["micro_batch_size"]`` how many
  forwards an eval batch of ``eval_batch_size`` takes, and ``reasons["planned_shape"]`` the shape
  planned for when ``max_shape`` was given.

How: the step is traced at two micro-batches; every tensor's size is affine in the micro-batch, so
the two traces give the trace at any micro-batch (:func:`memguard.planner._probe.interpolate_trace`),
which the device model turns into a peak (the CUDA caching allocator replayed, not extrapolated).
The largest micro-batch whose predicted peak fits the usable budget is found by bisection (the peak
grows with the micro-batch) and verified with one full trace; a miss steps down.

:func:`size_eval` sizes from the resolved request
(:meth:`memguard.planner._request.PlanRequest.resolve_eval`, which checks every option); the plan is
made by the planner's one builder (:func:`memguard.planner._assemble.build_plan`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from torch import nn

from memguard.batch import first_dim, resize_batch
from memguard.errors import InfeasiblePlanError
from memguard.estimator._eval_step import EVAL_NOTE, _with_ddp_buckets, eval_trace
from memguard.estimator._pricing import estimate_from_trace
from memguard.estimator._targets import Target, unwrap_model
from memguard.estimator._tracing import TraceRequest
from memguard.planner._assemble import Candidate, build_plan
from memguard.planner._plan import Plan
from memguard.planner._probe import interpolate_trace
from memguard.planner._request import PlanRequest, SearchSpace
from memguard.vocab import format_bytes

log = logging.getLogger("memguard")

#: ``Plan.reasons["mode"]`` of an evaluation plan.
EVAL_MODE_REASON = ("evaluation (train=False): one forward under no_grad per micro-batch, outputs kept; "
                    "no gradients, optimizer step or accumulation")
_MAX_VERIFY = 6  # full traces after the bisection before giving up (as the training search)


def size_eval(model: nn.Module, batch: Any, request: PlanRequest, space: SearchSpace) -> Plan:
    """Plan the evaluation micro-batch: the most samples per forward that fit the budget.

    Args:
        model, batch: the model and one example evaluation batch (other sizes are made along dim 0).
        request: the evaluation request: its ``loss_fn`` is the step's ``fn(model, batch) ->
            outputs``, an ``optimizer`` means its state is resident, ``keep_outputs`` and
            ``max_shape`` as for :func:`memguard.plan`.
        space: the request resolved (:meth:`~memguard.planner._request.PlanRequest.resolve_eval`):
            the target, the budget, the one precision, and the evaluation batch per rank
            (``space.per_rank``), the largest micro-batch considered.

    Returns:
        A :class:`~memguard.Plan` as described in the module docstring, verified with one full trace.

    Raises:
        InfeasiblePlanError: not even one sample fits; ``.closest`` is the one-sample plan.
    """
    from memguard.data import planning_batch

    example = first_dim(batch)
    n = space.per_rank
    precision, device, world_size, spec = space.precisions[0], space.device, space.world_size, space.spec
    worst, shape_reason = batch, None
    if request.max_shape is not None:
        worst, shape_reason = planning_batch(batch, request.max_shape)
    model = unwrap_model(model)
    usable = space.usable_bytes
    optimizer_state = request.optimizer is not None

    traces: dict[int, Any] = {}

    def trace_at(m: int):
        if m not in traces:
            how = TraceRequest(device=device, precision=precision, grads_present=False,
                               keep_outputs=request.keep_outputs, gpu=spec)
            traces[m] = eval_trace(model, resize_batch(worst, example, m), how, fn=request.loss_fn,
                                   optimizer=request.optimizer, optimizer_state=optimizer_state)
        return traces[m]

    def estimate(tr, m: int):
        est, _ = estimate_from_trace(tr, Target(device=device, precision=precision, world_size=world_size, gpu=spec),
                                     micro_batch_size=m)
        return _with_ddp_buckets(dataclasses.replace(est, notes=(EVAL_NOTE, *est.notes)), tr, world_size, False)

    m0 = max(1, min(example, n))
    m1 = 2 * m0

    def predicted(m: int) -> int:
        return estimate(interpolate_trace(trace_at(m0), m0, trace_at(m1), m1, m), m).peak_upper_bytes

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
        if est.peak_upper_bytes <= usable:  # plan on the upper bound, as the training search does
            return _micro_batch_plan(space, m, est, shape_reason)
        log.info("memguard: eval micro-batch %d predicted to fit but verified at %s; trying %d", m,
                 format_bytes(est.peak_upper_bytes), m - 1)
        m -= 1
    one = estimate(trace_at(1), 1)
    closest = _micro_batch_plan(space, 1, one, shape_reason)
    raise InfeasiblePlanError(
        f"no evaluation micro-batch fits {format_bytes(usable)} usable per rank: one sample needs "
        f"{format_bytes(one.peak_upper_bytes)} ({format_bytes(one.model_state_bytes)} of it parameters and other resident "
        "state)", closest=closest,
        suggestions=["evaluate in a 16-bit precision", "a shorter sequence (max_shape)",
                     "drop the optimizer state during evaluation (optimizer_state=False)"])


def _micro_batch_plan(space: SearchSpace, m: int, est: Any, shape_reason: str | None) -> Plan:
    """The evaluation plan of micro-batch ``m`` (its reasons say how an eval batch runs)."""
    n, precision = space.per_rank, space.precisions[0]
    forwards = -(-n // m)
    reasons = {
        "mode": EVAL_MODE_REASON,
        "micro_batch_size": (f"{m}: the most samples per forward predicted to fit; an eval batch of {n} runs as "
                             f"{forwards} forward{'s' if forwards != 1 else ''} whose outputs are concatenated"),
        "precision": f"{precision}: the evaluation's precision, as given",
    }
    if shape_reason is not None:
        reasons["planned_shape"] = shape_reason
    cand = Candidate(strategy="ddp", precision=precision, micro_batch_size=m, grad_accum_steps=1, checkpoint_blocks=0,
                     zero_stage=0, offload_optimizer=False, predicted_bytes=est.peak_upper_bytes, step_seconds=0.0,
                     throughput=0.0)
    return build_plan(space, cand, est, reasons)
