"""Thin adapters from a memguard plan to training frameworks.

Each adapter imports its framework only when used and raises
:class:`memguard.MissingDependencyError` with the exact ``pip install`` line when it is missing.
An adapter holds no logic the core lacks: it translates.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from memguard.errors import MissingDependencyError

__all__ = ["require"]


def require(module: str, package: str, extra: str) -> ModuleType:
    """Import ``module`` or raise :class:`MissingDependencyError` naming ``pip install memguard[extra]``."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(package, extra) from exc
