"""One rank of a tensor-parallel (or FSDP2 x TP) job trained by ``memguard.step``, with a real OOM on some ranks.

``python parallel_oom_worker.py '<json>'`` with ``RANK``/``WORLD_SIZE``/``MASTER_*`` set; the JSON holds
``dp_shard``, ``tp``, ``steps``, ``batch`` (one data-parallel rank's samples per step), ``planned``
(the first micro-batch), ``cap_ranks`` and ``out``.

The model is the layout benchmark's GPT-2-shaped model (:func:`benchmarks.layouts_cpu.build_model`),
laid out by :func:`memguard.integrations.parallel.apply` and prepared by
:func:`memguard.integrations.parallel.prepare`. The ranks in ``cap_ranks`` cap their address space with
``RLIMIT_AS`` at a budget calibrated from an uncapped forward/backward of the laid-out model (halfway
between the growth at a quarter of the planned micro-batch and at the planned one), so the planned
micro-batch runs out of memory in compute on those ranks only. Rank 0 also trains an unsharded copy in
this process (SGD on the whole batch of every data-parallel rank) for the weights to be compared.
Writes ``result{rank}.json`` (and rank 0 ``weights.pt``, ``reference.pt``).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from worker_common import vm_size  # noqa: E402

LR = 0.05


def make_batches(steps: int, rows: int, seq: int = 64) -> list[dict]:
    """``steps`` global batches of ``rows`` samples (every data-parallel rank's, in order), each with its indices."""
    from benchmarks.layouts_cpu import _VOCAB

    g = torch.Generator().manual_seed(1)
    out = []
    for s in range(steps):
        ids = torch.randint(0, _VOCAB, (rows, seq), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone(), "idx": torch.arange(s * rows, (s + 1) * rows)})
    return out


def calibrate(model: torch.nn.Module, loss_fn, batch: dict, sizes: list[int]) -> list[int]:
    """Address-space growth of one uncapped forward/backward at each micro-batch size (every rank runs it:
    the collectives inside need all of them)."""
    samples: list[int] = []
    handles = [h for m in model.modules() for h in (m.register_forward_pre_hook(lambda *a: samples.append(vm_size())),
                                                      m.register_forward_hook(lambda *a: samples.append(vm_size())))]
    out = []
    for k in sizes:
        base = vm_size()
        samples.clear()
        loss = loss_fn(model, {key: v[:k] for key, v in batch.items()})
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


def refusals(cfg: dict, model, optimizer, loss_fn, batch: dict) -> None:
    """``memguard.prepare`` (not ``parallel.prepare``) of the tensor-parallel model, then ``memguard.step``; and
    :func:`memguard.guard._tp.tp_rank_group` over a mesh whose tensor-parallel group is plain gloo (as on
    CUDA, where it is NCCL). Writes what each raised to ``result{rank}.json``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import memguard
    from memguard.guard._tp import tp_rank_group

    def error_of(fn) -> dict | None:
        try:
            fn()
        except Exception as exc:  # reported to the test
            return {"type": type(exc).__name__, "message": str(exc)}
        return None

    memguard.prepare(model, optimizer, micro_batch_size=cfg["planned"], loss_fn=loss_fn)
    result = {"rank": dist.get_rank(), "step": error_of(lambda: memguard.step(model, optimizer, batch)),
              "plain_mesh": error_of(lambda: tp_rank_group(model, init_device_mesh(
                  "cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))))}
    (Path(cfg["out"]) / f"result{result['rank']}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    import faulthandler

    # a rank still running then prints where it waits and exits: a hang fails the test with its stacks
    faulthandler.dump_traceback_later(cfg.get("hang_after_s", 120), exit=True)
    torch.set_num_threads(1)
    # oneDNN reports a failed allocation as "could not create a primitive" (not recognisable as an OOM)
    torch.backends.mkldnn.enabled = False
    import torch.distributed as dist

    import memguard
    from benchmarks.layouts_cpu import build_model
    from memguard.guard import guard_status
    from memguard.integrations.parallel import apply, mesh_of, prepare

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    messages: list[str] = []
    events: list = []

    class Recorder(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(f"{record.levelname}:{record.getMessage()}")
            if record.levelno == logging.WARNING:
                events.append("RETRY")

    logging.getLogger("memguard").addHandler(Recorder())
    logging.getLogger("memguard").setLevel(logging.INFO)

    dp, local = cfg["dp_shard"], cfg["batch"]
    batches = make_batches(cfg["steps"], dp * local)
    model = build_model("gpt")
    reference = copy.deepcopy(model) if rank == 0 else None
    model = apply(model, memguard.Layout(dp_shard=dp, tp=cfg["tp"]))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    def loss_fn(m, b):
        if not b["input_ids"].is_meta:
            events.append(b["idx"].tolist())
        return m(b["input_ids"], b["labels"])

    if cfg.get("refusals"):  # what must refuse rather than hang: no OOM, no calibration
        refusals(cfg, model, optimizer, loss_fn, batches[0])
        return
    prepare(model, optimizer, micro_batch_size=cfg["planned"], loss_fn=loss_fn)
    d = mesh_of(model)["dp_shard"].get_local_rank()  # tensor-parallel peers get the same rows
    shards = [{k: v[d * local:(d + 1) * local] for k, v in b.items()} for b in batches]
    d_small, d_big = calibrate(model, lambda m, b: m(b["input_ids"], b["labels"]), shards[0],
                               [cfg["planned"] // 4, cfg["planned"]])
    result: dict = {"rank": rank, "dp_index": d, "losses": [], "error": None,
                    "calibration": {"d_small": d_small, "d_big": d_big}}
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    events.clear()
    dist.barrier()
    if rank in cfg["cap_ranks"]:
        resource.setrlimit(resource.RLIMIT_AS, (vm_size() + (d_small + d_big) // 2, hard))
    try:
        for shard in shards:
            events.append("STEP")
            result["losses"].append(memguard.step(model, optimizer, shard))
    except Exception as exc:  # reported to the test
        result["error"] = {"type": type(exc).__name__, "message": str(exc)}
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))  # lifted before anything is compared
    status = guard_status(model)
    result.update(messages=messages, events=events, micro_batch_size=status.micro_batch_size,
                  oom_retries=status.oom_retries)
    out = Path(cfg["out"])
    if result["error"] is None:
        full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in model.named_parameters()}
        if rank == 0:
            torch.save(full, out / "weights.pt")
            ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
            for b in batches:  # every data-parallel rank's rows: the mean over them is FSDP2's averaged gradient
                reference(b["input_ids"], b["labels"]).backward()
                ref_opt.step()
                ref_opt.zero_grad(set_to_none=True)
            torch.save({n: p.detach() for n, p in reference.named_parameters()}, out / "reference.pt")
    (out / f"result{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown: gloo's threads can deadlock at exit (see tests/guard/oom_worker.py)


if __name__ == "__main__":
    main()
