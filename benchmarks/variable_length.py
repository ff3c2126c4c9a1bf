"""Batches of changing sequence length under a real CPU memory cap: memguard beside today's batch-size finders.

The job: one epoch over 160 token sequences in 10 batches of 16 (the batch the user wants), on a
2-layer, 64-wide GPT-2 built from a config (eager attention, dropout off), AdamW, fp32. Most
batches hold 64-token sequences; one holds 512-token ones and one 128-token ones (:data:`LENGTHS`),
and they come *after* the first batches, as a rare long batch does in real data. A batch is padded
to its longest sequence (labels -100 on the padding), so a batch that mixes lengths costs the
longest one's memory. Every tool sees the same samples in the same order.

Each tool runs in its own subprocess that imports everything, builds the model and data, runs one
warm-up step at 2 samples of 64 tokens, and caps its address space at its size then plus
``--room`` MiB (``setrlimit(RLIMIT_AS)``, as ``benchmarks/compare_batch_finders.py`` does); an
allocation past the cap fails with torch's real ``DefaultCPUAllocator: can't allocate memory``.
The subprocesses run glibc malloc with one arena and a fixed mmap threshold of 64 KiB (as the
guard's own ``RLIMIT_AS`` tests do), so that freed tensors leave the address space and the cap
follows live memory; with glibc's defaults the heap keeps what freed tensors held, and the cap
then stands for less than its room.

=================== =========================================================================
tool                how it is used
=================== =========================================================================
memguard            ``memguard.prepare(model, optimizer, budget_bytes=live + room,
                    device="cpu", precision="32-true", activation_checkpointing=False)``,
                    then ``memguard.step`` on each batch of 16: it plans on the first batch and
                    gives each new batch shape its own micro-batch before it runs
memguard-reactive   the same with the shape planning turned off (a new shape starts from the
                    planned micro-batch, capped by any shorter shape's): it finds the long
                    batch's micro-batch by OOM and halving instead. The difference between the
                    two is what planning a new shape costs and saves
accelerate          ``@find_executable_batch_size(starting_batch_size=16)`` around a training
                    function that frees memory, builds the model, optimizer and dataloader and
                    trains the epoch; on an OOM it starts over at ``int(0.9 * batch_size)``
lightning-power     ``Tuner(trainer).scale_batch_size(module, mode="power")`` (Lightning's
                    ``BatchSizeFinder`` with its defaults: trials of 3 steps from batch 2,
                    doubling), then ``trainer.fit(module)`` for the epoch
=================== =========================================================================

Measured: OOMs hit (recovered or not), samples trained (in steps whose update the final model
keeps), samples lost (of the 160, not trained: a failed run loses the rest of the epoch; a run that
starts over loses what it had trained), redone sample passes (samples run through the loss whose
work was not kept), seconds, and trained tokens per second. For memguard, the seconds spent
planning new shapes and each step's seconds (the long batch's step against memguard-reactive's is
the planning's cost against the retries it saves).

With ``--compiled-peak`` a further subprocess measures what memguard's estimate means for a
compiled model: the real CPU peak (``benchmarks.ground_truth.measure_cpu_peak``) of the same
GPT-2's training step at 8 x 256 tokens, eager and under ``torch.compile`` (inductor, compiled
before the measurement), beside ``memguard.estimate`` of it (which traces the eager step).

Usage::

    python -m benchmarks.variable_length                 # every tool, room 64 MiB (~3 min)
    python -m benchmarks.variable_length --room 96 --tools memguard,accelerate
    python -m benchmarks.variable_length --compiled-peak # also eager vs compiled peak (inductor needs a C++ compiler)

Writes ``variable_length.{json,md}`` to ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import logging
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parent.parent
_MARKER = "@@VARIABLE_LENGTH_RESULT@@ "
TOOLS = ("memguard", "memguard-reactive", "accelerate", "lightning-power")
#: Tokens per sequence of each batch of 16, in order: a long batch after five short ones.
LENGTHS = (64, 64, 64, 64, 64, 512, 64, 64, 128, 64)
BATCH = 16
VOCAB = 512


# --------------------------------------------------------------------------------------------
# model and data
# --------------------------------------------------------------------------------------------


def build_model():
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=1024, n_embd=64, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                                  attn_implementation="eager")
    return transformers.GPT2LMHeadModel(cfg).train()


def samples() -> list:
    """The dataset: ``len(LENGTHS) * BATCH`` token sequences, batch ``k``'s of ``LENGTHS[k]`` tokens."""
    import torch

    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, VOCAB, (length,), generator=g) for length in LENGTHS for _ in range(BATCH)]


def collate(seqs: list) -> dict:
    """Pad to the longest sequence: pad id 0, label -100 (ignored by the loss) on the padding."""
    import torch

    longest = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), longest, dtype=torch.long)
    labels = torch.full((len(seqs), longest), -100, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = s
        labels[i, :len(s)] = s
    return {"input_ids": ids, "labels": labels}


def loss_fn(model, batch):
    return model(input_ids=batch["input_ids"], labels=batch["labels"]).loss


def tokens_of(batch) -> int:
    return int((batch["labels"] != -100).sum())


# --------------------------------------------------------------------------------------------
# worker
# --------------------------------------------------------------------------------------------


class _Log:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.passes = 0  # samples run through the loss (outside memguard's traces)
        self.ooms: list[str] = []

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def counting(self, fn):
        from torch._subclasses.fake_tensor import is_fake

        def wrapped(model, batch):
            ids = batch["input_ids"]
            if ids.device.type != "meta" and not is_fake(ids):  # the planner traces on fake tensors
                self.passes += int(ids.shape[0])
            return fn(model, batch)

        return wrapped


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:200]


def _run_memguard(model, data, room: int, log: _Log, reactive: bool) -> dict:
    import torch

    import memguard
    from benchmarks.ground_truth import live_state_bytes
    from memguard.guard import guard_status
    from memguard.guard._core import Guard

    if reactive:  # no shape planning: a new shape starts from the planned micro-batch (capped by a shorter shape's)
        Guard._plan_signature = lambda self, sig, batch, base: None
    warnings: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    logging.getLogger("memguard").addHandler(_Keep(logging.WARNING))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    budget = live_state_bytes(model, (), None) + room
    memguard.prepare(model, optimizer, budget_bytes=budget, device="cpu", precision="32-true",
                     activation_checkpointing=False, loss_fn=log.counting(loss_fn))
    batches = [collate(data[k * BATCH:(k + 1) * BATCH]) for k in range(len(LENGTHS))]
    out: dict[str, Any] = {"budget_bytes": budget, "step_seconds": [], "micro_batches": []}
    trained = tokens = 0
    for b in batches:
        t = time.perf_counter()
        try:
            memguard.step(model, optimizer, b)
        except Exception as exc:  # noqa: BLE001 - reported as measured
            out["error"] = _short(exc)
            log.ooms.append(_short(exc))
            break
        out["step_seconds"].append(round(time.perf_counter() - t, 3))
        out["micro_batches"].append(guard_status(model).micro_batch_size)
        trained += BATCH
        tokens += tokens_of(b)
    status = guard_status(model)
    log.ooms += [w for w in warnings if w.startswith("out of memory")]
    out.update(trained=trained, tokens=tokens, planned_micro_batch=status.planned_micro_batch_size,
               by_shape={str(k): v for k, v in status.micro_batch_sizes.items()},
               shapes_planned=status.signatures_planned,
               shape_planning_seconds=round(status.signature_planning_seconds, 3))
    return out


def _run_accelerate(data, log: _Log) -> dict:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import find_executable_batch_size
    from torch.utils.data import DataLoader

    accelerator = Accelerator(cpu=True)
    attempts: list[dict[str, Any]] = []
    counting = log.counting(loss_fn)

    @find_executable_batch_size(starting_batch_size=BATCH)
    def train(batch_size):
        accelerator.free_memory()
        attempt = {"batch_size": batch_size, "trained": 0, "tokens": 0}
        attempts.append(attempt)
        model = build_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        loader = DataLoader(data, batch_size=batch_size, collate_fn=collate)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        for b in loader:
            try:
                accelerator.backward(counting(model, b))
                optimizer.step()
                optimizer.zero_grad()
            except Exception as exc:
                log.ooms.append(_short(exc))
                raise
            attempt["trained"] += int(b["input_ids"].shape[0])
            attempt["tokens"] += tokens_of(b)
        return batch_size

    out: dict[str, Any] = {}
    try:
        out["micro_batches"] = [train()]
    except Exception as exc:  # noqa: BLE001 - reported as measured
        out["error"] = _short(exc)
    last = attempts[-1] if attempts and "error" not in out else {"trained": 0, "tokens": 0}
    out.update(trained=last["trained"], tokens=last["tokens"],
               attempts=[{"batch_size": a["batch_size"], "trained": a["trained"]} for a in attempts])
    return out


def _run_lightning(model, data, log: _Log, root: str) -> dict:
    import pytorch_lightning as pl
    import torch
    from pytorch_lightning.tuner import Tuner
    from torch.utils.data import DataLoader

    counting = log.counting(loss_fn)
    done: list[tuple[str, int, int]] = []  # (phase, samples, tokens) of each completed training step
    phase = {"now": "finder"}

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.batch_size = 2

        def training_step(self, batch, batch_idx):
            return counting(self.model, batch)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            done.append((phase["now"], int(batch["input_ids"].shape[0]), tokens_of(batch)))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.model.parameters(), lr=1e-4)

        def train_dataloader(self):
            return DataLoader(data, batch_size=self.batch_size, collate_fn=collate)

    module = Module()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                         num_sanity_val_steps=0)
    out: dict[str, Any] = {}
    import pytorch_lightning.tuner.batch_size_scaling as bss

    original = bss.is_oom_error

    def observed(exc):  # observation only: Lightning's answer is returned unchanged
        log.ooms.append(_short(exc))
        return original(exc)

    bss.is_oom_error = observed
    try:
        out["micro_batches"] = [Tuner(trainer).scale_batch_size(module, mode="power")]
    except Exception as exc:  # noqa: BLE001
        out["error"] = "finder: " + _short(exc)
    finally:
        bss.is_oom_error = original
    out["finder_seconds"] = round(log.now(), 3)
    if "error" not in out:
        phase["now"] = "fit"
        try:
            trainer.fit(module)
        except Exception as exc:  # noqa: BLE001
            out["error"] = "fit: " + _short(exc)
            log.ooms.append(_short(exc))
    fit = [d for d in done if d[0] == "fit"]
    out.update(trained=sum(d[1] for d in fit), tokens=sum(d[2] for d in fit))
    return out


def _worker(tool: str, room_mib: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    import accelerate  # noqa: F401 - every tool imported before the cap
    import pytorch_lightning  # noqa: F401
    import transformers  # noqa: F401

    import memguard  # noqa: F401
    import memguard.guard  # noqa: F401
    from benchmarks.compare_batch_finders import cap_address_space

    data = samples()
    model = build_model()
    warm = collate(data[:2])
    loss_fn(model, warm).backward()  # map kernels and libraries before the cap
    model.zero_grad(set_to_none=True)
    del warm
    gc.collect()
    room = room_mib << 20
    cap = cap_address_space(room)
    log = _Log()
    root = tempfile.mkdtemp(prefix="varlen-")
    if tool.startswith("memguard"):
        out = _run_memguard(model, data, room, log, reactive=tool == "memguard-reactive")
    elif tool == "accelerate":
        del model
        gc.collect()
        out = _run_accelerate(data, log)
    else:
        out = _run_lightning(model, data, log, root)
    total = log.now()
    n = len(data)
    out.update(tool=tool, room_bytes=room, cap_bytes=cap, ooms=len(log.ooms), oom_messages=log.ooms[:12],
               lost=n - out["trained"], redone=max(0, log.passes - out["trained"]), seconds=round(total, 2),
               tokens_per_second=round(out["tokens"] / total, 1) if total > 0 else None,
               ok="error" not in out and out["trained"] == n)
    return out


def compiled_peak() -> dict[str, Any]:
    """Real CPU peaks of one training step, eager and compiled (inductor), and memguard's estimate, in bytes."""
    import copy

    import torch

    import memguard
    from benchmarks.ground_truth import measure_cpu_peak

    torch.set_num_threads(1)
    base = build_model()
    ids = torch.randint(1, VOCAB, (8, 256), generator=torch.Generator().manual_seed(2))
    batch = {"input_ids": ids, "labels": ids}
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    out: dict[str, Any] = {"batch": "8 x 256 tokens", "estimate_bytes": memguard.estimate(
        model, batch, optimizer=opt, loss_fn=loss_fn, device="cpu").peak_bytes}
    out["eager_bytes"] = measure_cpu_peak(model, batch, loss_fn, opt, steps=2).peak_bytes
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    compiled = torch.compile(model)
    t = time.perf_counter()
    loss_fn(compiled, batch).backward()  # compile forward and backward before measuring
    opt.step()
    opt.zero_grad(set_to_none=True)
    out["compile_seconds"] = round(time.perf_counter() - t, 1)
    out["inductor_bytes"] = measure_cpu_peak(compiled, batch, loss_fn, opt, steps=2).peak_bytes
    return out


def _run_worker(tool: str, room_mib: int, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.variable_length", "--worker", tool, "--room", str(room_mib)]
    env = dict(os.environ)
    env["PYTHONPATH"] = str(_REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    # One malloc arena and a fixed mmap threshold (mallopt(3)): tensors of 64 KiB and more are mapped and
    # unmapped when freed, so the address space follows live memory for every tool alike (with glibc's
    # defaults its dynamic threshold moves freed tensors onto the heap, whose size only grows).
    env.update(MALLOC_ARENA_MAX="1", MALLOC_MMAP_THRESHOLD_="65536")
    try:
        proc = subprocess.run(cmd, cwd=_REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"tool": tool, "ok": False, "error": f"timed out after {timeout:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith(_MARKER):
            return json.loads(line[len(_MARKER):])
    from benchmarks.compare_estimators import scrub_paths

    tail = [scrub_paths(ln) for ln in (proc.stderr or proc.stdout).strip().splitlines()][-15:]
    return {"tool": tool, "ok": False, "error": f"process exit {proc.returncode}", "stderr_tail": tail}


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------


def render_markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    m = meta["machine"]
    lines = [
        "# Variable-length batches under a real CPU memory cap",
        "",
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}",
        f"- machine: {m.get('cpu_model', '?')}, {m.get('usable_cores', '?')} usable of {m.get('cores', '?')} cores, "
        f"{m.get('ram_bytes', 0) / (1 << 30):.1f} GiB RAM, load average {m.get('load_average', '?')} at start and "
        f"{meta.get('load_average_end')} at end (a shared machine: seconds are inflated by the load), "
        f"{m.get('platform', '')}",
        f"- software: Python {m.get('python', '?')}, torch {m.get('torch', '?')}, transformers "
        f"{m.get('transformers', '?')}, accelerate {m.get('accelerate', '?')}, pytorch-lightning "
        f"{meta.get('lightning', '?')}; 1 intra-op thread",
        f"- job: one epoch of {len(LENGTHS) * BATCH} sequences in batches of {BATCH}, tokens per batch "
        f"{', '.join(map(str, LENGTHS))}; GPT-2 2 x 64 (eager attention), AdamW, fp32; cap = VmSize after a warm-up "
        f"step + {meta['room_mib']} MiB (`setrlimit(RLIMIT_AS)`), glibc malloc with `MALLOC_ARENA_MAX=1 "
        "MALLOC_MMAP_THRESHOLD_=65536`",
        "",
        "Columns: *micro-batches*: samples per forward/backward (memguard: per batch, after any halving; the finders: "
        "the size found); *OOMs*: out-of-memory errors hit, recovered or not; *trained*: samples in steps the final "
        "model keeps; *lost*: samples of the epoch not trained; *redone*: sample passes whose work was not kept; "
        "*tokens/s*: trained (non-padding) tokens per second of the whole run.",
        "",
        "| tool | micro-batches | OOMs | trained | lost | redone | seconds | tokens/s | result |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        mbs = r.get("micro_batches") or []
        shown = ", ".join(map(str, mbs)) if mbs else "—"
        result = "ok" if r.get("ok") else f"failed: {r.get('error', '?')[:120]}"
        cells = [r["tool"], shown] + [str(r.get(k, "—")) for k in ("ooms", "trained", "lost", "redone", "seconds",
                                                                    "tokens_per_second")] + [result]
        lines.append("| " + " | ".join(cells) + " |")
    by = {r["tool"]: r for r in rows}
    mg, re_ = by.get("memguard"), by.get("memguard-reactive")
    if mg and re_ and mg.get("step_seconds") and re_.get("step_seconds"):
        k = LENGTHS.index(max(LENGTHS))
        if len(mg["step_seconds"]) > k and len(re_["step_seconds"]) > k:
            lines += [
                "",
                "## Planning a new shape against the retries it saves",
                "",
                f"memguard planned {mg.get('shapes_planned')} new shape(s) in {mg.get('shape_planning_seconds')} s in "
                f"all (micro-batch per shape: {mg.get('by_shape')}). The {max(LENGTHS)}-token batch's step took "
                f"{mg['step_seconds'][k]} s with its planning, against {re_['step_seconds'][k]} s for "
                f"memguard-reactive, which found its micro-batch through {re_.get('ooms')} OOM(s) "
                f"(micro-batch per shape: {re_.get('by_shape')}).",
            ]
    cp = meta.get("compiled_peak")
    if cp and "eager_bytes" in cp:
        mib = 1 << 20
        lines += [
            "",
            "## What the estimate means for a compiled model",
            "",
            f"One training step of the same GPT-2 at {cp['batch']} (AdamW, fp32), real CPU peak of live tensors: "
            f"eager {cp['eager_bytes'] / mib:.1f} MiB, under `torch.compile` (inductor, compiled in "
            f"{cp['compile_seconds']} s before measuring) {cp['inductor_bytes'] / mib:.1f} MiB; memguard's estimate "
            f"(of the eager step) {cp['estimate_bytes'] / mib:.1f} MiB. The estimate bounds the compiled step from "
            f"above by {100 * (cp['estimate_bytes'] / cp['inductor_bytes'] - 1):.0f}%: inductor fuses pointwise ops "
            "and saves fewer activations for backward.",
        ]
    elif cp:
        lines += ["", f"Compiled peak: not measured ({cp.get('error', '?')})."]
    lines += ["", "Notes:", ""]
    for r in rows:
        if r.get("oom_messages"):
            lines.append(f"- {r['tool']}: first error: {r['oom_messages'][0][:160]}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; see the module docstring."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tools", default=",".join(TOOLS), help="comma-separated tools")
    parser.add_argument("--room", type=int, default=64, help="MiB above the warmed-up process")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per subprocess")
    parser.add_argument("--out", default=str(Path("benchmarks") / "results"), help="folder for the results")
    parser.add_argument("--compiled-peak", action="store_true", help="also measure eager vs compiled peak")
    parser.add_argument("--worker", choices=TOOLS + ("compiled-peak",), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(_REPO))
    if args.worker:
        import faulthandler

        faulthandler.enable()
        result = compiled_peak() if args.worker == "compiled-peak" else _worker(args.worker, args.room)
        print(_MARKER + json.dumps(result), flush=True)
        return 0
    tools = [t for t in args.tools.split(",") if t]
    bad = [t for t in tools if t not in TOOLS]
    if bad:
        parser.error(f"unknown tool(s) {bad}; tools: {', '.join(TOOLS)}")
    from benchmarks.compare_estimators import machine_description

    meta: dict[str, Any] = {
        "command": "python -m benchmarks.variable_length" + ("" if not argv else " " + shlex.join(argv)),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_description(), "room_mib": args.room, "lengths": list(LENGTHS), "batch": BATCH,
    }
    try:
        import pytorch_lightning

        meta["lightning"] = pytorch_lightning.__version__
    except ImportError:
        meta["lightning"] = None
    rows = []
    for tool in tools:
        row = _run_worker(tool, args.room, args.timeout)
        rows.append(row)
        print(f"  {tool}: {'ok' if row.get('ok') else row.get('error', '?')[:100]}", file=sys.stderr, flush=True)
    if args.compiled_peak:
        meta["compiled_peak"] = _run_worker("compiled-peak", args.room, max(args.timeout, 900.0))
    meta["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    md = render_markdown(rows, meta)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "variable_length.json").write_text(json.dumps({**meta, "runs": rows}, indent=2) + "\n")
    (out / "variable_length.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
