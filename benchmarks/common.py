"""Pieces every benchmark shares: a description of the machine, a worker in a fresh interpreter, and the
driver of the multi-rank CPU-truth benchmarks (:class:`MultiRankBenchmark`, :func:`launch_ranks`).

A benchmark script imports this as ``benchmarks.common``; a script run by path first puts the
repository root on ``sys.path`` (see the top of each script).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------------------------
# the machine
# --------------------------------------------------------------------------------------------


def _cpu_model() -> str:
    """The first ``model name`` of /proc/cpuinfo, else :func:`platform.processor` ('' if unknown)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or ""


def _ram_bytes() -> int:
    """Total RAM from /proc/meminfo, 0 where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024  # /proc/meminfo reports kB (proc(5))
    except OSError:
        pass
    return 0


def _version(module: str) -> str | None:
    """``module.__version__``, or None where the module is missing or fails to import."""
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001 - a missing tool is reported, not fatal
        return None


def machine_description(*, packages: Iterable[str] = (), gpu: bool = True, **extra: Any) -> dict[str, Any]:
    """Cores, RAM, CPU model, OS, library versions and the load average of this machine.

    The reports name a few fields two ways (``cpu_count``/``cores``, ``cpus_usable``/``usable_cores``,
    ``os``/``platform``); both spellings are filled so that every renderer finds the keys it reads.

    Args:
        packages: more modules whose ``__version__`` to record (None where not importable).
        gpu: describe CUDA device 0 (name, memory, compute capability) when CUDA is available;
            False keeps a CPU-only run from initialising CUDA.
        **extra: fields added last, overriding the measured ones (e.g. ``torch_threads=1`` where
            the workers, not this process, set the thread count).

    Returns:
        A JSON-serialisable dict.
    """
    import torch

    cores = os.cpu_count()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    info: dict[str, Any] = {
        "cpu_model": _cpu_model(),
        "cpu_count": cores,
        "cores": cores,
        "cpus_usable": usable,
        "usable_cores": usable,
        "ram_bytes": _ram_bytes(),
        "os": platform.platform(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.version.cuda,
    }
    transformers = _version("transformers")
    if transformers is not None:
        info["transformers"] = transformers
    for module in packages:
        info[module] = _version(module)
    if hasattr(os, "getloadavg"):
        info["load_average"] = [round(x, 2) for x in os.getloadavg()]
    if gpu and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_bytes=int(props.total_memory),
                    compute_capability=f"{props.major}.{props.minor}")
    info.update(extra)
    return info


# --------------------------------------------------------------------------------------------
# a worker in a fresh interpreter
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerRun:
    """What one worker subprocess left behind.

    Attributes:
        result: the JSON object of the worker's marker line, or None (timed out, or no such line).
        returncode: the exit status, None where it timed out.
        stdout: its standard output ('' where it timed out).
        stderr: its standard error ('' where it timed out).
        wall_seconds: wall-clock time from start to exit (or to the timeout).
        timeout: the limit it ran under, in seconds.
    """

    result: dict[str, Any] | None
    returncode: int | None
    stdout: str
    stderr: str
    wall_seconds: float
    timeout: float

    def _timed_out(self) -> str | None:
        return f"timed out after {self.timeout:.0f} s" if self.returncode is None else None

    def error_line(self, lines: int = 3) -> str:
        """Why no result, on one line: the timeout, or the exit status and the last ``lines`` lines."""
        tail = (self.stderr or self.stdout).strip().splitlines()[-lines:]
        return self._timed_out() or f"exit {self.returncode}: " + " | ".join(tail)

    def error_tail(self, chars: int) -> str:
        """Why no result, with the last ``chars`` characters of the output; the repository path as ``.``."""
        tail = (self.stderr or self.stdout)[-chars:].replace(str(REPO), ".")  # no local paths in results
        return self._timed_out() or f"worker exited {self.returncode}: {tail}"


def run_worker(module: str, args: Sequence[str], marker: str, *, timeout: float,
               one_thread: bool = False) -> WorkerRun:
    """Run ``python -m module *args`` from the repository root and read its marker line.

    The worker prints one line ``marker + json.dumps(result)`` on stdout; the first such line is
    parsed. The repository root goes first on ``PYTHONPATH`` so the worker imports this checkout.

    Args:
        module: the module to run, e.g. ``"benchmarks.accuracy_cpu"``.
        args: its command-line arguments.
        marker: the prefix of the result line.
        timeout: seconds before the worker is killed.
        one_thread: set ``OMP_NUM_THREADS=1`` unless the caller's environment sets it (no OpenMP
            pool beyond the one intra-op thread the worker uses).

    Returns:
        The :class:`WorkerRun`; its ``result`` is None where the worker timed out or printed no
        marker line.
    """
    cmd = [sys.executable, "-m", module, *args]
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if one_thread:
        env.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return WorkerRun(None, None, "", "", time.perf_counter() - t0, timeout)
    wall = time.perf_counter() - t0
    result = next((json.loads(line[len(marker):]) for line in proc.stdout.splitlines() if line.startswith(marker)),
                  None)
    return WorkerRun(result, proc.returncode, proc.stdout, proc.stderr, wall, timeout)


# --------------------------------------------------------------------------------------------
# settled collectives: the truth harnesses of sharded runs (benchmarks/deepspeed_cpu.py, fsdp2_cpu.py)
# --------------------------------------------------------------------------------------------

_COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor",
                "_reduce_scatter_base", "all_gather", "all_gather_into_tensor", "_all_gather_base",
                "_all_gather_base_coalesced", "broadcast", "all_to_all_single", "all_to_all", "gather", "scatter")


COLLECTIVE_CALLS: dict[str, int] = {}


_DS_COLLECTIVES = ("reduce_scatter_fn", "allgather_fn", "inference_all_reduce", "all_gather_coalesced",
                   "all_reduce_coalesced")


def settle_collectives(pause_s: float = 0.002, *, deepspeed_comm: bool = False) -> None:
    """Make every collective complete, and gloo's worker thread let go of it, before the caller goes on.

    gloo's worker thread holds the work (and through it the collective's tensors) until it has
    finished with it; when the caller has already dropped its references, the last one goes on that
    thread, where the profiler does not record the free. Waiting on the work and pausing ``pause_s``
    lets the worker thread drop its references first, so the caller's own drop is the last (seen).
    Patched before DeepSpeed is imported (its comm backend captures some of these functions then),
    and ``deepspeed.comm``'s own functions (``deepspeed_comm=True``) once it is: DeepSpeed's CPU
    backend may serve a collective from its shared-memory op instead of torch.distributed.
    """
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    def settled(fn):
        def call(*args, **kwargs):
            COLLECTIVE_CALLS[fn.__name__] = COLLECTIVE_CALLS.get(fn.__name__, 0) + 1
            work = fn(*args, **kwargs)
            if work is not None and hasattr(work, "wait"):
                work.wait()
            time.sleep(pause_s)
            return work

        call.__wrapped__ = fn
        return call

    mods = [dist, c10d]
    if deepspeed_comm:
        import deepspeed.comm
        import deepspeed.comm.comm

        mods = [deepspeed.comm, deepspeed.comm.comm]
    for name in _COLLECTIVES + (_DS_COLLECTIVES if deepspeed_comm else ()):
        for mod in mods:
            fn = getattr(mod, name, None)
            if fn is not None and not hasattr(fn, "__wrapped__"):
                setattr(mod, name, settled(fn))


# --------------------------------------------------------------------------------------------
# the multi-rank CPU-truth benchmarks (fsdp1_cpu, fsdp2_cpu, layouts_cpu, powersgd_cpu, deepspeed_cpu)
# --------------------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the rendezvous port of one run's ranks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def result_marker(name: str) -> str:
    """The prefix of a rank worker's result line, e.g. ``@@FSDP2_CPU_RESULT@@ `` for ``fsdp2_cpu``."""
    return f"@@{name.upper()}_RESULT@@ "


def _error_tail(returncode: int | None, err: str) -> str:
    """Why a rank left no result line: its exit status and its last error lines (else its last lines)."""
    lines = err.strip().splitlines()
    said = [ln for ln in lines if "Error" in ln] or lines
    return f"exit {returncode}: " + " | ".join(said[-3:]).replace(str(REPO), ".")  # no local paths in results


def launch_ranks(name: str, case: Any, world_size: int, args: Sequence[str], *, timeout: float,
                 env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """One real run of ``case``: ``python -m benchmarks.<name> --worker <case> *args`` once per rank.

    Every rank gets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``, a rendezvous on a free local port,
    ``OMP_NUM_THREADS=1`` and ``MALLOC_ARENA_MAX=1`` (glibc's arenas per gloo thread make memory
    erratic otherwise), the repository root first on ``PYTHONPATH``, and ``env`` last.

    Args:
        name: the benchmark module under ``benchmarks`` (its marker: :func:`result_marker`).
        case: a dataclass instance, passed to the worker as the JSON of :func:`dataclasses.asdict`.
        world_size: how many rank processes.
        args: more arguments for every worker (e.g. ``["--steps", "2"]``).
        timeout: seconds for the whole run; then every rank is killed.
        env: more environment variables for every rank.

    Returns:
        Each rank's result (the JSON of its marker line) in rank order, ``{"error": ...}`` for a rank
        that printed none; a single ``{"error": "timed out ..."}`` where the run timed out.
    """
    from dataclasses import asdict

    marker, port = result_marker(name), free_port()
    procs = []
    for rank in range(world_size):
        rank_env = dict(os.environ)
        rank_env.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(port), OMP_NUM_THREADS="1", MALLOC_ARENA_MAX="1")
        rank_env["PYTHONPATH"] = str(REPO) + (os.pathsep + rank_env["PYTHONPATH"] if rank_env.get("PYTHONPATH")
                                              else "")
        rank_env.update(env or {})
        cmd = [sys.executable, "-m", f"benchmarks.{name}", "--worker", json.dumps(asdict(case)), *args]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    deadline = time.monotonic() + timeout
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            for q in procs:
                q.communicate()
            return [{"error": f"timed out after {timeout:.0f} s"}]
        line = next((ln for ln in out.splitlines() if ln.startswith(marker)), None)
        results.append(json.loads(line[len(marker):]) if line is not None else {"error": _error_tail(p.returncode, err)})
    return results


def write_results(out: str | Path, name: str, rows: list[dict[str, Any]], meta: dict[str, Any],
                  render_markdown: Callable[[list[dict[str, Any]], dict[str, Any]], str]) -> str:
    """Write ``<name>.json`` (``{"meta": meta, "rows": rows}``) and ``<name>.md`` to ``out``; the Markdown."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    text = render_markdown(rows, meta)
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    (out / f"{name}.md").write_text(text)
    return text


def merge_result_files(name: str, paths: Sequence[str | Path], cases: Sequence[str]) -> tuple[list, dict]:
    """The rows of several ``<name>.json`` files as one (a later file's row replaces an earlier one of
    the same case), in the order of ``cases``, and their meta blocks joined: the commands (each with the
    cases it finished, where it stopped short) and dates, runs where they differ.
    """
    by_case: dict[str, dict[str, Any]] = {}
    metas = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        metas.append(data["meta"])
        for row in data["rows"]:
            by_case[row["case"]] = row
    rows = [by_case[n] for n in cases if n in by_case] + [r for n, r in by_case.items() if n not in cases]

    def command(m: dict[str, Any]) -> str:
        done, total = (str(m.get("cases_done", "")).split(" of ") + [""])[:2]
        stopped = done and done != total and "--merge" not in m["command"]  # a merge covers only some cases
        return m["command"] + (f" (stopped after {done} of {total} cases)" if stopped else "")

    runs = sorted({r for m in metas for r in str(m.get("runs")).split(" or ")}, key=str)
    return rows, dict(metas[0], command=" ; ".join(command(m) for m in metas)
                      + f" ; then --merge of the {len(metas)} {name}.json files they wrote",
                      date=" ; ".join(m["date"] for m in metas), cases_done=f"{len(rows)} of {len(cases)}",
                      runs=metas[0].get("runs") if len(runs) == 1 else " or ".join(runs))


def merge_argument(name: str) -> Callable[[argparse.ArgumentParser], None]:
    """``add_arguments`` for a ``--merge FILE...`` option (with :func:`merge_mode`)."""
    return lambda ap: ap.add_argument(
        "--merge", nargs="*", default=None, help=f"merge the rows of these {name}.json files (later files replace "
        "earlier rows of the same case) into --out, without running anything")


def merge_mode(name: str, cases: Callable[[], dict[str, Any]]) -> Callable[..., tuple[list, dict] | None]:
    """A :class:`MultiRankBenchmark` ``mode``: ``--merge`` by :func:`merge_result_files`."""
    return lambda args, ap: merge_result_files(name, args.merge, list(cases())) if args.merge is not None else None


def utc_now() -> str:
    """The date format of every result file's meta block."""
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


@dataclass(frozen=True)
class MultiRankBenchmark:
    """The command line of a benchmark that measures real gloo ranks against memguard's estimate.

    ``main(argv)`` parses ``--cases/--runs/--steps/--timeout/--out`` (and the script's own options,
    ``add_arguments``). Run as a rank (the hidden ``--worker <case JSON>``, as :func:`launch_ranks`
    starts it), it prints the marker line of ``worker(case, args)``. Otherwise a ``mode`` (e.g.
    ``--merge``) may produce the rows and meta block itself; else every selected case is measured
    in turn (``measure(case, args)``, one line printed per case: ``describe(row)``, or the row's ``error``), and
    ``<name>.json``/``<name>.md`` are written under ``--out`` after every case, so an interrupted run
    keeps what it measured. The meta block: the exact command, the date, the machine, ``runs`` and
    ``steps`` (and the options named in ``meta_args``), ``cases_done``.

    Attributes:
        name: the module under ``benchmarks`` and the stem of its result files.
        doc: the module docstring (its first paragraph is the ``--help`` description).
        case_type: the case dataclass (``case_type(**json)`` in the worker).
        cases: all cases by name.
        worker: one rank's measurement, run in the rank's own process.
        measure: a case's row (runs its ranks, estimates, summarises).
        render_markdown: the Markdown of the rows and the meta block.
        describe: the line printed after a case is measured (a row with an ``error`` prints that instead).
        default_cases: the cases run without ``--cases`` (None: all); then ``--cases all`` runs all.
        packages: modules whose versions the machine description records.
        runs, timeout: the defaults of ``--runs`` and ``--timeout``.
        steps_help: the help of ``--steps``.
        add_arguments: adds the script's own options to the parser.
        meta_args: options recorded in the meta block, after ``runs`` and ``steps``.
        mode: ``mode(args, parser)`` returns ``(rows, meta)`` where the options ask for something other
            than measuring (the rows are then written and printed), else None.
        hard_exit: end a worker with ``os._exit(0)`` after its line (no interpreter teardown: destroying
            some process groups can deadlock at exit).
    """

    name: str
    doc: str
    case_type: type
    cases: Callable[[], dict[str, Any]]
    worker: Callable[[Any, argparse.Namespace], dict[str, Any]]
    measure: Callable[[Any, argparse.Namespace], dict[str, Any]]
    render_markdown: Callable[[list[dict[str, Any]], dict[str, Any]], str]
    describe: Callable[[dict[str, Any]], str]
    default_cases: Sequence[str] | None = None
    packages: Sequence[str] = ()
    runs: int = 3
    timeout: float = 300.0
    steps_help: str = "profiled steps per run, after one warm-up step"
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None
    meta_args: Sequence[str] = ()
    mode: Callable[[argparse.Namespace, argparse.ArgumentParser], tuple[list, dict] | None] | None = None
    hard_exit: bool = False

    def parser(self) -> argparse.ArgumentParser:
        ap = argparse.ArgumentParser(description=self.doc.split("\n\n")[0])
        ap.add_argument("--cases", default="", help="comma-separated case names" + (
            ", or 'all' (default: DEFAULT_CASES)" if self.default_cases is not None else " (default: all)"))
        ap.add_argument("--runs", type=int, default=self.runs, help="real runs per case (fresh processes each)")
        ap.add_argument("--steps", type=int, default=2, help=self.steps_help)
        if self.add_arguments is not None:
            self.add_arguments(ap)
        ap.add_argument("--timeout", type=float, default=self.timeout, help="seconds per run")
        ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
        ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
        return ap

    def selected(self, spec: str, ap: argparse.ArgumentParser) -> list[str]:
        """The case names ``--cases`` selects (an unknown one is a usage error)."""
        cases = self.cases()
        if self.default_cases is not None and spec == "all":
            return list(cases)
        names = [n for n in spec.split(",") if n] or list(self.default_cases or cases)
        unknown = [n for n in names if n not in cases]
        if unknown:
            ap.error(f"unknown cases {unknown}; known: {', '.join(cases)}")
        return names

    def meta(self, args: argparse.Namespace, argv: Sequence[str] | None) -> dict[str, Any]:
        """The meta block of a measuring run: command, date, machine, runs, steps, ``meta_args``."""
        return {
            "command": f"python benchmarks/{self.name}.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
            "date": utc_now(),
            "machine": machine_description(packages=self.packages, gpu=False, torch_threads=1),
            "runs": args.runs, "steps": args.steps, **{k: getattr(args, k) for k in self.meta_args},
        }

    def main(self, argv: list[str] | None = None) -> int:
        ap = self.parser()
        args = ap.parse_args(argv)
        if args.worker is not None:
            result = self.worker(self.case_type(**json.loads(args.worker)), args)
            print(result_marker(self.name) + json.dumps(result), flush=True)
            if self.hard_exit:
                sys.stderr.flush()
                os._exit(0)
            return 0
        done = self.mode(args, ap) if self.mode is not None else None
        if done is not None:
            print(write_results(args.out, self.name, *done, self.render_markdown))
            return 0
        cases, names = self.cases(), self.selected(args.cases, ap)
        meta = self.meta(args, argv)
        rows: list[dict[str, Any]] = []
        text = ""
        for name in names:
            t0 = time.perf_counter()
            row = self.measure(cases[name], args)
            rows.append(row)
            said = str(row["error"]) if "error" in row else self.describe(row)
            print(f"{name}: {said}  [{time.perf_counter() - t0:.0f} s]", flush=True)
            meta["cases_done"] = f"{len(rows)} of {len(names)}"
            text = write_results(args.out, self.name, rows, meta, self.render_markdown)
        print(text or self.render_markdown(rows, meta))
        return 0
