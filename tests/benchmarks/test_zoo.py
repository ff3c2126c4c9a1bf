"""Tests of the benchmark model zoo: every case builds on meta, and the coverage is as promised."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `benchmarks`

from benchmarks.ground_truth import tensors_in, default_loss  # noqa: E402
from benchmarks.zoo import CASES, ZooCase  # noqa: E402


@pytest.fixture(scope="module")
def meta_builds():
    """Every case built once on the meta device (cheap: no init kernels run)."""
    return {name: case.build("meta") for name, case in CASES.items()}


def test_zoo_has_at_least_twelve_named_cases():
    assert len(CASES) >= 12
    for name, case in CASES.items():
        assert isinstance(case, ZooCase)
        assert case.name == name and case.kind and case.notes


@pytest.mark.parametrize("name", sorted(CASES))
def test_case_builds_on_meta_with_a_cpu_batch(name, meta_builds):
    model, batch, loss_fn = meta_builds[name]
    assert isinstance(model, nn.Module) and model.training
    params = list(model.parameters())
    assert params and all(p.device.type == "meta" for p in params)
    tensors = list(tensors_in(batch))
    assert tensors and all(t.device.type == "cpu" for t in tensors)
    assert len({t.shape[0] for t in tensors}) == 1  # one batch dimension, dim 0
    assert loss_fn is None or callable(loss_fn)
    optimizer = CASES[name].optimizer(model.parameters())
    assert isinstance(optimizer, torch.optim.Optimizer)
    trainable = {id(p) for p in params if p.requires_grad}
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert in_optimizer == trainable


def test_batches_are_deterministic():
    for name in ("gpt2", "resnet-bn", "bert-mlm"):
        _, a, _ = CASES[name].build("meta")
        _, b, _ = CASES[name].build("meta")
        for x, y in zip(tensors_in(a), tensors_in(b)):
            assert torch.equal(x, y)


def _optimizer_kinds() -> set[str]:
    kinds = set()
    p = [nn.Parameter(torch.zeros(1))]
    for case in CASES.values():
        opt = case.optimizer(p)
        d = opt.defaults
        name = type(opt).__name__
        if name == "Adam" and d.get("foreach"):
            name = "Adam-foreach"
        if name == "SGD" and d.get("momentum", 0) > 0:
            name = "SGD-momentum"
        kinds.add(name)
    return kinds


def test_optimizers_vary_as_required():
    assert {"AdamW", "Adam-foreach", "SGD-momentum", "RMSprop", "Adagrad"} <= _optimizer_kinds()


def test_required_model_families_are_covered(meta_builds):
    kinds = {case.kind for case in CASES.values()}
    assert {"causal-lm", "masked-lm", "seq2seq", "image-classification"} <= kinds

    attn = {
        name: getattr(getattr(model, "config", None), "_attn_implementation", None)
        for name, (model, _, _) in meta_builds.items()
    }
    assert attn["llama-sdpa"] == "sdpa" and attn["qwen2-eager"] == "eager"

    def tied(model):  # a Parameter reachable under two names
        return len(list(model.named_parameters(remove_duplicate=False))) > len(list(model.parameters()))

    assert tied(meta_builds["tied-lm"][0]) and tied(meta_builds["gpt2"][0])
    frozen = meta_builds["frozen-encoder"][0]
    assert any(not p.requires_grad for p in frozen.parameters())
    assert any(p.requires_grad for p in frozen.parameters())
    def checkpointing(model):  # transformers >= 5 renamed is_gradient_checkpointing
        if hasattr(model, "is_activation_checkpointing"):
            return model.is_activation_checkpointing
        return model.is_gradient_checkpointing

    assert checkpointing(meta_builds["gpt2-hf-ckpt"][0])
    assert not checkpointing(meta_builds["gpt2"][0])
    assert {type(m).__name__ for m in meta_builds["lstm-lm"][0].modules()} >= {"LSTM"}
    assert {type(m).__name__ for m in meta_builds["resnet-bn"][0].modules()} >= {"Conv2d", "BatchNorm2d"}


def test_model_sizes_are_in_the_benchmark_range(meta_builds):
    # parameters alone: between 1 MB and 100 MB of fp32, so real peaks land near 20-300 MB
    for name, (model, _, _) in meta_builds.items():
        n = sum(p.numel() for p in model.parameters())
        assert 250_000 <= n <= 25_000_000, (name, n)


@pytest.mark.parametrize("name", ["mlp", "tied-lm"])
def test_default_loss_runs_real_cases_without_loss_fn(name):
    # one real forward of the two torch.nn cases whose forward returns the loss itself
    # (tuple batch -> model(*batch), tensor batch -> model(batch))
    model, batch, loss_fn = CASES[name].build("cpu")
    assert loss_fn is None
    with torch.no_grad():
        loss = default_loss(model, batch)
    assert loss.numel() == 1 and math.isfinite(loss.item())


def test_real_and_meta_builds_match():
    real, _, _ = CASES["ckpt-mlp"].build("cpu")
    meta, _, _ = CASES["ckpt-mlp"].build("meta")
    assert [(n, p.shape) for n, p in real.named_parameters()] == [(n, p.shape) for n, p in meta.named_parameters()]
    again, _, _ = CASES["ckpt-mlp"].build("cpu")
    assert all(torch.equal(a, b) for a, b in zip(real.parameters(), again.parameters()))  # seeded
