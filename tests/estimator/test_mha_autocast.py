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
