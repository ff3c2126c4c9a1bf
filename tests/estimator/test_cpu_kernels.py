"""The CPU target follows the host's kernel paths (``memguard.estimator._cpu_kernels``).

PyTorch's CPU kernels choose a path by instruction set (oneDNN for 16-bit matmuls and
convolutions where the CPU supports the type, ATen's own kernels elsewhere), and the paths
allocate differently. Each test here pins the path it measures: a subprocess runs the real kernels
with ``ONEDNN_MAX_CPU_ISA`` set (oneDNN reads it once, when it loads), reports the level its oneDNN
really ran at (a cap cannot raise a CPU above what it has: on an AVX2-only host every cap gives
``avx2``), and memguard models that same level. So the comparisons hold on any x86-64 host, and on
each host they cover every level it can reach.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import memguard
from memguard import ConfigError
from memguard.estimator._cpu_kernels import ISAS, CpuTarget, _hardware_isa, host_isa
from memguard.estimator._op_memory import modelled_op_memory
from memguard.estimator._onednn_matmul import matmul_scratchpad_bytes

pytestmark = pytest.mark.cpu_truth

WORKER = Path(__file__).with_name("cpu_path_worker.py")
ROOT = Path(__file__).resolve().parents[2]
#: oneDNN caps tried: the host's own level, plain AVX-512 (Skylake/Cascade Lake: bf16 emulated),
#: and AVX2 (AMD before Zen 4, and any host with the cap)
LEVELS = ("", "AVX512_CORE", "AVX2")
TOLERANCE = 0.03  # the CPU zoo's accuracy goal for a whole step: |estimate / real - 1| <= 3%

_spec = importlib.util.spec_from_file_location("cpu_path_worker", WORKER)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)


def _run_worker(cap: str, cfg: dict) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("ONEDNN_MAX_CPU_ISA", None)
    if cap:
        env["ONEDNN_MAX_CPU_ISA"] = cap
    out = subprocess.run([sys.executable, str(WORKER), json.dumps(cfg)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("@@RESULT@@ "))
    return json.loads(line.split(" ", 1)[1])


STEPS = [("resmlp", "bf16-true"), ("convnext", "bf16-true"), ("convnext", "bf16-mixed"), ("convnet", "bf16-true"),
         ("convnet", "16-true"), ("convnet", "32-true")]


@pytest.fixture(scope="module", params=LEVELS, ids=lambda c: c or "host")
def measured(request) -> dict:
    """One worker per level: every op of the table and every step case, measured for real."""
    return _run_worker(request.param, {"ops": True, "steps": STEPS})


# ------------------------------------------------------------------------------------ ops
def _modelled(name: str, isa: str):
    op, make = worker.OPS[name]
    return modelled_op_memory(op, make, kernel_model=False, cpu_target=CpuTarget(isa=isa, threads=1))


#: matmuls: the oneDNN scratchpad (or its absence) is modelled to the byte, on every path
MATMULS = ["mm-bf16", "mm-bf16-large", "mm-bf16-transposed", "bmm-bf16", "linear-bf16", "mm-fp16", "mm-fp32"]


@pytest.mark.parametrize("name", MATMULS)
def test_matmul_memory_equals_the_real_kernel(measured, name):
    real = measured["ops"][name]
    model = _modelled(name, measured["isa"])
    assert (model.forward_peak, model.backward_peak) == (real["forward_peak"], real["backward_peak"]), (
        measured["isa"], model, real)
    assert (model.forward_kept, model.backward_kept) == (real["forward_kept"], real["backward_kept"])


#: convolutions: reorders and im2col buffers are replayed; oneDNN's own scratchpads (bias and
#: weight-gradient accumulation, a few hundred KiB at these sizes) are not, so the backward peak may
#: be below the real one by up to 20% of this single op (never above it by more than 1%); the
#: forward, which has no such scratchpad on the plain layouts used here, is within 1%.
CONVS = ["conv3x3-bf16", "conv3x3-fp32", "conv3x3-fp16", "dwconv7x7-bf16", "dwconv7x7-fp32", "stem4x4-bf16",
         "conv1x1-bf16"]


@pytest.mark.parametrize("name", CONVS)
def test_convolution_memory_follows_the_real_kernel(measured, name):
    real = measured["ops"][name]
    model = _modelled(name, measured["isa"])
    assert abs(model.forward_peak / real["forward_peak"] - 1) <= 0.01, (measured["isa"], model, real)
    assert -0.20 <= model.backward_peak / real["backward_peak"] - 1 <= 0.01, (measured["isa"], model, real)
    assert (model.forward_kept, model.backward_kept) == (real["forward_kept"], real["backward_kept"])


def test_without_the_kernel_model_the_16_bit_paths_are_missed(measured):
    """The check has teeth: on a level where oneDNN takes bf16, the bare fake trace misses memory."""
    if not CpuTarget(isa=measured["isa"]).bf16_onednn:
        pytest.skip(f"{measured['isa']}: bf16 does not reach oneDNN here")
    op, make = worker.OPS["mm-bf16-large"]
    bare = modelled_op_memory(op, make, kernel_model=False)
    assert bare.forward_peak < measured["ops"]["mm-bf16-large"]["forward_peak"]


# ------------------------------------------------------------------------------------ steps
@pytest.mark.parametrize("case", [f"{c}/{p}" for c, p in STEPS])
def test_training_step_estimate_matches_the_host_path(measured, case):
    r = measured["steps"][case]
    assert abs(r["estimate"] / r["real"] - 1) <= TOLERANCE, (measured["isa"], case, r)


# ------------------------------------------------------------------------------------ targets
def test_the_host_level_follows_the_cpu_and_the_onednn_cap():
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2")
    code = "from memguard.estimator._cpu_kernels import host_isa; print(host_isa())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "avx2", out.stderr
    assert host_isa() in ISAS
    # torch's own answer agrees with the level memguard found
    assert bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()) == CpuTarget(isa=host_isa()).bf16_onednn


@pytest.mark.parametrize(
    "flags, level",
    [
        ({"avx2", "fma"}, "avx2"),  # AMD Zen 3 and older, Intel Haswell-Comet Lake
        ({"avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq"}, "avx512_core"),  # Skylake-SP, Cascade Lake
        ({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}, "avx512_core_bf16"),  # Cooper Lake, Zen 4
        ({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_fp16"}, "avx512_core_fp16"),
        ({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16"},
         "avx512_core_amx"),  # Sapphire Rapids and later
        ({"avx2", "avx_vnni", "avx_vnni_int8", "avx_ne_convert"}, "avx2_vnni_2"),  # Sierra Forest, Arrow Lake
    ],
)
def test_cpu_flags_map_to_onednn_levels(flags, level):
    assert _hardware_isa(flags) == level


def test_named_targets_and_their_errors():
    assert CpuTarget.named("AVX512_CORE_AMX").isa == "avx512_core_amx"
    assert CpuTarget.named("avx10_1_512").isa == "avx512_core_fp16"  # oneDNN's newer name
    assert CpuTarget.named("host").isa == host_isa() and CpuTarget.named(None).isa == host_isa()
    with pytest.raises(ConfigError, match="cpu='sse9'.*avx512_core_bf16"):
        CpuTarget.named("sse9")


def _tiny_bf16_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))


def test_estimates_for_a_named_cpu_differ_by_its_kernel_paths():
    model, batch = _tiny_bf16_model(), torch.randn(512, 256)
    peaks = {isa: memguard.estimate(model, batch, loss_fn=lambda m, b: m(b).pow(2).mean(), device="cpu",
                                    precision="bf16-true", cpu=isa).peak_bytes
             for isa in ("avx2", "avx512_core", "avx512_core_bf16", "avx512_core_amx")}
    # AVX2: ATen's gemm, nothing extra. avx512_core: gemm:jit:bf16's fp32 accumulator of a whole
    # output ([512, 1024]: 2 MiB in the first layer's forward) is larger than the brgemm path's
    # per-thread blocks (tens of KiB)
    assert peaks["avx2"] < peaks["avx512_core_bf16"] < peaks["avx512_core"]
    assert peaks["avx512_core_amx"] == peaks["avx512_core_bf16"]  # see onednn_matmul's Known limitations


def test_cpu_is_checked_with_the_other_arguments():
    with pytest.raises(ConfigError) as info:
        memguard.estimate(_tiny_bf16_model(), torch.randn(4, 256), device="cuda", cpu="avx2", precision="fp8")
    # the planner checks it the same way
    with pytest.raises(ConfigError, match="cpu='avx9'"):
        memguard.plan(_tiny_bf16_model(), torch.randn(4, 256), global_batch_size=8, device="cpu", cpu="avx9",
                      budget_bytes=1 << 30, loss_fn=lambda m, b: m(b).pow(2).mean())
    text = str(info.value)
    assert "cpu='avx2' only applies to device='cpu'" in text and "fp8" in text


@pytest.mark.parametrize(
    "shape, kwargs, expected",
    [
        # measured on an AVX-512 BF16 host (torch 2.13, oneDNN 3.12, 1 thread): the brgemm blocks
        ((256, 64, 64), {}, 74752),
        ((4096, 4096, 4096), {}, 1721472),  # large power-of-two K: oneDNN copies A blocks too
        ((2048, 1024, 512), {"a_transposed": True}, 869504),  # the weight gradient of a linear layer
        ((8192, 3072, 768), {"threads": 2}, 394880),  # per-thread buffers
        # at ONEDNN_MAX_CPU_ISA=AVX512_CORE: gemm:jit:bf16's fp32 accumulator, 4*m*n + 128
        ((1024, 512, 2048), {"isa": "avx512_core"}, 4 * 1024 * 2048 + 128),
    ],
)
def test_matmul_scratchpad_table(shape, kwargs, expected):
    assert matmul_scratchpad_bytes(*shape, **kwargs) == expected
