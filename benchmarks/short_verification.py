"""The layout planner's short verification against the full trace it stands in for.

The planner verifies its winner with ``memguard.estimate(..., layout=...)``. Where a full trace of
the layout is predicted to take longer than ``verify_budget_s``, it traces the model cut to a few
blocks instead (:func:`memguard.planner._layouts.short_points`: 4 and 8 blocks, or (plain,
checkpointed) = (2, 2), (6, 2), (2, 6) when only some are checkpointed) and extrapolates every
figure to the whole stack. This prints, per case, the short and the full figure of the CUDA peak
(reserved, with the caching allocator's overhead), the allocated peak and the upper bound, and the
CPU seconds each took.

Models are Llama 3.1 8B- and 70B-shaped ``LlamaForCausalLM`` on the ``meta`` device (hidden 4096 /
8192, 32 / 80 layers, 8 KV heads, vocabulary 128256), bf16-mixed on the catalog's H100-80GB,
sequence 8192, AdamW.

Usage::

    python -m benchmarks.short_verification                 # every case
    python -m benchmarks.short_verification --cases 8b-fsdp8
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import machine_description, utc_now, write_results  # noqa: E402
from benchmarks.layout_planner import SEQ, SHAPES, _model  # noqa: E402  (the same Llama 3.1 shapes)

RESULTS = Path(__file__).resolve().parent / "results"
GiB = 2**30
CASES = {  # name: (shape, layout kwargs, micro-batch, checkpointed blocks)
    "8b-fsdp8": ("8b", dict(dp_shard=8), 2, 0),
    "8b-fsdp8-ckpt16": ("8b", dict(dp_shard=8), 2, 16),
    "8b-fsdp8-ckpt-all": ("8b", dict(dp_shard=8), 2, 32),
    "8b-fsdp4-tp2": ("8b", dict(dp_shard=4, tp=2), 2, 0),
    "8b-fsdp4-tp2-ckpt16": ("8b", dict(dp_shard=4, tp=2), 2, 16),
    "8b-hsdp2x4": ("8b", dict(dp_replicate=2, dp_shard=4), 1, 0),
    "70b-fsdp256": ("70b", dict(dp_shard=256), 1, 0),
    "70b-fsdp256-ckpt78": ("70b", dict(dp_shard=256), 2, 78),
}


def run_case(name: str) -> dict:
    import torch

    import memguard
    from memguard.estimator._tracing import keeping_blocks
    from memguard.planner._layouts import extrapolate, short_points

    shape, lay, m, k = CASES[name]
    model = _model(shape)
    ids = torch.zeros(m, SEQ, dtype=torch.long, device="meta")
    batch = {"input_ids": ids, "labels": ids}
    kwargs = dict(device="cuda", gpu="H100-80GB", precision="bf16-mixed", layout=memguard.Layout(**lay))
    n = SHAPES[shape][1]
    points = short_points(n, k)
    t0 = time.process_time()
    shorts = []
    for p, c in points:
        with keeping_blocks(p + c):
            shorts.append(memguard.estimate(model, batch, activation_checkpointing=c, **kwargs))
    short_s = time.process_time() - t0
    t1 = time.process_time()
    full = memguard.estimate(model, batch, activation_checkpointing=k, **kwargs)
    full_s = time.process_time() - t1

    def row(field: str) -> dict:
        s = extrapolate(points, [float(getattr(e, field)) for e in shorts], n - k, k)
        f = getattr(full, field)
        return {"short_gib": round(s / GiB, 3), "full_gib": round(f / GiB, 3), "error": round(s / f - 1, 5)}

    return {"case": name, "layout": memguard.Layout(**lay).describe(), "micro_batch": m, "blocks": n,
            "checkpointed": k, "points": [list(pt) for pt in points],
            "phases": sorted({e.peak_phase for e in shorts} | {full.peak_phase}),
            "peak": row("peak_bytes"), "allocated": row("allocated_peak_bytes"),
            "upper": row("peak_upper_bytes"), "short_seconds": round(short_s, 1), "full_seconds": round(full_s, 1)}


def _markdown(rows: list[dict], meta: dict) -> str:
    lines = ["# Short verification vs the full trace", "", f"Command: `{meta['command']}`  ",
             f"Date: {meta['date']}  ",
             f"Machine: {meta['machine'].get('cpu_model')} ({meta['machine'].get('cores')} cores, load average "
             f"{meta['load_average']:.1f}; CPU seconds by time.process_time)", "",
             "bf16-mixed, H100-80GB target, sequence 8192. Short: the model cut to the points' (plain, checkpointed) "
             "blocks, extrapolated to the whole stack.", "",
             "| case | layout | m | ckpt / blocks | points | peak short / full (GiB) | error | allocated error "
             "| upper error | seconds short / full |",
             "| --- | --- | ---: | --- | --- | --- | ---: | ---: | ---: | --- |"]
    for r in rows:
        pts = ", ".join(f"({p}, {c})" for p, c in r["points"])
        lines.append(f"| {r['case']} | {r['layout']} | {r['micro_batch']} | {r['checkpointed']} / {r['blocks']} | "
                     f"{pts} | {r['peak']['short_gib']} / {r['peak']['full_gib']} | {100 * r['peak']['error']:+.2f}% "
                     f"| {100 * r['allocated']['error']:+.2f}% | {100 * r['upper']['error']:+.2f}% | "
                     f"{r['short_seconds']} / {r['full_seconds']} |")
    errs = [r["peak"]["error"] for r in rows]
    lines += ["", f"Peak error: {100 * min(errs):+.2f}% to {100 * max(errs):+.2f}% over {len(rows)} cases.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    rows = []
    for name in args.cases:
        r = run_case(name)
        rows.append(r)
        print(f"{name}: peak short {r['peak']['short_gib']} GiB, full {r['peak']['full_gib']} GiB "
              f"({100 * r['peak']['error']:+.2f}%); {r['short_seconds']} s vs {r['full_seconds']} s", flush=True)
    shown = ["--cases", *args.cases] if args.cases != list(CASES) else []  # --out is not recorded
    meta = {"command": " ".join(["python -m benchmarks.short_verification", *shown]),
            "date": utc_now(), "machine": machine_description(packages=("transformers",), gpu=False),
            "load_average": os.getloadavg()[0]}
    print(write_results(args.out, "short_verification", rows, meta, _markdown))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
