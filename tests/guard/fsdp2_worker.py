"""One rank of a 2-rank gloo FSDP2 run that really runs out of memory, for the FSDP2 guard's tests.

Run as ``python fsdp2_worker.py '<json config>'``. Both ranks build the same model from the same
seed; rank 0 also trains a plain single-process reference on the whole global batch (what the
sharded, guarded run must reproduce). Then both ranks ``memguard.prepare(..., strategy="fsdp2")``
with a hand-made plan and, in ``"recover"`` mode:

1. calibrate: run one forward/backward at micro-batch ``planned // 4`` and one at ``planned``
   (no cap), sampling the address space (VmSize) at every module's forward entry and exit and
   after backward; ``d_small`` and ``d_big`` are the growths over the VmSize before each;
2. cap the ranks in ``cap_ranks`` with ``RLIMIT_AS`` at VmSize + (d_small + d_big) / 2, so the
   planned micro-batch fails for real and a quarter of it fits, with a margin of
   (d_big - d_small) / 2 either way;
3. train ``steps`` steps with ``memguard.step`` and write the full weights (``full_tensor``) to
   ``guarded_{stage}.pt`` and the outcome to ``result{rank}_{stage}.json``.

In ``"collective"`` mode the model has large blocks (8 MiB each unsharded) and tiny activations;
the capped rank gets VmSize + ``budget_mib``, less than one block's all-gather output, so the OOM
happens inside FSDP2's all-gather (the unrecoverable case).

Config keys: ``out``, ``mode``, ``rank``, ``port``, ``steps``, ``batch`` (global), ``seq``,
``planned``, ``zero_stages`` (one run per sharding level, in one process pair), ``bug_runs`` (then
one run per entry, "forward" or "backward", in which rank 1 raises a KeyError there),
``cap_ranks``, ``budget_mib`` (collective mode), ``time_steps`` (uncapped steps timed for the
agreement cost, with and without the agreements, interleaved).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn


@dataclass
class Output:
    loss: torch.Tensor


class Block(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(h, 4 * h)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(x)))


class Net(nn.Module):
    """Per position: 16 -> h, ``n`` residual MLP blocks, -> 1, averaged over positions; MSE against ``y``."""

    def __init__(self, h: int, n: int) -> None:
        super().__init__()
        self.inp = nn.Linear(16, h)
        self.blocks = nn.ModuleList(Block(h) for _ in range(n))
        self.head = nn.Linear(h, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor) -> Output:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.output(self.head(h).mean(dim=(1, 2)), y)

    def output(self, pred: torch.Tensor, y: torch.Tensor) -> Output:
        return Output(loss=((pred.float() - y) ** 2).mean())


def vm_size() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def make_batches(cfg: dict) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    out = []
    for s in range(cfg["steps"]):
        x = torch.randn(cfg["batch"], cfg["seq"], 16, generator=g)
        y = torch.randn(cfg["batch"], generator=g)
        out.append({"x": x, "y": y, "idx": torch.arange(s * cfg["batch"], (s + 1) * cfg["batch"])})
    return out


def reference(model: nn.Module, batches: list[dict]) -> nn.Module:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for b in batches:
        model(**b).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def calibrate(model: nn.Module, batch: dict, sizes: list[int]) -> list[int]:
    """Address-space growth of one uncapped forward/backward at each micro-batch size."""
    samples: list[int] = []
    handles = []
    for m in model.modules():
        handles.append(m.register_forward_pre_hook(lambda *a: samples.append(vm_size())))
        handles.append(m.register_forward_hook(lambda *a: samples.append(vm_size())))
    out = []
    for k in sizes:
        base = vm_size()
        samples.clear()
        micro = {key: v[:k] for key, v in batch.items()}
        loss = model(**micro).loss
        samples.append(vm_size())
        loss.backward()
        samples.append(vm_size())
        del loss
        out.append(max(samples) - base)
    for h in handles:
        h.remove()
    for p in model.parameters():
        p.grad = None
    return out


def run(cfg: dict, stage: int, first: bool, messages: list, events: list, bug: str | None = None) -> None:
    """One guarded run at sharding level ``stage``; writes ``result{rank}_{stage}.json`` (and weights).

    With ``bug="forward"``: no cap; rank 1 raises a KeyError in the second block's forward of the first
    step (a bug in user code, not an OOM) while rank 0 goes on to that block's all-gather; with
    ``bug="backward"`` in the first block's backward, after the second block's reduce-scatter; writes
    ``result{rank}_bug-{bug}.json``.
    """
    import torch.distributed as dist

    import memguard
    from memguard.estimator._result import Estimate
    from memguard.planner._plan import Plan

    out = Path(cfg["out"])
    rank, world = cfg["rank"], 2
    messages.clear()
    events.clear()
    collective = cfg["mode"] == "collective"
    torch.manual_seed(0)
    model = Net(512, 2) if collective else Net(64, 2)
    batches = make_batches(cfg)
    if rank == 0 and not collective and first:
        torch.save(reference(copy.deepcopy(model), batches).state_dict(), out / "reference.pt")
    local = cfg["batch"] // world
    est = Estimate(peak_bytes=4 << 20, breakdown={"params": 1 << 20, "activations": 3 << 20}, context_bytes=0,
                   peak_phase="backward", allocated_peak_bytes=4 << 20, device="cpu", precision="32-true",
                   zero_stage=stage, world_size=world, gpu=None, micro_batch_size=cfg["planned"])
    plan = Plan(micro_batch_size=cfg["planned"], grad_accum_steps=local // cfg["planned"], world_size=world,
                global_batch_size=cfg["batch"], precision="32-true", activation_checkpointing=False,
                zero_stage=stage, budget_bytes=64 << 20, estimate=est, device="cpu", strategy="fsdp2")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    memguard.prepare(model, opt, plan=plan, strategy="fsdp2")
    model.register_forward_pre_hook(lambda m, a, kw: events.append(kw["idx"].tolist()), with_kwargs=True)
    shards = [{k: v[rank * local:(rank + 1) * local] for k, v in b.items()} for b in batches]
    result: dict = {"rank": rank, "losses": [], "error": None}

    if cfg.get("time_steps"):  # the agreements' cost: memguard.step with and without them, interleaved
        rg = memguard.guard._core.guard_of(model, "").rank_group
        timing = copy.deepcopy(shards[0])
        memguard.step(model, opt, timing)  # warm-up (lazy init)
        with_s, without_s, count = [], [], 0
        for _ in range(cfg["time_steps"]):
            start = rg.agreements
            t0 = time.perf_counter()
            memguard.step(model, opt, timing)
            with_s.append(time.perf_counter() - t0)
            count = rg.agreements - start
            rg._boundary = lambda: None  # the same step, FSDP's collectives without their agreements
            t0 = time.perf_counter()
            memguard.step(model, opt, timing)
            without_s.append(time.perf_counter() - t0)
            del rg._boundary
        result["step_s"] = sorted(with_s)[len(with_s) // 2]  # medians: the machine is shared
        result["step_without_agreements_s"] = sorted(without_s)[len(without_s) // 2]
        result["agreements_per_step"] = count
        times = []
        for _ in range(200):
            t0 = time.perf_counter()
            rg.agree(0, [0])
            times.append(time.perf_counter() - t0)
        result["agreement_s"] = sorted(times)[100]

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if bug:
        budget = None
        if rank == 1 and bug == "backward":  # in block 0's backward, after block 1's reduce-scatter
            def user_bug_in_backward(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
                def fail(grad: torch.Tensor) -> None:
                    raise KeyError("a bug in user code on rank 1, in backward")

                output.register_hook(fail)

            model.blocks[0].register_forward_hook(user_bug_in_backward)
        elif rank == 1:
            def user_bug(*args: object) -> None:
                raise KeyError("a bug in user code on rank 1")

            model.blocks[1].register_forward_pre_hook(user_bug)
    elif collective:
        budget = cfg["budget_mib"] << 20
    else:
        d_small, d_big = calibrate(model, shards[0], [cfg["planned"] // 4, cfg["planned"]])
        budget = (d_small + d_big) // 2
        result["calibration"] = {"d_small": d_small, "d_big": d_big}
    dist.barrier()
    if rank in cfg["cap_ranks"] and budget is not None:
        resource.setrlimit(resource.RLIMIT_AS, (vm_size() + budget, hard))
    t0 = time.perf_counter()
    try:
        for shard in shards:
            events.append("STEP")
            result["losses"].append(memguard.step(model, opt, shard))
    except Exception as exc:  # reported to the test
        result["error"] = {"type": type(exc).__name__, "message": str(exc), "rank": getattr(exc, "rank", None)}
    result["train_s"] = time.perf_counter() - t0
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    from memguard.guard import guard_status

    status = guard_status(model)
    result.update(messages=messages, events=events, micro_batch_size=status.micro_batch_size,
                  oom_retries=status.oom_retries)
    if result["error"] is None:
        full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
        if rank == 0:
            torch.save(full, out / f"guarded_{stage}.pt")
    (out / f"result{rank}_{'bug-' + bug if bug else stage}.json").write_text(json.dumps(result))


def main() -> None:
    cfg = json.loads(sys.argv[1])
    rank, world = cfg["rank"], 2
    torch.set_num_threads(1)
    # oneDNN reports a failed allocation as "could not create a primitive", which is not recognisable as an
    # OOM; the native CPU kernels fail in the allocator with its own message.
    torch.backends.mkldnn.enabled = False
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    messages: list[str] = []
    events: list = []

    class Recorder(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(f"{record.levelname}:{record.getMessage()}")
            if record.levelno == logging.WARNING:
                events.append("RETRY")

    logging.getLogger("memguard").addHandler(Recorder())
    logging.getLogger("memguard").setLevel(logging.INFO)

    for i, stage in enumerate(cfg["zero_stages"]):  # one process pair for several runs: start-up dominates
        run(cfg, stage, i == 0, messages, events)
    for where in cfg.get("bug_runs", []):
        run(cfg, 3, False, messages, events, bug=where)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown: gloo's threads can deadlock at exit (see oom_worker.py)


if __name__ == "__main__":
    main()
