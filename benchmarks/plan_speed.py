"""How long a full ``memguard.plan`` takes for real model shapes, and how much host memory.

Three cases, each in a fresh subprocess (so imports, caches and the peak RSS of one case cannot
help or hurt another). Models are built on the ``meta`` device from their published shapes; no
weights are downloaded and nothing is allocated for real.

========== ========================================================== ============== =========
case       shape                                                      target         goal
========== ========================================================== ============== =========
gpt2-124m  ``GPT2Config()`` defaults (12 x 768, vocab 50257), seq 1024 1 x A100-80GB    <= 3 s
llama3-8b  32 layers, hidden 4096, ffn 14336, 32 heads / 8 KV,        8 x H100-80GB    <= 20 s
           vocab 128256, seq 4096
llama-70b  80 layers, hidden 8192, ffn 28672, 64 heads / 8 KV,        64 x H100-80GB   <= 60 s,
           vocab 128256, seq 4096                                                      RSS <= 2 GiB,
                                                                                       ZeRO-3
========== ========================================================== ============== =========

The shapes are those of the published configs: GPT-2 small is ``transformers.GPT2Config()``'s
defaults; Llama-3-8B and Llama-3-70B are from Meta's model cards / ``config.json`` (hidden 4096 /
8192, intermediate 14336 / 28672, 32 / 64 attention heads with 8 key-value heads, vocab 128256).

The timed quantity is the ``memguard.plan(...)`` call alone (the model is already built); import
and build times are reported beside it. Peak RSS is ``getrusage(RUSAGE_SELF).ru_maxrss`` of the
case's subprocess, so it includes importing torch and transformers.

Usage::

    python -m benchmarks.plan_speed                     # all cases
    python -m benchmarks.plan_speed --cases gpt2-124m   # some cases
    python -m benchmarks.plan_speed --profile llama-70b # cProfile one case, print the top functions

Writes ``plan_speed.json`` and ``plan_speed.md`` to ``--out`` (default ``benchmarks/results``)
and prints the Markdown table.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))  # `benchmarks` from this checkout when run by path
from benchmarks.common import machine_description, run_worker  # noqa: E402

_MARKER = "@@PLAN_SPEED_RESULT@@ "  # prefix of the worker's one JSON line on stdout
_GIB = 1 << 30  # memguard.vocab.GiB; not imported here: it imports torch, which each case times


@dataclass(frozen=True)
class SpeedCase:
    """One timed planning job.

    Attributes:
        name: identifier used on the command line.
        description: the shape, for the table.
        build: ``build() -> (model on meta, example batch)``.
        plan_kwargs: keyword arguments of ``memguard.plan`` besides model and batch.
        goal_seconds: the goal for the ``plan`` call.
        goal_rss_bytes: the goal for the subprocess's peak RSS, or None.
        expect_zero_stage: the ZeRO stage the plan must choose, or None.
    """

    name: str
    description: str
    build: Callable[[], tuple[Any, Any]]
    plan_kwargs: dict = field(default_factory=dict)
    goal_seconds: float = 0.0
    goal_rss_bytes: int | None = None
    expect_zero_stage: int | None = None


def _lm_batch(seq: int) -> dict[str, Any]:
    import torch

    ids = torch.zeros(1, seq, dtype=torch.long)  # one example sequence; the planner resizes dim 0
    return {"input_ids": ids, "labels": ids}


def _quiet() -> None:
    import transformers

    transformers.logging.set_verbosity_error()


def _build_gpt2() -> tuple[Any, Any]:
    import torch
    import transformers

    _quiet()
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config())  # GPT-2 small: 124M parameters
    model.train()
    return model, _lm_batch(1024)


def _llama(layers: int, hidden: int, ffn: int, heads: int, kv_heads: int) -> Any:
    import torch
    import transformers

    _quiet()
    config = transformers.LlamaConfig(
        vocab_size=128256, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=8192,
        tie_word_embeddings=False,  # Llama-3 8B/70B have an untied LM head (config.json)
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    model.train()
    return model


def _build_llama3_8b() -> tuple[Any, Any]:
    return _llama(32, 4096, 14336, 32, 8), _lm_batch(4096)  # Llama-3-8B config.json


def _build_llama_70b() -> tuple[Any, Any]:
    return _llama(80, 8192, 28672, 64, 8), _lm_batch(4096)  # Llama-3-70B config.json


CASES: dict[str, SpeedCase] = {
    c.name: c
    for c in [
        SpeedCase("gpt2-124m", "GPT-2 small (12 x 768), seq 1024", _build_gpt2,
                  dict(global_batch_size=512, gpu="A100-80GB"), goal_seconds=3.0),
        SpeedCase("llama3-8b", "Llama-3-8B shape (32 x 4096, ffn 14336, GQA 32/8), seq 4096", _build_llama3_8b,
                  dict(global_batch_size=512, gpu="H100-80GB", world_size=8), goal_seconds=20.0),
        SpeedCase("llama-70b", "Llama-70B shape (80 x 8192, ffn 28672, GQA 64/8), seq 4096", _build_llama_70b,
                  dict(global_batch_size=1024, gpu="H100-80GB", world_size=64), goal_seconds=60.0,
                  goal_rss_bytes=2 * _GIB, expect_zero_stage=3),
    ]
}


# --------------------------------------------------------------------------------------------
# worker (runs in a subprocess)
# --------------------------------------------------------------------------------------------


def _max_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # ru_maxrss is KiB on Linux (getrusage(2))


def _worker(name: str, profile: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    import torch  # noqa: F401 - timed: the import is part of a cold start

    import memguard

    import_s = time.perf_counter() - t0
    case = CASES[name]
    t0 = time.perf_counter()
    model, batch = case.build()
    build_s = time.perf_counter() - t0
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    t0 = time.perf_counter()
    failure = None
    try:
        p = memguard.plan(model, batch, **case.plan_kwargs)
    except memguard.MemguardError as exc:  # e.g. InfeasiblePlanError: still a timed answer
        p, failure = None, f"{type(exc).__name__}: {exc}"
    plan_s = time.perf_counter() - t0
    if profiler is not None:
        import io
        import pstats

        profiler.disable()
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out).strip_dirs()
        stats.sort_stats("cumulative").print_stats(45)
        stats.sort_stats("tottime").print_stats(30)
        print(out.getvalue(), file=sys.stderr)
    rss = _max_rss_bytes()
    if p is None:
        return {
            "case": name, "description": case.description, "plan_kwargs": case.plan_kwargs,
            "import_seconds": round(import_s, 3), "build_seconds": round(build_s, 3),
            "plan_seconds": round(plan_s, 3), "max_rss_bytes": rss, "goal_seconds": case.goal_seconds,
            "goal_rss_bytes": case.goal_rss_bytes, "expect_zero_stage": case.expect_zero_stage,
            "meets_goals": False, "error": failure, "profiled": profile,
        }
    ok_time = plan_s <= case.goal_seconds
    ok_rss = case.goal_rss_bytes is None or rss <= case.goal_rss_bytes
    ok_zero = case.expect_zero_stage is None or p.zero_stage == case.expect_zero_stage
    return {
        "case": name,
        "description": case.description,
        "plan_kwargs": case.plan_kwargs,
        "import_seconds": round(import_s, 3),
        "build_seconds": round(build_s, 3),
        "plan_seconds": round(plan_s, 3),
        "max_rss_bytes": rss,
        "num_params": int(p.estimate.num_params),
        "goal_seconds": case.goal_seconds,
        "goal_rss_bytes": case.goal_rss_bytes,
        "expect_zero_stage": case.expect_zero_stage,
        "meets_goals": bool(ok_time and ok_rss and ok_zero),
        "plan": {
            "micro_batch_size": p.micro_batch_size,
            "grad_accum_steps": p.grad_accum_steps,
            "world_size": p.world_size,
            "precision": p.precision,
            "checkpoint_blocks": p.checkpoint_blocks,
            "zero_stage": p.zero_stage,
            "offload_optimizer": p.offload_optimizer,
            "predicted_peak_bytes": int(p.estimate.peak_bytes),
            "usable_bytes": int(p.usable_bytes),
        },
        "explain": p.explain(),
        "profiled": profile,
    }


# --------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------


def _run_case(name: str, profile: bool, timeout: float) -> dict[str, Any]:
    run = run_worker("benchmarks.plan_speed", ["--worker", name] + (["--profile-worker"] if profile else []), _MARKER,
                     timeout=timeout)
    if profile and run.stderr:
        print(run.stderr, file=sys.stderr)
    if run.result is None:
        return {"case": name, "error": run.error_tail(2000), "meets_goals": False}
    return {**run.result, "subprocess_wall_seconds": round(run.wall_seconds, 3)}


def _fmt_gib(n: int | None) -> str:
    return "—" if n is None else f"{n / _GIB:.2f}"


def _markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [
        "# memguard planning speed",
        "",
        f"- command: `{report['command']}`",
        f"- date: {report['date']}",
        f"- machine: {m['cpu_model']}, {m['usable_cores']} usable of {m['cores']} cores, "
        f"{m['ram_bytes'] / _GIB:.1f} GiB RAM, {m['platform']}",
        f"- software: Python {m['python']}, torch {m['torch']} ({m['torch_threads']} intra-op threads)",
        f"- load average (1/5/15 min) before: {report['load_before']}, after: {report['load_after']} "
        "(other work shared these cores; times are wall clock)",
        "- each case in a fresh subprocess; the model is built on `meta`; timed: the `memguard.plan` call",
        "",
        "| case | plan s | goal s | import s | build s | peak RSS GiB | goal RSS | chosen plan | meets goals |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in report["results"]:
        if "error" in r:
            if "plan_seconds" in r:  # memguard answered, with an error
                first = r["error"].splitlines()[0][:160]
                lines.append(
                    f"| {r['case']} | {r['plan_seconds']:.2f} | {r['goal_seconds']:.0f} | {r['import_seconds']:.2f} | "
                    f"{r['build_seconds']:.2f} | {_fmt_gib(r['max_rss_bytes'])} | {_fmt_gib(r['goal_rss_bytes'])} | "
                    f"{first} | no |")
            else:
                lines.append(f"| {r['case']} | — | — | — | — | — | — | error: {r['error'].splitlines()[-1][:120]} | no |")
            continue
        p = r["plan"]
        chosen = (
            f"mb {p['micro_batch_size']} x acc {p['grad_accum_steps']} x {p['world_size']}, {p['precision']}, "
            f"ckpt {p['checkpoint_blocks']}, ZeRO-{p['zero_stage']}" + (" +offload" if p["offload_optimizer"] else "")
            + f"; {p['predicted_peak_bytes'] / _GIB:.1f} of {p['usable_bytes'] / _GIB:.1f} GiB"
        )
        lines.append(
            f"| {r['case']} | {r['plan_seconds']:.2f} | {r['goal_seconds']:.0f} | {r['import_seconds']:.2f} | "
            f"{r['build_seconds']:.2f} | {_fmt_gib(r['max_rss_bytes'])} | {_fmt_gib(r['goal_rss_bytes'])} | {chosen} | "
            f"{'yes' if r['meets_goals'] else 'no'} |"
        )
    lines.append("")
    for r in report["results"]:
        if "explain" in r:
            lines += [f"## {r['case']}: {r['description']}", "", "```", r["explain"], "```", ""]
        elif "error" in r:
            lines += [f"## {r['case']}: {r['description'] if 'description' in r else ''}", "", "```", r["error"], "```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
    parser.add_argument("--out", default=str(_REPO / "benchmarks" / "results"), help="folder for the results")
    parser.add_argument("--profile", metavar="CASE", help="cProfile one case and print where the time goes")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per case before giving up")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--profile-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        print(_MARKER + json.dumps(_worker(args.worker, args.profile_worker)), flush=True)
        return 0
    if args.profile:
        r = _run_case(args.profile, True, args.timeout)
        print(json.dumps({k: v for k, v in r.items() if k != "explain"}, indent=1))
        return 0

    names = [n for n in args.cases.split(",") if n]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; choose from {', '.join(CASES)}")
    load_before = [round(x, 2) for x in os.getloadavg()]
    results = []
    for name in names:
        r = _run_case(name, False, args.timeout)
        results.append(r)
        if "error" in r:
            print(f"{name}: {r['error']} ({r.get('plan_seconds', '—')} s)", file=sys.stderr)
        else:
            print(f"{name}: plan {r['plan_seconds']:.2f} s (goal {r['goal_seconds']:.0f} s), "
                  f"RSS {r['max_rss_bytes'] / _GIB:.2f} GiB -> {r['plan']}", file=sys.stderr)
    report = {
        "command": "python -m benchmarks.plan_speed" + ("" if not argv else " " + shlex.join(argv)),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_description(),
        "load_before": load_before,
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "results": results,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan_speed.json").write_text(json.dumps(report, indent=1) + "\n")
    md = _markdown(report)
    (out / "plan_speed.md").write_text(md + "\n")
    print(md)
    return 0 if all(r.get("meets_goals") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
