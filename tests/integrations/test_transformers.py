"""memguard.integrations.transformers.apply with the real TrainingArguments (and Trainer) on CPU."""

from __future__ import annotations

import dataclasses
import gc
import json
import logging

import pytest
import torch

import memguard
from memguard import ConfigError, Estimate, Plan
from memguard.integrations.deepspeed import to_config

transformers = pytest.importorskip("transformers")
from memguard.integrations.transformers import apply  # noqa: E402

DeepSpeedConfig = pytest.importorskip("deepspeed.runtime.config").DeepSpeedConfig


def make_plan(**kw) -> Plan:
    world = kw.pop("world_size", 1)
    micro = kw.pop("micro_batch_size", 2)
    accum = kw.pop("grad_accum_steps", 4)
    est = Estimate(
        peak_bytes=1 << 30, breakdown={"params": 1 << 30}, context_bytes=0, peak_phase="backward",
        allocated_peak_bytes=1 << 30, device="cuda", precision=kw.get("precision", "32-true"),
        zero_stage=kw.get("zero_stage", 0), world_size=world, gpu=None, micro_batch_size=micro,
    )
    base = dict(
        micro_batch_size=micro, grad_accum_steps=accum, world_size=world, global_batch_size=micro * accum * world,
        precision="32-true", activation_checkpointing=False, zero_stage=0, budget_bytes=2 << 30, estimate=est,
        hidden_size=32,
    )
    base.update(kw)
    return Plan(**base)


@pytest.fixture
def args(tmp_path):
    # use_cpu=True: without it TrainingArguments refuses bf16 on a machine with no bf16 GPU
    a = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none",
                                       per_device_train_batch_size=8, gradient_accumulation_steps=1,
                                       max_grad_norm=0.5, learning_rate=3e-4)
    yield a
    del a
    gc.collect()  # drops transformers' weak reference to any DeepSpeed config (it enables ZeRO-3 init)


def test_sets_batch_accumulation_precision_checkpointing(args):
    plan = make_plan(micro_batch_size=2, grad_accum_steps=4, precision="bf16-mixed", activation_checkpointing=True,
                     checkpoint_blocks=2)
    new = apply(args, plan)
    assert isinstance(new, transformers.TrainingArguments) and new is not args
    assert (new.per_device_train_batch_size, new.gradient_accumulation_steps) == (2, 4)
    assert new.bf16 is True and new.fp16 is False
    assert new.gradient_checkpointing is True
    assert getattr(new, "activation_checkpointing", True) is True  # the newer name, where it exists
    assert new.deepspeed is None
    # the user's other settings survive, the original is untouched
    assert new.learning_rate == 3e-4 and new.use_cpu is True
    assert (args.per_device_train_batch_size, args.bf16, args.gradient_checkpointing) == (8, False, False)


def test_checkpointing_off_when_the_plan_needs_none(tmp_path):
    names = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    flag = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    a = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **{flag: True})
    assert a.gradient_checkpointing is True
    new = apply(a, make_plan(activation_checkpointing=False))
    assert new.gradient_checkpointing is False
    assert getattr(new, "activation_checkpointing", False) is False


@pytest.mark.parametrize(
    "precision,bf16,fp16",
    [
        ("32-true", False, False),  # fp32: no autocast
        ("16-mixed", False, True),  # fp16 autocast + grad scaler
        ("bf16-mixed", True, False),  # bf16 autocast
        ("bf16-true", False, False),  # no TrainingArguments flag without ZeRO: the model's dtype decides
    ],
)
def test_precision_flags(args, precision, bf16, fp16):
    new = apply(args, make_plan(precision=precision))
    assert (new.bf16, new.fp16) == (bf16, fp16)


def test_true_precision_without_zero_warns_about_the_model_dtype(args, caplog):
    with caplog.at_level(logging.WARNING, logger="memguard"):
        apply(args, make_plan(precision="bf16-true"))
    assert "torch.bfloat16" in caplog.text


def test_zero_plan_writes_a_deepspeed_config_the_trainer_accepts(args):
    plan = make_plan(zero_stage=2, precision="bf16-mixed")
    new = apply(args, plan)
    expected = to_config(plan, gradient_clipping="auto")
    assert new.deepspeed == expected
    # transformers parsed it at construction and filled its own "auto" values from the arguments
    hf = new.hf_deepspeed_config.config
    assert hf["gradient_clipping"] == 0.5  # max_grad_norm
    triple = (hf["train_batch_size"], hf["train_micro_batch_size_per_gpu"], hf["gradient_accumulation_steps"])
    assert triple == (8, 2, 4)
    ds = DeepSpeedConfig(hf)
    assert ds.zero_optimization_stage == 2 and ds.bfloat16_config.enabled and ds.gradient_clipping == 0.5


def test_offload_adds_a_deepspeed_optimizer_filled_by_the_trainer(args):
    new = apply(args, make_plan(zero_stage=3, precision="bf16-mixed", offload_optimizer=True))
    hf = new.hf_deepspeed_config.config
    assert hf["optimizer"]["type"] == "AdamW"
    assert hf["optimizer"]["params"]["lr"] == 3e-4  # learning_rate, filled by transformers
    assert hf["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    DeepSpeedConfig(hf)


def test_bf16_true_under_zero_sets_bf16(args):
    new = apply(args, make_plan(zero_stage=1, precision="bf16-true"))
    assert new.bf16 is True  # must agree with the bf16 block, or transformers reports a mismatch
    assert new.deepspeed["bf16"]["bf16_master_weights_and_grads"] is True


def test_existing_deepspeed_config_is_filled_not_replaced(args, tmp_path):
    user = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "zero_optimization": {"stage": "auto", "overlap_comm": True},
        "bf16": {"enabled": "auto"},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(user))
    for given in (user, str(path)):
        with_ds = transformers.TrainingArguments(output_dir=str(tmp_path / "o"), use_cpu=True, report_to="none",
                                                 deepspeed=given)
        new = apply(with_ds, make_plan(zero_stage=2, precision="bf16-mixed"))
        assert new.deepspeed["zero_optimization"] == {"stage": 2, "overlap_comm": True}
        assert new.deepspeed["scheduler"] == user["scheduler"]
        assert new.deepspeed["train_micro_batch_size_per_gpu"] == 2 and new.bf16 is True
        del with_ds, new
        gc.collect()


def test_existing_deepspeed_config_that_contradicts_the_plan(args, tmp_path):
    with_ds = transformers.TrainingArguments(output_dir=str(tmp_path / "o"), use_cpu=True, report_to="none",
                                             deepspeed={"train_micro_batch_size_per_gpu": 8,
                                                        "zero_optimization": {"stage": 3}})
    with pytest.raises(ConfigError) as info:
        apply(with_ds, make_plan(zero_stage=2))
    assert len(info.value.problems) == 2
    del with_ds
    gc.collect()


def test_world_size_must_match(args):
    # a single CPU process: TrainingArguments.world_size is 1
    with pytest.raises(ConfigError, match="2 data-parallel rank.*on 1"):
        apply(args, make_plan(world_size=2))


def test_problems_are_listed_together(args):
    with pytest.raises(ConfigError) as info:
        apply(args, make_plan(world_size=2, zero_stage=2, precision="16-true"))
    assert len(info.value.problems) == 2


def test_not_training_arguments(args):
    with pytest.raises(ConfigError, match="TrainingArguments"):
        apply({"per_device_train_batch_size": 8}, make_plan())
    with pytest.raises(ConfigError, match="memguard.Plan"):
        apply(args, {"micro_batch_size": 2})


def test_subclass_is_kept(tmp_path):
    a = transformers.Seq2SeqTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                                              predict_with_generate=True)
    new = apply(a, make_plan())
    assert type(new) is transformers.Seq2SeqTrainingArguments and new.predict_with_generate is True


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_transformers_refusal_becomes_a_config_error(tmp_path):
    # without use_cpu=True, TrainingArguments itself refuses bf16 when no bf16 GPU is present
    a = transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none")
    with pytest.raises(ConfigError, match="use_cpu"):
        apply(a, make_plan(precision="bf16-mixed"))


def test_trainer_runs_the_plan(args):
    cfg = transformers.AutoConfig.for_model("gpt2", n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    plan = make_plan(micro_batch_size=2, grad_accum_steps=2, precision="bf16-mixed", activation_checkpointing=True)
    new = apply(transformers.TrainingArguments(output_dir=args.output_dir, use_cpu=True, report_to="none",
                                               max_steps=1, save_strategy="no", logging_strategy="no"), plan)
    data = [{"input_ids": torch.randint(0, 64, (8,)), "labels": torch.randint(0, 64, (8,))} for _ in range(8)]
    forwards = []
    model.register_forward_hook(lambda mod, args, kwargs, out: forwards.append(kwargs["input_ids"].shape[0]),
                                with_kwargs=True)
    trainer = transformers.Trainer(model=model, args=new, train_dataset=data)
    trainer.train()
    # one optimizer step = accumulation 2 forwards of the plan's micro-batch 2
    assert trainer.state.global_step == 1
    assert forwards == [2, 2]
    assert trainer.accelerator.mixed_precision == "bf16"
    # the newer name where it exists (the old one is a deprecated alias there)
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing


# --------------------------------------------------------------------------------------------------
# MemguardCallback with the real Trainer

import os  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from torch.utils.data import Dataset  # noqa: E402

from memguard.integrations.transformers import MemguardCallback  # noqa: E402

WORKER = Path(__file__).with_name("trainer_worker.py")
ROOT = Path(__file__).resolve().parents[2]
WORKER_TIMEOUT_S = 240


class Tokens(Dataset):
    def __init__(self, n: int, seq: int = 16, vocab: int = 128) -> None:
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread while a test trains: the tiny models gain nothing from more, and on a shared 2-core
    machine several threads per process mostly wait for each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_gpt2():
    config = transformers.GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def trainer_args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], per_device_train_batch_size=8,
                gradient_accumulation_steps=2, max_steps=2, save_strategy="no", disable_tqdm=True, logging_steps=1)
    base.update(kw)
    return transformers.TrainingArguments(**base)


def test_callback_plans_applies_and_trains_like_the_plain_trainer(tmp_path):
    # A 1.3 MiB budget on the CPU target, where this model's step at micro-batch 8 is predicted at about 1.6 MiB
    # (16 samples: 2.7 MiB, 2.1 of them activations): the planner must split the per-device batch of 8, so the
    # plan differs from the arguments, while keeping the global batch of 8 x 2 = 16.
    args = trainer_args(tmp_path)
    callback = MemguardCallback(budget_bytes=1300 << 10, activation_checkpointing=False)
    trainer = transformers.Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(32), callbacks=[callback])
    plan = callback.plan
    assert plan is not None and plan.precision == "32-true" and plan.world_size == 1
    assert plan.micro_batch_size * plan.grad_accum_steps == 16  # the global batch is unchanged
    assert plan.micro_batch_size < 8, plan.explain()
    assert trainer.args.per_device_train_batch_size == plan.micro_batch_size
    assert trainer.args.gradient_accumulation_steps == plan.grad_accum_steps
    assert args.per_device_train_batch_size == 8  # the user's object is untouched
    trainer.train()
    assert "training_step" not in trainer.__dict__  # restored at on_train_end
    # The same two optimizer steps by the plain Trainer on the arguments' batch: the weights agree up to the
    # summation order of the smaller micro-batches.
    plain = transformers.Trainer(model=tiny_gpt2(), args=trainer_args(tmp_path), train_dataset=Tokens(32))
    plain.train()
    for (name, a), b in zip(trainer.model.state_dict().items(), plain.model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_callback_plans_the_step_without_the_decoder_cache_the_trainer_turns_off(tmp_path):
    # The Trainer sets config.use_cache = args.use_cache (False) right after the callbacks' on_init_end; GPT-2's
    # config says True, and a trace with it builds the key/value cache the Trainer's steps never build.
    model = tiny_gpt2()
    assert model.config.use_cache is True
    callback = MemguardCallback(budget_bytes=1 << 30, activation_checkpointing=False)
    trainer = transformers.Trainer(model=model, args=trainer_args(tmp_path, per_device_train_batch_size=4,
                                                                  gradient_accumulation_steps=1),
                                   train_dataset=Tokens(32), callbacks=[callback])
    plan = callback.plan
    assert plan.micro_batch_size == 4 and plan.grad_accum_steps == 1, plan.explain()
    assert trainer.model.config.use_cache is False  # the Trainer's own setting, after the plan
    batch = {k: torch.stack([Tokens(32)[i][k] for i in range(4)]) for k in Tokens(32)[0]}
    with_cache = memguard.estimate(tiny_gpt2(), batch, device="cpu", activation_checkpointing=False)
    no_cache = tiny_gpt2()
    no_cache.config.use_cache = False
    without = memguard.estimate(no_cache, batch, device="cpu", activation_checkpointing=False)
    assert with_cache.peak_bytes > without.peak_bytes  # the cache is what the plan must leave out
    assert plan.estimate.peak_bytes == without.peak_bytes, (plan.estimate.peak_bytes, without.peak_bytes)


def test_callback_constrains_the_plan_to_the_arguments_precision(tmp_path):
    from memguard.integrations.transformers import _constraints

    args = trainer_args(tmp_path, bf16=True)
    # TrainingArguments(bf16=True) runs bf16 autocast: memguard plans for exactly that
    assert _constraints(args, tiny_gpt2()).planning_options({})["precision"] == "bf16-mixed"
    # bf16 weights without a flag: the Trainer trains them as they are
    assert _constraints(trainer_args(tmp_path), tiny_gpt2().to(torch.bfloat16)).precisions == ("bf16-true",)
    with pytest.raises(ConfigError, match="bf16-mixed"):  # a plan for another precision is refused
        transformers.Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(32),
                             callbacks=[MemguardCallback(plan=make_plan(micro_batch_size=8, grad_accum_steps=2))])
    with pytest.raises(ConfigError, match="bf16-mixed"):  # so is asking for another one
        transformers.Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(32),
                             callbacks=[MemguardCallback(budget_bytes=1 << 30, precision="32-true")])


def test_callback_refuses_what_it_cannot_guard(tmp_path):
    args = trainer_args(tmp_path, auto_find_batch_size=True)
    with pytest.raises(ConfigError) as info:
        transformers.Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(32),
                             callbacks=[MemguardCallback(plan=make_plan(world_size=2, micro_batch_size=8,
                                                                        grad_accum_steps=1))])
    text = str(info.value)
    # both problems, listed together: the Trainer's own batch halving, and a plan for 2 ranks on 1
    assert "auto_find_batch_size" in text and "world_size=1" in text, text


def test_callback_options_are_checked_at_construction():
    with pytest.raises(ConfigError) as info:
        MemguardCallback(max_retries=-1, device="cpu", guard_oom="yes")
    assert len(info.value.problems) == 3


def test_callback_added_after_construction_is_refused(tmp_path):
    trainer = transformers.Trainer(model=tiny_gpt2(), args=trainer_args(tmp_path), train_dataset=Tokens(32))
    trainer.add_callback(MemguardCallback(budget_bytes=1 << 30))
    with pytest.raises(ConfigError, match="constructor"):
        trainer.train()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(tmp_path, world: int, **cfg) -> list[dict]:
    config = {"out": str(tmp_path), "batch": 8, "accum": 2, "steps": 2, "seq": 64, "vocab": 4096,
              "cap_step": 1, "eval_oom": False, **cfg}
    # MALLOC_ARENA_MAX=1: one malloc arena however many threads (gloo, the Trainer) allocate, so the cap is
    # reproducible; a fixed MALLOC_MMAP_THRESHOLD_ maps every tensor above 64 KiB on its own and unmaps it when
    # freed, so VmSize follows the live tensors (mallopt(3)).
    env = {**os.environ, "MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(WORKER.parent), str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    if cfg.get("deepspeed") is not None:
        env["DS_ACCELERATOR"] = "cpu"  # DeepSpeed's CPU accelerator and its shm comm op (tests/deepspeed_op.py)
    procs = []
    for rank in range(world):
        rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)} if world > 1 else env
        procs.append(subprocess.Popen([sys.executable, str(WORKER), json.dumps(config)], env=rank_env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=WORKER_TIMEOUT_S)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    results = []
    for rank in range(world):
        path = tmp_path / f"result{rank}.json"
        assert path.exists(), "\n".join(o[-3000:] for o in outputs)
        results.append(json.loads(path.read_text()))
    return results


def assert_weights_equal(tmp_path, rank: int) -> None:
    plain = torch.load(tmp_path / f"plain{rank}.pt")
    guarded = torch.load(tmp_path / f"guarded{rank}.pt")
    for name, a in plain.items():
        # the retried step sums micro-batches of 4 instead of one batch of 8: equal up to float32 rounding
        torch.testing.assert_close(guarded[name], a, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_real_oom_in_training_halves_and_keeps_the_trainers_step(tmp_path):
    # 22 MiB over the VmSize at the start of step 2: the micro-batch of 8 samples x 64 tokens x 4096-entry
    # vocabulary needs 8 MiB for its logits alone and several such buffers through the loss and its backward,
    # so it fails; 4 samples fit (measured: one halving).
    (r,) = run_workers(tmp_path, 1, budget_mib=22, cap_ranks=[0], eval_oom=True)
    assert r["error"] is None and r["capped"], r
    assert r["oom_retries"] >= 1 and r["micro_batch_size"] <= 4
    assert any("out of memory at micro-batch 8" in m for m in r["messages"]), r["messages"]
    assert not r["patched_left"]
    assert_weights_equal(tmp_path, 0)
    # the Trainer's logging saw the same losses, gradient norms and learning rates (scheduler steps)
    for a, b in zip(r["plain_logs"], r["guarded_logs"], strict=True):
        assert a["learning_rate"] == b["learning_rate"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    # an evaluation whose every forward runs out of memory is halved down to one sample, then raises memguard's
    # error; the training micro-batch stays as it was
    assert r["eval_error"] == "OOMRecoveryError"
    assert any("OOM in evaluation at micro-batch 2" in m and "training micro-batch unchanged" in m
               for m in r["messages"]), r["messages"]
    assert (r["micro_batch_after_eval"], r["oom_retries_after_eval"]) == (r["micro_batch_size"], r["oom_retries"])


@pytest.mark.slow
def test_real_oom_on_one_ddp_rank_retries_on_both(tmp_path):
    # Only rank 0 is capped; rank 1 has memory to spare but must retry the same step with it, or the
    # ranks' gradients would be averaged over different micro-batch splits at different times.
    # memguard plans here (rank 0 plans, both apply): the whole local batch of 8 x 2 samples in one micro-batch
    results = run_workers(tmp_path, 2, budget_mib=22, cap_ranks=[0], plan="planner")
    for r in results:
        assert r["error"] is None, r
        assert r["plan"] == [16, 1] and r["trainer_batch"] == [16, 1], r
        # the 22 MiB cap fails micro-batches of 16 and 8 (see the single-process test); 4 fits
        assert r["oom_retries"] >= 1 and r["micro_batch_size"] <= 4, r
        assert not r["patched_left"]
    assert results[0]["capped"] and not results[1]["capped"]
    for rank in range(2):
        assert_weights_equal(tmp_path, rank)


@pytest.fixture
def fresh_accelerate_state():
    """Accelerate keeps one process-wide state and refuses a DeepSpeed plugin for a second Accelerator; the
    Trainer's own hyper-parameter search resets it the same way (trainer.py, _hp_search_setup)."""
    from accelerate.state import AcceleratorState

    def reset() -> None:
        AcceleratorState._reset_state(reset_partial_state=True)

    # Accelerate's DeepSpeed set-up leaves ACCELERATE_USE_DEEPSPEED=true in the environment, which would give
    # every later Accelerator (and Trainer) in this process a DeepSpeed plugin
    saved = dict(os.environ)
    reset()
    yield reset
    reset()
    os.environ.clear()
    os.environ.update(saved)
    gc.collect()  # drops transformers' weak reference to the DeepSpeed config (it enables ZeRO-3 init)


def test_callback_under_deepspeed_keeps_the_zero_stage_and_refills_the_config(tmp_path, fresh_accelerate_state):
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
          "zero_optimization": {"stage": 2}}
    args = trainer_args(tmp_path, deepspeed=ds)
    # a plan for another ZeRO stage than the config's is refused
    with pytest.raises(ConfigError, match="ZeRO stage 3"):
        transformers.Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(32),
                             callbacks=[MemguardCallback(plan=make_plan(zero_stage=3, micro_batch_size=4,
                                                                        grad_accum_steps=4))])
    fresh_accelerate_state()
    callback = MemguardCallback(plan=make_plan(zero_stage=2, micro_batch_size=4, grad_accum_steps=4))
    trainer = transformers.Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(32), callbacks=[callback])
    # what DeepSpeed will be initialised with: the plan's batch, DeepSpeed's rule train = micro x accum x world
    config = trainer.accelerator.state.deepspeed_plugin.deepspeed_config
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"],
            config["train_batch_size"]) == (4, 4, 16)
    assert trainer.args.hf_deepspeed_config.config is config
    # a config that fixes the micro-batch leaves memguard nothing to set, and one without a ZeRO stage leaves
    # nothing to plan for (the Trainer does not fill the stage): both are listed together
    fixed = {**ds, "train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": "auto"}}
    fresh_accelerate_state()
    with pytest.raises(ConfigError) as info:
        transformers.Trainer(model=tiny_gpt2(), args=trainer_args(tmp_path, deepspeed=fixed), train_dataset=Tokens(32),
                             callbacks=[MemguardCallback(budget_bytes=1 << 30)])
    assert "fixes train_micro_batch_size_per_gpu" in str(info.value)
    assert "zero_optimization.stage is 'auto'" in str(info.value)


class _OOMAbove:
    """The model's forward raises CUDA's out-of-memory error for more than ``limit`` samples (the real allocator's
    errors are the worker tests'; this one runs in-process and pins the loss arithmetic of the split)."""

    def __init__(self, model, limit: int) -> None:
        self.forward, self.limit, self.raised = model.forward, limit, 0
        self.__wrapped__ = model.forward  # the Trainer keeps the dataset columns this signature names

    def __call__(self, *args, **kwargs):
        if kwargs["input_ids"].shape[0] > self.limit:
            self.raised += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (in a test)")
        return self.forward(*args, **kwargs)


@pytest.mark.parametrize("num_items", [True, False])
def test_split_keeps_the_trainers_loss_scaling(tmp_path, num_items):
    # num_items=True: the Trainer counts the step's label tokens (num_items_in_batch) and the model divides its
    # summed loss by them, so micro-batch losses add up as they are. False: each batch's loss is a mean that the
    # Trainer divides by the accumulation, and memguard weights each micro-batch by its share of samples.
    def run(guarded: bool):
        model = tiny_gpt2()
        callbacks = [MemguardCallback(plan=make_plan(micro_batch_size=8, grad_accum_steps=2, world_size=1))] \
            if guarded else []
        trainer = transformers.Trainer(model=model, args=trainer_args(tmp_path, max_grad_norm=0.5, logging_steps=1),
                                       train_dataset=Tokens(32), callbacks=callbacks)
        trainer.model_accepts_loss_kwargs = num_items  # GPT-2's forward takes **kwargs and passes them to its loss
        if guarded:
            model.forward = _OOMAbove(model, 3)
        trainer.train()
        return trainer, callbacks, model

    guarded, (callback,), model = run(True)
    plain, _, _ = run(False)
    # 8 -> 4 -> 2 in the first step's first batch, then every batch runs in micro-batches of 2
    assert callback.micro_batch_size == 2 and callback.oom_retries == 2 and model.forward.raised == 2
    for (name, a), b in zip(guarded.model.state_dict().items(), plain.model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    logs = [(h["loss"], h["grad_norm"], h["learning_rate"]) for h in guarded.state.log_history if "loss" in h]
    want = [(h["loss"], h["grad_norm"], h["learning_rate"]) for h in plain.state.log_history if "loss" in h]
    assert len(logs) == len(want) == 2
    for (loss, norm, lr), (loss0, norm0, lr0) in zip(logs, want):
        assert loss == pytest.approx(loss0, rel=1e-5) and norm == pytest.approx(norm0, rel=1e-4) and lr == lr0


EVAL_WORKER = Path(__file__).with_name("trainer_eval_worker.py")


def run_eval_workers(tmp_path, world: int, **cfg) -> list[dict]:
    config = {"out": str(tmp_path), "seq": 64, "vocab": 4096, "batch": 8, "eval_batch": 32, "eval_accum": 2,
              "budget_mib": 56, **cfg}
    env = {**os.environ, "MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(WORKER.parent), str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    if cfg.get("deepspeed") is not None:
        env["DS_ACCELERATOR"] = "cpu"  # DeepSpeed's CPU accelerator and its shm comm op (tests/deepspeed_op.py)
    procs = [subprocess.Popen([sys.executable, str(EVAL_WORKER), json.dumps(config)],
                              env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)} if world > 1 else env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for rank in range(world)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=WORKER_TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        pytest.fail(f"the Trainer's evaluation did not finish within {WORKER_TIMEOUT_S} s: the ranks hung")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank in range(world):
        assert (tmp_path / f"result{rank}.json").exists(), "\n".join(o[-3000:] for o in outputs)
    return [json.loads((tmp_path / f"result{rank}.json").read_text()) for rank in range(world)]


@pytest.mark.slow
@pytest.mark.cpu_truth
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux")
def test_real_oom_in_evaluate_and_predict_halves_the_eval_batch(tmp_path):
    """Trainer.evaluate and predict of a tiny GPT-2 under a 56 MiB cap (see trainer_eval_worker.py): an
    evaluation batch of 32 x 64 tokens x a 4096-entry vocabulary has 32 MiB of logits, and the loss copies them,
    so the whole batch fails (measured: it fits from 66 MiB); halved to 16 the first piece fits and the 32 MiB
    joined logits are allocated next to it, the second 16 fails beside them and 8 fits (measured: works from 46
    to 62 MiB; under 42 the joined logits do not fit and memguard says so)."""
    (r,) = run_eval_workers(tmp_path, 1, eval_n=96)
    assert r["error"] is None and r["capped"], r["error"]
    assert r["whole_fits"] is False and "can't allocate memory" in r["whole_error"]  # a real OOM
    # the first batch ran whole before the cap; the second failed at 32, ran 16, failed at 16 beside the joined
    # logits, ran 8 and 8; the third starts from the 8 remembered: every sample once in the final attempts
    assert r["eval_forwards"] == [32, 32, 16, 16, 8, 8, 8, 8, 8, 8], r["eval_forwards"]
    assert r["eval_oom_retries"] == 2
    halvings = [m for m in r["messages"] if m.startswith("WARNING") and "OOM in evaluation" in m]
    assert len(halvings) == 2 and "halving to 16" in halvings[0] and "halving to 8" in halvings[1], halvings
    # metrics equal the unsplit run: the loss (labelled-token weights: every third sample has half its tokens
    # unlabelled) and the accuracy from every predicted token, over eval_accumulation_steps=2
    for key in ("eval_loss", "eval_accuracy"):
        assert r["guarded_eval"][key] == pytest.approx(r["plain_eval"][key], rel=1e-6), key
    for key in ("test_loss", "test_accuracy"):
        assert r["guarded_predict"][key] == pytest.approx(r["plain_predict"][key], rel=1e-6), key
    assert r["predictions_equal"] and r["label_ids_equal"]
    # the training micro-batch is the evaluation's own business no more
    assert r["train_micro"] == r["train_micro_after"] == [8, 0]


@pytest.mark.slow
@pytest.mark.cpu_truth
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux")
def test_real_oom_in_evaluate_on_one_ddp_rank(tmp_path):
    """Two gloo ranks, 96 evaluation samples each in batches of 32, rank 1 alone under the 56 MiB cap: it
    splits its batches while rank 0 runs them whole, and both meet in the Trainer's gathers (and in the
    labelled-token count the loss is normalised by, taken once per batch) the same number of times: no hang,
    and the metrics equal a plain DDP Trainer's."""
    r0, r1 = run_eval_workers(tmp_path, 2, eval_n=192, cap_ranks=[1])
    for r in (r0, r1):
        assert r["error"] is None, r["error"]
        for key in ("eval_loss", "eval_accuracy"):
            assert r["guarded_eval"][key] == pytest.approx(r["plain_eval"][key], rel=1e-6), key
        for key in ("test_loss", "test_accuracy"):
            assert r["guarded_predict"][key] == pytest.approx(r["plain_predict"][key], rel=1e-6), key
        assert r["predictions_equal"] and r["label_ids_equal"]
        assert r["train_micro"] == r["train_micro_after"] == [8, 0]
    assert r1["capped"] and not r0["capped"]
    assert r0["eval_oom_retries"] == 0 and r0["eval_forwards"] == [32, 32, 32]
    assert r1["eval_oom_retries"] == 2 and r1["eval_forwards"] == [32, 32, 16, 16, 8, 8, 8, 8, 8, 8]
    assert any("OOM in evaluation at micro-batch 32" in m for m in r1["messages"])


@pytest.mark.slow
@pytest.mark.cpu_truth
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux")
def test_real_oom_in_evaluate_on_one_fsdp2_rank_splits_every_rank(tmp_path):
    """The DDP run above with the model sharded by FSDP2 (``fsdp_config`` version 2, each GPT2Block and the root
    ``fully_shard``-ed): every evaluation forward all-gathers parameters from both ranks, so when rank 1 alone runs
    out of memory both ranks halve together, run the same forwards and meet in the Trainer's gathers: no hang,
    the retries logged on both ranks, and the metrics equal a plain FSDP2 Trainer's without the cap."""
    r0, r1 = run_eval_workers(tmp_path, 2, eval_n=192, cap_ranks=[1], fsdp2=True)
    for r in (r0, r1):
        assert r["error"] is None, r["error"]
        for key in ("eval_loss", "eval_accuracy"):
            assert r["guarded_eval"][key] == pytest.approx(r["plain_eval"][key], rel=1e-6), key
        for key in ("test_loss", "test_accuracy"):
            assert r["guarded_predict"][key] == pytest.approx(r["plain_predict"][key], rel=1e-6), key
        assert r["predictions_equal"] and r["label_ids_equal"]
        assert r["train_micro"] == r["train_micro_after"] == [8, 0]
        # both ranks split rank 1's way: the same forwards, and the halvings logged on each
        assert r["eval_forwards"] == [32, 32, 16, 16, 8, 8, 8, 8, 8, 8], r["eval_forwards"]
        assert r["eval_oom_retries"] == 2
        halvings = [m for m in r["messages"] if m.startswith("WARNING") and "OOM in evaluation" in m]
        assert len(halvings) == 2 and all("on rank 1" in m for m in halvings), halvings
        assert not any("evaluation is not guarded" in m for m in r["messages"])
    assert r1["capped"] and not r0["capped"]
    assert any("DefaultCPUAllocator" in m for m in r1["messages"] if "OOM in evaluation" in m)


@pytest.mark.slow
@pytest.mark.cpu_truth
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux")
def test_real_oom_in_an_fsdp2_evaluation_inside_train_splits_every_rank(tmp_path):
    """As above, with the evaluation run by train() after its step (eval_strategy="steps"): the ranks split
    under training's agreement group (armed on every FSDP2 group of the model) and the cap stays for the later
    evaluate() and predict(), which start from the remembered micro-batch."""
    r0, r1 = run_eval_workers(tmp_path, 2, eval_n=192, cap_ranks=[1], fsdp2=True, eval_in_train=True)
    for r in (r0, r1):
        assert r["error"] is None, r["error"]
        # train()'s one step (8 samples), then its evaluation: the first batch whole before the cap, the second
        # halved twice on both ranks, the third from the remembered 8
        assert r["train_eval_forwards"] == [8, 32, 32, 16, 16, 8, 8, 8, 8, 8, 8], r["train_eval_forwards"]
        [guarded] = r["train_eval"]
        plain = r["plain_train_eval"][0]  # the plain Trainer's in-train evaluation (its evaluate() comes next)
        assert guarded["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-6)
        assert guarded["eval_accuracy"] == pytest.approx(plain["eval_accuracy"], rel=1e-6)
        for key in ("eval_loss", "eval_accuracy"):
            assert r["guarded_eval"][key] == pytest.approx(r["plain_eval"][key], rel=1e-6), key
        assert r["predictions_equal"] and r["label_ids_equal"]
        assert r["eval_forwards"] == [8] * 12, r["eval_forwards"]  # the 8 remembered from the halvings in train()
        halvings = [m for m in r["messages"] if m.startswith("WARNING") and "OOM in evaluation" in m]
        assert len(halvings) == r["eval_oom_retries"] == 2 and all("on rank 1" in m for m in halvings), halvings
    assert r1["capped"] and not r0["capped"]


@pytest.mark.parametrize("deepspeed, fsdp, fsdp2", [
    (False, True, True),     # FSDP2: the ranks split together
    (False, True, False),    # FSDP1: the same, FSDP1's units resharded after a failed forward
    (True, False, False),    # DeepSpeed: ZeRO-3 engines split together, ZeRO-0/1/2 alone as DDP
    (False, False, False),   # one process or DDP
])
def test_the_evaluation_guard_runs_under_every_sharding(deepspeed, fsdp, fsdp2):
    from types import SimpleNamespace

    trainer = SimpleNamespace(is_deepspeed_enabled=deepspeed, is_fsdp_enabled=fsdp, args=SimpleNamespace(),
                              accelerator=SimpleNamespace(is_fsdp2=fsdp2), model=tiny_gpt2(), model_wrapped=None)
    callback = MemguardCallback()
    assert callback._eval_guard_refusal(trainer, {"input_ids": torch.zeros(4, 8, dtype=torch.long)}) is None
    # without torch.distributed (or with a model that is not sharded) there is no rank group to split with
    assert callback._eval_ranks(trainer) is None
    trainer.args.predict_with_generate = True
    assert "predict_with_generate" in callback._eval_guard_refusal(trainer, {"input_ids": torch.zeros(4, 8)})


def test_a_sharding_the_evaluation_guard_cannot_split_runs_unguarded_with_a_warning(tmp_path, caplog, monkeypatch):
    """What :func:`memguard.guard._evaluate_sharded.eval_rank_group` refuses (ZeRO-3 parameter offload, FSDP1's
    HYBRID_SHARD or CPU offload: configuration, the same on every rank, found before any collective) leaves the
    Trainer's own prediction_step to run, with one warning that gives memguard's reason and what to do."""
    from memguard.integrations._deepspeed_guard import engine_problems

    def plain():
        trainer = transformers.Trainer(model=tiny_gpt2(), args=trainer_args(tmp_path, per_device_eval_batch_size=4),
                                       train_dataset=Tokens(32), eval_dataset=Tokens(12))
        return trainer.evaluate()

    reason = "ZeRO-3 parameter offload (offload_param) fetches parameters from host or NVMe memory"
    callback = MemguardCallback(plan=make_plan(micro_batch_size=8, grad_accum_steps=2, device="cpu"))
    trainer = transformers.Trainer(model=tiny_gpt2(), args=trainer_args(tmp_path, per_device_eval_batch_size=4),
                                   train_dataset=Tokens(32), eval_dataset=Tokens(12), callbacks=[callback])

    def refuse(_trainer):
        raise ConfigError([reason + "; drop offload_param"])

    monkeypatch.setattr(callback, "_eval_ranks", refuse)
    with caplog.at_level(logging.WARNING, logger="memguard"):
        metrics = trainer.evaluate()
    warnings = [r.getMessage() for r in caplog.records if "evaluation is not guarded" in r.getMessage()]
    # once for the 3 batches, with memguard's reason and its fix
    assert len(warnings) == 1 and reason in warnings[0] and "drop offload_param" in warnings[0], warnings
    assert metrics["eval_loss"] == pytest.approx(plain()["eval_loss"], rel=1e-6)
    # the message the real refusal gives (engine_problems with evaluation=True) names the same fix
    from types import SimpleNamespace

    engine = SimpleNamespace(managed_gradient_accumulation=lambda: True, optimizer=None, pipeline_parallelism=False,
                             zero_optimization_stage=lambda: 3, zero_offload_param=lambda: True)
    assert any(reason in p for p in engine_problems(engine, evaluation=True))


class _NoLossKwargs(torch.nn.Module):
    """A causal LM whose forward takes no loss kwargs: the Trainer passes no num_items_in_batch, and the loss is
    the model's own mean over the micro-batch's labelled tokens."""

    loss_type = "ForCausalLM"  # what the Trainer reads to count labelled tokens shifted by one, as the loss does

    def __init__(self) -> None:
        super().__init__()
        self.lm = tiny_gpt2()

    def forward(self, input_ids, labels):
        return self.lm(input_ids=input_ids, labels=labels)


class _PartlyLabelled(Tokens):
    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.labels = self.ids.clone()
        self.labels[::4, :8] = -100  # micro-batches of 3 with 1, 1, 1 and 0 of these: sample weights would be wrong

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


@pytest.mark.parametrize("make", [tiny_gpt2, _NoLossKwargs], ids=["num_items_in_batch", "model_mean"])
def test_evaluate_splits_with_the_unsplit_loss(tmp_path, make):
    # the CPU allocator's message for forwards of more than 4 samples (c10/core/impl/alloc_cpu.cpp)
    oom = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1024 bytes"

    def run(guarded: bool):
        model = make()
        args = trainer_args(tmp_path, per_device_eval_batch_size=12, eval_accumulation_steps=1)
        callbacks = [MemguardCallback(plan=make_plan(micro_batch_size=8, grad_accum_steps=2, device="cpu"))] \
            if guarded else []
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(32), eval_dataset=_PartlyLabelled(24),
                                       callbacks=callbacks)
        sizes: list[int] = []

        def limit(module, a, kw):
            sizes.append(kw["input_ids"].shape[0])
            if guarded and kw["input_ids"].shape[0] > 4:
                raise RuntimeError(oom)

        model.register_forward_pre_hook(limit, with_kwargs=True)
        return trainer.evaluate(), sizes, callbacks

    plain, _, _ = run(False)
    guarded, sizes, (callback,) = run(True)
    assert sizes == [12, 6, 3, 3, 3, 3, 3, 3, 3, 3], sizes  # 12 and 6 fail, then 3 at a time; batch 2 starts at 3
    assert callback.eval_oom_retries == 2 and callback.oom_retries == 0
    assert guarded["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("plan, version", [
    # memguard plans (rank 0, before the Trainer shards the model): the whole local batch of 8 x 2 in one micro-batch
    ("planner", 2),
    # a given FSDP2 plan that keeps the arguments' 8 x 2: the Trainer's no_sync holds the first batch's gradients back
    ("given", 2),
    # the same under FSDP1 (fsdp_config version 1: FullyShardedDataParallel around each GPT2Block and the root)
    ("planner", 1),
    ("given", 1),
])
def test_real_oom_on_one_fsdp_rank_retries_on_both(tmp_path, plan, version):
    # Both Trainers (the plain reference and the guarded one) shard the tiny GPT-2 with FSDP through Accelerate
    # (fsdp="full_shard", each GPT2Block and the root); only rank 0 is capped. memguard's agreement before each FSDP
    # all-gather and reduce-scatter lets rank 1 leave its forward/backward when rank 0 fails in compute.
    results = run_workers(tmp_path, 2, budget_mib=22, cap_ranks=[0], plan=plan, fsdp2=True, fsdp_version=version)
    r0, r1 = results
    for r in results:
        assert r["error"] is None, r
        assert r["plan"] == ([16, 1] if plan == "planner" else [8, 2]), r
        # the 22 MiB cap fails 16 and 8 samples at once (see the single-process test); 4 fits
        assert r["oom_retries"] >= 1 and r["micro_batch_size"] <= 4, r
        assert not r["patched_left"]
        assert not any("not recovered" in m for m in r["messages"])
    assert r0["oom_retries"] == r1["oom_retries"] and r0["micro_batch_size"] == r1["micro_batch_size"]
    assert r0["agreements"] == r1["agreements"] > 0  # the same agreements on both ranks: none left unmatched
    retries0 = [m for m in r0["messages"] if m.startswith("WARNING:out of memory")]
    retries1 = [m for m in r1["messages"] if m.startswith("WARNING:out of memory")]
    assert all("DefaultCPUAllocator" in m for m in retries0) and all("on rank 0;" in m for m in retries1)
    assert r0["capped"] and not r1["capped"]
    for rank in range(2):
        assert_weights_equal(tmp_path, rank)  # the plain FSDP Trainer's, uncapped: 2e-8 to 6e-8 max difference observed


_SHM_SKIP = "DeepSpeed's shm comm op is not built for the ninja on PATH (bash scripts/dev.sh setup builds it)"


def _no_shm_op() -> bool:
    from tests.deepspeed_op import shm_op_prebuilt

    # CI builds the op in its set-up, so there these tests never skip: a missing build fails them
    return not shm_op_prebuilt() and not os.environ.get("CI")


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux")
@pytest.mark.skipif(_no_shm_op(), reason=_SHM_SKIP)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_real_oom_on_one_deepspeed_rank_retries_on_both(tmp_path, stage):
    # Both Trainers (the plain reference and the guarded one) run TrainingArguments(deepspeed=...) at ZeRO-<stage>,
    # the batch values "auto"; a given DeepSpeed plan keeps the arguments' 8 x 2. Only rank 0 is capped (22 MiB,
    # the same as the FSDP test: 8 samples at once fail, 4 fit). memguard's agreement before every DeepSpeed
    # collective lets rank 1 leave its forward/backward when rank 0 fails in compute; both reset the engine and run
    # the batch again at 4, and the engine steps once per optimizer step.
    results = run_workers(tmp_path, 2, budget_mib=22, cap_ranks=[0], plan="given", deepspeed=stage)
    r0, r1 = results
    for r in results:
        assert r["error"] is None, r
        assert r["plan"] == r["trainer_batch"] == [8, 2], r
        assert (r["oom_retries"], r["micro_batch_size"]) == (1, 4), r
        assert not r["patched_left"]
        assert not any("not recovered" in m for m in r["messages"])
        # the same optimizer steps as the plain Trainer: the loss and the engine's gradient norm of each step
        assert [h["step"] for h in r["guarded_logs"]] == [h["step"] for h in r["plain_logs"]] == [1, 2]
        for g, p in zip(r["guarded_logs"], r["plain_logs"]):
            assert g["loss"] == pytest.approx(p["loss"], rel=1e-6) and g["grad_norm"] == pytest.approx(p["grad_norm"],
                                                                                                      rel=1e-5)
    assert r0["agreements"] == r1["agreements"] > 0  # the same agreements on both ranks: none left unmatched
    retries0 = [m for m in r0["messages"] if m.startswith("WARNING:out of memory")]
    retries1 = [m for m in r1["messages"] if m.startswith("WARNING:out of memory")]
    assert len(retries0) == len(retries1) == 1
    assert "DefaultCPUAllocator" in retries0[0] and "on rank 0;" in retries1[0]
    assert r0["capped"] and not r1["capped"]
    # every sample ran exactly once in its optimizer step's final attempt (after the step's last retry), on one rank
    final: list[int] = []
    for r in results:
        windows: list[list] = [[]]
        for e in r["events"]:
            if e == "STEP":
                windows.append([])
            else:
                windows[-1].append(e)
        assert len([w for w in windows if w]) == 2
        for w in windows:
            last_retry = max((k for k, e in enumerate(w) if e == "RETRY"), default=-1)
            final += [i for e in w[last_retry + 1:] for i in e]
    assert sorted(final) == list(range(2 * 8 * 2 * 2))  # steps x batch x accum x world
    for rank in range(2):
        assert_weights_equal(tmp_path, rank)  # the plain DeepSpeed Trainer's, uncapped: 2.3e-8 max difference observed


def final_samples(events: list) -> list[int]:
    """The evaluation samples of a rank's forwards whose results were kept: a logged halving ("RETRY") discards the
    forward just before it (the micro-batch that failed on some rank, run again from its first sample), on every
    rank that splits with the one that failed."""
    kept: list[list[int]] = []
    for e in events:
        if e == "RETRY":
            kept.pop()
        else:
            kept.append(e)
    return [i for forward in kept for i in forward]


def _assert_same_metrics(r: dict) -> None:
    assert r["error"] is None, r["error"]
    for key in ("eval_loss", "eval_accuracy"):
        assert r["guarded_eval"][key] == pytest.approx(r["plain_eval"][key], rel=1e-6, abs=1e-6), key
    for key in ("test_loss", "test_accuracy"):
        assert r["guarded_predict"][key] == pytest.approx(r["plain_predict"][key], rel=1e-6, abs=1e-6), key
    assert r["predictions_equal"] and r["label_ids_equal"]
    assert r["train_micro"] == r["train_micro_after"] == [8, 0]
    assert not any("evaluation is not guarded" in m for m in r["messages"])


@pytest.mark.slow
@pytest.mark.cpu_truth
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux")
@pytest.mark.parametrize("sharding", [
    # FSDP1 (fsdp_config version 1): FullyShardedDataParallel around each GPT2Block and the root; each unit's
    # pre-forward all-gathers its flat parameter
    {"fsdp2": True, "fsdp_version": 1},
    # ZeRO-3 (TrainingArguments(deepspeed=...)): the parameter coordinator all-gathers every module's parameters
    pytest.param({"deepspeed": 3}, marks=pytest.mark.skipif(_no_shm_op(), reason=_SHM_SKIP)),
], ids=["fsdp1", "zero3"])
# "evaluate": after train(); "eval_in_train": at eval_strategy steps inside train(), then evaluate(); "no_train":
# evaluate() first, which prepares the model itself (ZeRO-3: an inference engine, without an optimizer)
@pytest.mark.parametrize("when", ["evaluate", "eval_in_train", "no_train"])
def test_real_oom_in_a_gathering_evaluation_on_one_rank_splits_every_rank(tmp_path, sharding, when):
    """The FSDP2 runs above (two gloo ranks, 96 evaluation samples each in batches of 32, rank 1 alone under the 56
    MiB cap) with the model sharded by FSDP1 or DeepSpeed ZeRO-3, whose evaluation forwards also gather parameters
    from both ranks: both ranks halve together, run the same forwards and meet in the Trainer's gathers (no hang:
    the workers' timeout fails the test), the retries are logged on both ranks, every sample is evaluated once,
    and the metrics equal a plain Trainer's under the same sharding without the cap (eval_accumulation_steps=2).
    With ``in_train`` the halvings happen in train()'s evaluation (under training's rank group) and the later
    evaluate() starts from the remembered 8 (measured: the same halvings as under FSDP2)."""
    in_train = when == "eval_in_train"
    r0, r1 = run_eval_workers(tmp_path, 2, eval_n=192, cap_ranks=[1], eval_in_train=in_train,
                              no_train=when == "no_train", **sharding)
    for r in (r0, r1):
        _assert_same_metrics(r)
        halvings = [m for m in r["messages"] if m.startswith("WARNING") and "OOM in evaluation" in m]
        assert len(halvings) == r["eval_oom_retries"] == 2 and all("on rank 1" in m for m in halvings), halvings
        if in_train:
            assert r["train_eval_forwards"] == [8, 32, 32, 16, 16, 8, 8, 8, 8, 8, 8], r["train_eval_forwards"]
            [guarded] = r["train_eval"]
            plain = r["plain_train_eval"][0]
            for key in ("eval_loss", "eval_accuracy"):
                assert guarded[key] == pytest.approx(plain[key], rel=1e-6, abs=1e-6), key
            assert r["eval_forwards"] == [8] * 12, r["eval_forwards"]
        else:
            assert r["eval_forwards"] == [32, 32, 16, 16, 8, 8, 8, 8, 8, 8], r["eval_forwards"]
            assert r["eval_events"].count("RETRY") == 2
    # evaluate(): each rank's 96 samples once in the forwards kept, the two ranks' shares the whole evaluation set
    assert sorted(final_samples(r0["eval_events"]) + final_samples(r1["eval_events"])) == list(range(192))
    assert r1["capped"] and not r0["capped"]
    assert any("DefaultCPUAllocator" in m for m in r1["messages"] if "OOM in evaluation" in m)


@pytest.mark.slow
@pytest.mark.cpu_truth
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux")
@pytest.mark.skipif(_no_shm_op(), reason=_SHM_SKIP)
@pytest.mark.parametrize("stage, in_train", [(1, False), (2, True)])
def test_real_oom_in_a_zero12_evaluation_on_one_rank_splits_that_rank_alone(tmp_path, stage, in_train):
    """Under ZeRO-1/2 every rank holds the whole model and an evaluation forward starts no DeepSpeed collective, so
    rank 1 (alone under the 56 MiB cap) splits its batches while rank 0 runs them whole, as under DDP; both meet in
    the Trainer's gathers the same number of times (no hang), every sample is evaluated once and the metrics equal a
    plain ZeRO-<stage> Trainer's without the cap."""
    r0, r1 = run_eval_workers(tmp_path, 2, eval_n=192, cap_ranks=[1], eval_in_train=in_train, deepspeed=stage)
    for r in (r0, r1):
        _assert_same_metrics(r)
    assert r1["capped"] and not r0["capped"]
    assert r0["eval_oom_retries"] == 0 and not any("OOM in evaluation" in m for m in r0["messages"])
    assert r1["eval_oom_retries"] == 2
    assert any("OOM in evaluation at micro-batch 32" in m and "DefaultCPUAllocator" in m for m in r1["messages"])
    if in_train:
        assert r0["train_eval_forwards"] == [8, 32, 32, 32] and r0["eval_forwards"] == [32] * 3
        assert r1["train_eval_forwards"] == [8, 32, 32, 16, 16, 8, 8, 8, 8, 8, 8], r1["train_eval_forwards"]
        assert r1["eval_forwards"] == [8] * 12, r1["eval_forwards"]
    else:
        assert r0["eval_forwards"] == [32, 32, 32]
        assert r1["eval_forwards"] == [32, 32, 16, 16, 8, 8, 8, 8, 8, 8], r1["eval_forwards"]
    assert sorted(final_samples(r0["eval_events"]) + final_samples(r1["eval_events"])) == list(range(192))
