"""What each ``pip install memguard[extra]`` installs, and what happens when it was not installed.

Every integration imports its framework only when used; a missing framework raises
:class:`memguard.MissingDependencyError` with the exact ``pip install 'memguard[extra]'`` line. The
checks run in one subprocess that hides frameworks with ``sys.modules[name] = None`` (``import``
then raises ModuleNotFoundError, and ``importlib.util.find_spec`` reports the package as absent, as
for a package that was never installed), before anything has imported them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The packages each extra must install: the adapter's framework, and what that framework needs to run the
# adapter (the Trainer and TrainingArguments refuse to work without accelerate).
NEEDED = {
    "transformers": {"transformers", "accelerate"},
    "peft": {"peft", "transformers", "accelerate"},
    "lightning": {"pytorch-lightning"},
    "accelerate": {"accelerate"},
    "deepspeed": {"deepspeed"},
}


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower() for r in requirements}


def test_each_extra_installs_what_its_integration_imports():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra, needed in NEEDED.items():
        assert extra in extras, extra
        assert needed <= _names(extras[extra]), (extra, extras[extra])
    # the development set-up installs every integration the tests run against, peft included
    assert {"transformers", "accelerate", "peft", "pytorch-lightning", "lightning"} <= _names(extras["dev"])


CHECKS = r'''
import json, sys

results = {}

def attempt(name, blocked, action):
    saved = {m: sys.modules.get(m) for m in blocked}
    for m in blocked:
        sys.modules[m] = None  # as if not installed
    try:
        action()
        results[name] = None
    except Exception as exc:
        results[name] = [type(exc).__name__, str(exc), isinstance(exc, ImportError)]
    finally:
        for m, mod in saved.items():
            if mod is None:
                sys.modules.pop(m, None)
            else:
                sys.modules[m] = mod
        for m in [m for m in sys.modules if m.startswith("memguard.integrations.") or m == "memguard.hf"]:
            del sys.modules[m]

def use_transformers():
    import memguard.integrations.transformers

def use_hf():
    from memguard import hf
    hf.build("gpt2", {}, batch_size=1, seq_len=8)

def use_lightning():
    import memguard.integrations.lightning

def use_accelerate():
    import torch
    from memguard.integrations import accelerate
    model = torch.nn.Linear(2, 2)
    accelerate.prepare(object(), model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=1)

def use_peft():
    import torch
    from memguard.estimator._twins import lora_model
    lora_model(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)))

def use_deepspeed():
    from memguard import Estimate, Plan
    from memguard.integrations.deepspeed import to_config
    est = Estimate(peak_bytes=1, breakdown={"params": 1}, context_bytes=0, peak_phase="backward",
                   allocated_peak_bytes=1, device="cuda", precision="bf16-mixed", zero_stage=2, world_size=2,
                   gpu=None, micro_batch_size=1)
    plan = Plan(micro_batch_size=1, grad_accum_steps=1, world_size=2, global_batch_size=2, precision="bf16-mixed",
                activation_checkpointing=False, zero_stage=2, budget_bytes=2, estimate=est, hidden_size=8)
    assert to_config(plan)["zero_optimization"]["stage"] == 2

attempt("transformers", ["transformers"], use_transformers)
attempt("hf", ["transformers"], use_hf)
# transformers present, accelerate missing: the Trainer could not run
attempt("transformers_without_accelerate", ["accelerate"], use_transformers)
attempt("lightning", ["lightning", "lightning.pytorch", "pytorch_lightning"], use_lightning)
attempt("accelerate", ["accelerate"], use_accelerate)
attempt("peft", ["peft"], use_peft)
attempt("deepspeed", ["deepspeed"], use_deepspeed)
print(json.dumps(results))
'''


def test_missing_frameworks_raise_with_the_pip_line():
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, "-c", CHECKS], capture_output=True, text=True, env=env, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    expected_extra = {"transformers": "transformers", "hf": "transformers",
                      "transformers_without_accelerate": "transformers", "lightning": "lightning",
                      "accelerate": "accelerate", "peft": "peft"}
    for case, extra in expected_extra.items():
        got = results[case]
        assert got is not None, case
        kind, message, is_import_error = got
        assert kind == "MissingDependencyError", (case, got)
        assert is_import_error  # `except ImportError` around an optional import still catches it
        assert f"pip install 'memguard[{extra}]'" in message, (case, message)
    # the DeepSpeed adapter writes JSON-ready configs and never imports DeepSpeed
    assert results["deepspeed"] is None
