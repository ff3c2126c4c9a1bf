"""A process that joins large evaluation outputs under a real memory cap, for test_eval_guard.py.

Run as ``python eval_join_worker.py '<json config>'``. The model maps each of ``seq`` positions of
a sample to ``WIDE`` outputs through a ``WIDE``-wide hidden layer, so under ``no_grad`` a forward
of ``m`` samples peaks at about two output-sized tensors (the GELU's output and the result),
``2 * m * seq * WIDE * 4`` bytes, and keeps one, ``u = seq * WIDE * 4`` bytes per sample (256 KiB
at ``seq=64``). The reference runs the batch whole without a cap. Then, per entry of ``runs``, a
fresh copy of the model is evaluated by :func:`memguard.guard._evaluate.evaluate` after capping
the address space with ``RLIMIT_AS`` at the current VmSize plus ``budget_mib`` (the cap is lifted
before any comparison): ``fn`` ``"outputs"`` (the default join) or ``"loss"`` (a loss-only fn);
``combine`` ``"all_at_once"`` joins every piece at the end with :func:`combine_outputs` (the
pieces and the whole at once, as memguard joined before). Writes ``result.json`` to ``out``.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import resource
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from oom_worker import vm_size  # noqa: E402

WIDE = 1024


@dataclass
class Output:
    loss: torch.Tensor
    logits: torch.Tensor


class Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, WIDE)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(WIDE, WIDE)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Output:
        logits = self.fc2(self.act(self.fc1(x)))
        return Output(loss=((logits.mean(dim=(1, 2)) - y) ** 2).mean(), logits=logits)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    out = Path(cfg["out"])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    from memguard.guard._evaluate import combine_outputs, eval_status, evaluate

    g = torch.Generator().manual_seed(1)
    n, seq = cfg["batch"], cfg["seq"]
    batch = {"x": torch.randn(n, seq, 16, generator=g), "y": torch.randn(n, generator=g)}
    model = Wide().eval()
    with torch.no_grad():
        ref = model(**batch)
        model(**{k: v[:2] for k, v in batch.items()})  # kernels initialised before any cap
    messages: list[str] = []

    class Recorder(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(f"{record.levelname}:{record.getMessage()}")

    logging.getLogger("memguard").addHandler(Recorder())
    logging.getLogger("memguard").setLevel(logging.INFO)

    results = []
    for run in cfg["runs"]:
        guarded = copy.deepcopy(model)
        fn = (lambda m, b: m(**b).loss) if run["fn"] == "loss" else None
        combine = combine_outputs if run.get("combine") == "all_at_once" else None
        messages.clear()
        r: dict = {"name": run["name"], "error": None}
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (vm_size() + (run["budget_mib"] << 20), hard))
        try:
            if run.get("probe_whole"):  # the whole batch must fail under this cap
                try:
                    with torch.no_grad():
                        guarded(**batch)
                    r["whole_fits"] = True
                except RuntimeError as exc:
                    r["whole_fits"] = False
                    r["whole_error"] = str(exc).splitlines()[0]
            got = evaluate(guarded, batch, fn, combine=combine)
        except Exception as exc:  # reported to the test
            got = None
            r["error"] = {"type": type(exc).__name__, "message": str(exc)}
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        status = eval_status(guarded)
        r.update(messages=list(messages), oom_retries=status.oom_retries, forwards=status.forwards,
                 micro_batch_sizes=list(status.micro_batch_size.values()))
        if got is not None:
            loss = got if run["fn"] == "loss" else got.loss
            r["loss"], r["ref_loss"] = float(loss), float(ref.loss)
            if run["fn"] != "loss":
                r["logits_shape"] = list(got.logits.shape)
                r["logits_max_diff"] = float((got.logits - ref.logits).abs().max())
        del got
        results.append(r)
    (out / "result.json").write_text(json.dumps(results))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
