"""The throughput cost model the planner maximises.

Predicted time of one optimizer step on one rank, in seconds::

    step = accum * max(flops(m) * recompute / (rate(precision) * MFU), ops * LAUNCH_S)
           + comm(zero_stage) + host_optimizer

* ``flops(m)``: forward + backward FLOPs of one micro-batch, counted on the traced step with
  ``torch.utils.flop_counter`` (so attention, convolutions and the LM head are all included).
* ``recompute``: checkpointing re-runs each checkpointed block's forward, one third of its
  forward + backward FLOPs (backward costs twice the forward: Kaplan et al. 2020, arXiv
  2001.08361, §2.1, C ≈ 6N per token = 2N forward + 4N backward), so ``1 + k/(3L)``.
* ``rate``: the GPU's dense TFLOP/s for the precision (bf16/fp16 tensor cores for 16-bit
  precisions; plain fp32 for ``32-true``, since PyTorch leaves TF32 matmuls off by default:
  ``torch.backends.cuda.matmul.allow_tf32 = False``). ``MFU`` is a constant 0.5 (an assumption;
  it scales every plan alike and matters only against the fixed costs below).
* ``ops * LAUNCH_S``: eager PyTorch pays a fixed host-side cost per ATen op, independent of the
  micro-batch. Kernels launch asynchronously, so host and device work overlap and a micro-batch
  takes the longer of the two; tiny micro-batches are host-bound, which is what makes them slow.
  ``LAUNCH_S`` = 10 µs is an assumed order of magnitude for eager dispatch plus kernel launch.
* ``comm``: bytes each rank sends per step over ``interconnect_gbps`` with no overlap (a
  conservative bound). Ring all-reduce moves 2Ψ elements per rank; ZeRO-1/2 move the same 2Ψ as
  reduce-scatter + all-gather, ZeRO-3 adds a parameter all-gather in forward and backward, 3Ψ in
  all (ZeRO paper, arXiv 1910.02054, §7.2-7.3). ZeRO-2 and ZeRO-3 communicate once per
  micro-batch (gradients are reduced as each micro-batch's backward produces them); DDP and
  ZeRO-1 once per step.
* FSDP2 (``strategy="fsdp2"``; ``_fsdp_param_group.py``, torch 2.13): each micro-batch all-gathers
  the parameters in the policy's ``param_dtype`` for forward and, at level 3
  (``reshard_after_forward=True``), again for backward; FSDP2 reshards after backward, so level 1
  all-gathers every micro-batch too. Gradients are reduce-scattered in ``reduce_dtype`` (fp32 for
  memguard's mixed policy) every micro-batch at levels 2-3, once per step at level 1 (no
  gradient sync on the other micro-batches).
* ``host_optimizer``: with the optimizer offloaded, fp32 gradients go to the host and updated
  16-bit parameters come back over PCIe (HOST_LINK_GBPS), and the host runs Adam over 16 bytes
  per parameter at HOST_ADAM_GBPS (assumed memory-bound host update).

On the CPU target every precision gets the same rate (CPUs have no tensor cores to speak of) and
communication is zero.
"""

from __future__ import annotations

from dataclasses import dataclass

MFU = 0.5  # assumed model-FLOPs utilisation; a common figure for eager training, and it cancels between plans
LAUNCH_S = 10e-6  # assumed eager per-op host cost (dispatch + launch), seconds
HOST_LINK_GBPS = 25.0  # PCIe 4.0 x16 per direction, ~25 GB/s usable (PCI-SIG 16 GT/s x16 = 31.5 GB/s raw)
HOST_ADAM_GBPS = 20.0  # assumed host memory bandwidth available to a CPU Adam update
CPU_TFLOPS = 1.0  # nominal CPU rate; only ratios between CPU plans matter


@dataclass(frozen=True)
class CostInputs:
    """What the cost model needs about the model and the hardware."""

    flops_per_sample: float
    ops_per_micro_batch: float
    num_params: int
    num_blocks: int
    device: str
    tflops: dict  # precision -> dense TFLOP/s
    interconnect_gbps: float
    ops_per_block: float = 0.0  # ATen ops one more repeated block adds per micro-batch (0: not probed)


def step_seconds(
    c: CostInputs,
    *,
    micro_batch_size: int,
    grad_accum_steps: int,
    world_size: int,
    precision: str,
    checkpoint_blocks: int,
    zero_stage: int,
    offload_optimizer: bool,
    strategy: str | None = None,
) -> float:
    """Predicted seconds of one optimizer step (see the module docstring)."""
    rate = c.tflops.get(precision, 0.0) * 1e12 * MFU
    if rate <= 0:
        return float("inf")
    recompute = 1.0 + (checkpoint_blocks / (3.0 * c.num_blocks) if c.num_blocks else 0.0)
    per_micro = max(c.flops_per_sample * micro_batch_size * recompute / rate, c.ops_per_micro_batch * LAUNCH_S)
    compute = grad_accum_steps * per_micro
    comm = 0.0
    if c.device == "cuda" and world_size > 1:
        elem = 2 if precision != "32-true" else 4  # gradients travel in the training dtype
        ring = (world_size - 1) / world_size  # ring collectives send (N-1)/N of the data per rank
        bw = c.interconnect_gbps * 1e9
        if strategy in ("fsdp2", "fsdp1"):
            gathered = 4 if precision == "32-true" else 2  # the all-gather runs in param_dtype
            # reduce_dtype: fp32 under memguard's FSDP2 mixed policy; 16-bit under FSDP1's MixedPrecision as
            # Lightning and Accelerate set it (memguard.estimator._fsdp1.fsdp1_layout)
            reduced = 4 if precision.endswith("-mixed") and strategy == "fsdp2" else gathered
            gathers = 2 if zero_stage == 3 else 1
            reduces = grad_accum_steps if zero_stage >= 2 else 1
            comm = (grad_accum_steps * gathers * gathered + reduces * reduced) * c.num_params * ring / bw
        elif zero_stage <= 1:
            comm = 2 * c.num_params * elem * ring / bw
        elif zero_stage == 2:
            comm = grad_accum_steps * c.num_params * elem * ring / bw + c.num_params * elem * ring / bw
        else:
            comm = grad_accum_steps * 3 * c.num_params * elem * ring / bw
    host = 0.0
    if offload_optimizer:
        shard = c.num_params / max(1, world_size)
        host = shard * (4 + 2) / (HOST_LINK_GBPS * 1e9) + shard * 16 / (HOST_ADAM_GBPS * 1e9)
    return compute + comm + host
