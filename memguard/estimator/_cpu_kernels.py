"""The CPU's kernel paths, by instruction set: allocate what the host's (or a named CPU's) kernels allocate.

PyTorch's CPU kernels pick a path by instruction set, and the paths allocate differently. A fake
tensor op returns only the op's outputs; the buffers a kernel allocates and frees inside the call
(oneDNN's reorders into blocked formats, its scratchpad, ATen's im2col columns) raise the peak
while the op runs and are invisible to the trace. A *rule* here replays, for one ATen op, the
allocations and frees its real kernel makes on the target CPU, in their order, around the op's
outputs. The recorder (:class:`memguard.estimator._trace.Recorder`) runs the rule after the fake op.

Which path runs (torch 2.13, oneDNN 3.x):

* bf16/fp16 ``mm``/``addmm``/``bmm``/``baddbmm`` go to oneDNN (``mkldnn_matmul``) when
  ``use_mkldnn_bf16_matmul``/``use_mkldnn_fp16_matmul`` hold (aten/src/ATen/native/mkldnn/Matmul.cpp):
  the dtype is supported by the CPU (``mkldnn_bf16_device_check`` -> ``ideep::has_bf16_type_support``
  -> oneDNN ``platform::has_data_type_support``: bf16 needs ``avx512_core`` or ``avx2_vnni_2``, fp16
  needs ``avx512_core_fp16`` or ``avx2_vnni_2``; src/cpu/platform.cpp) and ``m*k*n > 16**3``
  (``checksize``). Otherwise ATen's own gemm runs, which allocates nothing extra. fp32 matmuls go to
  MKL's sgemm (nothing extra) unless bf32/tf32 fast-math is enabled, which memguard does not model.
* ``convolution`` goes to oneDNN when ``ConvParams::use_mkldnn`` holds (aten/src/ATen/native/Convolution.cpp):
  bf16/fp16 inputs whenever the dtype is supported as above; fp32 inputs unless the call is a
  single-threaded unstrided 1x1 convolution on a batch below 16, or a tiny one (the "native is
  faster" conditions). Otherwise the slow path runs (``slow_conv2d``, ConvolutionMM2d.cpp), which
  unfolds the input into an im2col ``columns`` buffer ``[N, C/groups*kh*kw, oH*oW]`` (none for an
  unstrided, unpadded 1x1 kernel), once in forward and once for the weight gradient.
* oneDNN convolution on a contiguous (NCHW) input reorders the source into a channel-blocked format
  (``nChw16c`` on AVX-512, ``nChw8c`` on AVX2; none for first-layer convolutions of < 8 input
  channels, which read plain sources), reorders the weights, computes into a blocked destination
  and reorders that into the plain output (ideep ``convolution_forward::compute`` with
  ``reorder_if_differ_in``; aten/src/ATen/native/mkldnn/Conv.cpp ``_mkldnn_convolution``). Under
  ``channels_last`` (``mkldnn_conv_use_channels_last``, ConvUtils.h) the activations are used in place
  and only the weights are reordered. The backward does the same for the input gradient (blocked
  output gradient, weights, blocked input gradient) and for the weight gradient (blocked source and
  output gradient, blocked weight gradient; under ``channels_last`` a dense copy of it is converted
  once more, ``mkldnn_to_dense(...).to(memory_format)``). Which weight-gradient kernel runs decides
  its layout and scratchpad: a depthwise weight gradient of a direct kernel is blocked like a grouped
  one (:mod:`memguard.estimator._onednn_conv`), and the im2col + GEMM kernel (``gemm:jit``) books a
  weight-reduction buffer four times the weights (:mod:`memguard.estimator._onednn_gemm`).
* oneDNN's matmul scratchpad: on ``avx512_core``/``avx512_core_vnni`` (no native bf16 dot product)
  bf16 matmuls run ``gemm:jit`` with an fp32 accumulator as large as the destination
  (``gemm_bf16_matmul_t``, src/cpu/matmul/gemm_bf16_matmul.cpp, ``book_acc_scratchpad``); with a
  native dot product (``avx512_core_bf16``, ``avx512_core_fp16``, AMX, ``avx2_vnni_2``) they run the
  brgemm matmul, whose scratchpad holds per-thread copy and accumulation blocks
  (:mod:`memguard.estimator._onednn_matmul` sizes both).

Sequences were checked against ``torch.profiler`` memory events of the real kernels on an AVX-512
BF16 host at its own level, at ``ONEDNN_MAX_CPU_ISA=AVX512_CORE`` and at ``ONEDNN_MAX_CPU_ISA=AVX2``
(``tests/estimator/test_cpu_kernels.py``).

Known limitations:
    oneDNN's small internal buffers (bias reorders, the forward and input-gradient scratchpads of
    the brgemm kernels, the fp32 depthwise kernels' accumulators, dilated convolutions' weight-gradient
    scratchpads: tens of KiB per thread) are not replayed. 3-d convolutions, transposed convolutions and
    ``mkldnn``-layout tensors follow the same rules as 2-d ones only as far as the shapes carry over.
    The AMX and AVX-512-FP16 paths are modelled from the source, not measured (no such host was
    available); ``bf32``/``tf32`` fast-math matmuls and ``torch.jit``-frozen (prepacked) weights
    are not modelled.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from memguard.errors import ConfigError
from memguard.estimator._onednn_conv import (ConvShape, bwd_weights_blocked_weight_bytes, bwd_weights_kernel,
                                             bwd_weights_scratchpad_bytes)
from memguard.estimator._onednn import book
from memguard.estimator._onednn_gemm import fp32_bwd_weights_kernel, gemm_bwd_weights_scratchpad_bytes
from memguard.estimator._onednn_matmul import matmul_scratchpad_bytes

#: oneDNN's x86-64 instruction-set levels that change a kernel path memguard models, lowest first
#: (``dnnl_cpu_isa_t``, include/oneapi/dnnl/dnnl_types.h; the names ``ONEDNN_MAX_CPU_ISA`` takes).
#: ``avx2_vnni_2`` (AVX-NE-CONVERT: bf16/fp16 conversions on AVX2 hosts such as Sierra Forest) sits
#: below ``avx512_core`` in oneDNN's order but enables both 16-bit types.
ISAS = ("avx2", "avx2_vnni_2", "avx512_core", "avx512_core_bf16", "avx512_core_fp16", "avx512_core_amx")

# ONEDNN_MAX_CPU_ISA values (src/cpu/x64/cpu_isa_traits.cpp, ``get_max_cpu_isa_from_env``) and the
# level of ISAS each falls into; AVX10_1_512 is oneDNN's newer name for AVX512_CORE_FP16.
_ONEDNN_NAMES = {
    "sse41": "avx2", "avx": "avx2", "avx2": "avx2", "avx2_vnni": "avx2", "avx2_vnni_2": "avx2_vnni_2",
    "avx512_core": "avx512_core", "avx512_core_vnni": "avx512_core", "avx512_core_bf16": "avx512_core_bf16",
    "avx10_1_512": "avx512_core_fp16", "avx512_core_fp16": "avx512_core_fp16",
    "avx10_1_512_amx": "avx512_core_amx", "avx512_core_amx": "avx512_core_amx",
    "avx10_1_512_amx_fp16": "avx512_core_amx", "avx512_core_amx_fp16": "avx512_core_amx",
    "avx10_2_512": "avx512_core_fp16", "avx10_2_512_amx_2": "avx512_core_amx", "all": "avx512_core_amx",
    "default": "avx512_core_amx",
}


def _cpu_flags() -> set[str]:
    """The x86 feature flags Linux reports for this CPU (``/proc/cpuinfo``); empty elsewhere."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _hardware_isa(flags: set[str]) -> str:
    """The highest level of :data:`ISAS` the CPU implements, by oneDNN's requirements for each
    (src/cpu/x64/cpu_isa_traits.hpp ``mayiuse``)."""
    avx512_core = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags
    if avx512_core and {"amx_tile", "amx_bf16"} <= flags:
        return "avx512_core_amx"
    if avx512_core and {"avx512_fp16", "avx512_bf16"} <= flags:
        return "avx512_core_fp16"
    if avx512_core and "avx512_bf16" in flags:
        return "avx512_core_bf16"
    if avx512_core:
        return "avx512_core"
    if "avx_ne_convert" in flags and "avx_vnni_int8" in flags:
        return "avx2_vnni_2"
    return "avx2"


@functools.lru_cache(maxsize=1)
def host_isa() -> str:
    """The level of :data:`ISAS` this process's oneDNN runs at: the CPU's own, capped by
    ``ONEDNN_MAX_CPU_ISA`` (or its old name ``DNNL_MAX_CPU_ISA``) as oneDNN caps it.

    Checked against torch's own answer where it has one: oneDNN's bf16 support
    (``torch.ops.mkldnn._is_mkldnn_bf16_supported``) must agree with the level found.
    """
    level = _hardware_isa(_cpu_flags())
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").strip().lower()
    if cap in _ONEDNN_NAMES:
        capped = _ONEDNN_NAMES[cap]
        if capped == "avx2_vnni_2" and level.startswith("avx512"):
            capped = "avx2"  # an AVX-512 CPU has no AVX-NE-CONVERT: the cap leaves plain AVX2
        if ISAS.index(capped) < ISAS.index(level) or capped == "avx2":
            level = capped
    try:  # torch's view of oneDNN, when this build has oneDNN
        supported = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return level
    if supported != _bf16_onednn(level):
        level = "avx512_core" if supported else "avx2"
    return level


def _bf16_onednn(isa: str) -> bool:
    # platform::has_data_type_support(bf16): mayiuse(avx512_core) || mayiuse(avx2_vnni_2)
    return isa != "avx2"


def _fp16_onednn(isa: str) -> bool:
    # platform::has_data_type_support(f16): mayiuse(avx512_core_fp16) || mayiuse(avx2_vnni_2)
    return isa in ("avx2_vnni_2", "avx512_core_fp16", "avx512_core_amx")


@dataclass(frozen=True)
class CpuTarget:
    """The CPU a trace models: what the CPU kernels' choice of path depends on.

    Attributes:
        isa: a level of :data:`ISAS` (oneDNN's names; ``ONEDNN_MAX_CPU_ISA`` names are accepted by
            :meth:`named` and mapped to these).
        threads: intra-op threads (``torch.get_num_threads()`` of the training process): oneDNN's
            brgemm scratchpad is per thread, and fp32 1x1 convolutions take oneDNN only with more
            than one thread.
        onednn: oneDNN is enabled (``torch.backends.mkldnn.enabled``; ATen's dispatch checks
            ``userEnabledMkldnn``); off, every op takes ATen's own kernels.
    """

    isa: str = "avx2"
    threads: int = 1
    onednn: bool = True

    @classmethod
    def host(cls) -> "CpuTarget":
        """This process's CPU, at the level its oneDNN runs (see :func:`host_isa`), with its thread count."""
        onednn = torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
        return cls(isa=host_isa(), threads=torch.get_num_threads(), onednn=bool(onednn))

    @classmethod
    def named(cls, name: Any, problems: list[str] | None = None) -> "CpuTarget | None":
        """The target for a user's ``cpu=`` value: None or ``"host"`` (this CPU), a level of
        :data:`ISAS` or an ``ONEDNN_MAX_CPU_ISA`` name (case-insensitive), or a ``CpuTarget``.

        A bad value is appended to ``problems`` (and None returned) or, without ``problems``,
        raised as a :class:`~memguard.ConfigError`.
        """
        if isinstance(name, CpuTarget):
            return name
        if name is None or (isinstance(name, str) and name.strip().lower() == "host"):
            return cls.host()
        key = name.strip().lower() if isinstance(name, str) else None
        if key in _ONEDNN_NAMES:
            return cls(isa=_ONEDNN_NAMES[key], threads=torch.get_num_threads())
        message = (f"cpu={name!r} is not a CPU target: use 'host' (this CPU) or an instruction-set level, "
                   f"one of {', '.join(ISAS)}")
        if problems is None:
            raise ConfigError(message)
        problems.append(message)
        return None

    @property
    def bf16_onednn(self) -> bool:
        """bf16 matmuls and convolutions run in oneDNN on this CPU."""
        return _bf16_onednn(self.isa)

    @property
    def fp16_onednn(self) -> bool:
        """fp16 matmuls and convolutions run in oneDNN on this CPU."""
        return _fp16_onednn(self.isa)

    @property
    def channel_block(self) -> int:
        """oneDNN's channel block for activations: 16 lanes of fp32 on AVX-512, 8 on AVX2
        (``nChw16c``/``nChw8c``, src/cpu/x64/jit_avx512_common_conv_kernel.cpp / jit_avx2_conv_kernel_f32.cpp)."""
        return 16 if self.isa.startswith("avx512") else 8

    def onednn_takes(self, dtype: torch.dtype) -> bool:
        """Whether oneDNN runs 16-bit ``dtype`` matmuls/convolutions here (fp32 is decided per op)."""
        if not self.onednn:
            return False
        if dtype == torch.bfloat16:
            return self.bf16_onednn
        if dtype == torch.float16:
            return self.fp16_onednn
        return False


# ------------------------------------------------------------------------------------ replay
@dataclass
class Replay:
    """What a rule does inside one op: allocations and frees around the op's outputs.

    The recorder hands a rule one of these. :meth:`alloc` and :meth:`free` record a kernel-internal
    buffer (as a fake byte tensor, so the trace sees it born and die); :meth:`outputs` registers the
    op's outputs at that point of the sequence (by default they are registered after the rule).
    """

    make: Callable[[int], Any]  # nbytes -> a live fake buffer (registered as a temporary)
    publish: Callable[[Any], None]  # registers output leaves
    out: Any
    _live: dict[str, Any] = field(default_factory=dict)

    def alloc(self, name: str, nbytes: int) -> None:
        if nbytes > 0:
            self._live[name] = self.make(int(nbytes))

    def free(self, *names: str) -> None:
        for name in names:
            self._live.pop(name, None)

    def outputs(self, *leaves: Any) -> None:
        self.publish(leaves if leaves else self.out)

    def close(self) -> None:
        self._live.clear()


Rule = Callable[[CpuTarget, tuple, Any, Replay], None]

#: op -> rule(target, args, fake_outputs, replay)
CPU_RULES: dict[Any, Rule] = {}


def _rule(*ops: Any) -> Callable[[Rule], Rule]:
    def register(fn: Rule) -> Rule:
        for op in ops:
            CPU_RULES[op] = fn
        return fn

    return register


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


# ------------------------------------------------------------------------------------ matmul
def _matmul_dims(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int, int, int]:
    if a.dim() == 3:
        return a.shape[0], a.shape[1], a.shape[2], b.shape[2]
    return 1, a.shape[0], a.shape[1], b.shape[1]


def _is_transposed(t: torch.Tensor) -> bool:
    """A 2-d (or last-two-dims) transposed view, which oneDNN reads in place (Matmul.cpp
    ``is_mkldnn_optimized_format``)."""
    return t.dim() >= 2 and t.stride(-2) == 1 and t.shape[-2] > 1 and not t.is_contiguous()


def _matmul_rule(a_index: int) -> Rule:
    def rule(target: CpuTarget, args: tuple, out: Any, replay: Replay) -> None:
        a, b = args[a_index], args[a_index + 1]
        if not target.onednn_takes(a.dtype) or b.dtype != a.dtype or a.numel() == 0 or b.numel() == 0:
            return
        batch, m, k, n = _matmul_dims(a, b)
        if batch * m * k * n <= 16 ** 3:  # Matmul.cpp checksize: mkldnn_gemm_min_size
            return
        replay.outputs()  # ATen allocates the result before it calls oneDNN
        # Matmul.cpp: operands neither contiguous nor a transposed view are copied first
        for name, t in (("a_copy", a), ("b_copy", b)):
            if not (t.is_contiguous() or _is_transposed(t)):
                replay.alloc(name, _nbytes(t))
        replay.alloc("scratchpad", matmul_scratchpad_bytes(
            m, k, n, batch=batch, a_transposed=_is_transposed(a), b_transposed=_is_transposed(b),
            fp16=a.dtype == torch.float16, isa=target.isa, threads=target.threads))
        replay.free("scratchpad", "a_copy", "b_copy")

    return rule


_rule(torch.ops.aten.mm.default, torch.ops.aten.bmm.default)(_matmul_rule(0))
_rule(torch.ops.aten.addmm.default, torch.ops.aten.baddbmm.default)(_matmul_rule(1))


# ------------------------------------------------------------------------------------ convolution
def _conv_uses_onednn(target: CpuTarget, x: torch.Tensor, w: torch.Tensor, stride, dilation, groups: int) -> bool:
    """``ConvParams::use_mkldnn`` (aten/src/ATen/native/Convolution.cpp, torch 2.13)."""
    if not target.onednn:
        return False
    if x.dtype in (torch.bfloat16, torch.float16):
        return target.onednn_takes(x.dtype)
    if x.dtype != torch.float32 or x.dim() != 4:
        return False
    strided = any(s != 1 for s in stride)
    dilated = any(d != 1 for d in dilation)
    kh, kw = w.shape[-2], w.shape[-1]
    not_1x1_single = strided or dilated or x.shape[0] >= 16 or kw != 1 or kh != 1 or target.threads > 1
    big_enough = groups > 1 or (kw > 3 and kh > 3) or x.shape[0] > 1 or math.prod(x.shape) > 20480
    return not_1x1_single and big_enough


def _channels_last(x: torch.Tensor, w: torch.Tensor) -> bool:
    """``mkldnn_conv_use_channels_last`` (aten/src/ATen/native/ConvUtils.h)."""
    cl = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
    return (x.dim() in (4, 5) and not x.is_contiguous() and x.is_contiguous(memory_format=cl)) or (
        w.dim() in (4, 5) and not w.is_contiguous() and w.is_contiguous(memory_format=cl))


def _blocked_bytes(t: torch.Tensor, block: int) -> int:
    """Bytes of ``t`` in a channel-blocked layout (dim 1 padded to ``block``)."""
    if t.dim() < 2:
        return _nbytes(t)
    return _nbytes(t) // max(t.shape[1], 1) * _round_up(t.shape[1], block)


def _weight_bytes(w: torch.Tensor, groups: int, block: int) -> int:
    """The reordered weights: output and input channels per group padded to the block (oneDNN's
    ``OIhw16i16o``-style formats; depthwise weights are blocked over groups only)."""
    spatial = math.prod(w.shape[2:])
    if groups > 1 and w.shape[1] == 1:
        return _round_up(w.shape[0], block) * spatial * w.element_size()
    o_per_group = w.shape[0] // groups
    return groups * _round_up(o_per_group, block) * _round_up(w.shape[1], block) * spatial * w.element_size()


def _columns_bytes(x: torch.Tensor, w: torch.Tensor, out_spatial: int, stride, padding) -> int:
    """ATen's slow path im2col buffer ``[N, C/groups*kh*kw, oH*oW]`` for one group (the slow path
    loops over groups; ConvolutionMM2d.cpp ``slow_conv2d_forward_out_cpu``); none for an unstrided,
    unpadded 1x1 kernel, which multiplies the input in place."""
    kernel = w.shape[2:]
    if all(k == 1 for k in kernel) and all(s == 1 for s in stride) and all(p == 0 for p in padding):
        return 0
    return x.shape[0] * w.shape[1] * math.prod(kernel) * out_spatial * x.element_size()


def _conv_args(args: tuple) -> tuple:
    x, w = args[0], args[1]
    stride, padding, dilation, transposed = list(args[3]), list(args[4]), list(args[5]), bool(args[6])
    groups = int(args[8])
    return x, w, stride, padding, dilation, transposed, groups


def _plain_source(x: torch.Tensor, groups: int) -> bool:
    """oneDNN reads the source of a convolution with fewer than 16 input channels per group plain
    (its "first layer" kernels; measured at every level, AVX2 included)."""
    return x.shape[1] // groups < 16 and groups == 1


@_rule(torch.ops.aten.convolution.default)
def _convolution(target: CpuTarget, args: tuple, out: Any, replay: Replay) -> None:
    x, w, stride, padding, dilation, transposed, groups = _conv_args(args)
    if x.dim() != 4 or transposed or not isinstance(out, torch.Tensor):
        return
    if not _conv_uses_onednn(target, x, w, stride, dilation, groups):
        # the slow path runs each group on its own slice and concatenates the group outputs
        # (Convolution.cpp ``_convolution`` for ConvBackend::Slow2d with groups > 1)
        columns = _columns_bytes(x, w, math.prod(out.shape[2:]), stride, padding)
        if groups > 1:  # one group's columns at a time; the group outputs are kept for the join
            replay.alloc("group_outputs", _nbytes(out))
            replay.alloc("columns", columns)
            replay.free("columns")
            replay.outputs()
            replay.free("group_outputs")
        else:
            replay.alloc("columns", columns)
            replay.outputs()
            replay.free("columns")
        return
    block = target.channel_block
    if _channels_last(x, w):
        replay.alloc("weights", _weight_bytes(w, groups, block))
        replay.outputs()
        replay.free("weights")
        return
    if not _plain_source(x, groups):
        replay.alloc("src", _blocked_bytes(x, block))
    replay.alloc("weights", _weight_bytes(w, groups, block))
    replay.alloc("dst", _blocked_bytes(out, block))
    replay.free("weights", "src")
    replay.outputs()
    replay.free("dst")


@_rule(torch.ops.aten.convolution_backward.default)
def _convolution_backward(target: CpuTarget, args: tuple, out: Any, replay: Replay) -> None:
    grad_out = args[0]
    x, w, stride, padding, dilation, transposed, groups = _conv_args(args[1:])
    mask = list(args[10])
    if x.dim() != 4 or transposed:
        return
    grad_input, grad_weight, grad_bias = out
    if not _conv_uses_onednn(target, x, w, stride, dilation, groups):
        _slow_backward(out, x, w, grad_out, stride, padding, groups, mask, replay)
        return
    block = target.channel_block
    plain = _channels_last(x, w)
    first_layer = _plain_source(x, groups)
    if mask[0]:
        emulated_bf16 = x.dtype == torch.bfloat16 and target.isa == "avx512_core"
        strided = any(s_ != 1 for s_ in stride)
        if not plain:
            replay.alloc("grad_out", _blocked_bytes(grad_out, block))
        replay.alloc("weights", _weight_bytes(w, groups, block))
        if not plain:
            # a first-layer input gradient is computed plain, except by the bf16 kernels of a CPU
            # without a bf16 dot product, which pad it to the block (measured at avx512_core)
            plain_grad = first_layer and not emulated_bf16
            replay.alloc("grad_in", _nbytes(grad_input) if plain_grad else _blocked_bytes(grad_input, block))
        replay.free("weights", "grad_out")
        replay.outputs(grad_input)
        if strided and not emulated_bf16:
            # a strided input gradient runs oneDNN's brgemm strided kernel on channels-last copies
            # (``brgconv_strided``, ONEDNN_VERBOSE), whose result is copied once more into the output
            replay.alloc("copy", _nbytes(grad_input))
            replay.free("copy")
        replay.free("grad_in")
    if mask[1]:
        conv = ConvShape(n=x.shape[0], ic=x.shape[1], oc=w.shape[0], ih=x.shape[2], iw=x.shape[3], kh=w.shape[2],
                         kw=w.shape[3], stride=stride[0], pad=padding[0], dilation=dilation[0], groups=groups,
                         channels_last=plain, bias=bool(mask[2]))
        kernel = _bwd_weights_kernel(target, x.dtype, conv)
        depthwise = groups > 1 and groups == x.shape[1]
        # the depthwise and gemm weight-gradient kernels read plain tensors
        if not plain and not depthwise and kernel != "gemm":
            replay.alloc("grad_out", _blocked_bytes(grad_out, block))
            if not first_layer:
                replay.alloc("src", _blocked_bytes(x, block))
        replay.alloc("grad_w", _grad_weight_bytes(target, kernel, conv, w, block))
        if mask[2]:  # ideep computes the bias gradient into its own buffer too (measured: one per call)
            replay.alloc("grad_b", w.shape[0] * w.element_size())
        replay.alloc("scratchpad", _bwd_weights_scratchpad(target, kernel, conv, x.dtype))
        replay.free("scratchpad", "src", "grad_out")
        if plain:  # Conv.cpp mkldnn_convolution_backward_weights: mkldnn_to_dense(grad_w).to(channels_last)
            replay.alloc("grad_w_dense", _nbytes(w))
        replay.outputs(*(t for t in (grad_weight, grad_bias) if isinstance(t, torch.Tensor)))
        replay.free("grad_w", "grad_b", "grad_w_dense")


def _bwd_weights_kernel(target: CpuTarget, dtype: torch.dtype, conv: ConvShape) -> str | None:
    """oneDNN's weight-gradient kernel for ``conv`` (see _onednn_conv and _onednn_gemm), None where unknown."""
    if dtype == torch.bfloat16:
        return bwd_weights_kernel(conv)
    if dtype == torch.float32:
        return fp32_bwd_weights_kernel(conv, target.isa)
    return None


def _grad_weight_bytes(target: CpuTarget, kernel: str | None, conv: ConvShape, w: torch.Tensor, block: int) -> int:
    """The weight gradient oneDNN computes into before PyTorch's reorder: plain for ``gemm``; a
    depthwise one of a direct kernel (wider than 3, channels-last) blocked like a grouped one, a
    full block of channels a group (16 for bf16 and on AVX-512, 8 for fp32 on AVX2; _onednn_conv)."""
    depthwise = conv.groups > 1 and conv.groups == conv.ic == conv.oc
    if kernel == "gemm":
        return _nbytes(w)
    if depthwise and kernel in ("jit_bf16", "jit"):
        return bwd_weights_blocked_weight_bytes(conv, w.element_size(), 16 if kernel == "jit_bf16" else block)
    return _weight_bytes(w, conv.groups, block)


def _bwd_weights_scratchpad(target: CpuTarget, kernel: str | None, conv: ConvShape, dtype: torch.dtype) -> int:
    """The weight-gradient primitive's scratchpad (PyTorch allocates it per call: user scratchpad mode)."""
    if kernel == "gemm":
        return gemm_bwd_weights_scratchpad_bytes(conv, itemsize=dtype.itemsize, threads=target.threads,
                                                 isa=target.isa)
    if dtype == torch.bfloat16:
        return bwd_weights_scratchpad_bytes(conv, threads=target.threads, isa=target.isa) or 0
    simd_w = 16 if target.isa.startswith("avx512") else 8
    oc_g = conv.oc // conv.groups
    if kernel == "jit" and conv.bias and oc_g % simd_w:
        # key_conv_padded_bias: the fp32 direct kernels' bias gradient padded to the block
        # (jit_avx2_conv_kernel_f32.cpp / jit_avx512_common_conv_kernel.cpp, bwd-weights init_scratchpad)
        return book(conv.groups * _round_up(oc_g, simd_w) * 4)
    return 0


def _slow_backward(out: Any, x: torch.Tensor, w: torch.Tensor, grad_out: torch.Tensor, stride,
                   padding, groups: int, mask: list, replay: Replay) -> None:
    """The slow path's backward (ConvolutionMM2d.cpp ``slow_conv2d_backward_out_cpu``): the input
    gradient first; the bias gradient of a 16-bit convolution sums an fp32 copy of the output
    gradient (per group slice, which is small, when grouped); the weight gradient unfolds the input again. With groups, every group's gradients are
    slices kept until they are concatenated."""
    grad_input, grad_weight, grad_bias = out
    if groups > 1:
        replay.alloc("group_grads", sum(_nbytes(t) for t, m in zip((grad_input, grad_weight), mask) if m and
                                        isinstance(t, torch.Tensor)))
    elif mask[0]:
        replay.outputs(grad_input)
    if mask[2] and groups == 1 and grad_out.dtype in (torch.bfloat16, torch.float16):
        replay.alloc("grad_out_fp32", grad_out.numel() * 4)
        replay.free("grad_out_fp32")
    if mask[1]:
        replay.alloc("columns", _columns_bytes(x, w, math.prod(grad_out.shape[2:]), stride, padding))
        replay.free("columns")
    replay.outputs()
    replay.free("group_grads")


# ------------------------------------------------------------------------------------ batch norm
def _bn_contiguous(t: torch.Tensor) -> bool:
    """``is_contiguous`` of aten/src/ATen/native/Normalization.cpp: contiguous in some memory format."""
    return t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)) or (
        t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d))


@_rule(torch.ops.aten.native_batch_norm_backward.default)
def _batch_norm_backward(target: CpuTarget, args: tuple, out: Any, replay: Replay) -> None:
    """``batch_norm_backward_cpu_template`` (Normalization.cpp) allocates the input gradient with
    ``empty_like(input, input.suggest_memory_format())`` and, on its contiguous path, allocates it
    again (``suggest_memory_format_contig``) before the first is released: an input-sized transient."""
    grad_out, x = args[0], args[1]
    mask = list(args[9])
    if not mask[0] or not isinstance(x, torch.Tensor):
        return
    if not (_bn_contiguous(x) and _bn_contiguous(grad_out)
            and x.is_contiguous() == grad_out.is_contiguous()):  # the same suggested memory format
        return
    replay.alloc("first_grad_input", _nbytes(x))
    replay.outputs()
    replay.free("first_grad_input")
