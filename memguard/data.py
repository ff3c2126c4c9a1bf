"""The worst case up front: the longest batch a dataset can produce, and an example batch of that shape.

A job that plans on its first batch OOMs hours later on a rare long one. This module finds the
longest sample without loading the dataset into memory and builds the batch to plan for::

    shape = memguard.data.max_batch_shape(train_loader)        # {"seq_len": 1536}
    plan = memguard.plan(model, example_batch, global_batch_size=64, gpu="A100-80GB", max_shape=shape)
    plan.reasons["planned_shape"]                               # says which shape the plan is for

* :func:`scan_lengths` reads sample lengths one at a time: from a lengths column (the HF
  ``Trainer``'s ``length_column_name``, default ``"length"``) without touching a sample, from one
  column of a ``datasets``-like table in chunks, from a map-style dataset item by item, or from
  the first ``limit`` samples of an iterable.
* :func:`max_batch_shape` turns that into the ``max_shape`` the planner takes. For a
  ``DataLoader`` it collates ``batch_size`` copies of the longest sample with the loader's own
  ``collate_fn``, so padding rules (pad to the longest, to a multiple, or to a fixed length) are
  the loader's, not a guess.
* :func:`worst_case_batch` resizes an example batch to a ``max_shape``.

``max_shape`` is a mapping. ``"seq_len"`` is the sequence length: the size of dim 1 of the first
tensor in the batch with two or more dims (``input_ids`` in a transformers batch), and every
non-batch dim of every tensor of that size takes the new length, so ``attention_mask``, ``labels``,
``position_ids`` and a ``(batch, 1, seq, seq)`` mask all follow. Any other key names an entry of the
batch (a mapping key, or a tuple/list index) and gives that tensor's non-batch shape, e.g.
``{"pixel_values": (3, 448, 448)}``; such entries are left alone by ``"seq_len"``. A name keeps the
common case one line, while per-entry shapes cover batches where one length rule does not fit.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from memguard.batch import map_tensors, tensor_leaves
from memguard.errors import ConfigError

__all__ = [
    "LengthScan",
    "scan_lengths",
    "max_batch_shape",
    "worst_case_batch",
    "worst_case_loader_batch",
    "planning_batch",
    "ITERABLE_SCAN_LIMIT",
    "LENGTH_COLUMN",
    "SEQ_LEN",
]

#: The ``max_shape`` key of the sequence length.
SEQ_LEN = "seq_len"
#: The column the HF ``Trainer`` reads lengths from for ``group_by_length``
#: (``TrainingArguments.length_column_name``'s default).
LENGTH_COLUMN = "length"
#: Samples read from a dataset without ``__len__`` when no ``limit`` is given. An iterable may be
#: endless, so its scan must stop somewhere; the result then says it is incomplete
#: (``LengthScan.complete``). Pass ``limit=`` to read more, or ``lengths=`` to read none.
ITERABLE_SCAN_LIMIT = 10_000
#: Rows read per chunk from a column of a ``datasets``-like table: one chunk at a time is in memory.
_CHUNK = 1_000


@dataclass(frozen=True)
class LengthScan:
    """What :func:`scan_lengths` found.

    Attributes:
        max_length: the longest sample's length.
        index: the position of the longest sample in the scan order (its dataset index for
            map-style datasets), or None when the source has no positions.
        count: samples whose length was read.
        complete: every sample was read (False after a bounded scan of an iterable, or ``limit``).
        source: how the lengths were read, one phrase (shown by :meth:`describe`).
    """

    max_length: int
    index: int | None
    count: int
    complete: bool
    source: str

    def describe(self) -> str:
        """One sentence: the longest length, from how many samples, and how it was read."""
        where = f" (sample {self.index})" if self.index is not None else ""
        scope = f"all {self.count} samples" if self.complete else f"the first {self.count} samples only"
        return f"longest sample {self.max_length}{where} of {scope}, read from {self.source}"


def _length_of(item: Any, key: Any, dim: int) -> int:
    """The length of one sample: ``item[key]`` for a mapping, the first element of a tuple, else the
    item itself; a tensor's size along ``dim`` (its dim 0 for a 1-dim sample), a list's ``len``."""
    value = item
    if isinstance(item, Mapping):
        if key not in item:
            raise ConfigError(f"a sample has no {key!r} (it has {sorted(map(str, item))}); pass key= the entry "
                              "that holds the sequence, or length_fn=lambda sample: <its length>")
        value = item[key]
    elif isinstance(item, tuple):
        value = item[0]
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            raise ConfigError(f"a sample's {key!r} is a 0-dim tensor, which has no length; pass length_fn=")
        return int(value.shape[min(dim, value.dim() - 1)])
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        raise ConfigError(f"cannot read a length from a sample's {key!r} ({type(value).__name__}); pass "
                          "length_fn=lambda sample: <its length in tokens>")
    return len(value)


def _column_names(data: Any) -> list[str] | None:
    names = getattr(data, "column_names", None)
    if isinstance(names, Mapping):  # a DatasetDict: one list per split
        return None
    return list(names) if isinstance(names, (list, tuple)) else None


def _max_of(lengths: Iterable[int], source: str, *, total: int | None, limit: int | None) -> LengthScan:
    best, where, count = -1, None, 0
    for i, n in enumerate(lengths):
        if limit is not None and i >= limit:
            break
        n = int(n)
        count += 1
        if n > best:
            best, where = n, i
    if count == 0:
        raise ConfigError(f"the dataset is empty ({source}); there is no longest sample to plan for")
    complete = total is not None and count >= total
    return LengthScan(best, where, count, complete, source)


def _column_chunks(data: Any, key: str) -> Iterable[int]:
    """Lengths of column ``key`` read ``_CHUNK`` rows at a time (``Dataset.select_columns`` and
    ``Dataset.iter(batch_size=...)``, the ``datasets`` API), else row by row."""
    table = data.select_columns([key]) if hasattr(data, "select_columns") else data
    if hasattr(table, "iter"):
        for chunk in table.iter(batch_size=_CHUNK):
            for value in chunk[key]:
                yield len(value)
    else:
        for i in range(len(data)):
            yield _length_of(data[i], key, 0)


def scan_lengths(
    data: Any,
    *,
    key: Any = "input_ids",
    lengths: str | Sequence[int] | None = None,
    length_fn: Callable[[Any], int] | None = None,
    limit: int | None = None,
    dim: int = 0,
) -> LengthScan:
    """Find the longest sample of ``data`` without loading it all into memory.

    The lengths are read, in this order of preference:

    1. ``lengths``: a sequence of ints, or the name of a column holding them;
    2. a ``datasets``-like table (it has ``column_names``) with a ``"length"`` column
       (:data:`LENGTH_COLUMN`): that column, no sample is read;
    3. a ``datasets``-like table with a ``key`` column: that column alone, in chunks of rows;
    4. a ``DataLoader``: its dataset when it has one with ``__len__``, else its batches
       (each batch's ``key`` along dim 1, the padded length);
    5. a map-style dataset (``__len__`` and ``__getitem__``): one sample at a time, dropped
       before the next is read;
    6. any other iterable: at most ``limit`` samples (:data:`ITERABLE_SCAN_LIMIT` by default).

    Args:
        data: a dataset, a ``datasets.Dataset``-like table, a ``DataLoader`` or an iterable.
        key: the entry of a sample (mapping key) that holds the sequence; tuples use their first
            element and plain tensors/lists are the sequence.
        lengths: precomputed lengths, or the name of a column of ``data`` holding them.
        length_fn: ``length_fn(sample) -> int``, for samples whose length is read another way.
        limit: read at most this many samples (the result is then marked incomplete if more exist).
        dim: the sequence dim of a sample's tensor (0 for a 1-dim ``input_ids`` sample).

    Returns:
        A :class:`LengthScan`.

    Raises:
        ConfigError: bad arguments (all listed at once), an empty dataset, or samples whose
            length cannot be read (the message says to pass ``key=`` or ``length_fn=``).

    Known limitations:
        A map-style dataset without a lengths column is read sample by sample, one full pass of
        ``__getitem__`` (tokenisation included, if the dataset tokenises on access); give
        ``lengths=`` to avoid it. A bounded scan of an iterable finds the longest of the samples
        it saw, not necessarily of the whole stream.
    """
    problems = []
    if limit is not None and not (isinstance(limit, int) and limit >= 1):
        problems.append(f"limit={limit!r} must be a positive int or None")
    if length_fn is not None and not callable(length_fn):
        problems.append(f"length_fn must be a callable(sample) -> int, got {type(length_fn).__name__}")
    if not (isinstance(dim, int) and dim >= 0):
        problems.append(f"dim={dim!r} must be a non-negative int")
    if problems:
        raise ConfigError(problems)
    from torch.utils.data import DataLoader, IterableDataset

    if isinstance(data, DataLoader) and hasattr(data.dataset, "__len__") and not isinstance(data.dataset, IterableDataset):
        return scan_lengths(data.dataset, key=key, lengths=lengths, length_fn=length_fn, limit=limit, dim=dim)
    columns = _column_names(data)
    if isinstance(lengths, str):
        if columns is None or lengths not in columns:
            raise ConfigError(f"lengths={lengths!r} names a column, but the data has columns {columns}; pass the "
                              "lengths themselves or an existing column")
        return _max_of(data[lengths], f"column {lengths!r}", total=len(data), limit=limit)
    if lengths is not None:
        return _max_of(lengths, "the lengths given", total=len(lengths), limit=limit)
    if columns is not None and length_fn is None:
        if LENGTH_COLUMN in columns:
            return _max_of(data[LENGTH_COLUMN], f"column {LENGTH_COLUMN!r}", total=len(data), limit=limit)
        if key in columns:
            return _max_of(_column_chunks(data, key), f"column {key!r}", total=len(data), limit=limit)
    measure = length_fn if length_fn is not None else (lambda item: _length_of(item, key, dim))

    if isinstance(data, DataLoader):  # over an iterable dataset: its (padded) batches
        bound = limit or ITERABLE_SCAN_LIMIT

        def batch_lengths() -> Iterable[int]:
            for b in data:
                yield length_fn(b) if length_fn is not None else _length_of(b, key, 1)

        return _max_of(batch_lengths(), "the loader's batches (padded lengths)", total=None, limit=bound)

    if hasattr(data, "__len__") and hasattr(data, "__getitem__") and not isinstance(data, IterableDataset):
        n = len(data)
        return _max_of((measure(data[i]) for i in range(n)), "__getitem__, one sample at a time", total=n,
                       limit=limit)
    if not hasattr(data, "__iter__"):
        raise ConfigError(f"cannot read lengths from a {type(data).__name__}: pass a dataset, a DataLoader, an "
                          "iterable of samples, or lengths=")
    bound = limit or ITERABLE_SCAN_LIMIT
    return _max_of((measure(s) for s in itertools.islice(iter(data), bound + 1)), "iteration (bounded)",
                   total=None, limit=bound)


def worst_case_loader_batch(loader: Any, *, key: Any = "input_ids", lengths: Any = None,
                            length_fn: Callable[[Any], int] | None = None, limit: int | None = None) -> Any:
    """The batch a map-style ``DataLoader`` produces when every sample in it is the longest one:
    ``loader.collate_fn([longest] * loader.batch_size)``. The loader's own collate function pads,
    so its rules (to the longest, to a multiple, to a fixed length) decide the shape.

    Raises:
        ConfigError: the loader has no map-style dataset or no ``batch_size`` (a batch sampler or
            an iterable dataset: use :func:`max_batch_shape`, which scans its batches), or as
            :func:`scan_lengths`.
    """
    from torch.utils.data import DataLoader, IterableDataset

    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset) or loader.batch_size is None:
        raise ConfigError("worst_case_loader_batch needs a DataLoader over a map-style dataset with batch_size set; "
                          "for other loaders use max_batch_shape(loader), which scans the batches")
    scan = scan_lengths(loader.dataset, key=key, lengths=lengths, length_fn=length_fn, limit=limit)
    if scan.index is None:
        raise ConfigError("the longest sample's index is unknown; pass the dataset itself")
    longest = loader.dataset[scan.index]
    return loader.collate_fn([longest] * loader.batch_size)


def _seq_dim_size(batch: Any) -> int | None:
    """The sequence length of ``batch``: dim 1 of its first tensor with two or more dims."""
    return next((int(t.shape[1]) for t in tensor_leaves(batch) if t.dim() >= 2), None)


def max_batch_shape(data: Any, *, key: Any = "input_ids", lengths: Any = None,
                    length_fn: Callable[[Any], int] | None = None, limit: int | None = None,
                    pad_to_multiple_of: int | None = None) -> dict[str, int]:
    """The ``max_shape`` to plan for: ``{"seq_len": L}`` with ``L`` the longest padded length.

    For a map-style ``DataLoader``, ``L`` is the sequence length of
    :func:`worst_case_loader_batch` (its collate function's padding applied); otherwise it is the
    longest sample, rounded up to ``pad_to_multiple_of`` when given (a collator's
    ``pad_to_multiple_of``).

    Args:
        data, key, lengths, length_fn, limit: as for :func:`scan_lengths`.
        pad_to_multiple_of: round the length up to a multiple of this (ignored for a
            ``DataLoader``, whose collate function pads).

    Returns:
        ``{"seq_len": L}``, ready for ``memguard.plan(..., max_shape=...)``.

    Raises:
        ConfigError: as :func:`scan_lengths`, or a bad ``pad_to_multiple_of``.
    """
    from torch.utils.data import DataLoader, IterableDataset

    if pad_to_multiple_of is not None and not (isinstance(pad_to_multiple_of, int) and pad_to_multiple_of >= 1):
        raise ConfigError(f"pad_to_multiple_of={pad_to_multiple_of!r} must be a positive int or None")
    if (isinstance(data, DataLoader) and not isinstance(data.dataset, IterableDataset)
            and data.batch_size is not None and hasattr(data.dataset, "__len__")):
        worst = worst_case_loader_batch(data, key=key, lengths=lengths, length_fn=length_fn, limit=limit)
        n = _seq_dim_size(worst)
        if n is None:
            raise ConfigError("the loader's batches hold no tensor with a sequence dim (dim 1); plan with the "
                              "example batch as it is, or give max_shape per entry")
        return {SEQ_LEN: n}
    n = scan_lengths(data, key=key, lengths=lengths, length_fn=length_fn, limit=limit).max_length
    if pad_to_multiple_of:
        n = -(-n // pad_to_multiple_of) * pad_to_multiple_of
    return {SEQ_LEN: n}


def _entries(batch: Any) -> dict[Any, Any]:
    if isinstance(batch, Mapping):
        return dict(batch.items())
    if isinstance(batch, (tuple, list)):
        return dict(enumerate(batch))
    return {}


def _check_max_shape(batch: Any, max_shape: Any) -> list[str]:
    if not isinstance(max_shape, Mapping) or not max_shape:
        return [f"max_shape must be a non-empty mapping such as {{'seq_len': 2048}} or "
                f"{{'pixel_values': (3, 448, 448)}}, got {max_shape!r}"]
    out = []
    entries = _entries(batch)
    for k, v in max_shape.items():
        if k == SEQ_LEN:
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                out.append(f"max_shape['seq_len']={v!r} must be a positive int")
            elif _seq_dim_size(batch) is None:
                out.append("max_shape['seq_len'] needs a tensor with a sequence dim (dim 1) in the batch; "
                           "give the entries' shapes instead")
            continue
        if k not in entries:
            known = ", ".join(repr(e) for e in entries) or "none (the batch is a single tensor)"
            out.append(f"max_shape has {k!r}, which is not an entry of the batch (entries: {known}); use 'seq_len' "
                       "or an entry's key")
            continue
        t = entries[k]
        shape = (v,) if isinstance(v, int) else v
        if not isinstance(t, torch.Tensor) or t.dim() < 1:
            out.append(f"max_shape[{k!r}]: that entry is not a tensor with a batch dim")
        elif not (isinstance(shape, (tuple, list)) and all(isinstance(d, int) and d >= 0 for d in shape)):
            out.append(f"max_shape[{k!r}]={v!r} must be a tuple of non-negative ints (the non-batch dims)")
        elif len(shape) != t.dim() - 1:
            out.append(f"max_shape[{k!r}]={tuple(shape)} has {len(shape)} dims but {k!r} has {t.dim() - 1} "
                       f"non-batch dims (shape {tuple(t.shape)})")
    return out


def _tile(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``t`` resized to ``shape`` with its values repeated cyclically along each dim (valid token ids
    stay valid, a 0/1 mask stays 0/1)."""
    out = t
    for d, n in enumerate(shape):
        old = out.shape[d]
        if n == old:
            continue
        if old == 0:
            size = list(out.shape)
            size[d] = n
            out = torch.zeros(size, dtype=out.dtype, device=out.device)
        else:
            out = out.index_select(d, torch.arange(n, device=out.device) % old)
    return out


def worst_case_batch(batch: Any, max_shape: Mapping[Any, Any], *, materialize: bool = False) -> Any:
    """``batch`` resized to ``max_shape`` (see the module docstring for its keys), batch dim kept.

    Args:
        batch: an example batch (see :mod:`memguard.batch`).
        max_shape: ``{"seq_len": L}`` and/or ``{entry: non-batch shape}``.
        materialize: False (default) returns ``meta`` tensors, which cost nothing and are all the
            estimator and planner need; True returns real tensors on the batch's devices whose
            values repeat the example's cyclically (to run a real step at the worst shape).

    Returns:
        A batch of the same structure and dtypes.

    Raises:
        ConfigError: ``max_shape`` names no entry of the batch, gives a shape of the wrong rank,
            or a non-positive length (every problem at once).
    """
    problems = _check_max_shape(batch, max_shape)
    if problems:
        raise ConfigError(problems)
    per_entry = {k: ((v,) if isinstance(v, int) else tuple(v)) for k, v in max_shape.items() if k != SEQ_LEN}
    seq = max_shape.get(SEQ_LEN)
    old_seq = _seq_dim_size(batch)

    def target(t: torch.Tensor) -> tuple[int, ...]:
        if t.dim() < 1 or seq is None:
            return tuple(t.shape)
        return (t.shape[0], *(seq if s == old_seq else s for s in t.shape[1:]))

    def build(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        if tuple(t.shape) == shape:
            return t
        if materialize:
            return _tile(t, shape)
        return torch.empty(shape, dtype=t.dtype, device="meta")

    def resize(t: torch.Tensor) -> torch.Tensor:
        return build(t, target(t))

    if isinstance(batch, torch.Tensor):
        return resize(batch)
    entries = _entries(batch)
    resized = {}
    for k, v in entries.items():
        if k in per_entry:
            resized[k] = build(v, (v.shape[0], *per_entry[k]))
        else:
            resized[k] = map_tensors(v, resize)
    if isinstance(batch, Mapping):
        try:
            return type(batch)(resized)
        except Exception:  # noqa: BLE001 - a Mapping whose constructor takes something else
            return resized
    items = [resized[i] for i in range(len(batch))]
    if isinstance(batch, tuple):
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    return items


#: The last few :func:`planning_batch` answers, so that the same example batch and ``max_shape``
#: give the same worst-case batch object (a planner reused across calls recognises its batch).
_PLANNED: "OrderedDict[tuple, tuple[Any, Any, str]]" = OrderedDict()
_PLANNED_SIZE = 8


def _shape_key(max_shape: Mapping[Any, Any]) -> tuple:
    return tuple(sorted(((repr(k), tuple(v) if isinstance(v, (list, tuple)) else v) for k, v in max_shape.items()),
                        key=repr))


def planning_batch(batch: Any, max_shape: Mapping[Any, Any] | None) -> tuple[Any, str | None]:
    """The batch the planner traces for ``max_shape`` and the sentence ``Plan.reasons["planned_shape"]``
    shows; ``(batch, None)`` when ``max_shape`` is None. The same ``batch`` object and ``max_shape``
    give the same worst-case batch object.

    Raises:
        ConfigError: as :func:`worst_case_batch`.
    """
    if max_shape is None:
        return batch, None
    key = (id(batch), _shape_key(max_shape)) if isinstance(max_shape, Mapping) else None
    hit = _PLANNED.get(key) if key is not None else None
    if hit is not None and hit[0] is batch:
        _PLANNED.move_to_end(key)
        return hit[1], hit[2]
    worst = worst_case_batch(batch, max_shape)

    def shapes(b: Any) -> str:
        parts = []
        for k, v in _entries(b).items() or {"batch": b}.items():
            if isinstance(v, torch.Tensor):
                parts.append(f"{k} {tuple(v.shape[1:])}")
        return ", ".join(parts)

    given = ", ".join(f"{k}={tuple(v) if isinstance(v, list) else v}" for k, v in max_shape.items())
    reason = (f"the worst case max_shape {{{given}}}: per-sample shapes {shapes(worst)} "
              f"(the example batch had {shapes(batch)})")
    _PLANNED[key] = (batch, worst, reason)  # holds the example batch alive: at most _PLANNED_SIZE of them
    while len(_PLANNED) > _PLANNED_SIZE:
        _PLANNED.popitem(last=False)
    return worst, reason
