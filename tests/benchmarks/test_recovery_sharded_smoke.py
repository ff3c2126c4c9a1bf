"""Smoke test of benchmarks/recovery_sharded.py: its smallest case end to end (DDP on two gloo ranks, with
memguard and then the framework alone: two torchrun launches of two ranks, about 30 s of CPU;
39 s of wall time on a shared 2-core machine, 90-130 s at a load average of 11-14).

The other cases run by hand (the script's docstring); their integration tests are
tests/integrations/test_accelerate.py, test_deepspeed.py and tests/guard/test_fsdp2_recovery.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

_REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(_REPO))  # the repo root, for `benchmarks`

from benchmarks import recovery_sharded as bench  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux"),
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in"),
]


def test_ddp_case_recovers_with_memguard_and_ends_the_job_without_it(tmp_path: Path) -> None:
    data = bench.main(["--cases", "ddp", "--out", str(tmp_path)])
    row = data["rows"]["ddp"]
    # with memguard: rank 1's OOM at micro-batch 32 (20 MiB cap, ~1 MiB per sample) is redone at 16 on both ranks
    assert row["recovered"] is True and row["hang"] is False, row
    assert (row["retries"], row["micro_batch_size"]) == (1, 16)
    assert row["samples_lost"] == row["samples_twice"] == 0
    assert 0 < row["detect_s"] < row["oom_step_s"] and 0 < row["redo_s"] < row["oom_step_s"]
    assert row["normal_step_s"] > 0
    # the framework alone: rank 1 dies with the allocator's error in the capped step, the job does not finish
    base = row["baseline"]
    assert base["finished"] is True and base["hang"] is False and base["recovered"] is False, base
    rank1 = base["ranks"][1]
    assert rank1["outcome"] == "OOM (DefaultCPUAllocator)" and rank1["steps_done"] == bench._STEPS["cap_step"]
    assert base["samples_not_trained"] == 2 * bench._STEPS["batch"] * (bench._STEPS["steps"] - 1)
    assert 0 <= base["oom_to_end_s"] < bench._PG_TIMEOUT_S + 30
    # both files written, the Markdown from the JSON
    saved = json.loads((tmp_path / "recovery_sharded.json").read_text())
    assert saved["rows"]["ddp"]["samples_lost"] == 0
    md = (tmp_path / "recovery_sharded.md").read_text()
    assert "| ddp |" in md and "rank 1: OOM (DefaultCPUAllocator)" in md
