"""memguard's estimate beside the memory estimators users have today, on the accuracy zoo.

For every case of :mod:`benchmarks.zoo` this script compares, against the real peak of live
tensor bytes of one steady-state training step (forward + loss, backward, ``optimizer.step()``,
``zero_grad(set_to_none=True)``; :func:`benchmarks.ground_truth.measure_cpu_peak`, last of 2
steps), the numbers given by:

================== ==========================================================================
tool               what is taken as its estimate
================== ==========================================================================
memguard           ``memguard.estimate(model, batch, optimizer=..., loss_fn=..., device="cpu")
                   .peak_bytes``
accelerate         ``accelerate estimate-memory``'s "Training using Adam" column for float32:
                   ``max(estimate_training_usage(total_size, "float32").values())`` =
                   4 x the model size (weights 1x, gradients 1x, Adam states 2x), where the
                   model size is ``calculate_maximum_sizes(model)[0]`` (parameters + buffers,
                   tied weights once), exactly as the command computes it
deepspeed-zero2    ``estimate_zero2_model_states_mem_needs(total_params, 1, 1,
                   cpu_offload=False)``'s per-GPU bytes = 2Ψ + 18Ψ (model states only, 1 GPU,
                   no offload; the row "offload_optimizer=none" that
                   ``estimate_zero2_model_states_mem_needs_all_live`` prints)
deepspeed-zero3    ``estimate_zero3_model_states_mem_needs(total_params, largest_layer_params,
                   1, 1, cpu_offload=False)``'s per-GPU bytes = 4·largest layer + 18Ψ (model
                   states only, 1 GPU, no offload; the "offload_param=none,
                   offload_optimizer=none" row of ``..._all_live``)
torchinfo          ``torchinfo.summary(model, input_data=..., mode="train")``'s
                   "Estimated Total Size" = input + forward/backward pass + params bytes
memtracker-1step   ``torch.distributed._tools.mem_tracker.MemTracker`` around one training
                   step of a model, optimizer and batch built under ``FakeTensorMode``; its
                   "peak" snapshot total (the usage shown in its docstring)
memtracker-2step   the same tracker's peak over the second step (``reset_mod_stats()`` between
                   steps), i.e. the steady state once the optimizer state exists
================== ==========================================================================

DeepSpeed's and Accelerate's rules count model states only (and DeepSpeed assumes 16-bit
weights with fp32 master copies and Adam); they are reported as users would read them, not
adjusted to the case's optimizer or precision.

The real peaks are read from ``benchmarks/results/accuracy_cpu.json`` (written by
``benchmarks/accuracy_cpu.py``, which measures them the same way) when it has the case, and
measured again otherwise or with ``--measure``. Every case runs in its own subprocess with one
intra-op thread.

With ``--device cuda`` (only on a machine with a GPU; otherwise the run is skipped and says so)
the target is CUDA: the real peak is ``torch.cuda.max_memory_reserved()`` over the second of two
real steps, memguard is asked for ``device="cuda"`` and MemTracker traces fake CUDA tensors.

Usage::

    python -m benchmarks.compare_estimators                   # all cases, CPU target
    python -m benchmarks.compare_estimators --cases gpt2,mlp  # some cases
    python -m benchmarks.compare_estimators --measure         # re-measure the real peaks
    python -m benchmarks.compare_estimators --device cuda     # CUDA target (needs a GPU)

Writes ``compare_estimators.{json,md,png}`` (``compare_estimators_cuda.*`` for CUDA) to
``--out`` (default ``benchmarks/results``) and prints the Markdown table.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import shlex
import statistics
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))  # `benchmarks` from this checkout when run by path
from benchmarks import common  # noqa: E402
from benchmarks.common import run_worker  # noqa: E402

_MARKER = "@@COMPARE_ESTIMATORS_RESULT@@ "  # prefix of the worker's one JSON line on stdout

#: Tools in report order, with the one-line description used in the Markdown legend.
TOOLS: dict[str, str] = {
    "memguard": "`memguard.estimate(..., device=target).peak_bytes`",
    "accelerate": "`accelerate estimate-memory` 'Training using Adam' (float32): 4 x model size",
    "deepspeed-zero2": "`estimate_zero2_model_states_mem_needs` per-GPU bytes, 1 GPU, no offload "
    "(model states: 2Ψ + 18Ψ)",
    "deepspeed-zero3": "`estimate_zero3_model_states_mem_needs` per-GPU bytes, 1 GPU, no offload "
    "(model states: 4·largest layer + 18Ψ)",
    "torchinfo": "`torchinfo.summary(..., mode='train')` 'Estimated Total Size'",
    "memtracker-1step": "PyTorch `MemTracker` on FakeTensorMode, peak of one training step",
    "memtracker-2step": "PyTorch `MemTracker` on FakeTensorMode, peak of the 2nd step (steady state)",
}


# --------------------------------------------------------------------------------------------
# the tools, one function each (importable: the smoke test calls them on tiny models)
# --------------------------------------------------------------------------------------------


def accelerate_training_bytes(model: nn.Module) -> int:
    """What ``accelerate estimate-memory`` prints as "Training using Adam" for float32.

    The command (accelerate/commands/estimate.py, ``gather_data`` and ``estimate_command``)
    takes the model size from ``accelerate.utils.calculate_maximum_sizes`` (every parameter and
    buffer, tied weights once, at their own dtype) and, for ``"float32"``,
    ``estimate_training_usage`` returns model 1x, gradients 1x, optimizer (Adam) 2x and
    "step" 4x the model size; the column shows the maximum of those, i.e. 4 x the model size.

    Args:
        model: any module; meta tensors work (only shapes and dtypes are read).

    Returns:
        The bytes the command would print.
    """
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes

    total_size, _largest = calculate_maximum_sizes(model)
    usage = estimate_training_usage(total_size, "float32")
    return int(max(usage.values()))  # the column value (accelerate/commands/estimate.py, estimate_command)


def deepspeed_model_states_bytes(model: nn.Module) -> dict[str, int]:
    """DeepSpeed's ZeRO-2 and ZeRO-3 model-state estimates for 1 GPU without offload.

    Parameter counts come from DeepSpeed's own ``model_to_params`` (stage_1_and_2.py counts
    storages once by ``data_ptr``; stage3.py adds the largest single module's own parameters);
    the bytes are the per-GPU ``gpu_mem`` that ``estimate_zero2_model_states_mem_needs`` and
    ``estimate_zero3_model_states_mem_needs`` return with ``cpu_offload=False`` — the
    "offload ... none" rows that the ``..._all_live`` functions print.

    Args:
        model: a module with real (CPU) parameters: on ``meta`` every ``data_ptr()`` is 0 and
            DeepSpeed's count collapses to one tensor.

    Returns:
        ``{"deepspeed-zero2": bytes, "deepspeed-zero3": bytes}``.
    """
    from deepspeed.runtime.zero import stage3, stage_1_and_2

    total2 = stage_1_and_2.model_to_params(model)
    _cpu, gpu2 = stage_1_and_2.estimate_zero2_model_states_mem_needs(
        total2, num_gpus_per_node=1, num_nodes=1, cpu_offload=False
    )
    total3, largest = stage3.model_to_params(model)
    _cpu, gpu3, _largest_mem = stage3.estimate_zero3_model_states_mem_needs(
        total3, largest, num_gpus_per_node=1, num_nodes=1, cpu_offload=False, cpu_offload_params=False
    )
    return {"deepspeed-zero2": int(gpu2), "deepspeed-zero3": int(gpu3)}


def model_inputs(batch: Any, loss_fn: Callable | None) -> Any:
    """The arguments the model itself is called with, as torchinfo's ``input_data``.

    Without a ``loss_fn`` the model gets the whole batch (dict as keywords, tuple as positional
    arguments, tensor alone), as :func:`benchmarks.ground_truth.default_loss` calls it. Every
    ``loss_fn`` of the zoo calls ``model(batch[0])`` and compares with ``batch[1]``.
    """
    if loss_fn is None:
        return batch if isinstance(batch, (Mapping, list, tuple)) else [batch]
    return [batch[0]]


def torchinfo_total_bytes(model: nn.Module, inputs: Any, device: str = "cpu") -> int:
    """torchinfo's "Estimated Total Size" of ``model`` called on ``inputs`` in train mode.

    torchinfo (model_statistics.py) sums the input bytes, twice the output bytes of every leaf
    module that has parameters ("x2 for gradients") and the parameter bytes. It runs one real
    forward pass under ``torch.no_grad()``.

    Args:
        model: a module with real parameters.
        inputs: a list/tuple of positional arguments or a dict of keyword arguments.
        device: where torchinfo runs the forward pass.

    Returns:
        The bytes behind the "Estimated Total Size (MB)" line.
    """
    import torchinfo

    stats = torchinfo.summary(model, input_data=inputs, mode="train", device=device, verbose=0)
    return int(stats.total_input + stats.total_output_bytes + stats.total_param_bytes)


def memtracker_step_peaks(
    build: Callable[[], tuple[nn.Module, Any, Callable | None]],
    make_optimizer: Callable[[Any], torch.optim.Optimizer],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    *,
    steps: int = 2,
    elapsed: list[float] | None = None,
) -> list[int]:
    """Peak bytes of each training step, as PyTorch's ``MemTracker`` sees it on fake tensors.

    ``build()`` and ``make_optimizer(model.parameters())`` run inside one ``FakeTensorMode``, so
    the model, its batch and its optimizer hold no real memory. The tracker is entered once
    around all steps, as in its docstring; between steps ``reset_mod_stats()`` (required by
    MemTracker before a module runs forward again) restarts its peak from the current usage.

    Args:
        build: ``build() -> (model, batch, loss_fn or None)``, called under fake mode.
        make_optimizer: ``make_optimizer(params) -> Optimizer``.
        loss_fn: overrides the one ``build`` returns; None uses that one, or
            :func:`benchmarks.ground_truth.default_loss` when both are None.
        steps: training steps to trace.
        elapsed: if given, receives the seconds from the call to the end of each step.

    Returns:
        One peak (bytes, summed over devices) per step.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from benchmarks.ground_truth import default_loss

    t0 = time.perf_counter()
    fake_mode = FakeTensorMode()
    with fake_mode:
        model, batch, built_loss = build()
        optimizer = make_optimizer(model.parameters())
    compute = loss_fn or built_loss or default_loss
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    peaks: list[int] = []
    with fake_mode, tracker:
        for i in range(steps):
            if i:
                tracker.reset_mod_stats()
            loss = compute(model, batch)
            loss.backward()
            del loss
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            snapshot = tracker.get_tracker_snapshot("peak")
            peaks.append(int(sum(dev["Total"] for dev in snapshot.values())))  # "Total": mem_tracker.py _TOTAL_KEY
            if elapsed is not None:
                elapsed.append(time.perf_counter() - t0)
    return peaks


# --------------------------------------------------------------------------------------------
# worker (one case, in a subprocess)
# --------------------------------------------------------------------------------------------


def scrub_paths(text: str) -> str:
    """``text`` without this machine's paths (interpreter prefix, repository, temp folder)."""
    import tempfile

    for path, name in ((sys.prefix, "<python>"), (str(_REPO), "<repo>"), (tempfile.gettempdir(), "<tmp>")):
        text = text.replace(path, name)
    return text


def _timed(fn: Callable[[], Any]) -> tuple[Any, float, str | None]:
    t0 = time.perf_counter()
    try:
        return fn(), time.perf_counter() - t0, None
    except Exception as exc:  # noqa: BLE001 - a tool failing is a measured result
        msg = scrub_paths(f"{type(exc).__name__}: {exc}".strip().splitlines()[0])
        return None, time.perf_counter() - t0, msg[:300]


def _to_device(obj: Any, device: str) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, Mapping):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(v, device) for v in obj)
    return obj


def _measure_cuda(case: Any) -> dict[str, Any]:
    """Real CUDA peak: ``max_memory_reserved`` (and allocated) over the second of two steps."""
    from benchmarks.ground_truth import default_loss

    model, batch, loss_fn = case.build("cuda")
    batch = _to_device(batch, "cuda")
    optimizer = case.optimizer(model.parameters())
    compute = loss_fn or default_loss
    for i in range(2):
        if i:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        loss = compute(model, batch)
        loss.backward()
        del loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return {
        "steady_peak_bytes": int(torch.cuda.max_memory_reserved()),
        "max_allocated_bytes": int(torch.cuda.max_memory_allocated()),
    }


def _worker(name: str, mode: str, device: str) -> dict[str, Any]:
    torch.set_num_threads(1)  # one intra-op thread, as accuracy_cpu.py measures
    from benchmarks.zoo import CASES

    case = CASES[name]
    if mode == "truth":
        if device == "cuda":
            return _measure_cuda(case)
        from benchmarks.ground_truth import measure_cpu_peak

        model, batch, loss_fn = case.build("cpu")
        gt = measure_cpu_peak(model, batch, loss_fn, case.optimizer(model.parameters()), steps=2)
        return {"steady_peak_bytes": gt.steady_peak_bytes, "peak_phase": gt.peak_phase}

    model, batch, loss_fn = case.build("cpu")
    out: dict[str, Any] = {"optimizer": type(case.optimizer(model.parameters())).__name__}
    tools: dict[str, dict[str, Any]] = {}

    def record(tool: str, value: Any, seconds: float, error: str | None) -> None:
        tools[tool] = {"error": error, "seconds": seconds} if error else {"bytes": int(value), "seconds": seconds}

    # import every tool before timing it, so the seconds reported are the estimate's alone
    import memguard

    for mod in ("accelerate.commands.estimate", "accelerate.utils", "deepspeed.runtime.zero.stage3",
                "deepspeed.runtime.zero.stage_1_and_2", "torchinfo", "torch.distributed._tools.mem_tracker",
                "torch._subclasses.fake_tensor"):
        _timed(lambda: __import__(mod))  # a failed import shows again, as the tool's error, below

    est, s, err = _timed(lambda: memguard.estimate(model, batch, optimizer=case.optimizer, loss_fn=loss_fn,
                                                  device=device))
    record("memguard", None if est is None else est.peak_bytes, s, err)
    record("accelerate", *_timed(lambda: accelerate_training_bytes(model)))
    ds, s, err = _timed(lambda: deepspeed_model_states_bytes(model))
    for key in ("deepspeed-zero2", "deepspeed-zero3"):
        record(key, None if ds is None else ds[key], s, err)
    record("torchinfo", *_timed(lambda: torchinfo_total_bytes(model, model_inputs(batch, loss_fn))))
    del model, batch

    def build_fake() -> tuple[nn.Module, Any, Callable | None]:
        m, b, lf = case.build(device)
        return m, _to_device(b, device), lf

    elapsed: list[float] = []
    peaks, s, err = _timed(lambda: memtracker_step_peaks(build_fake, case.optimizer, steps=2, elapsed=elapsed))
    record("memtracker-1step", None if peaks is None else peaks[0], elapsed[0] if elapsed else s, err)
    record("memtracker-2step", None if peaks is None else peaks[1], s, err)
    out["tools"] = tools
    return out


def _run_worker(name: str, mode: str, device: str, timeout: float) -> dict[str, Any]:
    """Run one worker in a fresh interpreter; its result or ``{"error": ...}``."""
    run = run_worker("benchmarks.compare_estimators", ["--worker", mode, "--cases", name, "--device", device], _MARKER,
                     timeout=timeout, one_thread=True)
    return run.result if run.result is not None else {"error": scrub_paths(run.error_line())}


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------


def machine_description() -> dict[str, Any]:
    """Cores, RAM, CPU model, library versions (the compared tools too) and the load average now."""
    return common.machine_description(packages=("accelerate", "deepspeed", "torchinfo"), torch_threads=1)


def error_pct(estimate: int, real: int) -> float:
    """Signed relative error of ``estimate`` against ``real``, in percent."""
    return 100.0 * (estimate - real) / real


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per tool: cases with a number, failures, median and max |error| (and the worst case)."""
    out: dict[str, dict[str, Any]] = {}
    for tool in TOOLS:
        errs = [(abs(r["errors"][tool]), r["case"]) for r in rows if r.get("errors", {}).get(tool) is not None]
        failed = sum(1 for r in rows if "error" in r.get("tools", {}).get(tool, {}))
        entry: dict[str, Any] = {"n": len(errs), "failed": failed}
        if errs:
            worst = max(errs)
            entry.update(median_abs_error_pct=statistics.median(e for e, _ in errs), max_abs_error_pct=worst[0],
                         max_case=worst[1])
        out[tool] = entry
    return out


def _cell(row: dict[str, Any], tool: str) -> str:
    from memguard.vocab import MiB
    t = row.get("tools", {}).get(tool)
    if t is None:
        return "—"
    if "error" in t:
        return "fails"
    err = row.get("errors", {}).get(tool)
    mib = f"{t['bytes'] / MiB:.1f}"
    return mib if err is None else f"{mib} ({err:+.1f}%)"


def render_markdown(rows: list[dict[str, Any]], summary: dict[str, Any], meta: dict[str, Any]) -> str:
    """The report: header, legend, one row per case, the per-tool summary, failures."""
    from memguard.vocab import MiB
    m = meta["machine"]
    lines = [
        f"# Memory estimators compared ({meta['target']} target)",
        "",
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}",
        f"- machine: {m.get('cpu_model')}, {m.get('cpus_usable')} usable of {m.get('cpu_count')} cores, "
        f"{m.get('ram_bytes', 0) / (1 << 30):.1f} GiB RAM, load average {m.get('load_average')}, {m.get('os')}"
        + (f", GPU {m['gpu']}" if m.get("gpu") else ""),
        f"- software: Python {m.get('python')}, torch {m.get('torch')}, transformers {m.get('transformers')}, "
        f"accelerate {m.get('accelerate')}, deepspeed {m.get('deepspeed')}, torchinfo {m.get('torchinfo')}; "
        "1 intra-op thread",
        f"- real peak: {meta['truth_source']}",
        "",
        "Each cell: the tool's estimate in MiB and its signed error against the real peak of a "
        "steady-state training step. DeepSpeed and Accelerate count model states only and assume "
        "Adam (DeepSpeed also 16-bit weights with fp32 master copies), whatever the case's optimizer.",
        "",
    ]
    lines += [f"- **{tool}**: {desc}" for tool, desc in TOOLS.items()]
    lines += [
        "",
        "| case | optimizer | real (MiB) | " + " | ".join(TOOLS) + " |",
        "|---|---|---:|" + "---:|" * len(TOOLS),
    ]
    for r in rows:
        if "worker_error" in r or "truth_error" in r:
            msg = r.get("truth_error") or r.get("worker_error")
            lines.append(f"| {r['case']} | | error: {msg[:120]} |" + " |" * len(TOOLS))
            continue
        lines.append(
            f"| {r['case']} | {r.get('optimizer', '')} | {r['real_bytes'] / MiB:.1f} | "
            + " | ".join(_cell(r, t) for t in TOOLS) + " |"
        )
    lines += ["", "## |error| per tool", "", "| tool | cases | failed | median abs error % | max abs error % (case) |",
              "|---|---:|---:|---:|---|"]
    for tool, s in summary.items():
        if s["n"]:
            lines.append(f"| {tool} | {s['n']} | {s['failed']} | {s['median_abs_error_pct']:.1f} | "
                         f"{s['max_abs_error_pct']:.1f} ({s['max_case']}) |")
        else:
            lines.append(f"| {tool} | 0 | {s['failed']} | — | — |")
    lines += ["", "## Seconds per estimate (median over cases; imports excluded, MemTracker includes its "
              "fake build)", "",
              "| tool | median s |", "|---|---:|"]
    for tool in TOOLS:
        secs = [r["tools"][tool]["seconds"] for r in rows if tool in r.get("tools", {})]
        if secs:
            lines.append(f"| {tool} | {statistics.median(secs):.2f} |")
    failures = [(r["case"], t, v["error"]) for r in rows for t, v in r.get("tools", {}).items() if "error" in v]
    if failures:
        lines += ["", "## Failures (as measured)", ""]
        lines += [f"- {case} / {tool}: `{msg}`" for case, tool, msg in failures]
    if meta.get("plot"):
        lines += ["", f"![signed error per tool]({meta['plot']})"]
    return "\n".join(lines) + "\n"


def plot_errors(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """A strip plot of the signed error per tool (one dot per case, bar = median |error|)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tools = list(TOOLS)
    fig, ax = plt.subplots(figsize=(11, 5.5))
    ax.axhspan(-5, 5, color="0.9", zorder=0, label="±5%")
    ax.axhline(0, color="0.4", lw=0.8)
    for i, tool in enumerate(tools):
        pts = [(r["errors"][tool], r["case"]) for r in rows if r.get("errors", {}).get(tool) is not None]
        if not pts:
            ax.text(i, 0, "no result", ha="center", va="bottom", fontsize=8, rotation=90)
            continue
        n = len(pts)
        xs = [i + 0.5 * ((k + 0.5) / n - 0.5) for k in range(n)]  # spread the dots across the column
        ax.scatter(xs, [e for e, _ in pts], s=22, zorder=3)
        med = statistics.median(abs(e) for e, _ in pts)
        ax.hlines([med, -med], i - 0.3, i + 0.3, colors="k", linestyles=":", lw=1, zorder=2)
    failed = {t: sum(1 for r in rows if "error" in r.get("tools", {}).get(t, {})) for t in tools}
    labels = [t + (f"\n({failed[t]} of {len(rows)} failed)" if failed[t] else "") for t in tools]
    ax.set_xticks(range(len(tools)), labels, rotation=20, ha="right")
    ax.set_ylabel("signed error vs real peak (%)")
    ax.set_title(title + "  (dots: cases; dotted: ± median |error|)")
    ax.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _load_truth(path: Path) -> tuple[dict[str, int], str]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}, ""
    peaks = {c["case"]: int(c["real_bytes"]) for c in data.get("cases", []) if c.get("real_bytes")}
    return peaks, f"{path.name} ({data.get('date', 'undated')}, `{data.get('command', '')}`)"


def run(names: list[str], *, device: str, measure: bool, timeout: float, out: Path) -> tuple[list, str]:
    """One row per case: real peak, each tool's estimate, error %."""
    known, source = ({}, "") if (measure or device == "cuda") else _load_truth(out / "accuracy_cpu.json")
    rows = []
    measured = False
    for name in names:
        row: dict[str, Any] = {"case": name}
        if name in known:
            row["real_bytes"] = known[name]
        else:
            truth = _run_worker(name, "truth", device, timeout)
            measured = True
            if "error" in truth:
                row["truth_error"] = truth["error"]
            else:
                row["real_bytes"] = truth["steady_peak_bytes"]
                row["truth"] = truth
        est = _run_worker(name, "estimate", device, timeout)
        if "error" in est:
            row["worker_error"] = est["error"]
        else:
            row.update(est)
            if row.get("real_bytes"):
                row["errors"] = {t: (error_pct(v["bytes"], row["real_bytes"]) if "bytes" in v else None)
                                 for t, v in est["tools"].items()}
        rows.append(row)
        print(f"  {name}: done", file=sys.stderr, flush=True)
    how = ("measured in this run: torch.cuda.max_memory_reserved() over the 2nd of 2 real steps" if device == "cuda"
           else "measured in this run (torch.profiler, peak of the 2nd of 2 real steps)")
    if known and measured:
        source = f"{source}; cases missing there {how}"
    elif not known:
        source = how
    return rows, source


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; see the module docstring."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="the target")
    parser.add_argument("--out", default=str(Path("benchmarks") / "results"), help="folder for the results")
    parser.add_argument("--measure", action="store_true", help="re-measure real peaks instead of reading "
                        "accuracy_cpu.json")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per subprocess")
    parser.add_argument("--worker", choices=["truth", "estimate"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        sys.path.insert(0, str(_REPO))
        result = _worker(args.cases, args.worker, args.device)
        print(_MARKER + json.dumps(result), flush=True)
        return 0

    if args.device == "cuda" and not torch.cuda.is_available():
        print("CUDA target skipped: no CUDA device on this machine (torch.cuda.is_available() is False).")
        return 0

    sys.path.insert(0, str(_REPO))
    from benchmarks.zoo import CASES

    names = [n for n in args.cases.split(",") if n] or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "compare_estimators" + ("_cuda" if args.device == "cuda" else "")
    t0 = time.perf_counter()
    rows, source = run(names, device=args.device, measure=args.measure, timeout=args.timeout, out=out)
    summary = summarize(rows)
    meta = {
        "command": "python -m benchmarks.compare_estimators" + ("" if not argv else " " + shlex.join(argv)),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_description(),
        "target": args.device,
        "truth_source": source,
        "wall_seconds": time.perf_counter() - t0,
        "plot": f"{stem}.png",
    }
    plot_errors(rows, out / f"{stem}.png", f"Estimators vs real peak, {len(rows)} cases, {args.device} target")
    md = render_markdown(rows, summary, meta)
    (out / f"{stem}.json").write_text(json.dumps({**meta, "tools": TOOLS, "summary": summary, "cases": rows},
                                                 indent=2) + "\n")
    (out / f"{stem}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
