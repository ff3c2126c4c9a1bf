"""Tests of memguard.plot: the planner's memory curves and the PNGs drawn from them."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

import matplotlib.image  # noqa: E402
import numpy as np  # noqa: E402

import memguard  # noqa: E402
from memguard import hf, plot  # noqa: E402
from memguard.errors import ConfigError, MissingDependencyError  # noqa: E402
from memguard.planner._request import PlanRequest  # noqa: E402
from memguard.planner.api import TraceSession, plan_request  # noqa: E402

# Block activations dominate this tiny GPT-2 (a 128-token vocabulary keeps the logits small), so
# checkpointing and precision visibly change the curves.
TINY = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 128}
GLOBAL_BATCH = 16


@pytest.fixture(scope="module")
def planned():
    built = hf.build("gpt2", TINY, seq_len=64)
    planner = TraceSession(built.model, built.batch, device="cuda")
    request = PlanRequest(global_batch_size=GLOBAL_BATCH, gpu="A100-40GB")
    plan = plan_request(built.model, built.batch, request, session=planner)
    return built, planner, plan


def test_curves_cover_each_precision_and_checkpointing(planned):
    built, planner, plan = planned
    traces_before = planner.trace_count
    curves = plot.memory_curves(built.model, built.batch, plan, planner=planner)
    # A100-40GB has bf16: memguard.plan's default choices are bf16-mixed and 32-true, each drawn
    # without checkpointing and with both blocks checkpointed; the plan checkpoints nothing here.
    assert plan.checkpoint_blocks == 0
    assert {(c.precision, c.checkpoint_blocks) for c in curves} == {
        ("bf16-mixed", 0), ("bf16-mixed", 2), ("32-true", 0), ("32-true", 2)}
    assert curves[0].precision == plan.precision
    # The candidates are the divisors of the per-rank batch, 16.
    assert all(c.micro_batch_sizes == (1, 2, 4, 8, 16) for c in curves)
    for c in curves:
        # activations grow with the micro-batch
        assert list(c.peak_bytes) == sorted(c.peak_bytes) and c.peak_bytes[-1] > c.peak_bytes[0]
    by_key = {(c.precision, c.checkpoint_blocks): c for c in curves}
    for p in ("bf16-mixed", "32-true"):
        # checkpointing every block never needs more than checkpointing none, at the largest batch
        assert by_key[(p, 2)].peak_bytes[-1] < by_key[(p, 0)].peak_bytes[-1]
    # the plan's own configuration was predicted to fit
    own = by_key[(plan.precision, 0)]
    assert own.peak_bytes[own.micro_batch_sizes.index(plan.micro_batch_size)] <= plan.usable_bytes
    # drawing reuses the planner: at most the probes of a precision planning skipped are traced
    assert planner.trace_count - traces_before <= 4


def test_curves_match_a_full_estimate_at_the_example_batch(planned):
    built, planner, plan = planned
    curves = plot.memory_curves(built.model, built.batch, plan, planner=planner, precisions=["32-true"])
    (flat,) = [c for c in curves if c.precision == "32-true" and c.checkpoint_blocks == 0]
    # With 2 blocks, the 2-block probe is the whole model, traced at the planner's probe
    # micro-batch (8) and at 16. Interpolated down to micro-batch 1 (16 accumulation steps) and
    # replayed through the allocator model, the prediction must agree with memguard.estimate of
    # that configuration within 2% (the probe model's bound on CUDA without checkpointing; what
    # remains is accumulation's gradients, added as bytes rather than replayed).
    est = memguard.estimate(built.model, built.batch, gpu="A100-40GB", precision="32-true",
                            grad_accum_steps=GLOBAL_BATCH)
    assert abs(flat.peak_bytes[0] - est.peak_bytes) <= 0.02 * est.peak_bytes, (flat.peak_bytes[0], est.peak_bytes)


def _read_png(path):
    img = matplotlib.image.imread(str(path))
    return np.asarray(img)


def test_plot_plan_writes_a_real_png_of_the_documented_size(planned, tmp_path):
    built, planner, plan = planned
    curves = plot.memory_curves(built.model, built.batch, plan, planner=planner)
    out = tmp_path / "plan.png"
    assert plot.plot_plan(plan, out, curves=curves, title="tiny gpt2") == str(out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = _read_png(out)
    # FIGSIZE inches x DPI: 12 x 5 inches at 100 dpi
    assert img.shape[:2] == (500, 1200) == (plot.FIGSIZE[1] * plot.DPI, plot.FIGSIZE[0] * plot.DPI)
    # both panels hold drawing, not a blank canvas
    for half in (img[:, :800, :3], img[:, 800:, :3]):
        assert (half < 0.9).any() and half.std() > 0.05


def test_plot_closest_plan_without_curves_and_estimate(planned, tmp_path):
    built, planner, plan = planned
    out = tmp_path / "closest.png"
    plot.plot_plan(plan, out, fits=False)
    assert _read_png(out).shape[:2] == (500, 1200)
    est_png = tmp_path / "estimate.png"
    plot.plot_estimate(plan.estimate, est_png, budget_bytes=plan.budget_bytes, usable_bytes=plan.usable_bytes)
    img = _read_png(est_png)
    assert img.shape[:2] == (500, 600)  # FIGSIZE_SINGLE: 6 x 5 inches at 100 dpi
    assert img[:, :, :3].std() > 0.05


def test_missing_folder_is_a_config_error(planned, tmp_path):
    _, _, plan = planned
    with pytest.raises(ConfigError, match="does not exist"):
        plot.plot_plan(plan, tmp_path / "no" / "such" / "plan.png")


def test_missing_matplotlib_names_the_extra(planned, tmp_path, monkeypatch):
    _, _, plan = planned
    # A None entry in sys.modules makes `import matplotlib` raise ImportError, as when it is absent.
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'memguard\[plot\]'"):
        plot.plot_plan(plan, tmp_path / "plan.png")
    assert not (tmp_path / "plan.png").exists()
