"""oneDNN's fp32 weight-gradient kernel choice and its ``gemm:jit`` weight-gradient scratchpad.

Where no direct (jit) kernel takes a convolution's weight gradient, oneDNN runs the im2col + GEMM
kernel (``gemm:jit`` in ONEDNN_VERBOSE; ``gemm_convolution_bwd_weights_t`` for fp32,
``gemm_bf16_convolution_bwd_weights_t`` for bf16). Its scratchpad holds an im2col buffer and a
weight-reduction buffer that is four times the weights' size even on one thread: oneDNN books
``weights_d.size()`` (a byte count) as a count of floats (``src/cpu/gemm_convolution_utils.cpp``,
``init_conf``, ``scratchpad.book<float>(key_conv_wei_reduction, jcp.nthr * weights_d.size())``,
oneDNN v3.12, the version torch 2.13 bundles). On a 256-channel 3x3 convolution that is 9.4 MB,
four times the layer's weights, for a few KB of activations.

Which fp32 kernel runs follows the order of ``src/cpu/cpu_convolution_list.cpp``
(``backward_weights, f32``): the depthwise and 1x1 kernels, then the direct kernel of the level
(``jit_avx512_common_convolution_bwd_weights_t``, ``jit_avx2_convolution_bwd_weights_t``), whose
``init_conf`` rejects the shapes :func:`fp32_bwd_weights_kernel` names, then ``gemm:jit``.

Checked to the byte against real ``gemm:jit`` primitives (fp32 and bf16, NCHW and channels-last,
depthwise 7x7, 3x3 and 5x5 kernels larger than the image, a 15-wide kernel) at ``avx2`` and
``avx512_core_fp16`` with one thread (``tests/estimator/test_onednn_vision.py``), and at ``avx2``
with two threads (``outer_threading`` on: one reduction buffer and one im2col buffer a thread).

Known limitations:
    The memory-limit branches of ``outer_threading`` and of the im2col block are ported, not
    measured (no shape tried reaches them). The fp32
    direct kernels' per-thread weight-reduction copies (when they split the batch over threads,
    ``nthr_mb > 1``) are not modelled; neither are 3-d convolutions.
"""

from __future__ import annotations

from memguard.estimator._onednn import book
from memguard.estimator._onednn_conv import ConvShape

_FLOAT = 4  # sizeof(float): oneDNN's accumulators and reduction buffers


def _pads(conv: ConvShape) -> tuple[int, int, int, int]:
    """(top/left pad, bottom/right end padding, output height, output width), square, undilated
    (``calculate_end_padding``, src/common/utils.hpp)."""
    oh = (conv.ih + 2 * conv.pad - conv.kh) // conv.stride + 1
    ow = (conv.iw + 2 * conv.pad - conv.kw) // conv.stride + 1
    b_pad = max(0, (oh - 1) * conv.stride + conv.kh - (conv.ih + conv.pad))
    return conv.pad, b_pad, oh, ow


def fp32_bwd_weights_kernel(conv: ConvShape, isa: str) -> str | None:
    """The fp32 weight-gradient kernel oneDNN picks at ``isa``: ``"jit_dw"``, ``"jit_1x1"``,
    ``"jit"`` (the level's direct kernel) or ``"gemm"``; None for a dilated convolution (not modelled)."""
    if conv.dilation != 1:
        return None
    ic_g, oc_g = conv.ic // conv.groups, conv.oc // conv.groups
    if conv.groups > 1 and ic_g == 1 and oc_g == 1 and conv.kw <= 3 and conv.stride <= conv.kw:
        return "jit_dw"  # jit_uni_dw_conv_kernel_utils.cpp: depthwise kernels up to 3 wide
    if conv.kh == 1 and conv.kw == 1 and conv.pad == 0 and conv.groups == 1:
        return "jit_1x1"
    t_pad, b_pad, _, _ = _pads(conv)
    avx512 = isa.startswith("avx512")
    simd_w = 16 if avx512 else 8
    # plain (NCHW) grouped channels are not padded to the block (``ok_to_pad_channels`` needs one group)
    grouped_unaligned = not conv.channels_last and conv.groups > 1 and (ic_g % simd_w or oc_g % simd_w)
    if avx512:
        # jit_avx512_common_conv_kernel.cpp, bwd-weights init_conf: ``boundaries_ok`` and ``kw > 14``
        # (the ``is_hw_transp`` exception, a kernel as wide as a 1-wide output's input, is not taken)
        direct = (t_pad <= conv.kh // 2 and b_pad <= conv.kh // 2 and t_pad < conv.kw and b_pad < conv.kw
                  and t_pad <= 28 and conv.kw <= 14)
    else:
        # jit_avx2_conv_kernel_f32.cpp, bwd-weights init_conf: ``boundaries_ok`` and ``params_ok``
        # (``kw < 14``, ``kh <= ih`` [bwd_w:r2], ``t_pad < kh``)
        direct = (t_pad < conv.kh and b_pad < conv.kh and t_pad < conv.kw and b_pad < conv.kw
                  and conv.kw < 14 and conv.kh <= conv.ih)
    return "jit" if direct and not grouped_unaligned else "gemm"


def gemm_bwd_weights_scratchpad_bytes(conv: ConvShape, *, itemsize: int, threads: int, isa: str) -> int:
    """The scratchpad of one ``gemm:jit`` weight-gradient convolution (``itemsize`` 4: fp32, 2: bf16),
    as ``init_conf`` of src/cpu/gemm_convolution_utils.cpp books it for ``backward_weights``."""
    bf16 = itemsize == 2
    groups, ic, oc = conv.groups, conv.ic // conv.groups, conv.oc // conv.groups
    _, _, oh, ow = _pads(conv)
    os_, is_, ks = oh * ow, conv.ih * conv.iw, conv.kh * conv.kw
    no_im2col = ow == conv.iw and oh == conv.ih and conv.stride == 1 and ks == 1
    im2col = 0 if no_im2col else ic * ks * os_  # jcp.im2col_sz, in elements
    wei_bytes = groups * oc * ic * ks * itemsize  # weights_d.size(): the plain weights, in bytes
    bf16_extra = (wei_bytes * _FLOAT + (groups * oc * _FLOAT if conv.bias else 0)) if bf16 else 0
    # scratchpad_limit: min(1 GiB, 15 * max_threads * (src + weights + dst bytes))
    src_bytes, dst_bytes = conv.n * conv.ic * is_ * itemsize, conv.n * conv.oc * os_ * itemsize
    limit = min(1 << 30, 15 * threads * (src_bytes + wei_bytes + dst_bytes))
    simd_w = (64 if isa.startswith("avx512") else 32) // itemsize  # vlen / data_size
    if conv.channels_last:  # the ``is_nspc && is_bwd_w`` branch
        estimate = threads * (itemsize * im2col + itemsize * is_ * ic + _FLOAT * wei_bytes) + bf16_extra
    else:
        estimate = _FLOAT * threads * wei_bytes + bf16_extra + itemsize * threads * ic * ks * simd_w
    outer = estimate < limit and os_ // threads < 256 and (conv.n != 1 or groups > 2)
    nthr = threads if outer else 1
    total = book(nthr * wei_bytes * _FLOAT)  # key_conv_wei_reduction: weights_d.size() floats a thread
    if bf16:
        total += book(wei_bytes * _FLOAT)  # key_conv_int_dat_in_acc_dt: the fp32 weight accumulator
        if conv.bias:
            total += book(groups * oc * _FLOAT)  # key_conv_bias_bf16_convert_wsp
    if conv.channels_last:
        total += book(nthr * is_ * ic * itemsize)  # key_conv_gemm_imtr: the transposed source
    elif total < limit and limit - total < nthr * im2col * itemsize:
        # too large for what is left of the limit: the spatial block shrinks (``_coef = 0.05``)
        max_os_block = (limit - total) // (itemsize * nthr * (im2col // os_))
        im2col = ic * ks * max(simd_w, int(max_os_block * 0.05))
    return total + book(nthr * im2col * itemsize)  # key_conv_gemm_col
