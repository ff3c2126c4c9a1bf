"""How good is ``memguard.plan``'s micro-batch on the CPU target, against real runs?

For several models of the zoo (:mod:`benchmarks.zoo`) and several memory budgets, this script
compares the micro-batch ``memguard.plan`` chooses with the largest micro-batch that really fits,
found by real CPU training steps whose peak of live tensor bytes is measured with
``torch.profiler`` memory events. Beside it, on the same budgets and with the same real peaks as
the oracle for "would this OOM", it replays two real-run searches:

* **Lightning-style power scaling** (``BatchSizeFinder(mode="power")``, defaults ``init_val=2``,
  ``max_trials=25``): double the batch after each successful trial, halve and stop after the
  first failure (pytorch_lightning/tuner/batch_size_scaling.py ``_run_power_scaling``). Lightning
  never tries past the dataset length; here the "dataset" of one optimizer step holds the global
  batch, so a trial of ``n`` samples uses ``min(n, global)``.
* **Accelerate-style x0.9 backoff** (``accelerate.utils.find_executable_batch_size``): start at
  ``starting_batch_size`` (here the per-step batch, the largest useful micro-batch; Accelerate's
  own default is 128) and multiply by 0.9 (``int(b * 0.9)``) after each OOM.

Each counts the trial runs it needs (Lightning runs ``steps_per_trial=3`` steps per trial;
Accelerate restarts the whole training function per attempt). Neither keeps the global batch
fixed, so their result is also shown rounded down to a divisor of the global batch (what a user
must do to keep ``micro x accumulation == global``). memguard needs no real run.

Fairness: ``precision="32-true"``, ``activation_checkpointing=False`` and ``headroom=0`` are
fixed, so memguard answers exactly "the largest micro-batch whose step peak is under the budget"
and is compared against the real peak with no safety margin. The global batch is 240 (20
divisors). A micro-batch ``m < 240`` is measured inside gradient accumulation: one micro-batch that starts
with gradients allocated (as every micro-batch after the first does; the first allocates the same
gradients during its backward, so it never peaks higher), then ``optimizer.step()`` and
``zero_grad(set_to_none=True)``; ``m == 240`` is one plain step. The
optimizer state exists before measuring (one warm-up step at micro-batch 1).

Budgets: for each model, from the real peaks at micro-batch 1 and ``m_ref``, a budget that a
micro-batch of about ``t`` samples would need (linear between the two), for a few non-integer
``t``, so that the answers fall between divisors.

Cost control: real peaks are non-decreasing in the micro-batch (every activation grows with it),
so an answer known for one size decides others: a size below one that fits fits, a size above
one that OOMs OOMs. Only undecided sizes are measured; the table says how many were. A size whose peak, on the
line through the real peaks at 1 and ``m_ref``, exceeds twice the budget is taken to OOM without
running it (counted as "inferred by line").

Usage::

    python -m benchmarks.plan_quality_cpu                    # all models
    python -m benchmarks.plan_quality_cpu --models gpt2,vit  # some

Writes ``plan_quality_cpu.json`` and ``plan_quality_cpu.md`` to ``--out`` (default
``benchmarks/results``) and prints the Markdown table.
"""

from __future__ import annotations

import argparse
import bisect
import datetime as _dt
import gc
import json
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))  # `benchmarks` from this checkout when run by path
from benchmarks.common import machine_description, run_worker  # noqa: E402

_MARKER = "@@PLAN_QUALITY_RESULT@@ "
GLOBAL_BATCH = 240  # 2^4 x 3 x 5: 20 divisors, many of them not powers of two
GOAL_RATIO = 0.95


@dataclass(frozen=True)
class QualityCase:
    """One model of the benchmark.

    Attributes:
        zoo: the :data:`benchmarks.zoo.CASES` key.
        m_ref: the second micro-batch measured to place the budgets.
        targets: budgets are set where about this many samples would fit.
    """

    zoo: str
    m_ref: int
    targets: tuple[float, ...]


CASES: dict[str, QualityCase] = {
    c.zoo: c
    for c in [
        QualityCase("gpt2", 8, (1.5, 4.5, 10.5, 21.5)),  # ~0.3 s of real compute per sample
        QualityCase("llama-sdpa", 8, (2.5, 7.5, 13.5)),
        QualityCase("vit", 16, (3.5, 13.5, 35.5, 70.5)),
        QualityCase("resnet-bn", 16, (5.5, 18.5, 45.5, 100.5)),
        QualityCase("lstm-lm", 8, (2.5, 9.5, 27.5)),  # no repeated blocks: the planner's single-probe path
    ]
}


# --------------------------------------------------------------------------------------------
# real peaks
# --------------------------------------------------------------------------------------------


def _resize(batch: Any, n0: int, m: int) -> Any:
    """A real batch of ``m`` samples made of the example's rows (repeated as needed)."""
    import torch
    from torch.utils._pytree import tree_map

    index = torch.arange(m) % n0

    def one(x):
        if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == n0:
            return x[index].clone()
        return x

    return tree_map(one, batch)


class RealPeaks:
    """Real peaks of a training step by micro-batch, measured on demand and cached.

    ``fits(m, budget)`` answers from measurements where monotonicity decides, else measures.
    """

    def __init__(self, model, batch, loss_fn, optimizer, global_batch: int) -> None:
        from benchmarks.ground_truth import default_loss

        from memguard.batch import batch_size

        self.model, self.batch, self.optimizer = model, batch, optimizer
        self.compute = loss_fn if loss_fn is not None else default_loss
        self.n0 = batch_size(batch)
        self.global_batch = global_batch
        self.peaks: dict[int, int] = {}
        self.measure_seconds = 0.0
        self.line: tuple[float, float] | None = None  # (peak at 1, bytes per sample), once measured
        self.inferred_by_line = 0
        self._warm_up()

    def _warm_up(self) -> None:
        b = _resize(self.batch, self.n0, 1)
        self.compute(self.model, b).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def measure(self, m: int) -> int:
        """Real peak of live tensor bytes for micro-batch ``m`` (see the module docstring)."""
        if m in self.peaks:
            return self.peaks[m]
        from benchmarks.ground_truth import live_state_bytes
        from torch.profiler import ProfilerActivity, profile

        import torch

        batch = _resize(self.batch, self.n0, m)
        accumulating = m < self.global_batch
        for p in self.model.parameters():
            # inside accumulation every micro-batch after the first starts with gradients allocated
            # (and is the highest: the first allocates the same gradients during its backward)
            p.grad = torch.zeros_like(p) if (accumulating and p.requires_grad) else None
        gc.collect()
        gc.disable()
        t0 = time.perf_counter()
        try:
            baseline = live_state_bytes(self.model, batch, self.optimizer)
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                loss = self.compute(self.model, batch)
                loss.backward()  # accumulates into the existing gradients in place
                del loss
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
        finally:
            gc.enable()
        # "[memory]" events carry signed nbytes (allocation > 0, free < 0); the running sum over
        # time plus the bytes live at the start is the live-bytes curve (torch profiler docs). The
        # frees of gradients made before profiling carry no size, but they happen in zero_grad,
        # after the last allocation, so the peak is unaffected.
        events = prof.profiler.kineto_results.events()
        mem = sorted(((e.start_ns(), i, e.nbytes()) for i, e in enumerate(events) if e.name() == "[memory]"))
        level = peak = baseline
        for _, _, n in mem:
            level += n
            peak = max(peak, level)
        self.measure_seconds += time.perf_counter() - t0
        del batch
        self.peaks[m] = int(peak)
        return self.peaks[m]

    def set_line(self, m_ref: int) -> None:
        """Fit peak(m) = a + b (m - 1) through the real peaks at 1 and ``m_ref``."""
        p1, pref = self.measure(1), self.measure(m_ref)
        self.line = (p1, (pref - p1) / (m_ref - 1))

    def fits(self, m: int, budget: int) -> bool:
        m = min(m, self.global_batch)
        if m in self.peaks:
            return self.peaks[m] <= budget
        # sizes below the global batch share one regime (inside accumulation): monotone in m
        if m < self.global_batch:
            known = sorted(k for k in self.peaks if k < self.global_batch)
            if any(k >= m and self.peaks[k] <= budget for k in known):
                return True
            if any(k <= m and self.peaks[k] > budget for k in known):
                return False
        # a size whose peak, on the line through two real peaks, is over twice the budget is not
        # run: it would OOM by a wide margin (the real peaks are affine in m to <1% on these
        # models), and running it would cost minutes and gigabytes for nothing
        if self.line is not None and self.line[0] + self.line[1] * (m - 1) > 2 * budget:
            self.inferred_by_line += 1
            return False
        return self.measure(m) <= budget

    def largest_divisor(self, budget: int) -> int | None:
        """The largest divisor of the global batch whose real step fits (binary search)."""
        from memguard.planner.api import divisors

        divs = divisors(self.global_batch)
        below = [d for d in divs if d < self.global_batch]
        if self.fits(self.global_batch, budget):
            return self.global_batch
        lo, hi = 0, len(below) - 1  # invariant: answer index in [lo-1, hi]
        best = None
        while lo <= hi:
            mid = (lo + hi) // 2
            if self.fits(below[mid], budget):
                best = below[mid]
                lo = mid + 1
            else:
                hi = mid - 1
        return best


def lightning_power(fits: Callable[[int], bool], global_batch: int, init_val: int = 2, max_trials: int = 25,
                    max_val: int = 8192) -> tuple[int, int]:
    """Replay Lightning's ``_run_power_scaling``; returns (batch size found, trials run)."""
    new, any_success, trials = init_val, False, 0
    for i in range(max_trials):
        if new >= max_val:
            break
        trials += 1
        if fits(min(new, global_batch)):
            if i + 1 >= max_trials:
                break
            if new >= global_batch:  # _adjust_batch_size: batch >= dataset length -> unchanged, stop
                break
            new = min(int(new * 2.0), max_val)
            any_success = True
        else:
            new = max(1, int(new * 0.5))
            if any_success:
                break
    return min(new, global_batch), trials


def accelerate_backoff(fits: Callable[[int], bool], start: int) -> tuple[int | None, int]:
    """Replay ``find_executable_batch_size``; returns (batch size that ran, attempts)."""
    b, attempts = start, 0
    while b > 0:
        attempts += 1
        if fits(b):
            return b, attempts
        b = int(b * 0.9)
    return None, attempts


def _round_to_divisor(m: int | None, g: int) -> int | None:
    from memguard.planner.api import divisors

    if m is None:
        return None
    divs = divisors(g)
    i = bisect.bisect_right(divs, m)
    return divs[i - 1] if i else None


# --------------------------------------------------------------------------------------------
# worker
# --------------------------------------------------------------------------------------------


def _worker(name: str) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)  # one intra-op thread: deterministic, comparable, kind to shared cores
    import memguard
    from benchmarks.zoo import CASES as ZOO
    from memguard.planner.api import PlanRequest, TraceSession, plan_request

    case, zoo = CASES[name], ZOO[name]
    model, batch, loss_fn = zoo.build("cpu")
    optimizer = zoo.optimizer(model.parameters())
    real = RealPeaks(model, batch, loss_fn, optimizer, GLOBAL_BATCH)
    real.set_line(case.m_ref)
    p1, pref = real.peaks[1], real.peaks[case.m_ref]
    slope = real.line[1]
    budgets = [int(p1 + slope * (t - 1)) for t in case.targets]

    planner = TraceSession(model, batch, optimizer=zoo.optimizer, loss_fn=loss_fn, device="cpu")
    rows = []
    for t, budget in zip(case.targets, budgets):
        traces_before = planner.trace_count
        t0 = time.perf_counter()
        try:
            request = PlanRequest(global_batch_size=GLOBAL_BATCH, device="cpu", budget_bytes=budget, headroom=0.0,
                                  precision="32-true", activation_checkpointing=False, optimizer=zoo.optimizer,
                                  loss_fn=loss_fn)
            p = plan_request(model, batch, request, session=planner)
            mg = {"micro_batch_size": p.micro_batch_size, "grad_accum_steps": p.grad_accum_steps,
                  "predicted_peak_bytes": int(p.estimate.peak_bytes)}
        except memguard.InfeasiblePlanError as exc:
            mg = {"micro_batch_size": None, "error": str(exc).splitlines()[0]}
        plan_s = time.perf_counter() - t0
        mg["plan_seconds"] = round(plan_s, 3)
        mg["new_traces"] = planner.trace_count - traces_before
        truth = real.largest_divisor(budget)
        if mg["micro_batch_size"] is not None:
            mg["real_peak_bytes"] = real.measure(mg["micro_batch_size"])
            mg["over_budget"] = mg["real_peak_bytes"] > budget
            mg["ratio"] = round(mg["micro_batch_size"] / truth, 4) if truth else None
        fits = lambda m, b=budget: real.fits(m, b)  # noqa: E731
        lt_size, lt_trials = lightning_power(fits, GLOBAL_BATCH)
        ac_size, ac_trials = accelerate_backoff(fits, GLOBAL_BATCH)
        rows.append({
            "target_samples": t,
            "budget_bytes": budget,
            "truth_largest_divisor": truth,
            "truth_peak_bytes": real.peaks.get(truth) if truth else None,
            "memguard": mg,
            "lightning_power": {"batch_size": lt_size, "trials": lt_trials, "steps": 3 * lt_trials,
                                "divisor": _round_to_divisor(lt_size, GLOBAL_BATCH)},
            "accelerate_x0.9": {"batch_size": ac_size, "trials": ac_trials,
                                "divisor": _round_to_divisor(ac_size, GLOBAL_BATCH)},
        })
    return {
        "model": name,
        "notes": zoo.notes,
        "example_batch": real.n0,
        "peak_m1_bytes": p1,
        "peak_mref_bytes": pref,
        "m_ref": case.m_ref,
        "rows": rows,
        "real_peaks": {str(k): v for k, v in sorted(real.peaks.items())},
        "measurements": len(real.peaks),
        "inferred_by_line": real.inferred_by_line,
        "measure_seconds": round(real.measure_seconds, 2),
    }


# --------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------


def _run(name: str, timeout: float) -> dict[str, Any]:
    run = run_worker("benchmarks.plan_quality_cpu", ["--worker", name], _MARKER, timeout=timeout)
    if run.result is None:
        return {"model": name, "error": run.error_tail(1500)}
    return {**run.result, "wall_seconds": round(run.wall_seconds, 1)}


def _summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    rows = [r for res in results if "rows" in res for r in res["rows"]]
    mg = [r["memguard"] for r in rows]
    ratios = [m["ratio"] for m in mg if m.get("ratio") is not None]
    lt = [r["lightning_power"]["divisor"] / r["truth_largest_divisor"] for r in rows
          if r["truth_largest_divisor"] and r["lightning_power"]["divisor"]]
    ac = [r["accelerate_x0.9"]["divisor"] / r["truth_largest_divisor"] for r in rows
          if r["truth_largest_divisor"] and r["accelerate_x0.9"]["divisor"]]
    return {
        "cases": len(rows),
        "memguard_min_ratio": min(ratios) if ratios else None,
        "memguard_mean_ratio": round(sum(ratios) / len(ratios), 4) if ratios else None,
        "memguard_cases_at_goal": sum(r >= GOAL_RATIO for r in ratios),
        "memguard_over_budget": sum(bool(m.get("over_budget")) for m in mg),
        "memguard_infeasible": sum(m.get("micro_batch_size") is None for m in mg),
        "lightning_mean_ratio_divisor": round(sum(lt) / len(lt), 4) if lt else None,
        "accelerate_mean_ratio_divisor": round(sum(ac) / len(ac), 4) if ac else None,
        "lightning_total_trials": sum(r["lightning_power"]["trials"] for r in rows),
        "accelerate_total_trials": sum(r["accelerate_x0.9"]["trials"] for r in rows),
        "meets_goal": bool(ratios) and len(ratios) == len(rows) and min(ratios) >= GOAL_RATIO
        and not any(m.get("over_budget") for m in mg),
    }


def _markdown(report: dict[str, Any]) -> str:
    from memguard.vocab import MiB
    m = report["machine"]
    s = report["summary"]
    lines = [
        "# memguard plan quality on the CPU target",
        "",
        f"- command: `{report['command']}`",
        f"- date: {report['date']}",
        f"- machine: {m['cpu_model']}, {m['usable_cores']} usable of {m['cores']} cores, {m['platform']}; "
        f"Python {m['python']}, torch {m['torch']}, 1 intra-op thread; load average before {report['load_before']}, "
        f"after {report['load_after']}",
        f"- global batch {GLOBAL_BATCH}; memguard with `precision=\"32-true\"`, `activation_checkpointing=False`, "
        "`headroom=0` (a fair comparison against the real peak, with no safety margin)",
        "- truth: the largest divisor of the global batch whose real step (torch.profiler memory events) fits; "
        "micro-batches below the global batch measured inside gradient accumulation",
        "- Lightning: power scaling from 2 (3 steps per trial); Accelerate: x0.9 backoff from the global batch; "
        "both judged by the same real peaks; 'div' = rounded down to a divisor of the global batch",
        "",
        f"**Summary:** memguard / truth: min {s['memguard_min_ratio']}, mean {s['memguard_mean_ratio']}; "
        f"{s['memguard_cases_at_goal']} of {s['cases']} cases >= {GOAL_RATIO:.0%}; over budget: "
        f"{s['memguard_over_budget']}; infeasible: {s['memguard_infeasible']}. Mean ratio after rounding to a divisor: "
        f"Lightning {s['lightning_mean_ratio_divisor']} ({s['lightning_total_trials']} trials in all), "
        f"Accelerate {s['accelerate_mean_ratio_divisor']} ({s['accelerate_total_trials']} trials in all); "
        f"memguard: 0 real runs. Goal met: {'yes' if s['meets_goal'] else 'no'}.",
        "",
        "| model | budget MiB | truth | memguard (x accum) | ratio | memguard real peak MiB | over? | plan s | "
        "Lightning (div) | trials | Accelerate (div) | trials |",
        "|---|---:|---:|---|---:|---:|---|---:|---|---:|---|---:|",
    ]
    for res in report["results"]:
        if "error" in res:
            lines.append(f"| {res['model']} | error: {res['error'].splitlines()[-1][:150]} |" + " |" * 10)
            continue
        for r in res["rows"]:
            mg, lt, ac = r["memguard"], r["lightning_power"], r["accelerate_x0.9"]
            chosen = f"{mg['micro_batch_size']} x {mg['grad_accum_steps']}" if mg.get("micro_batch_size") else \
                f"infeasible ({mg.get('error', '')[:60]})"
            lines.append(
                f"| {res['model']} | {r['budget_bytes'] / MiB:.1f} | {r['truth_largest_divisor']} | {chosen} | "
                f"{mg.get('ratio', '—')} | "
                f"{(mg['real_peak_bytes'] / MiB) if mg.get('real_peak_bytes') else float('nan'):.1f} | "
                f"{'OVER' if mg.get('over_budget') else 'no'} | {mg['plan_seconds']:.1f} | "
                f"{lt['batch_size']} ({lt['divisor']}) | {lt['trials']} | {ac['batch_size']} ({ac['divisor']}) | "
                f"{ac['trials']} |"
            )
    lines += ["", "| model | real peak m=1 MiB | real peaks measured | OOMs inferred by line | measuring s | worker s |",
              "|---|---:|---:|---:|---:|---:|"]
    for res in report["results"]:
        if "error" not in res:
            lines.append(f"| {res['model']} | {res['peak_m1_bytes'] / MiB:.1f} | {res['measurements']} | "
                         f"{res['inferred_by_line']} | "
                         f"{res['measure_seconds']:.1f} | {res.get('wall_seconds', 0):.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(CASES), help="comma-separated zoo case names")
    parser.add_argument("--out", default=str(_REPO / "benchmarks" / "results"), help="folder for the results")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per model before giving up")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(_MARKER + json.dumps(_worker(args.worker)), flush=True)
        return 0
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {', '.join(CASES)}")
    load_before = [round(x, 2) for x in os.getloadavg()]
    t0 = time.perf_counter()
    results = []
    for name in names:
        r = _run(name, args.timeout)
        results.append(r)
        print(f"{name}: {'error' if 'error' in r else 'done'} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    report = {
        "command": "python -m benchmarks.plan_quality_cpu" + ("" if not argv else " " + shlex.join(argv)),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_description(),
        "load_before": load_before,
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "total_seconds": round(time.perf_counter() - t0, 1),
        "global_batch": GLOBAL_BATCH,
        "results": results,
    }
    report["summary"] = _summary(results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan_quality_cpu.json").write_text(json.dumps(report, indent=1) + "\n")
    md = _markdown(report)
    (out / "plan_quality_cpu.md").write_text(md + "\n")
    print(md)
    return 0 if report["summary"]["meets_goal"] else 1


if __name__ == "__main__":
    sys.exit(main())
