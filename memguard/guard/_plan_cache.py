"""What the guard learns about a planned job, kept in the plan cache for the job's next run.

When memguard planned with ``cache=`` (``True`` or a :class:`memguard.planner._cache.PlanCache`), a
micro-batch reduced after an out-of-memory error is written to the plan cache under a key derived
from the planner's plan (:class:`ReducedPlans`), and the next run of the same job starts from it
instead of the planner's micro-batch. Only the planned batch shape's micro-batch is kept: a shape
planned later (:mod:`memguard.guard._sizing`) is planned again in the next run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping

from torch import nn

from memguard.batch import LossFn
from memguard.planner.api import Plan

logger = logging.getLogger("memguard")

# The fields that identify a planned configuration, for the plan-cache key of its reduced form.
_PLAN_IDENTITY = ("micro_batch_size", "grad_accum_steps", "world_size", "global_batch_size", "precision",
                  "activation_checkpointing", "checkpoint_blocks", "zero_stage", "offload_optimizer", "device", "gpu",
                  "budget_bytes", "headroom")


@dataclass(frozen=True)
class ReducedPlans:
    """The plan-cache entry of one planned job's reduced micro-batch.

    Attributes:
        store: the plan cache.
        key: the entry's key (the planner's plan, the model, batch, optimizer and loss).
    """

    store: Any
    key: str

    @classmethod
    def for_plan(cls, plan: Plan, module: nn.Module, batch: Any, optimizer: Any, loss_fn: LossFn | None,
                 options: Mapping[str, Any]) -> "ReducedPlans | None":
        """The entry of ``plan``, planned with ``options``; None without ``cache=`` in them."""
        cache = options.get("cache")
        if not cache:
            return None
        from memguard.planner.api import PlanCache, plan_key

        store = cache if isinstance(cache, PlanCache) else PlanCache()
        knobs = {k: getattr(plan, k) for k in _PLAN_IDENTITY}
        # what the plan does not record but the step's memory depends on
        knobs["keep_outputs"] = bool(options.get("keep_outputs", False))
        key = plan_key(module, batch, optimizer, loss_fn, {"memguard.guard": "reduced after OOM", **knobs})
        return cls(store, key)

    def get(self, plan: Plan) -> Plan:
        """The plan a reduced micro-batch was remembered in, else ``plan`` (the planner's)."""
        reduced = self.store.get(self.key)
        if reduced is not None:
            logger.info("using micro-batch %d, remembered in the plan cache after an out-of-memory error (planned %d)",
                        reduced.micro_batch_size, plan.micro_batch_size)
            return reduced
        return plan

    def put(self, plan: Plan, mbs: int) -> None:
        """Remember micro-batch ``mbs`` (rounded down to a divisor of the local batch) for ``plan``; a cache
        that cannot be written is logged, never raised."""
        local = plan.global_batch_size // plan.world_size
        fit = max(d for d in range(1, min(mbs, local) + 1) if local % d == 0)  # a Plan needs mbs | local batch
        reduced = plan.replace(
            micro_batch_size=fit, grad_accum_steps=local // fit,
            reasons={**plan.reasons, "micro_batch_size": f"reduced from {plan.micro_batch_size} to {fit} after an "
                     "out-of-memory error in training (the estimate is still the planned one's)"},
        )
        try:
            self.store.put(self.key, reduced)
        except Exception as exc:  # a cache that cannot be written must not stop training
            logger.warning("could not write micro-batch %d to the plan cache: %s", fit, exc)
