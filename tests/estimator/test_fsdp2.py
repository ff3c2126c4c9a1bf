"""FSDP2 estimates: option checks, what the traced FSDP2 step holds, and a real 2-rank gloo run.

The estimate traces FSDP2 itself (``fully_shard`` per repeated block, then the root) over a fake
process group; these tests pin what that trace must contain and compare it with a real
``torch.distributed`` run of the same layout on CPU (gloo, 2 ranks, one process each).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

import memguard
from memguard.errors import ConfigError

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")


def _tiny_gpt2():
    cfg = transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=512, n_positions=64)
    with torch.device("meta"):
        return transformers.GPT2LMHeadModel(cfg)


def _batch(m=2, seq=32):
    ids = torch.zeros(m, seq, dtype=torch.long)
    return {"input_ids": ids, "labels": ids}


@pytest.fixture(scope="module")
def model():
    return _tiny_gpt2()


_ESTIMATES: dict = {}


def _fsdp2(model, **kwargs):
    """``memguard.estimate(strategy="fsdp2", device="cpu", world_size=2, ...)``, once per set of options
    (the tests share a handful of traces)."""
    kwargs = {"device": "cpu", "strategy": "fsdp2", "world_size": 2, "zero_stage": 3, **kwargs}
    key = tuple(sorted(kwargs.items()))
    if key not in _ESTIMATES:
        _ESTIMATES[key] = memguard.estimate(model, _batch(), **kwargs)
    return _ESTIMATES[key]


# ---------------------------------------------------------------------------------------------
# options
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, needles", [
    # not a strategy name, and a stage out of range: both reported at once
    (dict(strategy="fsdp", zero_stage=5), ["strategy='fsdp'", "zero_stage=5"]),
    # DDP does not shard or offload
    (dict(strategy="ddp", zero_stage=2, offload_optimizer=True), ["does not shard", "cannot offload"]),
    # DeepSpeed without ZeRO is DDP
    (dict(strategy="deepspeed", zero_stage=0), ["needs zero_stage 1, 2 or 3"]),
    # FSDP2's level 0 does not exist
    (dict(strategy="fsdp2", zero_stage=0, world_size=2), ["strategy='fsdp2' needs zero_stage 1, 2 or 3"]),
])
def test_invalid_strategy_options_are_listed_together(model, kwargs, needles):
    with pytest.raises(ConfigError) as info:
        memguard.estimate(model, _batch(), device="cpu", **kwargs)
    text = str(info.value)
    for needle in needles:
        assert needle in text, text
    assert len(info.value.problems) == len(needles)


def test_strategy_none_keeps_todays_meaning(model):
    # None with zero_stage >= 1 is DeepSpeed, exactly as strategy="deepspeed" (same numbers)
    a = memguard.estimate(model, _batch(), device="cpu", zero_stage=2, world_size=2)
    b = memguard.estimate(model, _batch(), device="cpu", zero_stage=2, world_size=2, strategy="deepspeed")
    assert a == b and a.strategy == "deepspeed"
    c = memguard.estimate(model, _batch(), device="cpu")
    assert c.strategy == "ddp"


# ---------------------------------------------------------------------------------------------
# what the FSDP2 trace holds
# ---------------------------------------------------------------------------------------------


def _padded_shard_bytes(model, world, elem):
    """Bytes of rank 0's padded shards: FSDP2 pads dim 0 to a multiple of the world size
    (torch/distributed/fsdp/_fully_shard/_fsdp_param.py, _init_sharded_param: padded_sharded_size)."""
    total = 0
    seen = set()
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        rows = -(-p.shape[0] // world) if p.dim() else 1
        total += rows * (p[0].numel() if p.dim() else 1) * elem
    return total


def _rank0_adam_bytes(model, world):
    """AdamW's state on rank 0: two fp32 moments of its unpadded shard (rank 0 holds the first
    torch.chunk of dim 0: ceil(rows / world) rows) and a 4-byte scalar ``step`` per parameter
    (torch/optim/adam.py, _init_group)."""
    total = 0
    seen = set()
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        rows = min(-(-p.shape[0] // world), p.shape[0])
        total += 2 * rows * (p[0].numel() if p.dim() > 1 else 1) * 4 + 4
    return total


@pytest.mark.parametrize("world", [2, 4])
def test_rank_holds_padded_fp32_shards_and_sharded_adam_state(model, world):
    est = _fsdp2(model, world_size=world)
    assert est.breakdown["optimizer"] == _rank0_adam_bytes(model, world)
    # the rank's fp32 shards (padded storage), plus any group unsharded at the peak
    assert est.breakdown["params"] >= _padded_shard_bytes(model, world, 4)
    assert "MixedPrecisionPolicy" in " ".join(est.notes) and est.strategy == "fsdp2"


def test_mixed_precision_policy_is_not_deepspeeds_16_bit_weights(model):
    # FSDP2 keeps fp32 shards under bf16-mixed (the policy casts at all-gather); DeepSpeed's stand-in
    # keeps 16-bit weights and a separate fp32 master copy in the optimizer's share
    f = _fsdp2(model, precision="bf16-mixed")
    f32 = _fsdp2(model)
    # the optimizer state is fp32 either way (the same sharded fp32 parameters)
    assert f.breakdown["optimizer"] == f32.breakdown["optimizer"]
    # and the forward runs in bf16: fewer activation bytes than fp32
    assert f.breakdown.get("activations", 0) < f32.breakdown.get("activations", 0)


def test_level_2_keeps_blocks_unsharded_after_forward(model):
    # reshard_after_forward=False keeps every block's unsharded parameters from forward to backward:
    # the peak holds more parameter bytes than level 3, which frees each block after its forward
    r3 = _fsdp2(model)
    r2 = _fsdp2(model, zero_stage=2)
    assert r2.peak_bytes > r3.peak_bytes
    assert r2.breakdown["params"] > r3.breakdown["params"]


def test_level_1_accumulates_unsharded_gradients(model):
    # under accumulation level 1 (no gradient sync before the last micro-batch) holds full-size fp32
    # gradients; level 2 holds only the sharded ones
    l1 = _fsdp2(model, zero_stage=1, grad_accum_steps=2)
    l2 = _fsdp2(model, zero_stage=2, grad_accum_steps=2)
    full = sum(p.numel() for p in model.parameters()) * 4
    assert l1.breakdown["grads"] >= full
    assert l2.breakdown["grads"] < full


def test_cpu_offload_moves_sharded_states_off_the_device(model):
    on = _fsdp2(model)
    off = _fsdp2(model, offload_optimizer=True)
    assert off.breakdown.get("optimizer", 0) == 0 and on.breakdown["optimizer"] > 0
    assert off.peak_bytes < on.peak_bytes


def test_fsdp2_estimate_leaves_no_process_group_behind(model):
    _fsdp2(model)
    assert not torch.distributed.is_initialized()


# ---------------------------------------------------------------------------------------------
# a real 2-rank gloo run
# ---------------------------------------------------------------------------------------------


def test_real_two_rank_gloo_run_matches_the_estimate():
    # benchmarks/fsdp2_cpu.py runs the same layout for real on 2 gloo ranks and measures every rank's
    # live tensor bytes with the profiler; the estimate traces that step, so it must agree within 3%
    from benchmarks.fsdp2_cpu import Case, estimate_case, run_case

    case = Case("gpt2", 2, "32-true", 3, False, batch=2, seq=32)
    for _ in range(3):
        ranks = run_case(case, steps=2, timeout=200)
        assert all("peak_bytes" in r for r in ranks), ranks
        # a rank whose profiler replay does not close missed a free gloo made on its own thread (see
        # benchmarks/fsdp2_cpu.py, summarise): its level is inflated from there on, so it is left out
        closed = [r for r in ranks if r["residual_bytes"] == 0] or ranks
        peaks = [r["peak_bytes"] for r in closed]
        # both ranks hold even shards, so the same bytes: ranks that disagree mean a free the replay did not see
        # (one such run in CI read rank 0 5% above rank 1, which equalled the estimate); measure again
        if max(peaks) - min(peaks) <= 0.005 * max(peaks):
            break
    real = max(peaks)
    est = estimate_case(case)["peak_bytes"]
    assert abs(est - real) <= 0.03 * real, (est, real, ranks)


def test_estimating_inside_a_running_job_leaves_its_process_group_as_it_was() -> None:
    # memguard.prepare(..., strategy="fsdp2") plans on the first step, when the job's process group exists:
    # the fake group the trace shards over must be set aside afterwards, and the job's group must still work.
    import socket

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        job, names = c10d._world.default_pg, dict(c10d._pg_names)
        model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
        est = memguard.estimate(model, torch.randn(8, 16), loss_fn=lambda m, b: m(b).sum(), device="cpu",
                                strategy="fsdp2", zero_stage=3, world_size=4)
        assert est.peak_bytes > 0 and est.strategy == "fsdp2"
        assert c10d._world.default_pg is job and dict(c10d._pg_names) == names and dist.get_world_size() == 1
        t = torch.ones(3)
        dist.all_reduce(t)  # the job's group still runs collectives
        assert t.tolist() == [1.0, 1.0, 1.0]
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# the streams FSDP2 allocates on (CUDA target)
# ---------------------------------------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.a = nn.Linear(d, 4 * d, bias=False)
        self.b = nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        return x + self.b(torch.relu(self.a(x)))


class _Stack(nn.Module):
    def __init__(self, d=256, n=3, vocab=1000):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(_Block(d) for _ in range(n))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def test_fsdp2_buffers_carry_the_streams_fsdp2_allocates_them_on(monkeypatch):
    # torch 2.13, torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py: foreach_all_gather makes the
    # all-gather output (all_gather_copy_in: every rank's padded shards in param_dtype) on the copy-in
    # stream (get_all_gather_streams: forward and pre-backward unshards use the separate streams);
    # foreach_reduce makes the reduce-scatter input on the current stream and its output, which the
    # sharded gradients view, on the reduce-scatter stream, in reduce_dtype (fp32)
    from memguard.estimator import _fsdp2_trace
    from memguard.estimator._cuda import simulate

    traces = []
    real = _fsdp2_trace.trace_fsdp2_step

    def keep(*args, **kwargs):
        traces.append(real(*args, **kwargs))
        return traces[-1]

    monkeypatch.setattr(_fsdp2_trace, "trace_fsdp2_step", keep)
    d, n, vocab, world = 256, 3, 1000, 4
    with torch.device("meta"):
        model = _Stack(d, n, vocab)
    batch = torch.zeros(2, 128, dtype=torch.long)
    est = memguard.estimate(model, (batch,), loss_fn=lambda m, b: m(b[0]).float().mean(), precision="bf16-mixed",
                            strategy="fsdp2", world_size=world, zero_stage=3, gpu="H100-80GB")
    trace = traces[-1]
    block_numel = 2 * d * 4 * d  # each dim 0 (1024 and 256) divides by 4: no padding
    root_numel = 2 * vocab * d  # the root group: embedding and head
    by_stream: dict = {}
    for h, sid in trace.streams.items():
        by_stream.setdefault(sid, []).append(trace.sizes[h])
    assert len(by_stream) == 2
    gathers, reduces = sorted(by_stream.values(), key=len, reverse=True)
    # reduce-scatter stream: one output per group and backward, numel / world fp32
    assert sorted(reduces) == sorted([root_numel // world * 4] + [block_numel // world * 4] * n)
    # copy-in stream: each block's all-gather output (bf16, all ranks) in forward and again in backward
    # (reshard_after_forward=True), the root's at least in forward
    assert gathers.count(block_numel * 2) == 2 * n and gathers.count(root_numel * 2) >= 1
    # the reduce-scatter input (fp32, world x the shard) stays on the default stream
    untagged = [trace.sizes[h] for h in range(len(trace.sizes)) if h not in trace.streams]
    assert untagged.count(block_numel * 4) >= n
    # the estimate prices the side streams from their own blocks: more reserved than one shared pool
    events = [(h, b) for h, b in trace.events if b]
    assert simulate(events, streams=trace.streams).peak_reserved > simulate(events).peak_reserved
    assert est.peak_bytes > 0
