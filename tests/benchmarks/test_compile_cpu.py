"""Smoke tests of benchmarks/compile_cpu.py: its report, and one real compiled step (aot_eager, no C++ compiler)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `benchmarks`

from benchmarks import compile_cpu  # noqa: E402

MiB = 1 << 20

_META = {"command": "python benchmarks/compile_cpu.py", "date": "d", "machine": {"cpu_model": "x"},
         "backend": "inductor", "steps": 2}


def test_report_rows_and_summary():
    rows = [
        # compiled 90 of 100 MiB: ratio 0.900; estimate 100 / 90 = 1.111
        {"case": "a", "eager_bytes": 100 * MiB, "compiled_bytes": 90 * MiB, "estimate_bytes": 100 * MiB,
         "compile_seconds": 3.0},
        # compiled above eager: 110 / 100 = 1.100, the estimate (100) below it: 0.909
        {"case": "b", "eager_bytes": 100 * MiB, "compiled_bytes": 110 * MiB, "estimate_bytes": 100 * MiB,
         "compile_seconds": 4.0, "compiled_peak_phase": "backward"},
        {"case": "c", "error": "worker exited 1: boom"},
    ]
    md = compile_cpu.render_markdown(rows, _META)
    assert "| a | 100.00 | 90.00 | 0.900 | — | 100.00 | 1.111 | 3.0 |" in md
    assert "| b | 100.00 | 110.00 | 1.100 | backward | 100.00 | 0.909 | 4.0 |" in md
    assert "| c | error: worker exited 1: boom" in md
    assert "Largest compiled / eager ratio: 1.100 (b); estimate >= compiled in 1 of 2 cases." in md


@pytest.mark.slow
def test_one_compiled_step(tmp_path):
    """One small zoo case through the real worker, with aot_eager (AOTAutograd's partitioned graphs, run eagerly)."""
    code = compile_cpu.main(["--cases", "ckpt-mlp", "--backend", "aot_eager", "--out", str(tmp_path), "--timeout", "600"])
    data = json.loads((tmp_path / "compile_cpu.json").read_text())
    (row,) = data["rows"]
    assert code == 0, row
    assert row["case"] == "ckpt-mlp" and row["backend"] == "aot_eager"
    assert row["compiled_bytes"] > 0
    # the eager truth is the one accuracy_cpu.py measures: memguard is within 0.01% of it there
    # (benchmarks/results/accuracy_cpu.md, ckpt-mlp: 66.13 real, 66.12 estimated MiB)
    assert abs(row["estimate_bytes"] - row["eager_bytes"]) <= 0.01 * row["eager_bytes"]
    assert (tmp_path / "compile_cpu.md").read_text().count("| ckpt-mlp |") == 1
