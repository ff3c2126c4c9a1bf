"""Porting a nanoGPT-style training loop to memguard: the loop before, the loop after, the same weights.

The loop is nanoGPT's ``train.py`` (karpathy/nanoGPT), cut to what memguard changes: gradient
accumulation over micro-steps, a ``GradScaler`` for float16, gradient clipping, a learning-rate
schedule and an evaluation every ``eval_interval`` iterations. :func:`train_before` is that loop;
:func:`train_after` is the same script with memguard (lines marked ``# memguard``):

* the 23-line micro-step block (autocast, loss / accumulation, backward through the scaler,
  ``unscale_``, ``clip_grad_norm_``, ``scaler.step``, ``update``, ``zero_grad``) becomes one
  ``memguard.step`` call on the optimizer step's *whole* batch (``batch_size *
  gradient_accumulation_steps`` samples): memguard splits it into micro-batches, weights each loss
  by its share of samples, clips once on the accumulated gradient (unscaled first) and steps;
* the clipping threshold and the GradScaler go to ``memguard.prepare`` (``max_grad_norm=``,
  ``grad_scaler=``), and the precision the script chose (``dtype``) is passed as ``precision=``, so
  memguard keeps it instead of choosing one;
* the learning-rate schedule and the evaluation stay as they are: the model and the optimizer are
  the same objects.

With ``micro_batch_size=batch_size`` memguard runs the original's micro-steps and the weights are
the original loop's, bit for bit. With ``budget_bytes`` memguard plans the micro-batch for the
budget on the first step (and halves it on an out-of-memory error); the gradient is the whole
batch's either way, summed in another grouping, so the weights equal the original's to float
rounding. ``python examples/port_nanogpt.py [float16]`` trains the three loops for a few
iterations on a CPU and prints the largest weight differences.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
from torch import nn
from torch.nn import functional as F

import memguard  # memguard

# nanoGPT's configuration, small enough for a CPU
block_size, vocab_size, n_layer, n_head, n_embd = 32, 65, 2, 2, 32
batch_size, gradient_accumulation_steps = 4, 4
max_iters, eval_interval, eval_iters = 6, 3, 2
learning_rate, warmup_iters, min_lr, grad_clip = 1e-3, 2, 1e-4, 1.0


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(n_embd, dim=2)
        q, k, v = (t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.c_proj(y)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block() for _ in range(n_layer))
        self.ln_f, self.lm_head = nn.LayerNorm(n_embd), nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def get_lr(it: int) -> float:
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    ratio = (it - warmup_iters) / (max_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


def _setup(dtype: str):
    torch.manual_seed(1337)
    data = {"train": torch.randint(0, vocab_size, (4096,)), "val": torch.randint(0, vocab_size, (1024,))}
    # one random stream for training batches and one for evaluation, so both loops see the same samples
    streams = {"train": torch.Generator().manual_seed(42), "eval": torch.Generator().manual_seed(43)}

    def get_batch(split: str, n: int = batch_size, stream: str = "train"):
        ix = torch.randint(len(data[split]) - block_size, (n,), generator=streams[stream])
        x = torch.stack([data[split][i:i + block_size] for i in ix])
        y = torch.stack([data[split][i + 1:i + 1 + block_size] for i in ix])
        return x, y

    model = GPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=(dtype == "float16"))
    ctx = nullcontext() if dtype == "float32" else torch.autocast("cpu", dtype=getattr(torch, dtype))
    return model, optimizer, scaler, ctx, get_batch


def _estimate_loss(model: nn.Module, ctx, get_batch) -> dict[str, float]:
    out = {}
    model.eval()
    with torch.no_grad():
        for split in ("train", "val"):
            losses = torch.zeros(eval_iters)
            for k in range(eval_iters):
                X, Y = get_batch(split, stream="eval")
                with ctx:
                    _, loss = model(X, Y)
                losses[k] = loss.item()
            out[split] = losses.mean().item()
    model.train()
    return out


def train_before(dtype: str = "float32") -> nn.Module:
    """nanoGPT's loop (train.py), single process."""
    model, optimizer, scaler, ctx, get_batch = _setup(dtype)
    X, Y = get_batch("train")
    for iter_num in range(max_iters):
        for param_group in optimizer.param_groups:
            param_group["lr"] = get_lr(iter_num)
        if iter_num % eval_interval == 0:
            losses = _estimate_loss(model, ctx, get_batch)
            print(f"before: step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        for micro_step in range(gradient_accumulation_steps):
            with ctx:
                logits, loss = model(X, Y)
                loss = loss / gradient_accumulation_steps
            X, Y = get_batch("train")
            scaler.scale(loss).backward()
        if grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return model


def loss_fn(model: nn.Module, batch) -> torch.Tensor:  # memguard: the loss of one micro-batch
    X, Y = batch
    return model(X, Y)[1]


def train_after(dtype: str = "float32", **plan_options) -> nn.Module:
    """The same loop with memguard: one ``memguard.step`` per iteration on the iteration's whole batch."""
    model, optimizer, scaler, ctx, get_batch = _setup(dtype)
    precision = {"float32": "32-true", "bfloat16": "bf16-mixed", "float16": "16-mixed"}[dtype]  # memguard
    model, optimizer = memguard.prepare(  # memguard
        model, optimizer, precision=precision, max_grad_norm=grad_clip, loss_fn=loss_fn,
        grad_scaler=scaler if dtype == "float16" else None, **plan_options)
    X, Y = get_batch("train", batch_size * gradient_accumulation_steps)  # memguard: the whole step's batch
    for iter_num in range(max_iters):
        for param_group in optimizer.param_groups:
            param_group["lr"] = get_lr(iter_num)
        if iter_num % eval_interval == 0:
            losses = _estimate_loss(model, ctx, get_batch)
            print(f"after:  step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        memguard.step(model, optimizer, (X, Y))  # memguard: micro-steps, scaler, clipping, step, zero_grad
        X, Y = get_batch("train", batch_size * gradient_accumulation_steps)  # memguard
    return model


def max_difference(a: nn.Module, b: nn.Module) -> float:
    """The largest absolute difference between two models' weights."""
    return max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def main(dtype: str = "float32") -> tuple[float, float]:
    before = train_before(dtype)
    # memguard with the original's micro-batch: the same sums in the same order, so the same weights
    same = train_after(dtype, micro_batch_size=batch_size)
    # memguard planning the micro-batch for a 1.5 MiB budget (8 x 2 and checkpointing in 32-true): the
    # gradient is the whole batch's, summed in another grouping, so the weights differ by float rounding,
    # which AdamW magnifies where a gradient is near zero (about 1e-5 after six steps)
    planned = train_after(dtype, device="cpu", budget_bytes=3 << 19)
    diffs = max_difference(before, same), max_difference(before, planned)
    print(f"max weight difference ({dtype}): {diffs[0]:.3g} at micro-batch {batch_size}, "
          f"{diffs[1]:.3g} as planned for 1.5 MiB")
    return diffs


if __name__ == "__main__":
    import sys

    main(*sys.argv[1:])
