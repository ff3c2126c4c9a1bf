"""What a front-end fixes and what its user asked for, checked before anything runs.

Every front-end (:func:`memguard.prepare`, the Lightning and transformers callbacks, the
Accelerate hooks) describes its framework in a :class:`Constraints` and checks its user's
arguments with :func:`option_problems`, which lists every problem at once (one
:class:`memguard.ConfigError` per call). What survives the checks travels to the guard as one
:class:`GuardOptions`. This module is also the guard's one door to the planner:
:func:`plan_options_problems` checks planning options and :func:`call_planner` plans, both through
one :class:`memguard.planner._request.PlanRequest` builder.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from memguard.batch import LossFn
from memguard.errors import ConfigError
from memguard.guard._window import DEFAULT_MAX_RETRIES
from memguard.planner.api import Plan
from memguard.planner.api import PlanRequest
from memguard.planner.api import plan_request
from memguard.vocab import PRECISIONS

#: Wrappers whose forward cannot be bypassed the way DDP's can: they need their own front-end.
UNSUPPORTED_WRAPPERS = {
    "FullyShardedDataParallel": "FSDP shards parameters inside its forward; memguard supports a plain module or one "
    "wrapped in DistributedDataParallel",
    "FSDPModule": "FSDP2 shards parameters inside its forward; pass strategy='fsdp2' to memguard.prepare to train a "
    "fully_shard model, or pass a plain module or one wrapped in "
    "DistributedDataParallel",
    "DeepSpeedEngine": "DeepSpeed runs its own step; turn the plan into a DeepSpeed config with "
    "memguard.integrations.deepspeed.to_config instead, or, under ZeRO-0/1 with "
    "\"managed_gradient_accumulation\": false, run each step with memguard.integrations.deepspeed.step",
}

#: How a front-end runs a precision: memguard does all of it ("guard": casts ``*-true`` weights,
#: autocasts, scales the loss), only the cast of ``*-true`` weights ("weights": the framework
#: autocasts and scales), or nothing ("framework").
PRECISION_ROLES = ("guard", "weights", "framework")


@dataclass(frozen=True)
class Constraints:
    """What a front-end fixes, for planning and for checking a given plan.

    Attributes:
        source: what fixes them, as messages name it (``"memguard.prepare"``, ``"the Trainer"``,
            ``"the Accelerator"``).
        taken: plan options the front-end supplies itself (a user passing one is told to drop it).
        zero_stages: the ZeRO stages (sharding levels) it can run.
        offload_optimizer: whether it can offload the optimizer.
        precisions: the precisions it runs, its own first; planning is fixed to the first. None:
            any of :data:`memguard.vocab.PRECISIONS`, chosen by the planner or the user.
        world_size: the ranks a given plan must be made for; None: not checked.
        grad_accum_steps: the accumulation a given plan must have; None: not checked.
        fix_plan: how to make a given plan match (appended to precision/accumulation problems).
        fix_precision: how to change the front-end's precision (appended to precision problems).
        precision_role: one of :data:`PRECISION_ROLES`.
        strategies: the parallel strategies the front-end runs (``"ddp"``, ``"deepspeed"``,
            ``"fsdp2"``), passed to the planner as ``strategy=`` (one as a value, several as a list)
            when the planner takes that option; None: not passed, the planner's default.
        splits_batch: memguard splits each batch the front-end gets into the plan's micro-batches
            (the plan's accumulation is memguard's, which the plan summary names as an override).
    """

    source: str = "memguard.prepare"
    taken: tuple[str, ...] = ()
    zero_stages: tuple[int, ...] = (0,)
    offload_optimizer: bool = False
    precisions: tuple[str, ...] | None = None
    world_size: int | None = None
    grad_accum_steps: int | None = None
    fix_plan: str = "plan again with memguard.plan()"
    fix_precision: str = ""
    precision_role: str = "guard"
    strategies: tuple[str, ...] | None = None
    splits_batch: bool = False

    def __post_init__(self) -> None:
        if self.precision_role not in PRECISION_ROLES:
            raise ConfigError(f"precision_role must be one of {', '.join(PRECISION_ROLES)}, got {self.precision_role!r}")

    def planning_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """``options`` with what the front-end fixes: its precision, ZeRO stages, offload and strategies."""
        out = dict(options)
        if self.precisions is not None:
            out["precision"] = self.precisions[0]
        if self.strategies is not None:
            out["strategy"] = self.strategies[0] if len(self.strategies) == 1 else list(self.strategies)
        out.setdefault("zero_stage", self.zero_stages[0] if len(self.zero_stages) == 1 else list(self.zero_stages))
        if not self.offload_optimizer:
            out.setdefault("offload_optimizer", False)
        return out


def clipping(value: float | None) -> float | None:
    """A clipping threshold as the guard applies it: 0 means no clipping, as nanoGPT's ``grad_clip=0.0``, the HF
    Trainer's ``max_grad_norm=0`` (``Trainer._inner_training_loop`` clips only ``if args.max_grad_norm > 0``) and
    Lightning's ``gradient_clip_val=0`` (``Precision.clip_gradients`` returns when ``clip_val <= 0``) mean it.
    Unlike ``torch.nn.utils.clip_grad_norm_(max_norm=0)``, which scales every gradient to zero."""
    return None if value is not None and value == 0 else value


def given_options(plan_options: Mapping[str, Any], **named: Any) -> dict[str, Any]:
    """A callback's planning options: its named, typed parameters that were given (not None), then ``**plan_options``.

    The Lightning and Trainer callbacks name the common :func:`memguard.plan` options as parameters of their own
    (typed and documented, so that LightningCLI and jsonargparse can see and check them); None there means "not
    given" (the planner's default applies). The rest still come as ``**plan_options``.
    """
    return {**{k: v for k, v in named.items() if v is not None}, **plan_options}


def _is_int(value: Any, least: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= least


def _as_tuple(value: Any) -> tuple[Any, ...]:
    return tuple(value) if isinstance(value, (list, tuple, set, frozenset)) else (value,)


def model_and_optimizer(first: Any, second: Any, problems: list[str]) -> tuple[nn.Module | None, Any]:
    """The model and the optimizer of ``prepare(first, second)``, given in either order; ``(None, None)``
    with a problem appended to ``problems`` when they are not one ``nn.Module`` and one optimizer."""
    pair = (first, second)
    models = [x for x in pair if isinstance(x, nn.Module)]
    optimizers = [x for x in pair if isinstance(x, torch.optim.Optimizer)]
    if len(models) != 1 or len(optimizers) != 1:
        problems.append(
            "prepare takes the model (an nn.Module) and its optimizer (a torch.optim.Optimizer), in either "
            f"order; got {type(first).__name__} and {type(second).__name__}"
        )
        return None, None
    return models[0], optimizers[0]


def wrapper_problems(model: Any) -> list[str]:
    """A problem if ``model`` is a wrapper memguard's guard cannot run (FSDP, DeepSpeed)."""
    for cls in type(model).__mro__:
        if cls.__name__ in UNSUPPORTED_WRAPPERS:
            return [UNSUPPORTED_WRAPPERS[cls.__name__]]
    return []


def plan_problems(plan: Plan, constraints: Constraints) -> list[str]:
    """Every reason ``plan`` cannot run on the front-end of ``constraints``."""
    c = constraints
    out = []
    if plan.zero_stage not in c.zero_stages:
        out.append(f"the plan uses ZeRO stage {plan.zero_stage}, which {c.source} cannot apply (it runs stage "
                   f"{', '.join(map(str, c.zero_stages))}); run it with DeepSpeed "
                   "(memguard.integrations.deepspeed.to_config) or plan with zero_stage=0")
    if plan.offload_optimizer and not c.offload_optimizer:
        out.append(f"the plan offloads the optimizer, which {c.source} cannot do (DeepSpeed can); plan with "
                   "offload_optimizer=False")
    if plan.precision not in PRECISIONS:
        out.append(f"the plan's precision {plan.precision!r} is not one of {', '.join(PRECISIONS)}")
    elif c.precisions is not None and plan.precision not in c.precisions:
        fix = c.fix_precision or c.fix_plan
        out.append(f"the plan's precision {plan.precision!r} differs from {c.source}'s {c.precisions[0]!r}; {fix}, "
                   f"or plan with precision={c.precisions[0]!r}")
    if c.grad_accum_steps is not None and plan.grad_accum_steps != c.grad_accum_steps:
        out.append(f"the plan accumulates {plan.grad_accum_steps} micro-batches but {c.source} accumulates "
                   f"{c.grad_accum_steps}; {c.fix_plan}")
    if c.world_size is not None and plan.world_size != c.world_size:
        out.append(f"the plan was made for {plan.world_size} processes but {c.source} runs {c.world_size}; plan "
                   f"with world_size={c.world_size}")
    return out


def _request(options: Mapping[str, Any], **filled: Any) -> PlanRequest:
    """The :class:`PlanRequest` of the user's ``options`` and what the guard fills in.

    The one place that builds planner requests, for :func:`plan_options_problems` and :func:`call_planner`.

    Raises:
        ConfigError: an unknown option name (the message lists the accepted ones).
    """
    return PlanRequest.from_options(**{**options, **filled})


def plan_options_problems(options: Mapping[str, Any]) -> list[str]:
    """Every problem with the user's options for :func:`memguard.plan`: unknown names and invalid values.

    Checked before a batch is seen, so the values the guard fills in later stand in: one sample per
    step, and ``device="cpu"`` unless given (the CUDA checks run when the planner gets the request).
    """
    # with gradient compression the front-end has checked already that DDP runs over several ranks
    ranks = {"world_size": 2, "global_batch_size": 2} if options.get("gradient_compression") else {}
    try:
        request = _request(options, **{"global_batch_size": 1, "device": options.get("device", "cpu"), **ranks})
    except ConfigError as exc:
        return list(exc.problems)
    return request.problems()


def call_planner(model: nn.Module, batch: Any, *, global_batch_size: int, optimizer: Any, loss_fn: LossFn | None,
                 world_size: int, options: Mapping[str, Any]) -> Plan:
    """:func:`memguard.plan` with the guard's arguments and the user's (checked) options."""
    request = _request(options, global_batch_size=global_batch_size, optimizer=optimizer, loss_fn=loss_fn,
                       world_size=world_size)
    return plan_request(model, batch, request)


def option_problems(constraints: Constraints, *, plan: Any = None, micro_batch_size: Any = None,
                    example_batch: Any = None, global_batch_size: Any = None, loss_fn: Any = None,
                    max_retries: Any = DEFAULT_MAX_RETRIES, probe_up_after: Any = None, max_grad_norm: Any = None,
                    clip_grad_value: Any = None, batch_dim: Any = 0, verbose: Any = True,
                    plan_options: Mapping[str, Any] | None = None) -> list[str]:
    """Every problem with a front-end's guard arguments, one sentence each.

    Exactly one of ``plan``, ``micro_batch_size`` and ``example_batch`` may set the micro-batch;
    ``plan_options`` are checked as planning options (or, with ``micro_batch_size``, as the
    ``precision`` and ``activation_checkpointing`` of a fixed micro-batch), and against what
    ``constraints`` fixes.
    """
    c = constraints
    options = dict(plan_options or {})
    out: list[str] = []
    sources = [name for name, v in (("plan", plan), ("micro_batch_size", micro_batch_size),
                                     ("example_batch", example_batch)) if v is not None]
    if len(sources) > 1:
        out.append(f"pass only one of {' / '.join(s + '=' for s in sources)}: each sets the micro-batch")
    if plan is not None and not isinstance(plan, Plan):
        out.append(f"plan must be a memguard.Plan, got {type(plan).__name__}; build it with memguard.plan()")
    if micro_batch_size is not None and not _is_int(micro_batch_size, 1):
        out.append(f"micro_batch_size must be a positive int, got {micro_batch_size!r}")
    if global_batch_size is not None and not _is_int(global_batch_size, 1):
        out.append(f"global_batch_size must be a positive int, got {global_batch_size!r}")
    if loss_fn is not None and not callable(loss_fn):
        out.append("loss_fn must be callable as loss_fn(model, batch) -> mean loss")
    if not _is_int(max_retries, 0):
        out.append(f"max_retries must be an int >= 0, got {max_retries!r}")
    if probe_up_after is not None and not _is_int(probe_up_after, 1):
        out.append(f"probe_up_after must be None or an int >= 1, got {probe_up_after!r}")
    for name, value in (("max_grad_norm", max_grad_norm), ("clip_grad_value", clip_grad_value)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0):
            out.append(f"{name} must be None, 0 (no clipping) or a positive number, got {value!r}")
    if not _is_int(batch_dim, 0):
        out.append(f"batch_dim must be an int >= 0 (the dim of each batch tensor that holds the samples), got "
                   f"{batch_dim!r}")
    if not isinstance(verbose, bool):
        out.append(f"verbose must be True or False, got {verbose!r}")
    taken = sorted(k for k in options if k in c.taken)
    if taken:
        out.append(f"{', '.join(taken)} come from {c.source} and its arguments; drop them")
        options = {k: v for k, v in options.items() if k not in c.taken}
    if isinstance(plan, Plan):
        out += plan_problems(plan, c)
        if options:
            out.append(f"{', '.join(sorted(options))} only apply when memguard plans; drop them or plan=")
        if global_batch_size is not None and global_batch_size != plan.global_batch_size:
            out.append(f"global_batch_size {global_batch_size} differs from the plan's {plan.global_batch_size}")
    elif micro_batch_size is not None:
        out += _fixed_options_problems(options)
    else:
        out += _planning_problems(options, c)
    return out


def _fixed_options_problems(options: Mapping[str, Any]) -> list[str]:
    out = []
    extra = sorted(set(options) - {"precision", "activation_checkpointing"})
    if extra:
        out.append(f"{', '.join(extra)} only apply when memguard plans; drop micro_batch_size= to plan, or drop them")
    p = options.get("precision", "32-true")
    if p not in PRECISIONS:
        out.append(f"with micro_batch_size=, precision must be one of {', '.join(PRECISIONS)}, got {p!r}")
    ac = options.get("activation_checkpointing", False)
    if not isinstance(ac, (bool, int)) or (not isinstance(ac, bool) and ac < 0):
        out.append("with micro_batch_size=, activation_checkpointing must be True/False or a number of blocks, "
                   f"got {ac!r}")
    return out


def _planning_problems(options: Mapping[str, Any], c: Constraints) -> list[str]:
    out = []
    stages = [s for s in _as_tuple(options.get("zero_stage", c.zero_stages[0])) if s not in c.zero_stages]
    if stages:
        hint = (" (write the plan into a DeepSpeed config with memguard.integrations.deepspeed.to_config for ZeRO, "
                "or pass strategy='fsdp2' to memguard.prepare)" if c.zero_stages == (0,) else "")
        out.append(f"zero_stage={options['zero_stage']!r} is not run by {c.source}: it runs stage "
                   f"{', '.join(map(str, c.zero_stages))}{hint}")
    if options.get("offload_optimizer") and not c.offload_optimizer:
        out.append(f"offload_optimizer=True needs DeepSpeed: {c.source} does not offload the optimizer")
    if "train" in options:
        out.append(f"train={options['train']!r} is not a guard option: {c.source} guards training steps; an "
                   "evaluation batch that may not fit runs through memguard.evaluate(model, batch)")
    if options.get("finetune") == "lora":
        out.append(f"finetune='lora' plans a LoRA twin of the model, which {c.source} cannot apply to the model "
                   "it was given: wrap the model with peft.get_peft_model first and pass that model")
    if options.get("finetune") == "qlora":
        out.append(f"finetune='qlora' plans a 4-bit QLoRA twin of the model, which {c.source} cannot apply to the "
                   "model it was given: load it with BitsAndBytesConfig(load_in_4bit=True), prepare it with "
                   "peft.prepare_model_for_kbit_training and get_peft_model, and pass that model")
    wanted = options.get("precision")
    if wanted is not None and c.precisions is not None and c.precisions[0] not in _as_tuple(wanted):
        fix = f"{c.fix_precision} or drop the option" if c.fix_precision else "drop the option"
        out.append(f"precision={wanted!r} was asked for but {c.source} runs {c.precisions[0]!r}; memguard does not "
                   f"change {c.source}'s precision: {fix}")
    return out + plan_options_problems(options)



@dataclass(frozen=True)
class GuardOptions:
    """The user's guard options of one front-end (checked by :func:`option_problems`), as the guard keeps them.

    Attributes:
        loss_fn: the default loss function (None: the model's ``.loss``).
        max_retries: at most this many halvings within one optimizer step.
        probe_up_after: double a reduced micro-batch again after this many clean steps (None: never).
        max_grad_norm: clip the accumulated gradients' total norm to this before each optimizer step
            (None or 0: no clipping; 0 is kept as None).
        clip_grad_value: clip each accumulated gradient element to ``[-v, v]`` before each optimizer
            step, after any norm clipping (None or 0: no clipping).
        batch_dim: the dim of the batch's tensors that holds the samples (split and counted along it).
        verbose: show the plan summary when a plan is applied (``MEMGUARD_QUIET=1`` silences it too).
        global_batch_size: samples per optimizer step for planning (None: from the batch).
        plan_options: the user's options for :func:`memguard.plan`.
        sync_gradients: memguard averages the gradients over the ranks (False: the framework's DDP
            reducer does, through :meth:`memguard.guard._core.Guard.anchor`, or FSDP2 does).
    """

    loss_fn: LossFn | None = None
    max_retries: int = DEFAULT_MAX_RETRIES
    probe_up_after: int | None = None
    max_grad_norm: float | None = None
    clip_grad_value: float | None = None
    batch_dim: int = 0
    verbose: bool = True
    global_batch_size: int | None = None
    plan_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    sync_gradients: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "plan_options", dict(self.plan_options or {}))  # the guard's own copy
        object.__setattr__(self, "max_grad_norm", clipping(self.max_grad_norm))
        object.__setattr__(self, "clip_grad_value", clipping(self.clip_grad_value))
