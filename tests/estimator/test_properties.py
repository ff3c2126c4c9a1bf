"""Property tests of ``memguard.estimate`` (hypothesis; see FEW below for the example budget).

* more samples or longer sequences never need less memory;
* activation checkpointing never increases activations;
* a higher ZeRO stage never increases per-rank bytes (where DeepSpeed's own formulas agree;
  see ``test_zero_stages`` for the two exceptions those formulas imply);
* the estimate leaves the model, its gradients and the global RNG state untouched.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import memguard

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

PRECISIONS = ["32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true"]
# Budget: every example runs 2-8 traced estimates (0.3-2 s each on a laptop-class CPU), so the
# default run draws 12 examples per property (8 for the GPT-2 one), a fixed sample
# (derandomize) so that a failure reproduces in CI; MEMGUARD_THOROUGH=1 draws 200 random ones.
_THOROUGH = os.environ.get("MEMGUARD_THOROUGH") == "1"
FEW = settings(max_examples=200 if _THOROUGH else 12, deadline=None, derandomize=not _THOROUGH, database=None)
FEWER = settings(max_examples=200 if _THOROUGH else 8, deadline=None, derandomize=not _THOROUGH, database=None)


class Block(nn.Module):
    def __init__(self, dim: int, p: float) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return x + self.drop(self.down(F.gelu(self.up(x))))


class MLP(nn.Module):
    """Residual MLP with ``blocks`` identical blocks; every block holds less than half of Ψ."""

    def __init__(self, dim: int = 32, blocks: int = 3, p: float = 0.1) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(Block(dim, p) for _ in range(blocks))
        self.head = nn.Linear(dim, 1)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h).pow(2).mean()


def mlp(device: str = "meta", **kwargs) -> MLP:
    with torch.device(device):
        return MLP(**kwargs)


_GPT2 = None


def gpt2():
    """A tiny GPT-2 on meta (built once; estimates never change it)."""
    global _GPT2
    if _GPT2 is None:
        cfg = transformers.GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=1, n_head=2)
        with torch.device("meta"):
            _GPT2 = transformers.GPT2LMHeadModel(cfg)
    return _GPT2


def tokens(batch: int, seq: int) -> dict[str, torch.Tensor]:
    ids = torch.zeros(batch, seq, dtype=torch.long)
    return {"input_ids": ids, "labels": ids}


@FEW
@given(
    sizes=st.lists(st.integers(1, 96), min_size=2, max_size=2, unique=True).map(sorted),
    device=st.sampled_from(["cpu", "cuda"]),
    precision=st.sampled_from(PRECISIONS),
)
def test_monotone_in_micro_batch(sizes, device, precision):
    small, large = (memguard.estimate(mlp(), torch.zeros(b, 32), device=device, precision=precision) for b in sizes)
    assert small.peak_bytes <= large.peak_bytes
    assert small.allocated_peak_bytes <= large.allocated_peak_bytes
    assert small.breakdown.get("activations", 0) <= large.breakdown.get("activations", 0) or (
        small.peak_phase != large.peak_phase)  # the peak may move to where fewer activations live


@FEWER
@given(
    seqs=st.lists(st.integers(4, 64), min_size=2, max_size=2, unique=True).map(sorted),
    batch=st.integers(1, 3),
    device=st.sampled_from(["cpu", "cuda"]),
)
def test_monotone_in_sequence_length(seqs, batch, device):
    short, long = (memguard.estimate(gpt2(), tokens(batch, s), device=device, precision="bf16-mixed") for s in seqs)
    assert short.peak_bytes <= long.peak_bytes
    assert short.allocated_peak_bytes <= long.allocated_peak_bytes
    assert short.phase_peaks["forward"] <= long.phase_peaks["forward"]


@FEW
@given(
    batch=st.integers(1, 256),
    blocks=st.integers(2, 4),
    device=st.sampled_from(["cpu", "cuda"]),
    precision=st.sampled_from(["32-true", "bf16-mixed"]),
    data=st.data(),
)
def test_checkpointing_never_increases_activations(batch, blocks, device, precision, data):
    model, x = mlp(blocks=blocks), torch.zeros(batch, 32)
    k = data.draw(st.integers(1, blocks), label="checkpointed blocks")
    plain = memguard.estimate(model, x, device=device, precision=precision)
    some = memguard.estimate(model, x, device=device, precision=precision, activation_checkpointing=k)
    every = memguard.estimate(model, x, device=device, precision=precision, activation_checkpointing=True)
    assert some.activation_checkpointing == k and every.activation_checkpointing == blocks
    # what forward keeps for backward (the forward phase's peak) shrinks as more blocks are checkpointed
    assert every.phase_peaks["forward"] <= some.phase_peaks["forward"] <= plain.phase_peaks["forward"]
    assert every.allocated_peak_bytes <= plain.allocated_peak_bytes


@FEW
@given(
    world_size=st.integers(1, 16),
    precision=st.sampled_from(PRECISIONS),
    batch=st.integers(1, 64),
    device=st.sampled_from(["cpu", "cuda"]),
)
def test_zero_stages(world_size, precision, batch, device):
    """Per-rank model states shrink from ZeRO-1 to ZeRO-2 on two or more ranks (ZeRO-2 partitions the
    gradients ZeRO-1 keeps whole), and ZeRO-1 holds less than DDP from four ranks on. Not more: real
    engines (benchmarks/results/deepspeed_cpu.md) keep an fp32 master partition even in fp32, so on one
    or two ranks ZeRO-1 can exceed plain training (stage 1 adds 4Ψ + 16Ψ/N in bf16-true against plain
    bf16's 10Ψ with DDP's buckets), and ZeRO-3 gathers the whole model under DeepSpeed's default
    stage3_max_reuse_distance, so its peak can exceed ZeRO-2's (measured: 66.4 vs 60.3 MiB on 2 ranks)."""
    model, x = mlp(), torch.zeros(batch, 32)
    est = [memguard.estimate(model, x, device=device, precision=precision, zero_stage=s, world_size=world_size)
           for s in range(4)]
    states = [e.model_state_bytes for e in est]
    if world_size >= 2:
        assert states[2] <= states[1], states
    if world_size >= 4:
        assert states[1] <= states[0], states


@FEW
@given(
    world_size=st.integers(1, 8),
    stage=st.integers(0, 3),
    precision=st.sampled_from(PRECISIONS),
)
def test_more_ranks_never_need_more_per_rank_memory_with_zero(world_size, stage, precision):
    model, x = mlp(), torch.zeros(4, 32)
    here = memguard.estimate(model, x, device="cpu", precision=precision, zero_stage=stage, world_size=world_size)
    more = memguard.estimate(model, x, device="cpu", precision=precision, zero_stage=stage, world_size=world_size + 1)
    if stage == 0 and world_size == 1:
        assert more.peak_bytes >= here.peak_bytes  # DDP's gradient buckets appear at 2 ranks
    else:
        assert more.peak_bytes <= here.peak_bytes


@FEW
@given(
    seed=st.integers(0, 2**31 - 1),
    p=st.sampled_from([0.0, 0.1, 0.5]),
    batch=st.integers(1, 32),
    device=st.sampled_from(["cpu", "cuda"]),
    precision=st.sampled_from(PRECISIONS),
    train=st.booleans(),
    ckpt=st.booleans(),
)
def test_model_and_rng_are_untouched(seed, p, batch, device, precision, train, ckpt):
    torch.manual_seed(seed)
    model = mlp("cpu", p=p).train(train)
    params = [(q, q.data_ptr(), q.detach().clone(), q.requires_grad) for q in model.parameters()]
    x = torch.randn(batch, 32)
    rng = torch.get_rng_state()
    first = memguard.estimate(model, x, device=device, precision=precision, activation_checkpointing=ckpt)
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.training is train
    assert all(m.training is train for m in model.modules())
    for (q, ptr, values, requires_grad), now in zip(params, model.parameters()):
        assert now is q and q.data_ptr() == ptr and torch.equal(q.detach(), values)
        assert q.grad is None and q.requires_grad is requires_grad
    # and it is deterministic: the same question gives the same answer
    assert memguard.estimate(model, x, device=device, precision=precision, activation_checkpointing=ckpt) == first
