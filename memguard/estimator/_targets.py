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


#: The data-parallel strategies memguard estimates: DDP (no sharding), DeepSpeed ZeRO, FSDP2, FSDP1.
STRATEGIES: tuple[str, ...] = ("ddp", "deepspeed", "fsdp2", "fsdp1")


def check_strategy(*, strategy: Any, zero_stage: Any, offload_optimizer: Any = False, problems: list[str]) -> None:
    """Append a sentence to ``problems`` for each invalid combination of ``strategy`` and its options.

    ``strategy=None`` is today's meaning (DDP, or DeepSpeed when ``zero_stage >= 1``); "ddp" means
    no sharding (``zero_stage=0``); "deepspeed" needs a ZeRO stage >= 1; "fsdp2" takes
    ``zero_stage`` as its sharding level 1-3; "fsdp1" takes 3, 2 or 0 (``FULL_SHARD``,
    ``SHARD_GRAD_OP``, ``NO_SHARD``).
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
    elif strategy == "fsdp1":
        if stage_ok and zero_stage == 1:
            problems.append("strategy='fsdp1' takes zero_stage 3 (FULL_SHARD), 2 (SHARD_GRAD_OP) or 0 (NO_SHARD); "
                            "FSDP1 has no level 1: use 2, or strategy='fsdp2'")
        if offload_optimizer:
            problems.append("strategy='fsdp1' with offload_optimizer=True (FSDP1's CPUOffload) is not modelled: drop "
                            "offload_optimizer, or estimate strategy='fsdp2' (CPUOffloadPolicy)")
        import torch.distributed as dist

        if not dist.is_available():
            problems.append("strategy='fsdp1' needs torch.distributed, which this torch build lacks")
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


def target_gpu(
    device: str, gpu: Any, problems: list[str], *, torch_version: Any = None, cuda_version: Any = None,
    cudnn_version: Any = None,
) -> Any:
    """The catalog entry the CUDA target uses (``gpu``, else the current device, else the generic one);
    None on the CPU. Problems (an unknown name, ``gpu=`` on the CPU, a version outside the modelled
    range) are appended to ``problems``.

    With any of ``torch_version``, ``cuda_version``, ``cudnn_version`` the entry comes back with its
    ``stack`` set (:func:`resolve_stack`); without them ``stack`` stays None, which every consumer
    reads as :func:`stack_of`'s default (the host's torch and its usual CUDA and cuDNN)."""
    versions = {"torch_version": torch_version, "cuda_version": cuda_version, "cudnn_version": cudnn_version}
    if device == "cuda":
        from memguard.estimator.gpus import GENERIC, current_gpu, get_gpu

        try:
            spec = get_gpu(gpu) if gpu is not None else (current_gpu() or GENERIC)
        except ConfigError as exc:
            problems.extend(exc.problems)
            return None
        if any(v is not None for v in versions.values()):
            stack = resolve_stack(spec, problems=problems, **versions)
            if stack is not None:
                spec = dataclasses.replace(spec, stack=stack)
        return spec
    if gpu is not None:
        problems.append(f"gpu={gpu!r} only applies to device='cuda'; drop it or set device='cuda'")
    for name, value in versions.items():
        if value is not None:
            problems.append(f"{name}={value!r} only applies to device='cuda' (the GPU's software stack); drop it "
                            "or set device='cuda'")
    return None


# ------------------------------------------------------------------------------------------------
# The software stack of the GPU machine: torch, CUDA and cuDNN versions.

#: The torch releases whose CUDA rules memguard models (``(major, minor)``, inclusive).
SUPPORTED_TORCH: tuple[tuple[int, int], tuple[int, int]] = ((2, 0), (2, 13))
#: CUDA toolkits of the torch builds modelled: the oldest is torch 2.0's cu117 wheel, the newest
#: torch 2.12/2.13's cu132 (``CUDA_ARCHES`` in .github/scripts/generate_binary_build_matrix.py).
SUPPORTED_CUDA: tuple[tuple[int, int], tuple[int, int]] = ((11, 7), (13, 2))
#: cuDNN releases, as ``torch.backends.cudnn.version()`` numbers them (8.5.0 = 8500, 9.10.2 = 91002):
#: torch 2.0's cu117 wheel pins 8.5.0.96; 9.x is the last major with a published numbering.
SUPPORTED_CUDNN: tuple[int, int] = (8500, 99999)

#: The CUDA and cuDNN of each torch release's default PyPI wheel (Linux x86_64): ``CUDA_STABLE`` of
#: .github/scripts/generate_binary_build_matrix.py at that release and the ``nvidia-cudnn-cu1x==``
#: pin of its ``PYTORCH_EXTRA_INSTALL_REQUIREMENTS`` (the wheel's Requires-Dist).
USUAL_STACKS: dict[tuple[int, int], tuple[tuple[int, int], int]] = {
    (2, 0): ((11, 7), 8500),  # cu117, nvidia-cudnn-cu11==8.5.0.96
    (2, 1): ((12, 1), 8902),  # cu121, nvidia-cudnn-cu12==8.9.2.26
    (2, 2): ((12, 1), 8902),
    (2, 3): ((12, 1), 8902),
    (2, 4): ((12, 1), 90100),  # cu121, nvidia-cudnn-cu12==9.1.0.70
    (2, 5): ((12, 4), 90100),  # cu124, 9.1.0.70
    (2, 6): ((12, 4), 90100),
    (2, 7): ((12, 6), 90501),  # cu126, nvidia-cudnn-cu12==9.5.1.17
    (2, 8): ((12, 8), 91002),  # cu128, nvidia-cudnn-cu12==9.10.2.21
    (2, 9): ((12, 8), 91002),
    (2, 10): ((12, 8), 91002),
    # torch 2.11 made cu130 the PyPI default (v2.11.0 release notes); 2.10's cu130 wheel pins
    # nvidia-cudnn-cu13==9.15.1.9, taken for 2.11 and 2.12 (their own pins were not read; pins only rise)
    (2, 11): ((13, 0), 91501),
    (2, 12): ((13, 0), 91501),
    (2, 13): ((13, 0), 92000),  # cu130, nvidia-cudnn-cu13==9.20.0.48
}


@dataclass(frozen=True)
class CudaStack:
    """The software a CUDA target runs, which decides kernel choices and workspace sizes.

    Attributes:
        torch: the torch release ``(major, minor)``.
        cuda: the CUDA toolkit torch was built with ``(major, minor)``; None on ROCm.
        cudnn: ``torch.backends.cudnn.version()`` of that build (e.g. 91002 for 9.10.2); None on ROCm.
    """

    torch: tuple[int, int]
    cuda: tuple[int, int] | None = None
    cudnn: int | None = None


def _range_text(low: tuple[int, ...], high: tuple[int, ...]) -> str:
    return f"{'.'.join(map(str, low))} to {'.'.join(map(str, high))}"


def cudnn_text(v: int) -> str:
    """``"9.10.2"`` for ``torch.backends.cudnn.version()``'s 91002 (``"8.9.2"`` for 8902)."""
    major = v // 10000 if v >= 90000 else v // 1000
    rest = v - major * (10000 if v >= 90000 else 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


def _parse_cudnn(value: Any) -> int | None:
    """``torch.backends.cudnn.version()``'s number for ``"9.10.2"``, ``"8.9"`` or an int such as 91002."""
    if is_int(value):
        return int(value)
    if not isinstance(value, str):
        return None
    import re

    m = re.fullmatch(r"\s*(\d+)\.(\d+)(?:\.(\d+))?(?:\.\d+)*\s*", value)
    if m is None:
        return int(value) if value.strip().isdigit() else None
    major, minor, patch = int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)
    # cudnn.h CUDNN_VERSION: MAJOR * 1000 + MINOR * 100 + PATCH before 9, MAJOR * 10000 + MINOR * 100 + PATCH from 9
    return major * (10000 if major >= 9 else 1000) + minor * 100 + patch


def _parse_pair(value: Any) -> tuple[int, int] | None:
    import re

    if not isinstance(value, str):
        return None
    m = re.match(r"\s*(\d+)\.(\d+)", value)
    return (int(m.group(1)), int(m.group(2))) if m else None


#: torch 2.0's cu118 wheel (download.pytorch.org/whl/cu118, nvidia-cudnn-cu11==8.7.0.84): the build
#: an sm90 GPU needs, since the default cu117 wheel has no sm_90 kernels.
_TORCH_2_0_CU118 = ((11, 8), 8700)


def usual_stack(torch_version: tuple[int, int], vendor: str = "nvidia",
                capability: tuple[int, int] = (8, 0)) -> CudaStack:
    """The stack of ``torch_version``'s default wheel (:data:`USUAL_STACKS`) that runs a GPU of
    ``capability`` (sm90 on torch 2.0: the cu118 wheel); ROCm has no CUDA or cuDNN. A release outside
    :data:`SUPPORTED_TORCH` takes the nearest modelled release's CUDA and cuDNN."""
    if vendor != "nvidia":
        return CudaStack(torch=torch_version)
    key = min(max(torch_version, SUPPORTED_TORCH[0]), SUPPORTED_TORCH[1])
    cuda, cudnn = USUAL_STACKS[key]
    if tuple(capability) >= (9, 0) and cuda < (11, 8):
        cuda, cudnn = _TORCH_2_0_CU118
    return CudaStack(torch=torch_version, cuda=cuda, cudnn=cudnn)


def stack_of(spec: Any) -> CudaStack:
    """The stack a CUDA target's GPU spec runs: its ``stack`` when set (:func:`target_gpu`), else the
    installed torch with :func:`usual_stack`'s CUDA and cuDNN."""
    stack = getattr(spec, "stack", None)
    if stack is not None:
        return stack
    from memguard.estimator._cuda import parse_torch_version

    return usual_stack(parse_torch_version(None), getattr(spec, "vendor", "nvidia"),
                       tuple(getattr(spec, "compute_capability", (8, 0))))


def resolve_stack(
    spec: Any, *, torch_version: Any = None, cuda_version: Any = None, cudnn_version: Any = None,
    problems: list[str],
) -> CudaStack | None:
    """The :class:`CudaStack` asked for: each version given, checked against the modelled ranges, and
    the ones left at None from :func:`usual_stack` of the torch release (None: the installed torch).
    A problem (appended to ``problems``, None returned) names the supported range."""
    from memguard.estimator._cuda import parse_torch_version

    n = len(problems)
    vendor = getattr(spec, "vendor", "nvidia")
    torch_v = None
    if torch_version is not None:
        torch_v = _parse_pair(torch_version) if isinstance(torch_version, str) else None
        if torch_v is None or not SUPPORTED_TORCH[0] <= torch_v <= SUPPORTED_TORCH[1]:
            problems.append(f"torch_version={torch_version!r} is not a torch release memguard models; pass one "
                            f"from {_range_text(*SUPPORTED_TORCH)} as a string such as '2.5.1' (the training "
                            "machine's torch.__version__), or None for the installed torch")
    else:
        torch_v = parse_torch_version(None)
    cap = tuple(getattr(spec, "compute_capability", (8, 0)))
    usual = usual_stack(torch_v or SUPPORTED_TORCH[1], vendor, cap)
    cuda_v, cudnn_v = usual.cuda, usual.cudnn
    if vendor != "nvidia":
        for name, value in (("cuda_version", cuda_version), ("cudnn_version", cudnn_version)):
            if value is not None:
                problems.append(f"{name}={value!r} does not apply to {getattr(spec, 'name', 'this GPU')}, an AMD "
                                "GPU (ROCm has neither CUDA nor cuDNN); drop it")
    else:
        if cuda_version is not None:
            cuda_v = _parse_pair(cuda_version)
            if cuda_v is None or not SUPPORTED_CUDA[0] <= cuda_v <= SUPPORTED_CUDA[1]:
                problems.append(f"cuda_version={cuda_version!r} is not a CUDA toolkit of a modelled torch build; pass "
                                f"one from {_range_text(*SUPPORTED_CUDA)} as a string such as '12.4' "
                                "(torch.version.cuda on the training machine), or None for the torch release's "
                                "usual one")
        if cudnn_version is not None:
            cudnn_v = _parse_cudnn(cudnn_version)
            if cudnn_v is None or not SUPPORTED_CUDNN[0] <= cudnn_v <= SUPPORTED_CUDNN[1]:
                problems.append(f"cudnn_version={cudnn_version!r} is not a cuDNN release memguard models; pass one "
                                f"from {cudnn_text(SUPPORTED_CUDNN[0])} to 9.x as a string such as '9.10.2' or "
                                "as torch.backends.cudnn.version() gives it (91002), or None for the torch "
                                "release's usual one")
        # CUDA 11.8 added sm_90 (CUDA 11.8 release notes; torch 2.0's cu118 wheel is the first with sm_90)
        if cuda_v is not None and len(problems) == n and cap >= (9, 0) and cuda_v < (11, 8):
            problems.append(f"cuda_version={cuda_version!r} cannot run {getattr(spec, 'name', 'this GPU')} "
                            f"(sm{cap[0]}{cap[1]} needs CUDA >= 11.8); pass a newer cuda_version")
    if len(problems) > n:
        return None
    return CudaStack(torch=torch_v, cuda=cuda_v, cudnn=cudnn_v)


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
    if strategy in ("fsdp2", "fsdp1"):  # FSDP1's MixedPrecision casts in the trace too (fsdp1_layout)
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
