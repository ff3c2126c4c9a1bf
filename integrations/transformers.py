"""Hugging Face transformers: apply a :class:`memguard.Plan` to ``TrainingArguments``.

``apply(training_args, plan)`` returns new ``TrainingArguments`` whose per-device batch,
gradient accumulation, bf16/fp16 flags, gradient checkpointing and DeepSpeed config come from the
plan. The Trainer then runs the plan; memguard does not wrap the Trainer's loop.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

from memguard.errors import ConfigError
from memguard.integrations import require
from memguard.integrations.deepspeed import AUTO, fill_auto, to_config
from memguard.planner.plan import Plan

__all__ = ["apply"]

logger = logging.getLogger("memguard")


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
