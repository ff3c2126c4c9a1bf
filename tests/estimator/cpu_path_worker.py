"""Subprocess worker for ``test_cpu_kernels.py``: real CPU kernels at the instruction-set level the
parent pinned (``ONEDNN_MAX_CPU_ISA`` must be set before torch loads oneDNN, hence a process).

``python cpu_path_worker.py '{"ops": true, "steps": [[CASE, PRECISION], ...]}'`` prints one JSON
line: the level this process's oneDNN runs at (``memguard.estimator._cpu_kernels.host_isa``); with
``ops``, per op of :data:`OPS` what the real kernel allocated
(``benchmarks.ground_truth.measure_op_memory``); per step case, the real steady-state peak of a
training step and memguard's CPU estimate for this host.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import memguard  # noqa: E402
from benchmarks.ground_truth import measure_cpu_peak, measure_op_memory  # noqa: E402
from memguard.estimator._cpu_kernels import host_isa  # noqa: E402


def _conv(n, c, h, o, k, dtype, groups=1, stride=1, pad=0, channels_last=False):
    def make(_device):
        x = torch.randn(n, c, h, h, dtype=dtype)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        w = torch.randn(o, c // groups, k, k, dtype=dtype, requires_grad=True)
        return x.requires_grad_(), w, torch.randn(o, dtype=dtype, requires_grad=True)

    return (lambda x, w, b: F.conv2d(x, w, b, stride=stride, padding=pad, groups=groups)), make


def _mm(m, k, n, dtype, transposed=False):
    def make(_device):
        a = torch.randn(m, k, dtype=dtype, requires_grad=True)
        b = torch.randn(n, k, dtype=dtype).t() if transposed else torch.randn(k, n, dtype=dtype)
        return a, b.detach().requires_grad_()

    return (lambda a, b: a @ b), make


def _bmm(batch, m, k, n, dtype):
    return (lambda a, b: torch.bmm(a, b)), (lambda _d: (torch.randn(batch, m, k, dtype=dtype, requires_grad=True),
                                                      torch.randn(batch, k, n, dtype=dtype, requires_grad=True)))


def _linear(rows, i, o, dtype):
    return F.linear, (lambda _d: (torch.randn(rows, i, dtype=dtype, requires_grad=True),
                                  torch.randn(o, i, dtype=dtype, requires_grad=True),
                                  torch.randn(o, dtype=dtype, requires_grad=True)))


BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

#: name -> (op, make_inputs); the test holds what each is expected to show
OPS = {
    "mm-bf16": _mm(256, 64, 64, BF16),
    "mm-bf16-large": _mm(1024, 512, 2048, BF16),
    "mm-bf16-transposed": _mm(512, 256, 384, BF16, transposed=True),
    "bmm-bf16": _bmm(8, 128, 64, 128, BF16),
    "linear-bf16": _linear(256, 64, 256, BF16),
    "mm-fp16": _mm(256, 64, 64, FP16),
    "mm-fp32": _mm(256, 64, 64, FP32),
    "conv3x3-bf16": _conv(8, 32, 32, 64, 3, BF16, pad=1),
    "conv3x3-fp32": _conv(8, 32, 32, 64, 3, FP32, pad=1),
    "conv3x3-fp16": _conv(8, 32, 32, 64, 3, FP16, pad=1),
    "dwconv7x7-bf16": _conv(8, 64, 16, 64, 7, BF16, groups=64, pad=3),
    "dwconv7x7-fp32": _conv(8, 64, 16, 64, 7, FP32, groups=64, pad=3),
    "stem4x4-bf16": _conv(8, 3, 64, 64, 4, BF16, stride=4),
    "conv1x1-bf16": _conv(16, 64, 16, 256, 1, BF16),
}


class ResMLP(nn.Module):
    """Linear -> 3 residual GELU blocks -> Linear; returns the MSE loss."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.inp, self.head = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
                                    for _ in range(3))

    def forward(self, x, y):
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return (self.head(h) - y).pow(2).mean()


class ConvNeXtBlock(nn.Module):
    """ConvNeXt (Liu et al. 2022): depthwise 7x7, LayerNorm, pointwise MLP as Linear layers, residual."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = nn.LayerNorm(c)
        self.pw1, self.pw2 = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

    def forward(self, x):
        y = self.norm(self.dw(x).permute(0, 2, 3, 1))
        return x + self.pw2(F.gelu(self.pw1(y))).permute(0, 3, 1, 2)


class ConvNeXt(nn.Module):
    def __init__(self, c: int = 64, depth: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 4, stride=4)
        self.blocks = nn.Sequential(*(ConvNeXtBlock(c) for _ in range(depth)))
        self.head = nn.Linear(c, 10)

    def forward(self, x, y):
        return F.cross_entropy(self.head(self.blocks(self.stem(x)).mean((2, 3))), y)


class ConvNet(nn.Module):
    """A VGG/ResNet-style stack of 3x3 convolutions on NCHW activations, with a strided stage."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1),
                                  nn.ReLU(), nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(),
                                  nn.Conv2d(64, 64, 3, padding=1), nn.ReLU())
        self.head = nn.Linear(64, 10)

    def forward(self, x, y):
        return F.cross_entropy(self.head(self.body(x).mean((2, 3))), y)


def _case(name: str):
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if name == "resmlp":
        return ResMLP(), (torch.randn(256, 64, generator=g), torch.randn(256, 64, generator=g))
    if name == "convnext":
        return ConvNeXt(), (torch.randn(16, 3, 64, 64, generator=g), torch.randint(0, 10, (16,), generator=g))
    if name == "convnet":
        return ConvNet(), (torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g))
    raise KeyError(name)


def _step(case: str, precision: str) -> dict:
    model, batch = _case(case)
    est = memguard.estimate(model, batch, device="cpu", precision=precision)
    dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float16 if precision.startswith("16") else None
    if precision.endswith("-true") and dtype is not None:
        model = copy.deepcopy(model).to(dtype)
        batch = tuple(t.to(dtype) if t.is_floating_point() else t for t in batch)
        loss_fn = None
    elif dtype is not None:
        def loss_fn(m, b):
            with torch.autocast("cpu", dtype=dtype):
                return m(*b)
    else:
        loss_fn = None
    real = measure_cpu_peak(model, batch, loss_fn, torch.optim.AdamW(model.parameters()), steps=2)
    return {"estimate": est.peak_bytes, "real": real.steady_peak_bytes}


def main() -> None:
    torch.set_num_threads(1)
    cfg = json.loads(sys.argv[1])
    out: dict = {"isa": host_isa(), "ops": {}, "steps": {}}
    if cfg.get("ops"):
        out["ops"] = {name: dataclasses.asdict(measure_op_memory(op, make)) for name, (op, make) in OPS.items()}
    for case, precision in cfg.get("steps", []):
        out["steps"][f"{case}/{precision}"] = _step(case, precision)
    print("@@RESULT@@ " + json.dumps(out))


if __name__ == "__main__":
    main()
