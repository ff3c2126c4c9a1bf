"""The evaluation step's estimate (``estimate_eval``, ``memguard.estimate(..., train=False)``) and plan.

Ground truth is the real CPU allocator under the profiler (``eval_ground_truth.py``): the same
forward under ``no_grad`` with the model in ``eval()`` mode, its output kept until the step ends.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memguard.batch import resize_batch
from memguard.errors import ConfigError
from memguard.estimator.api import estimate
from memguard.estimator._eval_step import EVAL_NOTE, EvalOptions, estimate_eval
from memguard.planner.api import plan as plan_for
from tests.estimator.eval_ground_truth import measure_cpu_eval_peak

pytestmark = pytest.mark.cpu_truth  # compares with real CPU kernels / a real memory cap

FP32 = 4


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.Dropout(0.1), nn.ReLU(), nn.Linear(256, 10))


def test_mlp_bytes_by_hand():
    x = torch.randn(32, 64)
    est = estimate_eval(mlp(), x, EvalOptions(device="cpu"))
    params = (64 * 256 + 256 + 256 * 10 + 10) * FP32
    # peak inside ReLU: the batch, Linear's output and ReLU's output (not in place); dropout is off in
    # eval mode (no mask, no copy) and nothing is saved for a backward
    expected = params + x.numel() * FP32 + 2 * 32 * 256 * FP32
    assert est.peak_bytes == expected
    assert est.breakdown.get("grads", 0) == 0 and est.breakdown.get("optimizer", 0) == 0
    assert est.peak_phase == "forward" and est.notes[0] == EVAL_NOTE
    assert est.peak_bytes == measure_cpu_eval_peak(mlp(), x)


def test_resident_state_options():
    x = torch.randn(32, 64)
    base = estimate_eval(mlp(), x, EvalOptions(device="cpu")).peak_bytes
    params = (64 * 256 + 256 + 256 * 10 + 10) * FP32
    # AdamW: exp_avg and exp_avg_sq per parameter plus a 0-dim fp32 step per tensor (torch/optim/adamw.py)
    with_opt = estimate_eval(mlp(), x, EvalOptions(device="cpu", optimizer_state=True)).peak_bytes
    assert with_opt - base == 2 * params + 4 * FP32
    with_grads = estimate_eval(mlp(), x, EvalOptions(device="cpu", grads_present=True)).peak_bytes
    assert with_grads - base == params
    # DDP's buckets (as large as all gradients) exist while the wrapper does, so in evaluation too
    assert estimate_eval(mlp(), x, EvalOptions(device="cpu", world_size=2)).peak_bytes - base == params
    # the previous step's output (32 x 10 fp32) is live until this forward returns
    kept = estimate_eval(mlp(), x, EvalOptions(device="cpu", keep_outputs=True)).peak_bytes
    assert kept - base == 32 * 10 * FP32


def test_eval_is_below_training():
    x = torch.randn(32, 64)
    train = estimate(mlp(), x, loss_fn=lambda m, b: m(b).sum(), device="cpu").peak_bytes
    assert estimate_eval(mlp(), x, EvalOptions(device="cpu")).peak_bytes < train


def gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.for_model("gpt2", n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=128,
                                            bos_token_id=0, eos_token_id=0)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.for_model("llama", num_hidden_layers=2, hidden_size=64, intermediate_size=172,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                                            bos_token_id=0, eos_token_id=0)
    return transformers.AutoModelForCausalLM.from_config(cfg)


# GPT-2 returning its loss too (the peak then includes cross-entropy's log-softmax over the logits), Llama its
# logits only (grouped-query attention, rotary tables, RMSNorm): two different peak mechanisms
@pytest.mark.parametrize("build,labels", [(gpt2, True), (llama, False)], ids=["gpt2-loss", "llama-logits"])
def test_transformers_against_the_real_cpu_peak(build, labels):
    torch.manual_seed(0)
    model = build()
    ids = torch.randint(0, 1000, (4, 96))
    batch = {"input_ids": ids, "labels": ids} if labels else {"input_ids": ids}
    est = estimate_eval(model, batch, EvalOptions(device="cpu")).peak_bytes
    real = measure_cpu_eval_peak(model, batch)
    # the tracer sees every storage the CPU allocator serves; 1% covers allocations made outside
    # tensors' storages (none were seen on these models: the measured error is under 0.02%)
    assert abs(est - real) / real < 0.01, (est, real)


def test_with_resident_optimizer_against_the_real_cpu_peak():
    torch.manual_seed(0)
    model = gpt2()
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    batch = {"input_ids": torch.randint(0, 1000, (4, 96))}
    est = estimate_eval(model, batch, EvalOptions(device="cpu", optimizer_state=True), optimizer=opt).peak_bytes
    real = measure_cpu_eval_peak(model, batch, optimizer=opt)
    assert abs(est - real) / real < 0.01, (est, real)


def test_training_only_options_are_refused_together():
    with pytest.raises(ConfigError) as info:
        estimate_eval(mlp(), torch.randn(2, 64),
                      EvalOptions(device="cpu", zero_stage=3, activation_checkpointing=True, grad_accum_steps=4),
                      optimizer=torch.optim.SGD)
    assert len(info.value.problems) == 4


def test_plan_eval_picks_the_largest_fitting_micro_batch():
    model, x = mlp(), torch.randn(4, 64)
    params = (64 * 256 + 256 + 256 * 10 + 10) * FP32
    per_sample = 64 * FP32 + 2 * 256 * FP32  # the input row and two hidden rows (test_mlp_bytes_by_hand)
    budget = params + 100 * per_sample + 1000  # 100 samples fit, with no headroom
    plan = plan_for(model, x, global_batch_size=512, train=False, device="cpu", budget_bytes=budget, headroom=0.0)
    assert plan.micro_batch_size == 100
    assert estimate_eval(model, resize_batch(x, 4, 101), EvalOptions(device="cpu")).peak_bytes > budget
    assert plan.grad_accum_steps == 1 and plan.global_batch_size == 100
    text = plan.explain()
    assert "evaluation (train=False)" in text and "512 runs as 6 forwards" in text


def test_plan_eval_max_shape_is_explained():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.for_model("gpt2", n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=512)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    batch = {"input_ids": torch.zeros(2, 64, dtype=torch.long)}
    short = plan_for(model, batch, global_batch_size=64, train=False, device="cpu", budget_bytes=200 << 20)
    long = plan_for(model, batch, global_batch_size=64, train=False, device="cpu", budget_bytes=200 << 20,
                    max_shape={"seq_len": 512})
    assert long.micro_batch_size < short.micro_batch_size  # 8x the tokens per sample: fewer samples fit
    assert "input_ids (512,)" in long.reasons["planned_shape"] and "planned_shape" in long.explain()
