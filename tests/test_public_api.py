"""The public API: a curated __all__, and importing memguard has no side effects."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import memguard

# The names the design contract promises, and nothing private.
EXPECTED = {
    "ConfigError",
    "Estimate",
    "InfeasiblePlanError",
    "MemguardError",
    "MissingDependencyError",
    "OOMRecoveryError",
    "PeerFailedError",
    "Plan",
    "__version__",
    "estimate",
    "evaluate",
    "plan",
    "prepare",
    "step",
}


def test_all_is_exactly_the_contract():
    assert set(memguard.__all__) == EXPECTED
    for name in memguard.__all__:
        assert hasattr(memguard, name), name


def test_every_error_is_a_memguard_error():
    for name in ("ConfigError", "InfeasiblePlanError", "OOMRecoveryError", "PeerFailedError", "MissingDependencyError"):
        assert issubclass(getattr(memguard, name), memguard.MemguardError)


def test_import_has_no_side_effects():
    code = (
        "import json, os, sys; before = dict(os.environ); import memguard; "
        "frameworks = [m for m in sys.modules if m.split('.')[0] in "
        "('lightning', 'pytorch_lightning', 'accelerate', 'deepspeed', 'transformers', 'matplotlib')]; "
        "print(json.dumps({'env_changed': before != dict(os.environ), 'frameworks': frameworks}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"env_changed": False, "frameworks": []}
