"""The training search: the fastest configuration of a resolved request that fits its budget.

How the search works (and why it traces so little):

1. **Probes.** For a precision and a checkpointing mode, the model is traced with only 1 and 2 of
   its repeated blocks kept (``keep_blocks``), at the example micro-batch. Every quantity of a
   stack of identical blocks is affine in the number of blocks, so two points give the whole
   model; every activation and temporary of the forward/backward is proportional to the batch
   (dim 0), while parameters, gradients and optimizer state are not. So one probe pair predicts
   the peak at any micro-batch, any number of checkpointed blocks (interpolating between the
   "none" and "all" probes) and any ZeRO stage (a re-scan of the same traces with other factors).
   For the CUDA target, whose caching allocator is affine in nothing, the probes are extended into
   a trace of every block and replayed through the allocator model (:mod:`memguard.planner._probe`).
2. **Search.** Every divisor of the per-rank batch is a micro-batch candidate; for each
   precision x ZeRO stage x offload, the fewest checkpointed blocks that fit are solved for, and
   the cost model (``memguard.planner._cost``) ranks the candidates by predicted samples/s. Ties
   go to the simpler plan (no checkpointing, lower ZeRO stage, no offload, then larger
   micro-batch). Probes of a precision or checkpointing mode whose best conceivable throughput
   cannot beat the best plan found are never traced.
3. **Verification.** The winner is estimated with one full trace; if its upper bound
   (``Estimate.peak_upper_bytes``: the peak plus the largest workspace of the CUDA kernels memguard
   has no rule for, :mod:`memguard.estimator._unmodelled`) does not fit after all,
   the next candidate is verified (and the configuration that missed is queued one micro-batch
   smaller), and so on.

The budget is per rank: the GPU's memory less its CUDA context (or ``budget_bytes``), and the
plan keeps ``headroom`` of it free (default 10%: the estimator is within ~1% of the real CPU
allocator; the rest covers CUDA kernels' own workspaces, fragmentation from other work and the
allocator model's simplifications).
"""

from __future__ import annotations

import dataclasses
import logging

from memguard.errors import InfeasiblePlanError
from memguard.estimator._pricing import estimate_from_trace
from memguard.estimator._targets import Target, traced_precision
from memguard.estimator._result import Estimate
from memguard.planner._assemble import CLOSEST_REASONS, Candidate, ModelFacts, build_plan, fitting_reasons
from memguard.planner._cost import step_seconds
from memguard.planner._plan import Plan
from memguard.planner._probe import ProbeModel, divisors
from memguard.planner._request import SearchSpace
from memguard.planner._session import TraceSession
from memguard.vocab import format_bytes

log = logging.getLogger("memguard")

_MAX_VERIFY = 6


def search(session: TraceSession, space: SearchSpace) -> Plan:
    """The fastest configuration of ``space`` predicted to fit, verified with one full trace.

    Raises:
        InfeasiblePlanError: nothing fits; ``.closest`` is the configuration with the smallest
            verified peak, with suggestions.
    """
    if not space.shardings:
        space = dataclasses.replace(space, shardings=tuple(("deepspeed" if z else "ddp", z) for z in space.zero_stages))
    spec = space.spec
    global_batch_size, world_size, usable = space.global_batch_size, space.world_size, space.usable_bytes
    precisions, ckpts, offloads, shardings = space.precisions, space.checkpointing, space.offloads, space.shardings
    local = space.per_rank
    sizes = divisors(local)[::-1]
    n_blocks = session.num_blocks
    if n_blocks < 1:
        ckpts = tuple(c for c in ckpts if not c) or (False,)
    cost = session.cost_inputs(spec, precisions[0])
    rank = {p: i for i, p in enumerate(sorted(precisions, key=lambda p: (p != "32-true", p)))}
    configs = [(st, z, o) for st, z in shardings for o in offloads if not (o and z == 0)]
    strategy_rank: dict[str, int] = {}
    for st, _ in shardings:
        strategy_rank.setdefault(st, len(strategy_rank))

    def seconds(p, m, k, z, o, st=None):
        return step_seconds(cost, micro_batch_size=m, grad_accum_steps=local // m, world_size=world_size,
                            precision=p, checkpoint_blocks=k, zero_stage=z, offload_optimizer=o, strategy=st)

    # Best conceivable throughput of each (precision, checkpointing) pair, ignoring memory.
    pairs = []
    for p in precisions:
        for ck in ckpts:
            k = 1 if ck else 0
            best = min(seconds(p, m, k, z, o, st) for m in sizes[:1] for st, z, o in configs)
            pairs.append((global_batch_size / best, p, ck))
    pairs.sort(key=lambda t: -t[0])

    candidates: list[Candidate] = []
    origin: dict[Candidate, tuple[ProbeModel, bool]] = {}  # a candidate's probe model and checkpointing
    closest: Candidate | None = None
    for bound, p, ck in pairs:
        if candidates and bound < max(c.throughput for c in candidates):
            continue  # cannot beat what is already found: do not trace it
        for st, z, o in configs:
            model = session.probe_model(p, zero_stage=z, world_size=world_size, spec=spec, offload=o,
                                        checkpointing=ck, strategy=st)
            for m in sizes:
                accum = local // m
                k = _fewest_blocks(model, m, accum, usable) if ck else 0
                allocated = model.allocated(m, k, accum)
                # the device holds at least the allocated bytes: past the budget they are the closeness
                # measure, and the allocator model need not run
                pred = allocated if allocated > usable else model.predict(m, k, accum)
                s = seconds(p, m, k, z, o, st)
                cand = Candidate(st, p, m, accum, k, z, o, pred, s, global_batch_size / s)
                if closest is None or pred < closest.predicted_bytes:
                    closest = cand
                if pred <= usable:
                    candidates.append(cand)
                    origin[cand] = (model, ck)
                    break
    if not candidates:
        raise _infeasible(session, space, closest)
    def smaller(cand: Candidate) -> Candidate | None:
        """The same configuration at the next smaller micro-batch, when a larger one missed."""
        model, ck = origin[cand]
        below = [m for m in sizes if m < cand.micro_batch_size]
        if not below:
            return None
        m = below[0]
        accum = local // m
        k = _fewest_blocks(model, m, accum, usable) if ck else 0
        sec = seconds(cand.precision, m, k, cand.zero_stage, cand.offload_optimizer, cand.strategy)
        new = Candidate(cand.strategy, cand.precision, m, accum, k, cand.zero_stage, cand.offload_optimizer,
                         model.predict(m, k, accum), sec, global_batch_size / sec)
        origin[new] = origin[cand]
        return new

    queue = sorted(candidates, key=lambda c: c.key(rank, strategy_rank))
    tried: list[tuple[Candidate, Estimate]] = []
    worst = 1.0  # how far predictions have fallen short of full traces so far
    while queue and len(tried) < _MAX_VERIFY:
        cand = queue.pop(0)
        if cand.predicted_bytes * worst <= usable:
            est = verify(session, space, cand, limit_bytes=usable)
            tried.append((cand, est))
            if est.peak_upper_bytes <= usable:  # the upper bound: no plan relies on memory the model did not count
                return _fitting_plan(session, space, cand, est)
            worst = max(worst, est.peak_upper_bytes / max(cand.predicted_bytes, 1))
            log.info("memguard: candidate %s predicted %s but verified at %s; trying the next",
                     cand, format_bytes(cand.predicted_bytes), format_bytes(est.peak_upper_bytes))
        # a miss (or one predicted as optimistically as the last miss): try a smaller micro-batch too
        follow = smaller(cand)
        if follow is not None:
            queue.append(follow)
            queue.sort(key=lambda c: c.key(rank, strategy_rank))
    if closest is not None and all(c is not closest for c, _ in tried):
        # last resort: the configuration with the smallest predicted peak of all
        est = verify(session, space, closest, limit_bytes=usable)
        if est.peak_upper_bytes <= usable:
            return _fitting_plan(session, space, closest, est)
        tried.append((closest, est))
    cand, est = min(tried, key=lambda t: t[1].peak_upper_bytes)
    raise _infeasible(session, space, cand, verified=est)


def _fewest_blocks(model: ProbeModel, m: int, accum: int, usable: int) -> int:
    """The fewest checkpointed blocks (>= 1) predicted to fit at micro-batch ``m``, or all of them if none does.

    The allocated bytes fall as more blocks are checkpointed, and the device holds at least those:
    the search starts from the fewest blocks whose allocated bytes fit.
    """
    n = model.num_blocks

    def fewest(fits) -> int:
        lo, hi = 1, n
        while lo < hi:
            mid = (lo + hi) // 2
            if fits(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo

    if model.allocated(m, n, accum) > usable or model.predict(m, n, accum) > usable:
        return n
    return fewest(lambda k: model.allocated(m, k, accum) <= usable and model.predict(m, k, accum) <= usable)


def verify(session: TraceSession, space: SearchSpace, cand: Candidate, *, limit_bytes: int | None = None
           ) -> Estimate:
    """The estimate of ``cand`` from one full trace (``limit_bytes``: the CUDA allocator model's cap, or None)."""
    spec, world_size = space.spec, space.world_size
    tr = session.trace(traced_precision(cand.precision, cand.zero_stage, cand.strategy), ckpt=cand.checkpoint_blocks,
                       m=cand.micro_batch_size, grads_present=cand.grad_accum_steps > 1, spec=spec,
                       fsdp2=session._layout(cand.strategy, cand.precision, cand.zero_stage, world_size))
    tr = session.with_compression(tr, cand.precision)  # gradient_compression="powersgd": its memory
    target = Target(device=session.device, precision=cand.precision, zero_stage=cand.zero_stage,
                    world_size=world_size, gpu=spec, strategy=cand.strategy,
                    offload_optimizer=cand.offload_optimizer)
    est, _ = estimate_from_trace(tr, target, micro_batch_size=cand.micro_batch_size,
                                 checkpointed=cand.checkpoint_blocks, limit_bytes=limit_bytes)
    return est


def _fitting_plan(session: TraceSession, space: SearchSpace, cand: Candidate, est: Estimate) -> Plan:
    """The plan of the configuration that fits, with its reasons and notes."""
    facts = ModelFacts.of(session.model)
    return build_plan(space, cand, est, fitting_reasons(space, cand, session.num_blocks), facts=facts, advise=True)


def _infeasible(session: TraceSession, space: SearchSpace, cand: Candidate | None,
                verified: Estimate | None = None) -> InfeasiblePlanError:
    """The error when nothing fits: the closest configuration's plan (verified, unless ``verified``
    is its estimate already) and what to change."""
    spec, budget, usable, headroom = space.spec, space.budget_bytes, space.usable_bytes, space.headroom
    world_size, zeros, offloads = space.world_size, space.zero_stages, space.offloads
    closest_plan = None
    est = verified
    if cand is not None:
        if est is None:
            est = verify(session, space, cand)
        closest_plan = build_plan(space, cand, est, CLOSEST_REASONS, facts=ModelFacts.of(session.model))
    need = est.peak_upper_bytes if est is not None else 0
    suggestions: list[str] = []
    if est is not None:
        states = est.model_state_bytes
        act = need - states
        if 3 not in zeros or world_size == 1:
            suggestions.append(
                "shard model states with ZeRO-3 over more GPUs (world_size > 1, zero_stage=3): "
                f"model states are {format_bytes(states)} per rank now"
            )
        if True not in offloads:
            suggestions.append("offload optimizer state to host memory (offload_optimizer=True with ZeRO >= 1)")
        if act > 0 and usable > states:
            frac = (usable - states) / act
            if frac < 1:
                suggestions.append(f"a shorter sequence or smaller inputs: activations must shrink to about {frac:.0%} of now")
        from memguard.estimator.gpus import GPUS

        bigger = sorted((g for g in GPUS.values() if g.memory_bytes - g.context_bytes > need / (1 - headroom)),
                        key=lambda g: g.memory_bytes)
        if bigger and space.device == "cuda" and spec is not None and spec.memory_bytes:
            suggestions.append(f"a GPU with more memory, e.g. {bigger[0].name} ({format_bytes(bigger[0].memory_bytes)})")
    msg = (
        f"no configuration fits {format_bytes(usable)} usable per rank ({format_bytes(budget)} budget, "
        f"{headroom:.0%} headroom); the closest needs {format_bytes(need)}"
    )
    return InfeasiblePlanError(msg, closest=closest_plan, suggestions=suggestions)
