"""The planner: search micro-batch x accumulation x precision x checkpointing x ZeRO for a budget.

:mod:`memguard.planner.api` is the front door: ``api.plan`` is ``memguard.plan``, and the guard,
the command line and the integrations import the planner only from it. Modules whose names start
with ``_`` are internal. How a plan is made, in the order it runs: ``_request`` checks the options
and resolves them into a ``SearchSpace``; ``_session`` (``TraceSession``) traces the step of one
model and batch and caches the traces; ``_probe`` predicts a step's peak at any micro-batch from
probe traces; ``_search`` finds the fastest configuration that fits and verifies it (``_cost`` is
the throughput model); ``_assemble`` builds every :class:`Plan` (``_plan``), fitting or closest;
``_eval_sizing`` sizes an evaluation step instead; ``_finetune`` measures fine-tuning alternatives
when nothing fits; ``_notes`` adds operational advice; ``_cache`` is the on-disk plan cache.
"""

from memguard.planner.api import DEFAULT_HEADROOM, Plan, plan

__all__ = ["Plan", "plan", "DEFAULT_HEADROOM"]
