"""memguard's plan + guard beside the batch-size finders users have today, under real CPU caps.

Every (model, budget, tool) runs in its own subprocess. The subprocess imports everything, builds
the model, its optimizer and a synthetic dataset, runs one warm-up forward/backward at batch 2
(so lazily loaded kernels and libraries are already mapped), reads its address-space size
(``VmSize`` in ``/proc/self/status``) and caps it with ``setrlimit(RLIMIT_AS, VmSize + room)``.
Any allocation past the cap then fails for real: torch's CPU allocator raises ``RuntimeError:
... DefaultCPUAllocator: can't allocate memory``. The cap bounds address space, so the room must
hold the step's tensors *and* what the allocator keeps around them (glibc heap fragmentation,
Python objects); this is the memory a CPU training job really has.

The job is the same for every tool: train ``--steps`` optimizer steps of a model that the user
would like to train with B samples per step (the model's ``batch``, or ``--batch``), in fp32,
with AdamW. Each tool is used as
its documentation says:

=================== =========================================================================
tool                how it is used
=================== =========================================================================
memguard            ``memguard.plan(model, batch, global_batch_size=B, device="cpu",
                    budget_bytes=params + buffers + room, precision="32-true",
                    activation_checkpointing=False)``, then ``prepare(model, optimizer,
                    plan=plan)`` and ``step(model, optimizer, batch)`` on batches of B samples
                    (the guard halves the micro-batch and reruns the same batch on an OOM)
accelerate          ``@find_executable_batch_size(starting_batch_size=B)`` on a training
                    function that, as Accelerate's memory guide shows, calls
                    ``accelerator.free_memory()``, builds the model, optimizer and dataloader
                    for ``batch_size`` and trains; on an OOM it recognises it restarts with
                    ``int(batch_size * 0.9)``
lightning-power     ``Tuner(trainer).scale_batch_size(module, mode="power")`` (defaults:
                    ``init_val=2``, ``steps_per_trial=3``), then ``trainer.fit(module)``
lightning-binsearch the same with ``mode="binsearch"`` (default ``margin=0.05``)
=================== =========================================================================

Models (:data:`CASES`): ``gpt2-eager`` (a tiny GPT-2 whose eager attention makes activations
dominate), ``resnet-bn`` (a small CNN with torch's oneDNN and NNPACK convolutions turned off, so
that every allocation goes through torch's CPU allocator and fails with its message) and
``resnet-bn-default`` (the same CNN with torch's default CPU kernels). Under a cap, oneDNN's
allocation failures surface as ``RuntimeError: could not create a primitive`` or as a crash
(SIGSEGV) of the process, and NNPACK's as ``posix_memalign failed`` (aten/src/ATen/native/NNPACK.cpp);
the report counts, per tool, every error seen and whether the tool recognised it.

Measured per run: the micro-batch the tool settled on, samples per optimizer step, OOMs hit,
samples lost (samples of batches whose step was abandoned), wasted sample passes (samples run
through the loss whose work was not kept: abandoned steps, steps a tool undid — Lightning
restores the weights after its trials, Accelerate rebuilds the model after an OOM — and
micro-batches the guard reran), the seconds until the first step of the configuration that
finished the job completed ("time to a working configuration") and the whole job's seconds.

Usage::

    python -m benchmarks.compare_batch_finders                       # everything (5-10 min)
    python -m benchmarks.compare_batch_finders --models gpt2-eager --rooms 96
    python -m benchmarks.compare_batch_finders --tools memguard,accelerate

Writes ``compare_batch_finders.{json,md}`` to ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import logging
import os
import shlex
import signal
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

_REPO = Path(__file__).resolve().parent.parent
_MARKER = "@@COMPARE_BATCH_FINDERS_RESULT@@ "  # prefix of the worker's one JSON line on stdout

TOOLS = ("memguard", "accelerate", "lightning-power", "lightning-binsearch")


# --------------------------------------------------------------------------------------------
# memory cap helpers (importable; the smoke test uses them)
# --------------------------------------------------------------------------------------------


def vmsize_bytes() -> int:
    """This process's address-space size: ``VmSize`` of ``/proc/self/status``.

    Raises:
        RuntimeError: the line is missing (not Linux).
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024  # /proc/<pid>/status reports kB (proc(5))
    raise RuntimeError("no VmSize line in /proc/self/status; the memory cap needs Linux")


def cap_address_space(room_bytes: int) -> int:
    """Limit this process's address space to its current size plus ``room_bytes``.

    Sets the soft ``RLIMIT_AS``; the hard limit is left as it is. Allocations past the cap fail
    (``mmap``/``brk`` return ENOMEM, setrlimit(2)), which torch's CPU allocator raises as
    ``RuntimeError: ... DefaultCPUAllocator: can't allocate memory``.

    Returns:
        The cap in bytes.
    """
    import resource

    cap = vmsize_bytes() + int(room_bytes)
    _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    return cap


def batch_samples(batch: Any) -> int:
    """Samples in a batch: dim 0 of its first tensor (tuple/list batches)."""
    import torch

    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    return int(batch[0].shape[0])


# --------------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FinderCase:
    """A small model whose step memory grows with the batch, and its data.

    Attributes:
        name: identifier.
        build: ``build() -> nn.Module`` with seeded weights.
        data: ``data(n) -> tuple of tensors`` with ``n`` samples on dim 0, seeded.
        loss_fn: ``loss_fn(model, batch) -> mean loss`` for a tuple batch.
        notes: what the case is.
        batch: the samples per optimizer step the user wants (more than fit in the rooms used).
        samples: the dataset's size (Lightning's finder stops at the dataset's length).
        rooms_mib: the rooms (MiB above the warmed-up process) it runs under by default.
        aten_kernels_only: turn off torch's oneDNN (mkldnn) and NNPACK CPU kernels, so that every
            allocation goes through torch's CPU allocator and fails with its message.
    """

    name: str
    build: Callable[[], Any]
    data: Callable[[int], tuple]
    loss_fn: Callable[[Any, tuple], Any]
    notes: str
    batch: int = 64
    samples: int = 256
    rooms_mib: tuple[int, ...] = (64, 160)
    aten_kernels_only: bool = False


def _gpt2_build():
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=512, n_positions=128, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0,
        attn_implementation="eager",
    )
    return transformers.GPT2LMHeadModel(config).train()


def _gpt2_data(n: int) -> tuple:
    import torch

    from benchmarks.zoo import seeded_generator

    return (torch.randint(0, 512, (n, 128), generator=seeded_generator()),)


def _gpt2_loss(model, batch):
    return model(input_ids=batch[0], labels=batch[0]).loss


def _resnet_build():
    import torch

    from benchmarks.zoo import SmallResNet

    torch.manual_seed(0)
    return SmallResNet(widths=(16, 32, 64), classes=10).train()


def _resnet_data(n: int) -> tuple:
    import torch

    from benchmarks.zoo import seeded_generator

    g = seeded_generator()
    return torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)


def _resnet_loss(model, batch):
    import torch.nn.functional as F

    return F.cross_entropy(model(batch[0]), batch[1])


CASES: dict[str, FinderCase] = {
    c.name: c
    for c in (
        FinderCase("gpt2-eager", _gpt2_build, _gpt2_data, _gpt2_loss,
                   "GPT-2 (2 x 32, 2 heads, vocab 512), eager attention, seq 128: activations dominate"),
        FinderCase("resnet-bn", _resnet_build, _resnet_data, _resnet_loss,
                   "ResNet-like CNN (widths 16/32/64, BatchNorm), 32x32 images, 10 classes; oneDNN and NNPACK "
                   "off, so that every allocation goes through torch's CPU allocator", batch=256, samples=1024,
                   aten_kernels_only=True),
        FinderCase("resnet-bn-default", _resnet_build, _resnet_data, _resnet_loss,
                   "the same CNN with torch's default CPU convolutions (oneDNN), whose allocation failures "
                   "have their own messages", batch=256, samples=1024, rooms_mib=(64,)),
    )
}


# --------------------------------------------------------------------------------------------
# worker: one tool on one model under one cap (run in a subprocess)
# --------------------------------------------------------------------------------------------


class _Log:
    """What a run did: loss calls, completed steps, OOMs, timestamps."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.loss_samples = 0  # samples passed through the loss (forward passes)
        self.ooms: list[dict[str, Any]] = []  # {"batch": samples of the abandoned batch or None, "error": ...}
        self.kept_steps: list[int] = []  # samples of each step whose work was kept
        self.undone_samples = 0  # samples of completed steps that the tool threw away
        self.first_kept_step_s: float | None = None
        self.phase = ""

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def counting(self, loss_fn: Callable) -> Callable:
        def wrapped(model, batch):
            self.loss_samples += batch_samples(batch)
            return loss_fn(model, batch)

        wrapped.__qualname__ = getattr(loss_fn, "__qualname__", "loss")
        return wrapped


def _short(exc: BaseException) -> str:
    from benchmarks.compare_estimators import scrub_paths

    text = scrub_paths(" ".join(str(exc).split()))
    return f"{type(exc).__name__}: {text}"[:240]


def _is_oom_text(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is an allocation failure.

    The report's own test, independent of every tool: ``MemoryError`` or an allocator message.
    """
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = str(e)
        if isinstance(e, MemoryError) or "can't allocate memory" in text or "out of memory" in text.lower():
            return True
        e = e.__cause__ or e.__context__
    return False


def _run_memguard(case: FinderCase, model, optimizer, data, room: int, batch: int, steps: int, log: _Log) -> dict:
    import memguard
    from benchmarks.ground_truth import live_state_bytes

    guard = memguard if hasattr(memguard, "prepare") else __import__("memguard.guard", fromlist=["prepare"])
    from memguard.guard import guard_status, is_oom_error

    budget = live_state_bytes(model, (), None) + room  # tensors already live + the room the cap leaves
    out: dict[str, Any] = {"budget_bytes": budget, "guard_api": guard.__name__ + ".prepare/step"}
    warnings: list[str] = []

    class _Keep(logging.Handler):  # the guard logs each recovered OOM at WARNING on the "memguard" logger
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    logging.getLogger("memguard").addHandler(_Keep(logging.WARNING))
    out["errors_seen"] = seen = []
    batches = [tuple(t[k * batch:(k + 1) * batch] for t in data) for k in range(steps)]
    try:
        plan = memguard.plan(model, batches[0], global_batch_size=batch, device="cpu", budget_bytes=budget,
                             optimizer=optimizer, loss_fn=case.loss_fn, precision="32-true",
                             activation_checkpointing=False)
    except Exception as exc:  # noqa: BLE001 - reported as measured
        out.update(error=_short(exc), plan_seconds=log.now())
        seen.append({"recognised": False, "error": _short(exc)})
        if _is_oom_text(exc):
            log.ooms.append({"batch": None, "error": _short(exc), "where": "plan"})
        return out
    out.update(plan_seconds=log.now(), planned_micro_batch=plan.micro_batch_size, grad_accum=plan.grad_accum_steps,
               plan_estimate_bytes=int(plan.estimate.peak_bytes) if plan.estimate is not None else None)
    guard.prepare(model, optimizer, plan=plan)
    counting = log.counting(case.loss_fn)
    for b in batches:
        try:
            guard.step(model, optimizer, b, counting)
        except Exception as exc:  # noqa: BLE001 - reported as measured
            log.ooms.append({"batch": batch_samples(b), "error": _short(exc), "where": "step"})
            out["error"] = _short(exc)
            # recognised: the guard saw an OOM (and gave up with OOMRecoveryError) rather than letting it through
            seen.append({"recognised": isinstance(exc, memguard.OOMRecoveryError) or is_oom_error(exc),
                         "error": _short(exc)})
            break
        log.kept_steps.append(batch_samples(b))
        if log.first_kept_step_s is None:
            log.first_kept_step_s = log.now()
    status = guard_status(model)
    out.update(micro_batch=status.micro_batch_size, guard_oom_retries=status.oom_retries,
               samples_per_step=batch)
    recovered = [w for w in warnings if w.startswith("out of memory")]
    for w in recovered:  # each halving is one OOM that the guard absorbed
        log.ooms.append({"batch": None, "error": "recovered by the guard: " + w[:200], "where": "step"})
        seen.insert(0, {"recognised": True, "error": w[:240]})
    return out


def _run_accelerate(case: FinderCase, data, batch: int, steps: int, log: _Log) -> dict:
    import accelerate.utils.memory as acc_memory
    import torch
    from accelerate import Accelerator
    from accelerate.utils import find_executable_batch_size
    from torch.utils.data import DataLoader, TensorDataset

    accelerator = Accelerator(cpu=True)
    recognised: list[dict[str, Any]] = []
    original = acc_memory.should_reduce_batch_size

    def observed(exc):  # observation only: Accelerate's own answer is returned unchanged
        answer = original(exc)
        recognised.append({"recognised": answer, "error": _short(exc)})
        return answer

    acc_memory.should_reduce_batch_size = observed
    attempts: list[dict[str, Any]] = []
    counting = log.counting(case.loss_fn)

    @find_executable_batch_size(starting_batch_size=batch)
    def train(batch_size):
        accelerator.free_memory()
        attempt = {"batch_size": batch_size, "steps_done": 0}
        attempts.append(attempt)
        model = case.build()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        loader = DataLoader(TensorDataset(*data), batch_size=batch_size)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        for k, b in enumerate(loader):
            if k == steps:
                break
            try:
                loss = counting(model, tuple(b))
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            except Exception as exc:
                attempt["error"] = _short(exc)
                attempt["failed_batch"] = batch_samples(b)
                raise
            attempt["steps_done"] += 1
            if attempt["steps_done"] == 1:
                attempt["first_step_s"] = log.now()
        return batch_size

    out: dict[str, Any] = {}
    try:
        found = train()
        out.update(micro_batch=found, samples_per_step=found)
    except Exception as exc:  # noqa: BLE001 - reported as measured
        out["error"] = _short(exc)
    finally:
        acc_memory.should_reduce_batch_size = original
    for i, a in enumerate(attempts):
        final = i == len(attempts) - 1 and "error" not in out
        if final:
            log.kept_steps += [a["batch_size"]] * a["steps_done"]
            log.first_kept_step_s = a.get("first_step_s")
        else:
            log.undone_samples += a["batch_size"] * a["steps_done"]
        if "error" in a:
            log.ooms.append({"batch": a.get("failed_batch"), "error": a["error"], "where": "step"})
    out.update(attempts=attempts, errors_seen=recognised)
    return out


def _lightning_module_class():
    import pytorch_lightning as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    class FinderModule(pl.LightningModule):
        """A LightningModule with a ``batch_size`` attribute, as the batch-size finder requires."""

        def __init__(self, model, data, loss_fn, log: _Log, batch_size: int) -> None:
            super().__init__()
            self.model = model
            self.data = data
            self.loss_fn = loss_fn
            self.run_log = log
            self.batch_size = batch_size
            self.events: list[tuple[str, str, int, float]] = []

        def training_step(self, batch, batch_idx):
            return self.loss_fn(self.model, tuple(batch))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.model.parameters(), lr=1e-4)

        def train_dataloader(self):
            return DataLoader(TensorDataset(*self.data), batch_size=self.batch_size)

        def on_train_batch_start(self, batch, batch_idx):
            self.events.append((self.run_log.phase, "start", batch_samples(batch), self.run_log.now()))

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.events.append((self.run_log.phase, "end", batch_samples(batch), self.run_log.now()))

    return FinderModule


def _run_lightning(case: FinderCase, model, data, mode: str, steps: int, log: _Log, module_cls, root: str) -> dict:
    import pytorch_lightning as pl
    import pytorch_lightning.tuner.batch_size_scaling as bss
    from pytorch_lightning.tuner import Tuner

    module = module_cls(model, data, log.counting(case.loss_fn), log, batch_size=2)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                         num_sanity_val_steps=0)
    seen: list[dict[str, Any]] = []
    original = bss.is_oom_error

    def observed(exc):  # observation only: Lightning's own answer is returned unchanged
        answer = original(exc)
        seen.append({"recognised": answer, "batch": module.batch_size, "error": _short(exc)})
        return answer

    bss.is_oom_error = observed
    out: dict[str, Any] = {}
    log.phase = "finder"
    try:
        found = Tuner(trainer).scale_batch_size(module, mode=mode)
        out["finder_seconds"] = log.now()
        out["micro_batch"] = found
    except Exception as exc:  # noqa: BLE001 - reported as measured
        out.update(error=_short(exc), finder_seconds=log.now())
    finally:
        bss.is_oom_error = original
    finder_events = list(module.events)
    if "error" not in out:
        log.phase = "fit"
        try:
            trainer.fit(module)
        except Exception as exc:  # noqa: BLE001 - reported as measured
            out["error"] = "fit: " + _short(exc)
        out["samples_per_step"] = module.batch_size
    starts = [e for e in finder_events if e[1] == "start"]
    ends = [e for e in finder_events if e[1] == "end"]
    log.undone_samples += sum(e[2] for e in ends)  # the tuner restores the pre-trial weights afterwards
    for s in seen:
        log.ooms.append({"batch": s["batch"], "error": s["error"],
                         "where": "finder" + ("" if s["recognised"] else " (not recognised)")})
    if len(starts) > len(ends) + len(seen):  # an abandoned step that never reached is_oom_error
        log.ooms.append({"batch": None, "error": out.get("error", "?"), "where": "finder"})
    fit_events = [e for e in module.events[len(finder_events):]]
    fit_ends = [e for e in fit_events if e[1] == "end"]
    log.kept_steps += [e[2] for e in fit_ends]
    if fit_ends:
        log.first_kept_step_s = fit_ends[0][3]
    fit_starts = [e for e in fit_events if e[1] == "start"]
    if len(fit_starts) > len(fit_ends) and "error" in out:
        log.ooms.append({"batch": fit_starts[-1][2], "error": out["error"], "where": "fit"})
    trials: list[int] = []
    for e in starts:  # the batch size of each trial, in order (a trial runs several steps of one size)
        if not trials or trials[-1] != e[2]:
            trials.append(e[2])
    out["finder_trials"] = trials
    out["errors_seen"] = [{"recognised": x["recognised"], "error": x["error"]} for x in seen]
    if str(out.get("error", "")).startswith("fit: "):  # after the search: nothing is there to catch it
        out["errors_seen"].append({"recognised": None, "error": out["error"][5:]})
    return out


def _worker(tool: str, case_name: str, room_mib: int, batch: int, steps: int, samples: int) -> dict[str, Any]:
    from memguard.vocab import MiB
    import torch

    torch.set_num_threads(1)  # one intra-op thread: comparable timings on a shared machine
    # import every tool before the cap, so that the cap's room is left for training
    import accelerate  # noqa: F401
    import pytorch_lightning  # noqa: F401
    import transformers  # noqa: F401

    import benchmarks.compare_estimators  # noqa: F401 - scrub_paths, used after errors under the cap
    import memguard  # noqa: F401
    import memguard.guard  # noqa: F401

    case = CASES[case_name]
    if case.aten_kernels_only:
        torch.backends.mkldnn.enabled = False  # torch/backends/mkldnn: a settable global flag
        torch.backends.nnpack.set_flags(False)  # torch/backends/nnpack
    data = case.data(samples)
    model = case.build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    module_cls = _lightning_module_class() if tool.startswith("lightning") else None
    root = tempfile.mkdtemp(prefix="finder-")
    warm = tuple(t[:2] for t in data)
    case.loss_fn(model, warm).backward()  # warm-up: map kernels and libraries before the cap
    model.zero_grad(set_to_none=True)
    del warm
    gc.collect()

    room = room_mib * MiB
    cap = cap_address_space(room)
    log = _Log()
    if tool == "memguard":
        out = _run_memguard(case, model, optimizer, data, room, batch, steps, log)
    elif tool == "accelerate":
        del model, optimizer
        gc.collect()
        out = _run_accelerate(case, data, batch, steps, log)
    else:
        out = _run_lightning(case, model, data, tool.split("-", 1)[1], steps, log, module_cls, root)
    total = log.now()
    shutil.rmtree(root, ignore_errors=True)
    lost = sum(o["batch"] or 0 for o in log.ooms if o["where"] != "plan")
    kept = sum(log.kept_steps)
    out.update(
        tool=tool, case=case_name, room_bytes=room, cap_bytes=cap, steps_done=len(log.kept_steps),
        ooms=len(log.ooms), oom_events=log.ooms, samples_lost=lost, undone_samples=log.undone_samples,
        wasted_sample_passes=max(0, log.loss_samples - kept), loss_samples=log.loss_samples,
        time_to_working_s=log.first_kept_step_s if len(log.kept_steps) == steps else None, total_s=total,
        ok=len(log.kept_steps) == steps and "error" not in out,
    )
    return out


def _run_worker(tool: str, case: str, room_mib: int, args: argparse.Namespace) -> dict[str, Any]:
    from memguard.vocab import MiB
    cmd = [sys.executable, "-m", "benchmarks.compare_batch_finders", "--worker", tool, "--models", case,
           "--rooms", str(room_mib), "--steps", str(args.steps)]
    cmd += ["--batch", str(args.batch)] if args.batch else []
    cmd += ["--samples", str(args.samples)] if args.samples else []
    env = dict(os.environ)
    env["PYTHONPATH"] = str(_REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")  # no OpenMP pool beyond the one thread we use
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=_REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"tool": tool, "case": case, "room_bytes": room_mib * MiB, "ok": False,
                "error": f"timed out after {args.timeout:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith(_MARKER):
            return json.loads(line[len(_MARKER):])
    from benchmarks.compare_estimators import scrub_paths

    lines = [scrub_paths(ln) for ln in (proc.stderr or proc.stdout).strip().splitlines()]
    how = f"exit {proc.returncode}"
    if proc.returncode < 0:
        how = f"killed by {signal.Signals(-proc.returncode).name}"  # subprocess: -N means signal N
    said = [ln for ln in lines if "Batch size" in ln]  # the finder's own progress lines, if any
    return {"tool": tool, "case": case, "room_bytes": room_mib * MiB, "ok": False,
            "error": f"process {how} after {time.perf_counter() - t0:.0f} s" + (f"; last: {said[-1]}" if said else ""),
            "stderr_tail": lines[-25:]}


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------


def _fmt_s(x: float | None) -> str:
    return "—" if x is None else f"{x:.1f}"


def render_markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The report: header, how each tool was used, one row per run, notes on failures."""
    from memguard.vocab import MiB
    m = meta["machine"]
    lines = [
        "# Batch-size finders under a real CPU memory cap",
        "",
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}",
        f"- machine: {m.get('cpu_model')}, {m.get('cpus_usable')} usable of {m.get('cpu_count')} cores, "
        f"{m.get('ram_bytes', 0) / (1 << 30):.1f} GiB RAM, load average {m.get('load_average')} at start and "
        f"{meta.get('load_average_end')} at end, {m.get('os')}",
        f"- software: Python {m.get('python')}, torch {m.get('torch')}, transformers {m.get('transformers')}, "
        f"accelerate {m.get('accelerate')}, pytorch-lightning {meta.get('lightning')}; 1 intra-op thread",
        f"- job: {meta['steps']} AdamW steps in fp32 with the samples per step the user wants ("
        + ", ".join(f"{c}: {b} of a {n}-sample dataset" for c, (b, n) in meta["wanted"].items())
        + "); cap = VmSize after warm-up + room (`setrlimit(RLIMIT_AS)`); glibc malloc with its defaults",
        "- memguard's budget = bytes of the parameters and buffers already live + room; precision fixed to 32-true "
        "and activation checkpointing off, so that only the micro-batch and accumulation differ between tools",
        "",
        "Columns: *micro-batch*: samples per forward/backward the tool settled on (memguard: after any guard "
        "halving; planned value in brackets); *samples/step*: samples per optimizer step (memguard keeps the wanted "
        "batch through accumulation; the finders change it); *OOMs*: out-of-memory errors hit; *lost*: samples of "
        "batches whose step was abandoned; *undone*: samples of steps that completed but whose update the tool threw "
        "away (Lightning restores the weights after its trials, Accelerate rebuilds the model after an OOM); "
        "*wasted*: samples run through the loss whose work was not kept (lost + undone + micro-batches rerun); "
        "*to working (s)*: seconds until the first step of the configuration that finished the job completed; "
        "*job (s)*: all seconds including the search.",
        "",
        "| model | room (MiB) | tool | micro-batch | samples/step | OOMs | lost | undone | wasted | to working (s) "
        "| job (s) | result |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        mb = r.get("micro_batch")
        if r.get("tool") == "memguard" and r.get("planned_micro_batch") is not None:
            mb = f"{mb} ({r['planned_micro_batch']})"
        result = "ok" if r.get("ok") else "failed: " + str(r.get("error", "?"))[:160].replace("|", "/")
        lines.append(
            f"| {r['case']} | {r['room_bytes'] // MiB} | {r['tool']} | {mb if mb is not None else '—'} | "
            f"{r.get('samples_per_step', '—')} | {r.get('ooms', '—')} | {r.get('samples_lost', '—')} | "
            f"{r.get('undone_samples', '—')} | {r.get('wasted_sample_passes', '—')} | "
            f"{_fmt_s(r.get('time_to_working_s'))} | {_fmt_s(r.get('total_s'))} | {result} |"
        )
    lines += ["", "## Per tool, over all runs above", "",
              "| tool | finished the job | OOMs | samples lost | wasted sample passes | median to working (s) |",
              "|---|---|---:|---:|---:|---:|"] + _summary_rows(rows)
    lines += ["", "## Errors seen under the cap, and whether the tool recognised them as out-of-memory", ""]
    lines += [f"- {n}" for n in _notes(rows)]
    plans = [r for r in rows if r.get("tool") == "memguard" and r.get("planned_micro_batch") is not None]
    if plans:
        lines += ["", "## memguard's plans against the cap", "",
                  "memguard's CPU estimate counts live tensor bytes; the cap bounds address space, which also holds "
                  "what glibc keeps around freed tensors and the Python objects made while planning. Where the plan "
                  "did not fit, the guard halved the micro-batch and reran the same batch.", "",
                  f"Guard API used: `{plans[0].get('guard_api')}`.", "",
                  "| model | room (MiB) | budget (MiB) | planned micro-batch x accumulation | predicted peak (MiB) | "
                  "plan s | micro-batch that ran |", "|---|---:|---:|---|---:|---:|---:|"]
        for r in plans:
            est = r.get("plan_estimate_bytes")
            lines.append(f"| {r['case']} | {r['room_bytes'] // MiB} | {r['budget_bytes'] / MiB:.1f} | "
                         f"{r['planned_micro_batch']} x {r.get('grad_accum')} | "
                         f"{'—' if est is None else f'{est / MiB:.1f}'} | {_fmt_s(r.get('plan_seconds'))} | "
                         f"{r.get('micro_batch')} |")
    return "\n".join(lines) + "\n"


def error_kind(message: str) -> str:
    """A short name for an error seen under the cap, for grouping in the report."""
    kinds = (
        ("DefaultCPUAllocator: can't allocate memory", "torch CPU allocator: `can't allocate memory`"),
        ("could not create a primitive", "oneDNN: `could not create a primitive`"),
        ("posix_memalign failed", "NNPACK workspace: `posix_memalign failed`"),
        ("killed by SIG", "the process crashed"),
    )
    for needle, kind in kinds:
        if needle in message:
            return kind + (f" ({message.split('killed by ')[1].split()[0]})" if needle == "killed by SIG" else "")
    return f"`{message[:100]}`"


def _notes(rows: list[dict[str, Any]]) -> list[str]:
    """Per tool: each kind of error seen under the cap, how often, and whether the tool recognised it."""
    from collections import Counter

    notes = []
    for tool in TOOLS:
        mine = [r for r in rows if r.get("tool") == tool]
        if not mine:
            continue
        counts: Counter = Counter()
        for r in mine:
            for e in r.get("errors_seen", []):
                counts[(error_kind(e["error"]), e["recognised"])] += 1
            if str(r.get("error", "")).startswith("process "):
                counts[(error_kind(r["error"]), False)] += 1
        label = {True: "recognised", False: "NOT recognised", None: "raised in the training run after the search"}
        parts = [f"{kind}: {n}x, {label[rec]}" for (kind, rec), n in sorted(counts.items(), key=str)]
        notes.append(f"**{tool}**: " + ("; ".join(parts) if parts else "no error under the cap"))
    return notes


def _summary_rows(rows: list[dict[str, Any]]) -> list[str]:
    """One Markdown row per tool: runs finished, OOMs, samples lost and wasted, time to working."""
    import statistics

    out = []
    for tool in TOOLS:
        mine = [r for r in rows if r.get("tool") == tool]
        if not mine:
            continue
        done = [r for r in mine if r.get("ok")]
        times = [r["time_to_working_s"] for r in done if r.get("time_to_working_s") is not None]
        med = f"{statistics.median(times):.1f}" if times else "—"
        out.append(f"| {tool} | {len(done)} of {len(mine)} | {sum(r.get('ooms') or 0 for r in mine)} | "
                   f"{sum(r.get('samples_lost') or 0 for r in mine)} | "
                   f"{sum(r.get('wasted_sample_passes') or 0 for r in mine)} | {med} |")
    return out


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; see the module docstring."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(CASES), help="comma-separated model names")
    parser.add_argument("--rooms", default="", help="comma-separated room sizes in MiB above the warmed-up "
                        "process (default: each model's)")
    parser.add_argument("--tools", default=",".join(TOOLS), help="comma-separated tools")
    parser.add_argument("--batch", type=int, default=None, help="wanted samples per optimizer step (default: "
                        "the model's)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps in the job")
    parser.add_argument("--samples", type=int, default=None, help="dataset size (default: the model's)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per subprocess")
    parser.add_argument("--out", default=str(Path("benchmarks") / "results"), help="folder for the results")
    parser.add_argument("--worker", choices=TOOLS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    sys.path.insert(0, str(_REPO))
    if args.worker:
        import faulthandler

        faulthandler.enable()  # a crash (e.g. SIGSEGV under the cap) prints the Python stack to stderr
        case = CASES[args.models]
        result = _worker(args.worker, args.models, int(args.rooms), args.batch or case.batch, args.steps,
                         args.samples or case.samples)
        print(_MARKER + json.dumps(result), flush=True)
        return 0

    models = [m for m in args.models.split(",") if m]
    tools = [t for t in args.tools.split(",") if t]
    rooms = [int(r) for r in args.rooms.split(",") if r]  # empty: each model's own rooms
    bad = [m for m in models if m not in CASES] + [t for t in tools if t not in TOOLS]
    if bad:
        parser.error(f"unknown model(s)/tool(s) {bad}; models: {', '.join(CASES)}; tools: {', '.join(TOOLS)}")

    from benchmarks.compare_estimators import machine_description

    meta: dict[str, Any] = {
        "command": "python -m benchmarks.compare_batch_finders" + ("" if not argv else " " + shlex.join(argv)),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_description(),
        "steps": args.steps,
        "wanted": {m: (args.batch or CASES[m].batch, args.samples or CASES[m].samples) for m in models},
    }
    try:
        import pytorch_lightning

        meta["lightning"] = pytorch_lightning.__version__
    except ImportError:
        meta["lightning"] = None
    t0 = time.perf_counter()
    rows = []
    for case in models:
        for room in rooms or CASES[case].rooms_mib:
            for tool in tools:
                row = _run_worker(tool, case, room, args)
                rows.append(row)
                print(f"  {case} room {room} MiB {tool}: {'ok' if row.get('ok') else row.get('error', '?')[:100]}",
                      file=sys.stderr, flush=True)
    meta["wall_seconds"] = time.perf_counter() - t0
    meta["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    md = render_markdown(rows, meta)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare_batch_finders.json").write_text(json.dumps({**meta, "runs": rows}, indent=2) + "\n")
    (out / "compare_batch_finders.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
