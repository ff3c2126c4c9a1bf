"""oneDNN's convolution scratchpad: the weight-gradient kernels' buffers for bf16 convolutions.

A bf16 convolution's weight gradient in oneDNN transposes blocks of the source and the output
gradient and accumulates the gradient in fp32, in a scratchpad PyTorch allocates per call (user
scratchpad mode). That scratchpad is a sizeable part of a convolution's backward peak (283 KB for a
32->64 3x3 convolution on an 8x32x32 batch: half the input's size), so it is modelled. Everything
follows oneDNN v3.12 (the version torch 2.13 bundles); paths are under ``src/cpu/x64/``.

* Each booking costs its size plus 128 bytes of alignment (``common/memory_tracking.hpp``
  ``registry_t::book``); a barrier of ``k`` contexts costs ``4096 * k + 4096`` (``cpu_barrier.hpp``).
* ``jit_bf16`` (``jit_avx512_core_bf16_conv_kernel.cpp``, bwd-weights ``init_conf``,
  ``init_scratchpad``, ``balance``): the transposed source (``tr_src``) and output gradient
  (``tr_diff_dst``) per thread group, and an fp32 reduction buffer of the weights and bias per
  mini-batch thread (PyTorch's bf16 weight gradients always take it).
* ``jit_bf16_1x1`` (``jit_avx512_core_bf16_1x1_conv_kernel.cpp``; ``jit_uni_1x1_conv_utils.hpp``
  ``rtus_prepare``): the fp32 reduction buffer, transposed load/broadcast blocks unless the
  ``permw`` layout is used, and the unit-stride copy of a strided source (``rtus``).
* ``jit_dw`` (``jit_uni_dw_conv_kernel_utils.cpp``, kernels up to 3 wide): fp32 weight and bias
  accumulators.

Checked to the byte against 504 real bf16 weight-gradient primitives (1 and 2 threads, NCHW and
channels-last, strides 1-4, groups, depthwise) at ``avx512_core_bf16`` and ``avx512_core``.

Known limitations:
    The ``gemm:jit`` weight-gradient kernel (grouped NCHW convolutions whose channels per group are
    not a multiple of 16, depthwise kernels wider than 3 on NCHW, first-layer convolutions with
    output channels not a multiple of 16) is sized by :mod:`memguard.estimator._onednn_gemm`, not
    here. Not modelled: dilated convolutions, the forward and input-gradient scratchpads of the brgemm kernels
    (channels-last and strided shapes on ``avx512_core_bf16``: a few KB to tens of KB), fp32
    scratchpads (a padded bias, and per-thread weight copies when the batch is split over threads)
    or cache-size dependent blocking of very wide images.
"""

from __future__ import annotations

from dataclasses import dataclass

from memguard.estimator._onednn import book, div_up, f32, rnd_up

@dataclass(frozen=True)
class ConvShape:
    """A 2-d convolution as oneDNN's weight-gradient primitive sees it (square strides and paddings).

    Attributes:
        n, ic, oc: the mini-batch, input and output channels.
        ih, iw, kh, kw: the input's and the kernel's height and width.
        stride, pad, dilation: the (square) stride, padding and dilation.
        groups: convolution groups (``groups == ic == oc`` is depthwise).
        channels_last: the tensors are channels-last (oneDNN's ``nhwc``), else ``nchw``.
        bias: the bias gradient is computed too.
    """

    n: int
    ic: int
    oc: int
    ih: int
    iw: int
    kh: int
    kw: int
    stride: int = 1
    pad: int = 0
    dilation: int = 1
    groups: int = 1
    channels_last: bool = False
    bias: bool = False


@dataclass(frozen=True)
class _JitBlocking:
    """jit_bf16's bwd-weights blocking, the input of its thread ``balance``: the mini-batch, the
    per-group channels, the heights, the transposed widths, the kernel, the channel blocks and
    their counts, the groups, the mini-batch work items and the stride."""

    mb: int
    ic: int
    oc: int
    ih: int
    oh: int
    tr_iw: int
    tr_ow: int
    kh: int
    kw: int
    nb_ic: int
    nb_oc: int
    ic_block: int
    oc_block: int
    groups: int
    mb_work: int
    stride: int


def _barrier(contexts: int) -> int:
    return 4096 * contexts + 4096 if contexts > 0 else 0


def _jit_balance(b: _JitBlocking, threads: int) -> tuple[int, int, int, int]:
    """``(nthr, nthr_mb, nthr_oc_b, nthr_ic_b)``: the bwd-weights ``balance`` of jit_bf16, in float32."""
    mb, ic, oc, ih, oh, tr_iw, tr_ow, kh, kw = b.mb, b.ic, b.oc, b.ih, b.oh, b.tr_iw, b.tr_ow, b.kh, b.kw
    nb_ic, nb_oc, ic_block, oc_block, groups = b.nb_ic, b.nb_oc, b.ic_block, b.oc_block, b.groups
    mb_work, stride = b.mb_work, b.stride
    if threads < groups:  # one group per thread, the mini-batch unsplit
        return threads, 1, 1, 1
    nthr = threads // groups
    src_size, dst_size, wei_size = mb * ic * ih * tr_iw * 2, mb * oc * oh * tr_ow * 2, oc * ic * kh * kw * 4
    wcs = f32(f32(f32(0.5) * f32(dst_size + src_size)) / f32(wei_size))
    oicr = f32(f32(nb_oc) / f32(nb_ic))
    src_coef = max(f32(1.0 / oicr), 1.0)
    if wcs < 1.0:
        src_coef = f32(src_coef * 4.0)
    dst_coef, wei_coef = max(oicr, 1.0), max(wcs, 1.0)

    def product(start: float, factors: tuple, divisors: tuple = ()) -> float:
        v = start
        for f in factors:
            v = f32(v * f)
        for d in divisors:
            v = f32(v / d)
        return v

    def cost(nmb: int, noc: int, nic: int) -> float:
        src = product(f32(src_coef * div_up(mb_work, nmb)), (1, div_up(nb_ic, nic), mb, ic_block, 1, ih, tr_iw),
                      (mb_work, 1, stride, stride))
        wei = product(wei_coef, (1, div_up(nb_oc, noc), div_up(nb_ic, nic), kh, kw, 1, ic_block, oc_block))
        dst = product(f32(dst_coef * div_up(mb_work, nmb)), (1, div_up(nb_oc, noc), mb, oc_block, 1, oh, tr_ow),
                      (mb_work,))
        return f32(f32(src + dst) + wei)

    best, pick = cost(1, 1, 1), (1, 1, 1)
    for nmb in range(1, min(nthr, mb_work) + 1):
        for noc in range(1, min(nthr // nmb, nb_oc) + 1):
            nic = min(nthr // nmb // noc, nb_ic)
            c = cost(nmb, noc, nic)
            if c <= best:
                best, pick = c, (nmb, noc, nic)
    nmb, noc, nic = pick
    if nthr // 2 < nmb < nthr:
        nmb = min(mb_work, nthr)
    return nmb * groups * noc * nic, nmb, noc, nic


def _jit(conv: ConvShape, threads: int, native: bool) -> int:
    n, ic, oc, ih, iw, kh, kw = conv.n, conv.ic, conv.oc, conv.ih, conv.iw, conv.kh, conv.kw
    stride, pad, groups, channels_last, bias = conv.stride, conv.pad, conv.groups, conv.channels_last, conv.bias
    oh, ow = (ih + 2 * pad - kh) // stride + 1, (iw + 2 * pad - kw) // stride + 1
    b_pad = max(0, (oh - 1) * stride + kh - (ih + pad))
    r_pad = max(0, (ow - 1) * stride + kw - (iw + pad))
    ic, oc = ic // groups, oc // groups
    first = ic < 16 and groups == 1  # is_1stconv
    if groups == 1 and not first and not channels_last:
        ic, oc = rnd_up(ic, 16), rnd_up(oc, 16)
    oc_block, ic_block = 16, (ic if first else 16)
    nb_oc, nb_ic = div_up(oc, oc_block), div_up(ic, ic_block)
    tr_src = not (first and (not channels_last or ic == 1))
    tr_pad = rnd_up(max(pad, r_pad + 1), 2)
    tr_iw = rnd_up(div_up(iw, stride) + tr_pad, 2) * stride if tr_src else iw
    tr_ow = rnd_up(ow, 2)
    working_set = (ic_block * tr_iw * 2 + oc_block * tr_ow * 2) * max(1, b_pad, pad)
    full_spatial = (native and ih == oh and iw == ow and kh != 1 and kw != 1 and stride == 1 and pad == kw // 2
                    and pad == kh // 2 and not first and working_set <= 48 * 1024 and ic >= 128)
    mb_work = n if full_spatial else n * oh
    blocking = _JitBlocking(mb=n, ic=ic, oc=oc, ih=ih, oh=oh, tr_iw=tr_iw, tr_ow=tr_ow, kh=kh, kw=kw, nb_ic=nb_ic,
                            nb_oc=nb_oc, ic_block=ic_block, oc_block=oc_block, groups=groups, mb_work=mb_work,
                            stride=stride)
    nthr, nmb, noc, nic = _jit_balance(blocking, threads)
    total = book(((nmb * nb_ic * groups * tr_iw * ic_block * ih) if tr_src else 0) * 2 + tr_pad * 2)
    if noc > 1:
        total += _barrier(nthr // noc)
    total += book(nmb * nb_oc * groups * tr_ow * oc_block * oh * 2)
    if nic > 1:
        total += _barrier(nthr // nic)
    weights = groups * nb_oc * oc_block * nb_ic * ic_block * kh * kw
    bias_elems = groups * nb_oc * oc_block if bias else 0
    total += book((weights + bias_elems) * nmb * 4) + _barrier(1)
    return total


def _best_divider(value: int, low: int, high: int, find_max: bool, step: int = 1) -> int:
    """``best_divider`` (jit_uni_1x1_conv_utils.hpp)."""
    high = max(1, min(high, value))
    low = max(1, min(low, high))
    best, pick = 3.4e38, high
    for d in range(high, low - 1, -step):
        r = rnd_up(value, d)
        loss = f32(f32(r - value) / r)
        if (find_max and loss < best) or (not find_max and loss <= best):
            best, pick = loss, d
    return pick


def _one_by_one(conv: ConvShape, threads: int) -> int:
    n, ic, oc, ih, iw = conv.n, conv.ic, conv.oc, conv.ih, conv.iw
    stride, channels_last, bias = conv.stride, conv.channels_last, conv.bias
    oc_given = oc
    oh, ow = (ih - 1) // stride + 1, (iw - 1) // stride + 1
    rtus = stride != 1
    if rtus:
        ih, iw = oh, ow
    if not channels_last:
        ic, oc = rnd_up(ic, 16), rnd_up(oc, 16)
    spatial = ih * iw
    permw = not channels_last and oh > 14 and ow > 14
    rb = _best_divider(spatial, 7, min(256, spatial), True, 2) if permw else _best_divider(spatial, 8, 16, True, 2)
    if spatial % rb:
        rb = _best_divider(iw, 4, iw, permw, 2)
    if rb > 256:
        rb = 1
    if not permw:
        rb = rnd_up(rb, 2)
    nb_bcast, nb_load, nb_reduce = div_up(ic, 16), div_up(oc, 16), div_up(spatial, rb)
    nmb = noc = nic = 1
    mult = 1 if stride != 1 and not rtus else max(1, oc // ic)

    def cost(m: int, o: int, i: int) -> int:
        step = 1 if rtus else stride
        return (div_up(n * nb_reduce, m) * div_up(nb_bcast, i) * 16 * rb // step // step
                + div_up(n * nb_reduce, m) * div_up(nb_load, o) * 16 * rb
                + 4 * mult * div_up(nb_load, o) * div_up(nb_bcast, i) * 256)

    best = cost(1, 1, 1)
    for m in range(1, min(threads, n * nb_reduce) + 1):
        for o in range(1, min(threads // m, nb_load) + 1):
            i = min(threads // m // o, nb_bcast)
            c = cost(m, o, i)
            if c <= best:
                best, nmb, noc, nic = c, m, o, i
    if threads // 2 < nmb < threads:
        nmb = min(n, threads)
    nthr = nmb * noc * nic
    load_blk, bcast_blk = _best_divider(nb_load, 16, nb_load, False), _best_divider(nb_bcast, 5, nb_bcast, False)
    total = book(oc * 2) if bias and oc_given % 16 else 0
    total += book((rnd_up(oc, 16) * rnd_up(ic, 16) + (rnd_up(oc, 16) if bias else 0)) * nmb * 4)
    if nmb > 1:
        total += _barrier(1)
    if not permw:
        total += book(nthr * rnd_up(spatial, 2) * 16 * load_blk * 2)
        total += book(nthr * rnd_up(spatial, 2) * 16 * bcast_blk * 2)
    if rtus:
        total += book(nthr * (spatial * ic if channels_last else bcast_blk * spatial * 16) * 2)
    return total


def _depthwise(n, channels, kh, kw, threads, channels_last, bias) -> int:
    if channels_last:
        total = book(rnd_up(channels, 16) * kh * kw * threads * 4) + (book(channels * threads * 4) if bias else 0)
    else:
        nmb = min(max(1, threads // min(div_up(channels, 16), threads)), n)
        if nmb > 1:
            total = book(channels * kh * kw * nmb * 4) + (book(channels * (nmb - 1) * 4) if bias else 0)
        else:
            total = book(channels * kh * kw * 4)
    return total + (book(channels * 4) if bias else 0)  # the bf16 bias conversion buffer


def bwd_weights_kernel(conv: ConvShape) -> str | None:
    """The bf16 weight-gradient kernel oneDNN picks for ``conv`` (``"jit_dw"``, ``"jit_bf16_1x1"``,
    ``"jit_bf16"`` or ``"gemm"``, after the names ONEDNN_VERBOSE prints), or None for a dilated
    convolution (not modelled). The same at ``avx512_core`` and at the native bf16 levels (the order
    of ``cpu/cpu_convolution_list.cpp``; measured at both). ``gemm``'s scratchpad is sized by
    :mod:`memguard.estimator._onednn_gemm`."""
    ic, oc, kh, kw, stride, pad = conv.ic, conv.oc, conv.kh, conv.kw, conv.stride, conv.pad
    groups, channels_last = conv.groups, conv.channels_last
    per_group_in, per_group_out = ic // groups, oc // groups
    depthwise = groups > 1 and per_group_in == 1 and per_group_out == 1
    if conv.dilation != 1:
        return None
    if depthwise and kw <= 3 and stride <= kw:  # jit_uni_dw_conv_kernel_utils.cpp: kernels up to 3 wide
        return "jit_dw"
    if kh == 1 and kw == 1 and pad == 0 and groups == 1:
        return "jit_bf16_1x1"
    if channels_last or (groups == 1 and (per_group_in >= 16 or oc % 16 == 0)) or (
            per_group_in % 16 == 0 and per_group_out % 16 == 0):
        return "jit_bf16"
    return "gemm"


def bwd_weights_blocked_weight_bytes(conv: ConvShape, itemsize: int, block: int = 16) -> int:
    """Bytes of the weight gradient in the grouped layout the direct kernels compute it in:
    ``gOIhw16i16o`` (``aBCde16c16b`` in ONEDNN_VERBOSE; ``gOIhw8i8o`` with ``block=8``, fp32 on
    AVX2), each group's output and input channels padded to the block, so a depthwise weight
    gradient takes ``block**2`` times its plain size (jit_avx512_core_bf16_conv_kernel.cpp,
    jit_avx512_common_conv_kernel.cpp and jit_avx2_conv_kernel_f32.cpp, bwd-weights ``init_conf``:
    ``wei_tag`` with groups; measured to the byte on channels-last 7x7 depthwise convolutions)."""
    return conv.groups * rnd_up(conv.oc // conv.groups, block) * rnd_up(conv.ic // conv.groups, block) \
        * conv.kh * conv.kw * itemsize


def bwd_weights_scratchpad_bytes(conv: ConvShape, *, threads: int, isa: str) -> int | None:
    """The scratchpad of one bf16 weight-gradient convolution in oneDNN, or None where the kernel
    oneDNN picks is not modelled (see Known limitations). ``threads`` is the intra-op thread count;
    ``isa`` is ``"avx512_core"`` or a level with a native bf16 dot product."""
    kernel = bwd_weights_kernel(conv)
    if kernel == "jit_dw":
        return _depthwise(conv.n, conv.groups, conv.kh, conv.kw, threads, conv.channels_last, conv.bias)
    if kernel == "jit_bf16_1x1":
        return _one_by_one(conv, threads)
    if kernel == "jit_bf16":
        return _jit(conv, threads, native=isa != "avx512_core")
    return None  # gemm (see _onednn_gemm) or a dilated convolution
