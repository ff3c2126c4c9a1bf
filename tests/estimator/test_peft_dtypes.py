"""PEFT adapter dtypes: float32 LoRA adapters on a bfloat16 base, under each front-end's precision convention.

``peft.get_peft_model`` upcasts the adapters to float32 on a 16-bit base (``autocast_adapter_dtype=True``, its
default) and each LoRA layer casts its input to the adapter's dtype (``_cast_input_dtype``). What a step saves
then depends on the front-end: a plain loop keeps the dtypes as built (memguard's ``"32-true"``), autocast
(the HF Trainer's ``bf16=True``, Lightning's ``"bf16-mixed"``) runs the adapters' matmuls in bf16, and
Lightning's ``"bf16-true"`` casts the whole module. Each is checked against real CPU steps of the real PEFT
model (torch.profiler memory events, ``benchmarks/ground_truth.py``) within the project's 3%.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from pathlib import Path

import pytest
import torch

import memguard

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `benchmarks`

from benchmarks.ground_truth import default_loss, measure_cpu_peak  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOLERANCE = 0.03  # the project's accuracy bar against the real CPU peak
VOCAB = 256


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: the tiny models gain nothing from more on a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def lora_llama(device: str = "cpu", *, autocast_adapter_dtype: bool = True) -> torch.nn.Module:
    """A 2-layer Llama with bf16 weights and r=16 LoRA adapters on every projection, as PEFT builds it."""
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, vocab_size=VOCAB,
                                   max_position_embeddings=128)
    torch.manual_seed(0)
    with torch.device(device):
        base = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    return peft.get_peft_model(base, peft.LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS),
                               autocast_adapter_dtype=autocast_adapter_dtype)


def lm_batch(n: int = 4, seq: int = 96) -> dict:
    ids = torch.randint(0, VOCAB, (n, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def real_peak(model, batch, context=contextlib.nullcontext) -> int:
    """The steady-state peak of two real CPU steps, forward and loss inside ``context()``."""
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    def loss_fn(m, b):
        with context():
            return default_loss(m, b)

    return measure_cpu_peak(model, batch, loss_fn, opt, steps=2).steady_peak_bytes


def assert_close(estimated: int, real: int) -> None:
    assert abs(estimated - real) <= TOLERANCE * real, f"estimate {estimated:,} vs real {real:,}"


def test_peft_builds_float32_adapters_on_a_bf16_base():
    # the premise of every test below: PEFT's autocast_adapter_dtype upcasts only the (trainable) adapters
    model = lora_llama("meta")
    assert {(p.dtype, p.requires_grad) for p in model.parameters()} == {(torch.bfloat16, False),
                                                                      (torch.float32, True)}
    assert all("lora_" in n for n, p in model.named_parameters() if p.dtype == torch.float32)


@pytest.mark.cpu_truth
def test_plain_loop_keeps_float32_adapters_and_their_float32_activations():
    # "32-true" keeps the dtypes as built and runs no autocast: what a plain loop does with this model
    batch = lm_batch()
    fp32 = lora_llama()
    bf16 = lora_llama(autocast_adapter_dtype=False)  # the same adapters left in bf16
    est32 = memguard.estimate(fp32, batch, device="cpu", precision="32-true")
    est16 = memguard.estimate(bf16, batch, device="cpu", precision="32-true")
    real32, real16 = real_peak(fp32, batch), real_peak(bf16, batch)
    assert_close(est32.peak_bytes, real32)
    assert_close(est16.peak_bytes, real16)
    # the float32 adapters cost something real (their inputs, cast to float32 and saved, their float32
    # gradients and AdamW moments), and the estimate follows it: its difference within 10% of the real one
    assert real32 - real16 > 0.05 * real16
    assert abs((est32.peak_bytes - est16.peak_bytes) - (real32 - real16)) <= 0.1 * (real32 - real16)
    # the estimate says which convention it assumed; the bf16-only model has nothing to choose between
    assert any("kept as built, no autocast" in n for n in est32.notes), est32.notes
    assert not any("kept as built" in n or "all cast" in n for n in est16.notes)


@pytest.mark.cpu_truth
def test_autocast_runs_the_float32_adapters_in_bf16():
    # "bf16-mixed": the dtypes as built under bf16 autocast (Lightning's bf16-mixed, the HF Trainer's
    # bf16=True); autocast casts each adapter's float32 input down again, so the matmuls save bf16
    batch = lm_batch()
    model = lora_llama()
    est = memguard.estimate(model, batch, device="cpu", precision="bf16-mixed")
    real = real_peak(model, batch, lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    assert_close(est.peak_bytes, real)
    assert est.peak_bytes < memguard.estimate(model, batch, device="cpu", precision="32-true").peak_bytes
    assert any("kept as built, under bfloat16 autocast" in n for n in est.notes), est.notes


@pytest.mark.cpu_truth
def test_bf16_true_is_lightnings_whole_module_cast():
    # Lightning's precision="bf16-true": HalfPrecision.convert_module casts the whole module (adapters too)
    # and the forward runs with bf16 as the default dtype (HalfPrecision.forward_context)
    from lightning.pytorch.plugins.precision import HalfPrecision

    batch = lm_batch()
    model = lora_llama()
    est = memguard.estimate(model, batch, device="cpu", precision="bf16-true")
    plugin = HalfPrecision("bf16-true")
    cast = plugin.convert_module(copy.deepcopy(model))
    assert {p.dtype for p in cast.parameters()} == {torch.bfloat16}
    assert_close(est.peak_bytes, real_peak(cast, batch, plugin.forward_context))
    assert any("all cast to bfloat16, as Lightning's precision='bf16-true'" in n for n in est.notes), est.notes
    # the user's model is left as built
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}


@pytest.mark.cpu_truth
def test_hf_trainer_bf16_plans_autocast_of_the_model_as_loaded(tmp_path):
    # TrainingArguments(bf16=True) does not cast the model: Accelerate wraps its forward in autocast
    # (Accelerator.prepare_model, native_amp), so the callback plans "bf16-mixed" on the dtypes as built;
    # the real step is the Trainer's own compute_loss on the model Accelerate prepared.
    from memguard.integrations.transformers import MemguardCallback

    model = lora_llama()
    ids = lm_batch(16)["input_ids"]
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], bf16=True,
                                          per_device_train_batch_size=4, gradient_accumulation_steps=1, max_steps=1,
                                          save_strategy="no", disable_tqdm=True)
    callback = MemguardCallback(budget_bytes=1 << 30, activation_checkpointing=False)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    plan = callback.plan
    assert plan.precision == "bf16-mixed" and plan.micro_batch_size == 4 and plan.grad_accum_steps == 1
    assert any("kept as built, under bfloat16 autocast" in n for n in plan.estimate.notes), plan.explain()
    assert "kept as built" in plan.explain()
    prepared = trainer.accelerator.prepare_model(trainer.model)  # what Trainer.train prepares on one device
    assert {p.dtype for p in prepared.parameters() if p.requires_grad} == {torch.float32}  # not cast
    cls, kwargs = trainer.get_optimizer_cls_and_kwargs(args, prepared)
    prepared.train()
    opt = cls([p for p in prepared.parameters() if p.requires_grad], **kwargs)
    batch = {"input_ids": ids[:4], "labels": ids[:4]}
    real = measure_cpu_peak(prepared, batch, lambda m, b: trainer.compute_loss(m, b), opt, steps=2)
    assert_close(plan.estimate.peak_bytes, real.steady_peak_bytes)


def test_notes_name_the_convention_for_each_precision_and_engine():
    model, batch = lora_llama("meta"), lm_batch(2, 16)
    # DeepSpeed casts every parameter to the 16-bit dtype (engine._cast_module_mixed_precision)
    zero = memguard.estimate(model, batch, device="cuda", precision="bf16-mixed", zero_stage=2, world_size=2)
    assert any("as DeepSpeed casts every parameter" in n for n in zero.notes), zero.notes
    # the note counts the parameters as built: bf16 frozen base, float32 trainable adapters
    note = next(n for n in memguard.estimate(model, batch, device="cpu").notes if "kept as built" in n)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert f"bfloat16 ({frozen:,} frozen)" in note and f"float32 ({trainable:,} trainable)" in note


@pytest.mark.cpu_truth
def test_no_cache_decoder_with_grouped_kv_heads(tmp_path):
    # The HF Trainer runs the model with config.use_cache = TrainingArguments.use_cache (False). transformers then
    # asks whether the positions it makes pack several sequences; a real run reads arange (one sequence) and skips
    # the causal mask, so SDPA takes the 2 key/value heads as they are. The trace must do the same: the fake check
    # used to answer "packed", adding a mask and repeat_kv copies of every layer's keys and values (+6% here).
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=8,
                                   num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
                                   use_cache=False)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model = peft.get_peft_model(base, peft.LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS))
    batch = lm_batch(2, 256)
    est = memguard.estimate(model, batch, device="cpu", precision="bf16-mixed")
    assert_close(est.peak_bytes, real_peak(model, batch, lambda: torch.autocast("cpu", dtype=torch.bfloat16)))
