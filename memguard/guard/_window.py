"""One optimizer step's micro-batches, fed one batch at a time, with the guard's OOM recovery.

:func:`memguard.step` receives the whole batch of an optimizer step at once. Lightning and
Accelerate instead hand the training code one dataloader batch at a time and step the optimizer
after every ``k`` of them (their gradient accumulation). :class:`MicroBatchWindow` serves all of
them: the batches of one optimizer step form a *window* (a window of one batch for
:func:`memguard.step`).

* :meth:`MicroBatchWindow.start` opens a window: every gradient is dropped (``grad = None``) and
  the running statistics of normalisation layers are remembered.
* :meth:`MicroBatchWindow.run` runs one batch: split along dim 0 into micro-batches of the current
  size, each micro-batch's mean loss weighted by its share of the batch's samples times ``weight``
  (``1/k`` for a framework that averages ``k`` batches) and back-propagated at once, so the
  accumulated gradient is the gradient of the window's mean loss.
* On an out-of-memory error on any rank, the window's gradients are dropped, the normalisation
  statistics restored, the micro-batch halved and *every batch of the window so far* run again
  from its first sample. No sample is lost and none counts twice. Each retry is logged at WARNING
  on the ``memguard`` logger; at micro-batch 1 (or after ``max_retries`` halvings) an
  :class:`memguard.OOMRecoveryError` says what would help.
* Under DistributedDataParallel every rank reports its outcome after each batch in one
  agreement (:func:`memguard.guard._distributed.agree`), before any other collective, so all ranks
  retry together or all raise. Gradients are then averaged either by memguard
  (:meth:`MicroBatchWindow.sync_gradients`, the protocol of :mod:`memguard.guard._distributed`) or by
  DDP's own reducer through :meth:`MicroBatchWindow.anchor` (for a framework that runs the
  backward of the loss it gets back from the training step and steps the optimizer itself).
* Under FSDP2 (a :class:`memguard.guard._sharded.ShardedRankGroup` as the rank group) FSDP's own
  collectives run inside forward and backward: each attempt runs with an agreement before every
  one of them, a peer that hears of a failure leaves forward/backward there (and takes the outcome
  from that agreement instead of agreeing again), and every rank resets FSDP2's per-step state
  before the retry. Gradients are FSDP2's to reduce; ``sync_gradients`` is False.
* :meth:`MicroBatchWindow.finish` closes the window and lets its batches go.

Why replay instead of keeping a copy of the gradients: a copy costs one more set of gradients at
the peak; keeping references to the window's batches costs only their inputs (at most one
optimizer step's samples, which :func:`memguard.step` holds as well), and a replay happens only
after an OOM.

Known limitations:
    The training code runs once per micro-batch and again on a replay, so whatever it does besides
    returning the loss (logging, counters) happens that many times. Under DDP it must not start a
    collective of its own (such as a metric synchronised across ranks): a rank that ran out of
    memory would not join it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from memguard.batch import batch_size, split_batch
from memguard.errors import ConfigError, MemguardError, OOMRecoveryError, PeerFailedError
from memguard.guard import _distributed as ddp_sync
from memguard.guard._distributed import ERROR, OK, OOM, RankGroup
from memguard.guard._oom import (
    Halvings,
    free_memory,
    is_oom_error,
    oom_summary,
    release_exception,
    turn_off_onednn_after,
)
from memguard.guard._sharded import PeerAbort, ShardedRankGroup, ShardingStopped

logger = logging.getLogger("memguard")

#: Default ``max_retries``: 16 halvings take any micro-batch up to 65536 down to 1.
DEFAULT_MAX_RETRIES = 16

LossOf = Callable[[Any], torch.Tensor]
Backward = Callable[[torch.Tensor], None]


def _plain_backward(loss: torch.Tensor) -> None:
    loss.backward()


def run_micro_batches(batch: Any, micro_batch_size: int, loss_of: LossOf, backward: Backward = _plain_backward, *,
                      weight: float = 1.0, n: int | None = None,
                      before: Callable[[bool], None] | None = None) -> torch.Tensor:
    """Forward and backward ``batch`` in micro-batches; the batch's mean loss (detached, float32).

    Each micro-batch of ``k`` samples out of ``n`` contributes ``loss_of(micro) * (k / n) * weight``
    to the gradient: sum_i (k_i/n) * mean_i is the batch's mean, so the accumulated gradient is
    ``weight`` times the gradient of the batch's mean loss.

    Args:
        batch: a tensor or a dict/tuple/list of tensors, samples in dim 0.
        micro_batch_size: samples per forward/backward (the last micro-batch may be smaller).
        loss_of: ``loss_of(micro_batch) -> mean loss over its samples`` (a scalar tensor).
        backward: runs the backward of a weighted loss (``loss.backward()`` by default; a framework's
            own backward, which may scale it, otherwise).
        weight: a factor on every micro-batch's loss, e.g. ``1/k`` for ``k`` accumulated batches.
        n: the batch's sample count, if already known.
        before: called with ``is_last`` before each micro-batch (FSDP2's gradient-sync switch).

    Raises:
        ConfigError: the batch cannot be split (see :func:`memguard.batch.batch_size`).
    """
    n = batch_size(batch) if n is None else n
    total: torch.Tensor | None = None
    seen = 0
    count = -(-n // micro_batch_size)
    for i, (micro, k) in enumerate(split_batch(batch, micro_batch_size)):
        seen += k
        if before is not None:
            before(seen >= n)
        where = f"micro-batch {i + 1} of {count} (samples {seen - k}:{seen} of the batch's {n})"
        try:
            loss = loss_of(micro)
        except Exception as exc:
            note_user_error(exc, f"raised in the loss function (or the model's forward) that memguard called on {where}")
            raise
        weighted = loss * ((k / n) * weight)
        try:
            backward(weighted)
        except Exception as exc:
            note_user_error(exc, f"raised in the backward that memguard ran for {where}")
            raise
        part = loss.detach().float() * (k / n)
        total = part if total is None else total + part
        del loss, weighted, micro
    assert total is not None  # batch_size() guarantees at least one sample
    return total


def note_user_error(exc: BaseException, where: str) -> None:
    """Add one line (a PEP 678 note) to a user's error saying where memguard called the code that raised it.

    Out-of-memory errors (which the window retries), memguard's own errors and its internal signals
    between ranks get no note, nor does an error that already has one.
    """
    if isinstance(exc, (MemguardError, PeerAbort, ShardingStopped)) or is_oom_error(exc):
        return
    if any(str(note).startswith("memguard:") for note in getattr(exc, "__notes__", ())):
        return
    exc.add_note(f"memguard: {where}")


def recovery_error(reason: str, micro_batch_size: int, *, plan: Any = None, precision: str | None = None,
                   optimizer_step: bool = False) -> OOMRecoveryError:
    """The :class:`memguard.OOMRecoveryError` for an OOM that halving cannot fix, with what would help.

    Args:
        reason: what happened, one sentence without the final full stop.
        micro_batch_size: the micro-batch at the last OOM.
        plan: the plan in force (its estimate is reported), if any.
        precision: the precision in force (default ``"32-true"``).
        optimizer_step: the OOM happened in ``optimizer.step()``, where the micro-batch does not matter.
    """
    precision = precision or "32-true"
    lines = [reason + "."]
    if plan is not None:
        lines += [f"Predicted for the planned micro-batch {plan.micro_batch_size} "
                  f"({plan.estimate.device}, {plan.estimate.precision}):", plan.estimate.table()]
    help_ = []
    if not optimizer_step and not (plan is not None and plan.activation_checkpointing):
        help_.append("activation checkpointing: prepare(..., activation_checkpointing=True)")
    if precision == "32-true":
        help_.append("a 16-bit precision: precision='bf16-mixed' (or '16-mixed' on GPUs without bf16)")
    help_.append("sharding parameters, gradients and optimizer states with DeepSpeed ZeRO, or offloading the "
                 "optimizer (memguard.integrations.deepspeed)")
    if not optimizer_step:
        help_.append("shorter inputs per sample (sequence length, image size)")
    help_.append("a device with more free memory (check for other processes holding memory on it)")
    lines.append("What would help:")
    lines += [f"  - {h}" for h in help_]
    return OOMRecoveryError("\n".join(lines), micro_batch_size=micro_batch_size,
                            breakdown=dict(plan.estimate.breakdown) if plan is not None else None)


def agreed_optimizer_step(step_fn: Callable[[], Any], rank_group: RankGroup | None, *,
                          after: Callable[[], None] | None = None, plan: Any = None, precision: str | None = None,
                          micro_batch_size: int = 0) -> None:
    """Run ``step_fn`` (the optimizer step), then ``after`` (zero the gradients), and agree on the outcome.

    Under DDP every rank learns whether a peer failed in its optimizer step, so that all stop.

    Raises:
        OOMRecoveryError: this rank ran out of memory in the step (a smaller micro-batch would not help).
        PeerFailedError: a peer failed in its step (its weights now differ from this rank's).
        Exception: this rank's own error in the step, unchanged.
    """
    code, failure = OK, None
    try:
        step_fn()
    except Exception as exc:
        code, failure = (OOM if is_oom_error(exc) else ERROR), exc
    if after is not None:
        after()
    codes = ddp_sync.agree(rank_group, code)[0] if rank_group is not None else [code]
    if max(codes) == OK:
        return
    if failure is not None and code == OOM:
        raise recovery_error(f"out of memory in optimizer.step(): {oom_summary(failure)}; the optimizer's memory does "
                             "not depend on the micro-batch", micro_batch_size, plan=plan, precision=precision,
                             optimizer_step=True) from failure
    if failure is not None:
        note_user_error(failure, "raised in the gradient clipping or optimizer step (with its hooks) that memguard ran "
                                 "after the optimizer step's last micro-batch")
        raise failure
    bad = next(r for r, c in enumerate(codes) if c != OK)
    raise PeerFailedError(f"rank {bad} failed in optimizer.step() (see that rank's log); the ranks' weights now "
                          "differ, so this rank stops too", rank=bad)


class _Anchor(torch.autograd.Function):
    """Forward: the loss value. Backward: a zero gradient (a stride-0 view, no allocation) per parameter."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.specs = [(p.shape, p.dtype, p.device) for p in params]
        return value.detach().clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        zeros = [torch.zeros((), dtype=dtype, device=device).expand(shape) for shape, dtype, device in ctx.specs]
        return (None, *zeros)


def gradient_anchor(value: torch.Tensor, params: Sequence[nn.Parameter]) -> torch.Tensor:
    """A scalar equal to ``value`` whose backward adds exactly zero to each of ``params``' gradients.

    For a framework that runs ``backward`` on the loss a training step returns after memguard has
    already run the real backward passes: the framework's backward then changes no gradient, but
    fires every parameter's gradient hook, so DistributedDataParallel's reducer averages the
    gradients accumulated so far (in a synchronising step) exactly as it would have. A parameter
    whose gradient is None gets a zero gradient.
    """
    if not params:
        return value.detach().clone().requires_grad_()
    return _Anchor.apply(value, *params)


@dataclass(eq=False)
class _Batch:
    batch: Any
    n: int
    loss_of: LossOf
    backward: Backward
    weight: float
    loss: torch.Tensor | None = None


def _snapshot_norm_stats(module: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copies of the running statistics that normalisation layers update during a training forward."""
    out = []
    for m in module.modules():
        if m.training and getattr(m, "track_running_stats", False):
            for b in m.buffers(recurse=False):
                out.append((b, b.detach().clone()))
    return out


def _restore_norm_stats(snapshot: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for live, saved in snapshot:
            live.copy_(saved)


class MicroBatchWindow:
    """The batches of one optimizer step, run in micro-batches with OOM recovery (see the module docstring).

    Args:
        micro_batch_size: the micro-batch to start from; halved on every OOM and kept for later windows.
        rank_group: the DDP process group (:func:`memguard.guard._distributed.rank_group_of`), the
            ranks of an FSDP2 model (:func:`memguard.guard._sharded.sharded_rank_group`), or None.
        sync_gradients: memguard averages the gradients itself with :meth:`sync_gradients` (the
            gradient bucket is then reserved before each batch, and the last batch of a window gives
            zero gradients to parameters only a peer used); False when DDP's reducer averages them
            (through :meth:`anchor`) or there is a single rank.
        max_retries: at most this many halvings within one window.
        plan: the plan in force, for the advice of an :class:`memguard.OOMRecoveryError`.
        precision: the precision in force, for the same advice.
        on_halve: called with the new micro-batch after each halving (e.g. to remember it in a cache).

    Attributes:
        micro_batch_size: the current micro-batch.
        oom_retries: halvings so far, over all windows.
        retried: whether the current (or last) window had an OOM.
    """

    def __init__(self, micro_batch_size: int, *, rank_group: RankGroup | None = None, sync_gradients: bool = False,
                 max_retries: int = DEFAULT_MAX_RETRIES, plan: Any = None, precision: str | None = None,
                 on_halve: Callable[[int], None] | None = None) -> None:
        if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
            raise ConfigError(f"micro_batch_size must be a positive int, got {micro_batch_size!r}")
        self.micro_batch_size = micro_batch_size
        self.rank_group = rank_group
        self.sync = sync_gradients and rank_group is not None
        self.max_retries = max_retries
        self.plan = plan
        self.precision = precision
        self.on_halve = on_halve
        self.oom_retries = 0
        self.retried = False
        self.is_open = False
        self._batches: list[_Batch] = []
        self._params: list[nn.Parameter] = []
        self._optimizers: tuple[Any, ...] = ()
        self._norm_stats: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._local_had: list[bool] = []
        self._had: list[bool] = []

    # ----------------------------------------------------------------------------------------------

    def start(self, module: nn.Module, params: Sequence[nn.Parameter], optimizers: Sequence[Any] = ()) -> None:
        """Open a window: drop every gradient of ``params`` and remember ``module``'s normalisation statistics.

        Args:
            module: the module the batches run through (inside any DDP wrapper).
            params: the parameters whose gradients the window accumulates (those DDP synchronises).
            optimizers: optimizers whose ``zero_grad(set_to_none=True)`` also runs when gradients are dropped.
        """
        self.finish()
        self._params = list(params)
        self._optimizers = tuple(optimizers)
        for p in self._params:
            p.grad = None
        self._norm_stats = _snapshot_norm_stats(module)
        self._local_had = [False] * len(self._params)
        self._had = list(self._local_had)
        self.retried = False
        self.is_open = True

    def finish(self) -> None:
        """Close the window and let go of its batches and parameters (gradients are left as they are)."""
        self._batches = []
        self._params = []
        self._optimizers = ()
        self._norm_stats = []
        self.is_open = False

    @property
    def params(self) -> list[nn.Parameter]:
        """The parameters of the open window (empty once it is finished)."""
        return list(self._params)

    def run(self, batch: Any, loss_of: LossOf, backward: Backward = _plain_backward, *, weight: float = 1.0,
            last: bool = False) -> torch.Tensor:
        """Run one batch of the window in micro-batches; its mean loss (a detached float32 scalar).

        Args:
            batch: this rank's batch: a tensor or a dict/tuple/list of tensors, samples in dim 0.
            loss_of: ``loss_of(micro_batch) -> mean loss over its samples``. It is called again for
                every micro-batch of a replay, so it must take everything it needs from its argument
                or from values fixed when it was made.
            backward: runs the backward of a weighted loss (default ``loss.backward()``).
            weight: a factor on this batch's losses (``1/k`` when a framework averages ``k`` batches).
            last: this is the window's last batch and :meth:`sync_gradients` follows: under DDP the
                parameters without a gradient get a zero one here, where an OOM is still recoverable.

        Raises:
            ConfigError: the batch cannot be split (peers are told, so they raise too).
            OOMRecoveryError: an OOM at micro-batch 1 or after ``max_retries`` halvings.
            PeerFailedError: under DDP, a peer failed with an error that is not an OOM.
            Exception: this rank's own error that is not an OOM, unchanged.
        """
        if not self.is_open:
            raise RuntimeError("MicroBatchWindow.run called before start()")
        rg = self.rank_group
        try:
            n = batch_size(batch)
        except ConfigError:
            if rg is not None:  # tell the peers, which would otherwise wait in the agreement forever
                ddp_sync.agree(rg, ERROR, [0] * (1 + len(self._params)))
            raise
        self._batches.append(_Batch(batch, n, loss_of, backward, weight))
        todo = self._batches[-1:]
        halvings = Halvings(self.max_retries)
        sharded = rg if isinstance(rg, ShardedRankGroup) else None
        while True:
            mbs = self.micro_batch_size
            code, info = self._attempt(todo, mbs, fill=last, last=last)
            if code == OOM:  # give the memory back before talking to the peers: the agreement allocates a little
                self._discard()
                free_memory()
            n_max = max(b.n for b in todo)
            if isinstance(info, PeerAbort):  # a peer's report already met this rank's agreement inside FSDP's hook
                codes, values = info.codes, info.values
                code, info, n_max = OK, None, values[0]
            elif sharded is not None:
                try:
                    codes, values = sharded.agree(code, [n_max])
                except ShardingStopped as stopped:
                    raise stopped.error from None
                n_max = values[0]
                self._had = list(self._local_had)
            elif rg is not None:
                codes, values = ddp_sync.agree(rg, code, [n_max] + [int(h) for h in self._local_had])
                n_max, self._had = values[0], [bool(v) for v in values[1:]]
            else:
                codes, self._had = [code], list(self._local_had)
            worst = max(codes)
            if worst == OK:
                break
            self._discard()
            if sharded is not None:
                sharded.reset(self._params)
            _restore_norm_stats(self._norm_stats)
            if worst == ERROR:
                if code == ERROR:
                    raise info
                bad = codes.index(ERROR)
                raise PeerFailedError(f"rank {bad} failed with an error that is not an out-of-memory error (see that "
                                      "rank's log); this rank stops too so that no rank waits forever", rank=bad)
            if code != OOM:
                free_memory()
            self.retried = True
            failed = [r for r, c in enumerate(codes) if c == OOM]
            where = f" on rank {', '.join(map(str, failed))}" if rg is not None else ""
            detail = f" ({info})" if code == OOM else ""
            effective = min(mbs, n_max)
            stop = halvings.stop(effective)
            if stop == "one sample":
                raise recovery_error(f"out of memory at micro-batch 1{where}{detail}", 1, plan=self.plan,
                                     precision=self.precision)
            if stop is not None:
                raise recovery_error(f"out of memory at micro-batch {effective}{where}{detail} after {halvings.done} "
                                     f"halvings in this step (max_retries={self.max_retries})", effective,
                                     plan=self.plan, precision=self.precision)
            new = halvings.halve(effective)
            if len(self._batches) == 1:
                what = f"the same batch of {n} samples from its first sample"
            else:
                what = (f"the {len(self._batches)} batches of this optimizer step so far "
                        f"({sum(b.n for b in self._batches)} samples) from their first sample")
            logger.warning("out of memory at micro-batch %d%s%s; retrying %s with micro-batch %d",
                           effective, where, detail, what, new)
            self.micro_batch_size = new
            self.oom_retries += 1
            if self.on_halve is not None:
                self.on_halve(new)
            todo = list(self._batches)
        loss = self._batches[-1].loss
        assert loss is not None  # set by the successful attempt
        return loss

    def _attempt(self, todo: Sequence[_Batch], mbs: int, *, fill: bool, last: bool = False) -> tuple[int, Any]:
        """Run every micro-batch of ``todo`` once: ``(code, error or OOM summary)``; under FSDP2 the
        code is OK with a :class:`PeerAbort` as the second item when a peer's failure stopped this rank.

        Raises:
            memguard.OOMRecoveryError, memguard.PeerFailedError, Exception: under FSDP2, a failure that
                cannot be recovered (see :mod:`memguard.guard._sharded`): every rank raises it.
        """
        rg = self.rank_group
        sharded = rg if isinstance(rg, ShardedRankGroup) else None
        try:
            if self.sync:
                ddp_sync.reserve_buckets(rg, self._params)
            if sharded is not None:
                n_max = max(b.n for b in todo)
                with sharded.armed(n_max, mbs):
                    for i, b in enumerate(todo):
                        final = last and i == len(todo) - 1
                        b.loss = run_micro_batches(b.batch, mbs, b.loss_of, b.backward, weight=b.weight, n=b.n,
                                                   before=lambda is_last, f=final: sharded.before_micro_batch(
                                                       is_last and f))
            else:
                for b in todo:
                    b.loss = run_micro_batches(b.batch, mbs, b.loss_of, b.backward, weight=b.weight, n=b.n)
            self._local_had = [p.grad is not None for p in self._params]
            if self.sync and fill:
                for p, h in zip(self._params, self._local_had):
                    if not h:  # a peer may have a gradient here: give the all-reduce a zero to add
                        p.grad = torch.zeros_like(p)
            return OK, None
        except Exception as exc:
            for b in todo:
                b.loss = None
            if isinstance(exc, ShardingStopped):
                error = exc.error
                release_exception(exc)
                raise error
            if isinstance(exc, PeerAbort):
                release_exception(exc)
                return OK, exc
            if is_oom_error(exc):
                summary = oom_summary(exc)
                turn_off_onednn_after(exc)
                release_exception(exc)
                return OOM, summary
            return ERROR, exc

    def _discard(self) -> None:
        """Drop every gradient of the window, in the parameters and in the optimizers."""
        for p in self._params:
            p.grad = None
        for opt in self._optimizers:
            opt.zero_grad(set_to_none=True)
        self._local_had = [False] * len(self._params)

    # ----------------------------------------------------------------------------------------------

    def anchor(self, value: torch.Tensor) -> torch.Tensor:
        """:func:`gradient_anchor` over the window's parameters that have a gradient on some rank.

        Under FSDP2 the micro-batches' own backward passes reduce-scattered the gradients already: the
        anchor then touches no parameter (a framework's backward of it runs no FSDP2 hook and adds nothing).
        """
        if isinstance(self.rank_group, ShardedRankGroup):
            return gradient_anchor(value, [])
        return gradient_anchor(value, [p for p, h in zip(self._params, self._had) if h])

    def sync_gradients(self, buffers: Sequence[torch.Tensor] = ()) -> None:
        """Average the window's gradients over the ranks (after the ``last=True`` batch); a no-op on one rank.

        Parameters that no rank gave a gradient keep None; the others are averaged through the bucket
        reserved before the batches (:func:`memguard.guard._distributed.all_reduce_gradients`), and
        ``buffers`` are copied from rank 0 when the DDP wrapper broadcasts buffers.
        """
        rg = self.rank_group
        if rg is None:
            return
        grads = []
        for p, h in zip(self._params, self._had):
            if h:
                if p.grad is None:  # only when run(last=True) was skipped; allocates outside the protected region
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
            else:
                p.grad = None
        if rg.comm_hook is not None:  # gradient compression (memguard.guard._comm_hooks)
            rg.comm_hook.sync(self._params, self._had)
        else:
            ddp_sync.all_reduce_gradients(rg, grads)
        if rg.broadcast_buffers and buffers:
            ddp_sync.broadcast_buffers(rg, buffers)
