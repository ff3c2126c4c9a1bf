"""The layout planner on torchtitan's published Llama 3.1 layouts: memguard's choice, its predicted
per-rank peak, where the published layout ranks in memguard's order, and the planning time.

The published runs (torchtitan ``docs/performance.md`` at commit eaea6f6a, "Llama 3.1 8B, 70B, and
405B ... from 8 GPUs to 512 GPUs", on hosts of 8 H100 GPUs "fully connected with NVLink", 96 GB
HBM2e each, "400 Gb/s per GPU" RDMA; sequence length 8192 from the ``train_configs`` TOMLs, e.g.
``torchtitan/models/llama3/train_configs/llama3_405b.toml``: ``seq_len = 8192``; bf16 training
with FSDP2's mixed-precision policy, fp32 reduction; AdamW):

========== ===== ============================ ============ ===== ==================== ==========
case       GPUs  layout                       local batch  GBS   activation ckpt      table
========== ===== ============================ ============ ===== ==================== ==========
8b-8       8     FSDP 8                       2            16    selective            Table 1
8b-128     128   FSDP 128                     2            256   selective            Table 3
70b-256    256   FSDP 32 x TP 8               16           512   full                 Table 4
405b-512   512   FSDP 8 x TP 8 x PP 8 (1F1B)  32           256   full                 Table 5
========== ===== ============================ ============ ===== ==================== ==========

Table 5's pipeline uses micro-batches of 1 (torchtitan's ``pipeline_parallel_microbatch_size``
default), so 32 micro-batches; its Interleaved 1F1B row is not searched by memguard (one stage per
rank only). The published runs also use ``torch.compile``, Float8 linears and async TP, which
memguard does not model, and torchtitan's TP plan shards the embeddings and the output layer
(with loss parallel), whereas memguard's default plan (the config's ``base_model_tp_plan``)
replicates them: so memguard's figures are for the same layout under plain bf16 and the
transformers plan, not a reproduction of torchtitan's memory column (reported beside it).

Models are ``LlamaForCausalLM`` on the ``meta`` device from Llama 3.1 shapes (hidden 4096 / 8192 /
16384, layers 32 / 80 / 126, heads 32 / 64 / 128, 8 KV heads, intermediate 14336 / 28672 / 53248,
vocab 128256). The budget is 96 GB per GPU less the catalog's CUDA context (torchtitan's H100s);
compute and link figures are the catalog's ``H100-80GB`` (NVLink 450 GB/s per direction, 50 GB/s
network per GPU).

"rank" is the published layout's best configuration (any micro-batch split and checkpointing for
its degrees, with its micro-batch where it is given) in memguard's order: fitting configurations
fastest first, then the rest by predicted peak; "layout rank" counts distinct layouts only.

Usage::

    python -m benchmarks.layout_planner                  # all cases
    python -m benchmarks.layout_planner --cases 8b-8     # some
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
GB = 10**9
GiB = 2**30

SHAPES = {  # hidden, layers, heads, intermediate (Llama 3.1 configs; 8 KV heads, vocab 128256)
    "8b": (4096, 32, 32, 14336),
    "70b": (8192, 80, 64, 28672),
    "405b": (16384, 126, 128, 53248),
}
CASES = {
    # name: (shape, world, gbs, published layout kwargs, published micro-batch, published memory GiB, source)
    "8b-8": ("8b", 8, 16, dict(dp_shard=8), 2, 82.4, "docs/performance.md Table 1 (FSDP row)"),
    "8b-128": ("8b", 128, 256, dict(dp_shard=128), 2, 67.0, "docs/performance.md Table 3 (FSDP row)"),
    "70b-256": ("70b", 256, 512, dict(dp_shard=32, tp=8), 16, 71.9, "docs/performance.md Table 4 (2D row)"),
    "405b-512": ("405b", 512, 256, dict(dp_shard=8, tp=8, pp=8, pp_schedule="1F1B"), 1, 82.5,
                 "docs/performance.md Table 5 (1F1B row)"),
}
SEQ = 8192
GPUS_PER_NODE = 8


def _model(shape: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    h, layers, heads, inter = SHAPES[shape]
    cfg = LlamaConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=8,
                      intermediate_size=inter, vocab_size=128256, max_position_embeddings=SEQ)
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


def run_case(name: str) -> dict:
    import torch

    import memguard
    from memguard.estimator.gpus import get_gpu
    from memguard.estimator._layout import Layout
    from memguard.planner import _layouts
    from memguard.planner._request import PlanRequest
    from memguard.planner._session import TraceSession
    from memguard.planner.api import plan_request

    shape, world, gbs, published, pub_m, pub_mem, source = CASES[name]
    model = _model(shape)
    ids = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
    batch = {"input_ids": ids, "labels": ids}
    budget = 96 * GB - get_gpu("H100-80GB").context_bytes
    request = PlanRequest(global_batch_size=gbs, gpu="H100-80GB", budget_bytes=budget, world_size=world,
                          gpus_per_node=GPUS_PER_NODE, precision="bf16-mixed")
    session = TraceSession.for_request(model, batch, request)
    start = time.perf_counter()
    error = None
    misses: list[str] = []  # the planner's "predicted X but verified at Y" lines: what verification corrected

    class Misses(logging.Handler):
        def emit(self, record):
            if "but verified at" in record.getMessage():
                misses.append(record.getMessage().removeprefix("memguard: "))

    handler, logger = Misses(), logging.getLogger("memguard")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        plan = plan_request(model, batch, request, session=session)
    except memguard.InfeasiblePlanError as exc:
        plan, error = exc.closest, str(exc)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    seconds = time.perf_counter() - start
    space = request.resolve()
    t1 = time.perf_counter()
    profile = _layouts.build_profile(session, space.precisions, space.spec, GPUS_PER_NODE, space.checkpointing)
    cost = session.cost_inputs(space.spec, space.precisions[0])
    ranked = _layouts.rank_layouts(
        profile, world=world, gpus_per_node=GPUS_PER_NODE, global_batch_size=gbs, precisions=space.precisions,
        checkpointing=space.checkpointing, usable=space.usable_bytes, rates=cost.tflops,
        flops_per_sample=cost.flops_per_sample, ops_per_micro=cost.ops_per_micro_batch,
        intra_gbps=space.spec.interconnect_gbps, net_gbps=space.spec.scale_out_gbps)
    rank_seconds = time.perf_counter() - t1  # traces are cached by now: the ranking alone
    pub = Layout(**published)
    matches = [i for i, c in enumerate(ranked) if _layouts.same_layout(c.layout, pub)]
    exact = [i for i in matches if ranked[i].micro_batch_size == pub_m]
    layouts_seen: list = []
    for c in ranked:
        key = (c.layout.dp_replicate, c.layout.dp_shard, c.layout.tp, c.layout.pp,
               c.layout.pp_schedule if c.layout.pp > 1 else "")
        if key not in layouts_seen:
            layouts_seen.append(key)
    pub_key = (pub.dp_replicate, pub.dp_shard, pub.tp, pub.pp, pub.pp_schedule if pub.pp > 1 else "")

    def describe(c):
        return None if c is None else {
            "configuration": c.describe(), "fits": c.fits, "predicted_peak_gib": round(c.predicted_bytes / GiB, 2),
            "stage_peaks_gib": [round(p / GiB, 2) for p in c.stage_peaks], "seconds_per_step": c.cost.total,
            "cost": c.cost.describe()}

    best_pub = ranked[matches[0]] if matches else None
    exact_pub = ranked[exact[0]] if exact else None
    return {
        "case": name, "world_size": world, "gpus_per_node": GPUS_PER_NODE, "global_batch_size": gbs,
        "seq_len": SEQ, "budget_bytes": budget, "usable_bytes": space.usable_bytes,
        "published": {"layout": pub.describe(), "micro_batch": pub_m, "memory_gib": pub_mem, "source": source},
        "memguard_choice": None if plan is None else {
            "layout": plan.layout.describe() if plan.layout else None, "fits": error is None,
            "schedule": plan.layout.pp_schedule if plan.layout and plan.layout.pp > 1 else None,
            "pp_microbatches": plan.layout.pp_microbatches if plan.layout else None,
            "micro_batch_size": plan.micro_batch_size, "grad_accum_steps": plan.grad_accum_steps,
            "checkpoint_blocks": plan.checkpoint_blocks, "precision": plan.precision,
            "peak_gib": round(plan.estimate.peak_bytes / GiB, 2),
            "verified": plan.reasons.get("estimate", ""), "why": plan.reasons.get("layout", "")},
        "error": error,
        "verification_misses": misses,
        "published_rank": (matches[0] + 1) if matches else None,
        "published_rank_with_its_micro_batch": (exact[0] + 1) if exact else None,
        "published_layout_rank": layouts_seen.index(pub_key) + 1 if pub_key in layouts_seen else None,
        "layouts": len(layouts_seen), "configurations": len(ranked),
        "fitting_configurations": sum(c.fits for c in ranked),
        "published_best": describe(best_pub), "published_with_its_micro_batch": describe(exact_pub),
        "planning_seconds": round(seconds, 2), "ranking_seconds": round(rank_seconds, 3),
        "traces": session.trace_count,
        "explain": plan.explain() if plan is not None else None,
    }


def _markdown(results: list[dict], meta: dict) -> str:
    lines = [
        "# Layout planner on torchtitan's published Llama 3.1 layouts", "",
        f"Command: `{meta['command']}`  ", f"Date: {meta['date']}  ",
        f"Machine: {meta['machine'].get('cpu_model')} ({meta['machine'].get('cores')} cores, load average "
        f"{meta['machine'].get('load_average')})", "",
        "Target: 8 H100 per node, 96 GB budget per GPU less the CUDA context (torchtitan's hosts), NVLink 450 GB/s "
        "and 50 GB/s network per GPU (the catalog's H100 figures), bf16-mixed, sequence 8192. Published figures "
        "from torchtitan docs/performance.md (commit eaea6f6a); those runs add torch.compile, Float8 and async TP and "
        "shard embeddings and output by TP, which memguard's default plan does not.", "",
        "| case | published layout (memory) | memguard's choice | predicted peak | published rank (config / layout) "
        "| published layout, memguard's prediction | planning time |",
        "| --- | --- | --- | ---: | --- | --- | ---: |",
    ]
    for r in results:
        ch = r["memguard_choice"] or {}
        pub = r["published_best"] or {}
        choice = f"{ch.get('layout')}, m={ch.get('micro_batch_size')}"
        if ch.get("pp_microbatches"):
            choice += f", {ch.get('schedule')} x {ch.get('pp_microbatches')}"
        else:
            choice += f" x {ch.get('grad_accum_steps')}"
        choice += f", ckpt {ch.get('checkpoint_blocks')}" + ("" if ch.get("fits") else " (nothing fits: closest)")
        lines.append(
            f"| {r['case']} | {r['published']['layout']}, m={r['published']['micro_batch']} "
            f"({r['published']['memory_gib']} GiB) | {choice} | {ch.get('peak_gib')} GiB | "
            f"{r['published_rank']} of {r['configurations']} / {r['published_layout_rank']} of {r['layouts']} | "
            f"{pub.get('configuration')}: {pub.get('predicted_peak_gib')} GiB, "
            f"{'fits' if pub.get('fits') else 'does not fit'} | {r['planning_seconds']} s |")
    misses = [f"- {r['case']}: {m}" for r in results for m in r.get("verification_misses", [])]
    if misses:
        lines += ["", "Verifications that found the layout model short (the planner then sized the next candidate "
                  "with that shortfall):", "", *misses]
    lines += ["", "Each case's `plan.explain()`:", ""]
    for r in results:
        lines += [f"## {r['case']}", "", "```", r["explain"] or "", "```", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--out", default="layout_planner")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks.common import machine_description

    results = []
    for name in args.cases:
        r = run_case(name)
        results.append(r)
        ch = r["memguard_choice"] or {}
        print(f"{name}: memguard {ch.get('layout')} m={ch.get('micro_batch_size')} peak {ch.get('peak_gib')} GiB "
              f"(fits={ch.get('fits')}); published rank {r['published_rank']}/{r['configurations']} "
              f"(layout {r['published_layout_rank']}/{r['layouts']}); {r['planning_seconds']} s", flush=True)
    meta = {"command": "python -m benchmarks.layout_planner " + " ".join(sys.argv[1:] if argv is None else argv),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine_description(packages=("transformers",), gpu=False)}
    meta["machine"]["load_average"] = os.getloadavg()[0]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2, default=str))
    (RESULTS / f"{args.out}.md").write_text(_markdown(results, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
