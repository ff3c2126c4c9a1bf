"""Multi-stage pipeline schedules (``Interleaved1F1B``, ``ZBVZeroBubble``): the stage layouts, the checks, and
real 2-rank gloo runs against the per-rank estimate."""

from __future__ import annotations

import pytest
import torch
import transformers

import memguard
from memguard.errors import ConfigError
from memguard.estimator._pipeline import rank_stage_indices, split_decoder_stages

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")


def _llama(layers=4):
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                   max_position_embeddings=64)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(cfg)


def _batch(m=4, seq=32):
    ids = torch.zeros(m, seq, dtype=torch.long)
    return {"input_ids": ids, "labels": ids}


@pytest.fixture(scope="module")
def llama():
    return _llama()


def test_stage_layouts_are_torchs():
    # the loop layout (stage s on rank s % pp) and the V layout (rank r holds r and 2 pp - 1 - r), as
    # generate_stage_to_rank_mapping and ScheduleZBVZeroBubble lay them out
    assert [rank_stage_indices(r, 2, 2, "loop") for r in range(2)] == [[0, 2], [1, 3]]
    assert [rank_stage_indices(r, 4, 3, "loop") for r in range(4)] == [[0, 4, 8], [1, 5, 9], [2, 6, 10], [3, 7, 11]]
    assert [rank_stage_indices(r, 2, 2, "v") for r in range(2)] == [[0, 3], [1, 2]]
    assert [rank_stage_indices(r, 4, 2, "v") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]


def test_split_keeps_each_stages_blocks_and_cuts_the_model_to_the_ranks():
    model = _llama(layers=8)
    blocks = list(model.model.layers)
    stages = split_decoder_stages(model, [0, 3], 4)  # V layout, rank 0 of 2: the first and the last stage
    assert [list(s.model.model.layers) for s in stages] == [blocks[0:2], blocks[6:8]]
    assert stages[0].first and not stages[0].last and stages[1].last and not stages[1].first
    assert stages[0].model.lm_head is None and stages[1].model.model.embed_tokens is None
    # the rank's model holds exactly its stages' parameters, the stages none in common
    ids = [{id(p) for p in s.parameters()} for s in stages]
    assert not ids[0] & ids[1] and ids[0] | ids[1] == {id(p) for p in model.parameters()}
    assert list(model.model.layers) == blocks[0:2] + blocks[6:8] and model.lm_head is not None


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "ZBVZeroBubble"])
def test_multi_stage_schedules_estimate_every_rank(llama, schedule):
    est = memguard.estimate(llama, _batch(), device="cpu",
                            layout=memguard.Layout(pp=2, pp_schedule=schedule, pp_microbatches=4))
    assert len(est.rank_peak_bytes) == 2 and est.peak_bytes == max(est.rank_peak_bytes)
    assert len(set(est.rank_peak_bytes)) == 2
    assert any("2 virtual stages per rank (4 in all)" in n for n in est.notes)


def test_interleaved_takes_the_stages_per_rank_it_is_given():
    # 8 blocks in 2 x 4 virtual stages: each rank holds 4 blocks either way, in 4 stages of 1 instead of 2 of 2
    model = _llama(layers=8)
    two = memguard.estimate(model, _batch(), device="cpu",
                            layout=memguard.Layout(pp=2, pp_schedule="Interleaved1F1B", pp_microbatches=4))
    four = memguard.estimate(model, _batch(), device="cpu",
                             layout=memguard.Layout(pp=2, pp_schedule="Interleaved1F1B", pp_microbatches=4,
                                                    pp_stages_per_rank=4))
    assert any("4 virtual stages per rank (8 in all)" in n for n in four.notes)
    assert four.breakdown["params"] == two.breakdown["params"]  # the same blocks per rank, differently cut
    assert four.rank_peak_bytes != two.rank_peak_bytes  # the schedule keeps different micro-batches in flight


def test_zbv_puts_the_head_and_the_embeddings_on_rank_0(llama):
    # the V layout: rank 0 holds stage 0 (embeddings) and stage 3 (final norm, head, loss); rank 1 the middle two
    # blocks only; under the loop layout rank 1 holds the head
    zbv = memguard.estimate(llama, _batch(), device="cpu",
                            layout=memguard.Layout(pp=2, pp_schedule="ZBVZeroBubble", pp_microbatches=4))
    loop = memguard.estimate(llama, _batch(), device="cpu",
                             layout=memguard.Layout(pp=2, pp_schedule="Interleaved1F1B", pp_microbatches=4))
    assert zbv.rank_peak_bytes[0] > zbv.rank_peak_bytes[1]
    assert zbv.rank_peak_bytes[0] > loop.rank_peak_bytes[0]


@pytest.mark.parametrize("layout, kwargs, needles", [
    # ZBV takes exactly two stages per rank (ScheduleZBVZeroBubble.__init__)
    (memguard.Layout(pp=2, pp_schedule="ZBVZeroBubble", pp_stages_per_rank=3), {},
     ["takes exactly 2 stages per rank", "pp_stages_per_rank=2"]),
    # interleaving needs two or more; one stage per rank is 1F1B
    (memguard.Layout(pp=2, pp_schedule="Interleaved1F1B", pp_stages_per_rank=1), {},
     ["2 or more stages per rank", "pp_schedule='1F1B'"]),
    (memguard.Layout(pp=2, pp_schedule="1F1B", pp_stages_per_rank=2), {},
     ["needs a multi-stage schedule", "'Interleaved1F1B'"]),
    (memguard.Layout(pp=2, pp_schedule="Interleaved1F1B", pp_stages_per_rank=0), {}, ["must be an integer >= 1"]),
    # ScheduleInterleaved1F1B: n_microbatches a multiple of max(1, n_microbatches // pp): 5 // 2 = 2 rounds
    (memguard.Layout(pp=2, pp_schedule="Interleaved1F1B", pp_microbatches=5), {},
     ["multiple of max(1, pp_microbatches // pp) = 2", "use one of 1, 2, 3, 4, 6, 8"]),
    # 4 blocks do not make 2 x 3 virtual stages
    (memguard.Layout(pp=2, pp_schedule="Interleaved1F1B", pp_stages_per_rank=3, pp_microbatches=4), {},
     ["needs at least 6 blocks, the model has 4"]),
    # not estimated yet: FSDP2 or TP inside the stages, activation checkpointing
    (memguard.Layout(pp=2, tp=2, pp_schedule="ZBVZeroBubble"), {}, ["with dp_shard or tp inside the stages"]),
    (memguard.Layout(pp=2, pp_schedule="ZBVZeroBubble", pp_microbatches=4), dict(activation_checkpointing=True),
     ["activation_checkpointing is not estimated under Layout(pp_schedule='ZBVZeroBubble')"]),
])
def test_invalid_multi_stage_layouts_say_what_would_work(llama, layout, kwargs, needles):
    with pytest.raises(ConfigError) as info:
        memguard.estimate(llama, _batch(), device="cpu", layout=layout, **kwargs)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "ZBVZeroBubble"])
def test_a_real_multi_stage_pipeline_run_matches_the_estimate_per_rank(schedule):
    """Both ranks of a 2-rank pipeline with 2 virtual stages each (the 4-block Llama, 4 micro-batches) against
    a real gloo run: within 3% of each rank's real peak (benchmarks/results/layouts_cpu.md lists the figures)."""
    from benchmarks.layouts_cpu import Case, estimate_case, run_case, single_process_loss

    case = Case("llama", 1, pp=2, pp_schedule=schedule)
    ranks = run_case(case, steps=1, timeout=300)
    assert all("error" not in r for r in ranks), ranks
    est = estimate_case(case)
    assert len(ranks) == 2 and len(est["rank_peak_bytes"]) == 2
    for r in ranks:
        real = r["peak_bytes"]
        assert abs(est["rank_peak_bytes"][r["rank"]] - real) <= 0.03 * real, (est, r)
    # only the rank that holds the last stage computes the loss: rank 1 under the loop layout, rank 0 under V
    holder = 0 if schedule == "ZBVZeroBubble" else 1
    assert [r["rank"] for r in ranks if r["first_loss"] is not None] == [holder], ranks
    loss = single_process_loss(case)
    assert [r["first_loss"] for r in ranks if r["first_loss"] is not None] == [pytest.approx(loss, rel=1e-5)]
