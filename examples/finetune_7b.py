"""Will a full fine-tune of a 7B Llama fit on a 24 GB GPU? And if not, what would?

The model is built on the ``meta`` device from Llama-2-7B's dimensions (no download, no memory);
memguard traces its training steps on fake tensors. A full fine-tune with AdamW needs ~16 bytes per
parameter for weights, gradients and optimizer state (ZeRO paper, arXiv 1910.02054), ~100 GiB for
6.7B parameters, so it cannot fit a 24 GB RTX 4090; memguard then measures the fine-tuning
alternatives (LoRA, QLoRA, an 8-bit optimizer, bf16-true, CPU offload), each planned and traced.

Run: ``python examples/finetune_7b.py`` (about a minute on a CPU).
"""

from __future__ import annotations

import torch

import memguard
from memguard.planner.api import PlanRequest, alternatives
from memguard.vocab import format_bytes

GPU = "RTX-4090"
SEQ_LEN = 512
GLOBAL_BATCH = 8


def llama2_7b_meta(layers: int = 32) -> torch.nn.Module:
    """Llama-2-7B's architecture (its config.json: 4096 hidden, 11008 MLP, 32 layers and heads,
    32000 tokens) with weights on ``meta``; ``layers`` cuts it down (for tests)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=layers, num_attention_heads=32,
                         num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096)
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def run(*, layers: int = 32, seq_len: int = SEQ_LEN, global_batch_size: int = GLOBAL_BATCH, gpu: str = GPU,
        only=None, **options):
    """Plan the full fine-tune; return (the plan or the InfeasiblePlanError, the measured alternatives).

    ``only`` limits the alternatives measured (names as in :func:`memguard.planner.api.alternatives`);
    ``options`` are more :func:`memguard.plan` options (e.g. ``budget_bytes``)."""
    model = llama2_7b_meta(layers)
    ids = torch.zeros(1, seq_len, dtype=torch.long)
    batch = {"input_ids": ids, "labels": ids}
    request = PlanRequest(global_batch_size=global_batch_size, gpu=gpu, **options)
    try:
        return memguard.plan(model, batch, **request.options()), []
    except memguard.InfeasiblePlanError as exc:
        return exc, alternatives(model, batch, request, only=only)


def main() -> None:
    result, alts = run()
    if isinstance(result, memguard.Plan):
        print(result.explain())
        return
    print(f"Full fine-tune of Llama-2-7B on {GPU} (sequence {SEQ_LEN}, global batch {GLOBAL_BATCH}):")
    print(f"  {result.reason}")
    usable = result.closest.usable_bytes if result.closest is not None else None
    print("Alternatives, measured:")
    for alt in alts:
        peak = format_bytes(alt.predicted_peak_bytes) if alt.predicted_peak_bytes is not None else "n/a"
        print(f"  {alt.name:<12} {peak:>11}  {'fits' if alt.fits else 'does not fit'}")
    print()
    for alt in alts:
        print(f"- {alt.line(usable)}")


if __name__ == "__main__":
    main()
