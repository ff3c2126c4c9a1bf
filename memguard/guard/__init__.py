"""The guard: run a plan in plain PyTorch and recover from out-of-memory errors without losing a sample.

``prepare(model, optimizer, ...)`` applies a plan (micro-batch, precision, activation
checkpointing); ``step(model, optimizer, batch)`` runs one optimizer step on a batch split into
micro-batches and, on an OOM, halves the micro-batch and runs the same batch again, on every
DistributedDataParallel rank together. Every front-end (``prepare``/``step``, the Lightning
callback, the Accelerate hooks) is a thin translation onto the same core (modules whose names
start with ``_`` are internal; the public names are this package's):

* :mod:`memguard.guard._options` is what a front-end fixes (``Constraints``), the checks of its
  arguments, the options the guard keeps (``GuardOptions``), and the guard's one call into the planner;
* :mod:`memguard.guard._core` is the guard core: the per-model state, planning under a
  front-end's constraints, applying a plan, the window life cycle, the optimizer step, the status;
* :mod:`memguard.guard._sizing` is the micro-batch of each batch shape (planned before a new shape
  runs, halved for its own shape only);
* :mod:`memguard.guard._shapes` is the batch shape signatures and the micro-batches a compiled
  model sees;
* :mod:`memguard.guard._plan_cache` remembers a micro-batch reduced after an OOM for the next run;
* :mod:`memguard.guard._oom` recognises OOMs and frees their memory;
* :mod:`memguard.guard._precision` applies a precision by Lightning's name;
* :mod:`memguard.guard._summary` is the plan summary shown when a plan is made or applied, and
  its switch (``MEMGUARD_QUIET=1``, ``verbose=False``);
* :mod:`memguard.guard._distributed` makes ranks agree before any collective that could hang;
* :mod:`memguard.guard._window` runs the batches of one optimizer step in micro-batches, halving and
  replaying them on an OOM (one batch for ``step``; the framework integrations feed one
  dataloader batch at a time);
* :mod:`memguard.guard._sharded` is the agreement protocol under FSDP2, whose collectives run
  inside forward and backward;
* :mod:`memguard.guard._runner` is ``prepare`` and ``step``, the plain-PyTorch front-end, and
  :mod:`memguard.guard._fsdp2` its ``strategy="fsdp2"`` path;
* :mod:`memguard.guard._evaluate` is ``memguard.evaluate``: an evaluation batch in micro-batches,
  halved on an OOM, with the unsplit result.

Batches are split by :mod:`memguard.batch`.
"""

from __future__ import annotations

from memguard.guard._oom import is_oom_error
from memguard.guard._runner import GuardStatus, compute_loss, guard_status, prepare, step

__all__ = ["prepare", "step", "is_oom_error", "guard_status", "GuardStatus", "compute_loss"]
