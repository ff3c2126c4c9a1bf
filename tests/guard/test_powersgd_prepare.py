"""memguard.prepare(gradient_compression="powersgd"): validation, and a real 2-rank gloo run against DDP's
own comm hook."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from two_ranks import free_port, run_two_ranks  # this folder is on sys.path under pytest
import torch
from torch import nn

import memguard

TIMEOUT_S = 120


def test_prepare_refuses_compression_without_ddp():
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(memguard.ConfigError, match="wrap the model in DistributedDataParallel"):
        memguard.prepare(model, opt, micro_batch_size=2, gradient_compression="powersgd")


def test_prepare_refuses_bad_powersgd_options():
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(memguard.ConfigError) as info:
        memguard.prepare(model, opt, micro_batch_size=2, gradient_compression="powersgd",
                         powersgd={"matrix_approximation_rank": 0, "start_powerSGD_iter": 1})
    assert len(info.value.problems) == 2  # both options, at once


def test_prepare_refuses_compression_with_fsdp2():
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(memguard.ConfigError, match="FSDP2"):
        memguard.prepare(model, opt, strategy="fsdp2", gradient_compression="powersgd")


@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
def test_two_ranks_match_ddp_with_the_powersgd_hook(tmp_path: Path) -> None:
    run_two_ranks(Path(__file__).with_name("powersgd_worker.py"), {"out": str(tmp_path), "port": free_port()},
                  timeout=TIMEOUT_S)
    r0, r1 = (json.loads((tmp_path / f"result{r}.json").read_text()) for r in (0, 1))
    assert r0["iter"] == 5  # one per step (maybe_increase_iter counts on the last bucket); PowerSGD from step 3
    # error feedback: one buffer per DDP bucket; the model's 340 KB of gradients fit the 1 MiB first bucket
    assert r0["errors"] == [64 * 256 + 256 + 256 * 256 + 256 + 256 * 8 + 8]
    assert r0["ours"] == r1["ours"]  # the ranks stay in step
    for k, ref in r0["theirs"].items():
        torch.testing.assert_close(torch.tensor(r0["ours"][k]), torch.tensor(ref), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux")
@pytest.mark.cpu_truth
def test_a_real_oom_on_one_rank_under_powersgd_is_recovered_and_matches_ddp_with_the_hook(tmp_path: Path) -> None:
    # 16 samples of 512 positions keep ~34 MiB for backward; from step 2 (PowerSGD compresses from step 2) rank 1
    # may grow by 24 MiB while memguard steps, so the micro-batch of 16 fails for real and a half fits
    run_two_ranks(Path(__file__).with_name("powersgd_worker.py"),
                  {"out": str(tmp_path), "port": free_port(), "seq": 512, "cap_step": 2, "budget_mib": 24},
                  timeout=TIMEOUT_S, mmap_threshold=True)
    r0, r1 = (json.loads((tmp_path / f"result{r}.json").read_text()) for r in (0, 1))
    retries0, retries1 = ([m for m in r["warnings"] if "out of memory" in m.lower() or "OOM" in m] for r in (r0, r1))
    assert retries1 and any("DefaultCPUAllocator" in m for m in retries1)  # the allocator's own error, on rank 1
    assert len(retries0) == len(retries1) and r0["oom_retries"] == r1["oom_retries"] >= 1  # logged on both ranks
    assert r0["micro_batch_size"] == r1["micro_batch_size"] < 16
    assert r0["ours"] == r1["ours"]  # the ranks stay in step
    # the halved steps accumulate the same mean-loss gradient before PowerSGD compresses it: DDP's hook on the
    # whole batch gives the same weights to float rounding
    for k, ref in r0["theirs"].items():
        torch.testing.assert_close(torch.tensor(r0["ours"][k]), torch.tensor(ref), rtol=1e-4, atol=1e-5)
