"""DeepSpeed ZeRO on CPU, precision and buffers: the cases of ``benchmarks/deepspeed_cpu.py`` whose
model holds a large buffer (never ZeRO-partitioned), that keep bf16 master weights and optimizer
states (``bf16_master_weights_and_grads`` + ``bf16_optimizer_states``, memguard's ``"bf16-true"``),
or whose only precision is DeepSpeed's ``torch_autocast`` section; measured and reported exactly as
that benchmark measures its cases (see its docstring).

Usage::

    python benchmarks/deepspeed_cpu_precision.py                    # PRECISION_CASES, 1 run each
    python benchmarks/deepspeed_cpu_precision.py --cases llama-z3-plan-bf16-buf16 --runs 2

Writes ``deepspeed_cpu_precision.json`` and ``deepspeed_cpu_precision.md`` to ``--out`` (default
``benchmarks/results``).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))  # `benchmarks` from this checkout when run by path
from benchmarks.deepspeed_cpu import BENCHMARK as _ALL, PRECISION_CASES, all_cases  # noqa: E402

BENCHMARK = dataclasses.replace(
    _ALL, name="deepspeed_cpu_precision", doc=__doc__,
    cases=lambda: {n: c for n, c in all_cases().items() if n in PRECISION_CASES}, default_cases=None)


def main(argv: list[str] | None = None) -> int:
    return BENCHMARK.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
