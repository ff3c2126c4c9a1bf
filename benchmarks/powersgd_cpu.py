"""PowerSGD under DDP on CPU: ``memguard.estimate(gradient_compression="powersgd")`` against real gloo runs.

Each case wraps a small model (a GPT-2-shaped HF model built from a config, or an MLP) in
``DistributedDataParallel`` over ``world_size`` gloo ranks on this machine (one process per rank),
registers torch's ``powerSGD_hook`` with a ``PowerSGDState`` (``start_powerSGD_iter=2``, the
smallest torch allows with error feedback or warm start), runs warm-up steps until the hook's state
exists and DDP has rebuilt its buckets, then ``--steps`` steady-state steps. The profiler
(``profile_memory=True``) runs from *before* DDP is built, so the reducer's buckets and PowerSGD's
buffers are allocated under it: the live bytes are the parameters and the batch (counted as
storages when it starts) plus the replayed ``[memory]`` events (by address:
:func:`benchmarks.fsdp2_cpu._replay`), and every collective is settled
(:func:`benchmarks.common.settle_collectives`), so that the hook's future chain runs on the main
thread, where the profiler sees it. A case's real peak is the worst rank's peak of the steady-state
steps over ``--runs`` runs (fresh processes each). ``unaccounted`` is the replayed level at the end
minus the storages still reachable from Python (parameters, batch, optimizer state, PowerSGD's
state): DDP's own buckets, which memguard models as all the gradients' bytes.

Usage::

    python benchmarks/powersgd_cpu.py                    # every case, 3 runs each
    python benchmarks/powersgd_cpu.py --cases mlp-r1 --runs 2

Writes ``powersgd_cpu.json`` and ``powersgd_cpu.md`` to ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import gc
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))
from benchmarks.common import MultiRankBenchmark, launch_ranks, settle_collectives  # noqa: E402
from benchmarks.fsdp2_cpu import _PREFIX, _replay, _storage_bytes  # noqa: E402

_MIB = 1 << 20
_START_ITER = 2  # PowerSGDState: start_powerSGD_iter > 1 with error feedback or warm start
_WARMUP = _START_ITER + 2  # plain all-reduce steps, the hook's first (allocating) step, one steady step


@dataclass(frozen=True)
class Case:
    """One configuration: model, ranks, PowerSGD rank and options, batch."""

    model: str  # "gpt2" or "mlp"
    world_size: int = 2
    rank: int = 1  # matrix_approximation_rank
    warm_start: bool = True
    use_error_feedback: bool = True
    batch: int = 4
    seq: int = 64

    @property
    def name(self) -> str:
        flags = ("" if self.warm_start else "-nows") + ("" if self.use_error_feedback else "-noef")
        return f"{self.model}-r{self.rank}{flags}"

    def options(self) -> dict[str, Any]:
        return {"matrix_approximation_rank": self.rank, "start_powerSGD_iter": _START_ITER,
                "warm_start": self.warm_start, "use_error_feedback": self.use_error_feedback}


def all_cases() -> dict[str, Case]:
    cases = [Case("gpt2"), Case("gpt2", rank=4), Case("mlp"), Case("mlp", rank=2), Case("mlp", warm_start=False),
             Case("gpt2", use_error_feedback=False)]
    return {c.name: c for c in cases}


def build_model(case: Case, device: str = "cpu"):
    """The case's model, built from a config (nothing downloaded), on ``device`` ("meta": no memory)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    with torch.device(device):
        if case.model == "gpt2":
            import transformers

            cfg = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=2048, n_positions=256)
            return transformers.GPT2LMHeadModel(cfg)
        if case.model == "mlp":
            return nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 2048), nn.GELU(),
                                 nn.Linear(2048, 512), nn.GELU(), nn.Linear(512, 16))
    raise ValueError(f"unknown model {case.model!r}")


def make_batch(case: Case):
    import torch

    g = torch.Generator().manual_seed(1)
    if case.model == "gpt2":
        ids = torch.randint(0, 2048, (case.batch, case.seq), generator=g)
        return {"input_ids": ids, "labels": ids.clone()}
    return torch.randn(case.batch * case.seq, 512, generator=g)


def loss_fn(model, batch):
    if isinstance(batch, dict):
        return model(**batch).loss
    return model(batch).float().pow(2).mean()


def estimate_case(case: Case, compression: bool = True) -> dict[str, Any]:
    import memguard

    t0 = time.perf_counter()
    kw = {"gradient_compression": "powersgd", "powersgd": case.options()} if compression else {}
    est = memguard.estimate(build_model(case, "meta"), make_batch(case), loss_fn=loss_fn, device="cpu",
                            world_size=case.world_size, **kw)
    return {"peak_bytes": int(est.peak_bytes), "peak_phase": est.peak_phase, "breakdown": dict(est.breakdown),
            "phase_peaks": dict(est.phase_peaks), "notes": list(est.notes[-1:]) if compression else [],
            "seconds": round(time.perf_counter() - t0, 2)}


def _rank_worker(case: Case, steps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.set_num_threads(1)
    settle_collectives(pause_s=0.02)
    settled = dist.all_reduce

    def all_reduce(*args, **kwargs):
        # wait for the work's future too: then powerSGD_hook's ``.then`` callbacks (and the all-reduces
        # they issue) run inline on the profiled thread, in the same order on every rank. Completed on
        # gloo's worker thread instead, a callback's all-reduce can be issued between two of the main
        # thread's, in a different order on each rank (gloo then fails with "Received data size doesn't
        # match expected size", seen here without this wait)
        work = settled(*args, **kwargs)
        if work is not None and hasattr(work, "get_future"):
            work.get_future().wait()
        return work

    dist.all_reduce = all_reduce
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = build_model(case)
    model.train()
    batch = make_batch(case)
    tensors = list(batch.values()) if isinstance(batch, dict) else [batch]
    gc.collect()
    gc.disable()
    baseline = _storage_bytes([*model.parameters(), *model.buffers(), *tensors])
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        o = case.options()
        state = PowerSGDState(None, matrix_approximation_rank=o["matrix_approximation_rank"],
                              start_powerSGD_iter=o["start_powerSGD_iter"], warm_start=o["warm_start"],
                              use_error_feedback=o["use_error_feedback"])
        ddp.register_comm_hook(state, powerSGD_hook)
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)

        def step(prefix: str):
            with record_function(prefix + "step"):
                with record_function(prefix + "forward"):
                    loss = loss_fn(ddp, batch)
                with record_function(prefix + "backward"):
                    loss.backward()
                del loss
                with record_function(prefix + "optimizer"):
                    optimizer.step()
                with record_function(prefix + "zero_grad"):
                    optimizer.zero_grad(set_to_none=True)

        for _ in range(_WARMUP):
            step("warmup::")
        dist.barrier()
        for _ in range(steps):
            step(_PREFIX)
        dist.barrier()
    level, phase_peaks, step_peaks, raw_peaks, suspect = _replay(prof, baseline)
    opt_state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    hook_state = [*state.error_dict.values(), *state.p_memory_dict.values(), *state.q_memory_dict.values()]
    reachable = _storage_bytes([*model.parameters(), *model.buffers(), *tensors, *opt_state, *hook_state])
    gc.enable()
    peak = max([p for k, p in enumerate(step_peaks) if k not in suspect] or step_peaks)
    result = {"rank": rank, "peak_bytes": peak, "phase_peaks": phase_peaks, "step_peaks": step_peaks,
              "raw_step_peaks": raw_peaks, "suspect_steps": suspect, "baseline_bytes": baseline,
              "hook_state_bytes": _storage_bytes(hook_state), "unaccounted_bytes": level - reachable,
              # the reducer's buckets: one flat tensor per bucket over its parameters' gradients
              # (torch/csrc/distributed/c10d/reducer.cpp, Reducer::initialize_buckets: at::empty({offset}))
              "reducer_bytes": sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad),
              "powersgd_iter": state.iter}
    dist.destroy_process_group()
    return result


def run_case(case: Case, *, steps: int = 2, timeout: float = 300.0) -> list[dict[str, Any]]:
    """One real run of ``case``: ``world_size`` rank processes; each rank's measurement (or an error)."""
    return launch_ranks("powersgd_cpu", case, case.world_size, ["--steps", str(steps)], timeout=timeout)


def measure(case: Case, *, runs: int, steps: int, timeout: float) -> dict[str, Any]:
    per_run = [run_case(case, steps=steps, timeout=timeout) for _ in range(runs)]
    row: dict[str, Any] = {"case": case.name, **asdict(case), "runs": per_run}
    errors = [r["error"] for rs in per_run for r in rs if "error" in r]
    if errors:
        row["error"] = errors[0]
        return row
    est, plain = estimate_case(case), estimate_case(case, compression=False)
    every = [r for rs in per_run for r in rs]
    # a rank whose replay does not close (the level left at the end is not the reducer's buckets: a free
    # the profiler did not see, e.g. DDP's old buckets after the rebuild) is high from that free on
    ranks = [r for r in every if r["unaccounted_bytes"] == r["reducer_bytes"]] or every
    row["unclosed_peaks"] = [r["peak_bytes"] for r in every if r["unaccounted_bytes"] != r["reducer_bytes"]]
    row["ranks_measured"] = len(every)
    worst = max(r["peak_bytes"] for r in ranks)
    row.update(estimate=est, ddp_estimate=plain, real_peak_bytes=worst,
               real_min_peak_bytes=min(r["peak_bytes"] for r in ranks),
               error_pct=round(100 * (est["peak_bytes"] - worst) / worst, 2),
               ddp_error_pct=round(100 * (plain["peak_bytes"] - worst) / worst, 2),
               hook_state_bytes=sorted({r["hook_state_bytes"] for r in ranks}),
               unaccounted_bytes=sorted({r["unaccounted_bytes"] for r in ranks}))
    return row


def render_markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "# PowerSGD under DDP on CPU: estimate vs. real gloo runs", "",
        f"Command: `{meta['command']}`  ", f"Date: {meta['date']}  ",
        f"Machine: {meta['machine'].get('cpu_model', '?')}, {meta['machine'].get('cpu_count')} cores, "
        f"torch {meta['machine'].get('torch')}; {meta['runs']} runs x {meta['steps']} steady-state steps per case, "
        f"2 gloo ranks", "",
        "Real: the worst rank's peak of live tensor bytes over all runs and steady-state steps (after "
        f"start_powerSGD_iter={_START_ITER}). `estimate`: `memguard.estimate(..., device=\"cpu\", world_size=2, "
        "gradient_compression=\"powersgd\", powersgd=...)`; `DDP only`: the same without the hook (what "
        "memguard predicted before PowerSGD was modelled). `hook state`: PowerSGD's error/P/Q tensors "
        "on a rank; `unaccounted`: the replayed level at the end minus every storage reachable from Python "
        "(DDP's reducer buckets).", "",
        "| case | real worst (MiB) | real best (MiB) | estimate (MiB) | error | DDP only (MiB) | error "
        "| hook state (MiB) | unaccounted (MiB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error_pct" not in r:
            lines.append(f"| {r['case']} | error: {r.get('error', '?')[:80]} | | | | | | | |")
            continue
        lines.append(
            f"| {r['case']} | {r['real_peak_bytes'] / _MIB:.3f} | {r['real_min_peak_bytes'] / _MIB:.3f} | "
            f"{r['estimate']['peak_bytes'] / _MIB:.3f} | {r['error_pct']:+.2f}% | "
            f"{r['ddp_estimate']['peak_bytes'] / _MIB:.3f} | {r['ddp_error_pct']:+.2f}% | "
            + ", ".join(f"{b / _MIB:.3f}" for b in r["hook_state_bytes"]) + " | "
            + ", ".join(f"{b / _MIB:.3f}" for b in r["unaccounted_bytes"]) + " |")
    ok = [r for r in rows if "error_pct" in r]
    if ok:
        worst = max(ok, key=lambda r: abs(r["error_pct"]))
        lines += ["", f"Worst |error| {abs(worst['error_pct']):.2f}% ({worst['case']}); "
                  f"{sum(abs(r['error_pct']) <= 3 for r in ok)} of {len(ok)} cases within 3%."]
        unclosed = [(r["case"], p) for r in ok for p in r.get("unclosed_peaks", [])]
        lines += ["", f"Rank-runs measured: {sum(r.get('ranks_measured', 0) for r in ok)}. Ranks whose replay did "
                  "not close (the level left at the end differs from the reducer's bucket bytes: a free the "
                  "profiler did not record; left out of the worst peak): "
                  + (", ".join(f"{c} {p / _MIB:.3f} MiB" for c, p in unclosed) if unclosed else "none") + "."]
    return "\n".join(lines) + "\n"


BENCHMARK = MultiRankBenchmark(
    name="powersgd_cpu", doc=__doc__, case_type=Case, cases=all_cases,
    worker=lambda case, args: _rank_worker(case, args.steps),
    measure=lambda case, args: measure(case, runs=args.runs, steps=args.steps, timeout=args.timeout),
    render_markdown=render_markdown, describe=lambda row: str(row["error_pct"]),
    steps_help="profiled steady-state steps per run")


def main(argv: list[str] | None = None) -> int:
    return BENCHMARK.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
