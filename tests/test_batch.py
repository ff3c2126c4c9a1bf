"""memguard.batch: one set of batch rules for the estimator, planner, guard and adapters."""

from __future__ import annotations

from collections import UserDict, namedtuple

import pytest
import torch
from torch import nn

from memguard.batch import (
    batch_size,
    call_model,
    compute_loss,
    first_dim,
    loss_from_output,
    map_tensors,
    resize_batch,
    split_batch,
)
from memguard.errors import ConfigError


class Encoding(UserDict):
    """Like HF's BatchEncoding: a UserDict, not a dict."""


class Echo(nn.Module):
    def forward(self, *args, **kwargs):
        return {"args": args, "kwargs": kwargs}


def test_call_model_by_batch_shape() -> None:
    x = torch.ones(2, 3)
    # a mapping (a UserDict included) becomes keyword arguments, a tuple/list positional ones
    assert call_model(Echo(), Encoding(a=x))["kwargs"].keys() == {"a"}
    assert len(call_model(Echo(), (x, x))["args"]) == 2
    assert len(call_model(Echo(), [x])["args"]) == 1
    assert call_model(Echo(), x)["args"][0] is x


def test_loss_from_output_prefers_loss_and_accepts_one_element_tensors() -> None:
    loss = torch.tensor([2.5])
    assert loss_from_output({"loss": loss, "logits": torch.ones(3)}).shape == ()
    assert float(loss_from_output(namedtuple("Out", "loss")(loss))) == 2.5
    assert loss_from_output(torch.tensor(1.0)).shape == ()
    with pytest.raises(ConfigError, match="loss_fn=") as info:
        loss_from_output(torch.ones(4))
    assert "shape (4,)" in str(info.value)


def test_compute_loss_uses_loss_fn_or_the_model() -> None:
    lin = nn.Linear(3, 1)
    x = torch.ones(4, 3)
    expected = lin(x).mean()
    assert torch.allclose(compute_loss(lin, x, lambda m, b: m(b).mean()), expected)
    with pytest.raises(ConfigError, match="loss_fn returned"):
        compute_loss(lin, x, lambda m, b: m(b))


def test_batch_size_checks_every_leaf() -> None:
    assert batch_size(Encoding(ids=torch.ones(5, 2), mask=torch.ones(5, 2), scale=torch.tensor(1.0))) == 5
    with pytest.raises(ConfigError) as info:
        batch_size({"a": torch.ones(4, 1), "b": torch.ones(3), "c": torch.ones(2)})
    assert len(info.value.problems) == 2  # both disagreeing leaves are listed at once
    with pytest.raises(ConfigError, match="no tensor"):
        batch_size({"a": 1})
    with pytest.raises(ConfigError, match="empty"):
        batch_size(torch.ones(0, 3))
    # first_dim does not check agreement: the estimator traces whatever it is given
    assert first_dim((3, {"x": torch.ones(7, 2), "y": torch.ones(2)})) == 7
    assert first_dim({"a": 1}) is None


def test_split_keeps_containers_and_covers_each_sample_once() -> None:
    Pair = namedtuple("Pair", "x y")
    batch = Encoding(pair=Pair(torch.arange(5), torch.arange(5) * 10), const=torch.tensor(7), tag="t")
    parts = list(split_batch(batch, 2))
    assert [n for _, n in parts] == [2, 2, 1]
    first = parts[0][0]
    assert isinstance(first, Encoding) and isinstance(first["pair"], Pair)
    assert first["const"].item() == 7 and first["tag"] == "t"  # non-batch leaves go whole to every part
    assert torch.cat([p["pair"].y for p, _ in parts]).tolist() == [0, 10, 20, 30, 40]
    with pytest.raises(ConfigError, match="positive int"):
        list(split_batch(batch, 0))


def test_map_tensors_falls_back_to_dict_for_odd_mappings() -> None:
    class Odd(dict):
        def __init__(self, required, other):
            super().__init__(required)

    out = map_tensors(Odd({"a": torch.ones(1)}, None), lambda t: t * 2)
    assert type(out) is dict and out["a"].item() == 2.0


def test_resize_batch_changes_only_dim0_leaves_and_allocates_nothing() -> None:
    batch = Encoding(ids=torch.ones(4, 9, dtype=torch.long), shared=torch.ones(3, 9))
    out = resize_batch(batch, 4, 16)
    assert isinstance(out, Encoding)
    assert out["ids"].shape == (16, 9) and out["ids"].dtype == torch.long and out["ids"].is_meta
    assert out["shared"] is batch["shared"]  # dim 0 is not the sample count: kept
    assert resize_batch(batch, 4, 4) is batch
