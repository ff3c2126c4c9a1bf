"""A 2-rank Accelerate run of a plan with a layout, for test_accelerate_layouts.py.

Run under ``torchrun`` as ``python accelerate_layout_worker.py '<json config>'``. Rank 0 first trains a plain
PyTorch reference on each full optimizer step (no Accelerate, no memguard). Then every rank builds
``Accelerator(**accelerator_kwargs(plan))`` for a hand-made FSDP2 plan whose layout is
``Layout(dp_shard=world)``: ``parallelism_config=ParallelismConfig(dp_shard_size=world)`` and the FSDP2 plugin.
Accelerate 1.15 on CPU processes refuses that as it comes: ``AcceleratorState.__init__`` (accelerate/state.py)
turns an ``fsdp_plugin`` into ``DistributedType.FSDP`` only for GPUs and other accelerators, so the state stays
MULTI_CPU, which ``ParallelismConfig._validate_accelerator`` (accelerate/parallelism_config.py) refuses for any
config over several processes (each rank tries, and records the error as ``unpatched``).
:func:`parallelism_on_cpu` sets what the GPU branch of ``AcceleratorState``
sets (``accelerate_worker.force_fsdp_on_cpu``) just before that validation, which then runs as on GPUs. The
model and optimizer go through :func:`memguard.integrations.accelerate.prepare` (``plan=``), which lets
``accelerator.prepare`` shard the model over the config's device mesh, and one
:func:`memguard.integrations.accelerate.step` per dataloader batch.

Config keys: ``out``, ``steps`` (optimizer steps), ``batch`` (dataloader batch = the plan's micro-batch),
``accumulate`` (the plan's accumulation), ``seq``. Each rank writes ``result<rank>.json`` (the
ParallelismConfig's sizes, the Accelerator's distributed type and mesh, the mesh the parameters are sharded
over, the samples each step ran, error) and ``weights<rank>.pt``; rank 0 also ``reference.pt``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
import traceback
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

from accelerate_worker import force_fsdp_on_cpu  # noqa: E402 - this folder is on sys.path
from worker_common import LR, MOMENTUM, Net, Samples, traced  # noqa: E402


@contextlib.contextmanager
def parallelism_on_cpu(plugin):
    """Let ``Accelerator(parallelism_config=..., fsdp_plugin=plugin, cpu=True)`` build on CPU processes as it does
    on GPUs (see the module docstring): ``Accelerator.__init__`` builds the config's device mesh, then calls
    ``parallelism_config._validate_accelerator(self)`` (accelerator.py, 1.15); this runs
    ``force_fsdp_on_cpu`` first, so the validation sees the FSDP2 Accelerator a GPU launch has."""
    from accelerate.parallelism_config import ParallelismConfig

    original = ParallelismConfig._validate_accelerator

    def validate(self, accelerator):
        force_fsdp_on_cpu(accelerator, plugin)
        return original(self, accelerator)

    ParallelismConfig._validate_accelerator = validate
    try:
        yield
    finally:
        ParallelismConfig._validate_accelerator = original


def main() -> None:
    cfg = json.loads(sys.argv[1])
    out = Path(cfg["out"])
    torch.set_num_threads(1)
    from accelerate import Accelerator

    from memguard import Estimate, Layout, Plan
    from memguard.integrations.accelerate import accelerator_kwargs, prepare, status, step

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    micro, accum, steps = cfg["batch"], cfg["accumulate"], cfg["steps"]
    layout = Layout(dp_shard=world)
    global_batch = micro * accum * world
    data = Samples(steps * global_batch, cfg["seq"])
    torch.manual_seed(0)
    initial = Net()

    if rank == 0:  # the reference: plain PyTorch, one optimizer step per global batch
        ref = copy.deepcopy(initial)
        opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=MOMENTUM)
        for s in range(steps):
            sl = slice(s * global_batch, (s + 1) * global_batch)
            ((ref(data.x[sl]) - data.y[sl]) ** 2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.save(ref.state_dict(), out / "reference.pt")

    ran: list[list[int]] = [[]]  # the samples each optimizer step ran, on this rank

    def loss_fn(model: nn.Module, batch: dict) -> torch.Tensor:
        if not traced(batch["idx"]):
            ran[-1].extend(batch["idx"].tolist())
        return ((model(batch["x"]).float() - batch["y"]) ** 2).mean()

    est = Estimate(peak_bytes=4 << 20, breakdown={"params": 1 << 20, "activations": 3 << 20}, context_bytes=0,
                   peak_phase="backward", allocated_peak_bytes=4 << 20, device="cpu", precision="32-true",
                   zero_stage=3, world_size=world, gpu=None, micro_batch_size=micro)
    plan = Plan(micro_batch_size=micro, grad_accum_steps=accum, world_size=world, global_batch_size=global_batch,
                precision="32-true", activation_checkpointing=False, zero_stage=3, strategy="fsdp2",
                block_class="Linear", budget_bytes=1 << 30, estimate=est, device="cpu", layout=layout)
    result: dict = {"error": None, "rank": rank}
    try:
        kwargs = accelerator_kwargs(plan)
        pc = kwargs["parallelism_config"]
        result["config"] = [pc.dp_replicate_size, pc.dp_shard_size, pc.tp_size, pc.cp_size, pc.sp_size]
        try:  # as it comes, Accelerate refuses it on CPU processes (see the module docstring)
            Accelerator(**kwargs)
        except ValueError as exc:
            result["unpatched"] = str(exc)
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state()  # (the process group and PartialState stay)
        with parallelism_on_cpu(kwargs["fsdp_plugin"]):
            accelerator = Accelerator(**kwargs)
        mesh = accelerator.torch_device_mesh
        result.update(distributed_type=str(accelerator.distributed_type.value), is_fsdp2=accelerator.is_fsdp2,
                      mesh=[list(mesh.mesh_dim_names), list(mesh.shape)], num_processes=accelerator.num_processes)
        model = initial
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        model, optimizer = prepare(accelerator, model, optimizer, plan=plan, loss_fn=loss_fn, verbose=False)
        shard_meshes = {(tuple(p.device_mesh.mesh_dim_names), tuple(p.device_mesh.shape))
                        for p in model.parameters() if hasattr(p, "device_mesh")}
        result["param_meshes"] = [[list(n), list(s)] for n, s in sorted(shard_meshes)]
        loader = accelerator.prepare(DataLoader(data, batch_size=micro, shuffle=False))
        losses = []
        for batch in loader:
            losses.append(step(accelerator, model, optimizer, batch))
            if accelerator.sync_gradients:
                ran.append([])
        result.update(losses=losses, steps=status(model).steps, ran=[r for r in ran if r])
        state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v)  # a collective every rank joins
                 for k, v in accelerator.unwrap_model(model).state_dict().items()}
        torch.save(state, out / f"weights{rank}.pt")
    except Exception as exc:  # reported to the test
        result["error"] = {"type": type(exc).__name__, "message": str(exc),
                           "where": traceback.format_tb(exc.__traceback__)[-4:]}
    (out / f"result{rank}.json").write_text(json.dumps(result))
    # Leave without interpreter teardown: with gloo, destroying the process group while a gloo worker thread
    # still releases a finished work's tensors can deadlock at exit (tests/guard/oom_worker.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
