"""The guard core: the per-model state and the window life cycle that every front-end runs a plan through.

A *front-end* is the API a user trains through: :func:`memguard.prepare` / :func:`memguard.step`,
the Lightning and transformers callbacks, the Accelerate hooks. Each translates its framework onto
the guard, whose concerns live in one module each:

* :mod:`memguard.guard._options`: :class:`~memguard.guard._options.Constraints` says what the
  front-end fixes (its precision, world size, ZeRO stages, accumulation, the plan options it
  supplies itself) and how a user changes it; :func:`~memguard.guard._options.option_problems`
  checks a front-end's arguments against them, listing every problem; what survives travels as
  one :class:`~memguard.guard._options.GuardOptions`; ``plan_options_problems`` and
  ``call_planner`` there are the one place that talks to the planner;
* this module: :class:`Guard` is the per-model state: it plans under the constraints (rank 0
  plans and broadcasts under DDP), applies a plan (micro-batch, precision, activation
  checkpointing; every change can be undone), runs each optimizer step's window of batches through
  :class:`memguard.guard._window.MicroBatchWindow` (the OOM engine), steps the optimizer with the
  ranks' agreement, and reports a :class:`GuardStatus`; :func:`register` / :func:`guard_of` keep
  one guard per model object;
* :mod:`memguard.guard._sizing`: the micro-batch of each batch's shape (a new shape is planned
  before it runs, an OOM halves only its own shape's micro-batch);
* :mod:`memguard.guard._plan_cache`: a micro-batch reduced after an OOM, remembered in the plan
  cache for the next run.

What stays in a front-end is translation only: where its framework keeps the model, optimizer,
precision, world size and batches, and which of its hooks calls which :class:`Guard` method.

Adding a front-end:

1. Describe the framework in a :class:`~memguard.guard._options.Constraints`: what it supplies
   itself (``taken``), the ZeRO stages (sharding levels) it runs, the precisions it runs and who
   applies them (``precision_role``), and what a given plan must match (world size, accumulation). An FSDP2
   path of ``memguard.prepare(..., strategy="fsdp2")`` declares ``zero_stages=(3, 2, 1)``
   (:func:`memguard.guard._fsdp2.fsdp2_constraints`); a
   transformers ``TrainerCallback`` the ``TrainingArguments``' precision (``bf16``/``fp16``), world
   size and accumulation with ``precision_role="framework"``.
2. Check its arguments with :func:`~memguard.guard._options.option_problems` (plus its own framework
   checks), raising one :class:`memguard.ConfigError` with every problem.
3. Make one :class:`Guard` per model (its user's options in a
   :class:`~memguard.guard._options.GuardOptions`) and :func:`register` it; apply a given plan with
   :meth:`Guard.apply`, or plan with :meth:`Guard.plan_and_apply` (or :meth:`Guard.make_plan` inside
   :meth:`Guard.agree_on_plan` when the framework must prepare the example batch and loss), and show
   the plan summary with :meth:`Guard.announce`, naming what the plan changed in the user's script
   (:meth:`Guard.plan_and_apply` announces by default).
4. Per optimizer step: :meth:`Guard.open_window`, :meth:`Guard.run` for each batch, then
   :meth:`Guard.optimizer_step` when memguard steps the optimizer, or :meth:`Guard.anchor` and
   :meth:`Guard.end_window` when the framework runs the backward and the step itself.
5. Report :meth:`Guard.status`, and call :meth:`Guard.undo` when the framework's run ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import weakref
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Mapping, Sequence

import torch
from torch import nn

from memguard.batch import LossFn, batch_size, compute_loss, map_tensors
from memguard.errors import ConfigError
from memguard.guard._distributed import RankGroup, plan_on_rank_zero
from memguard.guard._options import Constraints, GuardOptions, call_planner, plan_problems
from memguard.guard._plan_cache import ReducedPlans
from memguard.guard._precision import PrecisionSetup, setup_precision
from memguard.guard._shapes import Signature, is_compiled, mark_batch_dynamic, uncompiled
from memguard.guard._sizing import ShapeSizing
from memguard.guard._summary import budget_source, plan_summary, precision_of_dtype, show
from memguard.guard._window import MicroBatchWindow, agreed_optimizer_step
from memguard.planner.api import Plan
from memguard.vocab import ALL_BLOCKS

logger = logging.getLogger("memguard")


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
            (:class:`memguard.guard._shapes.Signature`, printable) uses now, in the order first seen.
        planned_micro_batch_sizes: the micro-batch each signature was given when first seen.
        signatures_planned: how many signatures were planned from probe traces (see :meth:`Guard.run`).
        signature_planning_seconds: the time those plans took, in total.
        compiled: whether the model runs through ``torch.compile``.
        grad_norm: the total norm of the accumulated gradients before clipping, at the last optimizer
            step (None without ``max_grad_norm``); under ``16-mixed`` unscaled, and ``inf``/``nan``
            when the GradScaler skipped that step.
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
    grad_norm: float | None = None


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
    from memguard.estimator._blocks import find_blocks

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


class Guard(ShapeSizing):
    """One prepared model: its plan, precision, micro-batch window, counters and undo actions.

    Batches of different shapes: every batch's shape signature (its tensors' non-batch dims,
    bucketed: :mod:`memguard.guard._shapes`) has its own micro-batch, chosen before the first batch
    of that signature runs (see :meth:`run` and :mod:`memguard.guard._sizing`). An OOM halves only
    the micro-batch of the signature that ran out, and ``probe_up_after`` doubles it back towards
    that signature's own size.

    Args:
        module: the model the micro-batches run through (inside any DDP wrapper).
        constraints: what the front-end fixes.
        options: the user's guard options (loss function, retries, planning options, ...); None: the defaults.
        world_size: data-parallel ranks.
        rank_group: the DDP group (:func:`memguard.guard._distributed.rank_group_of`), or None.
        grad_scaler: the GradScaler for ``16-mixed`` (memguard's own, or the framework's).

    Attributes:
        plan: the plan in force (None with a fixed ``micro_batch_size``).
        ceiling: the micro-batch the plan (or ``micro_batch_size=``) asked for, at most the
            front-end's batch (:meth:`limit_micro_batch`).
        precision, precision_name: the precision memguard runs (None when the framework runs it),
            and its name.
        window: the micro-batch window (the OOM engine), from the first :meth:`open_window`.
        steps: optimizer steps taken through the guard.
    """

    def __init__(self, module: nn.Module, constraints: Constraints, options: GuardOptions | None = None, *,
                 world_size: int = 1, rank_group: RankGroup | None = None, grad_scaler: Any = None) -> None:
        self._module = weakref.ref(module)
        self.constraints = constraints
        self.options = options if options is not None else GuardOptions()
        self.world_size = world_size
        self.rank_group = rank_group
        self.grad_scaler = grad_scaler
        first = next((p for p in module.parameters() if p.is_floating_point()), None)
        self.script_precision = precision_of_dtype(first.dtype if first is not None else None)
        devices = {p.device for p in module.parameters()}
        self.input_device: torch.device | None = next(iter(devices)) if len(devices) == 1 else None
        self.precision: PrecisionSetup | None = None
        self.precision_name: str | None = None
        self.plan: Plan | None = None
        self.plan_made = False  # memguard made the plan in force (else it was given)
        self.ceiling: int | None = None
        self.window: MicroBatchWindow | None = None
        self.steps = 0
        self._reduced: ReducedPlans | None = None  # where a reduced micro-batch is remembered (cache=)
        self._undo: list[Callable[[], None]] = []
        self._warned_stale_grads = False
        self._grad_norm: torch.Tensor | None = None  # the last step's total norm before clipping
        self._init_sizing()

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
        return self.window.micro_batch_size if self.window is not None else self.ceiling

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
            steps=self.steps, oom_retries=self.oom_retries, micro_batch_sizes=dict(self.shapes.now),
            planned_micro_batch_sizes=dict(self.shapes.given), signatures_planned=self.signatures_planned,
            signature_planning_seconds=self.signature_planning_seconds, compiled=self.compiled,
            grad_norm=float(self._grad_norm) if self._grad_norm is not None else None,
        )

    @property
    def scaler(self) -> Any:
        """The GradScaler in force (memguard's for ``16-mixed``, or the framework's), else None."""
        return self.precision.scaler if self.precision is not None else self.grad_scaler

    def on_undo(self, undo: Callable[[], None]) -> None:
        """Remember how to undo a change the guard made to the model (checkpointing, FSDP2's sharding);
        :meth:`undo` runs them in reverse order. A front-end restores its framework's own values itself."""
        self._undo.append(undo)

    def undo(self) -> None:
        """Undo every change the guard made, newest first, and close the window."""
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
        loss_fn = loss_fn if loss_fn is not None else self.options.loss_fn
        options = self.constraints.planning_options(self.options.plan_options)
        if device is not None:
            options["device"] = device
        options.setdefault("device", self.input_device.type if self.input_device is not None else "cuda")
        gbs = self.options.global_batch_size or batch_size(batch) * accumulation * self.world_size
        plan = call_planner(module, batch, global_batch_size=gbs, optimizer=optimizer, loss_fn=loss_fn,
                            world_size=self.world_size, options=options)
        self.shapes.set_reference(batch)
        self._context = {"optimizer": optimizer, "loss_fn": loss_fn, "options": options}
        # The plan cache also remembers what the guard learnt: a micro-batch reduced after an OOM is stored
        # under a key derived from the planner's plan, and used instead of it on the next run.
        reduced = ReducedPlans.for_plan(plan, module, batch, optimizer, loss_fn, options)
        if reduced is None:
            return plan
        self._reduced = reduced
        return reduced.get(plan)

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
                       accumulation: int = 1, announce: bool = True) -> Plan:
        """Plan from ``batch`` (rank 0 plans and broadcasts) and apply the plan; with ``announce``, show its
        summary (:meth:`announce`)."""
        plan = self.agree_on_plan(lambda: self.make_plan(batch, optimizer, loss_fn, accumulation=accumulation))
        self.apply(plan, optimizer)
        self.plan_made = True
        if announce:
            self.announce(plan)
        return plan

    def announce(self, plan: Plan, *, made: bool | None = None, runs: str | None = None, overrides: Sequence[str] = ()) -> None:
        """Show the plan summary (:mod:`memguard.guard._summary`): what runs, the predicted peak of the budget,
        and every choice that overrides the user's script (``overrides``, plus the precision and, when
        memguard splits the front-end's batches, the accumulation). ``made``: memguard made the plan
        (default: :attr:`plan_made`)."""
        made = self.plan_made if made is None else made
        changed = []
        if (made and self.constraints.precision_role == "guard" and self.constraints.precisions is None
                and "precision" not in self.options.plan_options and plan.precision != self.script_precision):
            how = "autocasts" if plan.precision.endswith("-mixed") else "casts the model"
            changed.append(f"precision {plan.precision} instead of your model's {self.script_precision} (memguard "
                           f"{how}; precision={self.script_precision!r} keeps yours)")
        if self.constraints.splits_batch and plan.grad_accum_steps > 1:
            changed.append(f"each batch of {plan.micro_batch_size * plan.grad_accum_steps} runs as "
                           f"{plan.grad_accum_steps} micro-batches of {plan.micro_batch_size} (gradient accumulation, "
                           "the same gradient)")
        text = plan_summary(plan, made=made, budget_from=budget_source(plan, self.options.plan_options) if made else "the plan's",
                            runs=runs, overrides=changed + list(overrides))
        show(text, verbose=self.options.verbose)

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
            from memguard.estimator._blocks import apply_activation_checkpointing

            self.on_undo(apply_activation_checkpointing(self.module, blocks))
        self.plan = plan
        self.plan_made = False
        self.ceiling = micro_batch_size
        self.window = None
        self.shapes.forget_sizes()
        if self._context is None and plan is not None:  # a given plan: plan new signatures with its settings
            self._context = {"optimizer": optimizer, "loss_fn": self.options.loss_fn, "options": {}}

    def limit_micro_batch(self, n: int) -> None:
        """Use at most ``n`` samples per micro-batch (a front-end whose batches hold fewer than the plan's)."""
        if self.ceiling is not None and n < self.ceiling and self.window is None:
            self.ceiling = n
            self.shapes.limit(n)

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
        loss_fn = loss_fn if loss_fn is not None else self.options.loss_fn
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
        if self.ceiling is None:
            raise ConfigError("no plan was applied before the first batch; prepare the model with a plan, a "
                              "micro_batch_size or planning options")
        if self.window is None:
            from memguard.guard._tp import unguarded_tensor_parallel

            problem = unguarded_tensor_parallel(self.module)  # an OOM there would leave its peers waiting
            if problem is not None:
                raise ConfigError(problem)
            self.window = MicroBatchWindow(self.ceiling, rank_group=self.rank_group,
                                           sync_gradients=self.options.sync_gradients,
                                           max_retries=self.options.max_retries,
                                           plan=self.plan, precision=self.precision_name, on_halve=self._on_halve)
        module = self.module
        params = synced_params(model, module)
        if warn_stale_grads and not self._warned_stale_grads and any(p.grad is not None for p in params):
            logger.warning("memguard.step found gradients from before the step and discards them: a step that may be "
                           "retried must start from none (let memguard.step run the whole backward)")
            self._warned_stale_grads = True
        self.window.start(module, params, optimizers)
        self.open.sigs, self.open.cap = [], None

    def run(self, batch: Any, loss_of: Callable[[Any], torch.Tensor],
            backward: Callable[[torch.Tensor], None] | None = None, *, model: nn.Module | None = None,
            weight: float = 1.0, last: bool = False) -> torch.Tensor:
        """Run one batch of the open window; with ``last`` and ``sync_gradients``, average the gradients.

        The batch runs at the micro-batch of its shape signature (:mod:`memguard.guard._shapes`; under DDP
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
        if self.open.cap is not None:
            mbs = min(mbs, self.open.cap)
        window.micro_batch_size = mbs
        self.open.current = sig
        if sig not in self.open.sigs:
            self.open.sigs.append(sig)
        if self.compiled:
            inner_loss_of = loss_of

            def loss_of(micro: Any) -> torch.Tensor:
                return inner_loss_of(mark_batch_dynamic(micro))
        retries = window.oom_retries
        try:
            loss = window.run(batch, loss_of, backward if backward is not None else self.backward, weight=weight,
                              last=last)
            if window.oom_retries != retries:  # only this signature's micro-batch is halved
                self._record_halving(sig, window)
            self.open.cap = window.micro_batch_size
            if last and self.options.sync_gradients:
                module = self.module
                window.sync_gradients(synced_buffers(model if model is not None else module, module))
        except BaseException:
            window.finish()
            raise
        return loss

    # ---------------------------------------------------------------------------------------------- shapes

    def anchor(self, value: torch.Tensor) -> torch.Tensor:
        """A loss equal to ``value`` whose backward adds zero to every gradient (for a framework's own backward)."""
        assert self.window is not None
        return self.window.anchor(value)

    def optimizer_step(self, step_fn: Callable[[], Any], zero_grad: Callable[[], None], *,
                       unscale: Callable[[], Any] | None = None) -> None:
        """Close the window, clip the accumulated gradients (``max_grad_norm``, then ``clip_grad_value``), step
        the optimizer, drop the gradients and agree with the peers on the outcome; then count the step.

        Clipping runs once per optimizer step, on the gradients of every micro-batch and batch of the
        window (averaged over the ranks first), through ``torch.nn.utils.clip_grad_norm_`` /
        ``clip_grad_value_``, which handle FSDP2's DTensor gradients too. The total norm before
        clipping is kept for :meth:`status` (``grad_norm``).

        Args:
            step_fn: the optimizer step (through the front-end's GradScaler, if any).
            zero_grad: drops the optimizer's gradients (the window's parameters' are dropped too).
            unscale: unscales the gradients before clipping (the GradScaler's ``unscale_`` of the
                optimizer, under ``16-mixed``); None: they are not scaled.

        Raises:
            OOMRecoveryError: out of memory in the step.
            PeerFailedError: a peer failed in its step.
            Exception: the user's own error in the step (its optimizer, a step hook), with a note.
        """
        window = self.window
        assert window is not None
        params = window.params
        self.end_window()
        max_norm, max_value = self.options.max_grad_norm, self.options.clip_grad_value

        def clip_and_step() -> None:
            if max_norm is not None or max_value is not None:
                if unscale is not None:
                    unscale()
                if max_norm is not None:
                    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
                    full = getattr(norm, "full_tensor", None)  # a DTensor under FSDP2
                    self._grad_norm = (full() if full is not None else norm).detach()
                if max_value is not None:
                    torch.nn.utils.clip_grad_value_(params, max_value)
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
        self._count_window(retried)

    def _on_halve(self, mbs: int) -> None:
        """Write the reduced micro-batch to the plan cache, when memguard planned with ``cache=``."""
        plan = self.plan
        if self.open.current is not None and self.open.current != self.shapes.reference:
            return  # the plan cache keeps the planned shape's micro-batch only
        if self._reduced is None or plan is None:
            logger.debug("micro-batch %s is kept for this process only (plan with cache=True to keep it across runs)",
                         mbs)
            return
        self._reduced.put(plan, mbs)


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
