"""Tests of the ``memguard`` command line, driven as a user drives it.

The first tests run ``python -m memguard`` (and the console script) in a subprocess; the rest call
``memguard.cli.main(argv)`` in this process, which runs the same code without paying torch's and
transformers' import time again. Models are tiny so that each call takes a few seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import memguard  # noqa: E402
from memguard import hf  # noqa: E402
from memguard.cli import main, parse_bytes  # noqa: E402

TINY_OVERRIDES = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 128}
SEQ = 64
TINY = ["--hf", "gpt2", "--hf-config", "n_layer=2", "n_embd=64", "n_head=2", "vocab_size=128", "--seq-len", str(SEQ)]
# Only one precision and no checkpointing: 3 traces instead of 9, for tests that need no choice.
FIXED = ["--precision", "32-true", "--activation-checkpointing", "off"]
REPO = Path(__file__).resolve().parents[1]


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "memguard", *args], capture_output=True, text=True,
                          cwd=cwd or REPO, env=env, timeout=300)


def tiny_model(batch_size: int = 1):
    built = hf.build("gpt2", TINY_OVERRIDES, batch_size=batch_size, seq_len=SEQ)
    return built.model, built.batch


def as_json(obj):
    return json.loads(json.dumps(obj))


FACTORY = textwrap.dedent("""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.fc = nn.Linear(d, d)

        def forward(self, x):
            return torch.relu(self.fc(x))

    class Net(nn.Module):
        def __init__(self, d=128, n=3):
            super().__init__()
            self.blocks = nn.ModuleList(Block(d) for _ in range(n))
            self.head = nn.Linear(d, 10)

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    def loss(model, batch):
        x, y = batch
        return nn.functional.cross_entropy(model(x), y)

    def make(batch_size=1):
        with torch.device("meta"):
            model = Net()
        batch = (torch.zeros(batch_size, 128), torch.zeros(batch_size, dtype=torch.long))
        return {"model": model, "batch": batch, "loss_fn": loss}

    def as_tuple(batch_size=1, seq_len=None):
        out = make(batch_size)
        return out["model"], out["batch"], out["loss_fn"]

    def model_only():
        return Net()
""")


# ------------------------------------------------------------------------------------------
# Subprocess: what a user types
# ------------------------------------------------------------------------------------------


def test_plan_json_matches_the_python_api_and_plot_is_a_png(tmp_path):
    png = tmp_path / "plan.png"
    # one precision (checkpointing still chosen) keeps the traces few
    proc = run_cli("plan", *TINY, "--gpu", "A100-40GB", "--global-batch-size", "16", "--precision", "32-true",
                   "--json", "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)  # stdout holds the JSON and nothing else
    model, batch = tiny_model()
    want = memguard.plan(model, batch, global_batch_size=16, gpu="A100-40GB", precision="32-true")
    assert got == as_json(want.to_dict())
    assert memguard.Plan.from_dict(got) == want
    assert "trace 1:" in proc.stderr and "plot written to" in proc.stderr  # progress on stderr

    import matplotlib.image

    img = matplotlib.image.imread(str(png))
    assert img.shape[:2] == (500, 1200)  # memguard.plot.FIGSIZE (12 x 5 in) at DPI 100
    assert img[:, :, :3].std() > 0.05  # a drawing, not a blank canvas


def test_bad_precision_is_usage_error_exit_2():
    proc = run_cli("plan", *TINY, "--gpu", "A100-40GB", "--global-batch-size", "8", "--precision", "fp8")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "'fp8' is not a precision" in proc.stderr and "bf16-mixed" in proc.stderr


def test_tiny_budget_is_infeasible_exit_1_with_closest_plan(tmp_path):
    # a plain torch model from a factory file: no transformers import, so the subprocess is quick
    (tmp_path / "factory.py").write_text(FACTORY)
    proc = run_cli("plan", "--model", "factory.py:make", "--device", "cpu", "--budget", "64KiB",
                   "--global-batch-size", "8", "--json", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    payload = json.loads(proc.stdout)
    assert payload["error"] == "infeasible"
    closest = memguard.Plan.from_dict(payload["closest"])
    # the closest plan is a real split of the batch, and it does not fit 64 KiB
    assert closest.micro_batch_size * closest.grad_accum_steps == 8 and closest.estimate.peak_bytes > (64 << 10)
    assert payload["suggestions"]
    assert "memguard: error: no configuration fits" in proc.stderr and "What would make it fit" in proc.stderr


def test_console_script_help_has_examples():
    script = Path(sys.executable).with_name("memguard")
    if not script.exists():
        pytest.skip("the memguard console script is not installed in this environment")
    proc = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    for text in ("estimate", "plan", "deepspeed-config", "gpus", "examples:",
                 "memguard plan --hf gpt2 --seq-len 1024 --gpu A100-40GB --global-batch-size 256"):
        assert text in proc.stdout


# ------------------------------------------------------------------------------------------
# In process: the same entry point
# ------------------------------------------------------------------------------------------


def test_plan_readable_report(capsys):
    assert main(["plan", *TINY, *FIXED, "--gpu", "A100-40GB", "--global-batch-size", "8"]) == 0
    out = capsys.readouterr().out
    for text in ("Model: gpt2 (GPT2LMHeadModel", "memguard plan for 1 x A100-40GB: global batch 8",
                 "Breakdown at the peak:", "activations", "Why:", "precision: 32-true: fixed by you"):
        assert text in out


def test_infeasible_readable_prints_closest_then_error(capsys):
    rc = main(["plan", *TINY, *FIXED, "--gpu", "A100-40GB", "--global-batch-size", "8", "--budget", "1MiB"])
    captured = capsys.readouterr()
    assert rc == 1
    assert "The closest plan (it does NOT fit)" in captured.out and "Breakdown at the peak" in captured.out
    assert "no configuration fits" in captured.err and "What would make it fit" in captured.err


def test_estimate_json_matches_the_python_api(capsys):
    rc = main(["estimate", *TINY, "--gpu", "A100-40GB", "--micro-batch-size", "4", "--precision", "bf16",
               "--activation-checkpointing", "on", "--json", "-q"])
    captured = capsys.readouterr()
    assert rc == 0 and captured.err == ""  # -q: no progress
    model, batch = tiny_model(batch_size=4)
    # "bf16" is Lightning's short name of "bf16-mixed"; "on" checkpoints every block
    want = memguard.estimate(model, batch, gpu="A100-40GB", precision="bf16-mixed", activation_checkpointing=True)
    assert json.loads(captured.out) == as_json(want.to_dict())


def test_keep_outputs_is_passed_to_estimate_and_plan(capsys):
    # --keep-outputs models `out = model(**batch)` keeping the logits alive through backward and the
    # step: the estimate is the Python API's with keep_outputs=True, and larger than without it (on
    # the CPU target, whose peak is live bytes: on CUDA these tiny logits vanish in a 2 MiB segment)
    argv = ["estimate", *TINY, "--device", "cpu", "--micro-batch-size", "4", "--json", "-q"]
    assert main([*argv, "--keep-outputs"]) == 0
    kept = json.loads(capsys.readouterr().out)
    model, batch = tiny_model(batch_size=4)
    assert kept == as_json(memguard.estimate(model, batch, device="cpu", keep_outputs=True).to_dict())
    assert main(argv) == 0
    assert kept["peak_bytes"] > json.loads(capsys.readouterr().out)["peak_bytes"]

    plan_argv = ["plan", *TINY, *FIXED, "--gpu", "A100-40GB", "--global-batch-size", "8", "--json", "-q"]
    assert main([*plan_argv, "--keep-outputs"]) == 0
    planned = json.loads(capsys.readouterr().out)
    model, batch = tiny_model()
    want = memguard.plan(model, batch, global_batch_size=8, gpu="A100-40GB", precision="32-true",
                         activation_checkpointing=False, keep_outputs=True)
    assert planned == as_json(want.to_dict())
    # the kept logits vanish in the CUDA allocator's 2 MiB segments, not in the allocated bytes
    without = memguard.plan(model, batch, global_batch_size=8, gpu="A100-40GB", precision="32-true",
                            activation_checkpointing=False)
    assert planned["micro_batch_size"] == without.micro_batch_size
    assert planned["estimate"]["allocated_peak_bytes"] > without.estimate.allocated_peak_bytes


def test_plan_options_are_checked_before_the_model_is_built(capsys):
    # PlanRequest's problems in the command line's words; --model x:y would fail to import if built
    rc = main(["plan", "--model", "x:y", "--device", "cpu", "--gpu", "T4", "--global-batch-size", "6",
               "--world-size", "4", "-q"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "--gpu T4 only applies to --device cuda" in err and "cannot be split evenly over world_size 4" in err
    assert "cannot import" not in err


def test_estimate_readable_says_whether_it_fits(capsys):
    assert main(["estimate", *TINY, "--device", "cpu", "--budget", "2MiB", "-q"]) == 0
    out = capsys.readouterr().out
    assert "Estimate:" in out and "does NOT fit" in out and "memguard plan" in out


def test_deepspeed_config_matches_the_adapter(tmp_path, capsys):
    pytest.importorskip("memguard.integrations.deepspeed")
    from memguard.integrations.deepspeed import to_config

    out = tmp_path / "ds.json"
    args = ["deepspeed-config", *TINY, "--gpu", "A100-40GB", "--global-batch-size", "16", "--world-size", "2",
            "--zero-stage", "2", "--precision", "bf16-mixed", "--activation-checkpointing", "off"]
    assert main([*args, "--set", "gradient_clipping=1.0", "--out", str(out), "-q"]) == 0
    written = json.loads(out.read_text())
    assert "DeepSpeed config written to" in capsys.readouterr().out
    model, batch = tiny_model()
    plan = memguard.plan(model, batch, global_batch_size=16, gpu="A100-40GB", world_size=2, zero_stage=2,
                         precision="bf16-mixed", activation_checkpointing=False)
    assert written == as_json(to_config(plan, gradient_clipping=1.0))
    # DeepSpeed's batch invariant: train_batch_size = micro-batch x accumulation x world size
    assert written["train_batch_size"] == 16 == (
        written["train_micro_batch_size_per_gpu"] * written["gradient_accumulation_steps"] * 2)
    # without --out the config is all of stdout
    assert main([*args, "-q"]) == 0
    assert json.loads(capsys.readouterr().out) == as_json(to_config(plan))


def test_gpus_lists_the_catalog(capsys):
    from memguard.estimator.gpus import GPUS

    assert main(["gpus"]) == 0
    out = capsys.readouterr().out
    for name, spec in GPUS.items():
        assert name in out and spec.source in out
    assert main(["gpus", "--json"]) == 0
    catalog = json.loads(capsys.readouterr().out)["catalog"]
    assert [g["name"] for g in catalog] == list(GPUS)
    assert catalog[0]["memory_bytes"] == next(iter(GPUS.values())).memory_bytes


def test_gpus_with_a_model_sizes_each_gpu(capsys):
    rc = main(["gpus", *TINY, *FIXED, "--global-batch-size", "8", "--gpus", "T4,a100-40gb", "--json", "-q"])
    assert rc == 0
    fits = json.loads(capsys.readouterr().out)["fits"]
    # a 0.1M-parameter model fits one of either GPU
    assert {f["gpu"] for f in fits} == {"T4", "A100-40GB"}
    assert all(f["count"] == 1 and f["plan"]["world_size"] == 1 for f in fits)
    assert main(["gpus", *TINY, *FIXED, "--global-batch-size", "8", "--gpus", "T4", "-q"]) == 0
    out = capsys.readouterr().out
    assert "T4" in out and "micro x accum" in out




def test_model_factory_from_a_file_matches_the_api(tmp_path, capsys):
    path = tmp_path / "my_factory.py"
    path.write_text(FACTORY)
    rc = main(["plan", "--model", f"{path}:make", "--device", "cpu", "--budget", "64MiB", "--global-batch-size", "8",
               "--json", "-q"])
    assert rc == 0
    got = json.loads(capsys.readouterr().out)
    import importlib.util

    spec = importlib.util.spec_from_file_location("my_factory_copy", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    made = mod.make()
    want = memguard.plan(made["model"], made["batch"], loss_fn=made["loss_fn"], global_batch_size=8, device="cpu",
                         budget_bytes=64 << 20)
    assert got == as_json(want.to_dict())


def test_model_factory_by_module_name(tmp_path, monkeypatch, capsys):
    (tmp_path / "user_models_for_cli_test.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the CLI adds the current folder; undone after
    rc = main(["plan", "--model", "user_models_for_cli_test:as_tuple", "--device", "cpu", "--budget", "64MiB",
               "--global-batch-size", "4", "--seq-len", "7", "-q"])
    assert rc == 0
    assert "Model: user_models_for_cli_test:as_tuple (Net" in capsys.readouterr().out
    # a model without a batch cannot be traced: usage error naming the protocol
    rc = main(["plan", "--model", "user_models_for_cli_test:model_only", "--device", "cpu", "--budget", "64MiB",
               "--global-batch-size", "4", "-q"])
    assert rc == 2
    assert "gave no example batch; return (model, batch)" in capsys.readouterr().err
    # make() takes no seq_len: --seq-len is refused rather than silently ignored
    rc = main(["plan", "--model", "user_models_for_cli_test:make", "--device", "cpu", "--budget", "64MiB",
               "--global-batch-size", "4", "--seq-len", "7", "-q"])
    assert rc == 2 and "takes no seq_len" in capsys.readouterr().err
    rc = main(["plan", "--model", "no_such_module_xyz:make", "--device", "cpu", "--budget", "64MiB",
               "--global-batch-size", "4", "-q"])
    assert rc == 2 and "cannot import 'no_such_module_xyz'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        # --hf-config only means something with --hf
        (["plan", "--model", "x:y", "--hf-config", "n_layer=2", "--global-batch-size", "8", "--gpu", "T4"],
         "--hf-config applies to --hf models only"),
        # an unknown GPU: the catalog error names close matches
        (["plan", *TINY, "--global-batch-size", "8", "--gpu", "B300"], "unknown gpu 'B300'"),
        # a typo in a config key would otherwise be silently ignored by transformers
        (["plan", "--hf", "gpt2", "--hf-config", "n_layers=2", "--global-batch-size", "8", "--gpu", "T4"],
         "did you mean n_layer"),
        # the global batch must split evenly over the ranks
        (["plan", *TINY, "--global-batch-size", "6", "--world-size", "4", "--gpu", "T4"],
         "cannot be split evenly over world_size 4"),
        # a torch release outside the modelled ones names the range (checked before the model is built)
        (["plan", "--model", "x:y", "--global-batch-size", "8", "--gpu", "T4", "--torch-version", "1.9"],
         "from 2.0 to 2.13"),
    ],
)
def test_config_errors_exit_2_with_the_fix(argv, message, capsys):
    assert main([*argv, "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("memguard: error: ") and message in err
    assert "--help" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a visible GPU is a valid default target")
def test_no_gpu_and_no_target_says_what_to_pass(capsys):
    assert main(["plan", *TINY, "--global-batch-size", "8", "-q"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device here" in err and "--gpu" in err and "--budget" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", *TINY, "--global-batch-size", "8", "--zero-stage", "5"],  # ZeRO has stages 0-3
        ["plan", *TINY, "--global-batch-size", "8", "--budget", "lots"],  # not a size
        ["plan", *TINY, "--global-batch-size", "0"],  # a batch has at least one sample
        ["plan", *TINY, "--global-batch-size", "8", "--headroom", "1.5"],  # a fraction below 1
        ["estimate", *TINY, "--precision", "bf16-mixed,32-true"],  # estimate takes one precision
        ["plan", "--global-batch-size", "8"],  # no model
    ],
)
def test_argparse_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    # one line: the error and where the options are, not argparse's usage block
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("memguard: error: ") and "--help` for the options" in err


# ------------------------------------------------------------------------------------------
# A bad value: exit 2 and one line that names the flag and what to write instead
# ------------------------------------------------------------------------------------------


def one_error_line(argv: list[str], capsys) -> str:
    """Run ``memguard`` on ``argv`` (quiet); assert exit 2, nothing on stdout and one line on stderr; return it."""
    try:
        rc = main([*argv, "-q"])
    except SystemExit as exc:  # argparse's errors
        rc = exc.code
    captured = capsys.readouterr()
    assert rc == 2, captured.err
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err  # one line, no traceback
    assert lines[0].startswith("memguard: error: ")
    return lines[0]


HF_PLAN = ["plan", "--hf", "gpt2", "--global-batch-size", "8", "--gpu", "T4", "--seq-len", "8"]


def test_hf_config_value_of_the_wrong_type_from_the_command_line():
    # the case: huggingface_hub's validation traceback (exit 1, "nothing fits") before; and
    # hidden_size, an alias of GPT-2's n_embd, slipped past that validation and failed in torch
    proc = run_cli(*HF_PLAN, "--hf-config", "hidden_size=abc")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "memguard: error: --hf-config: GPT2Config.hidden_size takes an integer, got 'abc'; write e.g. "
        "hidden_size=768 (run `memguard plan --help` for the options)"
    ]


def test_hf_config_comma_list_says_to_separate_with_spaces(capsys):
    line = one_error_line([*HF_PLAN, "--hf-config", "a=1,b=2"], capsys)
    assert "--hf-config" in line and "separate them with spaces: a=1 b=2" in line
    line = one_error_line([*HF_PLAN, "--hf-config", "n_layer=2,n_embd=64"], capsys)
    assert "n_layer=2 n_embd=64" in line


def test_hf_config_unknown_key_names_the_close_match(capsys):
    line = one_error_line([*HF_PLAN, "--hf-config", "n_layers=2"], capsys)
    assert "--hf-config: GPT2Config has no setting 'n_layers'; did you mean n_layer" in line


@pytest.mark.parametrize("item, message", [
    ("n_layer=-2", "GPT2Config.n_layer is a size or count and must be at least 1, got -2; write e.g. n_layer=12"),
    ("n_layer=0", "must be at least 1, got 0"),  # a model without blocks is not a model
    ("num_attention_heads=-1", "GPT2Config.num_attention_heads is a size or count"),  # an alias of n_head
    ("vocab_size=3000000000", "must be at most 2147483647"),  # beyond any vocabulary, and torch's sizes
    ("n_embd=2.0", "takes an integer, got 2.0"),
    ("resid_pdrop=high", "takes a number, got 'high'"),
    ("scale_attn_weights=yes", "is true or false, got 'yes'"),
    ("n_layer=", "has no value"),
])
def test_hf_config_sizes_and_types_are_checked(item, message, capsys):
    line = one_error_line([*HF_PLAN, "--hf-config", item], capsys)
    assert line.startswith("memguard: error: --hf-config: ") and message in line, line


def test_the_python_api_raises_the_same_config_errors():
    # the checks live in memguard.hf: the API raises ConfigError (a MemguardError), not the config's own error
    with pytest.raises(memguard.ConfigError, match="n_layer is a size or count"):
        hf.build("gpt2", {"n_layer": -2, "n_embd": 64, "n_head": 2}, seq_len=8)
    with pytest.raises(memguard.ConfigError, match="takes an integer, got 'abc'"):
        hf.config_for("gpt2", {"hidden_size": "abc"})
    with pytest.raises(memguard.ConfigError, match="separate them with spaces: a=1 b=2"):
        hf.parse_overrides(["a=1,b=2"])
    # null passes to the config, which fills it in (Llama: as many key/value heads as heads)
    assert hf.config_for("llama", {"num_key_value_heads": None}).num_key_value_heads == 32


@pytest.mark.parametrize("argv, message", [
    # every kind of option: a count, a size, a fraction, a list, a choice, a name, a path, key=value
    (["--micro-batch-size", "abc"], "argument --micro-batch-size: 'abc' is not a whole number"),
    (["--world-size", "99999999999"], "argument --world-size: '99999999999' is too large"),
    (["--budget", "1" + "0" * 400], "argument --budget: "),  # too long for a float: was an OverflowError
    (["--headroom", "nan"], "argument --headroom: 'nan' must be in [0, 1)"),
    (["--precision", "bf16,fp8"], "argument --precision: 'fp8' is not a precision"),
    (["--zero-stage", "1,,2"], "argument --zero-stage: '' is not a ZeRO stage"),
    (["--gpu", ""], "argument --gpu: an empty value"),
    (["--gpu", "B300"], "--gpu: unknown gpu 'B300'"),
    (["--plot", "plan.txt"], "--plot plan.txt: matplotlib cannot write a .txt file"),
    (["--max-seq-len", "4096"], "--max-seq-len 4096 exceeds GPT2Config.n_positions=1024"),
    (["--micro-batch-size", "2000000000"], "--micro-batch-size 2000000000 x --seq-len 8: an example batch"),
    (["--hf", "gtp2"], "--hf: unknown transformers model type 'gtp2'; did you mean 'gpt2'"),
    (["--hf-config", "n_head=2\nn_layer=1"], "takes an integer, got '2\\nn_layer=1'"),  # a newline, escaped
])
def test_any_bad_value_is_one_line_naming_the_flag(argv, message, capsys):
    line = one_error_line([*HF_PLAN, *argv], capsys)
    assert message in line, line


@pytest.mark.parametrize("argv, message", [
    (["estimate", *TINY, "--zero-stage", "4"], "argument --zero-stage: '4' is not a ZeRO stage"),
    (["estimate", *TINY, "--device", "cpu", "--gpu", "T4"], "--gpu T4 only applies to --device cuda"),
    (["gpus", "--gpus", "T4,,H100"], "argument --gpus: 'T4,,H100' has an empty GPU name"),
    (["gpus", "--gpus", "B300,B300"], "--gpus: unknown gpu 'B300'"),  # once, though given twice
    (["plan", "--model", "..pkg:make", "--global-batch-size", "8", "--gpu", "T4"], "'..pkg' is not a module name"),
    (["deepspeed-config", *TINY, "--global-batch-size", "8", "--gpu", "T4", "--set", "a=1,b=2"],
     "--set: config override 'a=1,b=2' joins 2 settings with commas"),
    (["deepspeed-config", *TINY, "--global-batch-size", "8", "--gpu", "T4", "--set", "zero_optimization..stage=1"],
     "an empty name between dots"),
    (["deepspeed-config", *TINY, "--global-batch-size", "8", "--gpu", "T4", "--out", "."], "--out .: that is a folder"),
    (["plan", *TINY, "--global-batch-size", "8", "--gpu", "T4", "--json=yes"], "ignored explicit argument 'yes'"),
])
def test_each_sub_command_says_which_flag(argv, message, capsys):
    assert message in one_error_line(argv, capsys)


def test_verbose_keeps_the_traceback(capsys):
    argv = [*HF_PLAN, "--hf-config", "hidden_size=abc"]
    assert main([*argv, "-q"]) == 2
    assert "Traceback" not in capsys.readouterr().err
    assert main([*argv, "-q", "--verbose"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "in config_for" in err, err
    # the one line still ends the output
    assert err.strip().splitlines()[-1].startswith("memguard: error: --hf-config: GPT2Config.hidden_size")


def test_a_config_transformers_cannot_build_is_one_line_and_verbose_shows_why(capsys):
    # the value passes the config (a string), but transformers has no such activation when it builds
    # the model: its KeyError is not a traceback, and --verbose shows it
    argv = [*HF_PLAN, "--hf-config", "n_layer=1", "n_embd=32", "n_head=2", "activation_function=nope"]
    line = one_error_line(argv, capsys)
    assert "--hf gpt2: transformers cannot build the model from this config" in line
    assert "(--verbose shows the traceback)" in line
    assert main([*argv, "-q", "-v"]) == 2
    assert "KeyError" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text, expected",
    [
        ("40GiB", 40 << 30),  # IEC binary unit
        ("80GB", 80 * 10**9),  # SI decimal unit, as GPU vendors count
        ("1.5TiB", 3 << 39),  # fractions of a unit: 1.5 x 2^40
        ("512M", 512 << 20),  # a bare letter is binary, as in `free -m`
        ("1000000", 10**6),  # plain bytes
        (" 2 gib ", 2 << 30),  # case and spaces are ignored
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "40 GiBs", "-1GiB", "0", "1e3"])
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


# The user's code fails: each case exits 2 (not 1, which means "nothing fits") with one line that names the
# factory and the error; --verbose adds the traceback.
BROKEN = {
    # the factory itself raises
    "raises": ("def make():\n    raise RuntimeError('checkpoint shards missing')\n",
               "the factory raised RuntimeError: checkpoint shards missing"),
    # the module has a syntax error
    "syntax": ("def make(:\n    pass\n", "has a syntax error"),
    # the module raises while it is imported
    "import_time": ("import os\nVALUE = 1 / 0\ndef make():\n    pass\n", "raised ZeroDivisionError: division by zero"),
    # the module exists, but a module it imports does not
    "missing_dep": ("import no_such_dependency_xyz\ndef make():\n    pass\n",
                    "raised ModuleNotFoundError: No module named 'no_such_dependency_xyz'"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
@pytest.mark.parametrize("by", ["file", "module"])
def test_failing_user_code_is_one_line_and_exit_2(case, by, tmp_path, monkeypatch, capsys):
    source, expected = BROKEN[case]
    name = f"broken_{case}_{by}_for_cli_test"
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the CLI adds the current folder; undone after
    spec = f"{path}:make" if by == "file" else f"{name}:make"
    argv = ["plan", "--model", spec, "--device", "cpu", "--budget", "64MiB", "--global-batch-size", "4", "-q"]
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err  # one line, no traceback
    assert spec in lines[0] and expected in lines[0], lines[0]
    sys.modules.pop(name, None)
    rc = main(argv + ["--verbose"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "Traceback (most recent call last)" in err or "SyntaxError" in err, err
    assert err.strip().splitlines()[-1].startswith("memguard: error: ")  # the one line still ends the output
    sys.modules.pop(name, None)


def test_failing_factory_from_the_command_line(tmp_path):
    # the real console entry point: no Python traceback reaches the terminal
    (tmp_path / "bad_factory.py").write_text(BROKEN["raises"][0])
    out = run_cli("plan", "--model", "bad_factory:make", "--device", "cpu", "--budget", "64MiB",
                  "--global-batch-size", "4", "-q", cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        "memguard: error: --model bad_factory:make: the factory raised RuntimeError: checkpoint shards missing "
        "(--verbose shows the traceback)"
    ]


def test_cpu_names_the_cpu_target_of_an_estimate(capsys):
    """--cpu is memguard.estimate's cpu=: a named CPU's kernel paths, checked like every value."""
    args = ["estimate", *TINY, "--device", "cpu", "--precision", "bf16-true", "--json", "-q"]
    peaks = {}
    for level in ("avx2", "avx512_core"):
        assert main([*args, "--cpu", level]) == 0
        peaks[level] = json.loads(capsys.readouterr().out)["peak_bytes"]
    model, batch = tiny_model()
    expected = memguard.estimate(model, batch, device="cpu", precision="bf16-true", cpu="avx512_core").peak_bytes
    assert peaks["avx512_core"] == expected and peaks["avx512_core"] > peaks["avx2"]  # gemm:jit's fp32 accumulator
    with pytest.raises(SystemExit) as bad:  # argparse's type check: exit 2
        main([*args, "--cpu", "sse9"])
    assert bad.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--cpu" in err and "avx512_core_bf16" in err
    assert main(["estimate", *TINY, "--cpu", "avx2", "-q"]) == 2  # the CUDA target
    assert "--cpu avx2 only applies to --device cpu" in capsys.readouterr().err


def _llama_dir(path: Path) -> Path:
    import transformers

    sizes = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                 intermediate_size=128, vocab_size=256, max_position_embeddings=128)
    transformers.AutoConfig.for_model("llama", **sizes).save_pretrained(path)
    return path


def test_hf_takes_a_checkpoint_directory(tmp_path, capsys):
    """--hf DIR reads DIR/config.json (as save_pretrained wrote it); no weights are read."""
    ckpt = _llama_dir(tmp_path / "ckpt")
    built = hf.build(str(ckpt), {"num_hidden_layers": 1}, seq_len=16)
    same = hf.build("llama", {"num_hidden_layers": 1, "hidden_size": 64, "num_attention_heads": 2,
                              "num_key_value_heads": 1, "intermediate_size": 128, "vocab_size": 256,
                              "max_position_embeddings": 128}, seq_len=16)
    assert built.num_params == same.num_params and built.config.num_hidden_layers == 1  # the override applies
    assert main(["estimate", "--hf", str(ckpt), "--seq-len", "16", "--gpu", "A100-40GB", "--json", "-q"]) == 0
    assert json.loads(capsys.readouterr().out)["peak_bytes"] == memguard.estimate(
        hf.build(str(ckpt), seq_len=16).model, hf.build(str(ckpt), seq_len=16).batch, gpu="A100-40GB").peak_bytes
    with pytest.raises(memguard.ConfigError, match="has no config.json"):
        hf.build(str(tmp_path))


def test_hf_hub_id_offline_without_the_config_is_one_line(monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["estimate", "--hf", "meta-llama/Llama-3.1-8B", "--seq-len", "16", "--gpu", "A100-40GB", "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "huggingface-cli download meta-llama/Llama-3.1-8B config.json" in err


def test_every_plan_option_has_a_flag_or_is_api_only():
    """memguard.plan's keywords (PlanRequest's fields) all reach the command line, or say why not."""
    import dataclasses

    from memguard.cli import API_ONLY_OPTIONS, CLI_OPTIONS, build_parser
    from memguard.planner._request import PlanRequest

    parser = build_parser()
    plan_parser = next(a for a in parser._actions if hasattr(a, "choices") and a.choices and "plan" in a.choices
                       ).choices["plan"]
    flags = {s for a in plan_parser._actions for s in a.option_strings}
    for f in dataclasses.fields(PlanRequest):
        if f.name in API_ONLY_OPTIONS:
            assert API_ONLY_OPTIONS[f.name] and f.name not in CLI_OPTIONS
        else:
            assert CLI_OPTIONS.get(f.name) in flags, f"memguard.plan's {f.name} has no flag on `memguard plan`"


def test_strategy_finetune_and_eval_flags_plan_what_the_api_plans(capsys):
    base = ["plan", *TINY, "--gpu", "A100-40GB", "--global-batch-size", "8", "--json", "-q"]
    model, batch = tiny_model()
    assert main([*base, "--eval"]) == 0
    cli = json.loads(capsys.readouterr().out)
    api = memguard.plan(model, batch, global_batch_size=8, gpu="A100-40GB", train=False)
    assert cli["micro_batch_size"] == api.micro_batch_size and cli["estimate"]["peak_bytes"] == api.estimate.peak_bytes
    assert main([*base, "--world-size", "2", "--strategy", "fsdp2"]) == 0
    assert json.loads(capsys.readouterr().out)["strategy"] == "fsdp2"
    # FSDP1 (what Accelerate, the HF Trainer and Lightning's FSDPStrategy run) is planned as memguard.plan plans it
    assert main([*base, "--world-size", "2", "--strategy", "fsdp1", "--zero-stage", "3"]) == 0
    cli = json.loads(capsys.readouterr().out)
    api = memguard.plan(model, batch, global_batch_size=8, gpu="A100-40GB", world_size=2, strategy="fsdp1",
                        zero_stage=3)
    assert cli["strategy"] == "fsdp1" and cli["zero_stage"] == 3
    assert cli["micro_batch_size"] == api.micro_batch_size and cli["estimate"]["peak_bytes"] == api.estimate.peak_bytes
    with pytest.raises(SystemExit) as bad:
        main([*base, "--strategy", "zero"])
    assert bad.value.code == 2 and "is not a strategy" in capsys.readouterr().err


def test_gradient_compression_flags_plan_and_estimate_what_the_api_does(capsys):
    model, batch = tiny_model()
    flags = ["--world-size", "2", "--zero-stage", "0", "--gradient-compression", "powersgd", "--powersgd-rank", "2"]
    assert main(["plan", *TINY, "--gpu", "A100-40GB", "--global-batch-size", "8", *flags, "--json", "-q"]) == 0
    cli = json.loads(capsys.readouterr().out)
    api = memguard.plan(model, batch, global_batch_size=8, gpu="A100-40GB", world_size=2, zero_stage=0,
                        gradient_compression="powersgd", powersgd=2)
    assert cli["micro_batch_size"] == api.micro_batch_size and cli["estimate"]["peak_bytes"] == api.estimate.peak_bytes
    assert api.estimate.breakdown.get("powersgd_state", 0) > 0
    # PowerSGD needs DDP over more than one rank: a ConfigError, exit 2, naming what to do
    assert main(["plan", *TINY, "--gpu", "A100-40GB", "--global-batch-size", "8", "--gradient-compression",
                 "powersgd", "-q"]) == 2
