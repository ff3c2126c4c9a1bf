"""Kernel-level GPU check of memguard's CUDA kernel model (``memguard.estimator._cuda_rules``).

For each op family the CUDA kernel model rewrites (dropout, fp16 softmax with an fp32 result,
cross-entropy, layer norm, RMS norm, embedding, capped cuDNN convolution) and for the foreach
AdamW step, the script runs the op on small shapes on a real GPU and records, from
``torch.cuda.memory_allocated`` / ``max_memory_allocated``:

* ``forward_peak``: most bytes live at once during the forward, above its inputs;
* ``forward_kept``: bytes live after the forward (outputs and what autograd saved);
* ``backward_peak`` / ``backward_kept``: the same for the backward, driven by a pre-built
  gradient of ones, above the state it started in.

A few ops without a rule (``mse_loss``, ``batch_norm``, ``group_norm``; kind ``no-rule``) are
measured too: for them the model is the CPU trace, and the GPU shows whether CUDA agrees.

Next to each it writes what memguard says for the same op: the op run on CPU fake tensors under
:class:`memguard.estimator._cuda_kernels.CudaKernelModel` (``model_*``) and as the CPU trace
records it without the kernel model (``cpu_trace_*``), each allocation rounded up to the caching
allocator's 512-byte blocks (``kMinBlockSize``, c10/cuda/CUDACachingAllocator.cpp), which is what
``memory_allocated`` counts. Convolutions are a bound: the model's peaks add the whole
``CUDNN_CONV_WSCAP_DBG`` cap (set by ``--conv-cap-mib``), the bound ``memguard.estimator._unmodelled``
gives the cuDNN workspace, so the GPU's figures must not exceed the model's. Each op runs once as a warm-up first (cuDNN/cuBLAS handles, lazily built
state).

Then it appends ``benchmarks/gpu_calibrate.py``'s end-to-end rows (real training steps against
``memguard.estimate(device="cuda")``), each also estimated through the path a machine without a
GPU takes (CPU fake tensors, ``est_cpu_fakes_*``), until ``--max-seconds`` (default 200) is spent, so a run ends within
5 minutes.

``--dry-run`` needs no CUDA: it computes every model column, leaves the GPU columns empty, and runs
one tiny end-to-end row through ``gpu_calibrate``'s own dry run.

Usage::

    PYTHONPATH=. python benchmarks/gpu_kernels.py --out benchmarks/results/gpu
    PYTHONPATH=. python benchmarks/gpu_kernels.py --dry-run --out /some/dir

Writes ``gpu_kernels.json`` to ``--out`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import json
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))  # `memguard` and `benchmarks` from this checkout
from benchmarks.common import machine_description  # noqa: E402
from memguard.estimator._cuda_kernels import CudaTarget  # noqa: E402
from memguard.estimator._op_memory import modelled_op_memory  # noqa: E402
from memguard.estimator._trace import load_rules  # noqa: E402

BLOCK = 512  # c10/cuda/CUDACachingAllocator.cpp kMinBlockSize: memory_allocated counts whole blocks
METRICS = ("forward_peak", "forward_kept", "backward_peak", "backward_kept")


@dataclass(frozen=True)
class KernelCase:
    """One op on small shapes.

    Attributes:
        name: ``family/variant``.
        make_inputs: ``make_inputs(device)`` -> the op's inputs (leaves already require grad).
        op: ``op(*inputs)`` -> one tensor.
        kind: ``"exact"`` (the model claims the kernel's bytes) or ``"bound"`` (an upper bound).
        gpu_context: wraps the GPU run (e.g. ``torch.autocast``); the model gets ``model_context``.
    """

    name: str
    make_inputs: Callable[[str], tuple]
    op: Callable[..., torch.Tensor]
    kind: str = "exact"
    gpu_context: Callable[[], Any] = contextlib.nullcontext
    model_context: Callable[[], Any] = contextlib.nullcontext
    note: str = ""


def _leaf(*shape, dtype=torch.float32):
    def make(device: str) -> tuple:
        g = torch.Generator(device=device).manual_seed(0) if device != "meta" else None
        return (torch.randn(*shape, device=device, dtype=dtype, generator=g).requires_grad_(),)

    return make


def _with_params(shape, params, dtype=torch.float32):
    def make(device: str) -> tuple:
        x = torch.randn(*shape, device=device, dtype=dtype).requires_grad_()
        return (x, *(torch.randn(*p, device=device, dtype=dtype).requires_grad_() for p in params))

    return make


def _logits_and_targets(rows: int, classes: int, dtype=torch.float32):
    def make(device: str) -> tuple:
        return (torch.randn(rows, classes, device=device, dtype=dtype).requires_grad_(),
                torch.randint(0, classes, (rows,), device=device))

    return make


def _indices_and_table(shape, vocab: int, dim: int):
    def make(device: str) -> tuple:
        return (torch.randint(0, vocab, shape, device=device),
                torch.randn(vocab, dim, device=device).requires_grad_())

    return make


def _batch_norm_inputs(device: str) -> tuple:
    c = 64
    return (torch.randn(32, c, 28, 28, device=device).requires_grad_(), torch.ones(c, device=device).requires_grad_(),
            torch.zeros(c, device=device).requires_grad_(), torch.zeros(c, device=device), torch.ones(c, device=device))


def _autocast_fp16_emulated():
    from memguard.estimator._autocast import CudaAutocastEmulation

    return CudaAutocastEmulation(torch.float16)


def kernel_cases() -> list[KernelCase]:
    """The op families of the CUDA kernel model, on shapes that run in milliseconds."""
    return [
        KernelCase("dropout/fp32", _leaf(256, 1024), lambda x: F.dropout(x, 0.1)),
        KernelCase("dropout/bf16", _leaf(256, 1024, dtype=torch.bfloat16), lambda x: F.dropout(x, 0.1)),
        KernelCase("log_softmax/fp16->fp32", _leaf(256, 8192, dtype=torch.float16),
                   lambda x: F.log_softmax(x, -1, dtype=torch.float32)),
        KernelCase("softmax/fp16->fp32", _leaf(256, 8192, dtype=torch.float16),
                   lambda x: F.softmax(x, -1, dtype=torch.float32)),
        KernelCase("cross_entropy/fp32", _logits_and_targets(1024, 8192), lambda x, t: F.cross_entropy(x, t)),
        KernelCase("cross_entropy/fp32-label-smoothing", _logits_and_targets(1024, 8192),
                   lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1)),
        KernelCase("cross_entropy/autocast-fp16", _logits_and_targets(1024, 8192),
                   lambda x, t: F.cross_entropy(x.half(), t),
                   gpu_context=lambda: torch.autocast("cuda", torch.float16),
                   model_context=_autocast_fp16_emulated,
                   note="model: memguard's CUDA autocast emulation inside the kernel model"),
        KernelCase("layer_norm/fp32", _with_params((8192, 768), [(768,), (768,)]),
                   lambda x, w, b: F.layer_norm(x, (768,), w, b)),
        KernelCase("layer_norm/bf16", _with_params((8192, 768), [(768,), (768,)], torch.bfloat16),
                   lambda x, w, b: F.layer_norm(x, (768,), w, b)),
        KernelCase("layer_norm/many-rows", _with_params((131072, 64), [(64,), (64,)]),
                   lambda x, w, b: F.layer_norm(x, (64,), w, b), note="M > 65536: partial dgamma/dbeta buffers"),
        KernelCase("rms_norm/fp32", _with_params((8192, 1024), [(1024,)]), lambda x, w: F.rms_norm(x, (1024,), w)),
        KernelCase("rms_norm/bf16", _with_params((8192, 1024), [(1024,)], torch.bfloat16),
                   lambda x, w: F.rms_norm(x, (1024,), w)),
        KernelCase("embedding/sorted", _indices_and_table((8, 1024), 50257, 768), lambda i, w: F.embedding(i, w),
                   note="8192 indices > 3072: sort-based backward (cub temp storage not modelled)"),
        KernelCase("embedding/small", _indices_and_table((2, 512), 50257, 768), lambda i, w: F.embedding(i, w)),
        # no rule: the CPU trace's figures are the model; the GPU shows whether CUDA agrees
        KernelCase("mse_loss/fp32", _with_params((1024, 1024), [(1024, 1024)]), lambda x, t: F.mse_loss(x, t),
                   kind="no-rule", note="CPU correction: the reduced loss keeps its unreduced buffer"),
        KernelCase("batch_norm/fp32", _batch_norm_inputs, lambda x, w, b, rm, rv: F.batch_norm(x, rm, rv, w, b, True),
                   kind="no-rule", note="CUDA takes cudnn_batch_norm (reserve space)"),
        KernelCase("group_norm/fp32", _with_params((32, 64, 28, 28), [(64,), (64,)]),
                   lambda x, w, b: F.group_norm(x, 8, w, b), kind="no-rule"),
        KernelCase("conv2d/capped", _with_params((16, 64, 56, 56), [(64, 64, 3, 3)]),
                   lambda x, w: F.conv2d(x, w, padding=1), kind="bound",
                   note="cuDNN workspace bounded by CUDNN_CONV_WSCAP_DBG"),
    ]


# --------------------------------------------------------------------------------------------
# measurements
# --------------------------------------------------------------------------------------------


def measure_gpu(case: KernelCase) -> dict[str, int]:
    """The op on the GPU: allocator figures above the inputs (forward) and above the state the
    backward starts in."""
    sync = torch.cuda.synchronize
    for attempt in range(2):  # the first pass is a warm-up
        gc.collect()
        torch.cuda.empty_cache()
        inputs = case.make_inputs("cuda")
        sync()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with case.gpu_context():
            out = case.op(*inputs)
        sync()
        fpeak = torch.cuda.max_memory_allocated() - base
        fkept = torch.cuda.memory_allocated() - base
        grad = torch.ones_like(out)
        sync()
        base2 = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        torch.autograd.backward(out, grad)
        sync()
        bpeak = torch.cuda.max_memory_allocated() - base2
        bkept = torch.cuda.memory_allocated() - base2
        del inputs, out, grad
    return {"forward_peak": fpeak, "forward_kept": fkept, "backward_peak": bpeak, "backward_kept": bkept}


def model_case(case: KernelCase, target: CudaTarget, kernel_model: bool) -> dict[str, int]:
    def op(*inputs):
        with case.model_context():
            return case.op(*inputs)

    m = modelled_op_memory(op, case.make_inputs, target, kernel_model=kernel_model, round_to=BLOCK)
    out = {k: getattr(m, k) for k in METRICS}
    if case.kind == "bound" and kernel_model:  # the bound of what no rule replays, as Estimate.peak_upper_bytes adds it
        extra = unmodelled_bound(case, target)
        out["forward_peak"] += extra
        out["backward_peak"] += extra
    return out


def unmodelled_bound(case: KernelCase, target: CudaTarget) -> int:
    """The largest bound among the entries :mod:`memguard.estimator._unmodelled` reports for the case's
    call (e.g. a convolution's cuDNN workspace under ``CUDNN_CONV_WSCAP_DBG``), on meta inputs."""
    from memguard.estimator._unmodelled import UnmodelledFinder

    inputs = case.make_inputs("meta")
    with UnmodelledFinder(target) as finder, case.model_context():
        case.op(*inputs)
    return max((e.bound_bytes or 0 for e in finder.unmodelled), default=0)


def _adamw_params(device: str) -> list[torch.Tensor]:
    shapes = [(1024, 1024), (1024,), (4096, 1024), (1024, 4096)]
    return [torch.zeros(s, device=device).requires_grad_() for s in shapes]


def _adamw_step_bytes(params: list[torch.Tensor], on_step: Callable[[Callable[[], None]], dict[str, int]]) -> dict:
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=True)  # memguard traces CUDA with foreach=True
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()  # lazily built state
    return on_step(opt.step)


def measure_gpu_adamw() -> dict[str, int]:
    def on_step(step):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return {"step_peak": torch.cuda.max_memory_allocated() - base,
                "step_kept": torch.cuda.memory_allocated() - base}

    gc.collect()
    torch.cuda.empty_cache()
    return _adamw_step_bytes(_adamw_params("cuda"), on_step)


def model_adamw() -> dict[str, int]:
    """The foreach step traced on CPU fake tensors, as memguard's trace records it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memguard.estimator._trace import Trace, Recorder

    def on_step(step):
        trace = Trace()
        with Recorder(trace):
            step()
        live = peak = 0
        for _, n in trace.events:
            size = -(-abs(n) // BLOCK) * BLOCK
            live += size if n > 0 else -size
            peak = max(peak, live)
        return {"step_peak": peak, "step_kept": live}

    with FakeTensorMode(allow_non_fake_inputs=True):
        return _adamw_step_bytes(_adamw_params("cpu"), on_step)


def _diff(model: int | None, gpu: int | None) -> int | None:
    return None if model is None or gpu is None else model - gpu


def run_kernel_rows(dry_run: bool, target: CudaTarget) -> list[dict[str, Any]]:
    load_rules()
    rows: list[dict[str, Any]] = []
    for case in kernel_cases():
        row: dict[str, Any] = {"case": case.name, "kind": case.kind, "note": case.note}
        try:
            model = model_case(case, target, True)
            cpu = model_case(case, target, False)
            row.update({f"model_{k}": v for k, v in model.items()})
            row.update({f"cpu_trace_{k}": v for k, v in cpu.items()})
        except Exception as exc:  # noqa: BLE001 - report and go on with the other cases
            row["error"] = f"model: {type(exc).__name__}: {exc}"[:300]
        gpu: dict[str, int] = {}
        if not dry_run:
            try:
                gpu = measure_gpu(case)
            except Exception as exc:  # noqa: BLE001
                row["error"] = (row.get("error", "") + f" gpu: {type(exc).__name__}: {exc}")[:600].strip()
        for k in METRICS:
            row[f"gpu_{k}"] = gpu.get(k)
            row[f"diff_{k}"] = _diff(row.get(f"model_{k}"), gpu.get(k))
        if case.kind == "bound" and gpu:
            row["bound_holds"] = all(row[f"model_{k}"] >= gpu[k] for k in ("forward_peak", "backward_peak"))
        rows.append(row)
        print(f"  {case.name}: " + ", ".join(f"{k} model {row.get('model_' + k)} gpu {row.get('gpu_' + k)}"
                                             for k in ("forward_kept", "backward_peak")), file=sys.stderr, flush=True)
    row = {"case": "adamw/foreach", "kind": "exact", "note": "step peak above params, grads and state"}
    try:
        row.update({f"model_{k}": v for k, v in model_adamw().items()})
    except Exception as exc:  # noqa: BLE001
        row["error"] = f"model: {type(exc).__name__}: {exc}"[:300]
    gpu = {}
    if not dry_run:
        try:
            gpu = measure_gpu_adamw()
        except Exception as exc:  # noqa: BLE001
            row["error"] = (row.get("error", "") + f" gpu: {type(exc).__name__}: {exc}")[:600].strip()
    for k in ("step_peak", "step_kept"):
        row[f"gpu_{k}"] = gpu.get(k)
        row[f"diff_{k}"] = _diff(row.get(f"model_{k}"), gpu.get(k))
    rows.append(row)
    return rows


# --------------------------------------------------------------------------------------------
# end-to-end rows (benchmarks/gpu_calibrate.py)
# --------------------------------------------------------------------------------------------


def run_end_to_end(names: list[str], dry_run: bool, deadline: float) -> tuple[list[dict[str, Any]], list[str]]:
    from benchmarks import gpu_calibrate as cal

    rows, skipped = [], []
    runs = [(cal.CASES[n], p) for n in names for p in cal.CASES[n].precisions
            if not dry_run or p in cal.CPU_PRECISIONS]
    if dry_run:
        runs = runs[:1]  # one tiny row proves the pipeline
    for case, precision in runs:
        if rows and time.perf_counter() > deadline:
            skipped.append(f"{case.name}/{precision}")
            continue
        rows.append(cal.run_case(case, precision, dry_run))
    return rows, skipped


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------


def _fmt(n: int | None) -> str:
    return "–" if n is None else f"{n:,}"


def _machine(m: dict) -> str:
    if m.get("gpu"):
        return f"{m['gpu']} (sm {m.get('compute_capability')}), torch {m.get('torch')}, CUDA {m.get('cuda')}"
    return f"{m.get('cpu_model', 'CPU')}, torch {m.get('torch')}, no GPU"


def render_markdown(kernel_rows: list[dict], e2e_rows: list[dict], meta: dict) -> str:
    lines = [
        "# memguard CUDA kernel model vs the GPU" + (" (dry run)" if meta["dry_run"] else ""),
        "",
        f"{meta['date']} · `{meta['command']}` · {_machine(meta['machine'])} · target {meta['target']}",
        "",
        "Bytes above the op's inputs (512-byte blocks). model = CPU fakes under the CUDA kernel model; "
        "cpu trace = the same without it; gpu = torch.cuda allocator.",
        "",
        "| op | kind | fwd kept model / cpu trace / gpu | fwd peak model / gpu | bwd peak model / cpu trace / gpu "
        "| bwd kept model / gpu |",
        "|---|---|---|---|---|---|",
    ]
    for r in kernel_rows:
        if r["case"] == "adamw/foreach":
            lines.append(f"| {r['case']} | {r['kind']} | step peak {_fmt(r.get('model_step_peak'))} / – / "
                         f"{_fmt(r.get('gpu_step_peak'))} | | | step kept {_fmt(r.get('model_step_kept'))} / "
                         f"{_fmt(r.get('gpu_step_kept'))} |")
            continue
        lines.append(
            f"| {r['case']} | {r['kind']} | {_fmt(r.get('model_forward_kept'))} / {_fmt(r.get('cpu_trace_forward_kept'))}"
            f" / {_fmt(r.get('gpu_forward_kept'))} | {_fmt(r.get('model_forward_peak'))} / {_fmt(r.get('gpu_forward_peak'))}"
            f" | {_fmt(r.get('model_backward_peak'))} / {_fmt(r.get('cpu_trace_backward_peak'))} / "
            f"{_fmt(r.get('gpu_backward_peak'))} | {_fmt(r.get('model_backward_kept'))} / {_fmt(r.get('gpu_backward_kept'))} |"
        )
    if e2e_rows:
        lines += ["", "## End-to-end (benchmarks/gpu_calibrate.py)", "",
                  "| case | precision | est reserved | est reserved, CPU fakes | real reserved | est allocated | "
                  "est allocated, CPU fakes | real allocated |", "|---|---|---|---|---|---|---|---|"]
        for r in e2e_rows:
            lines.append(
                f"| {r['case']} | {r['precision']} | {_fmt(r.get('est_peak_bytes'))} | "
                f"{_fmt(r.get('est_cpu_fakes_peak_bytes'))} | {_fmt(r.get('real_reserved_bytes'))} | "
                f"{_fmt(r.get('est_allocated_bytes'))} | {_fmt(r.get('est_cpu_fakes_allocated_bytes'))} | "
                f"{_fmt(r.get('real_allocated_bytes'))} |"
            )
    errors = [f"{r['case']}: {r['error']}" for r in kernel_rows + e2e_rows if r.get("error")]
    if errors:
        lines += ["", "Errors:", *[f"- {e}" for e in errors]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; see the module docstring."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(Path("benchmarks") / "results"), help="folder for gpu_kernels.json")
    parser.add_argument("--dry-run", action="store_true", help="no CUDA: model columns and one tiny end-to-end row")
    parser.add_argument("--e2e-cases", default=None,
                        help="comma-separated gpu_calibrate cases (default: all on a GPU, 'mlp' in a dry run; '' for none)")
    parser.add_argument("--conv-cap-mib", type=int, default=64, help="CUDNN_CONV_WSCAP_DBG for the convolution case")
    parser.add_argument("--max-seconds", type=float, default=200.0,
                        help="start no new end-to-end case after this many seconds")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device is visible; use --dry-run to exercise the pipeline on the CPU")
    os.environ["CUDNN_CONV_WSCAP_DBG"] = str(args.conv_cap_mib)  # read by cuDNN when it plans a conv
    if args.dry_run:
        torch.set_num_threads(1)

    from benchmarks import gpu_calibrate as cal

    e2e_names = ("mlp" if args.dry_run else ",".join(cal.CASES)) if args.e2e_cases is None else args.e2e_cases
    e2e_names = [n for n in e2e_names.split(",") if n]
    unknown = [n for n in e2e_names if n not in cal.CASES]
    if unknown:
        parser.error(f"unknown end-to-end case(s) {unknown}; known: {', '.join(cal.CASES)}")

    sm_count = torch.cuda.get_device_properties(0).multi_processor_count if not args.dry_run else None
    spec = None
    if not args.dry_run:
        from memguard.estimator.gpus import current_gpu

        spec = current_gpu()
    target = CudaTarget.for_spec(spec, sm_count=sm_count, conv_workspace_bytes=args.conv_cap_mib << 20)
    t0 = time.perf_counter()
    meta: dict[str, Any] = {
        "command": "python benchmarks/gpu_kernels.py" + ("" if not argv else " " + shlex.join(argv)),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "dry_run": args.dry_run,
        "machine": machine_description(gpu=not args.dry_run),
        "target": f"capability {target.capability}, torch {target.torch_version}, SMs {target.sm_count}, "
                  f"conv cap {args.conv_cap_mib} MiB",
        "torch": torch.__version__,
    }
    kernel_rows = run_kernel_rows(args.dry_run, target)
    e2e_rows, skipped = run_end_to_end(e2e_names, args.dry_run, t0 + args.max_seconds)
    meta["skipped"] = skipped
    meta["wall_seconds"] = time.perf_counter() - t0
    md = render_markdown(kernel_rows, e2e_rows, meta)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_kernels.json").write_text(
        json.dumps({**meta, "kernel_rows": kernel_rows, "end_to_end_rows": e2e_rows, "markdown": md}, indent=2) + "\n")
    print(md)
    return 1 if any(r.get("error") for r in kernel_rows) else 0


if __name__ == "__main__":
    sys.exit(main())
