"""examples/deepspeed_config.py runs on a CPU and writes a config DeepSpeed accepts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
DeepSpeedConfig = pytest.importorskip("deepspeed.runtime.config").DeepSpeedConfig

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "deepspeed_config.py"


@pytest.mark.slow
def test_example_writes_a_valid_deepspeed_config(tmp_path):
    out = tmp_path / "ds_config.json"
    # world size 1: DeepSpeedConfig outside torch.distributed sees one rank; ZeRO-2 fixed so the
    # config exercises zero_optimization (memguard only considers ZeRO by itself for several ranks)
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--gpu", "A10G", "--world-size", "1", "--zero-stage", "2",
         "--global-batch-size", "16", "--out", str(out)],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads(out.read_text())
    assert json.loads(proc.stdout) == config  # the printed JSON is the written one
    assert "memguard plan for 1 x A10G" in proc.stderr  # the plan is explained
    ds = DeepSpeedConfig(config)
    assert ds.train_batch_size == 16
    assert ds.train_micro_batch_size_per_gpu * ds.gradient_accumulation_steps == 16
    assert ds.zero_optimization_stage == 2
    # GPT-2 small's hidden size is 768: the HF bucket rule gives 768 * 768
    assert ds.zero_config.reduce_bucket_size == 768 * 768
