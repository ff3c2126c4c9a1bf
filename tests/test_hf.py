"""Tests of memguard.hf: transformers models built from configs on the meta device, offline."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import memguard  # noqa: E402
from memguard import hf  # noqa: E402
from memguard.errors import ConfigError  # noqa: E402

# Tiny sizes keep every build and trace well under a second.
TINY_GPT2 = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 1000}
TINY_BERT = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 2, "intermediate_size": 128,
             "vocab_size": 1000}
TINY_T5 = {"num_layers": 2, "d_model": 64, "d_ff": 128, "num_heads": 2, "d_kv": 32, "vocab_size": 1000}
TINY_LLAMA = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
              "num_key_value_heads": 1, "vocab_size": 1000}


@pytest.mark.parametrize(
    "item, key, value",
    [
        ("n_layer=2", "n_layer", 2),  # JSON integer
        ("resid_pdrop=0.1", "resid_pdrop", 0.1),  # JSON float
        ("tie_word_embeddings=false", "tie_word_embeddings", False),  # JSON boolean
        ("tie_word_embeddings=False", "tie_word_embeddings", False),  # Python literal, as users also write
        ("pad_token_id=null", "pad_token_id", None),  # JSON null
        ("attn_implementation=eager", "attn_implementation", "eager"),  # neither JSON nor literal: a string
        ("layer_types=[1, 2]", "layer_types", [1, 2]),  # JSON list
        (" n_head = 4 ", "n_head", 4),  # spaces around key and value are dropped
    ],
)
def test_parse_overrides_reads_json_then_literals_then_strings(item, key, value):
    assert hf.parse_overrides([item]) == {key: value}


def test_parse_overrides_lists_every_bad_item():
    with pytest.raises(ConfigError) as info:
        hf.parse_overrides(["n_layer", "=3", "n_head=2"])
    assert len(info.value.problems) == 2
    assert "'n_layer'" in info.value.problems[0] and "key=value" in info.value.problems[0]


def test_build_gpt2_on_meta_with_labels():
    built = hf.build("gpt2", TINY_GPT2, batch_size=3, seq_len=16)
    assert built.task == "causal-lm"
    assert type(built.model).__name__ == "GPT2LMHeadModel"
    assert built.model.training
    assert all(p.device.type == "meta" for p in built.model.parameters())
    assert built.config.n_layer == 2 and built.config.use_cache is False
    assert set(built.batch) == {"input_ids", "labels"}
    assert built.batch["input_ids"].shape == (3, 16) and built.batch["input_ids"].dtype == torch.long
    assert torch.equal(built.batch["labels"], built.batch["input_ids"])
    assert int(built.batch["input_ids"].max()) < 1000  # valid token ids for the vocabulary
    # GPT-2 ties the LM head to the token embedding: counted once. Embeddings 1000*64 + 1024*64,
    # per block 12*64^2 + 13*64 weights and biases, final norm 2*64 (GPT-2's layer shapes).
    assert built.num_params == 1000 * 64 + 1024 * 64 + 2 * (12 * 64 * 64 + 13 * 64) + 2 * 64
    assert "GPT2LMHeadModel" in built.describe() and "sequence 16" in built.describe()


@pytest.mark.parametrize(
    "model_type, overrides, task, cls, keys",
    [
        # bert's pre-training head is masked LM, though transformers also registers a causal head
        ("bert", TINY_BERT, "masked-lm", "BertForMaskedLM", {"input_ids", "attention_mask", "labels"}),
        # t5 is an encoder-decoder: seq2seq LM, labels feed the decoder
        ("t5", TINY_T5, "seq2seq-lm", "T5ForConditionalGeneration", {"input_ids", "attention_mask", "labels"}),
        # llama is decoder-only: causal LM
        ("llama", TINY_LLAMA, "causal-lm", "LlamaForCausalLM", {"input_ids", "labels"}),
    ],
)
def test_task_follows_the_model_type(model_type, overrides, task, cls, keys):
    built = hf.build(model_type, overrides, batch_size=2, seq_len=12)
    assert built.task == task
    assert type(built.model).__name__ == cls
    assert set(built.batch) == keys


def test_seq2seq_target_len_and_a_real_estimate():
    built = hf.build("t5", TINY_T5, batch_size=2, seq_len=12, target_len=5)
    assert built.batch["input_ids"].shape == (2, 12)
    assert built.batch["labels"].shape == (2, 5)
    assert built.target_len == 5
    # T5's config built without a checkpoint lacks decoder_start_token_id; build() supplies the pad
    # id so the labels can be shifted into decoder inputs and a step can be traced.
    est = memguard.estimate(built.model, built.batch, device="cpu")
    # fp32 weights (32-true) and buffers, tied embeddings once: what the meta model holds
    unique = {id(t): t for t in [*built.model.parameters(), *built.model.buffers()]}.values()
    assert est.breakdown["params"] == sum(t.numel() * t.element_size() for t in unique)
    assert est.num_params == built.num_params
    # during AdamW's step the weights, their gradients and both moments are live: 4 x the weights
    weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in built.model.parameters()}.values())
    assert est.peak_bytes >= 4 * weights


def test_default_seq_len_is_capped_by_the_model():
    # bert's max_position_embeddings is 512 (BertConfig default), below the 1024 default
    assert hf.build("bert", TINY_BERT).seq_len == 512
    # gpt2's n_positions is 1024: the default applies
    assert hf.build("gpt2", TINY_GPT2).seq_len == hf.DEFAULT_SEQ_LEN == 1024


def test_bad_inputs_name_the_fix():
    with pytest.raises(ConfigError, match="unknown transformers model type 'gpt3'.*'gpt2'"):
        hf.build("gpt3")
    with pytest.raises(ConfigError) as info:
        hf.build("gpt2", {"n_layers": 2, "n_embed": 64})
    problems = " | ".join(info.value.problems)
    assert len(info.value.problems) == 2
    assert "'n_layers'; did you mean n_layer" in problems and "'n_embed'; did you mean n_embd" in problems
    with pytest.raises(ConfigError, match="n_positions=1024.*n_positions=2048"):
        hf.build("gpt2", TINY_GPT2, seq_len=2048)
    with pytest.raises(ConfigError, match="target_len applies to encoder-decoder"):
        hf.build("gpt2", TINY_GPT2, seq_len=8, target_len=4)
    with pytest.raises(ConfigError, match="no language-modelling head"):
        hf.build("vit")
    with pytest.raises(ConfigError, match="batch_size=0"):
        hf.build("gpt2", TINY_GPT2, batch_size=0, seq_len=8)


def test_forced_task_uses_that_auto_class():
    built = hf.build("bert", TINY_BERT, seq_len=8, task="causal-lm")
    assert type(built.model).__name__ == "BertLMHeadModel"
    assert set(built.batch) == {"input_ids", "labels"}
