"""Model surgery for estimation: stand-ins that hold the bytes of LoRA, QLoRA, NF4 and 8-bit AdamW.

These build *other models and optimizers* whose memory memguard can trace on fake tensors, without
the libraries they stand in for being traced (or, for bitsandbytes, installed; a model with real
bitsandbytes 4-bit layers is traced through the same twin, :func:`memguard.estimator._nf4.twin_4bit_layers`):

* :func:`lora_model`: a LoRA twin (Hu et al. 2021, arXiv 2106.09685) of a model on ``meta``, built
  with ``peft``, adapting every linear layer of the repeated blocks (:func:`lora_target_modules`;
  the QLoRA paper, Dettmers et al. 2023, arXiv 2305.14314, section 4, found adapters on every linear
  layer of the blocks necessary to match full fine-tuning).
* :func:`qlora_model`: LoRA over 4-bit NormalFloat base weights (same paper), as transformers'
  ``BitsAndBytesConfig`` and ``peft.prepare_model_for_kbit_training`` build it;
  :class:`~memguard.estimator._nf4.NF4Linear` holds the bytes of bitsandbytes' ``Linear4bit``
  (packed codes in a frozen parameter, statistics in buffers) and allocates what it allocates.
* :class:`AdamW8bitStandIn`: an optimizer whose state has the bytes of bitsandbytes' ``AdamW8bit``
  (Dettmers et al. 2021, arXiv 2110.02861).

The user's model is never touched: every twin is a deep copy on ``meta``. The planner uses them to
measure fine-tuning alternatives (:mod:`memguard.planner._finetune`); they are usable with
:func:`memguard.estimate` directly (``optimizer=AdamW8bitStandIn``).
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from memguard.errors import ConfigError, MissingDependencyError
from memguard.estimator._targets import unwrap_model
from memguard.estimator._blocks import find_blocks
from memguard.estimator._nf4 import NF4_BLOCK, NF4_DOUBLE_QUANT_BLOCK, NF4Linear, nf4_weight_bytes  # noqa: F401

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
def _output_layer(model: nn.Module) -> nn.Module | None:
    get_out = getattr(model, "get_output_embeddings", None)
    return get_out() if callable(get_out) else None


def qlora_model(model: nn.Module, *, rank: int = LORA_RANK, alpha: int = LORA_ALPHA,
                compute_dtype: torch.dtype = torch.bfloat16, base_dtype: torch.dtype | None = None,
                quant_storage: torch.dtype = torch.uint8, double_quant: bool = True,
                prepare: bool = True) -> nn.Module:
    """A QLoRA twin of ``model`` on ``meta``: 4-bit NF4 base layers (:class:`NF4Linear`) with fp32 LoRA adapters.

    What ``AutoModelForCausalLM.from_pretrained(..., dtype=base_dtype, quantization_config=
    BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=
    double_quant, bnb_4bit_compute_dtype=compute_dtype, bnb_4bit_quant_storage=quant_storage))``,
    then (``prepare``) ``peft.prepare_model_for_kbit_training`` and ``get_peft_model`` with
    ``LoraConfig(r=rank, target_modules=lora_target_modules(model))`` build:

    * every ``nn.Linear`` but the output layer becomes 4-bit (transformers' bitsandbytes
      integration, ``replace_with_bnb_linear``, skips the modules of ``get_keys_to_not_convert``:
      the output embeddings); its packed codes are a frozen parameter of ``quant_storage``, which
      FSDP and ZeRO-3 shard, its statistics buffers, which they do not (:mod:`memguard.estimator._nf4`);
    * the other weights (embeddings, norms, the output layer) stay in ``base_dtype`` (default
      ``compute_dtype``), or with ``prepare`` are upcast to fp32 (prepare_model_for_kbit_training:
      every fp16/bf16 parameter that is not ``Params4bit``);
    * the adapted layers run peft's 4-bit LoRA forward (:class:`_LoraOver`).

    ``prepare`` also turns checkpointing on as ``prepare_model_for_kbit_training`` does on a
    transformers model (:func:`_kbit_checkpointing`: every decoder layer, inside the model's own
    forward); on another model it cannot, so estimate that with ``activation_checkpointing=True``
    (``memguard.plan(..., finetune="qlora")`` does).

    Raises:
        ConfigError: the model has no linear layer to adapt, or a storage dtype that cannot hold a layer.
    """
    from memguard.estimator._nf4 import NF4Linear

    model = unwrap_model(model)
    twin = _meta_twin(model)
    names = set(_target_names(twin))
    if not names:
        raise ConfigError(f"{type(model).__name__} has no nn.Linear layer for QLoRA to adapt")
    head = _output_layer(twin)
    kept = torch.float32 if prepare else (base_dtype or compute_dtype)
    for p in twin.parameters():
        p.requires_grad_(False)
        if p.is_floating_point():
            p.data = p.data.to(kept)
    quantised = [n for n, m in twin.named_modules() if n and _is_linear(m) and m is not head]
    for name in quantised:
        parent_name, _, leaf = name.rpartition(".")
        parent = twin.get_submodule(parent_name) if parent_name else twin
        old = getattr(parent, leaf)
        fan_in, fan_out = (old.in_features, old.out_features) if isinstance(old, nn.Linear) else old.weight.shape
        try:
            layer = NF4Linear(fan_in, fan_out, old.bias is not None, compute_dtype=compute_dtype,
                              weight_dtype=base_dtype or compute_dtype, quant_storage=quant_storage,
                              double_quant=double_quant)
        except ValueError as exc:
            raise ConfigError(f"{name}: {exc}; use bnb_4bit_quant_storage=torch.uint8 or a 16-bit dtype") from exc
        setattr(parent, leaf, _LoraOver(layer, fan_in, fan_out, rank, alpha) if name in names else layer)
    if prepare:
        _kbit_checkpointing(twin)
    return twin


def _kbit_checkpointing(model: nn.Module) -> bool:
    """What prepare_model_for_kbit_training (peft/utils/other.py) turns on in a transformers model:
    ``enable_input_require_grads()`` (its ``gradient_checkpointing_kwargs`` default, ``{}``, has no
    ``use_reentrant``) and ``gradient_checkpointing_enable(gradient_checkpointing_kwargs={})``: every
    decoder layer checkpointed with torch's default ``use_reentrant``. False when ``model`` has no such
    methods (not a transformers model)."""
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers 5's name
    if callable(enable):
        enable(activation_checkpointing_kwargs={})
    elif callable(getattr(model, "gradient_checkpointing_enable", None)):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={})
    else:
        return False
    model.enable_input_require_grads()
    return True


def checkpointed_inside(model: nn.Module) -> bool:
    """True when a transformers model checkpoints its layers itself (``gradient_checkpointing`` set on
    a submodule: modeling_utils.PreTrainedModel.is_activation_checkpointing)."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


class _LoraOver(nn.Module):
    """peft's LoRA over a 4-bit layer (peft/tuners/lora/bnb.py, ``Linear4bit.forward``): ``result =
    base_layer(x).clone()`` (the defensive clone), then outside autocast the input cast to the
    adapters' dtype (fp32) and the adapter output back to the result's, ``result + B(A(x)) * alpha / r``."""

    def __init__(self, base: nn.Module, fan_in: int, fan_out: int, rank: int, alpha: int):
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Linear(fan_in, rank, bias=False, device="meta")
        self.lora_B = nn.Linear(rank, fan_out, bias=False, device="meta")
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x).clone()
        if torch.is_autocast_enabled():
            return result + self.lora_B(self.lora_A(x)) * self.scaling
        out = self.lora_B(self.lora_A(x.to(self.lora_A.weight.dtype))) * self.scaling
        return result + out.to(result.dtype)
