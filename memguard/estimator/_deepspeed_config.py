"""A user's own DeepSpeed config as ``memguard.estimate`` keywords (``deepspeed_config=``).

:func:`read_deepspeed_config` reads a config (a dict, or the path of a JSON file, as
``deepspeed.initialize(config=...)`` takes it) and returns what the estimate needs: the ZeRO stage,
the precision, the micro-batch and accumulation, the world size, optimizer offload and the
resolved ``zero_optimization`` block whose buckets :class:`~memguard.estimator._sharding.ZeroBuckets`
models. Read as DeepSpeed 0.19.8 reads it:

* ``zero_optimization.stage`` (default 0; ``runtime/zero/config.py``, ``DeepSpeedZeroConfig.stage``);
  memguard models stages 1-3 under DeepSpeed.
* ``fp16.enabled`` -> ``"16-mixed"``; ``bf16.enabled`` (or the older key ``bfloat16``) ->
  ``"bf16-mixed"``, or ``"bf16-true"`` with ``bf16_master_weights_and_grads`` and
  ``bf16_optimizer_states`` (bf16 masters and optimizer states; the mapping of
  ``memguard.integrations.deepspeed.to_config``); ``torch_autocast`` alone -> ``"bf16-mixed"`` or
  ``"16-mixed"`` with fp32 weights under autocast; none -> ``"32-true"`` (``runtime/precision_config.py``:
  all are off by default). What each allocates, the master-weight flags DeepSpeed refuses and the
  buffers' dtypes (``data_types.buffer_dtype``, ``keep_in_fp32_modules``):
  :mod:`memguard.estimator._deepspeed_precision`.
* ``train_batch_size == train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size``;
  given two of the three DeepSpeed derives the third (``runtime/config.py``,
  ``DeepSpeedConfig._set_batch_related_parameters``), and so does this function.
* ``zero_optimization.offload_optimizer.device`` ``"cpu"`` or ``"nvme"`` (or the deprecated
  ``cpu_offload: true``) -> optimizer offload.

``"auto"`` values are resolved the way the Hugging Face integration resolves them
(huggingface/transformers ``integrations/deepspeed.py``, ``HfTrainerDeepSpeedConfig``):
``trainer_config_process`` fills the batch triple from the per-device batch size (here the example
batch's dim 0), ``gradient_accumulation_steps`` (here the keyword) and the world size, and
``fp16.enabled`` / ``bf16.enabled`` from the precision; ``trainer_config_finalize`` fills
``reduce_bucket_size`` with ``hidden_size**2`` and, at stage 3, ``stage3_prefetch_bucket_size`` with
``int(0.9 * hidden_size**2)`` and ``stage3_param_persistence_threshold`` with ``10 * hidden_size``,
the hidden size read from ``model.config`` (``hidden_size``, else ``max(hidden_sizes)``, else the
same under ``text_config``).

A keyword given with a value other than its default must agree with the config; where they
disagree the error names the keyword to drop (the config is what the engine will run).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from memguard.errors import ConfigError
from memguard.estimator import _deepspeed_precision as dsp

AUTO = "auto"

#: memguard.estimate's defaults: a keyword at its default counts as not given.
_DEFAULTS = {"zero_stage": 0, "precision": "32-true", "world_size": 1, "grad_accum_steps": 1,
             "offload_optimizer": False, "strategy": None}

#: zero_optimization keys that hold an element count (DeepSpeedZeroConfig, runtime/zero/config.py),
#: by their config names (the stage-3 ones are aliases of prefetch_bucket_size etc.).
_COUNT_KEYS = ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
               "stage3_max_live_parameters", "stage3_param_persistence_threshold", "stage3_max_reuse_distance",
               "prefetch_bucket_size", "max_live_parameters", "param_persistence_threshold", "max_reuse_distance",
               "sub_group_size")

#: What the HF integration's trainer_config_finalize fills from the hidden size.
_HIDDEN_KEYS = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")

_DTYPES = {"fp32": 4, "float32": 4, "float": 4, "fp16": 2, "float16": 2, "half": 2, "bf16": 2, "bfloat16": 2}


def hf_bucket_sizes(hidden_size: int) -> dict[str, int]:
    """The bucket sizes the Hugging Face integration writes for ``"auto"`` from a hidden size.

    huggingface/transformers ``integrations/deepspeed.py``, ``HfTrainerDeepSpeedConfig.trainer_config_finalize``:
    ``reduce_bucket_size = hidden_size * hidden_size``; at stage 3 ``stage3_prefetch_bucket_size =
    int(0.9 * hidden_size * hidden_size)`` and ``stage3_param_persistence_threshold = 10 * hidden_size``.
    """
    return {
        "reduce_bucket_size": hidden_size * hidden_size,
        "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
        "stage3_param_persistence_threshold": 10 * hidden_size,
    }


def model_hidden_size(model: Any) -> int | None:
    """The hidden size the HF integration reads from ``model.config`` (None where it finds none)."""
    config = getattr(model, "config", None)
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is None:
            continue
        if isinstance(getattr(cfg, "hidden_size", None), int):
            return int(cfg.hidden_size)
        sizes = getattr(cfg, "hidden_sizes", None)
        if sizes:
            return int(max(sizes))
    return None


@dataclass(frozen=True)
class DeepSpeedSettings:
    """What a DeepSpeed config sets for the estimate (:func:`read_deepspeed_config`).

    Attributes:
        zero_stage, precision, world_size, grad_accum_steps, offload_optimizer: ``memguard.estimate``'s
            keywords as the config sets them.
        micro_batch_size: ``train_micro_batch_size_per_gpu`` (the example batch's dim 0 where "auto").
        config: the config with every "auto" it uses resolved; its ``zero_optimization`` block holds
            numbers only (what :class:`~memguard.estimator._sharding.ZeroBuckets` reads).
        zero_precision: what the precision settings change on a rank
            (:class:`~memguard.estimator._deepspeed_precision.ZeroPrecision`).
    """

    zero_stage: int
    precision: str
    world_size: int
    grad_accum_steps: int
    offload_optimizer: bool
    micro_batch_size: int
    config: dict[str, Any]
    zero_precision: dsp.ZeroPrecision = dsp.ZeroPrecision()


def load_config(config: Any) -> dict[str, Any]:
    """A config dict from a dict or a JSON file's path (a copy: the caller's dict is left as it was)."""
    if isinstance(config, Mapping):
        return json.loads(json.dumps(dict(config)))  # a deep copy of plain JSON data
    if isinstance(config, (str, os.PathLike)):
        try:
            with open(config, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"deepspeed_config={str(config)!r}: no such file; pass the path of the JSON "
                              "config given to deepspeed.initialize, or the dict itself") from None
        except (OSError, ValueError) as exc:
            raise ConfigError(f"deepspeed_config={str(config)!r} cannot be read as JSON ({exc}); pass a JSON "
                              "file or the config dict") from None
        if not isinstance(data, dict):
            raise ConfigError(f"deepspeed_config={str(config)!r} holds a JSON {type(data).__name__}, not an "
                              "object; a DeepSpeed config is a JSON object")
        return data
    raise ConfigError(f"deepspeed_config must be a dict or the path of a JSON file, got {type(config).__name__}")


def read_deepspeed_config(config: Any, *, model: Any, batch_size: int | None, **given: Any) -> DeepSpeedSettings:
    """Read a DeepSpeed config for ``memguard.estimate`` (see the module docstring).

    Args:
        config: the config dict or the path of its JSON file.
        model: the model (its ``config`` gives the hidden size for "auto" bucket sizes).
        batch_size: the example batch's dim 0 (the micro-batch).
        **given: ``memguard.estimate``'s keywords ``zero_stage``, ``precision``, ``world_size``,
            ``grad_accum_steps``, ``offload_optimizer`` and ``strategy``; one at its default is not
            given. ``device`` (not checked against the config) picks ``torch_autocast``'s default
            dtype when the config names none.

    Returns:
        A :class:`DeepSpeedSettings`.

    Raises:
        ConfigError: every problem at once: an unreadable config, a stage outside 1-3, both fp16 and
            bf16 enabled, an inconsistent batch triple, a keyword that contradicts the config (the
            message names the keyword to drop), a micro-batch that is not the example batch's size,
            an "auto" that needs a hidden size the model does not say, a master-weight, autocast or
            ``data_types`` setting DeepSpeed refuses (:mod:`memguard.estimator._deepspeed_precision`),
            or a setting memguard does not model (parameter offload, a gradient accumulation dtype
            other than the weights', ``torch_autocast`` together with fp16/bf16).
    """
    cfg = load_config(config)
    problems: list[str] = []
    explicit = {k: v for k, v in given.items() if k in _DEFAULTS and v != _DEFAULTS[k]}

    def clash(keyword: str, value: Any, key: str, config_value: Any) -> None:
        if keyword in explicit and value != config_value:
            problems.append(f"{keyword}={value!r} contradicts the DeepSpeed config's {key} ({config_value!r}): "
                            f"drop {keyword}= (the config's value is used), or change the config")

    if explicit.get("strategy") not in (None, "deepspeed"):
        problems.append(f"strategy={explicit['strategy']!r} contradicts deepspeed_config= (a DeepSpeed engine): "
                        "drop strategy=, or drop deepspeed_config=")

    zero = cfg.get("zero_optimization") or {}
    if not isinstance(zero, dict):
        problems.append(f"the config's zero_optimization must be an object, got {zero!r}")
        zero = {}
    cfg["zero_optimization"] = zero

    # --- stage
    stage = zero.get("stage", 0)  # DeepSpeedZeroConfig.stage defaults to 0
    if stage == AUTO and "zero_stage" in explicit:
        stage = explicit["zero_stage"]
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage <= 3:
        problems.append(f"zero_optimization.stage {stage!r} is not a ZeRO stage: DeepSpeed 0.19.8 has stages 0-3 "
                        "(runtime/zero/config.py, ZeroStageEnum); set 1, 2 or 3")
        stage = 1
    elif stage == 0:
        problems.append("zero_optimization.stage 0 (DeepSpeed without ZeRO) is not modelled: set stage 1, 2 or 3 "
                        "in the config, or drop deepspeed_config= and estimate plain DDP with strategy='ddp'")
        stage = 1
    else:
        clash("zero_stage", given.get("zero_stage"), "zero_optimization.stage", stage)
    zero["stage"] = stage

    # --- offload
    offload_opt = zero.get("offload_optimizer") or {}
    device = offload_opt.get("device", "none") if isinstance(offload_opt, dict) else "none"
    offload = device in ("cpu", "nvme") or zero.get("cpu_offload") is True

    # --- precision
    precision, zero_precision = _precision(cfg, given.get("precision", "32-true"), model, offload,
                                           str(given.get("device") or "cuda"), problems)
    clash("precision", given.get("precision"), "fp16/bf16/torch_autocast blocks", precision)
    clash("offload_optimizer", given.get("offload_optimizer"), "zero_optimization.offload_optimizer.device",
          offload)
    offload_param = zero.get("offload_param") or {}
    if (isinstance(offload_param, dict) and offload_param.get("device", "none") not in ("none", None)) or \
            zero.get("cpu_offload_param") is True:
        problems.append("zero_optimization.offload_param (ZeRO-3 parameter offload) is not modelled: remove it "
                        "from the config to estimate the run with parameters on the device")

    # --- gradient accumulation dtype
    grad_accum_dtype = (cfg.get("data_types") or {}).get("grad_accum_dtype")
    if grad_accum_dtype is not None:
        weights = 4 if precision == "32-true" or zero_precision.autocast else 2
        if _DTYPES.get(str(grad_accum_dtype).lower()) != weights or (
                precision != "32-true" and str(grad_accum_dtype).lower() in ("fp16", "float16", "half")
                and precision.startswith("bf16")):
            problems.append(f"data_types.grad_accum_dtype {grad_accum_dtype!r} differs from the weights' dtype, "
                            "which is not modelled (DeepSpeed then takes BF16_Optimizer at stage 1 and a separate "
                            "accumulation buffer at stage 2): remove it to estimate accumulation in the weights' "
                            "dtype")

    # --- the batch triple
    micro, accum, world = _batch_triple(cfg, given, explicit, batch_size, problems)

    # --- zero_optimization counts and "auto"
    hidden_autos = [k for k in _HIDDEN_KEYS if zero.get(k) == AUTO]
    if hidden_autos:
        hidden = model_hidden_size(model)
        if hidden is None:
            problems.append(
                "the model's config has neither hidden_size nor hidden_sizes, so the \"auto\" values of "
                f"zero_optimization {', '.join(hidden_autos)} cannot be filled (the Hugging Face rule): "
                "replace them with numbers")
        else:
            sizes = hf_bucket_sizes(hidden)
            for k in hidden_autos:
                # the HF rule fills the stage-3 keys only at stage 3; elsewhere DeepSpeed ignores them
                if k == "reduce_bucket_size" or stage == 3:
                    zero[k] = sizes[k]
                else:
                    del zero[k]
    for k in _COUNT_KEYS:
        v = zero.get(k)
        if v is None:
            continue
        if isinstance(v, float) and v == int(v):
            zero[k] = int(v)  # DeepSpeed's pp_int fields take 5e8
        elif isinstance(v, bool) or not isinstance(v, int) or v < 0:
            problems.append(f"zero_optimization.{k} {v!r} must be a whole number of elements"
                            + (" (\"auto\" is filled only by the Hugging Face integration, and only for "
                               "reduce_bucket_size and the stage-3 prefetch and persistence sizes)"
                               if v == AUTO else ""))
            del zero[k]
    for k in ("overlap_comm", "contiguous_gradients"):
        v = zero.get(k)
        if v is not None and not isinstance(v, bool):
            problems.append(f"zero_optimization.{k} {v!r} must be true or false")
            del zero[k]
    if problems:
        raise ConfigError(problems)
    return DeepSpeedSettings(zero_stage=stage, precision=precision, world_size=world, grad_accum_steps=accum,
                             offload_optimizer=offload, micro_batch_size=micro, config=cfg,
                             zero_precision=zero_precision)


def _enabled(block: Any, keyword_says: bool, name: str, problems: list[str]) -> bool:
    if not isinstance(block, dict):
        return False
    value = block.get("enabled", False)  # fp16/bf16 are off unless enabled (runtime/precision_config.py)
    if value == AUTO:
        return keyword_says  # HF trainer_config_process: fp16.enabled / bf16.enabled from the arguments
    if not isinstance(value, bool):
        problems.append(f"{name}.enabled {value!r} must be true, false or \"auto\"")
        return False
    return value


def _precision(cfg: dict[str, Any], keyword: str, model: Any, offload: bool, device: str,
               problems: list[str]) -> tuple[str, dsp.ZeroPrecision]:
    fp16_block = cfg.get("fp16")
    fp16 = _enabled(fp16_block, keyword == "16-mixed", "fp16", problems)
    bf16_key = "bf16" if "bf16" in cfg else "bfloat16"  # runtime/constants.py: BFLOAT16 and BFLOAT16_OLD
    bf16_block = cfg.get(bf16_key)
    bf16 = _enabled(bf16_block, keyword.startswith("bf16"), bf16_key, problems)
    if fp16 and bf16:
        problems.append("the config enables both fp16 and bf16 (DeepSpeed refuses that): enable one")
        return "32-true", dsp.ZeroPrecision()
    data_types = cfg.get("data_types") or {}
    model_dtype = torch.float16 if fp16 else torch.bfloat16 if bf16 else None
    if data_types.get("param_dtype") is not None and dsp.dtype_of(data_types["param_dtype"]) != (
            model_dtype or torch.float32):
        # engine.py _assert_valid_mixed_precision_config
        problems.append(f"data_types.param_dtype {data_types['param_dtype']!r} conflicts with the enabled precision "
                        "(DeepSpeed asserts they match): drop param_dtype, or enable the matching fp16/bf16 block")
    master, notes = dsp.master_weights(bf16_block if isinstance(bf16_block, dict) else {},
                                       fp16_block if isinstance(fp16_block, dict) else {},
                                       bf16_on=bf16, offload=offload, problems=problems)
    buffers = dsp.buffer_bytes(model, data_types, model_dtype, problems) if model is not None else None
    autocast = dsp.autocast_setting(cfg, fp16_on=fp16, bf16_on=bf16, device=device, problems=problems)
    if autocast is not None:
        comm = dsp.comm_dtype_bytes(model, cfg["torch_autocast"], autocast, problems) if model is not None else ()
        notes.append("torch_autocast: fp32 weights, gradients and masters, forward under torch.autocast("
                     f"{str(autocast).replace('torch.', '')}); one reduce bucket per communication dtype")
        return ("bf16-mixed" if autocast == torch.bfloat16 else "16-mixed",
                dsp.ZeroPrecision(autocast=True, comm_dtype_bytes=comm, notes=tuple(notes)))
    precision = "16-mixed" if fp16 else "bf16-mixed" if bf16 else "32-true"
    if bf16 and master == 2:
        precision = "bf16-true"
    return precision, dsp.ZeroPrecision(master_bytes=master, buffer_bytes=buffers, notes=tuple(notes))


def _count(cfg: dict[str, Any], key: str, problems: list[str]) -> int | str | None:
    v = cfg.get(key)
    if v is None or v == AUTO:
        return v
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        problems.append(f"the config's {key} {v!r} must be a positive integer or \"auto\"")
        return None
    return v


def _batch_triple(cfg, given, explicit, batch_size, problems) -> tuple[int, int, int]:
    """The micro-batch, accumulation and world size (DeepSpeedConfig._set_batch_related_parameters,
    with HF's fill of "auto" from the example batch and the keywords)."""
    n_before = len(problems)
    micro = _count(cfg, "train_micro_batch_size_per_gpu", problems)
    accum = _count(cfg, "gradient_accumulation_steps", problems)
    train = _count(cfg, "train_batch_size", problems)
    world = int(given.get("world_size", 1) or 1)
    if micro == AUTO:
        micro = batch_size  # HF: per_device_train_batch_size, here the example micro-batch
    if accum == AUTO:
        accum = int(given.get("grad_accum_steps", 1) or 1)  # HF: gradient_accumulation_steps
    if train == AUTO:
        train = None  # HF: world_size * micro * accumulation, computed below
    if len(problems) > n_before:
        return int(batch_size or 1), 1, world
    if micro is not None and accum is not None and train is not None and "world_size" not in explicit:
        if train % (micro * accum) == 0:
            world = train // (micro * accum)  # the ranks this triple is written for
    if micro is None and accum is None and train is None:
        micro, accum = batch_size, int(given.get("grad_accum_steps", 1) or 1)
    elif micro is None and train is not None:
        accum = accum if accum is not None else int(given.get("grad_accum_steps", 1) or 1)
        if train % (accum * world):
            problems.append(f"train_batch_size {train} is not divisible by gradient_accumulation_steps {accum} x "
                            f"world_size {world}: fix the config's batch sizes or world_size=")
            return int(batch_size or 1), accum, world
        micro = train // (accum * world)
    elif accum is None:
        if train is None:
            accum = int(given.get("grad_accum_steps", 1) or 1)
        elif train % (micro * world):
            problems.append(f"train_batch_size {train} is not divisible by train_micro_batch_size_per_gpu {micro} x "
                            f"world_size {world}: fix the config's batch sizes or world_size=")
            return micro, 1, world
        else:
            accum = train // (micro * world)
    if train is not None and train != micro * accum * world:
        problems.append(f"train_batch_size {train} != train_micro_batch_size_per_gpu {micro} x "
                        f"gradient_accumulation_steps {accum} x world_size {world} (DeepSpeed asserts this): fix "
                        "the config's batch sizes or world_size=")
    if "grad_accum_steps" in explicit and explicit["grad_accum_steps"] != accum:
        problems.append(f"grad_accum_steps={explicit['grad_accum_steps']!r} contradicts the DeepSpeed config's "
                        f"gradient_accumulation_steps ({accum}): drop grad_accum_steps= (the config's value is "
                        "used), or change the config")
    if batch_size is not None and micro != batch_size:
        problems.append(f"the example batch holds {batch_size} samples but the config's "
                        f"train_micro_batch_size_per_gpu is {micro}: pass a batch of {micro} samples (the "
                        "micro-batch one rank runs), or change the config")
    return int(micro), int(accum), int(world)
