"""FSDP2 on CPU: ``memguard.estimate(strategy="fsdp2")`` against real multi-rank gloo runs.

Each case shards a small HF model (GPT-2 or Llama, built from a config) with ``fully_shard`` on
every repeated block and then the root — the layout ``memguard.integrations.fsdp.apply`` uses —
over ``world_size`` gloo ranks on this machine (one process per rank, ``init_device_mesh("cpu")``),
in fp32 or with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, with
``reshard_after_forward`` True (sharding level 3) or False (level 2), with or without activation
checkpointing of every block. Every rank runs one warm-up step, then ``--steps`` steps under
``torch.profiler`` (``profile_memory=True``): its live tensor bytes are the bytes live when the
profiler starts (its parameter shards, optimizer state and batch: each storage once) plus the
running sum of the signed ``[memory]`` events, as :mod:`benchmarks.ground_truth` measures a single
process, with every collective settled (:func:`benchmarks.common.settle_collectives`: waited on, then
a 2 ms pause, so that gloo's worker thread never drops a buffer's last reference unseen). The real peak of a case is the worst rank's peak over ``--runs`` runs (fresh processes
each: the peak moves with thread timing); it is compared with the estimate for the same rank
count, and with what ``zero_stage=3`` without ``strategy`` (DeepSpeed's ZeRO-3 estimators, the
stand-in before FSDP2 was modelled) predicts.

Usage::

    python benchmarks/fsdp2_cpu.py                       # every case, 3 runs each
    python benchmarks/fsdp2_cpu.py --cases gpt2-w2-fp32-r3 --runs 3

Writes ``fsdp2_cpu.json`` and ``fsdp2_cpu.md`` to ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))  # `benchmarks` from this checkout when run by path
from benchmarks.common import MultiRankBenchmark, launch_ranks, settle_collectives  # noqa: E402

_MIB = 1 << 20
_MEMORY_EVENT = "[memory]"  # the profiler's allocator events (torch/csrc/profiler/collection.cpp)
_PREFIX = "fsdp2_cpu::"  # our record_function ranges


@dataclass(frozen=True)
class Case:
    """One configuration: model, ranks, precision, sharding level, checkpointing, batch."""

    model: str  # "gpt2" or "llama"
    world_size: int
    precision: str  # "32-true" or "bf16-mixed"
    zero_stage: int  # 3: reshard_after_forward=True; 2: False
    checkpointing: bool
    batch: int = 2
    seq: int = 64

    @property
    def name(self) -> str:
        p = "fp32" if self.precision == "32-true" else "bf16"
        return f"{self.model}-w{self.world_size}-{p}-r{self.zero_stage}" + ("-ckpt" if self.checkpointing else "")


def all_cases() -> dict[str, Case]:
    """Every combination at 2 ranks; at 4 ranks each model and precision at both levels without
    checkpointing and at level 3 with it (keeps a full run to about an hour on 2 shared cores)."""
    out = {}
    for world in (2, 4):
        for model in ("gpt2", "llama"):
            for precision in ("32-true", "bf16-mixed"):
                for stage in (3, 2):
                    for ckpt in (False, True):
                        if world == 4 and ckpt and stage == 2:
                            continue
                        c = Case(model, world, precision, stage, ckpt)
                        out[c.name] = c
    return out


def build_model(name: str, device: str = "cpu"):
    """A small HF model from its config (nothing downloaded), on ``device`` ("meta": no memory)."""
    import torch
    import transformers

    if name == "gpt2":
        cfg = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=2048, n_positions=256)
        cls = transformers.GPT2LMHeadModel
    elif name == "llama":
        cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=2048,
                                       max_position_embeddings=256)
        cls = transformers.LlamaForCausalLM
    else:
        raise ValueError(f"unknown model {name!r}")
    torch.manual_seed(0)
    with torch.device(device):
        return cls(cfg)


def make_batch(case: Case):
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 2048, (case.batch, case.seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def estimate_case(case: Case, *, strategy: str | None = "fsdp2") -> dict[str, Any]:
    """memguard's estimate for ``case`` (``strategy=None, zero_stage=3``: the DeepSpeed stand-in)."""
    import memguard

    model = build_model(case.model, "meta")
    t0 = time.perf_counter()
    est = memguard.estimate(model, make_batch(case), device="cpu", precision=case.precision,
                            zero_stage=case.zero_stage if strategy else 3, world_size=case.world_size,
                            strategy=strategy, activation_checkpointing=case.checkpointing)
    return {"peak_bytes": int(est.peak_bytes), "peak_phase": est.peak_phase, "breakdown": dict(est.breakdown),
            "phase_peaks": dict(est.phase_peaks), "seconds": round(time.perf_counter() - t0, 2)}


# --------------------------------------------------------------------------------------------
# one rank (run in its own process)
# --------------------------------------------------------------------------------------------


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        t = getattr(t, "_local_tensor", t)  # a DTensor's memory is its local shard
        st = t.untyped_storage()
        if st.nbytes() and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def _live_bytes(model, batch, optimizer) -> int:
    """Bytes of the distinct storages of the parameter shards, buffers, grads, batch and optimizer state."""
    import torch

    def everything():
        for p in model.parameters():
            yield p
            if p.grad is not None:
                yield p.grad
        yield from model.buffers()
        yield from batch.values()
        for state in optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))

    return _storage_bytes(everything())


def profiled_steps(model: Any, batch: dict, optimizer: Any, forward: Any, steps: int) -> dict[str, Any]:
    """One warm-up training step, then ``steps`` steps under the profiler; this rank's replayed peaks.

    A step is ``forward()`` (which returns the loss), its backward, ``optimizer.step()`` and
    ``zero_grad(set_to_none=True)``, each in a ``record_function`` range under :data:`_PREFIX`. The
    warm-up makes the lazy inits and the optimizer's state; then the garbage collector is off (frees by
    reference count only, as in the estimator's trace), the ranks meet, and the live bytes when
    profiling starts (:func:`_live_bytes`) are the baseline of :func:`_replay`.

    Returns:
        ``peak_bytes`` (the peak of the steps whose replay saw every free; all steps' when none did),
        ``phase_peaks``, ``step_peaks``, ``raw_step_peaks``, ``suspect_steps``, ``baseline_bytes``,
        ``residual_bytes`` (replayed level at the end minus the live bytes then) and ``seconds``.
    """
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    def step():
        with record_function(_PREFIX + "step"):
            with record_function(_PREFIX + "forward"):
                loss = forward()
            with record_function(_PREFIX + "backward"):
                loss.backward()
            with record_function(_PREFIX + "optimizer"):
                optimizer.step()
            with record_function(_PREFIX + "zero_grad"):
                optimizer.zero_grad(set_to_none=True)

    step()
    gc.collect()
    gc.disable()
    dist.barrier()
    baseline = _live_bytes(model, batch, optimizer)
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(steps):
            step()
    seconds = time.perf_counter() - t0
    end = _live_bytes(model, batch, optimizer)
    gc.enable()
    level, phase_peaks, step_peaks, raw_peaks, suspect = _replay(prof, baseline)
    peak = max([p for k, p in enumerate(step_peaks) if k not in suspect] or step_peaks)
    return {"peak_bytes": peak, "phase_peaks": phase_peaks, "step_peaks": step_peaks, "raw_step_peaks": raw_peaks,
            "suspect_steps": suspect, "baseline_bytes": baseline, "residual_bytes": level - end,
            "seconds": round(seconds, 2)}


def _rank_worker(case: Case, steps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from memguard.estimator._blocks import apply_activation_checkpointing
    from memguard.estimator._fsdp2 import FSDP2Layout, shard_model
    from memguard.vocab import ALL_BLOCKS

    torch.set_num_threads(1)
    # every collective waited on, then a 20 ms pause (2 ms was not enough on a loaded machine): gloo's worker
    # thread lets go of the collective's buffers before the main thread does, so their frees are seen
    # (unsettled, a loaded machine left one rank ~2.5 MB high at random)
    settle_collectives(pause_s=0.02)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (case.world_size,))
    model = build_model(case.model)
    model.train()
    if case.checkpointing:
        apply_activation_checkpointing(model, ALL_BLOCKS)
    mp = torch.bfloat16 if case.precision == "bf16-mixed" else None
    shard_model(model, FSDP2Layout(world_size=case.world_size, zero_stage=case.zero_stage, mp_dtype=mp), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = make_batch(case)
    result = profiled_steps(model, batch, optimizer, lambda: model(**batch).loss, steps)
    dist.destroy_process_group()
    return {"rank": rank, **result}


#: A block freed unseen makes the steps it spans suspect from this size on: smaller ones move the peak of
#: these cases (tens of MB) by under 0.2%, and small frees on gloo's thread are common.
_SUSPECT_BYTES = 64 * 1024


def _replay(prof: Any, baseline: int) -> tuple[int, dict[str, int], list[int], list[int], list[int]]:
    """Live bytes over the profiled steps, from the allocator events of the profiler's event tree.

    The CPU allocator reports an allocation or a free to the profiler only on a thread where
    profiling is on (``memoryProfilingEnabled()`` is thread-local; c10/core/CPUAllocator.cpp). gloo's
    reduce-scatter clones its input on the calling thread and the clone is released by whichever
    thread drops the work last (torch/csrc/distributed/c10d/ProcessGroupGloo.cpp,
    ``reduce_scatter_tensor_coalesced``), often gloo's worker thread, where the free goes unreported
    and a running sum would drift up by one clone per reduce-scatter. So the replay tracks blocks by
    address: a block allocated inside a reduce-scatter op that is still live when the op returns is
    freed there (the work is complete when a synchronous collective returns), and an allocation at
    the address of a block still thought live means that block was freed unseen. The level was then
    high by that block from the unseen free (some time after the block's allocation) to the reuse, so
    every step that overlaps that interval is *suspect* (for a block of ``_SUSPECT_BYTES`` or more): its
    peak may be inflated.

    Returns:
        The final level, each phase's peak, each step's peak, each step's peak by the plain running
        sum of ``[memory]`` events (for comparison), and the indices of the suspect steps.
    """
    allocs: list[tuple[int, int, int, int]] = []  # (time, order, ptr, signed bytes)
    rs_end: dict[int, int] = {}  # order of an allocation made inside a reduce-scatter -> the op's end
    spans: list[tuple[int, int, str]] = []

    def walk(node: Any, rs: int | None) -> None:
        kind = type(node.extra_fields).__name__
        name = node.name
        if kind == "_ExtraFields_Allocation":
            order = len(allocs)
            allocs.append((node.start_time_ns, order, node.extra_fields.ptr, node.extra_fields.alloc_size))
            if rs is not None and node.extra_fields.alloc_size > 0:
                rs_end[order] = rs
            return
        if name.startswith(_PREFIX):
            spans.append((node.start_time_ns, node.end_time_ns, name[len(_PREFIX):]))
        if "reduce_scatter" in name:
            rs = node.end_time_ns
        for child in node.children:
            walk(child, rs)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, None)
    # synthetic frees at the end of the reduce-scatter op that allocated the block
    timeline = sorted([(t, 0, o, ptr, n) for t, o, ptr, n in allocs]
                      + [(rs_end[o], 1, o, ptr, -n) for t, o, ptr, n in allocs if o in rs_end])
    steps = sorted((a, b) for a, b, name in spans if name == "step")
    phases = [(a, b, name) for a, b, name in spans if name != "step"]
    live: dict[int, tuple[int, int, int]] = {}  # ptr -> (allocation order, bytes, allocation time)
    suspect: set[int] = set()
    level = baseline
    raw = baseline
    phase_peaks: dict[str, int] = {}
    step_peaks = [baseline] * len(steps)
    raw_peaks = [baseline] * len(steps)
    for t, synthetic, order, ptr, nbytes in timeline:
        if synthetic:
            if live.get(ptr, (None,))[0] == order:
                level -= live.pop(ptr)[1]
        elif nbytes > 0:
            raw += nbytes
            if ptr in live:  # that block was freed where the profiler did not see it
                _, stale, since = live.pop(ptr)
                level -= stale
                if stale >= _SUSPECT_BYTES:
                    suspect.update(k for k, (a, b) in enumerate(steps) if a <= t and b >= since)
            live[ptr] = (order, nbytes, t)
            level += nbytes
        else:
            raw += nbytes
            if ptr in live:
                level -= live.pop(ptr)[1]
        for k, (a, b) in enumerate(steps):
            if a <= t <= b:
                step_peaks[k] = max(step_peaks[k], level)
                raw_peaks[k] = max(raw_peaks[k], raw)
        phase = next((name for a, b, name in phases if a <= t <= b), "other")
        phase_peaks[phase] = max(phase_peaks.get(phase, 0), level)
    return level, phase_peaks, step_peaks, raw_peaks, sorted(suspect)


def run_case(case: Case, *, steps: int = 3, timeout: float = 300.0) -> list[dict[str, Any]]:
    """One real run of ``case``: ``world_size`` rank processes; each rank's measurement (or an error)."""
    return launch_ranks("fsdp2_cpu", case, case.world_size, ["--steps", str(steps)], timeout=timeout)


# --------------------------------------------------------------------------------------------
# the report
# --------------------------------------------------------------------------------------------


def measure(case: Case, *, runs: int, steps: int, timeout: float) -> dict[str, Any]:
    per_run = [run_case(case, steps=steps, timeout=timeout) for _ in range(runs)]
    errors = [r["error"] for rs in per_run for r in rs if "error" in r]
    row: dict[str, Any] = {"case": case.name, **asdict(case), "runs": per_run}
    if errors:
        row["error"] = errors[0]
        return row
    row.update(estimate=estimate_case(case), zero3_estimate=estimate_case(case, strategy=None))
    return summarise(row)


def summarise(row: dict[str, Any]) -> dict[str, Any]:
    """The real worst peak of a measured case and the estimates' errors against it.

    A rank whose replay does not close (live bytes at the end differ from the replayed level: a
    free the profiler missed whose block was neither allocated inside a reduce-scatter nor reused)
    has an inflated level from that point on; such ranks are listed but left out of the worst peak
    when any rank's accounting closes.
    """
    ranks = [r for rs in row["runs"] for r in rs if "peak_bytes" in r]
    clean = [r for r in ranks if r["residual_bytes"] == 0] or ranks
    worst = max(r["peak_bytes"] for r in clean)
    est, stand_in = row["estimate"], row["zero3_estimate"]
    peaks = [r["peak_bytes"] for r in clean]
    row.update(real_peak_bytes=worst, real_min_peak_bytes=min(peaks),
               real_typical_peak_bytes=max(set(peaks), key=lambda v: (peaks.count(v), -v)),  # most common
               ranks_measured=len(ranks), ranks_unclosed=len(ranks) - len(clean) if clean is not ranks else 0,
               unclosed_peaks=[r["peak_bytes"] for r in ranks if r["residual_bytes"] != 0],
               error_pct=round(100 * (est["peak_bytes"] - worst) / worst, 2),
               zero3_error_pct=round(100 * (stand_in["peak_bytes"] - worst) / worst, 2),
               max_residual_bytes=max(abs(r["residual_bytes"]) for r in ranks))
    return row


def render_markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    ok = [r for r in rows if "error_pct" in r]
    lines = [
        "# FSDP2 on CPU: estimate vs. real gloo runs", "",
        f"Command: `{meta['command']}`"
        + (f" (then `--merge` of {meta['merged_files']} result files: cases that failed in the first are taken "
           "from a re-run of those cases alone)" if meta.get("merged_files", 1) > 1 else "") + "  ",
        f"Date: {meta['date']}  ",
        f"Machine: {meta['machine'].get('cpu_model', '?')}, {meta['machine'].get('cpu_count')} cores, "
        f"torch {meta['machine'].get('torch')}, transformers {meta['machine'].get('transformers')}; "
        f"{meta['runs']} runs x {meta['steps']} profiled steps per case; cases done: {meta.get('cases_done', '?')}", "",
        "Real peak: the worst rank's peak of live tensor bytes over all runs (fresh processes each) and "
        "their profiled steps, replayed by address from the profiler's allocator events (gloo frees its "
        "reduce-scatter clone on a thread the profiler does not record; see `_replay`). "
        "`strategy=\"fsdp2\"` is memguard's FSDP2 estimate; `ZeRO-3 stand-in` is "
        "`zero_stage=3` without a strategy (DeepSpeed's estimators).", "",
        "| case | real worst (MiB) | real typical (MiB) | fsdp2 estimate (MiB) | error vs worst | error vs typical "
        "| ZeRO-3 stand-in (MiB) | error vs worst |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error_pct" not in r:
            lines.append(f"| {r['case']} | error: {r.get('error', '?')[:80]} | | | | | | |")
            continue
        typical = r["real_typical_peak_bytes"]
        lines.append(
            f"| {r['case']} | {r['real_peak_bytes'] / _MIB:.2f} | {typical / _MIB:.2f} | "
            f"{r['estimate']['peak_bytes'] / _MIB:.2f} | {r['error_pct']:+.2f}% | "
            f"{100 * (r['estimate']['peak_bytes'] - typical) / typical:+.3f}% | "
            f"{r['zero3_estimate']['peak_bytes'] / _MIB:.2f} | {r['zero3_error_pct']:+.2f}% |")
    if ok:
        worst = max(ok, key=lambda r: abs(r["error_pct"]))
        mean = sum(abs(r["error_pct"]) for r in ok) / len(ok)
        z_mean = sum(abs(r["zero3_error_pct"]) for r in ok) / len(ok)
        within = sum(1 for r in ok if abs(r["error_pct"]) <= 3)
        lines += ["", f"FSDP2 estimate: mean |error| {mean:.2f}%, worst {worst['error_pct']:+.2f}% ({worst['case']}); "
                  f"{within} of {len(ok)} cases within 3%. ZeRO-3 stand-in: mean |error| {z_mean:.2f}%."]
        lines += ["", "Real typical: the most common per-rank peak over all runs and ranks. A rank above it "
                  "(the worst) is one where a clone gloo released on its worker thread went unseen until its "
                  "address was reused (the replay then counts it live too long), or a genuine overlap of "
                  "gloo's work with the next group: the profiler cannot tell the two apart."]
        unclosed = [(r["case"], p) for r in ok for p in r.get("unclosed_peaks", [])]
        if unclosed:
            lines += ["", "Ranks whose replay did not close (a free the profiler missed; left out of the worst "
                      "peak): " + ", ".join(f"{c} {p / _MIB:.2f} MiB" for c, p in unclosed) + "."]
    return "\n".join(lines) + "\n"


def _merge(args: argparse.Namespace, ap: argparse.ArgumentParser) -> tuple[list, dict] | None:
    """``--merge``: the rows of earlier result files (a later file's row replaces an error row), re-summarised."""
    if args.merge is None:
        return None
    rows_by_case: dict[str, dict[str, Any]] = {}
    meta = None
    for path in args.merge:
        data = json.loads(Path(path).read_text())
        meta = meta or data["meta"]
        for row in data["rows"]:
            if "error" not in row or row["case"] not in rows_by_case:
                rows_by_case[row["case"]] = summarise(row) if "error" not in row else row
    rows = list(rows_by_case.values())
    meta = dict(meta or {}, cases_done=f"{sum('error' not in r for r in rows)} of {len(all_cases())}",
                merged_files=len(args.merge))
    return rows, meta


def _describe(row: dict[str, Any]) -> str:
    return f"{row['error_pct']:+.2f}% (ZeRO-3 stand-in {row['zero3_error_pct']:+.2f}%)"


BENCHMARK = MultiRankBenchmark(
    name="fsdp2_cpu", doc=__doc__, case_type=Case, cases=all_cases,
    worker=lambda case, args: _rank_worker(case, args.steps),
    measure=lambda case, args: measure(case, runs=args.runs, steps=args.steps, timeout=args.timeout),
    render_markdown=render_markdown, describe=_describe, mode=_merge,
    add_arguments=lambda ap: ap.add_argument(
        "--merge", nargs="*", default=None, help="re-summarise the rows of these fsdp2_cpu.json files (later files "
        "replace earlier rows of the same case) into --out, without running anything"))


def main(argv: list[str] | None = None) -> int:
    return BENCHMARK.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
