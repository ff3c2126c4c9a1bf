"""The planner: search micro-batch x accumulation x precision x checkpointing x ZeRO for a budget.

``search.plan`` is ``memguard.plan``; ``cost`` is the throughput model; ``plan.Plan`` the result;
``cache`` the on-disk plan cache; ``sizing`` answers "which GPUs, and how many, fit this job".
"""

from memguard.planner.plan import Plan
from memguard.planner.search import DEFAULT_HEADROOM, plan

__all__ = ["Plan", "plan", "DEFAULT_HEADROOM"]
