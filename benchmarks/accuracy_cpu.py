"""Accuracy of ``memguard.estimate(device="cpu")`` against real CPU training steps.

For every case of the zoo (:mod:`benchmarks.zoo`) this script measures the real peak of live
tensor bytes of a steady-state training step (:func:`benchmarks.ground_truth.measure_cpu_peak`,
2 steps, the last one counts), asks ``memguard.estimate`` for the same step, and reports the
error. Every measurement and every estimate runs in its own subprocess with one intra-op thread,
so one case's memory cannot disturb another's and results are deterministic.

Usage::

    python benchmarks/accuracy_cpu.py                       # all cases, estimate + ground truth
    python benchmarks/accuracy_cpu.py --no-estimate         # ground truth only
    python benchmarks/accuracy_cpu.py --cases gpt2,mlp --out my-results --repeat 3
    python benchmarks/accuracy_cpu.py --truth-from benchmarks/results/accuracy_cpu.json --out new
        # new estimates against the ground truth of an earlier run (the real steps do not depend
        # on memguard's code, so after a change to the estimator only the estimates need rerunning)

Writes ``accuracy_cpu.json`` and ``accuracy_cpu.md`` to ``--out`` (default
``benchmarks/results``) and prints the Markdown table.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))  # `benchmarks` from this checkout when run by path
from benchmarks.common import machine_description, run_worker  # noqa: E402

_MARKER = "@@ACCURACY_CPU_RESULT@@ "  # prefix of the worker's one JSON line on stdout
_MIB = 1 << 20


# --------------------------------------------------------------------------------------------
# workers (run in a subprocess)
# --------------------------------------------------------------------------------------------


def _max_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # ru_maxrss is KiB on Linux (getrusage(2))


def _worker(mode: str, name: str, steps: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)  # one intra-op thread: deterministic and comparable timings
    from benchmarks.zoo import CASES

    case = CASES[name]
    t0 = time.perf_counter()
    model, batch, loss_fn = case.build("cpu")
    build_s = time.perf_counter() - t0
    if mode == "truth":
        from benchmarks.ground_truth import measure_cpu_peak
        from benchmarks.zoo import real_step

        model, batch, loss_fn = real_step(model, batch, loss_fn, case.precision)
        optimizer = case.optimizer(model.parameters())
        gt = measure_cpu_peak(model, batch, loss_fn, optimizer, steps=steps)
        return {"build_seconds": build_s, "max_rss_bytes": _max_rss_bytes(), **gt.to_dict()}
    import memguard

    t0 = time.perf_counter()
    est = memguard.estimate(model, batch, optimizer=case.optimizer, loss_fn=loss_fn, device="cpu",
                            precision=case.precision)
    seconds = time.perf_counter() - t0
    return {
        "build_seconds": build_s,
        "seconds": seconds,
        "peak_bytes": int(est.peak_bytes),
        "peak_phase": est.peak_phase,
        "breakdown": dict(est.breakdown),
        "phase_peaks": dict(getattr(est, "phase_peaks", {}) or {}),
        "max_rss_bytes": _max_rss_bytes(),
    }


def _cpu_isa() -> str:
    """The instruction-set level the workers' oneDNN runs at, and the cap that set it if any."""
    import os

    from memguard.estimator._cpu_kernels import host_isa

    cap = os.environ.get("ONEDNN_MAX_CPU_ISA")
    return host_isa() + (f" (ONEDNN_MAX_CPU_ISA={cap})" if cap else " (the host's own)")


def _run_worker(mode: str, name: str, steps: int, timeout: float) -> dict[str, Any]:
    """Run one worker in a fresh interpreter; return its result or ``{"error": ...}``."""
    run = run_worker("benchmarks.accuracy_cpu", ["--worker", mode, "--cases", name, "--steps", str(steps)], _MARKER,
                     timeout=timeout, one_thread=True)
    return run.result if run.result is not None else {"error": run.error_line()}


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------


def _mib(n: int | None) -> str:
    return "—" if n is None else f"{n / _MIB:.2f}"


def render_markdown(rows: list[dict[str, Any]], summary: dict[str, Any], meta: dict[str, Any]) -> str:
    """The report: header, one table row per case, then the error summary."""
    m = meta["machine"]
    lines = [
        "# memguard CPU accuracy",
        "",
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}",
        f"- machine: {m.get('cpu_model')}, {m.get('cpus_usable')} usable of {m.get('cpu_count')} cores, "
        f"{m.get('ram_bytes', 0) / (1 << 30):.1f} GiB RAM, {m.get('os')}",
        f"- CPU kernel path (oneDNN's instruction-set level): {m.get('cpu_isa', '—')}",
        f"- software: Python {m.get('python')}, torch {m.get('torch')}, transformers {m.get('transformers', '—')}; "
        "1 intra-op thread",
        f"- ground truth: {meta['steps']} real steps under torch.profiler (profile_memory), peak of the last step; "
        f"{meta['repeat']} independent measurement(s) per case, spread = max - min"
        + (f" (reused from {meta['truth_from']})" if meta.get("truth_from") else ""),
        "",
        "| case | real peak (MiB) | estimated (MiB) | error % | peak phase real / est | estimate s | "
        "real spread (B) | residual (B) | step peaks (MiB) |",
        "|---|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    for r in rows:
        if r.get("truth_error"):
            lines.append(f"| {r['case']} | error: {r['truth_error']} | | | | | | | |")
            continue
        est = r.get("estimate_bytes")
        err = "—" if r.get("error_pct") is None else f"{r['error_pct']:+.2f}"
        if r.get("estimate_error"):
            err = f"error: {r['estimate_error'][:80]}"
        est_s = "—" if r.get("estimate_seconds") is None else f"{r['estimate_seconds']:.2f}"
        steps = ", ".join(_mib(p) for p in r["step_peaks"])
        lines.append(
            f"| {r['case']} | {_mib(r['real_bytes'])} | {_mib(est)} | {err} | "
            f"{r['real_phase']} / {r.get('estimate_phase') or '—'} | {est_s} | {r['spread_bytes']} | "
            f"{r['residual_bytes']} | {steps} |"
        )
    lines.append("")
    if summary.get("n"):
        lines.append(
            f"**|error| over {summary['n']} cases: median {summary['median_abs_error_pct']:.2f}%, "
            f"max {summary['max_abs_error_pct']:.2f}% ({summary['max_case']})**"
        )
    else:
        lines.append("No estimates (ground truth only).")
    return "\n".join(lines) + "\n"


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    errs = [(abs(r["error_pct"]), r["case"]) for r in rows if r.get("error_pct") is not None]
    if not errs:
        return {"n": 0}
    worst = max(errs)
    return {
        "n": len(errs),
        "median_abs_error_pct": statistics.median(e for e, _ in errs),
        "max_abs_error_pct": worst[0],
        "max_case": worst[1],
    }


def run(names: list[str], *, estimate: bool, repeat: int, steps: int, timeout: float,
        truth_from: dict[str, list[dict[str, Any]]] | None = None) -> list[dict[str, Any]]:
    """Measure (and estimate) every named case in its own subprocesses; one row per case.

    With ``truth_from`` (case -> the ``truth_runs`` of an earlier report) the ground truth is
    taken from there instead of measured again.
    """
    rows = []
    for name in names:
        if truth_from is not None:
            truths = truth_from[name]
        else:
            truths = [_run_worker("truth", name, steps, timeout) for _ in range(max(repeat, 1))]
        row: dict[str, Any] = {"case": name, "truth_runs": truths}
        bad = [t["error"] for t in truths if "error" in t]
        if bad:
            row["truth_error"] = bad[0]
        else:
            peaks = [t["steady_peak_bytes"] for t in truths]
            row.update(
                real_bytes=peaks[0],
                real_phase=truths[0]["peak_phase"],
                spread_bytes=max(peaks) - min(peaks),
                residual_bytes=truths[0]["residual_bytes"],
                step_peaks=truths[0]["step_peaks"],
                truth_seconds=truths[0]["seconds"],
            )
        if estimate:
            e = _run_worker("estimate", name, steps, timeout)
            row["estimate_run"] = e
            if "error" in e:
                row["estimate_error"] = e["error"]
            else:
                row.update(
                    estimate_bytes=e["peak_bytes"], estimate_phase=e["peak_phase"], estimate_seconds=e["seconds"]
                )
                if row.get("real_bytes"):
                    row["error_pct"] = 100.0 * (e["peak_bytes"] - row["real_bytes"]) / row["real_bytes"]
        rows.append(row)
        print(f"  {name}: done", file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; see the module docstring."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--out", default=str(Path("benchmarks") / "results"), help="folder for the .json/.md")
    parser.add_argument("--name", default="accuracy_cpu", help="file name of the .json/.md (default accuracy_cpu)")
    parser.add_argument("--no-estimate", action="store_true", help="ground truth only")
    parser.add_argument("--repeat", type=int, default=2, help="independent ground-truth runs per case")
    parser.add_argument("--steps", type=int, default=2, help="training steps per measurement")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per subprocess")
    parser.add_argument("--truth-from", default="", help="reuse the ground truth of an earlier accuracy_cpu.json")
    parser.add_argument("--worker", choices=["truth", "estimate"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        result = _worker(args.worker, args.cases, args.steps)
        print(_MARKER + json.dumps(result), flush=True)
        return 0

    sys.path.insert(0, str(_REPO))
    from benchmarks.zoo import CASES

    names = [n for n in args.cases.split(",") if n] or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")

    truth_from = None
    if args.truth_from:
        earlier = json.loads(Path(args.truth_from).read_text())
        truth_from = {r["case"]: r["truth_runs"] for r in earlier["cases"]}
        missing = [n for n in names if n not in truth_from]
        if missing:
            parser.error(f"{args.truth_from} has no ground truth for {missing}")
        args.steps, args.repeat = earlier["steps"], earlier["repeat"]

    t0 = time.perf_counter()
    rows = run(names, estimate=not args.no_estimate, repeat=args.repeat, steps=args.steps, timeout=args.timeout,
               truth_from=truth_from)
    meta = {
        "command": "python benchmarks/accuracy_cpu.py" + ("" if not argv else " " + shlex.join(argv)),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_description(torch_threads=1, cpu_isa=_cpu_isa()),  # the workers use one thread
        "steps": args.steps,
        "repeat": args.repeat,
        "wall_seconds": time.perf_counter() - t0,
    }
    if args.truth_from:
        meta["truth_from"] = args.truth_from
    summary = _summary(rows)
    md = render_markdown(rows, summary, meta)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps({**meta, "summary": summary, "cases": rows}, indent=2) + "\n")
    (out / f"{args.name}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
