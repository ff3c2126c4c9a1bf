"""Recovery from memory that really runs out: subprocesses capped with RLIMIT_AS (see oom_worker.py).

Each test starts ``oom_worker.py``, which trains a reference without a cap, then caps its own
address space at the current VmSize plus a budget and trains the same model with memguard from a
plan whose micro-batch does not fit. The CPU allocator then fails for real. The budgets were
measured on this model: about 1 MiB per sample at ``seq=64`` in fp32 (half that under 16-mixed),
so micro-batch 64 and 32 fail and 16 fits, with several MiB of margin either way.

Each worker runs in a few seconds on an idle machine (most of it importing torch); the timeouts
only catch hangs.
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

WORKER = Path(__file__).with_name("oom_worker.py")
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux"),
              pytest.mark.cpu_truth]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # One malloc arena and a fixed mmap threshold: large tensors are mmapped and unmapped when
    # freed, so the address space tracks live memory and the cap bites where the test expects.
    env.update(MALLOC_ARENA_MAX="1", MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    return env


def _start(cfg: dict) -> subprocess.Popen:
    env = _env()
    if cfg.get("mode") == "16-mixed":
        # This test is about the GradScaler, so it pins fp16 to ATen's kernels: on AVX-512-FP16 hosts
        # oneDNN runs fp16 matmuls, and there the first failure under the cap is oneDNN's ("could not
        # create a primitive"), recovered by turning oneDNN off (tests/guard/test_onednn_oom.py covers
        # that path). ONEDNN_MAX_CPU_ISA=AVX512_CORE has no fp16 support; a lower cap is kept.
        env.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")
    return subprocess.Popen([sys.executable, str(WORKER), json.dumps(cfg)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(procs: list[subprocess.Popen]) -> None:
    try:
        outs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"a worker did not finish within {TIMEOUT_S} s: the ranks hung")
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]


def _run(tmp_path: Path, **cfg) -> dict:
    cfg = {"out": str(tmp_path), "steps": 3, "batch": 64, "seq": 64, "planned": 64, **cfg}
    _finish([_start(cfg)])
    return json.loads((tmp_path / "result0.json").read_text())


def _rel(a: dict, b: dict) -> float:
    return max(((a[k] - b[k]).norm() / b[k].norm()).item() for k in b)


def _check_samples(result: dict, batch: int, world: int = 1) -> None:
    """In every step, the attempt after the last retry saw each of this rank's samples exactly once."""
    steps, current = [], None
    for e in result["events"]:
        if e == "STEP":
            current = [[]]
            steps.append(current)
        elif e == "RETRY":
            current.append([])
        else:
            current[-1].extend(e)
    local = batch // world
    for s, attempts in enumerate(steps):
        start = s * batch + result["rank"] * local
        assert sorted(attempts[-1]) == list(range(start, start + local)), f"step {s}"


def _retry_messages(result: dict) -> list[str]:
    return [m for m in result["messages"] if m.startswith("WARNING:out of memory")]


def test_fp32_recovers_with_the_full_batch_weights(tmp_path: Path) -> None:
    r = _run(tmp_path, mode="fp32", budget_mib=20)
    assert r["error"] is None
    msgs = _retry_messages(r)
    assert msgs and "micro-batch 64" in msgs[0] and "DefaultCPUAllocator" in msgs[0] and "micro-batch 32" in msgs[0]
    assert r["oom_retries"] == len(msgs) and r["micro_batch_size"] == 64 >> len(msgs)
    # the retries all happen in the first step; the later steps start at the remembered size
    assert r["events"].index("RETRY") < r["events"].index("STEP", 1) and r["events"].count("RETRY") == len(msgs)
    _check_samples(r, 64)
    # fp32, micro-batches summed in another order than the full batch: ~1e-7 observed, 1e-5 allowed.
    assert _rel(torch.load(tmp_path / "guarded0.pt"), torch.load(tmp_path / "reference.pt")) <= 1e-5


def test_micro_batch_one_raises_oom_recovery_error(tmp_path: Path) -> None:
    # seq=256: one sample needs about 4 MiB, the budget is 1 MiB, so even micro-batch 1 fails.
    r = _run(tmp_path, mode="fp32", budget_mib=1, planned=4, batch=4, seq=256, steps=1)
    err = r["error"]
    assert err is not None and err["type"] == "OOMRecoveryError" and err["micro_batch_size"] == 1
    assert err["breakdown"] == {"params": 1 << 20, "activations": 3 << 20}  # the plan's estimate
    assert "What would help" in err["message"]
    assert [m.split(";")[1].strip() for m in _retry_messages(r)] == [
        "retrying the same batch of 4 samples from its first sample with micro-batch 2",
        "retrying the same batch of 4 samples from its first sample with micro-batch 1",
    ]


def test_16_mixed_keeps_the_grad_scaler_intact(tmp_path: Path) -> None:
    # Under 16-mixed the activations are float16 (half the fp32 bytes): a 10 MiB budget still makes
    # micro-batch 64 and 32 fail. Step 2 contains a sample that overflows float16.
    r = _run(tmp_path, mode="16-mixed", budget_mib=10)
    assert r["error"] is None
    # each halving is one retry message, and the micro-batch reached is the planned 64 halved that often
    assert r["oom_retries"] == len(_retry_messages(r)) and r["micro_batch_size"] == 64 >> r["oom_retries"] < 64
    _check_samples(r, 64)
    # 2**10, x2 after step 1, /2 after the overflow of step 2, x2 after step 3; tracker reset each time.
    assert r["scaler"] == r["reference_scaler"] and r["scaler"]["scale"] == 2.0**11
    assert r["losses"][1] != r["losses"][1]  # NaN: the overflow was seen, and the step skipped
    # float16 rounds each matmul/sum (unit roundoff 2**-11 ~ 4.9e-4); summing micro-batches in a
    # different grouping moves the bias gradient by ~1e-3 relative over 3 steps: 1e-2 allowed.
    assert _rel(torch.load(tmp_path / "guarded0.pt"), torch.load(tmp_path / "reference.pt")) <= 1e-2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")
def test_ddp_only_rank_one_runs_out_and_both_ranks_agree(tmp_path: Path) -> None:
    cfg = {"out": str(tmp_path), "mode": "ddp", "budget_mib": 20, "planned": 64, "steps": 3, "batch": 128,
           "seq": 64, "world": 2, "port": _free_port(), "cap_ranks": [1]}
    _finish([_start({**cfg, "rank": r}) for r in (0, 1)])
    results = [json.loads((tmp_path / f"result{r}.json").read_text()) for r in (0, 1)]
    assert all(r["error"] is None for r in results)
    # only rank 1 ran out of memory, and both ranks retried together, to the same micro-batch
    assert all("DefaultCPUAllocator" in m for m in _retry_messages(results[1]))
    assert all("on rank 1;" in m for m in _retry_messages(results[0]))
    retries = len(_retry_messages(results[1]))
    assert len(_retry_messages(results[0])) == retries == results[0]["oom_retries"] == results[1]["oom_retries"]
    assert results[0]["micro_batch_size"] == results[1]["micro_batch_size"] == 64 >> retries < 64
    for r in results:
        _check_samples(r, 128, world=2)
    w0, w1 = torch.load(tmp_path / "guarded0.pt"), torch.load(tmp_path / "guarded1.pt")
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    # the reference is one process on the whole 128-sample batch; DDP averages two 64-sample means
    assert _rel(w0, torch.load(tmp_path / "reference.pt")) <= 1e-5


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")
def test_ddp_a_non_oom_error_on_one_rank_stops_both(tmp_path: Path) -> None:
    # No memory cap: rank 1 raises a KeyError in its forward at step 1; rank 0 must not wait forever.
    # memguard plans on the first step here: rank 0 plans and broadcasts the plan.
    cfg = {"out": str(tmp_path), "mode": "ddp", "budget_mib": 20, "planned": 32, "steps": 2, "batch": 64,
           "seq": 8, "world": 2, "port": _free_port(), "cap_ranks": [], "fail_rank": 1, "fail_step": 1,
           "use_planner": True}
    _finish([_start({**cfg, "rank": r}) for r in (0, 1)])
    r0, r1 = [json.loads((tmp_path / f"result{r}.json").read_text()) for r in (0, 1)]
    assert r1["error"]["type"] == "KeyError" and "rank 1" in r1["error"]["message"]
    # rank 0 did nothing wrong: it raises the distinct PeerFailedError, naming the rank that failed
    assert r0["error"]["type"] == "PeerFailedError" and "rank 1 failed" in r0["error"]["message"]
    assert r0["error"]["rank"] == 1
    assert len(r0["losses"]) == len(r1["losses"]) == 1
    assert r0["planned_micro_batch_size"] == r1["planned_micro_batch_size"] is not None
    assert r0["losses"][0] != r1["losses"][0]  # each rank's loss is over its own half of the batch


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")
def test_ddp_a_planning_failure_on_rank_zero_is_rebuilt_on_every_rank(tmp_path: Path) -> None:
    # 64 KiB cannot hold this model's weights: rank 0's planner raises InfeasiblePlanError on the first
    # step, and rank 1, which never planned, must raise the same error with the same closest plan and
    # suggestions instead of waiting for a plan.
    cfg = {"out": str(tmp_path), "mode": "ddp", "budget_mib": 20, "planned": 32, "steps": 1, "batch": 64,
           "seq": 8, "world": 2, "port": _free_port(), "cap_ranks": [], "use_planner": True, "plan_budget": 64 << 10}
    _finish([_start({**cfg, "rank": r}) for r in (0, 1)])
    r0, r1 = [json.loads((tmp_path / f"result{r}.json").read_text()) for r in (0, 1)]
    assert r0["error"]["type"] == r1["error"]["type"] == "InfeasiblePlanError"
    assert r1["error"]["suggestions"] == r0["error"]["suggestions"] and r0["error"]["suggestions"]
    assert r1["error"]["closest"] == r0["error"]["closest"] is not None
    assert r1["error"]["message"] == r0["error"]["message"]
    assert r0["losses"] == r1["losses"] == []
