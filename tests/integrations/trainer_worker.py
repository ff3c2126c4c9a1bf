"""An HF ``Trainer.train`` that really runs out of memory, for test_transformers.py.

Run as ``python trainer_worker.py '<json config>'`` (under DDP, once per rank with ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set: ``TrainingArguments``
then starts a gloo process group on CPU). Each process first trains a tiny GPT-2 (built from a
config, nothing downloaded) with a plain ``Trainer`` and no memory cap (the reference), then the
same initial weights with the same arguments and :class:`MemguardCallback`, given a plan that keeps
the arguments' batch and accumulation. A test callback caps the address space with ``RLIMIT_AS``
(current VmSize plus ``budget_mib``) at the start of optimizer step ``cap_step`` (after full steps,
so every lazy initialisation has happened) on the ranks in ``cap_ranks``, so a micro-batch that
does not fit fails with the CPU allocator's real error. The test sets ``MALLOC_ARENA_MAX=1`` and a
fixed ``MALLOC_MMAP_THRESHOLD_`` so that large tensors are mapped and unmapped one by one and
VmSize follows the live tensors (mallopt(3)).

Config keys: ``out`` (folder), ``batch`` (per-device batch), ``accum`` (gradient accumulation),
``steps``, ``seq``, ``vocab``, ``budget_mib``, ``cap_step``, ``cap_ranks``, ``plan``
(``"planner"``: memguard plans; otherwise a plan that keeps the arguments' batch), ``eval_oom``
(also run an evaluation whose forward always raises an out-of-memory error, to show that the
evaluation guard gives up with memguard's error and does not touch the training micro-batch), ``fsdp2``
(both Trainers shard the model with FSDP2 through Accelerate: ``fsdp="full_shard"``, each ``GPT2Block``
and the root ``fully_shard``-ed, see :func:`force_fsdp_on_cpu`), ``fsdp_version`` (1: FSDP1's
``FullyShardedDataParallel`` instead, each ``GPT2Block`` and the root wrapped), ``deepspeed`` (a ZeRO stage:
both Trainers run ``TrainingArguments(deepspeed=...)`` with that stage and the batch values ``"auto"``, on CPU
processes through :func:`deepspeed_backend_on_cpu`; run with ``DS_ACCELERATOR=cpu``).

Each rank writes ``result<rank>.json`` and its two sets of final weights.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
from pathlib import Path

import torch

from worker_common import vm_size  # noqa: E402 - this folder is on sys.path


def force_fsdp_on_cpu(trainer) -> None:
    """Make a CPU Trainer run its FSDP arguments. Accelerate 1.15 turns an ``fsdp_plugin`` into
    ``DistributedType.FSDP`` only for the accelerator types of GPUs and other devices, not MULTI_CPU
    (``AcceleratorState.__init__``, accelerate/state.py), so the Trainer's Accelerator drops the plugin its
    ``fsdp`` arguments built (trainer.py, ``create_accelerator_and_postprocess``); set what that branch sets,
    and the Trainer's flag read from it, so that ``train()`` shards the model with ``fsdp2_prepare_model``
    and takes its FSDP paths, as on GPUs. The state is process-wide: later Trainers see it too."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    from accelerate.state import PartialState

    state = trainer.accelerator.state
    if state.distributed_type != DistributedType.FSDP:
        state.distributed_type = DistributedType.FSDP
        state.fsdp_plugin = FullyShardedDataParallelPlugin(**trainer.args.fsdp_plugin_args)
        # AcceleratorState() copies PartialState's fields into itself whenever it is built again (state.py,
        # AcceleratorState.__init__), as Accelerate's utilities do during training: set it there too
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        if state.fsdp_plugin.fsdp_version == 1:
            # FSDP1 checks its device_id (Accelerate passes accelerator.device) against the parameters' device; on CPU
            # PartialState.set_device makes it "cpu:0" (torch.cpu.device_count() is 1) while the parameters are on
            # "cpu", which FSDP1's _get_compute_device refuses as inconsistent
            for shared in (state._shared_state, PartialState._shared_state):
                shared["device"] = torch.device("cpu")
    trainer.is_fsdp_enabled = True


def deepspeed_backend_on_cpu() -> None:
    """Let Accelerate start DeepSpeed on CPU processes. Accelerate 1.15 picks a backend (and so DeepSpeed's
    branch and the processes' number) only for GPUs and other accelerators unless ``cpu=True``
    (``PartialState._prepare_backend``, accelerate/state.py), and with ``cpu=True`` (``use_cpu``) it skips the
    DeepSpeed branch (``PartialState.__init__``: ``if not cpu``); without either a CPU process counts itself as
    the only one although DeepSpeed's ``init_distributed`` joins every rank. Return gloo over MULTI_CPU there,
    what the branch for a GPU returns with NCCL, so that ``PartialState.__init__`` initialises DeepSpeed's
    distributed backend, reads the ranks from ``torch.distributed`` and switches to ``DistributedType.DEEPSPEED``,
    as on GPUs."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    original = PartialState._prepare_backend

    def prepare_backend(self, cpu: bool = False, sagemaker_dp: bool = False, backend=None):
        found, kind = original(self, cpu, sagemaker_dp, backend)
        if found is None and not cpu and int(os.environ.get("LOCAL_RANK", -1)) != -1:
            return "gloo", DistributedType.MULTI_CPU
        return found, kind

    PartialState._prepare_backend = prepare_backend


def deepspeed_config(stage: int) -> dict:
    """A DeepSpeed config at ZeRO-``stage`` for ``TrainingArguments(deepspeed=...)``: the batch values ``"auto"``
    (the Trainer fills them from its arguments); small buckets (DeepSpeed's default 5e8-element bucket would not
    fit under the tests' caps); under ZeRO-3 every parameter gathered in the forward (DeepSpeed keeps those under
    ``stage3_param_persistence_threshold``, 1e5 elements by default, whole on every rank) and nothing prefetched."""
    zero: dict = {"stage": stage, "reduce_bucket_size": 500_000}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=0)
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": zero,
            "zero_allow_untested_optimizer": True}


def full_state(model) -> dict:
    """The model's weights; FSDP2's DTensor shards or FSDP1's flat parameters gathered (a collective every rank
    joins here)."""
    from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel, StateDictType

    if any(hasattr(p, "ds_id") for p in model.parameters()):  # ZeRO-3 partitions: gather them
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            return {k: v.detach().clone() for k, v in model.state_dict().items()}
    if isinstance(model, FullyShardedDataParallel):
        with FullyShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                                      FullStateDictConfig(rank0_only=False)):
            return dict(model.state_dict())
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in model.state_dict().items()}


def main() -> None:
    cfg = json.loads(sys.argv[1])
    out = Path(cfg["out"])
    torch.set_num_threads(1)
    import transformers
    from torch.utils.data import Dataset

    from memguard import Estimate, Plan
    from memguard.integrations.transformers import MemguardCallback

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    messages: list[str] = []

    # what the guarded Trainer ran, in order: each forward's sample indices, "RETRY" (memguard's halving, logged on
    # every rank) and "STEP" (the end of an optimizer step)
    events: list = []

    class Recorder(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(f"{record.levelname}:{record.getMessage()}")
            if record.levelno >= logging.WARNING and record.getMessage().startswith("out of memory"):
                events.append("RETRY")

    logging.getLogger("memguard").addHandler(Recorder())
    logging.getLogger("memguard").setLevel(logging.INFO)
    transformers.logging.set_verbosity_error()

    class Tokens(Dataset):
        def __init__(self, n: int) -> None:
            g = torch.Generator().manual_seed(1)
            self.ids = torch.randint(0, cfg["vocab"], (n, cfg["seq"]), generator=g)

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    config = transformers.GPT2Config(vocab_size=cfg["vocab"], n_positions=cfg["seq"], n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # replays redraw dropout masks
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    initial = transformers.GPT2LMHeadModel(config).state_dict()
    data = Tokens(cfg["steps"] * cfg["batch"] * cfg["accum"] * world)

    ds_stage = cfg.get("deepspeed")  # a ZeRO stage, or None
    ds_config = None
    if ds_stage is not None:
        deepspeed_backend_on_cpu()
        ds_config = deepspeed_config(ds_stage)

    def args(name: str) -> transformers.TrainingArguments:
        return transformers.TrainingArguments(
            output_dir=str(out / name), use_cpu=ds_stage is None, report_to=[],
            **({"deepspeed": ds_config} if ds_config is not None else {}), per_device_train_batch_size=cfg["batch"],
            gradient_accumulation_steps=cfg["accum"], max_steps=cfg["steps"], learning_rate=1e-3, max_grad_norm=0.5,
            lr_scheduler_type="linear", warmup_steps=1, logging_steps=1, save_strategy="no", disable_tqdm=True,
            dataloader_num_workers=0, seed=0, ddp_backend="gloo" if world > 1 else None,
            # FSDP1 without sync_module_states (its plugin looks for a GPU to broadcast on; every rank starts from
            # the same weights here anyway)
            **({"fsdp": "full_shard", "fsdp_config": {"version": cfg.get("fsdp_version", 2),
                                                      "transformer_layer_cls_to_wrap": ["GPT2Block"],
                                                      **({"sync_module_states": "false"}
                                                         if cfg.get("fsdp_version") == 1 else {})}}
               if cfg.get("fsdp2") else {}),
        )

    def model() -> transformers.GPT2LMHeadModel:
        m = transformers.GPT2LMHeadModel(config)
        m.load_state_dict(initial)
        return m

    result: dict = {"rank": rank, "error": None, "capped": False}

    # the reference: the plain Trainer, no memguard, no cap
    plain = transformers.Trainer(model=model(), args=args("plain"), train_dataset=data)
    if cfg.get("fsdp2"):
        force_fsdp_on_cpu(plain)
    plain.train()
    result["plain_logs"] = [h for h in plain.state.log_history if "loss" in h]
    torch.save(full_state(plain.model), out / f"plain{rank}.pt")

    stage = 3 if cfg.get("fsdp2") else ds_stage or 0  # fsdp="full_shard": FSDP2's sharding level 3
    est = Estimate(peak_bytes=4 << 20, breakdown={"params": 1 << 20, "activations": 3 << 20}, context_bytes=0,
                   peak_phase="backward", allocated_peak_bytes=4 << 20, device="cpu", precision="32-true",
                   zero_stage=stage, world_size=world, gpu=None, micro_batch_size=cfg["batch"])
    plan = Plan(micro_batch_size=cfg["batch"], grad_accum_steps=cfg["accum"], world_size=world,
                global_batch_size=cfg["batch"] * cfg["accum"] * world, precision="32-true",
                activation_checkpointing=False, zero_stage=stage,
                strategy="deepspeed" if ds_stage else "fsdp2" if stage else "ddp",
                budget_bytes=cfg["budget_mib"] << 20, estimate=est, device="cpu")
    # "planner": memguard plans (rank 0, broadcast) with room to spare and no checkpointing, which takes the
    # whole local batch of batch x accum samples as one micro-batch (the fastest split): the Trainer's
    # per-device batch and accumulation change, its global batch does not
    callback = (MemguardCallback(budget_bytes=1 << 30, activation_checkpointing=False) if cfg.get("plan") == "planner"
                else MemguardCallback(plan=plan))

    class Cap(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == cfg["cap_step"] and rank in cfg["cap_ranks"]:
                limit = vm_size() + (cfg["budget_mib"] << 20)
                resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
                result["capped"] = True

        def on_step_end(self, args, state, control, **kwargs):
            events.append("STEP")

    guarded = transformers.Trainer(model=model(), args=args("guarded"), train_dataset=data, eval_dataset=data,
                                   callbacks=[callback, Cap()])
    if cfg.get("fsdp2"):
        force_fsdp_on_cpu(guarded)
    # a sample is known by its first 16 tokens (random ids out of 4096: distinct)
    index = {tuple(data.ids[i, :16].tolist()): i for i in range(len(data))}
    assert len(index) == len(data)
    guarded.model.register_forward_pre_hook(
        lambda module, a, kw: events.append([index[tuple(r[:16].tolist())] for r in kw["input_ids"]]),
        with_kwargs=True)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    try:
        guarded.train()
    except Exception as exc:  # reported to the test, which decides whether it was expected
        result["error"] = {"type": type(exc).__name__, "message": str(exc)}
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    result.update(messages=messages, events=events, micro_batch_size=callback.micro_batch_size, oom_retries=callback.oom_retries,
                  plan=[callback.plan.micro_batch_size, callback.plan.grad_accum_steps],
                  trainer_batch=[guarded.args.per_device_train_batch_size, guarded.args.gradient_accumulation_steps],
                  patched_left="training_step" in guarded.__dict__,
                  guarded_logs=[h for h in guarded.state.log_history if "loss" in h])
    result["agreements"] = getattr(callback._guard.rank_group, "agreements", None)  # FSDP's/DeepSpeed's
    (out / f"result{rank}.json").write_text(json.dumps(result))  # in case gathering the weights below fails
    torch.save(full_state(guarded.model), out / f"guarded{rank}.pt")

    if cfg.get("eval_oom"):
        # an evaluation that runs out of memory even at one sample: memguard's error, the training micro-batch alone
        inner = guarded.model

        def oom_forward(*a, **k):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated in evaluation)")

        inner.forward = oom_forward
        try:
            guarded.evaluate()
            result["eval_error"] = None
        except Exception as exc:  # the callback halves down to one sample, then raises memguard's error
            result["eval_error"] = type(exc).__name__
        result["micro_batch_after_eval"] = callback.micro_batch_size
        result["oom_retries_after_eval"] = callback.oom_retries
    (out / f"result{rank}.json").write_text(json.dumps(result))
    # Leave without interpreter teardown: with gloo, destroying the process group while a gloo worker
    # thread still releases a finished work's tensors can deadlock at exit (tests/guard/oom_worker.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
