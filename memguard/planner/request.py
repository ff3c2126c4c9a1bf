"""A plan request: ``memguard.plan``'s options as one validated, frozen value.

:class:`PlanRequest` holds every keyword option of :func:`memguard.plan`, with the same names and
defaults, so that the command line, the guard and the adapters build and check a request once and
hand it to :func:`memguard.planner.search.plan_request`, instead of each checking options itself::

    request = PlanRequest.from_options(global_batch_size=64, gpu="A100-80GB", precision="bf16-mixed")
    problems = request.problems()            # every invalid value, as sentences; [] when valid
    smaller = dataclasses.replace(request, global_batch_size=32)
    plan = plan_request(model, batch, request)

:meth:`PlanRequest.resolve` turns a valid request into the :class:`SearchSpace` the search runs
over: the GPU's spec, the precisions, checkpointing modes, ZeRO stages and offload settings to
consider, and the budget.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from memguard.errors import ConfigError
from memguard.vocab import DEVICES, PRECISION_ALIASES, PRECISIONS, KiB, default_precisions

__all__ = ["PlanRequest", "SearchSpace", "DEFAULT_HEADROOM", "OPTION_NAMES", "ZERO_STAGES"]


#: The share of the budget a plan keeps free: the estimator is within ~1% of the real CPU allocator;
#: the rest covers CUDA kernels' own workspaces, fragmentation from other work and the allocator
#: model's simplifications (memguard/planner/search.py, module docstring).
DEFAULT_HEADROOM = 0.10
#: DeepSpeed's ZeRO stages (deepspeed/runtime/zero/config.py, ZeroStageEnum: 0 disabled to 3 weights).
ZERO_STAGES: tuple[int, ...] = (0, 1, 2, 3)
# /proc/meminfo reports kB, meaning KiB (proc(5), "/proc/meminfo").
_MEMINFO_UNIT = KiB


@dataclass(frozen=True)
class PlanRequest:
    """Every option of :func:`memguard.plan` (same names, same defaults, same meaning).

    Construction never fails on a bad value: :meth:`problems` lists them all, so that a caller can
    report them together with its own; :meth:`check` raises them. Use :meth:`from_options` to build
    one from user keywords (it names unknown ones), and ``dataclasses.replace`` to derive another.

    Attributes:
        global_batch_size: samples per optimizer step over all ranks.
        gpu: catalog name of the target GPU; None = the current CUDA device.
        budget_bytes: bytes per rank (overrides the GPU's memory less its CUDA context).
        world_size: data-parallel ranks.
        device: ``"cuda"`` or ``"cpu"``.
        optimizer: an optimizer, a callable ``params -> Optimizer``, or None for AdamW.
        loss_fn: ``loss_fn(model, batch) -> mean loss``, or None to use the model's own loss.
        precision: None = memguard chooses; a name fixes it; a sequence restricts it. Lightning's
            short names (``"bf16"``, ``"16"``, ``"32"``) are accepted.
        activation_checkpointing: None = memguard chooses; True requires it; False forbids it.
        zero_stage: None = memguard chooses; a stage fixes it; a sequence restricts it.
        offload_optimizer: False (default) = never; True = always; None = memguard chooses.
        headroom: the share of the budget kept free, in [0, 1).
        make_batch: ``make_batch(n)`` returns an example batch of ``n`` samples; None resizes dim 0.
        cache: True, or a :class:`memguard.planner.cache.PlanCache`, to reuse plans from disk.
        keep_outputs: True models a loop that keeps the model's output object alive through
            backward, the optimizer step and the next forward (``out = model(**batch)``).
        max_shape: plan for the worst-case batch of this shape instead of the example batch's:
            ``{"seq_len": L}`` and/or per-entry non-batch shapes (see :mod:`memguard.data`).
        train: True plans a training step; False an evaluation step
            (:func:`memguard.planner.eval_plan.plan_eval_for`).
        finetune: None (the model as given), ``"full"`` (the same, and measured fine-tuning
            alternatives when nothing fits) or ``"lora"`` (plan a LoRA twin of the model); see
            :mod:`memguard.planner.finetune`.
        strategy: None = today's choice (DDP, or DeepSpeed ZeRO at ``zero_stage >= 1``); one of
            ``"ddp"``, ``"deepspeed"``, ``"fsdp2"`` fixes it; a sequence restricts the search to
            those. Under ``"fsdp2"`` ``zero_stage`` is FSDP2's sharding level (3 =
            ``reshard_after_forward=True``, 2 = ``False``, 1 = ``False`` with gradient sync on the
            last micro-batch only).
        cpu: for ``device="cpu"``, the CPU whose kernel paths are modelled: None or ``"host"``, or
            an instruction-set level (see :func:`memguard.estimate`).
    """

    global_batch_size: int
    gpu: str | None = None
    budget_bytes: int | None = None
    world_size: int = 1
    device: str = "cuda"
    optimizer: Any = None
    loss_fn: Callable | None = None
    precision: str | Sequence[str] | None = None
    activation_checkpointing: bool | None = None
    zero_stage: int | Sequence[int] | None = None
    offload_optimizer: bool | None = False
    headroom: float = DEFAULT_HEADROOM
    make_batch: Callable[[int], Any] | None = None
    cache: bool | Any = False
    keep_outputs: bool = False
    max_shape: Mapping[Any, Any] | None = None
    train: bool = True
    finetune: str | None = None
    strategy: str | Sequence[str] | None = None
    cpu: str | None = None

    @classmethod
    def from_options(cls, **options: Any) -> "PlanRequest":
        """A request from keyword options, as :func:`memguard.plan` takes them.

        Values are not checked here (see :meth:`problems`); names are.

        Raises:
            ConfigError: an unknown option name (the message lists the accepted ones), or no
                ``global_batch_size``.
        """
        problems = []
        unknown = [name for name in options if name not in OPTION_NAMES]
        if unknown:
            problems.append(
                f"unknown plan option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                f"memguard.plan accepts {', '.join(OPTION_NAMES)}"
            )
        if "global_batch_size" not in options:
            problems.append("global_batch_size is required: the samples per optimizer step over all ranks")
        if problems:
            raise ConfigError(problems)
        return cls(**options)

    def options(self) -> dict[str, Any]:
        """The request as keyword options: ``PlanRequest.from_options(**r.options()) == r``."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def problems(self, *, spell: Mapping[str, str] | None = None) -> list[str]:
        """Every invalid value of the request, one sentence each; empty when the request is valid.

        Args:
            spell: how to name options in the sentences, e.g. ``{"budget_bytes": "--budget"}`` for
                a command line (then values follow the name after a space); default: Python's
                ``name=value``.
        """
        return self._examine(spell)[0]

    def check(self) -> "PlanRequest":
        """The request itself when valid.

        Raises:
            ConfigError: every problem :meth:`problems` finds, at once.
        """
        problems = self.problems()
        if problems:
            raise ConfigError(problems)
        return self

    def resolve(self) -> "SearchSpace":
        """What the search runs over: the GPU's spec, the choices of each knob and the budget.

        Raises:
            ConfigError: the request is invalid (every problem at once), or the budget cannot be
                determined (an unknown GPU's memory, or the host's on ``device="cpu"``).
        """
        problems, space = self._examine(None)
        if problems:
            raise ConfigError(problems)
        return space

    # ------------------------------------------------------------------------------------------

    def _examine(self, spell: Mapping[str, str] | None) -> tuple[list[str], "SearchSpace | None"]:
        def say(name: str, value: Any = dataclasses.MISSING) -> str:
            if spell is not None and name in spell:
                return spell[name] if value is dataclasses.MISSING else f"{spell[name]} {value}"
            return name if value is dataclasses.MISSING else f"{name}={value!r}"

        problems: list[str] = []
        gbs, world, device = self.global_batch_size, self.world_size, self.device
        if not _is_int(gbs) or gbs < 1:
            problems.append(f"{say('global_batch_size', gbs)} must be an integer >= 1")
        if not _is_int(world) or world < 1:
            problems.append(f"{say('world_size', world)} must be an integer >= 1 (the number of data-parallel ranks)")
        if device not in DEVICES:
            problems.append(f"{say('device', device)} must be one of {', '.join(map(repr, DEVICES))}")
        if _is_int(gbs) and _is_int(world) and gbs >= 1 and world >= 1 and gbs % world:
            problems.append(
                f"global_batch_size {gbs} cannot be split evenly over world_size {world}; use a multiple of "
                f"{world} (e.g. {gbs - gbs % world or world}) for {say('global_batch_size')}"
            )
        headroom = self.headroom
        if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not 0 <= headroom < 1:
            problems.append(f"{say('headroom', headroom)} must be a fraction in [0, 1), e.g. 0.1 for 10%")
        budget = self.budget_bytes
        if budget is not None and (not _is_int(budget) or budget <= 0):
            problems.append(f"{say('budget_bytes', budget)} must be a positive integer number of bytes")
        for name in ("loss_fn", "make_batch"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                problems.append(f"{say(name)} must be a callable or None, got {type(value).__name__}")
        opt = self.optimizer
        if opt is not None and not (isinstance(opt, torch.optim.Optimizer) or callable(opt)):
            problems.append(f"{say('optimizer')} must be an optimizer, a callable params -> optimizer, or None, "
                            f"got {type(opt).__name__}")
        if not isinstance(self.keep_outputs, bool):
            problems.append(f"{say('keep_outputs', self.keep_outputs)} must be True or False")
        if self.max_shape is not None and not (isinstance(self.max_shape, Mapping) and self.max_shape):
            problems.append(f"{say('max_shape', self.max_shape)} must be a non-empty mapping such as "
                            "{'seq_len': 2048} (see memguard.data), or None")
        if not isinstance(self.train, bool):
            problems.append(f"{say('train', self.train)} must be True (a training step) or False (an evaluation step)")
        from memguard.planner.finetune import finetune_problems

        problems.extend(finetune_problems(self.finetune, label=say("finetune")))
        from memguard.planner.cache import PlanCache

        if not isinstance(self.cache, (bool, PlanCache)):
            problems.append(f"{say('cache', self.cache)} must be True, False or a memguard.planner.cache.PlanCache")

        spec = None
        if device == "cuda":
            from memguard.estimator.gpus import GENERIC, current_gpu, get_gpu

            try:
                spec = get_gpu(self.gpu) if self.gpu is not None else current_gpu()
            except ConfigError as exc:
                problems.extend(exc.problems)
            if spec is None and self.gpu is None:
                if budget is None:
                    problems.append(
                        f"no CUDA device here: name the target with {say('gpu', 'A100-80GB')} "
                        f"(`memguard gpus` lists them) or give {say('budget_bytes')}, or plan for "
                        f"{say('device', 'cpu')}"
                    )
                else:
                    spec = GENERIC
        elif self.gpu is not None:
            problems.append(f"{say('gpu', self.gpu)} only applies to {say('device', 'cuda')}; drop it")
        if device == "cpu":
            from memguard.estimator.cpu_kernels import CpuTarget

            CpuTarget.named(self.cpu, problems)
        elif self.cpu is not None:
            problems.append(f"{say('cpu', self.cpu)} only applies to {say('device', 'cpu')}; drop it")

        defaults = default_precisions(device if device in DEVICES else "cpu", spec)
        precisions = tuple(
            PRECISION_ALIASES.get(p, p) if isinstance(p, str) else p
            for p in _choices(say("precision", self.precision), self.precision, defaults,
                              PRECISIONS + tuple(PRECISION_ALIASES), problems)
        )
        if spec is not None and not spec.bf16 and self.precision is not None:
            bad = [p for p in precisions if isinstance(p, str) and p.startswith("bf16")]
            if bad:
                problems.append(f"{spec.name} has no native bf16: use {say('precision', '16-mixed')} or "
                                f"'32-true', not {', '.join(bad)}")
        ckpts = _choices(say("activation_checkpointing", self.activation_checkpointing),
                         self.activation_checkpointing, (False, True), (False, True), problems)
        offloads = _choices(say("offload_optimizer", self.offload_optimizer), self.offload_optimizer,
                            (False, True), (False, True), problems)
        multi = _is_int(world) and world > 1
        from memguard.estimator.targets import STRATEGIES

        strategies = _choices(say("strategy", self.strategy), self.strategy, ("ddp", "deepspeed"), STRATEGIES,
                              problems)
        sharded = self.strategy is not None and any(s in ("deepspeed", "fsdp2") for s in strategies)
        # ZeRO stages are worth considering on one device only with offload (ZeRO-Offload's use case,
        # arXiv 2101.06840: a single GPU training with the optimizer on the host), or when a sharding
        # strategy is asked for by name
        default_zeros = ZERO_STAGES if multi or sharded else ((1, 2) if offloads == (True,) else (0,))
        zeros = _choices(say("zero_stage", self.zero_stage), self.zero_stage, default_zeros, ZERO_STAGES, problems)
        combos = tuple((s, z) for s in strategies for z in zeros
                       if isinstance(z, int) and ((z == 0) == (s == "ddp")))
        if not problems and not combos:
            problems.append(
                f"no sharding fits both {say('strategy', self.strategy)} and {say('zero_stage', self.zero_stage)}: "
                "'ddp' runs zero_stage 0, 'deepspeed' 1-3 (ZeRO), 'fsdp2' 1-3 (its sharding level)")
        elif offloads == (True,) and not any(z >= 1 for _, z in combos):
            problems.append(f"{say('offload_optimizer', True)} needs a ZeRO stage >= 1: pass "
                            f"{say('zero_stage', 1)}, 2 or 3")
        if "fsdp2" in strategies:
            import torch.distributed as dist

            if not dist.is_available():
                problems.append(f"{say('strategy', 'fsdp2')} needs torch.distributed, which this torch build lacks")
        if problems:
            return problems, None
        try:
            budget = budget if budget is not None else _default_budget(device, spec)
        except ConfigError as exc:
            return list(exc.problems), None
        return [], SearchSpace(
            spec=spec, precisions=precisions, checkpointing=ckpts, zero_stages=zeros, offloads=offloads,
            shardings=combos,
            budget_bytes=int(budget), usable_bytes=int(budget * (1 - headroom)),
            explicit_precision=self.precision is not None,
        )


#: The option names of :func:`memguard.plan` and :class:`PlanRequest`, in signature order.
OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(PlanRequest))


@dataclass(frozen=True)
class SearchSpace:
    """A valid request resolved for the search.

    Attributes:
        spec: the CUDA target's :class:`~memguard.estimator.gpus.GPUSpec` (None on the CPU).
        precisions: the precisions to consider, the default order or the user's.
        checkpointing: False and/or True.
        zero_stages: the ZeRO stages to consider.
        offloads: False and/or True.
        budget_bytes: bytes per rank before headroom.
        usable_bytes: ``budget_bytes`` less the headroom: what a plan's estimate must stay under.
        explicit_precision: the user fixed or restricted the precision.
        shardings: the ``(strategy, zero_stage)`` pairs to consider: ``("ddp", 0)``,
            ``("deepspeed", 1-3)``, ``("fsdp2", 1-3)``.
    """

    spec: Any
    precisions: tuple[str, ...]
    checkpointing: tuple[bool, ...]
    zero_stages: tuple[int, ...]
    offloads: tuple[bool, ...]
    budget_bytes: int
    usable_bytes: int
    explicit_precision: bool
    shardings: tuple[tuple[str, int], ...] = ()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _choices(label: str, value: Any, default: Sequence[Any], allowed: Sequence[Any], problems: list[str]) -> tuple:
    """``value`` as a tuple of choices (None: ``default``; one value; or a sequence restricting them)."""
    if value is None:
        return tuple(default)
    values = tuple(value) if isinstance(value, (list, tuple, set, frozenset)) else (value,)
    # bool is an int: 1 == True, so compare types too (zero_stage=True is not stage 1)
    bad = [v for v in values if not any(v == a and type(v) is type(a) for a in allowed)]
    if bad or not values:
        problems.append(f"{label}: each value must be one of {', '.join(map(repr, allowed))}")
    unique: list = []
    for v in values:
        if v not in unique:
            unique.append(v)
    return tuple(unique)


def _default_budget(device: str, spec: Any) -> int:
    """The GPU's memory less its CUDA context, or the host's available memory on the CPU.

    Raises:
        ConfigError: the GPU's memory is unknown, or the host's cannot be read.
    """
    if device == "cuda":
        if not spec.memory_bytes:
            raise ConfigError("the GPU's memory is unknown: pass budget_bytes= or a catalog gpu= name")
        return spec.memory_bytes - spec.context_bytes
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * _MEMINFO_UNIT
    except OSError:
        pass
    raise ConfigError("cannot read the available host memory: pass budget_bytes= for device='cpu'")
