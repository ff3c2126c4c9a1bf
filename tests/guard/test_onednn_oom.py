"""oneDNN failures: a primitive that ran out of memory is an OOM, a configuration oneDNN refuses is not.

What reaches Python: oneDNN's C++ API throws ``dnnl::error`` whose ``what()`` is the message alone
(``error::wrap_c_api`` in include/oneapi/dnnl/dnnl_common.hpp), and torch turns it into
``RuntimeError(what())``, so "could not create a primitive" carries no ``dnnl_status_t``. The guard
therefore counts a oneDNN failure as an OOM only while the process cannot map the memory the call
may have needed (``memguard.guard._oom._cannot_map``), a probe made only on such an exception.

Observed with torch 2.13.0+cpu (oneDNN v3.12.0) on an AMD EPYC with AVX-512 BF16 (no AVX512-FP16,
no AMX), with ``RLIMIT_AS`` at VmSize plus a budget, ``MALLOC_ARENA_MAX=1`` and
``OMP_NUM_THREADS=1``:

* a bfloat16 ``conv2d`` forward whose primitive is new raises ``RuntimeError: could not create a
  primitive`` with a budget of 0 to 192 KiB: its JIT kernels each map a 256 KiB code buffer, before
  PyTorch allocates the 1 MiB output (from 256 KiB on, without the heap pad below, the output
  allocation failed first, with the CPU allocator's message). With the primitive already created,
  the CPU allocator's error comes instead. This is what the tests below build on.
* the backward of a small bfloat16 conv raises the same message from inside ``Tensor.backward``
  (through the autograd engine, unchanged) for budgets of 0 to 512 KiB. Without the heap pad the
  gradients' small allocations met the cap too, and about half of the budgets got the CPU
  allocator's error instead, varying from run to run.
* with the heap pad (``MALLOC_TOP_PAD_`` of 16 MiB), 52 runs of 5 forward and 7 backward budgets
  from 0 to 512 KiB all gave oneDNN's message. Without it, 4 runs in 15 crashed (SIGSEGV in
  ``pd_t::clone``: oneDNN's ``operator new`` returns the null of a failed malloc, see the worker),
  which the guard cannot catch; a bfloat16 ``F.linear`` under a 256 KiB budget crashed the same way.
* adding two MKL-DNN tensors of different shapes raises "could not create a primitive descriptor
  for the sum primitive. ..." (``dnnl_invalid_arguments``, src/common/sum.cpp), and a float16 linear
  on a CPU without float16 support "... for the inner product forward propagation primitive. ..."
  (``dnnl_unimplemented``), with memory to spare and 16 MiB above VmSize alike.
* after a JIT code buffer could not be mapped, every later new JIT primitive on that thread fails
  with "could not create a primitive", with the cap lifted too: Xbyak keeps its error in a
  thread-local that oneDNN 3.12 never clears (oneDNN PR #5907 fixes it). Other threads are
  unaffected, so the worker runs each capped case on a fresh thread. The guard's retry on the same
  thread fails the same way; with memory to spare, that failure is not taken for an OOM.

The worker runs once for the module (about 2.5 s, mostly importing torch); the timeout only catches
hangs.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from memguard.guard import _oom as oom
from memguard.guard._oom import is_oom_error

pytestmark = pytest.mark.cpu_truth  # real oneDNN failures under a real memory cap

WORKER = Path(__file__).with_name("onednn_oom_worker.py")
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120
JIT = "could not create a primitive"  # dnnl.hpp primitive::primitive, wrapping dnnl_primitive_create
CPU_ALLOCATOR = "DefaultCPUAllocator: can't allocate memory"
PD_V3_5 = ("could not create a primitive descriptor for the {} primitive. Run workload with environment "
           "variable ONEDNN_VERBOSE=all to get additional diagnostic information.")  # dnnl.hpp, oneDNN 3.5+


def _capable() -> bool:
    return (sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")
            and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


real = pytest.mark.skipif(not _capable(), reason="needs Linux (RLIMIT_AS, /proc) and oneDNN bfloat16 on x86-64")


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("onednn") / "result.json"
    env = dict(os.environ)
    # one heap, 16 MiB of it mapped ahead (see the worker's docstring), one OpenMP thread
    env.update(MALLOC_ARENA_MAX="1", MALLOC_TOP_PAD_=str(16 << 20), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    try:
        proc = subprocess.run([sys.executable, str(WORKER), str(out)], env=env, capture_output=True, text=True,
                              timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the oneDNN worker did not finish within {TIMEOUT_S} s")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return json.loads(out.read_text())


# ---------------------------------------------------------------------------------------------------
# Real failures, under a real cap


@real
def test_forward_primitive_that_cannot_map_its_jit_code_is_oom(observed: dict) -> None:
    for rec in observed["forward"]:
        assert rec["type"] == "RuntimeError" and rec["message"] == JIT, rec
        assert rec["oom"] is True, rec  # classified under the cap, as the guard does
        # the same exception with the cap lifted: memory is what decides, not the message alone
        assert rec["oom_after_lifting_the_cap"] is False, rec


@real
def test_backward_primitive_that_runs_out_is_oom(observed: dict) -> None:
    recs = observed["backward"]
    for rec in recs:
        assert rec["type"] == "RuntimeError" and rec["oom"] is True, rec
        assert rec["message"] == JIT or CPU_ALLOCATOR in rec["message"], rec
    onednn = [r for r in recs if r["message"] == JIT]
    assert onednn, "no budget made a backward primitive fail inside oneDNN"
    # raised through the autograd engine, with the message unchanged
    assert all("_engine_run_backward" in r["frames"] for r in onednn)
    assert all(r["oom_after_lifting_the_cap"] is False for r in onednn)


@real
def test_configurations_onednn_refuses_are_not_oom(observed: dict) -> None:
    recs = observed["refusal"]
    refused = {"sum of different shapes": "sum", "float16 linear": "inner product forward propagation"}
    assert "sum of different shapes" in {r["case"] for r in recs}
    assert observed["fp16"] or "float16 linear" in {r["case"] for r in recs}
    for rec in recs:
        # dnnl.hpp's primitive_desc text ("for a ..." before oneDNN 3.5, "for the ... Run workload ..." since)
        pattern = rf"could not create a primitive descriptor for (?:a|the) {refused[rec['case']]} primitive"
        assert rec["type"] == "RuntimeError" and re.match(pattern, rec["message"]), rec
        # with memory to spare (budget None) and 16 MiB above VmSize alike
        assert rec["oom"] is False, rec


@real
def test_a_thread_whose_jit_failed_stays_failed_and_is_not_oom_once_memory_is_back(observed: dict) -> None:
    rec = observed["poisoned"]
    assert rec["message"] == JIT and rec["oom"] is True
    then = rec["then"]
    if then is not None:  # oneDNN without PR #5907: Xbyak's thread-local error is never cleared
        assert then["type"] == "RuntimeError" and then["message"] == JIT
        assert then["oom"] is False  # memory is free now, so the guard lets it propagate
    assert observed["fresh_thread"]["type"] is None  # another thread creates primitives as usual


@real
def test_probe_sees_the_cap(observed: dict) -> None:
    assert observed["probe"]["capped"] == {"small": True, "large": True}
    assert observed["probe"]["free"] == {"small": False, "large": False}


# ---------------------------------------------------------------------------------------------------
# In this process (no cap)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch is built without oneDNN")
def test_real_refusal_with_memory_to_spare_is_not_oom() -> None:
    a, b = torch.randn(2, 4).to_mkldnn(), torch.randn(1, 4).to_mkldnn()
    with pytest.raises(RuntimeError, match="could not create a primitive descriptor for") as info:
        a + b
    assert not is_oom_error(info.value)


def test_probe_with_memory_to_spare() -> None:
    assert not oom._cannot_map(oom._ONEDNN_SMALL)
    assert not oom._cannot_map(oom._ONEDNN_LARGE)


@pytest.mark.parametrize(
    "raised, short",
    [
        (OSError(errno.ENOMEM, "Cannot allocate memory"), True),
        (MemoryError(), True),
        (OSError(errno.EINVAL, "Invalid argument"), False),  # not about memory: cannot tell
        (ValueError("mmap length is too large"), False),
    ],
)
def test_probe_outcomes(monkeypatch: pytest.MonkeyPatch, raised: BaseException, short: bool) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise raised

    monkeypatch.setattr(mmap, "mmap", fail)
    assert oom._cannot_map(1 << 20) is short


# ---------------------------------------------------------------------------------------------------
# The classifier on constructed exceptions, with the exact message shapes from the source


SMALL, LARGE = oom._ONEDNN_SMALL, oom._ONEDNN_LARGE


@pytest.mark.parametrize(
    "message, needed",
    [
        # dnnl.hpp primitive::primitive and primitive::execute
        ("could not create a primitive", LARGE),
        ("could not execute a primitive", LARGE),
        ("could not create a primitive from a cache blob", LARGE),
        # dnnl.hpp primitive_desc constructors, oneDNN 3.5+ and 3.0-3.4
        (PD_V3_5.format("convolution forward propagation"), SMALL),
        (PD_V3_5.format("convolution weights update"), SMALL),
        ("could not create a primitive descriptor for a convolution forward propagation primitive", SMALL),
        ("could not create a primitive descriptor for a reorder primitive", SMALL),
        # dnnl.hpp memory::memory (may allocate the buffer) and ideep's tensor (wraps torch's buffer)
        ("could not create a memory object", LARGE),
        ("could not create a memory", SMALL),
    ],
)
@pytest.mark.parametrize("short", [True, False])
def test_onednn_messages_follow_the_probe(monkeypatch: pytest.MonkeyPatch, message: str, needed: int,
                                          short: bool) -> None:
    asked: list[int] = []

    def probe(nbytes: int) -> bool:
        asked.append(nbytes)
        return short

    monkeypatch.setattr(oom, "_cannot_map", probe)
    assert is_oom_error(RuntimeError(message)) is short
    assert asked == [needed]


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x4)"),
        RuntimeError("mkldnn_linear: fp16 path needs the cpu support avx_ne_convert or avx512_fp16"),
        RuntimeError("could not set scratchpad mode primitive attribute"),  # attribute setters: no memory
        ValueError("could not create a primitive"),  # the words, in a type that is not torch's
    ],
)
def test_other_errors_never_probe(monkeypatch: pytest.MonkeyPatch, exc: BaseException) -> None:
    def probe(nbytes: int) -> bool:
        raise AssertionError("probed")

    monkeypatch.setattr(oom, "_cannot_map", probe)
    assert not is_oom_error(exc)


def test_onednn_oom_as_a_cause_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(oom, "_cannot_map", lambda nbytes: True)
    try:
        try:
            raise RuntimeError(JIT)
        except RuntimeError as inner:
            raise KeyError("wrapped by a framework") from inner
    except KeyError as outer:
        assert is_oom_error(outer)


# ------------------------------------------------------------------------------------ recovery
RECOVERY_WORKER = Path(__file__).with_name("onednn_recovery_worker.py")


@pytest.mark.skipif(not _capable(), reason="bf16 convolutions take ATen's kernels here: no oneDNN kernel to fail")
def test_the_guard_recovers_from_a_onednn_kernel_that_cannot_be_built(tmp_path: Path) -> None:
    """A real oneDNN JIT failure under a cap: the guard turns oneDNN off, halves, redoes the samples."""
    env = dict(os.environ, MALLOC_ARENA_MAX="1", MALLOC_TOP_PAD_=str(64 << 20), MALLOC_MMAP_THRESHOLD_=str(1 << 30),
               MALLOC_TRIM_THRESHOLD_=str(1 << 30), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]))
    env.pop("ONEDNN_MAX_CPU_ISA", None)  # the host's own oneDNN path is the one that fails here
    proc = subprocess.run([sys.executable, str(RECOVERY_WORKER), str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    r = json.loads((tmp_path / "result.json").read_text())
    assert r["error"] is None, r
    assert r["onednn_before"] is True and r["onednn_after"] is False
    warnings = [m for m in r["messages"] if m.startswith("WARNING:")]
    assert any("turned torch.backends.mkldnn off" in m for m in warnings)
    assert any("could not create a primitive" in m and "micro-batch 4" in m for m in warnings)
    assert r["oom_retries"] == 1 and r["micro_batch_size"] == 4
    # every sample of each step in its last attempt, once
    steps, current = [], None
    for e in r["seen"]:
        if e == "STEP":
            current = []
            steps.append(current)
        else:
            current.append(e)
    assert [sorted(sum(s[-2:], [])) for s in steps] == [list(range(0, 8)), list(range(8, 16))]
    # bf16 weights (unit roundoff 2**-8) against a full-batch reference on the same ATen kernels
    guarded, reference = torch.load(tmp_path / "guarded.pt"), torch.load(tmp_path / "reference.pt")
    assert max(((guarded[k].float() - reference[k].float()).norm() / reference[k].float().norm()).item()
               for k in reference) <= 1e-2
