"""Evaluation through Accelerate's FSDP1 and DeepSpeed plugins with a real OOM on one rank, for test_accelerate.py.

Run by ``torchrun`` on 2 processes as ``python accelerate_eval_worker.py '<json config>'``. Each rank builds a CPU
``accelerate.Accelerator`` whose plugin is forced onto the CPU processes as on GPUs
(:func:`accelerate_worker.force_fsdp_on_cpu`, :func:`accelerate_worker.force_deepspeed_ranks_on_cpu`), lets
``accelerator.prepare`` wrap the model (FSDP1 ``FullyShardedDataParallel``, ``FULL_SHARD``, each ``Linear`` a unit)
or build the DeepSpeed engine, and evaluates a batch of ``sizes[rank]`` samples of its own:

1. the uncapped, unsplit forward of the prepared model under ``torch.no_grad()`` (every rank at once: FSDP1's and
   ZeRO-3's forwards all-gather parameters), the reference;
2. the ranks in ``cap_ranks`` capped with ``RLIMIT_AS`` at VmSize + ``budget_mib``, then
   :func:`memguard.integrations.accelerate.evaluate` of the same batch (per-sample predictions and the mean loss);
3. the cap lifted, the two compared.

Config keys: ``out``, ``seq``, ``sizes`` (samples per rank), ``cap_ranks``, ``budget_mib`` and either ``fsdp1``
(``{"use_orig_params": bool}``) or ``deepspeed`` (a ZeRO stage; run with ``DS_ACCELERATOR=cpu``; ``offload_param``
adds ZeRO-3's parameter offload to the host, which the evaluation refuses). Each rank writes
``result<rank>.json``: error, messages, the evaluation's retries, forwards, padding forwards and micro-batch, and
the largest absolute and relative differences from the reference.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
import time
import traceback
from pathlib import Path

import torch

from accelerate_worker import force_deepspeed_ranks_on_cpu, force_fsdp_on_cpu  # this folder is on sys.path
from worker_common import LR, Net, vm_size


def _accelerator(cfg: dict):
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin

    if cfg.get("fsdp1") is not None:
        plugin = FullyShardedDataParallelPlugin(fsdp_version=1, sharding_strategy="FULL_SHARD",
                                                use_orig_params=cfg["fsdp1"]["use_orig_params"],
                                                auto_wrap_policy="transformer_based_wrap",
                                                transformer_cls_names_to_wrap=["Linear"])
        accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
        force_fsdp_on_cpu(accelerator, plugin)
        return accelerator
    stage = cfg["deepspeed"]
    zero: dict = {"stage": stage, "reduce_bucket_size": 500_000}
    if stage == 3:  # gather every parameter (DeepSpeed keeps parameters under 1e5 elements whole)
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=0)
    if cfg.get("offload_param"):  # what memguard's evaluation refuses (the reason names offload_param)
        zero["offload_param"] = {"device": "cpu"}
    # no clipping (DeepSpeed clips at 1.0 when the key is absent, runtime/constants.py), the torch optimizer allowed
    config = {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
              "zero_allow_untested_optimizer": True, "zero_optimization": zero}
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    force_deepspeed_ranks_on_cpu(accelerator)
    return accelerator


def main() -> None:
    cfg = json.loads(sys.argv[1])
    out = Path(cfg["out"])
    torch.set_num_threads(1)
    from memguard.guard._evaluate import eval_status
    from memguard.integrations.accelerate import evaluate

    rank = int(os.environ["RANK"])
    messages: list[str] = []

    class Recorder(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(f"{record.levelname}:{record.getMessage()}")

    logging.getLogger("memguard").addHandler(Recorder())
    logging.getLogger("memguard").setLevel(logging.INFO)

    accelerator = _accelerator(cfg)
    torch.manual_seed(0)
    net = Net()
    model, _ = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=LR))
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(cfg["sizes"][rank], cfg["seq"], 16, generator=g)
    y = torch.randn(len(x), generator=g)

    def pred_and_loss(m, v: dict) -> dict:
        pred = m(v["x"])
        return {"pred": pred, "loss": ((pred - v["y"]) ** 2).mean()}

    model.eval()
    with torch.no_grad():  # the reference: every rank's unsplit forward at once, uncapped
        reference = pred_and_loss(model, {"x": x, "y": y})
    model.train()
    kind = accelerator.distributed_type
    result: dict = {"error": None, "rank": rank, "kind": str(getattr(kind, "value", kind))}
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    capped = rank in cfg["cap_ranks"]
    got = None
    if capped:
        resource.setrlimit(resource.RLIMIT_AS, (vm_size() + (cfg["budget_mib"] << 20), hard))
    started = time.perf_counter()
    try:
        got = evaluate(accelerator, model, {"x": x, "y": y}, pred_and_loss)
    except Exception as exc:  # reported to the test
        result["error"] = {"type": type(exc).__name__, "message": str(exc)[:3000],
                           "traceback": traceback.format_exc()[-4000:]}
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    st = eval_status(model)
    result.update(capped=capped, seconds=time.perf_counter() - started, messages=messages,
                  retries=[m for m in messages if m.startswith("WARNING") and "OOM in evaluation" in m],
                  oom_retries=st.oom_retries, forwards=st.forwards, padding_forwards=st.padding_forwards,
                  micro=list(st.micro_batch_size.values()), training=model.training)
    if got is not None:
        pred, ref = got["pred"], reference["pred"]
        result.update(shape=list(pred.shape), reference_shape=list(ref.shape),
                      max_abs=float((pred - ref).abs().max()),
                      max_rel=float(((pred - ref).abs() / ref.abs().clamp_min(1e-12)).max()),
                      loss=float(got["loss"]), ref_loss=float(reference["loss"]))
    (out / f"result{rank}.json").write_text(json.dumps(result))
    # Leave without interpreter teardown: with gloo, destroying the process group while a gloo worker
    # thread still releases a finished work's tensors can deadlock at exit (tests/guard/oom_worker.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
