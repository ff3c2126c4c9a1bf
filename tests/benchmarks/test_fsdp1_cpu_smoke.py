"""Smoke tests of benchmarks/fsdp1_cpu.py: its cases, its summary, and real 2-rank FSDP1 runs against
``memguard.estimate(strategy="fsdp1")`` (the full table is benchmarks/results/fsdp1_cpu.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `benchmarks`

pytest.importorskip("transformers")
from benchmarks import fsdp1_cpu as bench  # noqa: E402


def test_cases_cover_both_strategies_both_parameter_modes_and_both_precisions():
    cases = bench.all_cases()
    assert len({c.name for c in cases.values()}) == len(cases)
    two = [c for c in cases.values() if c.world_size == 2 and not c.lora]
    # 2 models x 2 precisions x 2 strategies x use_orig_params True/False at 2 ranks
    assert len(two) == 16
    # LoRA on a frozen Llama, wrapped by peft's fsdp_auto_wrap_policy: flat and original parameters, both levels
    lora = [c for c in cases.values() if c.lora]
    assert {(c.zero_stage, c.use_orig_params) for c in lora} == {(3, False), (3, True), (2, False)}
    assert {c.sharding_strategy for c in two} == {"FULL_SHARD", "SHARD_GRAD_OP"}
    assert cases["llama-w2-bf16-gradop-flat"] == bench.Case("llama", 2, "bf16-mixed", 2, False)


def test_summary_leaves_unclosed_ranks_out_and_takes_the_most_common_peak():
    # rank-runs: 100, 100, 104 closed; 130 did not close (a free the profiler missed): left out
    ranks = [{"peak_bytes": p, "residual_bytes": res, "phase_peaks": {"forward": p - 1, "backward": p}}
             for p, res in ((100, 0), (104, 0), (100, 0), (130, 8))]
    row = bench.summarise({"case": "x", "sharding_strategy": "SHARD_GRAD_OP", "runs": [ranks[:2], ranks[2:]], "estimate": {"peak_bytes": 102, "peak_phase": "forward",
                                                              "phase_peaks": {"forward": 102 + 3 * (1 << 20)}}})
    assert (row["real_peak_bytes"], row["real_typical_peak_bytes"], row["ranks_unclosed"]) == (104, 100, 1)
    assert row["error_pct"] == round(100 * (102 - 104) / 104, 2)  # against the worst closed rank
    assert row["typical_error_pct"] == 2.0
    assert row["real_phase_peaks"] == {"forward": 103, "backward": 104}
    md = bench.render_markdown([row, {"case": "y", "sharding_strategy": "FULL_SHARD", "error": "exit 1: boom"}],
                               {"command": "c", "date": "d", "machine": {}, "runs": 2, "steps": 2})
    # 4 rank-runs measured; the estimate's forward is 3 MiB above the real one's; no backward in the estimate
    assert "| x | SHARD_GRAD_OP | 4 | 0.00 |" in md and "| backward | forward | +3.00 |  |" in md and "-1.92%" in md and "| y | FULL_SHARD | | error: exit 1: boom" in md


def _real_worst(case):
    ranks = bench.run_case(case, steps=2, timeout=240)
    assert all("peak_bytes" in r for r in ranks), ranks
    # every rank ran the same model on the same batch: the same first loss
    assert len({round(r["first_loss"], 6) for r in ranks}) == 1, ranks
    closed = [r for r in ranks if r["residual_bytes"] == 0] or ranks  # a rank whose replay closed (fsdp2_cpu)
    return max(r["peak_bytes"] for r in closed)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2-w2-fp32-full-orig", "llama-w2-bf16-gradop-flat", "llama-w2-fp32-full-flat-lora"])
def test_a_real_two_rank_run_is_within_three_percent_of_the_fsdp1_estimate(name):
    # FULL_SHARD in fp32 with original parameters, SHARD_GRAD_OP under bf16 MixedPrecision with flat
    # parameters, and a LoRA model under peft's wrap policy with flat parameters (whose frozen units' shards
    # the trace lost before: -12.98%): rank 0 of the same FSDP1 step traced over a fake process group
    # (benchmarks/results/fsdp1_cpu.md) within 3% of the worst real rank
    case = bench.all_cases()[name]
    real, est = _real_worst(case), bench.estimate_case(case)["peak_bytes"]
    assert abs(est - real) <= 0.03 * real, (est, real)
