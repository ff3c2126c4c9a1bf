"""The probe model: the peak of a whole training step predicted from two cheap traces.

A model's repeated blocks are identical, so every quantity of the step is affine in the number of
blocks: traces of the model cut down to 1 and 2 blocks (the *probes*) give the whole model. Every
activation and temporary is proportional to the micro-batch (dim 0) while parameters, gradients
and optimizer state are not, so probes at one micro-batch ``m0`` give any micro-batch.

:class:`ProbeFeatures` holds one probe pair's quantities, extrapolated to the whole model;
:class:`ProbeModel` predicts the peak at micro-batch ``m`` with the first ``k`` blocks
checkpointed and ``accum`` micro-batches accumulated. The planner searches with it and
``memguard.plot`` draws it.

On the CUDA target the caching allocator's rounding, segment sizes and fragmentation are not
affine in anything: a probe's reserved/allocated ratio, measured on tensors the size of a 1-block
model, says little about the whole model. So for CUDA the probe traces are *extended* instead:
:func:`extend_trace` aligns the 1- and 2-block traces, repeats the second block's events until the
trace has every block, scales the batch-proportional tensors to the micro-batch, and the allocator
model (``memguard.estimator._cuda``, through ``memguard.estimator._pricing.estimate_from_trace``) replays the result.
Sizes at other micro-batches come from the extended traces at two micro-batches
(:func:`interpolate_trace`): a tensor's size is affine in the micro-batch. The CPU target uses the
same extended traces (its peak is their live bytes, with no allocator): the moment of the peak
moves with the micro-batch (a small model's optimizer step at micro-batch 8, its backward at 256),
which one set of features at one micro-batch cannot follow. Models without repeated blocks are
traced whole at the two micro-batches.

Known limitations:
    The extension reproduces a whole-model trace event for event on GPT-2, Llama and BERT models
    (checkpointed or not); on models small enough that one 2 MiB allocator segment is several
    percent of the step (a 64-wide, 4-block GPT-2: ~60 MB), checkpointed recomputation can shift
    one segment (~3%). With only some blocks checkpointed, the allocator's overhead is interpolated
    between none and all checkpointed (up to ~10% high on such tiny models). The plan's own
    estimate is always a full trace.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from memguard.estimator._analysis import Timeline

#: Phases that treat every parameter at once (foreach optimizer ops, ``zero_grad``) rather than block by block.
_HORIZONTAL_PHASES = frozenset({"setup", "optimizer", "zero_grad"})

#: Categories whose tensors grow with the micro-batch (every other category is model state).
BATCH_CATEGORIES = frozenset({"activations", "temporaries", "inputs"})


def divisors(n: int) -> list[int]:
    """Every divisor of ``n >= 1``, ascending: the micro-batches that split ``n`` samples evenly."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


@dataclass(frozen=True)
class ProbeFeatures:
    """One probe's (or one extrapolated probe pair's) quantities, in allocated bytes at micro-batch ``m0``.

    Attributes:
        states: params + optimizer state at the forward/backward peak.
        grads_at_peak: gradients live at the forward/backward peak of one micro-batch.
        grads_total: every gradient (live at the peak when micro-batches accumulate).
        act: activations + temporaries + inputs at the forward/backward peak (proportional to the batch).
        opt_peak: the peak of the optimizer step and ``zero_grad`` (batch-independent).
        act_slope: activations one more block adds (0 unless extrapolated from two probes).
    """

    states: float
    grads_at_peak: float
    grads_total: float
    act: float
    opt_peak: float
    act_slope: float = 0.0

    @staticmethod
    def of(timeline: Timeline) -> "ProbeFeatures":
        """The features of one evaluated probe trace (allocated bytes: no allocator, no workspace)."""
        pb = timeline.phase_breakdowns or {}
        fb_phase = max(("forward", "backward"), key=lambda p: timeline.phase_peaks.get(p, -1))
        bd = pb.get(fb_phase, timeline.breakdown)
        opt_phases = [p for p in ("optimizer", "zero_grad") if p in timeline.phase_peaks]
        grads_total = max([pb.get(p, {}).get("grads", 0) for p in opt_phases] + [bd.get("grads", 0)])
        return ProbeFeatures(
            states=bd.get("params", 0) + bd.get("optimizer", 0),
            grads_at_peak=bd.get("grads", 0),
            grads_total=grads_total,
            act=bd.get("activations", 0) + bd.get("temporaries", 0) + bd.get("inputs", 0),
            opt_peak=max([timeline.phase_peaks.get(p, 0) for p in opt_phases] + [0]),
        )

    def extrapolate(self, other: "ProbeFeatures", j1: int, j2: int, n: int) -> "ProbeFeatures":
        """Affine extrapolation from ``j1`` blocks (self) and ``j2`` blocks (other) to ``n``."""
        t = (n - j1) / (j2 - j1)

        def lin(a: float, b: float) -> float:
            return a + t * (b - a)

        return ProbeFeatures(
            states=lin(self.states, other.states),
            grads_at_peak=lin(self.grads_at_peak, other.grads_at_peak),
            grads_total=lin(self.grads_total, other.grads_total),
            act=lin(self.act, other.act),
            opt_peak=lin(self.opt_peak, other.opt_peak),
            act_slope=(other.act - self.act) / (j2 - j1),
        )


#: ``device_peak(m, checkpointed, accumulating)``: the device's peak (CUDA: reserved, workspaces included)
#: of the whole model at micro-batch ``m`` with no block (False) or every block (True) checkpointed, with
#: gradients present from the start (accumulating) or not.
DevicePeak = Callable[[int, bool, bool], int]


@dataclass
class ProbeModel:
    """Predicted peak bytes of a whole training step from probe features.

    Attributes:
        features: the whole model's features without checkpointing.
        features_ckpt: with every block checkpointed, or None when not probed.
        m0: the probes' micro-batch.
        num_blocks: the model's repeated blocks.
        device_peak: the target's peak of the extended probe traces (CUDA: the allocator model's
            reserved bytes; CPU: live bytes; see the module docstring), or None to predict from the
            features alone.
    """

    features: ProbeFeatures
    features_ckpt: ProbeFeatures | None
    m0: int
    num_blocks: int
    device_peak: DevicePeak | None = None

    def allocated(self, m: int, k: int = 0, accum: int = 1) -> int:
        """Predicted allocated (live tensor) bytes at the peak.

        With ``k`` of ``n`` blocks checkpointed the peak is the larger of two moments. At the start
        of backward the ``n - k`` plain blocks hold all their activations and the ``k`` checkpointed
        ones only their inputs: the plain features with ``k`` blocks' worth swapped for the
        checkpointed features' per-block cost. Later, while the checkpointed blocks are recomputed
        (they come first in the model, so last in backward), the plain blocks' activations are
        gone: the checkpointed features cut down to ``k`` blocks, recomputation transient included.
        """
        f_off, f_on, n = self.features, self.features_ckpt, self.num_blocks
        scale = m / self.m0
        if f_on is None or k <= 0 or not n:
            grads = f_off.grads_total if accum > 1 else f_off.grads_at_peak
            return int(max(f_off.states + grads + f_off.act * scale, f_off.opt_peak))
        k = min(k, n)
        act_start = f_off.act + k * (f_on.act_slope - f_off.act_slope)
        act_recompute = f_on.act - (n - k) * f_on.act_slope
        grads_start = f_off.grads_total if accum > 1 else f_off.grads_at_peak
        grads_recompute = f_on.grads_total if accum > 1 else f_on.grads_at_peak
        start = max(f_off.states + grads_start + act_start * scale, f_off.opt_peak)
        recompute = f_on.states + grads_recompute + act_recompute * scale
        return int(max(start, recompute))

    def predict(self, m: int, k: int = 0, accum: int = 1) -> int:
        """Predicted peak bytes on the device at micro-batch ``m``, ``k`` blocks checkpointed.

        Without ``device_peak`` this is :meth:`allocated`. With it, for no block or every block
        checkpointed, it is the target's peak of the extended probe traces (with the gradients
        allocated from the start when micro-batches accumulate); in between, the allocated prediction
        plus the difference between the two, interpolated between those two ends by the share of
        blocks checkpointed.
        """
        base = self.allocated(m, k, accum)
        if self.device_peak is None:
            return base
        n = self.num_blocks
        k = min(max(k, 0), n) if self.features_ckpt is not None else 0
        accumulating = accum > 1
        if k == 0 or not n:
            return self.device_peak(m, False, accumulating)
        if k == n:
            return self.device_peak(m, True, accumulating)

        def overhead(ckpt_all: bool) -> int:
            return self.device_peak(m, ckpt_all, accumulating) - self.allocated(m, n if ckpt_all else 0, accum)

        return base + int(overhead(False) + (overhead(True) - overhead(False)) * k / n)


def extend_trace(one: Any, two: Any, n: int, *, others: Sequence[Any] = ()) -> Any:
    """The trace of ``n`` blocks from traces of the same step with 1 and 2 blocks.

    The two traces are aligned on (allocate or free, category, bytes); the 2-block trace's events
    that the 1-block trace lacks are the second block's (its parameters, forward, backward and
    optimizer updates), and are repeated ``n - 2`` more times in place, each copy with its own
    tensor handles. A copy frees its own copies of the block's tensors; a tensor of the block freed
    outside the block's events is freed with all its copies. Tensors one block hands to the next
    (its output; in backward, the gradient of its input) are freed by the next copy, and backward
    runs the copies last to first, as autograd visits the blocks.

    Args:
        one, two: the step traced with 1 and 2 blocks.
        n: the blocks wanted.
        others: traces of the 2-block step at other micro-batches (the same events as ``two``, other
            sizes): they are extended the same way, event for event.

    Returns:
        A trace like ``two`` with ``n`` blocks' events (a list: that and each of ``others`` extended,
        when ``others`` are given), or None when the alignment finds anything but insertions (the
        2-block trace is not the 1-block trace plus one block) or ``others`` differ from ``two``.
    """
    if others and any(len(o.events) != len(two.events) or any(a[0] != b[0] for a, b in zip(o.events, two.events))
                      for o in others):
        return None
    if n <= 2:
        return [two, *others] if others else two

    def signature(tr: Any) -> list[tuple[bool, str, int]]:
        return [(nbytes > 0, tr.category[h], abs(nbytes)) for h, nbytes in tr.events]

    matcher = difflib.SequenceMatcher(None, signature(one), signature(two), autojunk=False)
    inserted = [False] * len(two.events)
    in_two: dict[int, int] = {}  # event index in `one` -> the same event in `two` (outside the block)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "insert":
            inserted[j1:j2] = [True] * (j2 - j1)
        elif tag == "equal":
            in_two.update(zip(range(i1, i2), range(j1, j2)))
        else:
            return None
    copies = n - 2
    width = len(two.category)
    block_allocs = {h for (h, nbytes), ins in zip(two.events, inserted) if ins and nbytes > 0}
    # Tensors passed from block to block (a block's output, the gradient of its input): in `two` the
    # block frees such a tensor of the block before it (`x1`), and the tensor the block makes in its
    # place (`x2`) is freed where `one` frees its `x1`. Copy c frees copy c-1's `x2`, and the last
    # copy's `x2` is freed where `two` frees `x2`.
    handle_in_two: dict[int, int] = {}
    for i, j in in_two.items():
        if one.events[i][1] > 0:
            handle_in_two[one.events[i][0]] = two.events[j][0]
    relay: dict[int, int] = {}
    for i, j in in_two.items():
        (a, nbytes), b = one.events[i], two.events[j][0]
        if nbytes < 0 and b in block_allocs and handle_in_two.get(a, b) not in block_allocs:
            relay[handle_in_two[a]] = b
    # Backward visits the blocks last to first: there the copies run in reverse (the last block's
    # first), and a tensor relayed backward (the gradient of a block's input, made in backward) goes
    # from each block to the one before it, the first block's to where `two` frees it.
    backward_start = two.phase_starts.get("backward", len(two.events))
    backward_end = min([v for v in two.phase_starts.values() if v > backward_start] + [len(two.events)])
    made_in_backward = {h for e, (h, nbytes) in enumerate(two.events)
                        if nbytes > 0 and backward_start <= e < backward_end}
    backward_relay = {h for h, b in relay.items() if b in made_in_backward}
    relayed_last = {b: (0 if h in backward_relay else copies) for h, b in relay.items()}
    out: list[tuple[int, int]] = []  # (handle, index of the event of `two` it repeats)
    block_handles: set[int] = set()  # handles allocated by the block's events, live now
    starts = {start: name for name, start in two.phase_starts.items()}
    phase_starts: dict[str, int] = {}
    i = 0
    total = len(two.events)
    phase = "setup"
    while i < total:
        if i in starts:
            phase = starts[i]
            phase_starts[phase] = len(out)
        if not inserted[i]:
            h, nbytes = two.events[i]
            if nbytes < 0 and h in relayed_last:  # a relayed tensor of the block that hands it on last
                out.append((h + relayed_last[h] * width, i))
            else:
                out.append((h, i))
                if nbytes < 0 and h in block_handles:  # a block tensor freed outside the block: free every copy
                    block_handles.discard(h)
                    out.extend((h + c * width, i) for c in range(1, copies + 1))
            i += 1
            continue
        j = i
        # In forward and backward a block runs start to end before the next; the optimizer's foreach
        # ops and zero_grad treat every parameter at once, so there copies are repeated per op:
        # runs end where allocations turn to frees or back.
        horizontal = phase in _HORIZONTAL_PHASES
        while j < total and inserted[j] and (j == i or j not in starts) and not (
                horizontal and (two.events[j][1] > 0) != (two.events[i][1] > 0)):
            j += 1
        for e in range(i, j):
            h, nbytes = two.events[e]
            if nbytes > 0:
                block_handles.add(h)
            elif h in block_handles:
                block_handles.discard(h)
        order = list(range(copies, -1, -1)) if phase == "backward" else list(range(copies + 1))
        for c in order:
            for e in range(i, j):
                h, nbytes = two.events[e]
                if nbytes > 0 or h in block_allocs:
                    out.append((h + c * width, e))
                elif h in relay:  # a tensor handed on by the neighbouring block
                    if h in backward_relay:
                        out.append((h if c == copies else relay[h] + (c + 1) * width, e))
                    else:
                        out.append((h if c == 0 else relay[h] + (c - 1) * width, e))
                elif c == order[0]:  # a tensor from outside the blocks: freed once
                    out.append((h, e))
        i = j

    def lin(a: int, b: int) -> int:
        return int(a + (n - 1) * (b - a))

    def extended(tr: Any) -> Any:
        return dataclasses.replace(
            tr, events=[(h, tr.events[e][1]) for h, e in out], category=list(tr.category) * (copies + 1),
            sizes=list(tr.sizes) * (copies + 1), phase_starts=dict(phase_starts),
            num_params=lin(one.num_params, tr.num_params),
            num_trainable_params=lin(one.num_trainable_params, tr.num_trainable_params),
            trainable_param_bytes=lin(one.trainable_param_bytes, tr.trainable_param_bytes),
            num_blocks=n, num_ops=lin(one.num_ops, tr.num_ops), flops=lin(one.flops, tr.flops),
            buffer_handles=[h + c * width for c in range(copies + 1) for h in tr.buffer_handles],
            buffer_source_bytes=lin(one.buffer_source_bytes, tr.buffer_source_bytes),
        )

    return [extended(t) for t in (two, *others)] if others else extended(two)


def scale_trace(trace: Any, factor: float) -> Any:
    """``trace`` with every tensor of :data:`BATCH_CATEGORIES` ``factor`` times as large (another micro-batch)."""
    if factor == 1:
        return trace
    per = [factor if c in BATCH_CATEGORIES else 1.0 for c in trace.category]
    events = [(h, int(nbytes * per[h]) if per[h] != 1.0 else nbytes) for h, nbytes in trace.events]
    return dataclasses.replace(trace, events=events)


def interpolate_trace(a: Any, m_a: int, b: Any, m_b: int, m: int) -> Any:
    """The trace at micro-batch ``m`` from traces ``a`` and ``b`` of the same step at ``m_a`` and ``m_b``.

    Each tensor's size is affine in the micro-batch (its shape has the batch as a factor, or not at
    all): the sizes at ``m`` follow from the two traces event by event. Tensors that do not grow with
    the batch (autocast's weight copies, rotary tables, masks shared by the batch) keep their size.
    Where the two traces' events differ, :func:`scale_trace` scales ``a`` by category instead.
    """
    if m_a == m_b or len(a.events) != len(b.events) or a.category != b.category or any(
            ha != hb for (ha, _), (hb, _) in zip(a.events, b.events)):
        return scale_trace(a, m / m_a)
    t = (m - m_a) / (m_b - m_a)
    events = [(h, sa if sa == sb else (1 if sa > 0 else -1) * max(0, round(abs(sa) + t * (abs(sb) - abs(sa)))))
              for (h, sa), (_, sb) in zip(a.events, b.events)]
    return dataclasses.replace(a, events=events)


def with_gradients_present(trace: Any) -> Any:
    """``trace`` as a micro-batch that starts with every gradient allocated (gradient accumulation).

    Without gradients the backward's gradient of a parameter becomes its ``.grad``; with them, it is
    a temporary that ``AccumulateGrad`` adds into the existing ``.grad`` and frees
    (torch/csrc/autograd/functions/accumulate_grad.h: ``variable_grad += new_grad`` when a gradient
    exists). So each gradient is allocated before the forward, and where the backward made it, a
    temporary of its size comes and goes.
    """
    start = trace.phase_starts.get("forward", 0)
    grads = [(h, n) for h, n in trace.events[start:] if n > 0 and trace.category[h] == "grads"]
    if not grads:
        return trace
    moved = {h for h, _ in grads}
    width = len(trace.category)
    events = list(trace.events[:start]) + grads
    temporaries: list[int] = []
    for h, n in trace.events[start:]:
        if n > 0 and h in moved:
            t = width + len(temporaries)
            temporaries.append(n)
            events += [(t, n), (t, -n)]
        else:
            events.append((h, n))
    # the gradients join the setup; each later phase also moves by one event per temporary before it
    phase_starts = {
        name: i if i < start else i + len(grads) + sum(1 for h, n in trace.events[start:i] if n > 0 and h in moved)
        for name, i in trace.phase_starts.items()
    }
    return dataclasses.replace(
        trace, events=events, category=list(trace.category) + ["temporaries"] * len(temporaries),
        sizes=list(trace.sizes) + temporaries, phase_starts=phase_starts,
    )
