"""PEFT adapter dtypes on CPU: ``memguard.estimate`` of LoRA models on a bf16 base against real steps.

``peft.get_peft_model`` keeps the adapters in float32 on a 16-bit base (``autocast_adapter_dtype=True``)
and each LoRA layer casts its input to the adapter's dtype, so what a step saves depends on what the
front-end does to the model. Each case builds the real PEFT model (r=16 on every attention and MLP
projection, from a transformers config, no download) and measures two real CPU steps with
:func:`benchmarks.ground_truth.measure_cpu_peak` (torch.profiler memory events), the steady-state
step's peak against ``memguard.estimate(..., device="cpu", precision=...)``:

- ``plain``: a plain loop, dtypes as built, no autocast (``precision="32-true"``);
- ``plain-bf16-adapters``: the same with ``autocast_adapter_dtype=False`` (adapters left in bf16);
- ``autocast``: the dtypes as built under ``torch.autocast("cpu", bfloat16)`` (``"bf16-mixed"``);
- ``lightning-bf16-true``: Lightning's ``HalfPrecision("bf16-true")``: ``convert_module`` casts the
  whole module, the forward runs in its ``forward_context`` (``"bf16-true"``);
- ``hf-trainer-bf16``: ``TrainingArguments(bf16=True)``: the model Accelerate prepares (autocast around
  the forward, the model as loaded) stepped through the Trainer's own ``compute_loss`` (``"bf16-mixed"``).

Usage::

    python benchmarks/peft_dtypes_cpu.py                 # every case on both models
    python benchmarks/peft_dtypes_cpu.py --models llama

Writes ``peft_dtypes_cpu.json`` and ``peft_dtypes_cpu.md`` to ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))
from benchmarks.ground_truth import default_loss, measure_cpu_peak  # noqa: E402

import memguard  # noqa: E402

_MIB = 1 << 20
_LLAMA = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_TARGETS = {"llama": _LLAMA, "llama-gqa": _LLAMA, "gpt2": ["c_attn", "c_proj", "c_fc"]}
CASES = ("plain", "plain-bf16-adapters", "autocast", "lightning-bf16-true", "hf-trainer-bf16")


def build(name: str, *, autocast_adapter_dtype: bool = True):
    """The bf16 base with PEFT's r=16 LoRA adapters, and its vocabulary size."""
    import peft
    import transformers

    if name.startswith("llama"):  # llama-gqa: 2 key/value heads for 8 query heads
        cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                       num_attention_heads=8, num_key_value_heads=2 if name == "llama-gqa" else 8,
                                       vocab_size=2048,
                                       max_position_embeddings=256)
        ctor = transformers.LlamaForCausalLM
    else:
        cfg = transformers.GPT2Config(n_embd=256, n_layer=4, n_head=8, vocab_size=2048, n_positions=256,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        ctor = transformers.GPT2LMHeadModel
    torch.manual_seed(0)
    base = ctor(cfg).to(torch.bfloat16)
    lora = peft.LoraConfig(r=16, lora_alpha=32, target_modules=_TARGETS[name],
                           fan_in_fan_out=name == "gpt2")  # GPT-2's Conv1D stores its weight transposed
    return peft.get_peft_model(base, lora, autocast_adapter_dtype=autocast_adapter_dtype), cfg.vocab_size


def _trainer(model, out: str, ids: torch.Tensor):
    """The HF Trainer with ``bf16=True`` and memguard's callback planning for it (a budget that the
    arguments' batch fits, so the plan keeps micro-batch 4 and no accumulation)."""
    import transformers

    from memguard.integrations.transformers import MemguardCallback

    args = transformers.TrainingArguments(output_dir=out, use_cpu=True, report_to=[], bf16=True,
                                          per_device_train_batch_size=len(ids), max_steps=1, save_strategy="no",
                                          disable_tqdm=True)
    callback = MemguardCallback(budget_bytes=1 << 30, activation_checkpointing=False)
    data = [{"input_ids": row, "labels": row} for row in ids]
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    assert callback.plan.micro_batch_size == len(ids) and callback.plan.grad_accum_steps == 1, callback.plan.explain()
    return trainer, args, callback.plan


def run_case(model_name: str, case: str, batch_size: int, seq: int) -> dict:
    model, vocab = build(model_name, autocast_adapter_dtype=case != "plain-bf16-adapters")
    ids = torch.randint(0, vocab, (batch_size, seq), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    precision = {"autocast": "bf16-mixed", "lightning-bf16-true": "bf16-true", "hf-trainer-bf16": "bf16-mixed"}.get(
        case, "32-true")
    context, loss_fn, planned = contextlib.nullcontext, None, None
    opt_cls, opt_kwargs = torch.optim.AdamW, {"lr": 1e-3}
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        if case == "hf-trainer-bf16":  # estimated after the Trainer set config.use_cache = args.use_cache (False)
            trainer, args, plan = _trainer(model, out, ids)
            planned = plan.estimate.peak_bytes  # planned in on_init_end, with args.use_cache as the Trainer sets it
        est = memguard.estimate(model, batch, device="cpu", precision=precision)  # the model as the user built it
        est_s = time.perf_counter() - t0
        if case == "autocast":
            context = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
        elif case == "lightning-bf16-true":
            from lightning.pytorch.plugins.precision import HalfPrecision

            plugin = HalfPrecision("bf16-true")
            model, context = plugin.convert_module(copy.deepcopy(model)), plugin.forward_context
        elif case == "hf-trainer-bf16":
            model = trainer.accelerator.prepare_model(trainer.model)  # Trainer.train's prepare on one device
            opt_cls, opt_kwargs = trainer.get_optimizer_cls_and_kwargs(args, model)
            loss_fn = lambda m, b: trainer.compute_loss(m, b)  # noqa: E731
        if loss_fn is None:
            def loss_fn(m, b):
                with context():
                    return default_loss(m, b)
        model.train()
        opt = opt_cls([p for p in model.parameters() if p.requires_grad], **opt_kwargs)
        truth = measure_cpu_peak(model, batch, loss_fn, opt, steps=2)
    real = truth.steady_peak_bytes
    return {"model": model_name, "case": case, "precision": precision, "batch": batch_size, "seq": seq,
            "real_bytes": real, "estimate_bytes": est.peak_bytes, "error": est.peak_bytes / real - 1,
            "real_phase": truth.peak_phase, "estimate_phase": est.peak_phase,
            "adapter_dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()
                                      if p.requires_grad}),
            "callback_plan_bytes": planned, "estimate_seconds": est_s,
            "note": next((n for n in est.notes if "parameters in" in n), "")}


def _planned(r: dict) -> str:
    if r["callback_plan_bytes"] is None:
        return "| |"
    return f"{r['callback_plan_bytes'] / _MIB:.3f} | {100 * (r['callback_plan_bytes'] / r['real_bytes'] - 1):+.2f}% |"


def write(rows: list[dict], out: Path, command: str, machine: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    machine = f"{machine or platform.processor() or platform.machine()}; torch {torch.__version__}"
    (out / "peft_dtypes_cpu.json").write_text(json.dumps({"command": command, "date": date, "machine": machine,
                                                          "rows": rows}, indent=1) + "\n")
    lines = ["# PEFT adapter dtypes on CPU: estimate vs. real steps", "",
             f"Command: `{command}`  ", f"Date: {date}  ", f"Machine: {machine}", "",
             "Real: the steady-state (second) step's peak of live tensor bytes (torch.profiler memory events, "
             "`benchmarks/ground_truth.py`). Model: a bf16 base with r=16 LoRA adapters from "
             "`peft.get_peft_model` (float32 adapters unless the case says otherwise), AdamW on the adapters. "
             "`estimate`: `memguard.estimate(model, batch, device=\"cpu\", precision=...)` of the model as the user "
             "built it (for `hf-trainer-bf16`: after the Trainer set `config.use_cache = args.use_cache`, False). "
             "`callback plan`: the `MemguardCallback`'s `plan.estimate`, made in `on_init_end` with "
             "`config.use_cache` set to `args.use_cache`, as the Trainer sets it right after (trainer.py, step 11 "
             "of `__init__`).", "",
             "| model | case | precision | adapters | real (MiB) | estimate (MiB) | error | peak phase (real/est) "
             "| callback plan (MiB) | error |",
             "|---|---|---|---|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['case']} | {r['precision']} | {'/'.join(r['adapter_dtypes'])} | "
                     f"{r['real_bytes'] / _MIB:.3f} | {r['estimate_bytes'] / _MIB:.3f} | {100 * r['error']:+.2f}% | "
                     f"{r['real_phase']}/{r['estimate_phase']} | " + _planned(r))
    worst = max(rows, key=lambda r: abs(r["error"]))
    lines += ["", f"Worst |error| {100 * abs(worst['error']):.2f}% ({worst['model']} {worst['case']}); "
              f"{sum(abs(r['error']) <= 0.03 for r in rows)} of {len(rows)} cases within 3%."]
    (out / "peft_dtypes_cpu.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--models", nargs="+", default=["llama", "llama-gqa", "gpt2"], choices=sorted(_TARGETS))
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--machine", default="", help="the machine's description, for the results")
    parser.add_argument("--out", type=Path, default=_REPO / "benchmarks" / "results")
    ns = parser.parse_args(argv)
    torch.set_num_threads(ns.threads)
    rows = []
    for m in ns.models:
        for c in ns.cases:
            row = run_case(m, c, ns.batch, ns.seq)
            rows.append(row)
            print(f"{m:6s} {c:20s} {row['precision']:10s} real {row['real_bytes'] / _MIB:9.3f} MiB  "
                  f"estimate {row['estimate_bytes'] / _MIB:9.3f} MiB  {100 * row['error']:+.2f}%", flush=True)
    command = shlex.join(["python", "benchmarks/peft_dtypes_cpu.py", *(argv if argv is not None else sys.argv[1:])])
    write(rows, ns.out, command, ns.machine)


if __name__ == "__main__":
    main()
