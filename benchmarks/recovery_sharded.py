"""OOM recovery under sharded training on CPU: what an OOM on one rank costs, per strategy, with memguard
and with the framework alone.

Every case trains the same job on two gloo ranks: ``tests/integrations/worker_common.py``'s ``Net`` (about
1 MiB of activations per sample at ``seq=64``), 4 optimizer steps of 64 samples per rank in micro-batches of
32, plain SGD. From step 1 on, rank 1 caps its address space with ``RLIMIT_AS`` at VmSize + 20 MiB (a
backward of 32 samples does not fit, 16 does; ``MALLOC_ARENA_MAX=1`` and a 64 KiB mmap threshold, as in the
integration tests, so the cap tracks live memory). Cases:

* ``ddp``: ``DistributedDataParallel`` + ``memguard.prepare``/``memguard.step``;
* ``fsdp2``: a ``fully_shard``-ed model (each ``Linear``, then the root) + ``memguard.prepare(...,
  strategy="fsdp2")``/``memguard.step``;
* ``accelerate-ddp`` / ``accelerate-fsdp1`` / ``accelerate-fsdp2``: an ``accelerate.Accelerator`` with 2
  accumulated batches of 32 (DDP; Accelerate's FSDP1 plugin, ``FULL_SHARD``, ``use_orig_params=True``; its
  FSDP2 plugin from ``accelerator_kwargs`` of an FSDP2 plan) + ``memguard.integrations.accelerate``;
* ``lightning-fsdp2``: a Lightning ``Trainer`` with ``ModelParallelStrategy`` (``fully_shard`` in
  ``configure_model``), 2 accumulated batches of 32 + ``memguard.integrations.lightning.MemguardCallback``;
* ``zero1`` / ``zero2`` / ``zero3`` / ``zero2-unmanaged``: a DeepSpeed engine +
  ``memguard.integrations.deepspeed.step`` (``tests/integrations/deepspeed_worker.py``, one pair of ranks
  for all of them).

The ``ddp``/``fsdp2``/``accelerate-*``/``lightning-*`` cases and every baseline run
``benchmarks/recovery_worker.py`` under ``torchrun``. Reported per case:

* ``recovered``, ``hang``, ``retries``, ``micro_batch_size``: whether both ranks finished, and how.
* ``samples_lost`` / ``samples_twice``: samples of a step missing from (or repeated in) the attempt that
  produced its update, over both ranks (the guard's promise: 0 and 0).
* ``oom_step_s``: the step that ran out of memory, from its start to its update, on rank 1;
  ``detect_s``: from its start to the agreed retry (the failed attempt and the agreement);
  ``redo_s``: from the agreed retry to the update (the reset and the redone samples);
  ``normal_step_s``: the median of the steps after it (same micro-batch as the redo);
  ``cost_s``: ``oom_step_s - normal_step_s``, what the OOM cost.
* ``baseline``: the same job and the same cap with the framework's own loop and no memguard (what the
  framework does alone): each rank's outcome, the time from the OOM to the end of the job, whether it hung
  (process groups time out after 60 s, the run is killed after 150 s), and the samples never trained.
* DeepSpeed only: ``agreements_per_step``, ``agreement_ms`` (one agreement alone, 200 in a row),
  ``step_with_s``/``step_without_s`` (medians of ``--time-steps`` interleaved uncapped steps with the
  agreements and with them skipped), ``overhead_pct``; and ``control``: the same OOM with memguard's retry
  but DeepSpeed's collectives run without the agreements (the worker's process groups time out after 90 s).

Usage::

    python benchmarks/recovery_sharded.py                          # every case, baselines and controls
    python benchmarks/recovery_sharded.py --cases fsdp2,zero2 --no-control --no-baseline

Writes ``recovery_sharded.json`` and ``recovery_sharded.md`` to ``--out`` (default ``benchmarks/results``).
The DeepSpeed cases need DeepSpeed with its CPU shm op built (``bash scripts/dev.sh setup``), the
``accelerate-*`` cases Accelerate, ``lightning-fsdp2`` Lightning (``lightning.pytorch``).
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

WORKER = REPO / "tests" / "integrations" / "deepspeed_worker.py"  # the guarded DeepSpeed rows
RECOVERY_WORKER = REPO / "benchmarks" / "recovery_worker.py"  # every other row, and every baseline
CASES: dict[str, dict[str, Any]] = {  # name -> what runs it: the framework path, and the workers' options
    "ddp": {"path": "memguard.step, DistributedDataParallel", "case": "ddp"},
    "fsdp2": {"path": "memguard.step, fully_shard (FSDP2)", "case": "fsdp2"},
    "accelerate-ddp": {"path": "Accelerate, DDP", "case": "accelerate-ddp"},
    "accelerate-fsdp1": {"path": "Accelerate, FSDP1 plugin (use_orig_params)", "case": "accelerate-fsdp1"},
    "accelerate-fsdp2": {"path": "Accelerate, FSDP2 plugin", "case": "accelerate-fsdp2"},
    "lightning-fsdp2": {"path": "Lightning, ModelParallelStrategy (FSDP2)", "case": "lightning-fsdp2"},
    "zero1": {"path": "DeepSpeed ZeRO-1", "case": "deepspeed", "stage": 1},
    "zero2": {"path": "DeepSpeed ZeRO-2", "case": "deepspeed", "stage": 2},
    "zero3": {"path": "DeepSpeed ZeRO-3", "case": "deepspeed", "stage": 3},
    "zero2-unmanaged": {"path": "DeepSpeed ZeRO-2, managed_gradient_accumulation false", "case": "deepspeed",
                        "stage": 2, "managed": False},
}
STRATEGIES = CASES  # the name before --cases
_STEPS = {"steps": 4, "batch": 64, "micro": 32, "seq": 64, "cap_step": 1, "cap_ranks": [1]}
_BUDGET_MIB = 20  # the backward of 32 samples fails, 16 fits (tests/integrations/test_deepspeed.py, test_accelerate.py)
_PG_TIMEOUT_S = 60  # the baselines' process groups: a rank left in a collective fails after this, not 30 min
_BASELINE_KILL_S = 150.0  # a baseline still running after this hangs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clean(text: str) -> str:
    """``text`` without this machine's paths: the checkout as ``.``, installed packages as ``<site-packages>``."""
    import torch

    site = str(Path(torch.__file__).resolve().parent.parent)
    text = text.replace(str(REPO), ".").replace(site, "<site-packages>").replace(sys.prefix, "<python>")
    return re.sub(r"\n *host *: [^\n]*", "", text)  # torchrun's failure summary names the host


def _env() -> dict[str, str]:
    # One malloc arena (gloo's threads would each get one and make the cap erratic) and a fixed mmap threshold,
    # so that freed tensors leave the address space and the cap tracks live memory (tests/guard/test_fsdp2_recovery.py)
    env = dict(os.environ, DS_ACCELERATOR="cpu", MALLOC_ARENA_MAX="1", MALLOC_MMAP_THRESHOLD_="65536",
               OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _communicate(command: list[str], timeout: float) -> tuple[bool, float, str, float]:
    """Run ``command`` in a session of its own: (finished in time, wall seconds, output, wall clock at the end)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(command, env=_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        text = proc.communicate(timeout=timeout)[0]
        done = True
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text = proc.communicate()[0]
        done = False
    return done, time.perf_counter() - t0, text, time.time()


def run_worker(cfg: dict[str, Any], out: Path, timeout: float) -> tuple[bool, float, str]:
    """Two ranks of the DeepSpeed worker (it spawns them): (finished in time, wall seconds, output tail)."""
    done, wall, text, _ = _communicate(
        [sys.executable, str(WORKER), json.dumps({"out": str(out), "port": _free_port(), **cfg})], timeout)
    return done, wall, _clean(text[-1500:])


def run_torchrun(cfg: dict[str, Any], out: Path, timeout: float) -> tuple[bool, float, str, float]:
    """Two ranks of ``recovery_worker.py`` under torchrun: (finished in time, wall s, output, wall clock at the end)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(_free_port()), str(RECOVERY_WORKER), json.dumps({"out": str(out), **cfg})]
    return _communicate(command, timeout)


def _load(out: Path, name: str | None = None) -> list[dict | None]:
    rows = []
    for r in (0, 1):
        path = out / (f"result{r}_{name}.json" if name else f"result{r}.json")
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


def _guarded_row(r0: dict | None, r1: dict | None, done: bool, tail: str) -> dict[str, Any]:
    """A guarded run's row from both ranks' results (the capped rank is 1)."""
    if r0 is None or r1 is None:
        return {"recovered": False, "hang": not done, "error": _clean(tail[-1500:])}
    ok = r0["error"] is None and r1["error"] is None
    row: dict[str, Any] = {"recovered": ok, "hang": False, "retries": r1["oom_retries"],
                           "micro_batch_size": r1["micro_batch_size"],
                           "errors": [r0["error"], r1["error"]] if not ok else None}
    lost = twice = 0
    for r in (r0, r1):
        a, b = sample_accounting(r)
        lost, twice = lost + a, twice + b
    # a step never run is lost too: the job stopped before it
    lost += sum(_STEPS["batch"] * (_STEPS["steps"] - len(r["step_times"])) for r in (r0, r1))
    row.update(samples_lost=lost, samples_twice=twice)
    cap_step = _STEPS["cap_step"]
    if ok and r1["retry_times"]:
        start, end = r1["step_times"][cap_step]
        normal = statistics.median(e - s for s, e in r1["step_times"][cap_step + 1:])
        row.update(oom_step_s=end - start, detect_s=r1["retry_times"][0] - start, redo_s=end - r1["retry_times"][-1],
                   normal_step_s=normal, cost_s=end - start - normal)
    return row


def guarded_deepspeed(names: list[str], time_steps: int, timeout: float) -> dict[str, dict[str, Any]]:
    """The DeepSpeed cases with memguard's protocol, in one pair of ranks (tests/integrations/deepspeed_worker.py)."""
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        runs = [{"name": n, "stage": CASES[n]["stage"], "managed": CASES[n].get("managed", True),
                 "budget_mib": _BUDGET_MIB, "time_steps": time_steps} for n in names]
        done, wall, tail = run_worker({**_STEPS, "runs": runs}, out, timeout)
        for n in names:
            r0, r1 = _load(out, n)
            row = _guarded_row(r0, r1, done, tail)
            timing = r0.get("timing") if r0 else None
            if timing:
                row.update(agreements_per_step=timing["agreements_per_step"], agreement_ms=timing["agreement_ms"],
                           step_with_s=timing["with"], step_without_s=timing["without"],
                           timing_micro_batch_size=timing["micro_batch_size"],
                           overhead_pct=100.0 * (timing["with"] / timing["without"] - 1.0))
            rows[n] = row
    return rows


def _worker_cfg(name: str, guarded: bool) -> dict[str, Any]:
    spec = {k: v for k, v in CASES[name].items() if k != "path"}
    return {**_STEPS, **spec, "guarded": guarded, "budget_mib": _BUDGET_MIB, "pg_timeout_s": _PG_TIMEOUT_S}


def guarded_torchrun(name: str, timeout: float) -> dict[str, Any]:
    """One case with memguard, under torchrun (recovery_worker.py)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        done, wall, text, _ = run_torchrun(_worker_cfg(name, True), out, timeout)
        r0, r1 = _load(out)
        return _guarded_row(r0, r1, done, text)


def _what(message: str) -> str:
    """A short name for an error a rank ended with."""
    m = message.lower()
    if "can't allocate memory" in m or "out of memory" in m:
        return "OOM (" + ("DefaultCPUAllocator" if "defaultcpuallocator" in m else message[:60]) + ")"
    if "connection closed by peer" in m or "connection reset by peer" in m:
        return "gloo: connection closed by the peer"
    if "timed out" in m or "timeout" in m:
        return "process-group timeout"
    return message[:80]


def _torchrun_exits(text: str) -> dict[int, str]:
    """Each failed rank's exit as torchrun's summary reports it (``rank : 1 ... exitcode : -15 ... (SIGTERM)``)."""
    exits: dict[int, str] = {}
    for rank, code, rest in re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)([^\n]*)",
                                       text):
        sig = re.search(r"\((SIG\w+)\)", rest)
        exits[int(rank)] = f"exit {code}" + (f" ({sig.group(1)} from torchrun)" if sig else "")
    return exits


def baseline(name: str, timeout: float = _BASELINE_KILL_S) -> dict[str, Any]:
    """The same job and cap with the framework's own loop, no memguard: what happens, and how fast."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        done, wall, text, end = run_torchrun(_worker_cfg(name, False), out, timeout)
        results = _load(out)
    exits = _torchrun_exits(text) if done else {}
    ranks = []
    for r, res in enumerate(results):
        if res is not None and res["error"] is not None:
            ranks.append({"rank": r, "outcome": _what(res["error"]["message"]), "type": res["error"]["type"],
                          "message": _clean(res["error"]["message"][:300]), "steps_done": res["steps_done"],
                          "error_wall": res["error_wall"], "exit": exits.get(r)})
        elif res is not None:
            ranks.append({"rank": r, "outcome": "finished", "steps_done": res["steps_done"], "exit": exits.get(r)})
        else:
            ranks.append({"rank": r, "outcome": exits.get(r, "killed after the timeout" if not done else "no result"),
                          "steps_done": None, "exit": exits.get(r)})
    errors = [x["error_wall"] for x in ranks if "error_wall" in x]
    first = min(errors) if errors else None
    for x in ranks:
        if "error_wall" in x:
            x["after_first_error_s"] = x.pop("error_wall") - first
    steps_done = [x["steps_done"] for x in ranks if x["steps_done"] is not None]
    finished = all(x["outcome"] == "finished" for x in ranks)
    return {"finished": done, "hang": not done, "recovered": done and finished, "wall_s": wall,
            "oom_to_end_s": None if first is None else end - first, "ranks": ranks,
            "samples_not_trained": 2 * _STEPS["batch"] * (_STEPS["steps"] - min(steps_done)) if steps_done else None,
            "tail": None if finished else _clean(text[-800:])}


def control(name: str, timeout: float) -> dict[str, Any]:
    """The same OOM with DeepSpeed's collectives unguarded (the worker's ``no_agreements``)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        run = {"name": name, "stage": CASES[name]["stage"], "managed": CASES[name].get("managed", True),
               "budget_mib": _BUDGET_MIB, "no_agreements": True}
        done, wall, tail = run_worker({**_STEPS, "runs": [run]}, out, timeout)
        r0, r1 = _load(out, name)
        errors = [None if r is None else r["error"] for r in (r0, r1)]
        return {"finished": done, "wall_s": wall,
                "recovered": done and all(r is not None and r["error"] is None for r in (r0, r1)),
                "errors": [None if e is None else {"type": e["type"], "message": _clean(e["message"][:300])}
                           for e in errors],
                "train_s": [None if r is None else r["train_s"] for r in (r0, r1)],
                "tail": None if done and r0 is not None and r1 is not None else tail[-600:]}


def _f(v: Any, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v) if isinstance(v, float) else str(v)


def _baseline_text(b: dict[str, Any] | None) -> tuple[str, str, str]:
    """(outcome, OOM to the end of the job, samples never trained) of a baseline, for the table."""
    if b is None:
        return "not run", "-", "-"
    if b["hang"]:
        return f"hang (killed after {b['wall_s']:.0f} s)", "-", "-"
    if b["recovered"]:
        return "finished", "-", "0"
    parts = []
    for x in b["ranks"]:
        text = x["outcome"]
        if x.get("after_first_error_s"):
            text += f" {x['after_first_error_s']:.1f} s later"
        parts.append(f"rank {x['rank']}: {text}")
    return "; ".join(parts), _f(b["oom_to_end_s"], "{:.1f} s"), _f(b["samples_not_trained"])


def _control_text(c: dict[str, Any] | None) -> str:
    if c is None:
        return "not run"
    if not c["finished"]:
        return f"hang (killed after {c['wall_s']:.0f} s)"
    if c["recovered"]:
        return "recovered"
    died = re.search(r"process (\d+) terminated with signal (\w+)", c.get("tail") or "")
    parts = [f"rank {i}: {e['type']}" for i, e in enumerate(c["errors"]) if e]
    if died:
        parts.append(f"rank {died.group(1)}: killed by {died.group(2)}")
    times = [t for t in c["train_s"] if t is not None]
    return "; ".join(parts) + (f" after {max(times):.0f} s" if times else "")


def render_markdown(meta: dict[str, Any], rows: dict[str, dict[str, Any]]) -> str:
    m, s = meta["machine"], meta["setup"]
    lines = ["# OOM recovery under sharding on CPU (2 gloo ranks): memguard and the framework alone", "",
             f"Command: `{meta['command']}`  ", f"Date: {meta['date']}  ",
             f"Machine: {m.get('cpu_model')}, {m.get('cores')} cores, load {m.get('load_average')}, "
             f"torch {m.get('torch')}, accelerate {m.get('accelerate')}, deepspeed {m.get('deepspeed')}", "",
             f"Job: {s['steps']} optimizer steps of {s['batch']} samples per rank, micro-batch {s['micro']}; from "
             f"step {s['cap_step']} rank 1 may grow {s['budget_mib']} MiB (RLIMIT_AS): 32 samples do not fit, 16 do. "
             f"Baseline: the same job and cap, the framework's own loop without memguard, process groups timing "
             f"out after {s['baseline_process_group_timeout_s']} s. Times in seconds, on rank 1; lost/twice over "
             "both ranks.", "",
             "| case | path | recovered | hang | retries | micro | lost | twice | OOM step | detect | redo "
             "| normal step | OOM cost | framework alone | its OOM to end of job | its samples not trained |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        outcome, t_end, untrained = _baseline_text(r.get("baseline"))
        lines.append(f"| {name} | {CASES[name]['path']} | {_f(r.get('recovered'))} | {_f(r.get('hang'))} | "
                     f"{_f(r.get('retries'))} | {_f(r.get('micro_batch_size'))} | {_f(r.get('samples_lost'))} | "
                     f"{_f(r.get('samples_twice'))} | {_f(r.get('oom_step_s'))} | {_f(r.get('detect_s'))} | "
                     f"{_f(r.get('redo_s'))} | {_f(r.get('normal_step_s'))} | {_f(r.get('cost_s'), '{:+.2f}')} | "
                     f"{outcome} | {t_end} | {untrained} |")
    guarded = [r for r in rows.values() if r.get("recovered") is not None]
    bases = [r["baseline"] for r in rows.values() if r.get("baseline")]
    lines += ["", f"With memguard: {sum(bool(r['recovered']) for r in guarded)} of {len(guarded)} cases recovered, "
              f"{sum(bool(r.get('hang')) for r in guarded)} hung, "
              f"{sum((r.get('samples_lost') or 0) + (r.get('samples_twice') or 0) for r in guarded)} samples lost or "
              f"run twice. The framework alone: {sum(bool(b['recovered']) for b in bases)} of {len(bases)} jobs "
              f"finished, {sum(bool(b['hang']) for b in bases)} hung. \"framework alone\" lists each rank's error "
              "(the survivor's delay after the OOM in seconds); \"OOM to end of job\" runs from rank 1's error to "
              "torchrun's exit; the samples not trained are those of the failed step and the steps after it."]
    ds = [n for n in rows if CASES[n]["case"] == "deepspeed"]
    if ds:
        lines += ["", "DeepSpeed: the agreements' cost when nothing fails, and the same OOM with memguard's retry but "
                  "DeepSpeed's collectives run without the agreements (process groups time out after 90 s):", "",
                  "| case | agreements/step | ms each | step with / without s | overhead | without agreements |",
                  "|---|---|---|---|---|---|"]
        for name in ds:
            r = rows[name]
            lines.append(f"| {name} | {_f(r.get('agreements_per_step'), '{:.0f}')} | "
                         f"{_f(r.get('agreement_ms'), '{:.2f}')} | {_f(r.get('step_with_s'), '{:.3f}')} / "
                         f"{_f(r.get('step_without_s'), '{:.3f}')} | {_f(r.get('overhead_pct'), '{:+.1f}%')} | "
                         f"{_control_text(r.get('control'))} |")
    return "\n".join(lines) + "\n"


def rerender(path: Path) -> None:
    """Write the Markdown of an existing JSON again (after a change to the table)."""
    data = json.loads(path.read_text())
    path.with_suffix(".md").write_text(render_markdown(data["meta"], data["rows"]))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", "--strategies", dest="cases", default=",".join(CASES),
                    help="comma-separated: " + ", ".join(CASES))
    ap.add_argument("--no-baseline", action="store_true", help="skip the runs of the framework alone")
    ap.add_argument("--no-control", action="store_true", help="skip the DeepSpeed runs without the agreements")
    ap.add_argument("--control-only", action="store_true", help="only the DeepSpeed runs without the agreements")
    ap.add_argument("--time-steps", type=int, default=7,
                    help="DeepSpeed: interleaved steps with and without the agreements")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds for the guarded runs of one worker")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    names = [n for n in args.cases.split(",") if n]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        ap.error(f"unknown cases {unknown}; choose from {', '.join(CASES)}")
    meta = {"command": "python benchmarks/recovery_sharded.py " + " ".join(shlex.quote(a) for a in
                                                                          (argv if argv is not None else sys.argv[1:])),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine_description(packages=("accelerate", "deepspeed", "lightning"), gpu=False, torch_threads=1),
            "setup": {**_STEPS, "budget_mib": _BUDGET_MIB, "world_size": 2, "backend": "gloo",
                      "baseline_process_group_timeout_s": _PG_TIMEOUT_S, "baseline_killed_after_s": _BASELINE_KILL_S,
                      "deepspeed_worker_process_group_timeout_s": 90}}
    ds = [n for n in names if CASES[n]["case"] == "deepspeed"]
    rows: dict[str, dict[str, Any]] = {n: {"recovered": None} for n in names}
    if not args.control_only:
        if ds:
            rows.update(guarded_deepspeed(ds, args.time_steps, args.timeout))
        for n in names:
            if n not in ds:
                rows[n] = guarded_torchrun(n, args.timeout)
            print(n, json.dumps(rows[n]), flush=True)
        if not args.no_baseline:
            for n in names:  # one pair of ranks each: an OOM without memguard ends the job
                rows[n]["baseline"] = baseline(n)
                print(n, "baseline", json.dumps(rows[n]["baseline"]), flush=True)
    if not args.no_control:
        for n in ds:
            rows[n]["control"] = control(n, timeout=240.0)
            print(n, "control", json.dumps(rows[n]["control"]), flush=True)
    rows = {n: rows[n] for n in names}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = {"meta": meta, "rows": rows}
    (out / "recovery_sharded.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / "recovery_sharded.md").write_text(render_markdown(meta, rows))
    print(render_markdown(meta, rows))
    return data


if __name__ == "__main__":
    main()
