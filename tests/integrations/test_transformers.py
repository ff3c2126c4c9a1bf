"""memguard.integrations.transformers.apply with the real TrainingArguments (and Trainer) on CPU."""

from __future__ import annotations

import dataclasses
import gc
import json
import logging

import pytest
import torch

from memguard import ConfigError, Estimate, Plan
from memguard.integrations.deepspeed import to_config

transformers = pytest.importorskip("transformers")
from memguard.integrations.transformers import apply  # noqa: E402

DeepSpeedConfig = pytest.importorskip("deepspeed.runtime.config").DeepSpeedConfig


def make_plan(**kw) -> Plan:
    world = kw.pop("world_size", 1)
    micro = kw.pop("micro_batch_size", 2)
    accum = kw.pop("grad_accum_steps", 4)
    est = Estimate(
        peak_bytes=1 << 30, breakdown={"params": 1 << 30}, context_bytes=0, peak_phase="backward",
        allocated_peak_bytes=1 << 30, device="cuda", precision=kw.get("precision", "32-true"),
        zero_stage=kw.get("zero_stage", 0), world_size=world, gpu=None, micro_batch_size=micro,
    )
    base = dict(
        micro_batch_size=micro, grad_accum_steps=accum, world_size=world, global_batch_size=micro * accum * world,
        precision="32-true", activation_checkpointing=False, zero_stage=0, budget_bytes=2 << 30, estimate=est,
        hidden_size=32,
    )
    base.update(kw)
    return Plan(**base)


@pytest.fixture
def args(tmp_path):
    # use_cpu=True: without it TrainingArguments refuses bf16 on a machine with no bf16 GPU
    a = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none",
                                       per_device_train_batch_size=8, gradient_accumulation_steps=1,
                                       max_grad_norm=0.5, learning_rate=3e-4)
    yield a
    del a
    gc.collect()  # drops transformers' weak reference to any DeepSpeed config (it enables ZeRO-3 init)


def test_sets_batch_accumulation_precision_checkpointing(args):
    plan = make_plan(micro_batch_size=2, grad_accum_steps=4, precision="bf16-mixed", activation_checkpointing=True,
                     checkpoint_blocks=2)
    new = apply(args, plan)
    assert isinstance(new, transformers.TrainingArguments) and new is not args
    assert (new.per_device_train_batch_size, new.gradient_accumulation_steps) == (2, 4)
    assert new.bf16 is True and new.fp16 is False
    assert new.gradient_checkpointing is True
    assert getattr(new, "activation_checkpointing", True) is True  # the newer name, where it exists
    assert new.deepspeed is None
    # the user's other settings survive, the original is untouched
    assert new.learning_rate == 3e-4 and new.use_cpu is True
    assert (args.per_device_train_batch_size, args.bf16, args.gradient_checkpointing) == (8, False, False)


def test_checkpointing_off_when_the_plan_needs_none(tmp_path):
    names = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    flag = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    a = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **{flag: True})
    assert a.gradient_checkpointing is True
    new = apply(a, make_plan(activation_checkpointing=False))
    assert new.gradient_checkpointing is False
    assert getattr(new, "activation_checkpointing", False) is False


@pytest.mark.parametrize(
    "precision,bf16,fp16",
    [
        ("32-true", False, False),  # fp32: no autocast
        ("16-mixed", False, True),  # fp16 autocast + grad scaler
        ("bf16-mixed", True, False),  # bf16 autocast
        ("bf16-true", False, False),  # no TrainingArguments flag without ZeRO: the model's dtype decides
    ],
)
def test_precision_flags(args, precision, bf16, fp16):
    new = apply(args, make_plan(precision=precision))
    assert (new.bf16, new.fp16) == (bf16, fp16)


def test_true_precision_without_zero_warns_about_the_model_dtype(args, caplog):
    with caplog.at_level(logging.WARNING, logger="memguard"):
        apply(args, make_plan(precision="bf16-true"))
    assert "torch.bfloat16" in caplog.text


def test_zero_plan_writes_a_deepspeed_config_the_trainer_accepts(args):
    plan = make_plan(zero_stage=2, precision="bf16-mixed")
    new = apply(args, plan)
    expected = to_config(plan, gradient_clipping="auto")
    assert new.deepspeed == expected
    # transformers parsed it at construction and filled its own "auto" values from the arguments
    hf = new.hf_deepspeed_config.config
    assert hf["gradient_clipping"] == 0.5  # max_grad_norm
    triple = (hf["train_batch_size"], hf["train_micro_batch_size_per_gpu"], hf["gradient_accumulation_steps"])
    assert triple == (8, 2, 4)
    ds = DeepSpeedConfig(hf)
    assert ds.zero_optimization_stage == 2 and ds.bfloat16_config.enabled and ds.gradient_clipping == 0.5


def test_offload_adds_a_deepspeed_optimizer_filled_by_the_trainer(args):
    new = apply(args, make_plan(zero_stage=3, precision="bf16-mixed", offload_optimizer=True))
    hf = new.hf_deepspeed_config.config
    assert hf["optimizer"]["type"] == "AdamW"
    assert hf["optimizer"]["params"]["lr"] == 3e-4  # learning_rate, filled by transformers
    assert hf["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    DeepSpeedConfig(hf)


def test_bf16_true_under_zero_sets_bf16(args):
    new = apply(args, make_plan(zero_stage=1, precision="bf16-true"))
    assert new.bf16 is True  # must agree with the bf16 block, or transformers reports a mismatch
    assert new.deepspeed["bf16"]["bf16_master_weights_and_grads"] is True


def test_existing_deepspeed_config_is_filled_not_replaced(args, tmp_path):
    user = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "zero_optimization": {"stage": "auto", "overlap_comm": True},
        "bf16": {"enabled": "auto"},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(user))
    for given in (user, str(path)):
        with_ds = transformers.TrainingArguments(output_dir=str(tmp_path / "o"), use_cpu=True, report_to="none",
                                                 deepspeed=given)
        new = apply(with_ds, make_plan(zero_stage=2, precision="bf16-mixed"))
        assert new.deepspeed["zero_optimization"] == {"stage": 2, "overlap_comm": True}
        assert new.deepspeed["scheduler"] == user["scheduler"]
        assert new.deepspeed["train_micro_batch_size_per_gpu"] == 2 and new.bf16 is True
        del with_ds, new
        gc.collect()


def test_existing_deepspeed_config_that_contradicts_the_plan(args, tmp_path):
    with_ds = transformers.TrainingArguments(output_dir=str(tmp_path / "o"), use_cpu=True, report_to="none",
                                             deepspeed={"train_micro_batch_size_per_gpu": 8,
                                                        "zero_optimization": {"stage": 3}})
    with pytest.raises(ConfigError) as info:
        apply(with_ds, make_plan(zero_stage=2))
    assert len(info.value.problems) == 2
    del with_ds
    gc.collect()


def test_world_size_must_match(args):
    # a single CPU process: TrainingArguments.world_size is 1
    with pytest.raises(ConfigError, match="2 data-parallel rank.*on 1"):
        apply(args, make_plan(world_size=2))


def test_problems_are_listed_together(args):
    with pytest.raises(ConfigError) as info:
        apply(args, make_plan(world_size=2, zero_stage=2, precision="16-true"))
    assert len(info.value.problems) == 2


def test_not_training_arguments(args):
    with pytest.raises(ConfigError, match="TrainingArguments"):
        apply({"per_device_train_batch_size": 8}, make_plan())
    with pytest.raises(ConfigError, match="memguard.Plan"):
        apply(args, {"micro_batch_size": 2})


def test_subclass_is_kept(tmp_path):
    a = transformers.Seq2SeqTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                                              predict_with_generate=True)
    new = apply(a, make_plan())
    assert type(new) is transformers.Seq2SeqTrainingArguments and new.predict_with_generate is True


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_transformers_refusal_becomes_a_config_error(tmp_path):
    # without use_cpu=True, TrainingArguments itself refuses bf16 when no bf16 GPU is present
    a = transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none")
    with pytest.raises(ConfigError, match="use_cpu"):
        apply(a, make_plan(precision="bf16-mixed"))


def test_trainer_runs_the_plan(args):
    cfg = transformers.AutoConfig.for_model("gpt2", n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    plan = make_plan(micro_batch_size=2, grad_accum_steps=2, precision="bf16-mixed", activation_checkpointing=True)
    new = apply(transformers.TrainingArguments(output_dir=args.output_dir, use_cpu=True, report_to="none",
                                               max_steps=1, save_strategy="no", logging_strategy="no"), plan)
    data = [{"input_ids": torch.randint(0, 64, (8,)), "labels": torch.randint(0, 64, (8,))} for _ in range(8)]
    forwards = []
    model.register_forward_hook(lambda mod, args, kwargs, out: forwards.append(kwargs["input_ids"].shape[0]),
                                with_kwargs=True)
    trainer = transformers.Trainer(model=model, args=new, train_dataset=data)
    trainer.train()
    # one optimizer step = accumulation 2 forwards of the plan's micro-batch 2
    assert trainer.state.global_step == 1
    assert forwards == [2, 2]
    assert trainer.accelerator.mixed_precision == "bf16"
    # the newer name where it exists (the old one is a deprecated alias there)
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
