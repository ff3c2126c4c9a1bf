"""Splitting a batch into micro-batches along dim 0.

A batch is a tensor or any nesting of dicts (any ``Mapping``), tuples (named tuples included) and
lists whose tensor leaves share the size of dim 0, the sample dimension. Non-tensor leaves and
0-dim tensors are passed whole to every micro-batch. Slicing makes views, so splitting allocates
nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Iterator

import torch

from memguard.errors import ConfigError

__all__ = ["batch_size", "split_batch", "map_tensors"]


def _leaves(batch: Any, path: str = "batch") -> Iterator[tuple[str, Any]]:
    if isinstance(batch, Mapping):
        for k, v in batch.items():
            yield from _leaves(v, f"{path}[{k!r}]")
    elif isinstance(batch, (tuple, list)):
        for i, v in enumerate(batch):
            yield from _leaves(v, f"{path}[{i}]")
    else:
        yield path, batch


def batch_size(batch: Any) -> int:
    """The number of samples in ``batch``: the size of dim 0 shared by its tensor leaves.

    Raises:
        ConfigError: the batch holds no tensor with a dim 0, a tensor leaf disagrees on the size of
            dim 0 (every problem is listed), or the batch is empty.
    """
    sized = [(p, t) for p, t in _leaves(batch) if isinstance(t, torch.Tensor) and t.dim() > 0]
    if not sized:
        raise ConfigError(
            "the batch holds no tensor with a batch dimension; pass a tensor, or a dict/tuple/list of "
            "tensors whose dim 0 is the sample dimension"
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


def _slice(batch: Any, start: int, stop: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[start:stop] if batch.dim() > 0 else batch
    if isinstance(batch, Mapping):
        items = {k: _slice(v, start, stop) for k, v in batch.items()}
        return _rebuild_mapping(batch, items)
    if isinstance(batch, tuple):
        items = [_slice(v, start, stop) for v in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    if isinstance(batch, list):
        return [_slice(v, start, stop) for v in batch]
    return batch


def _rebuild_mapping(original: Mapping, items: dict) -> Mapping:
    try:
        return type(original)(items)
    except Exception:  # a Mapping type whose constructor takes something else: fall back to dict
        return items


def split_batch(batch: Any, micro_batch_size: int) -> Iterator[tuple[Any, int]]:
    """Yield ``(micro_batch, samples)`` pairs covering ``batch`` in order, each sample exactly once.

    Every micro-batch has ``micro_batch_size`` samples except possibly the last, which has the rest.

    Raises:
        ConfigError: as :func:`batch_size`, or ``micro_batch_size`` is not a positive int.
    """
    if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise ConfigError(f"micro_batch_size must be a positive int, got {micro_batch_size!r}")
    n = batch_size(batch)
    for start in range(0, n, micro_batch_size):
        stop = min(start + micro_batch_size, n)
        yield _slice(batch, start, stop), stop - start


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to every tensor leaf of ``batch``, keeping the containers' types."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return _rebuild_mapping(batch, {k: map_tensors(v, fn) for k, v in batch.items()})
    if isinstance(batch, tuple):
        items = [map_tensors(v, fn) for v in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    if isinstance(batch, list):
        return [map_tensors(v, fn) for v in batch]
    return batch
