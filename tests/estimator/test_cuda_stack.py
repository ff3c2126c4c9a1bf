"""The CUDA target's software stack: ``torch_version=``, ``cuda_version=``, ``cudnn_version=``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memguard
from memguard.errors import ConfigError
from memguard.estimator._cuda import (
    BLAS_HANDLES_PER_TRAINING_STEP,
    allocator_config,
    blas_workspace_allocations,
    parse_torch_version,
    round_size,
)
from memguard.estimator._cuda_kernels import CudaTarget
from memguard.estimator._targets import (
    SUPPORTED_TORCH,
    USUAL_STACKS,
    CudaStack,
    cudnn_text,
    resolve_stack,
    stack_of,
    target_gpu,
)
from memguard.estimator.gpus import GPUS

MiB = 1 << 20


def _mlp() -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))


def _loss(model, batch):
    return model(batch).square().mean()


@pytest.mark.parametrize(
    "torch_version, cuda, cudnn",
    [
        # the default PyPI wheels: CUDA_STABLE of generate_binary_build_matrix.py and the cuDNN pin
        ("2.0.1", (11, 8), 8700),  # cu117 has no sm_90: the cu118 wheel, nvidia-cudnn-cu11==8.7.0.84
        ("2.4.1", (12, 1), 90100),  # cu121, nvidia-cudnn-cu12==9.1.0.70
        ("2.8.0", (12, 8), 91002),  # cu128, nvidia-cudnn-cu12==9.10.2.21
        ("2.13.0", (13, 0), 92000),  # cu130, nvidia-cudnn-cu13==9.20.0.48
    ],
)
def test_a_torch_release_brings_its_default_wheels_cuda_and_cudnn(torch_version, cuda, cudnn):
    problems: list[str] = []
    stack = resolve_stack(GPUS["H100-80GB"], torch_version=torch_version, problems=problems)
    assert problems == []
    assert stack == CudaStack(torch=parse_torch_version(torch_version), cuda=cuda, cudnn=cudnn)


def test_torch_2_0_on_an_a100_is_the_default_cu117_wheel():
    stack = resolve_stack(GPUS["A100-80GB"], torch_version="2.0.1", problems=[])
    assert stack == CudaStack(torch=(2, 0), cuda=(11, 7), cudnn=8500)  # nvidia-cudnn-cu11==8.5.0.96


def test_every_modelled_release_has_a_usual_stack():
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED_TORCH
    assert lo_major == hi_major == 2
    assert sorted(USUAL_STACKS) == [(2, m) for m in range(lo_minor, hi_minor + 1)]


@pytest.mark.parametrize("text, number", [("9.10.2", 91002), ("8.9.2", 8902), ("9.1", 90100), (91600, 91600),
                                          ("9.20.0.48", 92000)])
def test_cudnn_versions_read_as_torch_numbers_them(text, number):
    # cudnn.h CUDNN_VERSION: MAJOR*1000 + MINOR*100 + PATCH before 9, MAJOR*10000 + ... from 9
    stack = resolve_stack(GPUS["A100-80GB"], cudnn_version=text, problems=[])
    assert stack.cudnn == number
    assert cudnn_text(91002) == "9.10.2" and cudnn_text(8902) == "8.9.2"


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"torch_version": "1.13.1"}, "from 2.0 to 2.13"),
        ({"torch_version": "2.14"}, "from 2.0 to 2.13"),
        ({"torch_version": "latest"}, "from 2.0 to 2.13"),
        ({"cuda_version": "10.2"}, "from 11.7 to 13.2"),
        ({"cudnn_version": "7.6.5"}, "from 8.5.0 to 9.x"),
        ({"cuda_version": "11.7"}, "needs CUDA >= 11.8"),  # H100 (sm90) on torch 2.0's cu117
    ],
)
def test_unsupported_versions_name_the_supported_range(kwargs, says):
    problems: list[str] = []
    assert target_gpu("cuda", "H100-80GB", problems, **kwargs) is None or problems
    assert len(problems) == 1 and says in problems[0]


def test_versions_on_rocm_or_the_cpu_are_refused_with_what_to_do():
    problems: list[str] = []
    target_gpu("cuda", "MI300X", problems, cuda_version="12.4", cudnn_version="9.1")
    assert len(problems) == 2 and all("AMD GPU" in p and "drop it" in p for p in problems)
    problems = []
    target_gpu("cpu", None, problems, torch_version="2.4")
    assert problems and "only applies to device='cuda'" in problems[0]
    with pytest.raises(ConfigError, match="from 2.0 to 2.13"):
        memguard.estimate(_mlp(), torch.randn(4, 64), gpu="A100-80GB", torch_version="1.12")


def test_without_versions_the_spec_is_the_catalogs_and_the_stack_the_hosts():
    problems: list[str] = []
    spec = target_gpu("cuda", "A100-80GB", problems)
    assert spec is GPUS["A100-80GB"] and spec.stack is None
    host = parse_torch_version(None)
    assert stack_of(spec).torch == host
    target = CudaTarget.for_spec(spec)
    assert (target.torch_version, target.cuda_version, target.cudnn_version) == (host, *USUAL_STACKS[host])


def test_cuda_target_carries_the_requested_stack():
    spec = target_gpu("cuda", "H100-80GB", [], torch_version="2.5.1", cuda_version="12.4", cudnn_version="9.1.0")
    target = CudaTarget.for_spec(spec)
    assert target.torch_version == (2, 5) and target.cuda_version == (12, 4) and target.cudnn_version == 90100
    assert target.capability == (9, 0)


@pytest.mark.parametrize("torch_version", ["2.4.1", "2.9.0", "2.13.0"])
def test_blas_workspaces_follow_the_target_torch(torch_version):
    # cuBLASLt kept its own persistent 1 MiB per handle in torch 2.8-2.10 (pytorch/pytorch#156495),
    # unified with cuBLAS's from 2.11 (pytorch/pytorch#168175): blas_workspace_allocations
    est = memguard.estimate(_mlp(), torch.randn(16, 64), loss_fn=_loss, gpu="A100-80GB", torch_version=torch_version)
    per_handle = sum(blas_workspace_allocations((8, 0), torch_version))
    assert est.breakdown["workspace"] == BLAS_HANDLES_PER_TRAINING_STEP * per_handle
    assert any("target stack: torch " + torch_version.rsplit(".", 1)[0] in n for n in est.notes)


def test_allocator_options_follow_the_target_torch(monkeypatch):
    # roundup_power2_divisions' ">" entry: torch >= 2.9 fills from the interval after the last one
    # named (AllocatorConfig.cpp), torch < 2.9 from that interval itself (CUDAAllocatorConfig.cpp).
    # [512:4,>:2] and a 600 MiB request: 4 divisions of [512, 1024) MiB round it to 640 MiB in 2.13,
    # 2 divisions to 768 MiB in 2.8
    conf = "roundup_power2_divisions:[512:4,>:2]"
    assert round_size(600 * MiB, allocator_config(conf, torch_version="2.13")) == 640 * MiB
    assert round_size(600 * MiB, allocator_config(conf, torch_version="2.8")) == 768 * MiB
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
    with torch.device("meta"):
        model = nn.Linear(600 * MiB // 4 // 1024, 1024, bias=False)  # a 600 MiB fp32 weight
    peaks = {v: memguard.estimate(model, torch.randn(1, model.in_features), loss_fn=_loss, gpu="A100-80GB",
                                  torch_version=v, optimizer=lambda p: torch.optim.SGD(p, lr=0.1)).peak_bytes
             for v in ("2.8", "2.13")}
    # the weight, its gradient: two 600 MiB blocks, each 128 MiB larger in 2.8
    assert peaks["2.8"] - peaks["2.13"] >= 2 * 128 * MiB


def test_plan_takes_the_stack_and_refuses_a_bad_one():
    with pytest.raises(ConfigError, match="from 11.7 to 13.2"):
        memguard.plan(_mlp(), torch.randn(4, 64), global_batch_size=8, gpu="A100-80GB", cuda_version="9.0")


@pytest.mark.parametrize("torch_version, cuda, cudnn, expected", [
    # check_prefer_cudnn_attention (cuda/sdp_utils.cpp, torch 2.13): cuDNN > 9.15.0 on sm90 puts cuDNN
    # first; torch 2.13's default wheel has cuDNN 9.20.0 (CUDA 13.0)
    ("2.13.0", None, None, "cudnn"),
    # the same release with the cu126 wheel's cuDNN 9.10.2: the default order, flash first
    ("2.13.0", "12.6", "9.10.2", "flash"),
])
def test_sdpa_prefers_cudnn_attention_by_the_target_stack(torch_version, cuda, cudnn, expected):
    from memguard.estimator._cuda_attention import SdpaCall, SdpaSettings, select_sdpa_backend

    spec = target_gpu("cuda", "H100-80GB", [], torch_version=torch_version, cuda_version=cuda, cudnn_version=cudnn)
    target = CudaTarget.for_spec(spec)
    q = torch.empty(2, 8, 256, 64, dtype=torch.bfloat16, device="meta", requires_grad=True)
    got = select_sdpa_backend(target, SdpaCall(q, q, q), settings=SdpaSettings(),
                              cudnn_version=target.cudnn_version, cuda_major=target.cuda_version[0])
    assert got == expected


def test_evaluation_estimates_take_the_stack_too():
    with pytest.raises(ConfigError, match="from 2.0 to 2.13"):
        memguard.estimate(_mlp(), torch.randn(4, 64), gpu="A100-80GB", train=False, torch_version="1.13")
    est = memguard.estimate(_mlp(), torch.randn(4, 64), gpu="A100-80GB", train=False, torch_version="2.9")
    assert any("target stack: torch 2.9, CUDA 12.8, cuDNN 9.10.2" in n for n in est.notes)
