"""CUDA autocast, emulated on CPU fake tensors.

``torch.autocast("cuda")`` only acts on CUDA tensors, and without a GPU the trace runs on CPU
fake tensors, whose own autocast follows different op lists (CPU does not upcast softmax or
layer_norm to fp32; CUDA does). This ``TorchFunctionMode`` applies CUDA's policy at the level of
Python torch functions, above autograd, so that casts are recorded and saved exactly as real
autocast's are. The op lists are CUDA's, from ``ATen/autocast_mode.h`` (``AT_FORALL_LOWER_PRECISION_FP``,
``AT_FORALL_FP32``, ``AT_FORALL_FP32_SET_OPT_DTYPE``, ``AT_FORALL_PROMOTE``; torch 2.13).

Like real autocast: only fp32 tensors are cast down; casts of leaf tensors that require grad
(weights) are cached until the forward pass ends (``cached_cast`` in ATen/autocast_mode.cpp);
an op runs under the policy once, and the ops it calls internally are not cast again.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

# ATen/autocast_mode.h, AT_FORALL_LOWER_PRECISION_FP
LOWER = frozenset(
    """_convolution conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d conv_transpose3d
    convolution prelu addmm addmv addr matmul einsum mm mv linalg_vecdot linear addbmm baddbmm bmm
    chain_matmul linalg_multi_dot lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell
    scaled_dot_product_attention""".split()
)
# ATen/autocast_mode.h, AT_FORALL_FP32
FP32 = frozenset(
    """acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow softplus
    layer_norm rms_norm group_norm frobenius_norm nuclear_norm cosine_similarity poisson_nll_loss
    cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss kl_div l1_loss smooth_l1_loss
    huber_loss mse_loss margin_ranking_loss multilabel_margin_loss soft_margin_loss
    triplet_margin_loss multi_margin_loss binary_cross_entropy_with_logits dist pdist cdist renorm
    logsumexp upsample_nearest1d upsample_nearest2d upsample_nearest3d upsample_linear1d
    upsample_bilinear2d upsample_trilinear3d upsample_bicubic2d""".split()
)
# ATen/autocast_mode.h, AT_FORALL_FP32_SET_OPT_DTYPE: the op is asked for an fp32 result; the
# input is not copied.
FP32_SET_DTYPE = frozenset("prod softmax log_softmax cumprod cumsum sum".split())
# ATen/autocast_mode.h, AT_FORALL_PROMOTE
PROMOTE = frozenset("addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add".split())

#: the emulations entered and not yet exited, innermost last (see ``active_emulation``)
_ACTIVE: list = []


def active_emulation():
    """The innermost :class:`CudaAutocastEmulation` entered and not exited, or None.

    Unlike torch's mode stack, this does not change while the emulation's own handler runs.
    """
    return _ACTIVE[-1] if _ACTIVE else None


_ALIASES = {"__matmul__": "matmul", "__rmatmul__": "matmul", "__pow__": "pow", "__rpow__": "pow"}
_LOW = (torch.float16, torch.bfloat16)


class CudaAutocastEmulation(TorchFunctionMode):
    """Apply CUDA autocast's policy to torch functions called on CPU tensors.

    Args:
        dtype: the lower precision, ``torch.float16`` or ``torch.bfloat16``.

    Set ``caching = False`` after the forward pass (checkpoint recomputation in backward then
    casts without a cache, as real autocast's per-recompute cache amounts to).
    """

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.caching = True
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def clear_cache(self) -> None:
        self._cache.clear()

    def _down(self, x):
        if not (isinstance(x, torch.Tensor) and x.dtype == torch.float32):
            return x
        if self.caching and x.is_leaf and x.requires_grad:
            hit = self._cache.get(id(x))
            if hit is not None and hit[0] is x:
                return hit[1]
            cast = x.to(self.dtype)
            self._cache[id(x)] = (x, cast)
            return cast
        return x.to(self.dtype)

    @staticmethod
    def _up(x):
        return x.float() if isinstance(x, torch.Tensor) and x.dtype in _LOW else x

    def __enter__(self):
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            if _ACTIVE and _ACTIVE[-1] is self:
                _ACTIVE.pop()

    def call(self, func, args=(), kwargs=None):
        """Run ``func`` under CUDA autocast's policy: what ``__torch_function__`` does for a call it sees.

        For torch functions called from inside a Python-composite function that the trace
        reroutes (``F.multi_head_attention_forward``: a ``TorchFunctionMode`` never sees those nested
        calls), whereas real autocast, a dispatcher key, casts every ATen op the composite calls.
        """
        return self.__torch_function__(func, (), args, kwargs)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        name = _ALIASES.get(name, name)
        if name in LOWER:
            args, kwargs = tree_map(self._down, (args, kwargs))
        elif name in FP32:
            args, kwargs = tree_map(self._up, (args, kwargs))
        elif name in FP32_SET_DTYPE:
            first = args[0] if args else None
            if isinstance(first, torch.Tensor) and first.dtype in _LOW and kwargs.get("dtype") is None:
                if name in ("softmax", "log_softmax") and len(args) >= 3:
                    args = (*args[:2], torch.float32, *args[3:])
                elif not (name in ("sum", "prod", "cumsum", "cumprod") and len(args) > 2):
                    kwargs = {**kwargs, "dtype": torch.float32}
        elif name == "cross_entropy":
            # CompositeImplicit: autocast acts on the ops it is made of (see _cross_entropy_autocast)
            first = args[0] if args else kwargs.get("input")
            if isinstance(first, torch.Tensor) and first.dtype in _LOW:
                return _cross_entropy_autocast(*args, **kwargs)
        elif name in PROMOTE:
            floats = [x.dtype for x in args if isinstance(x, torch.Tensor) and x.is_floating_point()]
            if len(set(floats)) > 1:
                widest = torch.float32 if torch.float32 in floats else floats[0]
                args = tree_map(lambda x: x.to(widest) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, args)
        return func(*args, **kwargs)


def _cross_entropy_autocast(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                           reduction="mean", label_smoothing=0.0):
    """``F.cross_entropy`` of 16-bit logits under CUDA autocast, op by op.

    ATen's ``cross_entropy_loss`` (aten/src/ATen/native/LossNLL.cpp, torch 2.13) calls
    ``log_softmax(self, class_dim, self.scalar_type())``: the dtype is given, so autocast's
    ``fp32_set_opt_dtype`` policy (ATen/autocast_mode.h) leaves the log-probabilities 16-bit, and
    ``log_softmax`` saves them for backward. ``nll_loss`` is on autocast's fp32 list, so it runs on an
    fp32 copy of them, which it saves too (``nll_loss_backward`` takes ``self``; derivatives.yaml).
    With label smoothing the extra term sums the 16-bit log-probabilities over the classes with an
    fp32 result (``sum`` is ``fp32_set_opt_dtype`` as well). Probability targets take ATen's
    ``cross_entropy_loss_prob_target``, which has no op on autocast's lists: it runs unchanged.
    """
    import torch.nn.functional as F

    if target.is_floating_point():
        return F.cross_entropy(input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing)
    dim = 1 if input.dim() > 1 else 0
    logp = F.log_softmax(input, dim=dim, dtype=input.dtype)
    loss = F.nll_loss(logp.float(), target, weight, size_average, ignore_index, reduce, reduction)
    if label_smoothing:
        smooth = -logp.sum(dim, dtype=torch.float32)
        smooth = smooth.masked_fill(target == ignore_index, 0.0)
        smooth = smooth.sum() / (target != ignore_index).sum().clamp(min=1) if reduction == "mean" else (
            smooth.sum() if reduction == "sum" else smooth)
        loss = (1 - label_smoothing) * loss + label_smoothing * smooth / input.shape[dim]
    return loss
