"""CUDA kernel rules for attention: SDPA backend selection and each backend's saved tensors,
``nn.MultiheadAttention``'s slow path (see :mod:`memguard.estimator._cuda_kernels`).

On CPU fake tensors ``F.scaled_dot_product_attention`` runs the CPU's kernels: with dropout the
math path, which keeps the full ``batch x heads x seq x seq`` probabilities and a dropout mask in
the compute dtype. On CUDA, PyTorch picks one of four backends at run time (flash, memory-efficient,
cuDNN, math) by the rules of ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``, and the fused
backends keep only a logsumexp and the RNG state. :func:`select_sdpa_backend` follows those rules;
the rule registered for ``F.scaled_dot_product_attention`` then allocates (and saves for backward)
what the chosen CUDA kernel allocates.

Sources (PyTorch 2.13 unless noted; file paths under ``aten/src/ATen/native/transformers/``):
``cuda/sdp_utils.cpp`` and ``sdp_utils_cpp.h`` (selection), ``cuda/flash_attn/flash_api.cpp``
(``mha_fwd``/``mha_bwd``), ``cuda/attention.cu`` and ``cuda/attention_backward.cu`` (flash,
memory-efficient and cuDNN wrappers), ``attention.cpp`` (the math composite and mask handling).

Known limitations:
    The memory-efficient backward's CUTLASS workspace is modelled by its lower bound (an fp32 dq
    accumulator, ``kernel_backward.h``): tile padding and the dK/dV accumulators that 16-bit head
    dims above the kernel's register limit need depend on the kernel ``dispatch_cutlassB`` picks, and
    on sm70 16-bit kernels with large head dims compute delta with ATen ops (a transient fp32
    product) rather than in the kernel. Not modelled: flash's split-KV buffers (dropout-free calls
    with too few blocks to fill the GPU, i.e. inference-sized), flash's deterministic-mode
    ``nsplits`` accumulator (needs the SM count) and the cuDNN engine's own plan workspace (its
    backward's frontend-sized fp32 dQ accumulator and softmax sum are modelled:
    :func:`cudnn_sdpa_backward_workspace_bytes`). The cuDNN preference on
    sm90/sm100 needs the cuDNN version, which a CPU build cannot report: it is the target's
    (``CudaTarget.cudnn_version``, from ``memguard.estimate(cudnn_version=...)`` or the torch
    release's default wheel); a target without one never chooses cuDNN attention.
    The cuDNN rule's output layout and seed/offset tensors follow ``cudnn/MHA.cpp`` as read for
    earlier 2.x releases; only its backward (``_cudnn_attention_backward``) was re-read for 2.13.
    Torch 2.5.0 put cuDNN first on sm90 and 2.5.1 took that back: ``CudaTarget.torch_version``
    carries no patch level, so 2.5 is modelled as 2.5.1.
    ROCm: flash runs on AOTriton for gfx90a/gfx942 (:data:`ROCM_FLASH_ARCHS`, torch 2.3+), with the
    CUDA selection checks and ``mha_fwd_aot``/``mha_bwd_aot``'s tensors; AOTriton's lazily made fp32
    dq accumulator and the ROCm memory-efficient backend (masks take the math path here) are not
    modelled. Nested (jagged) tensors go to the CPU's own implementation. Grouped-query attention (fewer
    k/v heads than query heads) is taken by flash and cuDNN only: the memory-efficient backend of
    torch <= 2.13 requires equal head counts, so where flash cannot run such a call takes the math
    path (``select_sdpa_backend``). Later torch (main after 2.13, whose
    ``check_batch_size_and_num_heads_dense`` gained a third ``supports_mqa`` parameter) admits it on
    mem-efficient too; no such release is modelled.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import types
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch
import torch.nn.functional as F

from memguard.estimator._cuda_kernels import RULES, CudaTarget, cuda_rule
from memguard.estimator._cuda_sac import run_as_aten_op

Backend = Literal["flash", "efficient", "cudnn", "math"]

# at::SDPBackend's numbering (aten/src/ATen/SDPBackend.h): what torch._C._get_sdp_priority_order returns
_BACKEND_IDS = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}


@dataclass(frozen=True, eq=False)
class SdpaCall:
    """The arguments of one ``F.scaled_dot_product_attention`` call that CUDA's backend selection
    reads (after autocast): the tensors' shapes, strides, dtypes and ``requires_grad`` (meta or fake
    tensors are fine), and the options, named as SDPA names them."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_mask: torch.Tensor | None = None
    dropout_p: float = 0.0
    is_causal: bool = False
    enable_gqa: bool = False


@dataclass(frozen=True)
class SdpaSettings:
    """The global switches CUDA's SDPA selection reads (``at::globalContext()``).

    Attributes:
        flash, efficient, cudnn, math: ``torch.backends.cuda.*_sdp_enabled()`` (the
            ``torch.nn.attention.sdpa_kernel`` context sets them too).
        priority: the backends in the order they are tried (``torch._C._get_sdp_priority_order``).
        priority_is_default: the order was never changed by the user, so CUDA may replace it by the
            cuDNN-first order on first use (``priority_order`` in ``cuda/sdp_utils.cpp``).
        deterministic: ``torch.use_deterministic_algorithms(True)`` without ``warn_only``.
        math_reduced_precision: ``torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)``.
    """

    flash: bool = True
    efficient: bool = True
    cudnn: bool = True
    math: bool = True
    priority: tuple[str, ...] = ("flash", "efficient", "math", "cudnn", "overrideable")
    priority_is_default: bool = True
    deterministic: bool = False
    math_reduced_precision: bool = False


# the default order of at::Context (aten/src/ATen/Context.h, sdp_priority_order)
_DEFAULT_PRIORITY = ("flash", "efficient", "math", "cudnn", "overrideable")


def sdpa_settings() -> SdpaSettings:
    """Read the current SDPA switches; they are process-global and readable on a CPU build."""
    order = tuple(_BACKEND_IDS.get(int(i), "overrideable") for i in torch._C._get_sdp_priority_order())
    return SdpaSettings(
        flash=torch.backends.cuda.flash_sdp_enabled(),
        efficient=torch.backends.cuda.mem_efficient_sdp_enabled(),
        cudnn=torch.backends.cuda.cudnn_sdp_enabled(),
        math=torch.backends.cuda.math_sdp_enabled(),
        priority=order,
        priority_is_default=order == _DEFAULT_PRIORITY,
        deterministic=torch.are_deterministic_algorithms_enabled()
        and not torch.is_deterministic_algorithms_warn_only_enabled(),
        math_reduced_precision=torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed(),
    )


_HALF = (torch.float16, torch.bfloat16)


def _cap_in(cap: tuple[int, int], low: tuple[int, int], high: tuple[int, int]) -> bool:
    return low <= tuple(cap) <= high  # check_sm_version<lower, upper>: inclusive (sdp_utils.cpp)


def _requires_grad(q, k, v) -> bool:
    # input_requires_grad (sdp_utils_cpp.h): any input requires grad and grad mode is on
    return (q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled()


def _dense_common(q, k, v, attn_mask, enable_gqa: bool, gqa_supported: bool) -> bool:
    """Checks shared by the fused backends (sdp_utils_cpp.h)."""
    if not (q.dim() == k.dim() == v.dim() == 4):  # check_tensor_shapes
        return False
    if q.size(-2) == 0 or k.size(-2) == 0:  # check_nonzero_sequence_lengths_dense
        return False
    # check_batch_size_and_num_heads_dense: same batch; same heads unless GQA (kv heads divide q heads)
    if not (q.size(0) == k.size(0) == v.size(0)):
        return False
    if enable_gqa and gqa_supported:
        if k.size(-3) != v.size(-3) or q.size(-3) % k.size(-3) != 0:  # check_grouped_query_attention
            return False
    elif not (q.size(-3) == k.size(-3) == v.size(-3)):
        return False
    return True


def _unpack(call: SdpaCall) -> tuple:
    """``(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa)`` of a call."""
    return call.query, call.key, call.value, call.attn_mask, call.dropout_p, call.is_causal, call.enable_gqa


def _last_dim_stride_1(q, k, v, attn_mask, ignore_singleton: bool) -> bool:
    # check_last_dim_stride_equals_1_dense (sdp_utils_cpp.h)
    ok = q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    if ignore_singleton:
        ok = ok or q.size(-1) == 1
    if attn_mask is not None:
        ok = ok and attn_mask.stride(-1) == 1
    return ok


#: ROCm GPUs AOTriton's flash kernels run on (``aotriton::v2::flash::check_gpu`` in
#: ``check_flash_attention_hardware_support``'s ROCm branch, cuda/sdp_utils.cpp; its support list,
#: hip/flash_attn/aot/mha_all_aot.hip ``check_gpu_arch``): gfx90a (MI200, which torch reports as
#: compute capability 9.0) and gfx942 (MI300X, 9.4); others are experimental or unsupported.
ROCM_FLASH_ARCHS = ((9, 0), (9, 4))
#: torch 2.3 built ROCm's SDPA flash backend on AOTriton (USE_FLASH_ATTENTION with aotriton 0.4).
ROCM_FLASH_SINCE = (2, 3)


def _rocm_flash_hardware(target: CudaTarget) -> bool:
    return tuple(target.capability) in ROCM_FLASH_ARCHS and target.torch_version >= ROCM_FLASH_SINCE


def _can_use_flash(target: CudaTarget, s: SdpaSettings, call: SdpaCall) -> bool:
    """``can_use_flash_attention`` (cuda/sdp_utils.cpp, torch 2.13); on ROCm its hardware check is
    AOTriton's (:data:`ROCM_FLASH_ARCHS`), the other checks are the same code."""
    q, k, v, attn_mask, dropout_p, is_causal, enable_gqa = _unpack(call)
    if not s.flash:  # check_runtime_disabled_flash
        return False
    if target.vendor != "nvidia" and not _rocm_flash_hardware(target):
        return False
    if not (q.dim() == k.dim() == v.dim() == 4):  # check_tensor_shapes
        return False
    if attn_mask is not None:  # check_for_attn_mask: flash takes no arbitrary mask
        return False
    d_q, d_k, d_v = q.size(-1), k.size(-1), v.size(-1)
    if not (d_q == d_k == d_v and d_q <= 256):  # check_head_dim_size_flash: equal, <= 256
        return False
    # check_flash_attention_hardware_support: sm80..sm121 (torch < 2.7: sm80..sm90, before Blackwell)
    high = (12, 1) if target.torch_version >= (2, 7) else (9, 0)
    if target.vendor == "nvidia" and not _cap_in(target.capability, (8, 0), high):
        return False
    # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120
    if target.vendor == "nvidia" and _requires_grad(q, k, v) and (_cap_in(target.capability, (8, 6), (8, 9)) or _cap_in(target.capability, (12, 0), (12, 1))):
        if not (d_q <= 192 or (dropout_p == 0.0 and d_q > 224)):
            return False
    # check_flash_causal_non_square_seqlens
    if is_causal and q.size(-2) != k.size(-2):
        return False
    # check_dtypes_flash_attention: fp16/bf16 (FA3's fp8 only when the user enabled FA3 on sm90+)
    if not (q.dtype == k.dtype == v.dtype and q.dtype in _HALF):
        return False
    gqa = enable_gqa and target.torch_version >= (2, 5)  # enable_gqa: torch 2.5+
    if not _dense_common(q, k, v, attn_mask, gqa, gqa_supported=True):
        return False
    return _last_dim_stride_1(q, k, v, attn_mask, ignore_singleton=True)


def _min_gemm_alignment(target: CudaTarget, dtype: torch.dtype) -> int:
    """``minimum_gemm_alignment`` (cuda/sdp_utils.cpp): in elements."""
    is_half = dtype in _HALF
    major = target.capability[0]
    use_tc = major >= 8 or (major >= 7 and is_half)  # use_tensor_cores
    align = 4 if major >= 8 else 1
    if use_tc:
        align = max(align, 128 // (16 if is_half else 32))
    return align


def _can_use_efficient(target: CudaTarget, s: SdpaSettings, call: SdpaCall) -> bool:
    """``can_use_mem_efficient_attention`` (cuda/sdp_utils.cpp, torch 2.13)."""
    q, k, v, attn_mask, dropout_p, is_causal, enable_gqa = _unpack(call)
    if target.vendor != "nvidia" or not s.efficient:  # check_runtime_disabled_mem_efficient
        return False
    if not _cap_in(target.capability, (5, 0), (12, 1) if target.torch_version >= (2, 7) else (9, 0)):
        return False  # check_mem_efficient_hardware_support
    if not (q.dim() == k.dim() == v.dim() == 4):  # check_tensor_shapes
        return False
    # check_head_dim_size_mem_efficient: q and k head dims equal; q and v head dims aligned
    align = _min_gemm_alignment(target, q.dtype)
    d_q, d_k, d_v = q.size(-1), k.size(-1), v.size(-1)
    if not (d_q == d_k and d_q > 0 and d_v > 0 and d_q % align == 0 and d_v % align == 0):
        return False
    # check_data_ptr_alignment_mem_efficient (sm80+): storage offsets aligned to the GEMM alignment
    if target.capability[0] >= 8:
        align_bytes = align * q.element_size()
        for t in (q, k, v):
            if t.numel() and (t.storage_offset() * t.element_size()) % align_bytes:
                return False
    # check_batch_size_and_num_heads_dense<false /*supports_grouped_query_attention*/> (torch 2.5 to
    # 2.13; the 2.13 header's template has only <supports_gqa, requires_same_num_heads>): enable_gqa
    # is ignored, so q, k and v need equal head counts; torch's SDPA docstring: "GQA ... works only
    # for Flash_attention and math kernel on CUDA tensor"
    if not _dense_common(q, k, v, attn_mask, enable_gqa, gqa_supported=False):
        return False
    if not _last_dim_stride_1(q, k, v, attn_mask, ignore_singleton=False):
        return False
    # dtypes: sm80+ fp16/fp32/bf16, older fp16/fp32
    allowed = (torch.float16, torch.float32, torch.bfloat16) if target.capability[0] >= 8 else (torch.float16, torch.float32)
    return q.dtype == k.dtype == v.dtype and q.dtype in allowed


def _cudnn_shapes_ok(target: CudaTarget, q, k, v, dropout_p: float, cudnn_version: int) -> bool:
    """``check_cudnn_tensor_shapes`` and ``check_cudnn_d256_bprop_head_dim`` (cuda/sdp_utils.cpp)."""
    b, h, s_q, d_qk = q.shape
    s_k, d_v = k.size(2), v.size(3)
    if b > 65535 or h > 65535:
        return False
    if cudnn_version < 8903 or (cudnn_version < 8906 and dropout_p != 0.0):
        return False
    major, minor = target.capability
    sm90_or_10x = (major == 9 and minor == 0) or major == 10
    sm107_old = major == 10 and minor == 7 and cudnn_version <= 92500
    limit = 128
    # torch 2.13 builds ship a cuDNN frontend >= 1.24 (kCuDNNFrontendSupportsD256), assumed here
    if sm90_or_10x and not sm107_old and cudnn_version > 92200:
        limit = 256
    elif sm90_or_10x and cudnn_version >= 91100 and d_qk == 192 and d_v == 128:
        limit = 192
    if d_qk > limit or d_v > limit or d_qk % 8 or d_v % 8:
        return False
    if cudnn_version < 8906 and s_k % 64:
        return False
    if cudnn_version < 90000 and (s_q < 64 or (dropout_p != 0.0 and (s_q % 64 or s_k % 64))):
        return False
    if s_k == 1 or (dropout_p != 0.0 and s_q == 1):
        return False
    if _requires_grad(q, k, v) and limit == 256:
        ok = (d_qk <= 128 and d_v <= 128) or (d_qk, d_v) in ((192, 128), (256, 256))
        if not ok:
            return False
    return True


def _cudnn_mask_ok(q, k, attn_mask) -> bool:
    """``check_attn_mask_shape`` (sdp_utils_cpp.h)."""
    if attn_mask is None:
        return True
    if attn_mask.requires_grad:
        return False
    if attn_mask.size(-2) not in (q.size(2), 1) or attn_mask.size(-1) not in (k.size(2), 1):
        return False
    if attn_mask.dim() == 2:
        return True
    return attn_mask.dim() == 4 and attn_mask.size(0) in (1, q.size(0)) and attn_mask.size(1) in (1, q.size(1))


def _can_use_cudnn(target: CudaTarget, s: SdpaSettings, call: SdpaCall, cudnn_version: int | None) -> bool:
    """``can_use_cudnn_attention`` (cuda/sdp_utils.cpp, torch 2.13)."""
    q, k, v, attn_mask, dropout_p, is_causal, enable_gqa = _unpack(call)
    if target.vendor != "nvidia" or cudnn_version is None or cudnn_version < 90000:
        return False  # compiled without cuDNN attention, or cuDNN < 9
    if dropout_p > 0.0 and 91100 < cudnn_version < 91400:  # no dropout on cuDNN 9.11-9.13
        return False
    if not s.cudnn or s.deterministic:  # check_runtime_disabled_cudnn, check_cudnn_deterministic
        return False
    if not (q.dim() == k.dim() == v.dim() == 4):  # check_tensor_shapes
        return False
    if not (q.dtype == k.dtype == v.dtype and q.dtype in (_HALF if target.capability[0] >= 8 else (torch.float16,))):
        return False  # check_dtypes_low_precision
    if not _cudnn_mask_ok(q, k, attn_mask):
        return False
    if not _cap_in(target.capability, (8, 0), (12, 1)):  # check_cudnn_hardware_support
        return False
    if dropout_p * 16.0 != math.floor(dropout_p * 16.0):  # check_cudnn_dropout: multiples of 1/16
        return False
    if q.size(-2) == 0 or k.size(-2) == 0:
        return False
    if not _last_dim_stride_1(q, k, v, attn_mask, ignore_singleton=True):
        return False
    # check_batch_size_and_num_heads_dense<supports_gqa=true, requires_same_num_heads=false>
    if not (q.size(0) == k.size(0) == v.size(0)) or k.size(1) != v.size(1) or q.size(1) % k.size(1):
        return False
    return _cudnn_shapes_ok(target, q, k, v, dropout_p, cudnn_version)


def _prefer_cudnn(target: CudaTarget, cudnn_version: int | None, cuda_major: int) -> bool:
    """``check_prefer_cudnn_attention`` (cuda/sdp_utils.cpp, torch 2.13): cuDNN first on sm90/sm10x
    with cuDNN > 9.15.0 (CUDA 12 builds: only x.0 and x.3 minors), unless
    ``TORCH_CUDNN_SDPA_DEPRIORITIZED=1`` (read with ``c10::utils::check_env``, c10/util/env.cpp: only
    "1" is true)."""
    if os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED") == "1":
        return False
    if cudnn_version is None or cudnn_version <= 91500:
        return False
    major, minor = target.capability
    if major not in (9, 10):
        return False
    return cuda_major >= 13 or minor in (0, 3)


def select_sdpa_backend(
    target: CudaTarget,
    call: SdpaCall,
    *,
    settings: SdpaSettings | None = None,
    cudnn_version: int | None = None,
    cuda_major: int = 12,
) -> Backend:
    """The backend CUDA's ``select_sdp_backend`` (cuda/sdp_utils.cpp, torch 2.13) picks.

    Reads only shapes, strides, dtypes and ``requires_grad`` of the tensors (meta or fake is fine).

    Args:
        target: the GPU's compute capability and the torch version.
        call: the query, key, value, attn_mask, dropout_p, is_causal and enable_gqa given to
            ``F.scaled_dot_product_attention`` (after autocast).
        settings: the global switches; None reads them now (:func:`sdpa_settings`).
        cudnn_version: ``torch.backends.cudnn.version()`` of the CUDA build (e.g. 91000 for 9.10);
            None: no cuDNN attention (a CPU build cannot know it).
        cuda_major: the CUDA major version of the build (the cuDNN preference differs before 13).

    Raises:
        ConfigError: every backend is disabled or none accepts the inputs (CUDA raises
            "No available kernel" then).
    """
    from memguard.errors import ConfigError

    s = settings or sdpa_settings()
    if not (s.math or s.flash or s.efficient or s.cudnn):
        raise ConfigError(
            "every SDPA backend is disabled (torch.backends.cuda.enable_*_sdp(False) or sdpa_kernel([])); "
            "enable at least one, e.g. torch.backends.cuda.enable_math_sdp(True)"
        )
    order = s.priority
    if s.priority_is_default and _prefer_cudnn(target, cudnn_version, cuda_major):
        order = ("cudnn", "flash", "efficient", "math")  # priority_order() on first use
    call = dataclasses.replace(call, dropout_p=float(call.dropout_p), is_causal=bool(call.is_causal),
                               enable_gqa=bool(call.enable_gqa))
    query = call.query
    for name in order:
        if name == "cudnn" and _can_use_cudnn(target, s, call, cudnn_version):
            return "cudnn"
        if name == "flash" and _can_use_flash(target, s, call):
            return "flash"
        if name == "efficient" and _can_use_efficient(target, s, call):
            return "efficient"
        if name == "math" and s.math:
            return "math"
    raise ConfigError(
        f"no SDPA backend on sm{target.capability[0]}{target.capability[1]} accepts query "
        f"{tuple(query.shape)} {query.dtype} with the enabled backends (CUDA would fail with 'No available "
        "kernel'); enable the math backend (torch.backends.cuda.enable_math_sdp(True))"
    )


# ---------------------------------------------------------------------------------------------
# What each backend allocates and saves.


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def flash_saved_shapes(b: int, h: int, s_q: int, s_k: int, d: int, h_k: int | None = None) -> dict[str, tuple]:
    """Shapes and dtypes of flash attention's saved and temporary tensors (besides q, k, v, out).

    ``mha_fwd``/``mha_bwd`` (cuda/flash_attn/flash_api.cpp, torch 2.13); ``d`` is the head dim
    after padding to a multiple of 8.
    """
    h_k = h if h_k is None else h_k
    d_rounded = _round_up(d, 32 if d <= 128 else 64)  # head_size_rounded
    s_q_rounded = _round_up(s_q, 128)  # seqlen_q_rounded
    out = {
        "logsumexp": ((b, h, s_q), torch.float32),  # softmax_lse
        "philox_seed": ((2,), torch.uint64),  # rng_state, always allocated
        "philox_offset": ((), torch.uint64),  # _unused, always allocated
        "softmax_d": ((b, h, s_q_rounded), torch.float32),  # backward
        "dq_accum": ((b, s_q_rounded, h, d_rounded), torch.float32),  # backward, non-deterministic
    }
    if h_k != h:  # MQA/GQA: dk, dv per query head, summed afterwards
        out["dk_expanded"] = ((b, s_k, h, d), None)
        out["dv_expanded"] = ((b, s_k, h, d), None)
    return out


def efficient_saved_shapes(b: int, h: int, s_q: int, compute_logsumexp: bool = True) -> dict[str, tuple]:
    """Shapes and dtypes of the memory-efficient kernel's saved tensors (besides q, k, v, out).

    ``_efficient_attention_forward`` (cuda/attention.cu, torch 2.13): logsumexp padded to a multiple
    of ``kAlignLSE`` = 32 query rows; philox seed and offset are CPU scalars (no device memory).
    """
    return {"logsumexp": ((b, h, _round_up(s_q, 32) if compute_logsumexp else 0), torch.float32)}


def _aten_op(name: str) -> Any:
    """``torch.ops.aten.<name>.default``: the fused op CUDA's SDPA composite calls (attention.cpp)."""
    return getattr(torch.ops.aten, name).default


def _empty(shape, dtype, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=like.device)


def _bshd(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2)  # [B, H, S, D] <-> [B, S, H, D] views, as the CUDA wrappers do


def _pad_last_dim(t: torch.Tensor, multiple: int) -> torch.Tensor:
    # pad_last_dim<8, false> (attention.cpp): a padded copy when the head dim is not aligned
    d = t.size(-1)
    if d % multiple == 0:
        return t
    return F.pad(t, (0, multiple - d % multiple))


def _kernel_body(fn: Callable) -> Callable:
    """Run a rule's backward with ``__torch_function__`` handling off: autograd calls it while the
    trace's modes are active (the CUDA autocast emulation would recast its ops), and the CUDA
    kernel it stands for sees no autocast and no Python overrides either."""

    def wrapped(*args, **kwargs):
        with torch._C.DisableTorchFunction():
            return fn(*args, **kwargs)

    wrapped.__name__ = fn.__name__
    wrapped.__doc__ = fn.__doc__
    return wrapped


class _FlashAttention(torch.autograd.Function):
    """``_scaled_dot_product_flash_attention`` on CUDA: ``mha_fwd``/``mha_bwd`` allocations."""

    @staticmethod
    def forward(ctx, q, k, v, dropout_p: float, is_causal: bool, scale, rocm: bool = False):
        b, h, s_q, d = q.shape
        h_k, s_k = k.size(1), k.size(2)
        ctx.rocm = rocm

        def kernel() -> tuple:
            if rocm and is_causal:  # mha_fwd_aot: atomic_counter = at::zeros({1}, kInt) for causal calls
                counter = _empty((1,), torch.int32, q)
                del counter
            # the output is allocated as [B, S, H, D] (empty_like of the transposed query) and handed
            # back transposed: a view, so a later .transpose(1, 2).contiguous() costs no copy
            out = torch.empty_like(_bshd(q))
            lse = _empty((b, h, s_q), torch.float32, q)  # softmax_lse
            seed = _empty((2,), torch.uint64, q)  # rng_state
            offset = _empty((), torch.uint64, q)  # _unused (the "offset" output)
            # _scaled_dot_product_flash_attention_cuda (cuda/attention.cu) returns (attention,
            # logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset,
            # debug_attn_mask): cum_seq_* are undefined and the debug mask has 0 elements unless
            # asked for (mha_fwd): no memory, None here
            return (_bshd(out), lse, None, None, s_q, s_k, seed, offset, None)

        outs = run_as_aten_op(_aten_op("_scaled_dot_product_flash_attention"),
                              (q, k, v, dropout_p, is_causal, False), {"scale": scale}, kernel)
        attention, lse, seed, offset = outs[0], outs[1], outs[6], outs[7]
        # the [B, S, H, D] storage, detached: a view of the output itself would hold the node that
        # saves it (a reference cycle that only the garbage collector frees)
        ctx.save_for_backward(q, k, v, _bshd(attention).detach(), lse, seed, offset)
        ctx.meta = (b, h, h_k, s_q, s_k, d)
        return attention

    @staticmethod
    @_kernel_body
    def backward(ctx, grad_out):
        q, k, v, out_bshd, lse, seed, offset = ctx.saved_tensors
        b, h, h_k, s_q, s_k, d = ctx.meta
        dout = _bshd(grad_out).contiguous()  # _flash_attention_backward: "CUDA code assumes that dout is contiguous"
        out = out_bshd.contiguous()  # already contiguous in [B, S, H, D]: no copy
        q_t, k_t, v_t = _bshd(q), _bshd(k), _bshd(v)
        dq, dk, dv = torch.empty_like(q_t), torch.empty_like(k_t), torch.empty_like(v_t)
        if ctx.rocm:
            # mha_bwd_aot (hip/flash_attn/aot/mha_all_aot.hip): dq, dk, dv with empty_like (in the
            # kernel's GQA layout), softmax_d fp32 [B, H, S_q] and delta fp32 like the [B*H, S_q]
            # logsumexp; AOTriton's lazily made fp32 dq accumulator is not modelled (Known limitations)
            softmax_d = _empty((b, h, s_q), torch.float32, q)
            delta = _empty((b * h, s_q), torch.float32, q)
            del softmax_d, delta, dout, out
            return _bshd(dq), _bshd(dk), _bshd(dv), None, None, None, None
        shapes = flash_saved_shapes(b, h, s_q, s_k, d, h_k)
        softmax_d = _empty(shapes["softmax_d"][0], torch.float32, q)
        dq_accum = _empty(shapes["dq_accum"][0], torch.float32, q)
        if h_k != h:
            dk_exp = _empty((b, s_k, h, d), q.dtype, q)
            dv_exp = _empty((b, s_k, h, d), q.dtype, q)
            torch.sum(dk_exp.view(b, s_k, h_k, h // h_k, d), 3, out=dk)
            torch.sum(dv_exp.view(b, s_k, h_k, h // h_k, d), 3, out=dv)
            del dk_exp, dv_exp
        del softmax_d, dq_accum, dout, out
        return _bshd(dq), _bshd(dk), _bshd(dv), None, None, None, None


class _EfficientAttention(torch.autograd.Function):
    """``_scaled_dot_product_efficient_attention`` on CUDA (``_efficient_attention_forward`` in
    cuda/attention.cu, ``_efficient_attention_backward`` in cuda/attention_backward.cu)."""

    @staticmethod
    def forward(ctx, q, k, v, bias, dropout_p: float, is_causal: bool, scale, compute_lse: bool, cap):
        b, h, s_q, _ = q.shape
        d_v = v.size(-1)

        def kernel() -> tuple:
            out = _empty((b, s_q, h, d_v), q.dtype, q)  # res: [B, M, num_heads, Kv]
            lse = _empty(efficient_saved_shapes(b, h, s_q, compute_lse)["logsumexp"][0], torch.float32, q)
            if q.dtype in _HALF and d_v > 128:
                # kNeedsOutputAccumulatorBuffer (kernel_forward.h): 16-bit outputs need an fp32
                # accumulator when no single-value-iteration kernel fits (the largest has kMaxK = 128)
                accum = _empty((b, s_q, h, d_v), torch.float32, q)
                del accum
            # _scaled_dot_product_efficient_attention_cuda returns (output, log_sumexp, philox_seed,
            # philox_offset); seed and offset are CPU scalar tensors outside CUDA graph capture (no
            # device memory): None here
            return (out.transpose(1, 2), lse, None, None)

        outs = run_as_aten_op(_aten_op("_scaled_dot_product_efficient_attention"),
                              (q, k, v, bias, compute_lse, dropout_p, is_causal), {"scale": scale}, kernel)
        output, lse = outs[0], outs[1]
        ctx.save_for_backward(q, k, v, bias, output.transpose(1, 2).detach(), lse)  # detached: as for flash
        ctx.cap = cap
        return output

    @staticmethod
    @_kernel_body
    def backward(ctx, grad_out):
        q, k, v, bias, out, lse = ctx.saved_tensors
        b, h, m, d = q.shape
        dout = _bshd(grad_out).contiguous()  # "handle potentially non-contiguous grad_out through a copy"
        # grad_q/k/v: at::empty(query.sizes()) of the [B, M, H, K] views: contiguous in that layout
        dq = _empty(_bshd(q).shape, q.dtype, q)
        dk = _empty(_bshd(k).shape, k.dtype, k)
        dv = _empty(_bshd(v).shape, v.dtype, v)
        dbias = None
        if bias is not None and ctx.needs_input_grad[3]:
            # grad_bias: the last dim padded to 16 elements, then sliced back
            size = list(bias.shape)
            last = size[-1]
            size[-1] = _round_up(last, 16)
            dbias = _empty(size, bias.dtype, bias)[..., :last]
        if q.dtype in _HALF:
            delta = _empty((b, h, m), torch.float32, q)  # kKernelComputesDelta: the kernel fills it
        else:
            # fp32 kernels: delta = (grad_out * out).sum(-1), transposed to [B, H, M], by ATen ops
            delta = (dout.float() * out.float()).sum(-1).transpose(-2, -1).contiguous()
        # workspace: kNeedsAccumGradQ holds on sm70+ (split keys) and for 16-bit outputs, so dq is
        # accumulated in fp32 (kernel_backward.h workspace_elements_gq): at least B*H*M*K floats;
        # tile padding, per-tile headers and the dK/dV accumulators of large head dims are not modelled
        workspace = None
        if ctx.cap >= (7, 0) or q.dtype in _HALF:
            workspace = _empty((b * h * m * d * 4,), torch.uint8, q)
        del workspace, delta, dout
        return _bshd(dq), _bshd(dk), _bshd(dv), dbias, None, None, None, None, None


#: cudnn/MHA.cpp ``run_cudnn_SDP_bprop`` (the revision with the sm100 int64 seed workaround): from
#: cuDNN 9.5.1 (``CUDNN_VERSION >= 90501``) dO is copied only when its innermost stride is not 1;
#: before, whenever its strides differ from the output's.
CUDNN_BPROP_ANY_DO_STRIDES = 90501


def _cudnn_bprop_copies_grad(grad_out: torch.Tensor, out: torch.Tensor, cudnn_version: int) -> bool:
    """Whether ``run_cudnn_SDP_bprop`` (cudnn/MHA.cpp) materialises ``dO_`` with the output's layout
    (``permute_to_matching_layout``) before it runs the backward graph."""
    if cudnn_version < CUDNN_BPROP_ANY_DO_STRIDES:
        return grad_out.stride() != out.stride()  # "cuDNN < 9.5.1 assumes gradOutput has same strides"
    return grad_out.stride(-1) != 1


def cudnn_sdpa_backward_workspace_bytes(b: int, h_q: int, s_q: int, d_qk: int) -> int:
    """The part of cuDNN attention's backward workspace that cudnn-frontend sizes from the shapes.

    ``run_cudnn_SDP_bprop`` (cudnn/MHA.cpp) allocates ``mha_graph->get_workspace_size()`` bytes from
    the caching allocator for the duration of ``mha_graph->execute``, while dq, dk, dv are live. The
    graph's SDPA backward node (cudnn-frontend ``include/cudnn_frontend/node/sdpa.h``,
    ``CompositeSDPABackwardNode``: ``expand_node`` and ``get_fe_workspace_size_node``) puts into it,
    for dense (non-ragged) inputs with cuDNN >= 9.0 (the only ones memguard lets take cuDNN attention):

    * ``dQ_accum``: fp32 ``[b, h_q, s_q, d_qk]``, unless ``use_dp_workspace`` (dBias outputs or the
      deterministic algorithm: torch requests neither; ``check_cudnn_deterministic`` keeps cuDNN
      attention off under deterministic algorithms, and ``_cudnn_attention_backward`` computes no
      dBias);
    * ``softmax_sum``: fp32 ``[b, h_q, s_q, 1]``: non-virtual in the frontend revision read (the one
      with sink tokens and cuDNN 9.23 knobs, as recent torch vendors); the older
      ``SDPABackwardNode`` of earlier frontends kept it virtual from cuDNN 8.9.5, so for
      such a build it is counted 1/d_qk of dQ_accum high.

    The GQA ``dK_fullhead``/``dV_fullhead`` buffers are workspace only for ragged inputs with a
    ``max_total_seq_len`` (nested tensors, which take the CPU path here). The cuDNN engine's own
    plan workspace, added to this by ``Graph::get_workspace_size``, is decided by cuDNN at run time
    and not modelled.
    """
    dq_accum = b * h_q * s_q * d_qk * 4
    softmax_sum = b * h_q * s_q * 4
    return dq_accum + softmax_sum


class _CudnnAttention(torch.autograd.Function):
    """``_scaled_dot_product_cudnn_attention`` on CUDA (cuda/attention.cu, cudnn/MHA.cpp,
    ``_cudnn_attention_backward`` in cuda/attention_backward.cu)."""

    @staticmethod
    def forward(ctx, q, k, v, bias, dropout_p: float, is_causal: bool, scale, compute_stats: bool,
                cudnn_version: int = 91600):
        b, h, s_q, _ = q.shape
        d_v = v.size(-1)
        ctx.cudnn_version = cudnn_version

        def kernel() -> tuple:
            # alloc_with_matching_layout (cudnn/MHA.cpp): the output's dims are laid out in the order
            # of the query's strides (a packed [B, S, 3*H*D] projection gives [B, S, H, D] memory)
            order = sorted(range(4), key=lambda i: -q.stride(i))
            shape = (b, h, s_q, d_v)
            out = _empty([shape[i] for i in order], q.dtype, q).permute([order.index(i) for i in range(4)])
            # softmax stats fp32 [B, H, S_q] when training (attention_backward.cu hands cuDNN
            # logsumexp.unsqueeze(-1)); seed and offset: 1-element int64 device tensors (cudnn/MHA.cpp,
            # not re-read for 2.13: Known limitations)
            stats = _empty((b, h, s_q) if compute_stats else (0,), torch.float32, q)
            seed = _empty((1,), torch.int64, q)
            offset = _empty((1,), torch.int64, q)
            # _scaled_dot_product_cudnn_attention_cuda returns (output, logsumexp, cum_seq_q,
            # cum_seq_k, max_q, max_k, philox_seed, philox_offset, debug_attn_mask): cum_seq_*
            # undefined, no debug mask unless asked for: None here
            return (out, stats, None, None, s_q, k.size(2), seed, offset, None)

        outs = run_as_aten_op(_aten_op("_scaled_dot_product_cudnn_attention"),
                              (q, k, v, bias, compute_stats, dropout_p, is_causal, False), {"scale": scale}, kernel)
        out, stats, seed, offset = outs[0], outs[1], outs[6], outs[7]
        ctx.save_for_backward(q, k, v, bias, out, stats, seed, offset)
        return out

    @staticmethod
    @_kernel_body
    def backward(ctx, grad_out):
        q, k, v, bias, out, stats, seed, offset = ctx.saved_tensors
        # _cudnn_attention_backward (cuda/attention_backward.cu) allocates dq, dk, dv like q, k, v and
        # calls run_cudnn_SDP_bprop (cudnn/MHA.cpp), which makes dO_ and the graph's workspace
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dout = grad_out
        if _cudnn_bprop_copies_grad(grad_out, out, ctx.cudnn_version):
            dout = torch.empty_like(out).copy_(grad_out)  # permute_to_matching_layout: o's layout
        b, h, s_q, d_qk = q.shape
        workspace = _empty((cudnn_sdpa_backward_workspace_bytes(b, h, s_q, d_qk),), torch.uint8, q)
        del workspace, dout
        return dq, dk, dv, None, None, None, None, None, None


def _math_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, upcast: bool):
    """``_scaled_dot_product_attention_math`` (attention.cpp, torch 2.13) as CUDA runs it: the same
    composite as on the CPU except that ``at::dropout`` in training takes CUDA's fused
    ``native_dropout`` (``is_fused_kernel_acceptable`` in Dropout.cpp), whose mask is bool."""
    origin = q.dtype
    attn_mask = _float_mask(attn_mask, origin)  # scaled_dot_product_attention converts first
    if upcast and origin in _HALF:  # fp16/bf16 computed in fp32 unless reduced precision is allowed
        q, k, v = q.float(), k.float(), v.float()
    d = q.size(-1)
    s = scale if scale is not None else 1.0 / math.sqrt(d)
    factor = math.sqrt(abs(s))
    qs = q * (-factor if s < 0 else factor)  # scale q and k by sqrt(scale) for stability
    if is_causal:
        causal = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
        attn_mask = _float_mask(causal, qs.dtype)  # the causal mask in the compute dtype
    if enable_gqa and q.size(-3) != k.size(-3):  # pre_process_group_query_attention_input
        groups = q.size(-3) // k.size(-3)
        k = k.repeat_interleave(groups, dim=-3)
        v = v.repeat_interleave(groups, dim=-3)
    attn = torch.matmul(qs, k.transpose(-2, -1) * factor)
    if attn_mask is not None:
        attn = attn.add(attn_mask)
    attn = torch.ops.aten._safe_softmax(attn, -1)
    if dropout_p > 0.0:
        attn = torch.native_dropout(attn, dropout_p, True)[0]
    out = torch.matmul(attn, v)
    attn.to(origin)  # the composite also returns the weights in the input dtype (dropped here)
    return out.to(origin)


def _sdpa_args(args: tuple, kwargs: dict) -> dict:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    bound.setdefault("attn_mask", None)
    bound.setdefault("dropout_p", 0.0)
    bound.setdefault("is_causal", False)
    bound.setdefault("scale", None)
    bound.setdefault("enable_gqa", False)
    return bound


def _float_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    # convert_boolean_attn_mask (attention.cpp): a bool mask becomes an additive mask of q's dtype
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask, torch.zeros((), dtype=dtype), torch.full((), -math.inf, dtype=dtype))


def _efficient_bias(mask: torch.Tensor | None, q, k) -> torch.Tensor | None:
    """``preprocess_mask`` (attention.cpp, torch 2.5.1 to 2.13): unless every stride but the last is
    a multiple of ``mem_eff_alignment`` = 8 and the last is 1, pad the last dim by
    ``8 - last % 8`` (a copy; a full 8 when it is already a multiple) and slice back; then expand to
    [B, H, S_q, S_k] (a view)."""
    if mask is None:
        return None
    align = 8  # mem_eff_alignment
    aligned = all(st % align == 0 for st in mask.stride()[:-1]) and mask.stride(-1) == 1
    if not aligned:
        last = mask.size(-1)
        mask = F.pad(mask, (0, align - last % align))[..., :last]
    return mask.expand(q.size(0), q.size(1), q.size(2), k.size(2))


@cuda_rule(F.scaled_dot_product_attention)
def sdpa_rule(target: CudaTarget, func: Callable, args: tuple, kwargs: dict) -> Any:
    """Run ``F.scaled_dot_product_attention`` as CUDA would on ``target``: choose the backend by
    :func:`select_sdpa_backend` and allocate what that backend's kernels allocate.

    Raises:
        ConfigError: no backend is enabled that accepts the inputs (CUDA would fail the same way).
    """
    p = _sdpa_args(args, kwargs)
    q, k, v = p["query"], p["key"], p["value"]
    if any(t.is_nested for t in (q, k, v)):
        return func(*args, **kwargs)
    mask, dropout_p, is_causal, scale, gqa = p["attn_mask"], float(p["dropout_p"]), bool(p["is_causal"]), p["scale"], bool(p["enable_gqa"])
    settings = sdpa_settings()
    backend = select_sdpa_backend(target, SdpaCall(q, k, v, mask, dropout_p, is_causal, gqa), settings=settings,
                                  cudnn_version=target.cudnn_version,
                                  cuda_major=target.cuda_version[0] if target.cuda_version else 12)
    grad = _requires_grad(q, k, v)
    if backend == "flash":
        d = q.size(-1)
        qp, kp, vp = (_pad_last_dim(t, 8) for t in (q, k, v))
        out = _FlashAttention.apply(qp, kp, vp, dropout_p, is_causal, scale, target.vendor == "amd")
        return out[..., :d] if out.size(-1) != d else out
    if backend == "efficient":
        bias = _efficient_bias(_float_mask(mask, q.dtype), q, k)  # heads are equal here (no GQA)
        return _EfficientAttention.apply(q, k, v, bias, dropout_p, is_causal, scale, grad, tuple(target.capability))
    if backend == "cudnn":
        return _CudnnAttention.apply(q, k, v, _float_mask(mask, q.dtype), dropout_p, is_causal, scale, grad,
                                     target.cudnn_version)
    # the fp32 upcast of 16-bit inputs came with allow_fp16_bf16_reduction_math_sdp in torch 2.5
    upcast = target.torch_version >= (2, 5) and not settings.math_reduced_precision
    return _math_attention(q, k, v, mask, dropout_p, is_causal, scale, gqa, upcast=upcast)


# ---------------------------------------------------------------------------------------------
# nn.MultiheadAttention


_MHA_LOCK = threading.Lock()
_MHA_CLONES: dict[tuple, Callable] = {}


#: torch.nn.functional helpers that ``F.multi_head_attention_forward`` calls and that call torch
#: functions themselves (the in-projection's ``linear``): rerouted like the function itself
_MHA_HELPERS = ("_in_projection_packed", "_in_projection")


def _autocast_call(func: Callable, run: Callable) -> Callable:
    """``run`` with CUDA autocast's policy for ``func`` applied first, when the trace emulates autocast.

    Real autocast is a dispatcher key: it casts every ATen op that a Python composite such as
    ``F.multi_head_attention_forward`` calls (its in- and out-projection ``linear`` and its
    ``scaled_dot_product_attention`` run in float16/bfloat16, ATen/autocast_mode.h). The trace's
    emulation is a ``TorchFunctionMode`` that does not see those nested calls, so the rerouted
    composite applies the policy itself.
    """
    from memguard.estimator._autocast import active_emulation

    def stand_in(*a: Any, **kw: Any) -> Any:
        return run(*a, **kw)

    stand_in.__name__ = getattr(func, "__name__", "")  # the emulation decides by the function's name

    def call(*args: Any, **kwargs: Any) -> Any:
        emulation = active_emulation()
        if emulation is None:
            return run(*args, **kwargs)
        return emulation.call(stand_in, args, kwargs)

    return call


def _rerouted(func: Callable, target: CudaTarget, helpers: bool = True) -> Callable:
    """``func`` with every module-level name that refers to a ruled torch function bound to its
    rule instead: the same code object, other globals (nothing of torch is modified).

    ``F.multi_head_attention_forward`` calls ``dropout``, ``softmax``, ``linear`` and
    ``scaled_dot_product_attention`` by their bare names in ``torch.nn.functional``; a
    TorchFunctionMode never sees those nested calls (``handle_torch_function`` switches the mode off
    while it runs the function), so without this the CPU's kernels would run inside. For the same
    reason the CUDA autocast emulation would not cast them: every such name (and ``linear`` in the
    in-projection helpers, rerouted the same way) also goes through the emulation's policy.
    """
    key = (func, target, helpers, tuple(sorted(id(f) for f in RULES)))
    with _MHA_LOCK:
        clone = _MHA_CLONES.get(key)
    if clone is not None:
        return clone
    g = dict(func.__globals__)
    if g.get("torch") is torch:
        g["torch"] = _TORCH_UNDER_AUTOCAST  # torch.bmm, torch.baddbmm, ... called by attribute
    for name, value in func.__globals__.items():
        if not callable(value) or value is func:
            continue
        if _is_ruled(value):
            # look the rule up at call time: rules registered later (or replaced) apply
            g[name] = _autocast_call(value, (lambda f: (lambda *a, **kw: RULES[f](target, f, a, kw)))(value))
        elif name == "linear":
            g[name] = _autocast_call(value, value)
        elif helpers and name in _MHA_HELPERS and isinstance(value, types.FunctionType):
            g[name] = _rerouted(value, target, helpers=False)
    clone = types.FunctionType(func.__code__, g, func.__name__, func.__defaults__, func.__closure__)
    clone.__kwdefaults__ = func.__kwdefaults__
    with _MHA_LOCK:
        _MHA_CLONES[key] = clone
    return clone


class _TorchUnderAutocast(types.ModuleType):
    """``torch`` as the rerouted composite sees it: the functions CUDA autocast has a policy for
    (ATen/autocast_mode.h's lists, :mod:`memguard.estimator._autocast`) go through the active
    emulation (:func:`_autocast_call`), every other name is torch's own. ``F.multi_head_attention_
    forward`` calls ``torch.bmm``/``torch.baddbmm`` by attribute on its ``need_weights=True`` path
    (the default): real autocast casts their fp32 softmax weights to 16 bits, and without this the
    trace failed on an fp32 x fp16 ``bmm``."""

    def __init__(self) -> None:
        super().__init__("torch")
        self._wrapped: dict[str, Callable] = {}

    def __getattr__(self, name: str) -> Any:
        value = getattr(torch, name)
        from memguard.estimator._autocast import FP32, FP32_SET_DTYPE, LOWER, PROMOTE

        if callable(value) and not isinstance(value, type) and name in LOWER | FP32 | FP32_SET_DTYPE | PROMOTE:
            wrapped = self._wrapped.get(name)
            if wrapped is None:
                wrapped = self._wrapped[name] = _autocast_call(value, value)
            return wrapped
        return value


_TORCH_UNDER_AUTOCAST = _TorchUnderAutocast()


def _is_ruled(value: Any) -> bool:
    try:
        return value in RULES
    except TypeError:  # an unhashable callable
        return False


@cuda_rule(F.multi_head_attention_forward)
def mha_rule(target: CudaTarget, func: Callable, args: tuple, kwargs: dict) -> Any:
    """``nn.MultiheadAttention`` as CUDA runs it in training.

    The fast path (``torch._native_multi_head_attention``, ``MultiheadAttention.forward`` in
    torch/nn/modules/activation.py) needs ``not training`` and no autograd, so a training step
    takes the slow path, ``F.multi_head_attention_forward``: with ``need_weights=True`` (the
    default) it computes explicit weights (bmm, softmax, dropout), otherwise it calls
    ``scaled_dot_product_attention``. Both run here with the CUDA rules for the functions they call
    and, under autocast, with its policy for each (``torch.bmm``/``torch.baddbmm`` included: with
    weights, 16-bit autocast keeps softmax's fp32 ``[B*H, L, S]`` result and the fp16 copy the second
    ``bmm`` saves, where ``need_weights=False`` on sm80+ keeps flash's logsumexp only).
    """
    return _rerouted(func, target)(*args, **kwargs)
