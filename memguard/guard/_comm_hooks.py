"""Gradient compression in memguard's own DDP gradient sync: torch's ``powerSGD_hook``.

:func:`memguard.prepare` runs each micro-batch on the module inside the DDP wrapper and averages
the gradients itself (:mod:`memguard.guard._distributed`), so DDP's reducer never runs and a hook
given to ``DistributedDataParallel.register_comm_hook`` would never be called. Under
``gradient_compression="powersgd"`` the guard's sync calls the same hook, torch's
``powerSGD_hook`` with a ``PowerSGDState`` (torch/distributed/algorithms/ddp_comm_hooks/
powerSGD_hook.py), on the buckets DDP's reducer would have after its rebuild
(:func:`memguard.estimator._powersgd.ddp_buckets`: the estimate's buckets), one bucket at a time,
each waited on before the next. The hook reads a bucket through ``buffer()``, ``gradients()``
(views into the buffer), ``index()`` and ``is_last()``; :class:`Bucket` provides them (``dist.GradBucket``
cannot be built from Python). The flat buffer is one reusable tensor of the largest bucket's size
(the hook keeps nothing of it: its error, P and Q live in the state), so the guard's sync adds that
buffer and PowerSGD's state and transients, which :func:`memguard.estimate` counts with
``gradient_compression="powersgd"``.

Known limitations:
    Unlike memguard's plain sync, the hook allocates while it runs (its clone, the uncompressed
    tensors' buffer, the new error buffer); an OOM there on one rank leaves the others waiting in its
    next all-reduce. Parameters that got no gradient on any rank enter the buckets as zeros (as in
    DDP's buckets) and keep ``grad=None``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from memguard.estimator._powersgd import PowerSGDOptions, ddp_buckets



class Bucket:
    """What ``powerSGD_hook`` reads of a ``torch.distributed.GradBucket``."""

    def __init__(self, index: int, count: int, buffer: torch.Tensor, gradients: list[torch.Tensor],
                 parameters: list[torch.Tensor]) -> None:
        self._index, self._count, self._buffer = index, count, buffer
        self._gradients, self._parameters = gradients, parameters

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._index == self._count - 1

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._gradients

    def parameters(self) -> list[torch.Tensor]:
        return self._parameters


class PowerSGDSync:
    """Average gradients over a DDP group with ``powerSGD_hook``, bucket by bucket.

    Args:
        group: the DDP wrapper's process group.
        params: the trainable parameters, in ``model.parameters()`` order (each once).
        options: the hook's :class:`~memguard.estimator._powersgd.PowerSGDOptions`.
    """

    def __init__(self, group: Any, params: Sequence[torch.Tensor], options: PowerSGDOptions) -> None:
        self.options = options
        self.state = options.state(group)
        self.params = list(params)
        self.buckets = ddp_buckets(self.params, options)
        self._buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def _buffer(self, dtype: torch.dtype, device: torch.device, numel: int) -> torch.Tensor:
        key = (dtype, device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf[:numel]

    def sync(self, params: Sequence[torch.Tensor], had: Sequence[bool]) -> None:
        """Average ``p.grad`` of every parameter of ``params`` that some rank gave a gradient (``had``, by position)."""
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

        had_of = {id(p): bool(h) for p, h in zip(params, had)}
        for index, group in enumerate(self.buckets):
            ps = [self.params[i] for i in group]
            numel = sum(p.numel() for p in ps)
            flat = self._buffer(ps[0].dtype, ps[0].device, numel)
            views, offset = [], 0
            for p in ps:
                view = flat[offset: offset + p.numel()].view_as(p)
                if p.grad is not None:
                    view.copy_(p.grad)
                else:
                    view.zero_()
                views.append(view)
                offset += p.numel()
            out = powerSGD_hook(self.state, Bucket(index, len(self.buckets), flat, views, ps)).wait()
            if out.data_ptr() != flat.data_ptr():  # the plain all-reduce before start_powerSGD_iter returns its input
                flat.copy_(out)
            for p, view in zip(ps, views):
                if had_of.get(id(p)):
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    p.grad.copy_(view)
                else:
                    p.grad = None


def compression_problems(model: Any, gradient_compression: Any, powersgd: Any, *, strategy: Any = None
                         ) -> tuple[PowerSGDOptions | None, list[str]]:
    """The options ``prepare(gradient_compression=, powersgd=)`` ask for, and every problem with them.

    PowerSGD compresses DDP's gradient all-reduce: the model must be wrapped in
    ``DistributedDataParallel`` over more than one rank, and not sharded (FSDP2, ZeRO).
    """
    from torch import nn

    from memguard.errors import ConfigError
    from memguard.estimator._powersgd import resolve_options

    if gradient_compression is None and powersgd is None:
        return None, []
    try:
        options = resolve_options(gradient_compression, powersgd)
    except ConfigError as exc:
        return None, list(exc.problems)
    problems = []
    if strategy == "fsdp2":
        problems.append("gradient_compression='powersgd' is a DistributedDataParallel comm hook; FSDP2 "
                        "(strategy='fsdp2') reduce-scatters its gradients without it: drop one of the two")
    elif not isinstance(model, nn.parallel.DistributedDataParallel):
        problems.append("gradient_compression='powersgd' compresses DistributedDataParallel's gradient all-reduce: "
                        "wrap the model in DistributedDataParallel (more than one rank) or drop gradient_compression")
    else:
        import torch.distributed as dist

        world = dist.get_world_size(model.process_group)
        if world < 2:
            problems.append(f"gradient_compression='powersgd' needs more than one rank; this DDP group has {world}: "
                            "drop gradient_compression or run more ranks")
    return options, problems
