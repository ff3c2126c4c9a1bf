"""Rank agreement and gradient synchronisation for DistributedDataParallel.

The protocol (see :mod:`memguard.guard._runner` for where each piece runs):

1. Every micro-batch runs on the module inside the DDP wrapper (``ddp.module``), so DDP's reducer,
   its bucket rebuild and its buffer broadcast never start a collective while a peer may be stuck
   in an OOM. Until step 2 a rank talks to nobody.
2. Every rank calls :func:`agree` once: one all-reduce (MAX) of a small int32 vector holding each
   rank's outcome (ok, OOM, other error), the largest local batch, and which parameters got a
   gradient. All ranks leave it with the same view, so they all retry, all raise, or all go on.
3. Only then :func:`all_reduce_gradients` averages the gradients (SUM, then divide by the world
   size, as DDP does) through one reusable bucket of at most 25 MiB, and
   :func:`broadcast_buffers` copies rank 0's buffers to the others (DDP's ``broadcast_buffers``).
   Neither allocates, so neither can OOM half-way through a collective.
4. After the optimizer step, a second :func:`agree` tells every rank whether a peer failed in it.

Planning under DDP (:func:`plan_on_rank_zero`): rank 0 plans and broadcasts the plan, or its error,
so every rank applies the same plan (the planner reads free memory, which differs between ranks).

Cost against plain DDP: gradient communication no longer overlaps the backward pass (DDP overlaps
bucket all-reduces with the backward), and each step adds two all-reduces of a few hundred bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

#: Outcome codes one rank reports to :func:`agree`; MAX picks the worst.
OK, OOM, ERROR = 0, 1, 2

# DistributedDataParallel's default bucket_cap_mb (torch/nn/parallel/distributed.py).
_BUCKET_BYTES = 25 * 1024 * 1024


@dataclass(eq=False)
class RankGroup:
    """A DDP process group as the guard uses it.

    Attributes:
        group: the process group of the DDP wrapper.
        world_size, rank: size of the group and this process's rank in it.
        src: the global rank of the group's rank 0 (the source of buffer and plan broadcasts).
        device: where the agreement and bucket tensors live (CUDA for NCCL, else CPU).
        broadcast_buffers: the wrapper's ``broadcast_buffers`` flag.
        comm_hook: averages the gradients in place of :func:`all_reduce_gradients` when set
            (:class:`memguard.guard._comm_hooks.PowerSGDSync`: ``gradient_compression="powersgd"``).
    """

    group: Any
    world_size: int
    rank: int
    src: int
    device: torch.device
    broadcast_buffers: bool = True
    comm_hook: Any = None
    _buckets: dict = field(default_factory=dict)


def rank_group_of(model: nn.Module) -> RankGroup | None:
    """The :class:`RankGroup` of a DDP-wrapped ``model``, or None for any other module."""
    if not isinstance(model, nn.parallel.DistributedDataParallel):
        return None
    group = model.process_group
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    src = dist.get_global_rank(group, 0) if group not in (None, dist.group.WORLD) else 0
    backend = str(dist.get_backend(group))
    first = next(model.module.parameters(), None)
    device = torch.device("cpu")
    if "nccl" in backend and first is not None and first.device.type == "cuda":
        device = first.device
    return RankGroup(group, world_size, rank, src, device, bool(getattr(model, "broadcast_buffers", True)))


def agree(rg: RankGroup, code: int, values: Sequence[int] = ()) -> tuple[list[int], list[int]]:
    """All-reduce (MAX) this rank's outcome ``code`` and ``values``; every rank gets the same result.

    Returns:
        ``(codes, values)``: every rank's code, indexed by rank, and the element-wise maximum of
        ``values`` over ranks.
    """
    buf = torch.zeros(rg.world_size + len(values), dtype=torch.int32, device=rg.device)
    buf[rg.rank] = code
    if values:
        buf[rg.world_size:] = torch.tensor(list(values), dtype=torch.int32)
    dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=rg.group)
    out = buf.tolist()
    return out[: rg.world_size], out[rg.world_size:]


def _bucket(rg: RankGroup, dtype: torch.dtype, device: torch.device, numel: int) -> torch.Tensor:
    key = (dtype, device)
    buf = rg._buckets.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype, device=device)
        rg._buckets[key] = buf
    return buf


def reserve_buckets(rg: RankGroup, grads_like: Sequence[torch.Tensor]) -> None:
    """Allocate the reusable buckets before any micro-batch, so the sync itself allocates nothing."""
    for (dtype, device), tensors in _groups(grads_like).items():
        itemsize = torch.empty((), dtype=dtype).element_size()
        small = [t.numel() for t in tensors if t.numel() * itemsize <= _BUCKET_BYTES]
        if small:
            _bucket(rg, dtype, device, min(sum(small), _BUCKET_BYTES // itemsize))


def _groups(tensors: Sequence[torch.Tensor]) -> dict[tuple[torch.dtype, torch.device], list[torch.Tensor]]:
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return groups


def all_reduce_gradients(rg: RankGroup, grads: Sequence[torch.Tensor]) -> None:
    """Average ``grads`` over the ranks in place: SUM all-reduce, then divide by the world size.

    Every rank must pass tensors of the same shapes in the same order. Tensors up to 25 MiB travel
    packed in a reusable bucket; larger ones are all-reduced where they are.
    """
    for (dtype, device), tensors in _groups(grads).items():
        itemsize = torch.empty((), dtype=dtype).element_size()
        cap = _BUCKET_BYTES // itemsize
        pending: list[torch.Tensor] = []
        used = 0
        for t in tensors:
            if t.numel() > cap:
                _reduce_in_place(rg, t)
                continue
            if used + t.numel() > cap:
                _flush(rg, pending, used, dtype, device)
                pending, used = [], 0
            pending.append(t)
            used += t.numel()
        _flush(rg, pending, used, dtype, device)


def _reduce_in_place(rg: RankGroup, t: torch.Tensor) -> None:
    target = t if t.is_contiguous() else t.contiguous()
    dist.all_reduce(target, op=dist.ReduceOp.SUM, group=rg.group)
    target.div_(rg.world_size)
    if target is not t:
        t.copy_(target)


def _flush(rg: RankGroup, tensors: list[torch.Tensor], used: int, dtype: torch.dtype, device: torch.device) -> None:
    if not tensors:
        return
    flat = _bucket(rg, dtype, device, used)[:used]
    offset = 0
    for t in tensors:
        flat[offset: offset + t.numel()].copy_(t.reshape(-1))
        offset += t.numel()
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=rg.group)
    flat.div_(rg.world_size)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset: offset + t.numel()].view_as(t))
        offset += t.numel()


def broadcast_buffers(rg: RankGroup, buffers: Sequence[torch.Tensor]) -> None:
    """Copy the group's rank-0 buffers to every rank, in place (DDP's ``broadcast_buffers``)."""
    for b in buffers:
        dist.broadcast(b, src=rg.src, group=rg.group)


def plan_on_rank_zero(rg: RankGroup | None, make_plan: Callable[[], Any]) -> Any:
    """``make_plan()`` on rank 0, broadcast to every rank of ``rg`` (or just ``make_plan()`` without one).

    Every rank must call it. A failure on rank 0 is broadcast too, so that none waits: rank 0 raises
    its own error; the others rebuild a :class:`memguard.ConfigError` (same ``.problems``) or
    :class:`memguard.InfeasiblePlanError` (same ``.closest`` and ``.suggestions``), and raise a
    :class:`memguard.PeerFailedError` naming rank 0's error for anything else.

    Returns:
        The :class:`memguard.Plan`.
    """
    from memguard.planner.api import Plan

    if rg is None or rg.world_size == 1:
        return make_plan()
    payload: list[Any] = [None]
    failure: BaseException | None = None
    if rg.rank == 0:
        try:
            payload = [{"plan": make_plan().to_dict()}]
        except Exception as exc:  # every rank must hear of it, or the others wait forever
            failure = exc
            payload = [planning_error_payload(exc)]
    dist.broadcast_object_list(payload, src=rg.src, group=rg.group)
    if failure is not None:
        raise failure
    if "error" in payload[0]:
        raise rebuild_planning_error(payload[0])
    return Plan.from_dict(payload[0]["plan"])


def planning_error_payload(exc: BaseException) -> dict[str, Any]:
    """What the other ranks need to raise rank 0's planning error as it was (plain data only)."""
    from memguard.errors import ConfigError, InfeasiblePlanError

    out: dict[str, Any] = {"error": str(exc), "type": type(exc).__name__}
    if isinstance(exc, ConfigError):
        out["problems"] = list(exc.problems)
    elif isinstance(exc, InfeasiblePlanError):
        out.update(reason=exc.reason, suggestions=list(exc.suggestions),
                   closest=exc.closest.to_dict() if exc.closest is not None else None)
    return out


def rebuild_planning_error(payload: dict[str, Any]) -> Exception:
    """Rank 0's planning error, rebuilt on another rank from :func:`planning_error_payload`: a
    ConfigError with the same ``.problems``, an InfeasiblePlanError with the same ``.closest`` and
    ``.suggestions``, else a :class:`memguard.PeerFailedError` naming rank 0's error."""
    from memguard.errors import ConfigError, InfeasiblePlanError, PeerFailedError
    from memguard.planner.api import Plan

    if "problems" in payload:
        return ConfigError(payload["problems"])
    if "reason" in payload:
        closest = Plan.from_dict(payload["closest"]) if payload["closest"] is not None else None
        return InfeasiblePlanError(payload["reason"], closest=closest, suggestions=payload["suggestions"])
    return PeerFailedError(f"planning failed on rank 0 with {payload['type']}: {payload['error']} (see rank 0's log); "
                           "this rank stops too", rank=0)
