"""The peak of a ``torch.compile``-d training step against the eager one, on the CPU model zoo.

memguard traces the eager step. A compiled step runs other code: AOTAutograd's min-cut
partitioner (``torch/_functorch/partitioners.py``, ``min_cut_rematerialization_partition``, the
default of the inductor backend) chooses which forward values are saved for backward and which
are recomputed, and inductor fuses pointwise ops so their intermediates never exist, but it also
keeps its own buffers (``torch/_inductor``) and the compiled graph holds its saved values until
backward has run. Whether the eager estimate bounds the compiled peak is therefore a measured
question (pytorch/pytorch#122512 reports compiled peaks above eager ones on CUDA).

For each case of :mod:`benchmarks.zoo` given, one subprocess (one intra-op thread) measures:

* ``eager``: the real peak of live tensor bytes of a steady-state step
  (:func:`benchmarks.ground_truth.measure_cpu_peak`, 2 steps, the worst counts), the CPU-truth
  method of ``benchmarks/accuracy_cpu.py``;
* ``compiled``: the same for ``torch.compile(model, backend=...)`` after one untimed step that
  compiles forward and backward (the measured steps reuse the compiled graphs);
* ``estimate``: ``memguard.estimate(model, batch, device="cpu")`` of the eager step.

Usage::

    python benchmarks/compile_cpu.py                            # default cases, inductor
    python benchmarks/compile_cpu.py --cases mlp,tied-lm --backend aot_eager --out my-results
    python benchmarks/compile_cpu.py --render benchmarks/results/compile_cpu.json   # the Markdown again

Writes ``compile_cpu.json`` and ``compile_cpu.md`` (``--name``) to ``--out`` (default ``benchmarks/results``)
and prints the Markdown table. The inductor backend needs a C++ compiler on the host (it builds
its CPU kernels with one); ``--backend aot_eager`` runs AOTAutograd's partitioned graphs eagerly
without one.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))  # `benchmarks` from this checkout when run by path
from benchmarks.common import machine_description, run_worker  # noqa: E402

_MARKER = "@@COMPILE_CPU_RESULT@@ "
_MIB = 1 << 20

#: Small zoo cases whose compilation takes well under a minute on one core (measured: see the results).
DEFAULT_CASES = ("mlp", "tied-lm", "ckpt-mlp", "frozen-encoder", "resnet-bn", "convnext", "lstm-lm", "gpt2")


def _worker(name: str, backend: str, steps: int) -> dict[str, Any]:
    import copy

    import torch

    torch.set_num_threads(1)  # as accuracy_cpu.py: deterministic, comparable
    import memguard
    from benchmarks.ground_truth import measure_cpu_peak
    from benchmarks.zoo import CASES, real_step

    case = CASES[name]
    base, batch, loss_fn = case.build("cpu")
    out: dict[str, Any] = {"case": name, "backend": backend}
    est = memguard.estimate(base, batch, optimizer=case.optimizer, loss_fn=loss_fn, device="cpu",
                            precision=case.precision)
    out["estimate_bytes"] = int(est.peak_bytes)

    model, b, lf = real_step(copy.deepcopy(base), batch, loss_fn, case.precision)
    opt = case.optimizer(model.parameters())
    out["eager_bytes"] = measure_cpu_peak(model, b, lf, opt, steps=steps).peak_bytes
    del model, opt

    model, b, lf = real_step(copy.deepcopy(base), batch, loss_fn, case.precision)
    opt = case.optimizer(model.parameters())
    compiled = torch.compile(model, backend=backend)
    from memguard.batch import compute_loss

    t0 = time.perf_counter()
    loss = compute_loss(compiled, b, lf)  # compiles the forward (and, at backward, the backward)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    del loss
    out["compile_seconds"] = round(time.perf_counter() - t0, 1)
    gt = measure_cpu_peak(compiled, b, lf, opt, steps=steps)
    out["compiled_bytes"] = gt.peak_bytes
    out["compiled_peak_phase"] = gt.peak_phase
    out["compiled_phase_peaks"] = dict(gt.phase_peaks)
    return out


def _run(name: str, backend: str, steps: int, timeout: float) -> dict[str, Any]:
    run = run_worker("benchmarks.compile_cpu", ["--worker", name, "--backend", backend, "--steps", str(steps)],
                     _MARKER, timeout=timeout, one_thread=True)
    return run.result if run.result is not None else {"case": name, "backend": backend, "error": run.error_tail(600)}


def render_markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The report: header, one row per case, and the bound the rows support."""
    m = meta["machine"]
    lines = [
        "# Compiled vs eager training-step peak (CPU)",
        "",
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}",
        f"- machine: {m.get('cpu_model')}, {m.get('cpus_usable')} usable of {m.get('cpu_count')} cores, "
        f"{m.get('os')}; torch {m.get('torch')}, 1 intra-op thread",
        f"- backend: `{meta['backend']}`; truth: {meta['steps']} real steps under torch.profiler "
        "(profile_memory), worst step's peak of live tensor bytes, after one compiling step",
        "- compile s: wall time of the first (compiling) step, on this host as loaded at the time; inductor's on-disk "
        "cache (an earlier run of the same graph) shortens it",
        "",
        "| case | eager MiB | compiled MiB | compiled / eager | compiled peak in | estimate MiB | estimate / compiled "
        "| compile s |",
        "|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | error: {r['error'][-160:].replace('|', '/').replace(chr(10), ' ')} |||||||")
            continue
        e, c, s = r["eager_bytes"], r["compiled_bytes"], r["estimate_bytes"]
        lines.append(f"| {r['case']} | {e / _MIB:.2f} | {c / _MIB:.2f} | {c / e:.3f} | {r.get('compiled_peak_phase', '—')} | "
                     f"{s / _MIB:.2f} | {s / c:.3f} | {r['compile_seconds']} |")
    ok = [r for r in rows if "error" not in r]
    if ok:
        worst = max(ok, key=lambda r: r["compiled_bytes"] / r["eager_bytes"])
        lines += [
            "",
            f"Largest compiled / eager ratio: {worst['compiled_bytes'] / worst['eager_bytes']:.3f} ({worst['case']}); "
            f"estimate >= compiled in {sum(r['estimate_bytes'] >= r['compiled_bytes'] for r in ok)} of {len(ok)} cases.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(DEFAULT_CASES))
    p.add_argument("--backend", default="inductor", help="torch.compile backend: inductor (needs a C++ compiler) or aot_eager")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per case")
    p.add_argument("--out", default=str(_REPO / "benchmarks" / "results"))
    p.add_argument("--name", default="compile_cpu", help="file name of the results, without .json/.md")
    p.add_argument("--render", metavar="JSON", help="only rewrite the Markdown of an earlier run's compile_cpu.json")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.render:
        data = json.loads(Path(args.render).read_text())
        md = render_markdown(data["rows"], data["meta"])
        Path(args.render).with_suffix(".md").write_text(md)
        print(md)
        return 0
    if args.worker:
        print(_MARKER + json.dumps(_worker(args.worker, args.backend, args.steps)), flush=True)
        return 0
    rows = [_run(name, args.backend, args.steps, args.timeout) for name in args.cases.split(",") if name]
    argv_shown = sys.argv[1:] if argv is None else argv
    meta = {
        "command": " ".join(["python benchmarks/compile_cpu.py", *(shlex.quote(a) for a in argv_shown)]),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_description(gpu=False),
        "backend": args.backend,
        "steps": args.steps,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    md = render_markdown(rows, meta)
    (out / f"{args.name}.md").write_text(md)
    print(md)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
