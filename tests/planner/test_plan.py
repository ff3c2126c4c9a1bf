"""Tests of the :class:`memguard.Plan` result: the batch invariant, the JSON round trip, explain()."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import memguard
from memguard import ConfigError, Estimate, Plan
from memguard.planner._plan import PLAN_FORMAT_VERSION

PRECISIONS = ("32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true")


def _estimate(**over) -> Estimate:
    fields = dict(
        peak_bytes=3_000,
        breakdown={"params": 1_000, "grads": 500, "optimizer": 1_000, "activations": 400, "temporaries": 100},
        context_bytes=0,
        peak_phase="backward",
        allocated_peak_bytes=3_000,
        device="cpu",
        precision="32-true",
        zero_stage=0,
        world_size=1,
        gpu=None,
        micro_batch_size=4,
        num_params=250,
        num_trainable_params=250,
        model_state_bytes=2_500,
        phase_peaks={"forward": 2_500, "backward": 3_000, "optimizer": 2_900},
    )
    fields.update(over)
    return Estimate(**fields)


def _plan(**over) -> Plan:
    fields = dict(
        micro_batch_size=4, grad_accum_steps=3, world_size=2, global_batch_size=24, precision="bf16-mixed",
        activation_checkpointing=True, checkpoint_blocks=2, zero_stage=2, offload_optimizer=True,
        budget_bytes=10_000, estimate=_estimate(), device="cuda", gpu="A100-80GB", headroom=0.1,
        throughput=123.456789, reasons={"micro_batch_size": "because", "precision": "fastest"},
        block_class="GPT2Block", hidden_size=768,
    )
    fields.update(over)
    return Plan(**fields)


# ---------------------------------------------------------------------------------------------
# invariant
# ---------------------------------------------------------------------------------------------


def test_inconsistent_batch_arithmetic_is_a_config_error():
    # 4 x 3 x 2 = 24, not 25: a plan that does not multiply out must never exist
    with pytest.raises(ConfigError, match="global_batch_size"):
        _plan(global_batch_size=25)


def test_replace_checks_the_invariant_again():
    p = _plan()
    assert p.replace(micro_batch_size=2, grad_accum_steps=6).global_batch_size == 24
    with pytest.raises(ConfigError):
        p.replace(micro_batch_size=5)


def test_plan_is_frozen():
    p = _plan()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.micro_batch_size = 8  # type: ignore[misc]
    with pytest.raises(TypeError):
        p.reasons["x"] = "y"  # type: ignore[index]


def test_usable_bytes_is_budget_less_headroom():
    # 10% of 10_000 kept free leaves 9_000
    assert _plan(budget_bytes=10_000, headroom=0.1).usable_bytes == 9_000
    assert _plan(budget_bytes=10_000, headroom=0.0).usable_bytes == 10_000


# ---------------------------------------------------------------------------------------------
# serialisation
# ---------------------------------------------------------------------------------------------


def test_json_round_trip_is_equal():
    p = _plan()
    d = json.loads(json.dumps(p.to_dict()))
    assert d["format_version"] == PLAN_FORMAT_VERSION
    q = Plan.from_dict(d)
    assert q == p
    assert q.estimate == p.estimate
    assert dict(q.reasons) == dict(p.reasons)
    assert q.to_dict() == p.to_dict()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    micro=st.integers(1, 512),
    accum=st.integers(1, 64),
    world=st.integers(1, 128),
    precision=st.sampled_from(PRECISIONS),
    blocks=st.integers(0, 80),
    zero=st.integers(0, 3),
    offload=st.booleans(),
    budget=st.integers(1, 1 << 44),
    headroom=st.floats(0, 0.99, allow_nan=False),
    throughput=st.floats(0, 1e9, allow_nan=False, allow_infinity=False),
    gpu=st.one_of(st.none(), st.sampled_from(["A100-80GB", "H100-80GB", "T4"])),
    reasons=st.dictionaries(st.sampled_from(["micro_batch_size", "precision", "zero_stage"]), st.text(max_size=20)),
    peak=st.integers(0, 1 << 44),
)
def test_json_round_trip_property(micro, accum, world, precision, blocks, zero, offload, budget, headroom,
                                  throughput, gpu, reasons, peak):
    p = Plan(
        micro_batch_size=micro, grad_accum_steps=accum, world_size=world, global_batch_size=micro * accum * world,
        precision=precision, activation_checkpointing=blocks > 0, checkpoint_blocks=blocks, zero_stage=zero,
        offload_optimizer=offload, budget_bytes=budget, estimate=_estimate(peak_bytes=peak, precision=precision),
        device="cuda" if gpu else "cpu", gpu=gpu, headroom=headroom, throughput=throughput, reasons=reasons,
    )
    assert Plan.from_dict(json.loads(json.dumps(p.to_dict()))) == p


def test_from_dict_refuses_other_versions_and_missing_fields():
    d = _plan().to_dict()
    with pytest.raises(ConfigError, match="format version"):
        Plan.from_dict({**d, "format_version": PLAN_FORMAT_VERSION + 1})
    partial = {k: v for k, v in d.items() if k not in ("micro_batch_size", "estimate")}
    with pytest.raises(ConfigError) as info:
        Plan.from_dict(partial)
    # both missing fields named in one error
    assert "micro_batch_size" in str(info.value) and "estimate" in str(info.value)
    with pytest.raises(ConfigError, match="mapping"):
        Plan.from_dict([1, 2, 3])  # type: ignore[arg-type]


def test_from_dict_ignores_unknown_keys():
    # a newer writer may add fields within the same format version; readers keep what they know
    d = {**_plan().to_dict(), "some_future_field": 1}
    assert Plan.from_dict(d) == _plan()


# ---------------------------------------------------------------------------------------------
# explain()
# ---------------------------------------------------------------------------------------------


def test_explain_mentions_every_knob_and_the_numbers():
    p = _plan()
    text = p.explain().lower()
    for needle in ("micro-batch 4", "accumulation 3", "world 2", "global batch 24", "bf16-mixed",
                   "checkpointing", "2 blocks", "gpt2block", "zero stage", "2", "offload",
                   "headroom", "a100-80gb"):
        assert needle in text, needle
    # every reason is shown, and every non-zero breakdown category
    for reason in p.reasons.values():
        assert reason in p.explain()
    for category in ("params", "grads", "optimizer", "activations", "temporaries"):
        assert category in text
    assert str(p) == p.explain()


def test_explain_says_checkpointing_is_off():
    p = _plan(activation_checkpointing=False, checkpoint_blocks=0, offload_optimizer=False, zero_stage=0)
    text = p.explain()
    assert "checkpointing off" in " ".join(text.split())
    assert "ZeRO stage" in text and "precision" in text


def test_public_names():
    assert memguard.Plan is Plan
    assert "Plan" in memguard.__all__ and "plan" in memguard.__all__
