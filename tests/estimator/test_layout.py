"""Layouts: ``memguard.Layout``, its checks, and per-rank estimates of tensor-parallel and FSDP2 x TP
steps (``parallelize_module`` traced over a fake process group), with one real 2-rank gloo run."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

import memguard
from memguard.errors import ConfigError
from memguard.estimator._layout import default_plan_by_name, resolve_tp_plan

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")


def _llama(heads=4, kv=2, hidden=128, inter=344, layers=2):
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                                   num_attention_heads=heads, num_key_value_heads=kv, vocab_size=512,
                                   max_position_embeddings=64)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(cfg)


def _batch(m=2, seq=32):
    ids = torch.zeros(m, seq, dtype=torch.long)
    return {"input_ids": ids, "labels": ids}


@pytest.fixture(scope="module")
def llama():
    return _llama()


_ESTIMATES: dict = {}


def _est(model, layout, **kwargs):
    key = (id(model), layout, tuple(sorted(kwargs.items())))
    if key not in _ESTIMATES:
        _ESTIMATES[key] = memguard.estimate(model, _batch(), device="cpu", layout=layout, **kwargs)
    return _ESTIMATES[key]


# ---------------------------------------------------------------------------------------------
# the Layout object and the Estimate's rank_peak_bytes
# ---------------------------------------------------------------------------------------------


def test_layout_is_frozen_and_its_world_is_the_product():
    layout = memguard.Layout(dp_replicate=1, dp_shard=2, tp=4)
    assert layout.world_size == 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.tp = 2
    assert memguard.Layout() == memguard.Layout(pp_schedule="1F1B") and memguard.Layout().world_size == 1


def test_estimate_without_layout_has_one_rank_entry(llama):
    est = memguard.estimate(llama, _batch(), device="cpu")
    assert est.rank_peak_bytes == (est.peak_bytes,)
    again = memguard.Estimate.from_dict(est.to_dict())
    assert again.rank_peak_bytes == est.rank_peak_bytes and again.to_dict()["rank_peak_bytes"] == [est.peak_bytes]


def test_rank_peaks_must_have_the_peak_as_maximum():
    est = memguard.estimate(torch.nn.Linear(4, 4), torch.zeros(2, 4), device="cpu",
                            loss_fn=lambda m, b: m(b).sum())
    with pytest.raises(ValueError, match="max"):
        dataclasses.replace(est, rank_peak_bytes=(est.peak_bytes + 1, est.peak_bytes))


# ---------------------------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout, kwargs, needles", [
    # degrees must be positive integers; schedule names are torch's; both reported at once
    (memguard.Layout(tp=0, pp_schedule="zigzag"), {}, ["Layout(tp=0)", "pp_schedule='zigzag'"]),
    # no DDP over pipeline stages yet (FSDP2 and TP inside stages are estimated); two stages per rank need
    # 4 blocks, the model has 2; 1F1B needs micro-batches >= stages
    (memguard.Layout(pp=2, dp_replicate=2), {}, ["(DDP over pipeline stages) is not estimated yet",
                                                 "dp_shard=2"]),
    (memguard.Layout(pp=2, pp_schedule="Interleaved1F1B"), {}, ["with 2 stages per rank needs at least 4 blocks"]),
    (memguard.Layout(pp=4, pp_microbatches=2), {}, ["must be >= pp=4 under 1F1B"]),
    # 2 blocks cannot make 3 stages; 2 rows do not split into 3 micro-batches
    (memguard.Layout(pp=3, pp_schedule="GPipe", pp_microbatches=3), {}, ["needs at least 3 blocks",
                                                                         "do not split into pp_microbatches=3"]),
    (memguard.Layout(pp=2), dict(loss_fn=lambda m, b: m(**b).loss), ["drop loss_fn"]),
    # world_size is the layout's; a different one conflicts
    (memguard.Layout(tp=2), dict(world_size=4), ["world_size=4 conflicts with the layout's 2 ranks"]),
    # DeepSpeed's ZeRO takes no layout
    (memguard.Layout(dp_shard=2), dict(strategy="deepspeed", zero_stage=2), ["strategy='deepspeed' does not take"]),
    # DDP cannot be the dp_shard dimension
    (memguard.Layout(dp_shard=2), dict(strategy="ddp"), ["strategy='ddp' conflicts"]),
    # a sharding level needs a dp_shard dimension to shard over
    (memguard.Layout(tp=2), dict(zero_stage=3), ["zero_stage=3 shards over the layout's dp_shard dimension"]),
    # DDP over TP shards is not modelled: say what is
    (memguard.Layout(dp_replicate=2, tp=2), {}, ["DDP over tensor-parallel shards", "HSDP x TP"]),
    # 3 divides none of 4 heads, 2 kv-heads, hidden 128, intermediate 344: all four reported
    (memguard.Layout(tp=3), {}, ["num_attention_heads=4", "num_key_value_heads=2", "hidden_size=128",
                                 "intermediate_size=344"]),
    # a plan naming modules the model lacks, and a style that is not one
    (memguard.Layout(tp=2, tp_plan={"blocks.*.qkv": "colwise", "model.layers.*.mlp.up_proj": "diagonal"}), {},
     ["match no module", "style 'diagonal'"]),
    (("not a layout"), {}, ["layout must be a memguard.Layout"]),
])
def test_invalid_layouts_say_what_would_work(llama, layout, kwargs, needles):
    with pytest.raises(ConfigError) as info:
        memguard.estimate(llama, _batch(), device="cpu", layout=layout, **kwargs)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


def test_a_model_with_nothing_to_shard_is_refused():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    with pytest.raises(ConfigError, match="pass Layout\\(tp_plan="):
        memguard.estimate(model, torch.zeros(2, 8), device="cpu", layout=memguard.Layout(tp=2),
                          loss_fn=lambda m, b: m(b).sum())


# ---------------------------------------------------------------------------------------------
# the plan
# ---------------------------------------------------------------------------------------------


def test_default_plan_is_the_configs_base_model_tp_plan(llama):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    problems: list[str] = []
    plan, source = resolve_tp_plan(llama, memguard.Layout(tp=2), problems)
    assert not problems and source == "the config's base_model_tp_plan"
    # transformers' Llama plan names the base model's modules: prefixed with base_model_prefix "model"
    assert isinstance(plan["model.layers.*.self_attn.q_proj"], ColwiseParallel)
    assert isinstance(plan["model.layers.*.mlp.down_proj"], RowwiseParallel)
    assert len(plan) == 7  # q, k, v, gate, up colwise; o, down rowwise; embeddings, norms, head replicated


def test_plan_by_name_for_a_gpt_style_block():
    from benchmarks.layouts_cpu import build_model

    # the GPT-2-shaped model has no config: its Linear layers are found by name in the repeated blocks
    assert default_plan_by_name(build_model("gpt", "meta")) == {
        "h.*.attn.q_proj": "colwise", "h.*.attn.k_proj": "colwise", "h.*.attn.v_proj": "colwise",
        "h.*.attn.out_proj": "rowwise", "h.*.c_fc": "colwise", "h.*.c_proj": "rowwise",
    }


# ---------------------------------------------------------------------------------------------
# estimates
# ---------------------------------------------------------------------------------------------


def _local_param_bytes(model, tp):
    """Parameter bytes on one tensor-parallel rank under transformers' Llama plan: the seven
    projections (no biases) hold 1/tp of their weight (ColwiseParallel: Shard(0), RowwiseParallel:
    Shard(1)); embeddings, norms and the head are whole."""
    sharded = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    total = 0
    for name, p in model.named_parameters():
        n = p.numel() * p.element_size()
        total += n // tp if name.split(".")[-2] in sharded else n
    return total


def test_tensor_parallel_estimate_holds_the_local_shards(llama):
    est = _est(llama, memguard.Layout(tp=2))
    single = _est(llama, None)
    assert est.rank_peak_bytes == (est.peak_bytes,) * 2 and est.world_size == 2
    buffers = sum(b.numel() * b.element_size() for b in llama.buffers())  # rotary inv_freq, whole on each rank
    # at the peak (the optimizer step) every parameter exists once, as its local shard
    assert est.peak_phase == single.peak_phase == "optimizer"
    assert est.breakdown["params"] == _local_param_bytes(llama, 2) + buffers
    assert est.breakdown["params"] < single.breakdown["params"]
    assert est.peak_bytes < single.peak_bytes
    assert any("parallelize_module" in n for n in est.notes)


def test_fsdp2_by_tp_has_four_equal_ranks_below_either_alone(llama):
    both = _est(llama, memguard.Layout(dp_shard=2, tp=2))
    tp_only, fsdp_only = _est(llama, memguard.Layout(tp=2)), _est(llama, memguard.Layout(dp_shard=2))
    assert both.rank_peak_bytes == (both.peak_bytes,) * 4 and both.strategy == "fsdp2"
    # the sharded optimizer state: a quarter of the projections' state, half of the rest (FSDP2 shards
    # every parameter over dp_shard; TP halves the projections again)
    assert both.breakdown["optimizer"] < min(tp_only.breakdown["optimizer"], fsdp_only.breakdown["optimizer"])
    assert both.peak_bytes < min(tp_only.peak_bytes, fsdp_only.peak_bytes)


def test_data_parallel_layouts_are_the_existing_estimates(llama):
    fsdp = memguard.estimate(llama, _batch(), device="cpu", strategy="fsdp2", zero_stage=3, world_size=2)
    ddp = memguard.estimate(llama, _batch(), device="cpu", world_size=2)
    assert _est(llama, memguard.Layout(dp_shard=2)).rank_peak_bytes == (fsdp.peak_bytes,) * 2
    assert _est(llama, memguard.Layout(dp_replicate=2)).rank_peak_bytes == (ddp.peak_bytes,) * 2


def test_hsdp_shards_over_dp_shard_only(llama):
    hsdp = _est(llama, memguard.Layout(dp_replicate=2, dp_shard=2))
    fsdp = _est(llama, memguard.Layout(dp_shard=2))
    # HSDP replicates over dp_replicate and shards over dp_shard: each rank holds the 2-way shards that
    # FSDP2 over 2 ranks holds (the reduce-scatter's output is then all-reduced in place over replicas)
    assert hsdp.rank_peak_bytes == (hsdp.peak_bytes,) * 4
    assert hsdp.breakdown["optimizer"] == fsdp.breakdown["optimizer"]
    assert any("HSDP" in n for n in hsdp.notes)


def test_sequence_parallel_plan_shrinks_the_norms_activations():
    from benchmarks.layouts_cpu import build_model, sequence_parallel_plan

    model = build_model("gpt", "meta")
    plain = memguard.estimate(model, _batch(2, 64), device="cpu", layout=memguard.Layout(tp=2))
    sp = memguard.estimate(model, _batch(2, 64), device="cpu",
                           layout=memguard.Layout(tp=2, tp_plan=sequence_parallel_plan()))
    # the LayerNorms and the residual stream hold half the sequence: fewer activation bytes in forward
    assert sp.phase_peaks["forward"] < plain.phase_peaks["forward"]
    assert sp.breakdown["params"] == plain.breakdown["params"]


def test_pipeline_ranks_differ_and_1f1b_keeps_fewer_micro_batches_in_flight(llama):
    batch = _batch(4, 32)
    gpipe = memguard.estimate(llama, batch, device="cpu", layout=memguard.Layout(pp=2, pp_schedule="GPipe",
                                                                                  pp_microbatches=4))
    f1b = memguard.estimate(llama, batch, device="cpu", layout=memguard.Layout(pp=2, pp_schedule="1F1B",
                                                                                pp_microbatches=4))
    for est in (gpipe, f1b):
        assert len(est.rank_peak_bytes) == 2 and est.peak_bytes == max(est.rank_peak_bytes)
        assert len(set(est.rank_peak_bytes)) == 2  # the stages hold different blocks, head and buffers
    # GPipe keeps all 4 micro-batches' activations on rank 0 before its first backward, 1F1B pp - 0 = 2
    # (the schedules' own action order, schedules.py)
    assert f1b.rank_peak_bytes[0] < gpipe.rank_peak_bytes[0]
    assert any("pipelining" in n for n in f1b.notes)


def test_pipeline_needs_a_decoder_it_can_cut():
    from benchmarks.layouts_cpu import build_model

    with pytest.raises(ConfigError, match="transformers decoder models"):
        memguard.estimate(build_model("gpt", "meta"), _batch(2, 32), device="cpu", layout=memguard.Layout(pp=2))


def test_cuda_target_refuses_a_foreach_step_over_mixed_dtensors(llama):
    # torch.optim defaults to foreach on CUDA; its kernels refuse the plan's DTensors mixed with the
    # whole embeddings/norms/head, so the estimate says how to step instead
    with pytest.raises(ConfigError, match="foreach=False"):
        memguard.estimate(llama, _batch(), device="cuda", layout=memguard.Layout(tp=2))
    est = memguard.estimate(llama, _batch(), device="cuda", layout=memguard.Layout(tp=2),
                            optimizer=lambda params: torch.optim.AdamW(params, foreach=False))
    assert est.rank_peak_bytes == (est.peak_bytes,) * 2 and est.breakdown["workspace"] > 0


@pytest.mark.slow
def test_a_real_two_rank_tensor_parallel_run_matches_the_estimate():
    from benchmarks.layouts_cpu import Case, estimate_case, run_case, single_process_loss

    case = Case("gpt", 2, batch=2, seq=32)
    ranks = run_case(case, steps=1, timeout=240)
    assert all("error" not in r for r in ranks), ranks
    est = estimate_case(case)
    loss = single_process_loss(case)
    for r in ranks:
        # the settled replay of a rank's allocator events against that rank's estimate: within 3%
        real = r["peak_bytes"]
        assert abs(est["rank_peak_bytes"][r["rank"]] - real) <= 0.03 * real, (est, r)
        assert r["first_loss"] == pytest.approx(loss, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_a_real_pipeline_run_matches_the_estimate_per_rank(tp):
    """Both stages of a 1F1B pipeline (alone on 2 ranks; with tensor parallelism inside each stage on 4) against a
    real gloo run: every rank's estimate equalled its real peak to the byte in the layouts benchmark
    (benchmarks/results/layouts_cpu.md); 0.5% leaves room for one run's allocator replay, not for a missing
    buffer (a send's held tensor is 0.3-0.5% of a rank here)."""
    from benchmarks.layouts_cpu import Case, estimate_case, run_case, single_process_loss

    case = Case("llama", tp, pp=2, pp_schedule="1F1B")
    ranks = run_case(case, steps=1, timeout=300)
    assert all("error" not in r for r in ranks), ranks
    est = estimate_case(case)
    loss = single_process_loss(case)
    assert len(ranks) == 2 * tp and len(est["rank_peak_bytes"]) == 2 * tp
    for r in ranks:
        real = r["peak_bytes"]
        assert abs(est["rank_peak_bytes"][r["rank"]] - real) <= 0.005 * real, (est, r)
    # only the last stage computes the loss (schedule.step returns it there)
    losses = [r["first_loss"] for r in ranks if r["first_loss"] is not None]
    assert losses == [pytest.approx(loss, rel=1e-5)] * tp, ranks
