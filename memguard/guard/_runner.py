"""``prepare`` and ``step``: run a plan in plain PyTorch and recover from OOM without losing a sample.

``prepare`` keeps its per-model state (a guard core) keyed weakly by the model it was given, so
the model and optimizer come back unchanged in type and usable as before; ``step`` runs one
optimizer step on a batch, split into micro-batches.

One step, and what happens on an out-of-memory error:

1. The batch is split along dim 0 into micro-batches of the current size. Each micro-batch's loss
   (the mean over its samples) is multiplied by its share of the batch's samples before
   ``backward``, so the accumulated gradient is the gradient of the batch's mean loss.
2. If any micro-batch runs out of memory, the failed frames' locals are cleared (they hold the
   partial graph), every gradient of this step is dropped (``grad = None``), the running
   statistics of normalisation layers are restored, ``gc.collect()`` and ``empty_cache()`` run,
   the micro-batch is halved and the *same* batch is run again from its first sample. The
   GradScaler is untouched by a failed attempt: only ``scale()``, which changes no state after its
   first call, runs before the attempt is known to have succeeded.
3. Under DistributedDataParallel every rank reports its outcome in one all-reduce before any
   other collective (:mod:`memguard.guard._distributed`), so all ranks retry together; gradients are
   averaged only once every rank has finished every micro-batch. Under FSDP2
   (``strategy="fsdp2"``), whose collectives run inside forward and backward, every rank agrees
   before each of them, so a rank that fails is heard at the peers' next collective; FSDP2's
   per-step state is reset on every rank before the retry (:mod:`memguard.guard._sharded`).
4. The optimizer (through the GradScaler for ``16-mixed``) steps and the gradients are set to None.

Each retry is logged at WARNING on the ``memguard`` logger. The new micro-batch is kept for the
following steps; with ``probe_up_after=N`` it is doubled again (up to the planned size) after N
steps without an OOM. When memguard planned with ``cache=True`` (or a ``PlanCache``), the reduced
micro-batch is also written to the plan cache, and the next run of the same job starts from it.
At micro-batch 1 an OOM raises :class:`memguard.OOMRecoveryError`.

``prepare`` and ``step`` translate onto :class:`memguard.guard._core.Guard`, the state and steps every
front-end shares; steps 1-3 are :class:`memguard.guard._window.MicroBatchWindow` with a window of one
batch (the framework integrations open one window per optimizer step of several batches).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from memguard.batch import LossFn, compute_loss, map_tensors, tensor_leaves
from memguard.errors import ConfigError
from memguard.guard._core import Guard, GuardStatus, forget, guard_of, register
from memguard.guard._distributed import rank_group_of
from memguard.guard._options import (
    Constraints,
    GuardOptions,
    model_and_optimizer,
    option_problems,
    wrapper_problems,
)
from memguard.guard._window import DEFAULT_MAX_RETRIES
from memguard.planner.api import Plan

logger = logging.getLogger("memguard")

# Plain PyTorch runs ZeRO stage 0, any precision (memguard casts, autocasts and scales), any accumulation.
CONSTRAINTS = Constraints(source="memguard.prepare", taken=("world_size", "optimizer", "loss_fn"),
                          precision_role="guard", splits_batch=True,
                          fix_precision="pass another precision= to memguard.prepare")

_HOW_TO_PREPARE = ("call model, optimizer = memguard.prepare(model, optimizer) first and pass the same model object "
                   "to memguard.step")


def prepare(
    first: Any,
    second: Any,
    *,
    plan: Plan | None = None,
    micro_batch_size: int | None = None,
    global_batch_size: int | None = None,
    example_batch: Any = None,
    loss_fn: LossFn | None = None,
    max_retries: int = DEFAULT_MAX_RETRIES,
    probe_up_after: int | None = None,
    max_grad_norm: float | None = None,
    clip_grad_value: float | None = None,
    batch_dim: int = 0,
    verbose: bool = True,
    grad_scaler: torch.amp.GradScaler | None = None,
    strategy: str | None = None,
    mesh: Any = None,
    gradient_compression: str | None = None,
    powersgd: Any = None,
    **plan_options: Any,
) -> tuple[Any, Any]:
    """Apply a memory plan to a model and its optimizer, for :func:`step`.

    Exactly one of three sources sets the micro-batch:

    * ``plan=``: a :class:`memguard.Plan` (from ``memguard.plan`` or ``Plan.from_dict``);
    * ``micro_batch_size=``: a fixed size; ``precision=`` (one name) and ``activation_checkpointing=``
      (True for every repeated block, or a number of blocks) may come with it;
    * planning: with ``example_batch=`` now, else on the first :func:`step` from its batch, calling
      ``memguard.plan`` with ``global_batch_size`` (default: the batch's size times the world size),
      ``loss_fn``, the optimizer, the world size, the device of the model's parameters, ZeRO stage 0
      and every other keyword in ``plan_options`` (``gpu``, ``budget_bytes``, ``headroom``,
      ``precision``, ``activation_checkpointing``, ...). Under DDP rank 0 plans and broadcasts.

    The plan's activation checkpointing is applied to its first ``checkpoint_blocks`` repeated
    blocks, and its precision as in :mod:`memguard.guard._precision`. Preparing a model again undoes
    the checkpointing of the previous call. When a plan is made or applied, a short summary says
    what runs (rank 0 only; to stderr when no logging is configured, else an INFO record on the
    ``memguard`` logger); ``verbose=False`` or ``MEMGUARD_QUIET=1`` silences it.

    Args:
        first, second: the model (an ``nn.Module``, possibly wrapped in DistributedDataParallel) and
            its optimizer, in either order; they are returned in the order given, the same objects.
        plan: a plan to apply.
        micro_batch_size: a fixed micro-batch instead of a plan.
        global_batch_size: samples per optimizer step over all ranks, for planning.
        example_batch: a batch like those :func:`step` will get (this rank's share), to plan now.
        loss_fn: ``loss_fn(model, batch) -> mean loss``; the default for :func:`step`.
        max_retries: at most this many halvings of the micro-batch within one step.
        probe_up_after: after this many steps without an OOM, double a reduced micro-batch again (up
            to the planned size); None (default) never probes.
        max_grad_norm: clip the total norm of the accumulated gradients to this once per optimizer
            step, after the last micro-batch (unscaled first under ``16-mixed``); the norm before
            clipping is ``guard_status(model).grad_norm``. None or 0: no clipping (as the HF Trainer's
            and nanoGPT's 0; ``torch.nn.utils.clip_grad_norm_(max_norm=0)`` would zero the gradients).
        clip_grad_value: clip every accumulated gradient element to ``[-v, v]`` once per optimizer
            step (after ``max_grad_norm``, if both). None or 0: no clipping.
        batch_dim: the dim of the batch's tensors that holds the samples: 0 (default), or e.g. 1 for
            sequence-first data (``[seq, batch, ...]``); batches are split and counted along it, and
            ``loss_fn`` gets micro-batches in the same layout. Every tensor of the batch with more
            than ``batch_dim`` dims must have the samples there; 0-dim tensors go to every micro-batch.
        verbose: show the plan summary (default True).
        grad_scaler: the ``torch.amp.GradScaler`` to use if the precision is ``16-mixed`` (to set its
            options or load its state); default: a new one with PyTorch's defaults.
        strategy: None or ``"ddp"``: a plain module, or one wrapped in DistributedDataParallel.
            ``"fsdp2"``: a plain module that memguard shards with FSDP2 ``fully_shard`` once the plan
            is known (per repeated block, then the root; the optimizer is re-pointed at the sharded
            parameters), or a module already sharded with ``fully_shard`` at its root; planned with
            FSDP2's sharding levels (``zero_stage`` 3/2/1) and run with the OOM recovery of
            :mod:`memguard.guard._sharded` (see :mod:`memguard.guard._fsdp2`).
        mesh: with ``strategy="fsdp2"``, the 1-D ``DeviceMesh`` to shard over (default: every rank).
        gradient_compression: None, or ``"powersgd"``: under DDP (a wrapper over more than one rank),
            memguard's gradient sync runs torch's ``powerSGD_hook`` on DDP's buckets
            (:mod:`memguard.guard._comm_hooks`). When memguard plans, it plans with PowerSGD's memory;
            a ``plan=`` made with ``memguard.plan(gradient_compression="powersgd")`` needs it here again
            (a Plan does not record it).
        powersgd: the hook's options (a dict of ``PowerSGDState``'s keywords and ``bucket_cap_mb``, see
            :class:`memguard.estimator._powersgd.PowerSGDOptions`, or an
            int: the rank); None = ``PowerSGDState``'s defaults.
        **plan_options: options for ``memguard.plan`` (see above).

    Returns:
        ``(first, second)``, unchanged objects.

    Raises:
        ConfigError: bad arguments (every problem listed), an unsupported wrapper (FSDP1, DeepSpeed;
            an FSDP2 model needs ``strategy="fsdp2"``), a plan that needs ZeRO or optimizer offload
            (without ``strategy="fsdp2"``), or a cast that is no longer possible. Under
            ``strategy="fsdp2"`` also: no process group, a plan for another world size or strategy,
            ``16-mixed``, an optimizer that already has state
            (:class:`memguard.guard._fsdp2.FSDPSetupError` for a model that cannot be sharded as asked).
        InfeasiblePlanError: planning now (``example_batch``) found nothing that fits.
        PeerFailedError: under DDP, planning now failed on rank 0 with an error that is not memguard's.

    Known limitations:
        ``*-true`` precisions cast the model in place; they cannot be undone by preparing again.
    """
    from memguard.guard._comm_hooks import compression_problems

    wrapper = first if isinstance(first, nn.Module) else second
    compression, compression_trouble = compression_problems(wrapper, gradient_compression, powersgd, strategy=strategy)
    if compression_trouble and strategy == "fsdp2":
        raise ConfigError(compression_trouble)
    if compression is not None and plan is None and micro_batch_size is None:
        # memguard plans: with PowerSGD's memory (memguard.plan's gradient_compression=)
        plan_options = {**plan_options, "gradient_compression": "powersgd", "powersgd": compression}
    options = GuardOptions(loss_fn=loss_fn, max_retries=max_retries, probe_up_after=probe_up_after,
                           max_grad_norm=max_grad_norm, clip_grad_value=clip_grad_value, batch_dim=batch_dim,
                           verbose=verbose, global_batch_size=global_batch_size, plan_options=plan_options)
    if strategy == "fsdp2":
        from memguard.guard._fsdp2 import prepare_fsdp2

        return prepare_fsdp2(first, second, options, plan=plan, micro_batch_size=micro_batch_size,
                             example_batch=example_batch, grad_scaler=grad_scaler, mesh=mesh)
    problems: list[str] = []
    if mesh is not None:
        problems.append("mesh= is for strategy='fsdp2'; drop it, or pass strategy='fsdp2'")
    if strategy not in (None, "ddp"):
        problems.append(f"strategy must be None, 'ddp' or 'fsdp2', got {strategy!r}" + (
            "; DeepSpeed runs its own step: turn the plan into a config with memguard.integrations.deepspeed."
            "to_config" if strategy == "deepspeed" else ""))
    model, optimizer = model_and_optimizer(first, second, problems)
    if model is not None:
        problems += wrapper_problems(model)
    problems += compression_trouble
    if grad_scaler is not None and not isinstance(grad_scaler, torch.amp.GradScaler):
        problems.append(f"grad_scaler must be a torch.amp.GradScaler, got {type(grad_scaler).__name__}")
    problems += option_problems(CONSTRAINTS, plan=plan, micro_batch_size=micro_batch_size, example_batch=example_batch,
                                global_batch_size=global_batch_size, loss_fn=loss_fn, max_retries=max_retries,
                                probe_up_after=probe_up_after, max_grad_norm=max_grad_norm,
                                clip_grad_value=clip_grad_value, batch_dim=batch_dim, verbose=verbose,
                                plan_options=plan_options)
    if problems:
        raise ConfigError(problems)

    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    rg = rank_group_of(model)
    if rg is not None and compression is not None:
        from memguard.guard._comm_hooks import PowerSGDSync

        trainable = list(dict.fromkeys(p for p in inner.parameters() if p.requires_grad))
        rg.comm_hook = PowerSGDSync(rg.group, trainable, compression)
    world = rg.world_size if rg is not None else _world_size()
    if rg is None:  # tensor parallelism: agreements at its boundaries (memguard.guard._tp); TP shards need no averaging
        from memguard.guard._tp import tensor_parallel_rank_group

        tp_group = tensor_parallel_rank_group(inner)
        if tp_group is not None:
            rg, world = tp_group, tp_group.data_parallel_size
            options = dataclasses.replace(options, sync_gradients=False)
    forget(model)  # preparing again undoes the previous call's checkpointing
    guard = Guard(inner, CONSTRAINTS, options, world_size=world, rank_group=rg,
                  grad_scaler=grad_scaler)
    if isinstance(plan, Plan):
        if plan.world_size != world:
            logger.warning("the plan was made for %d ranks but %d are running; its micro-batch %d is used as is",
                           plan.world_size, world, plan.micro_batch_size)
        guard.apply(plan, optimizer)
        guard.announce(plan, made=False)
    elif micro_batch_size is not None:
        guard.apply(None, optimizer, micro_batch_size=micro_batch_size,
                    precision=plan_options.get("precision", "32-true"),
                    activation_checkpointing=plan_options.get("activation_checkpointing", False))
    elif example_batch is not None:
        if batch_dim:
            example_batch = sample_first(example_batch, batch_dim)
        guard.plan_and_apply(example_batch, optimizer, _batch_dim_loss(loss_fn, batch_dim))
    register(model, guard)
    return first, second


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any, loss_fn: LossFn | None = None) -> float:
    """One optimizer step on ``batch`` (this rank's share of the global batch); the mean loss.

    The batch is split along dim 0 into micro-batches of the current size (the last may be
    smaller); tensors are moved to the model's device (when it has one) as each micro-batch is
    used. On an out-of-memory error the same batch is run again with half the micro-batch, on
    every rank together (see the module docstring).

    Args:
        model: the model given to :func:`prepare`.
        optimizer: its optimizer.
        batch: a tensor, or a dict/tuple/list of tensors, with the samples in dim 0 (or in
            ``prepare``'s ``batch_dim``); non-tensor leaves and 0-dim tensors go to every micro-batch whole.
        loss_fn: ``loss_fn(model, micro_batch) -> mean loss over the micro-batch``; under DDP it
            gets the module inside the wrapper (``ddp.module``), so that no DDP hook runs. Default:
            the one given to :func:`prepare`, else the model is called (dict -> ``model(**batch)``,
            tuple/list -> ``model(*batch)``, tensor -> ``model(batch)``) and its ``.loss`` (or its
            output, if a scalar) is the loss.

    Returns:
        This rank's mean loss over ``batch``, as a float.

    Raises:
        ConfigError: the model was not prepared, the batch cannot be split, or no loss can be found.
        OOMRecoveryError: an OOM at micro-batch 1, after ``max_retries`` halvings, or in the
            optimizer step (where a smaller micro-batch does not help).
        PeerFailedError: under DDP, another rank failed with an error that is not an OOM (that rank
            raises its own error).

    An error raised by ``loss_fn``, the model, a backward hook or the optimizer step (with its
    hooks) is re-raised unchanged, with one note (PEP 678) saying where memguard called it: which
    micro-batch and samples, or the optimizer step.

    Known limitations:
        Gradients present when ``step`` starts are discarded (with a warning), because a retry must
        start from none. Dropout draws new masks on a retry. Normalisation layers see micro-batch
        statistics, as in any gradient accumulation. Under DDP, gradient all-reduce runs after the
        backward passes instead of overlapping them, DDP communication hooks are not used, and an
        OOM while averaging gradients is not recovered (the averaging allocates nothing: its bucket
        is reserved before the first micro-batch).
    """
    from memguard.guard._pipeline_step import pipeline_run_of

    run = pipeline_run_of(model)
    if run is not None:  # a stage cut by parallel.apply: its own schedule, drained and rerun on an OOM
        if loss_fn is not None:
            raise ConfigError("a pipeline stage computes the model's own loss on its last stage: drop loss_fn")
        return run.step(optimizer, batch)
    guard = guard_of(model, _HOW_TO_PREPARE)
    loss_fn = loss_fn if loss_fn is not None else guard.options.loss_fn
    dim = guard.options.batch_dim
    if dim:  # the guard splits along dim 0: it sees the batch sample-first, the loss function as the user wrote it
        batch, loss_fn = sample_first(batch, dim), _batch_dim_loss(loss_fn, dim)
    if guard.micro_batch_size is None:
        guard.plan_and_apply(batch, optimizer, loss_fn)
    guard.open_window(model, [optimizer], warn_stale_grads=True)
    loss = float(guard.run(batch, guard.loss_of(loss_fn), model=model, last=True))
    scaler = guard.scaler

    def step_fn() -> None:
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()

    guard.optimizer_step(step_fn, lambda: optimizer.zero_grad(set_to_none=True),
                         unscale=(lambda: scaler.unscale_(optimizer)) if scaler is not None else None)
    return loss


def _moved(batch: Any, source: int, target: int) -> Any:
    """``batch`` with every tensor's dim ``source`` moved to ``target`` (views; 0-dim tensors unchanged)."""
    def move(t: torch.Tensor) -> torch.Tensor:
        return t.movedim(source, target) if t.dim() > 0 else t

    return map_tensors(batch, move)


def sample_first(batch: Any, dim: int) -> Any:
    """``batch`` with its sample dim ``dim`` moved to dim 0 (views: nothing is copied).

    Raises:
        ConfigError: a tensor of the batch has dims, but not ``dim + 1`` of them.
    """
    short = [tuple(t.shape) for t in tensor_leaves(batch) if 0 < t.dim() <= dim]
    if short:
        raise ConfigError(f"batch_dim={dim}: every tensor of the batch needs its samples in dim {dim}, but tensors of "
                          f"shape {', '.join(map(str, short))} have no dim {dim}; give them the sample dim there "
                          "(flatten inside loss_fn instead), or pass them as 0-dim tensors or non-tensors to share "
                          "them whole")
    return _moved(batch, dim, 0)


class _BatchDimLoss:
    """A loss function for sample-first micro-batches: moves the sample dim back to ``dim``, then calls
    the user's ``loss_fn`` (or the model) on the micro-batch in the user's own layout."""

    def __init__(self, loss_fn: LossFn | None, dim: int) -> None:
        self.loss_fn, self.dim = loss_fn, dim
        self.__qualname__ = getattr(loss_fn, "__qualname__", "model.loss")  # the plan cache's key names it

    def __call__(self, model: nn.Module, micro: Any) -> torch.Tensor:
        return compute_loss(model, _moved(micro, 0, self.dim), self.loss_fn)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _BatchDimLoss) and (other.loss_fn, other.dim) == (self.loss_fn, self.dim)

    def __hash__(self) -> int:
        return hash((id(self.loss_fn), self.dim))


def _batch_dim_loss(loss_fn: LossFn | None, dim: int) -> LossFn | None:
    return _BatchDimLoss(loss_fn, dim) if dim else loss_fn


def guard_status(model: nn.Module) -> GuardStatus:
    """What the guard currently does for ``model`` (the object given to :func:`prepare`).

    Raises:
        ConfigError: the model was not prepared.
    """
    return guard_of(model, "call memguard.prepare(model, optimizer) first").status()
