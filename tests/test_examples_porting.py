"""The porting examples run as scripts: memguard's loop ends with the original loop's weights, and says what runs.

examples/port_nanogpt.py ports a nanoGPT-style loop (accumulation, GradScaler, clipping, a learning
rate schedule, an evaluation every N iterations); examples/port_accelerate.py an Accelerator-first
script (clipping, Accelerate's accumulation). Each trains the original and the ported loop on a CPU
in a few seconds, in a subprocess, and prints the largest weight difference.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("MEMGUARD_QUIET", None)
    proc = subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    return out


def test_the_nanogpt_port_ends_with_the_original_weights() -> None:
    out = _run(str(ROOT / "examples" / "port_nanogpt.py"))
    found = re.search(r"max weight difference \(float32\): (\S+) at micro-batch 4, (\S+) as planned", out)
    assert found is not None, out[-3000:]
    assert float(found.group(1)) == 0.0  # the original's micro-steps: bit for bit
    # planned for the budget: the same gradient summed in another grouping; AdamW magnifies the rounding
    # where a gradient is near zero (1.5e-5 measured after six steps)
    assert float(found.group(2)) < 1e-4
    # the evaluations every eval_interval iterations saw the same model
    before = re.findall(r"before: step (\d+): train loss (\S+), val loss (\S+)", out)
    after = re.findall(r"after:  step (\d+): train loss (\S+), val loss (\S+)", out)
    assert len(before) == 2 and after[:2] == before and after[2:] == before
    # the plan summary, shown without any logging set-up, names the accumulation memguard chose
    planned = re.search(r"memguard planned micro-batch (\d+) x accumulation (\d+) x world 1 = 16 samples", out)
    assert planned is not None and int(planned.group(2)) > 1, out[-3000:]
    assert f"each batch of 16 runs as {planned.group(2)} micro-batches of {planned.group(1)}" in out


def test_the_accelerator_first_port_ends_with_the_original_weights() -> None:
    pytest.importorskip("accelerate")
    out = _run(str(ROOT / "examples" / "port_accelerate.py"))
    found = re.search(r"max weight difference: (\S+)", out)
    assert found is not None, out[-3000:]
    assert float(found.group(1)) < 1e-6  # SGD: float rounding of the regrouped sums only (7e-9 measured)
    # what runs: the plan's micro-batch within each dataloader batch, and the Accelerator's accumulation
    runs = re.search(r"memguard planned micro-batch (\d+) \((\d+) per dataloader batch of 32\) x accumulation 2 "
                     r"\(the Accelerator's\) x world 1 = 64 samples per optimizer step", out)
    assert runs is not None, out[-3000:]
    assert int(runs.group(2)) > 1 and int(runs.group(1)) * int(runs.group(2)) >= 32
