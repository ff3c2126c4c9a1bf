"""A traceable twin of bitsandbytes' 4-bit ``Linear4bit``: its bytes, where they live, what it allocates.

QLoRA (Dettmers et al. 2023, arXiv 2305.14314) stores a frozen base in 4-bit NormalFloat. In
bitsandbytes (0.50; ``bitsandbytes/nn/modules.py``, ``functional.py``, ``backends/``):

* the packed codes are the layer's ``weight``, a ``Params4bit`` *parameter* (``requires_grad=False``)
  of ``quant_storage`` dtype (uint8 by default; FSDP-QLoRA loads with ``bnb_4bit_quant_storage=bf16``
  so FSDP can flatten and shard it with the 16-bit parameters), ``(numel + 1) // 2`` bytes;
* the statistics live in the weight's ``QuantState``, outside ``parameters()`` and ``buffers()``, so
  no engine shards them: ``absmax`` per block of 64 weights (fp32; with double quantisation,
  ``compress_statistics=True``, uint8 codes plus ``state2``: one fp32 absmax per 256 of them, its
  256-entry fp32 dynamic map and an fp32 ``offset``) and the 16-entry fp32 4-bit code.

:class:`NF4Linear` holds the packed codes as a frozen parameter of the same dtype and shape (so
FSDP1/FSDP2 and ZeRO-3 shard it as they shard ``Params4bit``) and the statistics as buffers (whole
on every rank), and its forward and backward allocate what ``MatMul4Bit`` allocates on the CPU
and default backends. :func:`twin_4bit_layers` swaps every ``Linear4bit`` of a real bitsandbytes
model (``from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True))``, with or
without peft adapters) for one, so ``memguard.estimate`` and ``memguard.plan`` trace such a model.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn

# bitsandbytes/functional.py quantize_4bit: blocksize defaults to 64 (the QLoRA paper's block);
# double quantisation quantises the absmax values with quantize_blockwise(..., blocksize=256).
NF4_BLOCK = 64
NF4_DOUBLE_QUANT_BLOCK = 256
# functional.create_dynamic_map(): the 8-bit dynamic map of state2 has 256 fp32 entries;
# functional.get_4bit_type("nf4"): the 4-bit code has 16.
DYNAMIC_MAP_ENTRIES = 256
CODE_4BIT_ENTRIES = 16

# The 16 NF4 levels: quantiles of N(0, 1) normalised to [-1, 1] (QLoRA appendix E; bitsandbytes
# functional.get_4bit_type("nf4")).
NF4_LEVELS = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
)


def packed_bytes(numel: int) -> int:
    """Bytes of the packed codes: two per byte, an odd count padded (backends/default/ops.py quantize_4bit)."""
    return (numel + 1) // 2


def nf4_weight_bytes(numel: int, *, double_quant: bool = True, blocksize: int = NF4_BLOCK) -> int:
    """Bytes of one weight of ``numel`` elements in NF4: packed codes plus absmax statistics.

    Absmax per block (fp32), or with double quantisation uint8 per block plus one fp32 per 256
    blocks (QLoRA section 3: 0.127 bit/param). The per-tensor constants (the 16-entry code, the
    256-entry map, the offset) are :func:`nf4_constant_bytes`.
    """
    blocks = math.ceil(numel / blocksize)
    absmax = blocks + 4 * math.ceil(blocks / NF4_DOUBLE_QUANT_BLOCK) if double_quant else 4 * blocks
    return packed_bytes(numel) + absmax


def nf4_constant_bytes(*, double_quant: bool = True) -> int:
    """fp32 constants of one layer's QuantState: the 4-bit code, and with double quantisation the
    dynamic map and the offset (functional.quantize_4bit: ``code``, ``state2.code``, ``offset``)."""
    return 4 * CODE_4BIT_ENTRIES + (4 * DYNAMIC_MAP_ENTRIES + 4 if double_quant else 0)


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t) or t.device.type == "meta"


class NF4Linear(nn.Module):
    """A frozen linear layer in 4-bit NormalFloat with the bytes and allocations of ``Linear4bit``.

    Args:
        in_features, out_features, bias: the layer's shape (a bias stays a frozen 16-bit parameter).
        compute_dtype: ``bnb_4bit_compute_dtype``: the input is cast to it and the weight
            dequantised into it in forward (``Linear4bit.forward``).
        weight_dtype: the dtype the weight had when quantised (``QuantState.dtype``, the model's
            ``torch_dtype``): backward dequantises into it, then casts to the gradient's dtype.
            Default: ``compute_dtype``.
        quant_storage: ``bnb_4bit_quant_storage``: the packed codes' dtype (uint8 default).
        double_quant: ``bnb_4bit_use_double_quant`` (``compress_statistics``).
        blocksize: weights per absmax block (64).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, *, compute_dtype: torch.dtype | None,
                 weight_dtype: torch.dtype | None = None, quant_storage: torch.dtype = torch.uint8,
                 double_quant: bool = True, blocksize: int = NF4_BLOCK, device: Any = "meta"):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.compute_dtype = compute_dtype
        self.weight_dtype = weight_dtype or compute_dtype or torch.float32
        self.double_quant, self.blocksize = double_quant, blocksize
        n = in_features * out_features
        nbytes = packed_bytes(n)
        item = torch.empty((), dtype=quant_storage).element_size()
        if nbytes % item:
            raise ValueError(f"{n} weights pack into {nbytes} bytes, not a whole number of {quant_storage}")
        # Params4bit: shape ((n + 1) // 2 // itemsize, 1), frozen (Params4bit.__new__ requires_grad=False)
        self.weight = nn.Parameter(torch.empty((nbytes // item, 1), dtype=quant_storage, device=device),
                                   requires_grad=False)
        blocks = math.ceil(n / blocksize)
        f32 = dict(dtype=torch.float32, device=device)
        self.register_buffer("code", torch.zeros(CODE_4BIT_ENTRIES, **f32))
        if double_quant:
            self.register_buffer("absmax", torch.zeros(blocks, dtype=torch.uint8, device=device))
            self.register_buffer("absmax2", torch.zeros(math.ceil(blocks / NF4_DOUBLE_QUANT_BLOCK), **f32))
            self.register_buffer("code2", torch.zeros(DYNAMIC_MAP_ENTRIES, **f32))
            self.register_buffer("offset", torch.zeros((), **f32))
        else:
            self.register_buffer("absmax", torch.zeros(blocks, **f32))
        # Linear4bit keeps the bias as an ordinary parameter; forward casts it to compute_dtype
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=compute_dtype or self.weight_dtype, device=device),
                                 requires_grad=False) if bias else None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def scales(self) -> torch.Tensor:
        """The fp32 absmax of every block. Double-quantised: ``dequantize_blockwise`` allocates its
        fp32 output, then ``+ offset`` (gemm_4bit's default impl) a second one (the first dies)."""
        if not self.double_quant:
            return self.absmax
        if _is_fake(self.absmax):
            first = torch.empty(self.absmax.shape, dtype=torch.float32, device=self.absmax.device)
            return first + self.offset
        block = self.absmax2.repeat_interleave(NF4_DOUBLE_QUANT_BLOCK)[: self.absmax.numel()]
        return self.code2[self.absmax.long()] * block + self.offset

    def dequantize(self, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The weight in ``dtype`` (``dequantize_4bit`` allocates only its output on the CPU)."""
        if _is_fake(self.weight):
            return torch.empty(self.shape, dtype=dtype, device=self.weight.device)
        n = self.in_features * self.out_features
        packed = self.weight.reshape(-1).view(torch.uint8)
        codes = torch.stack((packed >> 4, packed & 0xF), dim=-1).reshape(-1)[:n].long()
        values = self.code[codes] * scales.repeat_interleave(self.blocksize)[:n]
        return values.reshape(self.shape).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Linear4bit.forward: x.to(compute_dtype); the bias cast too; matmul_4bit(...).to(inp_dtype)
        inp_dtype = x.dtype
        compute = self.compute_dtype or inp_dtype  # None: set from the first input (set_compute_type)
        x = x.to(compute)
        bias = self.bias.to(compute) if self.bias is not None else None
        return _MatMul4Bit.apply(x, self.weight, bias, self).to(inp_dtype)


class _MatMul4Bit(torch.autograd.Function):
    """bitsandbytes/autograd/_functions.py ``MatMul4Bit``: forward ``gemm_4bit`` (scales, weight
    dequantised into the input's dtype, ``linear``); saves only the packed weight (``ctx.tensors =
    (None, B)``: the input is not kept, no weight gradient); backward dequantises again
    (``F.dequantize_4bit``: scales ``+= offset`` in place, the weight in ``QuantState.dtype``, cast
    to the gradient's dtype) for ``grad_A = grad_output @ W``."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        ctx.layer = layer
        ctx.save_for_backward(weight)
        ctx.bias_dtype = None if bias is None else bias.dtype
        scales = layer.scales()
        w = layer.dequantize(scales, x.dtype)
        return torch.nn.functional.linear(x, w, bias)

    @staticmethod
    def backward(ctx, grad_output):
        layer = ctx.layer
        grad_bias = grad_output.sum(0, dtype=ctx.bias_dtype) if ctx.needs_input_grad[2] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            scales = layer.scales()
            w = layer.dequantize(scales, layer.weight_dtype).to(grad_output.dtype)
            grad_x = torch.matmul(grad_output, w)
        return grad_x, None, grad_bias, None


# ------------------------------------------------------------------- real bitsandbytes models
def _bnb_linear4bit_class() -> type | None:
    try:
        import bitsandbytes as bnb
    except Exception:  # noqa: BLE001 - not installed, or a build that cannot load: no such layers
        return None
    return bnb.nn.Linear4bit


def has_4bit_layers(model: nn.Module) -> bool:
    """True when ``model`` holds bitsandbytes ``Linear4bit`` layers (checked by class name first, so
    bitsandbytes is imported only for a model that may have them)."""
    if not any(type(m).__name__ in ("Linear4bit", "LinearNF4", "LinearFP4") for m in model.modules()):
        return False
    cls = _bnb_linear4bit_class()
    return cls is not None and any(isinstance(m, cls) for m in model.modules())


def twin_of(layer: nn.Module) -> NF4Linear:
    """An :class:`NF4Linear` on ``meta`` with ``layer``'s (a bitsandbytes ``Linear4bit``) settings,
    read from its ``QuantState`` (blocksize, nesting, original dtype) and its weight's storage dtype."""
    state = getattr(layer.weight, "quant_state", None) or getattr(layer, "quant_state", None)
    compute = layer.compute_dtype
    if state is None:  # not quantised yet (on meta): what .to(device) will make of it
        return NF4Linear(layer.in_features, layer.out_features, layer.bias is not None, compute_dtype=compute,
                         weight_dtype=layer.weight.dtype, quant_storage=layer.quant_storage,
                         double_quant=bool(layer.weight.compress_statistics), blocksize=layer.weight.blocksize)
    out_f, in_f = state.shape
    return NF4Linear(in_f, out_f, layer.bias is not None, compute_dtype=compute, weight_dtype=state.dtype,
                     quant_storage=layer.weight.dtype, double_quant=bool(state.nested), blocksize=state.blocksize)


def twin_4bit_layers(model: nn.Module) -> nn.Module:
    """``model`` with every bitsandbytes ``Linear4bit`` replaced by :func:`twin_of` it, or ``model``
    itself when it has none. The copy shares every other parameter and buffer with ``model`` (the
    same objects, nothing copied, so an optimizer built over ``model`` still names them); ``model``
    is not touched."""
    if not has_4bit_layers(model):
        return model
    cls = _bnb_linear4bit_class()
    memo: dict[int, Any] = {}
    for m in model.modules():
        if isinstance(m, cls):
            twin = twin_of(m)
            twin.train(m.training)
            memo[id(m)] = twin
    for p in model.parameters():
        memo.setdefault(id(p), p)
    for b in model.buffers():
        memo.setdefault(id(b), b)
    return copy.deepcopy(model, memo)
