"""The guard core: one implementation of what every front-end that runs a plan does.

A *front-end* is the API a user trains through: :func:`memguard.prepare` / :func:`memguard.step`,
the Lightning callback, the Accelerate hooks. Each translates its framework onto this module:

* :class:`Constraints` says what the front-end fixes (its precision, world size, ZeRO stages,
  accumulation, the plan options it supplies itself) and how a user changes it;
  :func:`option_problems` checks a front-end's arguments against them, listing every problem;
* :class:`Guard` is the per-model state: it plans under the constraints (rank 0 plans and
  broadcasts under DDP; :func:`plan_options_problems` and :func:`call_planner` are the one place
  that talks to the planner), applies a plan (micro-batch, precision, activation checkpointing;
  every change can be undone), runs batches through :class:`memguard.guard.window.MicroBatchWindow`
  (the OOM engine) at the micro-batch of each batch's shape (:mod:`memguard.guard.shapes`: a new
  shape is planned before it runs, an OOM halves only its own shape's micro-batch), steps the
  optimizer with the ranks' agreement, remembers a reduced micro-batch in the plan cache, and
  reports a :class:`GuardStatus`;
* :func:`register` / :func:`guard_of` keep one guard per model object.

What stays in a front-end is translation only: where its framework keeps the model, optimizer,
precision, world size and batches, and which of its hooks calls which :class:`Guard` method.

Adding a front-end:

1. Describe the framework in a :class:`Constraints`: what it supplies itself (``taken``), the ZeRO
   stages (sharding levels) it runs, the precisions it runs and who applies them
   (``precision_role``), and what a given plan must match (world size, accumulation). An FSDP2
   path of ``memguard.prepare(..., strategy="fsdp2")`` declares ``zero_stages=(3, 2, 1)``
   (:func:`memguard.guard.fsdp2.fsdp2_constraints`); a
   transformers ``TrainerCallback`` the ``TrainingArguments``' precision (``bf16``/``fp16``), world
   size and accumulation with ``precision_role="framework"``.
2. Check its arguments with :func:`option_problems` (plus its own framework checks), raising one
   :class:`memguard.ConfigError` with every problem.
3. Make one :class:`Guard` per model and :func:`register` it; apply a given plan with
   :meth:`Guard.apply`, or plan with :meth:`Guard.plan_and_apply` (or :meth:`Guard.make_plan` inside
   :meth:`Guard.agree_on_plan` when the framework must prepare the example batch and loss).
4. Per optimizer step: :meth:`Guard.open_window`, :meth:`Guard.run` for each batch, then
   :meth:`Guard.optimizer_step` when memguard steps the optimizer, or :meth:`Guard.anchor` and
   :meth:`Guard.end_window` when the framework runs the backward and the step itself.
5. Report :meth:`Guard.status`, and call :meth:`Guard.undo` when the framework's run ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Mapping, Sequence

import torch
from torch import nn

from memguard.batch import LossFn, batch_size, compute_loss, map_tensors
from memguard.errors import ConfigError
from memguard.guard.distributed import RankGroup, plan_on_rank_zero
from memguard.guard.precision import PrecisionSetup, setup_precision
from memguard.guard.shapes import (
    Signature,
    halvings,
    is_compiled,
    mark_batch_dynamic,
    pad_batch,
    signature_of,
    size_bound,
    snap_to,
    uncompiled,
)
from memguard.guard.window import DEFAULT_MAX_RETRIES, MicroBatchWindow, agreed_optimizer_step
from memguard.planner.api import Plan, PlanRequest, fit_shape, plan_request
from memguard.vocab import ALL_BLOCKS, PRECISIONS

__all__ = [
    "Constraints",
    "Guard",
    "GuardStatus",
    "UNSUPPORTED_WRAPPERS",
    "DEFAULT_MAX_RETRIES",
    "option_problems",
    "plan_problems",
    "plan_options_problems",
    "call_planner",
    "wrapper_problems",
    "synced_params",
    "synced_buffers",
    "register",
    "guard_of",
    "forget",
    "blocks_for",
]

logger = logging.getLogger("memguard")

#: Wrappers whose forward cannot be bypassed the way DDP's can: they need their own front-end.
UNSUPPORTED_WRAPPERS = {
    "FullyShardedDataParallel": "FSDP shards parameters inside its forward; memguard supports a plain module or one "
    "wrapped in DistributedDataParallel",
    "FSDPModule": "FSDP2 shards parameters inside its forward; pass strategy='fsdp2' to memguard.prepare to train a "
    "fully_shard model, or pass a plain module or one wrapped in "
    "DistributedDataParallel",
    "DeepSpeedEngine": "DeepSpeed runs its own step; turn the plan into a DeepSpeed config with "
    "memguard.integrations.deepspeed.to_config instead, or, under ZeRO-0/1 with "
    "\"managed_gradient_accumulation\": false, run each step with memguard.integrations.deepspeed.step",
}

# The fields that identify a planned configuration, for the plan-cache key of its reduced form.
_PLAN_IDENTITY = ("micro_batch_size", "grad_accum_steps", "world_size", "global_batch_size", "precision",
                  "activation_checkpointing", "checkpoint_blocks", "zero_stage", "offload_optimizer", "device", "gpu",
                  "budget_bytes", "headroom")

#: How a front-end runs a precision: memguard does all of it ("guard": casts ``*-true`` weights,
#: autocasts, scales the loss), only the cast of ``*-true`` weights ("weights": the framework
#: autocasts and scales), or nothing ("framework").
PRECISION_ROLES = ("guard", "weights", "framework")


# --------------------------------------------------------------------------------------------------
# constraints and argument checks


@dataclass(frozen=True)
class Constraints:
    """What a front-end fixes, for planning and for checking a given plan.

    Attributes:
        source: what fixes them, as messages name it (``"memguard.prepare"``, ``"the Trainer"``,
            ``"the Accelerator"``).
        taken: plan options the front-end supplies itself (a user passing one is told to drop it).
        zero_stages: the ZeRO stages (sharding levels) it can run.
        offload_optimizer: whether it can offload the optimizer.
        precisions: the precisions it runs, its own first; planning is fixed to the first. None:
            any of :data:`memguard.vocab.PRECISIONS`, chosen by the planner or the user.
        world_size: the ranks a given plan must be made for; None: not checked.
        grad_accum_steps: the accumulation a given plan must have; None: not checked.
        fix_plan: how to make a given plan match (appended to precision/accumulation problems).
        fix_precision: how to change the front-end's precision (appended to precision problems).
        precision_role: one of :data:`PRECISION_ROLES`.
        strategies: the parallel strategies the front-end runs (``"ddp"``, ``"deepspeed"``,
            ``"fsdp2"``), passed to the planner as ``strategy=`` (one as a value, several as a list)
            when the planner takes that option; None: not passed, the planner's default.
    """

    source: str = "memguard.prepare"
    taken: tuple[str, ...] = ()
    zero_stages: tuple[int, ...] = (0,)
    offload_optimizer: bool = False
    precisions: tuple[str, ...] | None = None
    world_size: int | None = None
    grad_accum_steps: int | None = None
    fix_plan: str = "plan again with memguard.plan()"
    fix_precision: str = ""
    precision_role: str = "guard"
    strategies: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.precision_role not in PRECISION_ROLES:
            raise ConfigError(f"precision_role must be one of {', '.join(PRECISION_ROLES)}, got {self.precision_role!r}")

    def planning_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """``options`` with what the front-end fixes: its precision, ZeRO stages, offload and strategies."""
        out = dict(options)
        if self.precisions is not None:
            out["precision"] = self.precisions[0]
        if self.strategies is not None:
            out["strategy"] = self.strategies[0] if len(self.strategies) == 1 else list(self.strategies)
        out.setdefault("zero_stage", self.zero_stages[0] if len(self.zero_stages) == 1 else list(self.zero_stages))
        if not self.offload_optimizer:
            out.setdefault("offload_optimizer", False)
        return out


def _is_int(value: Any, least: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= least


def _as_tuple(value: Any) -> tuple[Any, ...]:
    return tuple(value) if isinstance(value, (list, tuple, set, frozenset)) else (value,)


def wrapper_problems(model: Any) -> list[str]:
    """A problem if ``model`` is a wrapper memguard's guard cannot run (FSDP, DeepSpeed)."""
    for cls in type(model).__mro__:
        if cls.__name__ in UNSUPPORTED_WRAPPERS:
            return [UNSUPPORTED_WRAPPERS[cls.__name__]]
    return []


def plan_problems(plan: Plan, constraints: Constraints) -> list[str]:
    """Every reason ``plan`` cannot run on the front-end of ``constraints``."""
    c = constraints
    out = []
    if plan.zero_stage not in c.zero_stages:
        out.append(f"the plan uses ZeRO stage {plan.zero_stage}, which {c.source} cannot apply (it runs stage "
                   f"{', '.join(map(str, c.zero_stages))}); run it with DeepSpeed "
                   "(memguard.integrations.deepspeed.to_config) or plan with zero_stage=0")
    if plan.offload_optimizer and not c.offload_optimizer:
        out.append(f"the plan offloads the optimizer, which {c.source} cannot do (DeepSpeed can); plan with "
                   "offload_optimizer=False")
    if plan.precision not in PRECISIONS:
        out.append(f"the plan's precision {plan.precision!r} is not one of {', '.join(PRECISIONS)}")
    elif c.precisions is not None and plan.precision not in c.precisions:
        fix = c.fix_precision or c.fix_plan
        out.append(f"the plan's precision {plan.precision!r} differs from {c.source}'s {c.precisions[0]!r}; {fix}, "
                   f"or plan with precision={c.precisions[0]!r}")
    if c.grad_accum_steps is not None and plan.grad_accum_steps != c.grad_accum_steps:
        out.append(f"the plan accumulates {plan.grad_accum_steps} micro-batches but {c.source} accumulates "
                   f"{c.grad_accum_steps}; {c.fix_plan}")
    if c.world_size is not None and plan.world_size != c.world_size:
        out.append(f"the plan was made for {plan.world_size} processes but {c.source} runs {c.world_size}; plan "
                   f"with world_size={c.world_size}")
    return out


def _request(options: Mapping[str, Any], **filled: Any) -> PlanRequest:
    """The :class:`PlanRequest` of the user's ``options`` and what the guard fills in.

    The one place that builds planner requests, for :func:`plan_options_problems` and :func:`call_planner`.

    Raises:
        ConfigError: an unknown option name (the message lists the accepted ones).
    """
    return PlanRequest.from_options(**{**options, **filled})


def plan_options_problems(options: Mapping[str, Any]) -> list[str]:
    """Every problem with the user's options for :func:`memguard.plan`: unknown names and invalid values.

    Checked before a batch is seen, so the values the guard fills in later stand in: one sample per
    step, and ``device="cpu"`` unless given (the CUDA checks run when the planner gets the request).
    """
    try:
        request = _request(options, global_batch_size=1, device=options.get("device", "cpu"))
    except ConfigError as exc:
        return list(exc.problems)
    return request.problems()


def call_planner(model: nn.Module, batch: Any, *, global_batch_size: int, optimizer: Any, loss_fn: LossFn | None,
                 world_size: int, options: Mapping[str, Any]) -> Plan:
    """:func:`memguard.plan` with the guard's arguments and the user's (checked) options."""
    request = _request(options, global_batch_size=global_batch_size, optimizer=optimizer, loss_fn=loss_fn,
                       world_size=world_size)
    return plan_request(model, batch, request)


def option_problems(constraints: Constraints, *, plan: Any = None, micro_batch_size: Any = None,
                    example_batch: Any = None, global_batch_size: Any = None, loss_fn: Any = None,
                    max_retries: Any = DEFAULT_MAX_RETRIES, probe_up_after: Any = None, max_grad_norm: Any = None,
                    plan_options: Mapping[str, Any] | None = None) -> list[str]:
    """Every problem with a front-end's guard arguments, one sentence each.

    Exactly one of ``plan``, ``micro_batch_size`` and ``example_batch`` may set the micro-batch;
    ``plan_options`` are checked as planning options (or, with ``micro_batch_size``, as the
    ``precision`` and ``activation_checkpointing`` of a fixed micro-batch), and against what
    ``constraints`` fixes.
    """
    c = constraints
    options = dict(plan_options or {})
    out: list[str] = []
    sources = [name for name, v in (("plan", plan), ("micro_batch_size", micro_batch_size),
                                     ("example_batch", example_batch)) if v is not None]
    if len(sources) > 1:
        out.append(f"pass only one of {' / '.join(s + '=' for s in sources)}: each sets the micro-batch")
    if plan is not None and not isinstance(plan, Plan):
        out.append(f"plan must be a memguard.Plan, got {type(plan).__name__}; build it with memguard.plan()")
    if micro_batch_size is not None and not _is_int(micro_batch_size, 1):
        out.append(f"micro_batch_size must be a positive int, got {micro_batch_size!r}")
    if global_batch_size is not None and not _is_int(global_batch_size, 1):
        out.append(f"global_batch_size must be a positive int, got {global_batch_size!r}")
    if loss_fn is not None and not callable(loss_fn):
        out.append("loss_fn must be callable as loss_fn(model, batch) -> mean loss")
    if not _is_int(max_retries, 0):
        out.append(f"max_retries must be an int >= 0, got {max_retries!r}")
    if probe_up_after is not None and not _is_int(probe_up_after, 1):
        out.append(f"probe_up_after must be None or an int >= 1, got {probe_up_after!r}")
    if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float))
                                      or max_grad_norm <= 0):
        out.append(f"max_grad_norm must be None or a positive number, got {max_grad_norm!r}")
    taken = sorted(k for k in options if k in c.taken)
    if taken:
        out.append(f"{', '.join(taken)} come from {c.source} and its arguments; drop them")
        options = {k: v for k, v in options.items() if k not in c.taken}
    if isinstance(plan, Plan):
        out += plan_problems(plan, c)
        if options:
            out.append(f"{', '.join(sorted(options))} only apply when memguard plans; drop them or plan=")
        if global_batch_size is not None and global_batch_size != plan.global_batch_size:
            out.append(f"global_batch_size {global_batch_size} differs from the plan's {plan.global_batch_size}")
    elif micro_batch_size is not None:
        out += _fixed_options_problems(options)
    else:
        out += _planning_problems(options, c)
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


def _planning_problems(options: Mapping[str, Any], c: Constraints) -> list[str]:
    out = []
    stages = [s for s in _as_tuple(options.get("zero_stage", c.zero_stages[0])) if s not in c.zero_stages]
    if stages:
        hint = (" (write the plan into a DeepSpeed config with memguard.integrations.deepspeed.to_config for ZeRO, "
                "or pass strategy='fsdp2' to memguard.prepare)" if c.zero_stages == (0,) else "")
        out.append(f"zero_stage={options['zero_stage']!r} is not run by {c.source}: it runs stage "
                   f"{', '.join(map(str, c.zero_stages))}{hint}")
    if options.get("offload_optimizer") and not c.offload_optimizer:
        out.append(f"offload_optimizer=True needs DeepSpeed: {c.source} does not offload the optimizer")
    if "train" in options:
        out.append(f"train={options['train']!r} is not a guard option: {c.source} guards training steps; an "
                   "evaluation batch that may not fit runs through memguard.evaluate(model, batch)")
    if options.get("finetune") == "lora":
        out.append(f"finetune='lora' plans a LoRA twin of the model, which {c.source} cannot apply to the model "
                   "it was given: wrap the model with peft.get_peft_model first and pass that model")
    wanted = options.get("precision")
    if wanted is not None and c.precisions is not None and c.precisions[0] not in _as_tuple(wanted):
        fix = f"{c.fix_precision} or drop the option" if c.fix_precision else "drop the option"
        out.append(f"precision={wanted!r} was asked for but {c.source} runs {c.precisions[0]!r}; memguard does not "
                   f"change {c.source}'s precision: {fix}")
    return out + plan_options_problems(options)


# --------------------------------------------------------------------------------------------------
# the per-model state


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
        steps: optimizer steps taken through the guard.
        oom_retries: micro-batch halvings so far.
        micro_batch_sizes: the micro-batch each batch shape signature
            (:class:`memguard.guard.shapes.Signature`, printable) uses now, in the order first seen.
        planned_micro_batch_sizes: the micro-batch each signature was given when first seen.
        signatures_planned: how many signatures were planned from probe traces (see :meth:`Guard.run`).
        signature_planning_seconds: the time those plans took, in total.
        compiled: whether the model runs through ``torch.compile``.
    """

    micro_batch_size: int | None
    planned_micro_batch_size: int | None
    precision: str | None
    plan: Plan | None
    grad_scaler: Any
    world_size: int
    steps: int
    oom_retries: int
    micro_batch_sizes: Mapping[Signature, int] = dataclasses.field(default_factory=dict)
    planned_micro_batch_sizes: Mapping[Signature, int] = dataclasses.field(default_factory=dict)
    signatures_planned: int = 0
    signature_planning_seconds: float = 0.0
    compiled: bool = False


def synced_params(model: nn.Module, inner: nn.Module) -> list[nn.Parameter]:
    """The parameters whose gradients the window accumulates: trainable, and not ignored by a DDP ``model``."""
    ignored = getattr(model, "parameters_to_ignore", set()) if model is not inner else set()
    return [p for name, p in inner.named_parameters() if p.requires_grad and name not in ignored]


def synced_buffers(model: nn.Module, inner: nn.Module) -> list[torch.Tensor]:
    """The buffers a DDP ``model`` broadcasts from rank 0 (all of ``inner``'s but the ignored ones)."""
    ignored = getattr(model, "parameters_to_ignore", set())
    return [b for name, b in inner.named_buffers() if name not in ignored]


def blocks_for(module: nn.Module, setting: bool | int) -> int:
    """How many repeated blocks ``activation_checkpointing=setting`` checkpoints."""
    if setting is False or setting == 0:
        return 0
    from memguard.estimator.blocks import find_blocks

    found = len(find_blocks(module))
    if found == 0:
        raise ConfigError("activation_checkpointing was asked for, but memguard found no repeated blocks in the "
                          "model; checkpoint it yourself (torch.utils.checkpoint) and pass "
                          "activation_checkpointing=False")
    if setting is True or setting == ALL_BLOCKS:
        return found
    if setting > found:
        raise ConfigError(f"activation_checkpointing={setting} blocks, but the model has {found}; pass at most {found}")
    return int(setting)


class Guard:
    """One prepared model: its plan, precision, micro-batch window, counters and undo actions.

    Batches of different shapes: every batch's shape signature (its tensors' non-batch dims,
    bucketed: :mod:`memguard.guard.shapes`) has its own micro-batch, chosen before the first batch
    of that signature runs (see :meth:`run`). An OOM halves only the micro-batch of the signature
    that ran out, and ``probe_up_after`` doubles it back towards that signature's own size.

    Args:
        module: the model the micro-batches run through (inside any DDP wrapper).
        constraints: what the front-end fixes.
        world_size: data-parallel ranks.
        rank_group: the DDP group (:func:`memguard.guard.distributed.rank_group_of`), or None.
        loss_fn: the default loss function.
        max_retries: at most this many halvings within one optimizer step.
        probe_up_after: double a reduced micro-batch again after this many clean steps (None: never).
        grad_scaler: the GradScaler for ``16-mixed`` (memguard's own, or the framework's).
        sync_gradients: memguard averages the gradients over the ranks (False: the framework's DDP
            reducer does, through :meth:`anchor`).
        global_batch_size: samples per optimizer step for planning (None: from the batch).
        plan_options: the user's options for :func:`memguard.plan`.
        max_grad_norm: clip the gradients' norm to this before each optimizer step (None: no clipping).
    """

    def __init__(self, module: nn.Module, constraints: Constraints, *, world_size: int = 1,
                 rank_group: RankGroup | None = None, loss_fn: LossFn | None = None,
                 max_retries: int = DEFAULT_MAX_RETRIES, probe_up_after: int | None = None, grad_scaler: Any = None,
                 sync_gradients: bool = True, global_batch_size: int | None = None,
                 plan_options: Mapping[str, Any] | None = None, max_grad_norm: float | None = None) -> None:
        self._module = weakref.ref(module)
        self.constraints = constraints
        self.world_size = world_size
        self.rank_group = rank_group
        self.loss_fn = loss_fn
        self.max_retries = max_retries
        self.probe_up_after = probe_up_after
        self.grad_scaler = grad_scaler
        self.sync_gradients = sync_gradients
        self.global_batch_size = global_batch_size
        self.plan_options = dict(plan_options or {})
        self.max_grad_norm = max_grad_norm
        devices = {p.device for p in module.parameters()}
        self.input_device: torch.device | None = next(iter(devices)) if len(devices) == 1 else None
        self.precision: PrecisionSetup | None = None
        self.precision_name: str | None = None
        self.plan: Plan | None = None
        self.ceiling: int | None = None
        self.window: MicroBatchWindow | None = None
        self.steps = 0
        self.clean_steps = 0
        self._micro_batch_size: int | None = None
        self._oom_cache: tuple[Any, str] | None = None
        self._undo: list[Callable[[], None]] = []
        self._warned_stale_grads = False
        # per batch-shape signature: the micro-batch now, the one it was given, its clean steps
        self._sizes: dict[Signature, int] = {}
        self._given: dict[Signature, int] = {}
        self._clean: dict[Signature, int] = {}
        self._reference: Signature | None = None  # the signature of the batch memguard planned on
        self._context: dict[str, Any] | None = None  # what planning a new signature needs (see make_plan)
        self._window_sigs: list[Signature] = []
        self._window_cap: int | None = None  # the smallest micro-batch of the open window's batches
        self._current: Signature | None = None
        self._limit: int | None = None
        self.signatures_planned = 0
        self.signature_planning_seconds = 0.0
        self._warned_signature_planning = False
        self._planning_signature = False

    # ---------------------------------------------------------------------------------------------- state

    @property
    def module(self) -> nn.Module:
        """The guarded module.

        Raises:
            ConfigError: it no longer exists.
        """
        module = self._module()
        if module is None:
            raise ConfigError("the prepared module no longer exists; prepare the model again")
        return module

    @property
    def micro_batch_size(self) -> int | None:
        """The micro-batch the next batch uses (None until a plan is applied)."""
        return self.window.micro_batch_size if self.window is not None else self._micro_batch_size

    @property
    def oom_retries(self) -> int:
        """Halvings of the micro-batch so far."""
        return self.window.oom_retries if self.window is not None else 0

    @property
    def compiled(self) -> bool:
        """Whether the model runs through ``torch.compile``."""
        module = self._module()
        return module is not None and is_compiled(module)

    def status(self) -> GuardStatus:
        """A snapshot of what the guard does now."""
        return GuardStatus(
            micro_batch_size=self.micro_batch_size,
            planned_micro_batch_size=self.plan.micro_batch_size if self.plan is not None else self.ceiling,
            precision=self.precision_name, plan=self.plan, grad_scaler=self.scaler, world_size=self.world_size,
            steps=self.steps, oom_retries=self.oom_retries, micro_batch_sizes=dict(self._sizes),
            planned_micro_batch_sizes=dict(self._given), signatures_planned=self.signatures_planned,
            signature_planning_seconds=self.signature_planning_seconds, compiled=self.compiled,
        )

    @property
    def scaler(self) -> Any:
        """The GradScaler in force (memguard's for ``16-mixed``, or the framework's), else None."""
        return self.precision.scaler if self.precision is not None else self.grad_scaler

    def on_undo(self, undo: Callable[[], None]) -> None:
        """Remember how to undo a change the front-end made; :meth:`undo` runs them in reverse order."""
        self._undo.append(undo)

    def undo(self) -> None:
        """Undo every change (checkpointing, the front-end's own), newest first, and close the window."""
        while self._undo:
            undo = self._undo.pop()
            try:
                undo()
            except Exception as exc:  # undo the rest whatever happens
                logger.warning("memguard could not undo a change: %s", exc)
        if self.window is not None:
            self.window.finish()

    # ---------------------------------------------------------------------------------------------- planning

    def make_plan(self, batch: Any, optimizer: Any, loss_fn: LossFn | None = None, *, accumulation: int = 1,
                  device: str | None = None) -> Plan:
        """Plan on this rank from ``batch``, under the front-end's constraints.

        The global batch is ``global_batch_size``, else the batch's size x ``accumulation`` x the world
        size. With ``cache=`` in the plan options, a micro-batch reduced after an OOM in an earlier
        run of the same job is taken from the plan cache instead of the planner's.

        Args:
            batch: one batch of this rank, as the front-end will run them.
            optimizer: the optimizer (its type and hyper-parameters).
            loss_fn: the loss function for the trace (default: the guard's).
            accumulation: batches per optimizer step that the front-end accumulates.
            device: ``"cuda"`` or ``"cpu"`` (default: the ``device`` option, else the parameters').

        Raises:
            ConfigError, InfeasiblePlanError: as :func:`memguard.plan`.
        """
        module = uncompiled(self.module)
        loss_fn = loss_fn if loss_fn is not None else self.loss_fn
        options = self.constraints.planning_options(self.plan_options)
        if device is not None:
            options["device"] = device
        options.setdefault("device", self.input_device.type if self.input_device is not None else "cuda")
        gbs = self.global_batch_size or batch_size(batch) * accumulation * self.world_size
        plan = call_planner(module, batch, global_batch_size=gbs, optimizer=optimizer, loss_fn=loss_fn,
                            world_size=self.world_size, options=options)
        self._reference = signature_of(batch)
        self._context = {"optimizer": optimizer, "loss_fn": loss_fn, "options": options}
        cache = options.get("cache")
        if not cache:
            return plan
        # The plan cache also remembers what the guard learnt: a micro-batch reduced after an OOM is stored
        # under a key derived from the planner's plan, and used instead of it on the next run.
        from memguard.planner.api import PlanCache, plan_key

        store = cache if isinstance(cache, PlanCache) else PlanCache()
        knobs = {k: getattr(plan, k) for k in _PLAN_IDENTITY}
        # what the plan does not record but the step's memory depends on
        knobs["keep_outputs"] = bool(options.get("keep_outputs", False))
        key = plan_key(module, batch, optimizer, loss_fn, {"memguard.guard": "reduced after OOM", **knobs})
        self._oom_cache = (store, key)
        reduced = store.get(key)
        if reduced is not None:
            logger.info("using micro-batch %d, remembered in the plan cache after an out-of-memory error (planned %d)",
                        reduced.micro_batch_size, plan.micro_batch_size)
            return reduced
        return plan

    def agree_on_plan(self, make: Callable[[], Plan]) -> Plan:
        """``make()`` on rank 0, broadcast to every rank, checked against the constraints.

        Raises:
            ConfigError: the plan cannot run on this front-end, or planning failed on bad input.
            InfeasiblePlanError: nothing fits.
            PeerFailedError: planning failed on rank 0 with another error.
        """
        plan = plan_on_rank_zero(self.rank_group, make)
        problems = plan_problems(plan, self.constraints)
        if problems:
            raise ConfigError(problems)
        return plan

    def plan_and_apply(self, batch: Any, optimizer: Any, loss_fn: LossFn | None = None, *,
                       accumulation: int = 1) -> Plan:
        """Plan from ``batch`` (rank 0 plans and broadcasts) and apply the plan."""
        plan = self.agree_on_plan(lambda: self.make_plan(batch, optimizer, loss_fn, accumulation=accumulation))
        self.apply(plan, optimizer)
        logger.info("planned micro-batch %d x accumulation %d x world %d, %s",
                    plan.micro_batch_size, plan.grad_accum_steps, plan.world_size, plan.precision)
        return plan

    # ---------------------------------------------------------------------------------------------- applying

    def set_precision(self, precision: str, optimizer: Any, *, wrapped: bool = False) -> None:
        """Apply ``precision`` as the front-end's :attr:`Constraints.precision_role` says.

        Raises:
            ConfigError: a cast is needed but no longer possible (see :func:`setup_precision`).
        """
        role = self.constraints.precision_role
        if role == "framework" or (role == "weights" and not precision.endswith("-true")):
            self.precision, self.precision_name = None, precision
            return
        scaler = self.grad_scaler if role == "guard" else None
        self.precision = setup_precision(precision, self.module, optimizer, wrapped=wrapped, scaler=scaler)
        self.precision_name = self.precision.precision

    def apply(self, plan: Plan | None, optimizer: Any, *, micro_batch_size: int | None = None,
              precision: str | None = None, activation_checkpointing: bool | int = False) -> None:
        """Apply ``plan`` (or a fixed micro-batch with a precision and checkpointing): precision, checkpointing,
        micro-batch.

        Raises:
            ConfigError: checkpointing asked for on a model without repeated blocks, or a cast that is
                no longer possible.
        """
        if plan is not None:
            micro_batch_size, precision = plan.micro_batch_size, plan.precision
            blocks = plan.checkpoint_blocks if plan.activation_checkpointing else 0
        else:
            blocks = blocks_for(self.module, activation_checkpointing)
        assert micro_batch_size is not None and precision is not None
        if self.precision_name != precision:
            self.set_precision(precision, optimizer, wrapped=self.rank_group is not None)
        if blocks > 0:
            from memguard.estimator.blocks import apply_activation_checkpointing

            self.on_undo(apply_activation_checkpointing(self.module, blocks))
        self.plan = plan
        self._micro_batch_size = self.ceiling = micro_batch_size
        self.window = None
        self._sizes, self._given, self._clean = {}, {}, {}
        self._limit = None
        if self._context is None and plan is not None:  # a given plan: plan new signatures with its settings
            self._context = {"optimizer": optimizer, "loss_fn": self.loss_fn, "options": {}}

    def limit_micro_batch(self, n: int) -> None:
        """Use at most ``n`` samples per micro-batch (a front-end whose batches hold fewer than the plan's)."""
        if self._micro_batch_size is not None and n < self._micro_batch_size and self.window is None:
            self._micro_batch_size = self.ceiling = n
            self._limit = n
            for sig in self._sizes:
                self._sizes[sig] = min(self._sizes[sig], n)
                self._given[sig] = min(self._given[sig], n)

    # ---------------------------------------------------------------------------------------------- running

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """Move an input tensor to the model's device and cast it for a ``*-true`` precision."""
        device = self.input_device
        if device is not None and t.device != device:
            t = t.to(device, non_blocking=True)
        return self.precision.cast_input(t) if self.precision is not None else t

    def autocast(self) -> ContextManager[Any]:
        """The context the forward and loss run under when memguard runs the precision."""
        return self.precision.autocast() if self.precision is not None else contextlib.nullcontext()

    def loss_of(self, loss_fn: LossFn | None = None, *,
                autocast: Callable[[], ContextManager[Any]] | None = None) -> Callable[[Any], torch.Tensor]:
        """``loss_of(micro_batch)`` for the window: place the inputs, then the loss under autocast."""
        loss_fn = loss_fn if loss_fn is not None else self.loss_fn
        context = autocast if autocast is not None else self.autocast
        module = self.module

        compiled = is_compiled(module)

        def loss_of(micro: Any) -> torch.Tensor:
            micro = map_tensors(micro, self.place)
            if compiled:  # placing may have made new tensors: mark those
                mark_batch_dynamic(micro)
            with context():
                return compute_loss(module, micro, loss_fn)

        return loss_of

    def backward(self, weighted: torch.Tensor, scaler: Any = None) -> None:
        """Back-propagate a weighted loss outside autocast (as PyTorch's AMP recipe does), through the
        GradScaler of ``16-mixed`` when there is one."""
        scaler = scaler if scaler is not None else self.scaler
        device_type = self.input_device.type if self.input_device is not None else "cpu"
        with torch.autocast(device_type=device_type, enabled=False):
            (scaler.scale(weighted) if scaler is not None else weighted).backward()

    def open_window(self, model: nn.Module, optimizers: Sequence[Any] = (), *, warn_stale_grads: bool = False) -> None:
        """Start an optimizer step's window over the parameters ``model`` (the module or its DDP wrapper) syncs.

        Args:
            model: what the front-end's user holds: the module, or its DDP wrapper.
            optimizers: optimizers whose gradients are dropped with the window's.
            warn_stale_grads: warn (once) when gradients from before the step are discarded.
        """
        if self._micro_batch_size is None:
            raise ConfigError("no plan was applied before the first batch; prepare the model with a plan, a "
                              "micro_batch_size or planning options")
        if self.window is None:
            self.window = MicroBatchWindow(self._micro_batch_size, rank_group=self.rank_group,
                                           sync_gradients=self.sync_gradients, max_retries=self.max_retries,
                                           plan=self.plan, precision=self.precision_name, on_halve=self._on_halve)
        module = self.module
        params = synced_params(model, module)
        if warn_stale_grads and not self._warned_stale_grads and any(p.grad is not None for p in params):
            logger.warning("memguard.step found gradients from before the step and discards them: a step that may be "
                           "retried must start from none (let memguard.step run the whole backward)")
            self._warned_stale_grads = True
        self.window.start(module, params, optimizers)
        self._window_sigs, self._window_cap = [], None

    def run(self, batch: Any, loss_of: Callable[[Any], torch.Tensor],
            backward: Callable[[torch.Tensor], None] | None = None, *, model: nn.Module | None = None,
            weight: float = 1.0, last: bool = False) -> torch.Tensor:
        """Run one batch of the open window; with ``last`` and ``sync_gradients``, average the gradients.

        The batch runs at the micro-batch of its shape signature (:mod:`memguard.guard.shapes`; under DDP
        the ranks' element-wise largest, agreed in one small all-reduce per batch). A signature seen for
        the first time gets its micro-batch before it runs (see :meth:`_size_for`; rank 0 chooses under
        DDP and the others follow in one more all-reduce); an OOM halves only this signature's. Within
        one window the micro-batch never grows from one batch to the next, so that a replay after an OOM
        runs every earlier batch of the window at most at the size it ran at. Under ``torch.compile`` dim
        0 of every micro-batch is marked dynamic, so one graph serves every micro-batch size but 1.

        Args:
            batch: this rank's batch.
            loss_of: ``loss_of(micro_batch) -> mean loss`` (see :meth:`loss_of`).
            backward: runs the backward of a weighted loss (default :meth:`backward`).
            model: the module or its DDP wrapper, for the buffers DDP broadcasts (default: the module).
            weight: a factor on this batch's losses (``1/k`` when the front-end averages ``k`` batches).
            last: this is the window's last batch.

        Returns:
            The batch's mean loss (a detached float32 scalar).

        Raises:
            ConfigError, OOMRecoveryError, PeerFailedError: as :meth:`MicroBatchWindow.run`.
        """
        if self._planning_signature:  # the planner's trace must not run the real window (see _plan_signature)
            raise RuntimeError("the loss function memguard plans with calls back into the guard; it must call the "
                               "model's own step, not the front-end's stand-in")
        window = self.window
        assert window is not None and window.is_open  # open_window() comes first
        try:
            sig = self._agreed_signature(batch)
            mbs = self._size_for(sig, batch)
        except BaseException:
            window.finish()
            raise
        # Within a window the micro-batch never grows: an OOM replays the window's earlier batches at the
        # current one's halved size, which is then at most what each of them ran at.
        if self._window_cap is not None:
            mbs = min(mbs, self._window_cap)
        window.micro_batch_size = mbs
        self._current = sig
        if sig not in self._window_sigs:
            self._window_sigs.append(sig)
        if self.compiled:
            inner_loss_of = loss_of

            def loss_of(micro: Any) -> torch.Tensor:
                return inner_loss_of(mark_batch_dynamic(micro))
        retries = window.oom_retries
        try:
            loss = window.run(batch, loss_of, backward if backward is not None else self.backward, weight=weight,
                              last=last)
            if window.oom_retries != retries:  # only this signature's micro-batch is halved
                new = window.micro_batch_size
                if self.compiled and self.ceiling is not None:
                    new = window.micro_batch_size = snap_to(new, halvings(self.ceiling))
                self._sizes[sig] = min(self._sizes[sig], new)
            self._window_cap = window.micro_batch_size
            if last and self.sync_gradients:
                module = self.module
                window.sync_gradients(synced_buffers(model if model is not None else module, module))
        except BaseException:
            window.finish()
            raise
        return loss

    # ---------------------------------------------------------------------------------------------- shapes

    def _agreed_signature(self, batch: Any) -> Signature:
        """The batch's signature; under DDP the element-wise largest of the ranks' (one small all-reduce)."""
        sig = signature_of(batch)
        rg = self.rank_group
        if rg is None or rg.world_size == 1:
            return sig
        return sig.with_flat(_agree_values(rg, sig.flat()))

    def _size_for(self, sig: Signature, batch: Any) -> int:
        """The micro-batch of signature ``sig``, chosen when it is first seen (on rank 0 under DDP).

        The first signature of a run is the plan's: the batch memguard planned on, else (a given plan or
        ``micro_batch_size=``) the first batch's. A new signature gets the largest micro-batch, at most the
        planned one, that the probe model of a batch of that signature (padded to the top of its bucket)
        predicts to fit the plan's budget with the plan's precision, checkpointing and sharding
        (:meth:`_plan_signature`); without a plan's budget, or when that fails, the planned one; a
        signature covered by a known one that runs at the planned micro-batch gets it without planning.
        Either is then capped by the micro-batch of every known signature it covers (memory never falls
        when a dim grows, so a signature needs at most the micro-batch of one it covers), and under
        ``torch.compile`` rounded down to a halving of the planned micro-batch.
        """
        if sig in self._sizes:
            return self._sizes[sig]
        rg = self.rank_group
        if rg is not None and rg.world_size > 1:
            mine = self._decide(sig, batch) if rg.rank == 0 else 0
            size = _agree_values(rg, [mine])[0]  # rank 0's choice (the others send 0)
        else:
            size = self._decide(sig, batch)
        self._sizes[sig] = self._given[sig] = size
        if self._reference is None:
            self._reference = sig
        if len(self._sizes) > 1:
            logger.info("new batch shape %s: micro-batch %d (planned %d for %s)", sig, size, self.ceiling,
                        self._reference)
        return size

    def _decide(self, sig: Signature, batch: Any) -> int:
        base = self.ceiling
        assert base is not None  # a plan or micro_batch_size was applied before the first batch
        if not self._sizes and (self._reference is None or sig == self._reference):
            return base
        size = base
        # a shape that a known one covers and that runs at the planned micro-batch fits it too: no planning
        covered = any(other.covers(sig) and m >= base for other, m in self._sizes.items())
        if sig != self._reference and not covered:
            planned = self._plan_signature(sig, batch, base)
            if planned is not None:
                size = planned
        bound = size_bound(sig, self._sizes)
        if bound is not None:
            size = min(size, bound)
        if self.compiled:
            size = snap_to(size, halvings(base))
        return max(1, size)

    def _plan_signature(self, sig: Signature, batch: Any, base: int) -> int | None:
        """The largest micro-batch up to ``base`` predicted to fit the plan's budget for batches of ``sig``.

        :func:`memguard.planner.api.fit_shape` on a batch of ``sig`` (padded to the top of its buckets),
        with the plan and the step the guard planned with; under ``torch.compile`` only halvings of
        ``base`` are tried. None when nothing can be planned (no plan, or the trace fails: logged once).
        Where the prediction is low (see ``fit_shape``'s known limitations), the OOM retry is the backstop.
        """
        plan, ctx = self.plan, self._context
        if plan is None or ctx is None:
            return None
        start = time.perf_counter()
        self._planning_signature = True
        try:
            size = fit_shape(uncompiled(self.module), pad_batch(batch, sig), plan, most=base,
                             optimizer=ctx["optimizer"], loss_fn=ctx["loss_fn"],
                             keep_outputs=ctx["options"].get("keep_outputs", False),
                             sizes=halvings(base) if self.compiled else None)
        except Exception as exc:  # noqa: BLE001 - planning a shape must never stop training
            if not self._warned_signature_planning:
                logger.warning("could not plan the micro-batch of batch shape %s (%s); it starts from the planned "
                               "micro-batch and is halved on an out-of-memory error", sig, exc)
                self._warned_signature_planning = True
            return None
        finally:
            self._planning_signature = False
            self.signature_planning_seconds += time.perf_counter() - start
        self.signatures_planned += 1
        logger.debug("planned batch shape %s in %.2f s: micro-batch %d", sig, time.perf_counter() - start, size)
        return size

    def anchor(self, value: torch.Tensor) -> torch.Tensor:
        """A loss equal to ``value`` whose backward adds zero to every gradient (for a framework's own backward)."""
        assert self.window is not None
        return self.window.anchor(value)

    def optimizer_step(self, step_fn: Callable[[], Any], zero_grad: Callable[[], None], *,
                       clip_grad_norm: Callable[[Sequence[nn.Parameter], float], Any] | None = None) -> None:
        """Close the window, step the optimizer (clipping first with ``max_grad_norm``), drop the gradients and
        agree with the peers on the outcome; then count the step.

        Args:
            step_fn: the optimizer step (through the front-end's GradScaler, if any).
            zero_grad: drops the optimizer's gradients (the window's parameters' are dropped too).
            clip_grad_norm: ``clip(params, max_norm)``, the front-end's clipping (which unscales first).

        Raises:
            OOMRecoveryError: out of memory in the step.
            PeerFailedError: a peer failed in its step.
        """
        window = self.window
        assert window is not None
        params = window.params
        self.end_window()
        clip = clip_grad_norm if clip_grad_norm is not None else torch.nn.utils.clip_grad_norm_

        def clip_and_step() -> None:
            if self.max_grad_norm is not None:
                clip(params, self.max_grad_norm)
            step_fn()

        def after() -> None:
            zero_grad()
            for p in params:
                p.grad = None

        agreed_optimizer_step(clip_and_step, self.rank_group, after=after, plan=self.plan,
                              precision=self.precision_name, micro_batch_size=window.micro_batch_size)

    def end_window(self) -> None:
        """The window's batches have all run: let them go and count one optimizer step."""
        window = self.window
        if window is None:
            return
        retried = window.retried
        window.finish()
        self.steps += 1
        self.clean_steps = 0 if retried else self.clean_steps + 1
        for sig in self._window_sigs:
            self._clean[sig] = 0 if retried else self._clean.get(sig, 0) + 1
        self._maybe_probe_up()

    def _maybe_probe_up(self) -> None:
        """Double a reduced micro-batch after ``probe_up_after`` clean steps of its signature, up to the
        micro-batch that signature was given."""
        every, window = self.probe_up_after, self.window
        if every is None or window is None:
            return
        for sig in self._window_sigs:
            mbs, given = self._sizes.get(sig), self._given.get(sig)
            if mbs is None or given is None or mbs >= given or self._clean.get(sig, 0) < every:
                continue
            new = min(given, mbs * 2)
            logger.info("%d steps of batch shape %s without an out-of-memory error; probing micro-batch %d -> %d",
                        self._clean[sig], sig, mbs, new)
            self._sizes[sig] = new
            self._clean[sig] = 0
            self.clean_steps = 0
            if sig == self._current:
                window.micro_batch_size = new

    def _on_halve(self, mbs: int) -> None:
        """Write the reduced micro-batch to the plan cache, when memguard planned with ``cache=``."""
        plan = self.plan
        if self._current is not None and self._current != self._reference:
            return  # the plan cache keeps the planned shape's micro-batch only
        if self._oom_cache is None or plan is None:
            logger.debug("micro-batch %s is kept for this process only (plan with cache=True to keep it across runs)",
                         mbs)
            return
        store, key = self._oom_cache
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


def _agree_values(rg: RankGroup, values: Sequence[int]) -> list[int]:
    """The element-wise maximum of ``values`` over the ranks: the rank group's own agreement where it has one
    (FSDP2's, which survives a peer's teardown), else :func:`memguard.guard.distributed.agree`."""
    from memguard.guard import distributed as ddp_sync

    own = getattr(rg, "agree", None)
    if callable(own):
        return list(own(ddp_sync.OK, values)[1])
    return ddp_sync.agree(rg, ddp_sync.OK, values)[1]


# --------------------------------------------------------------------------------------------------
# one guard per model object

_GUARDS: "weakref.WeakKeyDictionary[nn.Module, Guard]" = weakref.WeakKeyDictionary()


def register(model: nn.Module, guard: Guard) -> None:
    """Make ``guard`` the one of ``model`` (the object the user holds), undoing the previous one's changes."""
    forget(model)
    _GUARDS[model] = guard


def guard_of(model: Any, how_to_prepare: str) -> Guard:
    """The guard registered for ``model``.

    Raises:
        ConfigError: none is; the message ends with ``how_to_prepare``.
    """
    try:
        guard = _GUARDS.get(model)
    except TypeError:  # not weakly referenceable: cannot have been prepared
        guard = None
    if guard is None:
        raise ConfigError(f"this model was not prepared by memguard; {how_to_prepare}")
    return guard


def forget(model: nn.Module) -> None:
    """Forget the guard of ``model``, undoing its changes (before preparing the model again)."""
    old = _GUARDS.pop(model, None)
    if old is not None:
        old.undo()
