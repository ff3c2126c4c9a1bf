"""Hugging Face transformers: plan and guard a ``Trainer``, or apply a plan to ``TrainingArguments``.

Two entry points:

* :class:`MemguardCallback`, a ``transformers.TrainerCallback``: plans before training under what
  the ``TrainingArguments`` fix (precision, DeepSpeed config, world size), applies the plan to the
  Trainer (per-device batch, gradient accumulation, activation checkpointing) and, during training,
  recovers from out-of-memory errors (one device, DDP, FSDP, DeepSpeed) by halving the micro-batch and
  re-running the optimizer step's samples, on every rank together; an evaluation or prediction batch
  that runs out of memory is halved and redone, with the unsplit batch's loss and outputs::

      trainer = Trainer(model=model, args=args, train_dataset=ds,
                        callbacks=[MemguardCallback(budget_bytes=20 << 30, gpu="A100-40GB")])
      trainer.train()

* ``apply(training_args, plan)`` returns new ``TrainingArguments`` whose per-device batch,
  gradient accumulation, bf16/fp16 flags, gradient checkpointing and DeepSpeed config come from
  the plan, for a plan made by hand with :func:`memguard.plan`; the Trainer then runs the plan
  unguarded.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import json
import logging
import os
from typing import Any, Callable, Mapping

import torch

from memguard.batch import batch_size
from memguard.errors import ConfigError
from memguard.guard._core import Guard, GuardStatus
from memguard.guard._options import Constraints, GuardOptions, given_options, option_problems
from memguard.guard._window import DEFAULT_MAX_RETRIES
from memguard.guard._distributed import rank_group_of
from memguard.guard._sharded import ShardedRankGroup
from memguard.guard._evaluate import eval_status, split_eval
from memguard.integrations import require
from memguard.integrations.deepspeed import AUTO, fill_auto, to_config
from memguard.planner.api import Plan

__all__ = ["apply", "MemguardCallback"]

logger = logging.getLogger("memguard")

# Imported when this module is: the callback subclasses TrainerCallback. TrainingArguments and the Trainer
# need accelerate (transformers' Trainer refuses to run without it), which the transformers extra installs.
_tf = require("transformers", "transformers", "transformers")
require("accelerate", "accelerate", "transformers")


def _load_user_deepspeed(value: Any) -> dict[str, Any]:
    """The DeepSpeed config already in the arguments: a dict, or a path to a JSON file."""
    if isinstance(value, dict):
        return value
    if isinstance(value, (str, os.PathLike)) and os.path.isfile(value):
        with open(value, encoding="utf-8") as fh:
            return json.load(fh)
    raise ConfigError(
        f"training_args.deepspeed is {value!r}, neither a dict nor an existing JSON file; pass the DeepSpeed "
        "config as a dict or a path, or leave it unset and memguard writes one"
    )


def apply(training_args: Any, plan: Plan) -> Any:
    """New ``TrainingArguments`` that run ``plan``; ``training_args`` is not modified.

    Sets ``per_device_train_batch_size`` (the plan's micro-batch), ``gradient_accumulation_steps``,
    ``bf16`` / ``fp16`` (``"bf16-mixed"`` -> ``bf16``, ``"16-mixed"`` -> ``fp16``; ``"bf16-true"``
    under ZeRO -> ``bf16``, which DeepSpeed needs to agree with its ``bf16`` block),
    ``gradient_checkpointing`` (``activation_checkpointing`` in transformers versions that renamed
    it) and ``deepspeed``:

    * if ``training_args.deepspeed`` already holds a config (dict or JSON path), it is kept and
      its ``"auto"`` values are filled by :func:`memguard.integrations.deepspeed.fill_auto`
      (values contradicting the plan raise; values the plan does not determine, such as the
      optimizer's, stay ``"auto"`` for the Trainer to fill);
    * else, when ``plan.zero_stage > 0``, it is :func:`memguard.integrations.deepspeed.to_config`
      with ``gradient_clipping: "auto"`` (so the Trainer's ``max_grad_norm`` still applies: under
      DeepSpeed the Trainer leaves clipping to DeepSpeed) and, when the plan offloads the
      optimizer, a DeepSpeed ``AdamW`` optimizer section with ``"auto"`` hyper-parameters (the
      Trainer fills them; DeepSpeed refuses a torch optimizer with ZeRO-Offload);
    * else it is left unset.

    The new object is built with ``dataclasses.replace`` (``TrainingArguments`` is a dataclass),
    so transformers validates it again exactly as if it had been built by hand.

    Args:
        training_args: a ``transformers.TrainingArguments`` (or subclass, e.g.
            ``Seq2SeqTrainingArguments``).
        plan: the plan to apply; its ``world_size`` must equal ``training_args.world_size``.

    Returns:
        A new ``TrainingArguments`` of the same class.

    Raises:
        MissingDependencyError: transformers is not installed.
        ConfigError: ``training_args`` is not ``TrainingArguments``; the plan's world size differs
            from the arguments'; the plan has no DeepSpeed equivalent (see
            :mod:`memguard.integrations.deepspeed`); an existing DeepSpeed config contradicts the
            plan; or transformers refuses the new arguments (e.g. ``bf16`` without a bf16-capable
            GPU and without ``use_cpu=True``), with transformers' own message.

    Known limitations:
        ``gradient_checkpointing`` checkpoints every layer of the model, while a plan may
        checkpoint only its first ``checkpoint_blocks`` blocks: the run then uses less memory
        than planned and is somewhat slower. Without ZeRO, ``"bf16-true"`` and ``"16-true"`` have
        no ``TrainingArguments`` flag: the flags stay off and the model must be loaded in that
        dtype (``from_pretrained(..., dtype=torch.bfloat16)``); a warning says so.
        ``auto_find_batch_size=True`` lets the Trainer halve the per-device batch on an OOM
        without raising accumulation, which changes the global batch; a warning says so.
    """
    tf = require("transformers", "transformers", "transformers")
    if not isinstance(training_args, tf.TrainingArguments):
        raise ConfigError(
            f"apply() needs transformers.TrainingArguments, got {type(training_args).__name__}; "
            "build them with transformers.TrainingArguments(...)"
        )
    if not isinstance(plan, Plan):
        raise ConfigError(f"apply() needs a memguard.Plan, got {type(plan).__name__}; build one with memguard.plan()")

    problems: list[str] = []
    args_world = int(training_args.world_size)
    if plan.world_size != args_world:
        problems.append(
            f"the plan is for {plan.world_size} data-parallel rank(s) but these TrainingArguments run on "
            f"{args_world}; launch with {plan.world_size} processes or plan with world_size={args_world}"
        )

    ds_config: dict[str, Any] | None = None
    try:
        if training_args.deepspeed:
            ds_config = fill_auto(_load_user_deepspeed(training_args.deepspeed), plan)
        elif plan.zero_stage > 0:
            extra: dict[str, Any] = {"gradient_clipping": AUTO}
            if plan.offload_optimizer:
                # The HF Trainer fills "auto" optimizer values from TrainingArguments
                # (HfTrainerDeepSpeedConfig.trainer_config_process in transformers/integrations/deepspeed.py).
                extra["optimizer"] = {
                    "type": "AdamW",
                    "params": {"lr": AUTO, "betas": AUTO, "eps": AUTO, "weight_decay": AUTO},
                }
            ds_config = to_config(plan, **extra)
    except ConfigError as exc:
        problems += exc.problems
    if problems:
        raise ConfigError(problems)

    under_zero = ds_config is not None and plan.zero_stage > 0
    bf16 = plan.precision == "bf16-mixed" or (plan.precision == "bf16-true" and under_zero)
    fp16 = plan.precision == "16-mixed"
    if plan.precision in ("bf16-true", "16-true") and not under_zero:
        dtype = "torch.bfloat16" if plan.precision == "bf16-true" else "torch.float16"
        logger.warning(
            "memguard: precision %s has no TrainingArguments flag; bf16/fp16 stay off, so load the model in "
            "%s (from_pretrained(..., dtype=%s)) for the plan to hold",
            plan.precision, dtype, dtype,
        )
    if getattr(training_args, "auto_find_batch_size", False):
        logger.warning(
            "memguard: auto_find_batch_size=True halves the per-device batch on an OOM without raising "
            "gradient accumulation, which changes the global batch of %d the plan keeps",
            plan.global_batch_size,
        )

    changes: dict[str, Any] = {
        "per_device_train_batch_size": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.grad_accum_steps,
        "bf16": bf16,
        "fp16": fp16,
        "gradient_checkpointing": bool(plan.activation_checkpointing),
        "deepspeed": ds_config,
    }
    if "activation_checkpointing" in {f.name for f in dataclasses.fields(training_args)}:
        # newer transformers renamed the flag; the old name is only read when the new one is unset
        changes["activation_checkpointing"] = changes["gradient_checkpointing"]
    try:
        new_args = dataclasses.replace(training_args, **changes)
    except ValueError as exc:
        shown = ", ".join(f"{k}={v!r}" for k, v in changes.items() if k not in ("deepspeed", "activation_checkpointing"))
        raise ConfigError(f"transformers refused the arguments memguard derived from the plan ({shown}): {exc}") from exc
    logger.info(
        "memguard: TrainingArguments set from the plan: per-device batch %d x accumulation %d x world %d, "
        "bf16=%s fp16=%s gradient_checkpointing=%s deepspeed=%s",
        plan.micro_batch_size, plan.grad_accum_steps, plan.world_size, bf16, fp16,
        bool(plan.activation_checkpointing), f"ZeRO-{plan.zero_stage}" if ds_config is not None else "off",
    )
    return new_args


# --------------------------------------------------------------------------------------------------
# the Trainer callback

# Plan options the callback takes from the Trainer and its arguments instead of from the user.
_FROM_TRAINER = ("world_size", "device", "optimizer", "loss_fn", "batch", "zero_stage", "offload_optimizer")

_FIX_PRECISION = "set TrainingArguments(bf16=True) or (fp16=True), or load the model in that dtype"


def _precision_of(args: Any, model: Any) -> str:
    """The precision the Trainer runs: its ``bf16``/``fp16`` flags (Accelerate's autocast), else the weights' dtype."""
    if args.bf16:
        return "bf16-mixed"
    if args.fp16:
        return "16-mixed"
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()} if model is not None else set()
    if dtypes == {torch.bfloat16}:
        return "bf16-true"
    if dtypes == {torch.float16}:
        return "16-true"
    return "32-true"


def _deepspeed_of(args: Any) -> dict[str, Any] | None:
    """The DeepSpeed config of ``args`` (a dict), or None without DeepSpeed."""
    return _load_user_deepspeed(args.deepspeed) if args.deepspeed else None


def _zero_of(ds: Mapping[str, Any]) -> tuple[int | None, bool]:
    """ZeRO stage (None if it is not a number) and whether the optimizer is offloaded, from a DeepSpeed config
    (DeepSpeed's defaults: stage 0, no offload: deepspeed/runtime/zero/config.py)."""
    zero = ds.get("zero_optimization") or {}
    offload = (zero.get("offload_optimizer") or {}).get("device", "none")
    stage = zero.get("stage", 0)
    return (stage if stage in (0, 1, 2, 3) and not isinstance(stage, bool) else None), offload in ("cpu", "nvme")


def _is_fsdp2(trainer: Any) -> bool:
    """Whether the Trainer's Accelerator runs FSDP2 (``fsdp_config={"version": 2}``, transformers 5's default;
    ``Accelerator.is_fsdp2`` reads the plugin's ``fsdp_version``)."""
    return bool(getattr(trainer.accelerator, "is_fsdp2", False))


def _fsdp_stage(args: Any) -> int | None:
    """The sharding level of the Trainer's FSDP options (None without FSDP): ``full_shard`` reshards after the
    forward (memguard's stage 3), ``shard_grad_op`` does not (stage 2); transformers' FSDPOption names."""
    if not args.fsdp:
        return None
    if args.fsdp is True:  # transformers 5: options moved to fsdp_plugin_args (training_args.py, _process_fsdp_args)
        raf = (getattr(args, "fsdp_plugin_args", None) or {}).get("reshard_after_forward", True)
        # FSDP2: a bool; FSDP1: the sharding strategy's name
        return 3 if raf is True or str(raf).lower() in ("full_shard", "true", "1") else 2
    options = [str(getattr(o, "value", o)) for o in args.fsdp]
    return 2 if "shard_grad_op" in options and "full_shard" not in options else 3


def _constraints(args: Any = None, model: Any = None) -> Constraints:
    """What the ``TrainingArguments`` fix: the precision (Accelerate runs it), world size, ZeRO stage or FSDP
    sharding. Without ``args``: only what is known before the Trainer exists (for checking the callback's options)."""
    common = dict(source="the Trainer", taken=_FROM_TRAINER, precision_role="framework",
                  fix_plan="plan again with memguard.plan() for these TrainingArguments", fix_precision=_FIX_PRECISION)
    if args is None:
        return Constraints(**common, zero_stages=(0, 1, 2, 3), offload_optimizer=True)
    zero_stages, offload, extra = (0,), False, {}
    ds = _deepspeed_of(args)
    if ds is not None:
        stage, offload = _zero_of(ds)
        zero_stages = (stage,) if stage is not None else (0, 1, 2, 3)  # not a stage: refused by _trainer_problems
    fsdp = _fsdp_stage(args)
    if fsdp is not None:
        zero_stages = (fsdp,)
        if "strategies" in {f.name for f in dataclasses.fields(Constraints)}:  # else refused by _trainer_problems
            # transformers 5.24 runs FSDP2 unless fsdp_config's version is 1 (training_args.py, _process_fsdp_args:
            # ``int(self.fsdp_config.get("version", 2))``); FSDP1 is estimated as itself (memguard.estimator._fsdp1)
            version = int((getattr(args, "fsdp_config", None) or {}).get("version", 2))
            extra["strategies"] = ("fsdp1",) if version == 1 else ("fsdp2",)
    return Constraints(**common, **extra, zero_stages=zero_stages, offload_optimizer=offload,
                       precisions=(_precision_of(args, model),), world_size=int(args.world_size))


def _find_trainer(callback: Any) -> Any:
    """The ``Trainer`` whose callback handler is calling ``callback`` now (the ``self`` of a frame up the stack).

    Callbacks receive the model, optimizer and dataloaders but not the Trainer
    (``CallbackHandler.call_event`` in transformers/trainer_callback.py); the callback needs it to change the
    per-device batch before the train dataloader is built and to guard ``training_step``.
    """
    frame = inspect.currentframe()
    try:
        while frame is not None:
            owner = frame.f_locals.get("self")
            handler = getattr(owner, "callback_handler", None) if isinstance(owner, _tf.Trainer) else None
            if handler is not None and any(cb is callback for cb in handler.callbacks):
                return owner
            frame = frame.f_back
    finally:
        del frame
    return None


def _example_batch(trainer: Any, n: int) -> Any:
    """The first ``n`` training samples collated as the Trainer's train dataloader collates them.

    The dataset is read in order without a sampler (no random state is drawn); unused columns are removed the
    way ``Trainer.get_train_dataloader`` removes them.
    """
    dataset = trainer.train_dataset
    if dataset is None:
        raise ConfigError("the Trainer has no train_dataset to take an example batch from; pass train_dataset= to the "
                          "Trainer, or pass plan= to MemguardCallback")
    collator = trainer.data_collator
    try:
        import datasets  # noqa: F401 - only to recognise an HF dataset

        is_hf = isinstance(dataset, datasets.Dataset)
    except ImportError:
        is_hf = False
    if is_hf:
        dataset = trainer._remove_unused_columns(dataset, description="training")
    else:
        collator = trainer._get_collator_with_removed_columns(collator, description="training")
    if isinstance(dataset, torch.utils.data.IterableDataset):
        samples = []
        for sample in dataset:
            samples.append(sample)
            if len(samples) == n:
                break
    else:
        samples = [dataset[i] for i in range(min(n, len(dataset)))]
    if not samples:
        raise ConfigError("the train_dataset is empty; memguard needs one batch of samples to plan")
    return collator(samples)


def _no_backward(weighted: torch.Tensor) -> None:
    """The Trainer's own ``training_step`` already ran the backward (through ``accelerator.backward``)."""
    return None


class MemguardCallback(_tf.TrainerCallback):
    """Plan the per-device batch, accumulation and checkpointing of a ``Trainer``; halve on OOM during ``train()``.

    ::

        trainer = Trainer(model=model, args=args, train_dataset=ds,
                          callbacks=[MemguardCallback(budget_bytes=20 << 30, gpu="A100-40GB")])
        trainer.train()

    What happens, in the Trainer's events:

    * ``on_init_end`` (the end of ``Trainer.__init__``): the callback checks the arguments, then plans
      with :func:`memguard.plan` on the Trainer's model and one example batch (the first
      ``per_device_train_batch_size`` samples of ``train_dataset``, collated by the Trainer's collator),
      with the optimizer ``TrainingArguments.optim`` builds. The plan is *constrained* to what the
      arguments fix: the precision (``bf16`` -> ``"bf16-mixed"``, ``fp16`` -> ``"16-mixed"``, else the
      weights' dtype: bf16 weights -> ``"bf16-true"``), the world size, and the ZeRO stage and optimizer
      offload of a DeepSpeed config (or the sharding level of FSDP). The global batch stays
      ``per_device_train_batch_size x gradient_accumulation_steps x world size`` unless
      ``global_batch_size`` is given. Under DDP rank 0 plans and broadcasts. The plan is applied to a
      shallow copy of the arguments (the user's object is untouched): ``per_device_train_batch_size`` and
      ``gradient_accumulation_steps`` from the plan, and activation checkpointing on or off as the plan
      says (``gradient_checkpointing=True`` in the arguments makes the plan checkpoint, unless the
      ``activation_checkpointing`` option says otherwise); under DeepSpeed
      the config's ``"auto"`` batch values are filled again (transformers' ``propagate_args_to_deepspeed``).
      The plan is logged at INFO on the ``memguard`` logger.
    * ``on_train_begin``: on a single device, under DDP, under FSDP (``fsdp_config`` version 2, the
      default of transformers 5, or version 1) and under DeepSpeed, the callback stands in for the Trainer's
      ``training_step`` (an attribute on the Trainer instance, removed at ``on_train_end``). Each
      dataloader batch goes through the guard core (:class:`memguard.guard._core.Guard`, whose OOM engine
      is :class:`memguard.guard._window.MicroBatchWindow`): the batch is split into micro-batches of the
      current size and the Trainer's own ``training_step`` runs on each, so ``compute_loss``, label
      smoothing, ``compute_loss_func``, the fp16 GradScaler and ``accelerator.backward`` all stay the
      Trainer's. When the loss is normalised by ``num_items_in_batch`` (the tokens of the whole optimizer
      step) the micro-batch losses add up to the batch's as they are; otherwise each micro-batch's mean
      loss is weighted by its share of the batch's samples (through the Trainer's
      ``current_gradient_accumulation_steps``, by which ``training_step`` divides it). The returned loss
      is the sum, as the Trainer logs it. On an out-of-memory error on any rank the window's gradients
      are dropped, the micro-batch halved, and every batch of the current optimizer step run again from
      its first sample, on every rank together. Under DDP the micro-batches run under ``no_sync`` and
      the gradients are averaged after the step's last batch by memguard
      (:mod:`memguard.guard._distributed`, SUM then divide by the world size, as DDP does), so no rank
      can wait in a collective that a rank that ran out of memory never joins. Under FSDP (the model is
      sharded by the time ``on_train_begin`` runs) an agreement of the ranks runs before each FSDP
      all-gather and reduce-scatter (:mod:`memguard.guard._sharded`,
      :mod:`memguard.guard._fsdp2_frameworks`, :mod:`memguard.guard._fsdp1`): a rank that runs out of
      memory in compute reports at once, its peers leave forward/backward at their next FSDP
      collective, every rank resets FSDP's per-step state and replays the step's samples at half the
      micro-batch; FSDP reduces the gradients itself, under the Trainer's own ``no_sync`` for the
      accumulation's earlier batches. Under DeepSpeed (``TrainingArguments(deepspeed=...)``, ZeRO-1 to 3;
      ``model_wrapped`` is the engine) the same agreement runs before every DeepSpeed collective
      (:mod:`memguard.integrations._deepspeed_guard`); each micro-batch's ``accelerator.backward`` runs only
      ``engine.backward`` (Accelerate's ``DeepSpeedEngineWrapper.backward`` would set the accumulation
      boundary from ``sync_gradients`` and call ``engine.step()`` after every micro-batch of the last
      batch: ``accelerate/utils/deepspeed.py``), the window's last micro-batch is the engine's accumulation
      boundary, and the callback runs ``engine.step()`` once per optimizer step, agreed by every rank; after
      an OOM every rank resets the engine's step state and replays the step's samples at half the
      micro-batch. The Trainer then clips the gradients (DeepSpeed clips inside ``engine.step()``), steps the
      optimizer and the scheduler (no-ops for DeepSpeed's wrappers) and logs, unchanged.
    * ``on_train_end``: ``training_step`` is restored and the guard's state released.

    * ``evaluate``/``predict`` (and the evaluations during ``train()``): from ``on_init_end`` the callback
      stands in for the Trainer's ``prediction_step`` (an instance attribute; a subclass's own
      ``prediction_step`` is the one run). An evaluation batch that runs out of memory is halved and
      redone from the micro-batch that failed (:func:`memguard.guard._evaluate.split_eval`, its own
      micro-batch per batch shape, remembered for the next batch, logged at WARNING); the loss, logits
      and labels handed back to the Trainer's loop are the unsplit batch's, so its padding, gathering,
      ``eval_accumulation_steps``, ``preprocess_logits_for_metrics`` and ``compute_metrics`` see what
      they would without memguard. The loss: where the Trainer normalises it by the batch's labelled
      items (``num_items_in_batch``) that count is taken once for the whole batch, as the Trainer takes
      it (under DDP with ``average_tokens_across_devices`` it is one collective per batch on every rank,
      whatever the split), and the micro-batches' parts add up; otherwise the micro-batches' means are
      weighted by their labelled tokens. An evaluation OOM never changes the training micro-batch.
      Under FSDP2, FSDP1 and DeepSpeed ZeRO-3 on several ranks every rank's evaluation forwards gather
      parameters from the others, so the ranks split together
      (:mod:`memguard.guard._evaluate_sharded`): they agree on the micro-batch and the number of forwards
      (a rank with fewer samples runs padding forwards, discarded), FSDP's or DeepSpeed's all-gathers run
      behind memguard's agreements, and an OOM on any rank halves the micro-batch on every rank (logged on
      each); after a failed forward every rank puts the gathered parameters back (FSDP1's units resharded,
      ZeRO-3's parameters released). Under DeepSpeed ZeRO-0/1/2 an evaluation forward starts no collective
      and each rank splits alone, as under DDP. With ``predict_with_generate`` (outputs of different
      lengths), ZeRO-3 parameter offload, FSDP1's ``HYBRID_SHARD`` or CPU offload, evaluation is not guarded;
      a warning says so and why.

    Args:
        global_batch_size: samples per optimizer step over all ranks; default: what the arguments give.
        plan: a :class:`memguard.Plan` to apply instead of planning (it must match the arguments'
            precision, world size and ZeRO stage).
        max_retries: at most this many halvings within one optimizer step.
        guard_oom: recover from out-of-memory errors during training and evaluation (False: plan and
            apply only).
        budget_bytes: memory per rank to plan for (default: the GPU's memory less its CUDA context).
        gpu: the GPU to plan for, a catalog name such as ``"A100-80GB"`` (default: the one in use).
        headroom: share of the budget kept free (default 0.1).
        precision: only the arguments' own may be given (memguard does not change it).
        activation_checkpointing: True or False fixes it (default: memguard chooses).
        cache: reuse and store plans in memguard's plan cache (default False).
        cpu: the CPU a CPU job runs on, e.g. ``"avx512_core_amx"`` (default: this one).
        torch_version: the torch version of the GPU machine, e.g. ``"2.5.1"`` (default: this one's).
        cuda_version: its CUDA version, e.g. ``"12.4"``.
        cudnn_version: its cuDNN version, e.g. ``"9.10.2"``.
        **plan_options: any other option of :func:`memguard.plan` (world size, device, optimizer, loss and
            ZeRO stage come from the Trainer). Each named option above may be given here too; None means
            not given.

    Attributes:
        plan: the plan in force (None before the Trainer is built).
        micro_batch_size: the current micro-batch (smaller than the plan's after an OOM).
        oom_retries: halvings of the training micro-batch so far.
        eval_oom_retries: out-of-memory errors recovered from in evaluation and prediction so far.

    Raises:
        ConfigError: bad arguments (every problem listed); from the Trainer's constructor, arguments the
            callback cannot work with (``auto_find_batch_size``, ``model_init``, DataParallel over several
            GPUs in one process, a DeepSpeed config with a fixed micro-batch, a precision or plan that
            disagrees with the arguments), and planning failures on bad input.
        InfeasiblePlanError: from the Trainer's constructor, when nothing fits the budget.

    Known limitations:
        The callback must be passed to the Trainer's constructor (``callbacks=[...]``): the plan changes the
        per-device batch, which the Trainer reads before ``on_train_begin``. Callbacks are not given the
        Trainer, so the callback finds it on the call stack of ``on_init_end``. The Trainer's activation
        checkpointing covers every layer, while a plan may checkpoint only its first ``checkpoint_blocks``
        blocks: the run then uses less memory than planned and is somewhat slower. Under DeepSpeed with ZeRO
        offload, ZenFlow, pipeline parallelism, or fp16/bf16 below ZeRO-2 (engines whose state memguard cannot
        reset after an OOM: :func:`memguard.integrations._deepspeed_guard.engine_problems`) the plan is applied but
        out-of-memory errors in training are not recovered from; a warning gives the reasons. Under DeepSpeed an
        OOM inside ``engine.step()`` or inside a DeepSpeed collective stops every rank with the same
        :class:`memguard.OOMRecoveryError`. Under FSDP an out-of-memory
        error inside FSDP's own collectives stops every rank with the same :class:`memguard.OOMRecoveryError`
        (see :mod:`memguard.guard._sharded`), and FSDP1's ``HYBRID_SHARD`` and ``cpu_offload`` are refused at
        ``on_train_begin``. ``training_step`` runs once per micro-batch (and
        again on a replay), so a subclass's ``training_step`` that logs, logs per micro-batch. Without ``num_items_in_batch`` the split weights
        micro-batches by samples, which equals the Trainer's per-batch mean only when every sample has the same
        number of loss tokens. Gradient communication no longer overlaps the backward under DDP, and DDP
        communication hooks are not used. ``Trainer.add_callback`` after construction is refused at
        ``on_train_begin``. A replayed or split batch draws new dropout masks, so with dropout the run
        matches an out-of-memory-free one in distribution, not bit for bit.
    """

    def __init__(self, global_batch_size: int | None = None, *, plan: Plan | None = None,
                 max_retries: int = DEFAULT_MAX_RETRIES, guard_oom: bool = True, budget_bytes: int | None = None,
                 gpu: str | None = None, headroom: float | None = None, precision: str | list[str] | None = None,
                 activation_checkpointing: bool | None = None, cache: bool | None = None, cpu: str | None = None,
                 torch_version: str | None = None, cuda_version: str | None = None,
                 cudnn_version: str | None = None, **plan_options: Any) -> None:
        plan_options = given_options(
            plan_options, budget_bytes=budget_bytes, gpu=gpu, headroom=headroom, precision=precision,
            activation_checkpointing=activation_checkpointing, cache=cache, cpu=cpu, torch_version=torch_version,
            cuda_version=cuda_version, cudnn_version=cudnn_version)
        problems = option_problems(_constraints(), plan=plan, global_batch_size=global_batch_size,
                                   max_retries=max_retries, plan_options=plan_options)
        if not isinstance(guard_oom, bool):
            problems.append(f"guard_oom must be True or False, got {guard_oom!r}")
        if problems:
            raise ConfigError(problems)
        self.global_batch_size = global_batch_size
        self.max_retries = max_retries
        self.guard_oom = guard_oom
        self.plan_options = dict(plan_options)
        self.plan: Plan | None = plan
        self._given_plan = plan
        self._trainer: Any = None
        self._guard: Guard | None = None
        self._saved: dict[str, Any] | None = None  # the Trainer's own training_step before the stand-in (None: none)
        self._engine: Any = None  # the DeepSpeed engine whose steps the stand-in runs (None without DeepSpeed)
        self._eval_unguarded: str | None = None  # why evaluation is not guarded (logged once), None: it is

    # ----------------------------------------------------------------------------------------------
    # state for users and tests

    @property
    def micro_batch_size(self) -> int | None:
        """The micro-batch in force (None before the Trainer is built)."""
        if self._guard is not None and self._guard.micro_batch_size is not None:
            return self._guard.micro_batch_size
        return self.plan.micro_batch_size if self.plan is not None else None

    @property
    def oom_retries(self) -> int:
        """Halvings of the training micro-batch so far."""
        return self._guard.oom_retries if self._guard is not None else 0

    @property
    def eval_oom_retries(self) -> int:
        """Out-of-memory errors recovered from in ``evaluate``/``predict`` so far (they never change the
        training micro-batch)."""
        return eval_status(self._trainer.model).oom_retries if self._trainer is not None else 0

    def status(self) -> GuardStatus | None:
        """What the guard does (None before the Trainer is built)."""
        return self._guard.status() if self._guard is not None else None

    # ----------------------------------------------------------------------------------------------
    # events

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Plan (or take the given plan) and apply it to the Trainer's arguments; see the class docstring.

        Raises:
            ConfigError: the Trainer or its arguments do not allow it (every problem listed), or planning
                failed on bad input.
            InfeasiblePlanError: nothing fits.
        """
        trainer = _find_trainer(self)
        if trainer is None:
            raise ConfigError("MemguardCallback could not find the Trainer calling it; pass it to the Trainer's "
                              "constructor: Trainer(..., callbacks=[MemguardCallback(...)])")
        self._trainer = trainer
        args = trainer.args
        constraints = _constraints(args, trainer.model)
        problems = self._trainer_problems(trainer, constraints)
        if problems:
            raise ConfigError(problems)
        options = GuardOptions(max_retries=self.max_retries, global_batch_size=self.global_batch_size,
                               plan_options=self._planning_options(args, constraints))
        guard = Guard(trainer.model, constraints, options, world_size=int(args.world_size),
                      rank_group=_world_group(args))
        self._guard = guard
        plan = self._given_plan
        if plan is None:
            plan = guard.agree_on_plan(lambda: self._make_plan(trainer, guard))
        self.plan = plan
        self._apply(trainer, plan)
        if self.guard_oom:
            self._patch_prediction_step(trainer)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Stand in for the Trainer's ``training_step`` (single device, DDP, FSDP or DeepSpeed).

        Raises:
            ConfigError: the callback was added after the Trainer was built.
        """
        trainer, guard, plan = self._trainer, self._guard, self.plan
        if trainer is None or guard is None or plan is None:
            raise ConfigError("MemguardCallback was added after the Trainer was built, too late to set the per-device "
                              "batch; pass it to the constructor: Trainer(..., callbacks=[MemguardCallback(...)])")
        if not self.guard_oom:
            return
        wrapped = trainer.model_wrapped
        self._engine = None
        if trainer.is_deepspeed_enabled:
            # The engine is built by now: Trainer._prepare_for_training runs accelerator.prepare (deepspeed.initialize,
            # Accelerator._prepare_deepspeed) before the loop's on_train_begin (trainer.py, _inner_training_loop,
            # transformers 5.24), and model_wrapped is the DeepSpeedEngine. Arm the agreement before every DeepSpeed
            # collective (memguard.integrations._deepspeed_guard); the engine reduces the gradients, so memguard does not.
            from memguard.integrations._deepspeed_guard import engine_problems, engine_rank_group

            problems = engine_problems(wrapped)
            if problems:
                logger.warning("memguard: under this DeepSpeed engine the plan is applied but out-of-memory errors "
                               "during training are not recovered from: %s", "; ".join(problems))
                return
            self._engine = wrapped
            guard.rank_group = engine_rank_group(wrapped)
            guard.options = dataclasses.replace(guard.options, sync_gradients=False)
        elif trainer.is_fsdp_enabled:
            # The model is sharded by now: Trainer._prepare_for_training runs accelerator.prepare (fsdp2_prepare_model,
            # or the FullyShardedDataParallel wrapper of FSDP1) before the loop's on_train_begin (trainer.py,
            # _inner_training_loop, transformers 5.24). Arm the agreement before each FSDP collective; FSDP reduces
            # the gradients (the Trainer's no_sync holds them back on the accumulation's earlier batches), so memguard
            # does not average them. Trainer.training_step runs compute_loss on model_wrapped: FSDP1's root forward.
            from memguard.guard._fsdp1 import fsdp1_rank_group
            from memguard.guard._fsdp2_frameworks import framework_rank_group

            fsdp2 = bool(getattr(trainer.accelerator, "is_fsdp2", False))
            rg = framework_rank_group(wrapped) if fsdp2 else fsdp1_rank_group(wrapped)
            guard.rank_group = rg
            guard.options = dataclasses.replace(guard.options, sync_gradients=False)
            if rg is not None:
                guard.on_undo(rg.uninstall)
        else:
            guard.rank_group = rank_group_of(wrapped)
        guard.world_size = guard.rank_group.world_size if guard.rank_group is not None else 1
        micro = guard.micro_batch_size if guard.window is not None else plan.micro_batch_size
        guard.apply(None, trainer.optimizer, micro_batch_size=micro, precision=plan.precision,
                    activation_checkpointing=False)  # the Trainer checkpoints (gradient_checkpointing in the args)
        guard.plan = plan
        self._patch(trainer)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Restore the Trainer's ``training_step``."""
        self._restore()

    # ----------------------------------------------------------------------------------------------
    # internals

    def _trainer_problems(self, trainer: Any, constraints: Constraints) -> list[str]:
        args = trainer.args
        problems: list[str] = []
        if args.auto_find_batch_size:
            problems.append("auto_find_batch_size=True halves the per-device batch on an OOM without raising gradient "
                            "accumulation (the global batch changes) and restarts the loop; memguard plans the batch "
                            "and recovers within the step instead: set auto_find_batch_size=False")
        if trainer.model_init is not None:
            problems.append("model_init= builds a new model in train(), after memguard planned for the first one; "
                            "pass model= instead")
        if args.n_gpu > 1:
            problems.append(f"the Trainer runs torch.nn.DataParallel over {args.n_gpu} GPUs in one process, which "
                            "memguard does not guard; launch one process per GPU (torchrun) for DDP")
        if args.fsdp and "strategies" not in {f.name for f in dataclasses.fields(Constraints)}:
            problems.append("memguard cannot plan for the Trainer's FSDP yet; plan with memguard.plan(..., "
                            "strategy='fsdp2') and pass plan=, or drop fsdp from the TrainingArguments")
        ds = _deepspeed_of(args)
        if trainer.is_deepspeed_enabled and ds is None:
            problems.append("DeepSpeed is configured through Accelerate's config, not TrainingArguments(deepspeed=...); "
                            "pass the DeepSpeed config as TrainingArguments(deepspeed=...) so that memguard plans for its "
                            "ZeRO stage and fills its batch values")
        if ds is not None:
            fixed = [k for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
                     if k in ds and ds[k] != AUTO]
            if _zero_of(ds)[0] is None:
                stage = (ds.get("zero_optimization") or {}).get("stage")
                problems.append(f"the DeepSpeed config's zero_optimization.stage is {stage!r}; the Trainer does not "
                                "fill it, so set it to 0, 1, 2 or 3")
            if fixed:
                problems.append(f"the DeepSpeed config fixes {', '.join(fixed)}; set {' and '.join(fixed)} to \"auto\" "
                                "so that the Trainer fills them from the batch memguard plans")
        device = args.device.type
        if device not in ("cuda", "cpu"):
            problems.append(f"memguard plans for 'cuda' or 'cpu' devices, not {device!r}")
        problems += option_problems(constraints, plan=self._given_plan, plan_options=self.plan_options)
        return problems

    def _planning_options(self, args: Any, constraints: Constraints) -> dict[str, Any]:
        options = dict(self.plan_options)
        if args.gradient_checkpointing or getattr(args, "activation_checkpointing", False):
            options.setdefault("activation_checkpointing", True)  # the user's arguments ask for it
        options["offload_optimizer"] = constraints.offload_optimizer
        options.setdefault("device", args.device.type)
        return options

    def _make_plan(self, trainer: Any, guard: Guard) -> Plan:
        args = trainer.args
        batch = _example_batch(trainer, int(args.per_device_train_batch_size))
        cls, kwargs = trainer.get_optimizer_cls_and_kwargs(args, trainer.model)

        def optimizer(params: Any) -> Any:
            return cls(params, **kwargs)

        # The Trainer sets config.use_cache = args.use_cache (False by default) right after the callbacks'
        # on_init_end (trainer.py, __init__ step 11 "Finalize"), so the steps it runs have no decoder cache; plan
        # that step, not the model's own use_cache (True for GPT-2 and Llama, which traces a cache the step never
        # builds). The Trainer's own assignment follows, so the value is only restored for a Trainer without it.
        config = getattr(trainer.model, "config", None)
        use_cache = getattr(args, "use_cache", None)
        if config is None or use_cache is None or not hasattr(config, "use_cache"):
            return guard.make_plan(batch, optimizer, None, accumulation=int(args.gradient_accumulation_steps),
                                   device=args.device.type)
        before = config.use_cache
        config.use_cache = use_cache
        try:
            return guard.make_plan(batch, optimizer, None, accumulation=int(args.gradient_accumulation_steps),
                                   device=args.device.type)
        finally:
            config.use_cache = before

    def _apply(self, trainer: Any, plan: Plan) -> None:
        """The plan's per-device batch, accumulation and checkpointing, in a copy of the Trainer's arguments."""
        old = trainer.args
        checkpointing = bool(plan.activation_checkpointing)
        changes: dict[str, Any] = {"per_device_train_batch_size": plan.micro_batch_size,
                                   "gradient_accumulation_steps": plan.grad_accum_steps,
                                   "gradient_checkpointing": checkpointing}
        if "activation_checkpointing" in {f.name for f in dataclasses.fields(old)}:
            changes["activation_checkpointing"] = checkpointing  # the newer name, read first where it exists
        # A shallow copy with the fields set: dataclasses.replace would run TrainingArguments.__post_init__ again,
        # which resets the Accelerate state the Trainer already built.
        new = copy.copy(old)
        for name, value in changes.items():
            setattr(new, name, value)
        trainer.args = new
        # Trainer.__init__ read the per-device batch before the callbacks' on_init_end (trainer.py, __init__);
        # Trainer._update_auto_batch_size sets the same attribute when auto_find_batch_size changes the batch.
        trainer._train_batch_size = new.train_batch_size
        if trainer.is_deepspeed_enabled:
            self._refill_deepspeed(trainer, new)
        if trainer.is_world_process_zero() and self._guard is not None:
            changed = [f"{name} {before} -> {after}" for name, before, after in (
                ("per_device_train_batch_size", old.per_device_train_batch_size, plan.micro_batch_size),
                ("gradient_accumulation_steps", old.gradient_accumulation_steps, plan.grad_accum_steps),
                ("gradient_checkpointing", old.gradient_checkpointing, checkpointing)) if before != after]
            self._guard.announce(plan, made=self._given_plan is None, overrides=changed)
            logger.debug("the plan memguard applies to the Trainer:\n%s", plan.explain())

    @staticmethod
    def _refill_deepspeed(trainer: Any, args: Any) -> None:
        """Fill the DeepSpeed config's ``"auto"`` batch values again from ``args``, where the Trainer reads them.

        ``TrainingArguments`` filled them from the user's batch at construction; the Trainer's hyper-parameter
        search rebuilds the config the same way when it changes the batch (trainer.py, ``_hp_search_setup``:
        ``HfTrainerDeepSpeedConfig(args.deepspeed)`` then ``trainer_config_process(args)``), and
        ``propagate_args_to_deepspeed`` hands the result to Accelerate's DeepSpeed plugin.
        """
        from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

        hf_config = HfTrainerDeepSpeedConfig(copy.deepcopy(_deepspeed_of(args)))
        hf_config.trainer_config_process(args)
        args.hf_deepspeed_config = hf_config
        plugin = trainer.accelerator.state.deepspeed_plugin
        plugin.hf_ds_config = hf_config
        plugin.deepspeed_config = hf_config.config

    def _patch_prediction_step(self, trainer: Any) -> None:
        """Stand in for the Trainer's ``prediction_step`` (an instance attribute, for the Trainer's life): each
        evaluation and prediction batch goes through :func:`memguard.guard._evaluate.split_eval`, so a batch that
        runs out of memory is halved and redone from the micro-batch that failed, its results joined as the
        unsplit batch's (see :meth:`_prediction_step`)."""
        if "prediction_step" in trainer.__dict__ and getattr(trainer.__dict__["prediction_step"], "_memguard", False):
            return
        original = trainer.prediction_step  # the bound method (a subclass's own), or a user's instance attribute
        callback = self

        def prediction_step(model: Any, inputs: Any, prediction_loss_only: bool, ignore_keys: Any = None) -> Any:
            return callback._prediction_step(trainer, original, model, inputs, prediction_loss_only, ignore_keys)

        prediction_step._memguard = True  # type: ignore[attr-defined]
        trainer.__dict__["prediction_step"] = prediction_step

    def _eval_guard_refusal(self, trainer: Any, inputs: Any) -> str | None:
        """Why this evaluation batch runs unguarded, or None (what the model's sharding cannot guard is found by
        :meth:`_eval_ranks`)."""
        if getattr(trainer.args, "predict_with_generate", False):
            return "predict_with_generate's outputs differ in length between micro-batches"
        try:
            batch_size(inputs)
        except ConfigError as exc:
            return f"the batch cannot be split ({exc})"
        return None

    def _prediction_step(self, trainer: Any, original: Callable[..., Any], model: Any, inputs: Any,
                         prediction_loss_only: bool, ignore_keys: Any) -> Any:
        """The Trainer's own ``prediction_step`` on micro-batches of ``inputs``, halving on an OOM.

        The loss the Trainer's loop averages is the unsplit batch's: where the Trainer normalises the loss by the
        batch's labelled items (``num_items_in_batch``, gathered over ranks with
        ``average_tokens_across_devices``), that count is taken once for the whole batch, as the unsplit step
        takes it (one collective per batch on every rank, whatever the split), and every micro-batch's loss,
        normalised by it, is a part of the batch's sum; otherwise each micro-batch's mean is weighted by its
        labelled tokens. Logits and labels are joined along dim 0 (:class:`memguard.guard._evaluate._Joiner`).
        """
        refusal = self._eval_guard_refusal(trainer, inputs)
        ranks = None
        if refusal is None:
            try:
                ranks = self._eval_ranks(trainer)
            except ConfigError as exc:  # the same on every rank (the model's configuration), before any collective
                refusal = f"memguard cannot split this sharded model's evaluation: {exc}"
        if refusal is not None:
            if self._eval_unguarded != refusal:
                self._eval_unguarded = refusal
                logger.warning("memguard: evaluation is not guarded against out-of-memory errors: %s", refusal)
            return original(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        n = batch_size(inputs)
        # the bound method (trainer.py), or an instance attribute; None in transformers versions without it, whose
        # prediction_step takes each micro-batch's own mean
        counter = getattr(trainer, "_get_num_items_in_batch", None)
        whole: dict[str, Any] = {}  # the whole batch's count, taken the first time the Trainer asks for it
        asked = {"now": False, "sum": False}

        def count(batch_samples: Any, device: Any) -> Any:
            asked["now"] = True
            if "items" not in whole:
                whole["items"] = counter([inputs], device)
            return whole["items"]

        def run(micro: Any) -> Any:
            asked["now"] = False
            if counter is None:
                return original(model, micro, prediction_loss_only, ignore_keys=ignore_keys)
            saved = trainer.__dict__.get("_get_num_items_in_batch")
            trainer.__dict__["_get_num_items_in_batch"] = count
            try:
                loss, logits, labels = original(model, micro, prediction_loss_only, ignore_keys=ignore_keys)
            finally:
                if saved is None:
                    trainer.__dict__.pop("_get_num_items_in_batch", None)
                else:
                    trainer.__dict__["_get_num_items_in_batch"] = saved
            # normalised by the whole batch's count: each micro-batch's loss is its part of the batch's, weighted
            # by samples below the parts add up (loss x n / k, times k / n)
            asked["sum"] = asked["now"] and whole.get("items") is not None
            if asked["sum"] and loss is not None:
                loss = loss * (n / batch_size(micro))
            return loss, logits, labels

        def weight(micro: Any) -> Any:  # called after run(micro)
            return batch_size(micro) if asked["sum"] else _label_tokens(trainer, micro)

        return split_eval(inputs, run, state=eval_status(trainer.model), weight_fn=weight,
                          loss_only_hint=_TRAINER_LOSS_ONLY, ranks=ranks)

    def _eval_ranks(self, trainer: Any) -> Any:
        """The :class:`~memguard.guard._sharded.ShardedRankGroup` the evaluation's forwards run under when they start
        collectives on several ranks (every rank then splits, pads and halves together); None when each rank splits
        alone (one process, DDP, DeepSpeed ZeRO-0/1/2, whose forwards gather nothing).

        * FSDP2: each forward all-gathers parameters (``FSDPParamGroup.pre_forward``,
          torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py). Inside ``train()`` (evaluations at
          ``eval_strategy``) it is training's group, armed on every FSDP2 group of the model; outside it, the group
          :func:`~memguard.guard._evaluate_sharded.eval_rank_group` keeps with the FSDP2 root (the Trainer shards the
          model in place: ``fsdp2_prepare_model`` in accelerate/utils/fsdp_utils.py, so ``model_wrapped`` is
          ``model``), its agreements installed again first, since the training group's uninstall at the end of a
          ``train()`` drops every wrapper of FSDP's collectives, its own included.
        * FSDP1: each unit's pre-forward all-gathers its flat parameter (``_pre_forward_unshard``,
          torch/distributed/fsdp/_runtime_utils.py). ``model_wrapped`` is the ``FullyShardedDataParallel`` root
          (``Trainer._inner_training_loop`` and ``evaluation_loop`` set it from ``accelerator.prepare``, transformers
          5.24); inside ``train()`` the group armed on its units is training's (:mod:`memguard.guard._fsdp1`), after it
          a new one (``eval_rank_group`` looks it up by unit).
        * DeepSpeed: ``model_wrapped`` is the engine (``deepspeed_init`` or ``accelerator.prepare`` in
          ``evaluation_loop``). Under ZeRO-3 its forward gathers the parameters (the coordinator's
          ``fetch_sub_module``): the engine's :class:`~memguard.integrations._deepspeed_guard.DeepSpeedRankGroup`,
          training's one when ``train()`` made it (``engine_rank_group`` and ``eval_rank_group`` keep one per engine).

        Raises:
            ConfigError: the sharding cannot be guarded in evaluation (ZeRO-3 parameter offload, FSDP1's HYBRID_SHARD
                or CPU offload, HSDP: :func:`~memguard.guard._evaluate_sharded.eval_rank_group`); the same on every
                rank, raised before any collective.
        """
        if not (trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled):
            return None
        from memguard.guard._evaluate_sharded import eval_rank_group

        model = trainer.model_wrapped or trainer.model
        if trainer.is_deepspeed_enabled:
            return eval_rank_group(model)
        from memguard.guard._sharded import ShardedRankGroup

        training = getattr(self._guard, "rank_group", None)
        if isinstance(training, ShardedRankGroup) and getattr(training, "_installed", False):
            return training if training.world_size > 1 else None
        rg = eval_rank_group(model)
        if rg is not None and _is_fsdp2(trainer):
            rg.uninstall()
            rg.install()
        return rg

    def _patch(self, trainer: Any) -> None:
        """Stand in for the Trainer's ``training_step``, its own (instance) value dumped first for :meth:`_restore`."""
        self._restore()
        original = trainer.training_step  # the bound method (or a user's instance attribute)
        callback = self

        def training_step(model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
            try:
                return callback._training_step(trainer, original, model, inputs, num_items_in_batch)
            except BaseException:
                callback._restore()
                raise

        self._saved = {"training_step": trainer.__dict__.get("training_step")}
        trainer.__dict__["training_step"] = training_step

    def _restore(self) -> None:
        """Give the Trainer back its own ``training_step`` from the value dumped before; the guard's own changes
        are undone whatever happens."""
        saved, self._saved = self._saved, None
        if saved is None:
            return
        try:
            for name, previous in saved.items():
                if previous is None:
                    self._trainer.__dict__.pop(name, None)
                else:
                    self._trainer.__dict__[name] = previous
        finally:
            if self._guard is not None:
                self._guard.undo()

    def _training_step(self, trainer: Any, original: Callable[..., torch.Tensor], model: Any, inputs: Any,
                       num_items_in_batch: Any) -> torch.Tensor:
        guard = self._guard
        assert guard is not None  # set in on_init_end
        # The loop sets sync_gradients before each training_step: True on an optimizer step's last batch
        # (trainer.py, _run_epoch: accelerator.gradient_state._set_sync_gradients(do_sync_step)).
        last = bool(trainer.accelerator.sync_gradients)
        engine = self._engine
        if guard.window is None or not guard.window.is_open:
            guard.open_window(model, [trainer.optimizer] if trainer.optimizer is not None else [])
            if engine is not None:
                guard.rank_group.start_window()  # the engine's counters, for its reset after an OOM
        n = batch_size(inputs)
        accumulation = trainer.current_gradient_accumulation_steps
        sharded = isinstance(guard.rank_group, ShardedRankGroup)

        def loss_of(micro: Any) -> torch.Tensor:
            k = batch_size(micro)
            # training_step divides a per-batch mean loss by current_gradient_accumulation_steps (trainer.py,
            # training_step); accumulation * n / k also weights the micro-batch by its share k / n of the batch.
            # A loss normalised by num_items_in_batch is not divided and already adds up over micro-batches.
            trainer.current_gradient_accumulation_steps = accumulation * n / k
            # DDP: memguard averages the gradients after the last batch. FSDP2: FSDP2 reduce-scatters them in each
            # micro-batch's backward as the Trainer's own sync context says (trainer.py, _run_epoch).
            sync = contextlib.nullcontext() if sharded else trainer.accelerator.no_sync(model)
            accelerator = trainer.accelerator
            wrapper = getattr(accelerator, "deepspeed_engine_wrapped", None)
            if engine is not None:
                # DeepSpeed: the window sets the engine's accumulation boundary (True on its last micro-batch) and
                # memguard runs engine.step() once per optimizer step, agreed; Accelerate's wrapper would set the
                # boundary from sync_gradients and step after every micro-batch of the last batch
                # (DeepSpeedEngineWrapper.backward, accelerate/utils/deepspeed.py, 1.15): only its engine.backward runs
                accelerator.deepspeed_engine_wrapped = _EngineBackward(engine)
            try:
                with sync:
                    step_loss = original(model, micro, num_items_in_batch)
            finally:
                trainer.current_gradient_accumulation_steps = accumulation
                if engine is not None:
                    accelerator.deepspeed_engine_wrapped = wrapper
            # the window adds up loss * k / n over the micro-batches: return the Trainer's loss times n / k so the
            # sum is the Trainer's loss for the whole batch
            return step_loss.detach() * (n / k)

        loss = guard.run(inputs, loss_of, _no_backward, model=model, last=last)
        if last:
            guard.end_window()
            if engine is not None:  # an OOM here stops every rank with the same OOMRecoveryError
                from memguard.integrations._deepspeed_guard import agreed_engine_step

                agreed_engine_step(guard.rank_group, micro_batch_size=guard.window.micro_batch_size)
        return loss


class _EngineBackward:
    """Stands in for Accelerate's ``DeepSpeedEngineWrapper`` during one guarded micro-batch: ``backward`` runs
    ``engine.backward(loss, **kwargs)`` only (the Trainer passes ``scale_wrt_gas=False``: trainer.py,
    training_step), leaving the accumulation boundary to memguard's window and ``engine.step()`` to the callback."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def backward(self, loss: torch.Tensor, sync_gradients: bool = True, **kwargs: Any) -> None:
        self.engine.backward(loss, **kwargs)

    def get_global_grad_norm(self) -> Any:
        norm = self.engine.get_global_grad_norm()
        return norm.item() if hasattr(norm, "item") else norm


#: What an evaluation whose outputs cannot be joined should do instead, in the Trainer's terms.
_TRAINER_LOSS_ONLY = ("evaluate the loss only, TrainingArguments(prediction_loss_only=True) (nothing per-sample is "
                      "kept), or a smaller per_device_eval_batch_size; preprocess_logits_for_metrics runs after the "
                      "batch's logits are joined, so it cannot shrink them")


def _label_tokens(trainer: Any, micro: Any) -> Any:
    """The labelled items a micro-batch's mean loss averages over, counted on this rank alone: the labels that
    are not -100 (shifted by one for a causal LM, as ``Trainer._get_num_items_in_batch`` counts them), else the
    micro-batch's samples."""
    labels = micro.get("shift_labels") if isinstance(micro, Mapping) else None
    if labels is None and isinstance(micro, Mapping) and isinstance(micro.get("labels"), torch.Tensor):
        labels = micro["labels"][..., 1:] if getattr(trainer, "_loss_shifts_labels", False) else micro["labels"]
    if isinstance(labels, torch.Tensor) and labels.dim() > 0:
        return int(labels.ne(-100).sum())
    return batch_size(micro)


def _world_group(args: Any) -> Any:
    """The default process group as a :class:`memguard.guard._distributed.RankGroup`, for planning on rank 0 before
    the Trainer wraps the model (None on one process)."""
    import torch.distributed as dist

    from memguard.guard._distributed import RankGroup

    if int(args.world_size) <= 1 or not dist.is_available() or not dist.is_initialized():
        return None
    backend = str(dist.get_backend())
    device = args.device if "nccl" in backend else torch.device("cpu")
    return RankGroup(dist.group.WORLD, dist.get_world_size(), dist.get_rank(), 0, device)
