"""One rank of a 2-process DDP job (gloo): memguard.prepare(gradient_compression="powersgd") against DDP
with ``register_comm_hook(PowerSGDState(...), powerSGD_hook)``.

Run as ``python powersgd_worker.py '<json config>'`` with ``out``, ``rank``, ``port``. Both models start
from the same weights and see the same batches (different on each rank); memguard's copy runs through
``memguard.step`` (its own gradient sync, calling the hook on DDP's rebuilt buckets), the reference
through DDP's reducer with the hook. Writes ``result{rank}.json``: both models' weights after the
steps, the hook state's iteration count and error-buffer sizes, memguard's warnings and its micro-batch.

With ``seq`` each sample is ``seq`` positions of 64 features (about ``seq * 4`` KiB of activations kept for
backward per sample), and from step ``cap_step`` on rank 1 caps its address space (``RLIMIT_AS``) at its
VmSize plus ``budget_mib`` during ``memguard.step`` only (lifted for the reference's step), so a micro-batch
really runs out of memory there.
"""

from __future__ import annotations

import copy
import json
import logging
import resource
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from fsdp2_worker import vm_size  # noqa: E402  (the same VmSize reader as the other workers)

STEPS = 5
OPTIONS = {"start_powerSGD_iter": 2, "matrix_approximation_rank": 2}


def main() -> None:
    cfg = json.loads(sys.argv[1])
    rank = cfg["rank"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank, world_size=2)
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

    import memguard
    from memguard.guard import guard_status
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

    warnings: list[str] = []

    class Recorder(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    logging.getLogger("memguard").addHandler(Recorder())
    memguard.prepare(ours, opt, micro_batch_size=16, loss_fn=loss_fn, gradient_compression="powersgd",
                     powersgd=OPTIONS, verbose=False)
    g = torch.Generator().manual_seed(100 + rank)
    seq = cfg.get("seq")
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    for s in range(STEPS):
        batch = torch.randn(16, seq, 64, generator=g) if seq else torch.randn(16, 64, generator=g)
        if rank == 1 and seq and s >= cfg["cap_step"]:
            resource.setrlimit(resource.RLIMIT_AS, (vm_size() + (cfg["budget_mib"] << 20), hard))
        try:
            memguard.step(ours, opt, batch)
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        loss_fn(theirs, batch).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    state = guard_of(ours, "memguard.prepare").rank_group.comm_hook.state
    result = {
        "ours": {k: v.tolist() for k, v in net.state_dict().items()},
        "theirs": {k: v.tolist() for k, v in ref.state_dict().items()},
        "iter": state.iter,
        "errors": sorted(t.numel() for t in state.error_dict.values()),
        "warnings": warnings,
        "micro_batch_size": guard_status(ours).micro_batch_size,
        "oom_retries": guard_status(ours).oom_retries,
    }
    Path(cfg["out"], f"result{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
