"""QLoRA against the real thing: bitsandbytes' 4-bit layers on the CPU, peft's adapters, FSDP2's sharding.

The model is a tiny random Llama saved to a temporary directory and loaded back with
``from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...))`` on the
CPU (bitsandbytes' CPU backend quantises it): nothing is downloaded. The real step peak is the
profiler's peak of live tensor bytes (``benchmarks.ground_truth.measure_cpu_peak``) plus the
bytes of the layers' ``QuantState`` tensors, which are live throughout but reachable from neither
``parameters()`` nor ``buffers()`` (so the harness's starting bytes miss them).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import memguard
from memguard.estimator import _twins
from memguard.estimator._nf4 import NF4Linear, nf4_constant_bytes, nf4_weight_bytes, twin_4bit_layers, twin_of

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `benchmarks`

from benchmarks.ground_truth import measure_cpu_peak  # noqa: E402

bnb = pytest.importorskip("bitsandbytes")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
transformers.logging.set_verbosity_error()

TOLERANCE = 0.03  # the goal: |estimate / real - 1| <= 3%
LLAMA = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, vocab_size=1024, max_position_embeddings=256)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model("llama", **LLAMA)
    path = tmp_path_factory.mktemp("tiny-llama")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def load_qlora(path, *, prepare: bool = True, storage: torch.dtype = torch.uint8) -> nn.Module:
    """The usual QLoRA recipe: 4-bit NF4 with double quantisation, bf16 compute, then
    prepare_model_for_kbit_training (fp32 upcast, reentrant checkpointing) and LoRA r=8."""
    quant = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=storage)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=quant, device_map="cpu",
                                                              dtype=torch.bfloat16)
    if prepare:
        model = peft.prepare_model_for_kbit_training(model)
    return peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=8, target_modules=TARGETS))


def quant_state_bytes(model: nn.Module) -> int:
    """Bytes of every 4-bit layer's QuantState tensors (absmax, code; nested: offset, state2's)."""
    total, seen = 0, set()
    for m in model.modules():  # peft's wrapper exposes its base layer's weight too: count each once
        state = getattr(getattr(m, "weight", None), "quant_state", None)
        if state is None or id(state) in seen:
            continue
        seen.add(id(state))
        tensors = [state.absmax, state.code]
        if state.nested:
            tensors += [state.offset, state.state2.absmax, state.state2.code]
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total


def lm_batch(batch: int = 2, seq: int = 128) -> dict:
    ids = torch.randint(0, LLAMA["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def by_kind(model: nn.Module) -> dict:
    """Parameter bytes by (dtype, requires_grad): what every engine shards or keeps."""
    out: dict = {}
    for p in model.parameters():
        key = (p.dtype, p.requires_grad)
        out[key] = out.get(key, 0) + p.numel() * p.element_size()
    return out


# ------------------------------------------------------------------------------ the layer
def test_twin_dequantises_as_bitsandbytes():
    # the twin built from a real Linear4bit, given that layer's packed codes and QuantState, computes
    # the same output and input gradient: its layout (codes, nested absmax, offset) is bitsandbytes'
    torch.manual_seed(0)
    layer = bnb.nn.Linear4bit(256, 192, bias=False, compute_dtype=torch.float32, quant_type="nf4",
                              compress_statistics=True)
    layer.weight = bnb.nn.Params4bit(torch.randn(192, 256), requires_grad=False, quant_type="nf4",
                                     compress_statistics=True)
    layer = layer.to("cpu")  # quantises
    state = layer.weight.quant_state
    twin = twin_of(layer).to_empty(device="cpu")
    with torch.no_grad():
        twin.weight.copy_(layer.weight.data)
        twin.absmax.copy_(state.absmax)
        twin.code.copy_(state.code)
        twin.absmax2.copy_(state.state2.absmax)
        twin.code2.copy_(state.state2.code)
        twin.offset.copy_(state.offset)
    x = torch.randn(3, 256, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    layer(x).pow(2).sum().backward()
    twin(x2).pow(2).sum().backward()
    assert torch.allclose(twin(x2), layer(x), atol=1e-4)
    assert torch.allclose(x2.grad, x.grad, atol=1e-3)


def test_twin_holds_the_bytes_where_bitsandbytes_does(checkpoint):
    # FSDP-QLoRA's bf16 storage: the packed codes are a frozen bf16 parameter, the statistics no
    # parameter at all; the twin has the same parameters and, as buffers, the QuantState's bytes
    for storage in (torch.uint8, torch.bfloat16):
        real = load_qlora(checkpoint, storage=storage)
        twin = twin_4bit_layers(real)
        assert twin is not real and by_kind(twin) == by_kind(real)
        twin_stats = sum(b.numel() * b.element_size() for m in twin.modules() if isinstance(m, NF4Linear)
                         for b in m.buffers())
        assert twin_stats == quant_state_bytes(real)
    # the meta twin of the same architecture (no bitsandbytes involved) has the same bytes too
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("llama", **LLAMA))
    assert by_kind(_twins.qlora_model(meta, quant_storage=torch.bfloat16)) == by_kind(real)
    # hand count of one 256 x 256 projection: 32,768 packed bytes, 1,024 uint8 absmax, 4 fp32 absmax2
    assert nf4_weight_bytes(256 * 256) == 32768 + 1024 + 4 * 4
    assert nf4_constant_bytes() == 4 * (16 + 256 + 1)


def test_fsdp2_shards_the_packed_weights_as_it_shards_bitsandbytes(checkpoint):
    # real fully_shard over a 2-rank fake process group, on the real bitsandbytes model and on its
    # twin: rank 0 holds half of the packed codes (bf16 storage; every dim 0 here is even) in both
    from torch.distributed.fsdp import fully_shard

    from memguard.estimator._fsdp2 import fake_world

    def rank_bytes(model):
        with fake_world(2) as mesh:
            for layer in model.base_model.model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            packed = sum(p.to_local().numel() * p.element_size() for n, p in model.named_parameters()
                         if n.endswith("base_layer.weight"))
            other = sum(p.to_local().numel() * p.element_size() for n, p in model.named_parameters()
                        if not n.endswith("base_layer.weight"))
        return packed, other

    real = load_qlora(checkpoint, storage=torch.bfloat16)
    whole = sum(p.numel() * p.element_size() for n, p in real.named_parameters() if n.endswith("base_layer.weight"))
    real_rank = rank_bytes(real)
    twin_rank = rank_bytes(twin_4bit_layers(load_qlora(checkpoint, storage=torch.bfloat16)).to_empty(device="cpu"))
    assert real_rank == twin_rank and real_rank[0] * 2 == whole


def test_a_meta_model_with_bitsandbytes_layers_is_estimated_as_its_twin():
    # transformers' replace_with_bnb_linear on a meta model (what from_pretrained does before it
    # loads and quantises): unquantised Linear4bit layers, no memory; the estimate is the twin's
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear

    quant = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                            bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16)
    config = transformers.AutoConfig.for_model("llama", **LLAMA)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        plain = transformers.AutoModelForCausalLM.from_config(config)
    model = replace_with_bnb_linear(model, modules_to_not_convert=["lm_head"], quantization_config=quant)
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=8, target_modules=TARGETS))
    batch = lm_batch()
    got = memguard.estimate(model, batch, device="cpu", precision="32-true")
    want = memguard.estimate(_twins.qlora_model(plain, prepare=False), batch, device="cpu", precision="32-true")
    assert got.peak_bytes == want.peak_bytes and got.breakdown == want.breakdown


# ------------------------------------------------------------------------------ the step
def _real_peak(model, batch) -> int:
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    return measure_cpu_peak(model, batch, None, opt, steps=2).steady_peak_bytes + quant_state_bytes(model)


def test_qlora_step_peak_within_3_percent(checkpoint):
    # the recipe as users run it (prepare_model_for_kbit_training: fp32 upcast, reentrant
    # checkpointing inside the model), a plain fp32 loop around bf16 4-bit matmuls
    model = load_qlora(checkpoint)
    batch = lm_batch()
    est_real = memguard.estimate(model, batch, device="cpu", precision="32-true")
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("llama", **LLAMA))
    # the twin checkpoints every layer inside the model, as prepare_model_for_kbit_training does
    est_twin = memguard.estimate(_twins.qlora_model(meta), batch, device="cpu", precision="32-true")
    real = _real_peak(model, batch)
    assert abs(est_real.peak_bytes / real - 1) <= TOLERANCE, (est_real.peak_bytes, real)
    assert abs(est_twin.peak_bytes / real - 1) <= TOLERANCE, (est_twin.peak_bytes, real)


@pytest.mark.slow
def test_qlora_step_peak_without_prepare_within_3_percent(checkpoint):
    # bf16 embeddings, norms and head, no checkpointing: every block's activations are kept
    model = load_qlora(checkpoint, prepare=False)
    batch = lm_batch()
    est = memguard.estimate(model, batch, device="cpu", precision="32-true")
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("llama", **LLAMA))
    twin = memguard.estimate(_twins.qlora_model(meta, prepare=False), batch, device="cpu", precision="32-true")
    real = _real_peak(model, batch)
    assert abs(est.peak_bytes / real - 1) <= TOLERANCE, (est.peak_bytes, real)
    assert abs(twin.peak_bytes / real - 1) <= TOLERANCE, (twin.peak_bytes, real)


# ------------------------------------------------------------------------------ planning
def _meta_llama(**sizes):
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model("llama", **{**LLAMA, **sizes}))


def test_plan_finetune_qlora_plans_the_prepared_4bit_twin():
    model = _meta_llama(hidden_size=64, intermediate_size=176, vocab_size=256)
    batch = lm_batch(2, 32)
    batch = {k: v % 256 for k, v in batch.items()}
    plan = memguard.plan(model, batch, global_batch_size=2, device="cpu", budget_bytes=1 << 30,
                         precision="bf16-mixed", finetune="qlora")
    # prepare_model_for_kbit_training checkpoints every layer inside the model: the plan adds none
    assert plan.checkpoint_blocks == 0
    assert "QLoRA r=8" in plan.reasons["finetune"] and "checkpointed inside" in plan.reasons["finetune"]
    # the plan's estimate is the twin's, which the CPU-real test above checks against bitsandbytes
    est = memguard.estimate(_twins.qlora_model(model), batch, device="cpu", precision="bf16-mixed")
    assert plan.estimate.peak_bytes == est.peak_bytes


def test_cli_finetune_qlora(capsys):
    import json

    from memguard.cli import main

    args = ["plan", "--hf", "llama", "--hf-config", "hidden_size=64", "intermediate_size=176", "num_hidden_layers=2",
            "num_attention_heads=4", "num_key_value_heads=4", "vocab_size=256", "--seq-len", "32",
            "--global-batch-size", "2", "--device", "cpu", "--budget", "1GiB", "--precision", "bf16-mixed",
            "--finetune", "qlora", "--json", "-q"]
    assert main(args) == 0
    got = json.loads(capsys.readouterr().out)
    assert "QLoRA" in got["reasons"]["finetune"] and got["checkpoint_blocks"] == 0
