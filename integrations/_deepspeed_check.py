"""Checking a finished DeepSpeed config before a job gets it (:func:`validate_config`).

Two layers. The structural check needs nothing but the config: the sections DeepSpeed reads as mappings are
mappings, the ZeRO stage is 0-3, the batch triple holds for the planned world size, fp16 and bf16 are not both on,
``gradient_clipping`` is a number. Then, where DeepSpeed is installed, the config goes through DeepSpeed's own
``deepspeed.runtime.config.DeepSpeedConfig`` (its pydantic models reject unknown or out-of-range keys), which runs
on a machine without a GPU. That class reads the world size from ``deepspeed.comm`` and takes 1 when no process
group exists (``DeepSpeedConfig.__init__``, DeepSpeed 0.19.8), so it would reject a triple written for N ranks:
it is handed the one-rank view of the same triple (``train_batch_size = micro x accumulation``), after the
structural check has checked the triple for N.
"""

from __future__ import annotations

import copy
import importlib.util
from typing import Any, Mapping

from memguard.errors import ConfigError

#: Top-level sections DeepSpeed 0.19.8 reads as mappings (runtime/config.py and the config classes it builds).
#: ``zero_optimization`` may also be a bool: the deprecated form (runtime/zero/config.py, get_zero_config).
_SECTIONS = ("fp16", "bf16", "bfloat16", "optimizer", "scheduler", "activation_checkpointing", "data_types",
             "torch_autocast", "comms_logger", "flops_profiler", "tensorboard", "wandb", "csv_monitor",
             "checkpoint", "aio", "compression_training", "data_efficiency", "pipeline", "autotuning")
_BATCH = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def structure_problems(config: Mapping[str, Any], *, world_size: int) -> list[str]:
    """Every structural problem of ``config`` for ``world_size`` ranks, one sentence each (empty: none)."""
    out: list[str] = []
    for key in _SECTIONS:
        if key in config and not isinstance(config[key], Mapping):
            out.append(f"{key} must be a section (a JSON object), got {config[key]!r}")
    zero = config.get("zero_optimization")
    if zero is not None and not isinstance(zero, (Mapping, bool)):
        out.append(f"zero_optimization must be a section (a JSON object) such as {{\"stage\": 2}}, got {zero!r}")
    elif isinstance(zero, Mapping) and "stage" in zero and zero["stage"] not in (0, 1, 2, 3):
        out.append(f"zero_optimization.stage must be 0, 1, 2 or 3, got {zero['stage']!r}")
    given = {k: config[k] for k in _BATCH if k in config and config[k] != "auto"}
    for key, value in given.items():
        if not _positive_int(value):
            out.append(f"{key} must be a positive integer, got {value!r}")
    if len(given) == 3 and all(_positive_int(v) for v in given.values()):
        tbs, micro, gas = (given[k] for k in _BATCH)
        if tbs != micro * gas * world_size:
            out.append(f"train_batch_size {tbs} is not train_micro_batch_size_per_gpu {micro} x "
                       f"gradient_accumulation_steps {gas} x world size {world_size} = {micro * gas * world_size} "
                       "(DeepSpeed's batch rule); fix one of the three")
    enabled = [name for name in ("fp16", "bf16", "bfloat16")
               if isinstance(config.get(name), Mapping) and config[name].get("enabled") is True]
    if "fp16" in enabled and len(enabled) > 1:
        out.append("fp16 and bf16 are both enabled; DeepSpeed runs one of them: drop one")
    clip = config.get("gradient_clipping")
    if clip is not None and clip != "auto" and (isinstance(clip, bool) or not isinstance(clip, (int, float))
                                                 or clip < 0):
        out.append(f"gradient_clipping must be a number >= 0 (0: no clipping), got {clip!r}")
    return out


def _one_rank_view(config: Mapping[str, Any], world_size: int) -> dict[str, Any]:
    """``config`` with its batch triple as one rank of ``world_size`` sees it (see the module docstring)."""
    view = copy.deepcopy(dict(config))
    tbs = view.get("train_batch_size")
    if _positive_int(tbs) and world_size > 1:
        if tbs % world_size:
            raise ConfigError(f"train_batch_size {tbs} does not divide over {world_size} ranks; make it a multiple")
        view["train_batch_size"] = tbs // world_size
    return view


def _deepspeed_message(exc: BaseException) -> str:
    """DeepSpeed's (or pydantic's) error as one line: the first line, then each field error's own."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith("For further information")]
    return "; ".join(lines) or type(exc).__name__


def validate_config(config: Mapping[str, Any], *, world_size: int = 1, engine: bool = True) -> None:
    """Check a finished DeepSpeed config: structurally, then with DeepSpeed's own ``DeepSpeedConfig``.

    Args:
        config: the config as the job will get it.
        world_size: the number of ranks it is written for (the batch triple is checked for it).
        engine: also run DeepSpeed's ``DeepSpeedConfig`` when DeepSpeed is installed (False: the structural
            check alone, which needs no import of DeepSpeed).

    Raises:
        ConfigError: every structural problem; or DeepSpeed's own objection, in one line, naming the config as
            what to fix.
    """
    if not isinstance(config, Mapping):
        raise ConfigError(f"a DeepSpeed config is a mapping (a JSON object), got {type(config).__name__}")
    problems = structure_problems(config, world_size=world_size)
    if problems:
        raise ConfigError(problems)
    if not engine or importlib.util.find_spec("deepspeed") is None:
        return
    from deepspeed.runtime.config import DeepSpeedConfig

    try:
        DeepSpeedConfig(_one_rank_view(config, world_size))
    except ConfigError:
        raise
    except Exception as exc:  # DeepSpeed raises AssertionError, ValueError, TypeError or pydantic's ValidationError
        raise ConfigError(f"DeepSpeed rejects this config: {_deepspeed_message(exc)}; fix the key it names") from exc
