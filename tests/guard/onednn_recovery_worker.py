"""A training step whose oneDNN kernel cannot be built for lack of memory, recovered by the guard.

Run as ``python onednn_recovery_worker.py OUT``. A bf16 convolution net trains two steps: first a
plain reference on ATen's kernels (``torch.backends.mkldnn`` off, so no oneDNN kernel for these
shapes exists yet), then with ``memguard.step`` under an ``RLIMIT_AS`` cap a few pages above the
current address space. The heap was grown beforehand and is never trimmed or mmapped around
(``MALLOC_TOP_PAD_``, ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_`` set by the test), so
tensors still fit while oneDNN's JIT code buffers, which are mapped on their own, do not: the first
new convolution fails with "could not create a primitive". Writes ``result.json`` and the weights.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import resource
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(16, 32, 3, padding=1), nn.Conv2d(32, 32, 3, padding=1)

    def forward(self, x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.c2(F.relu(self.c1(x))).float().mean((1, 2, 3)), y)


def vm_size() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize")


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    from memguard.estimator._result import Estimate
    from memguard.guard import guard_status, prepare, step
    from memguard.planner._plan import Plan

    messages: list[str] = []
    seen: list[list[int]] = []

    class Recorder(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(f"{record.levelname}:{record.getMessage()}")

    logging.getLogger("memguard").addHandler(Recorder())
    model = Net().to(torch.bfloat16)
    initial = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(8, 16, 16, 16, generator=g).to(torch.bfloat16), "y": torch.randn(8, generator=g),
                "idx": torch.arange(8 * s, 8 * s + 8)} for s in range(2)]

    with torch.backends.mkldnn.flags(enabled=False):  # the reference on ATen's kernels
        ref = copy.deepcopy(initial)
        opt = torch.optim.SGD(ref.parameters(), lr=0.05)
        for b in batches:
            ref(**b).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    torch.save(ref.state_dict(), out / "reference.pt")

    guarded = initial
    guarded.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["idx"].tolist()), with_kwargs=True)
    opt = torch.optim.SGD(guarded.parameters(), lr=0.05)
    est = Estimate(peak_bytes=1 << 20, breakdown={"params": 1 << 19, "activations": 1 << 19}, context_bytes=0,
                   peak_phase="backward", allocated_peak_bytes=1 << 20, device="cpu", precision="bf16-true",
                   zero_stage=0, world_size=1, gpu=None, micro_batch_size=8)
    plan = Plan(micro_batch_size=8, grad_accum_steps=1, world_size=1, global_batch_size=8, precision="bf16-true",
                activation_checkpointing=False, zero_stage=0, budget_bytes=1 << 30, estimate=est, device="cpu")
    prepare(guarded, opt, plan=plan)
    result: dict = {"error": None, "onednn_before": torch.backends.mkldnn.enabled}
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vm_size() + (64 << 10), hard))
    try:
        for b in batches:
            seen.append("STEP")
            step(guarded, opt, b)
    except Exception as exc:  # reported to the test
        result["error"] = {"type": type(exc).__name__, "message": str(exc)}
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    status = guard_status(guarded)
    result.update(messages=messages, seen=seen, micro_batch_size=status.micro_batch_size,
                  oom_retries=status.oom_retries, onednn_after=torch.backends.mkldnn.enabled)
    torch.save(guarded.state_dict(), out / "guarded.pt")
    (out / "result.json").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
