"""Fine-tuning alternatives: LoRA/QLoRA twins, the 8-bit optimizer's bytes, and the measured list."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import memguard
from memguard import ConfigError
from memguard.estimator import _twins as twins
from memguard.estimator._nf4 import NF4_LEVELS as _NF4_LEVELS, nf4_constant_bytes
from memguard.planner import _finetune as ft
from memguard.planner.api import alternatives
from memguard.planner._request import PlanRequest, finetune_problems

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `benchmarks`

from benchmarks.ground_truth import measure_cpu_peak  # noqa: E402

LLAMA_TARGETS = ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj")


def tiny_llama(device: str = "meta", layers: int = 2) -> nn.Module:
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=4, vocab_size=256,
                                   max_position_embeddings=64)
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.LlamaForCausalLM(cfg)


def lm_batch(n: int = 2, seq: int = 16) -> dict:
    ids = torch.randint(0, 256, (n, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


# ------------------------------------------------------------------------------ target modules
def test_lora_targets_follow_the_architecture():
    # Llama: the attention projections and the gated MLP (every nn.Linear in a decoder layer)
    assert twins.lora_target_modules(tiny_llama()) == LLAMA_TARGETS
    # GPT-2: transformers' Conv1D layers c_attn/c_proj (attention) and c_fc/c_proj (MLP)
    with torch.device("meta"):
        gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2))
    assert twins.lora_target_modules(gpt2) == ("c_attn", "c_fc", "c_proj")
    # the output layer is never adapted
    assert "lm_head" not in twins.lora_target_modules(tiny_llama())


def test_lora_model_leaves_the_users_model_alone():
    model = tiny_llama("cpu")
    before = {n: (p.device, p.dtype, p.requires_grad, p.detach().clone()) for n, p in model.named_parameters()}
    lora = twins.lora_model(model)
    after = dict(model.named_parameters())
    assert set(after) == set(before)  # no adapters grafted onto the user's model
    for n, (dev, dtype, rg, value) in before.items():
        p = after[n]
        assert (p.device, p.dtype, p.requires_grad) == (dev, dtype, rg)
        assert torch.equal(p.detach(), value)
    # the twin: on meta, base frozen in bf16, adapters trainable in fp32 (peft's autocast_adapter_dtype)
    assert {p.device.type for p in lora.parameters()} == {"meta"}
    trainable = [(n, p) for n, p in lora.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n and p.dtype == torch.float32 for n, p in trainable)
    assert all(p.dtype == torch.bfloat16 for n, p in lora.named_parameters() if not p.requires_grad)
    # r=8 adapters on 7 linear layers per block: (in + out) * r parameters each
    h, i, r = 64, 176, twins.LORA_RANK
    per_block = 4 * (h + h) * r + 2 * (h + i) * r + (i + h) * r
    assert sum(p.numel() for _, p in trainable) == 2 * per_block


# ------------------------------------------------------------------------------ LoRA estimates
def _real_peft(model: nn.Module) -> nn.Module:
    real = copy.deepcopy(model)
    for p in real.parameters():
        p.data = p.data.to(torch.bfloat16)
    return peft.get_peft_model(real, peft.LoraConfig(r=twins.LORA_RANK, lora_alpha=twins.LORA_ALPHA,
                                                     target_modules=list(LLAMA_TARGETS)))


@pytest.mark.cpu_truth
def test_lora_twin_estimates_like_a_real_peft_model_and_the_real_cpu_peak():
    model = tiny_llama("cpu")
    batch = lm_batch()
    twin = twins.lora_model(model)
    real = _real_peft(model)
    kw = dict(device="cpu", precision="32-true")
    est_twin = memguard.estimate(twin, batch, **kw)
    est_real = memguard.estimate(real, batch, **kw)
    # same modules, shapes and dtypes: the meta twin and a real peft model trace identically
    assert est_twin.peak_bytes == est_real.peak_bytes
    assert dict(est_twin.breakdown) == dict(est_real.breakdown)
    # and the estimate matches real CPU steps of the real peft model (the estimator's CPU
    # target is exact to ~1%; 3% is the project's accuracy bar)
    opt = torch.optim.AdamW([p for p in real.parameters() if p.requires_grad], lr=1e-3)
    truth = measure_cpu_peak(real, batch, None, opt, steps=2)
    assert abs(est_real.peak_bytes - truth.steady_peak_bytes) <= 0.03 * truth.steady_peak_bytes
    # on this 64-wide model the adapters are ~15% of the parameters (19,712 of ~133k; on a 7B
    # model r=8 is ~0.3%), so the optimizer state is under a fifth of a full fine-tune's
    full = memguard.estimate(model, batch, **kw)
    assert est_twin.peak_bytes < full.peak_bytes
    assert est_twin.num_trainable_params == 19_712
    assert est_twin.breakdown["optimizer"] < 0.2 * full.breakdown["optimizer"]


# ------------------------------------------------------------------------------ 8-bit optimizer
@pytest.mark.parametrize("numel,expected", [
    # below min_8bit_size (4096): two fp32 moments, 8 bytes per element
    (4095, 8 * 4095),
    # 4096 elements: two uint8 moments (2 x 4096) + two fp32 absmax of ceil(4096/2048) = 2 blocks
    (4096, 2 * 4096 + 2 * 4 * 2),
    # 4096 x 4096 (a 7B attention projection): 2 bytes/param + 2 x 4 x 8192 blocks of 2048
    (4096 * 4096, 2 * 4096 * 4096 + 8 * 8192),
    # a partial last block still has an absmax: ceil(5000/2048) = 3
    (5000, 2 * 5000 + 8 * 3),
])
def test_adamw8bit_state_bytes_formula(numel, expected):
    assert twins.adamw8bit_state_bytes(numel) == expected


def test_adamw8bit_stand_in_allocates_the_formulas_bytes():
    params = [nn.Parameter(torch.randn(n)) for n in (10, 4096, 5000, 3 * 2048)]
    opt = twins.AdamW8bitStandIn(params, lr=1e-2)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    for p in params:
        state_bytes = sum(t.numel() * t.element_size() for t in opt.state[p].values() if torch.is_tensor(t))
        assert state_bytes == twins.adamw8bit_state_bytes(p.numel())
        big = p.numel() >= twins.BNB_MIN_8BIT_SIZE
        assert opt.state[p]["state1"].dtype == (torch.uint8 if big else torch.float32)


def test_adamw8bit_estimate_saves_what_the_formula_says():
    model = tiny_llama("cpu")
    batch = lm_batch()
    adam = memguard.estimate(model, batch, device="cpu")
    eight = memguard.estimate(model, batch, device="cpu", optimizer=twins.AdamW8bitStandIn)
    # AdamW keeps two fp32 moments (8 bytes/element) plus a step scalar per parameter; the 8-bit
    # optimizer keeps adamw8bit_state_bytes: the model states differ by exactly that
    params = list(model.parameters())
    step_scalars = sum(4 for _ in params)  # torch AdamW's fp32 "step" tensor per parameter
    expected = sum(8 * p.numel() - twins.adamw8bit_state_bytes(p.numel()) for p in params) + step_scalars
    assert adam.model_state_bytes - eight.model_state_bytes == expected


# ------------------------------------------------------------------------------ QLoRA
def test_nf4_bytes_and_layer_buffers():
    # 4096 x 4096: codes 8 MiB, uint8 absmax per 64 (262,144), fp32 per 256 absmax (1,024 x 4)
    n = 4096 * 4096
    assert twins.nf4_weight_bytes(n) == n // 2 + n // 64 + 4 * (n // 64 // 256)
    # without double quantisation: fp32 absmax per 64 (QLoRA's 0.5 bit/param overhead)
    assert twins.nf4_weight_bytes(n, double_quant=False) == n // 2 + 4 * (n // 64)
    layer = twins.NF4Linear(4096, 4096, False, compute_dtype=torch.bfloat16)
    # the packed codes are a frozen uint8 parameter (Params4bit), the statistics buffers; the fp32
    # constants (16-entry code, 256-entry map, offset) come on top of nf4_weight_bytes
    assert [(p.dtype, p.requires_grad, p.numel()) for p in layer.parameters()] == [(torch.uint8, False, n // 2)]
    state = sum(t.numel() * t.element_size() for t in [*layer.parameters(), *layer.buffers()])
    assert state == twins.nf4_weight_bytes(n) + 4 * (16 + 256 + 1)


def test_nf4_dequantize_real_values():
    # byte 0xF0 holds codes 15 (level +1.0) and 0 (level -1.0); block scale = map[2] (0.25) x 2.0 + offset 0.5
    layer = twins.NF4Linear(8, 8, False, compute_dtype=torch.float32).to_empty(device="cpu")
    with torch.no_grad():
        layer.weight.fill_(0xF0)
        layer.code.copy_(torch.tensor(_NF4_LEVELS))
        layer.absmax.fill_(2)
        layer.code2.zero_()
        layer.code2[2] = 0.25
        layer.absmax2.fill_(2.0)
        layer.offset.fill_(0.5)
    w = layer.dequantize(layer.scales(), torch.float32)
    assert torch.equal(w.reshape(-1), torch.tensor([1.0, -1.0] * 32))


def test_qlora_twin_needs_less_than_lora():
    model = tiny_llama("meta", layers=2)
    batch = lm_batch()
    kw = dict(device="cpu", precision="bf16-mixed")
    lora = memguard.estimate(twins.lora_model(model), batch, **kw)
    # prepare=False: the other weights stay bf16, as in the LoRA twin
    qlora = memguard.estimate(twins.qlora_model(model, prepare=False), batch, **kw)
    # the adapted linear weights go from 2 bytes to ~0.52 bytes each (plus each layer's fp32
    # QuantState constants); everything else is equal
    linear = sum(m.weight.numel() for n, m in model.named_modules()
                 if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in LLAMA_TARGETS)
    saved = 2 * linear - sum(twins.nf4_weight_bytes(m.weight.numel()) + nf4_constant_bytes()
                             for n, m in model.named_modules()
                             if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in LLAMA_TARGETS)
    assert lora.breakdown["params"] - qlora.breakdown["params"] == saved
    assert qlora.peak_bytes < lora.peak_bytes


# ------------------------------------------------------------------------------ requests
def test_finetune_variant_modes():
    model = tiny_llama()
    request = PlanRequest(global_batch_size=4, device="cpu", budget_bytes=10**9)
    full = ft.finetune_variant(model, request, "full")
    assert full.model is model and full.request is request and full.reason == ""
    lora = ft.finetune_variant(model, request, "lora")
    assert hasattr(lora.model, "peft_config") and lora.model is not model
    assert lora.request.precision == "bf16-mixed"  # adapters in fp32 under autocast: the LoRA recipe
    assert "r=8" in lora.reason and "q_proj" in lora.reason
    # QLoRA: 4-bit linear layers, the rest fp32, every block checkpointed (prepare_model_for_kbit_training)
    qlora = ft.finetune_variant(model, request, "qlora")
    assert any(isinstance(m, twins.NF4Linear) for m in qlora.model.modules())
    assert {p.dtype for p in qlora.model.parameters() if p.is_floating_point()} == {torch.float32}
    # transformers' checkpointing is on inside the twin, so the plan adds none
    assert qlora.request.activation_checkpointing is False and qlora.request.precision == "bf16-mixed"
    assert qlora.model.model.layers[0].gradient_checkpointing is True
    assert "QLoRA r=8" in qlora.reason and "4-bit NF4" in qlora.reason
    with pytest.raises(ConfigError, match="finetune='qqlora'"):
        ft.finetune_variant(model, request, "qqlora")
    # a user's optimizer instance is rebuilt over the adapters only
    inst = torch.optim.SGD(tiny_llama("cpu").parameters(), lr=0.5, momentum=0.9)
    lora2 = ft.finetune_variant(model, PlanRequest(global_batch_size=4, device="cpu", budget_bytes=10**9,
                                                   optimizer=inst), "lora")
    made = lora2.request.optimizer(list(lora2.model.parameters()))
    assert isinstance(made, torch.optim.SGD) and made.defaults["momentum"] == 0.9
    assert all(p.requires_grad for g in made.param_groups for p in g["params"])


def test_alternatives_when_a_full_finetune_does_not_fit():
    model = tiny_llama("meta", layers=2)  # 2 blocks: the 2-block probe is the whole model, traced once
    batch = lm_batch(1, 32)
    # the budget: between the LoRA twin's peak and the full fine-tune's peak at micro-batch 1
    full_est = memguard.estimate(model, batch, device="cpu", precision="bf16-mixed")
    lora_est = memguard.estimate(twins.lora_model(model), batch, device="cpu", precision="bf16-mixed")
    budget = int((lora_est.peak_bytes + 0.5 * (full_est.peak_bytes - lora_est.peak_bytes)) / 0.9)
    # one precision, no checkpointing: the fewest traces per alternative (CI time)
    request = PlanRequest(global_batch_size=2, device="cpu", budget_bytes=budget, precision="bf16-mixed",
                          activation_checkpointing=False)
    with pytest.raises(memguard.InfeasiblePlanError) as info:
        memguard.plan(model, batch, **request.options())
    full_peak = info.value.closest.estimate.peak_bytes
    found = alternatives(model, batch, request)
    alts = {a.name: a for a in found}
    assert set(alts) == {"lora", "qlora", "adamw8bit", "bf16-true", "cpu-offload"}
    usable = request.resolve().usable_bytes
    for a in found:
        assert a.predicted_peak_bytes is not None and a.fits == (a.plan is not None)
        assert a.fits == (a.predicted_peak_bytes <= usable)
        assert a.line(usable).startswith(a.name + ":")
        assert json.loads(json.dumps(a.to_dict()))["name"] == a.name  # plain data, JSON-ready
    # LoRA: frozen bf16 base, no base gradients or moments: fits, well under the full fine-tune
    assert alts["lora"].fits and alts["lora"].predicted_peak_bytes < full_peak
    assert alts["lora"].plan.estimate.peak_bytes <= alts["lora"].plan.usable_bytes
    # QLoRA's base is 4-bit: below LoRA's
    assert alts["qlora"].predicted_peak_bytes < alts["lora"].predicted_peak_bytes
    # 8-bit moments (2 bytes/param instead of 8), bf16-true (2+2+4 bytes/param instead of 4+4+8)
    # and offload (moments on the host) all shrink the full fine-tune's model states
    for name in ("adamw8bit", "bf16-true", "cpu-offload"):
        assert alts[name].predicted_peak_bytes < full_peak, name
    assert "2^-8" in alts["bf16-true"].note
    # ordered: what fits first, then by predicted peak
    keys = [(not a.fits, a.predicted_peak_bytes) for a in found]
    assert keys == sorted(keys)


def test_finetune_problems():
    assert finetune_problems(None) == [] and finetune_problems("lora") == []
    assert "must be None" in finetune_problems("LoRA")[0]


def test_finetune_7b_example_core():
    """examples/finetune_7b.py's core, on 2 of Llama-2-7B's 32 layers (full width: 4096 hidden, 32000
    vocabulary) with a 6 GiB budget, so that it runs in CI time: the figures must make sense."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "examples" / "finetune_7b.py"
    spec = importlib.util.spec_from_file_location("finetune_7b_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    budget = 6 << 30
    result, alts = example.run(layers=2, budget_bytes=budget, precision="bf16-mixed",
                               activation_checkpointing=False, only=("lora", "adamw8bit"))
    # 2 layers + embeddings + head = 0.67B parameters; a full AdamW fine-tune keeps ~16 bytes each
    # (ZeRO paper, arXiv 1910.02054): ~10.7 GB of model states alone, over the 6 GiB budget
    assert isinstance(result, memguard.InfeasiblePlanError)
    full_peak = result.closest.estimate.peak_bytes
    assert full_peak > 16 * 0.67e9 * 0.95
    by_name = {a.name: a for a in alts}
    lora, eight = by_name["lora"], by_name["adamw8bit"]
    # LoRA: bf16 base (2 bytes x 0.67B = 1.3 GB) and 0.3% trainable: fits where the full one does not
    assert lora.fits and lora.predicted_peak_bytes < budget
    assert 2 * 0.67e9 < lora.predicted_peak_bytes < full_peak / 2
    # 8-bit AdamW saves 6 of the 16 bytes per parameter (moments 8 -> 2), ~4 GB here: lower than the
    # full fine-tune, still more than the budget
    assert not eight.fits
    assert full_peak - eight.predicted_peak_bytes > 0.8 * 6 * 0.67e9
