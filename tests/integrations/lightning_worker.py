"""A Lightning ``Trainer.fit`` that really runs out of memory, for test_lightning.py.

Run as ``python lightning_worker.py '<json config>'``. The process first trains a plain PyTorch
reference on the full global batch (no Lightning, no memguard, no memory cap), then fits the same
initial weights with Lightning and :class:`MemguardCallback`. A test callback caps the address
space with ``RLIMIT_AS`` (current VmSize plus ``budget_mib``) at the start of batch ``cap_batch``
(after at least one full optimizer step, so that every lazy initialisation has happened), so a
micro-batch that does not fit fails with the CPU allocator's real error. Under ``strategy="ddp"``
Lightning starts rank 1 by running this script again; only the ranks in ``cap_ranks`` are capped.

Config keys: ``out`` (folder), ``world`` (1, or 2 for DDP), ``batch`` (the module's batch size per
rank before memguard), ``steps`` (optimizer steps), ``seq`` (positions per sample, which sets the
activation memory per sample: about 1 MiB at 64 in fp32, as in tests/guard/oom_worker.py),
``budget_mib``, ``cap_batch``, ``cap_ranks``, ``plan``: ``"planner"`` (memguard plans with a
``plan_budget_mib`` budget, default 1 GiB, which picks the whole batch) or ``[micro, accumulation]``
for a hand-made plan,
``package``: ``"lightning.pytorch"`` or ``"pytorch_lightning"`` (default), whose Trainer runs,
``strategy``: ``"ddp"`` (default), ``"model_parallel"`` (``ModelParallelStrategy`` over ``world``
data-parallel ranks, ``fully_shard`` of each linear layer and the root in ``configure_model``) or
``"fsdp"`` (``FSDPStrategy``, FSDP1: each linear layer and the LightningModule wrapped, ``FULL_SHARD``, or
``sharding_strategy`` from the config) or
``"deepspeed"`` (``DeepSpeedStrategy`` with ZeRO stage ``zero_stage``, optimizer offload to the host if
``offload``, on CPU: see :class:`CPUDeepSpeed`; run with ``DS_ACCELERATOR=cpu``).

With ``eval`` (a number of validation samples per rank), the module also has a ``val_dataloader`` and a
``test_dataloader`` (batches of ``val_batch``, each rank's share from Lightning's ``DistributedSampler``) whose
steps log ``val_loss``/``test_loss``; ``fit`` validates once, after its last step (``val_check_interval``), then
``trainer.validate`` and ``trainer.test`` run. On the ranks in ``eval_cap_ranks`` each of those three
evaluations caps the address space at its first batch (VmSize plus ``eval_budget_mib``) and lifts the cap at
its end; the epoch metrics of each evaluation are recorded (``metrics``), and each evaluation micro-batch's size
(``["VAL", n]`` events).

With ``plain_accumulate`` (k), no MemguardCallback runs: the module's batch size is ``batch // k`` and the
Trainer's ``accumulate_grad_batches`` k, i.e. plain Lightning on the same samples per optimizer step.

Each rank writes ``result<rank>.json`` (events, messages, callback state, error) and its final
weights ``lightning<rank>.pt``; rank 0 also writes ``reference.pt``.
"""

from __future__ import annotations

import copy
import datetime
import json
import logging
import os
import resource
import sys
import traceback
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from worker_common import LR, MOMENTUM, Net, Samples, traced, vm_size  # noqa: E402 - this folder is on sys.path


def mse(pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((pred.float() - y) ** 2).mean()


def rank_order(data: Samples, cfg: dict) -> list[list[int]]:
    """The sample order of each rank. Under DDP Lightning gives every train dataloader a
    ``DistributedSampler`` with ``shuffle=True`` and seed 0 (trainer/connectors/data_connector.py,
    _process_dataloader); on one process the DataLoader's own sequential order."""
    if cfg["world"] == 1:
        return [list(range(len(data)))]
    return [list(DistributedSampler(data, num_replicas=cfg["world"], rank=r, shuffle=True, seed=0))
            for r in range(cfg["world"])]


def reference(net: nn.Module, data: Samples, cfg: dict) -> nn.Module:
    """Plain PyTorch on the full global batch of each step: what the Lightning run must reproduce."""
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    orders, b = rank_order(data, cfg), cfg["batch"]
    for s in range(cfg["steps"]):
        idx = torch.tensor([i for order in orders for i in order[s * b:(s + 1) * b]])
        mse(net(data.x[idx]), data.y[idx]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return net


def main() -> None:
    cfg = json.loads(sys.argv[1])
    out = Path(cfg["out"])
    torch.set_num_threads(1)
    import importlib

    pl = importlib.import_module(cfg.get("package", "pytorch_lightning"))

    from memguard import Estimate, Plan
    from memguard.integrations.lightning import MemguardCallback

    rank = int(os.environ.get("LOCAL_RANK", "0"))
    events: list = []
    messages: list[str] = []

    class Recorder(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(f"{record.levelname}:{record.getMessage()}")
            if record.levelno >= logging.WARNING:
                events.append("RETRY")

    logging.getLogger("memguard").addHandler(Recorder())
    logging.getLogger("memguard").setLevel(logging.INFO)

    torch.manual_seed(0)
    initial = Net()
    data = Samples(cfg["steps"] * cfg["batch"] * cfg["world"], cfg["seq"])
    val_data = Samples(cfg.get("eval", 0) * cfg["world"], cfg["seq"])
    if rank == 0:
        torch.save(reference(copy.deepcopy(initial), data, cfg).state_dict(), out / "reference.pt")

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = copy.deepcopy(initial)
            self.batch_size = cfg["batch"]

        def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            if not traced(batch["idx"]):  # the planner traces this on fake tensors: skip those
                events.append(batch["idx"].tolist())  # the samples of this micro-batch
            return mse(self.net(batch["x"]), batch["y"])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(data, batch_size=self.batch_size, shuffle=False)

        def configure_model(self) -> None:
            if cfg.get("strategy") == "model_parallel":
                from torch.distributed.fsdp import FSDPModule, fully_shard

                if isinstance(self, FSDPModule):  # validate()/test() after fit() call this again
                    return

                mesh = self.device_mesh["data_parallel"]
                for layer in (self.net.fc1, self.net.fc2):
                    fully_shard(layer, mesh=mesh)
                fully_shard(self, mesh=mesh)

    class LitEval(Lit):
        """``Lit`` with validation and test steps and dataloaders (``eval`` in the config)."""

        def validation_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            return self._eval_step(batch, "val_loss")

        def test_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            return self._eval_step(batch, "test_loss")

        def _eval_step(self, batch: dict, name: str) -> torch.Tensor:
            loss = mse(self.net(batch["x"]), batch["y"])
            events.append(["VAL", len(batch["y"])])
            self.log(name, loss)
            return loss

        def val_dataloader(self) -> DataLoader:
            return DataLoader(val_data, batch_size=cfg["val_batch"], shuffle=False)

        def test_dataloader(self) -> DataLoader:
            return DataLoader(val_data, batch_size=cfg["val_batch"], shuffle=False)

    result: dict = {"rank": rank, "error": None, "order": rank_order(data, cfg)[rank]}
    deepspeed_run = cfg.get("strategy") == "deepspeed"
    fsdp1_run = cfg.get("strategy") == "fsdp"

    class CPUDeepSpeed(pl.strategies.DeepSpeedStrategy):
        """``DeepSpeedStrategy`` on CPU ranks: Lightning 2.6's ``DeepSpeedStrategy.setup_environment``
        (``strategies/deepspeed.py``) refuses any accelerator but CUDA, while DeepSpeed itself runs on CPU
        with ``DS_ACCELERATOR=cpu`` and gloo; and ``DeepSpeedStrategy.setup_distributed`` checks CUDA device
        indices (``_validate_device_index_selection``), which CPU devices lack, and passes
        ``root_device.index`` to ``deepspeed.initialize`` as ``device_rank``, which DeepSpeed compares with 0
        (``DeepSpeedEngine._set_distributed_vars``). Only those checks are met: the rest is Lightning's
        (``DDPStrategy.setup_environment``; ``setup_distributed`` without the check and without
        ``reset_seed``, a no-op when no ``PL_GLOBAL_SEED`` is set, as here; the root device ``cpu:<local
        rank>``, which torch treats as ``cpu``)."""

        @property
        def root_device(self) -> torch.device:
            return torch.device("cpu", self.local_rank)

        def setup_environment(self) -> None:
            pl.strategies.DDPStrategy.setup_environment(self)

        def setup_distributed(self) -> None:
            self.set_world_ranks()
            self._init_deepspeed_distributed()

    class Cap(pl.Callback):
        """Cap this rank's address space at the start of batch ``cap_batch``; record what the loop delivers."""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            events.append(["BATCH", batch["idx"].tolist()])
            if batch_idx == cfg["cap_batch"] and rank in cfg["cap_ranks"]:
                limit = vm_size() + (cfg["budget_mib"] << 20)
                resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
                result["capped"] = True

        def _cap_eval(self, batch_idx: int) -> None:
            if batch_idx == 0 and rank in cfg.get("eval_cap_ranks", []):
                limit = vm_size() + (cfg["eval_budget_mib"] << 20)
                resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
                result["eval_capped"] = result.get("eval_capped", 0) + 1

        def _lift(self) -> None:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))

        def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
            self._cap_eval(batch_idx)

        def on_test_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
            self._cap_eval(batch_idx)

        def on_validation_end(self, trainer, pl_module) -> None:
            self._lift()
            result.setdefault("metrics", []).append(float(trainer.callback_metrics["val_loss"]))

        def on_test_end(self, trainer, pl_module) -> None:
            self._lift()
            result.setdefault("metrics", []).append(float(trainer.callback_metrics["test_loss"]))

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            if not deepspeed_run:
                events.append("STEP")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            # Under DeepSpeedStrategy Lightning calls on_before_optimizer_step after every batch (the engine
            # accumulates): record a step when the engine's own optimizer-step counter advanced.
            if deepspeed_run and trainer.strategy.model.global_steps != result.get("engine_global_steps", 0):
                result["engine_global_steps"] = trainer.strategy.model.global_steps
                events.append("STEP")

    if cfg["plan"] == "planner":
        callback = MemguardCallback(budget_bytes=cfg.get("plan_budget_mib", 1024) << 20)
    else:
        micro, accum = cfg["plan"]
        local = micro * accum
        # under ModelParallelStrategy an FSDP2 plan (sharding level 3: fully_shard's reshard_after_forward default),
        # under DeepSpeedStrategy a plan of the config's ZeRO stage
        # (FSDPStrategy: FULL_SHARD is level 3, SHARD_GRAD_OP 2)
        stage = (3 if cfg.get("strategy") == "model_parallel" else cfg["zero_stage"] if deepspeed_run
                 else (2 if cfg.get("sharding_strategy") == "SHARD_GRAD_OP" else 3) if fsdp1_run else 0)
        planned_strategy = ("deepspeed" if deepspeed_run else "fsdp1" if fsdp1_run and stage else "fsdp2" if stage
                            else "ddp")
        est = Estimate(peak_bytes=4 << 20, breakdown={"params": 1 << 20, "activations": 3 << 20}, context_bytes=0,
                       peak_phase="backward", allocated_peak_bytes=4 << 20, device="cpu", precision="32-true",
                       zero_stage=stage, world_size=cfg["world"], gpu=None, micro_batch_size=micro)
        callback = MemguardCallback(plan=Plan(micro_batch_size=micro, grad_accum_steps=accum, world_size=cfg["world"],
                                              global_batch_size=local * cfg["world"], precision="32-true",
                                              activation_checkpointing=False, zero_stage=stage,
                                              strategy=planned_strategy, offload_optimizer=bool(cfg.get("offload")),
                                              budget_bytes=cfg["budget_mib"] << 20, estimate=est, device="cpu"))
    evaluates = bool(cfg.get("eval"))
    module = LitEval() if evaluates else Lit()
    plain_k = cfg.get("plain_accumulate")
    if plain_k:  # plain Lightning: no memguard, the same samples per optimizer step
        module.batch_size = cfg["batch"] // plain_k
    if cfg.get("strategy") == "model_parallel":
        strategy = pl.strategies.ModelParallelStrategy(data_parallel_size=cfg["world"], tensor_parallel_size=1)
    elif fsdp1_run:
        class CPUFSDP(pl.strategies.FSDPStrategy):
            """``FSDPStrategy`` on CPU ranks: Lightning 2.6 refuses ``accelerator="cpu"`` for the class itself only
            (``_AcceleratorConnector._check_strategy_and_fallback``, ``type(strategy) is FSDPStrategy``), and its
            ``_setup_model`` passes ``device_id=root_device.index`` (None on CPU), with which FSDP1 looks for an
            accelerator and refuses the host (``_init_device_handle``, torch/distributed/fsdp/_init_utils.py),
            while FSDP1 runs on CPU with gloo given ``device_id=cpu``. So the root is wrapped here as Lightning
            wraps it (the same arguments, but that ``device_id``), and Lightning's ``_setup_model`` does the rest
            (it wraps nothing more once a module is FSDP1, and drops the auto-wrap policy it already applied)."""

            def _setup_model(self, model: nn.Module) -> nn.Module:
                from torch.distributed.fsdp import FullyShardedDataParallel

                wrapped = FullyShardedDataParallel(
                    module=model, cpu_offload=self.cpu_offload, mixed_precision=self.mixed_precision_config,
                    sharding_strategy=self.sharding_strategy, device_id=torch.device("cpu"), **self.kwargs)
                return super()._setup_model(wrapped)

        strategy = CPUFSDP(auto_wrap_policy={nn.Linear},
                                              sharding_strategy=cfg.get("sharding_strategy", "FULL_SHARD"),
                                              process_group_backend="gloo", timeout=datetime.timedelta(seconds=90))
    elif deepspeed_run:
        # small gradient buckets, so that ZeRO-2 reduces from its hooks inside the backward; under ZeRO-3 every
        # parameter is gathered (DeepSpeed keeps parameters under 1e5 elements whole by default)
        zero = {"stage": cfg["zero_stage"], "reduce_bucket_size": 500_000}
        if cfg.get("offload"):  # ZeRO-Offload of the optimizer: planned, but not something memguard can reset
            zero["offload_optimizer"] = {"device": "cpu"}
        ds_config = {"zero_optimization": zero, "zero_allow_untested_optimizer": True}
        if cfg.get("offload"):  # the module's torch SGD instead of DeepSpeedCPUAdam (a compiled op)
            ds_config["zero_force_ds_cpu_optimizer"] = False
        if cfg["zero_stage"] == 3:
            zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=0)
        # a short process-group timeout: a rank left waiting in a collective fails instead of hanging
        strategy = CPUDeepSpeed(config=ds_config,
                                process_group_backend="gloo", timeout=datetime.timedelta(seconds=90))
    else:
        strategy = "ddp" if cfg["world"] > 1 else "auto"
    trainer = pl.Trainer(
        accelerator="cpu", devices=cfg["world"], strategy=strategy,
        max_steps=cfg["steps"], callbacks=[Cap()] if plain_k else [callback, Cap()], logger=False,
        enable_checkpointing=False, accumulate_grad_batches=plain_k or 1,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        **({"val_check_interval": cfg["steps"], "check_val_every_n_epoch": None} if evaluates else {}),
    )
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    try:
        trainer.fit(module)
        if evaluates:
            trainer.validate(module, verbose=False)
            trainer.test(module, verbose=False)
    except Exception as exc:  # reported to the test, which decides whether it was expected
        result["error"] = {"type": type(exc).__name__, "message": str(exc),
                           "traceback": traceback.format_exc()[-4000:]}
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    rg = callback._guard.rank_group if callback._guard is not None else None
    result["agreements"] = getattr(rg, "agreements", None)  # FSDP2's agreements, for their cost
    result.update(events=events, messages=messages, micro_batch_size=callback.micro_batch_size,
                  oom_retries=callback.oom_retries,
                  plan=[callback.plan.micro_batch_size, callback.plan.grad_accum_steps] if callback.plan else None,
                  restored_batch_size=module.batch_size, restored_accumulate=trainer.accumulate_grad_batches,
                  patched_left=sorted(k for k in ("training_step", "optimizer_zero_grad") if k in module.__dict__))
    # the callback's stand-ins on the strategy and its precision plugin (DeepSpeed) are gone too
    result["strategy_patched_left"] = sorted(
        [k for k in ("training_step",) if k in trainer.strategy.__dict__]
        + [k for k in ("backward", "optimizer_step") if k in trainer.strategy.precision_plugin.__dict__])
    if deepspeed_run and cfg["zero_stage"] == 3:  # ZeRO-3 keeps partitions: gather them (every rank joins)
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.net.parameters())):
            state = {k: v.detach().clone() for k, v in module.net.state_dict().items()}
    elif fsdp1_run:  # FSDP1 holds flat shards: gather the full parameters (every rank joins)
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(trainer.strategy.model):
            state = {k.replace("_fsdp_wrapped_module.", ""): v.detach().clone()
                     for k, v in module.net.named_parameters()}
    else:  # FSDP2 holds DTensor shards: gather the full weights (a collective every rank joins here)
        state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in module.net.state_dict().items()}
    torch.save(state, out / f"lightning{rank}.pt")
    (out / f"result{rank}.json").write_text(json.dumps(result))
    launcher = getattr(trainer.strategy, "launcher", None)
    for proc in getattr(launcher, "procs", []):  # rank 0 waits for the ranks Lightning started
        proc.wait(timeout=300)
    # Leave without interpreter teardown: with gloo, destroying the process group while a gloo worker
    # thread still releases a finished work's tensors can deadlock at exit (tests/guard/oom_worker.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
