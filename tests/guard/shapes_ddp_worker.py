"""One rank of a 2-process DDP job (gloo) whose ranks see batches of different lengths in the same step.

Run as ``python shapes_ddp_worker.py '<json config>'`` with ``out``, ``rank``, ``port``. Per
position the model maps 8 -> 16 -> 1; a micro-batch of more than 256 positions (samples x length)
fails with the CPU allocator's message, so a micro-batch of 8 fits 16 tokens (128 positions) but
not 64 (512), and 4 x 64 = 256 fits. Rank 0's second batch and rank 1's third are the long ones.
Writes ``result{rank}.json``: each rank's status and its weights' values, and the weights of a
single-process reference that averages the two ranks' batch gradients, as DDP does.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

LENGTHS = {0: [16, 64, 16], 1: [16, 16, 64]}
LIMIT = 256


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x))).mean()


def hungry(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if x.shape[0] * x.shape[1] > LIMIT:  # the message of c10/core/impl/alloc_cpu.cpp
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")
    return model(x)


def batches(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(10 + rank)
    return [torch.randn(8, length, 8, generator=g) for length in LENGTHS[rank]]


def main() -> None:
    cfg = json.loads(sys.argv[1])
    rank = cfg["rank"]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    from memguard.guard import guard_status, prepare, step

    model = Net()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for b0, b1 in zip(batches(0), batches(1)):  # DDP's average of the ranks' mean-loss gradients
        ((reference(b0) + reference(b1)) / 2).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    prepare(ddp, opt, micro_batch_size=8, loss_fn=hungry)
    sizes = []
    for b in batches(rank):
        step(ddp, opt, b)
        sizes.append(guard_status(ddp).micro_batch_size)
    status = guard_status(ddp)
    result = {
        "sizes": sizes, "oom_retries": status.oom_retries,
        "by_signature": {str(k): v for k, v in status.micro_batch_sizes.items()},
        "weights": {k: v.tolist() for k, v in model.state_dict().items()},
        "reference": {k: v.tolist() for k, v in reference.state_dict().items()},
    }
    (Path(cfg["out"]) / f"result{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown under gloo (see oom_worker.py)


if __name__ == "__main__":
    main()
