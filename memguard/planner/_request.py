"""A plan request: ``memguard.plan``'s options as one validated, frozen value, and their checks.

:class:`PlanRequest` holds every keyword option of :func:`memguard.plan`, with the same names and
defaults, so that the command line, the guard and the adapters build and check a request once and
hand it to :func:`memguard.planner.api.plan_request`, instead of each checking options itself::

    request = PlanRequest.from_options(global_batch_size=64, gpu="A100-80GB", precision="bf16-mixed")
    problems = request.problems()            # every invalid value, as sentences; [] when valid
    smaller = dataclasses.replace(request, global_batch_size=32)
    plan = plan_request(model, batch, request)

:meth:`PlanRequest.resolve` turns a valid request into the :class:`SearchSpace` the search runs
over: the GPU's spec, the precisions, checkpointing modes, ZeRO stages and offload settings to
consider, the budget, and the job's size; :meth:`PlanRequest.resolve_eval` does the same for an
evaluation step (``train=False``). Every option check of the planner lives here, and this module
imports nothing of the planner above it: the target is resolved once, by the estimator's
:func:`~memguard.estimator._targets.target_gpu` and :func:`~memguard.estimator._targets.target_cpu`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from memguard.batch import first_dim
from memguard.errors import ConfigError
from memguard.estimator._targets import STRATEGIES, target_cpu, target_gpu
from memguard.estimator.gpus import GENERIC
from memguard.planner._cache import PlanCache
from memguard.vocab import DEVICES, PRECISION_ALIASES, PRECISIONS, KiB, default_precisions

#: The share of the budget a plan keeps free: the estimator is within ~1% of the real CPU allocator;
#: the rest covers CUDA kernels' own workspaces, fragmentation from other work and the allocator
#: model's simplifications (memguard/planner/_search.py, module docstring).
DEFAULT_HEADROOM = 0.10
#: DeepSpeed's ZeRO stages (deepspeed/runtime/zero/config.py, ZeroStageEnum: 0 disabled to 3 weights).
ZERO_STAGES: tuple[int, ...] = (0, 1, 2, 3)
#: ``memguard.plan(..., finetune=...)``: None (the model as given), "full" (the model as given, and
#: when nothing fits the measured alternatives of :mod:`memguard.planner._finetune`), "lora" (plan
#: the LoRA variant), "qlora" (plan the QLoRA variant: a 4-bit NF4 base).
FINETUNE_CHOICES: tuple[str | None, ...] = (None, "full", "lora", "qlora")
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
        cache: True, or a :class:`memguard.planner._cache.PlanCache`, to reuse plans from disk.
        keep_outputs: True models a loop that keeps the model's output object alive through
            backward, the optimizer step and the next forward (``out = model(**batch)``).
        max_shape: plan for the worst-case batch of this shape instead of the example batch's:
            ``{"seq_len": L}`` and/or per-entry non-batch shapes (see :mod:`memguard.data`).
        train: True plans a training step; False an evaluation step
            (:func:`memguard.planner._eval_sizing.size_eval`).
        finetune: None (the model as given), ``"full"`` (the same, and measured fine-tuning
            alternatives when nothing fits), ``"lora"`` (plan a LoRA twin of the model) or ``"qlora"``
            (a QLoRA twin: 4-bit NF4 base, prepare_model_for_kbit_training, LoRA adapters); see
            :mod:`memguard.planner._finetune`.
        strategy: None = today's choice (DDP, or DeepSpeed ZeRO at ``zero_stage >= 1``); one of
            ``"ddp"``, ``"deepspeed"``, ``"fsdp2"`` fixes it; a sequence restricts the search to
            those. Under ``"fsdp2"`` ``zero_stage`` is FSDP2's sharding level (3 =
            ``reshard_after_forward=True``, 2 = ``False``, 1 = ``False`` with gradient sync on the
            last micro-batch only).
        cpu: for ``device="cpu"``, the CPU whose kernel paths are modelled: None or ``"host"``, or
            an instruction-set level (see :func:`memguard.estimate`).
        torch_version, cuda_version, cudnn_version: the CUDA target's software stack (see
            :func:`memguard.estimate`); None = the installed torch and its default wheel's CUDA and cuDNN.
        gradient_compression, powersgd: PowerSGD for DDP (see :func:`memguard.plan`).
        gpus_per_node: None plans ``world_size`` data-parallel ranks; a number searches parallel
            layouts of ``world_size`` GPUs in nodes of that many (:mod:`memguard.planner._layouts`):
            tensor parallelism inside a node, pipeline stages across nodes, FSDP2/DDP/HSDP over the
            rest; ``Plan.layout`` records the choice.
        verify_budget_s: with ``gpus_per_node``: the longest a verification trace of the chosen layout may
            be predicted to take (:func:`memguard.planner._layouts.trace_seconds`, from the model's op count);
            None = :data:`memguard.planner._layouts.VERIFY_BUDGET_S`, 0 = never verify, ``math.inf`` = always.
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
    torch_version: str | None = None
    cuda_version: str | None = None
    cudnn_version: str | int | None = None
    gradient_compression: str | None = None
    powersgd: Any = None
    gpus_per_node: int | None = None
    verify_budget_s: float | None = None

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

    def _versions(self) -> dict[str, Any]:
        return {"torch_version": self.torch_version, "cuda_version": self.cuda_version,
                "cudnn_version": self.cudnn_version}

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

    def resolve_eval(self, batch: Any) -> "SearchSpace":
        """What an evaluation plan (``train=False``) sizes over: the target, its budget, one precision.

        ``global_batch_size`` is the evaluation batch over all ranks, ``loss_fn`` the step's
        ``fn(model, batch) -> outputs`` and an ``optimizer`` means its state is resident (validation
        inside a training run). Knobs that only a training step has must be left at their defaults.

        Raises:
            ConfigError: a training-only knob was set (those first, all at once), or else every
                problem with the evaluation step, the target, the budget or ``batch``.
        """
        problems = self._eval_knob_problems()
        if problems:
            raise ConfigError(problems)
        precision = self.precision or "32-true"
        example = first_dim(batch)
        if example is None:
            problems.append("batch must hold at least one tensor with a batch dimension (dim 0)")
        if precision not in PRECISIONS:
            problems.append(f"precision={precision!r} must be one of {', '.join(PRECISIONS)} (the precision the "
                            "evaluation runs in)")
        from memguard.estimator._eval_step import _eval_problems

        problems.extend(_eval_problems(zero_stage=0, optimizer_state=self.optimizer is not None,
                                       grads_present=False, keep_outputs=self.keep_outputs,
                                       activation_checkpointing=0, grad_accum_steps=1, offload_optimizer=False,
                                       optimizer=self.optimizer))
        say = _speller(None)
        target = _job_problems(say, world=self.world_size, device=self.device, headroom=self.headroom,
                               budget=self.budget_bytes)
        spec = _target_spec(say, device=self.device, gpu=self.gpu, cpu=None, budget=self.budget_bytes,
                            versions=self._versions(),
                            problems=target)
        if precision in PRECISIONS:
            _check_bf16(say, spec, (precision,), target)
        problems.extend(target)
        if self.max_shape is not None and example is not None:
            problems.extend(shape_problems(batch, self.max_shape))
        if problems:
            raise ConfigError(problems)
        budget = _budget(self.device, spec, self.budget_bytes, problems)
        if problems:
            raise ConfigError(problems)
        return SearchSpace(
            spec=spec, precisions=(precision,), checkpointing=(False,), zero_stages=(0,), offloads=(False,),
            budget_bytes=int(budget), usable_bytes=int(budget * (1 - self.headroom)), explicit_precision=True,
            shardings=(("ddp", 0),), global_batch_size=self.global_batch_size, world_size=self.world_size,
            device=self.device, headroom=float(self.headroom), train=False,
        )

    # ------------------------------------------------------------------------------------------

    def _examine(self, spell: Mapping[str, str] | None) -> tuple[list[str], "SearchSpace | None"]:
        """Every problem of a training request, and its :class:`SearchSpace` when there is none.

        In order: the options' own values (:meth:`_value_problems`), the target (one GPU or CPU
        resolution, :func:`_target_spec`), the knobs' choices (:meth:`_knob_choices`), then the budget.
        """
        say = _speller(spell)
        problems = self._value_problems(say)
        spec = _target_spec(say, device=self.device, gpu=self.gpu, cpu=self.cpu, budget=self.budget_bytes,
                            versions=self._versions(),
                            problems=problems)
        knobs = self._knob_choices(say, spec, problems)
        compression = self.compression(problems)
        if problems:
            return problems, None
        if compression is not None:  # a DDP comm hook: plain DDP only (zero_stage=0, no offload)
            knobs = dataclasses.replace(knobs, zero_stages=(0,), offloads=(False,), shardings=(("ddp", 0),))
        budget = _budget(self.device, spec, self.budget_bytes, problems)
        if problems:
            return problems, None
        return [], SearchSpace(
            spec=spec, precisions=knobs.precisions, checkpointing=knobs.checkpointing, zero_stages=knobs.zero_stages,
            offloads=knobs.offloads, shardings=knobs.shardings,
            budget_bytes=int(budget), usable_bytes=int(budget * (1 - self.headroom)),
            explicit_precision=self.precision is not None, global_batch_size=self.global_batch_size,
            world_size=self.world_size, device=self.device, headroom=float(self.headroom),
        )

    def compression(self, problems: list[str]) -> Any:
        """The :class:`~memguard.estimator._powersgd.PowerSGDOptions` of ``gradient_compression=``/``powersgd=``
        (None: none), with its problems appended to ``problems`` (it needs DDP: ``world_size > 1``, and
        ``zero_stage`` 0 or None, ``strategy`` None or ``"ddp"``)."""
        from memguard.estimator._powersgd import check_ddp, resolve_options

        if self.gradient_compression is None and self.powersgd is None:
            return None
        try:
            options = resolve_options(self.gradient_compression, self.powersgd)
        except ConfigError as exc:
            problems.extend(exc.problems)
            return None
        stages = self.zero_stage if isinstance(self.zero_stage, (list, tuple)) else (self.zero_stage,)
        strategies = self.strategy if isinstance(self.strategy, (list, tuple)) else (self.strategy,)
        check_ddp(options, world_size=self.world_size, zero_stage=0 if 0 in stages or None in stages else stages[0],
                  strategy=None if (None in strategies or "ddp" in strategies) else strategies[0], problems=problems)
        return options

    def _value_problems(self, say: "_Say") -> list[str]:
        """The problems of each option's own value (types, ranges, the batch's split over the ranks)."""
        problems = _job_problems(say, world=self.world_size, device=self.device, headroom=self.headroom,
                                 budget=self.budget_bytes, global_batch_size=self.global_batch_size,
                                 split=self.gpus_per_node is None)
        problems.extend(self.layout_problems(say))
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
        problems.extend(finetune_problems(self.finetune, label=say("finetune")))
        if not isinstance(self.cache, (bool, PlanCache)):
            problems.append(f"{say('cache', self.cache)} must be True, False or a memguard.planner._cache.PlanCache")
        return problems

    def layout_problems(self, say: "_Say | None" = None) -> list[str]:
        """Why ``gpus_per_node=`` cannot be searched with the other options (empty when it can, or when unset)."""
        say = say or _speller(None)
        k, world = self.gpus_per_node, self.world_size
        budget = self.verify_budget_s
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                                   or math.isnan(budget) or budget < 0):
            return [f"{say('verify_budget_s', budget)} must be a number of seconds >= 0 (0: never verify, "
                    f"math.inf: always), or None for the default"]
        if k is None:
            if budget is not None:
                return [f"{say('verify_budget_s', budget)} bounds the layout search's verification: give "
                        f"{say('gpus_per_node')} too, or drop it (a plan without layouts is always verified)"]
            return []
        if not _is_int(k) or k < 1:
            return [f"{say('gpus_per_node', k)} must be an integer >= 1 (the GPUs of one node), e.g. 8"]
        problems = []
        if _is_int(world) and world >= 1 and world > k and world % k:
            fewer, more = world - world % k, world + k - world % k
            problems.append(
                f"{say('world_size', world)} is not a whole number of nodes of {say('gpus_per_node', k)}: use "
                f"{say('world_size')} {fewer} or {more}, or a {say('gpus_per_node')} that divides {world} "
                f"({', '.join(str(d) for d in range(1, min(world, 64) + 1) if world % d == 0)})")
        stages = self.zero_stage if isinstance(self.zero_stage, (list, tuple)) else (self.zero_stage,)
        bad_stages = [z for z in stages if z not in (None, 0, 3)]
        if bad_stages:
            problems.append(f"{say('gpus_per_node')} searches FSDP2 at sharding level 3 and DDP: drop "
                            f"{say('zero_stage', self.zero_stage)} or use 0 or 3")
        strategies = self.strategy if isinstance(self.strategy, (list, tuple)) else (self.strategy,)
        if any(st not in (None, "ddp", "fsdp2") for st in strategies):
            problems.append(f"{say('gpus_per_node')} lays out FSDP2 ('fsdp2') and DDP ('ddp') with tensor and "
                            f"pipeline parallelism: drop {say('strategy', self.strategy)} or use 'fsdp2'/'ddp'")
        if self.offload_optimizer not in (False, None):
            problems.append(f"{say('gpus_per_node')} does not search optimizer offload: drop {say('offload_optimizer')}")
        for name, default in (("gradient_compression", None), ("powersgd", None), ("finetune", None),
                              ("keep_outputs", False), ("max_shape", None)):
            if getattr(self, name) != default:
                problems.append(f"{say('gpus_per_node')} does not plan with {say(name, getattr(self, name))} yet: "
                                f"drop one of them")
        if self.train is False:
            problems.append(f"{say('gpus_per_node')} plans training steps: drop it to plan an evaluation step")
        return problems

    def _knob_choices(self, say: "_Say", spec: Any, problems: list[str]) -> "_Knobs":
        """The precisions, checkpointing modes, offloads, ZeRO stages and shardings to consider.

        A knob left at None gets its default choices; a value fixes it; a sequence restricts it.
        Invalid values and combinations that leave nothing to search are added to ``problems``.
        """
        device, world = self.device, self.world_size
        defaults = default_precisions(device if device in DEVICES else "cpu", spec)
        precisions = tuple(
            PRECISION_ALIASES.get(p, p) if isinstance(p, str) else p
            for p in _choices(say("precision", self.precision), self.precision, defaults,
                              PRECISIONS + tuple(PRECISION_ALIASES), problems)
        )
        if self.precision is not None:
            _check_bf16(say, spec, precisions, problems)
        ckpts = _choices(say("activation_checkpointing", self.activation_checkpointing),
                         self.activation_checkpointing, (False, True), (False, True), problems)
        offloads = _choices(say("offload_optimizer", self.offload_optimizer), self.offload_optimizer,
                            (False, True), (False, True), problems)
        multi = _is_int(world) and world > 1
        strategies = _choices(say("strategy", self.strategy), self.strategy, ("ddp", "deepspeed"), STRATEGIES,
                              problems)
        sharded = self.strategy is not None and any(s in ("deepspeed", "fsdp2", "fsdp1") for s in strategies)
        # ZeRO stages are worth considering on one device only with offload (ZeRO-Offload's use case,
        # arXiv 2101.06840: a single GPU training with the optimizer on the host), or when a sharding
        # strategy is asked for by name
        default_zeros = ZERO_STAGES if multi or sharded else ((1, 2) if offloads == (True,) else (0,))
        zeros = _choices(say("zero_stage", self.zero_stage), self.zero_stage, default_zeros, ZERO_STAGES, problems)
        combos = tuple((s, z) for s in strategies for z in zeros  # FSDP1 has no level 1 (nor a planned NO_SHARD)
                       if isinstance(z, int) and ((z == 0) == (s == "ddp")) and not (s == "fsdp1" and z == 1))
        if not problems and not combos:
            problems.append(
                f"no sharding fits both {say('strategy', self.strategy)} and {say('zero_stage', self.zero_stage)}: "
                "'ddp' runs zero_stage 0, 'deepspeed' 1-3 (ZeRO), 'fsdp2' 1-3 (its sharding level), 'fsdp1' 2-3 "
                "(SHARD_GRAD_OP, FULL_SHARD)")
        elif offloads == (True,) and not any(z >= 1 for _, z in combos):
            problems.append(f"{say('offload_optimizer', True)} needs a ZeRO stage >= 1: pass "
                            f"{say('zero_stage', 1)}, 2 or 3")
        for fsdp in ("fsdp2", "fsdp1"):
            import torch.distributed as dist

            if fsdp in strategies and not dist.is_available():
                problems.append(f"{say('strategy', fsdp)} needs torch.distributed, which this torch build lacks")
        return _Knobs(precisions, ckpts, offloads, zeros, combos)

    def _eval_knob_problems(self) -> list[str]:
        """The options an evaluation plan refuses: the training-only knobs, several precisions, and a
        ``global_batch_size`` that is not the evaluation batch over all ranks."""
        problems = []
        for name, default in (("activation_checkpointing", (None, False)), ("zero_stage", (None, 0)),
                              ("offload_optimizer", (None, False)), ("make_batch", (None,)), ("cache", (False,))):
            value = getattr(self, name)
            if not any(value is d for d in default):
                problems.append(f"{name}={value!r} does not apply to an evaluation plan (train=False); drop it")
        problems.extend(f"{name}={getattr(self, name)!r} does not apply to an evaluation plan (train=False); drop it"
                        for name in ("finetune", "strategy", "cpu") if getattr(self, name) is not None)
        if isinstance(self.precision, (list, tuple)):
            problems.append(f"precision={self.precision!r}: an evaluation plan takes one precision, the one "
                            "evaluation runs in")
        gbs, world = self.global_batch_size, self.world_size
        if not (isinstance(gbs, int) and gbs >= 1):
            problems.append(f"global_batch_size={gbs!r} must be a positive int (the evaluation batch over all ranks)")
        elif isinstance(world, int) and world >= 1 and gbs % world:
            problems.append(f"global_batch_size={gbs} is not divisible by world_size={world}")
        return problems


#: The option names of :func:`memguard.plan` and :class:`PlanRequest`, in signature order.
OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(PlanRequest))


@dataclass(frozen=True)
class SearchSpace:
    """A valid request resolved: what the search (or, with ``train=False``, the evaluation sizing) runs over.

    Attributes:
        spec: the CUDA target's :class:`~memguard.estimator.gpus.GPUSpec` (None on the CPU).
        precisions: the precisions to consider, the default order or the user's (one for evaluation).
        checkpointing: False and/or True.
        zero_stages: the ZeRO stages to consider.
        offloads: False and/or True.
        budget_bytes: bytes per rank before headroom.
        usable_bytes: ``budget_bytes`` less the headroom: what a plan's estimate must stay under.
        explicit_precision: the user fixed or restricted the precision.
        shardings: the ``(strategy, zero_stage)`` pairs to consider: ``("ddp", 0)``,
            ``("deepspeed", 1-3)``, ``("fsdp2", 1-3)``.
        global_batch_size: samples per optimizer step over all ranks (evaluation: the evaluation
            batch over all ranks).
        world_size: data-parallel ranks.
        device: ``"cuda"`` or ``"cpu"``.
        headroom: the share of ``budget_bytes`` kept free.
        train: True for a training step, False for an evaluation step.
    """

    spec: Any
    precisions: tuple[str, ...]
    checkpointing: tuple[bool, ...]
    zero_stages: tuple[int, ...]
    offloads: tuple[bool, ...]
    budget_bytes: int
    usable_bytes: int
    explicit_precision: bool
    shardings: tuple[tuple[str, int], ...]
    global_batch_size: int
    world_size: int
    device: str
    headroom: float
    train: bool = True

    @property
    def per_rank(self) -> int:
        """Samples per step on one rank: ``global_batch_size / world_size``."""
        return self.global_batch_size // self.world_size


@dataclass(frozen=True)
class _Knobs:
    """The choices of each knob of a training request (see :meth:`PlanRequest._knob_choices`)."""

    precisions: tuple[str, ...]
    checkpointing: tuple[bool, ...]
    offloads: tuple[bool, ...]
    zero_stages: tuple[int, ...]
    shardings: tuple[tuple[str, int], ...]


#: ``say(name)`` or ``say(name, value)``: an option named for the one who reads the sentence.
_Say = Callable[..., str]


def _speller(spell: Mapping[str, str] | None) -> _Say:
    """How sentences name options: ``spell``'s names (``"--budget 0"``), else Python's (``budget_bytes=0``)."""
    def say(name: str, value: Any = dataclasses.MISSING) -> str:
        if spell is not None and name in spell:
            return spell[name] if value is dataclasses.MISSING else f"{spell[name]} {value}"
        return name if value is dataclasses.MISSING else f"{name}={value!r}"

    return say


def finetune_problems(value: Any, *, label: str = "finetune") -> list[str]:
    """Sentences for an invalid ``finetune=`` value (empty when valid), for ``PlanRequest.problems``."""
    if value in FINETUNE_CHOICES:
        return []
    return [f"{label}={value!r} must be None (the model as given), 'full' (full fine-tuning; when nothing "
            "fits, memguard measures LoRA, QLoRA, 8-bit optimizer, bf16-true and offload alternatives), 'lora' or "
            "'qlora'"]


def _job_problems(say: _Say, *, world: Any, device: Any, headroom: Any, budget: Any,
                  global_batch_size: Any = dataclasses.MISSING, split: bool = True) -> list[str]:
    """The problems of the job's size and budget: ranks, device, headroom, budget and, when given,
    the global batch and its split over the ranks."""
    problems: list[str] = []
    gbs, has_gbs = global_batch_size, global_batch_size is not dataclasses.MISSING
    if has_gbs and (not _is_int(gbs) or gbs < 1):
        problems.append(f"{say('global_batch_size', gbs)} must be an integer >= 1")
    if not _is_int(world) or world < 1:
        problems.append(f"{say('world_size', world)} must be an integer >= 1 (the number of data-parallel ranks)")
    if device not in DEVICES:
        problems.append(f"{say('device', device)} must be one of {', '.join(map(repr, DEVICES))}")
    if split and has_gbs and _is_int(gbs) and _is_int(world) and gbs >= 1 and world >= 1 and gbs % world:
        problems.append(
            f"global_batch_size {gbs} cannot be split evenly over world_size {world}; use a multiple of "
            f"{world} (e.g. {gbs - gbs % world or world}) for {say('global_batch_size')}"
        )
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not 0 <= headroom < 1:
        problems.append(f"{say('headroom', headroom)} must be a fraction in [0, 1), e.g. 0.1 for 10%")
    if budget is not None and (not _is_int(budget) or budget <= 0):
        problems.append(f"{say('budget_bytes', budget)} must be a positive integer number of bytes")
    return problems


def _target_spec(say: _Say, *, device: Any, gpu: Any, cpu: Any, budget: Any, problems: list[str],
                 versions: Mapping[str, Any] | None = None) -> Any:
    """The CUDA target's GPU spec (None on the CPU, or when it cannot be resolved), the CPU target checked.

    The one resolution is the estimator's (:func:`memguard.estimator._targets.target_gpu`: ``gpu``, else
    the current device, else the generic spec, which a plan accepts only with ``budget_bytes``, and
    :func:`~memguard.estimator._targets.target_cpu`); an option given for the other device is a problem.
    """
    spec = None
    if device == "cuda":
        spec = target_gpu(device, gpu, problems, **(versions or {}))
        if gpu is None and spec is not None and spec.name == GENERIC.name and budget is None:  # no CUDA device here, and no budget
            spec = None
            problems.append(
                f"no CUDA device here: name the target with {say('gpu', 'A100-80GB')} "
                f"(`memguard gpus` lists them) or give {say('budget_bytes')}, or plan for "
                f"{say('device', 'cpu')}"
            )
    else:
        if gpu is not None:
            problems.append(f"{say('gpu', gpu)} only applies to {say('device', 'cuda')}; drop it")
        target_gpu(device, None, problems, **(versions or {}))  # versions given for the CPU
    if device == "cpu":
        target_cpu(device, cpu, problems)
    elif cpu is not None:
        problems.append(f"{say('cpu', cpu)} only applies to {say('device', 'cpu')}; drop it")
    return spec


def _check_bf16(say: _Say, spec: Any, precisions: Sequence[Any], problems: list[str]) -> None:
    """A problem when a GPU without native bf16 is asked for a bf16 precision."""
    if spec is not None and not spec.bf16:
        bad = [p for p in precisions if isinstance(p, str) and p.startswith("bf16")]
        if bad:
            problems.append(f"{spec.name} has no native bf16: use {say('precision', '16-mixed')} or "
                            f"'32-true', not {', '.join(bad)}")


def _budget(device: str, spec: Any, budget: int | None, problems: list[str]) -> int | None:
    """``budget``, else the target's default (:func:`_default_budget`; when it cannot be read, a problem)."""
    if budget is not None:
        return budget
    try:
        return _default_budget(device, spec)
    except ConfigError as exc:
        problems.extend(exc.problems)
        return None


def shape_problems(batch: Any, max_shape: Any) -> list[str]:
    """Why the worst-case batch of ``max_shape`` cannot be made from ``batch`` (empty when it can)."""
    from memguard.data import planning_batch

    try:
        planning_batch(batch, max_shape)
    except ConfigError as exc:
        return list(exc.problems)
    return []


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
