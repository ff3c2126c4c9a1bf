"""Smoke tests of the helpers behind benchmarks/compare_estimators.py and compare_batch_finders.py.

Tiny models only: each helper is checked against a hand computation or a property that must
hold, in seconds. The full comparisons are run by hand (see the scripts' docstrings).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

_REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(_REPO))  # the repo root, for `benchmarks`

from benchmarks import compare_batch_finders as cbf  # noqa: E402
from benchmarks import compare_estimators as ce  # noqa: E402


def _mlp() -> nn.Module:
    # Linear(10, 20): 10*20 + 20 = 220 params; Linear(20, 3): 20*3 + 3 = 63 params; 283 in all
    return nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 3))


class _Tied(nn.Module):
    """One 4x4 weight reachable from two modules (a tied embedding/head in miniature)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4, bias=False)
        self.b = self.a

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


@pytest.mark.parametrize(
    ("build", "expected"),
    [
        # 283 fp32 params = 1132 B; "Training using Adam" for float32 is 4 x model size
        (_mlp, 4 * 283 * 4),
        # + BatchNorm1d(20): weight and bias (40 fp32 params) and running_mean/var (40 fp32 buffers)
        # and num_batches_tracked (one int64 = 8 B): (283 + 40 + 40) * 4 + 8 = 1460 B, x4
        (lambda: nn.Sequential(nn.Linear(10, 20), nn.BatchNorm1d(20), nn.Linear(20, 3)), 4 * 1460),
        # a tied 4x4 weight counts once: 16 * 4 B = 64 B, x4
        (_Tied, 4 * 64),
    ],
)
def test_accelerate_rule_is_four_times_model_size(build, expected):
    pytest.importorskip("accelerate")
    assert ce.accelerate_training_bytes(build()) == expected


def test_accelerate_rule_reads_shapes_only():
    pytest.importorskip("accelerate")
    with torch.device("meta"):
        model = _mlp()
    assert ce.accelerate_training_bytes(model) == 4 * 283 * 4  # same as the real model above


def test_deepspeed_model_states():
    pytest.importorskip("deepspeed")
    got = ce.deepspeed_model_states_bytes(_mlp())
    # ZeRO-2, 1 GPU, no offload: 2Ψ + 18Ψ with Ψ = 283 (stage_1_and_2.py)
    # ZeRO-3, 1 GPU, no offload: 4 * largest layer (Linear(10, 20): 220 params) + 18Ψ (stage3.py)
    assert got == {"deepspeed-zero2": 20 * 283, "deepspeed-zero3": 4 * 220 + 18 * 283}


def test_torchinfo_total_size():
    pytest.importorskip("torchinfo")
    x = torch.randn(4, 10)
    got = ce.torchinfo_total_bytes(_mlp(), [x])
    # input: sys.getsizeof of the input's storage (torchinfo.get_total_memory_used);
    # forward/backward: 2 x output bytes of the leaf layers with parameters: 2 * (4*20 + 4*3) * 4 = 736;
    # params: 283 * 4 = 1132
    assert got == sys.getsizeof(x.untyped_storage()) + 736 + 1132


def test_memtracker_runner_sees_params_and_grads():
    def build():
        torch.manual_seed(0)
        return _mlp(), (torch.randn(4, 10),), lambda m, b: m(b[0]).square().mean()

    elapsed: list[float] = []
    peaks = ce.memtracker_step_peaks(build, lambda p: torch.optim.SGD(p, lr=0.1), steps=2, elapsed=elapsed)
    assert len(peaks) == 2 and len(elapsed) == 2
    # params (1132 B) and their grads (1132 B) are both live at the end of backward; plain SGD keeps no state
    assert all(p >= 2 * 283 * 4 for p in peaks)
    # the step is deterministic and stateless, so the second step peaks like the first
    assert peaks[0] == peaks[1]


@pytest.mark.parametrize(
    ("batch", "loss_fn", "expected"),
    [
        ({"x": 1}, None, {"x": 1}),  # no loss_fn: the model gets the dict as keywords
        ((1, 2), None, (1, 2)),  # no loss_fn: a tuple is the positional arguments
        ((1, 2), len, [1]),  # zoo loss_fns call model(batch[0])
    ],
)
def test_model_inputs(batch, loss_fn, expected):
    assert ce.model_inputs(batch, loss_fn) == expected


def test_summary_and_markdown():
    rows = [
        {"case": "a", "optimizer": "AdamW", "real_bytes": 100,
         "tools": {"memguard": {"bytes": 110, "seconds": 1.0}, "torchinfo": {"error": "boom", "seconds": 0.1}},
         "errors": {"memguard": ce.error_pct(110, 100), "torchinfo": None}},
        {"case": "b", "optimizer": "SGD", "real_bytes": 200,
         "tools": {"memguard": {"bytes": 190, "seconds": 1.0}, "torchinfo": {"bytes": 300, "seconds": 0.1}},
         "errors": {"memguard": ce.error_pct(190, 200), "torchinfo": ce.error_pct(300, 200)}},
    ]
    summary = ce.summarize(rows)
    # |+10%| and |-5%|: median 7.5, max 10 on case a
    assert summary["memguard"]["median_abs_error_pct"] == pytest.approx(7.5)
    assert summary["memguard"]["max_case"] == "a"
    assert summary["torchinfo"] == {"n": 1, "failed": 1, "median_abs_error_pct": 50.0, "max_abs_error_pct": 50.0,
                                    "max_case": "b"}
    meta = {"machine": {}, "command": "x", "date": "d", "target": "cpu", "truth_source": "s"}
    md = ce.render_markdown(rows, summary, meta)
    assert "| a | AdamW | 0.0 | 0.0 (+10.0%) |" in md
    assert "fails" in md and "`boom`" in md


@pytest.mark.parametrize(
    ("message", "kind"),
    [
        # the CPU allocator's message (c10/core/impl/alloc_cpu.cpp), as seen under the cap
        ("RuntimeError: [enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
         "you tried to allocate 4194304 bytes.", "torch CPU allocator: `can't allocate memory`"),
        # oneDNN's primitive creation failing under the cap
        ("RuntimeError: could not create a primitive", "oneDNN: `could not create a primitive`"),
        # NNPACK's workspace allocation (aten/src/ATen/native/NNPACK.cpp)
        ("RuntimeError: posix_memalign failed:Cannot allocate memory (12)",
         "NNPACK workspace: `posix_memalign failed`"),
        # a worker that died on a signal, as _run_worker reports it
        ("process killed by SIGSEGV after 14 s", "the process crashed (SIGSEGV)"),
        ("ValueError: something else", "`ValueError: something else`"),
    ],
)
def test_error_kind(message, kind):
    assert cbf.error_kind(message) == kind


def test_scrub_paths():
    import tempfile

    text = f"{sys.prefix}/lib/a.py {_REPO}/benchmarks/b.py {tempfile.gettempdir()}/c.ckpt"
    assert ce.scrub_paths(text) == "<python>/lib/a.py <repo>/benchmarks/b.py <tmp>/c.ckpt"


def test_vmsize_is_read():
    assert cbf.vmsize_bytes() > 1 << 20  # a Python interpreter with torch maps far more than 1 MiB


def test_cap_makes_a_real_cpu_oom_that_the_tools_recognise():
    """Under the cap a large allocation raises torch's CPU allocator error; who recognises it?

    The subprocess imports only torch (seconds); the real exception comes back as its type and
    ``args``, which is all that Accelerate's check reads (``isinstance``, ``len(args) == 1``, the
    message). Lightning's check reads the same, but importing Lightning takes too long for a smoke
    test; the benchmark itself records what Lightning answered.
    """
    script = textwrap.dedent(
        """
        import json, torch
        from benchmarks.compare_batch_finders import cap_address_space
        cap_address_space(64 << 20)
        try:
            torch.empty(1 << 30, dtype=torch.uint8)  # 1 GiB, far past 64 MiB of room
            print(json.dumps(None))
        except Exception as exc:
            print(json.dumps({"type": type(exc).__name__, "args": list(exc.args)}))
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=_REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(_REPO), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out is not None, "the 1 GiB allocation succeeded under a 64 MiB cap"
    assert out["type"] == "RuntimeError" and len(out["args"]) == 1
    assert "DefaultCPUAllocator: can't allocate memory" in out["args"][0]
    exc = RuntimeError(*out["args"])
    assert cbf._is_oom_text(exc)
    from memguard.guard._oom import is_oom_error

    assert is_oom_error(exc)
    if importlib.util.find_spec("accelerate"):
        from accelerate.utils.memory import should_reduce_batch_size

        assert should_reduce_batch_size(exc)
