"""One rank of a 2-process DDP job (gloo): memguard.prepare(gradient_compression="powersgd") against DDP
with ``register_comm_hook(PowerSGDState(...), powerSGD_hook)``.

Run as ``python powersgd_worker.py '<json config>'`` with ``out``, ``rank``, ``port``. Both models start
from the same weights and see the same batches (different on each rank); memguard's copy runs through
``memguard.step`` (its own gradient sync, calling the hook on DDP's rebuilt buckets), the reference
through DDP's reducer with the hook. Writes ``result{rank}.json``: both models' weights after the
steps and the hook state's iteration count and error-buffer sizes.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

STEPS = 5
OPTIONS = {"start_powerSGD_iter": 2, "matrix_approximation_rank": 2}


def main() -> None:
    cfg = json.loads(sys.argv[1])
    rank = cfg["rank"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank, world_size=2)
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

    import memguard
    from memguard.guard._core import guard_of

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 8))
    ref = copy.deepcopy(net)
    ours = nn.parallel.DistributedDataParallel(net)
    theirs = nn.parallel.DistributedDataParallel(ref)
    theirs.register_comm_hook(PowerSGDState(None, **OPTIONS), powerSGD_hook)
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(theirs.parameters(), lr=0.1)

    def loss_fn(model, batch):
        return model(batch).pow(2).mean()

    memguard.prepare(ours, opt, micro_batch_size=16, loss_fn=loss_fn, gradient_compression="powersgd",
                     powersgd=OPTIONS, verbose=False)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        batch = torch.randn(16, 64, generator=g)
        memguard.step(ours, opt, batch)
        loss_fn(theirs, batch).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    state = guard_of(ours, "memguard.prepare").rank_group.comm_hook.state
    result = {
        "ours": {k: v.tolist() for k, v in net.state_dict().items()},
        "theirs": {k: v.tolist() for k, v in ref.state_dict().items()},
        "iter": state.iter,
        "errors": sorted(t.numel() for t in state.error_dict.values()),
    }
    Path(cfg["out"], f"result{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
