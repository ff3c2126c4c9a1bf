"""nn.MultiheadAttention under the CUDA autocast emulation: its nested ops are cast as real autocast casts them."""

import torch
import torch.nn.functional as F
from torch import nn

import memguard


class _MHA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(256, 4, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x, need_weights=False)[0]


class _ByHand(nn.Module):
    """The ops F.multi_head_attention_forward runs for need_weights=False, called at top level."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(256, 4, batch_first=True)

    def forward(self, x):
        # torch/nn/modules/activation.py (batch_first) and F.multi_head_attention_forward /
        # _in_projection_packed, need_weights=False, step by step
        a, h = self.attn, 4
        x = x.transpose(1, 0)
        n, b, e = x.shape
        proj = F.linear(x, a.in_proj_weight, a.in_proj_bias)
        proj = proj.unflatten(-1, (3, e)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
        q, k, v = proj[0], proj[1], proj[2]
        q, k, v = (t.view(n, b * h, e // h).transpose(0, 1).view(b, h, n, e // h) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v)
        out = out.permute(2, 0, 1, 3).contiguous().view(b * n, e)
        out = F.linear(out, a.out_proj.weight, a.out_proj.bias).view(n, b, e)
        return out.transpose(1, 0)


def _estimate(model, seen):
    def loss(m, batch):
        out = m(batch)
        seen.append(out.dtype)
        return out.float().sum()

    return memguard.estimate(model, torch.randn(8, 512, 256), loss_fn=loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                             device="cuda", gpu="A100-40GB", precision="16-mixed")


def test_multihead_attention_output_is_half_under_autocast():
    # real CUDA autocast casts the out-projection's linear (AT_FORALL_LOWER_PRECISION_FP in
    # ATen/autocast_mode.h), so the module returns float16; the emulation used to miss the ops
    # nested in F.multi_head_attention_forward and returned float32
    seen = []
    _estimate(_MHA(), seen)
    assert seen and seen[0] == torch.float16


def test_multihead_attention_costs_what_its_ops_cost():
    # the same ops at top level (seen by the emulation directly) and nested in the module must give
    # the same step; uncast, the nested SDPA got float32 inputs and took the math path, which keeps
    # the 8x4x512x512 float32 probabilities (~34 MB here, several times the flash path's tensors)
    nested = _estimate(_MHA(), [])
    by_hand = _estimate(_ByHand(), [])
    assert nested.allocated_peak_bytes == by_hand.allocated_peak_bytes


class _MHAWeights(nn.Module):
    """nn.MultiheadAttention as most callers use it: need_weights left at True (the default)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(256, 4, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x)[0]


class _WeightsByHand(nn.Module):
    """F.multi_head_attention_forward's need_weights=True path (torch 2.0 to 2.13), op by op at top level:
    bmm of the scaled queries and keys, softmax, bmm with the values, the out-projection, the
    per-head weights averaged (average_attn_weights=True) and returned."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(256, 4, batch_first=True)

    def forward(self, x):
        import math

        a, h = self.attn, 4
        x = x.transpose(1, 0)
        n, b, e = x.shape
        proj = F.linear(x, a.in_proj_weight, a.in_proj_bias)
        proj = proj.unflatten(-1, (3, e)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
        q, k, v = (t.view(n, b * h, e // h).transpose(0, 1) for t in (proj[0], proj[1], proj[2]))
        weights = torch.bmm(q * math.sqrt(1.0 / float(e // h)), k.transpose(-2, -1))
        weights = F.softmax(weights, dim=-1)
        out = torch.bmm(weights, v)
        out = out.transpose(0, 1).reshape(n * b, e)
        out = F.linear(out, a.out_proj.weight, a.out_proj.bias).view(n, b, e)
        weights.view(b, h, n, n).mean(dim=1)
        return out.transpose(1, 0)


def test_multihead_attention_with_weights_traces_under_autocast_and_costs_its_ops():
    # real CUDA autocast gives softmax a float32 result (FP32_SET_OPT_DTYPE) and casts it back to
    # float16 for the second bmm (LOWER_PRECISION_FP); the composite calls torch.bmm by attribute,
    # which the emulation did not see, so the trace failed with "expected scalar type float32 but
    # found float16". Now the module step equals the same ops written at top level
    seen: list = []
    nested = _estimate(_MHAWeights(), seen)
    by_hand = _estimate(_WeightsByHand(), [])
    assert seen[0] == torch.float16
    assert nested.allocated_peak_bytes == by_hand.allocated_peak_bytes
    # the float32 softmax output (8*4 x 512 x 512 x 4 B = 32 MiB) and its float16 copy for bmm's
    # backward (16 MiB) are both kept: the step keeps more than the SDPA (flash) path does
    flash = _estimate(_MHA(), [])
    assert nested.allocated_peak_bytes - flash.allocated_peak_bytes >= 48 * (1 << 20)
