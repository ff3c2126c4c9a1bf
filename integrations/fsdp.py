"""Shard a plain PyTorch model with FSDP2 (``fully_shard``) as a memguard plan says.

``apply(model, plan)`` follows the layout FSDP2's own recipes use (torchtitan, torchtune): one
``fully_shard`` per repeated block (the blocks :func:`memguard.estimator.blocks.find_container`
finds: transformer layers, ResNet blocks), then one on the root for what is left (embeddings,
final norm, head). What the plan fixes:

* ``zero_stage`` is the sharding level (the meaning the estimator gives it under FSDP2):
  3 = ``reshard_after_forward=True`` (parameters re-gathered in backward), 2 = ``False``
  (unsharded parameters kept from forward to backward), 1 = ``False`` and gradients synchronised
  only on the last micro-batch of a step (``set_requires_gradient_sync``; :func:`memguard.step`
  does it, a hand-written loop must call ``model.set_requires_gradient_sync(is_last)``).
* ``bf16-mixed`` / ``16-mixed``: ``MixedPrecisionPolicy(param_dtype=bf16|fp16, reduce_dtype=fp32)``:
  FSDP2 all-gathers 16-bit copies of the fp32 shards and runs the model in 16 bits, so no autocast
  is used (and none must be added). ``bf16-true`` / ``16-true``: the model is cast before
  sharding. ``32-true``: fp32 everywhere.
* activation checkpointing of the plan's first ``checkpoint_blocks`` blocks, applied before
  sharding (:func:`memguard.estimator.blocks.apply_activation_checkpointing`, the one the estimate
  used).
* ``offload_optimizer``: ``CPUOffloadPolicy`` (sharded parameters, gradients and optimizer states
  live in host memory; the optimizer steps on the CPU).

Build the optimizer after ``apply`` (FSDP2 replaces the parameters with sharded ones), or let
:func:`memguard.prepare` (``strategy="fsdp2"``) do both.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from memguard.errors import ConfigError

__all__ = ["apply", "FSDPSetupError", "shard", "shard_layout", "stage_settings", "PRECISION_DTYPES"]

#: The 16-bit dtype of each precision name (Lightning's names, memguard.vocab.PRECISIONS).
PRECISION_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "bf16-true": torch.bfloat16,
                    "16-true": torch.float16, "32-true": None}


class FSDPSetupError(ConfigError):
    """A model, plan or process group that cannot be sharded as asked (every problem listed in ``.problems``)."""


def stage_settings(zero_stage: int) -> tuple[bool, bool]:
    """``(reshard_after_forward, sync_last_only)`` of an FSDP2 sharding level (3, 2 or 1).

    Raises:
        FSDPSetupError: ``zero_stage`` is not 1, 2 or 3.
    """
    # The agreed meaning of zero_stage under FSDP2 (the estimator's and the planner's).
    table = {3: (True, False), 2: (False, False), 1: (False, True)}
    if zero_stage not in table:
        raise FSDPSetupError(f"zero_stage {zero_stage} has no FSDP2 meaning (3 = reshard_after_forward=True, 2 = "
                             "False, 1 = False with gradient sync on the last micro-batch only); plan with "
                             "strategy='fsdp2'")
    return table[zero_stage]


def _problems(model: Any, plan: Any, mesh: Any) -> list[str]:
    import torch.distributed as dist

    from memguard.guard.sharded import is_fsdp_model
    from memguard.planner.plan import Plan

    out: list[str] = []
    if not isinstance(model, nn.Module):
        out.append(f"model must be an nn.Module, got {type(model).__name__}")
    elif isinstance(model, nn.parallel.DistributedDataParallel):
        out.append("the model is wrapped in DistributedDataParallel; pass the plain module (FSDP2 replaces DDP)")
    elif is_fsdp_model(model):
        out.append("the model is already sharded with fully_shard; apply the plan to the unsharded model, or pass "
                   "the sharded model to memguard.prepare(..., strategy='fsdp2') as it is")
    if not isinstance(plan, Plan):
        out.append(f"plan must be a memguard.Plan, got {type(plan).__name__}; build it with memguard.plan(..., "
                   "strategy='fsdp2')")
        return out
    strategy = getattr(plan, "strategy", None)  # Plan.strategy: "ddp", "deepspeed" or "fsdp2"
    if strategy == "deepspeed":
        out.append("the plan is for DeepSpeed; turn it into a DeepSpeed config with "
                   "memguard.integrations.deepspeed.to_config, or plan with strategy='fsdp2'")
    elif plan.zero_stage not in (1, 2, 3):
        out.append(f"the plan uses ZeRO stage {plan.zero_stage} (no sharding); plan with strategy='fsdp2' (stages "
                   "1-3), or run it with DistributedDataParallel")
    if plan.precision not in PRECISION_DTYPES:
        out.append(f"the plan's precision {plan.precision!r} is not one of {', '.join(PRECISION_DTYPES)}")
    if mesh is None and not (dist.is_available() and dist.is_initialized()):
        out.append("no process group: call torch.distributed.init_process_group (on every rank) before sharding, or "
                   "pass mesh=")
    else:
        size = mesh.size() if mesh is not None else dist.get_world_size()
        if size != plan.world_size:
            out.append(f"the plan was made for {plan.world_size} ranks but the mesh has {size}; plan with "
                       f"world_size={size}")
    return out


def _device_type(model: nn.Module) -> str:
    devices = {p.device.type for p in model.parameters()} - {"meta"}
    if devices:
        return sorted(devices)[0]
    return "cuda" if torch.cuda.is_available() else "cpu"


def shard(model: nn.Module, plan: Any, *, mesh: Any = None, reshard_after_forward: bool | None = None,
          offload: bool | None = None) -> Callable[[], None]:
    """:func:`apply`, returning a function that undoes the activation checkpointing it applied.

    Raises:
        FSDPSetupError: as :func:`apply`.
    """
    problems = _problems(model, plan, mesh)
    if problems:
        raise FSDPSetupError(problems)
    return shard_layout(model, plan, mesh=mesh, reshard_after_forward=reshard_after_forward, offload=offload)


def shard_layout(model: nn.Module, layout: Any, *, mesh: Any = None, reshard_after_forward: bool | None = None,
                 offload: bool | None = None) -> Callable[[], None]:
    """Shard ``model`` as ``layout`` says, without checking it: anything with a plan's ``zero_stage``,
    ``precision``, ``activation_checkpointing``, ``checkpoint_blocks`` and ``offload_optimizer``
    (the guard's fixed ``micro_batch_size=`` path has no Plan). Returns the checkpointing's undo.

    Raises:
        FSDPSetupError: an unknown sharding level, or checkpointing on a model without repeated blocks.
    """
    plan = layout
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    from memguard.estimator.blocks import apply_activation_checkpointing, find_container

    raf, _ = stage_settings(plan.zero_stage)
    if reshard_after_forward is not None:
        raf = bool(reshard_after_forward)
    if mesh is None:
        import torch.distributed as dist

        mesh = init_device_mesh(_device_type(model), (dist.get_world_size(),))
    dtype = PRECISION_DTYPES[plan.precision]
    if plan.precision.endswith("-true") and dtype is not None:
        model.to(dtype)  # bf16-true / 16-true: the weights themselves are 16-bit; FSDP2 shards them as they are
    # MixedPrecisionPolicy (torch/distributed/fsdp/_fully_shard/_fsdp_api.py): param_dtype is the dtype of the
    # all-gathered parameters and of the forward; reduce_dtype that of the gradient reduce-scatter.
    if plan.precision.endswith("-mixed"):
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    elif dtype is not None:  # *-true: parameters already 16-bit; cast float inputs to them
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
    else:
        mp = MixedPrecisionPolicy()
    use_offload = plan.offload_optimizer if offload is None else bool(offload)
    off = CPUOffloadPolicy() if use_offload else OffloadPolicy()
    undo: Callable[[], None] = lambda: None
    container = find_container(model)
    blocks = list(container.children()) if container is not None else []
    if plan.activation_checkpointing and plan.checkpoint_blocks > 0:
        if not blocks:
            raise FSDPSetupError("the plan checkpoints activations, but memguard found no repeated blocks in the "
                                 "model; plan with activation_checkpointing=False")
        undo = apply_activation_checkpointing(model, plan.checkpoint_blocks, blocks)
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=raf, mp_policy=mp, offload_policy=off)
    fully_shard(model, mesh=mesh, reshard_after_forward=raf, mp_policy=mp, offload_policy=off)
    return undo


def apply(model: nn.Module, plan: Any, *, mesh: Any = None, reshard_after_forward: bool | None = None,
          offload: bool | None = None) -> nn.Module:
    """Shard ``model`` in place with FSDP2 as ``plan`` says (see the module docstring); the model.

    Call it on every rank, after ``torch.distributed.init_process_group``, and build the optimizer
    afterwards.

    Args:
        model: a plain ``nn.Module`` (on its device, or on ``meta`` to materialise after sharding).
        plan: a :class:`memguard.Plan` made with ``strategy="fsdp2"`` for this world size.
        mesh: the 1-D ``DeviceMesh`` to shard over; default: every rank of the default process
            group, on the device type of the model's parameters.
        reshard_after_forward: overrides the plan's sharding level (``zero_stage`` 3 = True).
        offload: overrides the plan's ``offload_optimizer`` (``CPUOffloadPolicy``).

    Returns:
        The same ``model``, now an ``FSDPModule``.

    Raises:
        FSDPSetupError: no process group and no mesh, a mesh whose size differs from the plan's
            world size, a model already sharded (or wrapped in DDP), a DeepSpeed or un-sharded
            (ZeRO 0) plan, checkpointing planned on a model without repeated blocks.

    Known limitations:
        ``16-mixed`` needs loss scaling, which FSDP2 leaves to the training loop (a
        ``torch.amp.GradScaler`` does not all-reduce its inf checks over sharded gradients);
        ``bf16-mixed`` does not. Tied parameters shared by the root and a block (an LM head tied to
        the embedding is fine: both are in the root) must be in one ``fully_shard`` call.
    """
    shard(model, plan, mesh=mesh, reshard_after_forward=reshard_after_forward, offload=offload)
    return model
