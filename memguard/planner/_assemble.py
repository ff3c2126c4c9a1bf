"""The one builder of :class:`~memguard.planner._plan.Plan` values: fitting, closest and evaluation.

The search (:mod:`memguard.planner._search`) and the evaluation sizing
(:mod:`memguard.planner._eval_sizing`) decide a :class:`Candidate` (a micro-batch, accumulation,
precision, checkpointing and sharding, with its predicted peak and throughput) and verify it with
one full trace; :func:`build_plan` turns the candidate, its verified estimate and the resolved
request (:class:`~memguard.planner._request.SearchSpace`) into the ``Plan``, with the reasons the
caller gives (:func:`fitting_reasons` for the training plan that fits; :data:`CLOSEST_REASONS` for
the closest one an :class:`~memguard.errors.InfeasiblePlanError` carries) and, for a plan that
fits, the operational notes (:mod:`memguard.planner._notes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from torch import nn

from memguard.estimator._blocks import find_blocks, hidden_size
from memguard.estimator._result import Estimate
from memguard.planner._notes import notes_of
from memguard.planner._plan import Plan
from memguard.planner._request import SearchSpace

#: ``Plan.reasons`` of the closest configuration when nothing fits.
CLOSEST_REASONS: Mapping[str, str] = {"closest": "the configuration with the smallest predicted peak"}


@dataclass(frozen=True)
class Candidate:
    """One configuration the search considers, with its prediction.

    Attributes:
        strategy: ``"ddp"``, ``"deepspeed"`` or ``"fsdp2"``.
        precision: the precision name.
        micro_batch_size: samples per forward/backward on one rank.
        grad_accum_steps: micro-batches per optimizer step on one rank.
        checkpoint_blocks: repeated blocks checkpointed (the first ones).
        zero_stage: the ZeRO stage (FSDP2's sharding level under ``"fsdp2"``).
        offload_optimizer: optimizer state in host memory.
        predicted_bytes: the predicted peak per rank.
        step_seconds: the cost model's seconds per optimizer step.
        throughput: the cost model's samples per second.
    """

    strategy: str
    precision: str
    micro_batch_size: int
    grad_accum_steps: int
    checkpoint_blocks: int
    zero_stage: int
    offload_optimizer: bool
    predicted_bytes: int
    step_seconds: float
    throughput: float

    def key(self, precision_rank: dict[str, int], strategy_rank: dict[str, int] | None = None) -> tuple:
        """The search's order: fastest first; ties to the simpler plan (see :mod:`memguard.planner._search`)."""
        return (
            -float(f"{self.throughput:.3g}"),  # throughput first, to 3 significant digits
            self.checkpoint_blocks,
            (strategy_rank or {}).get(self.strategy, 0),  # then the strategy listed first
            self.zero_stage,
            self.offload_optimizer,
            precision_rank[self.precision],
            -self.micro_batch_size,
        )


@dataclass(frozen=True)
class ModelFacts:
    """What a plan records about the model: its repeated block's class, its hidden size, its block count."""

    block_class: str | None
    hidden_size: int | None
    num_blocks: int

    @classmethod
    def of(cls, model: nn.Module) -> "ModelFacts":
        """The facts of ``model`` (its repeated blocks as :func:`~memguard.estimator._blocks.find_blocks` finds them)."""
        blocks = find_blocks(model)
        return cls(type(blocks[0]).__name__ if blocks else None, hidden_size(model), len(blocks))


def build_plan(space: SearchSpace, cand: Candidate, est: Estimate, reasons: Mapping[str, str], *,
               facts: ModelFacts | None = None, advise: bool = False) -> Plan:
    """The :class:`~memguard.planner._plan.Plan` of ``cand`` under ``space``, verified as ``est``.

    Args:
        space: the resolved request (target, budget, headroom, ranks).
        cand: the configuration chosen.
        est: its verified estimate.
        reasons: ``Plan.reasons``, one sentence per knob.
        facts: the model's block class and hidden size (None: not recorded, as for evaluation plans).
        advise: add the operational notes of :func:`memguard.planner._notes.notes_of` (a plan that fits).
    """
    spec = space.spec
    block_class = facts.block_class if facts is not None else None
    plan = Plan(
        micro_batch_size=cand.micro_batch_size,
        grad_accum_steps=cand.grad_accum_steps,
        world_size=space.world_size,
        global_batch_size=cand.micro_batch_size * cand.grad_accum_steps * space.world_size,
        precision=cand.precision,
        activation_checkpointing=cand.checkpoint_blocks > 0,
        checkpoint_blocks=cand.checkpoint_blocks,
        zero_stage=cand.zero_stage,
        offload_optimizer=cand.offload_optimizer,
        budget_bytes=int(space.budget_bytes),
        estimate=est,
        device=space.device,
        gpu=spec.name if (spec is not None and space.device == "cuda" and spec.memory_bytes) else None,
        headroom=float(space.headroom),
        throughput=float(cand.throughput),
        reasons=reasons,
        block_class=block_class,
        hidden_size=facts.hidden_size if facts is not None else None,
        strategy=cand.strategy,
        notes=strategy_notes(cand, block_class) if facts is not None else (),
    )
    if advise:
        plan = plan.replace(notes=tuple(plan.notes) + tuple(notes_of(plan)))
    return plan


def fitting_reasons(space: SearchSpace, cand: Candidate, num_blocks: int) -> dict[str, str]:
    """``Plan.reasons`` of the training plan that fits: why each knob has its value."""
    spec, n, world = space.spec, num_blocks, space.world_size
    precisions = space.precisions
    reasons = {
        "micro_batch_size": (
            f"{cand.micro_batch_size} x {cand.grad_accum_steps} accumulation x {world} ranks = "
            f"{space.global_batch_size}; "
            f"the fastest split predicted to fit ({cand.throughput:.3g} samples/s by the cost model)"
        ),
        "precision": (
            f"{cand.precision}: fixed by you" if len(precisions) == 1 and space.explicit_precision else
            f"{cand.precision}: fastest of {', '.join(precisions)} that fits"
            + (f" ({_rate(spec, cand.precision):g} TFLOP/s on {spec.name})"
               if spec is not None and space.device == "cuda" and _rate(spec, cand.precision) else "")
        ),
        "activation_checkpointing": (
            "off: fits without recomputation" if cand.checkpoint_blocks == 0 else
            f"{cand.checkpoint_blocks} of {n} blocks: the fewest that let micro-batch {cand.micro_batch_size} fit "
            f"(+{100 * cand.checkpoint_blocks / (3 * n):.0f}% compute)"
        ),
        "zero_stage": (
            "0: one device" if world == 1 and cand.zero_stage == 0 else
            f"{cand.zero_stage}: the least sharding (and communication) that fits and is fastest"
        ),
    }
    strategies = [st for st, _ in space.shardings]
    if len(set(strategies)) > 1:
        reasons["strategy"] = f"{cand.strategy}: the fastest of {', '.join(dict.fromkeys(strategies))} that fits"
    elif cand.strategy in ("fsdp2", "fsdp1"):
        reasons["strategy"] = f"{cand.strategy}: asked for"
    if cand.offload_optimizer:
        reasons["offload_optimizer"] = "optimizer state in host memory: nothing fits on the device otherwise"
    return reasons


def strategy_notes(cand: Candidate, block_class: str | None) -> tuple[str, ...]:
    """How to run a plan's sharding, one sentence each (``Plan.notes``); empty for DDP and DeepSpeed."""
    if cand.strategy == "fsdp1":
        blocks = f"{{{block_class}}}" if block_class else "{the repeated block class}"
        what = "FULL_SHARD" if cand.zero_stage == 3 else "SHARD_GRAD_OP"
        mp = (" and MixedPrecision(param_dtype, reduce_dtype, buffer_dtype) in the plan's 16-bit dtype"
              if cand.precision != "32-true" else "")
        return (f"FSDP1: FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({blocks}), "
                f"sharding_strategy={what}, use_orig_params=True){mp} (Lightning's FSDPStrategy, Accelerate's FSDP "
                "plugin v1), as estimated.",)
    if cand.strategy != "fsdp2":
        return ()
    from memguard.estimator._fsdp2 import describe_stage

    precision, zero_stage = cand.precision, cand.zero_stage
    blocks = f"each {block_class}" if block_class else "each repeated block"
    notes = [
        f"FSDP2: fully_shard {blocks}, then the root module (memguard.integrations.fsdp.apply(model, plan) does "
        f"this), with {describe_stage(zero_stage)}."
    ]
    if precision.endswith("-mixed"):
        dtype = "torch.bfloat16" if precision.startswith("bf16") else "torch.float16"
        notes.append(f"{precision} under FSDP2 is MixedPrecisionPolicy(param_dtype={dtype}, reduce_dtype=torch.float32) "
                     "with no autocast.")
    if zero_stage == 1:
        notes.append("Call model.set_requires_gradient_sync(False) before every micro-batch but the last of a step, "
                     "and True before the last.")
    if cand.offload_optimizer:
        notes.append("offload_optimizer under FSDP2 is CPUOffloadPolicy: sharded parameters, gradients and optimizer "
                     "state in host memory; the optimizer steps on the CPU.")
    return tuple(notes)


def _rate(spec: Any, precision: str) -> float:
    """The GPU's peak TFLOP/s in ``precision``."""
    if precision == "32-true":
        return spec.fp32_tflops
    return spec.bf16_tflops if precision.startswith("bf16") else spec.fp16_tflops
