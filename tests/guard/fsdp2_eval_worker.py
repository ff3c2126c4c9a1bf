"""One rank of a 2-rank gloo FSDP2 evaluation that really runs out of memory, for the sharded evaluate's tests.

Run as ``python fsdp2_eval_worker.py '<json config>'``. Both ranks build the same model from the same
seed and each its own evaluation batch (``batches[rank]`` samples, ``seq`` positions; sample ids in
``idx`` are global); each rank keeps a plain, unsharded copy of the model and evaluates its batch
with it whole, uncapped: the reference. Then the model is sharded (``"prepare"``:
``memguard.prepare(..., strategy="fsdp2")``; ``"fully_shard"``: ``fully_shard`` on each block and
the root, memguard never told; ``"fsdp1"``: FSDP1's ``FullyShardedDataParallel`` with a unit per block), and,
in ``"recover"`` mode:

1. calibrate: one uncapped ``no_grad`` forward of the sharded model at a quarter of the largest
   batch and one at the largest batch, on both ranks (they all-gather together), sampling the
   address space (VmSize) at every module's forward entry and exit; ``d_small`` and ``d_big`` are
   the growths over the VmSize before each;
2. cap the ranks in ``cap_ranks`` with ``RLIMIT_AS`` at VmSize + (d_small + d_big) / 2, so the whole
   batch fails for real in a block's compute and half of it fits;
3. ``memguard.evaluate(model, batch)`` (the joined outputs), then, the remembered eval micro-batch
   forgotten so that it runs out of memory again, ``memguard.evaluate(model, batch, fn=loss only)``;
   write the outcome, the forwards' sample ids and the log to ``result{rank}.json`` and the
   outputs to ``tensors{rank}.pt``.

In ``"bug"`` mode nothing is capped and rank 1 fails on its own in the first evaluate call:
``bug="forward"`` raises a KeyError in the second block's forward (while rank 0 goes on to that
block's all-gather); ``bug="batch"`` gives rank 1 a batch without a batch dimension. ``time_calls`` (uncapped runs):
that many loss-only ``memguard.evaluate`` calls and plain ``no_grad`` forwards, interleaved, timed.

In ``"remember"`` mode nothing is capped; rank 0 alone remembers an eval micro-batch of
``remembered`` samples for its batch's shape before the calls (rank 1 remembers none).

In ``"collective"`` mode the blocks are large (8 MiB each unsharded) and the activations tiny; the
capped rank gets VmSize + ``budget_mib``, less than one block's all-gather output, so the OOM
happens inside FSDP2's all-gather during evaluation (the unrecoverable case).

Memory per sample in evaluation at ``seq`` positions (fp32, hidden 64): a block's fc1 output and
GELU's, ``2 * seq * 256 * 4`` bytes (0.5 MiB at ``seq=256``).
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

sys.path.insert(0, str(Path(__file__).parent))
from fsdp2_worker import Block, vm_size  # noqa: E402  (the same block and VmSize reader as the training worker)


@dataclass
class Output:
    loss: torch.Tensor
    pred: torch.Tensor


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
        pred = self.head(h).mean(dim=(1, 2))
        return Output(loss=((pred - y) ** 2).mean(), pred=pred)


def make_batch(cfg: dict, rank: int) -> dict:
    g = torch.Generator().manual_seed(10 + rank)
    n = cfg["batches"][rank]
    first = 1000 * rank
    return {"x": torch.randn(n, cfg["seq"], 16, generator=g), "y": torch.randn(n, generator=g),
            "idx": torch.arange(first, first + n)}


def calibrate(model: nn.Module, batch: dict, sizes: list[int]) -> list[int]:
    """Address-space growth of one uncapped no_grad forward at each size (every rank runs it: all-gathers)."""
    samples: list[int] = []
    handles = []
    for m in model.modules():
        handles.append(m.register_forward_pre_hook(lambda *a: samples.append(vm_size())))
        handles.append(m.register_forward_hook(lambda *a: samples.append(vm_size())))
    out = []
    for k in sizes:
        micro = {key: v[:k] for key, v in batch.items()}
        base = vm_size()
        samples.clear()
        with torch.no_grad():
            model(**micro)
        samples.append(vm_size())
        out.append(max(samples) - base)
    for h in handles:
        h.remove()
    return out


def main() -> None:
    cfg = json.loads(sys.argv[1])
    rank, world = cfg["rank"], 2
    torch.set_num_threads(1)
    torch.backends.mkldnn.enabled = False  # the native CPU kernels fail in the allocator with its own message
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

    import memguard
    from memguard.guard._evaluate import eval_status

    out = Path(cfg["out"])
    collective = cfg["mode"] == "collective"
    torch.manual_seed(0)
    model = Net(512, 2) if collective else Net(64, 2)
    batch = make_batch(cfg, rank)
    plain = copy.deepcopy(model).eval()
    with torch.no_grad():
        ref = plain(**batch)
    result: dict = {"rank": rank, "error": None, "ref_loss": ref.loss.item()}

    if cfg["how"] == "prepare":
        from memguard.estimator._result import Estimate
        from memguard.planner._plan import Plan

        n = max(cfg["batches"])
        est = Estimate(peak_bytes=4 << 20, breakdown={"params": 1 << 20, "activations": 3 << 20}, context_bytes=0,
                       peak_phase="backward", allocated_peak_bytes=4 << 20, device="cpu", precision="32-true",
                       zero_stage=3, world_size=world, gpu=None, micro_batch_size=n)
        plan = Plan(micro_batch_size=n, grad_accum_steps=1, world_size=world, global_batch_size=n * world,
                    precision="32-true", activation_checkpointing=False, zero_stage=3, budget_bytes=64 << 20,
                    estimate=est, device="cpu", strategy="fsdp2")
        memguard.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), plan=plan, strategy="fsdp2")
    elif cfg["how"] == "fsdp1":  # FSDP1, one unit per block and the root (as Lightning's FSDPStrategy wraps)
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}),
                                         use_orig_params=cfg.get("use_orig_params", False), device_id=torch.device("cpu"))
    else:
        from torch.distributed.fsdp import fully_shard

        for b in model.blocks:
            fully_shard(b)
        fully_shard(model)
    model.register_forward_pre_hook(lambda m, a, kw: events.append(kw["idx"].tolist()), with_kwargs=True)

    from memguard.guard._evaluate_sharded import eval_rank_group

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    budget = None
    if cfg["mode"] == "bug":
        if rank == 1 and cfg["bug"] == "forward":
            def user_bug(*args: object) -> None:
                raise KeyError("a bug in user code on rank 1")

            model.blocks[1].register_forward_pre_hook(user_bug)
        elif rank == 1:
            batch = {"x": torch.zeros(())}
    elif cfg["mode"] == "remember":
        from memguard.guard._evaluate import shape_signature

        if rank == 0:
            eval_status(model).remember(shape_signature(batch), cfg["remembered"])
    elif collective:
        budget = cfg["budget_mib"] << 20
    else:
        n = max(cfg["batches"])
        with torch.no_grad():  # warm-up: FSDP2's lazy init and gloo's buffers before measuring
            model(**{k: v[:1] for k, v in batch.items()})
        d_small, d_big = calibrate(model, batch, [n // 4, n])
        budget = (d_small + d_big) // 2
        result["calibration"] = {"d_small": d_small, "d_big": d_big}
    events.clear()
    dist.barrier()
    if rank in cfg["cap_ranks"] and budget is not None:
        resource.setrlimit(resource.RLIMIT_AS, (vm_size() + budget, hard))
    rg = eval_rank_group(model)
    if cfg.get("time_calls"):  # memguard.evaluate against the plain no_grad forward, uncapped, interleaved
        guarded_s, plain_s = [], []
        for _ in range(cfg["time_calls"]):
            t0 = time.perf_counter()
            memguard.evaluate(model, batch, fn=lambda m, b: m(**b).loss)
            guarded_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            with torch.no_grad():
                model.eval()
                model(**batch)
            plain_s.append(time.perf_counter() - t0)
        result["evaluate_s"] = sorted(guarded_s)[len(guarded_s) // 2]  # medians: the machine is shared
        result["plain_s"] = sorted(plain_s)[len(plain_s) // 2]
    agreements = rg.agreements
    t0 = time.perf_counter()
    outputs: dict = {}
    try:
        events.append("CALL")
        joined = memguard.evaluate(model, batch)
        result["joined_forwards"] = eval_status(model).forwards
        result["joined_padding"] = eval_status(model).padding_forwards
        outputs["pred"], outputs["loss"] = joined.pred, joined.loss
        if cfg["mode"] != "remember":  # forget the eval micro-batch: the next call OOMs again
            eval_status(model).micro_batch_size.clear()
        events.append("CALL")
        loss = memguard.evaluate(model, batch, fn=lambda m, b: m(**b).loss)
        result["loss_forwards"] = eval_status(model).forwards
        result["loss_padding"] = eval_status(model).padding_forwards
        outputs["loss_only"] = loss
    except Exception as exc:  # reported to the test
        result["error"] = {"type": type(exc).__name__, "message": str(exc), "rank": getattr(exc, "rank", None)}
    result["eval_s"] = time.perf_counter() - t0
    result["agreements"] = rg.agreements - agreements
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    result.update(messages=messages, events=events, oom_retries=eval_status(model).oom_retries,
                  eval_micro_batch_sizes=list(eval_status(model).micro_batch_size.values()))
    torch.save({"ref_pred": ref.pred, "ref_loss": ref.loss, **outputs}, out / f"tensors{rank}.pt")
    (out / f"result{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown: gloo's threads can deadlock at exit (see oom_worker.py)


if __name__ == "__main__":
    main()
