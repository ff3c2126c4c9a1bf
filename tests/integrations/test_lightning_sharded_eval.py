"""MemguardCallback guards validation and test steps under the sharded Lightning strategies, with a real cap.

``lightning_worker.py`` with ``eval``: 2 gloo ranks train two optimizer steps, then validate once inside
``fit`` (after its last step), then ``trainer.validate`` and ``trainer.test`` run. Each rank evaluates 168
samples in batches of 128 and 40. Rank 1's address space is capped at the first batch of each evaluation
(VmSize plus 12 MiB); an evaluation forward keeps about 0.5 MiB per sample at seq=64 (fc1's output and the
GELU's, 64 x 1024 fp32 each), so 128, 64 and 32 samples fail and 16 fit. Under these strategies every
evaluation forward all-gathers sharded parameters, so the ranks must split together: rank 0, which has
memory to spare, halves with rank 1 and logs it. The epoch metrics must equal an uncapped run's.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

PACKAGES = [name for name in ("lightning.pytorch", "pytorch_lightning")
            if importlib.util.find_spec(name.split(".")[0]) is not None]
if not PACKAGES:
    pytest.skip("Lightning is not installed", allow_module_level=True)
if not sys.platform.startswith("linux"):
    pytest.skip("RLIMIT_AS and /proc are Linux", allow_module_level=True)
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not built in", allow_module_level=True)

from test_lightning import _deepspeed_ready, _run_worker  # noqa: E402 - this folder is on sys.path under pytest

EVAL = {"eval": 168, "val_batch": 128, "eval_budget_mib": 12, "steps": 2, "plan": [64, 1], "cap_batch": -1,
        "cap_ranks": []}


def _eval_retries(result: dict) -> list[str]:
    return [m for m in result["messages"] if m.startswith("WARNING:memguard: OOM in evaluation")]


def _eval_sizes(result: dict) -> list[int]:
    return [e[1] for e in result["events"] if isinstance(e, list) and e[0] == "VAL"]


def _check(tmp_path: Path, together: bool = True, **cfg) -> None:
    (tmp_path / "capped").mkdir()
    (tmp_path / "plain").mkdir()
    c0, c1 = _run_worker(tmp_path / "capped", world=2, eval_cap_ranks=[1], **EVAL, **cfg)
    p0, p1 = _run_worker(tmp_path / "plain", world=2, eval_cap_ranks=[], **EVAL, **cfg)
    for r in (c0, c1, p0, p1):
        assert r["error"] is None, r["error"]
    assert c1.get("eval_capped") == 3 and not c0.get("eval_capped")  # in fit, validate() and test()
    # the evaluation inside fit: 128, 64 and 32 fail on rank 1, which halves to 16 and logs each retry
    assert len(_eval_retries(c1)) == 3
    assert all("DefaultCPUAllocator" in m for m in _eval_retries(c1))
    # every evaluation runs 16-sample micro-batches on rank 1 (validate() and test() start from the eval
    # micro-batch remembered for this shape, under the cap)
    per_eval = [16] * 10 + [8]  # 128 = 8 x 16, then 40 = 16 + 16 + 8
    assert _eval_sizes(c1) == per_eval * 3
    if together:  # rank 0 halves with rank 1, in the same forwards
        assert len(_eval_retries(c0)) == 3
        assert all("on rank 1;" in m for m in _eval_retries(c0))  # rank 0 halved because rank 1 ran out
        assert _eval_sizes(c0) == per_eval * 3
    else:  # each rank splits alone: rank 0 has the memory for its whole batches
        assert _eval_retries(c0) == [] and _eval_sizes(c0) == [128, 40] * 3
    assert _eval_sizes(p0) == _eval_sizes(p1) == [128, 40] * 3  # uncapped: each batch whole
    # val_loss in fit, val_loss of validate(), test_loss of test(); fp32 sums in another grouping: ~1e-7 observed
    for capped, plain in ((c0, p0), (c1, p1)):
        assert len(capped["metrics"]) == 3
        assert capped["metrics"] == pytest.approx(plain["metrics"], rel=1e-6)
        assert capped["patched_left"] == [] and capped["strategy_patched_left"] == []


def test_model_parallel_validation_and_test_split_on_every_rank_together(tmp_path: Path) -> None:
    # ModelParallelStrategy (FSDP2: fully_shard of each linear layer and the LightningModule)
    _check(tmp_path, strategy="model_parallel", package=PACKAGES[0])


def test_fsdp1_validation_and_test_split_on_every_rank_together(tmp_path: Path) -> None:
    # FSDPStrategy (FSDP1: each linear layer and the LightningModule wrapped, FULL_SHARD): each micro-batch runs
    # Lightning's own Strategy.validation_step/test_step, through the FSDP1 root's forward
    _check(tmp_path, strategy="fsdp", package=PACKAGES[0])


@pytest.mark.skipif(bool(_deepspeed_ready()), reason=_deepspeed_ready() or "ready")
def test_deepspeed_zero3_validation_and_test_split_on_every_rank_together(tmp_path: Path) -> None:
    # DeepSpeedStrategy, ZeRO-3 (every parameter gathered in each module's forward): through the engine's forward
    _check(tmp_path, strategy="deepspeed", zero_stage=3, package=PACKAGES[0])


@pytest.mark.skipif(bool(_deepspeed_ready()), reason=_deepspeed_ready() or "ready")
def test_deepspeed_zero2_validation_and_test_split_on_each_rank_alone(tmp_path: Path) -> None:
    # DeepSpeedStrategy, ZeRO-2: the forward starts no collective (parameters are replicated), so each rank splits
    # alone, as under DDP, inside the engine's forward; rank 0, uncapped, runs its batches whole
    _check(tmp_path, together=False, strategy="deepspeed", zero_stage=2, package=PACKAGES[0])
