"""The kernel-level GPU check's ``--dry-run``: every model column on the CPU, in a subprocess.

The expected model figures follow from the CUDA kernels the rules model (see
``tests/estimator/test_cuda_rules.py``), in the caching allocator's 512-byte blocks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_kernels.py"
FAMILIES = {"dropout", "log_softmax", "softmax", "cross_entropy", "layer_norm", "rms_norm", "embedding", "conv2d",
            "adamw", "mse_loss", "batch_norm", "group_norm"}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_kernels")
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["CUDA_VISIBLE_DEVICES"] = ""  # the dry run must not need (or touch) a GPU
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out)], cwd=out, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads((out / "gpu_kernels.json").read_text()), proc


def test_every_family_has_a_row_with_model_figures_and_no_gpu_figures(dry_run):
    data, proc = dry_run
    assert data["dry_run"] is True
    rows = data["kernel_rows"]
    assert {r["case"].split("/")[0] for r in rows} == FAMILIES
    for r in rows:
        assert not r.get("error"), r
        if r["case"] == "adamw/foreach":
            assert r["model_step_peak"] > 0 and r["gpu_step_peak"] is None
        else:
            assert r["model_forward_kept"] > 0 and r["gpu_forward_kept"] is None and r["diff_forward_kept"] is None
    assert data["markdown"].startswith("# memguard CUDA kernel model vs the GPU (dry run)")
    assert "| dropout/fp32 |" in proc.stdout


def test_model_figures_follow_the_cuda_kernels(dry_run):
    rows = {r["case"]: r for r in dry_run[0]["kernel_rows"]}
    n = 256 * 1024
    # native_dropout: fp32 output (4n) + bool mask (n); the CPU trace keeps an fp32 noise (4n)
    assert rows["dropout/fp32"]["model_forward_kept"] == 4 * n + n
    assert rows["dropout/fp32"]["cpu_trace_forward_kept"] == 8 * n
    # _fused_rms_norm: Y and one fp32 rstd per row; the composite keeps far more
    m, h = 8192, 1024
    assert rows["rms_norm/fp32"]["model_forward_kept"] == 4 * m * h + 4 * m
    assert rows["rms_norm/fp32"]["cpu_trace_forward_kept"] > 4 * m * h + 4 * m
    # ops without a rule: the model is the CPU trace
    for name in ("mse_loss/fp32", "batch_norm/fp32", "group_norm/fp32"):
        assert rows[name]["kind"] == "no-rule"
        assert rows[name]["model_forward_kept"] == rows[name]["cpu_trace_forward_kept"]
    # the capped convolution allocates the 64 MiB cap in forward and backward (a bound)
    conv = rows["conv2d/capped"]
    assert conv["kind"] == "bound"
    assert conv["model_forward_peak"] == conv["model_forward_kept"] + (64 << 20)
    # foreach AdamW: the step's only parameter-sized temporary is _foreach_sqrt's list
    params = (1024 * 1024 + 1024 + 2 * 4096 * 1024) * 4
    assert rows["adamw/foreach"]["model_step_peak"] >= params


def test_end_to_end_row_comes_from_gpu_calibrate(dry_run):
    e2e = dry_run[0]["end_to_end_rows"]
    assert [(r["case"], r["precision"]) for r in e2e] == [("mlp", "32-true")]
    assert e2e[0]["est_peak_bytes"] > 0 and e2e[0]["real_allocated_bytes"] > 0
