"""examples/plain_pytorch.py runs as a script, plans on its first step and learns."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_plain_pytorch_example_runs() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "plain_pytorch.py")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    # 5 MiB hold the model states and part of a batch's activations, not all 256 samples' (measured
    # plans: 64 x 4 in 32-true, 128 x 2 in bf16-mixed)
    planned = re.search(r"planned micro-batch (\d+) x accumulation (\d+)", out)
    assert planned is not None, out
    assert int(planned.group(1)) * int(planned.group(2)) == 256 and int(planned.group(2)) > 1
    losses = [float(v) for v in re.findall(r"mean loss ([0-9.]+)", out)]
    assert len(losses) == 3 and losses[-1] < losses[0]
