"""The public entry points of the evaluation and worst-case features: ``memguard.estimate(...,
train=False)``, ``memguard.plan(..., train=False)``, ``memguard.plan(..., max_shape=...)`` and
``memguard.evaluate``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memguard
from memguard.batch import resize_batch
from memguard.estimator._eval_step import EvalOptions, estimate_eval

FP32 = 4


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))


def test_estimate_train_false_is_the_eval_estimate():
    x = torch.randn(32, 64)
    assert memguard.estimate(mlp(), x, device="cpu", train=False) == estimate_eval(mlp(), x,
                                                                                    EvalOptions(device="cpu"))
    # an optimizer given with train=False: its state is resident (AdamW: 2 x params + a step per tensor)
    params = (64 * 256 + 256 + 256 * 10 + 10) * FP32
    with_opt = memguard.estimate(mlp(), x, device="cpu", train=False, optimizer=lambda p: torch.optim.AdamW(p))
    without = estimate_eval(mlp(), x, EvalOptions(device="cpu"))
    assert with_opt.peak_bytes - without.peak_bytes == 2 * params + 4 * FP32


def test_plan_train_false_and_training_knobs():
    plan = memguard.plan(mlp(), torch.randn(4, 64), global_batch_size=512, device="cpu", budget_bytes=1 << 20,
                         train=False)
    assert plan.reasons["mode"].startswith("evaluation") and plan.grad_accum_steps == 1
    fits = estimate_eval(mlp(), resize_batch(torch.randn(4, 64), 4, plan.micro_batch_size),
                         EvalOptions(device="cpu"))
    assert fits.peak_bytes <= plan.usable_bytes
    with pytest.raises(memguard.ConfigError) as info:
        memguard.plan(mlp(), torch.randn(4, 64), global_batch_size=8, device="cpu", budget_bytes=1 << 20,
                      train=False, zero_stage=2, activation_checkpointing=True)
    assert len(info.value.problems) == 2


def test_plan_max_shape_plans_for_the_longest_batch():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.for_model("gpt2", n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=1024)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    ids = torch.zeros(2, 64, dtype=torch.long)
    batch = {"input_ids": ids, "labels": ids}
    options = dict(global_batch_size=64, device="cpu", budget_bytes=300 << 20, precision="32-true",
                   activation_checkpointing=False)
    short = memguard.plan(model, batch, **options)
    long = memguard.plan(model, batch, max_shape={"seq_len": 1024}, **options)
    assert long.micro_batch_size < short.micro_batch_size  # 16x the tokens per sample
    assert long.estimate.peak_bytes <= long.usable_bytes
    assert "input_ids (1024,)" in long.reasons["planned_shape"] and "planned_shape" in long.explain()
    assert "planned_shape" not in short.reasons


def test_memguard_evaluate_is_exported():
    from memguard.guard._evaluate import evaluate

    assert memguard.evaluate is evaluate and "evaluate" in memguard.__all__
