"""A training process with batches of changing sequence length whose memory really runs out.

Run as ``python shapes_worker.py '<json config>'``. The process builds a 2-layer, 64-wide GPT-2
from a config (nothing is downloaded) and trains it twice from the same initial weights on the
same batches: first a plain full-batch reference loop (no memguard, no memory cap), then through
``memguard.prepare``/``memguard.step`` after capping its address space with ``RLIMIT_AS`` at the
current VmSize plus ``cap_mib``, so that a micro-batch that does not fit fails with the CPU
allocator's real error. It writes ``result.json`` and both models' weights to ``out``.

Config keys: ``out`` (folder), ``lengths`` (tokens per sample of each step's batch), ``batch``
(samples per step), ``cap_mib``, and either ``budget_mib`` (memguard plans for that budget on the
CPU target from the first batch) or ``micro_batch_size`` (a fixed micro-batch, no planning).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import resource
import sys
from pathlib import Path

import torch

VOCAB = 512


def gpt2_tiny() -> torch.nn.Module:
    import transformers

    # Dropout off: the guarded run and the reference must compute the same function.
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=1024,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def make_batches(lengths: list[int], n: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    out = []
    for s, length in enumerate(lengths):
        ids = torch.randint(0, VOCAB, (n, length), generator=g)
        out.append({"input_ids": ids, "idx": torch.arange(s * n, (s + 1) * n)})
    return out


def vm_size() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def main() -> None:
    cfg = json.loads(sys.argv[1])
    out = Path(cfg["out"])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    from torch._subclasses.fake_tensor import is_fake

    import memguard
    from memguard.guard import guard_status

    events: list = []
    messages: list[str] = []

    class Recorder(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(f"{record.levelname}:{record.getMessage()}")
            if record.levelno >= logging.WARNING:
                events.append("RETRY")

    logging.getLogger("memguard").addHandler(Recorder())
    logging.getLogger("memguard").setLevel(logging.INFO)

    def loss_fn(model: torch.nn.Module, batch: dict) -> torch.Tensor:
        idx = batch["idx"]
        if idx.device.type != "meta" and not is_fake(idx):
            events.append(batch["idx"].tolist())  # the samples this forward saw (not the planner's traces)
        ids = batch["input_ids"]
        return model(input_ids=ids, labels=ids).loss

    model = gpt2_tiny()
    initial = copy.deepcopy(model)
    batches = make_batches(cfg["lengths"], cfg["batch"])
    reference = copy.deepcopy(initial)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for b in batches:  # what the guarded run must reproduce: one full-batch step per batch
        ids = b["input_ids"]
        reference(input_ids=ids, labels=ids).loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    torch.save(reference.state_dict(), out / "reference.pt")
    del reference, ref_opt

    opt = torch.optim.SGD(initial.parameters(), lr=0.05, momentum=0.9)
    if "budget_mib" in cfg:
        memguard.prepare(initial, opt, loss_fn=loss_fn, budget_bytes=cfg["budget_mib"] << 20, device="cpu",
                         precision="32-true", activation_checkpointing=False)
    else:
        memguard.prepare(initial, opt, loss_fn=loss_fn, micro_batch_size=cfg["micro_batch_size"])

    result: dict = {"losses": [], "error": None, "sizes": []}
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vm_size() + (cfg["cap_mib"] << 20), hard))
    try:
        for b in batches:
            events.append("STEP")
            result["losses"].append(memguard.step(initial, opt, b))
            result["sizes"].append(guard_status(initial).micro_batch_size)
    except Exception as exc:  # reported to the test, which decides whether it was expected
        result["error"] = {"type": type(exc).__name__, "message": str(exc)}
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    status = guard_status(initial)
    result.update(events=events, messages=messages, oom_retries=status.oom_retries,
                  by_signature={str(k): v for k, v in status.micro_batch_sizes.items()},
                  signatures_planned=status.signatures_planned,
                  planning_seconds=status.signature_planning_seconds)
    if status.plan is not None:  # full estimates at the long batch's micro-batch and one more
        long = max(cfg["lengths"])
        m = next(v for k, v in status.micro_batch_sizes.items() if k.dims[0] == (long,))
        peaks = []
        for n in (m, m + 1):
            ids = torch.zeros(n, long, dtype=torch.long)
            peaks.append(memguard.estimate(initial, {"input_ids": ids, "idx": torch.arange(n)}, optimizer=opt,
                                           loss_fn=loss_fn, device="cpu").peak_bytes)
        result.update(long_peaks=peaks, usable_bytes=int(status.plan.budget_bytes * (1 - status.plan.headroom)))
    torch.save(initial.state_dict(), out / "guarded.pt")
    (out / "result.json").write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
