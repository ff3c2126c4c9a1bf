"""memguard's shared vocabulary: precision names and what they mean, byte units, named constants.

Every part of memguard (estimator, planner, guard, adapters, CLI, plots) takes its precision names,
their meaning and the default-precision rule from here, so they are defined once.

=============  =============  ===============  ============  =======================================
precision      weights        autocast         loss scaling  Lightning plugin it mirrors
=============  =============  ===============  ============  =======================================
``32-true``    fp32           none             no            ``Precision`` (nothing changes)
``16-mixed``   fp32           ``float16``      yes           ``MixedPrecision("16-mixed")``
``bf16-mixed`` fp32           ``bfloat16``     no            ``MixedPrecision("bf16-mixed")``
``16-true``    ``float16``    none             no            ``HalfPrecision("16-true")``
``bf16-true``  ``bfloat16``   none             no            ``HalfPrecision("bf16-true")``
=============  =============  ===============  ============  =======================================

(Lightning's names and semantics: lightning/fabric/plugins/precision/amp.py and half.py; the short
aliases ``"32"``, ``"16"``, ``"bf16"`` are lightning/fabric/connector.py's.)
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch

from memguard.errors import ConfigError

__all__ = [
    "Precision",
    "PRECISIONS",
    "PRECISION_ALIASES",
    "PrecisionSpec",
    "precision_spec",
    "normalize_precision",
    "default_precisions",
    "Device",
    "DEVICES",
    "KiB",
    "MiB",
    "GiB",
    "TiB",
    "ALL_BLOCKS",
    "format_bytes",
    "parse_bytes",
    "round_up",
]

Precision = Literal["32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true"]
#: The precision names memguard accepts, Lightning's, in this order everywhere.
PRECISIONS: tuple[str, ...] = get_args(Precision)
#: Lightning's short names (lightning/fabric/connector.py): "32" is "32-true", "16" and "bf16" mixed.
PRECISION_ALIASES: dict[str, str] = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}

Device = Literal["cuda", "cpu"]
#: The targets memguard estimates for.
DEVICES: tuple[str, ...] = get_args(Device)

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

#: "Checkpoint every repeated block": larger than any model's block count.
ALL_BLOCKS = sys.maxsize


@dataclass(frozen=True)
class PrecisionSpec:
    """What a precision name means for a training step.

    Attributes:
        name: the precision name, one of :data:`PRECISIONS`.
        param_dtype: the dtype the weights are cast to (``*-true`` with 16 bits), else None (kept).
        autocast_dtype: the autocast dtype (``*-mixed``), else None.
        loss_scale: whether the loss is scaled by a ``GradScaler`` (``16-mixed`` only: bf16 has fp32's
            exponent range).
    """

    name: str
    param_dtype: torch.dtype | None
    autocast_dtype: torch.dtype | None
    loss_scale: bool

    @property
    def mixed(self) -> bool:
        """True for ``*-mixed``: fp32 weights, 16-bit compute under autocast."""
        return self.autocast_dtype is not None

    @property
    def sixteen_bit(self) -> bool:
        """True for every precision but ``32-true``."""
        return self.name != "32-true"

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype matrix multiplications run in."""
        return self.autocast_dtype or self.param_dtype or torch.float32


_SPECS = {
    "32-true": PrecisionSpec("32-true", None, None, False),
    "16-mixed": PrecisionSpec("16-mixed", None, torch.float16, True),
    "bf16-mixed": PrecisionSpec("bf16-mixed", None, torch.bfloat16, False),
    "16-true": PrecisionSpec("16-true", torch.float16, None, False),
    "bf16-true": PrecisionSpec("bf16-true", torch.bfloat16, None, False),
}


def normalize_precision(name: Any) -> str:
    """``name`` as one of :data:`PRECISIONS`, accepting Lightning's short aliases.

    Raises:
        ConfigError: not a precision name.
    """
    full = PRECISION_ALIASES.get(name, name) if isinstance(name, str) else name
    if full not in _SPECS:
        raise ConfigError(
            f"precision={name!r} is not one of {', '.join(PRECISIONS)} "
            f"(or Lightning's short names {', '.join(PRECISION_ALIASES)})"
        )
    return full


def precision_spec(name: Any) -> PrecisionSpec:
    """The meaning of a precision name (aliases accepted).

    Raises:
        ConfigError: not a precision name.
    """
    return _SPECS[normalize_precision(name)]


def default_precisions(device: str, gpu: Any = None) -> tuple[str, ...]:
    """The precisions memguard considers when the user fixes none, best first.

    On CUDA: ``bf16-mixed`` where the GPU has native bf16 (Ampere and later), else ``16-mixed`` where
    it has tensor cores (Volta, Turing), each with ``32-true`` as the fallback; GPUs with neither get
    ``32-true`` only. Without a catalog GPU (``gpu=None``) the CUDA default is the Ampere one. On the
    CPU: ``32-true`` and ``bf16-mixed`` (CPU autocast runs in bfloat16).

    Args:
        device: ``"cuda"`` or ``"cpu"``.
        gpu: a :class:`memguard.estimator.gpus.GPUSpec` (its ``bf16`` and ``tensor_cores``), or None.
    """
    if device == "cuda" and gpu is not None:
        if gpu.bf16:
            return ("bf16-mixed", "32-true")
        return ("16-mixed", "32-true") if gpu.tensor_cores else ("32-true",)
    if device == "cuda":
        return ("bf16-mixed", "32-true")
    return ("32-true", "bf16-mixed")


_BINARY_UNITS = (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB))
# Decimal (SI) and binary (IEC) units; a bare K/M/G/T is binary, as in `free -g` and docker.
_PARSE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB,
    "k": KiB, "m": MiB, "g": GiB, "t": TiB,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def format_bytes(n: int) -> str:
    """Render a byte count with a binary unit, e.g. ``format_bytes(3 * GiB) == '3.00 GiB'``."""
    sign = "-" if n < 0 else ""
    n = abs(int(n))
    for unit, size in _BINARY_UNITS:
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{n} B"


def parse_bytes(text: str) -> int:
    """Parse a memory size: ``"40GiB"``, ``"80GB"``, ``"1.5TiB"``, ``"512M"``, ``"1000000"``.

    ``KB``/``MB``/``GB``/``TB`` are powers of 1000, ``KiB``/``MiB``/``GiB``/``TiB`` and the bare
    ``K``/``M``/``G``/``T`` powers of 1024; case is ignored; a plain number is bytes.

    Raises:
        ValueError: not a positive size (the message says how to write one).
    """
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _PARSE_UNITS:
        raise ValueError(f"{text!r} is not a memory size; write e.g. 40GiB, 80GB, 1.5TiB or a number of bytes")
    value = int(float(match.group(1)) * _PARSE_UNITS[unit])
    if value <= 0:
        raise ValueError(f"{text!r} must be more than 0 bytes")
    return value


def round_up(n: int, to: int) -> int:
    """``n`` rounded up to a multiple of ``to`` (0 stays 0)."""
    return -(-n // to) * to if n else 0
