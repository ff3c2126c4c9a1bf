"""Tests of the on-disk plan cache: hits, keys, atomic writes and corrupt files."""

from __future__ import annotations

import json
import logging
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memguard
from memguard import Estimate, Plan
from memguard.planner._cache import PlanCache, default_cache_dir, plan_key

KiB = 1 << 10


class TinyMLP(nn.Module):
    def __init__(self, dim: int = 16, blocks: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(dim, 2 * dim), nn.ReLU(), nn.Linear(2 * dim, dim))
                                    for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return x


def _loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(batch), torch.zeros_like(batch))


@pytest.fixture(scope="module")
def model() -> nn.Module:
    torch.manual_seed(0)
    return TinyMLP()


@pytest.fixture(scope="module")
def batch() -> torch.Tensor:
    return torch.randn(2, 8, 16)


def _kw(**over):
    kw = dict(global_batch_size=12, device="cpu", budget_bytes=400 * KiB, loss_fn=_loss, precision="32-true",
              activation_checkpointing=False)
    kw.update(over)
    return kw


def _json_files(d) -> list:
    return sorted(p.name for p in d.iterdir() if p.suffix == ".json")


def _plan_for_put(**over) -> Plan:
    est = Estimate(peak_bytes=10, breakdown={"params": 10}, context_bytes=0, peak_phase="backward",
                   allocated_peak_bytes=10, device="cpu", precision="32-true", zero_stage=0, world_size=1, gpu=None,
                   micro_batch_size=1)
    kw = dict(micro_batch_size=1, grad_accum_steps=2, world_size=1, global_batch_size=2, precision="32-true",
              activation_checkpointing=False, zero_stage=0, budget_bytes=100, estimate=est, device="cpu")
    kw.update(over)
    return Plan(**kw)


# ---------------------------------------------------------------------------------------------
# hits
# ---------------------------------------------------------------------------------------------


def test_second_identical_call_reads_the_cache(model, batch, tmp_path, caplog):
    cache = PlanCache(tmp_path)
    first = memguard.plan(model, batch, cache=cache, **_kw())
    files = _json_files(tmp_path)
    assert len(files) == 1
    # tamper with the stored plan: a second call that returns the tampered value read the file
    path = tmp_path / files[0]
    d = json.loads(path.read_text())
    d["throughput"] = 4242.0
    d["reasons"] = {"micro_batch_size": "from the cache"}
    path.write_text(json.dumps(d))
    with caplog.at_level(logging.INFO, logger="memguard"):
        second = memguard.plan(model, batch, cache=cache, **_kw())
    assert second.throughput == 4242.0 and second.reasons["micro_batch_size"] == "from the cache"
    assert second.replace(throughput=first.throughput, reasons=first.reasons) == first
    assert "cache" in caplog.text
    assert _json_files(tmp_path) == files


def test_cache_true_uses_memguard_cache_dir(model, batch, tmp_path, monkeypatch):
    monkeypatch.setenv("MEMGUARD_CACHE_DIR", str(tmp_path / "mg"))
    assert default_cache_dir() == tmp_path / "mg"
    p = memguard.plan(model, batch, cache=True, **_kw())
    files = _json_files(tmp_path / "mg")
    assert len(files) == 1
    assert Plan.from_dict(json.loads((tmp_path / "mg" / files[0]).read_text())) == p
    assert memguard.plan(model, batch, cache=True, **_kw()) == p


def test_cache_off_by_default_writes_nothing(model, batch, tmp_path, monkeypatch):
    monkeypatch.setenv("MEMGUARD_CACHE_DIR", str(tmp_path))
    memguard.plan(model, batch, **_kw())
    assert not list(tmp_path.iterdir())


def test_default_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("MEMGUARD_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "memguard"


# ---------------------------------------------------------------------------------------------
# keys
# ---------------------------------------------------------------------------------------------


def test_different_options_give_different_keys(model, batch):
    base = dict(global_batch_size=12, gpu=None, budget_bytes=1000, world_size=1, device="cpu",
                precision=("32-true",), ckpt=(False,), zero=(0,), offload=(False,), headroom=0.1)
    k0 = plan_key(model, batch, None, _loss, base)
    assert plan_key(model, batch, None, _loss, dict(base)) == k0  # deterministic
    variants = {
        "global batch": {**base, "global_batch_size": 24},
        "budget": {**base, "budget_bytes": 2000},
        "world size": {**base, "world_size": 2},
        "gpu": {**base, "gpu": "A100-80GB"},
        "precision": {**base, "precision": ("bf16-mixed",)},
        "checkpointing": {**base, "ckpt": (True,)},
        "zero": {**base, "zero": (3,)},
        "headroom": {**base, "headroom": 0.2},
    }
    keys = {name: plan_key(model, batch, None, _loss, opts) for name, opts in variants.items()}
    assert k0 not in keys.values()
    assert len(set(keys.values())) == len(keys)


def test_model_batch_optimizer_and_loss_change_the_key(model, batch):
    opts = dict(global_batch_size=12, budget_bytes=1000)
    k0 = plan_key(model, batch, None, _loss, opts)
    torch.manual_seed(0)
    wider = TinyMLP(dim=32)
    assert plan_key(wider, torch.randn(2, 8, 32), None, _loss, opts) != k0
    assert plan_key(TinyMLP(blocks=3), batch, None, _loss, opts) != k0  # structure
    assert plan_key(model, torch.randn(2, 9, 16), None, _loss, opts) != k0  # batch shape
    assert plan_key(model, batch.double(), None, _loss, opts) != k0  # batch dtype
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    sgd_m = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert len({k0, plan_key(model, batch, sgd, _loss, opts), plan_key(model, batch, sgd_m, _loss, opts)}) == 3
    assert plan_key(model, batch, None, None, opts) != k0
    # same structure, other weights: the same key (memory does not depend on values)
    torch.manual_seed(1)
    assert plan_key(TinyMLP(), torch.randn(2, 8, 16), None, _loss, opts) == k0


def test_plan_with_other_options_writes_another_file(model, batch, tmp_path):
    cache = PlanCache(tmp_path)
    memguard.plan(model, batch, cache=cache, **_kw())
    memguard.plan(model, batch, cache=cache, **_kw(budget_bytes=500 * KiB))
    memguard.plan(model, batch, cache=cache, **_kw(global_batch_size=24))
    assert len(_json_files(tmp_path)) == 3


# ---------------------------------------------------------------------------------------------
# atomic writes and corrupt files
# ---------------------------------------------------------------------------------------------


class _Unserialisable:
    """json.dump cannot encode this; it sits deep in the plan so the writer fails mid-file."""


def test_failed_write_leaves_no_partial_file(tmp_path):
    cache = PlanCache(tmp_path)
    good = _plan_for_put()
    path = cache.put("k", good)
    before = path.read_text()
    bad = _plan_for_put(reasons={"precision": _Unserialisable()})
    with pytest.raises(TypeError):
        cache.put("k", bad)
    # the old file is intact, and no temporary file is left behind
    assert path.read_text() == before
    assert sorted(os.listdir(tmp_path)) == ["k.json"]
    assert cache.get("k") == good
    with pytest.raises(TypeError):
        cache.put("new", bad)
    assert sorted(os.listdir(tmp_path)) == ["k.json"]
    assert cache.get("new") is None


def test_put_creates_the_folder_and_get_misses_quietly(tmp_path):
    cache = PlanCache(tmp_path / "a" / "b")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cache.get("missing") is None
    cache.put("x", _plan_for_put())
    assert cache.get("x") == _plan_for_put()


@pytest.mark.parametrize(
    "content",
    [
        "{not json",  # truncated / garbage
        "",  # empty file
        json.dumps({"micro_batch_size": 1}),  # valid JSON, not a plan
        json.dumps([1, 2, 3]),  # not a mapping
    ],
)
def test_corrupt_file_is_ignored_with_a_warning(tmp_path, content):
    cache = PlanCache(tmp_path)
    cache.path_for("k").write_text(content)
    with pytest.warns(UserWarning, match="ignoring"):
        assert cache.get("k") is None


def test_plan_survives_a_corrupt_cache_file_and_repairs_it(model, batch, tmp_path):
    cache = PlanCache(tmp_path)
    p = memguard.plan(model, batch, cache=cache, **_kw())
    (path,) = [tmp_path / f for f in _json_files(tmp_path)]
    path.write_text('{"micro_batch_size": ')
    with pytest.warns(UserWarning, match="ignoring"):
        again = memguard.plan(model, batch, cache=cache, **_kw())
    assert again == p
    assert Plan.from_dict(json.loads(path.read_text())) == p  # rewritten with the fresh plan
