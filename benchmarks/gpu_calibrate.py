"""Calibrate ``memguard.estimate(device="cuda")`` against a real GPU.

For each model (GPT-2 small, a small Llama-style model, a CNN, an MLP) and each of its
precisions, the script runs two real training steps on the GPU (forward + loss, backward,
``optimizer.step()``, ``optimizer.zero_grad(set_to_none=True)``; AdamW with torch's default
``foreach`` on CUDA), resets the allocator's peak statistics between them, and compares the
second (steady-state) step's ``torch.cuda.max_memory_reserved()`` with the estimate's
``peak_bytes`` and ``torch.cuda.max_memory_allocated()`` with its ``allocated_peak_bytes``.
The estimate is asked with ``gpu=None`` (the visible device's constants) for the same model
built on the ``meta`` device, and once more as a machine without a GPU makes it (traced on CPU
fake tensors with CUDA's autocast emulated and the CUDA kernel model; ``est_cpu_fakes_*``). It also records the CUDA context the driver reports
(``memguard.estimator.gpus.measure_context_bytes``) next to the estimate's ``context_bytes``.

Precisions follow Lightning's meaning: ``*-mixed`` = fp32 weights and ``torch.autocast``
(``16-mixed`` with ``torch.amp.GradScaler``), ``*-true`` = the module and float inputs cast
with ``.to(dtype)``.

Cases run one after another in one process; between cases every tensor is released and
``torch.cuda.empty_cache()`` returns the cached segments, so each case starts from an empty
allocator. ``--max-seconds`` (default 420) stops starting new cases once spent, so a run fits
in 8 minutes; results are written after every case, so a killed run keeps what it measured.

``--dry-run`` runs the same pipeline without CUDA: tiny models, ``estimate(device="cpu")``
against the peak of live tensor bytes of two real CPU steps measured with ``torch.profiler``
(:func:`benchmarks.ground_truth.measure_cpu_peak`), for the precisions the CPU runs
(32-true, bf16-mixed, bf16-true).

Usage::

    PYTHONPATH=. python benchmarks/gpu_calibrate.py --out benchmarks/results/gpu
    PYTHONPATH=. python benchmarks/gpu_calibrate.py --dry-run --out /some/dir
    PYTHONPATH=. python benchmarks/gpu_calibrate.py --cases gpt2-small --precisions bf16-mixed

Writes ``gpu_calibrate.json`` and ``gpu_calibrate.md`` to ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))  # `memguard` and `benchmarks` from this checkout
from benchmarks.common import machine_description  # noqa: E402

_MiB = 1 << 20
_GiB = 1 << 30
SEED = 0
CPU_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")  # what a CPU step can run (no fp16 autocast/scaler)
_DTYPE = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16, "16-true": torch.float16,
          "bf16-true": torch.bfloat16}
_CAST = {"16-true": torch.float16, "bf16-true": torch.bfloat16}  # *-true: module and float inputs cast


# --------------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------------


class ConvNet(nn.Module):
    """conv-BN-ReLU stages (stride 2 between stages), global pooling, a linear classifier."""

    def __init__(self, widths: tuple[int, ...], classes: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        cin = 3
        for i, w in enumerate(widths):
            for j in range(2):
                stride = 2 if (j == 0 and i > 0) else 1
                layers += [nn.Conv2d(cin, w, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(w),
                           nn.ReLU(inplace=True)]
                cin = w
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.features(x), 1), 1))


class MLP(nn.Module):
    """Linear-GELU layers and a linear classifier."""

    def __init__(self, dims: tuple[int, ...], classes: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.out = nn.Linear(dims[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.gelu(layer(x))
        return self.out(x)


def _classify(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(SEED)


@dataclass(frozen=True)
class Case:
    """One model: how to build it on a device, its example batch (on the CPU) and its loss."""

    name: str
    build: Callable[[str, bool], nn.Module]  # (device, tiny) -> model
    batch: Callable[[bool], Any]  # tiny -> batch on the CPU
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None
    precisions: tuple[str, ...]
    shape: Callable[[bool], str]  # tiny -> "micro-batch x ..." for the report


def _hf(cls_name: str, config) -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    return getattr(transformers, cls_name)(config)


def _build_gpt2(device: str, tiny: bool) -> nn.Module:
    import transformers

    if tiny:
        cfg = transformers.GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=4)
    else:
        cfg = transformers.GPT2Config()  # GPT-2 small: 124M, 12 layers, 768 hidden, vocab 50257
    torch.manual_seed(SEED)
    with torch.device(device):
        return _hf("GPT2LMHeadModel", cfg)


def _build_llama(device: str, tiny: bool) -> nn.Module:
    import transformers

    if tiny:
        cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                       attn_implementation="sdpa")
    else:
        cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1408,
                                       num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                                       max_position_embeddings=1024, attn_implementation="sdpa")
    torch.manual_seed(SEED)
    with torch.device(device):
        return _hf("LlamaForCausalLM", cfg)


def _lm_batch(vocab_tiny: int, vocab: int, shape_tiny: tuple[int, int], shape: tuple[int, int]):
    def make(tiny: bool) -> dict[str, torch.Tensor]:
        b, s = shape_tiny if tiny else shape
        ids = torch.randint(0, vocab_tiny if tiny else vocab, (b, s), generator=_generator())
        return {"input_ids": ids, "labels": ids.clone()}

    return make


def _build_cnn(device: str, tiny: bool) -> nn.Module:
    torch.manual_seed(SEED)
    with torch.device(device):
        return ConvNet((8, 16) if tiny else (64, 128, 256), classes=10 if tiny else 100)


def _cnn_batch(tiny: bool):
    b, hw, classes = (4, 16, 10) if tiny else (64, 128, 100)
    g = _generator()
    return torch.randn(b, 3, hw, hw, generator=g), torch.randint(0, classes, (b,), generator=g)


def _build_mlp(device: str, tiny: bool) -> nn.Module:
    torch.manual_seed(SEED)
    with torch.device(device):
        return MLP((64, 128, 128) if tiny else (1024, 4096, 4096, 4096, 4096), classes=10 if tiny else 1000)


def _mlp_batch(tiny: bool):
    b, d, classes = (16, 64, 10) if tiny else (512, 1024, 1000)
    g = _generator()
    return torch.randn(b, d, generator=g), torch.randint(0, classes, (b,), generator=g)


CASES: dict[str, Case] = {
    c.name: c
    for c in (
        Case("gpt2-small", _build_gpt2, _lm_batch(512, 50257, (2, 32), (8, 1024)), None,
             ("32-true", "bf16-mixed", "16-mixed"), lambda t: "2 × 32 tokens" if t else "8 × 1024 tokens"),
        Case("llama-small", _build_llama, _lm_batch(256, 32000, (2, 32), (8, 512)), None,
             ("bf16-mixed", "bf16-true"), lambda t: "2 × 32 tokens" if t else "8 × 512 tokens"),
        Case("cnn", _build_cnn, _cnn_batch, _classify, ("32-true", "bf16-mixed"),
             lambda t: "4 × 3×16×16" if t else "64 × 3×128×128"),
        Case("mlp", _build_mlp, _mlp_batch, _classify, ("32-true", "bf16-mixed", "16-true"),
             lambda t: "16 × 64" if t else "512 × 1024"),
    )
}


# --------------------------------------------------------------------------------------------
# one real training step, as memguard.estimate models it
# --------------------------------------------------------------------------------------------


def _call(model: nn.Module, batch: Any, loss_fn) -> torch.Tensor:
    if loss_fn is not None:
        return loss_fn(model, batch)
    if isinstance(batch, dict):
        out = model(**batch)
    elif isinstance(batch, (tuple, list)):
        out = model(*batch)
    else:
        out = model(batch)
    return out.loss if hasattr(out, "loss") else out


def _to(batch: Any, device: str, dtype: torch.dtype | None) -> Any:
    def move(t: torch.Tensor) -> torch.Tensor:
        if dtype is not None and t.is_floating_point():
            return t.to(device=device, dtype=dtype)
        return t.to(device)

    if isinstance(batch, dict):
        return {k: move(v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(move(v) for v in batch)
    return move(batch)


def make_loss(case: Case, precision: str, device: str) -> Callable[[nn.Module, Any], torch.Tensor]:
    """The case's loss, under autocast for the mixed precisions (forward and loss only)."""
    if precision.endswith("-mixed"):
        dtype = _DTYPE[precision]

        def loss(model, batch):
            with torch.autocast(device, dtype=dtype):
                return _call(model, batch, case.loss_fn)

        return loss
    return lambda model, batch: _call(model, batch, case.loss_fn)


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


def real_gpu_step_peaks(case: Case, precision: str) -> dict[str, Any]:
    """Two real steps on CUDA; the allocator's peaks during the second."""
    device = "cuda"
    gc.collect()
    torch.cuda.empty_cache()  # start from an empty allocator (a failed case may have left cache)
    model = case.build(device, False).train()
    dtype = _CAST.get(precision)
    if dtype is not None:
        model.to(dtype)
    batch = _to(case.batch(False), device, dtype)
    optimizer = adamw(model.parameters())
    scaler = torch.amp.GradScaler("cuda") if precision == "16-mixed" else None
    loss_fn = make_loss(case, precision, device)

    def step() -> None:
        loss = loss_fn(model, batch)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    try:
        step()  # creates the optimizer state (lazily), cuBLAS handles, autotuned kernels
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        stats = torch.cuda.memory_stats()
        from memguard.estimator.gpus import measure_context_bytes

        return {
            "real_reserved_bytes": int(torch.cuda.max_memory_reserved()),
            "real_allocated_bytes": int(torch.cuda.max_memory_allocated()),
            "real_context_bytes": measure_context_bytes(),
            "alloc_retries": int(stats.get("num_alloc_retries", 0)),
            "step_seconds": seconds,
        }
    finally:
        del model, optimizer, batch, scaler
        gc.collect()
        torch.cuda.empty_cache()


def real_cpu_step_peak(case: Case, precision: str) -> dict[str, Any]:
    """Dry run: two real CPU steps; the peak of live tensor bytes of the second (torch.profiler)."""
    from benchmarks.ground_truth import measure_cpu_peak

    model = case.build("cpu", True).train()
    dtype = _CAST.get(precision)
    if dtype is not None:
        model.to(dtype)
    batch = _to(case.batch(True), "cpu", dtype)
    t0 = time.perf_counter()
    truth = measure_cpu_peak(model, batch, make_loss(case, precision, "cpu"), adamw(model.parameters()), steps=2)
    return {
        "real_reserved_bytes": None,
        "real_allocated_bytes": truth.steady_peak_bytes,
        "real_context_bytes": None,
        "real_peak_phase": truth.peak_phase,
        "step_seconds": (time.perf_counter() - t0) / 2,
    }


def estimate_case(case: Case, precision: str, dry_run: bool) -> dict[str, Any]:
    import memguard

    model = case.build("meta", dry_run)
    t0 = time.perf_counter()
    est = memguard.estimate(model, case.batch(dry_run), optimizer=adamw, loss_fn=case.loss_fn,
                            device="cpu" if dry_run else "cuda", precision=precision)
    row = {
        "est_peak_bytes": est.peak_bytes,
        "est_allocated_bytes": est.allocated_peak_bytes,
        "est_context_bytes": est.context_bytes,
        "est_peak_phase": est.peak_phase,
        "est_gpu": est.gpu,
        "est_breakdown": dict(est.breakdown),
        "est_seconds": time.perf_counter() - t0,
        "est_cpu_fakes_peak_bytes": None,
        "est_cpu_fakes_allocated_bytes": None,
    }
    if not dry_run:
        fakes = estimate_on_cpu_fakes(case, precision)
        row["est_cpu_fakes_peak_bytes"] = fakes.peak_bytes
        row["est_cpu_fakes_allocated_bytes"] = fakes.allocated_peak_bytes
    return row


def estimate_on_cpu_fakes(case: Case, precision: str):
    """The CUDA estimate as a machine without a GPU makes it: traced on CPU fake tensors (CUDA's
    autocast emulated, the CUDA kernel model applied), with this GPU's catalog constants.

    memguard traces on fake CUDA tensors whenever a GPU is visible; hiding it from that one check
    (``torch.cuda.is_available``) selects the CPU-fake path without changing anything else.
    """
    from unittest import mock

    import memguard
    from memguard.estimator.gpus import current_gpu, get_gpu

    spec = current_gpu()
    try:
        gpu = get_gpu(spec.name).name if spec is not None else None
    except Exception:  # noqa: BLE001 - a GPU outside the catalog: generic constants
        gpu = None
    model = case.build("meta", False)
    with mock.patch.object(torch.cuda, "is_available", lambda: False):
        return memguard.estimate(model, case.batch(False), optimizer=adamw, loss_fn=case.loss_fn, device="cuda",
                                 precision=precision, gpu=gpu)


def _pct(est: int | None, real: int | None) -> float | None:
    if est is None or not real:
        return None
    return 100.0 * (est - real) / real


def run_case(case: Case, precision: str, dry_run: bool) -> dict[str, Any]:
    row: dict[str, Any] = {"case": case.name, "precision": precision, "shape": case.shape(dry_run)}
    try:
        row.update(estimate_case(case, precision, dry_run))
    except Exception as exc:  # noqa: BLE001 - report and go on with the other cases
        row["error"] = f"estimate: {type(exc).__name__}: {exc}"[:300]
    try:
        row.update(real_cpu_step_peak(case, precision) if dry_run else real_gpu_step_peaks(case, precision))
    except Exception as exc:  # noqa: BLE001 - an OOM or a bug in one case must not end the run
        row["error"] = (row.get("error", "") + f" real: {type(exc).__name__}: {exc}")[:600].strip()
    row["reserved_error_pct"] = _pct(row.get("est_peak_bytes"), row.get("real_reserved_bytes"))
    row["allocated_error_pct"] = _pct(row.get("est_allocated_bytes"), row.get("real_allocated_bytes"))
    row["reserved_error_cpu_fakes_pct"] = _pct(row.get("est_cpu_fakes_peak_bytes"), row.get("real_reserved_bytes"))
    return row


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"cases": len(rows), "errors": sum(1 for r in rows if r.get("error"))}
    for key in ("reserved_error_pct", "allocated_error_pct", "reserved_error_cpu_fakes_pct"):
        errs = [abs(r[key]) for r in rows if r.get(key) is not None]
        if errs:
            out[key] = {"n": len(errs), "median_abs": statistics.median(errs), "max_abs": max(errs)}
    return out


def _in(n: int | None, unit: int) -> str:
    return "—" if n is None else f"{n / unit:,.0f}"


def _signed(x: float | None) -> str:
    return "—" if x is None else f"{x:+.1f}"


def render_markdown(rows: list[dict[str, Any]], summary: dict[str, Any], meta: dict[str, Any]) -> str:
    m = meta["machine"]
    unit, u = (1 << 10, "KiB") if meta["dry_run"] else (_MiB, "MiB")  # dry-run models are tiny

    def b(n: int | None) -> str:
        return _in(n, unit)

    target = "CPU dry run (estimate device='cpu' vs torch.profiler live bytes)" if meta["dry_run"] else (
        f"{m.get('gpu')} ({_in(m.get('gpu_memory_bytes'), _MiB)} MiB, sm {m.get('compute_capability')})")
    lines = [
        "# memguard GPU calibration" + (" (dry run)" if meta["dry_run"] else ""),
        "",
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}",
        f"- target: {target}",
        f"- software: Python {m.get('python')}, torch {m.get('torch')} (CUDA {m.get('cuda')}), "
        f"transformers {m.get('transformers', '—')}",
        "- real: two AdamW training steps, peaks of the second; estimate: the same model on meta, gpu=None",
        f"- wall time: {meta['wall_seconds']:.0f} s",
        "",
        f"| case | precision | batch | est. peak {u} | real reserved {u} | err % | est. alloc {u} | "
        f"real alloc {u} | err % | est. ctx {u} | real ctx {u} | est. s | note |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        note = r.get("error") or (f"{r['alloc_retries']} alloc retries" if r.get("alloc_retries") else "")
        est_s = "—" if r.get("est_seconds") is None else f"{r['est_seconds']:.1f}"
        lines.append(
            f"| {r['case']} | {r['precision']} | {r['shape']} | {b(r.get('est_peak_bytes'))} | "
            f"{b(r.get('real_reserved_bytes'))} | {_signed(r.get('reserved_error_pct'))} | "
            f"{b(r.get('est_allocated_bytes'))} | {b(r.get('real_allocated_bytes'))} | "
            f"{_signed(r.get('allocated_error_pct'))} | {b(r.get('est_context_bytes'))} | "
            f"{b(r.get('real_context_bytes'))} | {est_s} | {note.replace('|', '/')} |"
        )
    lines.append("")
    alloc_label = ("allocated_peak_bytes vs the profiler's live tensor bytes" if meta["dry_run"]
                   else "allocated_peak_bytes vs max_memory_allocated")
    for key, label in (("reserved_error_pct", "peak_bytes vs max_memory_reserved"),
                       ("allocated_error_pct", alloc_label),
                       ("reserved_error_cpu_fakes_pct",
                        "peak_bytes traced on CPU fakes (as without a GPU) vs max_memory_reserved")):
        s = summary.get(key)
        if s:
            lines.append(f"- {label}: |error| median {s['median_abs']:.1f}%, max {s['max_abs']:.1f}% "
                         f"over {s['n']} runs")
    if meta.get("skipped"):
        lines.append(f"- skipped (time budget): {', '.join(meta['skipped'])}")
    return "\n".join(lines) + "\n"


def write(out: Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    summary = summarize(rows)
    md = render_markdown(rows, summary, meta)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_calibrate.json").write_text(json.dumps({**meta, "summary": summary, "rows": rows}, indent=2) + "\n")
    (out / "gpu_calibrate.md").write_text(md)
    return md


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; see the module docstring."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(Path("benchmarks") / "results"), help="folder for the .json/.md")
    parser.add_argument("--dry-run", action="store_true", help="no CUDA: tiny models, CPU estimate vs CPU steps")
    parser.add_argument("--cases", default="", help=f"comma-separated, from {', '.join(CASES)} (default: all)")
    parser.add_argument("--precisions", default="", help="comma-separated filter (default: each case's own)")
    parser.add_argument("--max-seconds", type=float, default=420.0,
                        help="start no new case after this many seconds (the first one always runs)")
    args = parser.parse_args(argv)

    names = [n for n in args.cases.split(",") if n] or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
    wanted = {p for p in args.precisions.split(",") if p}
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device is visible; use --dry-run to exercise the pipeline on the CPU")
    if args.dry_run:
        torch.set_num_threads(1)  # deterministic CPU allocations, and fair to a shared machine

    runs = [(CASES[n], p) for n in names for p in CASES[n].precisions
            if (not wanted or p in wanted) and (not args.dry_run or p in CPU_PRECISIONS)]
    meta: dict[str, Any] = {
        "command": "python benchmarks/gpu_calibrate.py" + ("" if not argv else " " + shlex.join(argv)),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "dry_run": args.dry_run,
        "machine": machine_description(gpu=not args.dry_run),
        "wall_seconds": 0.0,
        "skipped": [],
    }
    out = Path(args.out)
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for case, precision in runs:
        if rows and time.perf_counter() - t0 > args.max_seconds:  # the first case always runs
            meta["skipped"].append(f"{case.name}/{precision}")
            continue
        row = run_case(case, precision, args.dry_run)
        rows.append(row)
        meta["wall_seconds"] = time.perf_counter() - t0
        write(out, rows, meta)  # after every case: a killed run keeps what it measured
        print(f"  {case.name} {precision}: reserved err {_signed(row.get('reserved_error_pct'))}%, "
              f"allocated err {_signed(row.get('allocated_error_pct'))}% {row.get('error', '')}",
              file=sys.stderr, flush=True)
    meta["wall_seconds"] = time.perf_counter() - t0
    print(write(out, rows, meta))
    return 1 if rows and all(r.get("error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
