"""One pipeline rank laid out by ``memguard.integrations.parallel.apply(model, Layout(pp=...))`` (run by
test_parallel_pipeline.py).

``python parallel_pipeline_worker.py '<json>'`` with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``
set. The JSON holds ``"pp"``, ``"schedule"``, ``"microbatches"``, ``"steps"``, ``"out"`` and optionally
``"cap_rank"`` / ``"cap_mib"``: that rank's address space is capped (``RLIMIT_AS``) at its size after the
first step plus ``cap_mib`` MiB, for the steps after the first, and lifted before the results are
written. Each rank builds the same small Llama (:func:`build_llama`, seed 0), runs ``steps`` steps of
``parallel.step`` on :func:`make_batches`, and writes ``result{rank}.json`` (losses, micro-batch counts,
the "memguard" log records, the peak of its live tensor bytes measured on the first step) and
``weights{rank}.pt`` (its stage's parameters by name, after the last step).
"""

from __future__ import annotations

import json
import logging
import resource
import sys
from pathlib import Path

SEQ, ROWS, HIDDEN, LAYERS, VOCAB, LR = 16, 8, 64, 4, 256, 1e-3


def build_llama():
    """A 4-block Llama of hidden size 64 made from its config (no download), the same weights on every call."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128,
                                   num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg)
    model.train()
    return model


def make_batches(steps: int, rows: int = ROWS) -> list[dict]:
    """``steps`` batches of ``rows`` x SEQ tokens; some labels are ignored (-100), unevenly over the rows, so
    that micro-batches count different numbers of labels."""
    import torch

    g = torch.Generator().manual_seed(1)
    out = []
    for k in range(steps):
        ids = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
        labels = ids.clone()
        for r in range(rows):
            labels[r, : (r * 3 + k) % (SEQ // 2)] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def vm_size() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def main() -> None:
    import torch
    import torch.distributed as dist

    import memguard
    from memguard.integrations import parallel

    cfg = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    records = _Records()
    logging.getLogger("memguard").addHandler(records)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    layout = memguard.Layout(pp=cfg["pp"], pp_schedule=cfg["schedule"], pp_microbatches=cfg["microbatches"])
    model = parallel.apply(build_llama(), layout)
    applied = parallel.layout_of(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    batches = make_batches(cfg["steps"])
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    losses, micro, capped = [], [], False
    for k, batch in enumerate(batches):
        if k == 1 and cfg.get("cap_rank") == rank:
            resource.setrlimit(resource.RLIMIT_AS, (vm_size() + (cfg["cap_mib"] << 20), hard))
            capped = True
        losses.append(parallel.step(model, optimizer, batch))
        micro.append(applied.pipeline.microbatches)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    result = {"rank": rank, "losses": losses, "microbatches": micro, "capped": capped, "log": records.messages,
              "mesh": list(applied.mesh.shape), "mesh_dims": list(applied.mesh.mesh_dim_names),
              "stage": type(applied.pipeline.stage).__name__, "schedule": type(applied.pipeline.schedule).__name__}
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, Path(cfg["out"]) / f"weights{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    (Path(cfg["out"]) / f"result{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
