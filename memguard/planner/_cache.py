"""A plan cache on disk, so that the same job does not plan twice.

Plans are JSON files named by a SHA-256 key over everything a plan depends on: the model's
structure (module classes, parameter and buffer shapes, dtypes, ``requires_grad``), the example
batch's shapes and dtypes, the optimizer's class and hyperparameters, the loss function's
qualified name, the plan options (target GPU, budget, world size, precision and the other
knobs) and the torch and memguard versions. Files are written atomically (a temporary file, then
``os.replace``). A file that cannot be read or parsed is ignored with a warning, never an error.

The folder is ``$MEMGUARD_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/memguard`` or
``~/.cache/memguard``.

Known limitations:
    The loss function is keyed by its qualified name, not its code: after changing what a loss
    function computes, clear the cache (delete the folder) or pass ``cache=False``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from memguard.planner._plan import Plan

log = logging.getLogger("memguard")


def default_cache_dir() -> Path:
    env = os.environ.get("MEMGUARD_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "memguard"


def _describe_model(model: nn.Module) -> list:
    out = []
    for name, module in model.named_modules():
        params = [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in module.named_parameters(recurse=False)]
        buffers = [(n, tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers(recurse=False)]
        out.append((name, type(module).__qualname__, params, buffers))
    return out


def _describe_batch(batch: Any) -> list:
    leaves, spec = tree_flatten(batch)
    return [str(spec)] + [
        (tuple(x.shape), str(x.dtype)) if isinstance(x, torch.Tensor) else repr(x) for x in leaves
    ]


def _describe_optimizer(optimizer: Any) -> Any:
    if optimizer is None:
        return None
    if isinstance(optimizer, torch.optim.Optimizer):
        return (type(optimizer).__qualname__, sorted((k, repr(v)) for k, v in optimizer.defaults.items()))
    return getattr(optimizer, "__qualname__", repr(optimizer))


def plan_key(model: nn.Module, batch: Any, optimizer: Any, loss_fn: Any, options: dict) -> str:
    """The cache key of a plan request (see the module docstring)."""
    import memguard

    payload = {
        "model": _describe_model(model),
        "batch": _describe_batch(batch),
        "optimizer": _describe_optimizer(optimizer),
        "loss_fn": getattr(loss_fn, "__qualname__", None) if loss_fn is not None else None,
        "options": {k: repr(v) for k, v in sorted(options.items())},
        "torch": torch.__version__,
        "memguard": memguard.__version__,
    }
    if options.get("device") == "cpu" and options.get("cpu") in (None, "host"):
        from memguard.estimator._cpu_kernels import host_isa

        payload["cpu"] = host_isa()  # the host's kernel paths decide a CPU plan
    blob = json.dumps(payload, sort_keys=True, default=repr).encode()
    return hashlib.sha256(blob).hexdigest()


class PlanCache:
    """Plans on disk, one JSON file per key."""

    def __init__(self, directory: str | os.PathLike | None = None) -> None:
        self.directory = Path(directory) if directory is not None else default_cache_dir()

    def path_for(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def get(self, key: str) -> Plan | None:
        """The cached plan, or None (missing, unreadable or corrupt: the latter two warn)."""
        path = self.path_for(key)
        if not path.exists():
            return None
        try:
            return Plan.from_dict(json.loads(path.read_text()))
        except Exception as exc:  # noqa: BLE001 - a corrupt cache must never break training
            warnings.warn(f"memguard: ignoring unreadable plan cache file {path}: {exc}", stacklevel=2)
            return None

    def put(self, key: str, plan: Plan) -> Path:
        """Write ``plan`` atomically; returns its path."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path_for(key)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".plan-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump(plan.to_dict(), fh, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        log.debug("memguard: plan written to %s", path)
        return path
