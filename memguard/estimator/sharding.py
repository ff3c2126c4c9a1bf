"""Per-rank model-state bytes under DDP and DeepSpeed ZeRO, as category factors.

The trace counts the whole model on one rank. Sharding is applied by scaling the ``params``,
``grads`` and ``optimizer`` categories of the timeline (see ``analysis.scan``) so that, at the
end of backward, they hold exactly what DeepSpeed's own estimators say a rank holds:

* ZeRO-2 (``estimate_zero2_model_states_mem_needs`` in deepspeed/runtime/zero/stage_1_and_2.py):
  ``2Ψ + 18Ψ/N`` — 16-bit params on every rank; 16-bit grads, fp32 grads, fp32 master params and
  Adam's two fp32 moments (2 + 4 + 4 + 8 bytes) partitioned. With CPU offload: ``2Ψ``.
* ZeRO-3 (``estimate_zero3_model_states_mem_needs`` in deepspeed/runtime/zero/stage3.py):
  ``4·largest_layer + 18Ψ/N``; with the optimizer offloaded: ``4·largest_layer + 2Ψ/N``.
* ZeRO-1 (not in DeepSpeed's estimators; the ZeRO paper, arXiv 1910.02054, §5.1, partitions
  only optimizer state): 16-bit params and grads on every rank, the rest partitioned, ``4Ψ + 16Ψ/N``
  with DeepSpeed's byte layout above.
* DDP without ZeRO (``world_size > 1``): every rank holds everything, plus gradient buckets as
  large as all gradients (torch.nn.parallel.DistributedDataParallel docs,
  ``gradient_as_bucket_view``: "the saved memory size will be equal to the total gradients size").

Under ZeRO, DeepSpeed's fp16/bf16 modes keep the module's weights in 16 bits and run without
autocast (engine.py: the model is cast with ``module.half()``/``module.bfloat16()``), so a
``*-mixed`` precision with ``zero_stage >= 1`` is traced with 16-bit weights; no cached fp32→16-bit
weight casts exist then.

The byte counts generalise Adam's: the optimizer's own state bytes per parameter are read from
the trace (8 for Adam's two fp32 moments, 4 for SGD momentum, 0 for plain SGD), and 16-bit
precisions add DeepSpeed's fp32 master copy and fp32 gradient partition (4 + 4 bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ShardFactors", "model_state_factors"]


@dataclass(frozen=True)
class ShardFactors:
    """Factors for the ``params``, ``grads`` and ``optimizer`` categories, and extra constant bytes.

    ``extra`` holds bytes that exist on the rank but not in the single-device trace: DDP's
    gradient buckets (category ``grads``) and ZeRO-3's gathered largest layer (``params``).
    """

    params: float = 1.0
    grads: float = 1.0
    optimizer: float = 1.0
    extra_grads: int = 0
    extra_params: int = 0
    optimizer_temporaries: float = 1.0

    def as_dict(self) -> dict[str, float]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "optimizer_temporaries": self.optimizer_temporaries}


def model_state_factors(
    *,
    zero_stage: int,
    world_size: int,
    traced_params: int,
    traced_grads: int,
    traced_optimizer: int,
    num_params: int,
    num_trainable: int,
    largest_layer: int,
    sixteen_bit: bool,
    offload_optimizer: bool = False,
    state_scale: float = 1.0,
) -> ShardFactors:
    """Scale factors that turn single-device traced bytes into one rank's bytes.

    Args:
        traced_params, traced_grads, traced_optimizer: bytes of each category in the trace (params
            and optimizer at rest, grads after a full backward).
        num_params, num_trainable: Ψ over all and trainable parameters.
        largest_layer: parameters of the largest single module (DeepSpeed's largest layer; ZeRO-3
            gathers one at a time).
        sixteen_bit: training in fp16/bf16 (DeepSpeed then keeps fp32 master weights and grads).
        state_scale: multiply the traced optimizer bytes per parameter by this to get fp32 bytes
            (2 when the trace ran with 16-bit parameters, whose optimizer state is 16-bit too).
    """
    n = max(1, world_size)
    if zero_stage == 0:
        buckets = traced_grads if n > 1 else 0  # DDP docs: buckets as large as all gradients
        return ShardFactors(extra_grads=buckets)

    p_bytes = 2 if sixteen_bit else 4  # DeepSpeed keeps module weights in the training dtype
    master = 4 if sixteen_bit else 0  # fp32 master params (stage_1_and_2.py comment: "4_params_32bit")
    grad32 = 4 if sixteen_bit else 0  # fp32 grad partition ("4_grads_32bit")
    states = state_scale * traced_optimizer / num_trainable if num_trainable else 0.0  # Adam: 8 ("8_optimizer_states_32bit")
    psi, psi_t = num_params, num_trainable

    params_b = p_bytes * psi if zero_stage < 3 else 0.0
    grads_b = p_bytes * psi_t if zero_stage < 2 else p_bytes * psi_t / n
    host_part = (grad32 + master + states) * psi_t / n
    extra_params = 0
    if zero_stage == 3:
        extra_params = int((p_bytes + p_bytes) * largest_layer)  # stage3.py: largest_layer_memory = 4 * params
    if offload_optimizer:
        host_part = 0.0  # optimizer state, fp32 grads and master params live in host memory
        if zero_stage == 2:
            grads_b = 0.0  # stage_1_and_2.py: gpu_mem = 2 * total_params with cpu_offload
        if zero_stage == 3:
            grads_b = 0.0
            params_b = p_bytes * psi / n  # stage3.py: largest_layer_memory + 2 * total_params / total_gpus

    def ratio(target: float, traced: int) -> float:
        return target / traced if traced else 0.0

    # fp32 grads and master params are owned by the optimizer in DeepSpeed; count them there.
    # The optimizer step's temporaries follow the partition it updates (none on the device when
    # the optimizer runs on the host).
    return ShardFactors(
        optimizer_temporaries=0.0 if offload_optimizer else 1.0 / n,
        params=ratio(params_b, traced_params),
        grads=ratio(grads_b, traced_grads),
        optimizer=ratio(host_part, traced_optimizer) if traced_optimizer else 0.0,
        extra_params=extra_params,
        extra_grads=0 if traced_optimizer or host_part == 0 else int(host_part),
    )
