"""Lightning: plan the micro-batch before ``fit`` and recover from out-of-memory errors during it.

::

    from memguard.integrations.lightning import MemguardCallback

    trainer = Trainer(callbacks=[MemguardCallback(budget_bytes=8 << 30)], accumulate_grad_batches=1)
    trainer.fit(model)   # model.batch_size (or its datamodule's) feeds train_dataloader()

Works with ``lightning.pytorch`` and with ``pytorch_lightning``, and with both installed: the callback
is a ``Callback`` of every installed package (so either Trainer's ``isinstance`` checks accept it),
and it takes the strategy classes and utilities from the package of the Trainer it runs in (the
first Lightning class in the Trainer's MRO, so a Trainer subclass defined anywhere works).

Strategies. Single device, DDP, ``ModelParallelStrategy`` (FSDP2), ``FSDPStrategy`` (FSDP1) and
``DeepSpeedStrategy`` (ZeRO stages 0-3): the callback plans, applies and guards (below). Under the
sharded strategies the plan is constrained to the strategy's sharding:
DeepSpeed's ZeRO stage and optimizer offload from its config; FSDP's ``FULL_SHARD`` as ZeRO-3
(parameters resharded after forward) and ``SHARD_GRAD_OP`` as stage 2; ``ModelParallelStrategy``
(FSDP2, ``fully_shard`` in ``configure_model``) any FSDP2 level over its data-parallel ranks, which
``configure_model`` applies (``reshard_after_forward`` is ``plan.zero_stage == 3``); the plan's world
size is the strategy's. It plans in ``setup`` there, before the strategy wraps the module and before
DeepSpeed reads the batch size and accumulation into its config. Under ``ModelParallelStrategy``,
once ``configure_model`` has sharded the module (``on_fit_start``), the callback arms FSDP2's
agreement protocol on every ``fully_shard``-ed module (:mod:`memguard.guard._sharded`,
:mod:`memguard.guard._fsdp2_frameworks`: an agreement of the ranks before each FSDP2 all-gather and
reduce-scatter, so that a rank that runs out of memory in compute makes its peers leave
forward/backward at their next FSDP2 collective instead of waiting in it) and guards the training
steps as under DDP; FSDP2 reduce-scatters the gradients itself (Lightning's ``no_sync`` holds them
back on an accumulation window's earlier batches). Under ``DeepSpeedStrategy``, once the strategy has
built the engine (``on_fit_start``), the callback arms memguard's DeepSpeed protocol on it
(:mod:`memguard.integrations._deepspeed_guard`: an agreement of the ranks before every ``deepspeed.comm``
collective, ZeRO-1/2's gradient reduction, ZeRO-3's parameter all-gathers and reduce-scatters, the
step's all-reduces; after an OOM on any rank every rank resets the engine's step state) and stands
in for the strategy's ``training_step`` and the DeepSpeed precision plugin's ``backward`` and
``optimizer_step`` (:meth:`MemguardCallback._patch_deepspeed`): each micro-batch runs Lightning's
own training step through the engine's forward and ``engine.backward`` inside one agreed attempt,
the last micro-batch of an optimizer step's window is the engine's accumulation boundary (Lightning's
``accumulate_grad_batches``, which Lightning writes into the config as
``gradient_accumulation_steps``), and the engine steps once per window through
:func:`memguard.integrations._deepspeed_guard.agreed_engine_step`. Engines the protocol cannot reset (ZeRO
offload, ZenFlow, DeepSpeed's ``FP16_Optimizer``/``BF16_Optimizer`` wrappers: fp16/bf16 without
ZeRO, or bf16 ZeRO-1; :func:`memguard.integrations._deepspeed_guard.engine_problems`) are planned and applied only,
and the reason is logged. Under ``FSDPStrategy``, once the strategy has wrapped the module
(``on_fit_start``), the callback arms memguard's FSDP1 protocol on the wrapper
(:mod:`memguard.guard._fsdp1`: an agreement of the ranks before each FSDP1 all-gather and
reduce-scatter) and stands in for the strategy's ``training_step``
(:meth:`MemguardCallback._patch_strategy_step`): Lightning runs ``training_step`` *inside* the FSDP1
root's forward (forward redirection), so the callback splits the batch outside it and runs each
micro-batch through Lightning's own ``Strategy.training_step`` (the root's forward) and its backward
in one agreed attempt; FSDP1 reduce-scatters each micro-batch's gradients. :func:`strategy_for`
returns the Lightning strategy that runs a plan.

What the callback does, in Lightning's hooks:

* ``setup("fit")`` checks that it can work: automatic optimization, a strategy it knows (above),
  the train dataloader coming from the LightningModule or its LightningDataModule, a
  ``batch_size`` attribute (Lightning's ``BatchSizeFinder`` convention: ``lightning_hasattr``), no
  ``GradientAccumulationScheduler``, and a precision memguard knows. Every problem is listed in
  one :class:`memguard.ConfigError`.
* ``on_fit_start`` takes one example batch from the train dataloader (the global RNG state is left
  as it was), passes it through the precision plugin and the batch-transfer hooks as the training
  loop would, and calls :func:`memguard.plan` on the LightningModule with the loss of its
  ``training_step`` (a tensor, or a dict with ``"loss"``), the Trainer's optimizer, world size,
  device and precision: the plan is *constrained* to the Trainer's precision, and a ``precision=``
  option or a given ``plan=`` that disagrees with it is a ConfigError. Under DDP rank 0 plans and
  broadcasts. The global batch defaults to ``batch_size x accumulate_grad_batches x world size``.
  The plan is applied the way ``BatchSizeFinder`` applies its result: ``lightning_setattr`` of the
  micro-batch, then the train dataloader is rebuilt; ``trainer.accumulate_grad_batches`` becomes
  the plan's accumulation, and the plan's activation checkpointing is applied to the module's
  repeated blocks. The plan is logged at INFO on the ``memguard`` logger.
* During ``fit`` the callback stands in for ``training_step`` (an attribute on the module
  instance). Each dataloader batch goes through the guard core (:class:`memguard.guard._core.Guard`,
  whose OOM engine is :class:`memguard.guard._window.MicroBatchWindow`):
  the batch is split into micro-batches of the current size, the user's ``training_step`` runs on
  each, and each loss, weighted by its share of samples and by ``1/accumulate_grad_batches`` (as
  Lightning weights it), is back-propagated at once (scaled by the ``16-mixed`` GradScaler). The
  callback returns a loss equal to the batch's mean loss whose backward adds exactly zero to
  every gradient (:func:`memguard.guard._window.gradient_anchor`); Lightning's own backward of it
  fires the gradient hooks, so under ``strategy="ddp"`` DDP's reducer averages the accumulated
  gradients on the last batch of the window, and Lightning's own optimizer step (gradient
  clipping, GradScaler, schedulers, hooks) applies them. Lightning's ``zero_grad`` (which it runs
  *after* the first ``training_step`` of a window) is skipped; the window drops the gradients
  when that ``training_step`` starts instead. On an OOM on any rank, the window's gradients are dropped, the
  micro-batch halved, and every batch of the current optimizer step so far run again from its
  first sample, on every rank together (one small all-reduce per batch). Later batches keep the
  halved micro-batch (they are still split, since the dataloader's batches keep their size).
* ``status()`` reports what the guard does (:class:`memguard.guard._core.GuardStatus`), as
  :func:`memguard.guard.guard_status` does for ``prepare``/``step``.
* ``teardown`` and ``on_exception`` restore ``training_step``, ``optimizer_zero_grad``, the
  ``batch_size`` attribute, ``accumulate_grad_batches`` and the checkpointed blocks (under
  ``DeepSpeedStrategy`` also the strategy's ``training_step`` and the precision plugin's ``backward``
  and ``optimizer_step``, and the wrappers on DeepSpeed's communication backend).

Accumulation under DeepSpeed differs from plain Lightning, on purpose. With ``accumulate_grad_batches=k``
the callback's accumulated gradient is that of the optimizer step's mean loss, as Lightning gives under a
single device and DDP, and as DeepSpeed gives without Lightning. Lightning 2.6's own DeepSpeed path divides
the loss by ``k`` twice: ``ClosureResult.from_training_step_output`` (``loops/optimization/automatic.py``)
divides it by ``accumulate_grad_batches``, and ``DeepSpeedPrecision.backward`` calls
``deepspeed_engine.backward(loss)``, which divides it again by ``gradient_accumulation_steps`` (DeepSpeed's
``_scale_loss_by_gas``, ``scale_wrt_gas=True``; Lightning writes ``accumulate_grad_batches`` there). Measured
on 2 CPU ranks, ZeRO-2, ``k=2``, one SGD step from the same weights
(``test_deepspeed_accumulation_gives_the_windows_mean_loss_gradient_where_plain_lightning_gives_1_over_k``):
the callback's weight change equals a plain full-batch step's, plain Lightning's is 0.5000 of it. A job
that moves to the callback from plain Lightning with ``k > 1`` under DeepSpeed therefore sees ``k`` times
larger gradients: the same as with ``k = 1`` or under DDP; an optimizer invariant to the gradient's scale
(Adam, without clipping) is hardly affected, SGD's effective learning rate is ``k`` times plain Lightning's,
and a ``gradient_clipping`` threshold applies to the mean-loss gradient. (The same double division was
reported to Lightning, Lightning-AI/pytorch-lightning#6170, and fixed in the HF Trainer,
huggingface/transformers#35808.)

Why this design rather than manual optimization: switching the user's module to manual
optimization would change what their ``training_step`` must do, and would drop Lightning's
gradient clipping and automatic scheduler stepping; splitting inside the training step keeps every
Lightning feature of automatic optimization. Why replay the window rather than only the batch
that failed: the gradients of the earlier batches are mixed with the failed batch's partial ones,
and keeping a copy to restore would cost one more set of gradients at the peak.

Known limitations:
    ``training_step`` runs once per micro-batch (and again on a replay), so ``self.log`` in it
    logs the micro-batch's values; values returned besides the loss come from the last micro-batch.
    Planning also runs it, on a copy of the module with fake tensors and ``self.log`` silenced.
    Under DDP, ``training_step`` must not start a collective (``self.log(..., sync_dist=True)``,
    ``all_gather``): a rank that ran out of memory would not join it. Gradient communication no
    longer overlaps the backward passes (DDP averages on the returned loss's backward). Parameters
    that got no gradient on any rank are left alone, so DDP with ``find_unused_parameters=False``
    fails on them as it would without memguard. Trainer limits counted in batches
    (``limit_train_batches``, ``val_check_interval`` as ints) count the smaller batches. Manual
    optimization and dataloaders passed directly to ``fit`` are not supported; under
    ``FSDPStrategy`` an OOM inside FSDP1's own collectives stops every rank with the same
    :class:`memguard.OOMRecoveryError`, recovery is verified on CPU with gloo (fp32, ``FULL_SHARD``;
    ``SHARD_GRAD_OP`` fails after a recovery, see the tests), and a model the user wrapped in
    ``configure_model`` without an FSDP1 root is guarded unit by unit, untested; under DeepSpeed an OOM
    inside a DeepSpeed collective or in ``engine.step()`` stops every rank with the same
    :class:`memguard.OOMRecoveryError` (restart from a checkpoint), ``training_step`` must not start
    a collective of its own, Lightning's ``on_before_optimizer_step`` still runs after every batch (as
    Lightning runs it under DeepSpeed) while the engine steps once per window, an epoch whose batch
    count is not a multiple of ``accumulate_grad_batches`` ends its last window with an engine step,
    and recovery is verified on CPU with gloo (fp32 ZeRO-1/2/3) only; under
    ModelParallel (FSDP2) an OOM inside FSDP2's own collectives (their buffers) stops every rank
    with the same :class:`memguard.OOMRecoveryError`, and HSDP (a 2-D mesh) is refused; FSDP's
    ``HYBRID_SHARD``, ``cpu_offload`` and DeepSpeed's ``offload_param`` are refused, tensor
    parallelism is not modelled, and the module's layers must exist before ``configure_model``
    (the plan is made from them). FSDP1 (``FSDPStrategy``) is planned with memguard's FSDP1
    model (``strategy="fsdp1"``: each repeated block its own unit, ``use_orig_params=True``, the
    precision's ``MixedPrecision``); another ``auto_wrap_policy`` is estimated as that one.
    The plan is made once per ``fit``. Validation and test steps run in micro-batches when a batch
    does not fit (:meth:`MemguardCallback.on_validation_start`); a ``self.log(..., batch_size=N)``
    given explicitly in them overrides the micro-batch weighting of epoch means. Under the strategies
    whose forward gathers sharded parameters (FSDP, ModelParallel, DeepSpeed ZeRO-3) every rank splits
    together (:meth:`MemguardCallback._patch_eval_step`); ``validation_step``/``test_step`` must not
    start a collective of its own there (``self.log(..., sync_dist=True)``), and an engine or model
    memguard cannot reset after an OOM in evaluation is left unsplit with a warning. On one rank under
    FSDP1 the split runs inside the root's forward, without FSDP1's reset after an OOM (untested).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Sequence

import torch
from torch import nn

from memguard.batch import batch_size
from memguard.errors import ConfigError, MissingDependencyError
from memguard.guard._core import Guard, GuardStatus
from memguard.guard._distributed import RankGroup, rank_group_of
from memguard.guard._options import Constraints, GuardOptions, given_options, option_problems, plan_problems
from memguard.guard._window import DEFAULT_MAX_RETRIES
from memguard.planner.api import Plan
from memguard.vocab import PRECISIONS

__all__ = ["MemguardCallback", "strategy_for"]

logger = logging.getLogger("memguard")

# Options the callback takes from the Trainer instead of from the user.
_FROM_TRAINER = ("world_size", "device", "optimizer", "loss_fn", "batch")


@dataclass(frozen=True)
class _Sharding:
    """How a Lightning strategy shards the training state, in memguard's terms.

    Attributes:
        strategy: memguard's strategy name (``Plan.strategy``): ``"ddp"``, ``"fsdp2"``, ``"fsdp1"`` or
            ``"deepspeed"``.
        zero_stages: the sharding levels the strategy runs (ZeRO stages; under FSDP, 3 = parameters
            resharded after forward, 2 = kept unsharded between forward and backward).
        offload_optimizer: the strategy keeps optimizer states in host memory.
        world_size: the data-parallel ranks (the batch is split over them).
        guarded: the callback plans in ``on_fit_start`` and runs its out-of-memory guard from there
            (single device and DDP); under the sharded strategies it plans and applies the plan in
            ``setup``, before the strategy shards the module.
        arms_fsdp2: under ``ModelParallelStrategy``: once ``configure_model`` has sharded the module
            (``on_fit_start``), the callback arms FSDP2's agreement protocol on it and runs its guard.
        arms_deepspeed: under ``DeepSpeedStrategy``: once the strategy has built the DeepSpeed engine
            (``on_fit_start``), the callback arms memguard's DeepSpeed agreement protocol on it and runs
            each training step's micro-batches and the engine's step itself.
        arms_fsdp1: under ``FSDPStrategy``: once the strategy has wrapped the module in FSDP1
            (``on_fit_start``), the callback arms FSDP1's agreement protocol on the wrapper and runs each
            micro-batch through Lightning's own ``Strategy.training_step`` (the FSDP1 root's forward).
        name: the strategy's class name, for messages.
        unguarded_why: the key of :data:`_UNGUARDED_WHY` that says why the callback does not recover
            from out-of-memory errors under the strategy ("": it does).
    """

    strategy: str = "ddp"
    zero_stages: tuple[int, ...] = (0,)
    offload_optimizer: bool = False
    world_size: int | None = None
    guarded: bool = True
    arms_fsdp2: bool = False
    arms_deepspeed: bool = False
    arms_fsdp1: bool = False
    name: str = ""
    unguarded_why: str = ""


# Before a Trainer is known: every sharding any supported strategy runs (checked again in setup()).
_ANY_SHARDING = _Sharding(strategy="any", zero_stages=(0, 1, 2, 3), offload_optimizer=True)


def _constraints(trainer: Any = None, sharding: _Sharding = _ANY_SHARDING) -> Constraints:
    """What the Trainer fixes: its precision (Lightning runs it), world size and its strategy's sharding."""
    extra: dict[str, Any] = {}
    if sharding.strategy != "any":
        extra["strategies"] = (sharding.strategy,)
    world = sharding.world_size if sharding.world_size is not None else (
        trainer.world_size if trainer is not None else None)
    return Constraints(
        source="the Trainer", taken=_FROM_TRAINER, precision_role="framework",
        precisions=(str(trainer.precision),) if trainer is not None else None,
        world_size=world, zero_stages=sharding.zero_stages, offload_optimizer=sharding.offload_optimizer,
        fix_plan="plan again with memguard.plan() for this Trainer",
        fix_precision="set Trainer(precision=...)", **extra,
    )


def _import_lightning() -> ModuleType:
    """``lightning.pytorch`` if importable, else ``pytorch_lightning``."""
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise MissingDependencyError("pytorch-lightning (or lightning)", "lightning")


_pl = _import_lightning()
_PACKAGES = ("lightning.pytorch", "pytorch_lightning")


def _installed_packages() -> list[ModuleType]:
    """Every Lightning package that imports, ``lightning.pytorch`` first."""
    out = []
    for name in _PACKAGES:
        try:
            out.append(importlib.import_module(name))
        except ImportError:
            continue
    return out


def _package_of(obj: Any) -> ModuleType:
    """The Lightning package that ``obj`` (a Trainer, or a subclass of one defined anywhere) comes from.

    Both packages may be installed, and a user's Trainer subclass lives in the user's module, so the
    package is the one that defines the first Lightning class in the object's MRO.
    """
    for cls in type(obj).__mro__:
        module = cls.__module__ or ""
        for name in _PACKAGES:
            if module == name or module.startswith(name + "."):
                return importlib.import_module(name)
        if module == "lightning" or module.startswith("lightning."):  # lightning.fabric etc.: the unified package
            return importlib.import_module("lightning.pytorch")
    return _pl


def _step_loss(model: nn.Module, micro: Any) -> torch.Tensor:
    """The loss memguard plans with: the class's ``training_step`` (during ``fit`` the instance holds the
    callback's stand-in, which must not run inside the planner's trace of a new batch shape)."""
    own = model.__dict__.get("training_step")
    if own is not None and not getattr(own, "_memguard_stand_in", False):
        return _loss_of_output(own(micro, 0))[0]  # e.g. FSDP2's hooks around it in the FSDP2 trace
    return _loss_of_output(type(model).training_step(model, micro, 0))[0]


def _loss_of_output(out: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    """Lightning's automatic-optimization contract: a tensor, or a dict holding ``"loss"``."""
    if isinstance(out, torch.Tensor):
        return out, {}
    if isinstance(out, Mapping) and isinstance(out.get("loss"), torch.Tensor):
        return out["loss"], {k: v for k, v in out.items() if k != "loss"}
    raise ConfigError(f"training_step returned {type(out).__name__}; MemguardCallback needs the loss: return a tensor "
                      "or a dict with a 'loss' tensor (returning None to skip a step is not supported)")


def _no_log(*args: Any, **kwargs: Any) -> None:
    return None


# What the callback does not do under the sharded strategies, and why (logged when it plans there).
_UNGUARDED_WHY = {
    "deepspeed": "memguard's agreement protocol for DeepSpeed cannot reset this engine after an OOM ({problems}); "
                 "memguard planned and applied the micro-batch, accumulation and checkpointing only",
    "fsdp1": "the strategy's model holds no FullyShardedDataParallel module, so memguard has no FSDP1 collectives to "
             "guard; memguard planned and applied the micro-batch, accumulation and checkpointing only",
    "fsdp2": "configure_model sharded nothing with fully_shard, so memguard has no FSDP2 collectives to guard; "
             "memguard planned and applied the micro-batch, accumulation and checkpointing only",
}


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _sharding_of(strategy: Any, pkg: ModuleType, problems: list[str]) -> _Sharding:
    """The sharding of a Lightning strategy, or the reasons memguard cannot plan for it (appended to ``problems``)."""
    strategies = pkg.strategies
    name = type(strategy).__name__
    # DeepSpeedStrategy subclasses DDPStrategy: test it first.
    if isinstance(strategy, strategies.DeepSpeedStrategy):
        config = strategy.config if isinstance(strategy.config, Mapping) else {}
        zero = config.get("zero_optimization") or {}
        stage = zero.get("stage", 0)
        offload = str((zero.get("offload_optimizer") or {}).get("device", "none")).lower() not in ("none", "")
        if str((zero.get("offload_param") or {}).get("device", "none")).lower() not in ("none", ""):
            problems.append("DeepSpeed's offload_param (ZeRO-3 parameter offload) is not something memguard plans "
                            "for; drop it (memguard plans optimizer offload) or plan without the callback")
        if stage not in (0, 1, 2, 3):
            problems.append(f"the DeepSpeed config's zero_optimization.stage {stage!r} is not a ZeRO stage 0-3")
            stage = 0
        return _Sharding(strategy="deepspeed", zero_stages=(int(stage),), offload_optimizer=offload, guarded=False,
                         arms_deepspeed=True, name=name)
    if isinstance(strategy, strategies.FSDPStrategy):
        # FSDP1's sharding strategies (torch.distributed.fsdp.ShardingStrategy), estimated as FSDP1 itself
        # (memguard.estimator._fsdp1): FULL_SHARD is level 3, SHARD_GRAD_OP 2, NO_SHARD replication (DDP).
        kind = getattr(strategy.sharding_strategy, "name", str(strategy.sharding_strategy))
        stages = {"FULL_SHARD": (3,), "SHARD_GRAD_OP": (2,), "NO_SHARD": (0,)}
        if kind not in stages:
            problems.append(f"FSDPStrategy(sharding_strategy={kind!r}) shards within a node only, which memguard "
                            "does not model; use FULL_SHARD or SHARD_GRAD_OP")
        offload = getattr(strategy, "cpu_offload", None)
        if offload is not None and getattr(offload, "offload_params", False):
            problems.append("FSDPStrategy(cpu_offload=True) keeps parameters and gradients in host memory, which "
                            "memguard does not plan for; drop cpu_offload or plan without the callback")
        stage = stages.get(kind, (3,))
        return _Sharding(strategy="ddp" if stage == (0,) else "fsdp1", zero_stages=stage, guarded=False, name=name,
                         arms_fsdp1=True)
    if isinstance(strategy, strategies.ModelParallelStrategy):
        mesh = getattr(strategy, "_device_mesh", None)
        if mesh is not None and mesh.mesh_dim_names:
            dp, tp = mesh["data_parallel"].size(), mesh["tensor_parallel"].size()
        else:  # not set up yet: what the user asked for ("auto" is decided in setup_environment)
            dp, tp = _int_or_none(strategy._data_parallel_size), _int_or_none(strategy._tensor_parallel_size)
        if tp is not None and tp > 1:
            problems.append(f"ModelParallelStrategy with tensor_parallel_size={tp}: memguard does not model tensor "
                            "parallelism; use tensor_parallel_size=1 (FSDP2 over data_parallel_size ranks)")
        # The user's configure_model() applies fully_shard; any FSDP2 sharding level can run there.
        return _Sharding(strategy="fsdp2", zero_stages=(3, 2, 1), world_size=dp, guarded=False, arms_fsdp2=True,
                         name=name)
    if isinstance(strategy, (strategies.SingleDeviceStrategy, strategies.DDPStrategy)) and not getattr(
            strategy, "handles_gradient_accumulation", False):
        return _Sharding(name=name)
    problems.append(f"strategy {name} is not supported: MemguardCallback works with a single device, "
                    "strategy='ddp', FSDPStrategy, ModelParallelStrategy and DeepSpeedStrategy")
    return _Sharding(name=name)


def _strategy_problems(plan: Plan, sharding: _Sharding) -> list[str]:
    """A problem if ``plan`` records another strategy than the Trainer's (its ZeRO stage is checked by the core)."""
    planned = getattr(plan, "strategy", None)
    if not planned or sharding.strategy == "any" or planned == sharding.strategy:
        return []
    return [f"the plan was made for strategy {planned!r} but the Trainer runs {sharding.name} "
            f"({sharding.strategy!r}); build the Trainer with strategy=strategy_for(plan), or plan again "
            f"with strategy={sharding.strategy!r}"]


def _world_rank_group(strategy: Any) -> RankGroup | None:
    """The default process group as a :class:`RankGroup` (for the plan's broadcast), or None on one process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    device = torch.device("cpu")
    if "nccl" in str(dist.get_backend()):  # NCCL only moves CUDA tensors
        device = strategy.root_device
    return RankGroup(dist.group.WORLD, dist.get_world_size(), dist.get_rank(), 0, device)


def _apply_to_deepspeed_config(strategy: Any, plan: Plan) -> dict[str, Any]:
    """Make batch keys a user wrote into the DeepSpeed config agree with the plan; the values they had.

    Lightning fills ``gradient_accumulation_steps`` from the Trainer and ``train_micro_batch_size_per_gpu``
    from the dataloader only when absent (strategies/deepspeed.py, _format_batch_size_and_grad_accum_config);
    DeepSpeed checks ``train_batch_size == micro x accumulation x world`` (runtime/config.py).
    """
    config = strategy.config
    if not isinstance(config, dict):
        return {}
    saved = {}
    for key, value in (("train_micro_batch_size_per_gpu", plan.micro_batch_size),
                       ("train_batch_size", plan.global_batch_size)):
        if key in config and config[key] != value:
            saved[key] = config[key]
            config[key] = value
    return saved


@dataclass
class _Saved:
    """What the callback changes, as it was before: dumped before each change and put back once by
    :meth:`MemguardCallback._restore`, as Lightning's BatchSizeFinder dumps, resets and restores the
    Trainer (tuner/batch_size_scaling.py).

    Attributes:
        batch: the module's batch-size attribute (None: ``fit`` changed nothing yet).
        accumulate: the Trainer's ``accumulate_grad_batches``.
        deepspeed: the batch keys of a user's DeepSpeed config that the plan replaced.
        attributes: the module's own (instance) ``training_step``, ``optimizer_zero_grad``,
            ``validation_step`` and ``test_step`` the callback stands in for (None: it had none).
        objects: under ``DeepSpeedStrategy``, ``(object, name, own value or None)`` of each attribute the
            callback stands in for on the strategy and its precision plugin, in the order set.
    """

    batch: Any = None
    accumulate: int | None = None
    deepspeed: dict[str, Any] = field(default_factory=dict)
    attributes: dict[str, Any] = field(default_factory=dict)
    objects: list[tuple[Any, str, Any]] = field(default_factory=list)


def strategy_for(plan: Plan, *, package: str | ModuleType | None = None, fsdp_version: int = 2) -> Any:
    """The Lightning strategy that runs ``plan``: pass it as ``Trainer(strategy=...)``.

    ============================  ===============================================================
    plan                          strategy
    ============================  ===============================================================
    ``"ddp"``, one process        ``"auto"`` (Lightning's single-device strategy)
    ``"ddp"``, several processes  ``DDPStrategy()``
    ``"fsdp2"``                   ``ModelParallelStrategy(data_parallel_size=world,
                                  tensor_parallel_size=1)``: shard the module in its
                                  ``configure_model()`` as the plan says
                                  (``memguard.integrations.fsdp.apply``; ``reshard_after_forward``
                                  is ``zero_stage == 3``); with ``fsdp_version=1``,
                                  ``FSDPStrategy(sharding_strategy="FULL_SHARD")`` for stage 3,
                                  ``"SHARD_GRAD_OP"`` for stages 2 and 1 (FSDP1 has no stage 1)
    ``"fsdp1"``                   ``FSDPStrategy(sharding_strategy="FULL_SHARD")`` for stage 3,
                                  ``"SHARD_GRAD_OP"`` for stage 2
    ``"deepspeed"``               ``DeepSpeedStrategy(config=...)`` from
                                  :func:`memguard.integrations.deepspeed.to_config`, without
                                  ``gradient_accumulation_steps`` and ``train_batch_size`` (Lightning
                                  sets the accumulation from the Trainer and refuses it in the config)
    a ``plan.layout`` with TP     ``ModelParallelStrategy(data_parallel_size=dp_shard,
                                  tensor_parallel_size=tp)``
                                  (:func:`memguard.integrations.parallel.lightning_strategy_kwargs`):
                                  ``configure_model()`` applies TP over
                                  ``self.device_mesh["tensor_parallel"]`` and FSDP2 over
                                  ``"data_parallel"``; :class:`MemguardCallback` does not recover
                                  from OOM under TP yet
    ============================  ===============================================================

    The Trainer must also get ``precision=plan.precision``, ``devices``/``num_nodes`` giving
    ``plan.world_size`` processes and ``accumulate_grad_batches=plan.grad_accum_steps`` (or use
    :class:`MemguardCallback` with ``plan=``, which sets the batch size and accumulation).

    Args:
        plan: the plan.
        package: ``"lightning.pytorch"`` or ``"pytorch_lightning"`` (or the module) whose strategy
            classes to use; default: ``lightning.pytorch`` if installed.
        fsdp_version: 2 (``ModelParallelStrategy``, FSDP2) or 1 (``FSDPStrategy``) for an FSDP plan.

    Raises:
        ConfigError: not a Plan, a plan without a Lightning equivalent (``"16-true"`` under
            DeepSpeed, ...), an unknown package or ``fsdp_version``; every problem listed.
    """
    problems: list[str] = []
    if not isinstance(plan, Plan):
        raise ConfigError(f"strategy_for needs a memguard.Plan, got {type(plan).__name__}")
    if fsdp_version not in (1, 2):
        problems.append(f"fsdp_version must be 1 or 2, got {fsdp_version!r}")
    if package is None:
        pkg = _pl
    elif isinstance(package, ModuleType):
        pkg = package
    elif package in _PACKAGES:
        pkg = importlib.import_module(package)
    else:
        problems.append(f"package must be one of {', '.join(_PACKAGES)}, got {package!r}")
        pkg = _pl
    planned = plan.strategy
    if planned == "ddp" and plan.zero_stage != 0:
        problems.append(f"a 'ddp' plan with zero_stage {plan.zero_stage} is inconsistent; plan again")
    if planned not in ("ddp", "fsdp2", "fsdp1", "deepspeed"):
        problems.append(f"the plan's strategy {planned!r} has no Lightning strategy here")
    config = None
    if planned == "deepspeed":
        from memguard.integrations.deepspeed import to_config

        try:
            config = to_config(plan)
        except ConfigError as exc:
            problems += exc.problems
    layout = getattr(plan, "layout", None)
    tensor_parallel = layout is not None and (layout.tp > 1 or layout.pp > 1)
    if tensor_parallel and fsdp_version == 1:
        problems.append("the plan's layout has tensor or pipeline parallelism, which Lightning's FSDPStrategy "
                        "(FSDP1) cannot run; use fsdp_version=2 (ModelParallelStrategy)")
    if problems:
        raise ConfigError(problems)
    strategies = pkg.strategies
    if tensor_parallel:
        from memguard.integrations.parallel import lightning_strategy_kwargs

        return strategies.ModelParallelStrategy(**lightning_strategy_kwargs(plan))
    if planned == "ddp":
        return "auto" if plan.world_size == 1 else strategies.DDPStrategy()
    if planned == "fsdp1":
        return strategies.FSDPStrategy(sharding_strategy="FULL_SHARD" if plan.zero_stage == 3 else "SHARD_GRAD_OP")
    if planned == "fsdp2":
        if fsdp_version == 1:
            return strategies.FSDPStrategy(sharding_strategy="FULL_SHARD" if plan.zero_stage == 3 else "SHARD_GRAD_OP")
        return strategies.ModelParallelStrategy(data_parallel_size=plan.world_size, tensor_parallel_size=1)
    assert config is not None
    for key in ("gradient_accumulation_steps", "train_batch_size"):
        config.pop(key, None)
    return strategies.DeepSpeedStrategy(config=config)


# The callback is a Callback of every installed Lightning package, so that a Trainer of either accepts it
# (``Trainer(callbacks=cb)`` checks ``isinstance(cb, Callback)``, trainer/connectors/callback_connector.py).
# Both Callback classes derive from object only and define the same no-op hooks, so the MRO is simple.
_CALLBACK_BASES = tuple(pkg.Callback for pkg in _installed_packages())


class MemguardCallback(*_CALLBACK_BASES):  # type: ignore[misc]
    """Plan micro-batch, accumulation and activation checkpointing before ``fit``; halve on OOM during it.

    See the module docstring for what happens in each hook and why.

    Args:
        global_batch_size: samples per optimizer step over all ranks; default: the module's
            ``batch_size`` x ``accumulate_grad_batches`` x world size, i.e. what the Trainer would
            have used without memguard.
        plan: a :class:`memguard.Plan` to apply instead of planning (its precision must be the
            Trainer's, its world size the Trainer's).
        batch_arg_name: the attribute that sets the train dataloader's batch size, on the module,
            its datamodule or their ``hparams`` (as ``BatchSizeFinder``'s ``batch_arg_name``).
        max_retries: at most this many halvings within one optimizer step.
        budget_bytes: memory per rank to plan for (default: the GPU's memory less its CUDA context).
        gpu: the GPU to plan for, a catalog name such as ``"A100-80GB"`` (default: the one in use).
        headroom: share of the budget kept free (default 0.1).
        precision: only the Trainer's own may be given (memguard does not change it).
        activation_checkpointing: True or False fixes it (default: memguard chooses).
        zero_stage: a ZeRO stage or a list of them, within what the Trainer's strategy runs (default: chosen).
        offload_optimizer: optimizer state in host memory, under DeepSpeed (default False).
        cache: reuse and store plans in memguard's plan cache (default False).
        cpu: the CPU a CPU job runs on, e.g. ``"avx512_core_amx"`` (default: this one).
        torch_version: the torch version of the GPU machine, e.g. ``"2.5.1"`` (default: this one's).
        cuda_version: its CUDA version, e.g. ``"12.4"``.
        cudnn_version: its cuDNN version, e.g. ``"9.10.2"``.
        **plan_options: any other option of :func:`memguard.plan` (world size, device, optimizer and loss
            come from the Trainer). Each named option above may be given here too; None means not given.

    Attributes:
        plan: the plan in force during ``fit`` (None before).
        micro_batch_size: the current micro-batch (smaller than the plan's after an OOM).
        oom_retries: halvings so far.

    Raises:
        ConfigError: bad arguments (every problem listed).
    """

    def __init__(self, global_batch_size: int | None = None, *, plan: Plan | None = None,
                 batch_arg_name: str = "batch_size", max_retries: int = DEFAULT_MAX_RETRIES,
                 budget_bytes: int | None = None, gpu: str | None = None, headroom: float | None = None,
                 precision: str | list[str] | None = None, activation_checkpointing: bool | None = None,
                 zero_stage: int | list[int] | None = None, offload_optimizer: bool | None = None,
                 cache: bool | None = None, cpu: str | None = None, torch_version: str | None = None,
                 cuda_version: str | None = None, cudnn_version: str | None = None,
                 **plan_options: Any) -> None:
        plan_options = given_options(
            plan_options, budget_bytes=budget_bytes, gpu=gpu, headroom=headroom, precision=precision,
            activation_checkpointing=activation_checkpointing, zero_stage=zero_stage,
            offload_optimizer=offload_optimizer, cache=cache, cpu=cpu, torch_version=torch_version,
            cuda_version=cuda_version, cudnn_version=cudnn_version)
        problems = option_problems(_constraints(), plan=plan, global_batch_size=global_batch_size,
                                   max_retries=max_retries, plan_options=plan_options)
        if not isinstance(batch_arg_name, str) or not batch_arg_name:
            problems.append(f"batch_arg_name must be an attribute name, got {batch_arg_name!r}")
        if problems:
            raise ConfigError(problems)
        self.global_batch_size = global_batch_size
        self.batch_arg_name = batch_arg_name
        self.max_retries = max_retries
        self.plan_options = dict(plan_options)
        self.plan: Plan | None = plan
        self._given_plan = plan
        self._guard: Guard | None = None
        self._sharding: _Sharding | None = None
        self._checked_first_batch = False
        self._deepspeed_armed = False
        self._window_ends = False  # under DeepSpeed: the last training_step closed the optimizer step's window
        self._backward_done = False  # under DeepSpeed: the last training_step ran its backward passes
        self._eval_saved: dict[str, Any] = {}  # the strategy's own validation_step/test_step the callback stands in for
        self._eval_group: Any = None  # a rank group made for an evaluation outside fit (uninstalled at its end)
        self._saved = _Saved()

    # ----------------------------------------------------------------------------------------------
    # state for users and tests

    @property
    def micro_batch_size(self) -> int | None:
        """The micro-batch in force (None before ``fit`` starts)."""
        if self._guard is not None:
            return self._guard.micro_batch_size
        return self.plan.micro_batch_size if self.plan is not None else None

    @property
    def oom_retries(self) -> int:
        """Halvings of the micro-batch so far in this ``fit``."""
        return self._guard.oom_retries if self._guard is not None else 0

    def status(self) -> GuardStatus | None:
        """What the guard does in this ``fit`` (None before it starts)."""
        return self._guard.status() if self._guard is not None else None

    # ----------------------------------------------------------------------------------------------
    # hooks

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Check that the callback can work with this Trainer and module (``fit`` only).

        Raises:
            ConfigError: every reason it cannot, with what to do.
        """
        if stage != "fit":
            return
        pkg = _package_of(trainer)
        problems: list[str] = []
        if not pl_module.automatic_optimization:
            problems.append("MemguardCallback works with automatic optimization; with manual optimization call "
                            "memguard.step(model, optimizer, batch) from training_step yourself")
        sharding = _sharding_of(trainer.strategy, pkg, problems)
        self._sharding = sharding
        if not trainer.fit_loop._data_source.is_module():
            problems.append("the train dataloader was passed to trainer.fit(); return it from the LightningModule's "
                            "(or a LightningDataModule's) train_dataloader() so memguard can change its batch size, "
                            "as Lightning's BatchSizeFinder requires")
        if not pkg.utilities.parsing.lightning_hasattr(pl_module, self.batch_arg_name):
            problems.append(f"neither the LightningModule nor its datamodule (nor their hparams) has a "
                            f"'{self.batch_arg_name}' attribute; set self.{self.batch_arg_name} and build the train "
                            f"DataLoader with batch_size=self.{self.batch_arg_name}, as for Lightning's "
                            "BatchSizeFinder (or pass batch_arg_name=)")
        schedulers = [type(c).__name__ for c in trainer.callbacks
                      if isinstance(c, pkg.callbacks.GradientAccumulationScheduler)]
        if schedulers:
            problems.append("GradientAccumulationScheduler changes accumulate_grad_batches during fit, which memguard "
                            "sets from the plan; remove one of the two callbacks")
        precision = str(trainer.precision)
        if precision not in PRECISIONS:
            problems.append(f"the Trainer's precision {precision!r} is not one memguard plans for; use one of "
                            f"{', '.join(PRECISIONS)}")
        else:  # the precision option and a given plan against the Trainer's precision and world size
            problems += option_problems(_constraints(trainer, sharding), plan=self._given_plan,
                                        plan_options=self.plan_options)
            if self._given_plan is not None:
                problems += _strategy_problems(self._given_plan, sharding)
        device = trainer.strategy.root_device.type
        if device not in ("cuda", "cpu"):
            problems.append(f"memguard plans for 'cuda' or 'cpu' devices, not {device!r}")
        if problems:
            raise ConfigError(problems)
        if not sharding.guarded:
            # Sharded strategies read the batch size and accumulation when they set up (DeepSpeed writes
            # them into its config, trainer/strategies/deepspeed.py _format_batch_size_and_grad_accum_config;
            # FSDP and ModelParallel wrap the module in their setup()), which runs after this hook and
            # before on_fit_start: plan and apply now, on the module before it is sharded.
            self._plan_and_apply(trainer, pl_module, pkg)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """Plan (or take the given plan) and apply it; see the module docstring.

        Under DeepSpeed, FSDP and ModelParallel strategies this was done in :meth:`setup` already.

        Raises:
            ConfigError: the dataloader does not follow the batch-size attribute, or planning failed
                on bad input (as :func:`memguard.plan`).
            InfeasiblePlanError: nothing fits the budget.
        """
        sharding = self._sharding
        if sharding is not None and sharding.arms_fsdp2:
            self._arm_fsdp2(trainer, pl_module, sharding)
        if sharding is not None and sharding.arms_deepspeed:
            self._arm_deepspeed(trainer, pl_module, sharding)
        if sharding is not None and sharding.arms_fsdp1:
            self._arm_fsdp1(trainer, pl_module, sharding)
        if sharding is not None and not sharding.guarded:
            return
        self._plan_and_apply(trainer, pl_module, _package_of(trainer))

    def _arm_fsdp2(self, trainer: Any, pl_module: Any, sharding: _Sharding) -> None:
        """Under ``ModelParallelStrategy``, after ``configure_model`` sharded the module (the strategy's
        ``setup`` runs it before ``on_fit_start``: ``trainer/trainer.py`` ``_run``, Lightning 2.6): arm
        FSDP2's agreement protocol on every ``fully_shard``-ed module
        (:func:`memguard.guard._fsdp2_frameworks.framework_rank_group`) and stand in for
        ``training_step``, so that an OOM on any rank is recovered on every rank."""
        from memguard.guard._fsdp2_frameworks import framework_rank_group

        self._arm_group(trainer, sharding, framework_rank_group(pl_module), "fsdp2",
                        lambda: self._patch_module(trainer, pl_module))

    def _arm_group(self, trainer: Any, sharding: _Sharding, rg: Any, kind: str, patch: Any) -> None:
        """Guard training with the sharded rank group ``rg`` of ``kind`` ("fsdp1"/"fsdp2"; None: say why not),
        ``patch()`` standing in for Lightning's step."""
        guard = self._guard
        assert guard is not None  # planned in setup()
        if rg is None:
            if trainer.is_global_zero:
                logger.info("memguard does not recover from out-of-memory errors under %s: %s", sharding.name,
                            _UNGUARDED_WHY[kind])
            return
        guard.rank_group = rg
        guard.on_undo(rg.uninstall)
        patch()
        if trainer.is_global_zero:
            logger.info("memguard recovers from out-of-memory errors under %s: an agreement of the %d ranks runs "
                        "before each %s all-gather and reduce-scatter, so all ranks halve the micro-batch and "
                        "redo the same samples together", sharding.name, rg.world_size, kind.upper())

    def _arm_fsdp1(self, trainer: Any, pl_module: Any, sharding: _Sharding) -> None:
        """Under ``FSDPStrategy``, once the strategy wrapped the module in FSDP1 (``FSDPStrategy.setup`` ->
        ``_setup_model``: ``FullyShardedDataParallel(module=lightning_module, ...)``, which ``trainer/trainer.py``
        ``_run`` runs before ``on_fit_start``, Lightning 2.6): arm FSDP1's agreement protocol on every FSDP1 unit
        of the wrapper (:func:`memguard.guard._fsdp1.fsdp1_rank_group`: an agreement of the ranks before each
        FSDP1 all-gather and reduce-scatter) and stand in for the strategy's ``training_step``
        (:meth:`_patch_strategy_step`), so that each micro-batch runs through the FSDP1 root's forward."""
        from memguard.guard._fsdp1 import fsdp1_rank_group

        rg = fsdp1_rank_group(trainer.strategy.model)  # every rank: it may create a gloo group
        self._arm_group(trainer, sharding, rg, "fsdp1", lambda: self._patch_strategy_step(trainer, pl_module))

    def _arm_deepspeed(self, trainer: Any, pl_module: Any, sharding: _Sharding) -> None:
        """Under ``DeepSpeedStrategy``, once the strategy built the engine (``DeepSpeedStrategy.setup`` ->
        ``init_deepspeed`` -> ``deepspeed.initialize``, which ``trainer/trainer.py`` ``_run`` runs before
        ``on_fit_start``, Lightning 2.6): arm memguard's DeepSpeed agreement protocol on the engine
        (:func:`memguard.integrations._deepspeed_guard.engine_rank_group`: an agreement of the ranks before every
        ``deepspeed.comm`` collective) and stand in for the strategy's ``training_step``, the precision
        plugin's ``backward`` and ``optimizer_step`` (see :meth:`_patch_deepspeed`). An engine the protocol
        cannot reset (ZeRO offload, DeepSpeed's FP16/BF16 optimizer wrappers, ...) is left alone, and the
        reason logged."""
        from memguard.integrations._deepspeed_guard import engine_problems, engine_rank_group

        guard = self._guard
        assert guard is not None  # planned in setup()
        engine = trainer.strategy.model
        problems = engine_problems(engine)
        if problems:
            if trainer.is_global_zero:
                logger.info("memguard does not recover from out-of-memory errors under %s: %s", sharding.name,
                            _UNGUARDED_WHY["deepspeed"].format(problems="; ".join(problems)))
            return
        rg = engine_rank_group(engine)  # every rank: it may create a gloo group
        guard.rank_group = rg
        guard.on_undo(rg.uninstall)
        self._patch_deepspeed(trainer, pl_module, engine, rg)
        if trainer.is_global_zero:
            logger.info("memguard recovers from out-of-memory errors under %s (ZeRO stage %d): an agreement of the %d "
                        "ranks runs before each DeepSpeed collective, so all ranks reset the engine, halve the "
                        "micro-batch and redo the same samples together", sharding.name,
                        engine.zero_optimization_stage(), rg.world_size)

    def _plan_and_apply(self, trainer: Any, pl_module: Any, pkg: ModuleType) -> None:
        """Plan (rank 0 plans and broadcasts) or check the given plan, then apply it to the Trainer and module."""
        parsing = pkg.utilities.parsing
        sharding = self._sharding if self._sharding is not None else _Sharding(world_size=trainer.world_size)
        guarded = sharding.guarded
        world = sharding.world_size if sharding.world_size is not None else trainer.world_size
        self._checked_first_batch = False
        user_batch = parsing.lightning_getattr(pl_module, self.batch_arg_name)
        user_accum = trainer.accumulate_grad_batches
        rank_group = rank_group_of(trainer.strategy.model) if guarded else _world_rank_group(trainer.strategy)
        options = GuardOptions(loss_fn=_step_loss, max_retries=self.max_retries, sync_gradients=False,
                               global_batch_size=self.global_batch_size, plan_options=self.plan_options)
        guard = Guard(pl_module, _constraints(trainer, sharding), options, world_size=world, rank_group=rank_group,
                      grad_scaler=getattr(trainer.precision_plugin, "scaler", None))
        self._guard = guard
        plan = self._given_plan
        if plan is None:
            if guarded:
                trainer.fit_loop.setup_data()  # every rank: it holds a barrier
                loaders = trainer.train_dataloader
            else:  # before the strategy's setup: the module's (or datamodule's) own train_dataloader()
                loaders = trainer.fit_loop._data_source.dataloader()
            plan = guard.agree_on_plan(lambda: self._make_plan(trainer, pl_module, pkg, loaders, user_batch,
                                                               user_accum))
            problems = _strategy_problems(plan, sharding)
            if problems:
                raise ConfigError(problems)
        else:
            problems = plan_problems(plan, guard.constraints)
            if problems:
                raise ConfigError(problems)
        self.plan = plan

        # Apply the plan: checkpointing by the guard (guard.undo), the rest through the Trainer, whose values
        # before are dumped first and put back by _restore.
        self._saved.batch, self._saved.accumulate = user_batch, user_accum
        guard.apply(plan, trainer.optimizers[0] if trainer.optimizers else None)
        if plan.micro_batch_size != user_batch:
            parsing.lightning_setattr(pl_module, self.batch_arg_name, plan.micro_batch_size)
            # Lightning's BatchSizeFinder forces the rebuild the same way (tuner/batch_size_scaling.py,
            # _reset_dataloaders): the fit loop calls setup_data() again and builds a new DataLoader.
            trainer.fit_loop._combined_loader = None
        trainer.accumulate_grad_batches = plan.grad_accum_steps
        if sharding.strategy == "deepspeed":
            self._saved.deepspeed = _apply_to_deepspeed_config(trainer.strategy, plan)
        if guarded:
            self._patch_module(trainer, pl_module)
        if trainer.is_global_zero:
            changed = [f"{self.batch_arg_name} {user_batch} -> {plan.micro_batch_size}"] if (
                plan.micro_batch_size != user_batch) else []
            if plan.grad_accum_steps != user_accum:
                changed.append(f"accumulate_grad_batches {user_accum} -> {plan.grad_accum_steps}")
            guard.announce(plan, made=self._given_plan is None, overrides=changed)
            logger.debug("the plan memguard applies to the Trainer:\n%s", plan.explain())
            if sharding.unguarded_why:
                logger.info("memguard does not recover from out-of-memory errors under %s: %s", sharding.name,
                            _UNGUARDED_WHY[sharding.unguarded_why])

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        """The window's batches have all run: let them go (Lightning steps the optimizer itself).

        Under ``DeepSpeedStrategy`` Lightning calls this hook after every batch (the strategy
        ``handles_gradient_accumulation``); the callback's ``optimizer_step`` stand-in ends the window there."""
        if self._guard is not None and not self._deepspeed_armed:
            self._guard.end_window()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Undo every change the callback made."""
        for name in tuple(self._eval_saved):
            self._end_eval(trainer, pl_module, name)
        if stage == "fit":
            self._restore(trainer, pl_module)
        self._restore_attributes(pl_module)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        """Run ``validation_step`` on micro-batches when a validation batch does not fit."""
        self._patch_eval_step(trainer, pl_module, "validation_step")

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        """Give the module (or the strategy) its own ``validation_step`` back."""
        self._end_eval(trainer, pl_module, "validation_step")

    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        """Run ``test_step`` on micro-batches when a test batch does not fit."""
        self._patch_eval_step(trainer, pl_module, "test_step")

    def on_test_end(self, trainer: Any, pl_module: Any) -> None:
        """Give the module (or the strategy) its own ``test_step`` back."""
        self._end_eval(trainer, pl_module, "test_step")

    def _end_eval(self, trainer: Any, pl_module: Any, name: str) -> None:
        """Undo what :meth:`_patch_eval_step` did for ``name``."""
        self._restore_attributes(pl_module, name)
        if name in self._eval_saved:
            previous = self._eval_saved.pop(name)
            if previous is None:
                trainer.strategy.__dict__.pop(name, None)
            else:
                trainer.strategy.__dict__[name] = previous
        if self._eval_group is not None and not self._eval_saved:
            self._eval_group.uninstall()
            self._eval_group = None

    def _eval_ranks(self, trainer: Any, pl_module: Any, sharding: _Sharding) -> tuple[Any, str]:
        """The rank group whose ranks split an evaluation batch together, and why there is none.

        Returns ``(group, "")`` under the strategies whose evaluation forward gathers sharded parameters from
        every rank, ``(None, "")`` where each rank may split alone (single device, DDP, DeepSpeed ZeRO-1/2:
        the forward runs no collective), and ``(None, why)`` where memguard cannot split there. During ``fit``
        the group is training's (installed on every sharded module); in ``validate``/``test`` one is made for
        the evaluation and uninstalled at its end (:meth:`_end_eval`)."""
        from memguard.guard._sharded import ShardedRankGroup

        training = getattr(self._guard, "rank_group", None)  # a plain RankGroup where training is not guarded
        if not (isinstance(training, ShardedRankGroup) and getattr(training, "_installed", False)):
            training = None
        if sharding.arms_fsdp2:
            if training is not None:
                return training, ""
            from memguard.guard._fsdp2_frameworks import framework_rank_group

            rg = framework_rank_group(pl_module)  # every rank: it may create a gloo group
            self._eval_group = rg
            return rg, ""  # None: nothing is fully_shard-ed, so the forward gathers nothing
        if sharding.arms_fsdp1 or sharding.arms_deepspeed:
            # FSDP1 all-gathers in each unit's pre-forward; a ZeRO-3 engine in each module's (ZeRO-0/1/2 forwards
            # start no collective: eval_rank_group gives None, and each rank splits alone as under DDP)
            if training is not None and (sharding.arms_fsdp1 or 3 in sharding.zero_stages):
                return training, ""
            from memguard.guard._evaluate_sharded import eval_rank_group

            try:
                rg = eval_rank_group(trainer.strategy.model)  # every rank: it may create a gloo group
            except ConfigError as exc:  # e.g. an engine whose evaluation reset memguard has not verified
                return None, f"where {exc}"
            if rg is not None and not getattr(rg, "_installed", True):  # kept with the engine, uninstalled by fit
                rg.install()
                self._eval_group = rg
            return rg, ""
        return None, ""

    def _patch_eval_step(self, trainer: Any, pl_module: Any, name: str) -> None:
        """Stand in for ``validation_step``/``test_step``: the user's step per micro-batch, halving on an
        OOM, results merged (:func:`memguard.guard._evaluate.step_in_micro_batches`). The evaluation's
        micro-batch is its own state: an OOM here never changes the training micro-batch.

        Under the strategies whose forward gathers sharded parameters (:meth:`_eval_ranks`) every rank
        splits together (:func:`memguard.guard._evaluate_sharded.split_eval_sharded`: the same micro-batch
        offsets on every rank, padding forwards where a rank's batch is shorter, an agreement before each
        collective and after each forward, the sharded state reset on every rank after an OOM), and the
        callback stands in for the *strategy's* step, so that each micro-batch runs Lightning's own
        ``Strategy.validation_step``/``test_step`` (``strategies/strategy.py``, Lightning 2.6: through the
        FSDP1 wrapper's or the DeepSpeed engine's forward where there is one), never several inside one
        root forward."""
        from memguard.guard._evaluate import eval_status, step_in_micro_batches

        sharding = _sharding_of(trainer.strategy, _package_of(trainer), [])
        ranks, why = self._eval_ranks(trainer, pl_module, sharding)
        if why:
            # An evaluation forward gathers the sharded parameters from every rank: a rank that split its batch
            # alone would run more gathers than its peers and leave them waiting.
            if trainer.is_global_zero:
                logger.warning("memguard: %s is not guarded against out-of-memory errors under %s, %s; evaluate "
                               "with a batch that fits", name, sharding.name, why)
            return
        on_strategy = ranks is not None
        own_step = getattr(trainer.strategy if on_strategy else pl_module, name)

        def before_micro(micro: Any) -> None:
            # Lightning weights an epoch-level logged mean by the size of the batch it holds for the
            # step (trainer/connectors/logger_connector/result.py, _ResultCollection._extract_batch_size),
            # so it must hold the micro-batch while the user's step logs.
            results = trainer._results
            if results is not None:
                results.batch = micro
                results.batch_size = None

        def step(batch: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return step_in_micro_batches(own_step, batch, args, kwargs, state=eval_status(pl_module),
                                             before_micro=before_micro, ranks=ranks,
                                             loss_only_hint=f"return only the loss, or metrics reduced per "
                                                            f"micro-batch, from {name} (nothing per-sample is kept)")
            finally:
                results = trainer._results
                if results is not None:
                    results.batch = batch
                    results.batch_size = None

        if on_strategy:
            self._eval_saved.setdefault(name, trainer.strategy.__dict__.get(name))
            trainer.strategy.__dict__[name] = step
        else:
            self._stand_in(pl_module, name, step)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """Undo every change the callback made (Lightning calls no ``teardown`` after an exception)."""
        try:
            for name in tuple(self._eval_saved):
                self._end_eval(trainer, pl_module, name)
        finally:
            self._restore(trainer, pl_module)
            self._restore_attributes(pl_module)

    def _stand_in(self, pl_module: Any, name: str, value: Any) -> None:
        """Make ``value`` the module's own ``name``; its own value before is dumped (once) for
        :meth:`_restore_attributes`."""
        self._saved.attributes.setdefault(name, pl_module.__dict__.get(name))
        pl_module.__dict__[name] = value

    def _restore_attributes(self, pl_module: Any, *names: str) -> None:
        """Give the module back its own ``names`` (default: every one the callback stands in for)."""
        saved = self._saved.attributes
        for name in names or tuple(saved):
            if name not in saved:
                continue
            previous = saved.pop(name)
            if previous is None:
                pl_module.__dict__.pop(name, None)
            else:
                pl_module.__dict__[name] = previous

    def _restore(self, trainer: Any, pl_module: Any) -> None:
        """Put back what ``fit`` changed, newest first, from the values dumped before; the guard's own changes
        (checkpointing) are undone whatever happens."""
        saved = self._saved
        try:
            self._restore_attributes(pl_module, "training_step", "optimizer_zero_grad")
            while saved.objects:
                obj, name, previous = saved.objects.pop()
                if previous is None:
                    obj.__dict__.pop(name, None)
                else:
                    obj.__dict__[name] = previous
            self._deepspeed_armed = False
            if saved.deepspeed:
                trainer.strategy.config.update(saved.deepspeed)
            if saved.accumulate is not None:
                trainer.accumulate_grad_batches = saved.accumulate
                parsing = _package_of(trainer).utilities.parsing
                if parsing.lightning_getattr(pl_module, self.batch_arg_name) != saved.batch:
                    parsing.lightning_setattr(pl_module, self.batch_arg_name, saved.batch)
        finally:
            saved.batch, saved.accumulate, saved.deepspeed = None, None, {}
            if self._guard is not None:
                self._guard.undo()

    # ----------------------------------------------------------------------------------------------
    # internals

    def _make_plan(self, trainer: Any, pl_module: Any, pkg: ModuleType, loaders: Any, user_batch: Any,
                   user_accum: int) -> Plan:
        """Plan from one example batch of the train dataloader (rank 0 only under DDP)."""
        assert self._guard is not None
        batch = self._example_batch(trainer, pl_module, pkg, loaders)
        n = batch_size(batch)
        if n != user_batch:
            raise ConfigError(f"the train dataloader yields batches of {n} samples but {self.batch_arg_name} is "
                              f"{user_batch!r}; memguard sets the micro-batch through {self.batch_arg_name}, so build "
                              f"the train DataLoader with batch_size=self.{self.batch_arg_name}")

        # The planner traces a copy of the module (Lightning drops the Trainer reference from copies),
        # so self.log has nowhere to go: silence it while planning.
        had = {name: name in pl_module.__dict__ for name in ("log", "log_dict")}
        pl_module.log = _no_log
        pl_module.log_dict = _no_log
        try:
            return self._guard.make_plan(batch, trainer.optimizers[0] if trainer.optimizers else None, _step_loss,
                                         accumulation=user_accum, device=trainer.strategy.root_device.type)
        finally:
            for name, was in had.items():
                if not was:
                    del pl_module.__dict__[name]

    @staticmethod
    def _example_batch(trainer: Any, pl_module: Any, pkg: ModuleType, loaders: Any) -> Any:
        """One batch as ``training_step`` would see it: first of the train dataloader, converted and transferred."""
        if loaders is None:
            raise ConfigError("the Trainer has no train dataloader to take an example batch from; define "
                              "train_dataloader() in the LightningModule or its datamodule")
        combined = isinstance(loaders, (Mapping, list, tuple))
        iterable = pkg.utilities.CombinedLoader(loaders, "max_size_cycle") if combined else loaders
        with pkg.utilities.seed.isolate_rng():  # a shuffling sampler draws its seed from the global RNG
            batch = next(iter(iterable))
        if combined:
            batch = batch[0]  # CombinedLoader yields (batch, batch_idx, dataloader_idx)
        # The same steps as the training loop (loops/training_epoch_loop.py, advance()).
        batch = trainer.precision_plugin.convert_input(batch)
        batch = pl_module._on_before_batch_transfer(batch, dataloader_idx=0)
        return trainer.strategy.batch_to_device(batch, dataloader_idx=0)

    def _check_first_batch(self, batch: Any) -> None:
        """The first training batch must follow the batch-size attribute memguard set."""
        assert self.plan is not None
        if self._checked_first_batch:
            return
        n = batch_size(batch)
        if n > self.plan.micro_batch_size:
            raise ConfigError(f"the train dataloader still yields batches of {n} samples after memguard set "
                              f"{self.batch_arg_name}={self.plan.micro_batch_size}; build the train DataLoader "
                              f"with batch_size=self.{self.batch_arg_name}")
        self._checked_first_batch = True

    def _stand_in_on(self, obj: Any, name: str, value: Any) -> None:
        """Make ``value`` the instance attribute ``name`` of ``obj`` (a strategy or precision plugin); its own
        instance attribute before (if any) is dumped for :meth:`_restore`."""
        self._saved.objects.append((obj, name, obj.__dict__.get(name)))
        obj.__dict__[name] = value

    def _patch_deepspeed(self, trainer: Any, pl_module: Any, engine: Any, rg: Any) -> None:
        """Under ``DeepSpeedStrategy``: run each training step's micro-batches, their backward passes and the
        engine's step through memguard's DeepSpeed protocol.

        Lightning 2.6's automatic optimization under DeepSpeed (``loops/optimization/automatic.py``,
        ``_AutomaticOptimization.run``: the strategy ``handles_gradient_accumulation``, so every batch takes
        the optimizer-step path) calls, per batch, ``LightningOptimizer.step`` -> ``Strategy.optimizer_step``
        -> ``DeepSpeedPrecision.optimizer_step`` (``plugins/precision/deepspeed.py``), which runs the closure
        (``Strategy.training_step``, which calls the module's ``training_step`` through the engine's forward,
        ``strategies/strategy.py``; then ``Strategy.backward`` -> ``DeepSpeedPrecision.backward`` ->
        ``deepspeed_engine.backward(loss)``) and then ``deepspeed_engine.step()``. The callback stands in for
        three of these, as instance attributes:

        * ``strategy.training_step``: the batch is split into micro-batches of the current size; each runs
          Lightning's own ``Strategy.training_step`` (the engine's forward, with the ZeRO-3 hooks) and
          ``engine.backward(loss * share / accumulate_grad_batches, scale_wrt_gas=False)``, inside one
          agreed attempt (:class:`memguard.guard._window.MicroBatchWindow` over the engine's
          :class:`memguard.integrations._deepspeed_guard.DeepSpeedRankGroup`); the window's last micro-batch is the
          engine's accumulation boundary. On an OOM on any rank every rank resets the engine
          (:func:`memguard.integrations._deepspeed_guard.reset_engine`), halves the micro-batch and redoes every batch of
          the optimizer step so far. It returns the batch's mean loss, without a graph.
        * ``precision_plugin.backward``: Lightning's backward of that loss runs its hooks
          (``on_before_backward``, ``on_after_backward``) but no ``engine.backward`` (already done).
        * ``precision_plugin.optimizer_step``: runs the closure and ``_after_closure`` as Lightning does, then
          :func:`memguard.integrations._deepspeed_guard.agreed_engine_step` once per window (after its last batch)
          instead of ``engine.step()`` after every batch.

        The accumulated gradient is that of the window's mean loss, as under DDP (see "Accumulation under
        DeepSpeed" in the module docstring: Lightning's own DeepSpeed path gives ``1/accumulate_grad_batches``
        of it).

        Lightning's ``optimizer_zero_grad`` (which runs after a window's first ``training_step``) is skipped:
        the engine's step drops the gradients, and the window drops any left when it opens.
        """
        from memguard.integrations._deepspeed_guard import agreed_engine_step, engine_backward

        strategy = trainer.strategy
        precision = strategy.precision_plugin
        lightning_step = strategy.training_step  # Lightning's: the module's training_step through the engine
        lightning_backward = precision.backward
        callback = self
        guard = self._guard
        assert guard is not None
        backward = engine_backward(engine)

        def training_step(*args: Any, **kwargs: Any) -> Any:
            batch, batch_idx, rest = args[0], args[1], args[2:]
            assert callback.plan is not None
            accumulate = trainer.accumulate_grad_batches
            callback._check_first_batch(batch)
            if batch_idx % accumulate == 0 or guard.window is None or not guard.window.is_open:
                rg.start_window()  # the engine's counters, which a reset restores
                guard.open_window(engine.module, ())
            # The window ends on Lightning's accumulation boundary (training_epoch_loop.py, _should_accumulate:
            # batch_progress.current.ready % accumulate_grad_batches) or on the epoch's last batch.
            last = (batch_idx + 1) % accumulate == 0 or trainer.fit_loop.epoch_loop._num_ready_batches_reached()
            extras: dict[str, Any] = {}

            def loss_of(micro: Any) -> torch.Tensor:
                loss, extra = _loss_of_output(lightning_step(micro, batch_idx, *rest, **kwargs))
                extras.clear()
                extras.update(extra)
                return loss

            loss = guard.run(batch, loss_of, backward, weight=1.0 / accumulate, last=last)
            callback._window_ends, callback._backward_done = last, True
            out = guard.anchor(loss)  # no graph: the backward passes ran already
            return {"loss": out, **extras} if extras else out

        training_step._memguard_stand_in = True  # type: ignore[attr-defined]

        def precision_backward(tensor: Any, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
            if callback._backward_done:
                callback._backward_done = False
                return None
            return lightning_backward(tensor, model, optimizer, *args, **kwargs)

        def optimizer_step(optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
            # DeepSpeedPrecision.optimizer_step's order: the closure, then _after_closure (the
            # on_before_optimizer_step hooks), then the engine's step; here once per window, agreed.
            callback._window_ends = False
            closure()
            precision._after_closure(model, optimizer)
            if callback._window_ends:
                callback._window_ends = False
                agreed_engine_step(rg, micro_batch_size=guard.micro_batch_size or 0)
                guard.end_window()
            return None

        def optimizer_zero_grad(*args: Any, **kwargs: Any) -> None:
            return None  # the engine's step dropped the gradients; the window drops any left when it opens

        self._stand_in_on(strategy, "training_step", training_step)
        self._stand_in_on(precision, "backward", precision_backward)
        self._stand_in_on(precision, "optimizer_step", optimizer_step)
        self._stand_in(pl_module, "optimizer_zero_grad", optimizer_zero_grad)
        self._deepspeed_armed = True

    def _patch_strategy_step(self, trainer: Any, pl_module: Any) -> None:
        """Under ``FSDPStrategy``: stand in for the strategy's ``training_step`` (an instance attribute) and skip
        Lightning's ``optimizer_zero_grad``.

        Lightning 2.6's ``Strategy.training_step`` (``strategies/strategy.py``) calls the module's
        ``training_step`` through the FSDP1 wrapper's forward (``_ForwardRedirection``: the module's ``forward``
        is patched to run ``training_step``, then the wrapper is called), so the FSDP1 root's pre-forward
        all-gathers its parameters and its post-forward registers the pre-backward hooks on the outputs. The
        callback splits the batch *outside* that forward: each micro-batch runs Lightning's own
        ``Strategy.training_step`` (the root's forward, the user's ``training_step`` inside it) and its backward
        right after (``loss x share / accumulate_grad_batches``, through the Trainer's GradScaler), inside one
        agreed attempt of :class:`memguard.guard._fsdp1.FSDP1RankGroup`, as memguard's Accelerate adapter
        runs FSDP1 (:func:`memguard.integrations.accelerate.prepare`). The returned loss's backward touches no
        parameter (:meth:`memguard.guard._window.MicroBatchWindow.anchor` under a sharded group), so
        Lightning's own backward of it runs its hooks and adds nothing. FSDP1 reduce-scatters each
        micro-batch's gradients in its post-backward hooks (Lightning's ``block_backward_sync`` skips FSDP:
        ``strategies/parallel.py`` uses ``no_sync`` only for ``DistributedDataParallel``)."""
        strategy = trainer.strategy
        lightning_step = strategy.training_step  # Lightning's: the module's training_step through the root's forward
        callback = self
        guard = self._guard
        assert guard is not None

        def training_step(*args: Any, **kwargs: Any) -> Any:
            batch, batch_idx, rest = args[0], args[1], args[2:]
            assert callback.plan is not None
            accumulate = trainer.accumulate_grad_batches
            callback._check_first_batch(batch)
            # the window opens where Lightning zeroes the gradients (loops/optimization/automatic.py,
            # _make_zero_grad_fn: batch_idx % accumulate_grad_batches == 0)
            if batch_idx % accumulate == 0 or guard.window is None or not guard.window.is_open:
                guard.open_window(strategy.model, trainer.optimizers)
            extras: dict[str, Any] = {}

            def loss_of(micro: Any) -> torch.Tensor:
                loss, extra = _loss_of_output(lightning_step(micro, batch_idx, *rest, **kwargs))
                extras.clear()
                extras.update(extra)
                return loss

            loss = guard.run(batch, loss_of, weight=1.0 / accumulate)
            out = guard.anchor(loss)
            return {"loss": out, **extras} if extras else out

        training_step._memguard_stand_in = True  # type: ignore[attr-defined]

        def optimizer_zero_grad(*args: Any, **kwargs: Any) -> None:
            return None  # the window dropped the gradients before the window's first training_step

        self._stand_in_on(strategy, "training_step", training_step)
        self._stand_in(pl_module, "optimizer_zero_grad", optimizer_zero_grad)

    def _patch_module(self, trainer: Any, pl_module: Any) -> None:
        """Stand in for ``training_step`` and skip Lightning's ``optimizer_zero_grad`` (instance attributes)."""
        user_step = pl_module.training_step
        callback = self

        def training_step(batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> Any:
            return callback._training_step(trainer, pl_module, user_step, batch, batch_idx, args, kwargs)

        training_step._memguard_stand_in = True  # type: ignore[attr-defined]  # _step_loss skips it

        def optimizer_zero_grad(*args: Any, **kwargs: Any) -> None:
            return None  # the window dropped the gradients before the window's first training_step

        self._stand_in(pl_module, "training_step", training_step)
        self._stand_in(pl_module, "optimizer_zero_grad", optimizer_zero_grad)

    def _training_step(self, trainer: Any, pl_module: Any, user_step: Callable[..., Any], batch: Any, batch_idx: int,
                       args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        guard = self._guard
        assert guard is not None and self.plan is not None  # set in on_fit_start, before any training_step
        accumulate = trainer.accumulate_grad_batches
        self._check_first_batch(batch)
        # Lightning zeroes the gradients at the first batch of each accumulation window
        # (loops/optimization/automatic.py, _make_zero_grad_fn: batch_idx % accumulate_grad_batches == 0).
        if batch_idx % accumulate == 0 or guard.window is None or not guard.window.is_open:
            guard.open_window(trainer.strategy.model, trainer.optimizers)
        extras: dict[str, Any] = {}

        def loss_of(micro: Any) -> torch.Tensor:
            loss, extra = _loss_of_output(user_step(micro, batch_idx, *args, **kwargs))
            extras.clear()
            extras.update(extra)
            return loss

        # the backward runs outside autocast, through the Trainer's GradScaler (the guard's backward)
        loss = guard.run(batch, loss_of, weight=1.0 / accumulate)
        out = guard.anchor(loss)
        return {"loss": out, **extras} if extras else out
