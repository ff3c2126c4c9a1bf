"""memguard.step under tensor parallelism (and FSDP2 x TP) with memory that really runs out on rank 1.

Each test starts the ranks of parallel_oom_worker.py. Rank 1 caps its address space with ``RLIMIT_AS``
at a budget calibrated from an uncapped forward/backward of the laid-out model, so the planned
micro-batch fails in compute on rank 1 only while its peers go on towards their next collective. Every
run is bounded by a timeout (and each rank prints its stacks and exits if it is still running well
before it): a hang fails the test.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("parallel_oom_worker.py")
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 480

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux"),
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in"),
    pytest.mark.cpu_truth,
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path: Path, world: int, **cfg) -> list[dict]:
    cfg = {"out": str(tmp_path), "steps": 2, "batch": 8, "planned": 8, "cap_ranks": [1],
           "hang_after_s": TIMEOUT_S - 60, **cfg}
    env = dict(os.environ)
    # one malloc arena and a fixed mmap threshold, so that the cap tracks live memory (tests/guard/test_fsdp2_recovery.py)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world), OMP_NUM_THREADS="1",
               MALLOC_ARENA_MAX="1", MALLOC_MMAP_THRESHOLD_="65536",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, str(WORKER), json.dumps(cfg)], env={**env, "RANK": str(r)}, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    try:
        outs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"a rank did not finish within {TIMEOUT_S} s: the ranks hung")
    for p, out in zip(procs, outs):
        assert p.returncode == 0 and "Timeout (" not in out, out[-3000:]
    return [json.loads((tmp_path / f"result{r}.json").read_text()) for r in range(world)]


def _attempts(result: dict) -> list[list[list[int]]]:
    """Per step, the samples each attempt ran (split at the retries)."""
    steps: list[list[list[int]]] = []
    for e in result["events"]:
        if e == "STEP":
            steps.append([[]])
        elif e == "RETRY":
            steps[-1].append([])
        else:
            steps[-1][-1].extend(e)
    return steps


# tp2: TP 2 on 2 ranks; dp2tp2: FSDP2 2 x TP 2 on 4 ranks (rank 1 is the TP peer of rank 0 and the
# FSDP2 peer of rank 3, so its OOM must reach both kinds of collective)
@pytest.mark.parametrize(("dp_shard", "tp"), [(1, 2), (2, 2)], ids=["tp2", "dp2tp2"])
def test_an_oom_on_rank_1_is_retried_on_every_rank_with_the_same_samples_and_weights(tmp_path: Path, dp_shard: int,
                                                                                     tp: int) -> None:
    results = _run(tmp_path, dp_shard * tp, dp_shard=dp_shard, tp=tp)
    for r in results:
        assert r["error"] is None, r
        retries = [m for m in r["messages"] if m.startswith("WARNING:out of memory")]
        assert retries and all("on rank 1" in m for m in retries), r["messages"]  # every rank logs rank 1's OOM
        assert r["micro_batch_size"] < 8 and r["oom_retries"] == len(retries)
        # every attempt of a step ran this data-parallel rank's samples, each once, the last one included
        for s, attempts in enumerate(_attempts(r)):
            start = (s * dp_shard + r["dp_index"]) * 8
            assert all(sorted(a) == list(range(start, start + 8)) for a in attempts), (s, attempts)
    assert len({tuple(r["losses"]) for r in results if r["dp_index"] == 0}) == 1  # TP peers: one loss
    assert len({r["oom_retries"] for r in results}) == 1
    weights = torch.load(tmp_path / "weights.pt")
    reference = torch.load(tmp_path / "reference.pt")
    assert set(weights) == set(reference)
    for name, ref in reference.items():  # fp32; only the micro-batch split and the shards' sums differ
        torch.testing.assert_close(weights[name], ref, rtol=1e-4, atol=1e-5, msg=name)


def test_what_cannot_be_guarded_is_refused_on_every_rank_instead_of_hanging(tmp_path: Path) -> None:
    for r in _run(tmp_path, 2, tp=2, dp_shard=1, refusals=True):
        # memguard.prepare leaves tensor parallelism's collectives without agreements: memguard.step refuses
        assert r["step"]["type"] == "ConfigError" and "memguard.integrations.parallel.prepare" in r["step"]["message"]
        # a tensor-parallel group memguard did not make (plain gloo here; NCCL on CUDA) cannot be guarded
        assert r["plain_mesh"]["type"] == "ConfigError" and "only on gloo (CPU) ranks" in r["plain_mesh"]["message"]
