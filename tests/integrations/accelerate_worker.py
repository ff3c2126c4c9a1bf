"""An Accelerate training loop that really runs out of memory, for test_accelerate.py.

Run as ``python accelerate_worker.py '<json config>'``. The process trains a plain PyTorch
reference on the full global batch first (no Accelerate, no memguard, no memory cap), then the
same initial weights with ``accelerate.Accelerator`` on CPU and memguard's ``prepare``/``step``,
one call per dataloader batch. At the start of batch ``cap_batch`` (after at least one optimizer
step, so every lazy initialisation has happened) the address space is capped with ``RLIMIT_AS``
at the current VmSize plus ``budget_mib``, so a micro-batch that does not fit fails with the CPU
allocator's real error. The model is tests/guard/oom_worker.py's (about 1 MiB of activations per
sample at ``seq=64`` in fp32).

Config keys: ``out``, ``batch`` (dataloader batch), ``steps`` (optimizer steps), ``seq``,
``budget_mib``, ``cap_batch``, ``cap_ranks``, and ``plan``: ``"planner"`` (memguard plans on the
first step with a 1 GiB budget; the Accelerator accumulates ``accumulate`` batches) or
``[micro, accumulation]`` for a hand-made plan, with the Accelerator built by ``accelerator_kwargs``.
Started by ``torchrun`` on several processes, the Accelerator runs DDP (``MULTI_CPU``) and each
rank gets every ``world``-th batch of the dataloader (Accelerate's default batch sharding), so one
optimizer step covers ``batch x accumulation x world`` consecutive samples.
``batch_s`` in the result is each batch's wall time; ``skip_agreements`` (only without a cap) runs FSDP's
collectives without memguard's agreements before them, to measure what those cost.
With ``fsdp1``, the same with FSDP1 (``fsdp_version=1``, ``FULL_SHARD``, each ``Linear`` wrapped).
With ``fsdp2``, the Accelerator shards the model with FSDP2 (``FullyShardedDataParallelPlugin(fsdp_version=2)``,
``fully_shard`` of each ``Linear`` and of the root, parameters resharded after forward): the planner path
builds the plugin itself, a hand-made plan is an FSDP2 plan of sharding level 3 whose
``accelerator_kwargs`` builds it.
With ``deepspeed`` (a ZeRO stage) and a hand-made plan, the Accelerator runs Accelerate's DeepSpeed plugin
(``accelerator_kwargs`` of a DeepSpeed plan, its config without clipping and with small buckets); Accelerate
builds the engine in ``accelerator.prepare`` (run with ``DS_ACCELERATOR=cpu``).
With ``eval_factor``, after training (the cap still in force on the capped ranks) each rank evaluates
one validation batch of ``eval_factor x batch`` samples of its own with
:func:`memguard.integrations.accelerate.evaluate` and gathers the predictions with
``accelerator.gather_for_metrics``; the unsplit predictions of the same weights are computed after
the cap is lifted, for the test to compare. Under ``fsdp2``, ``fsdp1`` and ZeRO-3 that is the sharded model's
forward on every rank (each rank evaluates at once, and the ranks split together).
Each rank writes ``result<rank>.json`` (events, messages, error) and its weights
``accelerate<rank>.pt``; rank 0 also writes ``reference.pt``.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import resource
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

from worker_common import LR, MOMENTUM, Net, Samples, traced, vm_size  # noqa: E402 - this folder is on sys.path


def force_fsdp_on_cpu(accelerator, plugin) -> None:
    """Make a CPU Accelerator run its FSDP plugin. Accelerate 1.15 turns an ``fsdp_plugin`` into
    ``DistributedType.FSDP`` only for the accelerator types of GPUs and other devices, not MULTI_CPU
    (``AcceleratorState.__init__``, accelerate/state.py), so a CPU Accelerator ignores it; set what that
    branch sets (the distributed type and the plugin) so that ``accelerator.prepare`` shards the model with
    ``fsdp2_prepare_model`` and ``no_sync``/``backward`` take their FSDP2 paths, as on GPUs."""
    from accelerate.utils import DistributedType

    from accelerate.state import PartialState

    state = accelerator.state
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    # AcceleratorState() copies PartialState's fields into itself whenever it is built again (state.py,
    # AcceleratorState.__init__), as Accelerate's utilities do: set it there too
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    if plugin.fsdp_version == 1:
        # FSDP1 checks its device_id (Accelerate passes accelerator.device, accelerator.py _prepare_fsdp1 path) against
        # the parameters' device; on CPU PartialState.set_device makes it "cpu:0" (torch.cpu.device_count() is 1) while
        # the parameters are on "cpu", which FSDP1's _get_compute_device refuses as inconsistent
        for shared in (state._shared_state, PartialState._shared_state):
            shared["device"] = torch.device("cpu")


def force_deepspeed_ranks_on_cpu(accelerator) -> None:
    """Give a CPU Accelerator under DeepSpeed the ranks DeepSpeed runs on. Accelerate 1.15 on a host without GPUs
    picks no backend for a launch without ``cpu=True`` (``PartialState._prepare_backend``, accelerate/state.py),
    so it counts one process of index 0 although its DeepSpeed branch initialised ``torch.distributed`` on every
    rank (``deepspeed.comm.init_distributed``, which picks gloo under ``DS_ACCELERATOR=cpu``); with ``cpu=True``
    it ignores the DeepSpeed plugin. Set what ``PartialState.__init__`` sets from ``torch.distributed`` when it
    has a backend, so that the dataloader is sharded by rank as on GPUs."""
    import torch.distributed as dist

    from accelerate.state import PartialState

    assert dist.is_initialized(), "DeepSpeed's init_distributed did not run"
    fields = {"num_processes": dist.get_world_size(), "process_index": dist.get_rank(),
              "local_process_index": int(os.environ.get("LOCAL_RANK", dist.get_rank())), "backend": "gloo"}
    for shared in (accelerator.state._shared_state, PartialState._shared_state):
        shared.update(fields)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    out = Path(cfg["out"])
    torch.set_num_threads(1)
    from accelerate import Accelerator

    from memguard import Estimate, Plan
    from memguard.guard._evaluate import eval_status
    from memguard.integrations.accelerate import accelerator_kwargs, evaluate, prepare, status, step

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    events: list = []
    messages: list[str] = []

    class Recorder(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(f"{record.levelname}:{record.getMessage()}")
            if record.levelno >= logging.WARNING and record.getMessage().startswith("out of memory"):
                events.append("RETRY")

    logging.getLogger("memguard").addHandler(Recorder())
    logging.getLogger("memguard").setLevel(logging.INFO)

    torch.manual_seed(0)
    initial = Net()
    if cfg["plan"] == "planner":
        accumulate = cfg["accumulate"]
    else:
        accumulate = cfg["plan"][1]
    global_batch = cfg["batch"] * accumulate * world
    data = Samples(cfg["steps"] * global_batch, cfg["seq"])

    # the reference: plain PyTorch, one optimizer step per global batch
    ref = copy.deepcopy(initial)
    opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=MOMENTUM)
    for s in range(cfg["steps"]):
        sl = slice(s * global_batch, (s + 1) * global_batch)
        ((ref(data.x[sl]) - data.y[sl]) ** 2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if rank == 0:
        torch.save(ref.state_dict(), out / "reference.pt")

    def loss_fn(model: nn.Module, batch: dict) -> torch.Tensor:
        if not traced(batch["idx"]):  # the planner traces this on fake tensors: skip those
            events.append(batch["idx"].tolist())
        return ((model(batch["x"]).float() - batch["y"]) ** 2).mean()

    model = initial
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    fsdp1 = bool(cfg.get("fsdp1"))
    fsdp2 = bool(cfg.get("fsdp2")) or fsdp1  # (fsdp2: "sharded" below)
    ds_stage = cfg.get("deepspeed")  # a ZeRO stage, or None

    def fsdp1_plugin():
        from accelerate.utils import FullyShardedDataParallelPlugin

        return FullyShardedDataParallelPlugin(fsdp_version=1, sharding_strategy="FULL_SHARD", use_orig_params=True,
                                              auto_wrap_policy="transformer_based_wrap",
                                              transformer_cls_names_to_wrap=["Linear"])

    plan = None
    if cfg["plan"] == "planner":
        kwargs: dict = {"cpu": True, "gradient_accumulation_steps": accumulate}
        if fsdp1:
            kwargs["fsdp_plugin"] = fsdp1_plugin()
        elif fsdp2:
            from accelerate.utils import FullyShardedDataParallelPlugin

            kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(
                fsdp_version=2, reshard_after_forward=True, auto_wrap_policy="transformer_based_wrap",
                transformer_cls_names_to_wrap=["Linear"])
    else:
        micro, accum = cfg["plan"]
        stage = 3 if fsdp2 else ds_stage if ds_stage is not None else 0
        strategy = "fsdp2" if fsdp2 else "deepspeed" if ds_stage is not None else "ddp"
        est = Estimate(peak_bytes=4 << 20, breakdown={"params": 1 << 20, "activations": 3 << 20}, context_bytes=0,
                       peak_phase="backward", allocated_peak_bytes=4 << 20, device="cpu", precision="32-true",
                       zero_stage=stage, world_size=world, gpu=None, micro_batch_size=micro)
        plan = Plan(micro_batch_size=micro, grad_accum_steps=accum, world_size=world,
                    global_batch_size=micro * accum * world,
                    precision="32-true", activation_checkpointing=False, zero_stage=stage,
                    strategy=strategy, block_class="Linear" if fsdp2 else None,
                    budget_bytes=cfg["budget_mib"] << 20, estimate=est, device="cpu")
        kwargs = accelerator_kwargs(plan)
        if fsdp1:  # the same plan run by FSDP1 (FULL_SHARD: its sharding level 3)
            kwargs["fsdp_plugin"] = fsdp1_plugin()
        if ds_stage is not None:
            # accelerator_kwargs(plan)'s plugin, its config with what a comparison with plain SGD needs: no clipping
            # (DeepSpeed clips at 1.0 when the key is absent, runtime/constants.py), the torch optimizer allowed, and
            # small buckets (DeepSpeed's default 5e8-element bucket would not fit under the cap)
            from accelerate.utils import DeepSpeedPlugin

            from memguard.integrations.deepspeed import to_config

            zero = {"reduce_bucket_size": 500_000}
            if ds_stage == 3:  # gather every parameter (DeepSpeed keeps parameters under 1e5 elements whole)
                zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=0)
            config = to_config(plan, gradient_clipping=0.0, zero_allow_untested_optimizer=True, zero_optimization=zero)
            assert kwargs["deepspeed_plugin"].zero_stage == ds_stage and "cpu" not in kwargs
            kwargs["deepspeed_plugin"] = DeepSpeedPlugin(hf_ds_config=config)
    accelerator = Accelerator(**kwargs)
    if fsdp2:
        force_fsdp_on_cpu(accelerator, kwargs["fsdp_plugin"])
    if ds_stage is not None:
        force_deepspeed_ranks_on_cpu(accelerator)
    if plan is None:
        # under FSDP2 memguard plans before accelerator.prepare shards the model: from an example batch
        example = {k: v[: cfg["batch"]] for k, v in {"x": data.x, "y": data.y, "idx": torch.arange(len(data))}.items()}
        model, optimizer = prepare(accelerator, model, optimizer, loss_fn=loss_fn, budget_bytes=1 << 30,
                                   example_batch=example if fsdp2 else None)
    else:
        model, optimizer = prepare(accelerator, model, optimizer, plan=plan, loss_fn=loss_fn)
    if cfg.get("skip_agreements"):
        # For measuring what the agreements cost (no cap: nothing can fail): FSDP's collectives then run without them
        from memguard.guard._sharded import ShardedRankGroup

        ShardedRankGroup._boundary = lambda self: None
    loader = accelerator.prepare(DataLoader(data, batch_size=cfg["batch"], shuffle=False))

    b = cfg["batch"]
    batches = [list(range(i, min(i + b, len(data)))) for i in range(0, len(data), b)]
    result: dict = {"error": None, "losses": [], "rank": rank,
                    "order": [i for batch in batches[rank::world] for i in batch]}
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    try:
        for i, batch in enumerate(loader):
            events.append(["BATCH", batch["idx"].tolist()])
            if i == cfg["cap_batch"] and rank in cfg.get("cap_ranks", [0]):
                resource.setrlimit(resource.RLIMIT_AS, (vm_size() + (cfg["budget_mib"] << 20), hard))
                result["capped"] = True
            started = time.perf_counter()
            result["losses"].append(step(accelerator, model, optimizer, batch))
            result.setdefault("batch_s", []).append(time.perf_counter() - started)
            if accelerator.sync_gradients:
                events.append("STEP")
        if cfg.get("eval_factor"):
            g = torch.Generator().manual_seed(100 + rank)
            val = {"x": torch.randn(cfg["eval_factor"] * b, cfg["seq"], 16, generator=g)}
            val["y"] = torch.randn(len(val["x"]), generator=g)
            train_micro = status(model).micro_batch_size
            def pred_and_loss(m: nn.Module, v: dict) -> dict:
                pred = m(v["x"])
                return {"pred": pred, "loss": ((pred - v["y"]) ** 2).mean()}

            got = evaluate(accelerator, model, val, pred_and_loss)
            gathered = accelerator.gather_for_metrics(got["pred"])
            inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
            result["eval"] = {"oom_retries": eval_status(inner).oom_retries,
                              "micro": list(eval_status(inner).micro_batch_size.values()),
                              "train_micro": [train_micro, status(model).micro_batch_size],
                              "gathered": len(gathered), "loss": float(got["loss"])}
    except Exception as exc:  # reported to the test, which decides whether it was expected
        result["error"] = {"type": type(exc).__name__, "message": str(exc)}
        tb = exc.__traceback__
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    if result["error"] is not None:
        import traceback
        result["error"]["where"] = [f for f in traceback.format_tb(tb) if "frozen" not in f][-4:]
    from memguard.integrations.accelerate import status
    if "eval" in result:
        with torch.no_grad():
            # FSDP2's root and DDP's module run whole; FSDP1's wrapper and DeepSpeed's engine are called themselves
            # (every rank at once: their forwards all-gather), as unwrap_model's module holds only shards there
            inner = model if fsdp1 or ds_stage is not None else accelerator.unwrap_model(model)
            inner.eval()  # (DeepSpeedEngine.eval returns None, runtime/engine.py)
            whole = inner(val["x"])
            result["eval"]["pred_max_diff"] = float((whole - got["pred"]).abs().max())
            result["eval"]["ref_loss"] = float(((whole - val["y"]) ** 2).mean())

    st = status(model)
    result.update(events=events, messages=messages, micro_batch_size=st.micro_batch_size, oom_retries=st.oom_retries,
                  planned=st.planned_micro_batch_size, steps=st.steps)
    from memguard.guard._core import guard_of

    if ds_stage is not None:
        from memguard.integrations._deepspeed_guard import engine_rank_group

        result["agreements"] = engine_rank_group(model).agreements
    else:
        result["agreements"] = getattr(guard_of(model, "").rank_group, "agreements", None)  # FSDP2's, for their cost
    (out / f"result{rank}.json").write_text(json.dumps(result))  # in case gathering the weights below fails
    # FSDP2 holds DTensor shards: gather the full weights (a collective every rank joins here)
    if ds_stage is not None:  # the engine's module; ZeRO-3 keeps partitions: gather them (every rank joins)
        import deepspeed

        module = model.module
        with deepspeed.zero.GatheredParameters(list(module.parameters()), enabled=ds_stage == 3):
            state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    elif fsdp1:  # FSDP1's full state dict, on every rank (a collective every rank joins)
        from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel, StateDictType

        with FullyShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                                      FullStateDictConfig(rank0_only=False)):
            state = dict(model.state_dict())
    else:
        state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v)
                 for k, v in accelerator.unwrap_model(model).state_dict().items()}
    torch.save(state, out / f"accelerate{rank}.pt")
    (out / f"result{rank}.json").write_text(json.dumps(result))
    # Leave without interpreter teardown: with gloo, destroying the process group while a gloo worker
    # thread still releases a finished work's tensors can deadlock at exit (tests/guard/oom_worker.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
