"""The CLI and DeepSpeed configs: the written config is validated (structurally, then by DeepSpeed's own
``DeepSpeedConfig``), and ``memguard estimate --deepspeed-config`` estimates a user's own config."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

import memguard  # noqa: E402
from memguard import hf  # noqa: E402
from memguard.cli import main  # noqa: E402
from memguard.integrations._deepspeed_check import structure_problems, validate_config  # noqa: E402

TINY_OVERRIDES = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 128}
SEQ = 64
TINY = ["--hf", "gpt2", "--hf-config", "n_layer=2", "n_embd=64", "n_head=2", "vocab_size=128", "--seq-len", str(SEQ)]
DS_CONFIG = ["deepspeed-config", *TINY, "--global-batch-size", "8", "--gpu", "T4", "--world-size", "2",
             "--zero-stage", "2", "--precision", "32-true", "--activation-checkpointing", "off"]
GOOD = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}


def _one_error_line(argv, capsys) -> str:
    try:
        rc = main([*argv, "-q"])
    except SystemExit as exc:  # argparse's own errors
        rc = exc.code
    captured = capsys.readouterr()
    assert rc == 2, captured.err
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


@pytest.mark.parametrize("change, message", [
    # a section replaced by a number (what `--set zero_optimization=5` wrote, and exited 0 with)
    ({"zero_optimization": 5}, "zero_optimization must be a section"),
    ({"zero_optimization": {"stage": 5}}, "zero_optimization.stage must be 0, 1, 2 or 3, got 5"),
    ({"bf16": True}, "bf16 must be a section"),
    # 4 x 2 x 2 ranks = 16: 12 breaks DeepSpeed's batch rule for the world size the config is written for
    ({"train_batch_size": 12}, "train_batch_size 12 is not train_micro_batch_size_per_gpu 4 x "
                               "gradient_accumulation_steps 2 x world size 2 = 16"),
    ({"train_micro_batch_size_per_gpu": 0}, "train_micro_batch_size_per_gpu must be a positive integer"),
    ({"fp16": {"enabled": True}}, "fp16 and bf16 are both enabled"),
    ({"gradient_clipping": -1}, "gradient_clipping must be a number >= 0"),
])
def test_structural_problems_are_named(change, message):
    problems = structure_problems({**GOOD, **change}, world_size=2)
    assert len(problems) == 1 and message in problems[0], problems
    with pytest.raises(memguard.ConfigError, match=message.split(" (")[0][:40]):
        validate_config({**GOOD, **change}, world_size=2, engine=False)


def test_a_good_config_passes_for_its_world_size_only():
    assert structure_problems(GOOD, world_size=2) == []
    assert "world size 1 = 8" in structure_problems(GOOD, world_size=1)[0]


def test_deepspeed_itself_validates_what_the_structure_check_cannot():
    pytest.importorskip("deepspeed")
    validate_config(GOOD, world_size=2)  # DeepSpeed sees the one-rank view: 8 = 4 x 2 x 1, no objection
    bad = {**GOOD, "zero_optimization": {"stage": 2, "overlap_comn": True}}  # a misspelt key
    assert structure_problems(bad, world_size=2) == []
    with pytest.raises(memguard.ConfigError, match=r"DeepSpeed rejects this config: .*overlap_comn.*Extra inputs"):
        validate_config(bad, world_size=2)


def test_cli_refuses_a_config_that_deepspeed_could_not_read(capsys):
    # the plan's own stage 0 leaves nothing for the override to contradict: this wrote "zero_optimization": 5
    # and exited 0
    at = DS_CONFIG.index("--zero-stage") + 1
    stage0 = [*DS_CONFIG[:at], "0", *DS_CONFIG[at + 1:]]
    line = _one_error_line([*stage0, "--set", "zero_optimization=5"], capsys)
    assert "zero_optimization must be a section" in line, line
    # at stage 2 the plan's stage has nowhere to go
    line = _one_error_line([*DS_CONFIG, "--set", "zero_optimization=5"], capsys)
    assert "zero_optimization must be a mapping, got 5" in line, line


def test_cli_runs_deepspeeds_own_check(capsys):
    pytest.importorskip("deepspeed")
    line = _one_error_line([*DS_CONFIG, "--set", "zero_optimization.stage3_prefetch_bucket_size=-1"], capsys)
    assert "DeepSpeed rejects this config" in line and "stage3_prefetch_bucket_size" in line, line
    # the same command with a valid override writes the config
    assert main([*DS_CONFIG, "--set", "zero_optimization.overlap_comm=true", "-q"]) == 0
    written = json.loads(capsys.readouterr().out)
    assert written["zero_optimization"]["overlap_comm"] is True and written["zero_optimization"]["stage"] == 2


def test_cli_estimate_reads_a_users_deepspeed_config(tmp_path, capsys):
    path = tmp_path / "ds.json"
    # the batch triple says micro-batch 2 over 2 ranks; ZeRO-2 under bf16
    user = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
            "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}
    path.write_text(json.dumps(user))
    argv = ["estimate", *TINY, "--gpu", "A100-40GB", "--world-size", "2", "--json"]
    assert main([*argv, "--deepspeed-config", str(path), "-q"]) == 0  # the micro-batch comes from the config
    from_cli = json.loads(capsys.readouterr().out)
    assert main([*argv, "--micro-batch-size", "2", "--deepspeed-config", str(path), "-q"]) == 0
    assert json.loads(capsys.readouterr().out) == from_cli
    built = hf.build("gpt2", TINY_OVERRIDES, batch_size=2, seq_len=SEQ)
    expected = memguard.estimate(built.model, built.batch, gpu="A100-40GB", deepspeed_config=user)
    assert from_cli == json.loads(json.dumps(expected.to_dict()))
    assert from_cli["peak_bytes"] != json.loads(json.dumps(
        memguard.estimate(built.model, built.batch, gpu="A100-40GB", world_size=2).to_dict()))["peak_bytes"]
    # a keyword that contradicts the config names what to drop, in one line
    line = _one_error_line([*argv, "--deepspeed-config", str(path), "--zero-stage", "3"], capsys)
    assert "zero_stage" in line, line
    line = _one_error_line([*argv, "--deepspeed-config", str(path), "--micro-batch-size", "3"], capsys)
    assert "train_micro_batch_size_per_gpu is 2" in line, line
    line = _one_error_line([*argv[:-1], "--deepspeed-config", str(tmp_path / "missing.json")], capsys)
    assert "no such file" in line, line
