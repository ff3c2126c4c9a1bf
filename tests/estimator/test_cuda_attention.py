"""CUDA attention rules: backend choice as sdp_utils.cpp makes it, and the bytes each backend's
kernels allocate, checked against the shapes in PyTorch's source (torch 2.13)."""

from __future__ import annotations

import gc
from collections import Counter
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses import FakeTensorMode

from memguard.errors import ConfigError
from memguard.estimator import _cuda_attention as ca
from memguard.estimator._cuda_kernels import RULES, CudaKernelModel, CudaTarget
from memguard.estimator._trace import Trace, Recorder, load_rules

load_rules()

A100, V100, A10, H100, RTX50 = (8, 0), (7, 0), (8, 6), (9, 0), (12, 0)
DEFAULT = ca.SdpaSettings()  # every backend on, the default order (at::Context)


def qkv(b=2, h=4, s_q=128, s_k=None, d=64, dtype=torch.bfloat16, h_k=None, d_v=None, grad=True):
    s_k = s_q if s_k is None else s_k
    h_k = h if h_k is None else h_k
    d_v = d if d_v is None else d_v
    make = lambda *shape: torch.empty(*shape, dtype=dtype, device="meta", requires_grad=grad)  # noqa: E731
    return make(b, h, s_q, d), make(b, h_k, s_k, d), make(b, h_k, s_k, d_v)


def choose(cap, *, torch_version=(2, 13), mask=None, dropout=0.1, causal=False, gqa=False,
           settings=DEFAULT, cudnn=None, **shape):
    q, k, v = qkv(**shape)
    return ca.select_sdpa_backend(CudaTarget(cap, torch_version), ca.SdpaCall(q, k, v, mask, dropout, causal, gqa),
                                  settings=settings, cudnn_version=cudnn)


FLOAT_MASK = torch.zeros(2, 1, 1, 128, dtype=torch.bfloat16, device="meta")


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        # every check_* of can_use_flash_attention passes: bf16, sm80, d=64, no mask
        (dict(cap=A100), "flash"),
        # check_dtypes_flash_attention: fp16/bf16 only; mem-efficient takes fp32 on sm80+
        (dict(cap=A100, dtype=torch.float32), "efficient"),
        # check_flash_attention_hardware_support: sm80..sm121; mem-efficient sm50+ takes fp16
        (dict(cap=V100, dtype=torch.float16), "efficient"),
        # less_than_sm80_mem_efficient_dtypes = {fp16, fp32}: bf16 on sm70 falls to math
        (dict(cap=V100, dtype=torch.bfloat16), "math"),
        # check_for_attn_mask: flash takes no attn_mask; mem-efficient takes an additive bias
        (dict(cap=A100, mask=FLOAT_MASK), "efficient"),
        # check_head_dim_size_flash: d <= 256; mem-efficient has no upper bound on CUDA
        (dict(cap=A100, d=512), "efficient"),
        # check_flash_causal_non_square_seqlens: is_causal needs s_q == s_k for flash
        (dict(cap=A100, causal=True, s_q=64, s_k=128), "efficient"),
        # flash pads head dims to a multiple of 8 itself: d=60 is fine
        (dict(cap=A100, d=60, dtype=torch.float16), "flash"),
        # fp32 on sm80: minimum_gemm_alignment = max(4, 128/32) = 4 elements; 6 % 4 != 0 -> math
        (dict(cap=A100, d=6, dtype=torch.float32), "math"),
        # fp16 on sm70: tensor cores -> alignment 128/16 = 8; d=60 is not aligned -> math
        (dict(cap=V100, d=60, dtype=torch.float16), "math"),
        # sm86 training with 192 < d <= 224: flash's backward cannot, mem-efficient (d % 8 == 0) can
        (dict(cap=A10, d=200), "efficient"),
        # ... without grad the sm86 restriction does not apply
        (dict(cap=A10, d=200, grad=False), "flash"),
        # sm86, d in (224, 256] with dropout -> no flash; without dropout -> flash
        (dict(cap=A10, d=256), "efficient"),
        (dict(cap=A10, d=256, dropout=0.0), "flash"),
        # GQA with enable_gqa: check_grouped_query_attention (kv heads divide q heads) -> flash
        (dict(cap=A100, h=8, h_k=2, gqa=True), "flash"),
        # different heads without enable_gqa: check_batch_size_and_num_heads_dense fails for both
        (dict(cap=A100, h=8, h_k=2), "math"),
        # mem-efficient instantiates check_batch_size_and_num_heads_dense<false> (no GQA, torch <= 2.13):
        # where flash cannot run (sm < 80, fp32, an attn_mask) a GQA call falls to math
        (dict(cap=V100, dtype=torch.float16, h=8, h_k=2, gqa=True), "math"),
        (dict(cap=A100, dtype=torch.float32, h=8, h_k=2, gqa=True), "math"),
        (dict(cap=A100, mask=FLOAT_MASK, h=8, h_k=2, gqa=True), "math"),
        # ...but equal head counts pass its same_num_heads check whatever enable_gqa says
        (dict(cap=V100, dtype=torch.float16, gqa=True), "efficient"),
        # cuDNN does take GQA and a mask (<supports_gqa=true, requires_same_num_heads=false>)
        (dict(cap=A100, mask=FLOAT_MASK, h=8, h_k=2, gqa=True, cudnn=91000, dropout=0.125,
              settings=replace(DEFAULT, math=False)), "cudnn"),
        # enable_gqa exists from torch 2.5: a 2.4 target treats it as absent
        (dict(cap=A100, h=8, h_k=2, gqa=True, torch_version=(2, 4)), "math"),
        # torch < 2.7: flash and mem-efficient stop at sm90 (Blackwell support came in 2.7)
        (dict(cap=RTX50, torch_version=(2, 6)), "math"),
        (dict(cap=RTX50), "flash"),
        # settings: flash disabled (sdpa_kernel / enable_flash_sdp(False)) -> next in order
        (dict(cap=A100, settings=replace(DEFAULT, flash=False)), "efficient"),
        (dict(cap=A100, settings=replace(DEFAULT, flash=False, efficient=False)), "math"),
        # cuDNN comes after math in the default order: never reached while math is on...
        (dict(cap=A100, cudnn=91000, settings=replace(DEFAULT, flash=False, efficient=False)), "math"),
        # ...but it is next when math is off too (dropout 0.125 is a multiple of 1/16)
        (dict(cap=A100, cudnn=91000, dropout=0.125,
              settings=replace(DEFAULT, flash=False, efficient=False, math=False)), "cudnn"),
        # check_prefer_cudnn_attention: sm90 with cuDNN > 9.15.0 puts cuDNN first
        (dict(cap=H100, cudnn=91600, dropout=0.125), "cudnn"),
        # check_cudnn_dropout: 0.1 is not a multiple of 1/16 -> cuDNN refuses, flash next
        (dict(cap=H100, cudnn=91600, dropout=0.1), "flash"),
        # cuDNN 9.15.0 or unknown: no preference, the default order
        (dict(cap=H100, cudnn=91500, dropout=0.125), "flash"),
        (dict(cap=H100, dropout=0.125), "flash"),
        # a user-set order is kept (priority_order_init_ only replaces the default)
        (dict(cap=H100, cudnn=91600, dropout=0.125,
              settings=replace(DEFAULT, priority=("efficient", "flash", "math", "cudnn"), priority_is_default=False)),
         "efficient"),
    ],
)
def test_backend_choice(kwargs, expected):
    cap = kwargs.pop("cap")
    assert choose(cap, **kwargs) == expected


def test_no_backend_is_a_config_error():
    # CUDA raises "No available kernel" when nothing is enabled or nothing enabled accepts the inputs
    with pytest.raises(ConfigError, match="enable"):
        choose(A100, settings=replace(DEFAULT, flash=False, efficient=False, cudnn=False, math=False))
    with pytest.raises(ConfigError, match="math"):
        choose(V100, dtype=torch.bfloat16, settings=replace(DEFAULT, math=False))


def test_settings_follow_sdpa_kernel_context():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        s = ca.sdpa_settings()
    assert (s.flash, s.efficient, s.cudnn, s.math) == (False, False, False, True)
    assert ca.sdpa_settings().priority_is_default  # torch 2.13 CPU build: flash, efficient, math, cudnn


def test_flash_saved_shapes_follow_mha_fwd_and_mha_bwd():
    # flash_api.cpp: softmax_lse [b, h, s_q] fp32; rng_state uint64[2] and the uint64 scalar always;
    # mha_bwd: softmax_d [b, h, round128(s_q)], dq_accum [b, round128(s_q), h, round(d, 32)] fp32
    s = ca.flash_saved_shapes(b=2, h=12, s_q=200, s_k=200, d=64)
    assert s["logsumexp"] == ((2, 12, 200), torch.float32)
    assert s["philox_seed"] == ((2,), torch.uint64) and s["philox_offset"] == ((), torch.uint64)
    assert s["softmax_d"] == ((2, 12, 256), torch.float32)
    assert s["dq_accum"] == ((2, 256, 12, 64), torch.float32)
    assert "dk_expanded" not in s
    # head dims above 128 round to 64 (head_size_rounded); GQA expands dk/dv to all query heads
    g = ca.flash_saved_shapes(b=1, h=8, s_q=128, s_k=96, d=136, h_k=2)
    assert g["dq_accum"][0] == (1, 128, 8, 192)
    assert g["dk_expanded"][0] == (1, 96, 8, 136)


def test_efficient_logsumexp_is_padded_to_32_rows():
    # attention.cu: logsumexp [B, H, ceil_div(max_seqlen_q, kAlignLSE) * kAlignLSE], kAlignLSE = 32
    assert ca.efficient_saved_shapes(2, 4, 100)["logsumexp"] == ((2, 4, 128), torch.float32)
    assert ca.efficient_saved_shapes(2, 4, 96)["logsumexp"][0] == (2, 4, 96)
    # no logsumexp without grad (compute_logsumexp = any input requires grad)
    assert ca.efficient_saved_shapes(2, 4, 100, compute_logsumexp=False)["logsumexp"][0] == (2, 4, 0)


# ---------------------------------------------------------------------------------------------
# bytes a fake forward+backward allocates


def _allocations(cap, dtype, *, b=2, h=4, s=100, d=64, dropout=0.1, mask=False, cudnn=None, cuda=None,
                 vendor="nvidia"):
    """Storage sizes allocated by SDPA's forward and by its backward under the CUDA rules.

    q, k, v are views of one projection (as in a transformer block); the output is turned back to
    [B, S, H*D] with ``transpose(1, 2).reshape`` as Hugging Face's SDPA attention does.
    """
    gc.disable()
    try:
        with FakeTensorMode():
            x = torch.empty(b, s, 3 * h * d, dtype=dtype, requires_grad=True)
            m = torch.zeros(b, 1, 1, s, dtype=dtype) if mask else None
            trace = Trace()
            rec = Recorder(trace)
            with rec:
                rec.register(x, "inputs")
                if m is not None:
                    rec.register(m, "inputs")
                start = len(trace.events)
                with CudaKernelModel(CudaTarget(cap, vendor=vendor, cuda_version=cuda, cudnn_version=cudnn)):
                    q, k, v = x.view(b, s, 3, h, d).permute(2, 0, 3, 1, 4).unbind(0)
                    out = F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=dropout)
                    y = out.transpose(1, 2).reshape(b, s, h * d)
                    mid = len(trace.events)
                    grad = torch.empty_like(y)
                    rec.register(grad, "inputs")
                    bstart = len(trace.events)
                    y.backward(grad)
        fwd = [n for _, n in trace.events[start:mid] if n > 0]
        bwd = [n for _, n in trace.events[bstart:] if n > 0]
        return Counter(fwd), Counter(bwd)
    finally:
        gc.enable()


def test_flash_bytes_match_flash_api():
    b, h, s, d = 2, 4, 100, 64
    fwd, bwd = _allocations(A100, torch.bfloat16, b=b, h=h, s=s, d=d)
    bhsd = b * h * s * d * 2
    # forward: out [B, S, H, D] bf16, softmax_lse fp32 [B, H, S], rng_state uint64[2], uint64 scalar;
    # the output is already [B, S, H, D] in memory, so transpose(1, 2).reshape copies nothing
    assert fwd == Counter([bhsd, b * h * s * 4, 16, 8])
    # backward (mha_bwd): dq, dk, dv like q, k, v; softmax_d [B, H, 128] and dq_accum
    # [B, 128, H, 64] fp32 (seqlen rounded to 128, head dim to 32); grad_out needs no copy
    expected = Counter([bhsd, bhsd, bhsd, b * h * 128 * 4, b * 128 * h * 64 * 4])
    # plus autograd's, outside the kernel: unbind's backward stacks dq, dk, dv into one [3, ...] tensor,
    # and the non-contiguous permuted gradient is copied to x's layout for view's backward
    assert bwd == expected + Counter({3 * bhsd: 2})


def test_efficient_bytes_match_attention_cu():
    b, h, s, d = 2, 4, 100, 64
    fwd, bwd = _allocations(A100, torch.float32, b=b, h=h, s=s, d=d)
    bhsd = b * h * s * d * 4
    # _efficient_attention_forward: res [B, M, H, Kv] fp32 and logsumexp [B, H, 128] (32-row padding);
    # seed/offset are CPU scalars: nothing more on the device
    assert fwd == Counter([bhsd, b * h * 128 * 4])
    # backward (_efficient_attention_backward): grad_q/k/v = at::empty of the [B, M, H, K] views;
    # fp32 kernels leave delta to ATen: (grad_out * out) [B, M, H, Kv] fp32, .sum(-1) [B, M, H],
    # .transpose(-2, -1).contiguous() [B, H, M]; the fp32 dq accumulation workspace (kNeedsAccumGradQ
    # on sm70+), at least B*H*M*K floats
    expected = Counter([bhsd] * 3 + [bhsd, b * s * h * 4, b * h * s * 4] + [bhsd])
    assert expected - bwd == Counter()


def test_efficient_16bit_kernel_computes_delta_and_accumulates_large_head_dims():
    b, h, s, d = 2, 2, 64, 160  # d > 128: no single-value-iteration forward kernel
    fwd, bwd = _allocations(A100, torch.bfloat16, b=b, h=h, s=s, d=d, mask=True)  # mask: no flash
    bhsd = b * h * s * d * 2
    # forward: res bf16, logsumexp fp32 [B, H, 64], and the fp32 output accumulator (freed)
    assert Counter([bhsd, b * h * 64 * 4, bhsd * 2]) - fwd == Counter()
    # backward: delta [B, H, M] fp32 from the kernel (kKernelComputesDelta for 16-bit), workspace
    assert Counter([bhsd] * 3 + [b * h * s * 4, b * h * s * d * 4]) - bwd == Counter()
    assert bhsd * 2 not in bwd or bwd[bhsd * 2] == 1  # no fp32 grad_out * out product (only the workspace)


def test_efficient_bool_mask_is_converted_and_padded():
    # a bool mask becomes a float bias (convert_boolean_attn_mask); preprocess_mask pads it when a
    # stride is not a multiple of 8: S=100 gives row stride 100, so 8 - 100 % 8 = 4 columns more
    b, h, s, d = 2, 4, 100, 64
    with FakeTensorMode(), CudaKernelModel(CudaTarget(A100)):
        q = torch.empty(b, h, s, d, dtype=torch.float32)
        m = torch.ones(b, 1, s, s, dtype=torch.bool)
        bias = ca._efficient_bias(ca._float_mask(m, q.dtype), q, q)
        assert bias.shape == (b, h, s, s)
        assert bias.untyped_storage().nbytes() == b * s * 104 * 4
        # aligned strides (S=96): no copy, the converted mask itself is expanded
        m96 = torch.ones(b, 1, 96, 96, dtype=torch.bool)
        q96 = torch.empty(b, h, 96, d, dtype=torch.float32)
        bias96 = ca._efficient_bias(ca._float_mask(m96, q96.dtype), q96, q96)
        assert bias96.untyped_storage().nbytes() == b * 96 * 96 * 4


def test_math_path_keeps_a_bool_dropout_mask():
    b, h, s, d = 2, 4, 100, 64
    fwd, _ = _allocations(V100, torch.bfloat16, b=b, h=h, s=s, d=d)  # bf16 on sm70: math
    bhsd4, bhss4 = b * h * s * d * 4, b * h * s * s * 4
    # _scaled_dot_product_attention_math: q, k, v upcast to fp32 (keeping the views' [B, S, H, D]
    # strides), q and k^T scaled, and matmul's reshape to 3-d copies q, k^T and v for that reason;
    # scores; softmax; native_dropout's output and its bool mask (CUDA's fused dropout); attn @ v
    # in fp32; the weights cast back (returned by the composite, dropped); the output cast to bf16;
    # and the caller's transpose(1, 2).reshape copies that [B, H, S, D] output once more
    bhsd2 = b * h * s * d * 2
    expected = Counter([bhsd4] * 9 + [bhss4] * 3 + [b * h * s * s, b * h * s * s * 2, bhsd2, bhsd2])
    assert fwd == expected


def test_fused_backends_keep_far_less_than_the_cpu():
    # the point of the rules: on the CPU, SDPA with dropout keeps the probabilities and mask
    b, h, s, d = 2, 4, 256, 64
    flash_fwd, _ = _allocations(A100, torch.bfloat16, b=b, h=h, s=s, d=d)
    math_fwd, _ = _allocations(V100, torch.bfloat16, b=b, h=h, s=s, d=d)
    assert sum(k * n for k, n in flash_fwd.items()) < b * h * s * s  # less than one byte per score
    assert sum(k * n for k, n in math_fwd.items()) > 3 * b * h * s * s * 4


def test_multihead_attention_slow_path_reaches_the_rules():
    # F.multi_head_attention_forward's own calls (softmax, dropout, SDPA) are invisible to a
    # TorchFunctionMode; the MHA rule runs torch's code with those names bound to the rules
    seen = []
    original = RULES.get(F.softmax)

    def spy(target, func, args, kwargs):
        seen.append(func)
        return func(*args, **kwargs)

    RULES[F.softmax] = spy
    try:
        with FakeTensorMode():
            mha = torch.nn.MultiheadAttention(32, 4, dropout=0.1, batch_first=True)
            x = torch.empty(2, 10, 32)
            with CudaKernelModel(CudaTarget(A100)):
                out, weights = mha(x, x, x)  # need_weights=True: bmm + softmax + dropout
        assert out.shape == (2, 10, 32) and weights.shape == (2, 10, 10)
        assert seen == [F.softmax]
    finally:
        if original is None:
            del RULES[F.softmax]
        else:
            RULES[F.softmax] = original


def test_multihead_attention_without_weights_runs_the_chosen_kernel():
    # need_weights=False calls SDPA: on an A100 in bf16 that is flash, whose fp32 logsumexp
    # [B, H, S] is allocated in the forward (the CPU would keep B*H*S*S probabilities instead)
    b, s, e, h = 2, 40, 64, 4  # sizes chosen so no other tensor has the probabilities' byte count
    gc.disable()
    try:
        with FakeTensorMode():
            mha = torch.nn.MultiheadAttention(e, h, dropout=0.1, batch_first=True, dtype=torch.bfloat16)
            x = torch.empty(b, s, e, dtype=torch.bfloat16, requires_grad=True)
            trace = Trace()
            with Recorder(trace), CudaKernelModel(CudaTarget(A100)):
                mha(x, x, x, need_weights=False)
        sizes = [n for _, n in trace.events if n > 0]
        assert b * h * s * 4 in sizes  # flash's softmax_lse
        assert b * h * s * s * 2 not in sizes and b * h * s * s * 4 not in sizes  # no probabilities
    finally:
        gc.enable()


def test_cudnn_bytes():
    # H100 with cuDNN 9.16: check_prefer_cudnn_attention puts cuDNN first; dropout 0.125 = 2/16 passes
    # check_cudnn_dropout. Forward: the output in the query's [B, S, H, D] memory layout (so the
    # caller's transpose(1, 2).reshape copies nothing), fp32 stats [B, H, S], int64 seed and offset;
    # backward: dq, dk, dv like q, k, v (_cudnn_attention_backward)
    b, h, s, d = 2, 4, 128, 64
    fwd, bwd = _allocations(H100, torch.bfloat16, b=b, h=h, s=s, d=d, dropout=0.125, cudnn=91600, cuda=(12, 8))
    bhsd = b * h * s * d * 2
    assert fwd == Counter([bhsd, b * h * s * 4, 8, 8])
    assert Counter([bhsd] * 3) - bwd == Counter()
    # run_cudnn_SDP_bprop's workspace (cudnn-frontend CompositeSDPABackwardNode): fp32 dQ_accum
    # [b, h, s, d] plus fp32 softmax_sum [b, h, s, 1], one caching-allocator block, after dq, dk, dv
    assert bwd[b * h * s * d * 4 + b * h * s * 4] == 1


def test_cudnn_backward_workspace_is_live_with_the_gradients():
    # the workspace is requested while dq, dk and dv exist: the backward's peak holds all four
    b, h, s, d = 2, 4, 128, 64
    gc.disable()
    try:
        with FakeTensorMode():
            q, k, v = (torch.empty(b, h, s, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
            trace = Trace()
            with Recorder(trace) as rec, CudaKernelModel(CudaTarget(H100, cuda_version=(12, 8), cudnn_version=91600)):
                for t in (q, k, v):
                    rec.register(t, "inputs")
                out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.125)
                grad = torch.empty_like(out)
                rec.register(grad, "inputs")
                start = len(trace.events)
                out.backward(grad)
        walk, peak = 0, 0
        for _, n in trace.events[start:]:
            walk += n
            peak = max(peak, walk)
        bhsd = b * h * s * d * 2
        assert peak >= 3 * bhsd + ca.cudnn_sdpa_backward_workspace_bytes(b, h, s, d)
    finally:
        gc.enable()


def test_cudnn_backward_copies_grad_out_by_the_cudnn_version():
    # run_cudnn_SDP_bprop: cuDNN < 9.5.1 needs dO with o's strides; from 9.5.1 only a non-unit
    # innermost stride forces the copy (permute_to_matching_layout)
    out = torch.empty(2, 4, 8, 16).transpose(1, 2).contiguous().transpose(1, 2)  # [B, S, H, D] memory
    same = torch.empty_strided(out.shape, out.stride())
    other_layout = torch.empty(2, 4, 8, 16)  # contiguous [B, H, S, D]: strides differ, innermost 1
    strided = torch.empty(2, 4, 16, 8).transpose(-1, -2)  # innermost stride 8
    assert not ca._cudnn_bprop_copies_grad(same, out, 90400)
    assert ca._cudnn_bprop_copies_grad(other_layout, out, 90400)
    assert not ca._cudnn_bprop_copies_grad(other_layout, out, 90501)
    assert ca._cudnn_bprop_copies_grad(strided, out, 90501)


def test_math_upcast_follows_the_torch_version():
    # bf16 on sm70 takes the math path (table above). torch >= 2.5 computes it in fp32: q, k, v are
    # upcast (three fp32 copies); a 2.4 target keeps bf16 throughout
    b, h, s, d = 1, 2, 48, 64  # sizes with distinct byte counts for [B, H, S, D] and [B, H, S, S]

    def math_fwd(version):
        gc.disable()
        try:
            with FakeTensorMode():
                q = torch.empty(b, h, s, d, dtype=torch.bfloat16, requires_grad=True)
                trace = Trace()
                with Recorder(trace) as rec, CudaKernelModel(CudaTarget(V100, version)):
                    rec.register(q, "inputs")
                    n0 = len(trace.events)
                    F.scaled_dot_product_attention(q, q, q)
            return Counter(n for _, n in trace.events[n0:] if n > 0)
        finally:
            gc.enable()

    new, old = math_fwd((2, 13)), math_fwd((2, 4))
    fp32, bf16 = b * h * s * d * 4, b * h * s * d * 2
    # 2.13: q, k, v upcast, q and k^T scaled, attn @ v: six fp32 [B, H, S, D]; bf16 output
    assert new[fp32] == 6 and new[bf16] == 1
    # 2.4: nothing in fp32; scaled q, scaled k^T, attn @ v in bf16 (the output cast is a no-op)
    assert fp32 not in old and b * h * s * s * 4 not in old
    assert old[bf16] == 3


def test_flash_gqa_backward_ignores_the_trace_modes():
    # GQA on flash: mha_bwd computes dk, dv for every query head ([B, S_k, H, D] each) and sums
    # them into [B, S_k, H_k, D]. Autograd runs the rule's backward while the trace's modes are
    # active (the CUDA autocast emulation, which would recast the sum); the rule must not see them.
    from torch.overrides import TorchFunctionMode

    used_by_the_rule = {torch.sum, torch.empty, torch.empty_like, torch.Tensor.contiguous, torch.Tensor.view}

    class Hostile(TorchFunctionMode):  # stands in for the autocast emulation
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in used_by_the_rule:
                raise AssertionError(f"a rule's backward reached a TorchFunctionMode with {func}")
            return func(*args, **(kwargs or {}))

    b, h, h_k, s, d = 2, 8, 2, 64, 64
    gc.disable()
    try:
        with FakeTensorMode():
            q = torch.empty(b, h, s, d, dtype=torch.bfloat16, requires_grad=True)
            k = torch.empty(b, h_k, s, d, dtype=torch.bfloat16, requires_grad=True)
            v = torch.empty(b, h_k, s, d, dtype=torch.bfloat16, requires_grad=True)
            trace = Trace()
            with Recorder(trace):
                with CudaKernelModel(CudaTarget(A100)):
                    out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, enable_gqa=True)
                grad = torch.empty_like(out)
                n0 = len(trace.events)
                from torch.autograd.variable import Variable

                with Hostile():  # engine call: Tensor.backward would itself go through the mode
                    Variable._execution_engine.run_backward((out,), (grad,), False, False, (), allow_unreachable=True,
                                                            accumulate_grad=True)
        bwd = Counter(n for _, n in trace.events[n0:] if n > 0)
        expanded = b * s * h * d * 2
        assert bwd[expanded] >= 3  # dq and the two expanded dk, dv (all [B, S, H, D] bf16)
        assert q.grad is not None and k.grad.shape == (b, h_k, s, d)
    finally:
        gc.enable()


def test_gqa_without_flash_keeps_the_math_path_probabilities():
    # A Qwen2.5-0.5B-like layer on a T4 (sm75: no flash): fp16, batch 4, seq 1024, 14 query heads,
    # 2 KV heads, head dim 64, causal, enable_gqa. Mem-efficient refuses GQA in torch <= 2.13
    # (sdp_utils.cpp), so the math composite runs and autograd keeps (MiB): the scaled fp32 q (14) and
    # the scaled, repeated fp32 k^T (14) for the first matmul, the fp32 probabilities [4, 14, 1024,
    # 1024] (224) and the repeated fp32 v (14) for the second, and the fp16 output (7): 273 MiB, where
    # the mem-efficient kernel with k and v repeated (memguard before) kept 21 MiB.
    b, h, h_k, s, d = 4, 14, 2, 1024, 64
    gc.disable()
    try:
        with FakeTensorMode():
            q = torch.empty(b, h, s, d, dtype=torch.float16, requires_grad=True)
            k = torch.empty(b, h_k, s, d, dtype=torch.float16, requires_grad=True)
            v = torch.empty(b, h_k, s, d, dtype=torch.float16, requires_grad=True)
            t4 = CudaTarget((7, 5))
            assert ca.select_sdpa_backend(t4, ca.SdpaCall(q, k, v, None, 0.0, True, True), settings=DEFAULT) == "math"
            trace = Trace()
            with Recorder(trace) as rec:
                for t in (q, k, v):
                    rec.register(t, "inputs")
                n0 = len(trace.events)
                with CudaKernelModel(t4):
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                kept = sum(n for _, n in trace.events[n0:])
        assert out.shape == (b, h, s, d)
        assert kept == (14 + 14 + 224 + 14 + 7) << 20
    finally:
        gc.enable()


def _sizes(fn, dtype, b=2, h=3, s=40, d=16):
    """Storage sizes ``fn(q, k, v)`` allocates on fake CPU tensors (q, k, v packed as in a block)."""
    gc.disable()
    try:
        with FakeTensorMode():
            x = torch.empty(b, s, 3 * h * d, dtype=dtype, requires_grad=True)
            q, k, v = x.view(b, s, 3, h, d).permute(2, 0, 3, 1, 4).unbind(0)
            trace = Trace()
            with Recorder(trace):
                fn(q, k, v)
        return Counter(n for _, n in trace.events if n > 0)
    finally:
        gc.enable()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_math_rule_allocates_what_the_installed_composite_does(dtype):
    # the math path is one composite on every device (_scaled_dot_product_attention_math); run the
    # installed torch's own on the CPU and compare: without dropout the sizes must agree exactly
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def torch_math(q, k, v, p=0.0):
        with sdpa_kernel(SDPBackend.MATH):
            F.scaled_dot_product_attention(q, k, v, dropout_p=p)

    def ours(q, k, v, p=0.0):
        ca._math_attention(q, k, v, None, p, False, None, False, upcast=True)

    assert _sizes(ours, dtype) == _sizes(torch_math, dtype)
    # with dropout the CPU keeps a mask in the compute dtype (fp32 here: 16-bit inputs are upcast),
    # CUDA's native_dropout a bool mask: exactly that one tensor differs
    b, h, s = 2, 3, 40
    cpu = _sizes(lambda q, k, v: torch_math(q, k, v, 0.1), dtype)
    cuda = _sizes(lambda q, k, v: ours(q, k, v, 0.1), dtype)
    assert cpu - cuda == Counter({b * h * s * s * 4: 1}) and cuda - cpu == Counter({b * h * s * s: 1})


MI300X = (9, 4)  # gfx942, as torch's ROCm build reports it


@pytest.mark.parametrize("cap, torch_version, mask, expected", [
    (MI300X, (2, 13), None, "flash"),  # AOTriton check_gpu accepts gfx942
    ((9, 0), (2, 13), None, "flash"),  # gfx90a (MI200)
    (MI300X, (2, 2), None, "math"),  # before torch 2.3's AOTriton flash
    ((11, 0), (2, 13), None, "math"),  # gfx1100: experimental in AOTriton, off by default
    (MI300X, (2, 13), FLOAT_MASK, "math"),  # a mask: flash takes none; ROCm's mem-efficient is not modelled
])
def test_rocm_flash_runs_on_aotriton_architectures(cap, torch_version, mask, expected):
    q, k, v = qkv()
    target = CudaTarget(cap, torch_version, vendor="amd")
    got = ca.select_sdpa_backend(target, ca.SdpaCall(q, k, v, mask, 0.1), settings=DEFAULT)
    assert got == expected


def test_rocm_flash_bytes_match_mha_all_aot():
    b, h, s, d = 2, 4, 100, 64
    fwd, bwd = _allocations(MI300X, torch.bfloat16, b=b, h=h, s=s, d=d, vendor="amd")
    bhsd = b * h * s * d * 2
    # forward as on CUDA: out [B, S, H, D], softmax_lse fp32 [B, H, S], the two RNG tensors
    assert fwd == Counter([bhsd, b * h * s * 4, 16, 8])
    # mha_bwd_aot: dq, dk, dv; softmax_d fp32 [B, H, S_q] and delta fp32 [B*H, S_q] (no rounding to
    # 128 rows, no dq_accum of CUDA's mha_bwd); autograd's stack and layout copy as on CUDA
    assert bwd == Counter([bhsd, bhsd, bhsd, b * h * s * 4, b * h * s * 4]) + Counter({3 * bhsd: 2})



# ---------------------------------------------------------------------------------------------
# selective activation checkpointing sees the fused ATen op (memguard/estimator/_cuda_sac.py)


def _sac_attention(save_ops, target=CudaTarget(A100), dtype=torch.bfloat16, b=2, h=4, s=100, d=64, end=False):
    """A checkpointed attention block (qkv projection, causal SDPA, output projection) under a
    selective checkpointing policy that saves the ops in ``save_ops`` and recomputes the rest
    (``save_ops=None``: plain checkpointing, no policy).

    Returns the ops the policy saw with their outputs, the storage sizes live after forward (the
    block's output and what the region saved) and those allocated in backward (with ``end``: those
    live after backward instead).
    """
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    seen = []

    def policy(ctx, func, *args, **kwargs):
        outs = ctx.op_output if isinstance(ctx.op_output, tuple) else (ctx.op_output,)
        # shapes and dtypes only: holding the outputs would keep them alive
        seen.append((func, [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t for t in outs]))
        return CheckpointPolicy.MUST_SAVE if func in save_ops else CheckpointPolicy.PREFER_RECOMPUTE

    def block(x, w_qkv, w_o):
        qkv = (x @ w_qkv).view(b, s, 3, h, d).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        return out.transpose(1, 2).reshape(b, s, h * d) @ w_o

    gc.disable()
    try:
        with FakeTensorMode():
            x = torch.empty(b, s, h * d, dtype=dtype, requires_grad=True)
            w_qkv = torch.empty(h * d, 3 * h * d, dtype=dtype, requires_grad=True)
            w_o = torch.empty(h * d, h * d, dtype=dtype, requires_grad=True)
            trace = Trace()
            rec = Recorder(trace)
            with rec:
                for t in (x, w_qkv, w_o):
                    rec.register(t, "inputs")
                start = len(trace.events)
                with CudaKernelModel(target):
                    extra = {} if save_ops is None else {
                        "context_fn": lambda: create_selective_checkpoint_contexts(policy)}
                    y = checkpoint(block, x, w_qkv, w_o, use_reentrant=False, preserve_rng_state=False, **extra)
                    mid = len(trace.events)
                    grad = torch.empty_like(y)
                    rec.register(grad, "inputs")
                    bstart = len(trace.events)
                    from torch.autograd.variable import Variable

                    # the engine itself (as the trace does): Tensor.backward would switch the kernel
                    # model off while it handles the call, and the recomputation would run CPU kernels
                    Variable._execution_engine.run_backward((y,), (grad,), False, False, (), allow_unreachable=True,
                                                            accumulate_grad=True)
            assert x.grad is not None and w_qkv.grad is not None
        live = Counter()
        for _, n in trace.events[start:mid]:
            live[abs(n)] += 1 if n > 0 else -1
        bwd = Counter(n for _, n in trace.events[bstart:] if n > 0)
        if end:
            for _, n in trace.events[bstart:]:
                live[abs(n)] += 1 if n > 0 else -1
            return seen, +live, None
        return seen, +live, bwd
    finally:
        gc.enable()


def test_sac_policy_sees_and_saves_the_flash_attention_op():
    b, h, s, d = 2, 4, 100, 64
    flash = torch.ops.aten._scaled_dot_product_flash_attention.default
    seen, live, bwd = _sac_attention({flash}, b=b, h=h, s=s, d=d)
    # on CUDA the policy sees one _scaled_dot_product_flash_attention call (attention.cpp, bf16 causal
    # on sm80), with its outputs (_scaled_dot_product_flash_attention_cuda): the attention output
    # [B, H, S, D] bf16 and the fp32 logsumexp [B, H, S]; not the kernel's own empty/empty_like calls
    funcs = [f for f, _ in seen]
    assert funcs.count(flash) == 1
    assert torch.ops.aten.empty_like.default not in funcs and torch.ops.aten.empty.memory_format not in funcs
    out = dict(seen)[flash]
    assert out[0] == ((b, h, s, d), torch.bfloat16) and out[1] == ((b, h, s), torch.float32)
    assert out[6] == ((2,), torch.uint64) and out[7] == ((), torch.uint64)  # philox seed, offset
    bhsd, lse = b * h * s * d * 2, b * h * s * 4
    # saved: the attention output, logsumexp, rng_state (uint64[2]) and the offset (uint64 scalar)
    # stay live after forward next to the block's output y ([B, S, H*D] bf16, the size of bhsd)
    assert live == Counter({bhsd: 2, lse: 1, 16: 1, 8: 1})
    # recomputation reruns the qkv projection but takes the attention outputs from the cache:
    # no logsumexp-sized buffer in backward (softmax_d is [B, H, 128] fp32: seqlen rounded to 128)
    assert bwd[lse] == 0 and bwd[b * h * 128 * 4] == 1


def test_sac_policy_that_saves_nothing_recomputes_flash_attention():
    b, h, s, d = 2, 4, 100, 64
    seen, live, bwd = _sac_attention(set(), b=b, h=h, s=s, d=d)
    assert [f for f, _ in seen].count(torch.ops.aten._scaled_dot_product_flash_attention.default) == 1
    bhsd, lse = b * h * s * d * 2, b * h * s * 4
    # only the block's output survives forward; backward recomputes the kernel: logsumexp again
    assert live == Counter({bhsd: 1})
    assert bwd[lse] == 1


@pytest.mark.parametrize(
    "target, dtype, op, saved",
    [
        # fp32 on sm80: flash takes fp16/bf16 only, the memory-efficient kernel takes the call; saved:
        # the output [B, S, H, D] fp32 (the size of the block's output y) and logsumexp [B, H, S
        # rounded to 32] (kAlignLSE); its philox seed and offset are CPU scalars (no device memory)
        (CudaTarget(A100), torch.float32, torch.ops.aten._scaled_dot_product_efficient_attention.default,
         {2 * 4 * 100 * 64 * 4: 2, 2 * 4 * 128 * 4: 1}),
        # H100 with cuDNN 9.16 puts cuDNN first (test_cudnn_bytes); saved: the output, fp32 stats
        # [B, H, S], int64 seed and offset
        (CudaTarget(H100, cuda_version=(12, 8), cudnn_version=91600), torch.bfloat16,
         torch.ops.aten._scaled_dot_product_cudnn_attention.default, {2 * 4 * 100 * 64 * 2: 2, 2 * 4 * 100 * 4: 1, 8: 2}),
    ],
)
def test_sac_policy_sees_the_other_fused_ops(target, dtype, op, saved):
    seen, live, _ = _sac_attention({op}, target=target, dtype=dtype)
    assert [f for f, _ in seen].count(op) == 1
    assert live == Counter(saved)


@pytest.mark.parametrize("save_ops", [None, {torch.ops.aten._scaled_dot_product_flash_attention.default}])
def test_checkpointed_flash_attention_frees_what_it_saved(save_ops):
    # after backward only the block's output and the gradients of x, w_qkv and w_o are left (the
    # gradient fed in is registered before the backward): the kernel's saved output and logsumexp,
    # recomputed or cached, are gone. Saving a view of the Function's own output would tie the saved
    # tensor to its node in a reference cycle that only the garbage collector (off in a trace) frees.
    b, h, s, d = 2, 4, 100, 64
    _, live, _ = _sac_attention(save_ops, b=b, h=h, s=s, d=d, end=True)
    bhsd = b * h * s * d * 2
    assert live == Counter({bhsd: 2, (h * d) * (3 * h * d) * 2: 1, (h * d) * (h * d) * 2: 1})


def test_cudnn_preference_can_be_turned_off(monkeypatch):
    # check_prefer_cudnn_attention: check_env("TORCH_CUDNN_SDPA_DEPRIORITIZED") != true; check_env
    # (c10/util/env.cpp) reads only "1" as true
    target = CudaTarget(H100, cuda_version=(13, 0), cudnn_version=92000)
    monkeypatch.delenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", raising=False)
    assert ca._prefer_cudnn(target, 92000, 13)
    monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "true")  # not "1": ignored, with a warning
    assert ca._prefer_cudnn(target, 92000, 13)
    monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")
    assert not ca._prefer_cudnn(target, 92000, 13)
