"""Batch shape signatures: which batches can share a micro-batch, and the micro-batches a compiled model sees.

Real data does not come in one shape: sequence lengths change from batch to batch, and a step's
activation memory grows with them (on the CPU target, GPT-2's attention scores grow with the
square of the length: a 2-layer, 64-wide GPT-2 needs 1.6 MiB per sample at 64 tokens and 23 MiB at
512, 14x for 8x the length, measured with :func:`memguard.estimate`). The guard therefore keeps one
micro-batch per *signature*: the non-batch dims of the batch's tensors, bucketed.
Guarded evaluation (:mod:`memguard.guard._evaluate`) keeps its own micro-batch per *exact*
signature (``signature_of(batch, exact=True)``: the dims as they are, with the dtypes), and
starts a new, smaller shape from a larger one's micro-batch scaled by how much smaller it is
(:meth:`Signature.scaled`). Both use one rule for which shape needs at least another's memory
(:meth:`Signature.covers`).

Bucketing (:func:`bucket`): a size up to 8 is kept exactly; a larger one is rounded up to a
multiple of an eighth of the next power of two at or above it, i.e. four buckets per doubling
(64, 80, 96, 112, 128, 160, ...). A batch is planned for the top of its bucket, so it never needs
more memory than planned, at most 25% more positions than it has (65 -> 80 is the worst case,
1.23x) are planned for, and a run whose lengths span 64 to 4096 plans at most 24 signatures (25 with
the reference batch's own). Only the dims that differ from the reference batch's (the batch memguard
planned on, else the first) are bucketed: a dim equal to the reference's is kept as it is, since the
dims a model fixes (an RNN state's hidden size, channels, a feature width) are the same in every
batch, and a probe batch padded past them (a hidden size of 200 planned as 224) is one the model
rejects.
Rounding up to a power of two would plan up to 2x the positions (4x the attention memory on the
CPU target); exact shapes would plan once per distinct length.

Micro-batch sizes under ``torch.compile`` (:func:`halvings`): a compiled model recompiles for a
new input shape, so the guard takes every micro-batch it chooses from the halvings of the planned
one (``M, M // 2, M // 4, ..., 1``), which is also what an OOM retry produces, and marks dim 0 of
each micro-batch's tensors dynamic (:func:`mark_batch_dynamic`), so the sizes share one graph.

What memguard's estimate means for a compiled model: the estimate and every plan trace the eager
module (``_orig_mod``) on fake tensors, so they predict the eager step's peak. Under the default
inductor backend that is an upper bound in practice, not a guarantee: inductor fuses pointwise ops
(their intermediates are never allocated) and its partitioner saves fewer activations for backward,
recomputing cheap ops instead (torch/_functorch/partitioners.py,
``min_cut_rematerialization_partition``); what it adds are its generated kernels' scratch buffers.
So a compiled step is expected to fit where the plan says the eager one fits, with memory to spare
that memguard does not claim: a 2-layer, 64-wide GPT-2 training step at 8 x 256 tokens (AdamW, fp32)
peaks at 51.4 MiB eager and 35.5 MiB compiled on the CPU, and memguard estimates 51.4 MiB
(``python -m benchmarks.variable_length --compiled-peak``, torch 2.13). Not covered:
``mode="reduce-overhead"`` (CUDA graphs keep a private memory pool per captured shape, on top of
the step), and inductor's autotuning (``mode="max-autotune"``), which benchmarks kernels with extra
workspaces during the first steps.

Known limitations:
    A training signature leaves out dtypes and non-tensor leaves (they rarely change within a job).
    Under DistributedDataParallel every rank's batch must have the same structure (the same
    tensor leaves with the same number of dims), as DDP training batches do: the ranks agree on
    the element-wise largest signature.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import torch
from torch import nn

from memguard.batch import map_tensors

#: Sizes up to this are kept exactly; above it, four buckets per doubling (see the module docstring).
EXACT_UP_TO = 8


def bucket(n: int) -> int:
    """The top of the bucket holding size ``n``: ``n`` itself up to 8, else ``n`` rounded up to a
    multiple of ``p / 8``, where ``p`` is the smallest power of two ``>= n`` (four buckets per doubling).

    >>> [bucket(n) for n in (7, 64, 65, 100, 129, 512, 513)]
    [7, 64, 80, 112, 160, 512, 640]
    """
    if n <= EXACT_UP_TO:
        return n
    step = (1 << (n - 1).bit_length()) // 8
    return -(-n // step) * step


@dataclass(frozen=True)
class Signature:
    """The non-batch dims of a batch's tensor leaves, in the batch's order (see :func:`signature_of`).

    Two batches with equal signatures share a micro-batch. ``dims`` and ``dtypes`` identify it;
    ``names`` (the leaves' paths, such as ``input_ids``) are for messages.

    Attributes:
        dims: for each tensor leaf with a batch dim, its other dims, bucketed (exact: every tensor
            leaf's, as they are).
        names: the leaves' paths.
        dtypes: each leaf's dtype in an exact signature; empty in a bucketed one.
    """

    dims: tuple[tuple[int, ...], ...]
    names: tuple[str, ...] = field(default=(), compare=False, hash=False)
    dtypes: tuple[torch.dtype, ...] = ()

    def key(self) -> tuple:
        """An exact signature as the key guarded evaluation keeps: ``((dims, dtype), ...)`` per leaf."""
        return tuple(zip(self.dims, self.dtypes))

    @classmethod
    def from_key(cls, key: tuple) -> "Signature":
        """The exact signature of a :meth:`key`."""
        return cls(tuple(tuple(dims) for dims, _ in key), dtypes=tuple(dtype for _, dtype in key))

    def flat(self) -> list[int]:
        """The dims as one list of ints (for the ranks' agreement)."""
        return [d for dims in self.dims for d in dims]

    def with_flat(self, values: Sequence[int]) -> "Signature":
        """The same structure with the dims taken from ``values`` (as :meth:`flat` lists them)."""
        out, i = [], 0
        for dims in self.dims:
            out.append(tuple(int(v) for v in values[i:i + len(dims)]))
            i += len(dims)
        return Signature(tuple(out), self.names, self.dtypes)

    def covers(self, other: "Signature") -> bool:
        """Whether every dim of this signature is at least ``other``'s (same structure and dtypes): a batch of
        this signature then needs at least the memory of one of ``other``'s at the same micro-batch."""
        return (len(self.dims) == len(other.dims) and self.dtypes == other.dtypes
                and all(len(a) == len(b) and all(x >= y for x, y in zip(a, b))
                        for a, b in zip(self.dims, other.dims)))

    def scaled(self, size: int, smaller: "Signature") -> int:
        """``size`` samples of this signature scaled to ``smaller``, which it :meth:`covers`: times the
        smallest ratio of elements per sample over the leaves whose dims differ.

        A sequence model's memory per sample grows at least in proportion to its sequence length
        (activations linearly, attention scores quadratically), so this many shorter samples need no
        more memory than ``size`` longer ones; a model for which that is false meets an OOM, which
        halves as usual.
        """
        ratios = [math.prod(a) / max(1, math.prod(b)) for a, b in zip(self.dims, smaller.dims) if a != b]
        return max(size, int(size * min(ratios))) if ratios else size

    def __str__(self) -> str:
        parts = [f"{name}[*{''.join(f',{d}' for d in dims)}]" for name, dims in zip(self.names, self.dims)]
        return " ".join(parts) if parts else "[*]"


def _tensor_paths(batch: Any, path: str = "") -> Iterable[tuple[str, torch.Tensor]]:
    if isinstance(batch, torch.Tensor):
        yield path or "batch", batch
    elif isinstance(batch, Mapping):
        for k, v in batch.items():
            yield from _tensor_paths(v, f"{path}.{k}" if path else str(k))
    elif isinstance(batch, (tuple, list)):
        for i, v in enumerate(batch):
            yield from _tensor_paths(v, f"{path}[{i}]")


def signature_of(batch: Any, *, exact: bool = False, fixed: Signature | None = None) -> Signature:
    """The :class:`Signature` of ``batch``: each tensor leaf's dims after dim 0, bucketed by :func:`bucket`.

    0-dim tensors and non-tensor leaves go whole to every micro-batch and are left out. With
    ``exact`` (guarded evaluation's), every tensor leaf's dims after dim 0 as they are, with its dtype.
    With ``fixed``, the reference batch's own dims (:func:`dims_of`), only the dims that differ from the
    reference's are bucketed: a dim the model fixes (an LSTM state's hidden size, image channels) is the
    same in every batch and is kept as it is, so a batch padded to its signature is still one the model
    takes; the sequence lengths that vary are bucketed (see the module docstring).
    """
    if exact:
        leaves = list(_tensor_paths(batch))
        return Signature(tuple(tuple(int(d) for d in t.shape[1:]) for _, t in leaves), tuple(p for p, _ in leaves),
                         tuple(t.dtype for _, t in leaves))
    leaves = [(p, t) for p, t in _tensor_paths(batch) if t.dim() > 0]
    ref = fixed.dims if fixed is not None and len(fixed.dims) == len(leaves) else None

    def dims(i: int, t: torch.Tensor) -> tuple[int, ...]:
        own = ref[i] if ref is not None and len(ref[i]) == t.dim() - 1 else None
        return tuple(int(d) if own is not None and int(d) == own[j] else bucket(int(d))
                     for j, d in enumerate(t.shape[1:]))

    return Signature(tuple(dims(i, t) for i, (_, t) in enumerate(leaves)), tuple(p for p, _ in leaves))


def dims_of(batch: Any) -> Signature:
    """The dims after dim 0 of ``batch``'s tensor leaves with a batch dim, as they are (no dtypes): the
    reference that :func:`signature_of`'s ``fixed`` compares a later batch with."""
    leaves = [(p, t) for p, t in _tensor_paths(batch) if t.dim() > 0]
    return Signature(tuple(tuple(int(d) for d in t.shape[1:]) for _, t in leaves), tuple(p for p, _ in leaves))


def pad_batch(batch: Any, sig: Signature) -> Any:
    """A batch like ``batch`` whose tensors have the dims of ``sig`` (the top of their buckets).

    For planning only: the tracer reads shapes and dtypes, not values, so the new tensors are on
    the ``meta`` device and cost nothing.
    """
    dims = iter(sig.dims)

    def pad(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0:
            return t
        want = next(dims)
        if tuple(t.shape[1:]) == want:
            return t
        return torch.empty((t.shape[0], *want), dtype=t.dtype, device="meta")

    return map_tensors(batch, pad)


def halvings(m: int) -> list[int]:
    """``m, m // 2, m // 4, ..., 1``: the micro-batches an OOM retry goes through from ``m`` (descending)."""
    out = [m]
    while out[-1] > 1:
        out.append(out[-1] // 2)
    return out


def snap_to(m: int, allowed: Sequence[int]) -> int:
    """The largest of ``allowed`` that is at most ``m`` (the smallest of them if none is)."""
    below = [a for a in allowed if a <= m]
    return max(below) if below else min(allowed)


def size_bound(sig: Signature, known: Mapping[Signature, int]) -> int | None:
    """The largest micro-batch ``sig`` can need no less memory than allows: the smallest size of a known
    signature that ``sig`` covers (memory never falls when a dim grows), or None if it covers none."""
    sizes = [m for other, m in known.items() if sig.covers(other)]
    return min(sizes) if sizes else None


# --------------------------------------------------------------------------------------------------
# torch.compile


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` runs through ``torch.compile``: an ``OptimizedModule`` (``torch.compile(model)``)
    or a module compiled in place (``model.compile()``, which sets ``_compiled_call_impl``)."""
    if getattr(module, "_compiled_call_impl", None) is not None:
        return True
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except Exception:  # noqa: BLE001 - a torch without dynamo compiles nothing
        return False
    return isinstance(module, OptimizedModule)


def uncompiled(module: nn.Module) -> nn.Module:
    """The module ``torch.compile(model)`` wrapped (``_orig_mod``), else ``module``: the planner traces the
    eager module on fake tensors, which a compiled wrapper would hand to dynamo."""
    inner = getattr(module, "_orig_mod", None)
    return inner if is_compiled(module) and isinstance(inner, nn.Module) else module


def mark_batch_dynamic(batch: Any) -> Any:
    """Mark dim 0 of every tensor of ``batch`` as dynamic for ``torch.compile``; returns ``batch``.

    ``torch._dynamo.maybe_mark_dynamic`` (torch/_dynamo/decorators.py) makes dynamo compile the
    first graph with a symbolic batch size instead of recompiling for the next size; unlike
    ``mark_dynamic`` it does not raise when the model specialises the size (for instance on a
    micro-batch of one, which dynamo always specialises).
    """
    try:
        from torch._dynamo import maybe_mark_dynamic
    except Exception:  # noqa: BLE001
        return batch

    def mark(t: torch.Tensor) -> torch.Tensor:
        if t.dim() > 0:
            maybe_mark_dynamic(t, 0)
        return t

    map_tensors(batch, mark)
    return batch
