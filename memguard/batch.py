"""Batches: calling the model for its loss, counting, splitting, resizing and mapping samples.

A batch is a tensor or any nesting of mappings (any ``collections.abc.Mapping``: ``dict``, HF's
``BatchEncoding``, which is a ``UserDict``), tuples (named tuples included) and lists, whose tensor
leaves share the size of dim 0, the sample dimension. Non-tensor leaves and 0-dim tensors are passed
whole to every micro-batch. The estimator, the planner, the guard and the adapters all use this
module, so a batch that one accepts the others accept too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Iterator

import torch
from torch import nn

from memguard.errors import ConfigError

__all__ = [
    "LossFn",
    "call_model",
    "loss_from_output",
    "compute_loss",
    "tensor_leaves",
    "batch_size",
    "first_dim",
    "split_batch",
    "map_tensors",
    "resize_batch",
]

#: ``loss_fn(model, batch) -> scalar loss``: the mean loss over the samples it was given.
LossFn = Callable[[nn.Module, Any], torch.Tensor]

_LOSS_FN_HINT = (
    "pass loss_fn=lambda model, batch: <mean loss of the batch> (for example "
    "lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])), or include the labels so the "
    "model returns .loss"
)


def call_model(model: nn.Module, batch: Any) -> Any:
    """Call ``model`` with ``batch`` the way memguard does without a ``loss_fn``.

    A mapping is passed as keyword arguments (``model(**batch)``), a tuple or list as positional
    arguments (``model(*batch)``), anything else as the one argument.
    """
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def loss_from_output(out: Any, *, source: str = "the model") -> torch.Tensor:
    """The scalar loss in a model's output: ``out.loss`` (attribute or mapping key) when it is a
    tensor, else ``out`` itself when it is a one-element tensor; returned with shape ``()``.

    Raises:
        ConfigError: neither is a one-element tensor; says how to pass ``loss_fn``.
    """
    found = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if isinstance(found, torch.Tensor):
        out = found
    if not isinstance(out, torch.Tensor) or out.numel() != 1:
        what = f"a tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigError(f"{source} returned {what}, which has no .loss and is not a scalar loss; {_LOSS_FN_HINT}")
    return out.reshape(())


def compute_loss(model: nn.Module, batch: Any, loss_fn: LossFn | None = None) -> torch.Tensor:
    """The scalar loss of ``model`` on ``batch``: ``loss_fn(model, batch)``, or the model's own loss
    (:func:`call_model`, then :func:`loss_from_output`).

    Raises:
        ConfigError: no scalar loss could be found, with how to pass ``loss_fn``.
    """
    if loss_fn is not None:
        return loss_from_output(loss_fn(model, batch), source="loss_fn")
    return loss_from_output(call_model(model, batch))


def _leaves(batch: Any, path: str = "batch") -> Iterator[tuple[str, Any]]:
    if isinstance(batch, Mapping):
        for k, v in batch.items():
            yield from _leaves(v, f"{path}[{k!r}]")
    elif isinstance(batch, (tuple, list)):
        for i, v in enumerate(batch):
            yield from _leaves(v, f"{path}[{i}]")
    else:
        yield path, batch


def tensor_leaves(batch: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``batch``, in order."""
    return (t for _, t in _leaves(batch) if isinstance(t, torch.Tensor))


def first_dim(batch: Any) -> int | None:
    """Dim 0 of the first tensor leaf that has one, or None; unlike :func:`batch_size` it does not
    check that the other leaves agree (the estimator traces whatever shapes it is given)."""
    return next((int(t.shape[0]) for t in tensor_leaves(batch) if t.dim() > 0), None)


def batch_size(batch: Any) -> int:
    """The number of samples in ``batch``: the size of dim 0 shared by its tensor leaves.

    Raises:
        ConfigError: the batch holds no tensor with a dim 0, a tensor leaf disagrees on the size of
            dim 0 (every problem is listed), or the batch is empty.
    """
    sized = [(p, t) for p, t in _leaves(batch) if isinstance(t, torch.Tensor) and t.dim() > 0]
    if not sized:
        raise ConfigError(
            f"the batch ({type(batch).__name__}) holds no tensor with a batch dimension; pass a tensor, or a "
            "mapping/tuple/list of tensors whose dim 0 is the sample dimension"
        )
    n = sized[0][1].shape[0]
    problems = [
        f"{p} has {t.shape[0]} rows in dim 0 but {sized[0][0]} has {n}; memguard splits every tensor of "
        f"the batch along dim 0, so give them all the sample dimension first (pass shared tensors "
        f"through loss_fn instead)"
        for p, t in sized[1:]
        if t.shape[0] != n
    ]
    if n == 0:
        problems.append("the batch is empty (dim 0 has size 0); pass at least one sample")
    if problems:
        raise ConfigError(problems)
    return int(n)


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Apply ``fn`` to every tensor leaf of ``batch``, keeping the containers' types (a mapping whose
    type cannot be rebuilt from a dict comes back as a dict)."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        items = {k: map_tensors(v, fn) for k, v in batch.items()}
        try:
            return type(batch)(items)
        except Exception:  # noqa: BLE001 - a Mapping whose constructor takes something else
            return items
    if isinstance(batch, tuple):
        items = [map_tensors(v, fn) for v in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    if isinstance(batch, list):
        return [map_tensors(v, fn) for v in batch]
    return batch


def split_batch(batch: Any, micro_batch_size: int) -> Iterator[tuple[Any, int]]:
    """Yield ``(micro_batch, samples)`` pairs covering ``batch`` in order, each sample exactly once.

    Every micro-batch has ``micro_batch_size`` samples except possibly the last, which has the rest.
    Slicing makes views, so splitting allocates nothing.

    Raises:
        ConfigError: as :func:`batch_size`, or ``micro_batch_size`` is not a positive int.
    """
    if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise ConfigError(f"micro_batch_size must be a positive int, got {micro_batch_size!r}")
    n = batch_size(batch)
    for start in range(0, n, micro_batch_size):
        stop = min(start + micro_batch_size, n)
        yield map_tensors(batch, lambda t, a=start, b=stop: t[a:b] if t.dim() > 0 else t), stop - start


def resize_batch(batch: Any, m0: int, n: int) -> Any:
    """A batch of ``n`` samples shaped like ``batch`` (which has ``m0``): every tensor whose dim 0 is
    ``m0`` gets dim 0 ``n``; other leaves are kept. Only shapes and dtypes matter to the tracer, so
    the new tensors are on the ``meta`` device and cost nothing."""
    if n == m0:
        return batch

    def resize(t: torch.Tensor) -> torch.Tensor:
        if t.dim() > 0 and t.shape[0] == m0:
            return torch.empty((n, *t.shape[1:]), dtype=t.dtype, device="meta")
        return t

    return map_tensors(batch, resize)
