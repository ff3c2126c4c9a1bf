"""CUDA kernel rules other than attention: dropout, softmax and losses, norms, embeddings,
convolutions, optimizers (see :mod:`memguard.estimator._cuda_kernels`).

Each rule replaces one family of torch functions, while the trace models a CUDA target on CPU fake
tensors, by a ``torch.autograd.Function`` whose forward and backward create fake tensors of exactly
the sizes and dtypes that CUDA's kernels create, keep and free, in the same order. Every rule names
the PyTorch source it follows (paths under ``aten/src/ATen/native/`` of torch 2.13, the installed
version, unless a rule says otherwise); the saved tensors follow ``tools/autograd/derivatives.yaml``.

What the CPU trace records instead, and why each rule exists:

* ``F.dropout``: the CPU runs ``_dropout_impl`` (``Dropout.cpp``), a noise tensor in the input's
  dtype (4 bytes an element in fp32) kept for backward; CUDA runs ``native_dropout`` and keeps a
  1-byte bool mask (``is_fused_kernel_acceptable``).
* ``softmax`` / ``log_softmax`` of a float16 tensor with ``dtype=torch.float32``: the CPU first
  copies the input to fp32 (``SoftMax.cpp``), and its backward produces an fp32 gradient that is
  then cast back; CUDA runs ``_softmax(x, dim, half_to_float=True)`` with neither copy.
* ``F.rms_norm``: on the CPU ``_fused_rms_norm`` is the composite (an fp32 copy of the input, the
  normalised product and the weighted product are saved); CUDA's fused kernel keeps one fp32
  ``rstd`` value per row (``cuda/layer_norm_kernel.cu``); torch 2.4-2.7 ran their own composite.
* ``F.layer_norm``: CUDA keeps ``mean``/``rstd`` in the accumulate type (fp32 for 16-bit inputs,
  where the CPU keeps 16-bit ones), and its weight-gradient reduction for many rows and a narrow
  hidden size uses per-block partial buffers.
* ``F.embedding``: the CPU's dense backward allocates only the weight gradient; CUDA's
  (``cuda/Embedding.cu``, ``cuda/EmbeddingBackwardKernel.cu``) sorts the indices for more than
  3072 of them and keeps sorted and original indices, segment offsets and fp32 partial sums of
  ``(n/10 + min(n, V)) x D`` during the backward.
* convolutions have no rule: their cuDNN workspaces are the execution plan's choice, which no trace
  can know; :mod:`memguard.estimator._unmodelled` names them and, under a cap
  (``CUDNN_CONV_WSCAP_DBG``, :func:`conv_workspace_cap_bytes`), bounds them in
  ``Estimate.peak_upper_bytes``.

Cross-entropy needs no rule of its own: ``cross_entropy`` is composite (``LossNLL.cpp``:
``log_softmax`` then ``nll_loss``), the same on both devices, and CUDA's ``nll_loss`` kernels
(``cuda/Loss.cu``) allocate what the meta kernels do (``output``, ``total_weight``; a zeroed
``grad_input``). Its only CUDA difference is the fp16 ``log_softmax`` above, which the rule covers.
Optimizers need none either, only the path torch.optim would choose on CUDA; see
:func:`cuda_group_foreach` and :func:`cuda_optimizer_path`.

Known limitations:
    Memory a CUDA library allocates through the caching allocator without a tensor is not
    modelled where its size is decided at run time: CUB's temporary storage in the embedding
    backward's radix sort and segment scans, cuDNN convolution workspaces (bounded only under a
    cap), and the cuDNN RNN reserve space: :mod:`memguard.estimator._unmodelled` lists them. Batch and group norm keep per-channel (``[C]``) or per-group
    (``[N, G]``) statistics on both devices and have no rule; their CUDA backwards' ``[N, C]``
    accumulate-type scratch (cuda/group_norm_kernel.cu) is not modelled.
    ``benchmarks/gpu_kernels.py`` measures each of these next to the model on a real GPU.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from memguard.errors import ConfigError
from memguard.estimator._cuda_kernels import CudaTarget, cuda_op_rule, cuda_rule

#: cuda/Embedding.cu ``embedding_dense_backward_cuda``: up to this many indices (and without
#: ``scale_grad_by_freq``) the backward runs one feature kernel on ``grad_weight`` alone (torch 2.13).
EMBEDDING_SORT_THRESHOLD = 3072
#: cuda/EmbeddingBackwardKernel.cu ``NROWS_PER_THREAD``: rows summed into one partial segment.
EMBEDDING_ROWS_PER_PARTIAL = 10


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any) -> Any:
    """Argument ``name`` (position ``index``) of a torch function call, or its default."""
    if len(args) > index:
        return args[index]
    return kwargs.get(name, default)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """``at::toAccumulateType(t, /*is_cuda=*/true)`` (ATen/AccumulateType.h): fp32 for 16-bit and
    fp32 floats, fp64 for fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _empty(shape, dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device=like.device)


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    """``expect_contiguous()`` / ``contiguous()``: a copy only when the tensor is not contiguous."""
    return t if t.is_contiguous() else t.contiguous()


# --------------------------------------------------------------------------------------------
# Dropout
# --------------------------------------------------------------------------------------------


class _NativeDropout(torch.autograd.Function):
    """CUDA's ``native_dropout`` (cuda/Dropout.cu ``dropout_cuda<bool>``): an output like the
    input and a bool mask; autograd keeps the mask only (derivatives.yaml ``native_dropout``:
    ``native_dropout_backward(grad, result1, scale)``), whose CUDA kernel
    (``dropout_backward_cuda``) allocates one gradient like ``grad``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        mask = torch.empty_like(x, dtype=torch.bool)
        out = torch.empty_like(x)
        ctx.save_for_backward(mask)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.saved_tensors  # the mask is read here and released with the graph
        return torch.empty_like(grad)


@cuda_rule(F.dropout, torch.dropout)
def dropout(target: CudaTarget, func: Callable, args: tuple, kwargs: dict) -> Any:
    """``F.dropout`` / ``torch.dropout`` as CUDA runs them.

    Dropout.cpp ``dropout``: a training call with ``0 < p < 1`` on a non-empty CUDA tensor takes
    ``native_dropout`` (``is_fused_kernel_acceptable``); in-place dropout (``dropout_``), ``p``
    of 0 or 1 and evaluation keep the generic ``_dropout_impl``, exactly as on the CPU.
    """
    x = args[0] if args else kwargs.get("input")
    if func is F.dropout:
        p = _arg(args, kwargs, 1, "p", 0.5)
        train = _arg(args, kwargs, 2, "training", True)
        inplace = _arg(args, kwargs, 3, "inplace", False)
    else:  # torch.dropout(input, p, train)
        p = _arg(args, kwargs, 1, "p", 0.5)
        train = _arg(args, kwargs, 2, "train", True)
        inplace = False
    if inplace or not train or not (0.0 < float(p) < 1.0) or not isinstance(x, torch.Tensor) or x.numel() == 0:
        return func(*args, **kwargs)
    if x.is_nested or not x.is_floating_point():
        return func(*args, **kwargs)
    return _NativeDropout.apply(x)


# --------------------------------------------------------------------------------------------
# softmax / log_softmax of float16 with an fp32 result
# --------------------------------------------------------------------------------------------


class _HalfToFloatSoftmax(torch.autograd.Function):
    """``_softmax`` / ``_log_softmax`` with ``half_to_float=True`` (cuda/SoftMax.cu
    ``host_softmax``): the input is made contiguous, the output is fp32 and is what autograd
    keeps (derivatives.yaml ``_softmax``/``_log_softmax``: ``result``); the backward
    (``_softmax_backward_data(grad, result, dim, Half)``) writes a float16 gradient directly."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        xc = _contiguous(x)
        out = torch.empty(xc.shape, dtype=torch.float32, device=xc.device)
        del xc
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (out,) = ctx.saved_tensors
        g = _contiguous(grad)
        return torch.empty(g.shape, dtype=torch.float16, device=g.device)


_SOFTMAXES = (F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, torch.Tensor.softmax, torch.Tensor.log_softmax)


@cuda_rule(*_SOFTMAXES)
def softmax_half_to_float(target: CudaTarget, func: Callable, args: tuple, kwargs: dict) -> Any:
    """``softmax``/``log_softmax`` of a float16 tensor asked for an fp32 result.

    SoftMax.cpp ``softmax(input, dim, dtype)`` / ``log_softmax``: ``input.is_cuda() && Half &&
    dtype == Float`` calls ``_softmax(input, dim, /*half_to_float=*/true)``; any other case
    converts the input first (``input_.toType(dtype)``), as the CPU always does. bfloat16 is not
    part of the fused path.
    """
    x = args[0] if args else kwargs.get("input", kwargs.get("self"))
    dim = _arg(args, kwargs, 1, "dim", None)
    if func in (F.softmax, F.log_softmax):
        dtype = _arg(args, kwargs, 3, "dtype", None)
    else:
        dtype = _arg(args, kwargs, 2, "dtype", None)
    if (
        not isinstance(x, torch.Tensor) or x.dtype != torch.float16 or dtype != torch.float32
        or dim is None or not isinstance(dim, int) or x.is_nested or x.is_sparse
    ):
        return func(*args, **kwargs)
    return _HalfToFloatSoftmax.apply(x)


# --------------------------------------------------------------------------------------------
# Layer norm and RMS norm
# --------------------------------------------------------------------------------------------


def _rows_cols(x: torch.Tensor, normalized_shape) -> tuple[int, int, list[int]]:
    """``_check_layer_norm_inputs``: M rows of N normalised elements, and the stats' view shape."""
    nd = len(normalized_shape)
    axis = x.dim() - nd
    m = math.prod(x.shape[:axis])
    n = math.prod(x.shape[axis:])
    return m, n, list(x.shape[:axis]) + [1] * nd


def layer_norm_partial_rows(m: int, n: int, sm_count: int | None) -> int:
    """Rows of the per-block partial buffers of CUDA's layer/RMS-norm weight gradient, 0 if none.

    cuda/layer_norm_kernel.cu ``LaunchGammaBetaBackwardCUDAKernel`` (torch 2.13): when
    ``M > 64 * 1024 && N / 32 < sm_count / 2`` it launches ``blocks.y = min(32768 / blocks.x,
    ceil(M / 32))`` row blocks (``blocks.x = ceil(N / 32)``) that write ``[blocks.y, N]`` partial
    sums in the weight's dtype, then reduces them with ``.sum(0)``. Without a known SM count the
    condition cannot be evaluated and 0 is returned.
    """
    if sm_count is None or m <= 64 * 1024 or not (n // 32 < sm_count // 2):  # integer division, as in C++
        return 0
    blocks_x = -(-n // 32)
    return int(min((64 * 1024 // 2) // blocks_x, -(-m // 32)))


def _weight_grads(target: CudaTarget, m: int, n: int, params: list[torch.Tensor | None], need: list[bool]) -> list:
    """``dgamma``/``dbeta`` as the CUDA kernel leaves them: ``empty_like`` each, or, on the
    partial-buffer path, the partial buffers (all of them live together) reduced by ``sum(0)``."""
    # ROCm's launch is not replayed (its block width differs in newer releases): bounded there instead
    # (memguard.estimator._unmodelled.layer_norm_partial_bytes), as without an SM count
    rows = layer_norm_partial_rows(m, n, target.sm_count if target.vendor == "nvidia" else None)
    grads: list = [torch.empty_like(p) if (p is not None and nd) else None for p, nd in zip(params, need)]
    if rows and grads[0] is not None:
        partials = [torch.empty((rows, n), dtype=g.dtype, device=g.device) if g is not None else None for g in grads]
        grads = [part.sum(0).view(g.shape) if part is not None else None for part, g in zip(partials, grads)]
        del partials
    return grads


class _LayerNorm(torch.autograd.Function):
    """cuda/layer_norm_kernel.cu ``layer_norm_cuda``: ``Y`` like the (contiguous) input and
    ``mean``/``rstd`` of ``M`` accumulate-type values, viewed to the stats shape; autograd keeps
    input, weight, bias, mean and rstd (derivatives.yaml ``native_layer_norm``).
    ``layer_norm_backward_cuda``: ``dX``/``dgamma``/``dbeta`` with ``empty_like``, ``dY`` made
    contiguous (``LayerNormBackwardKernelImpl``), partial buffers as in
    :func:`layer_norm_partial_rows`."""

    @staticmethod
    def forward(ctx, x, weight, bias, normalized_shape, target):
        m, n, stat_shape = _rows_cols(x, normalized_shape)
        xc = _contiguous(x)
        y = torch.empty_like(xc, memory_format=torch.contiguous_format)
        acc = _acc_dtype(x.dtype)
        mean = _empty((m,), acc, x).view(stat_shape)
        rstd = _empty((m,), acc, x).view(stat_shape)
        del xc
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.mn = (m, n)
        ctx.target = target
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        m, n = ctx.mn
        xc = _contiguous(x)
        dx = torch.empty_like(xc, memory_format=torch.contiguous_format) if ctx.needs_input_grad[0] else None
        need = [ctx.needs_input_grad[1], ctx.needs_input_grad[2]]
        gc = _contiguous(grad)
        dgamma, dbeta = _weight_grads(ctx.target, m, n, [weight, bias], need)
        del gc, xc
        return dx, dgamma, dbeta, None, None


@cuda_rule(F.layer_norm, torch.layer_norm)
def layer_norm(target: CudaTarget, func: Callable, args: tuple, kwargs: dict) -> Any:
    """``F.layer_norm`` / ``torch.layer_norm`` as ``native_layer_norm`` runs on CUDA."""
    x = args[0] if args else kwargs.get("input")
    shape = _arg(args, kwargs, 1, "normalized_shape", None)
    weight = _arg(args, kwargs, 2, "weight", None)
    bias = _arg(args, kwargs, 3, "bias", None)
    eps = _arg(args, kwargs, 4, "eps", 1e-5)
    if not isinstance(x, torch.Tensor) or shape is None or x.is_nested or not x.is_floating_point():
        return func(*args, **kwargs)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    del eps  # values do not change what is allocated
    return _LayerNorm.apply(x, weight, bias, shape, target)


class _FusedRmsNorm(torch.autograd.Function):
    """cuda/layer_norm_kernel.cu ``_fused_rms_norm_cuda``: ``Y`` like the contiguous input and
    ``rstd`` of ``M`` accumulate-type values viewed to the stats shape; autograd keeps input,
    weight and rstd (derivatives.yaml ``_fused_rms_norm``: ``_fused_rms_norm_backward(grad,
    input, normalized_shape, result1, weight, mask)``), whose CUDA kernel writes ``dX`` and
    ``dgamma`` (with ``empty_like``; partial buffers for ``dgamma`` only, ``rms_norm=true``)."""

    @staticmethod
    def forward(ctx, x, weight, normalized_shape, target):
        m, n, stat_shape = _rows_cols(x, normalized_shape)
        xc = _contiguous(x)
        y = torch.empty_like(xc, memory_format=torch.contiguous_format)
        rstd = _empty((m,), _acc_dtype(x.dtype), x).view(stat_shape)
        del xc
        ctx.save_for_backward(x, weight, rstd)
        ctx.mn = (m, n)
        ctx.target = target
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        m, n = ctx.mn
        xc = _contiguous(x)
        dx = torch.empty_like(xc, memory_format=torch.contiguous_format) if ctx.needs_input_grad[0] else None
        gc = _contiguous(grad)
        (dgamma,) = _weight_grads(ctx.target, m, n, [weight], [ctx.needs_input_grad[1]])
        del gc, xc
        return dx, dgamma, None, None


#: torch 2.8 gave ``_fused_rms_norm`` its CUDA kernel (native_functions.yaml: ``CUDA:
#: _fused_rms_norm_cuda``; earlier releases ran the composite on every device).
FUSED_RMS_NORM_SINCE = (2, 8)


#: pytorch/pytorch#147203 (torch 2.7) moved the composite's weight multiply into the op-math type,
#: casting once at the end (as pytorch/pytorch#187779 recounts: "the CPU side was aligned in #147203").
RMS_NORM_WEIGHT_IN_OPMATH_SINCE = (2, 7)


def rms_norm_composite(x: torch.Tensor, normalized_shape, weight: torch.Tensor | None, eps: float | None,
                       torch_version: tuple[int, int]) -> torch.Tensor:
    """``rms_norm`` as layer_norm.cpp wrote it before the fused CUDA kernel (torch 2.4 to 2.7), the
    composite every device ran: the input upcast to its op-math type (``toOpMathType``: fp32 for
    16-bit inputs, the input itself for fp32), ``rsqrt(pow(upcast, 2).mean(dims, keepdim=True)
    .add_(eps))`` and ``upcast.mul(rsqrt)``; then, in torch 2.4 to 2.6, ``.type_as(input)`` and
    ``mul(weight)`` in the input's dtype, and from 2.7 (:data:`RMS_NORM_WEIGHT_IN_OPMATH_SINCE`)
    ``mul(weight)`` in the op-math type and ``type_as(input)`` last.

    Autograd keeps the upcast (``pow`` and ``mul`` save it), the product that ``mul(weight)`` saves
    and the output: on [8192, 4096] bf16 with a bf16 weight 128 + 64 + 64 = 256 MiB in 2.4-2.6,
    128 + 128 + 64 = 320 MiB in 2.7 (the fused kernel of 2.8+: the 64 MiB output and the rstd).
    Written out in ATen calls because the installed torch's own composite may be another release's.
    """
    dims = list(range(x.dim() - len(normalized_shape), x.dim()))  # dims_to_reduce: the trailing dims
    opmath = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    upcast = x.to(opmath)
    eps_val = float(eps) if eps is not None else torch.finfo(opmath).eps  # numeric_limits<opmath>::epsilon()
    rstd = torch.rsqrt(torch.pow(upcast, 2).mean(dims, keepdim=True).add_(eps_val))
    result = upcast.mul(rstd)
    del upcast, rstd
    if torch_version >= RMS_NORM_WEIGHT_IN_OPMATH_SINCE:
        if weight is not None:
            result = result.mul(weight)
        return result.type_as(x)
    result = result.type_as(x)
    if weight is not None:
        result = result.mul(weight)
    return result


@cuda_rule(F.rms_norm, torch.rms_norm)
def rms_norm(target: CudaTarget, func: Callable, args: tuple, kwargs: dict) -> Any:
    """``F.rms_norm`` / ``torch.rms_norm`` as CUDA runs them.

    layer_norm.cpp ``rms_norm_symint``: channels-last or complex inputs, and a weight whose dtype
    differs from the input's, take ``rms_norm_composite`` (as on the CPU); everything else calls
    ``_fused_rms_norm``, the fused CUDA kernel. A target torch older than 2.8 runs the composite of
    its own release (:func:`rms_norm_composite`; ``F.rms_norm`` arrived in 2.4).
    """
    x = args[0] if args else kwargs.get("input")
    shape = _arg(args, kwargs, 1, "normalized_shape", None)
    weight = _arg(args, kwargs, 2, "weight", None)
    if (
        target.torch_version < FUSED_RMS_NORM_SINCE and isinstance(x, torch.Tensor) and shape is not None
        and not x.is_nested and x.is_floating_point()
    ):
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        return rms_norm_composite(x, shape, weight, _arg(args, kwargs, 3, "eps", None), target.torch_version)
    if (
        target.torch_version < FUSED_RMS_NORM_SINCE or not isinstance(x, torch.Tensor) or shape is None
        or x.is_nested or x.is_complex() or not x.is_floating_point()
        or (weight is not None and weight.dtype != x.dtype)
        or (x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous())
        or (x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d) and not x.is_contiguous())
    ):
        return func(*args, **kwargs)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    return _FusedRmsNorm.apply(x, weight, shape, target)


# --------------------------------------------------------------------------------------------
# Embedding
# --------------------------------------------------------------------------------------------


def embedding_backward_temporaries(num_indices: int, num_weights: int, dim: int, grad_dtype: torch.dtype,
                                   index_dtype: torch.dtype = torch.int64,
                                   scale_grad_by_freq: bool = False) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """The temporaries CUDA's dense embedding backward allocates, in order: ``(name, shape, dtype)``.

    cuda/Embedding.cu ``embedding_dense_backward_cuda`` (torch 2.13): up to
    :data:`EMBEDDING_SORT_THRESHOLD` indices without ``scale_grad_by_freq``, none (one kernel on
    ``grad_weight``). Otherwise ``sorted_indices`` and ``orig_indices`` (like the indices), ``range``
    (``arange``, freed after the radix sort), ``count`` with ``scale_grad_by_freq``; then
    cuda/EmbeddingBackwardKernel.cu ``embedding_backward_cuda_kernel``: ``segment_offsets`` [n],
    ``num_of_segments`` (int64 scalar), ``partials_per_segment`` and its offsets
    [min(n, V)], ``num_of_partial_segments`` (int64 scalar), ``partial_segment_offset`` and
    ``grad_weight_per_segment`` [n / 10 + min(n, V)] (x D, fp32 for 16-bit gradients).
    """
    if num_indices <= EMBEDDING_SORT_THRESHOLD and not scale_grad_by_freq:
        return []
    n = num_indices
    max_segments = min(n, num_weights)
    max_partial = n // EMBEDDING_ROWS_PER_PARTIAL + max_segments
    partial_dtype = torch.float32 if grad_dtype in (torch.float16, torch.bfloat16) else grad_dtype
    out = [("sorted_indices", (n,), index_dtype), ("orig_indices", (n,), index_dtype), ("range", (n,), index_dtype)]
    if scale_grad_by_freq:
        out.append(("count", (n,), index_dtype))
    out += [
        ("segment_offsets", (n,), index_dtype),
        ("num_of_segments", (), torch.int64),
        ("partials_per_segment", (max_segments,), index_dtype),
        ("partials_per_segment_offset", (max_segments,), index_dtype),
        ("num_of_partial_segments", (), torch.int64),
        ("partial_segment_offset", (max_partial,), index_dtype),
        ("grad_weight_per_segment", (max_partial, dim), partial_dtype),
    ]
    return out


class _Embedding(torch.autograd.Function):
    """``embedding`` forward (an ``index_select`` output on both devices) with CUDA's dense
    backward; autograd keeps the indices (derivatives.yaml ``embedding``)."""

    @staticmethod
    def forward(ctx, weight, indices, padding_idx, scale_grad_by_freq):
        out = torch.embedding(weight, indices, padding_idx, scale_grad_by_freq, False)
        ctx.save_for_backward(indices)
        ctx.meta = (weight.shape[0], padding_idx, scale_grad_by_freq)
        return out

    @staticmethod
    def backward(ctx, grad):
        (indices,) = ctx.saved_tensors
        num_weights, _padding_idx, scale = ctx.meta
        ic = _contiguous(indices)
        g = _contiguous(grad)
        dim = g.shape[-1]
        temps = embedding_backward_temporaries(ic.numel(), num_weights, dim, g.dtype, ic.dtype, scale)
        live = {}
        grad_weight = None
        for name, shape, dtype in temps:
            if name == "segment_offsets":  # embedding_backward_cuda_kernel: grad_weight comes first
                grad_weight = torch.zeros((num_weights, dim), dtype=g.dtype, device=g.device)
            live[name] = torch.empty(shape, dtype=dtype, device=g.device)
            if name == "range":  # lives only while the radix sort runs
                del live[name]
        if grad_weight is None:  # the feature kernel: grad_weight alone
            grad_weight = torch.zeros((num_weights, dim), dtype=g.dtype, device=g.device)
        del live, g, ic
        return grad_weight, None, None, None


@cuda_rule(F.embedding)
def embedding(target: CudaTarget, func: Callable, args: tuple, kwargs: dict) -> Any:
    """``F.embedding`` with CUDA's dense backward (sparse gradients and ``max_norm`` keep the
    generic path: ``embedding_renorm_`` and the sparse backward are not modelled)."""
    indices = args[0] if args else kwargs.get("input")
    weight = _arg(args, kwargs, 1, "weight", None)
    padding_idx = _arg(args, kwargs, 2, "padding_idx", None)
    max_norm = _arg(args, kwargs, 3, "max_norm", None)
    scale = bool(_arg(args, kwargs, 5, "scale_grad_by_freq", False))
    sparse = bool(_arg(args, kwargs, 6, "sparse", False))
    if (
        sparse or max_norm is not None or not isinstance(weight, torch.Tensor) or not isinstance(indices, torch.Tensor)
        or weight.dim() != 2 or indices.is_floating_point()
    ):
        return func(*args, **kwargs)
    # F.embedding's own normalisation of padding_idx (torch/nn/functional.py)
    if padding_idx is None:
        padding_idx = -1
    elif padding_idx < 0:
        padding_idx = weight.size(0) + padding_idx
    return _Embedding.apply(weight, indices, padding_idx, scale)


# --------------------------------------------------------------------------------------------
# Convolutions: the cuDNN workspace cap (the workspaces are listed by _unmodelled)
# --------------------------------------------------------------------------------------------


def conv_workspace_cap_bytes(target: CudaTarget) -> int | None:
    """The cuDNN convolution workspace bound in bytes, or None when there is none.

    ``CudaTarget.conv_workspace_bytes`` when set, else the ``CUDNN_CONV_WSCAP_DBG`` environment
    variable (MiB; "CUDA Environment Variables" in the PyTorch docs: "used to set the workspace
    configuration for cuDNN per allocation", read by cuDNN itself). Without a cap cuDNN chooses
    plans by its heuristics (or by speed under ``cudnn.benchmark``) and takes what the allocator can
    give; no trace can know it. Read by :func:`memguard.estimator._unmodelled.conv_workspace`.
    """
    if target.conv_workspace_bytes is not None:
        return int(target.conv_workspace_bytes)
    raw = os.environ.get("CUDNN_CONV_WSCAP_DBG")
    if raw:
        try:
            return int(raw) * 1024 * 1024
        except ValueError:
            raise ConfigError(
                f"CUDNN_CONV_WSCAP_DBG={raw!r} is not a whole number of MiB (cuDNN reads it as one); set it "
                "to e.g. 4096, or unset it"
            ) from None
    return None


# --------------------------------------------------------------------------------------------
# Matrix products: operands cuBLAS cannot read in place
# --------------------------------------------------------------------------------------------


def _non_overlapping_and_dense(sizes: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """``TensorImpl::compute_non_overlapping_and_dense`` (c10/core/TensorImpl.cpp): in the order of
    increasing strides (size-1 dims last), each stride is the product of the sizes before it."""
    order = sorted(range(len(sizes)), key=lambda i: (sizes[i] < 2, strides[i]))
    expected = 1
    for i in order:
        if sizes[i] < 2:
            return True
        if strides[i] != expected:
            return False
        expected *= sizes[i]
    return True


def cublas_needs_copy(t: torch.Tensor) -> bool:
    """Whether CUDA's ``mm``/``addmm`` copies this 2-d operand before calling cuBLAS.

    ``prepare_matrix_for_cublas`` (aten/src/ATen/native/cuda/Blas.cpp; cuBlasCommonArgs.h in recent
    releases, the same code from torch 1.x to 2.13): a non-overlapping dense tensor is passed as it
    is, and so is a column-major (``stride(0) == 1``, ``stride(1) >= max(1, size(0))``) or row-major
    (``stride(1) == 1``, ``stride(0) >= max(1, size(1))``) one; anything else, such as the
    stride-0 gradient that ``sum()``'s backward expands, becomes ``tensor.clone(Contiguous)``.
    """
    if t.dim() != 2 or t.numel() == 0:
        return False
    if _non_overlapping_and_dense(tuple(t.shape), t.stride()):
        return False
    (s0, s1), (n0, n1) = t.stride(), t.shape
    if s0 == 1 and s1 >= max(1, n0):
        return False
    return not (s1 == 1 and s0 >= max(1, n1))


@cuda_op_rule(torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
def cublas_operand_copies(target: CudaTarget, args: tuple, out: Any, replay: Any) -> None:
    """The contiguous copies ``prepare_matrix_for_cublas`` makes of ``mm``/``addmm`` operands (see
    :func:`cublas_needs_copy`): allocated after the output (``addmm_out_cuda_impl`` runs on the
    structured kernel's output) and freed when the call returns. A fake-tensor trace records neither,
    as the meta kernel reads strides without copying: the backward of ``logits.sum()`` hands the
    language-model head's two gradient matmuls a stride-0 ``[tokens, vocab]`` gradient, and CUDA
    materialises it in each (``mean()`` divides first, which is already a dense tensor).
    """
    del target
    mats = args[:2] if len(args) == 2 else args[1:3]  # mm(self, mat2); addmm(self, mat1, mat2, ...)
    replay.outputs()
    for i, m in enumerate(mats):
        if isinstance(m, torch.Tensor) and cublas_needs_copy(m):
            replay.alloc(f"operand{i}", m.numel() * m.element_size())
    replay.free("operand0", "operand1")


# --------------------------------------------------------------------------------------------
# Optimizers
# --------------------------------------------------------------------------------------------


#: Built-in optimizers whose functional form resolves ``foreach=None`` (with ``fused=None``) by
#: ``_default_to_fused_or_foreach`` (torch/optim/adam.py, sgd.py, ... torch 2.13; AdamW subclasses Adam).
#: Not: Adafactor (_adafactor.py ``if foreach:``, so None takes the for-loop), Muon (_muon.py: for-loop
#: only, foreach=True raises), LBFGS and SparseAdam (no foreach implementation).
_FOREACH_BY_DEFAULT = ("Adadelta", "Adagrad", "Adam", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop", "SGD")
_NO_FOREACH_BY_DEFAULT = ("Adafactor", "Muon", "LBFGS", "SparseAdam")


def _is_optimizer(cls: type, names: tuple[str, ...]) -> bool:
    return any(isinstance(getattr(torch.optim, n, None), type) and issubclass(cls, getattr(torch.optim, n))
               for n in names)


def cuda_group_foreach(optimizer_cls: type, group: Mapping[str, Any], params: Iterable[Any] | None = None) -> bool:
    """Whether ``optimizer.step()`` takes the foreach path for one param group on CUDA tensors.

    torch 2.13: an explicit ``fused=True`` or ``foreach=...`` wins. Left at None, the built-in
    optimizers call ``_default_to_fused_or_foreach(params, differentiable, use_fused=False)``
    (torch/optim/optimizer.py), which is False with ``differentiable=True`` or when a parameter's
    exact type is not in ``torch.optim.optimizer._foreach_supported_types`` (Tensor, Parameter, and
    DTensor once torch.distributed.tensor is imported: a tensor subclass takes the for-loop);
    Adam and AdamW then also keep the for-loop for a Tensor ``lr`` without ``capturable=True``
    (adam.py: "Do not flip on foreach for the unsupported case"). Other optimizers with a Tensor lr
    keep foreach. Dtypes play no part in the foreach choice (only ``fused`` checks them).

    Args:
        optimizer_cls: the optimizer's class (subclasses of a built-in follow its functional form).
        group: the param group (its ``foreach``, ``fused``, ``differentiable``, ``lr``, ``capturable``).
        params: the tensors whose types decide, as they will be in training: the user's parameters,
            not the trace's fake tensors (``FakeTensor`` is no supported type); None = ``group["params"]``.

    An optimizer memguard does not know with a ``foreach`` option is taken to default to foreach on
    CUDA, as every built-in one documents.
    """
    if group.get("fused"):
        return False
    if group.get("foreach") is not None:
        return bool(group["foreach"])
    if _is_optimizer(optimizer_cls, _NO_FOREACH_BY_DEFAULT) or "foreach" not in group:
        return False
    if group.get("differentiable"):  # _default_to_fused_or_foreach: differentiable -> (False, False)
        return False
    from torch.optim.optimizer import _foreach_supported_types  # the live list (DTensor appends itself)

    # _default_to_fused_or_foreach: type(p) in _foreach_supported_types and a foreach device (CUDA here)
    if not all(p is None or type(p) in _foreach_supported_types for p in (group["params"] if params is None else params)):
        return False
    # adam.py adam(): foreach stays off for a Tensor lr without capturable (Adam, and AdamW through it)
    if _is_optimizer(optimizer_cls, ("Adam",)) and isinstance(group.get("lr"), torch.Tensor) and not group.get("capturable"):
        return False
    return True


def cuda_optimizer_path(optimizer: torch.optim.Optimizer, target: CudaTarget) -> str:
    """The implementation ``optimizer.step()`` takes on CUDA tensors: ``"fused"``, ``"foreach"``,
    ``"for-loop"``, or ``"mixed"`` when its param groups differ.

    Per group: ``fused=True`` gives the fused kernels, otherwise :func:`cuda_group_foreach` decides
    (torch/optim/optimizer.py ``_default_to_fused_or_foreach``, torch 2.13), judging the types of the
    optimizer's own parameters. Traced on CPU fake tensors the same Python code runs with the same
    ``_foreach_*`` calls, and each ``_foreach_*`` CUDA kernel (cuda/ForeachBinaryOpList.cu etc. over
    ``multi_tensor_apply``, whose tensor lists travel as kernel arguments) allocates exactly its
    output list, which is what the CPU's per-tensor fallbacks allocate; ``_fused_adam(w)_``
    (cuda/fused_adam_impl.cu) updates in place and allocates nothing, like its CPU kernel. So the
    CUDA target only has to set each group's ``foreach`` flag to torch's CUDA choice.
    """
    del target  # no compute-capability dependence in torch 2.13's choice
    if "foreach" not in getattr(optimizer, "defaults", {}):
        return "for-loop"  # optimizers without a foreach implementation (LBFGS, SparseAdam)
    paths = {
        "fused" if g.get("fused") else "foreach" if cuda_group_foreach(type(optimizer), g) else "for-loop"
        for g in optimizer.param_groups
    }
    return paths.pop() if len(paths) == 1 else "mixed"


#: pytorch/pytorch#104898 (torch 2.1) made ``_multi_tensor_adam``/``_multi_tensor_adamw`` add eps to
#: the square-root list in place; torch 2.0 computed ``denom = torch._foreach_add(exp_avg_sq_sqrt,
#: eps)``, a second parameter-sized list live through ``_foreach_addcdiv_`` (pytorch/pytorch#97712).
ADAM_DENOM_IN_PLACE_SINCE = (2, 1)


class _OutOfPlaceAdamDenom(TorchFunctionMode):
    """Run the installed torch's foreach Adam as torch 2.0 allocated it: the in-place ``_foreach_add_``
    on the list that the last ``_foreach_sqrt`` returned (``exp_avg_sq_sqrt``, or AMSGrad's
    ``max_exp_avg_sq_sqrt``) becomes an out-of-place ``_foreach_add`` whose result (``denom``)
    lives until the ``_foreach_addcdiv_`` that reads it has returned."""

    def __init__(self) -> None:
        super().__init__()
        self._sqrt: list[int] = []
        self._denom: Any = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch._foreach_add_ and args and self._sqrt and [id(t) for t in args[0]] == self._sqrt:
            self._sqrt = []
            self._denom = torch._foreach_add(*args, **kwargs)  # 2.0: denom, a new list
            return None
        out = func(*args, **kwargs)
        if func is torch._foreach_sqrt:
            self._sqrt = [id(t) for t in out]
        elif func is torch._foreach_addcdiv_:
            self._denom = None  # 2.0's denom dies with the step's locals, after the update
        return out


def cuda_optimizer_step_mode(optimizer: torch.optim.Optimizer, target: CudaTarget | None) -> Any:
    """A mode to run ``optimizer.step()`` under so that its allocations are the target torch's, or a
    null context: foreach Adam/AdamW before torch 2.1 (:data:`ADAM_DENOM_IN_PLACE_SINCE`)."""
    import contextlib

    if (
        target is None or target.torch_version >= ADAM_DENOM_IN_PLACE_SINCE
        or not _is_optimizer(type(optimizer), ("Adam", "AdamW"))
        or not any(g.get("foreach") for g in optimizer.param_groups)
    ):
        return contextlib.nullcontext()
    return _OutOfPlaceAdamDenom()
