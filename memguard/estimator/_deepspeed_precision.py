"""What a DeepSpeed config's precision settings make a ZeRO rank allocate (DeepSpeed 0.19.8).

Read by :func:`memguard.estimator._deepspeed_config.read_deepspeed_config`; priced by
:func:`memguard.estimator._sharding.model_state_factors`.

* ``bf16.bf16_master_weights_and_grads`` with ``bf16.bf16_optimizer_states``: the ZeRO optimizers
  keep the master partition in bf16 (``base_optimizer.py``, ``_configure_master_weights`` returns
  ``torch.bfloat16``; ``stage_1_and_2.py`` clones the partition ``.to(dtype=master_weights_and_grads_dtype)``,
  ``stage3.py`` ``_create_fp32_partitions`` the same) and the torch optimizer's state follows its
  bf16 parameter: 2 + 4 bytes per sharded element for Adam, where fp32 masters take 4 + 8. The step's
  gradient partition is ``flat_grad_partition.to(<master dtype>)``, the flat copy itself.
  memguard's name for it is ``"bf16-true"`` (the mapping of ``integrations.deepspeed.to_config``).
* ``bf16_master_weights_and_grads`` alone (or ``fp16.fp16_master_weights_and_grads``): allowed only
  with ZeRO-Offload and DeepSpeedCPUAdam (``_configure_master_weights`` calls ``_enforce_cpu_offload``
  whenever ``bf16_optimizer_states`` is off); the low-precision master lives on the host, so the
  device holds what ``"bf16-mixed"`` with offload holds.
* ``torch_autocast`` (``runtime/torch_autocast.py``): the module keeps its fp32 weights (no
  fp16/bf16 cast in ``_configure_distributed_model``) and forward runs under ``torch.autocast``;
  the parameters of ``lower_precision_safe_modules`` (default Linear, Conv1d-3d) get ``comm_dtype``
  the autocast dtype, and the ZeRO optimizers keep one reduce bucket per communication dtype
  (``stage_1_and_2.py``: ``self.ipg_buckets = {dtype: IPGBucket() for dtype in comm_dtypes}``, each
  of the weights' dtype; ``stage3.py``: each of its own dtype).
* Buffers are never partitioned (engine.py ``_cast_module_mixed_precision``: "Buffers are never
  ZeRO-partitioned"); under fp16/bf16 they keep the dtype they were loaded in unless
  ``data_types.buffer_dtype`` is set, and those matching ``data_types.keep_in_fp32_modules``
  (default ``"auto"``: the model's ``_keep_in_fp32_modules_strict``, and ``_keep_in_fp32_modules``
  under fp16) are made fp32 (``runtime/keep_in_fp32.py``).
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Any

import torch

#: DeepSpeed's DtypeEnum (runtime/config.py): the names it accepts for each dtype.
DTYPE_NAMES = {
    torch.float16: ("torch.float16", "fp16", "float16", "half"),
    torch.float32: ("torch.float32", "fp32", "float32", "float"),
    torch.bfloat16: ("torch.bfloat16", "bf16", "bfloat16"),
    torch.int8: ("torch.int8", "int8"),
}
#: engine.py CASTABLE_DTYPES: the dtypes the mixed-precision cast touches.
_CASTABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: torch_autocast.py LOWER_PRECISION_SAFE_MODULES (the default of lower_precision_safe_modules).
_SAFE_DEFAULT = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)


@dataclass(frozen=True)
class ZeroPrecision:
    """What the precision settings change on a ZeRO rank (see the module docstring).

    Attributes:
        master_bytes: bytes per element of the master partition (4; 2 with bf16 masters on the device).
        autocast: ``torch_autocast``: fp32 weights, forward under autocast.
        comm_dtype_bytes: element bytes of each communication dtype (one reduce bucket each);
            empty: one bucket of the weights' dtype.
        buffer_bytes: bytes of the model's buffers on every rank, in the dtypes the engine gives
            them; None: the dtypes of the user's model.
        notes: what the estimate assumed that the user should know.
    """

    master_bytes: int = 4
    autocast: bool = False
    comm_dtype_bytes: tuple[int, ...] = ()
    buffer_bytes: int | None = None
    notes: tuple[str, ...] = ()


def dtype_of(name: Any) -> torch.dtype | None:
    """The torch dtype of a DtypeEnum name (None if DeepSpeed does not know it)."""
    for dtype, names in DTYPE_NAMES.items():
        if str(name) in names:
            return dtype
    return None


def master_weights(bf16: dict, fp16: dict, *, bf16_on: bool, offload: bool, problems: list[str]) -> tuple[int, list]:
    """The master partition's bytes and notes for the fp16/bf16 blocks' master-weight flags."""
    notes: list[str] = []
    master = bool(bf16.get("bf16_master_weights_and_grads"))
    states = bool(bf16.get("bf16_optimizer_states"))
    fp16_master = bool(fp16.get("fp16_master_weights_and_grads"))
    if states and not master:
        # runtime/config.py _do_error_check: "bf16_optimizer_states requires bf16_master_weights_and_grads"
        problems.append("bf16.bf16_optimizer_states needs bf16.bf16_master_weights_and_grads (DeepSpeed asserts "
                        "this): set both, or drop bf16_optimizer_states")
        return 4, notes
    if master and not bf16_on:
        problems.append("bf16.bf16_master_weights_and_grads is set but bf16.enabled is not: enable bf16, or drop "
                        "bf16_master_weights_and_grads")
        return 4, notes
    if (master and not states) or fp16_master:
        key = "bf16.bf16_master_weights_and_grads" if master else "fp16.fp16_master_weights_and_grads"
        if not offload:
            # base_optimizer.py _configure_master_weights -> _enforce_cpu_offload: "Master weights feature
            # requires ZeRO Offload with DeepSpeedCPUAdam"
            problems.append(f"{key} without bf16_optimizer_states needs ZeRO-Offload with DeepSpeedCPUAdam "
                            "(DeepSpeed asserts this): add zero_optimization.offload_optimizer {\"device\": \"cpu\"}, "
                            + ("or also set bf16.bf16_optimizer_states (bf16 masters and states on the device), "
                               if master else "") + f"or drop {key}")
            return 4, notes
        notes.append(f"{key}: the low-precision master weights, gradients and optimizer state live on the host "
                     "(ZeRO-Offload with DeepSpeedCPUAdam); the device holds what it holds with fp32 masters offloaded")
        return 4, notes
    if master and states:
        if offload:
            notes.append("bf16 master weights and optimizer states offloaded to the host (DeepSpeedCPUAdam with "
                         "fp32_optimizer_states=False)")
        return 2, notes
    return 4, notes


def autocast_setting(cfg: dict, *, fp16_on: bool, bf16_on: bool, device: str,
                     problems: list[str]) -> torch.dtype | None:
    """The autocast dtype of the config's ``torch_autocast`` section (None: not enabled)."""
    block = cfg.get("torch_autocast")
    if not isinstance(block, dict) or block.get("enabled", False) is not True:
        return None  # runtime/config.py get_torch_autocast_enabled: default False
    if fp16_on or bf16_on:
        problems.append("torch_autocast together with fp16/bf16 (16-bit weights under autocast) is not modelled: "
                        "enable either torch_autocast or the fp16/bf16 block")
        return None
    name = block.get("dtype")
    if name is None:
        # torch.autocast(dtype=None) takes the device's default: bfloat16 on CPU, float16 on CUDA
        # (torch/amp/autocast_mode.py, torch.get_autocast_dtype)
        return torch.bfloat16 if device == "cpu" else torch.float16
    dtype = dtype_of(name)
    if dtype not in (torch.float16, torch.bfloat16):
        # runtime/config.py get_torch_autocast_dtype raises ValueError for an unknown name
        problems.append(f"torch_autocast.dtype {name!r} is not an autocast dtype: set \"bfloat16\" or \"float16\"")
        return None
    return dtype


def comm_dtype_bytes(model: Any, block: dict, dtype: torch.dtype, problems: list[str]) -> tuple[int, ...]:
    """Element bytes of the communication dtypes ``init_autocast_params`` gives the trainable parameters."""
    names = block.get("lower_precision_safe_modules")
    classes: tuple = _SAFE_DEFAULT
    if names is not None:
        found = []
        for name in names:
            try:  # torch_autocast.py init_autocast_params: importlib of "package.Class"
                package, cls = str(name).rsplit(".", 1)
                found.append(getattr(importlib.import_module(package), cls))
            except (ValueError, ImportError, AttributeError):
                problems.append(f"torch_autocast.lower_precision_safe_modules: {name!r} cannot be imported "
                                "(DeepSpeed raises ValueError): give classes as \"package.module.Class\"")
        classes = tuple(found)
    sizes = set()
    for module in model.modules():
        safe = module.__class__ in classes  # an exact class match, as init_autocast_params tests it
        for p in module.parameters(recurse=False):
            if p.requires_grad:
                sizes.add(torch.empty((), dtype=dtype).element_size() if safe else p.element_size())
    return tuple(sorted(sizes))


def _keep_pattern(model: Any, setting: Any, dtype: torch.dtype) -> re.Pattern | None:
    """runtime/keep_in_fp32.py keep_in_fp32_pattern."""
    if setting is None or setting == "auto":
        patterns = set()
        for module_name, child in model.named_modules():
            names = set(getattr(child, "_keep_in_fp32_modules_strict", None) or [])
            if dtype == torch.float16:
                names |= set(getattr(child, "_keep_in_fp32_modules", None) or [])
            for name in names:
                pattern = name.replace("*", ".*")
                patterns.add(rf"^{re.escape(module_name)}\..*{pattern}" if module_name else pattern)
    else:
        patterns = {str(name).replace("*", ".*") for name in setting}
    return re.compile("|".join(sorted(patterns))) if patterns else None


def buffer_bytes(model: Any, data_types: dict, dtype: torch.dtype | None, problems: list[str]) -> int | None:
    """Bytes of the model's buffers as the engine's fp16/bf16 cast leaves them (None: unchanged)."""
    if dtype is None:
        return None  # fp32 or torch_autocast: _configure_distributed_model casts nothing
    setting = data_types.get("keep_in_fp32_modules", "auto")
    if setting != "auto" and not (isinstance(setting, list) and all(isinstance(n, str) for n in setting)):
        problems.append(f"data_types.keep_in_fp32_modules {setting!r} must be \"auto\" or a list of name patterns "
                        "(DeepSpeed raises DeepSpeedConfigError)")
        return None
    target = None
    if data_types.get("buffer_dtype") is not None:
        target = dtype_of(data_types["buffer_dtype"])
        if target is None:
            problems.append(f"data_types.buffer_dtype {data_types['buffer_dtype']!r} is not a DeepSpeed dtype: "
                            "use \"fp32\", \"bf16\" or \"fp16\"")
            return None
    pattern = _keep_pattern(model, setting, dtype)
    total = changed = 0
    for name, b in model.named_buffers():
        size = b.element_size()
        if pattern is not None and b.is_floating_point() and pattern.search(name):
            size = 4  # keep_buffers_in_fp32: ``buf.data = buf.data.float()``
        elif target is not None and b.dtype in _CASTABLE:
            size = torch.empty((), dtype=target).element_size()
        total += b.numel() * size
        changed += size != b.element_size()
    return total if changed else None
