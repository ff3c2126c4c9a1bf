"""memguard: predict, plan and guard the memory of a training step.

``estimate`` predicts the peak memory of one training step without a GPU; ``plan`` chooses
micro-batch, accumulation, precision, checkpointing and ZeRO stage for a budget; ``prepare`` and
``step`` apply a plan to plain PyTorch and recover from out-of-memory errors without losing a
sample. Importing memguard imports torch and nothing else heavy, and has no side effects.
"""

from __future__ import annotations

from memguard.errors import (
    ConfigError,
    InfeasiblePlanError,
    MemguardError,
    MissingDependencyError,
    OOMRecoveryError,
    PeerFailedError,
)
from memguard.estimator.api import estimate
from memguard.estimator._result import Estimate
from memguard.guard import prepare, step
from memguard.guard._evaluate import evaluate
from memguard.planner.api import Plan, plan

__version__ = "0.1.0.dev0"

__all__ = [
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
]
