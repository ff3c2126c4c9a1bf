"""One pipeline rank laid out by ``memguard.integrations.parallel.apply(model, Layout(pp=...))`` (run by
test_parallel_pipeline.py).

``python parallel_pipeline_worker.py '<json>'`` with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``
set. The JSON holds ``"pp"``, ``"schedule"``, ``"microbatches"``, ``"steps"`` and ``"out"``, and optionally:

* ``"seq"``, ``"vocab"``: the batches' length and the model's vocabulary;
* ``"checkpoint_blocks"``: apply a plan (its ``layout`` and ``checkpoint_blocks``, the blocks checkpointed over
  all stages) instead of the layout; the result's ``checkpointed`` lists the stage's checkpointed blocks;
* ``"measure"``: the rank only measures its peak of live tensor bytes (:func:`_measure`) and writes it
  as ``real_peak_bytes``;
* ``"raise_rank"``: from the second step on, that rank's base model raises a ValueError when called;
* ``"cap_rank"``, ``"cap_factor"``: from the second step on, that rank's address space is capped
  (``RLIMIT_AS``) at its size then plus ``cap_factor`` times the first step's rise (``VmPeak`` over
  ``VmSize`` at its start); the cap is lifted before the results are written;
* ``"hang_after_s"``: a rank still running then prints its stacks and exits.

Each rank builds the same small Llama (:func:`build_llama`, seed 0), runs ``steps`` steps of
``parallel.step`` on :func:`make_batches`, and writes ``result{rank}.json`` (losses, micro-batch counts
after each step, the error a step raised, the "memguard" log records, the first step's rise) and
``weights{rank}.pt`` (its stage's parameters by name, after the last step).
"""

from __future__ import annotations

import faulthandler
import json
import logging
import resource
import sys
from pathlib import Path

SEQ, ROWS, HIDDEN, LAYERS, VOCAB, LR = 16, 8, 64, 4, 256, 1e-3


def build_llama(vocab: int = VOCAB):
    """A 4-block Llama of hidden size 64 made from its config (no download), the same weights on every call."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=128,
                                   num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=1024, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg)
    model.train()
    return model


def make_batches(steps: int, rows: int = ROWS, seq: int = SEQ, vocab: int = VOCAB) -> list[dict]:
    """``steps`` batches of ``rows`` x SEQ tokens; some labels are ignored (-100), unevenly over the rows, so
    that micro-batches count different numbers of labels."""
    import torch

    g = torch.Generator().manual_seed(1)
    out = []
    for k in range(steps):
        ids = torch.randint(0, vocab, (rows, seq), generator=g)
        labels = ids.clone()
        for r in range(rows):
            labels[r, : (r * 3 + k) % (seq // 2)] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def vm(field: str = "VmSize") -> int:
    """This process's ``VmSize`` (or ``VmPeak``) in bytes, from /proc/self/status (kB = KiB: proc(5))."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _measure(model, optimizer, batch, run) -> int:
    """The peak of live tensor bytes over two steps of ``parallel.step`` on ``batch``, after a warm-up step, as
    the layout benchmark measures a pipeline rank (:func:`benchmarks.layouts_cpu._pipeline_worker`: the
    profiler's allocator events replayed by address over the model, batch, optimizer state and the stage's
    receive buffers, :func:`benchmarks.fsdp2_cpu._replay`)."""
    import gc

    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    from benchmarks.fsdp2_cpu import _PREFIX, _live_bytes, _replay, _storage_bytes
    from memguard.estimator._pipeline import stage_buffers
    from memguard.integrations import parallel

    def step() -> None:
        with record_function(_PREFIX + "step"), record_function(_PREFIX + "forward"):
            parallel.step(model, optimizer, batch)

    step()  # warm-up: the stage's receive buffers and the optimizer's state
    gc.collect()
    gc.disable()
    dist.barrier()
    fwd, grads = stage_buffers(run.schedule)
    baseline = _live_bytes(model, batch, optimizer) + _storage_bytes(fwd + grads)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(2):
            step()
    gc.enable()
    _, _, step_peaks, _, suspect = _replay(prof, baseline)
    return max([p for k, p in enumerate(step_peaks) if k not in suspect] or step_peaks)


def main() -> None:
    import torch
    import torch.distributed as dist

    import memguard
    from memguard.guard._pipeline_step import pipeline_run_of
    from memguard.integrations import parallel

    cfg = json.loads(sys.argv[1])
    if cfg.get("hang_after_s"):  # a hung rank prints where it waits, then exits (the test then fails)
        faulthandler.dump_traceback_later(cfg["hang_after_s"], exit=True)
    torch.set_num_threads(1)
    records = _Records()
    logging.getLogger("memguard").addHandler(records)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    layout = memguard.Layout(pp=cfg["pp"], pp_schedule=cfg["schedule"], pp_microbatches=cfg["microbatches"])
    vocab, seq = cfg.get("vocab", VOCAB), cfg.get("seq", SEQ)
    batches = make_batches(cfg["steps"], seq=seq, vocab=vocab)
    plan = layout
    if cfg.get("checkpoint_blocks"):
        import types

        plan = types.SimpleNamespace(layout=layout, checkpoint_blocks=cfg["checkpoint_blocks"])
    model = parallel.apply(build_llama(vocab), plan, batch=batches[0])  # the stage and schedule built now
    checkpointed = [i for i, b in enumerate(model.model.layers) if getattr(b, "_memguard_checkpointed", False)]
    applied = parallel.layout_of(model)
    built = [type(applied.pipeline.stage).__name__, type(applied.pipeline.schedule).__name__]
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if cfg.get("measure"):
        result = {"rank": rank, "real_peak_bytes": _measure(model, optimizer, batches[0], applied.pipeline),
                  "checkpointed": checkpointed}
        dist.barrier()
        dist.destroy_process_group()
        (Path(cfg["out"]) / f"result{rank}.json").write_text(json.dumps(result))
        return
    losses, micro, capped, growth, error = [], [], False, 0, None
    try:
        for k, batch in enumerate(batches):
            if k == 1 and cfg.get("cap_rank") == rank:
                # the calibration: the first step's rise of the address space (its peak over its start; with
                # MALLOC_MMAP_THRESHOLD_ fixed, every large tensor is its own mapping, returned when freed)
                resource.setrlimit(resource.RLIMIT_AS, (vm() + int(cfg["cap_factor"] * growth), hard))
                capped = True
            if k == 1 and cfg.get("raise_rank") == rank:
                def fail(module, args):
                    raise ValueError("an error of the model's own")
                model.model.register_forward_pre_hook(fail)
            before = vm()
            # memguard.step dispatches a stage cut by parallel.apply to the same PipelineRun
            step = memguard.step if cfg.get("via") == "memguard" else parallel.step
            losses.append(step(model, optimizer, batch))
            if k == 0:
                growth = vm("VmPeak") - before
            micro.append(applied.pipeline.microbatches)
    except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
        error = {"type": type(exc).__name__, "message": str(exc), "notes": getattr(exc, "__notes__", []),
                 "cause": None if exc.__cause__ is None else f"{type(exc.__cause__).__name__}: {exc.__cause__}"}
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    result = {"rank": rank, "losses": losses, "error": error, "first_step_growth": growth, "microbatches": micro,
              "capped": capped, "log": records.messages, "built_by_apply": built,
              "run_registered": pipeline_run_of(model) is applied.pipeline,
              "mesh": list(applied.mesh.shape), "mesh_dims": list(applied.mesh.mesh_dim_names),
              "stage": type(applied.pipeline.stage).__name__, "schedule": type(applied.pipeline.schedule).__name__,
              "checkpointed": checkpointed}
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, Path(cfg["out"]) / f"weights{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    (Path(cfg["out"]) / f"result{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
