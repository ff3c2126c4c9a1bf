"""Pieces every benchmark shares: a description of the machine, and a worker in a fresh interpreter.

A benchmark script imports this as ``benchmarks.common``; a script run by path first puts the
repository root on ``sys.path`` (see the top of each script).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
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
