"""The plan summary a user sees when a plan is made or applied, and the one switch that silences it.

A plan changes how the user's script runs (its micro-batch, accumulation, sometimes its precision),
so memguard says so once, on rank 0, without any logging set-up: when the user has configured no
logging handler the summary goes to stderr (as :data:`logging.lastResort` shows warnings), else it
is an INFO record on the ``memguard`` logger, which the user's configuration shows or filters.
``MEMGUARD_QUIET=1`` in the environment, or ``verbose=False`` to a front-end's ``prepare``,
silences it (it is then a DEBUG record).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from memguard.vocab import format_bytes

logger = logging.getLogger("memguard")

#: The environment variable that silences the plan summary (any value but empty or ``0``).
QUIET_ENV = "MEMGUARD_QUIET"

_DTYPE_PRECISIONS = {torch.float32: "32-true", torch.bfloat16: "bf16-true", torch.float16: "16-true"}


def precision_of_dtype(dtype: torch.dtype | None) -> str:
    """The precision a model of floating-point ``dtype`` runs in without memguard (``"32-true"`` by default)."""
    return _DTYPE_PRECISIONS.get(dtype, "32-true") if dtype is not None else "32-true"


def budget_source(plan: Any, options: Mapping[str, Any]) -> str:
    """Where the budget of a plan made with the user's planning ``options`` came from, in words."""
    if options.get("budget_bytes") is not None:
        return "given"
    if plan.device == "cuda":
        return f"the {plan.gpu}'s memory less its CUDA context" if plan.gpu else "the GPU's memory less its CUDA context"
    return "no budget given: the machine's available RAM"


def plan_summary(plan: Any, *, made: bool, budget_from: str, runs: str | None = None,
                 overrides: Sequence[str] = ()) -> str:
    """The summary's text: what runs, the predicted peak of the budget and where the budget came from, and
    every choice that overrides the user's script.

    Args:
        plan: the plan.
        made: memguard made it now (else it was given).
        budget_from: where the budget came from (:func:`budget_source`).
        runs: what runs per optimizer step, when the front-end runs it otherwise than the plan's
            numbers say (default: micro-batch x accumulation x world).
        overrides: the choices that change what the user's script said, one phrase each.
    """
    head = runs or (f"micro-batch {plan.micro_batch_size} x accumulation {plan.grad_accum_steps} x world "
                    f"{plan.world_size} = {plan.global_batch_size} samples per optimizer step")
    checkpointing = (f"activation checkpointing of {plan.checkpoint_blocks} blocks" if plan.activation_checkpointing
                     else "no activation checkpointing")
    target = plan.gpu or plan.device
    lines = [f"memguard {'planned' if made else 'runs the plan:'} {head}, {plan.precision}, {checkpointing}",
             f"  predicted peak {format_bytes(plan.estimate.peak_bytes)} of {format_bytes(plan.usable_bytes)} usable "
             f"on {target} ({format_bytes(plan.budget_bytes)} budget, {budget_from}; "
             f"{100 * plan.headroom:.0f}% headroom)"]
    if overrides:
        lines.append("  overrides your script:")
        lines += [f"    {o}" for o in overrides]
    lines.append(f"  (silence this with {QUIET_ENV}=1 or prepare(..., verbose=False))")
    return "\n".join(lines)


def quiet() -> bool:
    """Whether the environment silences the summary (``MEMGUARD_QUIET`` set to anything but empty or ``0``)."""
    return os.environ.get(QUIET_ENV, "").strip() not in ("", "0")


def show(text: str, *, verbose: bool = True) -> None:
    """Show the summary on rank 0: to stderr when no logging is configured, else as an INFO record."""
    if not verbose or quiet():
        logger.debug("%s", text)
        return
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    if logger.hasHandlers():
        logger.info("%s", text)
    else:
        print(text, file=sys.stderr, flush=True)
