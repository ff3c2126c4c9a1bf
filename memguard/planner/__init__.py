"""The planner: search micro-batch x accumulation x precision x checkpointing x ZeRO for a budget.

``api`` is the front door (``api.plan`` is ``memguard.plan``; the guard, the command line and the
integrations import the planner only from it); ``request`` checks and resolves the options;
``session`` caches the traces of one model and batch; ``probe`` predicts a step's peak from probe
traces; ``search`` finds the fastest configuration that fits (``eval_sizing`` the largest
evaluation micro-batch); ``assemble`` builds every ``Plan``; ``cost`` is the throughput model;
``plan.Plan`` the result; ``cache`` the on-disk plan cache; ``finetune`` the fine-tuning
alternatives; ``notes`` the operational advice.
"""

from memguard.planner.api import DEFAULT_HEADROOM, Plan, plan

__all__ = ["Plan", "plan", "DEFAULT_HEADROOM"]
