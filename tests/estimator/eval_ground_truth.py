"""The real CPU peak of an evaluation step, measured with the profiler (the eval estimate's ground truth).

Like ``benchmarks.ground_truth.measure_cpu_peak`` for a training step: the bytes live when the
profiler starts (parameters, buffers, the batch, optimizer state when given) plus the running sum of
the CPU allocator's signed ``[memory]`` events (``prof.profiler.kineto_results.events()``) is the
live tensor bytes at every moment; the maximum over the last step is the steady-state peak.
"""

from __future__ import annotations

import gc
from typing import Any, Callable

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from benchmarks.ground_truth import live_state_bytes
from memguard.batch import call_model

_MEMORY_EVENT = "[memory]"  # the name the profiler gives allocator events (torch/csrc/profiler/collection.cpp)


def measure_cpu_eval_peak(model: nn.Module, batch: Any, fn: Callable[[nn.Module, Any], Any] | None = None, *,
                          optimizer: torch.optim.Optimizer | None = None, steps: int = 2) -> int:
    """Run ``steps`` real evaluation steps (``model.eval()``, ``no_grad``, outputs kept until the step
    ends, then dropped) and return the peak live tensor bytes of the last one."""
    model.eval()
    gc.collect()
    was = gc.isenabled()
    gc.disable()  # frees by reference count only, at deterministic points
    try:
        baseline = live_state_bytes(model, batch, optimizer)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            for _ in range(steps):
                with torch.no_grad():
                    out = fn(model, batch) if fn is not None else call_model(model, batch)
                del out
    finally:
        if was:
            gc.enable()
    mem = [(e.start_ns(), i, e.nbytes()) for i, e in enumerate(prof.profiler.kineto_results.events())
           if e.name() == _MEMORY_EVENT]
    mem.sort(key=lambda t: (t[0], t[1]))
    level, peaks = baseline, [baseline]
    for _, _, n in mem:
        level += n
        peaks.append(level)
    # every step allocates and frees the same sequence (the first may add lazily built caches), so
    # the overall peak bounds the steady one; the steady step is checked to return to the baseline
    if level != baseline:
        raise AssertionError(f"an evaluation step leaked {level - baseline} bytes")
    return max(peaks)
