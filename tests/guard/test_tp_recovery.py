"""memguard.step under tensor parallelism (Layout(tp=2) on two gloo ranks): no hang, and an OOM is recovered.

Each test starts two ranks of ``tp_worker.py`` (a small Llama laid out by
``memguard.integrations.parallel.apply``); every run is bounded by a timeout, so a hang fails the
test. The weights a guarded run ends with are gathered (``full_tensor``) and compared with a plain
single-process run of the same steps on the same batches.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from two_ranks import free_port, run_two_ranks  # this folder is on sys.path under pytest
import torch

WORKER = Path(__file__).with_name("tp_worker.py")
TIMEOUT_S = 120

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux"),
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in"),
    pytest.mark.cpu_truth,
]


def _run(tmp_path: Path, **cfg) -> list[list[dict]]:
    """Both ranks' results, per repeat."""
    cfg = {"out": str(tmp_path), "port": free_port(), "steps": 3, "batch": 32, "seq": 64, "planned": 16,
           "repeats": 1, "cap_ranks": [1], "hang_after_s": TIMEOUT_S - 20, **cfg}
    run_two_ranks(WORKER, cfg, timeout=TIMEOUT_S, mmap_threshold=True)
    return [[json.loads((tmp_path / f"result{r}_{i}.json").read_text()) for r in (0, 1)]
            for i in range(cfg["repeats"])]


def _retries(result: dict) -> list[str]:
    return [m for m in result["messages"] if m.startswith("WARNING:out of memory")]


def _last_attempts(result: dict) -> list[list[int]]:
    """Each step's samples in its attempt after the last retry."""
    steps: list[list[list[int]]] = []
    for e in result["events"]:
        if e == "STEP":
            steps.append([[]])
        elif e == "RETRY":
            steps[-1].append([])
        else:
            steps[-1][-1].extend(e)
    return [sorted(attempts[-1]) for attempts in steps]


def _check_samples(result: dict, batch: int) -> None:
    """In every step, the attempt after the last retry saw each sample of the batch exactly once."""
    for s, seen in enumerate(_last_attempts(result)):
        assert seen == list(range(s * batch, (s + 1) * batch)), f"step {s}"


def _check_reference(tmp_path: Path, i: int, r0: dict, r1: dict) -> None:
    # Tensor parallelism sums the rowwise layers' partial products in an all-reduce, the same sums in another
    # order: fp32 reordering moves the weights by ~1e-7 relative (observed), 1e-5 allowed (as for FSDP2 and DDP).
    ref_losses = json.loads((tmp_path / "reference_losses.json").read_text())
    for r in (r0, r1):
        torch.testing.assert_close(r["losses"], ref_losses, rtol=1e-5, atol=1e-6)
    ref = torch.load(tmp_path / "reference.pt")
    guarded = torch.load(tmp_path / f"guarded_{i}.pt")
    assert guarded.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(guarded[k], ref[k], rtol=1e-5, atol=1e-6, msg=k)


def test_a_tensor_parallel_model_trains_guarded_as_the_unsplit_model_three_times(tmp_path: Path) -> None:
    runs = _run(tmp_path, mode="plain", repeats=3)
    for i, (r0, r1) in enumerate(runs):
        assert r0["error"] is None and r1["error"] is None, (r0["error"], r1["error"])
        assert _retries(r0) == _retries(r1) == [] and r0["micro_batch_size"] == r1["micro_batch_size"] == 16
        # the agreements ran (the same number on both ranks: one sequence of boundaries)
        assert r0["agreements"] == r1["agreements"] > 3 * 2 * 14
        for r in (r0, r1):
            _check_samples(r, 32)
        _check_reference(tmp_path, i, r0, r1)
        # memguard.evaluate of the trained model, in 4 micro-batches of 8 under the same agreements (every TP
        # forward boundary of each), equals the unsplit trained model's loss
        assert r0["eval_agreements"] == r1["eval_agreements"] >= 4 * 28
        ref_eval = json.loads((tmp_path / "reference_eval.json").read_text())
        assert r0["eval_loss"] == pytest.approx(ref_eval, rel=1e-5) and r1["eval_loss"] == r0["eval_loss"]


def test_a_real_oom_on_one_tensor_parallel_rank_is_recovered_on_both(tmp_path: Path) -> None:
    [(r0, r1)] = _run(tmp_path, mode="recover")
    assert r0["error"] is None and r1["error"] is None, (r0["error"], r1["error"])
    # the calibration leaves room for a quarter of the planned micro-batch, not for all of it
    assert r1["calibration"]["d_big"] > 2 * r1["calibration"]["d_small"]
    # only rank 1 ran out of memory (the allocator's own error), and both ranks halved together
    assert _retries(r1) and all("DefaultCPUAllocator" in m for m in _retries(r1))
    assert _retries(r0) and all("on rank 1;" in m and "DefaultCPUAllocator" not in m for m in _retries(r0))
    assert len(_retries(r0)) == len(_retries(r1)) == r0["oom_retries"] == r1["oom_retries"]
    assert r0["micro_batch_size"] == r1["micro_batch_size"] == 16 >> r0["oom_retries"] >= 4
    for r in (r0, r1):
        _check_samples(r, 32)  # no sample lost or seen twice
    _check_reference(tmp_path, 0, r0, r1)


@pytest.mark.parametrize(("mode", "where"), [
    ("inside", "tensor parallelism's output redistribution of model.layers.0.self_attn.o_proj"),
    ("inside_backward", "the backward of tensor parallelism's input redistribution of model.layers.1.mlp.up_proj"),
], ids=["forward", "backward"])
def test_an_oom_inside_a_tensor_parallel_collective_stops_every_rank_with_the_same_error(
        tmp_path: Path, mode: str, where: str) -> None:
    # Rank 1 fails as the allocator does where TP's all-reduce would allocate, after memguard's agreement at that
    # boundary passed (tp_worker.py: RowwiseParallel's output all-reduce in forward, a ColwiseParallel input
    # gradient's all-reduce in backward), while rank 0 goes into the collective: rank 1 cannot join it, so it
    # records the error and tears the process groups down, and both ranks raise the same OOMRecoveryError.
    [(r0, r1)] = _run(tmp_path, mode=mode)
    assert r0["error"]["type"] == r1["error"]["type"] == "OOMRecoveryError"
    assert r0["error"]["message"] == r1["error"]["message"]
    assert f"out of memory inside {where} on rank 1" in r0["error"]["message"]
    assert "DefaultCPUAllocator" in r0["error"]["message"]
    # bounded: rank 0 leaves the collective as soon as rank 1 tears the process groups down
    assert r0["train_s"] < 30 and r0["losses"] == r1["losses"] == []


def test_a_bug_on_one_tensor_parallel_rank_stops_both_without_a_hang(tmp_path: Path) -> None:
    # rank 1 raises a KeyError entering layer 1 (compute, not an OOM, not inside a boundary); rank 0, which goes
    # on to layer 1's first TP boundary, leaves forward at the agreement there and raises PeerFailedError
    [(r0, r1)] = _run(tmp_path, mode="bug")
    assert r1["error"]["type"] == "KeyError" and "rank 1" in r1["error"]["message"]
    assert r0["error"]["type"] == "PeerFailedError" and r0["error"]["rank"] == 1
    assert r0["losses"] == r1["losses"] == [] and r0["train_s"] < 30


def _run_ranks(tmp_path: Path, world: int, **cfg) -> list[dict]:
    """Every rank's result of a ``world``-rank run (one repeat), each bounded by the timeout."""
    cfg = {"out": str(tmp_path), "port": free_port(), "steps": 3, "batch": 32, "seq": 64, "repeats": 1,
           "cap_ranks": [1], "hang_after_s": 2 * TIMEOUT_S - 20, **cfg}
    run_two_ranks(WORKER, cfg, timeout=2 * TIMEOUT_S, mmap_threshold=True, world=world)
    return [json.loads((tmp_path / f"result{r}_0.json").read_text()) for r in range(world)]


def test_fsdp2_x_tensor_parallel_recovers_a_real_oom_on_one_of_four_ranks(tmp_path: Path) -> None:
    # Layout(dp_shard=2, tp=2): ranks 0, 1 are shard 0's TP pair, ranks 2, 3 shard 1's; one agreement group over
    # all four, at FSDP2's collectives and TP's. Only rank 1 is capped; every rank halves with it.
    results = _run_ranks(tmp_path, 4, mode="recover", dp_shard=2, planned=8, seq=128)
    assert all(r["error"] is None for r in results), [r["error"] for r in results]
    r1 = results[1]
    assert r1["calibration"]["d_big"] > 2 * r1["calibration"]["d_small"]
    assert _retries(r1) and all("DefaultCPUAllocator" in m for m in _retries(r1))
    for r in results:
        assert len(_retries(r)) == r["oom_retries"] == r1["oom_retries"] >= 1
        assert r is r1 or all("on rank 1;" in m for m in _retries(r))
        assert r["micro_batch_size"] == 8 >> r1["oom_retries"] >= 2
        assert r["agreements"] == r1["agreements"]
        # each shard's 16 samples of every step, each exactly once after the last retry
        start = (r["rank"] // 2) * 16
        assert _last_attempts(r) == [list(range(32 * i + start, 32 * i + start + 16)) for i in range(3)]
    # the mean over the two shards' losses is the whole batch's (equal shards); weights as the unsplit run's
    losses = [(a + b) / 2 for a, b in zip(results[0]["losses"], results[2]["losses"])]
    torch.testing.assert_close(losses, json.loads((tmp_path / "reference_losses.json").read_text()), rtol=1e-5,
                               atol=1e-6)
    ref, guarded = torch.load(tmp_path / "reference.pt"), torch.load(tmp_path / "guarded_0.pt")
    assert guarded.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(guarded[k], ref[k], rtol=1e-5, atol=1e-6, msg=k)
