"""Fine-tuning knobs: what to change when a full fine-tune does not fit, each one measured.

When no configuration of micro-batch, accumulation, precision, checkpointing and ZeRO fits, the
usual answer for fine-tuning a large model on one GPU is not "more GPUs" but one of:

* **LoRA** (Hu et al. 2021, arXiv 2106.09685): the base weights frozen (and held in 16 bits), small
  trainable low-rank adapters on the linear layers of every repeated block.
  :func:`memguard.estimator._twins.lora_model`
  builds that model with ``peft`` on the ``meta`` device from a twin of the user's model (the
  user's model is never touched), choosing the target modules from the architecture: every
  ``nn.Linear`` (and transformers' ``Conv1D``) inside the repeated blocks, which is ``q/k/v/o_proj``
  plus ``gate/up/down_proj`` for Llama-style models and ``c_attn``/``c_proj``/``c_fc`` for GPT-2:
  the QLoRA paper (Dettmers et al. 2023, arXiv 2305.14314, section 4) found adapters on every
  linear layer of the blocks necessary to match full fine-tuning.
* **QLoRA**: LoRA on 4-bit NormalFloat base weights (same paper), as transformers'
  ``BitsAndBytesConfig`` and ``peft.prepare_model_for_kbit_training`` leave the model: a stand-in
  for bitsandbytes' ``Linear4bit`` (:class:`memguard.estimator._nf4.NF4Linear`) holds its bytes
  where it holds them and allocates what it allocates; :func:`finetune_variant` plans it for
  ``memguard.plan(..., finetune="qlora")``.
* **An 8-bit optimizer** (Dettmers et al. 2021, arXiv 2110.02861): bitsandbytes' ``AdamW8bit``
  keeps both Adam moments in 8 bits with one fp32 scale per block.
  :class:`memguard.estimator._twins.AdamW8bitStandIn`
  holds exactly the state bytes bitsandbytes' source allocates.
* **bf16-true**: weights, gradients and optimizer state in bfloat16 (half of 32-bit's bytes), with
  a numerical caveat (:data:`BF16_TRUE_NOTE`).
* **CPU offload** (ZeRO-Offload, Ren et al. 2021, arXiv 2101.06840): optimizer state and step in
  host memory.

:func:`alternatives` plans each of them with the planner's front door, passed in as ``plan_with``
(every figure is a traced estimate, verified with one full trace when it fits) and returns them as :class:`Alternative`
records, smallest predicted peak first. :func:`finetune_variant` is what
``memguard.plan(..., finetune="lora")`` plans instead of the user's model. The stand-in models and
optimizers are model surgery for estimation and live in :mod:`memguard.estimator._twins`; this
module only decides which of them to plan, with which request.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from memguard.errors import ConfigError, InfeasiblePlanError, MissingDependencyError
from memguard.estimator._nf4 import has_4bit_layers
from memguard.estimator._targets import unwrap_model
from memguard.estimator._twins import (
    LORA_RANK,
    AdamW8bitStandIn,
    _is_peft,
    _target_names,
    checkpointed_inside,
    lora_model,
    lora_target_modules,
    qlora_model,
)
from memguard.planner._request import FINETUNE_CHOICES, finetune_problems
from memguard.planner._session import TraceSession
from memguard.vocab import format_bytes

#: The numerics of ``bf16-true`` in one line. bfloat16 has 8 significant bits (7 stored + 1 implicit),
#: so round-to-nearest drops an update smaller than half a unit in the last place, about 2^-8 of the
#: weight (Zamirai et al. 2020, "Revisiting BFloat16 Training", arXiv 2010.06192).
BF16_TRUE_NOTE = (
    "pure bf16 weights keep 8 significant bits: an update smaller than ~2^-8 of a weight rounds away "
    "(arXiv 2010.06192), so small learning rates stall; keep fp32 master weights (bf16-mixed), or use "
    "stochastic rounding / Kahan summation"
)


# ---------------------------------------------------------------------------------------------- data
@dataclass(frozen=True)
class Alternative:
    """One way to make a fine-tune fit, measured with memguard's planner.

    Attributes:
        name: short name: ``"lora"``, ``"qlora"``, ``"adamw8bit"``, ``"bf16-true"``, ``"cpu-offload"``.
        change: what to change in the training script, one sentence.
        predicted_peak_bytes: the predicted peak per rank, its upper bound (``Estimate.peak_upper_bytes``
            of the plan's verified estimate when it fits, else of the closest configuration's), or None when it could not be measured (e.g.
            ``peft`` missing; ``note`` says why).
        fits: a plan fits the budget with this change.
        note: what else to know (numerics, host memory, paging, how it was modelled).
        plan: the plan when it fits, else None.
    """

    name: str
    change: str
    predicted_peak_bytes: int | None
    fits: bool
    note: str
    plan: Any = None

    def line(self, usable_bytes: int | None = None) -> str:
        """One line for ``InfeasiblePlanError.suggestions`` and ``Plan.explain()``."""
        if self.predicted_peak_bytes is None:
            peak = "not measured"
        else:
            room = f" of {format_bytes(usable_bytes)} usable" if usable_bytes else ""
            verdict = "fits" if self.fits else "does not fit"
            peak = f"predicted peak {format_bytes(self.predicted_peak_bytes)}{room}, {verdict}"
            if self.plan is not None:
                p = self.plan
                peak += (f" (micro-batch {p.micro_batch_size} x {p.grad_accum_steps}, {p.precision}"
                         + (f", {p.checkpoint_blocks} blocks checkpointed" if p.checkpoint_blocks else "")
                         + (f", ZeRO-{p.zero_stage}" if p.zero_stage else "") + ")")
        return f"{self.name}: {self.change} -> {peak}; {self.note}"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the plan as :meth:`memguard.Plan.to_dict` writes it)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["plan"] = self.plan.to_dict() if self.plan is not None else None
        return d


@dataclass(frozen=True)
class FinetuneVariant:
    """What to plan for a fine-tuning mode: the model, the request and a sentence for ``Plan.reasons``.

    Attributes:
        model: the model to trace (the user's, or a ``meta`` LoRA twin of it).
        request: the plan request to search with.
        reason: why/what, for ``Plan.reasons["finetune"]``; empty for the model as given.
    """

    model: nn.Module
    request: Any
    reason: str = ""


# ---------------------------------------------------------------------------- requests and plans
def _plain_request(request: Any, **changes: Any) -> Any:
    """``request`` with ``changes``, without a fine-tuning mode (no recursion) and without the cache."""
    names = {f.name for f in dataclasses.fields(request)}
    if "finetune" in names:
        changes.setdefault("finetune", None)
    return dataclasses.replace(request, cache=False, **changes)


def _mixed16(spec: Any) -> str:
    return "16-mixed" if spec is not None and not spec.bf16 else "bf16-mixed"


def _trainable_factory(optimizer: Any) -> Any:
    """An optimizer argument that works on another model: an instance's class and hyperparameters
    over the trainable parameters (an instance is bound to the user's parameters)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    cls, defaults = type(optimizer), dict(optimizer.defaults)
    try:
        accepted = inspect.signature(cls.__init__).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
            defaults = {k: v for k, v in defaults.items() if k in accepted}
    except (TypeError, ValueError):
        pass

    def make(params):
        return cls([p for p in params if p.requires_grad], **defaults)

    return make


def _lora_reason(model: nn.Module, base_dtype: torch.dtype | None, what: str = "LoRA") -> str:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    names = _adapted_names(model)
    dtype = str(base_dtype).replace("torch.", "") if base_dtype is not None else "their dtype"
    return (f"{what} r={LORA_RANK} on {', '.join(names)}: {trainable:,} trainable of {total:,} parameters "
            f"({100 * trainable / max(total, 1):.2f}%), base weights frozen in {dtype}")


def _adapted_names(model: nn.Module) -> tuple[str, ...]:
    """The leaf names of the layers a (peft or memguard) LoRA model adapts."""
    names = set()
    for name, mod in model.named_modules():
        if hasattr(mod, "lora_A") and name:
            names.add(name.rsplit(".", 1)[-1])
    return tuple(sorted(names))


def finetune_variant(model: nn.Module, request: Any, finetune: str | None = None) -> FinetuneVariant:
    """What ``memguard.plan(model, batch, finetune=...)`` plans.

    ``None`` and ``"full"``: the model and request as given. ``"qlora"``: a ``meta`` QLoRA twin
    (:func:`qlora_model`: 4-bit NF4 base, fp32 non-quantised weights, LoRA adapters), planned as
    ``"lora"`` is and, unless the request says otherwise, with every block checkpointed (what
    ``peft.prepare_model_for_kbit_training`` turns on). A model with bitsandbytes 4-bit layers
    is planned as given. ``"lora"``: a ``meta`` LoRA twin of
    the model (:func:`lora_model`, base weights in bf16, or fp16 on GPUs without bf16), a request
    whose optimizer acts on the adapters only and whose precision, unless the user chose one, is the
    16-bit mixed precision the GPU supports (adapters in fp32 under autocast: the usual LoRA recipe).
    A model that already has peft adapters is planned as given.

    Args:
        model: the user's model (never modified).
        request: the :class:`~memguard.planner._request.PlanRequest`.
        finetune: one of :data:`FINETUNE_CHOICES`; default: ``request.finetune`` when the request has it.

    Raises:
        ConfigError: an invalid ``finetune`` value or request.
        MissingDependencyError: ``finetune="lora"`` without ``peft``.
    """
    if finetune is None:
        finetune = getattr(request, "finetune", None)
    problems = finetune_problems(finetune)
    if problems:
        raise ConfigError(problems)
    plain = unwrap_model(model)
    if finetune not in ("lora", "qlora") or _is_peft(plain) or has_4bit_layers(plain):
        return FinetuneVariant(model, request, "")
    spec = request.resolve().spec
    base_dtype = torch.float16 if spec is not None and not spec.bf16 else torch.bfloat16
    changes: dict[str, Any] = {"optimizer": _trainable_factory(request.optimizer)}
    if request.precision is None:
        changes["precision"] = _mixed16(spec)
    if finetune == "qlora":
        variant = qlora_model(model, compute_dtype=base_dtype, prepare=True)
        inside = checkpointed_inside(variant)
        if request.activation_checkpointing is None:
            # prepare_model_for_kbit_training checkpoints every layer inside a transformers model;
            # another model's blocks are checkpointed by the plan
            changes["activation_checkpointing"] = not inside
        reason = _lora_reason(variant, None, "QLoRA").replace(
            "base weights frozen in their dtype", f"linear base weights frozen in 4-bit NF4 (double-quantised, "
            f"{str(base_dtype).replace('torch.', '')} compute), the rest in fp32"
            + (" and every layer checkpointed inside the model" if inside else "")
            + " as peft.prepare_model_for_kbit_training leaves it")
        return FinetuneVariant(variant, dataclasses.replace(request, **changes), reason)
    variant = lora_model(model, base_dtype=base_dtype)
    new_request = dataclasses.replace(request, **changes)
    return FinetuneVariant(variant, new_request, _lora_reason(variant, base_dtype))


#: How an alternative is planned: ``plan_with(model, batch, request, session=...) -> Plan``, the planner's
#: front door (:func:`memguard.planner.api.plan_request`), passed in so that this module plans nothing itself.
PlanWith = Callable[..., Any]


def _measure(plan_with: PlanWith, model: nn.Module, batch: Any, request: Any, session: Any = None
             ) -> tuple[int | None, Any]:
    """(predicted peak, plan or None) of ``model`` under ``request``, planned by ``plan_with`` (``session``:
    one whose traces fit the request, to reuse them)."""
    try:
        plan = plan_with(model, batch, request, session=session)
    except InfeasiblePlanError as exc:
        closest = exc.closest
        return (closest.estimate.peak_upper_bytes if closest is not None else None), None
    return plan.estimate.peak_upper_bytes, plan


def alternatives(model: nn.Module, batch: Any, request: Any, *, plan_with: PlanWith,
                 only: Sequence[str] | None = None, session: Any = None) -> list[Alternative]:
    """Measured ways to make a fine-tune of ``model`` fit ``request``'s budget, smallest peak first.

    Each alternative is planned with ``plan_with`` (probes, then one full trace of the chosen
    configuration): LoRA, QLoRA (4-bit base, modelled: :class:`~memguard.estimator._twins.NF4Linear`),
    an 8-bit AdamW (:class:`~memguard.estimator._twins.AdamW8bitStandIn`, when the optimizer is
    AdamW/Adam or the default), ``bf16-true`` (where the GPU has bf16 and the request does not
    already allow it) and CPU offload of the optimizer (ZeRO-Offload, when the request does not
    already allow it). :func:`memguard.planner.api.alternatives` calls this with the planner's
    front door.

    Args:
        model: the user's model (never modified).
        batch: the example micro-batch.
        request: the :class:`~memguard.planner._request.PlanRequest` that did not fit.
        plan_with: plans one request (:func:`memguard.planner.api.plan_request`).
        only: names to measure (default: all that apply), e.g. ``("lora", "adamw8bit")``.
        session: the :class:`~memguard.planner._session.TraceSession` of the search that did not fit,
            to reuse its traces (``bf16-true`` and CPU offload trace the same model and optimizer);
            default: a new one, shared by those two.

    Returns:
        One :class:`Alternative` per applicable knob, those that fit first, then by predicted peak.

    Raises:
        ConfigError: the request is invalid.
    """
    space = request.resolve()
    spec = space.spec
    model = unwrap_model(model)
    wanted = set(only) if only is not None else None
    out: list[Alternative] = []

    def want(name: str) -> bool:
        return wanted is None or name in wanted

    # Unless the user chose precisions, each alternative is planned at the 16-bit mixed precision the
    # GPU supports only: the usual setting for fine-tuning, and one probe set per alternative, not two.
    precision = request.precision if request.precision is not None else _mixed16(spec)
    base16 = torch.float16 if spec is not None and not spec.bf16 else torch.bfloat16
    dname = str(base16).replace("torch.", "")
    peft_model = _is_peft(model)
    if want("lora") and not peft_model:
        targets = lora_target_modules(model)
        change = (f"LoRA: load the base weights in {dname} and train peft LoraConfig(r={LORA_RANK}, "
                  f"target_modules={list(targets)}) adapters")
        try:
            variant = finetune_variant(model, _plain_request(request), "lora")
        except MissingDependencyError as exc:
            out.append(Alternative("lora", change, None, False, f"not measured: {exc}"))
        else:
            peak, plan = _measure(plan_with, variant.model, batch, _plain_request(variant.request))
            out.append(Alternative("lora", change, peak, plan is not None, variant.reason, plan))
    if want("qlora") and not peft_model and _target_names(model):
        variant = finetune_variant(model, _plain_request(request, precision=precision), "qlora")
        peak, plan = _measure(plan_with, variant.model, batch, _plain_request(variant.request))
        out.append(Alternative(
            "qlora",
            f"QLoRA: load the base in 4-bit NF4 (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4', "
            f"bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.{dname})) with the same LoRA adapters",
            peak, plan is not None,
            "base weights at NF4's bytes (0.5 byte/weight + absmax per 64, double-quantised; arXiv "
            "2305.14314), dequantised per layer in forward and backward as bitsandbytes' MatMul4Bit does; "
            "embeddings, norms and output layer in fp32 and every block checkpointed, as "
            "peft.prepare_model_for_kbit_training leaves them", plan))
    opt = request.optimizer
    adam_like = opt is None or isinstance(opt, (torch.optim.AdamW, torch.optim.Adam)) or opt in (
        torch.optim.AdamW, torch.optim.Adam)
    if want("adamw8bit") and adam_like:
        hyper = {}
        if isinstance(opt, torch.optim.Optimizer):
            hyper = {k: opt.defaults[k] for k in ("lr", "betas", "eps", "weight_decay") if k in opt.defaults}

        def make(params, _hyper=hyper):
            return AdamW8bitStandIn([p for p in params if p.requires_grad], **_hyper)

        peak, plan = _measure(plan_with, model, batch, _plain_request(request, optimizer=make, precision=precision))
        out.append(Alternative(
            "adamw8bit", "optimizer=bitsandbytes.optim.AdamW8bit(model.parameters(), ...) instead of AdamW",
            peak, plan is not None,
            "Adam moments in 8 bits with an fp32 scale per 2048 values (2 bytes/param + 0.4%, vs 8; "
            "bitsandbytes/optim/optimizer.py, arXiv 2110.02861); PagedAdamW8bit: same bytes, but moments "
            "of tensors >= 1e5 elements sit in CUDA unified memory that the driver pages to host under "
            "pressure (slower, not an OOM), counted here on the device", plan))
    plain = _plain_request(request)
    if session is None or session.mismatches(model, batch, plain):
        session = TraceSession.for_request(model, batch, plain)
    bf16_ok = spec is None or spec.bf16
    if want("bf16-true") and bf16_ok and "bf16-true" not in space.precisions:
        peak, plan = _measure(plan_with, model, batch, _plain_request(request, precision="bf16-true"), session)
        out.append(Alternative("bf16-true", "precision='bf16-true' (weights, gradients and optimizer state in "
                               "bf16: model.to(torch.bfloat16))", peak, plan is not None, BF16_TRUE_NOTE, plan))
    if want("cpu-offload") and True not in space.offloads:
        zeros = tuple(z for z in space.zero_stages if z >= 1) or ((1, 2) if request.world_size == 1 else (1, 2, 3))
        # ZeRO >= 1 traces *-mixed as *-true (memguard.estimator._targets.traced_precision): the
        # bf16-true alternative's traces serve here too
        offload = _plain_request(request, offload_optimizer=True, zero_stage=zeros, precision=precision)
        peak, plan = _measure(plan_with, model, batch, offload, session)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        out.append(Alternative(
            "cpu-offload", "DeepSpeed ZeRO-Offload: offload_optimizer=True with ZeRO stage 1 or 2 "
            "(zero_optimization.offload_optimizer.device='cpu')", peak, plan is not None,
            # ZeRO-Offload (arXiv 2101.06840): fp32 parameters, momentum and variance
            # (12 bytes/param) and the fp16 gradients (2 bytes/param) live in host memory
            f"needs about {format_bytes(14 * trainable // max(request.world_size, 1))} of host memory "
            "per rank (14 bytes/param, arXiv 2101.06840) and runs the optimizer step on the CPU", plan))
    out.sort(key=lambda a: (not a.fits, a.predicted_peak_bytes is None, a.predicted_peak_bytes or 0))
    return out


def suggestion_lines(alts: Sequence[Alternative], usable_bytes: int | None = None) -> list[str]:
    """``InfeasiblePlanError.suggestions`` lines for :func:`alternatives`' result."""
    return [a.line(usable_bytes) for a in alts]
