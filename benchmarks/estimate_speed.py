"""How long ``memguard.estimate`` takes, and how much memory the process needs for it.

Cases (models built on the ``meta`` device from configs, so no weights exist anywhere):

* ``gpt2``: GPT-2 124M (default ``GPT2Config``), sequence 1024, micro-batch 8, bf16-mixed, CUDA
  target, ``gpu="A100-80GB"``. Goal: <= 2 s (issue: the estimator, item 5).
* ``gpt2-mb1`` / ``gpt2-mb64``: the same at micro-batch 1 and 64, to show that the cost of an
  estimate does not grow with the micro-batch (tensors are fake: only shapes change). The
  comparison uses each case's fastest run, the one least disturbed by other load.
* ``llama3-8b``: a Llama-3-8B-shaped config (32 layers, hidden 4096, ffn 14336, 32 heads / 8 KV
  heads, vocab 128256), sequence 4096, micro-batch 1, bf16-mixed, CUDA target. Goal: <= 15 s
  with the process's peak RSS <= 2 GiB.

Every case runs in a fresh interpreter, so ``ru_maxrss`` (the process's peak resident set,
getrusage(2)) is that case's alone. The worker imports memguard and transformers, builds the
model, runs ``--warmup`` untimed estimates, then ``--repeat`` timed ones (wall clock,
``time.perf_counter``); the median is reported. ``rss_before`` is the resident set just before
the first estimate (interpreter, torch, transformers, the meta model), so ``peak_rss -
rss_before`` is roughly what estimating costs in memory. The process's CPU time per estimate
(``time.process_time``) is reported too: on a shared machine it varies less with other load
than wall time does.

Usage::

    python benchmarks/estimate_speed.py                      # all cases
    python benchmarks/estimate_speed.py --cases gpt2 --repeat 5
    python benchmarks/estimate_speed.py --profile gpt2       # also write a cProfile summary

Writes ``estimate_speed.json`` and ``estimate_speed.md`` to ``--out`` (default
``benchmarks/results``) and prints the table. The load average of the machine (os.getloadavg)
is recorded before and after, because timings on a shared machine depend on it.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
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

_MARKER = "@@ESTIMATE_SPEED_RESULT@@ "  # prefix of the worker's one JSON line on stdout
_GiB = 1 << 30
_MiB = 1 << 20

GOAL_GPT2_SECONDS = 2.0  # issue item 5: GPT-2 124M, seq 1024, micro-batch 8, bf16-mixed, CUDA target
GOAL_LLAMA_SECONDS = 15.0  # issue item 5: Llama-3-8B-shaped config, seq 4096
GOAL_LLAMA_RSS = 2 * _GiB  # issue item 5: peak RSS of the process
GROWTH_LIMIT = 1.25  # "does not grow with the micro-batch": fastest run at 64 within 1.25x of the one at 1

#: case -> (model, micro-batch, sequence, default timed repeats, default warm-ups)
CASES: dict[str, tuple[str, int, int, int, int]] = {
    "gpt2": ("gpt2", 8, 1024, 3, 1),
    "gpt2-mb1": ("gpt2", 1, 1024, 3, 1),
    "gpt2-mb64": ("gpt2", 64, 1024, 3, 1),
    "llama3-8b": ("llama3-8b", 1, 4096, 1, 0),
}


# --------------------------------------------------------------------------------------------
# worker (runs in a fresh interpreter)
# --------------------------------------------------------------------------------------------


def _rss_now() -> int:
    """Current resident set of this process in bytes (/proc/self/statm, in pages; proc(5))."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def _max_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # ru_maxrss is KiB on Linux (getrusage(2))


def build_model(name: str):
    """The case's model, built on the meta device (no memory, no init kernels)."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    if name == "gpt2":
        config = transformers.GPT2Config()  # 124M: 12 layers, 768 hidden, 12 heads, vocab 50257
        cls = transformers.GPT2LMHeadModel
    elif name == "llama3-8b":
        # Meta-Llama-3-8B's config.json: 32 layers, hidden 4096, intermediate 14336, 32 heads,
        # 8 KV heads, vocab 128256, rope_theta 500000, 8192 positions
        config = transformers.LlamaConfig(
            num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
            num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
        )
        cls = transformers.LlamaForCausalLM
    else:
        raise ValueError(f"unknown model {name!r}")
    with torch.device("meta"):
        return cls(config)


def _relative_paths(text: str) -> str:
    """Shorten file names in a profile to ``<site-packages>/...``, ``<stdlib>/...`` or repo-relative."""
    import sysconfig

    paths = sysconfig.get_paths()
    for key, tag in (("purelib", "<site-packages>"), ("platlib", "<site-packages>"), ("stdlib", "<stdlib>")):
        if paths.get(key):
            text = text.replace(paths[key].rstrip("/") + "/", tag + "/")
    return text.replace(str(_REPO) + "/", "")


def _worker(case: str, repeat: int, warmup: int, profile: str | None) -> dict[str, Any]:
    t0 = time.perf_counter()
    import torch

    import memguard

    import_s = time.perf_counter() - t0
    model_name, micro, seq, _, _ = CASES[case]
    t0 = time.perf_counter()
    model = build_model(model_name)
    build_s = time.perf_counter() - t0
    ids = torch.zeros(micro, seq, dtype=torch.long)
    batch = {"input_ids": ids, "labels": ids}
    kwargs = dict(device="cuda", precision="bf16-mixed", gpu="A100-80GB")
    rss_before = _rss_now()

    for _ in range(warmup):
        memguard.estimate(model, batch, **kwargs)
    times, cpu_times = [], []
    est = None
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        est = memguard.estimate(model, batch, **kwargs)
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)

    result: dict[str, Any] = {
        "case": case,
        "model": model_name,
        "micro_batch_size": micro,
        "seq_len": seq,
        "num_params": est.num_params,
        "import_seconds": import_s,
        "build_seconds": build_s,
        "warmup": warmup,
        "seconds": times,
        "median_seconds": statistics.median(times),
        "min_seconds": min(times),
        "cpu_seconds": cpu_times,  # CPU time of the process (all threads): less sensitive to other load
        "median_cpu_seconds": statistics.median(cpu_times),
        "rss_before_bytes": rss_before,
        "peak_rss_bytes": _max_rss(),
        "estimate_peak_bytes": est.peak_bytes,
        "estimate_peak_phase": est.peak_phase,
        "torch_threads": torch.get_num_threads(),
    }
    if profile:
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        memguard.estimate(model, batch, **kwargs)
        prof.disable()
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("cumulative").print_stats(40)
        stats.sort_stats("tottime").print_stats(25)
        Path(profile).write_text(_relative_paths(text.getvalue()))
        result["profile_file"] = Path(profile).name
    return result


def _run_worker(case: str, repeat: int, warmup: int, profile: str | None, timeout: float) -> dict[str, Any]:
    args = ["--worker", case, "--repeat", str(repeat), "--warmup", str(warmup)]
    if profile:
        args += ["--profile-file", profile]
    run = run_worker("benchmarks.estimate_speed", args, _MARKER, timeout=timeout)
    return run.result if run.result is not None else {"case": case, "error": run.error_line()}


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def summarize(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Goals met or not, and the growth of the cost with the micro-batch."""
    out: dict[str, Any] = {}
    gpt2 = rows.get("gpt2", {})
    if "median_seconds" in gpt2:
        out["gpt2_seconds"] = gpt2["median_seconds"]
        out["gpt2_goal_met"] = gpt2["median_seconds"] <= GOAL_GPT2_SECONDS
    llama = rows.get("llama3-8b", {})
    if "median_seconds" in llama:
        out["llama_seconds"] = llama["median_seconds"]
        out["llama_peak_rss_bytes"] = llama["peak_rss_bytes"]
        out["llama_goal_met"] = (llama["median_seconds"] <= GOAL_LLAMA_SECONDS
                                 and llama["peak_rss_bytes"] <= GOAL_LLAMA_RSS)
    # the fastest run is the least disturbed by other load on a shared machine
    by_mb = {r["micro_batch_size"]: r["min_seconds"] for r in rows.values()
             if r.get("model") == "gpt2" and "min_seconds" in r}
    if len(by_mb) >= 2:
        lo, hi = min(by_mb), max(by_mb)
        out["gpt2_seconds_by_micro_batch"] = {str(k): v for k, v in sorted(by_mb.items())}
        out["growth_largest_vs_smallest_micro_batch"] = by_mb[hi] / by_mb[lo]
        out["flat_in_micro_batch"] = by_mb[hi] / by_mb[lo] <= GROWTH_LIMIT
    return out


def render_markdown(rows: dict[str, dict[str, Any]], summary: dict[str, Any], meta: dict[str, Any]) -> str:
    m = meta["machine"]
    lines = [
        "# memguard.estimate speed",
        "",
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}",
        f"- machine: {m.get('cpu_model')}, {m.get('cpus_usable')} usable of {m.get('cpu_count')} cores, "
        f"{m.get('ram_bytes', 0) / _GiB:.1f} GiB RAM, {m.get('os')}",
        f"- software: Python {m.get('python')}, torch {m.get('torch')} ({m.get('torch_threads')} threads), "
        f"transformers {m.get('transformers', '—')}",
        f"- load average (1, 5, 15 min) before: {meta['load_before']}, after: {meta['load_after']} "
        "(a shared machine: timings scale with the load)",
        "- every case in a fresh interpreter; target CUDA A100-80GB, bf16-mixed, AdamW; models on meta",
        "",
        "| case | params | micro-batch × seq | median s | min s | CPU s | runs (s) | peak RSS MiB | RSS before MiB | "
        "estimated peak GiB | phase |",
        "|---|---:|---|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    for case, r in rows.items():
        if "error" in r:
            lines.append(f"| {case} | error: {r['error']} | | | | | | | | | |")
            continue
        runs = ", ".join(f"{t:.2f}" for t in r["seconds"])
        lines.append(
            f"| {case} | {r['num_params'] / 1e6:.0f}M | {r['micro_batch_size']} × {r['seq_len']} | "
            f"{r['median_seconds']:.2f} | {r['min_seconds']:.2f} | {r['median_cpu_seconds']:.2f} | {runs} | {r['peak_rss_bytes'] / _MiB:.0f} | "
            f"{r['rss_before_bytes'] / _MiB:.0f} | "
            f"{r['estimate_peak_bytes'] / _GiB:.2f} | {r['estimate_peak_phase']} |"
        )
    lines.append("")
    if "gpt2_goal_met" in summary:
        lines.append(f"- GPT-2 124M, micro-batch 8: {summary['gpt2_seconds']:.2f} s "
                     f"(goal <= {GOAL_GPT2_SECONDS:.0f} s: {'met' if summary['gpt2_goal_met'] else 'missed'})")
    if "llama_goal_met" in summary:
        lines.append(f"- Llama-3-8B shape: {summary['llama_seconds']:.2f} s, peak RSS "
                     f"{summary['llama_peak_rss_bytes'] / _GiB:.2f} GiB (goal <= {GOAL_LLAMA_SECONDS:.0f} s and "
                     f"<= 2 GiB: {'met' if summary['llama_goal_met'] else 'missed'})")
    if "flat_in_micro_batch" in summary:
        by = ", ".join(f"{k}: {v:.2f} s" for k, v in summary["gpt2_seconds_by_micro_batch"].items())
        lines.append(f"- GPT-2 by micro-batch, fastest run ({by}): largest / smallest = "
                     f"{summary['growth_largest_vs_smallest_micro_batch']:.2f} "
                     f"({'flat' if summary['flat_in_micro_batch'] else 'grows'}; limit {GROWTH_LIMIT})")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; see the module docstring."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="", help=f"comma-separated, from {', '.join(CASES)} (default: all)")
    parser.add_argument("--out", default=str(Path("benchmarks") / "results"), help="folder for the .json/.md")
    parser.add_argument("--repeat", type=int, default=None, help="timed runs per case (default: 3, Llama 1)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed runs first (default: 1, Llama 0)")
    parser.add_argument("--profile", default="", help="comma-separated cases to also profile with cProfile")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per case")
    parser.add_argument("--worker", choices=list(CASES), help=argparse.SUPPRESS)
    parser.add_argument("--profile-file", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        result = _worker(args.worker, args.repeat or 1, args.warmup or 0, args.profile_file)
        print(_MARKER + json.dumps(result), flush=True)
        return 0

    names = [n for n in args.cases.split(",") if n] or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
    profiled = {n for n in args.profile.split(",") if n}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    load_before = _load()
    t0 = time.perf_counter()
    rows: dict[str, dict[str, Any]] = {}
    for name in names:
        _, _, _, repeat, warmup = CASES[name]
        repeat = args.repeat if args.repeat is not None else repeat
        warmup = args.warmup if args.warmup is not None else warmup
        profile = str((out / f"estimate_speed_profile_{name}.txt").resolve()) if name in profiled else None
        rows[name] = _run_worker(name, repeat, warmup, profile, args.timeout)
        r = rows[name]
        status = r.get("error") or f"median {r['median_seconds']:.2f} s, peak RSS {r['peak_rss_bytes'] / _MiB:.0f} MiB"
        print(f"  {name}: {status}", file=sys.stderr, flush=True)
    meta = {
        "command": "python benchmarks/estimate_speed.py" + ("" if not argv else " " + shlex.join(argv)),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_description(),
        "load_before": load_before,
        "load_after": _load(),
        "wall_seconds": time.perf_counter() - t0,
        "goals": {"gpt2_seconds": GOAL_GPT2_SECONDS, "llama_seconds": GOAL_LLAMA_SECONDS,
                  "llama_peak_rss_bytes": GOAL_LLAMA_RSS, "micro_batch_growth_limit": GROWTH_LIMIT},
    }
    summary = summarize(rows)
    md = render_markdown(rows, summary, meta)
    (out / "estimate_speed.json").write_text(json.dumps({**meta, "summary": summary, "cases": rows}, indent=2) + "\n")
    (out / "estimate_speed.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
