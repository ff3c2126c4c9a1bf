"""The guard core: what every front-end (prepare/step, Lightning, Accelerate, and the next ones) shares."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memguard.errors import ConfigError, InfeasiblePlanError, PeerFailedError
from memguard.estimator._result import Estimate
from memguard.guard._core import Guard, forget, guard_of, register
from memguard.guard._options import Constraints, option_problems, plan_options_problems, plan_problems
from memguard.guard._distributed import planning_error_payload, rebuild_planning_error
from memguard.planner._plan import Plan


def plan_of(micro: int = 4, accum: int = 2, precision: str = "32-true", world: int = 1, zero_stage: int = 0) -> Plan:
    est = Estimate(peak_bytes=1 << 20, breakdown={"params": 1 << 10}, context_bytes=0, peak_phase="backward",
                   allocated_peak_bytes=1 << 20, device="cpu", precision=precision, zero_stage=zero_stage,
                   world_size=world, gpu=None, micro_batch_size=micro)
    return Plan(micro_batch_size=micro, grad_accum_steps=accum, world_size=world,
                global_batch_size=micro * accum * world, precision=precision, activation_checkpointing=False,
                zero_stage=zero_stage, budget_bytes=1 << 30, estimate=est, device="cpu")


# A front-end that fixes its precision, world size and accumulation, as the Accelerate hooks do.
FIXED = Constraints(source="the Framework", taken=("world_size",), precisions=("bf16-mixed",), world_size=2,
                    grad_accum_steps=4, fix_plan="rebuild the Framework from the plan")


def test_a_plan_is_checked_against_every_constraint_at_once() -> None:
    problems = plan_problems(plan_of(precision="32-true", world=1, accum=2), FIXED)
    # precision, accumulation and world size each differ from what the front-end runs: three sentences
    assert len(problems) == 3
    assert "precision '32-true' differs from the Framework's 'bf16-mixed'" in problems[0]
    assert "accumulates 2 micro-batches but the Framework accumulates 4" in problems[1]
    assert "made for 1 processes but the Framework runs 2" in problems[2]
    assert plan_problems(plan_of(precision="bf16-mixed", world=2, accum=4), FIXED) == []


def test_a_sharding_front_end_declares_its_zero_stages() -> None:
    # How an FSDP2 front-end plugs in: it runs stage 3 (reshard after forward) besides 0, not DeepSpeed's 1 and 2.
    fsdp2 = Constraints(source="FSDP2", zero_stages=(0, 3))
    assert plan_problems(plan_of(zero_stage=3), fsdp2) == []
    assert "ZeRO stage 2, which FSDP2 cannot apply" in plan_problems(plan_of(zero_stage=2), fsdp2)[0]
    assert option_problems(fsdp2, plan_options={"zero_stage": [0, 3], "budget_bytes": 1 << 30}) == []
    # the message names the stages it runs; the DeepSpeed hint is only for a front-end that runs no ZeRO
    problem = option_problems(fsdp2, plan_options={"zero_stage": 2})[0]
    assert "zero_stage=2 is not run by FSDP2: it runs stage 0, 3" in problem and "to_config" not in problem
    # planning fixes what the front-end fixes and leaves the rest to the planner
    assert fsdp2.planning_options({})["zero_stage"] == [0, 3]
    assert FIXED.planning_options({"precision": "32-true"})["precision"] == "bf16-mixed"


def test_option_problems_lists_every_problem() -> None:
    problems = option_problems(FIXED, plan=plan_of(precision="bf16-mixed", world=2, accum=4), micro_batch_size=0,
                               global_batch_size=-1, loss_fn=3, max_retries=-1, probe_up_after=0, max_grad_norm=-1,
                               plan_options={"world_size": 2})
    # two sources of the micro-batch, micro_batch_size, global_batch_size, loss_fn, max_retries, probe_up_after,
    # max_grad_norm, a taken option, and global_batch_size against the plan's 4 x 4 x 2 = 32
    assert len(problems) == 9, problems
    assert any("world_size come from the Framework" in p for p in problems)
    assert any("differs from the plan's 32" in p for p in problems)


def test_planning_options_are_checked_by_the_planners_request() -> None:
    # a misspelt name and an invalid value are both caught before any batch is seen
    problems = plan_options_problems({"budget_byte": 1, "headroom": 2})
    assert problems == [problems[0]] and "unknown plan option 'budget_byte'" in problems[0]
    problems = plan_options_problems({"headroom": 2})
    assert len(problems) == 1 and "headroom=2" in problems[0]
    assert plan_options_problems({"budget_bytes": 1 << 30, "precision": "bf16-mixed"}) == []
    with pytest.raises(ConfigError, match="the Framework runs 'bf16-mixed'"):
        raise ConfigError(option_problems(FIXED, plan_options={"precision": "32-true"}))


def test_planning_errors_are_rebuilt_with_what_they_carry() -> None:
    # what a rank other than 0 raises when rank 0's planning fails (the payload is what is broadcast)
    config = rebuild_planning_error(planning_error_payload(ConfigError(["a", "b"])))
    assert type(config) is ConfigError and config.problems == ["a", "b"]
    closest = plan_of()
    infeasible = rebuild_planning_error(planning_error_payload(
        InfeasiblePlanError("nothing fits", closest=closest, suggestions=["use bf16", "checkpoint"])))
    assert type(infeasible) is InfeasiblePlanError
    assert infeasible.closest == closest and infeasible.suggestions == ["use bf16", "checkpoint"]
    assert str(infeasible) == str(InfeasiblePlanError("nothing fits", suggestions=["use bf16", "checkpoint"]))
    other = rebuild_planning_error(planning_error_payload(KeyError("user bug")))
    assert type(other) is PeerFailedError and other.rank == 0 and "KeyError" in str(other)


def test_precision_roles() -> None:
    opt_of = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)  # noqa: E731
    # "weights": memguard casts a *-true model and leaves autocast to the framework
    m = nn.Linear(2, 2)
    g = Guard(m, Constraints(precision_role="weights"))
    g.apply(plan_of(precision="bf16-true"), opt_of(m))
    assert m.weight.dtype == torch.bfloat16 and g.status().precision == "bf16-true"
    g.apply(plan_of(precision="bf16-mixed"), opt_of(m))
    assert g.precision is None and g.status().precision == "bf16-mixed"
    # "framework": the framework does everything; memguard only records the name
    m = nn.Linear(2, 2)
    g = Guard(m, Constraints(precision_role="framework"))
    g.apply(plan_of(precision="bf16-true"), opt_of(m))
    assert m.weight.dtype == torch.float32 and g.precision is None and g.status().precision == "bf16-true"
    # "guard": memguard autocasts and scales 16-mixed itself
    m = nn.Linear(2, 2)
    g = Guard(m, Constraints())
    g.apply(plan_of(precision="16-mixed"), opt_of(m))
    assert isinstance(g.status().grad_scaler, torch.amp.GradScaler)


def test_one_guard_per_model_and_undo_runs_newest_first() -> None:
    m = nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="not prepared by memguard; prepare it"):
        guard_of(m, "prepare it")
    undone: list[int] = []
    g = Guard(m, Constraints())
    g.on_undo(lambda: undone.append(1))
    g.on_undo(lambda: undone.append(2))
    register(m, g)
    assert guard_of(m, "") is g
    register(m, Guard(m, Constraints()))  # preparing again undoes the previous guard's changes
    assert undone == [2, 1]
    forget(m)
    with pytest.raises(ConfigError):
        guard_of(m, "")


def test_a_front_end_whose_batches_are_smaller_than_the_plans_micro_batch() -> None:
    m = nn.Linear(2, 1)
    g = Guard(m, Constraints())
    g.apply(plan_of(micro=8, accum=1), torch.optim.SGD(m.parameters(), lr=0.1))
    g.limit_micro_batch(3)  # a dataloader batch of 3 is the most one forward can take
    st = g.status()
    assert (st.micro_batch_size, st.planned_micro_batch_size) == (3, 8)


def test_planning_options_that_would_plan_another_step_or_model_are_refused() -> None:
    # train=False plans an evaluation step and finetune="lora" a LoRA twin: a guard that runs training steps on
    # the model it was given could apply neither plan, so both are refused with the way to get what was meant.
    problems = option_problems(Constraints(), plan_options={"train": False, "finetune": "lora", "budget_bytes": 1 << 30})
    assert any("memguard.evaluate" in p for p in problems)
    assert any("peft.get_peft_model" in p for p in problems)
    qlora = option_problems(Constraints(), plan_options={"finetune": "qlora", "budget_bytes": 1 << 30})
    assert any("BitsAndBytesConfig" in p for p in qlora)
    assert option_problems(Constraints(), plan_options={"finetune": "full", "budget_bytes": 1 << 30}) == []
