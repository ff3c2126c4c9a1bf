"""Hugging Face Accelerate: run a plan with the Accelerator's own accumulation, precision and backward.

::

    from accelerate import Accelerator
    from memguard.integrations.accelerate import accelerator_kwargs, prepare, step

    plan = memguard.plan(model, example_batch, global_batch_size=256, budget_bytes=8 << 30, device="cpu")
    accelerator = Accelerator(**accelerator_kwargs(plan))   # mixed precision, accumulation, cpu
    model, optimizer = prepare(accelerator, model, optimizer, plan=plan)
    loader = accelerator.prepare(DataLoader(dataset, batch_size=plan.micro_batch_size))
    for batch in loader:
        loss = step(accelerator, model, optimizer, batch, loss_fn)   # steps every k-th batch

:func:`step` is called once per dataloader batch, as in Accelerate's own gradient-accumulation
loop, and does what that loop does: it enters ``accelerator.accumulate(model)``, runs the forward
and loss under ``accelerator.autocast()``, calls ``accelerator.backward`` (which divides by the
accumulation steps and scales the loss for ``fp16``), and, when ``accelerator.sync_gradients``
says the accumulation is complete, steps and zeroes the prepared optimizer (which unscales and
skips on overflow through the Accelerator's GradScaler).

What memguard adds, through :class:`memguard.guard.window.MicroBatchWindow`: each batch is split
into micro-batches of the plan's size (weighted by their share of samples, so the gradient is
unchanged); on an out-of-memory error the micro-batch is halved and every batch of the current
optimizer step so far is run again from its first sample, losing and repeating no sample. Under
DDP (``accelerate launch`` on several processes) the micro-batches run on the module inside the
DDP wrapper, every rank reports its outcome in one small all-reduce after each batch, so all ranks
retry together, and the gradients are averaged by memguard once per optimizer step
(:mod:`memguard.guard.distributed`), after every rank has finished.

Without ``plan=`` or ``example_batch=``, :func:`prepare` plans on the first :func:`step`, from its
batch: the plan is constrained to the Accelerator's precision (``"no"`` -> the model's dtype,
``"fp16"`` -> ``16-mixed``, ``"bf16"`` -> ``bf16-mixed``), its world size and device, and the
global batch defaults to the batch's size x ``gradient_accumulation_steps`` x processes. The
dataloader's batch size and the Accelerator's accumulation stay as they are; the plan's
micro-batch is the size each batch is split into (a plan larger than the batch uses whole
batches). With ``plan=``, the Accelerator must have been built with :func:`accelerator_kwargs`.

Known limitations:
    DeepSpeed, FSDP, XLA and Megatron-LM Accelerators are not supported (for DeepSpeed, write the
    plan into its config with :func:`memguard.integrations.deepspeed.to_config`). Gradient
    clipping must be asked of :func:`prepare` (``max_grad_norm=``), since the optimizer steps
    inside :func:`step`. The loss function runs once per micro-batch (and again on a replay). Under
    DDP, gradient communication does not overlap the backward passes and DDP communication hooks
    are not used; the loss function must not start collectives of its own.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from memguard.errors import ConfigError
from memguard.guard.distributed import RankGroup, plan_on_rank_zero, rank_group_of
from memguard.guard.precision import setup_precision
from memguard.guard.runner import (
    _UNSUPPORTED_WRAPPERS,
    GuardStatus,
    _plan_problems,
    _planning_options_problems,
    _synced_buffers,
    _synced_params,
    compute_loss,
)
from memguard.guard.split import batch_size, map_tensors
from memguard.guard.window import DEFAULT_MAX_RETRIES, MicroBatchWindow, agreed_optimizer_step
from memguard.integrations import require
from memguard.planner.plan import Plan

__all__ = ["accelerator_kwargs", "prepare", "step", "status"]

logger = logging.getLogger("memguard")

LossFn = Callable[[nn.Module, Any], torch.Tensor]

# Lightning's precision names -> Accelerate's mixed_precision ("*-true" casts the model instead).
_MIXED = {"32-true": "no", "16-mixed": "fp16", "bf16-mixed": "bf16", "16-true": "no", "bf16-true": "no"}
_TRUE_DTYPES = {torch.float32: "32-true", torch.bfloat16: "bf16-true", torch.float16: "16-true"}
# Options taken from the Accelerator and the model instead of from the user.
_FROM_ACCELERATOR = ("world_size", "device", "optimizer", "loss_fn", "batch")


def accelerator_kwargs(plan: Plan) -> dict[str, Any]:
    """Keyword arguments for ``accelerate.Accelerator(...)`` that run ``plan``.

    ``mixed_precision`` (``"no"`` / ``"fp16"`` / ``"bf16"``; ``"*-true"`` plans use ``"no"`` and
    :func:`prepare` casts the model), ``gradient_accumulation_steps`` (the plan's accumulation) and
    ``cpu=True`` for a CPU plan. Build the dataloader with ``batch_size=plan.micro_batch_size``.

    Raises:
        ConfigError: ``plan`` is not a Plan, or it needs DeepSpeed (ZeRO stage > 0 or optimizer offload).
    """
    if not isinstance(plan, Plan):
        raise ConfigError(f"accelerator_kwargs needs a memguard.Plan, got {type(plan).__name__}")
    problems = _plan_problems(plan)
    if problems:
        raise ConfigError(problems)
    kwargs: dict[str, Any] = {"mixed_precision": _MIXED[plan.precision],
                              "gradient_accumulation_steps": plan.grad_accum_steps}
    if plan.device == "cpu":
        kwargs["cpu"] = True
    return kwargs


@dataclass(eq=False)
class _AccelerateState:
    """What :func:`step` needs for one prepared model (internal, mutable)."""

    module_ref: "weakref.ref[nn.Module]"
    rank_group: RankGroup | None
    loss_fn: LossFn | None
    max_retries: int
    max_grad_norm: float | None
    precision: str
    cast_input: Callable[[torch.Tensor], torch.Tensor]
    plan_request: dict | None = None
    plan: Plan | None = None
    window: MicroBatchWindow | None = None
    undo_checkpointing: Callable[[], None] | None = None
    steps: int = 0
    world_size: int = 1
    grad_scaler: Any = None


_STATES: "weakref.WeakKeyDictionary[nn.Module, _AccelerateState]" = weakref.WeakKeyDictionary()


def _accelerate() -> Any:
    return require("accelerate", "accelerate", "accelerate")


def _inner(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def _allowed_precisions(accelerator: Any, module: nn.Module) -> tuple[str, ...]:
    """The precisions this Accelerator runs: its mixed precision, or for ``"no"`` the ``*-true`` ones."""
    mp = str(getattr(accelerator, "mixed_precision", "no"))
    if mp == "fp16":
        return ("16-mixed",)
    if mp == "bf16":
        return ("bf16-mixed",)
    if mp == "no":
        first = next((p for p in module.parameters() if p.is_floating_point()), None)
        current = _TRUE_DTYPES.get(first.dtype, "32-true") if first is not None else "32-true"
        return (current,) + tuple(p for p in ("32-true", "bf16-true", "16-true") if p != current)
    return ()


def prepare(
    accelerator: Any,
    first: Any,
    second: Any,
    *,
    plan: Plan | None = None,
    example_batch: Any = None,
    global_batch_size: int | None = None,
    loss_fn: LossFn | None = None,
    max_retries: int = DEFAULT_MAX_RETRIES,
    max_grad_norm: float | None = None,
    **plan_options: Any,
) -> tuple[Any, Any]:
    """Apply a plan to a model and optimizer and prepare them with the Accelerator.

    A ``"*-true"`` plan casts the model first; then ``accelerator.prepare(model, optimizer)`` runs,
    unless the optimizer is already an Accelerate optimizer (both were prepared already). The plan
    is ``plan=``, or made now from ``example_batch=`` (under DDP rank 0 plans and broadcasts), or
    made on the first :func:`step` (see the module docstring); its activation checkpointing is
    applied to the model's repeated blocks.

    Args:
        accelerator: an ``accelerate.Accelerator`` (single process, or DDP over processes).
        first, second: the model and its optimizer, in either order; returned prepared, in the same order.
        plan: a :class:`memguard.Plan` to apply; the Accelerator must match it (:func:`accelerator_kwargs`).
        example_batch: a batch like this rank's dataloader batches, to plan now.
        global_batch_size: samples per optimizer step over all ranks, for planning (default: the
            batch's size x ``gradient_accumulation_steps`` x processes).
        loss_fn: ``loss_fn(model, batch) -> mean loss``, the default for :func:`step`; None calls the
            model with the batch and takes ``output.loss`` (as :func:`memguard.step`).
        max_retries: at most this many halvings within one optimizer step.
        max_grad_norm: clip the gradients' norm to this (``accelerator.clip_grad_norm_``) before each
            optimizer step; None does not clip.
        **plan_options: options for :func:`memguard.plan` (``budget_bytes``, ``gpu``, ``headroom``,
            ``activation_checkpointing``, ``precision`` if it is the Accelerator's, ...).

    Returns:
        ``(model, optimizer)`` as ``accelerator.prepare`` returns them, in the order given.

    Raises:
        MissingDependencyError: accelerate is not installed.
        ConfigError: bad arguments (all listed), an Accelerator that is not single-process or DDP, or
            one whose precision or accumulation differs from the plan's.
        InfeasiblePlanError: planning now found nothing that fits.
    """
    acc = _accelerate()
    problems: list[str] = []
    if not isinstance(accelerator, acc.Accelerator):
        problems.append(f"the first argument must be an accelerate.Accelerator, got {type(accelerator).__name__}")
    pair = (first, second)
    models = [x for x in pair if isinstance(x, nn.Module)]
    optimizers = [x for x in pair if isinstance(x, (torch.optim.Optimizer, acc.optimizer.AcceleratedOptimizer))]
    if len(models) != 1 or len(optimizers) != 1:
        problems.append("prepare takes the accelerator, then the model (an nn.Module) and its optimizer, in either "
                        f"order; got {type(first).__name__} and {type(second).__name__}")
    if problems:
        raise ConfigError(problems)
    model, optimizer = models[0], optimizers[0]
    dtype = str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type))
    if dtype != "NO" and not dtype.startswith("MULTI_"):
        problems.append(f"Accelerator with distributed_type {dtype} is not supported: memguard's Accelerate hooks "
                        "run one process or DDP (for DeepSpeed, write the plan into its config with "
                        "memguard.integrations.deepspeed.to_config)")
    for cls in type(model).__mro__:
        if cls.__name__ in _UNSUPPORTED_WRAPPERS:
            problems.append(_UNSUPPORTED_WRAPPERS[cls.__name__])
            break
    if plan is not None and not isinstance(plan, Plan):
        problems.append(f"plan must be a memguard.Plan, got {type(plan).__name__}; build it with memguard.plan()")
    if plan is not None and example_batch is not None:
        problems.append("pass only one of plan= / example_batch=: each sets the micro-batch")
    if global_batch_size is not None and (isinstance(global_batch_size, bool)
                                          or not isinstance(global_batch_size, int) or global_batch_size < 1):
        problems.append(f"global_batch_size must be a positive int, got {global_batch_size!r}")
    if loss_fn is not None and not callable(loss_fn):
        problems.append("loss_fn must be callable as loss_fn(model, batch) -> mean loss")
    if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
        problems.append(f"max_retries must be an int >= 0, got {max_retries!r}")
    if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float))
                                      or max_grad_norm <= 0):
        problems.append(f"max_grad_norm must be None or a positive number, got {max_grad_norm!r}")
    taken = sorted(k for k in plan_options if k in _FROM_ACCELERATOR)
    if taken:
        problems.append(f"{', '.join(taken)} come from the Accelerator and the model; drop them")
    inner = _inner(model)
    allowed = _allowed_precisions(accelerator, inner)
    if not allowed:
        problems.append(f"the Accelerator's mixed_precision {accelerator.mixed_precision!r} is not one memguard plans "
                        "for; use 'no', 'fp16' or 'bf16'")
    if isinstance(plan, Plan):
        problems += _plan_problems(plan)
        if plan_options:
            problems.append(f"{', '.join(sorted(plan_options))} only apply when memguard plans; drop them or plan=")
        if allowed and plan.precision not in allowed:
            problems.append(f"the plan's precision {plan.precision!r} does not match the Accelerator's mixed_precision "
                            f"{accelerator.mixed_precision!r}; build it with Accelerator(**accelerator_kwargs(plan))")
        if plan.grad_accum_steps != accelerator.gradient_accumulation_steps:
            problems.append(f"the plan accumulates {plan.grad_accum_steps} micro-batches but the Accelerator "
                            f"{accelerator.gradient_accumulation_steps}; build it with "
                            "Accelerator(**accelerator_kwargs(plan))")
        if plan.world_size != accelerator.num_processes:
            problems.append(f"the plan was made for {plan.world_size} processes but the Accelerator runs "
                            f"{accelerator.num_processes}; plan with world_size={accelerator.num_processes}")
    else:
        problems += _planning_options_problems({k: v for k, v in plan_options.items() if k not in _FROM_ACCELERATOR})
        wanted = plan_options.get("precision")
        if wanted is not None and allowed:
            asked = tuple(wanted) if isinstance(wanted, (list, tuple, set, frozenset)) else (wanted,)
            if allowed[0] not in asked:
                problems.append(f"precision={wanted!r} was asked for but the Accelerator runs {allowed[0]!r} (its "
                                f"mixed_precision {accelerator.mixed_precision!r}); build the Accelerator with that "
                                "precision (accelerator_kwargs) or drop the option")
    if problems:
        raise ConfigError(problems)

    already = isinstance(optimizer, acc.optimizer.AcceleratedOptimizer)
    raw_optimizer = optimizer.optimizer if already else optimizer
    precision = plan.precision if isinstance(plan, Plan) else allowed[0]
    # "*-true": cast the model now (as memguard.prepare does), before Accelerate wraps it in DDP.
    setup = setup_precision(precision, inner, raw_optimizer, wrapped=isinstance(model, nn.parallel.DistributedDataParallel)) \
        if precision.endswith("-true") else None
    state = _AccelerateState(
        module_ref=weakref.ref(inner), rank_group=None, loss_fn=loss_fn, max_retries=max_retries,
        max_grad_norm=max_grad_norm, precision=precision,
        cast_input=setup.cast_input if setup is not None else (lambda t: t),
        plan_request={"global_batch_size": global_batch_size, "options": dict(plan_options)},
    )
    if not already:
        prepared = accelerator.prepare(model, optimizer)
        model, optimizer = prepared[0], prepared[1]
    state.rank_group = rank_group_of(model)
    if isinstance(plan, Plan):
        _apply(state, inner, plan)
    elif example_batch is not None:  # under DDP rank 0 plans and broadcasts: free memory differs between ranks
        _apply(state, inner, plan_on_rank_zero(
            state.rank_group, lambda: _make_plan(accelerator, state, inner, raw_optimizer, example_batch, loss_fn)))
    state.world_size = accelerator.num_processes
    state.grad_scaler = getattr(accelerator, "scaler", None)
    _STATES[model] = state
    return (model, optimizer) if isinstance(first, nn.Module) else (optimizer, model)


def _make_plan(accelerator: Any, state: _AccelerateState, inner: nn.Module, optimizer: Any, batch: Any,
               loss_fn: LossFn | None) -> Plan:
    import memguard

    request = state.plan_request or {"global_batch_size": None, "options": {}}
    options = dict(request["options"])
    options["precision"] = state.precision  # constrained to the Accelerator's
    options.setdefault("zero_stage", 0)
    options.setdefault("offload_optimizer", False)
    world = accelerator.num_processes
    gbs = request["global_batch_size"] or batch_size(batch) * accelerator.gradient_accumulation_steps * world
    return memguard.plan(inner, batch, global_batch_size=gbs, optimizer=optimizer, loss_fn=loss_fn,
                         world_size=world, device=accelerator.device.type, **options)


def _apply(state: _AccelerateState, inner: nn.Module, plan: Plan) -> None:
    """The plan's activation checkpointing; the micro-batch is applied by the window of the first step."""
    if state.undo_checkpointing is None and plan.activation_checkpointing and plan.checkpoint_blocks > 0:
        from memguard.estimator.blocks import apply_activation_checkpointing

        state.undo_checkpointing = apply_activation_checkpointing(inner, plan.checkpoint_blocks)
    state.plan = plan
    state.plan_request = None


def step(accelerator: Any, model: nn.Module, optimizer: Any, batch: Any, loss_fn: LossFn | None = None) -> float:
    """Forward and backward one dataloader batch, and step the optimizer when the accumulation is complete.

    Args:
        accelerator: the Accelerator given to :func:`prepare`.
        model: the model :func:`prepare` returned.
        optimizer: the optimizer :func:`prepare` returned.
        batch: this rank's dataloader batch (a tensor or a dict/tuple/list of tensors, samples in
            dim 0); tensors are moved to ``accelerator.device`` if they are elsewhere.
        loss_fn: ``loss_fn(module, micro_batch) -> mean loss`` (it gets the module inside any DDP
            wrapper); default: the one given to :func:`prepare`, else the model's ``.loss``.

    Returns:
        This rank's mean loss over ``batch``, as a float.

    Raises:
        ConfigError: the model was not prepared by :func:`prepare`, the batch cannot be split, or no
            loss can be found.
        OOMRecoveryError: an OOM at micro-batch 1, after ``max_retries`` halvings, or in the optimizer step.
        MemguardError: under DDP, another rank failed with an error that is not an OOM.
    """
    state = _STATES.get(model)
    if state is None:
        raise ConfigError("this model was not prepared by memguard; call model, optimizer = "
                          "memguard.integrations.accelerate.prepare(accelerator, model, optimizer) first and pass the "
                          "model it returns")
    inner = state.module_ref()
    if inner is None:
        raise ConfigError("the prepared module no longer exists; call prepare again")
    loss_fn = loss_fn if loss_fn is not None else state.loss_fn
    raw = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
    if state.plan is None:
        plan = plan_on_rank_zero(state.rank_group,
                                 lambda: _make_plan(accelerator, state, inner, raw, batch, loss_fn))
        problems = _plan_problems(plan)
        if problems:
            raise ConfigError(problems)
        _apply(state, inner, plan)
    if state.window is None:
        plan = state.plan
        assert plan is not None
        # The dataloader's batch is the most one forward can take: a larger planned micro-batch uses whole batches.
        micro = min(plan.micro_batch_size, batch_size(batch))
        state.window = MicroBatchWindow(micro, rank_group=state.rank_group, sync_gradients=True,
                                        max_retries=state.max_retries, plan=plan, precision=plan.precision)
        if accelerator.is_main_process:
            logger.info("memguard runs micro-batch %d within each dataloader batch of this plan:\n%s", micro,
                        plan.explain())
    window = state.window
    device = accelerator.device
    cast = state.cast_input

    def place(t: torch.Tensor) -> torch.Tensor:
        return cast(t.to(device) if t.device != device else t)

    def loss_of(micro: Any) -> torch.Tensor:
        micro = map_tensors(micro, place)
        with accelerator.autocast():
            return compute_loss(inner, micro, loss_fn)

    with accelerator.accumulate(model):
        if not window.is_open:
            window.start(inner, _synced_params(model, inner), [raw])
        last = bool(accelerator.sync_gradients)
        try:
            loss = window.run(batch, loss_of, accelerator.backward, last=last)
            if last:
                window.sync_gradients(_synced_buffers(model, inner))
        except BaseException:
            window.finish()
            raise
        if last:
            params = window.params
            window.finish()

            def step_fn() -> None:
                if state.max_grad_norm is not None:
                    accelerator.clip_grad_norm_(params, state.max_grad_norm)
                optimizer.step()

            def zero() -> None:
                optimizer.zero_grad(set_to_none=True)
                for p in params:
                    p.grad = None

            agreed_optimizer_step(step_fn, state.rank_group, after=zero, plan=state.plan, precision=state.precision,
                                  micro_batch_size=window.micro_batch_size)
            state.steps += 1
    return float(loss)


def status(model: nn.Module) -> GuardStatus:
    """What memguard currently does for ``model`` (as :func:`prepare` returned it).

    Raises:
        ConfigError: the model was not prepared by :func:`prepare`.
    """
    state = _STATES.get(model)
    if state is None:
        raise ConfigError("this model was not prepared by memguard.integrations.accelerate.prepare")
    window = state.window
    return GuardStatus(
        micro_batch_size=window.micro_batch_size if window is not None else None,
        planned_micro_batch_size=state.plan.micro_batch_size if state.plan is not None else None,
        precision=state.precision, plan=state.plan, grad_scaler=state.grad_scaler, world_size=state.world_size,
        steps=state.steps, oom_retries=window.oom_retries if window is not None else 0,
    )
