"""The guard: run a plan in plain PyTorch and recover from out-of-memory errors without losing a sample.

``prepare(model, optimizer, ...)`` applies a plan (micro-batch, precision, activation
checkpointing); ``step(model, optimizer, batch)`` runs one optimizer step on a batch split into
micro-batches and, on an OOM, halves the micro-batch and runs the same batch again, on every
DistributedDataParallel rank together. Every front-end (``prepare``/``step``, the Lightning
callback, the Accelerate hooks) is a thin translation onto the same core:

* :mod:`memguard.guard.core` is the guard core: option checks, planning under a front-end's
  constraints, the per-model state, applying a plan, the optimizer step, the status;
* :mod:`memguard.guard.oom` recognises OOMs and frees their memory;
* :mod:`memguard.guard.precision` applies a precision by Lightning's name;
* :mod:`memguard.guard.distributed` makes ranks agree before any collective that could hang;
* :mod:`memguard.guard.window` runs the batches of one optimizer step in micro-batches, halving and
  replaying them on an OOM (one batch for ``step``; the framework integrations feed one
  dataloader batch at a time);
* :mod:`memguard.guard.runner` is ``prepare`` and ``step``, the plain-PyTorch front-end.

Batches are split by :mod:`memguard.batch`.
"""

from __future__ import annotations

from memguard.guard.oom import is_oom_error
from memguard.guard.runner import GuardStatus, compute_loss, guard_status, prepare, step

__all__ = ["prepare", "step", "is_oom_error", "guard_status", "GuardStatus", "compute_loss"]
