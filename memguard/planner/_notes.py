"""Operational advice for a plan: the environment and library settings that go with it.

:func:`operational_notes` returns the lines of ``Plan.notes`` for a run's :class:`RunSettings`
(:func:`notes_of` for a plan's): each applies only where its condition holds
and names its source. The rules:

* **DDP gradient buckets** (more than one rank, no ZeRO, DistributedDataParallel): DDP copies every
  gradient into its all-reduce buckets unless ``gradient_as_bucket_view=True``, and memguard's
  estimate counts those copies (``memguard/estimator/_sharding.py``); the note says how much the flag
  saves. DDP's buckets are ``bucket_cap_mb=25`` MiB (torch/nn/parallel/distributed.py); NCCL moves
  each through its own buffers of ``NCCL_BUFFSIZE`` (4 MiB by default, per channel and peer; NCCL
  environment-variable docs), allocated outside PyTorch's allocator and so outside the estimate.
* **DeepSpeed ZeRO buckets** (ZeRO stage >= 1 over several ranks or with offload): the plan's
  DeepSpeed config (``memguard.integrations.deepspeed.to_config``) sets ``reduce_bucket_size`` to
  hidden_size^2 elements (the Hugging Face rule), close to DDP's 25 MiB; DeepSpeed's own default,
  5e8 elements (deepspeed/runtime/zero/config.py), needs about 1 GB of 16-bit bucket buffers.
* **NCCL transports** (more than one rank on a catalog GPU with a known P2P/IB problem): the GPU
  catalog's ``p2p_caveat`` (``memguard/estimator/gpus.py``), e.g. ``NCCL_P2P_DISABLE=1`` and
  ``NCCL_IB_DISABLE=1`` on RTX 40-series GPUs with older drivers.
* **PCIe-only multi-GPU** (more than one rank, GPUs linked by PCIe only): gradient traffic shares
  the PCIe link with host transfers; ``NCCL_P2P_LEVEL`` decides when NCCL uses P2P (NCCL docs).
* **Allocator fragmentation** (CUDA, NVIDIA): ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``
  where the batch shape varies from step to step, or where the predicted peak is within 5% of the
  usable budget: expandable segments let the caching allocator grow one segment instead of
  splitting fixed ones (PyTorch docs, "CUDA semantics: Optimizing memory usage with
  PYTORCH_CUDA_ALLOC_CONF"). memguard models both: the fixed segments by default, expandable
  segments when ``PYTORCH_CUDA_ALLOC_CONF`` says so where it plans
  (``memguard.estimator._cuda_expandable``), so setting it there shows what it saves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memguard.vocab import MiB, format_bytes

#: DistributedDataParallel's default ``bucket_cap_mb`` (torch/nn/parallel/distributed.py).
DDP_BUCKET_BYTES = 25 * MiB
#: NCCL's default ``NCCL_BUFFSIZE`` (NCCL docs, "Environment Variables": 4194304).
NCCL_DEFAULT_BUFFSIZE = 4 * MiB
#: DeepSpeed's default ``reduce_bucket_size`` in elements (deepspeed/runtime/zero/config.py, 5e8).
DEEPSPEED_DEFAULT_BUCKET = 500_000_000
#: A plan whose peak is within this share of the usable budget is "tight": fragmentation matters.
TIGHT_FRACTION = 0.95

_ALLOC_DOC = ("PyTorch docs, CUDA semantics, 'Optimizing memory usage with PYTORCH_CUDA_ALLOC_CONF'")


@dataclass(frozen=True)
class RunSettings:
    """What the notes' rules read of a run (see the module docstring for the rules).

    Attributes:
        device: ``"cuda"`` or ``"cpu"``.
        world_size: data-parallel ranks.
        zero_stage: the ZeRO stage (the sharding level under ``"fsdp2"``).
        strategy: ``"ddp"``, ``"deepspeed"``, ``"fsdp2"`` or None (DDP, or DeepSpeed with ZeRO).
        gpu: the catalog GPU (:class:`~memguard.estimator.gpus.GPUSpec`), its name, or None.
        peak_bytes: the plan's predicted peak per rank (its upper bound, ``Estimate.peak_upper_bytes``).
        usable_bytes: the budget less headroom.
        grad_bytes: the gradients' bytes per rank (what DDP's buckets copy).
        hidden_size: the model's hidden size, when known (DeepSpeed bucket sizes).
        precision: the plan's precision (bucket element size).
        offload_optimizer: ZeRO-Offload.
        variable_shapes: the batch shape changes between steps (variable sequence lengths).
    """

    device: str
    world_size: int
    zero_stage: int = 0
    strategy: str | None = "ddp"
    gpu: Any = None
    peak_bytes: int = 0
    usable_bytes: int = 0
    grad_bytes: int = 0
    hidden_size: int | None = None
    precision: str = "32-true"
    offload_optimizer: bool = False
    variable_shapes: bool = False


def operational_notes(run: RunSettings) -> tuple[str, ...]:
    """The operational notes for a run with these settings (see the module docstring for the rules).

    Returns:
        One sentence per applicable rule, each naming its source; empty when none applies.
    """
    device, world_size, zero_stage, strategy = run.device, run.world_size, run.zero_stage, run.strategy
    gpu, peak_bytes, usable_bytes, grad_bytes = run.gpu, run.peak_bytes, run.usable_bytes, run.grad_bytes
    hidden_size, precision, offload_optimizer = run.hidden_size, run.precision, run.offload_optimizer
    variable_shapes = run.variable_shapes
    from memguard.estimator.gpus import lookup_gpu

    spec = lookup_gpu(gpu) if isinstance(gpu, str) else gpu
    multi = world_size > 1
    kind = strategy or ("deepspeed" if zero_stage >= 1 else "ddp")
    notes: list[str] = []
    if multi and kind == "ddp" and zero_stage == 0:
        if grad_bytes > 0:
            notes.append(
                f"DistributedDataParallel(model, gradient_as_bucket_view=True) saves {format_bytes(grad_bytes)} per "
                "rank that this plan counts: without it DDP's buckets copy every gradient (torch "
                "DistributedDataParallel docs, gradient_as_bucket_view)")
        if device == "cuda":
            notes.append(
                f"DDP all-reduces gradients in buckets of bucket_cap_mb=25 ({format_bytes(DDP_BUCKET_BYTES)}, "
                "torch/nn/parallel/distributed.py); NCCL streams each through its own buffers of NCCL_BUFFSIZE "
                f"({format_bytes(NCCL_DEFAULT_BUFFSIZE)} by default, per channel and peer; NCCL environment "
                "variables docs), outside PyTorch's allocator and this estimate: raise either only with free "
                "memory beyond the plan's headroom")
    if kind == "deepspeed" and zero_stage >= 1 and (multi or offload_optimizer):
        item = 4 if precision == "32-true" else 2
        if hidden_size:
            ours = hidden_size * hidden_size
            notes.append(
                f"ZeRO-{zero_stage}: the plan's DeepSpeed config sets reduce_bucket_size={ours:,} elements "
                f"(hidden_size^2, the Hugging Face rule; {format_bytes(ours * item)}), near DDP's 25 MiB buckets; "
                f"DeepSpeed's default 5e8 would hold {format_bytes(DEEPSPEED_DEFAULT_BUCKET * item)} of bucket "
                "buffers (deepspeed/runtime/zero/config.py) that this plan does not budget")
        else:
            notes.append(
                f"ZeRO-{zero_stage}: set reduce_bucket_size (and allgather_bucket_size) near 25 MiB of elements "
                f"(e.g. {DDP_BUCKET_BYTES // item:,}): DeepSpeed's default 5e8 elements would hold "
                f"{format_bytes(DEEPSPEED_DEFAULT_BUCKET * item)} of bucket buffers "
                "(deepspeed/runtime/zero/config.py) that this plan does not budget")
    if multi and device == "cuda" and spec is not None:
        if getattr(spec, "p2p_caveat", ""):
            notes.append(f"{spec.name}: {spec.p2p_caveat}")
        if getattr(spec, "interconnect", "") == "pcie" and spec.vendor == "nvidia":
            notes.append(
                f"{spec.name} GPUs talk over PCIe only ({spec.interconnect_gbps:g} GB/s per direction): if "
                "`nvidia-smi topo -m` shows the GPUs under different CPU sockets, NCCL_P2P_LEVEL decides whether "
                "NCCL still uses P2P (NCCL environment variables docs); gradient all-reduce time grows with the "
                "model, so prefer larger accumulation over more ranks when communication dominates")
    if device == "cuda" and (spec is None or getattr(spec, "vendor", "nvidia") == "nvidia"):
        tight = usable_bytes > 0 and peak_bytes >= TIGHT_FRACTION * usable_bytes
        if variable_shapes or tight:
            why = ("the batch shape varies between steps" if variable_shapes else
                   f"the predicted peak ({format_bytes(peak_bytes)}) is within {100 * (1 - TIGHT_FRACTION):.0f}% "
                   f"of the usable {format_bytes(usable_bytes)}")
            notes.append(
                f"{why}: run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True so the caching allocator grows "
                f"segments instead of fragmenting fixed ones ({_ALLOC_DOC}); this plan modelled the allocator "
                "configuration it was made under: set the variable where you plan, too, to see the saving")
    return tuple(notes)


def notes_of(plan: Any, *, variable_shapes: bool = False) -> tuple[str, ...]:
    """:func:`operational_notes` for a :class:`~memguard.Plan` (or anything with its attributes)."""
    est = plan.estimate
    # gradients have their parameter's dtype: 16-bit under *-true 16-bit precisions, else fp32
    grad_item = 2 if plan.precision in ("16-true", "bf16-true") else 4
    return operational_notes(RunSettings(
        device=plan.device, world_size=plan.world_size, zero_stage=plan.zero_stage,
        strategy=getattr(plan, "strategy", None), gpu=plan.gpu, peak_bytes=getattr(est, "peak_upper_bytes", est.peak_bytes),
        usable_bytes=plan.usable_bytes, grad_bytes=est.num_trainable_params * grad_item,
        hidden_size=plan.hidden_size, precision=plan.precision, offload_optimizer=plan.offload_optimizer,
        variable_shapes=variable_shapes))
