"""``prepare`` and ``step``: run a plan in plain PyTorch and recover from OOM without losing a sample.

``prepare`` keeps its per-model state in a ``WeakKeyDictionary`` keyed by the model it was given, so
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
   other collective (:mod:`memguard.guard.distributed`), so all ranks retry together; gradients are
   averaged only once every rank has finished every micro-batch.
4. The optimizer (through the GradScaler for ``16-mixed``) steps and the gradients are set to None.

Each retry is logged at WARNING on the ``memguard`` logger. The new micro-batch is kept for the
following steps; with ``probe_up_after=N`` it is doubled again (up to the planned size) after N
steps without an OOM. When memguard planned with ``cache=True`` (or a ``PlanCache``), the reduced
micro-batch is also written to the plan cache, and the next run of the same job starts from it.
At micro-batch 1 an OOM raises :class:`memguard.OOMRecoveryError`.

Steps 1-3 are :class:`memguard.guard.window.MicroBatchWindow` with a window of one batch; the
framework integrations use the same class with one window per optimizer step of several batches.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from memguard.errors import ConfigError
from memguard.guard import distributed as ddp_sync
from memguard.guard.distributed import ERROR, RankGroup, plan_on_rank_zero, rank_group_of
from memguard.guard.precision import PRECISIONS, PrecisionSetup, setup_precision
from memguard.guard.split import batch_size, map_tensors
from memguard.guard.window import DEFAULT_MAX_RETRIES, MicroBatchWindow, agreed_optimizer_step
from memguard.planner.plan import Plan

__all__ = ["prepare", "step", "guard_status", "GuardStatus", "compute_loss"]

logger = logging.getLogger("memguard")

LossFn = Callable[[nn.Module, Any], torch.Tensor]

# Wrappers whose forward cannot be bypassed the way DDP's can; they need their own integration.
_UNSUPPORTED_WRAPPERS = {
    "FullyShardedDataParallel": "FSDP shards parameters inside its forward; memguard.prepare supports a plain "
    "module or one wrapped in DistributedDataParallel",
    "FSDPModule": "FSDP shards parameters inside its forward; memguard.prepare supports a plain module or one "
    "wrapped in DistributedDataParallel",
    "DeepSpeedEngine": "DeepSpeed runs its own step; turn the plan into a DeepSpeed config with "
    "memguard.integrations.deepspeed.to_config instead",
}


# The fields that identify a planned configuration, for the plan-cache key of its reduced form.
_PLAN_IDENTITY = ("micro_batch_size", "grad_accum_steps", "world_size", "global_batch_size", "precision",
                  "activation_checkpointing", "checkpoint_blocks", "zero_stage", "offload_optimizer", "device", "gpu",
                  "budget_bytes", "headroom")


@dataclass(eq=False)
class _GuardState:
    """Everything ``step`` needs for one prepared model (internal, mutable)."""

    module_ref: "weakref.ref[nn.Module]"
    rank_group: RankGroup | None
    world_size: int
    loss_fn: LossFn | None
    max_retries: int
    probe_up_after: int | None
    input_device: torch.device | None
    grad_scaler: Any = None
    precision: PrecisionSetup | None = None
    plan: Plan | None = None
    micro_batch_size: int | None = None
    ceiling: int | None = None
    plan_request: dict | None = None
    undo_checkpointing: Callable[[], None] | None = None
    oom_cache: tuple[Any, str] | None = None
    clean_steps: int = 0
    oom_retries: int = 0
    steps: int = 0
    warned_stale_grads: bool = False


_STATES: "weakref.WeakKeyDictionary[nn.Module, _GuardState]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class GuardStatus:
    """What the guard currently does for a prepared model.

    Attributes:
        micro_batch_size: the micro-batch the next step uses (None until planned on the first step).
        planned_micro_batch_size: the micro-batch the plan (or ``micro_batch_size=``) asked for.
        precision: the precision name in force (None until planned).
        plan: the plan in force, if memguard planned or was given one.
        grad_scaler: the ``torch.amp.GradScaler`` of ``16-mixed``, else None.
        world_size: data-parallel ranks.
        steps: optimizer steps taken through :func:`step`.
        oom_retries: micro-batch halvings so far.
    """

    micro_batch_size: int | None
    planned_micro_batch_size: int | None
    precision: str | None
    plan: Plan | None
    grad_scaler: Any
    world_size: int
    steps: int
    oom_retries: int


# --------------------------------------------------------------------------------------------------
# prepare


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
    grad_scaler: torch.amp.GradScaler | None = None,
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
    blocks, and its precision as in :mod:`memguard.guard.precision`. Preparing a model again undoes
    the checkpointing of the previous call.

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
        grad_scaler: the ``torch.amp.GradScaler`` to use if the precision is ``16-mixed`` (to set its
            options or load its state); default: a new one with PyTorch's defaults.
        **plan_options: options for ``memguard.plan`` (see above).

    Returns:
        ``(first, second)``, unchanged objects.

    Raises:
        ConfigError: bad arguments (every problem listed), an unsupported wrapper (FSDP, DeepSpeed),
            a plan that needs ZeRO or optimizer offload, or a cast that is no longer possible.
        InfeasiblePlanError: planning now (``example_batch``) found nothing that fits.

    Known limitations:
        ``*-true`` precisions cast the model in place; they cannot be undone by preparing again.
    """
    problems: list[str] = []
    model, optimizer = _sort_args(first, second, problems)
    if model is not None:
        for cls in type(model).__mro__:
            if cls.__name__ in _UNSUPPORTED_WRAPPERS:
                problems.append(_UNSUPPORTED_WRAPPERS[cls.__name__])
                break
    sources = [name for name, v in (("plan", plan), ("micro_batch_size", micro_batch_size),
                                     ("example_batch", example_batch)) if v is not None]
    if len(sources) > 1:
        problems.append(f"pass only one of {' / '.join(s + '=' for s in sources)}: each sets the micro-batch")
    if plan is not None and not isinstance(plan, Plan):
        problems.append(f"plan must be a memguard.Plan, got {type(plan).__name__}; build it with memguard.plan()")
    if micro_batch_size is not None and (isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int)
                                         or micro_batch_size < 1):
        problems.append(f"micro_batch_size must be a positive int, got {micro_batch_size!r}")
    if global_batch_size is not None and (isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int)
                                          or global_batch_size < 1):
        problems.append(f"global_batch_size must be a positive int, got {global_batch_size!r}")
    if loss_fn is not None and not callable(loss_fn):
        problems.append("loss_fn must be callable as loss_fn(model, batch) -> mean loss")
    if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
        problems.append(f"max_retries must be an int >= 0, got {max_retries!r}")
    if probe_up_after is not None and (isinstance(probe_up_after, bool) or not isinstance(probe_up_after, int)
                                       or probe_up_after < 1):
        problems.append(f"probe_up_after must be None or an int >= 1, got {probe_up_after!r}")
    if grad_scaler is not None and not isinstance(grad_scaler, torch.amp.GradScaler):
        problems.append(f"grad_scaler must be a torch.amp.GradScaler, got {type(grad_scaler).__name__}")
    if isinstance(plan, Plan):
        problems += _plan_problems(plan)
        if plan_options:
            problems.append(f"{', '.join(sorted(plan_options))} only apply when memguard plans; drop them or plan=")
        if global_batch_size is not None and global_batch_size != plan.global_batch_size:
            problems.append(f"global_batch_size {global_batch_size} differs from the plan's {plan.global_batch_size}")
    elif micro_batch_size is not None:
        problems += _fixed_options_problems(plan_options)
    else:
        problems += _planning_options_problems(plan_options)
    if problems:
        raise ConfigError(problems)

    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    rg = rank_group_of(model)
    world = rg.world_size if rg is not None else _world_size()
    old = _STATES.pop(model, None)
    if old is not None and old.undo_checkpointing is not None:
        old.undo_checkpointing()
    devices = {p.device for p in inner.parameters()}
    state = _GuardState(
        module_ref=weakref.ref(inner), rank_group=rg, world_size=world, loss_fn=loss_fn,
        max_retries=max_retries, probe_up_after=probe_up_after, grad_scaler=grad_scaler,
        input_device=next(iter(devices)) if len(devices) == 1 else None,
    )
    wrapped = rg is not None
    if isinstance(plan, Plan):
        if plan.world_size != world:
            logger.warning("the plan was made for %d ranks but %d are running; its micro-batch %d is used as is",
                           plan.world_size, world, plan.micro_batch_size)
        _apply(state, inner, optimizer, plan.micro_batch_size, plan.precision,
               plan.checkpoint_blocks if plan.activation_checkpointing else 0, wrapped, plan)
    elif micro_batch_size is not None:
        blocks = _blocks_for(inner, plan_options.get("activation_checkpointing", False))
        _apply(state, inner, optimizer, micro_batch_size, plan_options.get("precision", "32-true"), blocks, wrapped)
    else:
        state.plan_request = {"global_batch_size": global_batch_size, "options": dict(plan_options)}
        if example_batch is not None:
            _plan_and_apply(state, inner, optimizer, example_batch, loss_fn)
    _STATES[model] = state
    return first, second


def _sort_args(first: Any, second: Any, problems: list[str]) -> tuple[nn.Module | None, Any]:
    pair = (first, second)
    models = [x for x in pair if isinstance(x, nn.Module)]
    optimizers = [x for x in pair if isinstance(x, torch.optim.Optimizer)]
    if len(models) != 1 or len(optimizers) != 1:
        problems.append(
            "prepare takes the model (an nn.Module) and its optimizer (a torch.optim.Optimizer), in either "
            f"order; got {type(first).__name__} and {type(second).__name__}"
        )
        return None, None
    return models[0], optimizers[0]


def _plan_problems(plan: Plan) -> list[str]:
    out = []
    if plan.zero_stage != 0:
        out.append(f"the plan uses ZeRO stage {plan.zero_stage}, which plain PyTorch cannot apply; run it with "
                   "DeepSpeed (memguard.integrations.deepspeed.to_config) or plan with zero_stage=0")
    if plan.offload_optimizer:
        out.append("the plan offloads the optimizer, which needs DeepSpeed; plan with zero_stage=0")
    if plan.precision not in PRECISIONS:
        out.append(f"the plan's precision {plan.precision!r} is not one of {', '.join(PRECISIONS)}")
    return out


def _fixed_options_problems(options: Mapping[str, Any]) -> list[str]:
    out = []
    extra = sorted(set(options) - {"precision", "activation_checkpointing"})
    if extra:
        out.append(f"{', '.join(extra)} only apply when memguard plans; drop micro_batch_size= to plan, or drop them")
    p = options.get("precision", "32-true")
    if p not in PRECISIONS:
        out.append(f"with micro_batch_size=, precision must be one of {', '.join(PRECISIONS)}, got {p!r}")
    ac = options.get("activation_checkpointing", False)
    if not isinstance(ac, (bool, int)) or (not isinstance(ac, bool) and ac < 0):
        out.append("with micro_batch_size=, activation_checkpointing must be True/False or a number of blocks, "
                   f"got {ac!r}")
    return out


def _planning_options_problems(options: Mapping[str, Any]) -> list[str]:
    out = []
    zs = options.get("zero_stage", 0)
    if zs not in (0, (0,), [0]):
        out.append(f"zero_stage={zs!r} needs DeepSpeed; plain PyTorch runs ZeRO stage 0 "
                   "(use memguard.integrations.deepspeed for ZeRO)")
    make_plan = _planner()
    if make_plan is not None:
        params = inspect.signature(make_plan).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            taken = {"model", "batch", "global_batch_size", "optimizer", "loss_fn", "world_size"}
            unknown = sorted(k for k in options if k not in params or k in taken)
            if unknown:
                out.append(f"unknown plan options {', '.join(unknown)}; memguard.plan accepts "
                           f"{', '.join(k for k in params if k not in taken)}")
    return out


def _planner() -> Callable[..., Plan] | None:
    try:
        module = importlib.import_module("memguard.planner.search")
    except ImportError:
        return None
    return getattr(module, "plan", None)


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _blocks_for(inner: nn.Module, setting: bool | int) -> int:
    if setting is False or setting == 0:
        return 0
    from memguard.estimator.blocks import find_blocks

    found = len(find_blocks(inner))
    if found == 0:
        raise ConfigError("activation_checkpointing was asked for, but memguard found no repeated blocks in the "
                          "model; checkpoint it yourself (torch.utils.checkpoint) and pass "
                          "activation_checkpointing=False")
    if setting is True:
        return found
    if setting > found:
        raise ConfigError(f"activation_checkpointing={setting} blocks, but the model has {found}; pass at most {found}")
    return int(setting)


def _apply(state: _GuardState, inner: nn.Module, optimizer: torch.optim.Optimizer, micro_batch_size: int,
           precision: str, blocks: int, wrapped: bool, plan: Plan | None = None) -> None:
    state.precision = setup_precision(precision, inner, optimizer, wrapped=wrapped, scaler=state.grad_scaler)
    if blocks > 0:
        from memguard.estimator.blocks import apply_activation_checkpointing

        state.undo_checkpointing = apply_activation_checkpointing(inner, blocks)
    state.plan = plan
    state.micro_batch_size = state.ceiling = micro_batch_size
    state.plan_request = None


def _plan_and_apply(state: _GuardState, inner: nn.Module, optimizer: torch.optim.Optimizer, batch: Any,
                    loss_fn: LossFn | None) -> None:
    """Plan from ``batch`` (rank 0 plans and broadcasts under DDP) and apply the plan."""
    plan = plan_on_rank_zero(state.rank_group, lambda: _call_planner(state, inner, optimizer, batch, loss_fn))
    problems = _plan_problems(plan)
    if problems:
        raise ConfigError(problems)
    _apply(state, inner, optimizer, plan.micro_batch_size, plan.precision,
           plan.checkpoint_blocks if plan.activation_checkpointing else 0, state.rank_group is not None, plan)
    logger.info("planned micro-batch %d x accumulation %d x world %d, %s",
                plan.micro_batch_size, plan.grad_accum_steps, plan.world_size, plan.precision)


def _call_planner(state: _GuardState, inner: nn.Module, optimizer: torch.optim.Optimizer, batch: Any,
                  loss_fn: LossFn | None) -> Plan:
    make_plan = _planner()
    if make_plan is None:
        raise ConfigError("this memguard has no planner (memguard.planner.search); pass plan= or micro_batch_size=")
    request = state.plan_request or {"global_batch_size": None, "options": {}}
    options = dict(request["options"])
    options.setdefault("device", state.input_device.type if state.input_device is not None else "cuda")
    options.setdefault("zero_stage", 0)
    gbs = request["global_batch_size"] or batch_size(batch) * state.world_size
    plan = make_plan(inner, batch, global_batch_size=gbs, optimizer=optimizer, loss_fn=loss_fn,
                     world_size=state.world_size, **options)
    if options.get("cache"):
        # The plan cache also remembers what the guard learnt: a micro-batch reduced after an OOM is stored
        # under a key derived from the planner's plan, and used instead of it on the next run.
        from memguard.planner.cache import PlanCache, plan_key

        store = options["cache"] if isinstance(options["cache"], PlanCache) else PlanCache()
        knobs = {k: getattr(plan, k) for k in _PLAN_IDENTITY}
        key = plan_key(inner, batch, optimizer, loss_fn, {"memguard.guard": "reduced after OOM", **knobs})
        state.oom_cache = (store, key)
        reduced = store.get(key)
        if reduced is not None:
            logger.info("using micro-batch %d, remembered in the plan cache after an out-of-memory error (planned %d)",
                        reduced.micro_batch_size, plan.micro_batch_size)
            return reduced
    return plan


# --------------------------------------------------------------------------------------------------
# step


def step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any, loss_fn: LossFn | None = None) -> float:
    """One optimizer step on ``batch`` (this rank's share of the global batch); the mean loss.

    The batch is split along dim 0 into micro-batches of the current size (the last may be
    smaller); tensors are moved to the model's device (when it has one) as each micro-batch is
    used. On an out-of-memory error the same batch is run again with half the micro-batch, on
    every rank together (see the module docstring).

    Args:
        model: the model given to :func:`prepare`.
        optimizer: its optimizer.
        batch: a tensor, or a dict/tuple/list of tensors, with the samples in dim 0; non-tensor
            leaves and 0-dim tensors go to every micro-batch whole.
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
        MemguardError: under DDP, another rank failed with an error that is not an OOM (that rank
            raises its own error).

    Known limitations:
        Gradients present when ``step`` starts are discarded (with a warning), because a retry must
        start from none. Dropout draws new masks on a retry. Normalisation layers see micro-batch
        statistics, as in any gradient accumulation. Under DDP, gradient all-reduce runs after the
        backward passes instead of overlapping them, DDP communication hooks are not used, and an
        OOM while averaging gradients is not recovered (the averaging allocates nothing: its bucket
        is reserved before the first micro-batch).
    """
    state = _STATES.get(model)
    if state is None:
        raise ConfigError("this model was not prepared; call model, optimizer = memguard.prepare(model, optimizer) "
                          "first and pass the same model object to memguard.step")
    inner = state.module_ref()
    if inner is None:  # the wrapper outlived the module it wraps: cannot happen with DDP, kept for safety
        raise ConfigError("the prepared module no longer exists; call memguard.prepare again")
    loss_fn = loss_fn if loss_fn is not None else state.loss_fn
    if state.micro_batch_size is None:
        _plan_and_apply(state, inner, optimizer, batch, loss_fn)
    rg = state.rank_group
    params = _synced_params(model, inner)
    try:
        batch_size(batch)
    except ConfigError:
        if rg is not None:  # tell the peers, which would otherwise wait in the agreement forever
            ddp_sync.agree(rg, ERROR, [0] * (1 + len(params)))
        raise
    _drop_stale_grads(state, params)
    prec = state.precision
    assert prec is not None  # set by prepare or by planning before the first step
    device = state.input_device

    def place(t: torch.Tensor) -> torch.Tensor:
        if device is not None and t.device != device:
            t = t.to(device, non_blocking=True)
        return prec.cast_input(t)

    def loss_of(micro: Any) -> torch.Tensor:
        micro = map_tensors(micro, place)
        with prec.autocast():
            return compute_loss(inner, micro, loss_fn)

    def backward(weighted: torch.Tensor) -> None:
        (prec.scaler.scale(weighted) if prec.scaler is not None else weighted).backward()

    def on_halve(new: int) -> None:
        state.micro_batch_size = new
        state.oom_retries += 1
        _remember(state)

    window = MicroBatchWindow(state.micro_batch_size, rank_group=rg, sync_gradients=True,
                              max_retries=state.max_retries, plan=state.plan, precision=prec.precision,
                              on_halve=on_halve)
    window.start(inner, params, [optimizer])
    try:
        total = window.run(batch, loss_of, backward, last=True)
        window.sync_gradients(_synced_buffers(model, inner))
    finally:
        window.finish()
    loss = float(total)
    total = None
    _optimizer_step(state, optimizer, params)
    state.steps += 1
    state.clean_steps = 0 if window.retried else state.clean_steps + 1
    _maybe_probe_up(state)
    return loss


def compute_loss(model: nn.Module, batch: Any, loss_fn: LossFn | None = None) -> torch.Tensor:
    """The scalar loss of ``model`` on ``batch``: ``loss_fn(model, batch)``, or the model's own loss.

    Raises:
        ConfigError: no scalar loss could be found, with how to pass ``loss_fn``.
    """
    if loss_fn is not None:
        out = loss_fn(model, batch)
        source = "loss_fn"
    else:
        if isinstance(batch, Mapping):
            out = model(**batch)
        elif isinstance(batch, (tuple, list)):
            out = model(*batch)
        else:
            out = model(batch)
        source = "the model"
        found = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
        if isinstance(found, torch.Tensor):
            out = found
    if not isinstance(out, torch.Tensor) or out.numel() != 1:
        what = f"a tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigError(
            f"{source} returned {what}, not a scalar loss; pass loss_fn=lambda model, batch: <mean loss of the "
            "batch> to memguard.prepare or memguard.step (or include the labels so the model returns .loss)"
        )
    return out.reshape(())


def _synced_params(model: nn.Module, inner: nn.Module) -> list[nn.Parameter]:
    ignored = getattr(model, "parameters_to_ignore", set()) if model is not inner else set()
    return [p for name, p in inner.named_parameters() if p.requires_grad and name not in ignored]


def _synced_buffers(model: nn.Module, inner: nn.Module) -> list[torch.Tensor]:
    ignored = getattr(model, "parameters_to_ignore", set())
    return [b for name, b in inner.named_buffers() if name not in ignored]


def _drop_stale_grads(state: _GuardState, params: Sequence[nn.Parameter]) -> None:
    stale = [p for p in params if p.grad is not None]
    if stale and not state.warned_stale_grads:
        logger.warning("memguard.step found gradients from before the step and discards them: a step that may be "
                       "retried must start from none (let memguard.step run the whole backward)")
        state.warned_stale_grads = True
    for p in stale:
        p.grad = None


def _discard(params: Sequence[nn.Parameter], optimizer: torch.optim.Optimizer) -> None:
    """Drop every gradient of the failed attempt, in the model and in the optimizer."""
    for p in params:
        p.grad = None
    optimizer.zero_grad(set_to_none=True)


def _optimizer_step(state: _GuardState, optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter]) -> None:
    """Step (through the GradScaler for 16-mixed), zero the grads, and agree with the peers on the outcome."""
    scaler = state.precision.scaler if state.precision else None

    def step_fn() -> None:
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()

    agreed_optimizer_step(step_fn, state.rank_group, after=lambda: _discard(params, optimizer), plan=state.plan,
                          precision=state.precision.precision if state.precision else None,
                          micro_batch_size=state.micro_batch_size or 0)


def _maybe_probe_up(state: _GuardState) -> None:
    every = state.probe_up_after
    mbs, ceiling = state.micro_batch_size, state.ceiling
    if every is None or mbs is None or ceiling is None or mbs >= ceiling or state.clean_steps < every:
        return
    new = min(ceiling, mbs * 2)
    logger.info("%d steps without an out-of-memory error; probing micro-batch %d -> %d", state.clean_steps, mbs, new)
    state.micro_batch_size = new
    state.clean_steps = 0


def _remember(state: _GuardState) -> None:
    """Write the reduced micro-batch to the plan cache, when memguard planned with ``cache=``."""
    mbs, plan = state.micro_batch_size, state.plan
    if state.oom_cache is None or plan is None or mbs is None:
        logger.debug("micro-batch %s is kept for this process only (plan with cache=True to keep it across runs)", mbs)
        return
    store, key = state.oom_cache
    local = plan.global_batch_size // plan.world_size
    fit = max(d for d in range(1, min(mbs, local) + 1) if local % d == 0)  # a Plan needs mbs | local batch
    reduced = plan.replace(
        micro_batch_size=fit, grad_accum_steps=local // fit,
        reasons={**plan.reasons, "micro_batch_size": f"reduced from {plan.micro_batch_size} to {fit} after an "
                 "out-of-memory error in training (the estimate is still the planned one's)"},
    )
    try:
        store.put(key, reduced)
    except Exception as exc:  # a cache that cannot be written must not stop training
        logger.warning("could not write micro-batch %d to the plan cache: %s", fit, exc)


def guard_status(model: nn.Module) -> GuardStatus:
    """What the guard currently does for ``model`` (the object given to :func:`prepare`).

    Raises:
        ConfigError: the model was not prepared.
    """
    state = _STATES.get(model)
    if state is None:
        raise ConfigError("this model was not prepared; call memguard.prepare(model, optimizer) first")
    prec = state.precision
    return GuardStatus(
        micro_batch_size=state.micro_batch_size, planned_micro_batch_size=state.ceiling,
        precision=prec.precision if prec else None, plan=state.plan,
        grad_scaler=prec.scaler if prec else None, world_size=state.world_size,
        steps=state.steps, oom_retries=state.oom_retries,
    )
