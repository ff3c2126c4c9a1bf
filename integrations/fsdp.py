"""Shard a plain PyTorch model with FSDP2 (``fully_shard``) as a memguard plan says.

``apply(model, plan)`` follows the layout FSDP2's own recipes use (torchtitan, torchtune): one
``fully_shard`` per repeated block (the blocks :func:`memguard.estimator._blocks.find_container`
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
  sharding (:func:`memguard.estimator._blocks.apply_activation_checkpointing`, the one the estimate
  used).
* ``offload_optimizer``: ``CPUOffloadPolicy`` (sharded parameters, gradients and optimizer states
  live in host memory; the optimizer steps on the CPU).

Build the optimizer after ``apply`` (FSDP2 replaces the parameters with sharded ones), or let
:func:`memguard.prepare` (``strategy="fsdp2"``) do both.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from memguard.guard._fsdp2 import FSDPSetupError, shard

__all__ = ["apply", "FSDPSetupError"]


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
