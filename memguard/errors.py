"""Every error memguard raises on purpose.

The tree::

    MemguardError                  root: catch this to catch everything memguard raises on purpose
    ├── ConfigError                bad arguments, or a model/batch/loss that cannot be traced;
    │                              lists every problem at once (``.problems``); also a ValueError
    ├── InfeasiblePlanError        no configuration fits the budget; ``.closest`` is the nearest
    │                              plan, ``.suggestions`` what would make it fit
    ├── OOMRecoveryError           an out-of-memory error that halving cannot fix (micro-batch 1
    │                              already, or retries exhausted); carries the predicted breakdown
    ├── PeerFailedError            under DistributedDataParallel, another rank failed (``.rank``);
    │                              this rank stops too so that none waits forever; the failing
    │                              rank raises its own error
    └── MissingDependencyError     an optional framework is not installed; also an ImportError,
                                   and the message holds the exact ``pip install`` line

Errors that are not memguard's (a bug in the user's model, a real CUDA error that is not an
out-of-memory) propagate unchanged.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

__all__ = [
    "MemguardError",
    "ConfigError",
    "InfeasiblePlanError",
    "OOMRecoveryError",
    "PeerFailedError",
    "MissingDependencyError",
]


class MemguardError(Exception):
    """Root of every error memguard raises on purpose."""


class ConfigError(MemguardError, ValueError):
    """Bad arguments, listing every problem found, each with what to do about it.

    Attributes:
        problems: one sentence per problem.
    """

    def __init__(self, problems: str | Sequence[str]):
        if isinstance(problems, str):
            problems = [problems]
        self.problems: list[str] = list(problems)
        if len(self.problems) == 1:
            msg = self.problems[0]
        else:
            msg = f"{len(self.problems)} problems:\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(msg)


class InfeasiblePlanError(MemguardError):
    """No configuration fits the memory budget.

    Attributes:
        closest: the plan that came nearest (a :class:`memguard.Plan`), or None when not even
            one configuration could be evaluated.
        suggestions: what would make it fit, most effective first.
        alternatives: measured fine-tuning alternatives (``memguard.planner._finetune.Alternative``:
            name, change, predicted peak, fits, note, plan) when planned with ``finetune="full"``,
            else empty.
        reason: the message without the suggestions.
    """

    def __init__(self, message: str, *, closest: Any = None, suggestions: Iterable[str] = (),
                 alternatives: Iterable[Any] = ()):
        self.reason = message
        self.closest = closest
        self.alternatives: list[Any] = list(alternatives)
        self.suggestions: list[str] = list(suggestions)
        if self.suggestions:
            message += "\nWhat would make it fit:\n" + "\n".join(f"  - {s}" for s in self.suggestions)
        super().__init__(message)


class OOMRecoveryError(MemguardError):
    """An out-of-memory error that halving the micro-batch cannot fix.

    Attributes:
        micro_batch_size: the micro-batch at which the last OOM happened.
        breakdown: the predicted breakdown (bytes per category) if a plan was known, else None.
    """

    def __init__(self, message: str, *, micro_batch_size: int, breakdown: Any = None):
        self.micro_batch_size = micro_batch_size
        self.breakdown = breakdown
        super().__init__(message)


class PeerFailedError(MemguardError):
    """Another rank of the process group failed; this rank stops too, so that no rank waits forever.

    The rank that failed raises its own error (see its log); under DistributedDataParallel the other
    ranks raise this one.

    Attributes:
        rank: the rank that failed, in the process group.
    """

    def __init__(self, message: str, *, rank: int):
        self.rank = rank
        super().__init__(message)


class MissingDependencyError(MemguardError, ImportError):
    """An optional framework is needed but not installed."""

    def __init__(self, package: str, extra: str):
        super().__init__(
            f"{package} is not installed; install it with: pip install 'memguard[{extra}]'"
        )
