"""Plan a GPT-2 training job and write the DeepSpeed config that runs the plan.

No GPU and no download: the model is GPT-2 small's architecture built on the ``meta`` device, and
memguard plans for a GPU from its catalog. Runs on a CPU in well under a minute::

    python examples/deepspeed_config.py --gpu A10G --world-size 4 --global-batch-size 64 --out ds_config.json
    deepspeed train.py --deepspeed_config ds_config.json     # then, on the GPU machines

Options fix or restrict what memguard may choose (``--zero-stage 2``, ``--precision bf16-mixed``);
anything else in the config (optimizer, scheduler, clipping) is yours to add, e.g. with
``to_config(plan, gradient_clipping=1.0)``.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import memguard
from memguard.integrations.deepspeed import to_config


def gpt2_on_meta(seq_len: int) -> torch.nn.Module:
    """GPT-2 small (12 layers, hidden 768, 124M parameters), built without allocating memory."""
    import transformers

    config = transformers.AutoConfig.for_model("gpt2", n_positions=seq_len)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="A10G", help="GPU catalog name (see `memguard gpus`)")
    parser.add_argument("--world-size", type=int, default=4, help="data-parallel ranks")
    parser.add_argument("--global-batch-size", type=int, default=64, help="samples per optimizer step")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per sample")
    parser.add_argument("--zero-stage", type=int, default=None, help="fix the ZeRO stage (default: memguard chooses)")
    parser.add_argument("--precision", default=None,
                        help="fix the precision, e.g. bf16-mixed (default: memguard chooses)")
    parser.add_argument("--out", default=None, help="write the JSON here (default: print it only)")
    args = parser.parse_args(argv)

    # memguard.plan is the public entry point; memguard.planner._plan is the same function
    plan_fn = getattr(memguard, "plan", None)
    if plan_fn is None:
        from memguard.planner import _plan as plan_fn

    model = gpt2_on_meta(args.seq_len)
    tokens = torch.zeros(1, args.seq_len, dtype=torch.long, device="meta")
    try:
        plan = plan_fn(
            model,
            {"input_ids": tokens, "labels": tokens},  # one example sample; memguard sizes dim 0 itself
            global_batch_size=args.global_batch_size,
            gpu=args.gpu,
            world_size=args.world_size,
            zero_stage=args.zero_stage,
            precision=args.precision,
        )
    except memguard.InfeasiblePlanError as exc:
        print(exc, file=sys.stderr)
        return 1

    config = to_config(plan)
    print(plan.explain(), file=sys.stderr)
    if plan.activation_checkpointing:
        print(
            f"note: checkpoint the first {plan.checkpoint_blocks} blocks in the model itself "
            "(memguard.prepare does it); DeepSpeed's activation_checkpointing block only configures "
            "deepspeed.checkpointing",
            file=sys.stderr,
        )
    text = json.dumps(config, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
