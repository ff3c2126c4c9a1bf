"""Real CPU ground truth: the peak of live tensor bytes during actual training steps.

:func:`measure_cpu_peak` runs real training steps (forward + loss, backward, ``optimizer.step()``,
``optimizer.zero_grad(set_to_none=True)``) under ``torch.profiler`` with ``profile_memory=True``.
Every allocation and free of the CPU allocator appears in the profiler's trace as a ``[memory]``
event whose ``nbytes()`` is signed (positive = allocation, negative = free). The bytes already
live when the profiler starts (parameters, buffers, the batch, existing gradients and optimizer
state, each storage counted once) plus the running sum of those events in time order is the
number of live tensor bytes at every moment; its maximum is the peak.

The model is called exactly as ``memguard.estimate`` calls it when no ``loss_fn`` is given:
see :func:`default_loss`.
"""

from __future__ import annotations

import bisect
import gc
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

from memguard.batch import call_model, loss_from_output

__all__ = [
    "GroundTruth",
    "PHASES",
    "default_loss",
    "live_state_bytes",
    "measure_cpu_peak",
    "measure_op_memory",
    "measure_repeated",
]

#: Phases of one training step, in order; the names match ``Estimate.peak_phase``.
PHASES = ("forward", "backward", "optimizer", "zero_grad")

_PREFIX = "memguard_gt::"  # prefix of our record_function ranges, so model ranges cannot collide
_MEMORY_EVENT = "[memory]"  # name the profiler gives allocator events (torch/csrc/profiler/collection.cpp)


@dataclass(frozen=True)
class GroundTruth:
    """What :func:`measure_cpu_peak` measured.

    Attributes:
        peak_bytes: the peak of live tensor bytes over all measured steps.
        steady_peak_bytes: the peak of the last step alone (the steady state once optimizer
            state exists; step 1 creates it lazily).
        peak_phase: the phase of the last step in which ``steady_peak_bytes`` was reached
            (one of :data:`PHASES`, or ``"unknown"``).
        step_peaks: the peak of each step, in order.
        phase_peaks: for the last step, the peak inside each phase.
        phase_end_bytes: for the last step, the live bytes when each phase ended (e.g. after
            ``forward``: state plus everything saved for backward plus the loss).
        baseline_bytes: live bytes when the profiler started (params, buffers, batch, grads,
            optimizer state; shared storages once).
        end_bytes: the same accounting after the last step.
        residual_bytes: ``baseline + sum(events) - end_bytes``: bytes allocated during the steps
            and still live but not reachable from the model, batch or optimizer (caches, leaks,
            garbage held by reference cycles). 0 for a clean step.
        num_memory_events: allocator events seen.
        seconds: wall time of the measured steps (profiler overhead included).
        steps: number of steps measured.
    """

    peak_bytes: int
    steady_peak_bytes: int
    peak_phase: str
    step_peaks: tuple[int, ...]
    phase_peaks: Mapping[str, int]
    baseline_bytes: int
    end_bytes: int
    residual_bytes: int
    num_memory_events: int
    seconds: float
    steps: int
    step_peak_phases: tuple[str, ...] = field(default_factory=tuple)
    phase_end_bytes: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "phase_peaks", MappingProxyType(dict(self.phase_peaks)))
        object.__setattr__(self, "phase_end_bytes", MappingProxyType(dict(self.phase_end_bytes)))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "peak_bytes": self.peak_bytes,
            "steady_peak_bytes": self.steady_peak_bytes,
            "peak_phase": self.peak_phase,
            "step_peaks": list(self.step_peaks),
            "step_peak_phases": list(self.step_peak_phases),
            "phase_peaks": dict(self.phase_peaks),
            "phase_end_bytes": dict(self.phase_end_bytes),
            "baseline_bytes": self.baseline_bytes,
            "end_bytes": self.end_bytes,
            "residual_bytes": self.residual_bytes,
            "num_memory_events": self.num_memory_events,
            "seconds": self.seconds,
            "steps": self.steps,
        }


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """Call ``model`` with ``batch`` the way ``memguard.estimate`` does when ``loss_fn`` is None.

    A dict (any Mapping) batch is passed as keyword arguments, a tuple or list as positional
    arguments, anything else (a tensor) as the single argument. The loss is ``output.loss`` when
    the output has one (transformers' ``ModelOutput``, a dict with ``"loss"``), else the output
    itself when it is a one-element tensor. Only the loss is returned: the rest of the output
    (logits, hidden states) is dropped before backward, as in a training loop that keeps only
    the loss.

    Args:
        model: the module to call.
        batch: one micro-batch: a tensor, or a tuple/list/dict of tensors.

    Returns:
        The scalar loss tensor.

    Raises:
        TypeError: the output has no ``loss`` and is not a one-element tensor.
    """
    if isinstance(batch, Mapping):
        output = model(**batch)
    elif isinstance(batch, (tuple, list)):
        output = model(*batch)
    else:
        output = model(batch)
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if loss is None and isinstance(output, torch.Tensor) and output.numel() == 1:
        loss = output
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"{type(model).__name__} returned {type(output).__name__} with no `loss` and no scalar "
            "value; pass labels in the batch or give a loss_fn(model, batch)"
        )
    return loss


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside nested dicts, lists, tuples and sets."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from tensors_in(value)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for value in obj:
            yield from tensors_in(value)


def _unique_storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Sum of the bytes of the distinct CPU storages behind ``tensors``."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if t.device.type != "cpu" or t.is_sparse:
            continue
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or ptr in seen:
            continue
        seen.add(ptr)
        total += nbytes
    return total


def live_state_bytes(model: nn.Module, batch: Any, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Bytes of the distinct storages of params, buffers, grads, the batch and optimizer state.

    Args:
        model: the module.
        batch: the micro-batch (a tensor or nested containers of tensors).
        optimizer: its state tensors and tensor hyper-parameters are counted too.

    Returns:
        The bytes those tensors occupy, each storage counted once (tied weights, views).
    """

    def everything() -> Iterator[torch.Tensor]:
        for p in model.parameters():
            yield p
            if p.grad is not None:
                yield p.grad
        yield from model.buffers()
        yield from tensors_in(batch)
        if optimizer is not None:
            yield from tensors_in(list(optimizer.state.values()))
            yield from tensors_in([{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups])

    return _unique_storage_bytes(everything())


def _check_cpu(model: nn.Module, batch: Any) -> None:
    devices = {t.device.type for t in [*model.parameters(), *model.buffers(), *tensors_in(batch)]}
    if devices - {"cpu"}:
        raise ValueError(f"measure_cpu_peak needs a model and batch on the CPU, found {sorted(devices)}")


def _ranges(events: list[Any]) -> dict[str, list[tuple[int, int]]]:
    """``{name: [(start_ns, end_ns), ...]}`` of our record_function ranges, in time order."""
    out: dict[str, list[tuple[int, int]]] = {}
    for e in events:
        name = e.name()
        if name.startswith(_PREFIX):
            out.setdefault(name[len(_PREFIX):], []).append((e.start_ns(), e.end_ns()))
    for spans in out.values():
        spans.sort()
    return out


def measure_cpu_peak(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None,
    optimizer: torch.optim.Optimizer,
    steps: int = 2,
    *,
    keep_outputs: bool = False,
) -> GroundTruth:
    """Run ``steps`` real CPU training steps and measure the peak of live tensor bytes.

    Each step: ``loss = loss_fn(model, batch)`` (or :func:`default_loss`), ``loss.backward()``,
    ``optimizer.step()``, ``optimizer.zero_grad(set_to_none=True)``. With ``keep_outputs`` the
    step is the hand-written loop ``out = model(**batch); loss = out.loss; loss.backward(); ...``,
    whose ``out`` lives until the next step's ``out = ...`` rebinds it (what
    ``memguard.estimate(..., keep_outputs=True)`` models). Python's cyclic garbage
    collector is paused during the steps so frees happen deterministically, by reference count.
    Gradients left on the parameters are dropped first (as the previous step's
    ``zero_grad(set_to_none=True)`` would have), because the profiler cannot see the size of
    a block freed during profiling that was allocated before it started.

    Args:
        model: a module on the CPU, in the mode to measure (usually ``train()``).
        batch: one micro-batch on the CPU.
        loss_fn: ``loss_fn(model, batch) -> scalar``, or None to call the model directly.
        optimizer: a constructed optimizer over the model's parameters.
        steps: steps to run; the last one is the steady state when ``steps >= 2``.
        keep_outputs: keep the model's output object between steps, as above (needs
            ``loss_fn=None``: the loss is read from the output).

    Returns:
        A :class:`GroundTruth`. The model's weights and the optimizer state are updated.

    Raises:
        ValueError: ``steps < 1``, a tensor is not on the CPU, or ``keep_outputs`` with a ``loss_fn``.

    Known limitations:
        Counts what goes through PyTorch's CPU allocator (every tensor); memory that libraries
        allocate themselves (oneDNN scratch space, Python objects) is not counted. Bytes live
        at the start that are unreachable from the model, batch and optimizer (e.g. tensors a
        module cached on an earlier call) are not in ``baseline_bytes``. A tensor counted in
        the baseline that the step frees and replaces (not in place) makes ``residual_bytes``
        positive, because its free carries no size; a clean measurement has residual 0.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if keep_outputs and loss_fn is not None:
        raise ValueError("keep_outputs=True reads the loss from the model's output; pass loss_fn=None")
    _check_cpu(model, batch)
    compute = loss_fn if loss_fn is not None else default_loss

    # The CPU allocator reports the size of a free only for blocks allocated while profiling
    # (c10/core/CPUAllocator.cpp warns "Memory block of unknown size was allocated before the
    # profiling started"), so gradients that zero_grad would free in step 1 must not predate it.
    for p in model.parameters():
        p.grad = None
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        baseline = live_state_bytes(model, batch, optimizer)
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = None
            for i in range(steps):
                with record_function(f"{_PREFIX}step{i}"):
                    with record_function(f"{_PREFIX}forward"):
                        if keep_outputs:
                            out = call_model(model, batch)  # rebinding frees the previous step's output
                            loss = loss_from_output(out)
                        else:
                            loss = compute(model, batch)
                    with record_function(f"{_PREFIX}backward"):
                        loss.backward()
                    with record_function(f"{_PREFIX}optimizer"):
                        optimizer.step()
                    with record_function(f"{_PREFIX}zero_grad"):
                        optimizer.zero_grad(set_to_none=True)
                    del loss
            del out
        seconds = time.perf_counter() - t0
        end = live_state_bytes(model, batch, optimizer)
    finally:
        if was_enabled:
            gc.enable()

    events = prof.profiler.kineto_results.events()
    ranges = _ranges(events)
    # stable sort by time keeps the recording order of events with equal timestamps
    mem = sorted(
        ((e.start_ns(), i, e.nbytes()) for i, e in enumerate(events) if e.name() == _MEMORY_EVENT),
        key=lambda x: (x[0], x[1]),
    )
    times = [t for t, _, _ in mem]
    levels: list[int] = []
    level = baseline
    for _, _, nbytes in mem:
        level += nbytes
        levels.append(level)

    def level_before(t: int) -> int:
        k = bisect.bisect_left(times, t)
        return levels[k - 1] if k else baseline

    def level_at(t: int) -> int:
        k = bisect.bisect_right(times, t)
        return levels[k - 1] if k else baseline

    def peak_in(start: int, stop: int) -> tuple[int, int]:
        """(peak, time of peak) over [start, stop], counting the level at ``start``."""
        best, when = level_before(start), start
        lo, hi = bisect.bisect_left(times, start), bisect.bisect_right(times, stop)
        for k in range(lo, hi):
            if levels[k] > best:
                best, when = levels[k], times[k]
        return best, when

    def phase_at(t: int) -> str:
        for phase in PHASES:
            for start, stop in ranges.get(phase, []):
                if start <= t <= stop:
                    return phase
        return "unknown"

    step_spans = [ranges[f"step{i}"][0] for i in range(steps)]
    step_peaks, step_phases = [], []
    for start, stop in step_spans:
        best, when = peak_in(start, stop)
        step_peaks.append(best)
        step_phases.append(phase_at(when))

    last_start, last_stop = step_spans[-1]
    phase_peaks, phase_end = {}, {}
    for phase in PHASES:
        for start, stop in ranges.get(phase, []):
            if last_start <= start and stop <= last_stop:
                phase_peaks[phase] = peak_in(start, stop)[0]
                phase_end[phase] = level_at(stop)

    final_level = levels[-1] if levels else baseline
    return GroundTruth(
        peak_bytes=max(step_peaks),
        steady_peak_bytes=step_peaks[-1],
        peak_phase=step_phases[-1],
        step_peaks=tuple(step_peaks),
        step_peak_phases=tuple(step_phases),
        phase_peaks=phase_peaks,
        phase_end_bytes=phase_end,
        baseline_bytes=baseline,
        end_bytes=end,
        residual_bytes=final_level - end,
        num_memory_events=len(mem),
        seconds=seconds,
        steps=steps,
    )


def measure_repeated(
    build: Callable[[], tuple[nn.Module, Any, Any]],
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    repeats: int = 2,
    steps: int = 2,
) -> tuple[list[GroundTruth], int]:
    """Measure a freshly built setup ``repeats`` times in this process, to check stability.

    Args:
        build: ``build() -> (model, batch, loss_fn)`` returning a new, identical setup each call.
        make_optimizer: ``make_optimizer(params) -> Optimizer``.
        repeats: how many measurements.
        steps: steps per measurement.

    Returns:
        The measurements and the spread (max - min) of their steady-state peaks, in bytes.
    """
    results = []
    for _ in range(repeats):
        model, batch, loss_fn = build()
        optimizer = make_optimizer(model.parameters())
        results.append(measure_cpu_peak(model, batch, loss_fn, optimizer, steps=steps))
        del model, batch, loss_fn, optimizer
        gc.collect()
    peaks = [r.steady_peak_bytes for r in results]
    return results, max(peaks) - min(peaks)


def measure_op_memory(op: Callable[..., torch.Tensor], make_inputs: Callable[[str], tuple], *, warmup: int = 1):
    """What one real CPU op allocates, forward then backward, in the form of
    :func:`memguard.estimator._op_memory.modelled_op_memory` (bytes relative to the inputs).

    The backward is driven by a pre-built ``ones`` gradient, as the modelled measurement drives it;
    ``warmup`` calls first build oneDNN's primitives (their caches are not per-call memory).
    """
    from memguard.estimator._op_memory import OpMemory, _signed_walk

    inputs = make_inputs("cpu")
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    out = op(*inputs)
    grad = torch.ones_like(out)
    for _ in range(warmup):
        op(*inputs).backward(grad)
    del out
    for t in leaves:
        t.grad = None
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function(_PREFIX + "forward"):
            out = op(*inputs)
        with record_function(_PREFIX + "backward"):
            out.backward(grad)
    fwd_range = bwd_range = None
    for e in prof.profiler.kineto_results.events():
        if e.name() == _PREFIX + "forward":
            fwd_range = (e.start_ns(), e.end_ns())
        elif e.name() == _PREFIX + "backward":
            bwd_range = (e.start_ns(), e.end_ns())
    fwd, bwd = [], []
    for e in prof.profiler.kineto_results.events():
        if e.name() != _MEMORY_EVENT:
            continue
        if fwd_range[0] <= e.start_ns() <= fwd_range[1]:
            fwd.append(e.nbytes())
        elif bwd_range[0] <= e.start_ns() <= bwd_range[1]:
            bwd.append(e.nbytes())

    fpeak, fkept = _signed_walk(fwd)
    bpeak, bkept = _signed_walk(bwd)
    return OpMemory(fpeak, fkept, bpeak, bkept, tuple(n for n in fwd + bwd if n > 0))
