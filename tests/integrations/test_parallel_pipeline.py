"""memguard.integrations.parallel.apply(model, Layout(pp=...)) and parallel.step, on real gloo ranks.

Each test starts the ranks of parallel_pipeline_worker.py (a small Llama cut into pipeline stages by
apply, trained with parallel.step), bounded by a timeout (a hang fails the test), and compares every
rank's losses and its stage's weights after the steps with one process training the whole model on
the same batches (``model(**batch).loss``, the same AdamW).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("parallel_pipeline_worker.py")
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="multi-rank runs use gloo over localhost"),
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in"),
]


def _worker_module():
    spec = importlib.util.spec_from_file_location("parallel_pipeline_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path: Path, pp: int, **cfg) -> tuple[list[dict], list[dict]]:
    cfg = {"out": str(tmp_path), "pp": pp, "steps": 3, **cfg}
    env = dict(os.environ)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(pp), OMP_NUM_THREADS="1",
               MALLOC_ARENA_MAX="1", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, str(WORKER), json.dumps(cfg)], env={**env, "RANK": str(r)}, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(pp)]
    try:
        outs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"a rank did not finish within {TIMEOUT_S} s: the ranks hung")
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    results = [json.loads((tmp_path / f"result{r}.json").read_text()) for r in range(pp)]
    weights = [torch.load(tmp_path / f"weights{r}.pt") for r in range(pp)]
    return results, weights


def _single_process(steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The whole model in one process on the same batches: ``model(**batch).loss``, backward, AdamW."""
    w = _worker_module()
    torch.set_num_threads(1)
    model = w.build_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=w.LR)
    losses = []
    for batch in w.make_batches(steps):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _global_name(name: str, stage: int, stages: int) -> str:
    """A stage's parameter name in the whole model: split_decoder renumbers the blocks it keeps from 0."""
    from memguard.estimator._pipeline import stage_bounds

    lo, _ = stage_bounds(_worker_module().LAYERS, stages, stage)
    return re.sub(r"\.layers\.(\d+)\.", lambda m: f".layers.{int(m.group(1)) + lo}.", name)


def _assert_equal_to_one_process(results: list[dict], weights: list[dict], steps: int) -> None:
    losses, reference = _single_process(steps)
    for r in results:  # every rank returns the batch's loss
        assert r["losses"] == pytest.approx(losses, abs=1e-5), (r["rank"], r["losses"], losses)
    seen = set()
    for stage, stage_weights in enumerate(weights):
        for name, value in stage_weights.items():
            full = _global_name(name, stage, len(weights))
            assert full not in seen, full
            seen.add(full)
            diff = float((value - reference[full]).abs().max())
            assert diff <= 1e-5, (stage, full, diff)
    assert seen == set(reference), set(reference) ^ seen  # the stages hold every weight exactly once


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
def test_two_stages_train_as_one_process(tmp_path: Path, schedule: str) -> None:
    results, weights = _run(tmp_path, 2, schedule=schedule, microbatches=4)
    for r in results:
        assert r["mesh"] == [2, 1, 1, 1] and r["mesh_dims"] == ["pp", "dp_replicate", "dp_shard", "tp"]
        assert r["stage"] == "PipelineStage"
        assert r["schedule"] == {"1F1B": "Schedule1F1B", "GPipe": "ScheduleGPipe"}[schedule]
        assert r["microbatches"] == [4, 4, 4] and r["log"] == []
    _assert_equal_to_one_process(results, weights, 3)
