"""memguard.prepare(gradient_compression="powersgd"): validation, and a real 2-rank gloo run against DDP's
own comm hook."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import memguard

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    worker = Path(__file__).with_name("powersgd_worker.py")
    env = dict(os.environ)
    env.update(MALLOC_ARENA_MAX="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(worker), json.dumps({"out": str(tmp_path), "rank": r, "port": port})],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"the ranks did not finish within {TIMEOUT_S} s")
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    r0, r1 = (json.loads((tmp_path / f"result{r}.json").read_text()) for r in (0, 1))
    assert r0["iter"] == 5  # one per step (maybe_increase_iter counts on the last bucket); PowerSGD from step 3
    # error feedback: one buffer per DDP bucket; the model's 340 KB of gradients fit the 1 MiB first bucket
    assert r0["errors"] == [64 * 256 + 256 + 256 * 256 + 256 + 256 * 8 + 8]
    assert r0["ours"] == r1["ours"]  # the ranks stay in step
    for k, ref in r0["theirs"].items():
        torch.testing.assert_close(torch.tensor(r0["ours"][k]), torch.tensor(ref), rtol=1e-5, atol=1e-6)
