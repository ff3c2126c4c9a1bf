"""What a target means, checked and resolved: shared by the training and the evaluation estimate.

A target is where a step runs (``device``, the ``gpu`` or ``cpu`` whose kernels are modelled), in
which ``precision``, on how many data-parallel ranks and under which sharding ``strategy``. This
module checks those arguments (each problem a sentence, collected so that a
:class:`~memguard.errors.ConfigError` lists them all at once), resolves them (the strategy a
request means, the catalog GPU, the CPU's instruction-set level, the precision a step is traced
in) and unwraps the model the user passed. It imports only the GPU catalog and the CPU model
(both lazily), so :mod:`memguard.estimator.api`, :mod:`memguard.estimator._eval_step` and the
planner share it without a circle.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from torch import nn

from memguard.errors import ConfigError
from memguard.vocab import PRECISIONS

def is_int(value: Any) -> bool:
    """An ``int`` that is not a ``bool`` (``True == 1``, but ``zero_stage=True`` is no stage)."""
    return isinstance(value, int) and not isinstance(value, bool)


#: The data-parallel strategies memguard estimates: DDP (no sharding), DeepSpeed ZeRO, FSDP2.
STRATEGIES: tuple[str, ...] = ("ddp", "deepspeed", "fsdp2")


def check_strategy(*, strategy: Any, zero_stage: Any, offload_optimizer: Any = False, problems: list[str]) -> None:
    """Append a sentence to ``problems`` for each invalid combination of ``strategy`` and its options.

    ``strategy=None`` is today's meaning (DDP, or DeepSpeed when ``zero_stage >= 1``); "ddp" means
    no sharding (``zero_stage=0``); "deepspeed" needs a ZeRO stage >= 1; "fsdp2" takes
    ``zero_stage`` as its sharding level 1-3.
    """
    stage_ok = is_int(zero_stage) and 0 <= zero_stage <= 3
    if strategy is not None and strategy not in STRATEGIES:
        problems.append(f"strategy={strategy!r} is not one of None, {', '.join(map(repr, STRATEGIES))}")
        return
    if strategy == "ddp":
        if stage_ok and zero_stage != 0:
            problems.append(f"strategy='ddp' does not shard: zero_stage={zero_stage} needs strategy='deepspeed' "
                            "or 'fsdp2' (or pass zero_stage=0)")
        if offload_optimizer:
            problems.append("strategy='ddp' cannot offload the optimizer: use strategy='deepspeed' with "
                            "zero_stage >= 1, or 'fsdp2' (CPUOffloadPolicy)")
    elif strategy == "deepspeed":
        if stage_ok and zero_stage == 0:
            problems.append("strategy='deepspeed' needs zero_stage 1, 2 or 3 (ZeRO off is strategy='ddp')")
    elif strategy == "fsdp2":
        if stage_ok and zero_stage == 0:
            problems.append("strategy='fsdp2' needs zero_stage 1, 2 or 3 (its sharding level: 3 = "
                            "reshard_after_forward=True, 2 = False, 1 = False with gradient sync on the last "
                            "micro-batch only); zero_stage=0 is strategy='ddp'")
        import torch.distributed as dist

        if not dist.is_available():
            problems.append("strategy='fsdp2' needs torch.distributed, which this torch build lacks")
    elif offload_optimizer and stage_ok and zero_stage == 0:
        problems.append("offload_optimizer=True needs zero_stage >= 1 (ZeRO-Offload)")


def resolve_strategy(strategy: str | None, zero_stage: int) -> str:
    """The strategy a request means: ``None`` is DDP without ZeRO, DeepSpeed with it."""
    if strategy is not None:
        return strategy
    return "deepspeed" if zero_stage >= 1 else "ddp"

def check_common(
    *, precision: Any = "32-true", zero_stage: Any = 0, world_size: Any = 1, device: Any = "cuda", problems: list[str]
) -> None:
    """Append a sentence to ``problems`` for each invalid target argument."""
    if precision not in PRECISIONS:  # full names only: an Estimate records exactly what was asked
        problems.append(f"precision={precision!r} is not one of {', '.join(PRECISIONS)}")
    if not (is_int(zero_stage) and 0 <= zero_stage <= 3):  # True is not stage 1 (as memguard.plan refuses it)
        problems.append(f"zero_stage={zero_stage!r} must be 0, 1, 2 or 3")
    if not (is_int(world_size) and world_size >= 1):
        problems.append(f"world_size={world_size!r} must be an integer >= 1 (the number of data-parallel ranks)")
    if device not in ("cuda", "cpu"):
        problems.append(f"device={device!r} must be 'cuda' or 'cpu'")


def target_gpu(device: str, gpu: Any, problems: list[str]) -> Any:
    """The catalog entry the CUDA target uses (``gpu``, else the current device, else the generic one);
    None on the CPU. Problems (an unknown name, ``gpu=`` on the CPU) are appended to ``problems``."""
    if device == "cuda":
        from memguard.estimator.gpus import GENERIC, current_gpu, get_gpu

        try:
            return get_gpu(gpu) if gpu is not None else (current_gpu() or GENERIC)
        except ConfigError as exc:
            problems.extend(exc.problems)
    elif gpu is not None:
        problems.append(f"gpu={gpu!r} only applies to device='cuda'; drop it or set device='cuda'")
    return None


def target_cpu(device: str, cpu: Any, problems: list[str]):
    """The :class:`~memguard.estimator._cpu_kernels.CpuTarget` of the CPU target (``cpu`` named, or
    this host), None for the CUDA target; a bad ``cpu`` is added to ``problems``."""
    from memguard.estimator._cpu_kernels import CpuTarget

    if device != "cpu":
        if cpu is not None:
            problems.append(f"cpu={cpu!r} only applies to device='cpu'; drop it or set device='cpu'")
        return None
    return CpuTarget.named(cpu, problems)


def unwrap_model(model: Any) -> Any:
    """The model inside DistributedDataParallel, DataParallel and similar wrappers (their ``.module``),
    and inside ``torch.compile``'s ``OptimizedModule`` (its ``_orig_mod``: the eager module is traced)."""
    while isinstance(model, nn.Module):
        inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            inner = model.__dict__.get("_orig_mod") or model._modules.get("_orig_mod")
        if not isinstance(inner, nn.Module):
            return model
        model = inner
    return model


def traced_precision(precision: str, zero_stage: int, strategy: str | None = None) -> str:
    """The precision a step is traced in: DeepSpeed's 16-bit modes (ZeRO >= 1) keep 16-bit weights
    and use no autocast, so ``*-mixed`` under ZeRO is traced as ``*-true``. Under FSDP2 the
    precision is traced as named: the mixed-precision policy is applied by FSDP2 itself in the trace
    (fp32 sharded weights, no autocast; see :func:`fsdp2_layout`)."""
    if strategy == "fsdp2":
        return precision
    if zero_stage >= 1 and precision.endswith("-mixed"):
        return precision.replace("-mixed", "-true")
    return precision


@dataclass(frozen=True)
class Target:
    """A checked target that a trace is priced for (:func:`memguard.estimator._pricing.estimate_from_trace`).

    Attributes:
        device: ``"cuda"`` or ``"cpu"``.
        precision: the precision asked for, as the :class:`~memguard.Estimate` records it (the
            trace may have run in :func:`traced_precision`).
        zero_stage: the strategy's sharding level 0-3 (ZeRO's stage; FSDP2's level).
        world_size: data-parallel ranks.
        gpu: the CUDA target's :class:`~memguard.estimator.gpus.GPUSpec` (its name, context bytes
            and BLAS workspaces; :func:`target_gpu`); None on the CPU.
        strategy: ``"ddp"``, ``"deepspeed"`` or ``"fsdp2"``; None means what :func:`resolve_strategy`
            makes of ``zero_stage``.
        offload_optimizer: the optimizer state lives on the host (ZeRO-Offload; FSDP2's
            ``CPUOffloadPolicy``).
    """

    device: str
    precision: str
    zero_stage: int = 0
    world_size: int = 1
    gpu: Any = None
    strategy: str | None = None
    offload_optimizer: bool = False

    def resolved(self) -> "Target":
        """This target with its strategy resolved (:func:`resolve_strategy`)."""
        return dataclasses.replace(self, strategy=resolve_strategy(self.strategy, self.zero_stage))
