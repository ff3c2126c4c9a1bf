"""One rank of pipeline stages with FSDP2 and/or tensor parallelism inside, laid out by
``memguard.integrations.parallel.apply(model, Layout(pp=..., dp_shard=..., tp=...))`` (run by
test_parallel_pipeline_mesh.py).

``python parallel_pipeline_mesh_worker.py '<json>'`` with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``
set. The JSON holds ``"pp"``, ``"dp_shard"``, ``"tp"``, ``"schedule"``, ``"microbatches"``, ``"steps"`` and
``"out"``, and optionally ``"seq"``, ``"vocab"``, ``"measure"``, ``"raise_rank"``, ``"cap_rank"``,
``"cap_factor"`` and ``"hang_after_s"``, as parallel_pipeline_worker.py takes them (whose model, batches and
measurement this reuses), ``"optimizer"`` (:func:`make_optimizer`), ``"fill_uninitialized"``: fill every tensor
torch allocates uninitialised with NaN (a read of memory nothing wrote then shows in the losses on every run), and
``"inside_rank"``: from the second step on,
that rank's tensor-parallel redistributions of partial tensors fail as an allocation does (an OOM inside a TP
collective); the ranks then write their results and exit without a barrier; ``"time_steps"``: only
:func:`time_steps`.

Each rank builds the same small Llama (seed 0), takes its data-parallel share of each global batch of
``parallel_pipeline_worker.ROWS`` rows (the rows of its ``dp_shard`` coordinate; the ranks of one stage that
differ only in their ``tp`` coordinate take the same rows), runs ``steps`` steps of ``memguard.step`` (which
dispatches to ``parallel.step``) and writes ``result{rank}.json`` (losses, micro-batch counts after each step,
the error a step raised, the "memguard" log records, the stage and the rank's coordinates, the agreements its
stage ran) and ``weights{rank}.pt`` (its stage's parameters by name, whole: every DTensor's ``full_tensor()``,
after the last step).
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import parallel_pipeline_worker as base  # noqa: E402 - the pp-only worker's model, batches and measurement


#: SGD's learning rate (``"optimizer": "sgd"``): large enough that a step moves the weights well above the tests'
#: 1e-5 tolerance.
SGD_LR = 0.5


def make_optimizer(params, name: str):
    """AdamW at parallel_pipeline_worker's learning rate, or (``"sgd"``) plain SGD, whose update is linear in the
    gradient: AdamW's first step is ``lr * g / (|g| + eps)`` (``torch/optim/adamw.py``), which turns a rounding
    difference in a gradient near zero into a difference of up to ``lr`` in the weight."""
    import torch

    if name == "sgd":
        return torch.optim.SGD(params, lr=SGD_LR)
    return torch.optim.AdamW(params, lr=base.LR)


def time_steps(model, optimizer, batch: dict, run, steps: int) -> dict:
    """The stage agreements' cost: ``steps`` steps of ``memguard.step`` with them, interleaved with as many without
    any (the run's rank group set aside: its hooks and wrappers then call straight through); the medians (the
    machine is shared) and the agreements per step."""
    import time

    import memguard

    rg = run.rank_group
    memguard.step(model, optimizer, batch)  # warm-up
    with_s, without_s, per_step = [], [], 0
    for _ in range(steps):
        start, t0 = rg.agreements, time.perf_counter()
        memguard.step(model, optimizer, batch)
        with_s.append(time.perf_counter() - t0)
        per_step = rg.agreements - start
        run.rank_group = None
        t0 = time.perf_counter()
        memguard.step(model, optimizer, batch)
        without_s.append(time.perf_counter() - t0)
        run.rank_group = rg
    return {"step_s": sorted(with_s)[steps // 2], "step_without_agreements_s": sorted(without_s)[steps // 2],
            "agreements_per_step": per_step}


def main() -> None:
    import torch
    import torch.distributed as dist

    import memguard
    from memguard.integrations import parallel

    cfg = json.loads(sys.argv[1])
    if cfg.get("hang_after_s"):  # a hung rank prints where it waits, then exits (the test then fails)
        faulthandler.dump_traceback_later(cfg["hang_after_s"], exit=True)
    torch.set_num_threads(1)
    if cfg.get("fill_uninitialized"):
        # torch.empty and the like fill floating-point memory with NaN only under deterministic algorithms
        # (torch/utils/deterministic.py, fill_uninitialized_memory)
        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = True
    if cfg.get("measure"):
        # every collective (torch.distributed's and DTensor's functional ones) completes and gloo's worker thread
        # lets go of its tensors before the caller goes on, as the layout benchmark measures a rank
        from benchmarks.common import settle_collectives
        from benchmarks.layouts_cpu import settle_functional_collectives

        settle_collectives(pause_s=0.02)
        settle_functional_collectives(pause_s=0.02)
    records = base._Records()
    logging.getLogger("memguard").addHandler(records)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    layout = memguard.Layout(pp=cfg["pp"], dp_shard=cfg.get("dp_shard", 1), tp=cfg.get("tp", 1),
                             pp_schedule=cfg["schedule"], pp_microbatches=cfg["microbatches"])
    vocab, seq = cfg.get("vocab", base.VOCAB), cfg.get("seq", base.SEQ)
    target = layout
    if cfg.get("checkpoint_blocks") or cfg.get("precision"):  # the fields of a plan apply() reads
        import types

        target = types.SimpleNamespace(layout=layout, checkpoint_blocks=cfg.get("checkpoint_blocks", 0),
                                       precision=cfg.get("precision", "32-true"))
    model = parallel.apply(base.build_llama(vocab), target)
    applied = parallel.layout_of(model)
    mesh, run = applied.mesh, applied.pipeline
    shard, shards = mesh.get_local_rank("dp_shard"), layout.dp_shard
    share = base.ROWS // shards

    def mine(batch: dict) -> dict:  # copies: a view would keep the whole batch's storage alive (and measured)
        return {k: v[shard * share:(shard + 1) * share].clone() for k, v in batch.items()}

    batches = [mine(b) for b in base.make_batches(cfg["steps"], seq=seq, vocab=vocab)]
    optimizer = make_optimizer(model.parameters(), cfg.get("optimizer", "adamw"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    coords = {"stage": run.rank, "dp_shard": shard, "tp": mesh.get_local_rank("tp")}
    if cfg.get("measure"):
        result = {"rank": rank, **coords, "real_peak_bytes": base._measure(model, optimizer, batches[0], run)}
        dist.barrier()
        dist.destroy_process_group()
        (Path(cfg["out"]) / f"result{rank}.json").write_text(json.dumps(result))
        return
    if cfg.get("time_steps"):
        result = {"rank": rank, **coords, **time_steps(model, optimizer, batches[0], run, cfg["time_steps"])}
        dist.barrier()
        dist.destroy_process_group()
        (Path(cfg["out"]) / f"result{rank}.json").write_text(json.dumps(result))
        return
    losses, micro, capped, growth, error = [], [], False, 0, None
    try:
        for k, batch in enumerate(batches):
            if k == 1 and cfg.get("cap_rank") == rank:
                # the calibration of parallel_pipeline_worker.py: the first step's rise of the address space
                resource.setrlimit(resource.RLIMIT_AS, (base.vm() + int(cfg["cap_factor"] * growth), hard))
                capped = True
            if k == 1 and cfg.get("inside_rank") == rank:
                # from the second step on, DTensor.redistribute of a Partial tensor fails as the CPU allocator does,
                # after memguard's agreement at that TP boundary passed (tests/guard/tp_worker.py)
                sys.path.insert(0, str(Path(__file__).parents[1] / "guard"))
                import tp_worker

                tp_worker.inject_oom_in_redistribute()
            if k == 1 and cfg.get("raise_rank") == rank:
                def fail(module, args):
                    raise ValueError("an error of the model's own")
                model.model.register_forward_pre_hook(fail)
            before = base.vm()
            losses.append(memguard.step(model, optimizer, batch))
            if k == 0:
                growth = base.vm("VmPeak") - before
            micro.append(run.microbatches)
    except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
        error = {"type": type(exc).__name__, "message": str(exc), "notes": getattr(exc, "__notes__", []),
                 "cause": None if exc.__cause__ is None else f"{type(exc.__cause__).__name__}: {exc.__cause__}"}
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    result = {"rank": rank, **coords, "losses": losses, "error": error, "first_step_growth": growth,
              "checkpointed": sum(bool(getattr(b, "_memguard_checkpointed", False)) for b in model.model.layers),
              "microbatches": micro, "capped": capped, "log": records.messages,
              "mesh": list(mesh.shape), "stage_ranks": run.stage_ranks,
              "agreements": run.rank_group.agreements if run.rank_group is not None else 0,
              "rank_group_size": run.rank_group.world_size if run.rank_group is not None else 1}
    if cfg.get("inside_rank") is not None and error is not None:
        # the process groups are torn down (aborted here, or by the peer that stopped): no barrier; exit at once, as
        # a job does after such an error
        (Path(cfg["out"]) / f"result{rank}.json").write_text(json.dumps(result))
        sys.stdout.flush()
        os._exit(0)
    if error is None:
        from torch.distributed.tensor import DTensor

        # full_tensor() is a collective over the parameter's mesh: every rank of the stage calls it in the same order
        weights = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                   for n, p in model.named_parameters()}
        torch.save(weights, Path(cfg["out"]) / f"weights{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    (Path(cfg["out"]) / f"result{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
