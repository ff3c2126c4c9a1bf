"""What the Lightning and Accelerate OOM tests share: the workers' data, model and memory probes, and
the check that every sample ran exactly once per optimizer step (imported by the workers, which run as
scripts from this folder, and by the tests)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

HIDDEN = 1024
LR, MOMENTUM = 0.05, 0.9


class Samples(Dataset):
    """``n`` samples: x (seq x 16), a target y, and the sample's index."""

    def __init__(self, n: int, seq: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, seq, 16, generator=g)
        self.y = torch.randn(n, generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.y[i], "idx": torch.tensor(i)}


class Net(nn.Module):
    """Per position: 16 -> HIDDEN -> GELU -> 1, averaged over positions (tests/guard/oom_worker.py's model)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, HIDDEN)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x))).mean(dim=(1, 2))


def traced(t: torch.Tensor) -> bool:
    """Whether ``t`` is one of the planner's fake or meta tensors (not a sample the loop delivered)."""
    from torch._subclasses.fake_tensor import is_fake

    return t.is_meta or is_fake(t)


def vm_size() -> int:
    """This process's virtual memory size in bytes (``VmSize`` of /proc/self/status, in kB = KiB: proc(5))."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def check_samples(result: dict, steps: int, per_step: int, *, skip_until_first_batch: bool = False) -> None:
    """Each optimizer step's final attempt ran every sample the loop delivered in it exactly once,
    and the loop delivered each of this rank's samples once, in the sampler's order.

    ``skip_until_first_batch`` drops events before the first delivered batch (Lightning's callback
    runs the model while planning, before training starts).
    """
    events = result["events"]
    if skip_until_first_batch:
        events = events[next(i for i, e in enumerate(events) if isinstance(e, list) and e[0] == "BATCH"):]
    windows: list[list] = [[]]
    for e in events:
        if e == "STEP":
            windows.append([])
        else:
            windows[-1].append(e)
    windows = [w for w in windows if w]
    assert len(windows) == steps
    delivered_all = []
    for w in windows:
        delivered = [i for e in w if isinstance(e, list) and e[0] == "BATCH" for i in e[1]]
        last_retry = max((k for k, e in enumerate(w) if e == "RETRY"), default=-1)
        run = [i for e in w[last_retry + 1:] if isinstance(e, list) and e[0] != "BATCH" for i in e]
        assert sorted(run) == sorted(delivered), w
        assert len(delivered) == per_step
        delivered_all += delivered
    assert delivered_all == result["order"][: steps * per_step]
