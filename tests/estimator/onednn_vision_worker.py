"""Subprocess worker for ``test_onednn_vision.py``: real oneDNN convolution kernels of vision models at
the instruction-set level the parent pinned (``ONEDNN_MAX_CPU_ISA`` is read once, when oneDNN loads).

``python onednn_vision_worker.py '{"ops": true, "steps": ["hf-resnet", ...]}'`` prints one JSON line:
the level this process's oneDNN runs at; with ``ops``, per op of :data:`OPS` what the real kernel
allocated (``benchmarks.ground_truth.measure_op_memory``); per zoo case of ``steps``, the real
steady-state peak of a training step and memguard's CPU estimate of it for this host.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import memguard  # noqa: E402
from benchmarks.ground_truth import measure_cpu_peak, measure_op_memory  # noqa: E402
from benchmarks.zoo import CASES, real_step  # noqa: E402
from memguard.estimator._cpu_kernels import host_isa  # noqa: E402

BF16, FP32 = torch.bfloat16, torch.float32


def _conv(n, c, h, o, k, dtype, groups=1, pad=0, stride=1, channels_last=False):
    """A convolution with bias whose input does not need a gradient: the backward is the weight
    gradient alone, the part of the kernel these cases exercise."""

    def make(_device):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(n, c, h, h, generator=g, dtype=dtype)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        w = torch.randn(o, c // groups, k, k, generator=g, dtype=dtype)
        return x, w.requires_grad_(), torch.randn(o, generator=g, dtype=dtype).requires_grad_()

    return (lambda x, w, b: F.conv2d(x, w, b, stride=stride, padding=pad, groups=groups)), make


#: name -> (op, make_inputs, dtype); the test says what each is expected to show
OPS = {
    # ConvNeXt's depthwise 7x7 on channels-last activations: the direct kernel's grouped weight layout
    "dw7x7-cl-bf16": (*_conv(8, 128, 4, 128, 7, BF16, groups=128, pad=3, channels_last=True), BF16),
    "dw7x7-cl-fp32": (*_conv(8, 64, 16, 64, 7, FP32, groups=64, pad=3, channels_last=True), FP32),
    # depthwise 7x7 on NCHW: gemm:jit, in bf16 and in fp32
    "dw7x7-nchw-bf16": (*_conv(8, 64, 16, 64, 7, BF16, groups=64, pad=3), BF16),
    "dw7x7-nchw-fp32": (*_conv(8, 64, 16, 64, 7, FP32, groups=64, pad=3), FP32),
    # a ResNet's last stage: a 3x3 kernel on a 2x2 map (gemm:jit on AVX2, direct on AVX-512)
    "3x3-on-2x2-fp32": (*_conv(8, 256, 2, 256, 3, FP32, pad=1), FP32),
    # a 15-wide kernel: gemm:jit on every level
    "15x15-fp32": (*_conv(4, 32, 8, 32, 15, FP32, pad=7), FP32),
    # output channels not a multiple of the block: the direct kernel's padded bias
    "3x3-oc20-fp32": (*_conv(8, 32, 8, 20, 3, FP32, pad=1), FP32),
}


def _step(name: str) -> dict:
    case = CASES[name]
    model, batch, loss_fn = case.build("cpu")
    est = memguard.estimate(model, batch, optimizer=case.optimizer, loss_fn=loss_fn, device="cpu",
                            precision=case.precision)
    model, batch, loss_fn = real_step(model, batch, loss_fn, case.precision)
    real = measure_cpu_peak(model, batch, loss_fn, case.optimizer(model.parameters()), steps=2)
    return {"estimate": est.peak_bytes, "real": real.steady_peak_bytes}


def main() -> None:
    torch.set_num_threads(1)
    cfg = json.loads(sys.argv[1])
    out: dict = {"isa": host_isa(), "ops": {}, "steps": {}}
    if cfg.get("ops"):
        out["ops"] = {name: dataclasses.asdict(measure_op_memory(op, make)) for name, (op, make, _) in OPS.items()}
    for name in cfg.get("steps", []):
        out["steps"][name] = _step(name)
    print("@@RESULT@@ " + json.dumps(out))


if __name__ == "__main__":
    main()
