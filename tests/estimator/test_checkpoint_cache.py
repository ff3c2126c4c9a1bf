"""memguard's activation checkpointing trains a transformers model without its KV cache, as transformers does."""

import pytest
import torch

import memguard

transformers = pytest.importorskip("transformers")


def _llama(use_cache: bool) -> torch.nn.Module:
    cfg = transformers.AutoConfig.for_model(
        "llama", hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=1000, max_position_embeddings=512, use_cache=use_cache,
    )
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    model.train()
    return model


def _loss(model, batch):
    return model(input_ids=batch, labels=batch).loss


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_checkpointing_ignores_the_configs_use_cache(device):
    # transformers' GradientCheckpointingLayer turns the cache off before it checkpoints a layer
    # (modeling_layers.py): with the cache on, the backward replay of each layer would append its
    # keys and values to the cache a second time. A config that leaves use_cache=True (Llama's
    # default) must therefore give the same checkpointed step as one with use_cache=False.
    batch = torch.randint(0, 1000, (2, 256))
    kw = dict(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=_loss, device=device,
              activation_checkpointing=True)
    if device == "cuda":
        kw["gpu"] = "A100-80GB"
    on = memguard.estimate(_llama(True), batch, **kw)
    off = memguard.estimate(_llama(False), batch, **kw)
    assert on.allocated_peak_bytes == off.allocated_peak_bytes
    assert on.peak_bytes == off.peak_bytes


def test_checkpointing_does_not_touch_the_users_config():
    model = _llama(True)
    memguard.estimate(model, torch.randint(0, 1000, (1, 64)), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                      loss_fn=_loss, device="cpu", activation_checkpointing=True)
    assert model.config.use_cache is True  # the trace turns it off in its own copy only


def test_checkpointing_a_real_model_turns_the_cache_off_and_undo_restores_it():
    # the guard checkpoints the user's own model through the same function as the trace, so the
    # real step runs without the cache the estimate leaves out; undo gives the setting back
    from memguard.estimator._blocks import apply_activation_checkpointing

    model = _llama(True)
    undo = apply_activation_checkpointing(model, 2)
    assert model.config.use_cache is False
    undo()
    assert model.config.use_cache is True
    untouched = _llama(True)
    apply_activation_checkpointing(untouched, 0)()  # nothing wrapped: nothing changed
    assert untouched.config.use_cache is True
