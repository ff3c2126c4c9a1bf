"""QLoRA on the CPU: real bitsandbytes 4-bit steps against memguard's estimate, and FSDP2's shards.

A tiny random Llama is saved to a temporary directory and loaded back with transformers'
``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
bnb_4bit_compute_dtype=torch.bfloat16)`` on the CPU (bitsandbytes' CPU backend quantises it; nothing
is downloaded), optionally prepared by ``peft.prepare_model_for_kbit_training`` (fp32 upcast,
checkpointing), with peft LoRA r=8 on every linear layer of the blocks. For each row:

* ``real``: the steady-state peak of live tensor bytes of two real AdamW steps (torch.profiler
  memory events, :func:`benchmarks.ground_truth.measure_cpu_peak`) plus the layers' QuantState
  tensors, live throughout but reachable from neither ``parameters()`` nor ``buffers()``;
* ``model``: ``memguard.estimate`` of that real model (``device="cpu"``, ``precision="32-true"``);
* ``twin``: ``memguard.estimate`` of :func:`memguard.estimator._twins.qlora_model` of the same
  architecture on ``meta`` (no bitsandbytes involved).

Then, for FSDP2, real ``fully_shard`` (each decoder layer, then the root) over a fake process group
of N ranks, on the real model (``bnb_4bit_quant_storage=torch.bfloat16``, as FSDP-QLoRA loads it)
and on memguard's twin of it: rank 0's bytes of packed 4-bit codes and of the other parameters.

Run: ``python -m benchmarks.qlora_cpu [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch

LLAMA = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, vocab_size=1024, max_position_embeddings=512)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def load_qlora(path, *, prepare: bool, storage=torch.uint8):
    import peft
    import transformers

    quant = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=storage)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=quant, device_map="cpu",
                                                              dtype=torch.bfloat16)
    if prepare:
        model = peft.prepare_model_for_kbit_training(model)
    return peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=8, target_modules=TARGETS))


def quant_state_bytes(model) -> int:
    total, seen = 0, set()
    for m in model.modules():  # peft's wrapper exposes its base layer's weight too: count each once
        state = getattr(getattr(m, "weight", None), "quant_state", None)
        if state is None or id(state) in seen:
            continue
        seen.add(id(state))
        tensors = [state.absmax, state.code] + ([state.offset, state.state2.absmax, state.state2.code]
                                                if state.nested else [])
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total


def step_row(path, *, prepare: bool, batch_size: int, seq: int) -> dict:
    import transformers

    import memguard
    from benchmarks.ground_truth import measure_cpu_peak
    from memguard.estimator._twins import qlora_model

    ids = torch.randint(0, LLAMA["vocab_size"], (batch_size, seq), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    model = load_qlora(path, prepare=prepare)
    est_model = memguard.estimate(model, batch, device="cpu", precision="32-true").peak_bytes
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("llama", **LLAMA))
    est_twin = memguard.estimate(qlora_model(meta, prepare=prepare), batch, device="cpu",
                                 precision="32-true").peak_bytes
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    real = measure_cpu_peak(model, batch, None, opt, steps=2).steady_peak_bytes + quant_state_bytes(model)
    return dict(prepare=prepare, batch=batch_size, seq=seq, real=real, model=est_model, twin=est_twin,
                model_err=est_model / real - 1, twin_err=est_twin / real - 1)


def shard_row(path, world: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    from memguard.estimator._fsdp2 import fake_world
    from memguard.estimator._nf4 import twin_4bit_layers

    def rank0(model):
        with fake_world(world) as mesh:
            for layer in model.base_model.model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            out = {"packed": 0, "other": 0}
            for n, p in model.named_parameters():
                local = p.to_local()
                out["packed" if n.endswith("base_layer.weight") else "other"] += local.numel() * local.element_size()
        return out

    real = load_qlora(path, prepare=True, storage=torch.bfloat16)
    whole = {"packed": 0, "other": 0}
    for n, p in real.named_parameters():
        whole["packed" if n.endswith("base_layer.weight") else "other"] += p.numel() * p.element_size()
    stats = quant_state_bytes(real)
    got_real = rank0(real)
    twin = twin_4bit_layers(load_qlora(path, prepare=True, storage=torch.bfloat16)).to_empty(device="cpu")
    got_twin = rank0(twin)
    return dict(world=world, whole=whole, real_rank0=got_real, twin_rank0=got_twin, quant_state_per_rank=stats)


def main(argv=None) -> int:
    import transformers

    transformers.logging.set_verbosity_error()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows to this JSON file")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    path = tempfile.mkdtemp()
    config = transformers.AutoConfig.for_model("llama", **LLAMA)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    steps = [step_row(path, prepare=p, batch_size=b, seq=s) for p in (True, False) for b, s in ((2, 128), (2, 384))]
    print("prepare  batch x seq      real B     model B  err      twin B  err")
    for r in steps:
        print(f"{str(r['prepare']):7}  {r['batch']} x {r['seq']:<6} {r['real']:>11,} {r['model']:>11,} "
              f"{100 * r['model_err']:+5.1f}% {r['twin']:>11,} {100 * r['twin_err']:+5.1f}%")
    shards = [shard_row(path, w) for w in (2, 4)]
    print("FSDP2 rank 0 (bf16 storage): world  packed real/twin/whole   other real/twin/whole   QuantState per rank")
    for r in shards:
        print(f"  {r['world']}  {r['real_rank0']['packed']:,}/{r['twin_rank0']['packed']:,}/{r['whole']['packed']:,}"
              f"   {r['real_rank0']['other']:,}/{r['twin_rank0']['other']:,}/{r['whole']['other']:,}"
              f"   {r['quant_state_per_rank']:,}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": steps, "fsdp2": shards}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
