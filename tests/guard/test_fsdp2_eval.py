"""memguard.evaluate on an FSDP2 model with memory that really runs out on one of two gloo ranks.

Each test starts two ranks of ``fsdp2_eval_worker.py``. Only rank 1 caps its address space with
``RLIMIT_AS``, at a budget calibrated from uncapped forwards of the same sharded model (halfway
between the growth at a quarter of the largest batch and at the whole of it), so the whole batch
fails in a block's compute on rank 1 only while rank 0 goes on towards FSDP2's next all-gather.
Every run is bounded by a timeout: a hang fails the test.
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

WORKER = Path(__file__).with_name("fsdp2_eval_worker.py")
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 150

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux"),
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in"),
    pytest.mark.cpu_truth,
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path: Path, **cfg) -> list[dict]:
    cfg = {"out": str(tmp_path), "port": _free_port(), "cap_ranks": [1], "seq": 256, **cfg}
    env = dict(os.environ)
    # One malloc arena and a fixed mmap threshold: freed tensors leave the address space (see test_fsdp2_recovery).
    env.update(MALLOC_ARENA_MAX="1", MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, str(WORKER), json.dumps({**cfg, "rank": r})], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"a rank did not finish within {TIMEOUT_S} s: the ranks hung")
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    return [json.loads((tmp_path / f"result{r}.json").read_text()) for r in (0, 1)]


def _retries(result: dict) -> list[str]:
    return [m for m in result["messages"] if m.startswith("WARNING:memguard: OOM in evaluation")]


def _calls(result: dict) -> list[list]:
    """The forwards of each evaluate call (sample ids per forward, "RETRY" where a retry was logged)."""
    calls: list[list] = []
    for e in result["events"]:
        if e == "CALL":
            calls.append([])
        else:
            calls[-1].append(e)
    return calls


def _check_recovered(tmp_path: Path, results: list[dict], batches: list[int]) -> None:
    r0, r1 = results
    assert r0["error"] is None and r1["error"] is None, (r0["error"], r1["error"])
    # the calibration leaves room for half of the largest batch, not for all of it
    assert r1["calibration"]["d_big"] > 2 * r1["calibration"]["d_small"]
    # only rank 1 ran out of memory (the allocator's own error); both ranks logged each retry and halved together
    assert len(_retries(r1)) == 2 and all("DefaultCPUAllocator" in m for m in _retries(r1))
    assert len(_retries(r0)) == 2 and all("on rank 1;" in m and "halves to" in m for m in _retries(r0))
    assert r0["oom_retries"] == r1["oom_retries"] == 2
    # the agreements both ranks ran (the same count: they are all-reduces), see _evaluate_sharded's docstring
    assert r0["agreements"] == r1["agreements"] > 0
    assert r0["eval_micro_batch_sizes"] == r1["eval_micro_batch_sizes"] == [max(batches) // 2]
    for r, n in zip(results, batches):
        first = 1000 * r["rank"]
        for call, kind in zip(_calls(r), ("joined", "loss")):
            # every rank ran the same forwards: the whole batch (failed on rank 1), then two halves
            assert call.count("RETRY") == 1
            after = call[call.index("RETRY") + 1:]
            assert len(after) == 2
            padding = r[f"{kind}_padding"]
            assert r[f"{kind}_forwards"] + padding == 2
            # after the retry each of this rank's samples was evaluated exactly once; a padding forward ran on its
            # first sample only (its result discarded)
            real, pads = after[: len(after) - padding], after[len(after) - padding:]
            assert [i for f in real for i in f] == list(range(first, first + n))
            assert pads == [[first]] * padding
        t = torch.load(tmp_path / f"tensors{r['rank']}.pt")
        # The reference is an unsharded copy on the same samples, unsplit and uncapped: the per-sample predictions
        # of a split batch are computed row by row the same way (observed equal; 1e-6 allowed for kernel blocking),
        # and the loss is the sample-weighted mean of the micro-batches' means, summed in float64.
        torch.testing.assert_close(t["pred"], t["ref_pred"], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(t["loss"], t["ref_loss"], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(t["loss_only"], t["ref_loss"], rtol=1e-6, atol=1e-7)


def test_an_eval_oom_on_one_rank_of_a_prepared_fsdp2_model_is_recovered_on_both(tmp_path: Path) -> None:
    batches = [64, 64]
    _check_recovered(tmp_path, _run(tmp_path, mode="recover", how="prepare", batches=batches), batches)


def test_a_rank_with_fewer_samples_runs_padding_forwards_on_a_fully_shard_model(tmp_path: Path) -> None:
    # rank 0 has 20 samples, rank 1 (capped) 64: the ranks agree on 64 (fails on rank 1), then on 32: rank 0 runs
    # its 20 samples in the first half and a padding forward in the second, so both run FSDP2's all-gathers twice.
    batches = [20, 64]
    results = _run(tmp_path, mode="recover", how="fully_shard", batches=batches)
    _check_recovered(tmp_path, results, batches)
    assert results[0]["joined_padding"] == results[0]["loss_padding"] == 1
    assert results[1]["joined_padding"] == results[1]["loss_padding"] == 0


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_an_eval_oom_on_one_rank_of_an_fsdp1_model_is_recovered_on_both(tmp_path: Path, use_orig_params: bool) -> None:
    # FSDP1 all-gathers each unit's flat parameter in its pre-forward (torch.distributed.fsdp._runtime_utils._unshard):
    # the same agreement protocol, with FSDP1's reset of the units after the failed forward (memguard.guard._fsdp1)
    batches = [20, 64]
    results = _run(tmp_path, mode="recover", how="fsdp1", batches=batches, use_orig_params=use_orig_params)
    _check_recovered(tmp_path, results, batches)
    assert results[0]["joined_padding"] == results[0]["loss_padding"] == 1


def test_an_eval_oom_inside_an_fsdp_all_gather_stops_every_rank_with_the_same_error(tmp_path: Path) -> None:
    # Blocks of 8 MiB unsharded, a 2 MiB budget on rank 1: the all-gather output of the first block cannot be
    # allocated, inside FSDP2's collective path, while rank 0 is already in that all-gather.
    r0, r1 = _run(tmp_path, mode="collective", how="prepare", batches=[8, 8], seq=4, budget_mib=2)
    assert r0["error"]["type"] == r1["error"]["type"] == "OOMRecoveryError"
    assert r0["error"]["message"] == r1["error"]["message"]
    assert "inside FSDP2's all-gather of blocks.0 on rank 1" in r0["error"]["message"]
    assert "DefaultCPUAllocator" in r0["error"]["message"]
    assert r0["eval_s"] < 30  # bounded: rank 0 leaves its all-gather as soon as rank 1 tears the group down


@pytest.mark.parametrize("bug", ["forward", "batch"])
def test_an_error_on_one_rank_stops_its_peer_instead_of_hanging(tmp_path: Path, bug: str) -> None:
    # "forward": a KeyError (not an OOM) in rank 1's second block; rank 0, which went on to that block's all-gather,
    # leaves its forward at the agreement before it. "batch": rank 1's batch has no batch dimension; rank 0 learns
    # it at the first agreement, before any forward.
    r0, r1 = _run(tmp_path, mode="bug", how="prepare", batches=[8, 8], seq=4, bug=bug)
    assert r1["error"]["type"] == ("KeyError" if bug == "forward" else "ConfigError")
    assert r0["error"]["type"] == "PeerFailedError" and r0["error"]["rank"] == 1
    assert "rank 1 failed in evaluation" in r0["error"]["message"]
    assert r0["oom_retries"] == r1["oom_retries"] == 0


def test_the_ranks_start_from_the_smallest_remembered_eval_micro_batch_and_remember_the_same(tmp_path: Path) -> None:
    # Only rank 0 remembers 16 samples for this shape (an OOM it had alone, say); rank 1 would run its 64 whole. They
    # agree on 16: four forwards each, in both calls, and both remember 16.
    r0, r1 = _run(tmp_path, mode="remember", how="prepare", batches=[64, 64], seq=8, remembered=16)
    assert r0["error"] is None and r1["error"] is None
    for r in (r0, r1):
        assert r["joined_forwards"] == r["loss_forwards"] == 4 and r["joined_padding"] == 0
        assert r["eval_micro_batch_sizes"] == [16] and r["oom_retries"] == 0
        for call in _calls(r):
            assert [len(f) for f in call] == [16, 16, 16, 16]
        t = torch.load(tmp_path / f"tensors{r['rank']}.pt")
        torch.testing.assert_close(t["pred"], t["ref_pred"], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(t["loss_only"], t["ref_loss"], rtol=1e-6, atol=1e-7)


_ONE_RANK = """
import os, socket, sys, json
import torch, torch.distributed as dist
sys.path.insert(0, {here!r})
from fsdp2_eval_worker import Net
from torch.distributed.fsdp import fully_shard
import memguard
from memguard.guard._evaluate import eval_status
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
dist.init_process_group("gloo", rank=0, world_size=1)
torch.manual_seed(0)
model = Net(16, 2)
batch = {{"x": torch.randn(6, 4, 16), "y": torch.randn(6), "idx": torch.arange(6)}}
with torch.no_grad():
    ref = model(**batch).loss.item()
for b in model.blocks:
    fully_shard(b)
out = {{}}
try:
    memguard.evaluate(model, batch)
except memguard.ConfigError as exc:
    out["not_root"] = str(exc)
fully_shard(model)
out["loss"] = memguard.evaluate(model, batch, micro_batch_size=4).loss.item()
out["ref"], out["forwards"] = ref, eval_status(model).forwards
print(json.dumps(out))
sys.stdout.flush()
os._exit(0)
"""


def test_a_module_whose_blocks_only_are_sharded_is_refused_and_one_rank_splits_alone(tmp_path: Path) -> None:
    code = _ONE_RANK.format(here=str(WORKER.parent))
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "not itself the FSDP2 root" in out["not_root"] and "pass the root module" in out["not_root"]
    # one rank in the group: no peer to keep in step, so the single-process split runs (4 + 2 samples); the mean
    # loss is the sample-weighted mean of the two micro-batches' means, summed in float64
    assert out["forwards"] == 2
    assert out["loss"] == pytest.approx(out["ref"], rel=1e-6)
