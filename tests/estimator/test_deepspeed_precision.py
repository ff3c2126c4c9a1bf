"""DeepSpeed ZeRO: module buffers, bf16 master weights and optimizer states, ``torch_autocast``.

Expected values follow DeepSpeed 0.19.8, cited where each is decided: buffers are never
partitioned and keep the dtype they were loaded in unless ``data_types.buffer_dtype`` is set
(``engine.py`` ``_cast_module_mixed_precision``; ``runtime/keep_in_fp32.py``); with
``bf16_master_weights_and_grads`` + ``bf16_optimizer_states`` the master partition is a bf16 clone and
Adam's two moments follow it (``base_optimizer.py`` ``_configure_master_weights``); ``torch_autocast``
keeps fp32 weights and one reduce bucket per communication dtype (``stage_1_and_2.py`` ``ipg_buckets``).
Single-process estimates, except the one real 2-rank engine at the end (slow).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memguard
from memguard.errors import ConfigError
from memguard.estimator._deepspeed_config import read_deepspeed_config

MIB = 1 << 20
N = 2  # ranks
BUFFER = 64 * MIB  # a 64 MiB fp32 buffer (16 Mi elements)


class Buffered(nn.Module):
    """The issue's model: a Linear(1024, 1024) and a large registered buffer the forward never reads."""

    def __init__(self, buffer_dtype=torch.float32, buffer_bytes=BUFFER):
        super().__init__()
        self.lin = nn.Linear(1024, 1024)
        itemsize = torch.empty((), dtype=buffer_dtype).element_size()
        self.register_buffer("table", torch.zeros(buffer_bytes // itemsize, dtype=buffer_dtype))

    def forward(self, x):
        return self.lin(x).float().pow(2).mean()


class Block(nn.Module):
    """Linear + LayerNorm (two communication dtypes under torch_autocast)."""

    def __init__(self, norm=True):
        super().__init__()
        self.lin = nn.Linear(256, 256)
        self.norm = nn.LayerNorm(256) if norm else nn.Identity()

    def forward(self, x):
        return self.norm(self.lin(x)).float().pow(2).mean()


def loss_fn(model, batch):
    return model(batch)


def build(cls, *args, **kw):
    with torch.device("meta"):
        return cls(*args, **kw)


def config(stage, **blocks):
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": stage}}
    cfg.update(blocks)
    return cfg


def estimate(model, cfg=None, **kw):
    x = torch.randn(4, next(model.parameters()).shape[-1], device="meta")
    if cfg is not None:
        kw["deepspeed_config"] = cfg
    return memguard.estimate(model, x, device="cpu", world_size=N, loss_fn=loss_fn, **kw)


# ------------------------------------------------------------------------------------------- buffers


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_buffers_are_whole_on_every_rank(stage):
    # the same Linear with and without the buffer: the buffer is never partitioned and, loaded in fp32,
    # stays fp32 under bf16 (buffer_dtype unset), so every moment of the step holds exactly 64 MiB more
    with_buffer = estimate(build(Buffered), zero_stage=stage, precision="bf16-mixed")
    without = estimate(build(Buffered, buffer_bytes=0), zero_stage=stage, precision="bf16-mixed")
    assert with_buffer.peak_bytes - without.peak_bytes == BUFFER
    assert with_buffer.breakdown["params"] - without.breakdown["params"] == BUFFER
    # the optimizer step is the parameters' alone: the buffer is no "largest parameter" of it
    assert with_buffer.breakdown["temporaries"] == without.breakdown["temporaries"]


@pytest.mark.parametrize("stage", [1, 3])
def test_buffer_dtype_and_keep_in_fp32_modules(stage):
    bf16 = {"enabled": True}
    base = estimate(build(Buffered, buffer_bytes=0), config(stage, bf16=bf16)).peak_bytes
    # data_types.buffer_dtype casts every floating buffer: 64 MiB of fp32 become 32 MiB of bf16
    cast = estimate(build(Buffered), config(stage, bf16=bf16, data_types={"buffer_dtype": "bf16"}))
    assert cast.peak_bytes - base == BUFFER // 2
    # a buffer named in keep_in_fp32_modules is left out of that cast (and kept fp32)
    kept = estimate(build(Buffered), config(stage, bf16=bf16, data_types={"buffer_dtype": "bf16",
                                                                          "keep_in_fp32_modules": ["table"]}))
    assert kept.peak_bytes - base == BUFFER
    # ... and upcast to fp32 where it was loaded in bf16 (keep_buffers_in_fp32: buf.data.float())
    loaded_bf16 = build(Buffered, buffer_dtype=torch.bfloat16, buffer_bytes=BUFFER // 2)
    assert estimate(loaded_bf16, config(stage, bf16=bf16)).peak_bytes - base == BUFFER // 2  # left as loaded
    upcast = estimate(loaded_bf16, config(stage, bf16=bf16, data_types={"keep_in_fp32_modules": ["tab*"]}))
    assert upcast.peak_bytes - base == BUFFER


def test_keep_in_fp32_auto_reads_the_models_strict_list():
    # "auto": the model's _keep_in_fp32_modules_strict (bf16 and fp16); _keep_in_fp32_modules only under fp16
    class Strict(Buffered):
        _keep_in_fp32_modules_strict = ["table"]

    class Loose(Buffered):
        _keep_in_fp32_modules = ["table"]

    kw = dict(model=None, batch_size=4)
    for cls, block, fp32 in ((Strict, "bf16", True), (Loose, "bf16", False), (Loose, "fp16", True)):
        model = build(cls, buffer_dtype=torch.bfloat16, buffer_bytes=BUFFER // 2)
        kw["model"] = model
        ds = read_deepspeed_config(config(2, **{block: {"enabled": True}}), **kw)
        assert ds.zero_precision.buffer_bytes == (BUFFER if fp32 else None)  # None: as loaded


# -------------------------------------------------------------------------- bf16 masters and states


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_masters_and_states_take_6_bytes_per_sharded_element(stage):
    model = build(Block)
    psi = sum(p.numel() for p in model.parameters())
    mixed = estimate(model, config(stage, bf16={"enabled": True}))
    true = estimate(model, config(stage, bf16={"enabled": True, "bf16_master_weights_and_grads": True,
                                               "bf16_optimizer_states": True}))
    assert (mixed.precision, true.precision) == ("bf16-mixed", "bf16-true")
    # fp32 master 4 + Adam's two fp32 moments 8 per element of the rank's partition; bf16: 2 + 2 x 2
    assert mixed.breakdown["optimizer"] == pytest.approx(12 * psi / N, abs=64)
    assert true.breakdown["optimizer"] == pytest.approx(6 * psi / N, abs=64)
    assert true.peak_bytes < mixed.peak_bytes
    # the same with the keywords (to_config's mapping of precision="bf16-true")
    kw = estimate(model, zero_stage=stage, precision="bf16-true")
    assert kw.breakdown["optimizer"] == true.breakdown["optimizer"]


@pytest.mark.parametrize("bf16, offload, message", [
    ({"enabled": True, "bf16_master_weights_and_grads": True}, False, "needs ZeRO-Offload with DeepSpeedCPUAdam"),
    ({"enabled": True, "bf16_optimizer_states": True}, False, "needs bf16.bf16_master_weights_and_grads"),
    ({"enabled": False, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}, False,
     "bf16.enabled is not"),
])
def test_master_weight_flags_deepspeed_refuses(bf16, offload, message):
    cfg = config(2, bf16=bf16)
    with pytest.raises(ConfigError, match=message):
        read_deepspeed_config(cfg, model=build(Block), batch_size=4)


def test_bf16_masters_alone_with_offload_say_where_they_are():
    cfg = config(2, bf16={"enabled": True, "bf16_master_weights_and_grads": True})
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    ds = read_deepspeed_config(cfg, model=build(Block), batch_size=4)
    # the masters live on the host with DeepSpeedCPUAdam: the device holds what bf16-mixed offload holds
    assert (ds.precision, ds.offload_optimizer, ds.zero_precision.master_bytes) == ("bf16-mixed", True, 4)
    est = estimate(build(Block), cfg)
    assert any("bf16_master_weights_and_grads" in n for n in est.notes)


# ---------------------------------------------------------------------------------- torch_autocast


def test_torch_autocast_alone_is_fp32_weights_under_autocast():
    model = build(Block)
    psi = sum(p.numel() for p in model.parameters())
    cfg = config(2, torch_autocast={"enabled": True, "dtype": "bfloat16"})
    ds = read_deepspeed_config(cfg, model=model, batch_size=4)
    # Linear's parameters communicate in bf16, LayerNorm's in their own fp32 (init_autocast_params)
    zp = ds.zero_precision
    assert (ds.precision, zp.autocast, zp.comm_dtype_bytes) == ("bf16-mixed", True, (2, 4))
    est = estimate(model, cfg)
    assert est.breakdown["params"] == 4 * psi  # the module keeps fp32 weights (no bf16 cast)
    assert any("torch_autocast" in n for n in est.notes)
    # the old reading: 32-true with no note
    assert not any("torch_autocast" in n for n in estimate(model, config(2)).notes)
    # a Linear-only model: one communication dtype
    only = read_deepspeed_config(cfg, model=build(Block, norm=False), batch_size=4)
    assert only.zero_precision.comm_dtype_bytes == (2,)


@pytest.mark.parametrize("stage, per_element", [(2, 4), (3, 2 + 4)])
def test_torch_autocast_keeps_a_reduce_bucket_per_communication_dtype(stage, per_element):
    # stage 1-2: one bucket per comm dtype, each of the weights' dtype (fp32); stage 3: each of its own
    # dtype (bf16 for the Linear's, fp32 for LayerNorm's). Two bucket sizes 4096 apart show them.
    model = build(Block)

    def backward_peak(size):
        cfg = config(stage, torch_autocast={"enabled": True, "dtype": "bfloat16"})
        cfg["zero_optimization"]["reduce_bucket_size"] = size
        return estimate(model, cfg).phase_peaks["backward"]

    grown = backward_peak(8192 + 4096) - backward_peak(8192)
    assert grown == 4096 * (2 * per_element if stage < 3 else per_element)


@pytest.mark.parametrize("block, message", [
    ({"enabled": True, "dtype": "int8"}, "not an autocast dtype"),
    ({"enabled": True, "lower_precision_safe_modules": ["torch.nn.NoSuchModule"]}, "cannot be imported"),
])
def test_torch_autocast_errors(block, message):
    with pytest.raises(ConfigError, match=message):
        read_deepspeed_config(config(2, torch_autocast=block), model=build(Block), batch_size=4)


def test_torch_autocast_with_bf16_is_refused():
    cfg = config(2, torch_autocast={"enabled": True}, bf16={"enabled": True})
    with pytest.raises(ConfigError, match="either torch_autocast or the fp16/bf16 block"):
        read_deepspeed_config(cfg, model=build(Block), batch_size=4)


def test_param_dtype_must_match_the_precision():
    # engine.py _assert_valid_mixed_precision_config
    cfg = config(2, bf16={"enabled": True}, data_types={"param_dtype": "fp16"})
    with pytest.raises(ConfigError, match="param_dtype"):
        read_deepspeed_config(cfg, model=build(Block), batch_size=4)


# ------------------------------------------------------------------------------ a real 2-rank engine


@pytest.mark.slow
def test_real_engine_buffer_and_bf16_masters():
    """One case of benchmarks/deepspeed_cpu_precision.py on two real gloo ranks: a Llama-shaped model
    with a 16 MiB fp32 buffer under ZeRO-3 and bf16 (the buffer whole on each rank, fp32);
    ``memguard.estimate(deepspeed_config=<its config>)`` within 3% of the worst rank."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    from tests.deepspeed_op import shm_op_prebuilt

    if not shm_op_prebuilt():
        pytest.skip("needs DeepSpeed with its shm comm op built (bash scripts/dev.sh setup)")
    from benchmarks.deepspeed_cpu import Case, estimate_case, run_case, steady

    case = Case("llama", 3, "plan", precision="bf16-mixed", buffer_mib=16)
    ranks = run_case(case, steps=2, warmup=1, timeout=240)
    assert all("error" not in r for r in ranks), ranks
    real = max(p for r in ranks for p in steady(r))
    est = estimate_case(case)["peak_bytes"]
    assert abs(est - real) / real <= 0.03, (est, real)


# ------------------------------------------------------------------- ZeRO-2: the last rank's partition


def test_zero_2_partition_from_the_first_bucket_reduction():
    from memguard.estimator._sharding import TracedStates, ZeroBuckets, ZeroSetup, model_state_factors

    psi = 1_000_000

    def factors(reduce_bucket_size, grads_at_start=False, largest=0):
        traced = TracedStates(params=4 * psi, grads=4 * psi, optimizer=8 * psi, num_params=psi, num_trainable=psi,
                              largest_layer=psi // 10, grads_at_start=grads_at_start, largest_param_bytes=largest)
        return model_state_factors(traced, ZeroSetup(zero_stage=2, world_size=N, sixteen_bit=False,
                                                     buckets=ZeroBuckets(reduce_bucket_size=reduce_bucket_size)))

    # more gradients than one bucket: the first reduction comes early in backward, and the last rank's
    # copy_grads_in_partition allocates its whole partition (4 x Ψ/N bytes) then, beside the bucket
    small = factors(65536)
    assert small.bucket_in_backward == 65536 * 4
    assert (small.partition_at_first_reduce, small.first_reduce_elements) == (4 * psi // N, 65536)
    assert small.grads == 0.0  # the module's gradients are moved into the bucket by their hooks
    # a parameter larger than the bucket: its gradient waits for the next hook (extra_large_param_to_reduce)
    assert factors(65536, largest=4 * 100_000).partition_at_first_reduce == 4 * psi // N + 4 * 100_000
    assert factors(65536, largest=4 * 60_000).partition_at_first_reduce == 4 * psi // N  # it fits the bucket
    # every gradient fits one bucket: it is reduced when backward ends, the partition copy grows as before
    whole = factors(psi)
    assert whole.partition_at_first_reduce == 0 and whole.grads == pytest.approx(1 / N)
    # under accumulation (gradients at the start) the partition exists already: unchanged
    assert factors(65536, grads_at_start=True).partition_at_first_reduce == 0
