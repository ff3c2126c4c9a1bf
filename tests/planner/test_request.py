"""Tests of :class:`memguard.planner._request.PlanRequest`: the options of ``memguard.plan`` as one value."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import memguard
from memguard import ConfigError
from memguard.planner._request import DEFAULT_HEADROOM, OPTION_NAMES, PlanRequest
from memguard.vocab import GiB


def test_fields_are_plan_options_with_the_same_defaults():
    # The request is memguard.plan's keyword options: same names, same order, same defaults, so a
    # caller can pass either and plan() stays a thin wrapper.
    params = inspect.signature(memguard.plan).parameters
    keywords = [p for p in params.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert [p.name for p in keywords] == list(OPTION_NAMES)
    fields = {f.name: f for f in dataclasses.fields(PlanRequest)}
    for p in keywords:
        default = fields[p.name].default
        expected = p.default if p.default is not inspect.Parameter.empty else dataclasses.MISSING
        assert default == expected, p.name


def test_from_options_names_unknown_options_and_lists_the_accepted_ones():
    with pytest.raises(ConfigError) as info:
        PlanRequest.from_options(global_batch_size=8, micro_batch=4, gpus="A100")
    text = str(info.value)
    assert "'micro_batch'" in text and "'gpus'" in text
    for name in OPTION_NAMES:  # the message lists every accepted option
        assert name in text, name


def test_from_options_requires_the_global_batch_size():
    with pytest.raises(ConfigError, match="global_batch_size is required"):
        PlanRequest.from_options(gpu="A100-80GB")


def test_a_valid_request_has_no_problems_and_round_trips():
    r = PlanRequest.from_options(global_batch_size=64, gpu="A100-80GB", world_size=8, precision="bf16")
    assert r.problems() == []
    assert r.check() is r
    assert PlanRequest.from_options(**r.options()) == r
    space = r.resolve()
    # Lightning's short name "bf16" is bf16-mixed (lightning/fabric/connector.py)
    assert space.precisions == ("bf16-mixed",)
    assert space.spec.name == "A100-80GB"
    # the default budget is the GPU's memory less its CUDA context; headroom 10% is kept free
    assert space.budget_bytes == space.spec.memory_bytes - space.spec.context_bytes
    assert space.usable_bytes == int(space.budget_bytes * (1 - DEFAULT_HEADROOM))
    # several ranks: every ZeRO stage is a candidate unless the user restricts them
    assert space.zero_stages == (0, 1, 2, 3)


def test_problems_lists_every_bad_value_at_once():
    r = PlanRequest(global_batch_size=10, world_size=4, device="cpu", gpu="A100-80GB", budget_bytes=-5,
                    headroom=1.5, precision="fp8", zero_stage=7, activation_checkpointing="some",
                    offload_optimizer="yes", keep_outputs="no", loss_fn=3, cache="disk")
    problems = r.problems()
    text = "\n".join(problems)
    for needle in ("cannot be split", "gpu=", "budget_bytes", "headroom", "precision", "zero_stage",
                   "activation_checkpointing", "offload_optimizer", "keep_outputs", "loss_fn", "cache"):
        assert needle in text, needle
    assert len(problems) == 11  # one sentence per bad value
    with pytest.raises(ConfigError) as info:
        r.check()
    assert info.value.problems == problems


def test_problems_can_be_spelled_as_command_line_flags():
    r = PlanRequest(global_batch_size=8, device="cpu", gpu="T4", budget_bytes=0)
    problems = r.problems(spell={"gpu": "--gpu", "device": "--device", "budget_bytes": "--budget"})
    text = "\n".join(problems)
    assert "--gpu T4 only applies to --device cuda" in text and "--budget 0" in text
    assert "gpu=" not in text


def test_replace_derives_a_request_and_problems_see_the_change():
    r = PlanRequest(global_batch_size=8, gpu="A100-80GB")
    assert r.problems() == []
    bad = dataclasses.replace(r, world_size=3)
    assert any("cannot be split evenly over world_size 3" in p for p in bad.problems())
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.world_size = 2  # type: ignore[misc]


@pytest.mark.parametrize("gpu", ["T4", "V100-16GB"])  # Turing and Volta have no bf16 arithmetic
def test_bf16_on_a_gpu_without_it_is_a_problem_only_when_asked_for(gpu):
    assert any("no native bf16" in p for p in PlanRequest(global_batch_size=8, gpu=gpu, precision="bf16-mixed").problems())
    space = PlanRequest(global_batch_size=8, gpu=gpu).resolve()
    # the default is the GPU's fastest 16-bit format with tensor cores, fp16 (vocab.default_precisions)
    assert space.precisions == ("16-mixed", "32-true")


@pytest.mark.parametrize(
    "options, zero_stages",
    [
        ({}, (0,)),  # one device, nothing to shard
        ({"offload_optimizer": True}, (1, 2)),  # ZeRO-Offload on one device needs ZeRO-1 or 2
        ({"world_size": 2}, (0, 1, 2, 3)),
        ({"world_size": 2, "zero_stage": [3, 1, 3]}, (3, 1)),  # a restriction keeps its order, once each
    ],
)
def test_zero_stage_choices(options, zero_stages):
    r = PlanRequest(global_batch_size=8, device="cpu", budget_bytes=GiB, **options)
    assert r.resolve().zero_stages == zero_stages


def test_zero_stage_true_is_not_stage_1():
    # bool is a subclass of int (True == 1), but zero_stage=True is a mistake, not ZeRO-1
    assert any("zero_stage" in p for p in PlanRequest(global_batch_size=8, zero_stage=True, device="cpu",
                                                      budget_bytes=GiB).problems())


def test_optimizer_may_be_an_instance_or_a_factory():
    p = torch.nn.Parameter(torch.zeros(1))
    for opt in (torch.optim.SGD([p], lr=0.1), lambda params: torch.optim.SGD(params, lr=0.1), None):
        assert PlanRequest(global_batch_size=1, device="cpu", budget_bytes=GiB, optimizer=opt).problems() == []
    bad = PlanRequest(global_batch_size=1, device="cpu", budget_bytes=GiB, optimizer="adam").problems()
    assert len(bad) == 1 and "optimizer" in bad[0]
