"""Turn a :class:`~memguard.estimator._trace.Trace` into a peak and a breakdown.

One general mechanism covers sharding: every category's live bytes are multiplied by a factor
(1 for a single device; ZeRO and offload shrink params, grads and optimizer state) before the
running total is taken, so the peak moves to wherever the scaled timeline peaks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from memguard.estimator._trace import Trace

@dataclass(frozen=True)
class Timeline:
    """The peak of a scaled trace.

    Attributes:
        peak_bytes: max over time of the scaled live bytes.
        peak_index: event index at which it is reached.
        breakdown: scaled live bytes per category at the peak.
        phase_peaks: the peak inside each phase.
        phase_breakdowns: the breakdown at each phase's own peak.
    """

    peak_bytes: int
    peak_index: int
    breakdown: Mapping[str, int]
    phase_peaks: Mapping[str, int]
    phase_breakdowns: Mapping[str, Mapping[str, int]] = None  # type: ignore[assignment]


def scan(
    trace: Trace, factors: Mapping[str, float] | None = None, extra: Mapping[str, int] | None = None
) -> Timeline:
    """Walk the events once, tracking scaled live bytes per category; return the peak.

    Args:
        factors: multiply each category's bytes by this (missing: 1).
        extra: constant bytes per category live during the whole step (DDP buckets, say).
    """
    factors = factors or {}
    extra = {c: int(v) for c, v in (extra or {}).items() if v}
    cats = sorted(set(trace.category))
    index_of = {c: i for i, c in enumerate(cats)}
    scale = [float(factors.get(c, 1.0)) for c in cats]
    cat_idx = [index_of[c] for c in trace.category]
    live = [0.0] * len(cats)
    total = 0.0
    peak, peak_at = -1.0, 0
    peak_live = list(live)
    bounds = sorted((start, name) for name, start in trace.phase_starts.items())
    phase_peaks: dict[str, int] = {}
    phase_live: dict[str, list[float]] = {}
    b = 0
    phase = "setup"
    for i, (handle, nbytes) in enumerate(trace.events):
        while b < len(bounds) and bounds[b][0] <= i:
            phase = bounds[b][1]
            b += 1
        c = cat_idx[handle]
        delta = nbytes * scale[c]
        live[c] += delta
        total += delta
        if total > phase_peaks.get(phase, -1):
            phase_peaks[phase] = int(round(total))
            phase_live[phase] = list(live)
        if total > peak:
            peak, peak_at = total, i
            peak_live = list(live)
    breakdown = {c: int(round(peak_live[index_of[c]])) for c in cats}
    for c, v in extra.items():
        breakdown[c] = breakdown.get(c, 0) + v
    added = sum(extra.values())

    def snapshot(values: list[float]) -> dict[str, int]:
        out = {c: int(round(values[index_of[c]])) for c in cats}
        for c, v in extra.items():
            out[c] = out.get(c, 0) + v
        return out

    return Timeline(
        peak_bytes=sum(breakdown.values()),
        peak_index=peak_at,
        breakdown=breakdown,
        phase_peaks={k: v + added for k, v in phase_peaks.items() if k != "setup"},
        phase_breakdowns={k: snapshot(v) for k, v in phase_live.items() if k != "setup"},
    )


def scaled_events(trace: Trace, factors: Mapping[str, float]) -> list[tuple[int, int]]:
    """The trace's events with each size scaled by its category's factor (for the allocator model)."""
    if not any(f != 1.0 for f in factors.values()):
        return trace.events
    per_handle = [float(factors.get(c, 1.0)) for c in trace.category]
    out = []
    for handle, nbytes in trace.events:
        f = per_handle[handle]
        out.append((handle, nbytes if f == 1.0 else int(nbytes * f)))
    return out
