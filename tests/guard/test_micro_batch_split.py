"""Splitting batches along dim 0, as the guard does it (memguard.batch)."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import pytest
import torch

from memguard.errors import ConfigError
from memguard.batch import batch_size, map_tensors, split_batch

Pair = namedtuple("Pair", "x y")


@pytest.mark.parametrize(
    "n, mbs, sizes",
    [
        (10, 3, [3, 3, 3, 1]),  # the last micro-batch takes the remainder
        (8, 4, [4, 4]),  # exact division
        (5, 8, [5]),  # a micro-batch larger than the batch: one micro-batch
        (4, 1, [1, 1, 1, 1]),  # micro-batch 1: one sample each
    ],
)
def test_sizes_cover_every_sample_once(n: int, mbs: int, sizes: list[int]) -> None:
    x = torch.arange(n)
    parts = list(split_batch(x, mbs))
    assert [k for _, k in parts] == sizes
    assert torch.equal(torch.cat([p for p, _ in parts]), x)


def test_nested_containers_keep_their_types() -> None:
    batch = OrderedDict(
        ids=torch.arange(6),
        pair=Pair(torch.zeros(6, 2), torch.ones(6)),
        extra=[torch.arange(6) * 2, "tag"],
        scale=torch.tensor(3.0),  # 0-dim: passed whole
        name="run-1",  # non-tensor: passed whole
    )
    parts = list(split_batch(batch, 4))
    first, k = parts[0]
    assert k == 4 and type(first) is OrderedDict and type(first["pair"]) is Pair
    assert torch.equal(first["ids"], torch.arange(4))
    assert torch.equal(parts[1][0]["extra"][0], torch.tensor([8, 10]))
    assert first["extra"][1] == "tag" and first["name"] == "run-1"
    assert first["scale"] is batch["scale"]


def test_slices_are_views() -> None:
    x = torch.zeros(6, 3)
    (part, _), *_ = split_batch(x, 2)
    assert part.data_ptr() == x.data_ptr()


def test_mismatched_leaves_are_all_reported() -> None:
    batch = {"a": torch.zeros(4), "b": torch.zeros(3), "c": (torch.zeros(5),)}
    with pytest.raises(ConfigError) as info:
        batch_size(batch)
    assert len(info.value.problems) == 2
    assert "batch['b']" in str(info.value) and "batch['c'][0]" in str(info.value)


@pytest.mark.parametrize("batch", [torch.zeros(0, 3), {"x": "text"}, [torch.tensor(1.0)]])
def test_batches_without_samples_are_refused(batch: object) -> None:
    with pytest.raises(ConfigError):
        batch_size(batch)


def test_bad_micro_batch_size() -> None:
    with pytest.raises(ConfigError):
        list(split_batch(torch.zeros(3), 0))


def test_map_tensors() -> None:
    out = map_tensors({"x": torch.ones(2), "n": 3, "t": (torch.zeros(1),)}, lambda t: t + 1)
    assert torch.equal(out["x"], torch.full((2,), 2.0)) and out["n"] == 3 and torch.equal(out["t"][0], torch.ones(1))
