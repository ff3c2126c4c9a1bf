"""One rank of a job laid out by ``memguard.integrations.parallel.apply`` (run by test_parallel.py).

``python parallel_worker.py '<json>'`` with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` set.
The JSON holds a :class:`benchmarks.layouts_cpu.Case` (``"case"``), ``"steps"`` and ``"out"``.

The model, batch and measurement are the layout benchmark's (:mod:`benchmarks.layouts_cpu`): its
models and batch, its settling of every collective (``settle_collectives``,
``settle_functional_collectives``) and the replay of the profiler's allocator events by address
(:func:`benchmarks.fsdp2_cpu._replay`, over the live bytes of :func:`benchmarks.fsdp2_cpu._live_bytes`)
around the same training step (loss, backward, ``AdamW.step``, ``zero_grad``); only the layout is
made by :func:`memguard.integrations.parallel.apply` instead of by hand. Writes ``result{rank}.json``.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path


def main() -> None:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    from benchmarks.common import settle_collectives
    from benchmarks.fsdp2_cpu import _PREFIX, _live_bytes, _replay
    from benchmarks.layouts_cpu import Case, build_model, layout_of, make_batch, settle_functional_collectives
    from memguard.batch import compute_loss
    from memguard.integrations.parallel import apply, layout_of as applied_layout

    cfg = json.loads(sys.argv[1])
    case = Case(**cfg["case"])
    torch.set_num_threads(1)
    settle_collectives(pause_s=0.02)
    settle_functional_collectives(pause_s=0.02)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = apply(build_model(case.model), layout_of(case))
    model.train()
    applied = applied_layout(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = make_batch(case)
    losses: list[float] = []

    def step() -> None:
        with record_function(_PREFIX + "step"):
            with record_function(_PREFIX + "forward"):
                loss = compute_loss(model, batch)
            with record_function(_PREFIX + "backward"):
                loss.backward()
            with record_function(_PREFIX + "optimizer"):
                optimizer.step()
            with record_function(_PREFIX + "zero_grad"):
                optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))

    step()  # warm-up: lazy inits and the optimizer's state
    gc.collect()
    gc.disable()  # frees by reference count only, as in the estimator's trace
    dist.barrier()
    baseline = _live_bytes(model, batch, optimizer)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(cfg["steps"]):
            step()
    end = _live_bytes(model, batch, optimizer)
    gc.enable()
    level, _, step_peaks, _, suspect = _replay(prof, baseline)
    peak = max([p for k, p in enumerate(step_peaks) if k not in suspect] or step_peaks)
    local_shapes = {n: list(getattr(p, "_local_tensor", p).shape) for n, p in model.named_parameters()}
    dist.barrier()
    dist.destroy_process_group()
    result = {"rank": rank, "peak_bytes": peak, "residual_bytes": level - end, "losses": losses,
              "mesh": list(applied.mesh.shape), "mesh_dims": list(applied.mesh.mesh_dim_names),
              "tp_plan_source": applied.tp_plan_source, "local_shapes": local_shapes}
    (Path(cfg["out"]) / f"result{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
