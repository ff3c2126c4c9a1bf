"""Two DeepSpeed ranks on CPU (gloo) where one really runs out of memory, for test_deepspeed.py.

Run as ``python deepspeed_worker.py '<json config>'`` with ``DS_ACCELERATOR=cpu``. Rank 0 first
trains a plain PyTorch reference on each step's global batch (both ranks' samples, no DeepSpeed, no
cap). Then both ranks train the same initial weights through a DeepSpeed engine (ZeRO stage
``stage``, DeepSpeed's own accumulation unless ``managed`` is false) with
:func:`memguard.integrations.deepspeed.step`. At the start of step ``cap_step`` the ranks in
``cap_ranks`` cap their address space with ``RLIMIT_AS`` (current VmSize plus ``budget_mib``), so a
micro-batch that does not fit fails with the CPU allocator's real error.

Config keys: ``out`` (folder), ``port``, ``steps``, ``batch`` (samples per rank per step), ``micro``
(the config's micro-batch; accumulation = batch / micro), ``seq`` (about 1 MiB of activations per
sample at 64, as in lightning_worker.py), ``cap_step``, ``cap_ranks``, optional ``model`` ("net":
worker_common.Net; "wide": an 8 MiB layer, whose ZeRO-3 all-gather is the largest allocation), and
``runs``: a list of engines trained one after the other in the same two processes, each a dict with
``name``, ``stage``, ``managed`` (DeepSpeed's own accumulation, default true), ``budget_mib`` and
optional ``bf16`` (DeepSpeed's bf16 mode), ``uncapped`` (no cap: the run to compare with),
``adapter`` (each step through :func:`adapter_step`, a framework adapter's loop, instead of
:func:`memguard.integrations.deepspeed.step`), ``no_agreements`` (from ``cap_step`` on,
DeepSpeed's collectives run without memguard's agreements: the control that shows what they
prevent) and ``time_steps`` (after training: that many interleaved steps with and without
memguard's agreements, uncapped, for the cost figures) and ``eval`` (after training: :func:`evaluate_engine`).

Each rank writes ``result<rank>_<name>.json`` (events, messages, the phase and time of each retry,
each step's start and end, micro-batch, retries, agreements, error) and
``deepspeed<rank>_<name>.pt`` (its final full weights); rank 0 also writes ``reference.pt``.
"""

from __future__ import annotations

import copy
import datetime
import json
import logging
import os
import resource
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from worker_common import LR, MOMENTUM, Net, Samples, vm_size  # noqa: E402


class Wide(nn.Module):
    """16 -> 2048 -> 1024 (an 8 MiB fp32 weight) -> 1: the 8 MiB layer's all-gather dominates a small batch."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 2048)
        self.fc2 = nn.Linear(2048, 1024)
        self.fc3 = nn.Linear(1024, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x))))).mean(dim=(1, 2))


def mse(pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((pred.float() - y) ** 2).mean()


def full_state(engine) -> dict:
    """The engine's full weights (ZeRO-3 keeps partitions: gather them first)."""
    import deepspeed

    params = list(engine.module.parameters())
    ctx = deepspeed.zero.GatheredParameters(params) if engine.zero_optimization_stage() == 3 else None
    if ctx is None:
        return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    with ctx:
        return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def adapter_step(engine, batch: dict, loss_fn, state: dict) -> None:
    """One optimizer step the way a framework adapter would run it with memguard's DeepSpeed protocol:
    its own loop over micro-batches, each forward/backward in :func:`guarded_attempt`, halving and
    redoing the step's samples on an agreed OOM, then :func:`agreed_engine_step`."""
    from memguard.batch import batch_size, split_batch
    from memguard.integrations._deepspeed_guard import agreed_engine_step, engine_rank_group, guarded_attempt

    rg = engine_rank_group(engine)
    n = batch_size(batch)
    rg.start_window()
    while True:
        mbs, seen, ok = state["micro"], 0, True
        for micro, k in split_batch(batch, mbs):
            seen += k
            rg.before_micro_batch(seen >= n)  # the boundary on the last micro-batch (managed accumulation)

            def forward_backward(micro=micro, k=k) -> None:
                engine.backward(loss_fn(engine, micro) * (k / n), scale_wrt_gas=False)

            out = guarded_attempt(rg, forward_backward, n_max=n, micro_batch_size=mbs)
            if not out.ok:  # every rank got the same outcome, and the engine is reset on every rank
                ok = False
                break
        if ok:
            break
        state["micro"] = mbs // 2
        state["retries"] += 1
        logging.getLogger("memguard").warning(
            "out of memory at micro-batch %d on rank %s%s; redoing the step's %d samples with micro-batch %d", mbs,
            ", ".join(map(str, out.oom_ranks)), f" ({out.detail})" if out.detail else "", n, mbs // 2)
    agreed_engine_step(rg, micro_batch_size=state["micro"])


def evaluate_engine(engine, data, rank: int, ev: dict, dtype: torch.dtype, messages: list[str]) -> dict:
    """``memguard.integrations.deepspeed.evaluate(engine, ...)`` on this rank's ``ev["sizes"][rank]`` samples (per-sample outputs, joined),
    with the ranks in ``ev["cap_ranks"]`` capped at VmSize + ``ev["budget_mib"]``, against the engine's own
    unsplit forward of the same samples made before the cap."""
    from memguard.guard._evaluate import eval_status
    from memguard.integrations import deepspeed as mg_ds

    x = data.x[: ev["sizes"][rank]].to(dtype)
    with torch.no_grad():
        reference = engine(x)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    seen = len(messages)
    capped = rank in ev["cap_ranks"]
    out, error = None, None
    if capped:
        resource.setrlimit(resource.RLIMIT_AS, (vm_size() + (ev["budget_mib"] << 20), hard))
    t = time.perf_counter()
    try:
        out = mg_ds.evaluate(engine, {"x": x}, lambda eng, b: eng(b["x"]))
    except Exception as exc:  # reported to the test
        error = {"type": type(exc).__name__, "message": str(exc)[:3000], "traceback": traceback.format_exc()[-4000:]}
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    status = eval_status(engine)
    return {"capped": capped, "error": error, "seconds": time.perf_counter() - t,
            "retries": [m for m in messages[seen:] if "OOM in evaluation" in m],
            "forwards": status.forwards, "padding_forwards": status.padding_forwards,
            "max_abs": None if out is None else (out.float() - reference.float()).abs().max().item(),
            "shape": None if out is None else list(out.shape), "reference_shape": list(reference.shape)}


def worker(rank: int, world: int, cfg: dict) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(cfg["port"]))
    torch.set_num_threads(1)
    import deepspeed

    from memguard.integrations import deepspeed as mg_ds

    out = Path(cfg["out"])
    events: list = []
    messages: list[str] = []
    phase = ["idle"]
    retry_phases: list[str] = []
    retry_times: list[float] = []

    class Recorder(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(f"{record.levelname}:{record.getMessage()}")
            if record.levelno == logging.WARNING and record.getMessage().startswith("out of memory"):
                events.append("RETRY")
                retry_phases.append(phase[0])
                retry_times.append(time.perf_counter())

    logging.getLogger("memguard").addHandler(Recorder())
    # a short process-group timeout: a rank left waiting in a collective fails the test instead of hanging it
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=90))
    torch.manual_seed(0)
    initial = Wide() if cfg.get("model") == "wide" else Net()
    b, steps = cfg["batch"], cfg["steps"]
    data = Samples(steps * b * world, cfg["seq"])

    def indices(step: int, r: int) -> list[int]:
        start = (step * world + r) * b
        return list(range(start, start + b))

    if rank == 0:  # the reference: one process, the global batch of each step (both ranks' samples)
        net = copy.deepcopy(initial)
        opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
        for s in range(steps):
            idx = torch.tensor([i for r in range(world) for i in indices(s, r)])
            mse(net(data.x[idx]), data.y[idx]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.save(net.state_dict(), out / "reference.pt")

    def train(run: dict) -> None:
        for log in (events, messages, retry_phases, retry_times):
            log.clear()
        model = copy.deepcopy(initial)
        zero = {"stage": run["stage"], "reduce_bucket_size": 500_000}
        if run["stage"] == 3:  # gather every parameter (DeepSpeed keeps parameters under 1e5 elements whole)
            zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=0)
        config = {"train_micro_batch_size_per_gpu": cfg["micro"], "gradient_accumulation_steps": b // cfg["micro"],
                  "train_batch_size": b * world, "zero_optimization": zero, "zero_allow_untested_optimizer": True,
                  # DeepSpeed clips at 1.0 when the key is absent (runtime/constants.py): compare with plain SGD
                  "gradient_clipping": 0.0}
        if not run.get("managed", True):
            config["managed_gradient_accumulation"] = False
        if run.get("bf16"):
            config["bf16"] = {"enabled": True}
        engine, *_ = deepspeed.initialize(model=model, config=config,
                                          optimizer=torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM))

        dtype = torch.bfloat16 if run.get("bf16") else torch.float32

        def loss_fn(eng, micro: dict) -> torch.Tensor:
            phase[0] = "forward"
            events.append(micro["idx"].tolist())  # the samples of this micro-batch
            loss = mse(eng(micro["x"].to(dtype)), micro["y"])
            phase[0] = "backward"
            return loss

        adapter_state = {"micro": cfg["micro"], "retries": 0}
        result: dict = {"rank": rank, "error": None, "order": [i for s in range(steps) for i in indices(s, rank)]}
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        t0 = time.perf_counter()
        step_times: list[list[float]] = []  # [start, end] of each step (perf_counter)
        try:
            for s in range(steps):
                idx = torch.tensor(indices(s, rank))
                batch = {"x": data.x[idx], "y": data.y[idx], "idx": idx}
                events.append(["BATCH", idx.tolist()])
                if s == cfg["cap_step"] and run.get("no_agreements"):  # the control: DeepSpeed's collectives unguarded
                    mg_ds._WINDOWS[engine].rank_group.skip_agreements = True  # made by step 0
                if s == cfg["cap_step"] and rank in cfg["cap_ranks"] and not run.get("uncapped"):
                    resource.setrlimit(resource.RLIMIT_AS, (vm_size() + (run["budget_mib"] << 20), hard))
                    result["capped"] = True
                started = time.perf_counter()
                if run.get("adapter"):
                    adapter_step(engine, batch, loss_fn, adapter_state)
                else:
                    mg_ds.step(engine, batch, loss_fn)
                step_times.append([started, time.perf_counter()])
                phase[0] = "idle"
                events.append("STEP")
        except Exception as exc:  # reported to the test, which decides whether it was expected
            result["error"] = {"type": type(exc).__name__, "message": str(exc)[:3000],
                               "traceback": traceback.format_exc()[-4000:]}
        result["train_s"] = time.perf_counter() - t0
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        from memguard.integrations._deepspeed_guard import _GROUPS

        rg = _GROUPS.get(engine)
        adapter = run.get("adapter")
        result.update(events=events, messages=messages, retry_phases=retry_phases, retry_times=retry_times,
                      step_times=step_times,
                      micro_batch_size=adapter_state["micro"] if adapter else mg_ds.micro_batch_size(engine),
                      oom_retries=adapter_state["retries"] if adapter else mg_ds.oom_retries(engine),
                      global_steps=engine.global_steps, agreements=rg.agreements if rg is not None else 0)
        if result["error"] is None and run.get("eval"):
            result["eval"] = evaluate_engine(engine, data, rank, run["eval"], dtype, messages)
        if result["error"] is None:
            torch.save(full_state(engine), out / f"deepspeed{rank}_{run['name']}.pt")
            n_time = run.get("time_steps", 0)
            if n_time:  # interleaved steps with and without the agreements (same engine, uncapped)
                idx = torch.tensor(indices(0, rank))
                batch = {"x": data.x[idx], "y": data.y[idx], "idx": idx}
                times: dict[str, list[float]] = {"with": [], "without": []}
                per_step = []
                for i in range(2 * n_time + 2):
                    skip = i % 2 == 1
                    rg.skip_agreements = skip
                    before = rg.agreements
                    t = time.perf_counter()
                    mg_ds.step(engine, batch, loss_fn)
                    dt = time.perf_counter() - t
                    if i >= 2:  # the first pair warms up
                        times["without" if skip else "with"].append(dt)
                        if not skip:
                            per_step.append(rg.agreements - before)
                rg.skip_agreements = False
                result["timing"] = {k: statistics.median(v) for k, v in times.items()}
                result["timing"]["agreements_per_step"] = statistics.median(per_step)
                result["timing"]["micro_batch_size"] = mg_ds.micro_batch_size(engine)
                # the agreement alone: the same all-reduce, 200 times
                t = time.perf_counter()
                for _ in range(200):
                    rg.agree(0, [0])
                result["timing"]["agreement_ms"] = (time.perf_counter() - t) / 200 * 1e3
        (out / f"result{rank}_{run['name']}.json").write_text(json.dumps(result))

    for run in cfg["runs"]:
        train(run)
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without interpreter teardown: destroying a gloo group while its threads release work can
    # deadlock at exit (tests/guard/oom_worker.py).
    os._exit(0)


if __name__ == "__main__":
    import torch.multiprocessing as mp

    cfg = json.loads(sys.argv[1])
    mp.spawn(worker, args=(2, cfg), nprocs=2)
