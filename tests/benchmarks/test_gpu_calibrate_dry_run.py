"""The GPU calibration script's ``--dry-run``: the whole pipeline on the CPU, in a subprocess.

The dry run builds every case's tiny model, asks ``memguard.estimate(device="cpu")`` and
measures two real CPU training steps with ``torch.profiler``; the comparison must hold the
issue's CPU accuracy goal (|error| <= 3%) where the CPU kernels allocate nothing internally.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_calibrate.py"

# the CPU-runnable precisions of each case (gpu_calibrate.CPU_PRECISIONS within the case's own)
EXPECTED_ROWS = {
    ("gpt2-small", "32-true"), ("gpt2-small", "bf16-mixed"),
    ("llama-small", "bf16-mixed"), ("llama-small", "bf16-true"),
    ("cnn", "32-true"), ("cnn", "bf16-mixed"),
    ("mlp", "32-true"), ("mlp", "bf16-mixed"),
}
# oneDNN's CPU convolutions allocate reordered copies of their operands through the CPU allocator,
# inside the kernel, where fake tensors cannot see them (about -8% in fp32, -35% in bf16 here);
# the accuracy goal is checked on the other models
CPU_KERNEL_SCRATCH = {"cnn"}


def _run(tmp_path: Path, *args: str, timeout: float = 420) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["CUDA_VISIBLE_DEVICES"] = ""  # the dry run must not need (or touch) a GPU
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_calibrate")
    proc = _run(out, "--dry-run", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out, proc


def test_dry_run_writes_json_and_markdown(dry_run):
    out, proc = dry_run
    data = json.loads((out / "gpu_calibrate.json").read_text())
    assert data["dry_run"] is True
    assert data["command"].startswith("python benchmarks/gpu_calibrate.py --dry-run")
    assert {(r["case"], r["precision"]) for r in data["rows"]} == EXPECTED_ROWS
    assert data["skipped"] == []
    md = (out / "gpu_calibrate.md").read_text()
    assert md.startswith("# memguard GPU calibration (dry run)")
    assert md.count("\n| ") == 1 + len(EXPECTED_ROWS)  # header row + one row per run
    assert "| gpt2-small | bf16-mixed |" in md and "| gpt2-small | bf16-mixed |" in proc.stdout


def test_dry_run_rows_hold_real_measurements(dry_run):
    out, _ = dry_run
    for row in json.loads((out / "gpu_calibrate.json").read_text())["rows"]:
        assert "error" not in row, row
        assert row["est_peak_bytes"] == row["est_allocated_bytes"] > 0  # the CPU target reserves nothing
        assert row["real_allocated_bytes"] > 0 and row["real_reserved_bytes"] is None
        assert row["est_context_bytes"] == 0
        assert row["allocated_error_pct"] == pytest.approx(
            100.0 * (row["est_allocated_bytes"] - row["real_allocated_bytes"]) / row["real_allocated_bytes"])


def test_dry_run_meets_the_cpu_accuracy_goal(dry_run):
    out, _ = dry_run
    rows = json.loads((out / "gpu_calibrate.json").read_text())["rows"]
    checked = [r for r in rows if r["case"] not in CPU_KERNEL_SCRATCH]
    assert len(checked) == 6
    for row in checked:
        assert abs(row["allocated_error_pct"]) <= 3.0, row


def test_the_gpu_mode_refuses_to_run_without_cuda(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible to this process")
    proc = _run(tmp_path, "--out", str(tmp_path), "--cases", "mlp", timeout=120)
    assert proc.returncode == 2  # argparse's usage error
    assert "--dry-run" in proc.stderr
    assert not (tmp_path / "gpu_calibrate.json").exists()


def test_a_time_budget_of_zero_skips_everything_but_the_first_case(tmp_path):
    proc = _run(tmp_path, "--dry-run", "--out", str(tmp_path), "--cases", "mlp", "--max-seconds", "0", timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((tmp_path / "gpu_calibrate.json").read_text())
    assert [(r["case"], r["precision"]) for r in data["rows"]] == [("mlp", "32-true")]
    assert data["skipped"] == ["mlp/bf16-mixed"]
