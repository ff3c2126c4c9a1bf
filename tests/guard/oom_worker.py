"""A training process that really runs out of memory, for the guard's tests.

Run as ``python oom_worker.py '<json config>'``. The process trains a small model twice from the
same initial weights: first a plain full-batch reference (no memguard, no memory cap), then with
``memguard.guard.step`` after capping its address space with ``RLIMIT_AS`` to the current VmSize
plus ``budget_mib``, so that the planned micro-batch fails with the CPU allocator's real error.
It writes ``result.json`` and the weights (``guarded.pt``, ``reference.pt``) to ``out``.

Config keys: ``out`` (folder), ``mode`` (``"fp32"``, ``"16-mixed"``, ``"ddp"``), ``budget_mib``,
``planned`` (the plan's micro-batch), ``steps``, ``batch`` (global samples per step), ``seq``
(positions per sample, which sets the activation memory per sample), ``rank``/``world``/``port``
and ``cap_ranks`` for ``"ddp"``, and ``fail_rank``/``fail_step`` to raise an error that is not an
OOM in that rank's forward at that step (0-based); ``use_planner`` to let memguard plan on the
first step instead of using the hand-made plan.

Memory per sample: the activations saved for backward are two float tensors of ``seq x 1024`` per
sample (fc1's output and GELU's), plus two gradients of that size in backward, so about
``4 * seq * 1024 * 4`` bytes per sample in fp32 (1 MiB at ``seq=64``); the parameters are 70 KiB.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import resource
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

HIDDEN = 1024


@dataclass
class Output:
    loss: torch.Tensor


class Net(nn.Module):
    """Per position: 16 -> HIDDEN -> GELU -> 1, averaged over positions; MSE against ``y``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, HIDDEN)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor) -> Output:
        pred = self.fc2(self.act(self.fc1(x))).mean(dim=(1, 2))
        return Output(loss=((pred.float() - y) ** 2).mean())


def make_batches(cfg: dict) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    batches = []
    for s in range(cfg["steps"]):
        x = torch.randn(cfg["batch"], cfg["seq"], 16, generator=g)
        y = torch.randn(cfg["batch"], generator=g)
        if cfg["mode"] == "16-mixed" and s == 1:
            x[5] = 6e4  # overflows float16 in the forward: GradScaler must skip this step and back off
        idx = torch.arange(s * cfg["batch"], (s + 1) * cfg["batch"])
        batches.append({"x": x, "y": y, "idx": idx})
    return batches


def vm_size() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def reference(model: nn.Module, batches: list[dict], cfg: dict) -> tuple[nn.Module, dict | None]:
    """A plain PyTorch loop on the full global batch (what the guarded run must reproduce)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", **SCALER) if cfg["mode"] == "16-mixed" else None
    for b in batches:
        if scaler is not None:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(**b).loss
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            model(**b).loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)
    return model, (scaler.state_dict() if scaler is not None else None)


# init_scale 2**10 keeps normal steps finite; growth_interval 1 makes the scale change every step.
SCALER = {"init_scale": 2.0**10, "growth_interval": 1}


def main() -> None:
    cfg = json.loads(sys.argv[1])
    out = Path(cfg["out"])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    from memguard.estimator._result import Estimate
    from memguard.guard import guard_status, prepare, step
    from memguard.planner._plan import Plan

    rank, world = cfg.get("rank", 0), cfg.get("world", 1)
    events: list = []
    messages: list[str] = []

    class Recorder(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(f"{record.levelname}:{record.getMessage()}")
            if record.levelno >= logging.WARNING:
                events.append("RETRY")

    logging.getLogger("memguard").addHandler(Recorder())
    logging.getLogger("memguard").setLevel(logging.INFO)

    model = Net()
    initial = copy.deepcopy(model)
    batches = make_batches(cfg)
    ref_model, ref_scaler = reference(copy.deepcopy(initial), batches, cfg)
    torch.save(ref_model.state_dict(), out / "reference.pt")

    guarded = initial
    if cfg["mode"] == "ddp":
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        guarded = nn.parallel.DistributedDataParallel(guarded)
        dist.barrier()
    opt = torch.optim.SGD(guarded.parameters(), lr=0.05, momentum=0.9)
    inner = guarded.module if cfg["mode"] == "ddp" else guarded
    inner.register_forward_pre_hook(lambda m, a, kw: events.append(kw["idx"].tolist()), with_kwargs=True)

    def user_bug(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if rank == cfg.get("fail_rank") and events.count("STEP") == cfg.get("fail_step", 1) + 1:
            raise KeyError(f"a bug in user code on rank {rank}")

    inner.register_forward_pre_hook(user_bug, with_kwargs=True)

    precision = "16-mixed" if cfg["mode"] == "16-mixed" else "32-true"
    local = cfg["batch"] // world
    # A hand-made plan, as the planner would return it; its estimate is what an OOMRecoveryError reports.
    est = Estimate(peak_bytes=4 << 20, breakdown={"params": 1 << 20, "activations": 3 << 20}, context_bytes=0,
                   peak_phase="backward", allocated_peak_bytes=4 << 20, device="cpu", precision=precision,
                   zero_stage=0, world_size=world, gpu=None, micro_batch_size=cfg["planned"])
    plan = Plan(micro_batch_size=cfg["planned"], grad_accum_steps=local // cfg["planned"], world_size=world,
                global_batch_size=cfg["batch"], precision=precision, activation_checkpointing=False,
                zero_stage=0, budget_bytes=cfg["budget_mib"] << 20, estimate=est, device="cpu")
    scaler = torch.amp.GradScaler("cpu", **SCALER) if precision == "16-mixed" else None
    if cfg.get("use_planner"):  # memguard plans on the first step (rank 0 plans and broadcasts under DDP)
        prepare(guarded, opt, budget_bytes=cfg.get("plan_budget", 1 << 30), precision=precision, grad_scaler=scaler)
    else:
        prepare(guarded, opt, plan=plan, grad_scaler=scaler)

    result: dict = {"rank": rank, "losses": [], "error": None}
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if rank in cfg.get("cap_ranks", [0]):
        vm = vm_size()
        resource.setrlimit(resource.RLIMIT_AS, (vm + (cfg["budget_mib"] << 20), hard))
        result["capped_at"] = vm + (cfg["budget_mib"] << 20)
    try:
        for b in batches:
            shard = {k: v[rank * local:(rank + 1) * local] for k, v in b.items()}
            events.append("STEP")
            result["losses"].append(step(guarded, opt, shard))
    except Exception as exc:  # reported to the test, which decides whether it was expected
        result["error"] = {"type": type(exc).__name__, "message": str(exc),
                           "micro_batch_size": getattr(exc, "micro_batch_size", None),
                           "breakdown": getattr(exc, "breakdown", None), "rank": getattr(exc, "rank", None),
                           "problems": getattr(exc, "problems", None),
                           "suggestions": getattr(exc, "suggestions", None),
                           "closest": exc.closest.to_dict() if getattr(exc, "closest", None) is not None else None}
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    status = guard_status(guarded)
    result.update(events=events, messages=messages, micro_batch_size=status.micro_batch_size,
                  planned_micro_batch_size=status.planned_micro_batch_size,
                  oom_retries=status.oom_retries, reference_scaler=ref_scaler,
                  scaler=status.grad_scaler.state_dict() if status.grad_scaler is not None else None)
    torch.save(inner.state_dict(), out / f"guarded{rank}.pt")
    (out / f"result{rank}.json").write_text(json.dumps(result))
    # Leave without interpreter teardown: with gloo, destroying the process group while a gloo worker
    # thread still releases a finished work's tensors can deadlock at exit (seen once in torch 2.13).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
