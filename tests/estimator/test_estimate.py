"""Tests of ``memguard.estimate``: what it accepts, what it leaves alone, and how close it is.

Where a real CPU reference is cheap, the estimate for ``device="cpu"`` is compared with the
peak of live tensor bytes of two real CPU training steps measured by ``torch.profiler``
(``benchmarks.ground_truth.measure_cpu_peak``): the issue's goal is |error| <= 3% per model.
Other expectations are derived from the byte layout of the tensors involved (float32 = 4 bytes,
bfloat16 = 2 bytes) and the state each ``torch.optim`` optimizer keeps, measured on a real
optimizer after a real step.
"""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import memguard
from memguard import ConfigError, Estimate
from memguard.estimator._cuda import BLAS_HANDLES_PER_TRAINING_STEP, blas_workspace_config, cublas_workspace_bytes
from memguard.estimator.gpus import GENERIC, current_gpu, get_gpu
from memguard.estimator._result import CATEGORIES

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `benchmarks`

from benchmarks.ground_truth import measure_cpu_peak  # noqa: E402

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

MiB = 1 << 20
FP32 = 4  # bytes per float32 element
BF16 = 2  # bytes per bfloat16 / float16 element
TOLERANCE = 0.03  # the accuracy goal for one model: |estimate / real - 1| <= 3%


# ----------------------------------------------------------------------------------- models
class Block(nn.Module):
    """A pre-norm residual MLP block (a transformer block without attention)."""

    def __init__(self, dim: int, norm: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim) if norm else nn.Identity()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(F.gelu(self.up(self.norm(x)))))


class ResMLP(nn.Module):
    """``inp -> blocks -> head``; returns the loss itself (scalar) so no ``loss_fn`` is needed.

    ``ckpt`` wraps each block in ``torch.utils.checkpoint`` inside the model's own forward:
    ``"reentrant"``, ``"non-reentrant"`` or None.
    """

    def __init__(self, dim: int = 64, blocks: int = 3, norm: bool = False, ckpt: str | None = None) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(Block(dim, norm) for _ in range(blocks))
        self.head = nn.Linear(dim, dim)
        self.ckpt = ckpt

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            if self.ckpt is None:
                h = block(h)
            else:
                h = checkpoint(block, h, use_reentrant=self.ckpt == "reentrant")
        out = self.head(h)
        return out.pow(2).mean() if y is None else (out - y).pow(2).mean()


class TiedLM(nn.Module):
    """Embedding and output projection share one weight (as GPT-2 does)."""

    def __init__(self, vocab: int = 512, dim: int = 32, tie: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.mix(self.embed(ids))))
        return F.cross_entropy(logits.flatten(0, 1), ids.flatten())


def build(cls, *args, device: str = "cpu", seed: int = 0, **kwargs) -> nn.Module:
    torch.manual_seed(seed)
    with torch.device(device):
        return cls(*args, **kwargs)


def gpt2(device: str = "cpu", **overrides) -> nn.Module:
    cfg = dict(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4)
    cfg.update(overrides)
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(**cfg)).train()


def llama(attn: str, device: str = "cpu") -> nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, attn_implementation=attn,
    )
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.LlamaForCausalLM(cfg).train()


def lm_batch(batch: int = 2, seq: int = 32, vocab: int = 256) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def relative_error(estimated: int, real: int) -> float:
    return estimated / real - 1.0


@pytest.fixture
def one_thread():
    """Real CPU steps on one thread: deterministic allocations, fair to other users of the CPU."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


# ------------------------------------------------------------------- result shape, targets
def test_cpu_target_result():
    model = build(ResMLP)
    est = memguard.estimate(model, randn(8, 64), device="cpu")
    assert isinstance(est, Estimate)
    assert est.device == "cpu" and est.gpu is None and est.context_bytes == 0
    assert est.peak_bytes == est.allocated_peak_bytes  # CPU: live tensor bytes, nothing reserved
    assert sum(est.breakdown.values()) == est.peak_bytes
    assert set(est.breakdown) <= set(CATEGORIES[:6])  # tensor categories only on the CPU target
    assert "allocator_overhead" not in est.breakdown and "workspace" not in est.breakdown
    assert est.peak_phase in ("forward", "backward", "optimizer", "zero_grad")
    # the peak is the largest of the phase peaks
    assert max(est.phase_peaks.values()) == est.peak_bytes
    assert est.micro_batch_size == 8
    assert est.num_params == sum(p.numel() for p in model.parameters())
    assert est.num_trainable_params == est.num_params


def test_cuda_target_result_without_a_gpu_name():
    est = memguard.estimate(build(ResMLP), randn(64, 64), device="cuda", precision="bf16-mixed")
    assert est.device == "cuda"
    spec = current_gpu() or GENERIC  # none named: the visible device's constants, else generic ones
    assert est.gpu == spec.name
    assert est.context_bytes == spec.context_bytes > 0
    # one cuBLAS (and, on some versions, cuBLASLt) workspace per handle, two handles per step
    expected = BLAS_HANDLES_PER_TRAINING_STEP * cublas_workspace_bytes(
        spec.compute_capability, vendor=spec.vendor, cublas_workspace_config=blas_workspace_config(spec.vendor))
    assert est.breakdown["workspace"] == expected
    assert est.breakdown["allocator_overhead"] >= 0
    assert est.peak_bytes >= est.allocated_peak_bytes
    assert sum(est.breakdown.values()) == est.peak_bytes
    # every segment of the caching allocator is a multiple of 2 MiB (small segments are 2 MiB,
    # large ones 20 MiB or rounded up to 2 MiB: c10/cuda/CUDACachingAllocator.cpp)
    assert est.peak_bytes % (2 * MiB) == 0
    assert est.total_bytes == est.peak_bytes + est.context_bytes


def test_cuda_target_catalog_gpu():
    model, batch = build(ResMLP), randn(64, 64)
    a100 = memguard.estimate(model, batch, device="cuda", precision="bf16-mixed", gpu="A100-80GB")
    spec = get_gpu("A100-80GB")
    assert a100.gpu == "A100-80GB"
    assert a100.context_bytes == spec.context_bytes
    # an alias resolves to the same entry, with the same result
    alias = memguard.estimate(model, batch, device="cuda", precision="bf16-mixed", gpu="NVIDIA A100-SXM4-80GB")
    assert alias == a100


def test_unknown_gpu_is_a_config_error_naming_the_catalog():
    with pytest.raises(ConfigError) as info:
        memguard.estimate(build(ResMLP), randn(4, 64), device="cuda", gpu="Z9000-1TB")
    assert "Z9000" in str(info.value) and "A100-80GB" in str(info.value)


def test_gpu_on_cpu_target_is_a_config_error():
    with pytest.raises(ConfigError, match="device='cuda'"):
        memguard.estimate(build(ResMLP), randn(4, 64), device="cpu", gpu="A100-80GB")


def test_cuda_and_cpu_targets_share_the_tensor_trace_in_fp32():
    """In fp32 nothing about the tensors differs between the targets except the optimizer's
    default ``foreach`` (on CUDA tensors torch.optim uses the multi-tensor path), so params, grads
    and optimizer state must be the same bytes."""
    model, batch = build(ResMLP), randn(256, 64)
    cpu = memguard.estimate(model, batch, device="cpu")
    cuda = memguard.estimate(model, batch, device="cuda")
    for cat in ("params", "optimizer", "inputs"):
        assert cuda.breakdown.get(cat, 0) == cpu.breakdown.get(cat, 0), cat


# ------------------------------------------------------------------ meta / real weights
def test_meta_and_real_weights_give_the_same_estimate():
    # an HF model (tied embeddings, buffers built on meta) on the CPU target, and a plain model on
    # the CUDA target (allocator model and autocast emulation)
    batch = lm_batch()
    assert memguard.estimate(gpt2("meta"), batch, device="cpu") == memguard.estimate(gpt2("cpu"), batch, device="cpu")
    x = randn(32, 64)
    on_meta = memguard.estimate(build(ResMLP, device="meta"), x, device="cuda", precision="bf16-mixed")
    on_cpu = memguard.estimate(build(ResMLP, device="cpu"), x, device="cuda", precision="bf16-mixed")
    assert on_meta == on_cpu


def test_user_model_and_rng_are_left_exactly_as_they_were():
    model = build(ResMLP, norm=True).eval()  # eval: the estimate traces a train step on its own copy
    model.blocks[0].up.weight.requires_grad_(False)
    params = list(model.parameters())
    before = [(p, p.data_ptr(), p.untyped_storage().data_ptr(), p.detach().clone(), p.requires_grad) for p in params]
    buffers = [(b, b.data_ptr(), b.detach().clone()) for b in model.buffers()]
    batch = randn(16, 64)
    batch_before = batch.clone()
    torch.manual_seed(1234)
    rng = torch.get_rng_state()

    memguard.estimate(model, batch, device="cpu")
    memguard.estimate(model, batch, device="cuda", precision="16-mixed", activation_checkpointing=True)

    assert torch.equal(torch.get_rng_state(), rng)  # dropout in the traced copy drew nothing
    assert model.training is False
    assert all(not m.training for m in model.modules())
    after = list(model.parameters())
    assert len(after) == len(before)
    for p_after, (p, ptr, storage_ptr, values, requires_grad) in zip(after, before):
        assert p_after is p  # the same Parameter objects
        assert p.device.type == "cpu"
        assert p.data_ptr() == ptr and p.untyped_storage().data_ptr() == storage_ptr
        assert torch.equal(p.detach(), values)
        assert p.grad is None
        assert p.requires_grad is requires_grad
    for b, ptr, values in buffers:
        assert b.data_ptr() == ptr and torch.equal(b, values)
    assert torch.equal(batch, batch_before)
    # nothing memguard wraps is left on the user's blocks
    assert all("forward" not in block.__dict__ for block in model.blocks)


def test_existing_gradients_are_left_alone():
    model = build(ResMLP)
    model(randn(4, 64)).backward()
    grads = [(p.grad, p.grad.clone()) for p in model.parameters()]
    memguard.estimate(model, randn(4, 64), device="cpu")
    for p, (g, values) in zip(model.parameters(), grads):
        assert p.grad is g and torch.equal(g, values)


def test_real_weights_are_not_copied():
    """The estimate allocates no real memory for weights: the real CPU allocator, watched by the
    profiler, never holds more than a few KiB while the model's weights are 16 MiB."""
    from torch.profiler import ProfilerActivity, profile

    model = build(nn.Sequential, nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 1024))
    weights = sum(p.numel() * FP32 for p in model.parameters())
    assert weights > 16 * MiB
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        est = memguard.estimate(model, randn(4, 1024), loss_fn=lambda m, b: m(b).mean(), device="cpu")
    live = peak = 0
    for event in prof.profiler.kineto_results.events():
        if event.name() == "[memory]":
            live += event.nbytes()
            peak = max(peak, live)
    assert peak < 1 * MiB  # a copy of the smallest weight matrix alone would be 8 MiB
    assert est.breakdown["params"] == weights  # while the estimate counts them in full


# ------------------------------------------------------------- tied, frozen, buffers
def test_tied_weights_are_counted_once():
    tied = memguard.estimate(build(TiedLM), torch.zeros(2, 8, dtype=torch.long), device="cpu")
    untied = memguard.estimate(build(TiedLM, tie=False), torch.zeros(2, 8, dtype=torch.long), device="cpu")
    shared = 512 * 32  # the embedding matrix, shared with the head when tied
    assert untied.num_params - tied.num_params == shared
    assert tied.num_params == sum(p.numel() for p in build(TiedLM).parameters())  # parameters() dedups
    assert untied.breakdown["params"] - tied.breakdown["params"] == shared * FP32


def test_frozen_parameters_get_no_gradients_and_no_optimizer_state():
    model = build(ResMLP)
    for p in model.inp.parameters():
        p.requires_grad_(False)
    for p in model.blocks[0].parameters():
        p.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    n_trainable = sum(p.numel() for p in trainable)
    est = memguard.estimate(model, randn(2, 64), device="cpu", optimizer=lambda ps: torch.optim.AdamW(
        [p for p in ps if p.requires_grad]))
    # a tiny batch: AdamW's per-parameter temporaries make the optimizer step the peak, where
    # every gradient is live
    assert est.peak_phase == "optimizer"
    assert est.num_trainable_params == n_trainable < est.num_params
    assert est.breakdown["grads"] == n_trainable * FP32
    # AdamW: exp_avg and exp_avg_sq (fp32) plus a 0-dim fp32 `step` per parameter (torch/optim/adamw.py)
    assert est.breakdown["optimizer"] == 2 * n_trainable * FP32 + len(trainable) * FP32


def test_frozen_parameters_passed_to_an_optimizer_get_no_state():
    """torch.optim skips parameters whose grad is None, so even an optimizer given every parameter
    creates no state for frozen ones."""
    model = build(ResMLP)
    for p in model.blocks.parameters():
        p.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    est = memguard.estimate(model, randn(2, 64), device="cpu", optimizer=lambda ps: torch.optim.AdamW(ps))
    n = sum(p.numel() for p in trainable)
    assert est.breakdown["optimizer"] == 2 * n * FP32 + len(trainable) * FP32


class WithBuffers(ResMLP):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.zeros(256, 1024))  # 1 MiB persistent buffer
        self.register_buffer("scratch", torch.zeros(128, 1024), persistent=False)  # 0.5 MiB

    def forward(self, x, y=None):
        return super().forward(x, y) + self.table[0, 0] + self.scratch[0, 0]


def test_buffers_are_counted_as_model_state():
    plain = memguard.estimate(build(ResMLP), randn(2, 64), device="cpu")
    buffered = memguard.estimate(build(WithBuffers), randn(2, 64), device="cpu")
    assert buffered.breakdown["params"] - plain.breakdown["params"] == (256 + 128) * 1024 * FP32
    assert buffered.num_params == plain.num_params  # buffers are not parameters
    assert buffered.breakdown["grads"] == plain.breakdown["grads"]


def test_batchnorm_buffers_are_not_updated():
    model = build(nn.Sequential, nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 1))
    bn = model[1]
    mean, var, tracked = bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone()
    memguard.estimate(model, randn(8, 16), loss_fn=lambda m, b: m(b).mean(), device="cpu")
    assert torch.equal(bn.running_mean, mean) and torch.equal(bn.running_var, var)
    assert torch.equal(bn.num_batches_tracked, tracked)


# ----------------------------------------------------------------------------- batches
def test_dict_tuple_list_batches_are_equivalent():
    model = build(ResMLP)
    x, y = randn(32, 64), randn(32, 64, seed=1)
    as_dict = memguard.estimate(model, {"x": x, "y": y}, device="cpu")  # model(**batch)
    as_tuple = memguard.estimate(model, (x, y), device="cpu")  # model(*batch)
    as_list = memguard.estimate(model, [x, y], device="cpu")
    with_loss_fn = memguard.estimate(model, (x, y), loss_fn=lambda m, b: m(b[0], b[1]), device="cpu")
    assert as_dict == as_tuple == as_list == with_loss_fn
    assert as_dict.breakdown["inputs"] == (x.numel() + y.numel()) * FP32
    assert as_dict.micro_batch_size == 32


def test_tensor_batch():
    x = randn(32, 64)
    est = memguard.estimate(build(ResMLP), x, device="cpu")  # model(batch) returns the scalar loss
    assert est.breakdown["inputs"] == x.numel() * FP32
    assert est.micro_batch_size == 32


def test_a_batch_encoding_like_mapping_is_a_batch():
    from collections import UserDict

    class Encoding(UserDict):
        """HF's BatchEncoding is a UserDict, not a dict."""

    # any Mapping is passed as **batch and faked leaf by leaf, so it is the same step as a dict
    plain = memguard.estimate(gpt2(), lm_batch(), device="cpu")
    assert memguard.estimate(gpt2(), Encoding(lm_batch()), device="cpu") == plain


def test_hf_model_output_loss_is_used():
    est = memguard.estimate(gpt2(), lm_batch(), device="cpu")
    # without loss_fn the model is called with **batch and its output's .loss is the loss: the very
    # same step as the explicit loss_fn, so the same estimate
    assert est == memguard.estimate(gpt2(), lm_batch(), device="cpu", loss_fn=lambda m, b: m(**b).loss)
    assert est.micro_batch_size == 2


# -------------------------------------------------------------------------- optimizers
def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
               if isinstance(t, torch.Tensor))


def _real_state_bytes(factory, model) -> int:
    """Bytes of optimizer state after one real CPU step (lazily created state included)."""
    real = copy.deepcopy(model)
    opt = factory(real.parameters())
    real(randn(2, 64)).backward()
    opt.step()
    return _state_bytes(opt)


def _fused_supported(factory) -> bool:
    try:
        p = nn.Parameter(torch.zeros(2))
        opt = factory([p])
        p.grad = torch.zeros(2)
        opt.step()
        return True
    except (RuntimeError, ValueError, TypeError):
        return False


OPTIMIZERS = {
    # name: factory; the expected state is measured on a real optimizer after a real step
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),  # no state
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),  # momentum_buffer
    "sgd-momentum-fused": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
    "adam": lambda ps: torch.optim.Adam(ps),  # exp_avg, exp_avg_sq, step
    "adam-foreach": lambda ps: torch.optim.Adam(ps, foreach=True),
    "adam-fused": lambda ps: torch.optim.Adam(ps, fused=True),
    "adamw-amsgrad": lambda ps: torch.optim.AdamW(ps, amsgrad=True),  # + max_exp_avg_sq
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, fused=True),
    "rmsprop-centered-momentum": lambda ps: torch.optim.RMSprop(ps, centered=True, momentum=0.9, foreach=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps),  # sum, step (reads step with .item())
    "adagrad-foreach": lambda ps: torch.optim.Adagrad(ps, foreach=True),
    "adagrad-fused": lambda ps: torch.optim.Adagrad(ps, fused=True),
    "adafactor": lambda ps: torch.optim.Adafactor(ps),  # factored row/col variances, step
    "adafactor-foreach": lambda ps: torch.optim.Adafactor(ps, foreach=True),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_state_matches_a_real_optimizer(name):
    factory = OPTIMIZERS[name]
    if "fused" in name and not _fused_supported(factory):
        pytest.skip(f"{name} is not supported on this CPU build")
    model = build(ResMLP)
    expected = _real_state_bytes(factory, model)
    # the optimizer state exists before the step starts, so it is live at any peak
    est = memguard.estimate(model, randn(2, 64), optimizer=factory, device="cpu")
    assert est.breakdown.get("optimizer", 0) == expected


def test_adagrad_on_the_cuda_target():
    # the CUDA target forces the foreach path; Adagrad keeps one fp32 `sum` per parameter + step
    model = build(ResMLP)
    est = memguard.estimate(model, randn(2, 64), optimizer=lambda ps: torch.optim.Adagrad(ps), device="cuda")
    assert est.breakdown["optimizer"] == _real_state_bytes(lambda ps: torch.optim.Adagrad(ps), model)


def test_default_optimizer_is_adamw():
    model, batch = build(ResMLP), randn(4, 64)
    assert memguard.estimate(model, batch, device="cpu") == memguard.estimate(
        model, batch, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), device="cpu")


INSTANCE_CASES = [
    pytest.param(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, id="SGD"),
    pytest.param(torch.optim.Adam, {"lr": 3e-4, "weight_decay": 0.01}, id="Adam"),
    pytest.param(torch.optim.RMSprop, {"lr": 1e-3, "centered": True}, id="RMSprop"),
    pytest.param(torch.optim.AdamW, {"lr": 3e-4, "weight_decay": 0.01}, id="AdamW"),  # defaults carry an
    # extra key (decoupled_weight_decay) that AdamW's constructor does not take
    pytest.param(torch.optim.Adafactor, {"lr": 1e-2}, id="Adafactor"),
]


@pytest.mark.parametrize("cls, kwargs", INSTANCE_CASES)
def test_optimizer_instance_equals_callable_and_is_left_alone(cls, kwargs):
    model, batch = build(ResMLP), randn(4, 64)
    instance = cls(model.parameters(), **kwargs)
    groups_before = [dict((k, v) for k, v in g.items() if k != "params") for g in instance.param_groups]
    est_instance = memguard.estimate(model, batch, optimizer=instance, device="cpu")
    est_callable = memguard.estimate(model, batch, optimizer=lambda ps: cls(ps, **kwargs), device="cpu")
    assert est_instance == est_callable
    assert len(instance.state) == 0  # the user's optimizer was not stepped
    assert [p for g in instance.param_groups for p in g["params"]] == list(model.parameters())
    assert [dict((k, v) for k, v in g.items() if k != "params") for g in instance.param_groups] == groups_before


def test_optimizer_instance_with_param_groups_over_part_of_the_model():
    model = build(ResMLP)
    instance = torch.optim.SGD(
        [{"params": model.head.parameters(), "momentum": 0.9}, {"params": model.inp.parameters()}], lr=0.1)
    est = memguard.estimate(model, randn(2, 64), optimizer=instance, device="cpu")
    # only the first group keeps a momentum buffer (torch/optim/sgd.py)
    assert est.breakdown.get("optimizer", 0) == sum(p.numel() for p in model.head.parameters()) * FP32


@pytest.mark.parametrize("name", ["sgd-momentum", "adam-foreach", "adamw-fused"])
@pytest.mark.cpu_truth
def test_cpu_estimate_matches_real_cpu_peak_per_optimizer(name, one_thread):
    factory = OPTIMIZERS[name]
    if "fused" in name and not _fused_supported(factory):
        pytest.skip(f"{name} is not supported on this CPU build")
    model, batch = build(ResMLP, dim=128), randn(128, 128)
    est = memguard.estimate(model, batch, optimizer=factory, device="cpu")
    real = measure_cpu_peak(model, batch, None, factory(model.parameters()), steps=2)
    assert abs(relative_error(est.peak_bytes, real.steady_peak_bytes)) <= TOLERANCE, (est.peak_bytes, real)


# ------------------------------------------------------------------ accuracy on the CPU
@pytest.mark.parametrize(
    "case",
    [
        "mlp",  # dense fp32 blocks with GELU, dropout and LayerNorm
        "gpt2-dict",  # HF causal LM, dict batch, tied embeddings, SDPA attention
    ],
)
@pytest.mark.cpu_truth
def test_cpu_estimate_matches_real_cpu_peak(case, one_thread):
    if case == "mlp":
        model, batch, loss_fn = build(ResMLP, norm=True), (randn(256, 64), randn(256, 64, seed=1)), None
    else:
        model, batch, loss_fn = gpt2(), lm_batch(4, 64), None
    est = memguard.estimate(model, batch, loss_fn=loss_fn, device="cpu")
    real = measure_cpu_peak(model, batch, loss_fn, _adamw(model.parameters()), steps=2)
    assert abs(relative_error(est.peak_bytes, real.steady_peak_bytes)) <= TOLERANCE, (est.peak_bytes, real)
    assert est.peak_phase == real.peak_phase


@pytest.mark.parametrize("loss", ["mse", "smooth_l1", "bce_with_logits"])
@pytest.mark.cpu_truth
def test_cpu_estimate_matches_real_cpu_peak_with_reduced_losses(loss, one_thread):
    """Reduced losses whose kernels allocate the unreduced elementwise loss internally; the peak
    is at the loss, so missing that buffer would cost a quarter of it."""
    model, batch = build(nn.Linear, 64, 1024), (randn(256, 64), torch.rand(256, 1024, generator=torch.Generator().manual_seed(1)))
    fn = {"mse": F.mse_loss, "smooth_l1": F.smooth_l1_loss, "bce_with_logits": F.binary_cross_entropy_with_logits}[loss]

    def loss_fn(m, b):
        return fn(m(b[0]), b[1])

    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    est = memguard.estimate(model, batch, loss_fn=loss_fn, optimizer=sgd, device="cpu")
    real = measure_cpu_peak(model, batch, loss_fn, sgd(model.parameters()), steps=2)
    assert abs(relative_error(est.peak_bytes, real.steady_peak_bytes)) <= TOLERANCE, (est.peak_bytes, real)


# ------------------------------------------------------------------ activation checkpointing
@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant"])
@pytest.mark.cpu_truth
def test_checkpointing_inside_the_model(mode, one_thread):
    batch = randn(256, 128)
    plain = memguard.estimate(build(ResMLP, dim=128, blocks=4), batch, device="cpu")
    model = build(ResMLP, dim=128, blocks=4, ckpt=mode)
    est = memguard.estimate(model, batch, device="cpu")
    # checkpointing the model already had is honoured: each block keeps only its input
    assert est.peak_bytes < plain.peak_bytes
    assert est.activation_checkpointing == 0  # memguard added none
    real = measure_cpu_peak(model, batch, None, _adamw(model.parameters()), steps=2)
    assert abs(relative_error(est.peak_bytes, real.steady_peak_bytes)) <= TOLERANCE, (est.peak_bytes, real)


def _hf_checkpointing_on(model) -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return bool(model.is_gradient_checkpointing)


@pytest.mark.cpu_truth
def test_hf_gradient_checkpointing_enable(one_thread):
    batch = lm_batch(2, 128)
    plain = llama("eager")
    model = llama("eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5 renamed it; the old name still works
        model.gradient_checkpointing_enable()
    assert _hf_checkpointing_on(model)
    est = memguard.estimate(model, batch, device="cpu")
    assert est.peak_bytes < memguard.estimate(plain, batch, device="cpu").peak_bytes
    real = measure_cpu_peak(model, batch, None, _adamw(model.parameters()), steps=2)
    assert abs(relative_error(est.peak_bytes, real.steady_peak_bytes)) <= TOLERANCE, (est.peak_bytes, real)
    assert _hf_checkpointing_on(model)  # still on, and the model is still in train mode
    assert model.training


@pytest.mark.cpu_truth
def test_memguard_checkpointing_reduces_activations_and_matches_real_checkpointing(one_thread):
    from memguard.estimator._blocks import apply_activation_checkpointing

    batch = randn(512, 64)
    model = build(ResMLP, blocks=4)
    plain = memguard.estimate(model, batch, device="cpu")
    est = memguard.estimate(model, batch, device="cpu", activation_checkpointing=True)
    assert est.activation_checkpointing == 4
    assert est.phase_peaks["forward"] < plain.phase_peaks["forward"]
    assert est.peak_bytes < plain.peak_bytes
    two = memguard.estimate(model, batch, device="cpu", activation_checkpointing=2)
    assert two.activation_checkpointing == 2
    assert est.phase_peaks["forward"] < two.phase_peaks["forward"] < plain.phase_peaks["forward"]
    undo = apply_activation_checkpointing(model, 4)  # the same wrapping, on the real model
    try:
        real = measure_cpu_peak(model, batch, None, _adamw(model.parameters()), steps=2)
    finally:
        undo()
    assert abs(relative_error(est.peak_bytes, real.steady_peak_bytes)) <= TOLERANCE, (est.peak_bytes, real)


# ---------------------------------------------------------------------------- attention
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.cpu_truth
def test_attention_implementations_match_real_cpu_peak(attn, one_thread):
    model = llama(attn)
    assert model.config._attn_implementation == attn
    batch = lm_batch(4, 128)
    est = memguard.estimate(model, batch, device="cpu")
    real = measure_cpu_peak(model, batch, None, _adamw(model.parameters()), steps=2)
    assert abs(relative_error(est.peak_bytes, real.steady_peak_bytes)) <= TOLERANCE, (est.peak_bytes, real)


def test_eager_attention_keeps_quadratic_activations_sdpa_does_not():
    """Eager attention saves the (batch, heads, seq, seq) probabilities; SDPA's fused kernels keep
    O(seq) memory. Doubling the sequence must therefore cost eager more than SDPA."""
    growth = {}
    for attn in ("eager", "sdpa"):
        model = llama(attn, device="meta")
        short = memguard.estimate(model, lm_batch(1, 32), device="cuda", precision="bf16-mixed")
        long = memguard.estimate(model, lm_batch(1, 64), device="cuda", precision="bf16-mixed")
        growth[attn] = long.phase_peaks["forward"] - short.phase_peaks["forward"]
        assert growth[attn] > 0
    assert growth["eager"] > growth["sdpa"]


# --------------------------------------------------------------------------- precisions
PRECISIONS = ["32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true"]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_all_precisions(device):
    model, batch = build(ResMLP, norm=True), (randn(512, 64), randn(512, 64, seed=1))
    est = {p: memguard.estimate(model, batch, device=device, precision=p) for p in PRECISIONS}
    full = est["32-true"]
    for p in PRECISIONS:
        assert est[p].precision == p
        assert sum(est[p].breakdown.values()) == est[p].peak_bytes
    n = full.num_params
    # *-true: weights (and float inputs) in 16 bits: exactly half of fp32
    for p in ("16-true", "bf16-true"):
        assert est[p].breakdown["params"] == n * BF16 == full.breakdown["params"] // 2
        assert est[p].breakdown["inputs"] == full.breakdown["inputs"] // 2
    # *-mixed: fp32 weights (autocast casts on the fly), 16-bit activations for matmuls
    for p in ("16-mixed", "bf16-mixed"):
        assert est[p].breakdown["params"] == full.breakdown["params"]
        assert est[p].phase_peaks["forward"] < full.phase_peaks["forward"]
    # fp16 and bf16 have the same size and autocast lists; 16-mixed only adds GradScaler's
    # scalar multiply of the loss
    assert abs(est["16-mixed"].allocated_peak_bytes - est["bf16-mixed"].allocated_peak_bytes) <= 1024
    assert est["16-true"] == memguard.estimate(model, batch, device=device, precision="16-true")
    assert est["bf16-true"].peak_bytes < full.peak_bytes


@pytest.mark.cpu_truth
def test_bf16_true_matches_real_cpu_peak(one_thread):
    model, batch = build(ResMLP), (randn(256, 64), randn(256, 64, seed=1))
    est = memguard.estimate(model, batch, device="cpu", precision="bf16-true")
    real_model = copy.deepcopy(model).to(torch.bfloat16)
    real_batch = tuple(t.to(torch.bfloat16) for t in batch)
    real = measure_cpu_peak(real_model, real_batch, None, _adamw(real_model.parameters()), steps=2)
    assert abs(relative_error(est.peak_bytes, real.steady_peak_bytes)) <= TOLERANCE, (est.peak_bytes, real)


@pytest.mark.cpu_truth
def test_bf16_mixed_on_the_cpu_target_matches_cpu_autocast(one_thread):
    model, batch = build(ResMLP), (randn(256, 64), randn(256, 64, seed=1))

    def autocast_loss(m, b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(*b)

    est = memguard.estimate(model, batch, device="cpu", precision="bf16-mixed")
    real = measure_cpu_peak(model, batch, autocast_loss, _adamw(model.parameters()), steps=2)
    assert abs(relative_error(est.peak_bytes, real.steady_peak_bytes)) <= TOLERANCE, (est.peak_bytes, real)


def test_grad_accumulation_starts_with_gradients_allocated():
    model, batch = build(ResMLP), randn(64, 64)
    first = memguard.estimate(model, batch, device="cpu")
    later = memguard.estimate(model, batch, device="cpu", grad_accum_steps=4)
    grads = first.num_trainable_params * FP32
    # every gradient is live during the forward of a micro-batch after the first
    assert later.phase_peaks["forward"] == first.phase_peaks["forward"] + grads
    assert later.peak_bytes >= first.peak_bytes


# ------------------------------------------------------------------------------ errors
def test_bad_target_arguments_are_reported_together():
    with pytest.raises(ConfigError) as info:
        memguard.estimate(build(ResMLP), randn(4, 64), precision="fp8", zero_stage=4, world_size=0)
    problems = info.value.problems
    assert len(problems) == 3
    text = str(info.value)
    assert "fp8" in text and "zero_stage=4" in text and "world_size=0" in text
    assert "32-true" in text  # says what the valid precisions are


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"zero_stage": -1}, "zero_stage=-1"),  # below 0
        ({"zero_stage": "2"}, "zero_stage='2'"),  # a string is not a stage
        ({"zero_stage": 1.5}, "zero_stage=1.5"),
        ({"world_size": -3}, "world_size=-3"),
        ({"world_size": 2.0}, "world_size=2.0"),  # must be an int
        ({"precision": "bf16"}, "precision='bf16'"),  # Lightning's names only
        ({"device": "tpu"}, "device='tpu'"),
        ({"grad_accum_steps": 0}, "grad_accum_steps=0"),
        ({"offload_optimizer": True}, "offload_optimizer"),  # needs ZeRO >= 1
    ],
)
def test_each_bad_argument_is_a_config_error(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(".", r"\.")):
        memguard.estimate(build(ResMLP), randn(4, 64), **kwargs)


@pytest.mark.parametrize("kwargs, fragment", [({"zero_stage": True}, "zero_stage=True"),
                                              ({"world_size": True}, "world_size=True")])
def test_a_bool_is_not_a_stage_or_a_rank_count_as_for_the_planner(kwargs, fragment):
    # bool is an int (True == 1): the estimate refuses it as memguard.plan does, rather than
    # returning an Estimate whose zero_stage=True the planner would refuse
    with pytest.raises(ConfigError, match=fragment):
        memguard.estimate(build(ResMLP), randn(4, 64), device="cpu", **kwargs)
    with pytest.raises(ConfigError, match=fragment):
        memguard.plan(build(ResMLP), randn(4, 64), global_batch_size=4, device="cpu", budget_bytes=2**30,
                      **kwargs)


def test_config_error_is_a_memguard_error_and_a_value_error():
    with pytest.raises(memguard.MemguardError):
        memguard.estimate(build(ResMLP), randn(4, 64), world_size=0)
    with pytest.raises(ValueError):
        memguard.estimate(build(ResMLP), randn(4, 64), world_size=0)


def test_loss_that_is_not_a_scalar():
    with pytest.raises(ConfigError, match="scalar"):
        memguard.estimate(build(ResMLP), randn(4, 64), loss_fn=lambda m, b: m.head(m.inp(b)), device="cpu")


def test_model_output_without_loss_says_how_to_pass_loss_fn():
    model = build(nn.Linear, 8, 4)
    with pytest.raises(ConfigError) as info:
        memguard.estimate(model, randn(4, 8), device="cpu")
    assert "loss_fn" in str(info.value)


def test_no_trainable_parameters():
    model = build(ResMLP)
    model.requires_grad_(False)
    with pytest.raises(ConfigError, match="no trainable parameters"):
        memguard.estimate(model, randn(4, 64), device="cpu")


def test_loss_that_does_not_require_grad():
    with pytest.raises(ConfigError, match="does not require grad"):
        memguard.estimate(build(ResMLP), randn(4, 64), loss_fn=lambda m, b: m(b).detach(), device="cpu")


def test_batch_the_model_cannot_consume_names_the_call_and_loss_fn():
    model = build(ResMLP)
    with pytest.raises(ConfigError) as info:
        memguard.estimate(model, {"inputs": randn(4, 64)}, device="cpu")  # ResMLP has no `inputs`
    text = str(info.value)
    assert "model(**batch)" in text and "loss_fn" in text and "inputs" in text
    with pytest.raises(ConfigError) as info:
        memguard.estimate(model, randn(4, 63), device="cpu")  # wrong feature size
    assert "loss_fn" in str(info.value)
    with pytest.raises(ConfigError) as info:
        memguard.estimate(model, randn(4, 63), loss_fn=lambda m, b: m(b), device="cpu")
    assert "loss_fn(model, batch) failed" in str(info.value)


def test_batch_without_tensors():
    with pytest.raises(ConfigError, match="batch"):
        memguard.estimate(build(ResMLP), [1, 2, 3], device="cpu")


def test_problems_found_before_tracing_are_listed_together():
    model = build(ResMLP)
    model.requires_grad_(False)
    with pytest.raises(ConfigError) as info:
        memguard.estimate(model, "not a batch", precision="fp8", world_size=0)
    assert len(info.value.problems) == 4  # precision, world_size, batch, no trainable parameters


def test_not_a_module():
    with pytest.raises(ConfigError, match="nn.Module"):
        memguard.estimate(lambda x: x, randn(4, 64), device="cpu")


def test_bad_optimizer_argument():
    with pytest.raises(ConfigError, match="optimizer"):
        memguard.estimate(build(ResMLP), randn(4, 64), optimizer=3, device="cpu")


def test_boolean_masking_is_a_config_error():
    """Ops whose output size depends on values cannot be traced on fake tensors (trace.py, Known
    limitations): the user gets a ConfigError, not a bare traceback."""

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x):
            h = self.lin(x)
            return h[h > 0].sum()

    with pytest.raises(ConfigError):
        memguard.estimate(build(Masked), randn(8, 16), device="cpu")
