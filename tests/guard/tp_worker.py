"""One rank of a gloo tensor-parallel run (TP 2, or FSDP2 x TP 2) under ``memguard.step``, for test_tp_recovery.py.

Run as ``python tp_worker.py '<json config>'``. Both ranks build the same small Llama
(``transformers.LlamaConfig``, built from the config, nothing downloaded) from the same seed; rank 0
also trains a plain single-process copy on the same batches (what the tensor-parallel, guarded run
must reproduce). Then, ``repeats`` times, both ranks lay a fresh copy out with
``memguard.integrations.parallel.apply(model, Layout(dp_shard=dp_shard, tp=2))``, ``memguard.prepare``
it with a fixed micro-batch (``strategy="fsdp2"`` when ``dp_shard > 1``) and train ``steps`` steps
with ``memguard.step``. The two TP ranks of a shard get the same samples (tensor parallelism splits
the model, not the samples); each FSDP2 shard its own part of the batch.

In ``"recover"`` mode, before training: one uncapped forward/backward at micro-batch ``planned // 4``
and one at ``planned`` on both ranks (tensor parallelism needs both), sampling the address space
(VmSize) at every module's forward entry and exit and after backward; ``d_small`` and ``d_big`` are
the growths over the VmSize before each. The ranks in ``cap_ranks`` then cap their address space
with ``RLIMIT_AS`` at VmSize + (d_small + d_big) / 2, so the planned micro-batch fails for real and
a quarter of it fits. The cap is lifted after training, before the weights are gathered.

Each repeat writes ``result{rank}_{i}.json`` (losses, the memguard log, the sample indices each
micro-batch saw, the final micro-batch, the retries; in "plain" mode the loss ``memguard.evaluate``
gives on the first batch, in micro-batches of ``planned // 2``) and, on rank 0, ``guarded_{i}.pt`` (the full
weights, gathered with ``DTensor.full_tensor``); rank 0 writes ``reference.pt``,
``reference_losses.json`` and ``reference_eval.json`` (the trained copy's loss on the first batch).

Config keys: ``out``, ``port``, ``rank``, ``mode`` ("plain", "recover", "inside": rank 1's first
all-reducing ``DTensor.redistribute`` fails as an OOM would, see :func:`inject_oom_in_redistribute`;
"inside_backward": as :func:`inject_oom_in_from_local_backward` says; "bug": rank 1 raises a KeyError
entering layer 1, a bug in user code, not an OOM), ``steps``, ``batch``,
``seq``, ``planned``, ``repeats``, ``cap_ranks``, ``dp_shard``, ``time_steps`` (then only: that many
uncapped steps timed with and without the agreements, interleaved, written to ``timing{rank}.json``) (default 1; ``2 * dp_shard`` ranks).
"""

from __future__ import annotations

import copy
import faulthandler
import json
import logging
import os
import resource
import sys
import time
from pathlib import Path

import torch

VOCAB = 1024  # the logits (replicated, outside tensor parallelism) dominate the activations


def make_model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      attn_implementation="eager")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def vm_size() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def make_batches(cfg: dict) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    out = []
    for s in range(cfg["steps"]):
        ids = torch.randint(0, VOCAB, (cfg["batch"], cfg["seq"]), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone(),
                    "idx": torch.arange(s * cfg["batch"], (s + 1) * cfg["batch"])})
    return out


def forward_loss(model: torch.nn.Module, b: dict) -> torch.Tensor:
    return model(input_ids=b["input_ids"], labels=b["labels"]).loss


def reference(model: torch.nn.Module, batches: list[dict]) -> tuple[torch.nn.Module, list[float]]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for b in batches:
        loss = forward_loss(model, b)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, losses


def calibrate(model: torch.nn.Module, batch: dict, sizes: list[int]) -> list[int]:
    """Address-space growth of one uncapped forward/backward at each micro-batch size (both ranks together)."""
    samples: list[int] = []
    handles = []
    for m in model.modules():
        handles.append(m.register_forward_pre_hook(lambda *a: samples.append(vm_size())))
        handles.append(m.register_forward_hook(lambda *a: samples.append(vm_size())))
    out = []
    for k in sizes:
        base = vm_size()
        samples.clear()
        loss = forward_loss(model, {key: v[:k] for key, v in batch.items()})
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


def inject_oom_in_redistribute() -> None:
    """From now on ``DTensor.redistribute`` fails as the CPU allocator does when it cannot allocate (its message,
    ``c10/core/impl/alloc_cpu.cpp``), before any collective is issued: what a real OOM allocating the output of
    tensor parallelism's all-reduce does, after memguard's agreement at that boundary passed. The first call is
    the all-reduce of the first RowwiseParallel output (``self_attn.o_proj`` of layer 0)."""
    from torch.distributed.tensor import DTensor

    original = DTensor.redistribute

    def redistribute(self: DTensor, *args: object, **kwargs: object) -> DTensor:
        if not any(p.is_partial() for p in self.placements):  # a local one (Shard(2) -> Shard(-1)): no collective
            return original(self, *args, **kwargs)
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                           f"you tried to allocate {self.to_local().nbytes} bytes. Error code 12 (Cannot allocate "
                           "memory)")

    DTensor.redistribute = redistribute  # type: ignore[method-assign]


def inject_oom_in_from_local_backward() -> None:
    """From now on the backward of ``DTensor.from_local`` (``_FromTorchTensor.backward``,
    ``torch/distributed/tensor/_api.py``) fails as the CPU allocator does when its gradient is ``Partial``, before
    the all-reduce to ``Replicate`` that it would issue: the first is a ColwiseParallel input gradient of layer 1."""
    from torch.distributed.tensor import _api

    original = _api._FromTorchTensor.backward

    def backward(ctx: object, grad_output: object) -> object:
        if grad_output is None or not any(p.is_partial() for p in grad_output.placements):
            return original(ctx, grad_output)
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                           f"you tried to allocate {grad_output.to_local().nbytes} bytes. Error code 12 (Cannot "
                           "allocate memory)")

    _api._FromTorchTensor.backward = staticmethod(backward)  # type: ignore[method-assign]


def main() -> None:
    cfg = json.loads(sys.argv[1])
    faulthandler.dump_traceback_later(cfg.get("hang_after_s", 100), exit=True)  # a hang prints its stacks, fails
    torch.set_num_threads(1)
    import torch.distributed as dist

    import memguard
    from memguard.guard import guard_status
    from memguard.guard._core import guard_of
    from memguard.integrations.parallel import apply

    rank, dp = cfg["rank"], cfg.get("dp_shard", 1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]))
    dist.init_process_group("gloo", rank=rank, world_size=2 * dp)
    out = Path(cfg["out"])
    messages: list[str] = []
    events: list = []

    class Recorder(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(f"{record.levelname}:{record.getMessage()}")
            if record.levelno == logging.WARNING:
                events.append("RETRY")

    logging.getLogger("memguard").addHandler(Recorder())
    logging.getLogger("memguard").setLevel(logging.INFO)

    base = make_model()
    batches = make_batches(cfg)
    if rank == 0:
        ref, losses = reference(copy.deepcopy(base), batches)
        with torch.no_grad():
            ref.eval()
            local = cfg["batch"] // dp
            (out / "reference_eval.json").write_text(json.dumps(forward_loss(ref, {k: v[:local] for k, v in
                                                                               batches[0].items()}).item()))
        torch.save(ref.state_dict(), out / "reference.pt")
        (out / "reference_losses.json").write_text(json.dumps(losses))

    # Layout(dp_shard=dp, tp=2) puts rank r at shard r // 2 (memguard.integrations.parallel: dims dp_shard, tp):
    # the two TP ranks of a shard see the same samples, the shards each their own part of the batch.
    local = cfg["batch"] // dp
    shards = [{k: v[(rank // 2) * local:(rank // 2 + 1) * local] for k, v in b.items()} for b in batches]

    def loss_fn(model: torch.nn.Module, micro: dict) -> torch.Tensor:
        events.append(micro["idx"].tolist())
        return forward_loss(model, micro)

    for i in range(cfg.get("repeats", 1)):
        messages.clear()
        events.clear()
        model = apply(copy.deepcopy(base), memguard.Layout(dp_shard=dp, tp=2))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        memguard.prepare(model, opt, micro_batch_size=cfg["planned"], loss_fn=loss_fn, verbose=False,
                         **({"strategy": "fsdp2"} if dp > 1 else {}))
        result: dict = {"rank": rank, "losses": [], "error": None}
        if cfg.get("time_steps"):  # the agreements' cost: memguard.step with and without them, interleaved
            rg = guard_of(model, "").rank_group
            memguard.step(model, opt, shards[0])  # warm-up
            with_s, without_s = [], []
            for _ in range(cfg["time_steps"]):
                start = rg.agreements
                t0 = time.perf_counter()
                memguard.step(model, opt, shards[0])
                with_s.append(time.perf_counter() - t0)
                result["agreements_per_step"] = rg.agreements - start
                rg._boundary = lambda: None  # the same step, TP's collectives without their agreements
                t0 = time.perf_counter()
                memguard.step(model, opt, shards[0])
                without_s.append(time.perf_counter() - t0)
                del rg._boundary
            result["step_s"] = sorted(with_s)[len(with_s) // 2]  # medians: the machine is shared
            result["step_without_agreements_s"] = sorted(without_s)[len(without_s) // 2]
            (out / f"timing{rank}.json").write_text(json.dumps(result))
            break
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        budget = None
        if cfg["mode"] == "recover":
            d_small, d_big = calibrate(model, shards[0], [cfg["planned"] // 4, cfg["planned"]])
            budget = (d_small + d_big) // 2
            result["calibration"] = {"d_small": d_small, "d_big": d_big}
        if cfg["mode"] == "inside" and rank == 1:
            inject_oom_in_redistribute()
        if cfg["mode"] == "inside_backward" and rank == 1:
            inject_oom_in_from_local_backward()
        if cfg["mode"] == "bug" and rank == 1:  # a bug in user code, in compute between two TP boundaries
            def user_bug(*args: object) -> None:
                raise KeyError("a bug in user code on rank 1")

            model.model.layers[1].register_forward_pre_hook(user_bug)
        dist.barrier()
        if rank in cfg.get("cap_ranks", []) and budget is not None:
            resource.setrlimit(resource.RLIMIT_AS, (vm_size() + budget, hard))
        t0 = time.perf_counter()
        try:
            for b in shards:
                events.append("STEP")
                result["losses"].append(memguard.step(model, opt, b))
        except Exception as exc:  # reported to the test
            result["error"] = {"type": type(exc).__name__, "message": str(exc), "rank": getattr(exc, "rank", None)}
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        result["train_s"] = time.perf_counter() - t0
        status = guard_status(model)
        result.update(messages=list(messages), events=list(events), micro_batch_size=status.micro_batch_size,
                      oom_retries=status.oom_retries, agreements=guard_of(model, "").rank_group.agreements)
        if result["error"] is None and cfg["mode"] == "plain":  # memguard.evaluate under the same agreements
            rg = guard_of(model, "").rank_group
            before = rg.agreements
            with torch.no_grad():
                evaluated = memguard.evaluate(model, shards[0], forward_loss, micro_batch_size=cfg["planned"] // 2)
            result["eval_loss"], result["eval_agreements"] = float(evaluated), rg.agreements - before
        if result["error"] is None:
            full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                    for k, v in model.state_dict().items()}
            if rank == 0:
                torch.save(full, out / f"guarded_{i}.pt")
        (out / f"result{rank}_{i}.json").write_text(json.dumps(result))
        if result["error"] is not None:
            # the process groups may be torn down: no barrier; rank 0 hosts the store that the peers read the
            # stopping rank's error from, so it stays a little longer
            time.sleep(5 if rank == 0 else 0)
            break
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown: gloo's threads can deadlock at exit (see oom_worker.py)


if __name__ == "__main__":
    main()
