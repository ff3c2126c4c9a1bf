"""FSDP1 on CPU: ``memguard.estimate(strategy="fsdp1")`` against real multi-rank gloo runs.

FSDP1 (``torch.distributed.fsdp.FullyShardedDataParallel``: Lightning's ``FSDPStrategy``, Accelerate's
and the Trainer's ``fsdp_version=1``) is estimated by tracing rank 0 of a real FSDP1 step over a fake
process group (:mod:`memguard.estimator._fsdp1`): ``FULL_SHARD`` is ``zero_stage=3``, ``SHARD_GRAD_OP``
``zero_stage=2``, ``use_orig_params`` and the ``MixedPrecision`` dtypes come from
``fsdp1_options``. Each row also gives what the FSDP2 model (``strategy="fsdp2"`` at the same level),
memguard's stand-in for FSDP1 before it, predicts.

Each case wraps a small HF model (GPT-2 or Llama, built from a config, as
:mod:`benchmarks.fsdp2_cpu` builds it) in ``FullyShardedDataParallel`` over ``world_size`` gloo ranks
on this machine (one process per rank), auto-wrapped per transformer block
(``ModuleWrapPolicy({<the block class>})``: what Lightning's ``auto_wrap_policy={Block}`` and
Accelerate's ``TRANSFORMER_BASED_WRAP`` from ``_no_split_modules`` do) with the root unit holding the
rest, with ``use_orig_params`` True or False, ``FULL_SHARD`` or ``SHARD_GRAD_OP``, in fp32 or with
the ``MixedPrecision`` Lightning's ``FSDPPrecision("bf16-mixed")`` configures (``param_dtype``,
``reduce_dtype`` and ``buffer_dtype`` bf16: ``lightning/fabric/plugins/precision/fsdp.py``,
``mixed_precision_config``; its ``autocast("cuda")`` does nothing on CPU). The optimizer is
``torch.optim.AdamW`` over the wrapped model's trainable parameters (the flat parameters without
``use_orig_params``). The ``-lora`` cases add peft's LoRA adapters (:data:`LORA`) to a frozen Llama and
wrap it with peft's own ``fsdp_auto_wrap_policy`` (every adapter leaf a unit as well as every block), as
the HF Trainer and Accelerate shard a PEFT model; the estimate wraps it so by itself
(``memguard.estimator._fsdp1.wraps_trainable_leaves``). Measurement as in :mod:`benchmarks.fsdp2_cpu`: one warm-up step, then
``--steps`` steps under ``torch.profiler`` (``profile_memory=True``), live bytes replayed by address
(``_replay``), every collective settled; a case's real peak is the worst rank's over ``--runs``
runs (fresh processes each).

Usage::

    python benchmarks/fsdp1_cpu.py                            # every case, 3 runs each
    python benchmarks/fsdp1_cpu.py --cases gpt2-w2-fp32-full-orig --runs 3

Writes ``fsdp1_cpu.json`` and ``fsdp1_cpu.md`` to ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))  # `benchmarks` from this checkout when run by path
from benchmarks.common import (  # noqa: E402
    MultiRankBenchmark,
    launch_ranks,
    merge_argument,
    merge_mode,
    settle_collectives,
)
from benchmarks.fsdp2_cpu import build_model, make_batch, profiled_steps  # noqa: E402

_MIB = 1 << 20
_STRATEGIES = {3: "FULL_SHARD", 2: "SHARD_GRAD_OP"}  # as integrations/lightning.py maps them to levels


@dataclass(frozen=True)
class Case:
    """One configuration: model, ranks, precision, sharding strategy, ``use_orig_params``, batch."""

    model: str  # "gpt2" or "llama"
    world_size: int
    precision: str  # "32-true" or "bf16-mixed"
    zero_stage: int  # 3: FULL_SHARD; 2: SHARD_GRAD_OP
    use_orig_params: bool
    batch: int = 2
    seq: int = 64
    lora: bool = False  # peft LoRA adapters on a frozen base, wrapped by peft's fsdp_auto_wrap_policy

    @property
    def name(self) -> str:
        p = "fp32" if self.precision == "32-true" else "bf16"
        return (f"{self.model}-w{self.world_size}-{p}-{'full' if self.zero_stage == 3 else 'gradop'}-"
                + ("orig" if self.use_orig_params else "flat") + ("-lora" if self.lora else ""))

    @property
    def sharding_strategy(self) -> str:
        return _STRATEGIES[self.zero_stage]


def all_cases() -> dict[str, Case]:
    """Every combination at 2 ranks; at 4 ranks fp32 and bf16 ``FULL_SHARD`` with original parameters."""
    out = {}
    for model in ("gpt2", "llama"):
        for precision in ("32-true", "bf16-mixed"):
            for stage in (3, 2):
                for orig in (True, False):
                    c = Case(model, 2, precision, stage, orig)
                    out[c.name] = c
    for model in ("gpt2", "llama"):
        for precision in ("32-true", "bf16-mixed"):
            c = Case(model, 4, precision, 3, True)
            out[c.name] = c
    # LoRA on Llama (q/k/v/o), as the HF Trainer shards a PEFT model: flat and original parameters, fp32 only:
    # without autocast peft casts an adapter's input to lora_A.weight's dtype (peft/tuners/lora/layer.py,
    # Linear.forward: _cast_input_dtype), which outside the adapter's own unit is the fp32 original, and FSDP1's
    # MixedPrecision then runs lora_A in bf16 on an fp32 input (a dtype error); on a GPU Accelerate's autocast
    # hides this, and memguard's FSDP1 trace has no autocast (memguard.estimator._fsdp1)
    for stage, orig in ((3, False), (3, True), (2, False)):
        c = Case("llama", 2, "32-true", stage, orig, lora=True)
        out[c.name] = c
    return out


#: The LoRA cases' adapters (peft.LoraConfig): rank 8 on the attention projections of every block.
LORA = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


def case_model(case: Case, device: str = "cpu") -> Any:
    """The case's model: :func:`benchmarks.fsdp2_cpu.build_model`'s, with peft's LoRA adapters (the base frozen)
    for a LoRA case."""
    model = build_model(case.model, device)
    if case.lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(**LORA, task_type="CAUSAL_LM"))
    return model


def estimate_case(case: Case, *, strategy: str = "fsdp1") -> dict[str, Any]:
    """memguard's estimate of ``case``: ``strategy="fsdp1"`` with the case's ``use_orig_params`` and the
    ``MixedPrecision`` :func:`wrap` configures (the default of ``*-mixed`` under FSDP1: param, reduce and
    buffer dtype bf16), or ``"fsdp2"`` (the FSDP2 model at the same level, the stand-in before)."""
    import memguard

    t0 = time.perf_counter()
    kw = {"fsdp1_options": {"use_orig_params": case.use_orig_params}} if strategy == "fsdp1" else {}
    est = memguard.estimate(case_model(case, "meta"), make_batch(case), device="cpu", precision=case.precision,
                            zero_stage=case.zero_stage, world_size=case.world_size, strategy=strategy, **kw)
    return {"peak_bytes": int(est.peak_bytes), "peak_phase": est.peak_phase, "breakdown": dict(est.breakdown),
            "phase_peaks": dict(est.phase_peaks), "seconds": round(time.perf_counter() - t0, 2)}


# --------------------------------------------------------------------------------------------
# one rank (run in its own process)
# --------------------------------------------------------------------------------------------


def wrap(model: Any, case: Case) -> Any:
    """``model`` wrapped in FSDP1 as the case says, each repeated block its own unit, the root the rest; a LoRA
    case with peft's own ``fsdp_auto_wrap_policy`` (each adapter leaf a unit too), as the HF Trainer wraps it
    (transformers/distributed/fsdp.py, ``update_fsdp_plugin_peft``)."""
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from memguard.estimator._blocks import find_container

    if case.lora:
        from peft.utils.other import fsdp_auto_wrap_policy

        policy = fsdp_auto_wrap_policy(model)
    else:
        policy = ModuleWrapPolicy({type(b) for b in find_container(model).children()})
    bf16 = torch.bfloat16
    mp = MixedPrecision(param_dtype=bf16, reduce_dtype=bf16, buffer_dtype=bf16) if case.precision == "bf16-mixed" else None
    return FullyShardedDataParallel(model, auto_wrap_policy=policy, mixed_precision=mp,
                                    sharding_strategy=getattr(ShardingStrategy, case.sharding_strategy),
                                    use_orig_params=case.use_orig_params, device_id=torch.device("cpu"))


def _rank_worker(case: Case, steps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    settle_collectives(pause_s=0.02)  # as benchmarks/fsdp2_cpu.py: gloo's thread lets go first
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = wrap(case_model(case), case)
    model.train()
    # the trainable parameters, as the HF Trainer's create_optimizer takes them (a frozen flat parameter has none)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    batch = make_batch(case)
    losses: list[float] = []

    def forward():
        loss = model(**batch).loss
        losses.append(float(loss.detach()))
        return loss

    result = profiled_steps(model, batch, optimizer, forward, steps)
    dist.destroy_process_group()
    return {"rank": rank, **result, "first_loss": losses[0]}


def run_case(case: Case, *, steps: int = 2, timeout: float = 300.0) -> list[dict[str, Any]]:
    """One real run of ``case``: ``world_size`` rank processes; each rank's measurement (or an error)."""
    return launch_ranks("fsdp1_cpu", case, case.world_size, ["--steps", str(steps)], timeout=timeout)


# --------------------------------------------------------------------------------------------
# the report
# --------------------------------------------------------------------------------------------


def measure(case: Case, *, runs: int, steps: int, timeout: float) -> dict[str, Any]:
    per_run = [run_case(case, steps=steps, timeout=timeout) for _ in range(runs)]
    errors = [r["error"] for rs in per_run for r in rs if "error" in r]
    row: dict[str, Any] = {"case": case.name, **asdict(case), "sharding_strategy": case.sharding_strategy,
                           "runs": per_run}
    if errors:
        row["error"] = errors[0]
        return row
    row["estimate"] = estimate_case(case)
    row["fsdp2_estimate"] = estimate_case(case, strategy="fsdp2")
    return summarise(row)


def summarise(row: dict[str, Any]) -> dict[str, Any]:
    """The worst and the most common rank peak (ranks whose replay closed, as in fsdp2_cpu) and the error."""
    ranks = [r for rs in row["runs"] for r in rs if "peak_bytes" in r]
    clean = [r for r in ranks if r["residual_bytes"] == 0] or ranks
    peaks = [r["peak_bytes"] for r in clean]
    worst, est = max(peaks), row["estimate"]["peak_bytes"]
    typical = max(set(peaks), key=lambda v: (peaks.count(v), -v))
    row.update(real_peak_bytes=worst, real_min_peak_bytes=min(peaks), real_typical_peak_bytes=typical,
               ranks_measured=len(ranks), ranks_unclosed=len(ranks) - len(clean) if clean is not ranks else 0,
               error_pct=round(100 * (est - worst) / worst, 2),
               typical_error_pct=round(100 * (est - typical) / typical, 2),
               fsdp2_error_pct=(round(100 * (row["fsdp2_estimate"]["peak_bytes"] - worst) / worst, 2)
                                if "fsdp2_estimate" in row else None),
               real_phase_peaks={k: max(r["phase_peaks"].get(k, 0) for r in clean) for k in clean[0]["phase_peaks"]})
    return row


def render_markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    m = meta["machine"]
    lines = [
        "# FSDP1 on CPU: memguard.estimate(strategy=\"fsdp1\") vs. real gloo runs", "",
        f"Command: `{meta['command']}`  ", f"Date: {meta['date']}  ",
        f"Machine: {m.get('cpu_model', '?')}, {m.get('cpu_count')} cores, torch {m.get('torch')}, "
        f"transformers {m.get('transformers')}; {meta['runs']} runs x {meta['steps']} profiled steps per case; "
        f"cases done: {meta.get('cases_done', '?')}; the host was shared with other work while the runs ran", "",
        "Real: the worst rank's peak of live tensor bytes over all runs (fresh processes each) and profiled "
        "steps, replayed by address from the profiler's allocator events (`benchmarks/fsdp2_cpu.py`, `_replay`), "
        "collectives settled; typical: the most common rank peak. Estimate: `memguard.estimate(..., "
        "device=\"cpu\", strategy=\"fsdp1\", zero_stage=3 (FULL_SHARD) or 2 (SHARD_GRAD_OP), "
        "fsdp1_options={\"use_orig_params\": ...})` (rank 0 of a real FSDP1 step traced over a fake process "
        "group). FSDP2 model: `strategy=\"fsdp2\"` at the same level, memguard's stand-in for FSDP1 before. "
        "`orig`/`flat`: `use_orig_params=True`/`False`. bf16: FSDP1 "
        "`MixedPrecision(param_dtype, reduce_dtype, buffer_dtype = bf16)` (Lightning's `FSDPPrecision`), what "
        "`strategy=\"fsdp1\"` assumes for `bf16-mixed`.", "",
        "| case | strategy | rank-runs | real worst (MiB) | real typical (MiB) | estimate (MiB) | error vs worst "
        "| error vs typical | real peak phase | estimate's peak phase | forward: estimate - real (MiB) "
        "| backward: estimate - real (MiB) | FSDP2 model (MiB) | FSDP2 model vs worst |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error_pct" not in r:
            lines.append(f"| {r['case']} | {r.get('sharding_strategy', '')} | | error: {str(r.get('error', '?'))[:80]} "
                         "| | | | | | | | | | |")
            continue
        real, est = r["real_phase_peaks"], r["estimate"]["phase_peaks"]
        gap = {k: f"{(est[k] - real[k]) / _MIB:+.2f}" if k in est and k in real else "" for k in ("forward", "backward")}
        lines.append(
            f"| {r['case']} | {r['sharding_strategy']} | {r['ranks_measured']} | {r['real_peak_bytes'] / _MIB:.2f} | "
            f"{r['real_typical_peak_bytes'] / _MIB:.2f} | {r['estimate']['peak_bytes'] / _MIB:.2f} | "
            f"{r['error_pct']:+.2f}% | {r['typical_error_pct']:+.2f}% | {max(real, key=real.get)} | "
            f"{r['estimate']['peak_phase']} | {gap['forward']} | {gap['backward']} | {_fsdp2_cells(r)} |")
    ok = [r for r in rows if "error_pct" in r]
    if ok:
        worst = max(ok, key=lambda r: abs(r["error_pct"]))
        lines += ["", f"Against the worst rank: mean |error| {sum(abs(r['error_pct']) for r in ok) / len(ok):.2f}%, "
                  f"worst {worst['error_pct']:+.2f}% ({worst['case']}); "
                  f"{sum(abs(r['error_pct']) <= 3 for r in ok)} of {len(ok)} cases within 3%."]
        old = [r for r in ok if r.get("fsdp2_error_pct") is not None]
        if old:
            worst_old = max(old, key=lambda r: abs(r["fsdp2_error_pct"]))
            lines += ["", f"The FSDP2 model on the same cases: mean |error| "
                      f"{sum(abs(r['fsdp2_error_pct']) for r in old) / len(old):.2f}%, worst "
                      f"{worst_old['fsdp2_error_pct']:+.2f}% ({worst_old['case']})."]
        lines += ["", _MECHANISMS]
    return "\n".join(lines) + "\n"


def _fsdp2_cells(row: dict[str, Any]) -> str:
    old = row.get("fsdp2_estimate")
    if old is None:
        return " | "
    return f"{old['peak_bytes'] / _MIB:.2f} | {row['fsdp2_error_pct']:+.2f}%"


#: Why the FSDP2 model missed FSDP1 and what the FSDP1 trace holds (torch 2.13): printed under the table.
_MECHANISMS = (
    "Where the FSDP2 model and FSDP1 differ (both traced, so the difference is FSDP's own code): FSDP2 "
    "all-gathers a unit into a separate buffer and copies it out into per-parameter unsharded tensors "
    "(`_fully_shard/_fsdp_collectives.py`, `foreach_all_gather`, `foreach_all_gather_copy_out`), FSDP1 into "
    "the unit's padded unsharded flat parameter, whose views are the parameters (`_flat_param.py`, "
    "`FlatParamHandle._all_gather_flat_param`: on CPU `dist.all_gather` into `torch.chunk` views of it); "
    "in backward FSDP1 prefetches the next unit from the current one's pre-backward hook "
    "(`BackwardPrefetch.BACKWARD_PRE`, `_runtime_utils.py`, `_prefetch_handle`); under `MixedPrecision` it "
    "keeps a 16-bit copy of the shard (`_use_low_precision_shard`) and reduces the gradients in bf16 "
    "(`reduce_dtype`), where memguard's FSDP2 bf16-mixed (`MixedPrecisionPolicy(param_dtype=bf16, "
    "reduce_dtype=fp32)`) reduces in fp32.")


def _describe(row: dict[str, Any]) -> str:
    return (f"real {row['real_peak_bytes'] / _MIB:.2f} MiB, estimate {row['estimate']['peak_bytes'] / _MIB:.2f} MiB, "
            f"{row['error_pct']:+.2f}% (typical {row['typical_error_pct']:+.2f}%)")


BENCHMARK = MultiRankBenchmark(
    name="fsdp1_cpu", doc=__doc__, case_type=Case, cases=all_cases,
    worker=lambda case, args: _rank_worker(case, args.steps),
    measure=lambda case, args: measure(case, runs=args.runs, steps=args.steps, timeout=args.timeout),
    render_markdown=render_markdown, describe=_describe, mode=merge_mode("fsdp1_cpu", all_cases),
    add_arguments=merge_argument("fsdp1_cpu"))


def main(argv: list[str] | None = None) -> int:
    return BENCHMARK.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
