"""Planning with a strategy: ``Plan.strategy``/``Plan.notes``, the request's checks, and the search
choosing FSDP2 where DDP does not fit."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

import memguard
from memguard import ConfigError, Plan
from memguard.planner._request import PlanRequest

from tests.planner.test_plan import _estimate, _plan


# ---------------------------------------------------------------------------------------------
# Plan fields
# ---------------------------------------------------------------------------------------------


def test_strategy_and_notes_round_trip_through_json():
    p = _plan(strategy="fsdp2", zero_stage=3, notes=("FSDP2: fully_shard each GPT2Block, then the root.",
                                                     "bf16-mixed under FSDP2 is MixedPrecisionPolicy(...)."))
    back = Plan.from_dict(json.loads(json.dumps(p.to_dict())))
    assert back == p and back.strategy == "fsdp2" and isinstance(back.notes, tuple)
    text = p.explain()
    assert "FSDP2, sharding level 3" in text
    for note in p.notes:
        assert note in text


@pytest.mark.parametrize("zero_stage, expected", [
    (0, "ddp"),        # a dict from before strategies existed: stage 0 was DDP (or one device)
    (2, "deepspeed"),  # and stages 1-3 were DeepSpeed ZeRO
])
def test_old_dicts_load_with_the_meaning_zero_stage_had(zero_stage, expected):
    d = _plan(zero_stage=zero_stage, offload_optimizer=False).to_dict()
    del d["strategy"], d["notes"]
    back = Plan.from_dict(d)
    assert back.strategy == expected and back.notes == ()


def test_unknown_plan_strategy_is_a_config_error():
    with pytest.raises(ConfigError, match="strategy"):
        _plan(strategy="fsdp")


@pytest.mark.parametrize("strategy, zero_stage", [("ddp", 2), ("fsdp2", 0), ("deepspeed", 0)])
def test_strategy_and_stage_must_agree(strategy, zero_stage):
    # DDP never shards; DeepSpeed and FSDP2 always do (stage/level 1-3)
    with pytest.raises(ConfigError, match="inconsistent"):
        _plan(strategy=strategy, zero_stage=zero_stage, offload_optimizer=False)


# ---------------------------------------------------------------------------------------------
# the request
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("options, needle", [
    (dict(strategy="fsdp"), "strategy='fsdp'"),                       # not a strategy
    (dict(strategy="ddp", zero_stage=2), "no sharding fits both"),    # DDP does not shard
    (dict(strategy="fsdp2", zero_stage=0), "no sharding fits both"),  # FSDP2 has no level 0
    (dict(strategy=("deepspeed",), zero_stage=(0,)), "no sharding fits both"),
])
def test_request_rejects_impossible_strategies(options, needle):
    problems = PlanRequest(global_batch_size=8, world_size=2, device="cpu", budget_bytes=1 << 30,
                           **options).problems()
    assert any(needle in p for p in problems), problems


def test_default_search_space_is_unchanged():
    # strategy=None: DDP at stage 0, DeepSpeed at stages 1-3, exactly the stages searched before
    space = PlanRequest(global_batch_size=8, world_size=2, device="cpu", budget_bytes=1 << 30).resolve()
    assert space.shardings == (("ddp", 0), ("deepspeed", 1), ("deepspeed", 2), ("deepspeed", 3))
    fsdp = PlanRequest(global_batch_size=8, world_size=2, device="cpu", budget_bytes=1 << 30,
                       strategy="fsdp2").resolve()
    assert fsdp.shardings == (("fsdp2", 1), ("fsdp2", 2), ("fsdp2", 3))


# ---------------------------------------------------------------------------------------------
# the search
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2():
    cfg = transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=512, n_positions=64)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.zeros(2, 32, dtype=torch.long)
    return model, {"input_ids": ids, "labels": ids}


def test_plan_picks_fsdp2_where_ddp_does_not_fit(gpt2):
    model, batch = gpt2
    fixed = dict(device="cpu", world_size=2, precision="32-true")
    fsdp = memguard.estimate(model, batch, strategy="fsdp2", zero_stage=3, **fixed)
    # DDP's smallest step (micro-batch 1, 2 accumulated) needs more than FSDP2's at micro-batch 2
    ddp = memguard.estimate(model, {k: v[:1] for k, v in batch.items()}, grad_accum_steps=2, **fixed)
    assert ddp.peak_bytes > fsdp.peak_bytes
    p = memguard.plan(model, batch, global_batch_size=4, budget_bytes=fsdp.peak_bytes, headroom=0.0,
                      strategy=("ddp", "fsdp2"), zero_stage=(0, 3), activation_checkpointing=False, **fixed)
    assert p.strategy == "fsdp2" and p.zero_stage == 3
    assert p.micro_batch_size * p.grad_accum_steps * p.world_size == 4
    assert p.estimate.peak_bytes <= fsdp.peak_bytes and p.estimate.strategy == "fsdp2"
    assert any("fully_shard" in n for n in p.notes) and "strategy" in p.reasons


def test_plan_obeys_a_fixed_strategy(gpt2):
    model, batch = gpt2
    p = memguard.plan(model, batch, global_batch_size=4, device="cpu", world_size=2, budget_bytes=1 << 34,
                      strategy="fsdp2", zero_stage=2, precision="bf16-mixed", activation_checkpointing=False)
    # ample memory: the plan is FSDP2 at the level asked for, with the policy spelled out
    assert (p.strategy, p.zero_stage, p.micro_batch_size) == ("fsdp2", 2, 2)
    assert any("MixedPrecisionPolicy(param_dtype=torch.bfloat16" in n for n in p.notes)
    est = memguard.estimate(model, batch, device="cpu", world_size=2, strategy="fsdp2", zero_stage=2,
                            precision="bf16-mixed")
    assert p.estimate.peak_bytes == est.peak_bytes  # verified with the same full trace
