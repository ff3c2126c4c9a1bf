"""Fine-tuning knobs: what to change when a full fine-tune does not fit, each one measured.

When no configuration of micro-batch, accumulation, precision, checkpointing and ZeRO fits, the
usual answer for fine-tuning a large model on one GPU is not "more GPUs" but one of:

* **LoRA** (Hu et al. 2021, arXiv 2106.09685): the base weights frozen (and held in 16 bits), small
  trainable low-rank adapters on the linear layers of every repeated block. :func:`lora_model`
  builds that model with ``peft`` on the ``meta`` device from a twin of the user's model (the
  user's model is never touched), choosing the target modules from the architecture: every
  ``nn.Linear`` (and transformers' ``Conv1D``) inside the repeated blocks, which is ``q/k/v/o_proj``
  plus ``gate/up/down_proj`` for Llama-style models and ``c_attn``/``c_proj``/``c_fc`` for GPT-2:
  the QLoRA paper (Dettmers et al. 2023, arXiv 2305.14314, section 4) found adapters on every
  linear layer of the blocks necessary to match full fine-tuning.
* **QLoRA**: LoRA on 4-bit NormalFloat base weights (same paper). bitsandbytes' ``Linear4bit`` is
  not used (see :class:`NF4Linear`): a stand-in holds the same bytes and dequantises the same way.
* **An 8-bit optimizer** (Dettmers et al. 2021, arXiv 2110.02861): bitsandbytes' ``AdamW8bit``
  keeps both Adam moments in 8 bits with one fp32 scale per block. :class:`AdamW8bitStandIn`
  holds exactly the state bytes bitsandbytes' source allocates.
* **bf16-true**: weights, gradients and optimizer state in bfloat16 (half of 32-bit's bytes), with
  a numerical caveat (:data:`BF16_TRUE_NOTE`).
* **CPU offload** (ZeRO-Offload, Ren et al. 2021, arXiv 2101.06840): optimizer state and step in
  host memory.

:func:`alternatives` plans each of them with memguard's own planner (every figure is a traced
estimate, verified with one full trace when it fits) and returns them as :class:`Alternative`
records, smallest predicted peak first. :func:`finetune_variant` is what
``memguard.plan(..., finetune="lora")`` plans instead of the user's model.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from memguard.errors import ConfigError, InfeasiblePlanError, MissingDependencyError
from memguard.estimator.targets import unwrap_model
from memguard.estimator.blocks import find_blocks
from memguard.vocab import format_bytes

__all__ = [
    "Alternative",
    "AdamW8bitStandIn",
    "NF4Linear",
    "FinetuneVariant",
    "FINETUNE_CHOICES",
    "BF16_TRUE_NOTE",
    "adamw8bit_state_bytes",
    "nf4_weight_bytes",
    "lora_target_modules",
    "lora_model",
    "qlora_model",
    "finetune_problems",
    "finetune_variant",
    "alternatives",
    "suggestion_lines",
]

#: ``memguard.plan(..., finetune=...)``: None (the model as given), "full" (the model as given, and
#: when nothing fits the measured alternatives of this module), "lora" (plan the LoRA variant).
FINETUNE_CHOICES: tuple[str | None, ...] = (None, "full", "lora")

# peft's LoraConfig defaults (peft/tuners/lora/config.py, peft 0.21: r=8, lora_alpha=8,
# lora_dropout=0.0); the rank changes the adapters' bytes only, a fraction of a percent of the base.
LORA_RANK = 8
LORA_ALPHA = 8

# bitsandbytes/optim/optimizer.py (Optimizer2State, bitsandbytes 0.45-0.48):
#   init_state keeps 32-bit state1/state2 for tensors with fewer than min_8bit_size (default 4096)
#   elements; larger ones get uint8 state1/state2 (zeros_like(p, dtype=uint8)) and, block-wise (the
#   default), fp32 absmax1/absmax2 of ceil(numel / 2048) elements each. The two 256-entry fp32
#   quantisation maps ("dynamic", "udynamic") are shared by every parameter: 2 KiB in all, not modelled.
BNB_MIN_8BIT_SIZE = 4096
BNB_STATE_BLOCK = 2048
# get_state_buffer: paged optimizers put state1/state2 of tensors with at least 1e5 elements in CUDA
# unified memory (F.get_paged, cudaMallocManaged) instead of PyTorch's caching allocator.
BNB_PAGED_MIN_NUMEL = 100_000

# NF4 storage (QLoRA, arXiv 2305.14314 section 3; bitsandbytes Linear4bit / quantize_4bit): two
# 4-bit codes per byte, one absmax per block of 64 weights; double quantisation stores those absmax
# as uint8 with one fp32 scale per block of 256 absmax values (the paper's c2 = 256; 0.127 bit/param).
NF4_BLOCK = 64
NF4_DOUBLE_QUANT_BLOCK = 256

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
        predicted_peak_bytes: the predicted peak per rank (the plan's verified estimate when it
            fits, else the closest configuration's), or None when it could not be measured (e.g.
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


# ------------------------------------------------------------------------------ 8-bit optimizer
def adamw8bit_state_bytes(numel: int, *, min_8bit_size: int = BNB_MIN_8BIT_SIZE) -> int:
    """Bytes of bitsandbytes ``AdamW8bit`` state for one parameter of ``numel`` elements.

    Two fp32 moments below ``min_8bit_size`` elements; else two uint8 moments plus two fp32 absmax
    vectors of ``ceil(numel / 2048)`` (bitsandbytes/optim/optimizer.py, ``Optimizer2State.init_state``).
    """
    if numel < min_8bit_size:
        return 2 * 4 * numel
    return 2 * numel + 2 * 4 * math.ceil(numel / BNB_STATE_BLOCK)


class AdamW8bitStandIn(torch.optim.Optimizer):
    """An optimizer whose state has the bytes of bitsandbytes' ``AdamW8bit``, for estimation.

    State per parameter, as ``Optimizer2State.init_state`` allocates it (bitsandbytes/optim/optimizer.py):
    ``state1``/``state2`` in uint8 with the parameter's shape and fp32 ``absmax1``/``absmax2`` of
    ``ceil(numel / 2048)`` elements; below ``min_8bit_size`` elements, fp32 ``state1``/``state2``.
    bitsandbytes updates with one fused kernel per parameter (``optimizer_update_8bit_blockwise``)
    that dequantises in registers, so the step allocates nothing; this stand-in's step allocates
    nothing either.

    Known limitations:
        The step is a memory model, not AdamW: it applies decoupled weight decay and a plain
        gradient step in place (``p -= lr * (grad + weight_decay * p)``) and leaves the moments at
        zero. Train with ``bitsandbytes.optim.AdamW8bit``; pass this class to ``memguard.estimate``
        / ``memguard.plan`` (``optimizer=AdamW8bitStandIn``) to predict that optimizer's memory.
        ``PagedAdamW8bit`` keeps the same bytes, but its moments of tensors with at least 1e5
        elements live in CUDA unified memory outside PyTorch's allocator; memguard counts them on
        the device (the worst case, when nothing is paged out).
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, min_8bit_size: int = BNB_MIN_8BIT_SIZE):
        # the defaults of bitsandbytes.optim.AdamW8bit (bitsandbytes/optim/adamw.py: weight_decay=1e-2)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      min_8bit_size=min_8bit_size))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    if p.numel() < group["min_8bit_size"]:
                        state["state1"] = torch.zeros_like(p, dtype=torch.float32)
                        state["state2"] = torch.zeros_like(p, dtype=torch.float32)
                    else:
                        blocks = math.ceil(p.numel() / BNB_STATE_BLOCK)
                        state["state1"] = torch.zeros_like(p, dtype=torch.uint8)
                        state["state2"] = torch.zeros_like(p, dtype=torch.uint8)
                        state["absmax1"] = torch.zeros((blocks,), dtype=torch.float32, device=p.device)
                        state["absmax2"] = torch.zeros((blocks,), dtype=torch.float32, device=p.device)
                state["step"] += 1
                p.mul_(1.0 - group["lr"] * group["weight_decay"])
                p.add_(p.grad, alpha=-group["lr"])
        return loss


# ------------------------------------------------------------------------------------------ LoRA
def _is_linear(module: nn.Module) -> bool:
    # transformers' GPT-2 uses its own Conv1D (a transposed Linear; transformers/pytorch_utils.py)
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def _target_names(model: nn.Module) -> list[str]:
    """Full names (relative to ``model``) of the linear layers LoRA adapts."""
    blocks = find_blocks(model)
    block_ids = {id(b) for b in blocks}
    out: list[str] = []
    if blocks:
        # every linear layer inside a repeated block
        stack = [(name, mod) for name, mod in model.named_modules() if id(mod) in block_ids]
        for prefix, block in stack:
            out += [f"{prefix}.{n}" for n, m in block.named_modules() if n and _is_linear(m)]
        return out
    # no repeated blocks: every linear layer but the output layer (as peft's "all-linear" does)
    get_out = getattr(model, "get_output_embeddings", None)
    head = get_out() if callable(get_out) else None
    return [n for n, m in model.named_modules() if n and _is_linear(m) and m is not head]


def lora_target_modules(model: nn.Module) -> tuple[str, ...]:
    """The layer names LoRA adapts in ``model``: every linear layer of the repeated blocks.

    ``("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj")`` for a Llama,
    ``("c_attn", "c_fc", "c_proj")`` for GPT-2 (sorted leaf names; the same names peft's
    ``target_modules`` takes). Without repeated blocks, every linear layer but the output layer.
    """
    return tuple(sorted({n.rsplit(".", 1)[-1] for n in _target_names(unwrap_model(model))}))


def _meta_twin(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are on ``meta`` (no data is copied)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def _require_peft() -> Any:
    try:
        import peft
    except ImportError as exc:
        raise MissingDependencyError("peft", "peft") from exc
    return peft


def _is_peft(model: nn.Module) -> bool:
    return hasattr(model, "peft_config")


def lora_model(model: nn.Module, *, rank: int = LORA_RANK, alpha: int = LORA_ALPHA,
               target_modules: Sequence[str] | None = None, base_dtype: torch.dtype | None = torch.bfloat16,
               ) -> nn.Module:
    """A LoRA twin of ``model`` on the ``meta`` device, built with ``peft``; ``model`` is not touched.

    Args:
        model: the model to fine-tune (any device, ``meta`` included).
        rank: LoRA rank ``r`` (peft's default, 8).
        alpha: ``lora_alpha`` (peft's default, 8; it scales, it costs no memory).
        target_modules: layer names to adapt; default :func:`lora_target_modules`.
        base_dtype: the dtype the frozen base weights are held in (the usual ``torch_dtype=`` when
            loading for LoRA); None keeps the model's. peft keeps the adapters in fp32
            (``autocast_adapter_dtype=True``, peft/tuners/tuners_utils.py).

    Returns:
        The ``peft`` model (``PeftModel``) on ``meta``: only the adapters require grad.

    Raises:
        MissingDependencyError: ``peft`` is not installed.
        ConfigError: the model has no linear layer to adapt.
    """
    peft = _require_peft()
    model = unwrap_model(model)
    twin = _meta_twin(model)
    names = _target_names(twin) if target_modules is None else list(target_modules)
    if not names:
        raise ConfigError(f"{type(model).__name__} has no nn.Linear layer for LoRA to adapt; pass "
                          "target_modules= naming the layers, or plan the full fine-tune")
    if base_dtype is not None:
        for p in twin.parameters():
            if p.is_floating_point():
                p.data = p.data.to(base_dtype)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=names)
    return peft.get_peft_model(twin, config)


# ----------------------------------------------------------------------------------------- QLoRA
def nf4_weight_bytes(numel: int, *, double_quant: bool = True) -> int:
    """Bytes of one weight of ``numel`` elements in NF4 (QLoRA, arXiv 2305.14314, section 3).

    Packed codes ``ceil(numel / 2)`` bytes; absmax per block of 64: fp32 (4 bytes), or with double
    quantisation uint8 plus one fp32 per 256 absmax values.
    """
    blocks = math.ceil(numel / NF4_BLOCK)
    absmax = blocks + 4 * math.ceil(blocks / NF4_DOUBLE_QUANT_BLOCK) if double_quant else 4 * blocks
    return math.ceil(numel / 2) + absmax


class _DequantMatmul(torch.autograd.Function):
    """``linear(x, dequantise(W))`` that keeps the input and the packed weight for backward, as
    bitsandbytes' ``MatMul4Bit`` does (bitsandbytes/autograd/_functions.py: forward ``linear(A,
    dequantize_4bit(B))``, ``ctx.tensors = (A, B)``; backward dequantises again for ``grad_A =
    grad_output @ W``). The dequantised weight is a temporary of the compute dtype in both passes."""

    @staticmethod
    def forward(ctx, x, packed, absmax, absmax2, shape, dtype):
        ctx.save_for_backward(x, packed, absmax, absmax2)
        ctx.shape, ctx.wdtype = shape, dtype
        w = _nf4_dequantize(packed, absmax, absmax2, shape, x.dtype)
        return torch.nn.functional.linear(x, w)

    @staticmethod
    def backward(ctx, grad_out):
        _, packed, absmax, absmax2 = ctx.saved_tensors
        w = _nf4_dequantize(packed, absmax, absmax2, ctx.shape, grad_out.dtype)
        return grad_out @ w, None, None, None, None, None


# The 16 NF4 levels: quantiles of N(0, 1) normalised to [-1, 1] (QLoRA appendix E; bitsandbytes
# functional.get_4bit_type("nf4")).
_NF4_LEVELS = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
)


def _nf4_dequantize(packed: torch.Tensor, absmax: torch.Tensor, absmax2: torch.Tensor, shape, dtype):
    """The weight of ``shape`` from NF4 codes. On fake/meta tensors (tracing) only the result is
    allocated, as bitsandbytes' fused kernel (``dequantize_4bit``) allocates only its output."""
    from torch._subclasses.fake_tensor import is_fake

    if is_fake(packed) or packed.device.type == "meta":
        return packed.new_empty(shape, dtype=dtype)
    numel = math.prod(shape)
    codes = torch.stack((packed >> 4, packed & 0xF), dim=-1).reshape(-1)[:numel].long()
    levels = torch.tensor(_NF4_LEVELS, dtype=torch.float32, device=packed.device)
    scale = (absmax.float() * absmax2.repeat_interleave(NF4_DOUBLE_QUANT_BLOCK)[: absmax.numel()])
    values = levels[codes] * scale.repeat_interleave(NF4_BLOCK)[:numel]
    return values.reshape(shape).to(dtype)


class NF4Linear(nn.Module):
    """A frozen linear layer with 4-bit NormalFloat weights: the bytes of bitsandbytes' ``Linear4bit``
    (``quant_type="nf4"``, ``compress_statistics=True``), traceable on fake tensors.

    bitsandbytes is not a dependency of memguard (and was not installed where this was written, so
    tracing its ``Linear4bit`` could not be tried). Its recent releases register fake kernels for the
    4-bit ops (bitsandbytes/_ops.py: ``register_fake`` for ``dequantize_4bit``, ``gemm_4bit``), so
    the real layer may trace where it is installed, but its weights are quantised when moved to a
    device (``Params4bit``), which a ``meta`` model never is. memguard therefore models the layer:
    ``packed`` (uint8, two codes per byte), ``absmax`` (uint8, one per 64 weights) and ``absmax2``
    (fp32, one per 256 absmax values) are buffers, and the forward dequantises into a temporary of the
    input's dtype, as bitsandbytes' ``MatMul4Bit`` does. Built from an ``nn.Linear`` on ``meta`` by
    :func:`qlora_model`.

    Known limitations:
        The absmax values are stored as plain scales (a uint8 code times its block's fp32 scale),
        not through bitsandbytes' 256-entry dynamic map with an offset; the bytes are the same.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, *, compute_dtype: torch.dtype,
                 device: Any = "meta"):
        super().__init__()
        self.in_features, self.out_features, self.compute_dtype = in_features, out_features, compute_dtype
        n = in_features * out_features
        blocks = math.ceil(n / NF4_BLOCK)
        self.register_buffer("packed", torch.zeros(math.ceil(n / 2), dtype=torch.uint8, device=device))
        self.register_buffer("absmax", torch.zeros(blocks, dtype=torch.uint8, device=device))
        self.register_buffer("absmax2", torch.zeros(math.ceil(blocks / NF4_DOUBLE_QUANT_BLOCK),
                                                    dtype=torch.float32, device=device))
        # Linear4bit keeps the bias as an ordinary (16-bit) parameter
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=compute_dtype, device=device),
                                 requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _DequantMatmul.apply(x, self.packed, self.absmax, self.absmax2,
                                   (self.out_features, self.in_features), self.compute_dtype)
        return out + self.bias if self.bias is not None else out


def qlora_model(model: nn.Module, *, rank: int = LORA_RANK, alpha: int = LORA_ALPHA,
                compute_dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """A QLoRA twin of ``model`` on ``meta``: :class:`NF4Linear` base layers with fp32 LoRA adapters.

    The targeted linear layers (:func:`lora_target_modules`) become :class:`NF4Linear`; the rest of
    the base (embeddings, norms, output layer) is held in ``compute_dtype``, as ``from_pretrained(...,
    quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
    bnb_4bit_use_double_quant=True))`` leaves it. Adapters are plain ``nn.Linear`` pairs (LoRA's
    ``B @ A`` path, ``lora_A`` then ``lora_B``, peft/tuners/lora/layer.py) in fp32.

    Raises:
        ConfigError: the model has no linear layer to adapt.
    """
    model = unwrap_model(model)
    twin = _meta_twin(model)
    names = _target_names(twin)
    if not names:
        raise ConfigError(f"{type(model).__name__} has no nn.Linear layer for QLoRA to adapt")
    for p in twin.parameters():
        p.requires_grad_(False)
        if p.is_floating_point():
            p.data = p.data.to(compute_dtype)
    for name in names:
        parent_name, _, leaf = name.rpartition(".")
        parent = twin.get_submodule(parent_name) if parent_name else twin
        old = getattr(parent, leaf)
        if isinstance(old, nn.Linear):
            fan_in, fan_out = old.in_features, old.out_features
        else:  # transformers Conv1D: weight (in, out)
            fan_in, fan_out = old.weight.shape
        setattr(parent, leaf, _LoraOver(NF4Linear(fan_in, fan_out, old.bias is not None,
                                                  compute_dtype=compute_dtype), fan_in, fan_out, rank, alpha))
    return twin


class _LoraOver(nn.Module):
    """``base(x) + B(A(x)) * alpha / r`` with fp32 adapters, as peft's ``lora.Linear`` computes it
    (peft/tuners/lora/layer.py: the input is cast to the adapter's dtype, the result back)."""

    def __init__(self, base: nn.Module, fan_in: int, fan_out: int, rank: int, alpha: int):
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Linear(fan_in, rank, bias=False, device="meta")
        self.lora_B = nn.Linear(rank, fan_out, bias=False, device="meta")
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        lora = self.lora_B(self.lora_A(x.to(self.lora_A.weight.dtype))) * self.scaling
        return out + lora.to(out.dtype)


# ---------------------------------------------------------------------------- requests and plans
def finetune_problems(value: Any, *, label: str = "finetune") -> list[str]:
    """Sentences for an invalid ``finetune=`` value (empty when valid), for ``PlanRequest.problems``."""
    if value in FINETUNE_CHOICES:
        return []
    return [f"{label}={value!r} must be None (the model as given), 'full' (full fine-tuning; when nothing "
            "fits, memguard measures LoRA, 8-bit optimizer, bf16-true and offload alternatives) or 'lora'"]


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

    ``None`` and ``"full"``: the model and request as given. ``"lora"``: a ``meta`` LoRA twin of
    the model (:func:`lora_model`, base weights in bf16, or fp16 on GPUs without bf16), a request
    whose optimizer acts on the adapters only and whose precision, unless the user chose one, is the
    16-bit mixed precision the GPU supports (adapters in fp32 under autocast: the usual LoRA recipe).
    A model that already has peft adapters is planned as given.

    Args:
        model: the user's model (never modified).
        request: the :class:`~memguard.planner.request.PlanRequest`.
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
    if finetune != "lora" or _is_peft(unwrap_model(model)):
        return FinetuneVariant(model, request, "")
    spec = request.resolve().spec
    base_dtype = torch.float16 if spec is not None and not spec.bf16 else torch.bfloat16
    variant = lora_model(model, base_dtype=base_dtype)
    changes: dict[str, Any] = {"optimizer": _trainable_factory(request.optimizer)}
    if request.precision is None:
        changes["precision"] = _mixed16(spec)
    new_request = dataclasses.replace(request, **changes)
    return FinetuneVariant(variant, new_request, _lora_reason(variant, base_dtype))


def _measure(model: nn.Module, batch: Any, request: Any, planner: Any = None) -> tuple[int | None, Any]:
    """(predicted peak, plan or None) of ``model`` under ``request``, by memguard's planner (``planner``:
    one whose traces fit the request, to reuse them)."""
    from memguard.planner.search import plan_request

    try:
        plan = plan_request(model, batch, request, planner=planner)
    except InfeasiblePlanError as exc:
        closest = exc.closest
        return (closest.estimate.peak_bytes if closest is not None else None), None
    return plan.estimate.peak_bytes, plan


def alternatives(model: nn.Module, batch: Any, request: Any, *, only: Sequence[str] | None = None,
                 planner: Any = None) -> list[Alternative]:
    """Measured ways to make a fine-tune of ``model`` fit ``request``'s budget, smallest peak first.

    Each alternative is planned with memguard's planner (probes, then one full trace of the chosen
    configuration): LoRA, QLoRA (4-bit base, modelled: :class:`NF4Linear`), an 8-bit AdamW
    (:class:`AdamW8bitStandIn`, when the optimizer is AdamW/Adam or the default), ``bf16-true``
    (where the GPU has bf16 and the request does not already allow it) and CPU offload of the
    optimizer (ZeRO-Offload, when the request does not already allow it).

    Args:
        model: the user's model (never modified).
        batch: the example micro-batch.
        request: the :class:`~memguard.planner.request.PlanRequest` that did not fit.
        only: names to measure (default: all that apply), e.g. ``("lora", "adamw8bit")``.
        planner: the :class:`~memguard.planner.search.Planner` of the search that did not fit, to reuse
            its traces (``bf16-true`` and CPU offload trace the same model and optimizer); default: a new
            one, shared by those two.

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
            peak, plan = _measure(variant.model, batch, _plain_request(variant.request))
            out.append(Alternative("lora", change, peak, plan is not None, variant.reason, plan))
    if want("qlora") and not peft_model and _target_names(model):
        variant_model = qlora_model(model, compute_dtype=base16)
        req = _plain_request(request, optimizer=_trainable_factory(request.optimizer), precision=precision)
        peak, plan = _measure(variant_model, batch, req)
        out.append(Alternative(
            "qlora",
            f"QLoRA: load the base in 4-bit NF4 (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4', "
            f"bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.{dname})) with the same LoRA adapters",
            peak, plan is not None,
            "base weights modelled at NF4's bytes (0.5 byte/weight + absmax per 64, double-quantised; "
            "arXiv 2305.14314), dequantised per layer in forward and backward as bitsandbytes does; "
            "bitsandbytes itself is not traced; peft's prepare_model_for_kbit_training would also upcast "
            "the non-quantised weights (embeddings, norms, output layer) to fp32, not counted here", plan))
    opt = request.optimizer
    adam_like = opt is None or isinstance(opt, (torch.optim.AdamW, torch.optim.Adam)) or opt in (
        torch.optim.AdamW, torch.optim.Adam)
    if want("adamw8bit") and adam_like:
        hyper = {}
        if isinstance(opt, torch.optim.Optimizer):
            hyper = {k: opt.defaults[k] for k in ("lr", "betas", "eps", "weight_decay") if k in opt.defaults}

        def make(params, _hyper=hyper):
            return AdamW8bitStandIn([p for p in params if p.requires_grad], **_hyper)

        peak, plan = _measure(model, batch, _plain_request(request, optimizer=make, precision=precision))
        out.append(Alternative(
            "adamw8bit", "optimizer=bitsandbytes.optim.AdamW8bit(model.parameters(), ...) instead of AdamW",
            peak, plan is not None,
            "Adam moments in 8 bits with an fp32 scale per 2048 values (2 bytes/param + 0.4%, vs 8; "
            "bitsandbytes/optim/optimizer.py, arXiv 2110.02861); PagedAdamW8bit: same bytes, but moments "
            "of tensors >= 1e5 elements sit in CUDA unified memory that the driver pages to host under "
            "pressure (slower, not an OOM), counted here on the device", plan))
    from memguard.planner.search import Planner

    plain = _plain_request(request)
    if planner is None or planner.mismatches(model, batch, plain):
        planner = Planner.for_request(model, batch, plain)
    bf16_ok = spec is None or spec.bf16
    if want("bf16-true") and bf16_ok and "bf16-true" not in space.precisions:
        peak, plan = _measure(model, batch, _plain_request(request, precision="bf16-true"), planner)
        out.append(Alternative("bf16-true", "precision='bf16-true' (weights, gradients and optimizer state in "
                               "bf16: model.to(torch.bfloat16))", peak, plan is not None, BF16_TRUE_NOTE, plan))
    if want("cpu-offload") and True not in space.offloads:
        zeros = tuple(z for z in space.zero_stages if z >= 1) or ((1, 2) if request.world_size == 1 else (1, 2, 3))
        # ZeRO >= 1 traces *-mixed as *-true (memguard.estimator.targets.traced_precision): the
        # bf16-true alternative's traces serve here too
        peak, plan = _measure(model, batch, _plain_request(request, offload_optimizer=True, zero_stage=zeros,
                                                          precision=precision), planner)
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
