"""Tests of ``memguard.plan``: batch arithmetic, knobs, budgets, infeasibility and probe accuracy.

Most tests plan for the CPU target with an explicit ``budget_bytes`` on a tiny residual MLP whose
activations (token dimension 16) dominate its parameters, so the budget really decides the
micro-batch. Tracing costs ~0.1-1 s, so tests that ask many questions share one
:class:`~memguard.planner._session.TraceSession` (``plan_request(..., session=)``): it only caches traces,
which depend on neither the budget nor the batch arithmetic.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import nn

import memguard
from memguard import ConfigError, InfeasiblePlanError, MemguardError, Plan
from memguard.planner._request import PlanRequest
from memguard.planner.api import DEFAULT_HEADROOM, plan_request
from memguard.planner._session import TraceSession

KiB = 1 << 10
MiB = 1 << 20
SEQ, DIM = 16, 32


class TinyResidualMLP(nn.Module):
    """Three residual MLP blocks over a (batch, 16, 32) input; forward returns the MSE loss."""

    def __init__(self, dim: int = DIM, blocks: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)) for _ in range(blocks)
        )
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return F.mse_loss(self.head(x).squeeze(-1), y)


def _batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, SEQ, DIM, generator=g), torch.randn(n, SEQ, generator=g)


@pytest.fixture(scope="module")
def model() -> nn.Module:
    torch.manual_seed(0)
    return TinyResidualMLP()


@pytest.fixture(scope="module")
def batch():
    return _batch(4)


@pytest.fixture(scope="module")
def planner(model, batch) -> TraceSession:
    return TraceSession(model, batch, device="cpu")


@pytest.fixture(scope="module")
def peaks(model):
    """Full ``memguard.estimate`` peaks (32-true, no checkpointing), cached by (micro-batch, accumulation)."""
    cache: dict[tuple[int, int], int] = {}

    def peak(m: int, accum: int = 1) -> int:
        if (m, accum) not in cache:
            cache[(m, accum)] = memguard.estimate(model, _batch(m), device="cpu", grad_accum_steps=accum).peak_bytes
        return cache[(m, accum)]

    return peak


def plan_with(planner: TraceSession, model, batch, **options) -> Plan:
    """``memguard.plan(model, batch, **options)``, reusing ``planner``'s traces."""
    return plan_request(model, batch, PlanRequest.from_options(**options), session=planner)


def _check_invariant(p: Plan, global_batch_size: int, world_size: int) -> None:
    assert p.micro_batch_size * p.grad_accum_steps * p.world_size == global_batch_size
    assert p.world_size == world_size and p.global_batch_size == global_batch_size
    assert p.micro_batch_size >= 1 and p.grad_accum_steps >= 1
    assert p.estimate.micro_batch_size == p.micro_batch_size


# ---------------------------------------------------------------------------------------------
# batch arithmetic
# ---------------------------------------------------------------------------------------------


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(local=st.integers(1, 90), world=st.integers(1, 8), budget_kib=st.integers(700, 4000))
def test_batch_invariant_property(model, batch, planner, local, world, budget_kib):
    # global = local x world is always divisible; the budget ranges from a few samples to all of them
    p = plan_with(planner, model, batch, global_batch_size=local * world, world_size=world, device="cpu",
                      budget_bytes=budget_kib * KiB)
    _check_invariant(p, local * world, world)
    assert p.estimate.peak_bytes <= p.usable_bytes


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(global_batch=st.integers(1, 1000), world=st.integers(2, 64))
def test_indivisible_global_batch_is_a_config_error(model, batch, global_batch, world):
    assume(global_batch % world != 0)
    with pytest.raises(ConfigError, match="cannot be split") as info:
        memguard.plan(model, batch, global_batch_size=global_batch, world_size=world, device="cpu",
                      budget_bytes=MiB)
    assert str(world) in str(info.value)


def test_every_problem_is_listed_at_once(model, batch):
    with pytest.raises(ConfigError) as info:
        memguard.plan(model, batch, global_batch_size=10, world_size=4, device="cpu", gpu="A100-80GB",
                      budget_bytes=-5, headroom=1.5, precision="fp8", zero_stage=7)
    problems = info.value.problems
    text = str(info.value)
    # one sentence per bad argument: the split, gpu on cpu, budget, headroom, precision, zero stage
    for needle in ("cannot be split", "gpu=", "budget_bytes", "headroom", "precision", "zero_stage"):
        assert needle in text, needle
    assert len(problems) >= 6
    assert isinstance(info.value, MemguardError) and isinstance(info.value, ValueError)


def test_bad_global_batch_and_world_size(model, batch):
    with pytest.raises(ConfigError) as info:
        memguard.plan(model, batch, global_batch_size=0, world_size=0, device="cpu", budget_bytes=MiB)
    assert "global_batch_size" in str(info.value) and "world_size" in str(info.value)


@pytest.mark.parametrize(
    "global_batch, expected_micro, larger_divisor",
    [
        # 24 = 12 x 2; the budget lies between the peaks at 12 and 24, so 12 (not 8 = the largest
        # power of two) is the largest divisor that fits
        (24, 12, 24),
        # 60 = 20 x 3; the budget lies between the peaks at 20 and 30 (the next divisor of 60)
        (60, 20, 30),
    ],
)
def test_non_power_of_two_micro_batches(model, batch, planner, peaks, global_batch, expected_micro, larger_divisor):
    fits = peaks(expected_micro, global_batch // expected_micro)
    too_big = peaks(larger_divisor, global_batch // larger_divisor)
    assert fits < too_big
    budget = (fits + too_big) // 2
    p = plan_with(planner, model, batch, global_batch_size=global_batch, device="cpu", budget_bytes=budget, headroom=0.0,
                      precision="32-true", activation_checkpointing=False)
    _check_invariant(p, global_batch, 1)
    assert p.micro_batch_size == expected_micro
    assert p.micro_batch_size & (p.micro_batch_size - 1) != 0  # not a power of two
    assert p.estimate.peak_bytes == fits


# ---------------------------------------------------------------------------------------------
# budget and headroom
# ---------------------------------------------------------------------------------------------


def test_default_headroom_is_documented_value(model, batch, planner):
    assert DEFAULT_HEADROOM == 0.10  # module docstring of memguard.planner._search: 10% by default
    p = plan_with(planner, model, batch, global_batch_size=8, device="cpu", budget_bytes=4 * MiB)
    assert p.headroom == DEFAULT_HEADROOM


@pytest.mark.parametrize("headroom", [0.0, 0.25])
def test_verified_estimate_is_under_usable_budget(model, batch, headroom):
    budget = 1500 * KiB
    p = memguard.plan(model, batch, global_batch_size=48, device="cpu", budget_bytes=budget, headroom=headroom)
    assert p.budget_bytes == budget and p.headroom == headroom
    assert p.estimate.peak_bytes <= budget * (1 - headroom)
    # the plan's estimate is what memguard.estimate says about the same configuration
    again = memguard.estimate(model, _batch(p.micro_batch_size), device="cpu", precision=p.precision,
                              activation_checkpointing=p.checkpoint_blocks, grad_accum_steps=p.grad_accum_steps)
    assert again.peak_bytes == p.estimate.peak_bytes
    assert again.peak_bytes <= budget * (1 - headroom)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(a=st.integers(600, 6000), b=st.integers(600, 6000))
def test_tighter_budget_never_gives_a_larger_micro_batch(model, batch, planner, a, b):
    # with precision and checkpointing fixed, the feasible micro-batches of a smaller budget are a
    # subset of those of a larger one, and larger micro-batches are never slower in the cost model
    tight, loose = sorted((a * KiB, b * KiB))
    kw = dict(global_batch_size=120, device="cpu", precision="32-true", activation_checkpointing=False)

    def micro_batch(budget: int) -> int:  # 0 when nothing fits (micro-batch 1 needs ~790 KiB)
        try:
            return plan_with(planner, model, batch, budget_bytes=budget, **kw).micro_batch_size
        except InfeasiblePlanError:
            return 0

    assert micro_batch(tight) <= micro_batch(loose)


# ---------------------------------------------------------------------------------------------
# knobs: None lets memguard choose, a value fixes it, a sequence restricts it
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "knob, value, check",
    [
        ("precision", None, lambda p: p.precision in ("32-true", "bf16-mixed")),  # the CPU default set
        ("precision", "bf16-mixed", lambda p: p.precision == "bf16-mixed"),
        ("precision", "16-true", lambda p: p.precision == "16-true"),  # *-true only when asked for
        ("precision", ["16-mixed", "32-true"], lambda p: p.precision in ("16-mixed", "32-true")),
        ("activation_checkpointing", False, lambda p: not p.activation_checkpointing and p.checkpoint_blocks == 0),
        ("activation_checkpointing", True, lambda p: p.activation_checkpointing and 1 <= p.checkpoint_blocks <= 3),
        ("activation_checkpointing", None, lambda p: (p.checkpoint_blocks > 0) == p.activation_checkpointing),
    ],
)
def test_single_device_knobs(model, batch, planner, knob, value, check):
    p = plan_with(planner, model, batch, global_batch_size=24, device="cpu", budget_bytes=1200 * KiB, **{knob: value})
    _check_invariant(p, 24, 1)
    assert check(p), p.explain()
    assert p.estimate.precision == p.precision
    assert p.estimate.activation_checkpointing == p.checkpoint_blocks


@pytest.mark.parametrize(
    "options, check",
    [
        ({"zero_stage": None}, lambda p: p.zero_stage in (0, 1, 2, 3)),
        ({"zero_stage": 2}, lambda p: p.zero_stage == 2),
        ({"zero_stage": [1, 3]}, lambda p: p.zero_stage in (1, 3)),
        ({"zero_stage": 1, "offload_optimizer": True}, lambda p: p.zero_stage == 1 and p.offload_optimizer),
        ({"zero_stage": 3, "offload_optimizer": None}, lambda p: p.zero_stage == 3),
        ({"zero_stage": 2, "offload_optimizer": False}, lambda p: not p.offload_optimizer),
    ],
)
def test_zero_and_offload_knobs(model, batch, planner, options, check):
    p = plan_with(planner, model, batch, global_batch_size=24, world_size=2, device="cpu", budget_bytes=1200 * KiB,
                      precision="32-true", **options)
    _check_invariant(p, 24, 2)
    assert check(p), p.explain()
    assert p.estimate.zero_stage == p.zero_stage and p.estimate.offload_optimizer == p.offload_optimizer


def test_zero_is_off_on_one_device_by_default(model, batch, planner):
    p = plan_with(planner, model, batch, global_batch_size=8, device="cpu", budget_bytes=4 * MiB)
    assert p.zero_stage == 0 and not p.offload_optimizer


def test_bad_knob_values_are_listed_together(model, batch):
    with pytest.raises(ConfigError) as info:
        memguard.plan(model, batch, global_batch_size=8, device="cpu", budget_bytes=MiB,
                      precision=["32-true", "fp8"], activation_checkpointing="some", zero_stage=[0, 5],
                      offload_optimizer="yes")
    text = str(info.value)
    for needle in ("precision", "activation_checkpointing", "zero_stage", "offload_optimizer"):
        assert needle in text, needle


def test_offload_with_zero_stage_0_is_a_config_error(model, batch):
    # offload lives in ZeRO: fixing stage 0 leaves it nothing to attach to
    with pytest.raises(ConfigError, match="ZeRO"):
        memguard.plan(model, batch, global_batch_size=8, device="cpu", budget_bytes=MiB, offload_optimizer=True,
                      zero_stage=0)


def test_offload_on_one_device_considers_zero_1_and_2(model, batch):
    # ZeRO-Offload's main use is a single device: with the stage left to memguard it picks 1 or 2
    plan = memguard.plan(model, batch, global_batch_size=8, device="cpu", budget_bytes=64 * MiB,
                         offload_optimizer=True)
    assert plan.offload_optimizer and plan.zero_stage in (1, 2)


# ---------------------------------------------------------------------------------------------
# bf16 on GPUs without it
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def meta_mlp():
    """A wider residual MLP on meta (6.3M parameters, (batch, 256, 512) inputs): compute-bound on a
    GPU at useful micro-batches, so the cost model's precision speed-up decides the precision."""
    with torch.device("meta"):
        m = TinyResidualMLP(dim=512, blocks=3)
    x = torch.empty(1, 256, 512, device="meta")
    y = torch.empty(1, 256, device="meta")
    batch = (x, y)
    return m, batch, TraceSession(m, batch, device="cuda")


@pytest.mark.parametrize("gpu", ["T4", "V100-16GB"])  # Turing (7.5) and Volta (7.0) have no bf16 arithmetic
@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true", ["bf16-mixed", "32-true"]])
def test_bf16_refused_on_gpus_without_it(model, batch, gpu, precision):
    with pytest.raises(ConfigError, match="bf16"):
        memguard.plan(model, batch, global_batch_size=8, gpu=gpu, precision=precision)


def test_bf16_never_chosen_by_default_without_it(meta_mlp):
    model, batch, planner = meta_mlp
    kw = dict(global_batch_size=64, budget_bytes=4 << 30, activation_checkpointing=False)
    on_a100 = plan_with(planner, model, batch, gpu="A100-80GB", **kw)
    assert on_a100.precision == "bf16-mixed"  # the same question on Ampere picks bf16: the test can tell
    for gpu in ("T4", "V100-16GB"):
        p = plan_with(planner, model, batch, gpu=gpu, **kw)
        assert not p.precision.startswith("bf16"), p.explain()
        assert p.precision in ("16-mixed", "32-true")
        assert p.gpu == gpu


# ---------------------------------------------------------------------------------------------
# infeasible
# ---------------------------------------------------------------------------------------------


def test_infeasible_has_closest_plan_and_suggestions(model, batch, planner):
    budget = 64 * KiB  # below the parameters + optimizer state of the model alone
    with pytest.raises(InfeasiblePlanError) as info:
        plan_with(planner, model, batch, global_batch_size=16, device="cpu", budget_bytes=budget)
    err = info.value
    assert isinstance(err, MemguardError)
    closest = err.closest
    assert isinstance(closest, Plan)
    _check_invariant(closest, 16, 1)
    assert closest.estimate.peak_bytes > closest.usable_bytes
    assert closest.budget_bytes == budget
    assert err.suggestions
    text = str(err)
    assert "ZeRO-3" in text and "offload" in text
    # the closest plan is the smallest configuration: micro-batch 1 needs the least memory
    assert closest.micro_batch_size == 1


def test_infeasible_on_a_small_gpu_suggests_a_bigger_one():
    # 24 Linear(8192, 8192) layers on meta: 1.6e9 parameters, > 14.75 GiB of model states in any
    # precision with Adam (>= 12 bytes/param), so nothing fits one T4 without sharding
    with torch.device("meta"):
        big = nn.Sequential(*[nn.Linear(8192, 8192) for _ in range(24)])
    x = torch.empty(1, 8192, device="meta")
    with pytest.raises(InfeasiblePlanError) as info:
        memguard.plan(big, x, global_batch_size=8, gpu="T4", loss_fn=lambda m, b: m(b).sum(),
                      precision="16-mixed", activation_checkpointing=False)
    err = info.value
    assert isinstance(err.closest, Plan) and err.closest.gpu == "T4"
    assert any("GPU with more memory" in s for s in err.suggestions)
    assert any("ZeRO-3" in s for s in err.suggestions)


def test_zero3_over_many_ranks_fits_a_model_one_gpu_cannot_hold():
    # Regression: foreach optimizers' fp32 temporaries (as large as all parameters, 15 GiB here) were
    # once charged to every ZeRO rank, although each rank steps only its 1/64 partition.
    # 60 x Linear(8192, 8192) = 4.0e9 parameters on meta. ZeRO-3 over 64 ranks holds
    # 18 bytes x 4.0e9 / 64 = 1.1 GB + 4 x the largest layer (0.27 GB) of model states per rank
    # (DeepSpeed's estimate_zero3_model_states_mem_needs), and activations of one (1, 8192) row are
    # negligible: it must fit a 16 GB T4 easily.
    with torch.device("meta"):
        big = nn.Sequential(*[nn.Linear(8192, 8192) for _ in range(60)])
    x = torch.empty(1, 8192, device="meta")
    p = memguard.plan(big, x, global_batch_size=64, world_size=64, gpu="T4", zero_stage=3, precision="16-mixed",
                      activation_checkpointing=False, loss_fn=lambda m, b: m(b).float().pow(2).mean())
    assert p.zero_stage == 3
    assert p.estimate.peak_bytes < 4 << 30
