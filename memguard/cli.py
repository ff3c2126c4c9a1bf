"""The ``memguard`` command line: ``estimate``, ``plan``, ``deepspeed-config`` and ``gpus``.

Run ``memguard --help`` or ``memguard plan --help``. Also ``python -m memguard``.

A model comes from one of:

* ``--hf MODEL_TYPE [--hf-config KEY=VALUE ...]``: a transformers model built from
  ``AutoConfig.for_model(MODEL_TYPE, **overrides)`` on the meta device (nothing is downloaded;
  see :mod:`memguard.hf`), with a batch of ``--micro-batch-size`` x ``--seq-len`` token ids
  and labels;
* ``--model pkg.module:factory`` (or ``path/to/file.py:factory``): a callable, looked up in a
  module importable from the current folder. It may take keyword arguments ``batch_size`` (the
  ``--micro-batch-size``) and ``seq_len`` (``--seq-len``, passed only when given) and returns
  one of:

  - ``(model, batch)`` or ``(model, batch, loss_fn)``;
  - a dict with keys ``model`` and ``batch`` and optionally ``loss_fn``, ``optimizer`` (an
    optimizer or a callable ``params -> Optimizer``) and ``make_batch`` (``n -> batch of n``);
  - a model alone, when it has an ``example_input_array`` (Lightning's convention) to use as
    the batch.

  ``model``, ``batch``, ``loss_fn`` and ``optimizer`` mean what they mean for
  :func:`memguard.plan`; build large models on ``torch.device("meta")``.

Output is a readable report on stdout; ``--json`` prints exactly ``Plan.to_dict()`` (or
``Estimate.to_dict()``) instead, and nothing else goes to stdout; when nothing fits, ``--json``
prints ``{"error": "infeasible", "message": ..., "suggestions": [...], "closest":
Plan.to_dict() or null}``. Progress and errors go to stderr. Exit status: 0 done; 1 no configuration fits (the closest plan and what would make it
fit are printed) or another memguard error such as a missing optional package; 2 bad usage
(unknown option, bad value, a model or batch that cannot be built or traced): one line on stderr
that names the option and what to write instead (one per problem when there are several), and
with ``--verbose`` the traceback before it.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import inspect
import json
import logging
import os
import re
import sys
import textwrap
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from memguard.errors import ConfigError, InfeasiblePlanError, MemguardError, MissingDependencyError
from memguard.hf import MAX_SIZE
from memguard.planner.api import DEFAULT_HEADROOM, PlanRequest
from memguard.vocab import PRECISION_ALIASES, PRECISIONS, format_bytes, parse_bytes

__all__ = ["main", "build_parser", "parse_bytes", "load_model", "LoadedModel"]

log = logging.getLogger("memguard")

EXIT_OK = 0
EXIT_INFEASIBLE = 1
EXIT_USAGE = 2

#: How the command line spells memguard.plan's options, for PlanRequest's problem sentences.
CLI_OPTIONS = {
    "global_batch_size": "--global-batch-size", "gpu": "--gpu", "cpu": "--cpu", "budget_bytes": "--budget",
    "world_size": "--world-size", "device": "--device", "precision": "--precision",
    "activation_checkpointing": "--activation-checkpointing", "zero_stage": "--zero-stage",
    "offload_optimizer": "--offload-optimizer", "headroom": "--headroom", "cache": "--cache",
    "keep_outputs": "--keep-outputs",
    "max_shape": "--max-seq-len", "strategy": "--strategy", "finetune": "--finetune", "train": "--eval",
    "torch_version": "--torch-version", "cuda_version": "--cuda-version", "cudnn_version": "--cudnn-version",
    "gradient_compression": "--gradient-compression", "powersgd": "--powersgd-rank",
    "gpus_per_node": "--gpus-per-node", "verify_budget_s": "--verify-budget",
}

#: memguard.plan's options that take Python objects, so the command line has no flag for them.
API_ONLY_OPTIONS = {
    "optimizer": "an optimizer instance or factory: return it from a --model factory (its 'optimizer' key)",
    "loss_fn": "a Python callable: return it from a --model factory (its 'loss_fn' key)",
    "make_batch": "a Python callable: return it from a --model factory (its 'make_batch' key)",
}


# ------------------------------------------------------------------------------------------
# Argument types
# ------------------------------------------------------------------------------------------


#: The largest count an option takes (int32's maximum, as for config sizes): far above any real
#: batch, sequence or world size; beyond it torch's int64 sizes overflow, and the planner's
#: divisor search of a global batch of 10**20 would not end.
MAX_COUNT = MAX_SIZE
#: The largest --budget: int64's maximum number of bytes (8 EiB), the most torch can count.
MAX_BUDGET = 2**63 - 1


def _bytes_arg(text: str) -> int:
    try:
        value = parse_bytes(text)
    except (ValueError, OverflowError) as exc:  # OverflowError: a number too long for a float
        message = str(exc) if isinstance(exc, ValueError) else f"{text!r} is too large; write e.g. 80GB"
        raise argparse.ArgumentTypeError(message) from None
    if value > MAX_BUDGET:
        raise argparse.ArgumentTypeError(f"{text!r} is more than 8 EiB (2**63 - 1 bytes, the most torch counts); "
                                         "write e.g. 80GB")
    return value


def _precision_list(text: str) -> list[str]:
    out = []
    for part in (p.strip() for p in text.split(",")):
        name = PRECISION_ALIASES.get(part, part)
        if name not in PRECISIONS:
            raise argparse.ArgumentTypeError(
                f"{part!r} is not a precision; use {', '.join(PRECISIONS)} (or a comma list of them)"
            )
        out.append(name)
    return out


def _one_precision(text: str) -> str:
    names = _precision_list(text)
    if len(names) != 1:
        raise argparse.ArgumentTypeError("estimate takes one precision; use `memguard plan` to compare several")
    return names[0]


def _comma_choices(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    """A comma list of ``allowed`` names; any other part is a one-line usage error."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        if part not in allowed:
            raise argparse.ArgumentTypeError(f"{part!r} is not {what}; use {', '.join(allowed)} or a comma list")
        out.append(part)
    return out


def _stage_list(text: str) -> list[int]:
    return [int(s) for s in _comma_choices(text, ("0", "1", "2", "3"), "a ZeRO stage")]


STRATEGIES = ("ddp", "deepspeed", "fsdp2", "fsdp1")  # memguard.plan's strategy= values


def _strategy_list(text: str) -> list[str]:
    return _comma_choices(text, STRATEGIES, "a strategy")


def _one_stage(text: str) -> int:
    stages = _stage_list(text)
    if len(stages) != 1:
        raise argparse.ArgumentTypeError("estimate takes one ZeRO stage; use `memguard plan` to compare several")
    return stages[0]


def _int(text: str) -> int:
    """``int(text)`` for a count: digits only, so ``1e3`` or ``2.0`` is refused rather than guessed."""
    raw = text.strip()
    if not re.fullmatch(r"[+-]?[0-9]+", raw, flags=re.ASCII):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; write digits, e.g. 8")
    digits = raw.lstrip("+-").lstrip("0") or "0"
    # only the digits that matter reach int(): it refuses more than 4300 of them (a ValueError of its own)
    value = (-1 if raw.startswith("-") else 1) * (int(digits) if len(digits) <= 20 else MAX_COUNT + 1)
    if value > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"{text!r} is too large: at most {MAX_COUNT} (2**31 - 1)")
    return value


def _positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1; write e.g. 8")
    return value


def _seconds(text: str) -> float:
    """``--verify-budget``: seconds >= 0, or ``inf``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds; write e.g. 20, 0 or inf") from None
    if value != value or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a number of seconds >= 0; write e.g. 20, 0 or inf")
    return value


def _text(example: str) -> Callable[[str], str]:
    """The type of a free-form option: any text but an empty one (``--gpu ""`` would mean "not given")."""

    def text(value: str) -> str:
        if not value.strip():
            raise argparse.ArgumentTypeError(f"an empty value; write e.g. {example}")
        return value

    return text


def _cpu_level(text: str) -> str:
    """``--cpu``: ``host`` or one of oneDNN's instruction-set levels (:class:`memguard.estimator._cpu_kernels.CpuTarget`)."""
    from memguard.estimator._cpu_kernels import ISAS, CpuTarget

    problems: list[str] = []
    CpuTarget.named(text, problems)
    if problems:
        raise argparse.ArgumentTypeError(f"{text!r} is not a CPU target; write host (this CPU) or one of {', '.join(ISAS)}")
    return text


def _gpu_names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"{text!r} has an empty GPU name; write e.g. T4,A100-40GB")
    return names


def _fraction(text: str) -> float:
    raw = text.strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction; write e.g. 0.1 or 10%") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be in [0, 1) (or [0%, 100%))")
    return value


def _ckpt_estimate(text: str) -> int | bool:
    low = text.strip().lower()
    if low in ("on", "all", "true"):
        return True
    if low in ("off", "none", "false", "0"):
        return 0
    if not re.fullmatch(r"[+-]?[0-9]+", low, flags=re.ASCII):
        raise argparse.ArgumentTypeError(f"{text!r}: use on, off or a number of blocks")
    value = _int(low)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the number of blocks must be >= 0")
    return value


_TRISTATE = {"auto": None, "on": True, "off": False}


# ------------------------------------------------------------------------------------------
# The parser
# ------------------------------------------------------------------------------------------

_EPILOG_MAIN = """\
examples:
  # the fastest plan for GPT-2 124M (sequence 1024) on one A100-40GB, global batch 256;
  # no GPU and no download needed
  memguard plan --hf gpt2 --seq-len 1024 --gpu A100-40GB --global-batch-size 256

  # peak memory of one step at micro-batch 8 in bf16 mixed precision, with a breakdown
  memguard estimate --hf gpt2 --seq-len 1024 --gpu A100-40GB --micro-batch-size 8 --precision bf16-mixed

  # a 7B Llama on 8 x A100-80GB: let memguard choose micro-batch, precision, checkpointing, ZeRO
  memguard plan --hf llama --seq-len 2048 --gpu A100-80GB --world-size 8 --global-batch-size 512

  # your own model: a factory in my_model.py returning (model, batch) or (model, batch, loss_fn)
  memguard plan --model my_model:build --gpu H100 --global-batch-size 64 --plot plan.png

  # a DeepSpeed config for the plan, and which GPUs (how many of each) fit the job
  memguard deepspeed-config --hf gpt2 --gpu A100-40GB --world-size 4 --global-batch-size 256 --out ds.json
  memguard gpus --hf gpt2 --seq-len 1024 --global-batch-size 256

exit status: 0 done; 1 nothing fits (the closest plan is printed) or another memguard error;
2 bad usage: a bad value of any option, or the --model module or factory failed (one line that
names the option; --verbose adds the traceback).
Progress goes to stderr; --json keeps stdout machine-readable.
"""

_MODEL_HELP = """\
model factory protocol (--model pkg.module:factory or path/to/file.py:factory):
  the callable may take keyword arguments batch_size (--micro-batch-size) and seq_len
  (--seq-len, passed when given) and returns (model, batch), (model, batch, loss_fn), a dict
  with keys model, batch and optionally loss_fn, optimizer, make_batch, or a model with an
  example_input_array. loss_fn(model, batch) returns the mean loss; without it the model is
  called with the batch and output.loss (or a scalar output) is used. The optimizer defaults
  to torch.optim.AdamW. Build big models on torch.device("meta").
"""


def _model_options(parser: argparse.ArgumentParser, *, required: bool) -> None:
    g = parser.add_argument_group("model" + ("" if required else " (optional: size the job on each GPU)"))
    src = g.add_mutually_exclusive_group(required=required)
    src.add_argument("--model", metavar="PKG.MODULE:FACTORY", type=_text("my_model:build"),
                     help="a callable returning the model and an example batch (see the protocol below)")
    src.add_argument("--hf", metavar="MODEL_TYPE", type=_text("gpt2"),
                     help="a transformers model type (gpt2, llama, mistral, qwen2, bert, t5, ...) built from its "
                          "default config on the meta device; nothing is downloaded")
    g.add_argument("--hf-config", metavar="KEY=VALUE", nargs="+", action="extend", default=[],
                   help="config overrides for --hf, e.g. n_layer=2 n_embd=64 (JSON values; strings as is)")
    g.add_argument("--hf-task", choices=("auto", "causal-lm", "masked-lm", "seq2seq-lm"), default="auto",
                   help="the head for --hf (default auto: seq2seq for encoder-decoders such as t5/bart, masked LM "
                        "for encoders such as bert, causal LM otherwise)")
    g.add_argument("--seq-len", type=_positive_int, metavar="N",
                   help="tokens per sample (--hf default: 1024, or the model's maximum positions if smaller)")
    g.add_argument("--target-len", type=_positive_int, metavar="N",
                   help="decoder tokens per sample for encoder-decoder --hf models (default: --seq-len)")


def _micro_batch_option(parser: argparse.ArgumentParser, help_text: str, default: int | None = 1) -> None:
    parser.add_argument("--micro-batch-size", type=_positive_int, default=default, metavar="N", help=help_text)


def _target_options(parser: argparse.ArgumentParser, *, budget_help: str) -> argparse._ArgumentGroup:
    g = parser.add_argument_group("target")
    g.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="the training device (default cuda)")
    g.add_argument("--gpu", metavar="NAME", type=_text("A100-40GB"),
                   help="a GPU of the catalog, e.g. A100-40GB, H100, RTX-4090 (see `memguard gpus`); default: "
                        "the GPU of this machine, if any")
    g.add_argument("--cpu", metavar="LEVEL", type=_cpu_level,
                   help="with --device cpu: the CPU whose kernel paths are modelled, host (default: this CPU) or "
                        "an instruction-set level: avx2, avx512_core, avx512_core_bf16, avx512_core_fp16, "
                        "avx512_core_amx")
    g.add_argument("--world-size", type=_positive_int, default=1, metavar="N",
                   help="data-parallel ranks (default 1)")
    g.add_argument("--torch-version", metavar="X.Y", type=_text("2.5.1"),
                   help="with --device cuda: the torch release of the training machine, 2.0 to 2.13 "
                        "(default: the installed torch)")
    g.add_argument("--cuda-version", metavar="X.Y", type=_text("12.4"),
                   help="the CUDA toolkit of that torch build, 11.7 to 13.2 (default: that release's PyPI "
                        "wheel's)")
    g.add_argument("--cudnn-version", metavar="X.Y.Z", type=_text("9.10.2"),
                   help="its cuDNN, 8.5 to 9.x (default: that release's PyPI wheel's)")
    g.add_argument("--gradient-compression", choices=("powersgd",), default=None,
                   help="DDP with torch's PowerSGD hook (needs --world-size > 1, no ZeRO or FSDP2): its error-"
                        "feedback buffers, P/Q matrices and per-bucket temporaries are counted")
    g.add_argument("--powersgd-rank", type=_positive_int, default=None, metavar="R",
                   help="with --gradient-compression powersgd: the matrix approximation rank (default 1)")
    g.add_argument("--gpus-per-node", type=_positive_int, default=None, metavar="K",
                   help="search parallel layouts of --world-size GPUs in nodes of K: tensor parallelism inside a "
                        "node, pipeline stages across nodes, FSDP2/DDP/HSDP over the rest (default: --world-size "
                        "data-parallel ranks)")
    g.add_argument("--verify-budget", type=_seconds, default=None, metavar="SECONDS",
                   help="with --gpus-per-node: verify the chosen layout with a full trace when it is predicted "
                        "(from the model's op count) to take at most SECONDS, else with traces of the model cut to "
                        "a few blocks when those fit (default 20; 0: never; inf: always a full trace)")
    g.add_argument("--budget", type=_bytes_arg, metavar="SIZE", help=budget_help)
    return g


def _knob_options(parser: argparse.ArgumentParser, *, headroom: bool = True) -> None:
    g = parser.add_argument_group("plan constraints (default: memguard chooses)")
    g.add_argument("--precision", type=_precision_list, action="extend", metavar="P[,P...]",
                   help="restrict the precision: " + ", ".join(PRECISIONS) + " (repeatable or a comma list; "
                        "bf16, 16 and 32 are Lightning's short names)")
    g.add_argument("--activation-checkpointing", choices=tuple(_TRISTATE), default="auto",
                   help="checkpoint repeated blocks: auto (the fewest that fit, if any), on (required), off")
    g.add_argument("--zero-stage", type=_stage_list, action="extend", metavar="S[,S...]",
                   help="restrict the DeepSpeed ZeRO stage (0-3; repeatable or a comma list); default: 0 on one rank, "
                        "0-3 on several")
    g.add_argument("--offload-optimizer", nargs="?", const="on", default="off", choices=tuple(_TRISTATE),
                   help="optimizer state in host memory (ZeRO-Offload, needs ZeRO >= 1): the flag alone means on; "
                        "auto lets memguard decide; default off")
    _keep_outputs_option(g)
    if headroom:
        g.add_argument("--headroom", type=_fraction, metavar="FRACTION",
                       help="share of the budget kept free as a safety margin (default 0.1, i.e. 10%%)")


def _keep_outputs_option(group) -> None:
    group.add_argument("--keep-outputs", action="store_true",
                       help="the training loop keeps the model's output object alive through backward, the "
                            "optimizer step and the next forward (a hand-written `out = model(**batch)` loop); "
                            "default: the output is dropped after the loss, as in Lightning and the HF Trainer")


def _output_options(parser: argparse.ArgumentParser, *, json_help: str | None, plot: bool) -> None:
    g = parser.add_argument_group("output")
    if json_help:
        g.add_argument("--json", action="store_true", help=json_help)
    if plot:
        g.add_argument("--plot", metavar="FILE.png", type=_text("plan.png"),
                       help="draw the report with matplotlib (pip install 'memguard[plot]'); .png, .svg or .pdf")
    g.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    g.add_argument("-v", "--verbose", action="count", default=0, help="log memguard's decisions on stderr (-vv: debug details)")


def _wrap(text: str) -> str:
    return textwrap.fill(text, width=88)


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line: the error and where the options are."""

    def error(self, message: str):
        """Print ``memguard: error: MESSAGE (run `PROG --help` for the options)`` and exit 2."""
        # argparse's own error() prints the whole usage first: many lines that hide the one that
        # matters; --help still prints it
        self.exit(EXIT_USAGE, f"memguard: error: {_printable(message)} (run `{self.prog} --help` for the options)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``memguard`` argument parser (sub-commands set ``func``)."""
    from memguard import __version__

    fmt = argparse.RawDescriptionHelpFormatter
    parser = _Parser(
        prog="memguard",
        description=_wrap("Predict the peak memory of a PyTorch training step without a GPU, and plan micro-batch, "
                          "accumulation, precision, activation checkpointing and ZeRO stage for a memory budget."),
        epilog=_EPILOG_MAIN, formatter_class=fmt,
    )
    parser.add_argument("--version", action="version", version=f"memguard {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "plan", help="the fastest configuration that fits (micro-batch, accumulation, precision, checkpointing, ZeRO)",
        description=_wrap("Choose micro-batch, gradient accumulation, precision, activation checkpointing and "
                          "ZeRO stage for a memory budget, verified with one full trace."),
        formatter_class=fmt, epilog=_MODEL_HELP + "\n" + _EPILOG_MAIN,
    )
    _model_options(p, required=True)
    _micro_batch_option(p, "samples in the example batch traced for the probes (default 1; activations are scaled "
                           "to other micro-batches)")
    p.add_argument("--global-batch-size", type=_positive_int, required=True, metavar="N",
                   help="samples per optimizer step over all ranks")
    _target_options(p, budget_help="memory per rank (default: the GPU's memory less its CUDA context; required for "
                                   "--device cpu or an unknown GPU), e.g. 40GiB, 80GB")
    _knob_options(p)
    w = p.add_argument_group("what is planned")
    w.add_argument("--strategy", type=_strategy_list, action="extend", metavar="S[,S...]",
                   help="the sharding strategy: ddp, deepspeed, fsdp2 or fsdp1 (FlatParameter FSDP, what Accelerate, the HF "
                        "Trainer and Lightning's FSDPStrategy run), or a comma list to choose among (default: DDP, or "
                        "DeepSpeed ZeRO for stages >= 1); under fsdp2 and fsdp1 --zero-stage is the sharding level "
                        "(fsdp1: 2 SHARD_GRAD_OP, 3 FULL_SHARD)")
    w.add_argument("--finetune", choices=("full", "lora", "qlora"),
                   help="full: when nothing fits, list measured LoRA, QLoRA, 8-bit AdamW, bf16 and offload "
                        "alternatives; lora: plan a LoRA twin of the model (needs peft); qlora: plan a QLoRA twin "
                        "(4-bit NF4 base with double quantisation, fp32 embeddings/norms/head and checkpointing "
                        "as peft's prepare_model_for_kbit_training leaves them, LoRA adapters)")
    w.add_argument("--eval", action="store_true",
                   help="plan an evaluation step (no_grad forward, outputs kept) instead of a training step: "
                        "--global-batch-size is the evaluation batch over all ranks")
    p.add_argument("--max-seq-len", type=_positive_int, metavar="N",
                   help="plan for the longest batch the data can produce: every sequence dim of the example batch "
                        "set to N tokens (memguard.plan's max_shape={'seq_len': N}); the plan says which shape it "
                        "planned for")
    p.add_argument("--cache", action="store_true", help="reuse and store plans on disk (memguard's plan cache)")
    _output_options(p, json_help="print Plan.to_dict() as JSON on stdout, nothing else", plot=True)
    p.set_defaults(func=_cmd_plan)

    e = sub.add_parser(
        "estimate", help="the peak memory of one training step, with a breakdown by category",
        description=_wrap("Predict the peak memory of one training step (forward, backward, optimizer step) "
                          "for a fixed configuration."),
        formatter_class=fmt, epilog=_MODEL_HELP + "\n" + _EPILOG_MAIN,
    )
    _model_options(e, required=True)
    _micro_batch_option(e, "the micro-batch to estimate (default 1, or the --deepspeed-config's "
                           "train_micro_batch_size_per_gpu)", default=None)
    g = _target_options(e, budget_help="say whether the estimate fits this much memory per rank, e.g. 40GiB "
                                       "(default with --gpu: the GPU's memory less its CUDA context)")
    g.add_argument("--headroom", type=_fraction, metavar="FRACTION",
                   help="share of the budget kept free when judging the fit (default 0.1)")
    c = e.add_argument_group("configuration")
    c.add_argument("--precision", type=_one_precision, default="32-true", metavar="P",
                   help="one of " + ", ".join(PRECISIONS) + " (default 32-true)")
    c.add_argument("--zero-stage", type=_one_stage, default=0, metavar="S", help="DeepSpeed ZeRO stage 0-3 (default 0)")
    c.add_argument("--activation-checkpointing", type=_ckpt_estimate, default=0, metavar="on|off|N",
                   help="checkpoint all repeated blocks (on), none (off, default) or the first N")
    c.add_argument("--offload-optimizer", action="store_true", help="optimizer state in host memory (ZeRO >= 1)")
    c.add_argument("--grad-accum-steps", type=_positive_int, default=1, metavar="N",
                   help="> 1: gradients already exist when a micro-batch starts (default 1)")
    _keep_outputs_option(c)
    c.add_argument("--deepspeed-config", metavar="FILE.json", type=_text("ds_config.json"), default=None,
                   help="estimate under your own DeepSpeed config: its ZeRO stage, precision, batch triple, "
                        "offload and buckets (the options above, where given, must agree with it)")
    _output_options(e, json_help="print Estimate.to_dict() as JSON on stdout, nothing else", plot=True)
    e.set_defaults(func=_cmd_estimate)

    d = sub.add_parser(
        "deepspeed-config", help="plan, then write the DeepSpeed JSON config of the plan",
        description=_wrap("Plan as `memguard plan` does and print (or write) the DeepSpeed config that runs the plan: "
                          "batch sizes, ZeRO stage and offload, fp16/bf16, activation checkpointing."),
        formatter_class=fmt, epilog=_MODEL_HELP + "\n" + _EPILOG_MAIN,
    )
    _model_options(d, required=True)
    _micro_batch_option(d, "samples in the example batch traced for the probes (default 1)")
    d.add_argument("--global-batch-size", type=_positive_int, required=True, metavar="N",
                   help="samples per optimizer step over all ranks")
    _target_options(d, budget_help="memory per rank (default: the GPU's memory less its CUDA context)")
    _knob_options(d)
    d.add_argument("--cache", action="store_true", help="reuse and store plans on disk (memguard's plan cache)")
    o = d.add_argument_group("DeepSpeed config")
    o.add_argument("--out", metavar="FILE", type=_text("ds.json"),
                   help="write the config here (default: print it on stdout)")
    o.add_argument("--set", metavar="KEY=VALUE", nargs="+", action="extend", default=[], dest="ds_set",
                   help="extra config entries, dotted for nested keys, e.g. gradient_clipping=1.0 "
                        "zero_optimization.overlap_comm=true (JSON values)")
    _output_options(d, json_help=None, plot=False)
    d.set_defaults(func=_cmd_deepspeed)

    gp = sub.add_parser(
        "gpus", help="list the GPU catalog; with a model, which GPUs (and how many of each) fit the job",
        description=_wrap("List the GPUs memguard knows. With a model and --global-batch-size, find for each GPU the "
                          "fewest (a power of two up to --max-gpus) that fit the job, and the plan for them."),
        formatter_class=fmt, epilog=_MODEL_HELP + "\n" + _EPILOG_MAIN,
    )
    _model_options(gp, required=False)
    _micro_batch_option(gp, "samples in the example batch traced for the probes (default 1)")
    gp.add_argument("--global-batch-size", type=_positive_int, metavar="N",
                    help="samples per optimizer step over all GPUs (needed with a model)")
    gp.add_argument("--gpus", metavar="NAME[,NAME...]", action="extend", type=_gpu_names,
                    help="only these GPUs (default: the whole catalog)")
    gp.add_argument("--max-gpus", type=_positive_int, default=64, metavar="N", help="the most GPUs tried (default 64)")
    _knob_options(gp)
    _output_options(gp, json_help="print the catalog (and the fits) as JSON on stdout", plot=False)
    gp.set_defaults(func=_cmd_gpus)
    return parser


# ------------------------------------------------------------------------------------------
# Progress and errors
# ------------------------------------------------------------------------------------------


class _Progress:
    """Progress lines on stderr (silent with --quiet)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.start = time.perf_counter()
        self.traces = 0

    def say(self, message: str) -> None:
        if self.enabled:
            print(f"memguard: {message}", file=sys.stderr, flush=True)

    def restart(self) -> None:
        self.start = time.perf_counter()

    def elapsed(self) -> str:
        return f"{time.perf_counter() - self.start:.1f} s"

    def trace_done(self, what: dict, seconds: float) -> None:
        """Report one new trace (the :attr:`memguard.planner._session.TraceSession.on_trace` hook)."""
        self.traces += 1
        keep, ckpt = what.get("keep"), what.get("ckpt") or 0
        bits = [what["precision"], "whole model" if keep is None else f"{keep}-block probe"]
        if ckpt:
            bits.append(f"{ckpt} block{'s' if ckpt > 1 else ''} checkpointed")
        if what.get("m") is not None:
            bits.append(f"micro-batch {what['m']}")
        self.say(f"  trace {self.traces}: {', '.join(bits)} ({seconds:.1f} s)")


def _configure_logging(verbose: int) -> Callable[[], None]:
    """Send the memguard logger to stderr at the -v level; returns what restores it."""
    saved = (log.level, log.propagate)
    level = logging.WARNING if verbose <= 0 else (logging.INFO if verbose == 1 else logging.DEBUG)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    log.setLevel(level)
    log.propagate = False

    def restore() -> None:
        log.removeHandler(handler)
        log.setLevel(saved[0])
        log.propagate = saved[1]

    return restore


def _printable(text: str) -> str:
    """``text`` with control and invisible characters escaped (``\\n``, ``\\x00``, ``\\u200b``).

    Problems quote what the user typed; a newline or carriage return in it would break the one
    line an error is, and an invisible character would hide why a name is unknown.
    """
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _problems_text(exc: ConfigError) -> str:
    """A :class:`ConfigError` as :func:`_fail` prints it: one line per problem (ConfigError's own form)."""
    problems = [_printable(p) for p in exc.problems] or [_printable(str(exc))]
    if len(problems) == 1:
        return problems[0]
    return f"{len(problems)} problems:\n" + "\n".join(f"  - {p}" for p in problems)


def _fail(message: str, *, hint: str | None = None) -> None:
    """Print ``memguard: error: MESSAGE`` on stderr; a hint ends a one-line message, in parentheses."""
    sys.stdout.flush()
    if hint and "\n" not in message:
        message, hint = f"{message} ({hint})", None  # one bad value, one line
    print(f"memguard: error: {message}", file=sys.stderr)
    if hint:
        print(f"memguard: {hint}", file=sys.stderr)


# ------------------------------------------------------------------------------------------
# Loading the model
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadedModel:
    """What a command needs of the model: the objects :func:`memguard.plan` takes, and a name."""

    model: Any
    batch: Any
    loss_fn: Callable | None = None
    optimizer: Any = None
    make_batch: Callable[[int], Any] | None = None
    description: str = ""


class UserCodeError(ConfigError):
    """The user's model module or factory failed (it would not import, or the factory raised).

    The command line prints one line naming the factory and the error, and the traceback with
    ``--verbose``; the user's own exception is ``__cause__``.
    """


def _one_line(exc: BaseException) -> str:
    """``Type: message`` of ``exc`` on one line (the message's first line)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _import_failure(spec: str, module_part: str, exc: BaseException) -> UserCodeError:
    """The error for a model module that failed to import."""
    if isinstance(exc, SyntaxError):
        where = f" ({exc.filename}, line {exc.lineno})" if exc.filename else ""
        return UserCodeError(f"--model {spec}: {module_part} has a syntax error{where}: {exc.msg}")
    return UserCodeError(f"--model {spec}: importing {module_part} raised {_one_line(exc)}")


def _resolve_factory(spec: str) -> Callable:
    module_part, sep, attr = spec.rpartition(":")
    if not sep or not module_part or not attr:
        raise ConfigError(f"--model {spec!r} is not 'pkg.module:factory' (or 'path/to/file.py:factory')")
    if module_part.endswith(".py") or os.sep in module_part or "/" in module_part:
        path = os.path.abspath(module_part)
        if not os.path.isfile(path):
            raise ConfigError(f"--model {spec!r}: no file {module_part!r}; give an existing .py file or pkg.module")
        name = "_memguard_user_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except Exception as exc:  # the user's code: any error it raises while importing
            sys.modules.pop(name, None)
            raise _import_failure(spec, module_part, exc) from exc
    else:
        if not all(part.isidentifier() for part in module_part.split(".")):
            # importlib would raise TypeError for "..x" and import "x-y" nowhere: say what a name is
            raise ConfigError(f"--model {spec!r}: {module_part!r} is not a module name; write pkg.module:factory "
                              "(dotted Python names) or path/to/file.py:factory")
        cwd = os.getcwd()
        if cwd not in sys.path and "" not in sys.path:
            sys.path.insert(0, cwd)  # like `python -m`, find modules in the current folder
        try:
            module = importlib.import_module(module_part)
        except ModuleNotFoundError as exc:
            missing = exc.name or ""
            if module_part != missing and not module_part.startswith(missing + "."):  # a module it imports is missing
                raise _import_failure(spec, module_part, exc) from exc
            raise ConfigError(
                f"--model {spec!r}: cannot import {module_part!r} ({exc}); run memguard from the folder that holds it "
                "or add that folder to PYTHONPATH"
            ) from exc
        except Exception as exc:  # the user's code: any error it raises while importing
            raise _import_failure(spec, module_part, exc) from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"--model {spec!r}: {module_part} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"--model {spec!r}: {attr} is a {type(obj).__name__}, not a callable returning the model")
    return obj


def _accepts(func: Callable, name: str) -> bool:
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _from_factory(spec: str, *, batch_size: int, seq_len: int | None) -> LoadedModel:
    from torch import nn

    factory = _resolve_factory(spec)
    kwargs: dict[str, Any] = {}
    if _accepts(factory, "batch_size"):
        kwargs["batch_size"] = batch_size
    elif batch_size != 1:
        raise ConfigError(f"--micro-batch-size {batch_size}: the factory {spec} takes no batch_size argument")
    if seq_len is not None:
        if not _accepts(factory, "seq_len"):
            raise ConfigError(f"--seq-len {seq_len}: the factory {spec} takes no seq_len argument; drop --seq-len "
                              "or add a seq_len keyword argument to it")
        kwargs["seq_len"] = seq_len
    try:
        result = factory(**kwargs)
    except MemguardError:
        raise
    except Exception as exc:  # the user's code: report it as theirs, not as a memguard failure
        raise UserCodeError(f"--model {spec}: the factory raised {_one_line(exc)}") from exc
    out: dict[str, Any] = {}
    if isinstance(result, nn.Module):
        out["model"] = result
    elif isinstance(result, (tuple, list)) and len(result) in (2, 3):
        out = dict(zip(("model", "batch", "loss_fn"), result))
    elif isinstance(result, dict):
        unknown = sorted(set(result) - {"model", "batch", "loss_fn", "optimizer", "make_batch"})
        if unknown:
            raise ConfigError(f"--model {spec}: the returned dict has unknown keys {unknown}; use model, batch, "
                              "loss_fn, optimizer, make_batch")
        out = dict(result)
    else:
        raise ConfigError(f"--model {spec} returned a {type(result).__name__}; return (model, batch), "
                          "(model, batch, loss_fn), a dict with model and batch, or a model")
    model = out.get("model")
    problems = []
    if not isinstance(model, nn.Module):
        problems.append(f"--model {spec}: the model is a {type(model).__name__}, not a torch.nn.Module")
    if out.get("batch") is None:
        example = getattr(model, "example_input_array", None)
        if example is None:
            problems.append(f"--model {spec} gave no example batch; return (model, batch) or set "
                            "model.example_input_array")
        out["batch"] = example
    if problems:
        raise ConfigError(problems)
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    return LoadedModel(model=model, batch=out["batch"], loss_fn=out.get("loss_fn"), optimizer=out.get("optimizer"),
                       make_batch=out.get("make_batch"),
                       description=f"{spec} ({type(model).__name__}, {n / 1e6:.1f}M parameters)")


def _flagged(flag: str, func: Callable, *args: Any) -> Any:
    """``func(*args)``, its :class:`ConfigError` problems each starting with ``flag``."""
    try:
        return func(*args)
    except ConfigError as exc:
        raise ConfigError([p if p.startswith(flag) else f"{flag}: {p}" for p in exc.problems]) from exc


#: The most tokens the --hf example batch may hold: its token ids and labels are real CPU tensors
#: (1 GiB at this size), unlike the model's weights on the meta device.
MAX_EXAMPLE_TOKENS = 2**26


def _load_hf(args: argparse.Namespace, progress: _Progress) -> LoadedModel:
    """:func:`load_model` for ``--hf``: flags checked before the model is built, each problem naming its flag."""
    from memguard import hf

    overrides = _flagged("--hf-config", hf.parse_overrides, args.hf_config)
    try:
        import transformers

        if args.verbose < 2:
            transformers.logging.set_verbosity_error()  # config notes and deprecations are noise here
    except ImportError as exc:
        raise MissingDependencyError("transformers", "transformers") from exc
    # hf.build checks the same, but cannot say which flag is at fault (a config takes milliseconds)
    _flagged("--hf", hf.config_for, args.hf)
    config = _flagged("--hf-config", hf.config_for, args.hf, overrides)
    problems = []
    seq_len = args.seq_len or hf.DEFAULT_SEQ_LEN
    tokens = args.micro_batch_size * max(seq_len, args.target_len or 0)
    if tokens > MAX_EXAMPLE_TOKENS:
        default = "" if args.seq_len else " (the default)"
        problems.append(f"--micro-batch-size {args.micro_batch_size} x --seq-len {seq_len}{default}: an example batch "
                        f"of {tokens} tokens would take {format_bytes(16 * tokens)} of this machine's memory (the "
                        f"most is {MAX_EXAMPLE_TOKENS} tokens); use a smaller --micro-batch-size or --seq-len")
    bound = hf.max_positions(config)
    max_seq_len = getattr(args, "max_seq_len", None)
    if bound is not None and max_seq_len and max_seq_len > bound[1]:
        problems.append(f"--max-seq-len {max_seq_len} exceeds {type(config).__name__}.{bound[0]}={bound[1]}; raise it "
                        f"(--hf-config {bound[0]}={max_seq_len}) or plan for shorter sequences")
    if problems:
        raise ConfigError(problems)
    progress.say(f"building {args.hf} from its config on the meta device (no download)")
    try:
        built = hf.build(args.hf, overrides, batch_size=args.micro_batch_size, seq_len=args.seq_len,
                         target_len=args.target_len, task=args.hf_task)
    except MemguardError:
        raise
    except Exception as exc:  # the config passed its checks, but transformers cannot build a model from it
        raise ConfigError(f"--hf {args.hf}: transformers cannot build the model from this config "
                          f"({_one_line(exc)}); change the --hf-config values") from exc
    return LoadedModel(model=built.model, batch=built.batch, description=built.describe())


def load_model(args: argparse.Namespace, progress: _Progress | None = None) -> LoadedModel:
    """Build the model and example batch the command line asks for.

    Raises:
        ConfigError: a bad model specification or options that do not go with it.
        MissingDependencyError: ``--hf`` without transformers installed.
    """
    progress = progress or _Progress(False)
    problems = []
    if not args.hf:
        for flag, value in (("--hf-config", args.hf_config), ("--target-len", args.target_len),
                            ("--hf-task", args.hf_task != "auto")):
            if value:
                problems.append(f"{flag} applies to --hf models only")
    if problems:
        raise ConfigError(problems)
    if args.hf:
        return _load_hf(args, progress)
    progress.say(f"building the model with {args.model}")
    return _from_factory(args.model, batch_size=args.micro_batch_size, seq_len=args.seq_len)


# ------------------------------------------------------------------------------------------
# Commands
# ------------------------------------------------------------------------------------------


def _restrict(values):
    """A flag's list as a plan knob: None (memguard chooses), one value (fixed) or several (a restriction)."""
    if not values:
        return None
    unique = list(dict.fromkeys(values))
    return unique[0] if len(unique) == 1 else unique


def _knobs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        precision=_restrict(args.precision),
        activation_checkpointing=_TRISTATE[args.activation_checkpointing],
        zero_stage=_restrict(args.zero_stage),
        offload_optimizer=_TRISTATE[args.offload_optimizer],
    )


def plan_request(args: argparse.Namespace, loaded: "LoadedModel | None" = None) -> PlanRequest:
    """The :class:`~memguard.planner._request.PlanRequest` the command line asks for.

    Without ``loaded`` (before the model is built) the model's optimizer, loss and ``make_batch``
    are left at their defaults, so the options can be checked before a slow model build.
    """
    return PlanRequest(
        global_batch_size=args.global_batch_size, gpu=args.gpu, budget_bytes=args.budget,
        world_size=args.world_size, device=args.device, cpu=args.cpu, torch_version=args.torch_version,
        cuda_version=args.cuda_version, cudnn_version=args.cudnn_version,
        gradient_compression=args.gradient_compression, powersgd=args.powersgd_rank,
        gpus_per_node=getattr(args, "gpus_per_node", None),
        verify_budget_s=getattr(args, "verify_budget", None),
        strategy=_restrict(getattr(args, "strategy", None)), finetune=getattr(args, "finetune", None),
        train=not getattr(args, "eval", False),
        optimizer=loaded.optimizer if loaded else None, loss_fn=loaded.loss_fn if loaded else None,
        headroom=DEFAULT_HEADROOM if args.headroom is None else args.headroom,
        make_batch=loaded.make_batch if loaded else None, cache=args.cache, keep_outputs=args.keep_outputs,
        max_shape={"seq_len": args.max_seq_len} if getattr(args, "max_seq_len", None) else None,
        **_knobs(args),
    )


def _gpu_problems(name: str) -> list[str]:
    """The catalog's problems with the GPU ``name`` (unknown, ambiguous), as it words them; [] when known."""
    from memguard.estimator.gpus import get_gpu

    try:
        get_gpu(name)
    except ConfigError as exc:
        return exc.problems
    return []


def _gpu_sentence(flag: str, problem: str) -> str:
    """A catalog problem in the command line's words: the flag first, its options rather than keywords."""
    other = "leave out --gpu and give --budget" if flag == "--gpu" else "run `memguard plan --budget SIZE`"
    return f"{flag}: " + problem.replace("pass gpu=None with budget_bytes=", other)


def _check_request(args: argparse.Namespace) -> None:
    """Raise every problem of the plan options, in the command line's words, before building the model."""
    problems = plan_request(args).problems(spell=CLI_OPTIONS)
    # the catalog's sentences about the GPU name come without the flag: say it is --gpu's value
    unknown = set(_gpu_problems(args.gpu)) if args.gpu else set()
    problems = [_gpu_sentence("--gpu", p) if p in unknown else p for p in problems]
    if problems:
        raise ConfigError(problems)
    if args.device == "cpu" and args.budget is None:
        log.info("memguard: --device cpu without --budget: using the host's available memory")


def _check_output_path(option: str, path: str | None) -> None:
    """Raise :class:`ConfigError` unless ``path`` can be a file to write (checked before the slow work)."""
    if not path:
        return
    if "\0" in path:
        raise ConfigError(f"{option} {path!r}: a file name cannot hold a NUL character")
    if os.path.isdir(path):
        raise ConfigError(f"{option} {path}: that is a folder; give a file name in it")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ConfigError(f"{option} {path}: the folder {parent} does not exist; create it first")


def _check_plot_path(path: str | None) -> None:
    """:func:`_check_output_path` for ``--plot``, and a suffix matplotlib can write (it decides the format)."""
    _check_output_path("--plot", path)
    if not path:
        return
    from matplotlib.backend_bases import FigureCanvasBase

    kinds = FigureCanvasBase.get_supported_filetypes()
    suffix = os.path.splitext(path)[1].lstrip(".").lower()
    if suffix not in kinds:
        what = f"a .{suffix} file" if suffix else "a file without a suffix"
        raise ConfigError(f"--plot {path}: matplotlib cannot write {what}; end the name in .png, .svg or .pdf "
                          f"(or {', '.join('.' + k for k in sorted(kinds) if k not in ('png', 'svg', 'pdf'))})")


def _plan_with_progress(args, loaded: LoadedModel, progress: _Progress):
    """Plan as the command line asks; return (plan or None, InfeasiblePlanError or None, planner)."""
    from memguard.planner.api import TraceSession
    from memguard.planner.api import plan_request as run_plan

    request = plan_request(args, loaded)
    planner = TraceSession.for_request(loaded.model, loaded.batch, request) if request.train else None
    if planner is not None:  # an evaluation plan traces its own steps (planner.eval_sizing)
        planner.on_trace = progress.trace_done
    progress.say(f"planning {loaded.description}: tracing probes on fake tensors (no memory is allocated)")
    progress.restart()
    try:
        plan = run_plan(loaded.model, loaded.batch, request, session=planner)
    except InfeasiblePlanError as exc:
        progress.say(f"no plan fits ({progress.traces} traces, {progress.elapsed()})")
        return None, exc, planner
    progress.say(f"planned in {progress.elapsed()} ({progress.traces} traces)")
    return plan, None, planner


def _draw_plan(args, loaded: LoadedModel, plan, planner, progress: _Progress, *, fits: bool) -> None:
    from memguard import plot

    progress.say("drawing memory against micro-batch size (probe predictions; more probes may be traced)")
    curves = plot.memory_curves(loaded.model, loaded.batch, plan, optimizer=loaded.optimizer, loss_fn=loaded.loss_fn,
                                precisions=list(dict.fromkeys(args.precision)) if args.precision else None,
                                make_batch=loaded.make_batch, planner=planner)
    plot.plot_plan(plan, args.plot, curves=curves, title=loaded.description, fits=fits)
    progress.say(f"plot written to {args.plot}")


def _report_infeasible(args, exc: InfeasiblePlanError) -> int:
    closest = exc.closest
    if args_json(args):
        payload = {"error": "infeasible", "message": str(exc).splitlines()[0], "suggestions": exc.suggestions,
                   "closest": closest.to_dict() if closest is not None else None}
        print(json.dumps(payload, indent=2))
    elif closest is not None:
        print("No configuration fits. The closest plan (it does NOT fit):\n")
        print(closest.explain())
    _fail(str(exc))
    return EXIT_INFEASIBLE


def args_json(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "json", False))


def _cmd_plan(args: argparse.Namespace, progress: _Progress) -> int:
    if args.plot:
        from memguard.plot import require_matplotlib

        require_matplotlib()
    _check_plot_path(args.plot)
    _check_request(args)
    loaded = load_model(args, progress)
    plan, infeasible, planner = _plan_with_progress(args, loaded, progress)
    if args.plot:
        target = plan if plan is not None else infeasible.closest
        if target is not None:
            _draw_plan(args, loaded, target, planner, progress, fits=plan is not None)
    if infeasible is not None:
        return _report_infeasible(args, infeasible)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
        return EXIT_OK
    print(f"Model: {loaded.description}\n")
    print(plan.explain())
    e = plan.estimate
    print(f"\nPredicted throughput: {plan.throughput:.3g} samples/s (cost model); "
          f"{e.num_params / 1e6:.1f}M parameters, peak during {e.peak_phase}.")
    return EXIT_OK


def _config_micro_batch(path: str | None, world_size: int) -> int:
    """The micro-batch one rank runs under a DeepSpeed config: ``train_micro_batch_size_per_gpu``, or
    ``train_batch_size / (gradient_accumulation_steps x world size)`` (DeepSpeed derives it so); 1 without one."""
    if path is None:
        return 1
    from memguard.estimator._deepspeed_config import load_config

    cfg = load_config(path)
    micro, train, accum = (cfg.get(k) for k in ("train_micro_batch_size_per_gpu", "train_batch_size",
                                                 "gradient_accumulation_steps"))
    if isinstance(micro, int) and micro >= 1:
        return micro
    accum = accum if isinstance(accum, int) and accum >= 1 else 1
    if isinstance(train, int) and train >= accum * world_size and train % (accum * world_size) == 0:
        return train // (accum * world_size)
    return 1


def _cmd_estimate(args: argparse.Namespace, progress: _Progress) -> int:
    import memguard

    if args.plot:
        from memguard.plot import require_matplotlib

        require_matplotlib()
    _check_plot_path(args.plot)
    if args.gpu:  # before the model is built, in the command line's words (as plan_request says them)
        if args.device != "cuda":
            raise ConfigError(f"--gpu {args.gpu} only applies to --device cuda; drop it")
        bad = _gpu_problems(args.gpu)
        if bad:
            raise ConfigError([_gpu_sentence("--gpu", p) for p in bad])
    if args.cpu and args.device != "cpu":
        raise ConfigError(f"--cpu {args.cpu} only applies to --device cpu; drop it or add --device cpu")
    if args.micro_batch_size is None:
        args.micro_batch_size = _config_micro_batch(args.deepspeed_config, args.world_size)
    loaded = load_model(args, progress)
    progress.say(f"estimating {loaded.description}: tracing one step on fake tensors")
    progress.restart()
    est = memguard.estimate(
        loaded.model, loaded.batch, optimizer=loaded.optimizer, loss_fn=loaded.loss_fn, device=args.device,
        precision=args.precision, zero_stage=args.zero_stage, world_size=args.world_size, gpu=args.gpu,
        activation_checkpointing=args.activation_checkpointing, grad_accum_steps=args.grad_accum_steps,
        offload_optimizer=args.offload_optimizer, keep_outputs=args.keep_outputs, cpu=args.cpu,
        torch_version=args.torch_version, cuda_version=args.cuda_version, cudnn_version=args.cudnn_version,
        gradient_compression=args.gradient_compression, powersgd=args.powersgd_rank,
        deepspeed_config=args.deepspeed_config,
    )
    progress.say(f"estimated in {progress.elapsed()}")
    budget = args.budget
    if budget is None and args.device == "cuda" and args.gpu:
        from memguard.estimator.gpus import get_gpu

        spec = get_gpu(args.gpu)
        budget = spec.memory_bytes - spec.context_bytes
    headroom = DEFAULT_HEADROOM if args.headroom is None else args.headroom
    usable = int(budget * (1 - headroom)) if budget else None
    if args.plot:
        from memguard import plot

        plot.plot_estimate(est, args.plot, budget_bytes=budget, usable_bytes=usable, title=loaded.description)
        progress.say(f"plot written to {args.plot}")
    if args.json:
        print(json.dumps(est.to_dict(), indent=2))
        return EXIT_OK
    print(f"Model: {loaded.description}\n")
    print(str(est))
    if usable:
        verdict = "fits" if est.peak_bytes <= usable else "does NOT fit"
        print(f"\n{verdict}: {format_bytes(est.peak_bytes)} of {format_bytes(usable)} usable "
              f"({format_bytes(budget)} budget, {headroom:.0%} headroom)")
        if est.peak_bytes > usable:
            print("run `memguard plan` with the same model for a configuration that fits")
    return EXIT_OK


def _set_dotted(items: Sequence[str]) -> dict[str, Any]:
    from memguard.hf import parse_overrides

    flat = _flagged("--set", parse_overrides, items)
    out: dict[str, Any] = {}
    problems = []
    for key, value in flat.items():
        node = out
        parts = key.split(".")
        if not all(parts):
            problems.append(f"--set {key}: an empty name between dots; write e.g. zero_optimization.overlap_comm=true")
            continue
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                problems.append(f"--set {key}: {part} is already set to a value, not a section")
                break
            node = child
        else:
            node[parts[-1]] = value
    if problems:
        raise ConfigError(problems)
    return out


def _has_deepspeed() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def _cmd_deepspeed(args: argparse.Namespace, progress: _Progress) -> int:
    _check_output_path("--out", args.out)
    overrides = _set_dotted(args.ds_set)
    _check_request(args)
    from memguard.integrations.deepspeed import to_config, validate_config  # DeepSpeed is imported to validate
    loaded = load_model(args, progress)
    plan, infeasible, _ = _plan_with_progress(args, loaded, progress)
    if infeasible is not None:
        return _report_infeasible(args, infeasible)
    config = to_config(plan, **overrides)
    progress.say("validating the config" + (" with DeepSpeed's DeepSpeedConfig" if _has_deepspeed() else ""))
    validate_config(config, world_size=plan.world_size)
    text = json.dumps(config, indent=2)
    if args.out:
        try:
            with open(args.out, "w", encoding="utf-8") as fh:
                fh.write(text + "\n")
        except OSError as exc:  # no permission, a read-only disk, a name too long, ...
            raise ConfigError(f"--out {args.out}: cannot write the config ({exc.strerror or exc}); choose another "
                              "file") from exc
        print(f"Model: {loaded.description}\n")
        print(plan.explain())
        print(f"\nDeepSpeed config written to {args.out}")
    else:
        print(text)
        progress.say(f"plan: micro-batch {plan.micro_batch_size} x accumulation {plan.grad_accum_steps} x world "
                     f"{plan.world_size}, {plan.precision}, ZeRO-{plan.zero_stage}"
                     + (f", {plan.checkpoint_blocks} blocks checkpointed" if plan.activation_checkpointing else ""))
    return EXIT_OK


def _catalog_rows() -> list[list[str]]:
    from memguard.estimator.gpus import GPUS

    rows = []
    for s in GPUS.values():
        half = s.bf16_tflops if s.bf16 else s.fp16_tflops
        rows.append([s.name, format_bytes(s.memory_bytes), f"{s.compute_capability[0]}.{s.compute_capability[1]}",
                     "yes" if s.bf16 else "no", f"{half:g}", f"{s.fp32_tflops:g}", f"{s.memory_bandwidth_gbps:g}",
                     f"{s.interconnect_gbps:g}"])
    return rows


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths)).rstrip()]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def _cmd_gpus(args: argparse.Namespace, progress: _Progress) -> int:
    from memguard.estimator.gpus import GPUS, get_gpu

    has_model = bool(args.model or args.hf)
    problems = []
    if has_model and args.global_batch_size is None:
        problems.append("--global-batch-size is needed to size a job: the samples per optimizer step over all GPUs")
    if not has_model and args.global_batch_size is not None:
        problems.append("--global-batch-size needs a model (--hf or --model)")
    names = None
    if args.gpus:
        names = []
        for n in dict.fromkeys(args.gpus):  # T4,T4: one GPU, and one problem if it is unknown
            bad = _gpu_problems(n)
            if bad:
                problems.extend(_gpu_sentence("--gpus", p) for p in bad)
            else:
                names.append(get_gpu(n).name)
    if problems:
        raise ConfigError(problems)

    catalog = [dataclasses.asdict(s) for s in GPUS.values() if names is None or s.name in names]
    if not has_model:
        if args.json:
            print(json.dumps({"catalog": catalog}, indent=2))
            return EXIT_OK
        rows = [r for r in _catalog_rows() if names is None or r[0] in names]
        print(_table(["GPU", "memory", "CC", "bf16", "16-bit TFLOP/s", "fp32 TFLOP/s", "memory GB/s", "link GB/s"],
                      rows))
        print("\nmemory: what torch reports as total_memory; TFLOP/s: dense tensor-core peaks from the datasheets.")
        print("Sources:")
        for s in GPUS.values():
            if names is None or s.name in names:
                print(f"  {s.name}: {s.source}")
        return EXIT_OK

    from memguard.planner.api import fit_gpus

    loaded = load_model(args, progress)
    count = len(names) if names else sum(1 for s in GPUS.values() if s.memory_bytes)
    progress.say(f"sizing {loaded.description} on {count} GPU kinds (world sizes 1, 2, 4, ... up to "
                 f"{args.max_gpus}; traces are shared)")
    progress.restart()
    fits = fit_gpus(loaded.model, loaded.batch, global_batch_size=args.global_batch_size, gpus=names,
                    max_gpus=args.max_gpus, optimizer=loaded.optimizer, loss_fn=loaded.loss_fn,
                    make_batch=loaded.make_batch,
                    headroom=DEFAULT_HEADROOM if args.headroom is None else args.headroom,
                    keep_outputs=args.keep_outputs, **_knobs(args))
    progress.say(f"sized in {progress.elapsed()}")
    any_fit = any(f.count for f in fits)
    if args.json:
        print(json.dumps({"catalog": catalog, "fits": [f.to_dict() for f in fits]}, indent=2))
        return EXIT_OK if any_fit else EXIT_INFEASIBLE
    rows = []
    for f in fits:
        p = f.plan
        if p is None:
            rows.append([f.gpu, "-", f"does not fit on {args.max_gpus} or fewer", "", "", "", "", ""])
            continue
        ckpt = f"{p.checkpoint_blocks} blocks" if p.activation_checkpointing else "off"
        rows.append([f.gpu, str(f.count), f"{p.micro_batch_size} x {p.grad_accum_steps}", p.precision, ckpt,
                     str(p.zero_stage) + (" +offload" if p.offload_optimizer else ""),
                     f"{format_bytes(p.estimate.peak_bytes)} / {format_bytes(p.usable_bytes)}", f"{p.throughput:.3g}"])
    print(f"Model: {loaded.description}; global batch {args.global_batch_size}\n")
    print(_table(["GPU", "count", "micro x accum", "precision", "checkpointing", "ZeRO", "peak / usable per GPU",
                  "samples/s"], rows))
    misses = [f for f in fits if f.plan is None and f.reason]
    if misses:
        print("\nWhy not:")
        for f in misses:
            print(f"  {f.gpu}: {f.reason}")
    print("\nsamples/s: the cost model's relative prediction for the whole job. "
          "`memguard plan --gpu NAME --world-size N` explains one row.")
    return EXIT_OK if any_fit else EXIT_INFEASIBLE


# ------------------------------------------------------------------------------------------
# Entry point
# ------------------------------------------------------------------------------------------


def _print_traceback(args: argparse.Namespace, exc: BaseException) -> None:
    """With --verbose, the traceback of ``exc`` (and of what caused it) on stderr, for debugging."""
    if args.verbose:
        sys.stdout.flush()
        traceback.print_exception(exc, file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 done, 1 nothing fits, 2 bad usage)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    restore_logging = _configure_logging(args.verbose)
    progress = _Progress(enabled=not args.quiet)
    hint = f"run `memguard {args.command} --help` for the options"
    try:
        return args.func(args, progress)
    except InfeasiblePlanError as exc:  # raised by a path that did not catch it (e.g. a cached plan)
        return _report_infeasible(args, exc)
    except UserCodeError as exc:
        if args.verbose and exc.__cause__ is not None:
            sys.stdout.flush()
            traceback.print_exception(exc.__cause__, file=sys.stderr)
            _fail(_problems_text(exc))
        else:
            _fail(f"{_problems_text(exc)} (--verbose shows the traceback)")
        return EXIT_USAGE
    except ConfigError as exc:
        _print_traceback(args, exc)
        foreign = exc.__cause__ is not None and not isinstance(exc.__cause__, MemguardError)
        _fail(_problems_text(exc), hint="--verbose shows the traceback" if foreign and not args.verbose else hint)
        return EXIT_USAGE
    except MemguardError as exc:
        _print_traceback(args, exc)
        _fail(str(exc))
        return EXIT_INFEASIBLE
    except KeyboardInterrupt:
        _fail("interrupted")
        return 130  # 128 + SIGINT, the shell's convention
    finally:
        restore_logging()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
