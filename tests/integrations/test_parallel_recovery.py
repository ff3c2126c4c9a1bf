"""memguard.step runs a tensor-parallel model (TP, FSDP2 x TP) guarded on every rank, without a hang.

memguard puts an agreement at every boundary of tensor parallelism's collectives (memguard.guard._tp), so
memguard.step no longer refuses these layouts. Each test starts the ranks of parallel_refusal_worker.py,
bounded by a timeout: a hang fails the test.
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

WORKER = Path(__file__).with_name("parallel_refusal_worker.py")
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="multi-rank runs use gloo over localhost"),
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path: Path, world: int, **cfg) -> list[dict]:
    cfg = {"out": str(tmp_path), "hang_after_s": TIMEOUT_S - 60, **cfg}
    env = dict(os.environ)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world), OMP_NUM_THREADS="1",
               MALLOC_ARENA_MAX="1", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
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


# tp2: TP 2 on 2 ranks (memguard.prepare); dp2tp2: FSDP2 2 x TP 2 on 4 ranks (memguard.prepare(strategy="fsdp2"),
# one agreement group over all four ranks, at FSDP2's collectives and TP's)
@pytest.mark.parametrize(("dp_shard", "tp"), [(1, 2), (2, 2)], ids=["tp2", "dp2tp2"])
def test_memguard_step_runs_a_tensor_parallel_model_guarded_on_every_rank(tmp_path: Path, dp_shard: int,
                                                                         tp: int) -> None:
    results = _run(tmp_path, dp_shard * tp, dp_shard=dp_shard, tp=tp)
    for r in results:
        assert r["error"] is None, r
        assert r["rank_group"] == "TensorParallelRankGroup"
    # the TP ranks of a shard saw the same samples: the same loss
    for shard in range(dp_shard):
        assert len({results[shard * tp + i]["loss"] for i in range(tp)}) == 1
