"""Applying a precision, named as Lightning names them (:mod:`memguard.vocab` says what each means).

``32-true`` changes nothing; ``*-mixed`` runs the forward and loss under ``torch.autocast`` with the
precision's dtype, and ``16-mixed`` scales the loss with a ``torch.amp.GradScaler``; ``16-true`` and
``bf16-true`` cast the model's floating-point parameters and buffers, and floating-point inputs as
they are used. These are the semantics of Lightning's ``MixedPrecision`` and ``HalfPrecision``
plugins (lightning/fabric/plugins/precision/amp.py and half.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ContextManager

import torch
from torch import nn

from memguard.errors import ConfigError
from memguard.vocab import precision_spec

@dataclass(frozen=True)
class PrecisionSetup:
    """What a step needs to run in a precision.

    Attributes:
        precision: the precision name.
        device_type: ``"cuda"``, ``"cpu"``, ... the device type of the model's parameters.
        autocast_dtype: the autocast dtype for ``*-mixed``, else None.
        input_dtype: the dtype floating-point inputs are cast to for ``*-true`` (not 32), else None.
        scaler: the ``torch.amp.GradScaler`` for ``16-mixed``, else None.
    """

    precision: str
    device_type: str
    autocast_dtype: torch.dtype | None = None
    input_dtype: torch.dtype | None = None
    scaler: Any = None

    def autocast(self) -> ContextManager[Any]:
        """The context the forward and the loss run under."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.autocast_dtype)

    def cast_input(self, t: torch.Tensor) -> torch.Tensor:
        """Cast a floating-point input tensor for ``*-true``; other tensors pass unchanged."""
        if self.input_dtype is not None and t.is_floating_point() and t.dtype != self.input_dtype:
            return t.to(self.input_dtype)
        return t


def setup_precision(
    precision: str,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    wrapped: bool = False,
    scaler: Any = None,
) -> PrecisionSetup:
    """Apply ``precision`` to ``module`` (casting it for ``*-true``) and return the step's setup.

    Args:
        precision: one of :data:`memguard.vocab.PRECISIONS` (or Lightning's short aliases).
        module: the model (the inner module when it is wrapped in DistributedDataParallel).
        optimizer: the optimizer over its parameters; it must hold no state yet if a cast is needed.
        wrapped: whether ``module`` sits inside DistributedDataParallel (which cannot be cast after
            wrapping).
        scaler: the GradScaler to use for ``16-mixed`` (ignored otherwise); None makes a new one.

    Raises:
        ConfigError: unknown precision; a cast is needed but the optimizer already holds state or the
            module is wrapped in DistributedDataParallel.
    """
    spec = precision_spec(precision)  # raises ConfigError for an unknown name
    precision = spec.name
    first = next((p for p in module.parameters()), None)
    device_type = first.device.type if first is not None else "cpu"
    if spec.mixed:
        if not spec.loss_scale:
            scaler = None
        elif scaler is None:
            scaler = torch.amp.GradScaler(device_type)
        return PrecisionSetup(precision, device_type, autocast_dtype=spec.autocast_dtype, scaler=scaler)
    dtype = spec.param_dtype
    if dtype is None:  # 32-true
        return PrecisionSetup(precision, device_type)
    floating = [t for t in list(module.parameters()) + list(module.buffers()) if t.is_floating_point()]
    if any(t.dtype != dtype for t in floating):
        problems = []
        if wrapped:
            problems.append(
                f"precision {precision!r} casts the model, which DistributedDataParallel does not allow "
                f"after wrapping; cast it first (model.to({dtype})) and wrap it afterwards"
            )
        if optimizer.state:
            problems.append(
                f"precision {precision!r} casts the model, but the optimizer already holds state for the "
                f"current dtype; call memguard.prepare before the first optimizer step"
            )
        if problems:
            raise ConfigError(problems)
        # nn.Module.to casts in place (param.data = ...), so the optimizer keeps the same Parameters.
        module.to(dtype)
    return PrecisionSetup(precision, device_type, input_dtype=dtype)
