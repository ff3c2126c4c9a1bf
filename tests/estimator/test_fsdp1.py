"""FSDP1 estimates (``strategy="fsdp1"``): option checks and what the traced FSDP1 step holds.

The estimate traces ``FullyShardedDataParallel`` itself (each repeated block its own unit, the root the
rest) over a fake process group; these tests pin what rank 0 of that trace must hold, from FSDP1's
source (torch 2.13, ``torch/distributed/fsdp/_flat_param.py``). The real 2-rank gloo comparison is
``tests/benchmarks/test_fsdp1_cpu_smoke.py`` (and ``benchmarks/results/fsdp1_cpu.md``).
"""

from __future__ import annotations

import pytest
import torch
import transformers

import memguard
from memguard.errors import ConfigError

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")


@pytest.fixture(scope="module")
def model():
    cfg = transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=512, n_positions=64)
    with torch.device("meta"):
        return transformers.GPT2LMHeadModel(cfg)


def _batch(m=2, seq=32):
    ids = torch.zeros(m, seq, dtype=torch.long)
    return {"input_ids": ids, "labels": ids}


_ESTIMATES: dict = {}


def _fsdp1(model, **kwargs):
    """``memguard.estimate(strategy="fsdp1", device="cpu", world_size=2, zero_stage=3, ...)``, once per set
    of options (the tests share a handful of traces)."""
    kwargs = {"device": "cpu", "strategy": "fsdp1", "world_size": 2, "zero_stage": 3, **kwargs}
    key = repr(sorted(kwargs.items()))
    if key not in _ESTIMATES:
        _ESTIMATES[key] = memguard.estimate(model, _batch(), **kwargs)
    return _ESTIMATES[key]


def _unit_numels(model):
    """Parameters of each FSDP1 unit: one per transformer block (ModuleWrapPolicy of the block class), and the
    root with the rest (GPT-2's tied lm_head is wte: FlatParamHandle flattens a shared parameter once)."""
    blocks = [sum(p.numel() for p in b.parameters()) for b in model.transformer.h]
    return blocks + [sum(p.numel() for p in model.parameters()) - sum(blocks)]


def _shard(numel, world):
    """Rank 0's padded shard of a flat parameter: the first ``torch.chunk`` of world chunks, ceil(numel / world)
    elements (FlatParamHandle._get_shard, padded to that size)."""
    return -(-numel // world)


# ---------------------------------------------------------------------------------------------
# options
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, needles", [
    # FSDP1 has no level 1, and its CPUOffload is not modelled: both reported at once
    (dict(strategy="fsdp1", zero_stage=1, offload_optimizer=True), ["FSDP1 has no level 1", "CPUOffload"]),
    # FSDP1's options without FSDP1
    (dict(strategy="fsdp2", zero_stage=3, fsdp1_options={"use_orig_params": False}), ["strategy='fsdp1' only"]),
    # an unknown option and a wrong type
    (dict(strategy="fsdp1", zero_stage=3, fsdp1_options={"sync_module_states": True, "use_orig_params": "yes"}),
     ["['sync_module_states'] is not an FSDP1 option", "must be True or False"]),
])
def test_invalid_fsdp1_options_are_listed_together(model, kwargs, needles):
    with pytest.raises(ConfigError) as info:
        memguard.estimate(model, _batch(), device="cpu", world_size=2, **kwargs)
    text = str(info.value)
    for needle in needles:
        assert needle in text, text
    assert len(info.value.problems) == len(needles)


# ---------------------------------------------------------------------------------------------
# what the FSDP1 trace holds
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 4])
def test_rank_holds_padded_flat_shards_and_their_adam_state(model, world):
    est = _fsdp1(model, world_size=world, fsdp1_options={"use_orig_params": False})
    units = _unit_numels(model)
    # without use_orig_params AdamW steps the sharded flat parameters: two fp32 moments of each padded shard
    # and a 4-byte scalar step per flat parameter (torch/optim/adam.py, _init_group)
    assert est.breakdown["optimizer"] == sum(2 * 4 * _shard(n, world) + 4 for n in units)
    # the fp32 shards, plus whatever is unsharded at the peak
    assert est.breakdown["params"] >= sum(4 * _shard(n, world) for n in units)
    assert est.strategy == "fsdp1"
    assert any("FULL_SHARD" in n and "use_orig_params=False" in n for n in est.notes), est.notes


def test_a_lora_model_gets_peft_units_and_every_frozen_shard_is_counted():
    # peft's fsdp_auto_wrap_policy (the HF Trainer's for a PEFT model) makes each adapter leaf a unit of its own;
    # without it FSDP1 refuses a block of frozen and trainable parameters under use_orig_params=False
    peft = pytest.importorskip("peft")
    from memguard.estimator._fsdp1 import ADAPTER_UNITS_NOTE, FSDP1Layout, wraps_trainable_leaves

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
    with torch.device("meta"):
        lora = peft.get_peft_model(transformers.LlamaForCausalLM(cfg),
                                   peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    flat = FSDP1Layout(world_size=2, use_orig_params=False)
    assert wraps_trainable_leaves(lora, flat) and wraps_trainable_leaves(lora, FSDP1Layout(world_size=2))
    with torch.device("meta"):
        plain = transformers.LlamaForCausalLM(cfg)
    assert not wraps_trainable_leaves(plain, flat)  # nothing frozen: one unit per block
    by_mode = {orig: memguard.estimate(lora, _batch(), device="cpu", strategy="fsdp1", world_size=2, zero_stage=3,
                                       fsdp1_options={"use_orig_params": orig}) for orig in (True, False)}
    for est in by_mode.values():
        assert ADAPTER_UNITS_NOTE in est.notes, est.notes
    # each unit's shard is held whichever view its flat parameter shows when the step starts: the two modes
    # hold the same bytes at the peak (benchmarks/results/fsdp1_cpu.md, the -lora cases: real runs agree)
    assert by_mode[True].peak_bytes == by_mode[False].peak_bytes
    # a plain model is wrapped per block, with no note
    est = memguard.estimate(plain, _batch(), device="cpu", strategy="fsdp1", world_size=2, zero_stage=3)
    assert ADAPTER_UNITS_NOTE not in est.notes


def test_original_parameters_add_only_their_own_step_counters(model):
    # with use_orig_params the optimizer steps each original parameter's view into the shard: the same moments
    # (the views cover the shard's unpadded elements; padding is at the end of the last rank's chunk), and one
    # 4-byte step per original parameter instead of one per flat parameter; nothing else changes (the real runs
    # of both modes peak alike, benchmarks/results/fsdp1_cpu.md)
    orig, flat = _fsdp1(model), _fsdp1(model, fsdp1_options={"use_orig_params": False})
    params = len(list(model.parameters()))
    assert orig.peak_bytes - flat.peak_bytes == 4 * (params - len(_unit_numels(model)))


def test_shard_grad_op_keeps_every_block_unsharded_until_backward(model):
    # SHARD_GRAD_OP frees no unit after its forward (_runtime_utils.py, _should_free_in_backward), FULL_SHARD
    # frees each before the next unit's all-gather: by the end of forward SHARD_GRAD_OP holds every block's
    # unsharded parameters on top of the same activations, FULL_SHARD at most one
    full, grad_op = _fsdp1(model), _fsdp1(model, zero_stage=2)
    block_bytes = 4 * _unit_numels(model)[0]
    assert grad_op.phase_peaks["forward"] - full.phase_peaks["forward"] >= (len(model.transformer.h) - 1) * block_bytes


def test_no_shard_holds_the_whole_model_and_its_adam_state(model):
    est = _fsdp1(model, zero_stage=0)
    total = sum(p.numel() for p in model.parameters())
    # NO_SHARD shards nothing (FlatParamHandle.shard returns early): every rank has all fp32 parameters, and
    # AdamW's two moments of each original parameter with its step
    assert est.breakdown["params"] >= 4 * total
    assert est.breakdown["optimizer"] == 2 * 4 * total + 4 * len(list(model.parameters()))


def test_accumulation_starts_from_the_sharded_gradients(model):
    # a micro-batch after the first finds the sharded gradient of the one before, which FSDP1 accumulates into
    # (_runtime_utils.py, _accumulate_sharded_grad): fp32, each unit's padded shard
    est = _fsdp1(model, zero_stage=2, grad_accum_steps=2)
    assert est.breakdown["grads"] >= sum(4 * _shard(n, 2) for n in _unit_numels(model))
    assert est.peak_bytes > _fsdp1(model, zero_stage=2).peak_bytes


def test_mixed_precision_keeps_fp32_shards_and_computes_in_bf16(model):
    bf16, fp32 = _fsdp1(model, precision="bf16-mixed"), _fsdp1(model)
    # MixedPrecision casts at the all-gather: the sharded fp32 parameters and their fp32 AdamW state stay
    assert bf16.breakdown["optimizer"] == fp32.breakdown["optimizer"]
    # the forward and backward run in bf16: fewer activation bytes
    assert bf16.breakdown["activations"] < fp32.breakdown["activations"]
    # Lightning's and Accelerate's FSDP1 MixedPrecision: param, reduce and buffer dtype all bf16
    assert any("param_dtype=bfloat16, reduce_dtype=bfloat16, buffer_dtype=bfloat16" in n for n in bf16.notes)


def test_fsdp1_estimate_leaves_no_process_group_behind(model):
    _fsdp1(model)
    assert not torch.distributed.is_initialized()


# ---------------------------------------------------------------------------------------------
# planning FSDP1
# ---------------------------------------------------------------------------------------------


def test_plan_request_searches_fsdp1_at_its_two_sharding_levels():
    from memguard.planner._request import PlanRequest

    # FULL_SHARD (3) and SHARD_GRAD_OP (2); FSDP1 has no level 1 and NO_SHARD is DDP's job
    space = PlanRequest(global_batch_size=8, world_size=2, device="cpu", budget_bytes=1 << 30, strategy="fsdp1").resolve()
    assert space.shardings == (("fsdp1", 2), ("fsdp1", 3))
    problems = PlanRequest(global_batch_size=8, world_size=2, device="cpu", budget_bytes=1 << 30, strategy="fsdp1",
                           zero_stage=1).problems()
    assert any("no sharding fits both" in p and "'fsdp1' 2-3" in p for p in problems), problems


def test_plan_obeys_a_fixed_fsdp1_strategy(model):
    p = memguard.plan(model, _batch(), global_batch_size=4, device="cpu", world_size=2, budget_bytes=1 << 34,
                      strategy="fsdp1", zero_stage=3, precision="bf16-mixed", activation_checkpointing=False)
    # ample memory: FSDP1 at the level asked for, sized on the same FSDP1 trace as the estimate
    assert (p.strategy, p.zero_stage, p.micro_batch_size) == ("fsdp1", 3, 2)
    assert any("FullyShardedDataParallel" in n and "FULL_SHARD" in n for n in p.notes), p.notes
    assert p.estimate.peak_bytes == _fsdp1(model, precision="bf16-mixed").peak_bytes
    assert "FSDP1" in p.explain()
