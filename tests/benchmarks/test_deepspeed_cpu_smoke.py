"""Smoke tests of benchmarks/deepspeed_cpu.py's helpers (no engine is started; seconds).

The real engines run in tests/estimator/test_sharding.py (two cases) and by hand (the script's
docstring gives the commands).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(_REPO))  # the repo root, for `benchmarks`

pytest.importorskip("transformers")
from benchmarks import deepspeed_cpu as bench  # noqa: E402


def test_default_cases_are_cases_and_names_are_unique():
    cases = bench.all_cases()
    assert set(bench.DEFAULT_CASES) <= set(cases)
    assert len({c.name for c in cases.values()}) == len(cases)
    assert cases["llama-z2-plan-bf16-gas2"] == bench.Case("llama", 2, "plan", precision="bf16-mixed", accum=2)


@pytest.mark.parametrize("name", ["llama-z3-plan-w4", "llama-z1-plan-bf16-gas2", "llama-z2-plan-offload",
                                  "llama-z2-default"])
def test_engine_config_is_what_the_case_says(name):
    DeepSpeedConfig = pytest.importorskip("deepspeed.runtime.config").DeepSpeedConfig
    case = bench.all_cases()[name]
    cfg = bench.ds_config(case)
    # the batch triple for case.world_size ranks: micro x accumulation x ranks
    assert cfg["train_batch_size"] == case.batch * case.accum * case.world_size
    assert cfg["zero_optimization"]["stage"] == case.zero_stage
    assert ("reduce_bucket_size" in cfg["zero_optimization"]) == (case.buckets == "plan")
    assert cfg.get("bf16", {}).get("enabled", False) == (case.precision == "bf16-mixed")
    assert (cfg["zero_optimization"].get("offload_optimizer", {}).get("device") == "cpu") == case.offload
    one_rank = dict(cfg, train_batch_size=case.batch * case.accum)  # DeepSpeedConfig sees one rank here
    assert DeepSpeedConfig(one_rank).gradient_accumulation_steps == case.accum


def test_summary_takes_phantom_setup_blocks_off_and_checks_closure_per_cycle():
    # two micro-batches per cycle: starts alternate (gradients held between them), cycles start level;
    # rank 1 holds a 2-byte set-up block freed unseen: taken off every step
    rank0 = {"rank": 0, "warmup": 2, "step_peaks": [5, 6, 10, 12, 10, 12], "step_starts": [0, 1, 3, 4, 3, 4],
             "raw_step_peaks": [5, 6, 10, 12, 10, 12], "phantom_setup_bytes": 0}
    rank1 = dict(rank0, rank=1, step_peaks=[p + 2 for p in rank0["step_peaks"]],
                 step_starts=[s + 2 for s in rank0["step_starts"]], phantom_setup_bytes=2)
    row = {"case": "x", "accum": 2, "runs": [[rank0, rank1]], "estimate": {"peak_bytes": 12},
           "estimate_without_buckets": {"peak_bytes": 6}}
    out = bench.summarise(row)
    assert out["real_peak_bytes"] == 12 and out["error_pct"] == 0.0
    assert out["steady_starts_equal"] is True
    assert out["phantom_setup_bytes"] == [0, 2]
