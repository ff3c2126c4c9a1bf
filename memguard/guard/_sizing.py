"""Per-shape sizing: the micro-batch of every batch shape signature a guarded model meets.

Real data does not come in one shape (:mod:`memguard.guard._shapes`), so the guard keeps one
micro-batch per shape signature (:class:`ShapeSizes`). :class:`ShapeSizing` is the half of
:class:`memguard.guard._core.Guard` that chooses them:

* the first signature of a run is the plan's (the batch memguard planned on, else the first one);
* a new signature gets the largest micro-batch, at most the planned one, that probe traces of a
  batch of that signature (padded to the top of its bucket) predict to fit the plan's budget
  (:meth:`ShapeSizing._plan_signature`), capped by every known signature it covers; under DDP rank 0
  chooses and the others follow;
* an OOM halves only the signature that ran out (:meth:`ShapeSizing._record_halving`), and
  ``probe_up_after`` clean steps double a reduced signature back towards its own size
  (:meth:`ShapeSizing._maybe_probe_up`).

The window's own shape bookkeeping (which signatures ran in the open window, and the smallest
micro-batch they ran at) is an :class:`OpenWindow`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from memguard.guard._distributed import RankGroup
from memguard.guard._shapes import (Signature, dims_of, halvings, pad_batch, signature_of, size_bound, snap_to,
                                    uncompiled)

if TYPE_CHECKING:
    from torch import nn

    from memguard.guard._options import GuardOptions
    from memguard.guard._window import MicroBatchWindow
    from memguard.planner.api import Plan

logger = logging.getLogger("memguard")


@dataclass
class ShapeSizes:
    """The micro-batch of every signature seen since the plan was applied.

    Attributes:
        now: the micro-batch each signature uses now, in the order first seen.
        given: the micro-batch each signature was given when first seen.
        clean: each signature's optimizer steps since its last OOM or probe.
        reference: the signature of the batch memguard planned on (kept when a plan is applied again).
        fixed: that batch's dims as they are (:func:`memguard.guard._shapes.dims_of`): a later batch's dim
            equal to its is not bucketed.
    """

    now: dict[Signature, int] = field(default_factory=dict)
    given: dict[Signature, int] = field(default_factory=dict)
    clean: dict[Signature, int] = field(default_factory=dict)
    reference: Signature | None = None
    fixed: Signature | None = None

    def set_reference(self, batch: Any) -> Signature:
        """Make ``batch`` the reference (the batch planned on, or the first one); returns its signature."""
        self.fixed = dims_of(batch)
        self.reference = signature_of(batch, fixed=self.fixed)
        return self.reference

    def forget_sizes(self) -> None:
        """Start again from the planned micro-batch (a plan was applied)."""
        self.now, self.given, self.clean = {}, {}, {}

    def limit(self, n: int) -> None:
        """At most ``n`` samples per micro-batch for every known signature."""
        for sig in self.now:
            self.now[sig] = min(self.now[sig], n)
            self.given[sig] = min(self.given[sig], n)


@dataclass
class OpenWindow:
    """The shapes of the open window.

    Attributes:
        sigs: the signatures of the window's batches so far, in order.
        cap: the smallest micro-batch the window's batches ran at (within a window it never grows).
        current: the signature of the batch running now (or last).
    """

    sigs: list[Signature] = field(default_factory=list)
    cap: int | None = None
    current: Signature | None = None


class ShapeSizing:
    """The per-shape sizing of :class:`memguard.guard._core.Guard` (see the module docstring).

    It reads the guard's plan, planned micro-batch (``ceiling``), rank group and options, and keeps
    its own state in ``shapes`` and ``open``; ``_context`` is what planning a new signature needs
    (set by :meth:`memguard.guard._core.Guard.make_plan`, or by applying a given plan).
    """

    # what the guard provides
    plan: Plan | None
    ceiling: int | None
    rank_group: RankGroup | None
    options: GuardOptions
    window: MicroBatchWindow | None
    module: nn.Module
    compiled: bool
    # the sizing's own state
    shapes: ShapeSizes
    open: OpenWindow
    _context: dict[str, Any] | None
    signatures_planned: int
    signature_planning_seconds: float
    _warned_signature_planning: bool
    _planning_signature: bool

    def _init_sizing(self) -> None:
        """Start with no signature seen (the guard's ``__init__`` calls it)."""
        self.shapes = ShapeSizes()
        self.open = OpenWindow()
        self._context = None  # what planning a new signature needs (see make_plan)
        self.signatures_planned = 0
        self.signature_planning_seconds = 0.0
        self._warned_signature_planning = False
        self._planning_signature = False

    def _agreed_signature(self, batch: Any) -> Signature:
        """The batch's signature; under DDP the element-wise largest of the ranks' (one small all-reduce)."""
        if self.shapes.fixed is None:
            self.shapes.fixed = dims_of(batch)  # the first batch's dims; a plan's batch sets them before
        sig = signature_of(batch, fixed=self.shapes.fixed)
        rg = self.rank_group
        if rg is None or rg.world_size == 1:
            return sig
        return sig.with_flat(_agree_values(rg, sig.flat()))

    def _size_for(self, sig: Signature, batch: Any) -> int:
        """The micro-batch of signature ``sig``, chosen when it is first seen (on rank 0 under DDP).

        The first signature of a run is the plan's: the batch memguard planned on, else (a given plan or
        ``micro_batch_size=``) the first batch's. A new signature gets the largest micro-batch, at most the
        planned one, that the probe model of a batch of that signature (padded to the top of its bucket)
        predicts to fit the plan's budget with the plan's precision, checkpointing and sharding
        (:meth:`_plan_signature`); without a plan's budget, or when that fails, the planned one; a
        signature covered by a known one that runs at the planned micro-batch gets it without planning.
        Either is then capped by the micro-batch of every known signature it covers (memory never falls
        when a dim grows, so a signature needs at most the micro-batch of one it covers), and under
        ``torch.compile`` rounded down to a halving of the planned micro-batch.
        """
        if sig in self.shapes.now:
            return self.shapes.now[sig]
        rg = self.rank_group
        if rg is not None and rg.world_size > 1:
            mine = self._decide(sig, batch) if rg.rank == 0 else 0
            size = _agree_values(rg, [mine])[0]  # rank 0's choice (the others send 0)
        else:
            size = self._decide(sig, batch)
        self.shapes.now[sig] = self.shapes.given[sig] = size
        if self.shapes.reference is None:
            self.shapes.reference = sig
        if len(self.shapes.now) > 1:
            logger.info("new batch shape %s: micro-batch %d (planned %d for %s)", sig, size, self.ceiling,
                        self.shapes.reference)
        return size

    def _decide(self, sig: Signature, batch: Any) -> int:
        base = self.ceiling
        assert base is not None  # a plan or micro_batch_size was applied before the first batch
        if not self.shapes.now and (self.shapes.reference is None or sig == self.shapes.reference):
            return base
        size = base
        # a shape that a known one covers and that runs at the planned micro-batch fits it too: no planning
        covered = any(other.covers(sig) and m >= base for other, m in self.shapes.now.items())
        if sig != self.shapes.reference and not covered:
            planned = self._plan_signature(sig, batch, base)
            if planned is not None:
                size = planned
        bound = size_bound(sig, self.shapes.now)
        if bound is not None:
            size = min(size, bound)
        if self.compiled:
            size = snap_to(size, halvings(base))
        return max(1, size)

    def _plan_signature(self, sig: Signature, batch: Any, base: int) -> int | None:
        """The largest micro-batch up to ``base`` predicted to fit the plan's budget for batches of ``sig``.

        :func:`memguard.planner.api.fit_shape` on a batch of ``sig`` (padded to the top of its buckets),
        with the plan and the step the guard planned with; under ``torch.compile`` only halvings of
        ``base`` are tried. None when nothing can be planned (no plan, or the trace fails: logged once).
        Where the prediction is low (see ``fit_shape``'s known limitations), the OOM retry is the backstop.
        """
        plan, ctx = self.plan, self._context
        if plan is None or ctx is None:
            return None
        from memguard.planner.api import fit_shape

        start = time.perf_counter()
        self._planning_signature = True
        try:
            size = fit_shape(uncompiled(self.module), pad_batch(batch, sig), plan, most=base,
                             optimizer=ctx["optimizer"], loss_fn=ctx["loss_fn"],
                             keep_outputs=ctx["options"].get("keep_outputs", False),
                             sizes=halvings(base) if self.compiled else None)
        except Exception as exc:  # noqa: BLE001 - planning a shape must never stop training
            if not self._warned_signature_planning:
                logger.warning("could not plan the micro-batch of batch shape %s: memguard traced a probe batch padded "
                               "to that shape from this batch's %s, and the trace failed (%s); it starts from the "
                               "planned micro-batch and is halved on an out-of-memory error", sig, dims_of(batch), exc)
                self._warned_signature_planning = True
            return None
        finally:
            self._planning_signature = False
            self.signature_planning_seconds += time.perf_counter() - start
        self.signatures_planned += 1
        logger.debug("planned batch shape %s in %.2f s: micro-batch %d", sig, time.perf_counter() - start, size)
        return size

    def _record_halving(self, sig: Signature, window: MicroBatchWindow) -> None:
        """An OOM halved the window's micro-batch while ``sig`` ran: only ``sig``'s micro-batch is halved
        (under ``torch.compile`` to a halving of the planned one)."""
        new = window.micro_batch_size
        if self.compiled and self.ceiling is not None:
            new = window.micro_batch_size = snap_to(new, halvings(self.ceiling))
        self.shapes.now[sig] = min(self.shapes.now[sig], new)

    def _count_window(self, retried: bool) -> None:
        """The open window's optimizer step is done: count a clean step for each of its signatures."""
        for sig in self.open.sigs:
            self.shapes.clean[sig] = 0 if retried else self.shapes.clean.get(sig, 0) + 1
        self._maybe_probe_up()

    def _maybe_probe_up(self) -> None:
        """Double a reduced micro-batch after ``probe_up_after`` clean steps of its signature, up to the
        micro-batch that signature was given."""
        every, window = self.options.probe_up_after, self.window
        if every is None or window is None:
            return
        for sig in self.open.sigs:
            mbs, given = self.shapes.now.get(sig), self.shapes.given.get(sig)
            if mbs is None or given is None or mbs >= given or self.shapes.clean.get(sig, 0) < every:
                continue
            new = min(given, mbs * 2)
            logger.info("%d steps of batch shape %s without an out-of-memory error; probing micro-batch %d -> %d",
                        self.shapes.clean[sig], sig, mbs, new)
            self.shapes.now[sig] = new
            self.shapes.clean[sig] = 0
            if sig == self.open.current:
                window.micro_batch_size = new


def _agree_values(rg: RankGroup, values: Sequence[int]) -> list[int]:
    """The element-wise maximum of ``values`` over the ranks: the rank group's own agreement where it has one
    (FSDP2's, which survives a peer's teardown), else :func:`memguard.guard._distributed.agree`."""
    from memguard.guard import _distributed as ddp_sync

    own = getattr(rg, "agree", None)
    if callable(own):
        return list(own(ddp_sync.OK, values)[1])
    return ddp_sync.agree(rg, ddp_sync.OK, values)[1]
