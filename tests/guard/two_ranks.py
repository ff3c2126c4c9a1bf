"""What the guard's two-rank tests share: a free port, and two worker processes run to the end or failed as a hang.

Imported by the tests (this folder is on ``sys.path`` under pytest). Each worker is run as
``python WORKER '<json config>'`` with the config's ``rank`` set, one malloc arena (gloo's threads would each get
one and make an address-space cap erratic), one OpenMP thread and the repository on ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port nobody listens on now (for the workers' rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_ranks(worker: Path, cfg: dict[str, Any], *, timeout: float, mmap_threshold: bool = False,
                  world: int = 2, **env_extra: str) -> list[str]:
    """Run ``worker`` as ranks 0 and 1 (``world`` ranks in all) with ``cfg`` (plus ``rank``); their outputs.

    ``mmap_threshold`` fixes glibc's mmap threshold at 64 KiB, so that freed tensors leave the address
    space and an RLIMIT_AS cap tracks live memory. The test fails if a rank does not finish within
    ``timeout`` seconds (the ranks hung; both are killed) or exits with an error (its output's end is shown).
    """
    env = dict(os.environ)
    env.update(MALLOC_ARENA_MAX="1", OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
               **env_extra)
    if mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    procs = [subprocess.Popen([sys.executable, str(worker), json.dumps({**cfg, "rank": r})], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        for p in procs:
            p.communicate()
        pytest.fail(f"a rank did not finish within {timeout} s: the ranks hung")
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    return outs
