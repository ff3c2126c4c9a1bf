"""``memguard.estimate(..., deepspeed_config=)``: reading a user's DeepSpeed config.

The expected values follow DeepSpeed 0.19.8 (``runtime/config.py``
``DeepSpeedConfig._set_batch_related_parameters``; ``runtime/zero/config.py`` defaults) and the
Hugging Face integration's "auto" rule (``HfTrainerDeepSpeedConfig.trainer_config_process`` /
``trainer_config_finalize``), each cited where it decides the value.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import memguard
from memguard.estimator._deepspeed_config import hf_bucket_sizes, read_deepspeed_config


class WithConfig(nn.Module):
    """A tiny model with an HF-style ``config.hidden_size``."""

    def __init__(self, hidden=32):
        super().__init__()
        self.config = SimpleNamespace(hidden_size=hidden)
        self.lin = nn.Linear(hidden, hidden)

    def forward(self, x):
        return self.lin(x).pow(2).mean()


def read(config, *, batch_size=4, model=None, **kw):
    return read_deepspeed_config(config, model=model or WithConfig(), batch_size=batch_size, **kw)


def test_hf_bucket_rule():
    # trainer_config_finalize: hidden^2, int(0.9 * hidden^2), 10 * hidden
    assert hf_bucket_sizes(256) == {"reduce_bucket_size": 65536, "stage3_prefetch_bucket_size": 58982,
                                    "stage3_param_persistence_threshold": 2560}


def test_auto_values_filled_like_the_hf_integration():
    cfg = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "train_batch_size": "auto", "bf16": {"enabled": "auto"},
           "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                 "stage3_param_persistence_threshold": "auto"}}
    ds = read(cfg, batch_size=4, grad_accum_steps=3, world_size=2, precision="bf16-mixed")
    assert (ds.micro_batch_size, ds.grad_accum_steps, ds.world_size) == (4, 3, 2)  # batch dim 0, keywords
    assert ds.precision == "bf16-mixed"  # bf16.enabled "auto" <- the bf16 argument
    zero = ds.config["zero_optimization"]
    # hidden_size 32 from model.config: 32^2, int(0.9 * 32^2) = 921, 10 * 32
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"],
            zero["stage3_param_persistence_threshold"]) == (1024, 921, 320)


def test_stage_3_keys_left_to_deepspeed_below_stage_3():
    # trainer_config_finalize fills the stage-3 keys only when is_zero3()
    ds = read({"train_micro_batch_size_per_gpu": 4,
               "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto",
                                     "stage3_prefetch_bucket_size": "auto"}})
    assert ds.config["zero_optimization"]["reduce_bucket_size"] == 1024
    assert "stage3_prefetch_bucket_size" not in ds.config["zero_optimization"]


def test_hidden_size_from_hidden_sizes_and_text_config():
    m = WithConfig()
    m.config = SimpleNamespace(hidden_sizes=[16, 48, 32])  # HF: max(hidden_sizes)
    ds = read({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1, "reduce_bucket_size": "auto"}},
              model=m)
    assert ds.config["zero_optimization"]["reduce_bucket_size"] == 48 * 48
    m.config = SimpleNamespace(text_config=SimpleNamespace(hidden_size=64))
    ds = read({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1, "reduce_bucket_size": "auto"}},
              model=m)
    assert ds.config["zero_optimization"]["reduce_bucket_size"] == 64 * 64


def test_auto_bucket_without_hidden_size_is_a_config_error():
    with pytest.raises(memguard.ConfigError, match="neither hidden_size nor hidden_sizes.*replace them with numbers"):
        read({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}},
             model=nn.Linear(2, 2))


@pytest.mark.parametrize("triple, world, expected", [
    # _set_batch_related_parameters: given two of three, the third; world from the process group
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (4, 4, 2)),   # accum = 32 // 4 // 2
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, (4, 2, 4)),      # micro = 32 // 4 // 2
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 2, (4, 2, 2)),
    ({"train_micro_batch_size_per_gpu": 4}, 1, (4, 1, 1)),                          # accum defaults to 1
    # all three given and world_size not: the ranks the triple is written for, 32 / (4 * 2)
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 1, (4, 2, 4)),
])
def test_batch_triple(triple, world, expected):
    ds = read({**triple, "zero_optimization": {"stage": 2}}, batch_size=4, world_size=world)
    assert (ds.micro_batch_size, ds.grad_accum_steps, ds.world_size) == expected


@pytest.mark.parametrize("block, expected", [
    ({}, "32-true"),                                            # fp16 and bf16 off by default
    ({"fp16": {"enabled": True}}, "16-mixed"),
    ({"bf16": {"enabled": True}}, "bf16-mixed"),
    ({"bfloat16": {"enabled": True}}, "bf16-mixed"),            # the older key (runtime/constants.py BFLOAT16_OLD)
    ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}}, "bf16-true"),
    ({"fp16": {"enabled": False}, "bf16": {"enabled": False}}, "32-true"),
])
def test_precision(block, expected):
    assert read({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1}, **block}).precision == expected


def test_offload_optimizer_and_counts():
    ds = read({"train_micro_batch_size_per_gpu": 4,
               "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "reduce_bucket_size": 5e8,
                                     "overlap_comm": True}})
    assert ds.offload_optimizer is True
    assert ds.config["zero_optimization"]["reduce_bucket_size"] == 500_000_000  # pp_int: 5e8 taken as an int
    assert read({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2, "cpu_offload": True}}
                ).offload_optimizer is True  # the deprecated key


@pytest.mark.parametrize("cfg, kw, message", [
    ({"zero_optimization": {"stage": 2}}, {"zero_stage": 3}, r"zero_stage=3 contradicts .*stage \(2\): drop zero_stage="),
    ({"bf16": {"enabled": True}}, {"precision": "16-mixed"}, r"precision='16-mixed' contradicts .*drop precision="),
    ({"gradient_accumulation_steps": 4}, {"grad_accum_steps": 2},
     r"grad_accum_steps=2 contradicts .*gradient_accumulation_steps \(4\): drop grad_accum_steps="),
    ({}, {"offload_optimizer": True}, r"offload_optimizer=True contradicts .*drop offload_optimizer="),
    ({}, {"strategy": "fsdp2"}, r"strategy='fsdp2' contradicts deepspeed_config=.*drop strategy="),
    # DeepSpeed's _batch_assertion: 24 != 4 * 2 * 2
    ({"train_batch_size": 24, "gradient_accumulation_steps": 2}, {"world_size": 2},
     r"train_batch_size 24 != train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 2 x world_size 2"),
    ({"train_batch_size": 30}, {"world_size": 2}, r"train_batch_size 30 is not divisible by"),
])
def test_conflicting_keywords_name_the_one_to_drop(cfg, kw, message):
    base = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}
    with pytest.raises(memguard.ConfigError, match=message):
        read({**base, **cfg}, **kw)


def test_keyword_that_agrees_is_accepted():
    ds = read({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}},
              zero_stage=3, precision="bf16-mixed")
    assert (ds.zero_stage, ds.precision) == (3, "bf16-mixed")


@pytest.mark.parametrize("zero, message", [
    ({"stage": 4}, r"stage 4 is not a ZeRO stage.*set 1, 2 or 3"),
    ({"stage": "two"}, r"stage 'two' is not a ZeRO stage"),
    ({}, r"stage 0 \(DeepSpeed without ZeRO\) is not modelled.*strategy='ddp'"),  # DeepSpeed's default stage is 0
    ({"stage": 3, "offload_param": {"device": "cpu"}}, r"offload_param .* is not modelled: remove it"),
    ({"stage": 2, "allgather_bucket_size": "auto"}, r"allgather_bucket_size 'auto' must be a whole number"),
])
def test_unsupported_settings(zero, message):
    with pytest.raises(memguard.ConfigError, match=message):
        read({"train_micro_batch_size_per_gpu": 4, "zero_optimization": zero})


def test_every_problem_listed_at_once():
    with pytest.raises(memguard.ConfigError) as info:
        read({"train_micro_batch_size_per_gpu": 8, "fp16": {"enabled": True}, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 5}}, batch_size=4)
    assert len(info.value.problems) == 3  # the stage, fp16 + bf16, the micro-batch against the batch


def test_grad_accum_dtype_other_than_the_weights_is_refused():
    with pytest.raises(memguard.ConfigError, match="grad_accum_dtype 'fp32' differs from the weights' dtype"):
        read({"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"},
              "zero_optimization": {"stage": 1}})
    assert read({"train_micro_batch_size_per_gpu": 4, "data_types": {"grad_accum_dtype": "fp32"},
                 "zero_optimization": {"stage": 1}}).precision == "32-true"


def test_config_file_and_bad_paths(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}))
    assert read(str(path)).zero_stage == 2
    assert read(path).zero_stage == 2
    with pytest.raises(memguard.ConfigError, match="no such file"):
        read(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(memguard.ConfigError, match="cannot be read as JSON"):
        read(str(tmp_path / "bad.json"))
    with pytest.raises(memguard.ConfigError, match="must be a dict or the path"):
        read(42)


def test_callers_dict_is_left_unchanged():
    cfg = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}
    before = json.dumps(cfg, sort_keys=True)
    read(cfg)
    assert json.dumps(cfg, sort_keys=True) == before


# --------------------------------------------------------------- through memguard.estimate
def test_estimate_takes_the_config_stage_precision_and_buckets():
    model, batch = WithConfig(64), torch.randn(4, 64)
    loss = lambda m, b: m(b)  # noqa: E731
    cfg = {"train_micro_batch_size_per_gpu": 4, "train_batch_size": 8, "gradient_accumulation_steps": 1,  # 2 ranks
           "zero_optimization": {"stage": 2, "reduce_bucket_size": 1_000_000}}
    est = memguard.estimate(model, batch, loss_fn=loss, device="cpu", deepspeed_config=cfg)
    assert (est.zero_stage, est.world_size, est.precision) == (2, 2, "32-true")
    same = memguard.estimate(model, batch, loss_fn=loss, device="cpu", zero_stage=2, world_size=2)
    # the config's 1e6-element fp32 reduce bucket (stage_1_and_2.py setup_buckets, from backward's start
    # to the step) is the whole difference in backward
    assert est.phase_peaks["backward"] - same.phase_peaks["backward"] == 4 * 1_000_000
    assert est.phase_peaks["optimizer"] == same.phase_peaks["optimizer"]
    with pytest.raises(memguard.ConfigError, match="drop zero_stage="):
        memguard.estimate(model, batch, loss_fn=loss, device="cpu", zero_stage=3, deepspeed_config=cfg)


@pytest.mark.parametrize("cfg", [
    {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4},
    {"train_batch_size": 32, "gradient_accumulation_steps": 8},
    {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3,
     "zero_optimization": {"stage": 3, "reduce_bucket_size": 5e7, "stage3_prefetch_bucket_size": 1000,
                           "stage3_param_persistence_threshold": 77, "stage3_max_live_parameters": 1e8,
                           "stage3_max_reuse_distance": 0, "overlap_comm": False}},
    {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True}, "zero_optimization": {"stage": 1}},
])
def test_read_as_deepspeed_reads_it(cfg):
    """DeepSpeed's own parser (one rank outside torch.distributed) gets the same batch triple,
    stage, precision and bucket sizes."""
    DeepSpeedConfig = pytest.importorskip("deepspeed.runtime.config").DeepSpeedConfig
    from memguard.estimator._sharding import ZeroBuckets

    cfg = {"zero_optimization": {"stage": 2}, **cfg}
    ours = read(cfg, batch_size=cfg.get("train_micro_batch_size_per_gpu", 4))
    theirs = DeepSpeedConfig(json.loads(json.dumps(cfg)))
    assert (ours.micro_batch_size, ours.grad_accum_steps) == (theirs.train_micro_batch_size_per_gpu,
                                                                theirs.gradient_accumulation_steps)
    assert ours.zero_stage == theirs.zero_optimization_stage
    assert (ours.precision == "bf16-mixed") == theirs.bfloat16_config.enabled
    b, z = ZeroBuckets.from_config(ours.config), theirs.zero_config
    assert (b.reduce_bucket_size, b.allgather_bucket_size, b.prefetch_bucket_size, b.max_live_parameters,
            b.param_persistence_threshold, b.max_reuse_distance, b.contiguous_gradients) == (
        z.reduce_bucket_size, z.allgather_bucket_size, z.prefetch_bucket_size, z.max_live_parameters,
        z.param_persistence_threshold, z.max_reuse_distance, z.contiguous_gradients)
