"""OOM recovery under sharded training on CPU: what an OOM on one rank costs, per DeepSpeed ZeRO stage.

Each strategy trains the worker model of ``tests/integrations/deepspeed_worker.py`` on two gloo
ranks (3 optimizer steps of 64 samples per rank, micro-batch 32, about 1 MiB of activations per
sample) through :func:`memguard.integrations.deepspeed.step`. From step 1 on rank 1 caps its
address space with ``RLIMIT_AS`` (20 MiB above its size then: the backward of 32 samples does not
fit, 16 does). Reported per strategy:

* ``recovered``, ``retries``, ``micro_batch_size``: whether both ranks finished, and how.
* ``samples_lost`` / ``samples_twice``: samples of a step missing from (or repeated in) the
  attempt that produced its update, over both ranks (the guard's promise: 0 and 0).
* ``oom_step_s``: the step that ran out of memory, from its start to its update, on rank 1;
  ``detect_s``: from its start to the agreed retry (the failed attempt and the agreement);
  ``redo_s``: from the agreed retry to the update (the reset and the redone samples);
  ``normal_step_s``: the median of the uncapped steps after it (same micro-batch as the redo).
* ``agreements_per_step``, ``agreement_ms`` (one agreement alone, 200 in a row), ``step_with_s`` and
  ``step_without_s`` (medians of interleaved uncapped steps with the agreements and with them
  skipped) and ``overhead_pct``: the protocol's cost when nothing fails.
* ``control``: the same OOM with DeepSpeed's collectives run without the agreements (only the
  agreement that ends an attempt is left): what the ranks did and how long it took. The worker's
  process groups time out after 90 s.

Usage::

    python benchmarks/recovery_sharded.py                          # ZeRO-1/2/3, with controls
    python benchmarks/recovery_sharded.py --strategies zero2 --no-control

Writes ``recovery_sharded.json`` and ``recovery_sharded.md`` to ``--out`` (default
``benchmarks/results``). Needs DeepSpeed with its CPU shm op built (``bash scripts/dev.sh setup``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))  # `benchmarks` from this checkout when run by path
from benchmarks.common import REPO, machine_description  # noqa: E402

WORKER = REPO / "tests" / "integrations" / "deepspeed_worker.py"
STRATEGIES = {  # name -> the worker's run options
    "zero1": {"stage": 1},
    "zero2": {"stage": 2},
    "zero3": {"stage": 3},
    "zero2-unmanaged": {"stage": 2, "managed": False},
}
_STEPS = {"steps": 3, "batch": 64, "micro": 32, "seq": 64, "cap_step": 1, "cap_ranks": [1]}
_BUDGET_MIB = 20  # the backward of 32 samples fails, 16 fits (tests/integrations/test_deepspeed.py)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clean(text: str) -> str:
    """``text`` without this machine's paths: the checkout as ``.``, installed packages as ``<site-packages>``."""
    import torch

    site = str(Path(torch.__file__).resolve().parent.parent)
    return text.replace(str(REPO), ".").replace(site, "<site-packages>").replace(sys.prefix, "<python>")


def run_worker(cfg: dict[str, Any], out: Path, timeout: float) -> tuple[bool, float, str]:
    """Two ranks of the worker: (finished in time, wall seconds, output tail)."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", MALLOC_ARENA_MAX="1", MALLOC_MMAP_THRESHOLD_="65536",
               OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(WORKER), json.dumps({"out": str(out), "port": _free_port(), **cfg})],
                            env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        text = proc.communicate(timeout=timeout)[0]
        done = True
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text = proc.communicate()[0]
        done = False
    return done, time.perf_counter() - t0, _clean(text[-1500:])


def _load(out: Path, name: str) -> list[dict | None]:
    rows = []
    for r in (0, 1):
        path = out / f"result{r}_{name}.json"
        rows.append(json.loads(path.read_text()) if path.exists() else None)
    return rows


def sample_accounting(result: dict) -> tuple[int, int]:
    """(lost, twice): samples each step delivered that its final attempt ran zero times / more than once."""
    windows: list[list] = [[]]
    for e in result["events"]:
        if e == "STEP":
            windows.append([])
        else:
            windows[-1].append(e)
    lost = twice = 0
    for w in windows[: len(result["step_times"])]:
        delivered = [i for e in w if isinstance(e, list) and e[0] == "BATCH" for i in e[1]]
        last_retry = max((k for k, e in enumerate(w) if e == "RETRY"), default=-1)
        ran = [i for e in w[last_retry + 1:] if isinstance(e, list) and e[0] != "BATCH" for i in e]
        lost += sum(1 for i in set(delivered) if ran.count(i) == 0)
        twice += sum(1 for i in set(delivered) if ran.count(i) > 1)
    return lost, twice


def guarded(names: list[str], time_steps: int, timeout: float) -> dict[str, dict[str, Any]]:
    """Every strategy with memguard's protocol, in one pair of ranks."""
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        runs = [{"name": n, **STRATEGIES[n], "budget_mib": _BUDGET_MIB, "time_steps": time_steps} for n in names]
        done, wall, tail = run_worker({**_STEPS, "runs": runs}, out, timeout)
        for n in names:
            r0, r1 = _load(out, n)
            if r0 is None or r1 is None:
                rows[n] = {"recovered": False, "hang": not done, "error": tail}
                continue
            ok = r0["error"] is None and r1["error"] is None
            row: dict[str, Any] = {"recovered": ok, "hang": False, "retries": r1["oom_retries"],
                                   "micro_batch_size": r1["micro_batch_size"],
                                   "errors": [r0["error"], r1["error"]] if not ok else None}
            lost = twice = 0
            for r in (r0, r1):
                a, b = sample_accounting(r)
                lost, twice = lost + a, twice + b
            row.update(samples_lost=lost, samples_twice=twice)
            cap_step = _STEPS["cap_step"]
            if ok and r1["retry_times"]:
                start, end = r1["step_times"][cap_step]
                row.update(oom_step_s=end - start, detect_s=r1["retry_times"][0] - start,
                           redo_s=end - r1["retry_times"][-1],
                           normal_step_s=statistics.median(e - s for s, e in r1["step_times"][cap_step + 1:]))
            timing = r0.get("timing")
            if timing:
                row.update(agreements_per_step=timing["agreements_per_step"], agreement_ms=timing["agreement_ms"],
                           step_with_s=timing["with"], step_without_s=timing["without"],
                           timing_micro_batch_size=timing["micro_batch_size"],
                           overhead_pct=100.0 * (timing["with"] / timing["without"] - 1.0))
            rows[n] = row
    return rows


def control(name: str, timeout: float) -> dict[str, Any]:
    """The same OOM with DeepSpeed's collectives unguarded (the worker's ``no_agreements``)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        run = {"name": name, **STRATEGIES[name], "budget_mib": _BUDGET_MIB, "no_agreements": True}
        done, wall, tail = run_worker({**_STEPS, "runs": [run]}, out, timeout)
        r0, r1 = _load(out, name)
        errors = [None if r is None else r["error"] for r in (r0, r1)]
        return {"finished": done, "wall_s": wall,
                "recovered": done and all(r is not None and r["error"] is None for r in (r0, r1)),
                "errors": [None if e is None else {"type": e["type"], "message": _clean(e["message"][:300])}
                           for e in errors],
                "train_s": [None if r is None else r["train_s"] for r in (r0, r1)],
                "tail": None if done and r0 is not None and r1 is not None else tail[-600:]}


def render_markdown(meta: dict[str, Any], rows: dict[str, dict[str, Any]]) -> str:
    lines = ["# OOM recovery under DeepSpeed ZeRO on CPU (2 gloo ranks)", "",
             f"Command: `{meta['command']}`  ", f"Date: {meta['date']}  ",
             f"Machine: {meta['machine'].get('cpu_model')}, {meta['machine'].get('cores')} cores, load "
             f"{meta['machine'].get('load_average')}, torch {meta['machine'].get('torch')}, "
             f"deepspeed {meta['machine'].get('deepspeed')}", "",
             "| strategy | recovered | retries | micro | lost | twice | OOM step s | detect s | redo s | normal step s "
             "| agreements/step | ms each | step with / without s | overhead | without agreements |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(v: Any, fmt: str = "{:.3f}") -> str:
        return "-" if v is None else fmt.format(v) if isinstance(v, float) else str(v)

    for name, r in rows.items():
        c = r.get("control")
        if c is None:
            ctl = "not run"
        elif not c["finished"]:
            ctl = f"hang (killed after {c['wall_s']:.0f} s)"
        elif c["recovered"]:
            ctl = "recovered"
        else:
            died = re.search(r"process (\d+) terminated with signal (\w+)", c.get("tail") or "")
            parts = [f"rank {i}: {e['type']}" for i, e in enumerate(c["errors"]) if e]
            if died:
                parts.append(f"rank {died.group(1)}: killed by {died.group(2)}")
            times = [t for t in c["train_s"] if t is not None]
            ctl = "; ".join(parts) + (f" after {max(times):.0f} s" if times else "")
        lines.append(f"| {name} | {r['recovered']} | {f(r.get('retries'))} | {f(r.get('micro_batch_size'))} | "
                     f"{f(r.get('samples_lost'))} | {f(r.get('samples_twice'))} | {f(r.get('oom_step_s'))} | "
                     f"{f(r.get('detect_s'))} | {f(r.get('redo_s'))} | {f(r.get('normal_step_s'))} | "
                     f"{f(r.get('agreements_per_step'), '{:.0f}')} | {f(r.get('agreement_ms'), '{:.2f}')} | "
                     f"{f(r.get('step_with_s'))} / {f(r.get('step_without_s'))} | "
                     f"{f(r.get('overhead_pct'), '{:+.1f}%')} | {ctl} |")
    return "\n".join(lines) + "\n"


def rerender(path: Path) -> None:
    """Write the Markdown of an existing JSON again (after a change to the table)."""
    data = json.loads(path.read_text())
    path.with_suffix(".md").write_text(render_markdown(data["meta"], data["rows"]))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated: " + ", ".join(STRATEGIES))
    ap.add_argument("--no-control", action="store_true", help="skip the runs without the agreements")
    ap.add_argument("--control-only", action="store_true", help="only the runs without the agreements")
    ap.add_argument("--time-steps", type=int, default=7, help="interleaved steps with and without the agreements")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds for the guarded runs together")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    names = [n for n in args.strategies.split(",") if n]
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown:
        ap.error(f"unknown strategies {unknown}; choose from {', '.join(STRATEGIES)}")
    meta = {"command": "python benchmarks/recovery_sharded.py " + " ".join(shlex.quote(a) for a in
                                                                          (argv if argv is not None else sys.argv[1:])),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine_description(packages=("deepspeed",), gpu=False, torch_threads=1),
            "setup": {**_STEPS, "budget_mib": _BUDGET_MIB, "world_size": 2, "backend": "gloo",
                      "process_group_timeout_s": 90}}
    rows = guarded(names, args.time_steps, args.timeout) if not args.control_only else {n: {"recovered": None}
                                                                                         for n in names}
    for n in names:
        print(n, json.dumps(rows[n]), flush=True)
    if not args.no_control:
        for n in names:  # one pair of ranks each: an unguarded OOM breaks the process groups
            rows[n]["control"] = control(n, timeout=240.0)
            print(n, "control", json.dumps(rows[n]["control"]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "recovery_sharded.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    (out / "recovery_sharded.md").write_text(render_markdown(meta, rows))
    print(render_markdown(meta, rows))


if __name__ == "__main__":
    main()
