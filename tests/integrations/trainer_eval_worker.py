"""An HF ``Trainer.evaluate``/``predict`` that really runs out of memory, for test_transformers.py.

Run as ``python trainer_eval_worker.py '<json config>'`` (under DDP once per rank, with ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set: the Trainer then runs a gloo
process group and each rank evaluates its share of the samples). A tiny GPT-2 (built from a config, nothing
downloaded) is trained for one optimizer step and then evaluated and asked to predict, twice from the
same initial weights: by a plain ``Trainer`` with no memory cap (the reference), then by a ``Trainer``
with :class:`MemguardCallback` (a plan that keeps the arguments' batch). In the guarded run a test
callback caps the address space with ``RLIMIT_AS`` (current VmSize plus ``budget_mib``) after the
first evaluation batch's prediction step (so every lazy initialisation has happened), and the cap
stays for ``evaluate`` and ``predict``; it is lifted before anything is compared. The evaluation
batch's logits (``eval_batch`` x ``seq`` x ``vocab`` fp32) and the loss's copies of them do not fit
under the cap; ``preprocess_logits_for_metrics`` keeps the token ids only, as an accuracy metric does.
The test sets ``MALLOC_ARENA_MAX=1`` and a fixed ``MALLOC_MMAP_THRESHOLD_`` (see trainer_worker.py).

Config keys: ``out``, ``seq``, ``vocab``, ``batch`` (training per-device batch), ``eval_batch``,
``eval_n`` (evaluation samples), ``eval_accum`` (``eval_accumulation_steps``), ``budget_mib``,
``cap_ranks`` (default ``[0]``), ``fsdp2`` (both Trainers shard the model with FSDP2 through Accelerate:
``fsdp="full_shard"``, ``fsdp_config`` version 2, each ``GPT2Block`` and the root ``fully_shard``-ed, see
trainer_worker.force_fsdp_on_cpu; the plan is an FSDP2 plan of sharding level 3), ``fsdp_version`` (with
``fsdp2``; 1: FSDP1's ``FullyShardedDataParallel`` around each ``GPT2Block`` and the root instead),
``deepspeed`` (a ZeRO stage: both Trainers run ``TrainingArguments(deepspeed=...)`` with
trainer_worker.deepspeed_config, on CPU processes through trainer_worker.deepspeed_backend_on_cpu; run with
``DS_ACCELERATOR=cpu``). Each rank writes ``result<rank>.json``. With ``eval_in_train``, both Trainers also
evaluate inside ``train()`` after its step (``eval_strategy="steps"``), and the cap comes after that
evaluation's first batch. With ``no_train``, neither Trainer trains: ``evaluate()`` comes first and prepares the
model itself (``evaluation_loop``: ``accelerator.prepare``, or ``deepspeed_init`` with ``inference=True`` under
ZeRO-3, an engine without an optimizer). ``eval_events`` lists what the guarded ``evaluate()`` ran on this rank, in
order: each forward's evaluation-sample indices, and ``"RETRY"`` for each halving memguard logged.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
from pathlib import Path

import numpy as np
import torch

from worker_common import vm_size  # noqa: E402 - this folder is on sys.path


def main() -> None:
    cfg = json.loads(sys.argv[1])
    out = Path(cfg["out"])
    torch.set_num_threads(1)
    import transformers
    from torch.utils.data import Dataset

    from memguard import Estimate, Plan
    from memguard.integrations.transformers import MemguardCallback

    fsdp2 = bool(cfg.get("fsdp2"))  # FSDP, of version fsdp_version
    fsdp_version = int(cfg.get("fsdp_version", 2))
    ds_stage = cfg.get("deepspeed")  # a ZeRO stage, or None
    sharded = fsdp2 or ds_stage is not None
    if fsdp2:
        from trainer_worker import force_fsdp_on_cpu
    ds_config = None
    if ds_stage is not None:
        from trainer_worker import deepspeed_backend_on_cpu, deepspeed_config

        deepspeed_backend_on_cpu()
        ds_config = deepspeed_config(ds_stage)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    messages: list[str] = []
    events: list = []  # see the module docstring

    class Recorder(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(f"{record.levelname}:{record.getMessage()}")
            if record.levelno >= logging.WARNING and "OOM in evaluation" in record.getMessage():
                events.append("RETRY")

    logging.getLogger("memguard").addHandler(Recorder())
    logging.getLogger("memguard").setLevel(logging.INFO)
    transformers.logging.set_verbosity_error()

    class Tokens(Dataset):
        def __init__(self, n: int, seed: int) -> None:
            g = torch.Generator().manual_seed(seed)
            self.ids = torch.randint(0, cfg["vocab"], (n, cfg["seq"]), generator=g)
            self.labels = self.ids.clone()
            self.labels[::3, : cfg["seq"] // 2] = -100  # every third sample has half its tokens unlabelled

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.ids[i], "labels": self.labels[i]}

    config = transformers.GPT2Config(vocab_size=cfg["vocab"], n_positions=cfg["seq"], n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    initial = transformers.GPT2LMHeadModel(config).state_dict()
    train, evaluation = Tokens(cfg["batch"], 1), Tokens(cfg["eval_n"], 2)

    def args(name: str) -> transformers.TrainingArguments:
        return transformers.TrainingArguments(
            output_dir=str(out / name), use_cpu=ds_config is None, report_to=[],
            **({"deepspeed": ds_config} if ds_config is not None else {}), per_device_train_batch_size=cfg["batch"],
            per_device_eval_batch_size=cfg["eval_batch"], eval_accumulation_steps=cfg["eval_accum"], max_steps=1,
            learning_rate=1e-3, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0,
            ddp_backend="gloo" if world > 1 else None,
            **({"eval_strategy": "steps", "eval_steps": 1} if cfg.get("eval_in_train") else {}),
            # FSDP1 without sync_module_states (its plugin looks for a GPU to broadcast on; every rank starts from the
            # same weights here anyway)
            **({"fsdp": "full_shard", "fsdp_config": {"version": fsdp_version,
                                                      "transformer_layer_cls_to_wrap": ["GPT2Block"],
                                                      **({"sync_module_states": "false"} if fsdp_version == 1 else {})}}
               if fsdp2 else {}))

    def model() -> transformers.GPT2LMHeadModel:
        m = transformers.GPT2LMHeadModel(config)
        m.load_state_dict(initial)
        return m

    def ids_only(logits, labels):
        return logits.argmax(-1)

    def accuracy(p) -> dict:
        pred, labels = p.predictions[:, :-1], p.label_ids[:, 1:]
        mask = labels != -100
        return {"accuracy": float((pred[mask] == labels[mask]).mean())}

    def trainer(name: str, callbacks: list) -> transformers.Trainer:
        made = transformers.Trainer(model=model(), args=args(name), train_dataset=train, eval_dataset=evaluation,
                                    compute_metrics=accuracy, preprocess_logits_for_metrics=ids_only,
                                    callbacks=callbacks)
        if fsdp2:
            force_fsdp_on_cpu(made)
        return made

    result: dict = {"error": None, "capped": False}
    plain = trainer("plain", [])
    if not cfg.get("no_train"):
        plain.train()
    result["plain_eval"] = plain.evaluate()
    plain_pred = plain.predict(evaluation)
    result["plain_predict"] = plain_pred.metrics

    stage = 3 if fsdp2 else ds_stage or 0  # fsdp="full_shard": FSDP2's sharding level 3
    est = Estimate(peak_bytes=4 << 20, breakdown={"params": 1 << 20, "activations": 3 << 20}, context_bytes=0,
                   peak_phase="backward", allocated_peak_bytes=4 << 20, device="cpu", precision="32-true",
                   zero_stage=stage, world_size=world, gpu=None, micro_batch_size=cfg["batch"])
    plan = Plan(micro_batch_size=cfg["batch"], grad_accum_steps=1, world_size=world,
                global_batch_size=cfg["batch"] * world,
                precision="32-true", activation_checkpointing=False, zero_stage=stage,
                strategy="deepspeed" if ds_stage else "fsdp2" if fsdp2 else "ddp", budget_bytes=1 << 30, estimate=est,
                device="cpu")
    callback = MemguardCallback(plan=plan)
    seen: list[int] = []

    class Cap(transformers.TrainerCallback):
        def on_prediction_step(self, args, state, control, **kwargs):
            if not result["capped"] and (cfg.get("eval_in_train") or not guarded.is_in_train) and rank in cfg.get("cap_ranks", [0]):
                limit = vm_size() + (cfg["budget_mib"] << 20)
                resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
                result["capped"] = True

    guarded = trainer("guarded", [callback, Cap()])
    # an evaluation sample is known by its first 16 tokens (random ids out of 4096: distinct)
    index = {tuple(evaluation.ids[i, :16].tolist()): i for i in range(len(evaluation))}
    assert len(index) == len(evaluation)

    def record(module, a, kw) -> None:
        seen.append(int(kw["input_ids"].shape[0]))
        events.append([index.get(tuple(r[:16].tolist()), -1) for r in kw["input_ids"]])

    guarded.model.register_forward_pre_hook(record, with_kwargs=True)
    if not cfg.get("no_train"):
        guarded.train()
    result["train_micro"] = [callback.micro_batch_size, callback.oom_retries]
    if cfg.get("eval_in_train"):
        result["train_eval_forwards"] = list(seen)
        result["train_eval"] = [h for h in guarded.state.log_history if "eval_loss" in h]
        result["plain_train_eval"] = [h for h in plain.state.log_history if "eval_loss" in h]
    seen.clear()
    events.clear()
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    guarded_pred = None
    try:
        result["guarded_eval"] = guarded.evaluate()
        result["eval_forwards"] = list(seen)
        result["eval_events"] = list(events)
        guarded_pred = guarded.predict(evaluation)
        result["guarded_predict"] = guarded_pred.metrics
    except Exception as exc:  # reported to the test
        result["error"] = {"type": type(exc).__name__, "message": str(exc)[:3000]}
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    result.update(messages=messages, eval_oom_retries=callback.eval_oom_retries,
                  train_micro_after=[callback.micro_batch_size, callback.oom_retries])
    if guarded_pred is not None:
        result["predictions_equal"] = bool(np.array_equal(plain_pred.predictions, guarded_pred.predictions))
        result["label_ids_equal"] = bool(np.array_equal(plain_pred.label_ids, guarded_pred.label_ids))
    # the whole evaluation batch really does not fit under this cap (a plain forward with the loss); not under FSDP or
    # DeepSpeed, where a rank that fails in that forward would leave its peers in the next all-gather (the retries'
    # messages name the allocator's error there)
    if sharded:
        result["rank"] = rank
        (out / f"result{rank}.json").write_text(json.dumps(result, default=float))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    batch = {"input_ids": evaluation.ids[: cfg["eval_batch"]], "labels": evaluation.labels[: cfg["eval_batch"]]}
    resource.setrlimit(resource.RLIMIT_AS, (vm_size() + (cfg["budget_mib"] << 20), hard))
    try:
        with torch.no_grad():
            guarded.model(**batch)
        result["whole_fits"] = True
    except RuntimeError as exc:
        result["whole_fits"], result["whole_error"] = False, str(exc).splitlines()[0]
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    result["rank"] = rank
    (out / f"result{rank}.json").write_text(json.dumps(result, default=float))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
