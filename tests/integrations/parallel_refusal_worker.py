"""One rank of a job laid out by ``memguard.integrations.parallel.apply`` and prepared by ``memguard.prepare``
(run by test_parallel_recovery.py): ``memguard.step`` must run the tensor-parallel model guarded on every rank.

``python parallel_refusal_worker.py '<json>'`` with ``RANK``/``WORLD_SIZE``/``MASTER_*`` set; the JSON holds
``dp_shard``, ``tp`` and ``out``. Writes ``result{rank}.json`` with the step's loss or what it raised, and the
guard's rank group.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path


def main() -> None:
    cfg = json.loads(sys.argv[1])
    faulthandler.dump_traceback_later(cfg.get("hang_after_s", 120), exit=True)  # a hang prints its stacks and fails
    import torch
    import torch.distributed as dist

    import memguard
    from benchmarks.layouts_cpu import build_model
    from memguard.integrations.parallel import apply

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = apply(build_model("gpt"), memguard.Layout(dp_shard=cfg["dp_shard"], tp=cfg["tp"]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    ids = torch.randint(0, 2048, (4, 32), generator=torch.Generator().manual_seed(1))
    memguard.prepare(model, optimizer, micro_batch_size=2, loss_fn=lambda m, b: m(b["input_ids"], b["labels"]),
                     **({"strategy": "fsdp2"} if cfg["dp_shard"] > 1 else {}))
    result: dict = {"rank": dist.get_rank(), "error": None}
    try:
        result["loss"] = memguard.step(model, optimizer, {"input_ids": ids, "labels": ids})
    except Exception as exc:  # reported to the test
        result["error"] = {"type": type(exc).__name__, "message": str(exc)}
    from memguard.guard._core import guard_of

    result["rank_group"] = type(guard_of(model, "").rank_group).__name__
    dist.barrier()  # every rank got here: none is left waiting in a collective
    (Path(cfg["out"]) / f"result{result['rank']}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown: gloo's threads can deadlock at exit (see tests/guard/oom_worker.py)


if __name__ == "__main__":
    main()
