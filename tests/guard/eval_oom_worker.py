"""A process that trains and validates under a real memory cap, for the guarded evaluation's tests.

Run as ``python eval_oom_worker.py '<json config>'``. The model and data are made twice from the
same seed: first a plain reference (no memguard, no cap) that trains on full batches and runs each
validation batch whole; then a guarded run (``memguard.guard.step`` with a plan of micro-batch
``train_batch``, and :func:`memguard.guard._evaluate.evaluate` for validation) after capping the
address space with ``RLIMIT_AS`` at the current VmSize plus ``budget_mib``. The validation batch is
``val_factor`` times the training batch, so it fails whole with the CPU allocator's real error;
``val_seqs`` gives each validation batch its own sequence length (default: ``seq`` for all).
Writes ``result.json``, the weights and the validation outputs of both runs to ``out``.

Memory per sample at ``seq`` positions (fp32): training saves fc1's and GELU's outputs for backward
and makes their gradients, about ``4 * seq * 1024 * 4`` bytes (1 MiB at ``seq=64``); evaluation
under ``no_grad`` holds at most fc1's output and GELU's at once, ``2 * seq * 1024 * 4`` bytes
(0.5 MiB at ``seq=64``).
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
from oom_worker import vm_size  # noqa: E402  (the same VmSize reader as the training worker)

HIDDEN = 1024


@dataclass
class Output:
    loss: torch.Tensor
    pred: torch.Tensor


class Net(nn.Module):
    """Per position: 16 -> HIDDEN -> GELU -> 1, averaged over positions; MSE against ``y``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, HIDDEN)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor) -> Output:
        pred = self.fc2(self.act(self.fc1(x))).mean(dim=(1, 2))
        return Output(loss=((pred - y) ** 2).mean(), pred=pred)


def batch(g: torch.Generator, n: int, seq: int, first: int) -> dict:
    return {"x": torch.randn(n, seq, 16, generator=g), "y": torch.randn(n, generator=g),
            "idx": torch.arange(first, first + n)}


def main() -> None:
    cfg = json.loads(sys.argv[1])
    out = Path(cfg["out"])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    from memguard.estimator._result import Estimate
    from memguard.guard import guard_status, prepare, step
    from memguard.guard._evaluate import eval_status, evaluate
    from memguard.planner._plan import Plan

    g = torch.Generator().manual_seed(1)
    n_train, seq = cfg["train_batch"], cfg["seq"]
    n_val = n_train * cfg["val_factor"]
    train = [batch(g, n_train, seq, 1000 * s) for s in range(cfg["steps"])]
    val_seqs = cfg.get("val_seqs") or [seq] * cfg["val_batches"]  # variable-length validation batches
    val = [batch(g, n_val, s, 100_000 + 1000 * v) for v, s in enumerate(val_seqs)]
    model = Net()
    initial = copy.deepcopy(model)

    def schedule(run_train, run_val) -> list:
        """Train, validating after every ``val_every`` steps: the same order in both runs."""
        outputs = []
        for s, b in enumerate(train):
            run_train(b)
            if (s + 1) % cfg["val_every"] == 0:
                outputs.append([run_val(v) for v in val])
        return outputs

    # the reference: plain PyTorch, full batches, validation unsplit
    ref = copy.deepcopy(initial)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)

    def ref_train(b):
        ref.train()
        ref(**b).loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)

    def ref_val(b):
        ref.eval()
        with torch.no_grad():
            o = ref(**b)
        return {"loss": o.loss.item(), "pred": o.pred}

    ref_out = schedule(ref_train, ref_val)

    # the guarded run, under the cap
    guarded = initial
    opt = torch.optim.SGD(guarded.parameters(), lr=0.05, momentum=0.9)
    seen: list = []
    guarded.register_forward_hook(lambda m, a, kw, o: seen.append(("train" if m.training else "val",
                                                                   kw["idx"].tolist())), with_kwargs=True)
    est = Estimate(peak_bytes=n_train << 20, breakdown={"activations": n_train << 20}, context_bytes=0,
                   peak_phase="backward", allocated_peak_bytes=n_train << 20, device="cpu", precision="32-true",
                   zero_stage=0, world_size=1, gpu=None, micro_batch_size=n_train)
    plan = Plan(micro_batch_size=n_train, grad_accum_steps=1, world_size=1, global_batch_size=n_train,
                precision="32-true", activation_checkpointing=False, zero_stage=0,
                budget_bytes=cfg["budget_mib"] << 20, estimate=est, device="cpu")
    prepare(guarded, opt, plan=plan)
    messages: list[str] = []

    class Recorder(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(f"{record.levelname}:{record.getMessage()}")

    logging.getLogger("memguard").addHandler(Recorder())
    logging.getLogger("memguard").setLevel(logging.INFO)

    forwards: list[int] = []

    def guarded_val(b):
        o = evaluate(guarded, b)
        forwards.append(eval_status(guarded).forwards)
        return {"loss": o.loss.item(), "pred": o.pred}

    result: dict = {"error": None}
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vm_size() + (cfg["budget_mib"] << 20), hard))
    try:
        if cfg.get("uncapped_eval_probe"):  # the whole validation batch must fail under this cap
            try:
                with torch.no_grad():
                    guarded(**val[0])
                result["whole_val_fits"] = True
            except RuntimeError as exc:
                result["whole_val_fits"] = False
                result["whole_val_error"] = str(exc).splitlines()[0]
        guarded_out = schedule(lambda b: step(guarded, opt, b), guarded_val)
    except Exception as exc:  # reported to the test
        result["error"] = {"type": type(exc).__name__, "message": str(exc)}
        guarded_out = []
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    status = guard_status(guarded)
    result.update(
        messages=messages, seen=seen, forwards=forwards,
        train_micro_batch_size=status.micro_batch_size, train_planned=status.planned_micro_batch_size,
        train_oom_retries=status.oom_retries, eval_oom_retries=eval_status(guarded).oom_retries,
        eval_micro_batch_sizes={str(k[0][0][0]): v for k, v in eval_status(guarded).micro_batch_size.items()},
        ref_losses=[[v["loss"] for v in vs] for vs in ref_out],
        guarded_losses=[[v["loss"] for v in vs] for vs in guarded_out],
    )
    torch.save({"ref": ref.state_dict(), "guarded": guarded.state_dict(),
                "ref_pred": [[v["pred"] for v in vs] for vs in ref_out],
                "guarded_pred": [[v["pred"] for v in vs] for vs in guarded_out]}, out / "tensors.pt")
    (out / "result.json").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
