"""Two DeepSpeed ranks on CPU (gloo) where one really runs out of memory, for test_deepspeed.py.

Run as ``python deepspeed_worker.py '<json config>'`` with ``DS_ACCELERATOR=cpu``. Rank 0 first
trains a plain PyTorch reference on each step's global batch (both ranks' samples, no DeepSpeed, no
cap). Then both ranks train the same initial weights through a ZeRO-1 engine with caller-owned
accumulation (``managed_gradient_accumulation: false``) and
:func:`memguard.integrations.deepspeed.step`. At the start of step ``cap_step`` the ranks in
``cap_ranks`` cap their address space with ``RLIMIT_AS`` (current VmSize plus ``budget_mib``), so a
micro-batch that does not fit fails with the CPU allocator's real error.

Config keys: ``out`` (folder), ``steps``, ``batch`` (samples per rank per step), ``micro`` (the
config's micro-batch; accumulation = batch / micro), ``seq`` (about 1 MiB of activations per sample
at 64, as in lightning_worker.py), ``budget_mib``, ``cap_step``, ``cap_ranks``, ``port``.

Each rank writes ``result<rank>.json`` (events, messages, micro-batch, retries, error) and
``deepspeed<rank>.pt`` (its final weights); rank 0 also writes ``reference.pt``.
"""

from __future__ import annotations

import copy
import datetime
import json
import logging
import os
import resource
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from worker_common import LR, MOMENTUM, Net, Samples, vm_size  # noqa: E402


def mse(pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((pred.float() - y) ** 2).mean()


def worker(rank: int, world: int, cfg: dict) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(cfg["port"]))
    torch.set_num_threads(1)
    import deepspeed

    from memguard.integrations import deepspeed as mg_ds

    out = Path(cfg["out"])
    events: list = []
    messages: list[str] = []

    class Recorder(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(f"{record.levelname}:{record.getMessage()}")
            if record.levelno >= logging.WARNING:
                events.append("RETRY")

    logging.getLogger("memguard").addHandler(Recorder())
    # a short process-group timeout: a rank left waiting in a collective fails the test instead of hanging it
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=90))
    torch.manual_seed(0)
    initial = Net()
    b, steps = cfg["batch"], cfg["steps"]
    data = Samples(steps * b * world, cfg["seq"])

    def indices(step: int, r: int) -> list[int]:
        start = (step * world + r) * b
        return list(range(start, start + b))

    if rank == 0:  # the reference: one process, the global batch of each step (both ranks' samples)
        net = copy.deepcopy(initial)
        opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
        for s in range(steps):
            idx = torch.tensor([i for r in range(world) for i in indices(s, r)])
            mse(net(data.x[idx]), data.y[idx]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.save(net.state_dict(), out / "reference.pt")

    model = copy.deepcopy(initial)
    config = {"train_micro_batch_size_per_gpu": cfg["micro"], "gradient_accumulation_steps": b // cfg["micro"],
              "train_batch_size": b * world,
              # a 2 MB gradient bucket (DeepSpeed allocates it in the first backward of every step)
              "zero_optimization": {"stage": 1, "reduce_bucket_size": 500_000},
              "managed_gradient_accumulation": False, "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      optimizer=torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM))

    def loss_fn(eng, micro: dict) -> torch.Tensor:
        events.append(micro["idx"].tolist())  # the samples of this micro-batch
        return mse(eng(micro["x"]), micro["y"])

    result: dict = {"rank": rank, "error": None, "order": [i for s in range(steps) for i in indices(s, rank)]}
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    try:
        for s in range(steps):
            idx = torch.tensor(indices(s, rank))
            batch = {"x": data.x[idx], "y": data.y[idx], "idx": idx}
            events.append(["BATCH", idx.tolist()])
            if s == cfg["cap_step"] and rank in cfg["cap_ranks"]:
                resource.setrlimit(resource.RLIMIT_AS, (vm_size() + (cfg["budget_mib"] << 20), hard))
                result["capped"] = True
            mg_ds.step(engine, batch, loss_fn)
            events.append("STEP")
    except Exception as exc:  # reported to the test, which decides whether it was expected
        result["error"] = {"type": type(exc).__name__, "message": str(exc)[:2000]}
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    # What step() refuses, on a real engine: ZeRO-2 with DeepSpeed's own accumulation (the default).
    zero2 = {k: v for k, v in config.items() if k != "managed_gradient_accumulation"}
    zero2["zero_optimization"] = {"stage": 2, "reduce_bucket_size": 500_000}
    other = copy.deepcopy(initial)
    engine2, *_ = deepspeed.initialize(model=other, config=zero2,
                                       optimizer=torch.optim.SGD(other.parameters(), lr=LR, momentum=MOMENTUM))
    try:
        mg_ds.step(engine2, {"x": data.x[:2], "y": data.y[:2], "idx": torch.arange(2)}, loss_fn)
        result["refused"] = None
    except Exception as exc:
        result["refused"] = {"type": type(exc).__name__, "problems": list(getattr(exc, "problems", [str(exc)]))}
    result.update(events=events, messages=messages, micro_batch_size=mg_ds.micro_batch_size(engine),
                  oom_retries=mg_ds.oom_retries(engine), global_steps=engine.global_steps)
    torch.save({k: v.detach().clone() for k, v in engine.module.state_dict().items()}, out / f"deepspeed{rank}.pt")
    (out / f"result{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without interpreter teardown: destroying a gloo group while its threads release work can
    # deadlock at exit (tests/guard/oom_worker.py).
    os._exit(0)


if __name__ == "__main__":
    import torch.multiprocessing as mp

    cfg = json.loads(sys.argv[1])
    mp.spawn(worker, args=(2, cfg), nprocs=2)
