"""One rank of a recovery benchmark case, for ``benchmarks/recovery_sharded.py``; started by ``torchrun``.

Run as ``python -m torch.distributed.run --nproc_per_node 2 benchmarks/recovery_worker.py '<json config>'``
(``DS_ACCELERATOR=cpu`` for the DeepSpeed cases, ``MALLOC_ARENA_MAX=1`` and ``MALLOC_MMAP_THRESHOLD_=65536``
as in the integration tests, so that ``RLIMIT_AS`` tracks live memory). Every case trains the same job:
``tests/integrations/worker_common.py``'s ``Net`` (about 1 MiB of activations per sample at ``seq=64``)
on ``steps`` optimizer steps of ``batch`` samples per rank, in micro-batches of ``micro``, plain SGD.
At the start of step ``cap_step`` the ranks in ``cap_ranks`` cap their address space at VmSize +
``budget_mib`` (20 MiB: a backward of 32 samples does not fit, 16 does).

``guarded`` true: the loop memguard documents for the case (``memguard.step``, the Accelerate adapter's
``step``, or ``memguard.integrations.deepspeed.step``). ``guarded`` false: the same job, the same cap, and the
framework's own loop without memguard (``loss.backward()``/``accelerator.backward``/``engine.backward``): what
the framework does alone. Then an exception is recorded and raised again, so the process ends as the
framework would end it.

Cases (``case``):

* ``ddp``: ``DistributedDataParallel`` (gloo), ``no_sync`` on all but the last micro-batch;
* ``fsdp2``: ``fully_shard`` of each ``Linear`` and of the root (parameters resharded after forward),
  passed to ``memguard.prepare(..., strategy="fsdp2")``;
* ``accelerate-ddp`` / ``accelerate-fsdp1`` / ``accelerate-fsdp2``: an ``accelerate.Accelerator`` with
  ``gradient_accumulation_steps = batch / micro``, a dataloader of ``micro``-sample batches, and
  Accelerate's FSDP1 plugin (``FULL_SHARD``, ``use_orig_params=True``, each ``Linear`` wrapped) or FSDP2
  plugin (``accelerator_kwargs`` of an FSDP2 plan: each ``Linear`` and the root, ``sync_each_batch``),
  forced onto FSDP on CPU as ``tests/integrations/accelerate_worker.py`` does;
* ``lightning-fsdp2``: a Lightning ``Trainer`` with ``ModelParallelStrategy`` (data-parallel 2; ``fully_shard``
  of each ``Linear`` and of the module in ``configure_model``, as tests/integrations/lightning_worker.py),
  ``accumulate_grad_batches = batch / micro``, each rank's samples in order (``use_distributed_sampler=False``),
  and :class:`memguard.integrations.lightning.MemguardCallback` with the plan of that job;
* ``deepspeed``: a ZeRO stage ``stage`` engine (``managed`` false: ``managed_gradient_accumulation: false``,
  one ``engine.step()`` per optimizer step), the config of ``tests/integrations/deepspeed_worker.py``
  (only the plain-loop baseline runs here; the guarded ZeRO rows run that worker).

Each rank writes ``result<rank>.json``: events (``["BATCH", idx]`` per delivered batch, each micro-batch's
sample indices, ``"RETRY"``, ``"STEP"``), step times (``perf_counter``), retry times, the error, and wall
clock times (``time.time()``) of the cap and of the error, for the parent's time to failure.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import resource
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

_REPO = Path(__file__).resolve().parent.parent
for _p in (str(_REPO), str(_REPO / "tests" / "integrations")):
    if _p not in sys.path:
        sys.path.insert(0, _p)
from worker_common import LR, MOMENTUM, Net, Samples, vm_size  # noqa: E402

CASES = ("ddp", "fsdp2", "accelerate-ddp", "accelerate-fsdp1", "accelerate-fsdp2", "lightning-fsdp2", "deepspeed")


def mse(pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((pred.float() - y) ** 2).mean()


def hand_plan(cfg: dict, world: int, strategy: str, stage: int):
    """A plan of ``micro x (batch / micro)`` per rank, as the planner would return it (the planner is not what is
    measured; tests/integrations/accelerate_worker.py builds the same)."""
    from memguard import Estimate, Plan

    micro, accum = cfg["micro"], cfg["batch"] // cfg["micro"]
    est = Estimate(peak_bytes=4 << 20, breakdown={"params": 1 << 20, "activations": 3 << 20}, context_bytes=0,
                   peak_phase="backward", allocated_peak_bytes=4 << 20, device="cpu", precision="32-true",
                   zero_stage=stage, world_size=world, gpu=None, micro_batch_size=micro)
    return Plan(micro_batch_size=micro, grad_accum_steps=accum, world_size=world,
                global_batch_size=micro * accum * world, precision="32-true", activation_checkpointing=False,
                zero_stage=stage, strategy=strategy, block_class="Linear" if strategy == "fsdp2" else None,
                budget_bytes=1 << 30, estimate=est, device="cpu")


def main() -> None:
    cfg = json.loads(sys.argv[1])
    case, guarded = cfg["case"], bool(cfg["guarded"])
    if case not in CASES:
        raise SystemExit(f"unknown case {case!r}; one of {', '.join(CASES)}")
    out = Path(cfg["out"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    # oneDNN reports a failed allocation as "could not create a primitive" (tests/guard/fsdp2_worker.py);
    # the native CPU kernels fail in the allocator with its own message, which every path recognises
    torch.backends.mkldnn.enabled = False
    # a short process-group timeout: a rank left waiting in a collective fails after it instead of 30 min
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=cfg["pg_timeout_s"]))

    events: list = []
    messages: list[str] = []
    retry_times: list[float] = []

    class Recorder(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(f"{record.levelname}:{record.getMessage()}")
            if record.levelno == logging.WARNING and record.getMessage().startswith("out of memory"):
                events.append("RETRY")
                retry_times.append(time.perf_counter())

    logging.getLogger("memguard").addHandler(Recorder())
    logging.getLogger("memguard").setLevel(logging.INFO)

    torch.manual_seed(0)
    model = Net()
    b, micro, steps = cfg["batch"], cfg["micro"], cfg["steps"]
    data = Samples(steps * b * world, cfg["seq"])

    def indices(s: int) -> list[int]:  # this rank's samples of step s (the sampler's order under Accelerate)
        if case.startswith("accelerate"):  # the dataloader's micro-batches go to the ranks in turn
            per = b // micro
            return [i for k in range(per) for i in range(((s * per + k) * world + rank) * micro,
                                                         ((s * per + k) * world + rank + 1) * micro)]
        start = (s * world + rank) * b
        return list(range(start, start + b))

    def loss_fn(m, mb: dict) -> torch.Tensor:
        events.append(mb["idx"].tolist())
        return mse(m(mb["x"]), mb["y"])

    def micro_batches(batch: dict, size: int):
        for i in range(0, len(batch["idx"]), size):
            yield {k: v[i:i + size] for k, v in batch.items()}

    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    accelerator = engine = None
    if case == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        if guarded:
            import memguard

            memguard.prepare(model, optimizer, micro_batch_size=micro, verbose=False)
    elif case == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                fully_shard(m, reshard_after_forward=True)
        fully_shard(model, reshard_after_forward=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        if guarded:
            import memguard

            memguard.prepare(model, optimizer, strategy="fsdp2", micro_batch_size=micro, verbose=False)
    elif case.startswith("accelerate"):
        from accelerate import Accelerator
        from accelerate_worker import force_fsdp_on_cpu  # tests/integrations: how the tests force FSDP on CPU

        from memguard.integrations.accelerate import accelerator_kwargs

        kind = case.split("-", 1)[1]
        kwargs = accelerator_kwargs(hand_plan(cfg, world, "fsdp2" if kind != "ddp" else "ddp",
                                              3 if kind != "ddp" else 0))
        if kind == "fsdp1":  # the plan run by FSDP1 as the tests run it (accelerate_worker.fsdp1_plugin)
            from accelerate.utils import FullyShardedDataParallelPlugin

            kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(
                fsdp_version=1, sharding_strategy="FULL_SHARD", use_orig_params=True,
                auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Linear"])
        accelerator = Accelerator(**kwargs)
        if kind != "ddp":
            force_fsdp_on_cpu(accelerator, kwargs["fsdp_plugin"])
        if guarded:
            from memguard.integrations.accelerate import prepare

            plan = hand_plan(cfg, world, "fsdp2" if kind != "ddp" else "ddp", 3 if kind != "ddp" else 0)
            model, optimizer = prepare(accelerator, model, optimizer, plan=plan, loss_fn=loss_fn, verbose=False)
        else:
            model, optimizer = accelerator.prepare(model, optimizer)
    elif case == "deepspeed":
        import deepspeed

        zero = {"stage": cfg["stage"], "reduce_bucket_size": 500_000}
        if cfg["stage"] == 3:  # tests/integrations/deepspeed_worker.py: gather every parameter
            zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=0)
        config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": b // micro,
                  "train_batch_size": b * world, "zero_optimization": zero, "zero_allow_untested_optimizer": True,
                  "gradient_clipping": 0.0}  # DeepSpeed clips at 1.0 when absent (runtime/constants.py)
        if not cfg.get("managed", True):  # step() is the accumulation boundary (DeepSpeed 0.19 engine.step)
            config["managed_gradient_accumulation"] = False
        deepspeed.init_distributed(dist_backend="gloo")  # the group above is taken as it is
        engine, *_ = deepspeed.initialize(model=model, config=config, optimizer=optimizer)
        if guarded:
            raise SystemExit("the guarded DeepSpeed rows run tests/integrations/deepspeed_worker.py")

    def plain_step(batch: dict) -> None:
        """One optimizer step the framework's way, without memguard."""
        parts = list(micro_batches(batch, micro))
        if case == "deepspeed":
            for mb in parts:
                engine.backward(loss_fn(engine, mb))
                if cfg.get("managed", True):
                    engine.step()  # steps the optimizer at the accumulation boundary
            if not cfg.get("managed", True):
                engine.step()  # unmanaged: the caller's step() ends the window
            return
        for k, mb in enumerate(parts):
            if accelerator is not None:
                with accelerator.accumulate(model):
                    accelerator.backward(loss_fn(model, mb))
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                continue
            last = k == len(parts) - 1
            ctx = model.no_sync() if case == "ddp" and not last else _nullcontext()
            with ctx:
                (loss_fn(model, mb) * (len(mb["idx"]) / len(batch["idx"]))).backward()
        if accelerator is None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    def guarded_step(batch: dict) -> None:
        if accelerator is not None:
            from memguard.integrations.accelerate import step

            for mb in micro_batches(batch, micro):  # one call per dataloader batch
                events.append(["BATCH", mb["idx"].tolist()])
                step(accelerator, model, optimizer, mb)
        else:
            import memguard

            memguard.step(model, optimizer, batch, loss_fn)

    result: dict = {"rank": rank, "case": case, "guarded": guarded, "error": None,
                    "order": [i for s in range(steps) for i in indices(s)]}
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    step_times: list[list[float]] = []
    dist.barrier()
    t0 = time.perf_counter()
    error: BaseException | None = None
    try:
        if case == "lightning-fsdp2":
            callback = fit_lightning(cfg, model, data, result, events, step_times, loss_fn, hard)
        for s in range(steps if case != "lightning-fsdp2" else 0):
            idx = torch.tensor(indices(s))
            batch = {"x": data.x[idx], "y": data.y[idx], "idx": idx}
            if accelerator is None or not guarded:
                events.append(["BATCH", idx.tolist()])
            if s == cfg["cap_step"] and rank in cfg["cap_ranks"]:
                resource.setrlimit(resource.RLIMIT_AS, (vm_size() + (cfg["budget_mib"] << 20), hard))
                result["capped_wall"] = time.time()
            started = time.perf_counter()
            (guarded_step if guarded else plain_step)(batch)
            step_times.append([started, time.perf_counter()])
            events.append("STEP")
    except BaseException as exc:  # recorded, then (baseline) raised again
        error = exc
        result["error"] = {"type": type(exc).__name__, "message": str(exc)[:2000],
                           "traceback": traceback.format_exc()[-3000:]}
        result["error_wall"] = time.time()
    result["train_s"] = time.perf_counter() - t0
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    result.update(events=events, messages=messages, retry_times=retry_times, step_times=step_times,
                  steps_done=len(step_times))
    if guarded and case == "lightning-fsdp2":
        result.update(micro_batch_size=callback.micro_batch_size, oom_retries=callback.oom_retries)
    elif guarded:
        if accelerator is not None:
            from memguard.integrations.accelerate import status
        else:
            from memguard.guard import guard_status as status
        st = status(model)
        result.update(micro_batch_size=st.micro_batch_size, oom_retries=st.oom_retries)
    (out / f"result{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    if error is not None and not guarded:
        raise error  # the process ends as the framework's loop would end it
    # Leave without interpreter teardown: destroying a gloo group while its threads release work can
    # deadlock at exit (tests/guard/oom_worker.py).
    os._exit(0 if error is None else 1)


def fit_lightning(cfg: dict, net: torch.nn.Module, data, result: dict, events: list, step_times: list, loss_fn,
                  hard: int):
    """``Trainer.fit`` of the job under ``ModelParallelStrategy``; returns memguard's callback (None unguarded).
    ``step_times`` gets each optimizer step's [start of its first batch, end of the batch that stepped]."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, Subset

    rank, world = dist.get_rank(), dist.get_world_size()
    b, micro = cfg["batch"], cfg["micro"]
    order = result["order"]

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net
            # memguard's callback sets the dataloader's batch to the plan's micro-batch (and the accumulation)
            self.batch_size = b if cfg["guarded"] else micro

        def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            return loss_fn(self.net, batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(Subset(data, order), batch_size=self.batch_size, shuffle=False)

        def configure_model(self) -> None:  # tests/integrations/lightning_worker.py's sharding
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in (self.net.fc1, self.net.fc2):
                fully_shard(layer, mesh=mesh)
            fully_shard(self, mesh=mesh)

    open_step: list[float] = []

    class Record(pl.Callback):
        """What the loop delivers, each step's times, and the cap at the start of step ``cap_step``."""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            events.append(["BATCH", batch["idx"].tolist()])
            if not open_step:
                if len(step_times) == cfg["cap_step"] and rank in cfg["cap_ranks"]:
                    resource.setrlimit(resource.RLIMIT_AS, (vm_size() + (cfg["budget_mib"] << 20), hard))
                    result["capped_wall"] = time.time()
                open_step.append(time.perf_counter())

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            open_step.append(-1.0)  # this batch steps

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if open_step and open_step[-1] == -1.0:
                step_times.append([open_step[0], time.perf_counter()])
                open_step.clear()
                events.append("STEP")

    callbacks: list = [Record()]
    callback = None
    if cfg["guarded"]:
        from memguard.integrations.lightning import MemguardCallback

        callback = MemguardCallback(plan=hand_plan(cfg, world, "fsdp2", 3))
        callbacks.insert(0, callback)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, num_nodes=1,
        strategy=pl.strategies.ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1,
                                                     timeout=datetime.timedelta(seconds=cfg["pg_timeout_s"])),
        max_steps=cfg["steps"], accumulate_grad_batches=1 if cfg["guarded"] else b // micro,
        use_distributed_sampler=False, callbacks=callbacks, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(Lit())
    return callback


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    main()
