"""Property tests of the ``memguard`` command line: a bad value is exit 2 and one line, never a traceback.

Every option of every sub-command is found in the parser the CLI builds (``build_parser``), so an
option added later is covered without touching this file. Each example feeds one malformed value
(random text, negative, zero, empty, comma lists, unicode, huge numbers, ``key=value`` items) to one
option, appended to a command line that otherwise runs in well under a second (a 1-layer GPT-2
built from its config on the meta device: nothing is downloaded), and runs ``memguard.cli.main``
in this process. What must hold:

* no traceback, whatever the value;
* the exit status is 0 (done), 1 (nothing fits) or 2 (bad usage);
* a value the option's own argparse ``type`` or ``choices`` refuses, or any value given to a flag
  that takes none (``--json=x``), is exit 2;
* exit 2 is exactly one line on stderr, ``memguard: error: ...``, and nothing on stdout; only a
  value with several bad parts (``--gpus 0,1``) gets one line per part, under ``N problems:``.

A value the option's type accepts may still be refused later (``--world-size 3`` for a global batch
of 4) or may be fine: then 0, 1 or 2 are all correct, but the one-line rule still holds for 2.

Three tests share these rules: a sweep of each kind of malformed value over every option (what the
parser refuses: milliseconds each), random draws of option and value (hypothesis), and random
values for every setting of four real transformers configs (``--hf-config``), which reach the
model build and the trace.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import re
import sys
import traceback

import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

from memguard.cli import build_parser, main  # noqa: E402

# Budget: a value the parser refuses costs milliseconds, one that reaches the planner about half a
# second; the default run draws a fixed sample (derandomize) so a failure reproduces in CI, and
# MEMGUARD_THOROUGH=1 draws 2000 random ones (1000 of config settings).
_THOROUGH = os.environ.get("MEMGUARD_THOROUGH") == "1"
FUZZ = settings(max_examples=2000 if _THOROUGH else 300, deadline=None, derandomize=not _THOROUGH, database=None,
                suppress_health_check=[HealthCheck.too_slow])

# A model that builds and plans in well under a second, and knobs fixed so the planner traces little.
TINY = ["--hf", "gpt2", "--hf-config", "n_layer=1", "n_embd=32", "n_head=2", "vocab_size=64", "--seq-len", "8"]
FIXED = ["--precision", "32-true", "--activation-checkpointing", "off"]
TARGET = ["--device", "cpu", "--budget", "1GiB"]
# The rest of each sub-command's command line: with TINY, or alone when the fuzzed option is --model
# (which excludes --hf).
REST = {
    "plan": ["--global-batch-size", "4", *TARGET, *FIXED, "-q"],
    "estimate": ["--device", "cpu", "-q"],
    "deepspeed-config": ["--global-batch-size", "4", *TARGET, *FIXED, "-q"],
    "gpus": ["--global-batch-size", "4", "--gpus", "T4", "--max-gpus", "1", *FIXED, "-q"],
}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options() -> list[tuple[str | None, argparse.Action]]:
    """(sub-command or None for the top level, action) for every option the parser has."""
    parser = build_parser()
    found: list[tuple[str | None, argparse.Action]] = [(None, a) for a in parser._actions if a.option_strings]
    for name, sub in _subparsers(parser).items():
        found += [(name, a) for a in sub._actions if a.option_strings]
    return found


OPTIONS = _options()
COMMANDS = sorted(_subparsers(build_parser()))


def test_every_sub_command_has_a_base_command_line():
    # a new sub-command needs a fast command line here, so that its options are covered too
    assert set(COMMANDS) == set(REST)
    assert len(OPTIONS) > 40  # the discovery found the options (about 20 per sub-command)


# GPT-2's config keys (and their aliases), so that key=value items hit real settings too.
_GPT2 = transformers.AutoConfig.for_model("gpt2")
GPT2_KEYS = sorted(set(_GPT2.to_dict()) | set(getattr(_GPT2, "attribute_map", {})))
DS_KEYS = ["gradient_clipping", "train_batch_size", "train_micro_batch_size_per_gpu", "zero_optimization",
           "zero_optimization.stage", "zero_optimization.overlap_comm", "fp16.enabled", "bf16", "a..b", ".x", "x."]

SPECIAL = ["", " ", "0", "-0", "-1", "+3", "1e3", "2.0", "0x10", "1_000", "nan", "inf", "-inf", "1,2", ",", "=",
           "==", "a=1,b=2", "n_layer=1,n_embd=32", "on,off", "bf16,fp8", "32-true,", "0,1,5", "T4,,H100", "∞", "１２", "٣",
           "\u200b", "\x00", "-", "-x", "--x", "%", "50%", "150%", "1.5TiB", "-1GiB", "9" * 400, "1" + "0" * 400 + "GB",
           "9" * 5000, "[" * 5000,  # beyond int()'s 4300 digits; nested beyond json's recursion limit
           # values some option accepts, so that the checks after parsing run too
           "1", "2", "8", "off", "on", "auto", "cpu", "cuda", "T4", "32-true", "gpt2", "causal-lm", "n_layer=2",
           "resid_pdrop=0.5", "gradient_clipping=1.0", "plan.png", "out.json"]

scalars = st.one_of(
    st.sampled_from(SPECIAL),
    st.text(max_size=24),  # random text (no surrogates: a command line cannot hold them)
    st.text(alphabet=st.characters(min_codepoint=0x80), min_size=1, max_size=8),  # unicode only
    st.integers(max_value=0).map(str),  # zero and negative numbers
    st.integers(min_value=2**31).map(str),  # huge numbers
    st.floats().map(repr),  # fractions, nan, inf, exponents
)
comma_lists = st.lists(scalars, min_size=2, max_size=4).map(",".join)
items = st.tuples(st.one_of(st.sampled_from(GPT2_KEYS + DS_KEYS), st.text(max_size=12)),
                  st.one_of(scalars, comma_lists)).map("=".join)
values = st.one_of(scalars, comma_lists, items,
                   st.integers(min_value=1, max_value=64).map(str))  # valid for most counts: the run goes on


def _importable(spec: str) -> bool:
    """Whether ``--model spec`` could import a real module or file (the fuzz never runs real code)."""
    module = spec.rpartition(":")[0]
    if "/" in module or os.sep in module or module.endswith(".py"):
        return os.path.exists(module)
    top = module.split(".")[0]
    try:
        return bool(top.isidentifier() and importlib.util.find_spec(top))
    except (ImportError, ValueError):
        return False


def _refuses(action: argparse.Action, value: str) -> bool:
    """Whether argparse itself refuses ``value`` for ``action`` (its ``type`` or ``choices``)."""
    if action.nargs == 0:
        return True  # a flag: `--json=x` is "ignored explicit argument"
    converted = value
    if action.type is not None:
        try:
            converted = action.type(value)
        except (argparse.ArgumentTypeError, TypeError, ValueError):  # what argparse turns into its error
            return True
        except Exception as exc:  # anything else escapes argparse: a traceback on the user's terminal
            raise AssertionError(f"the type of {action.option_strings} raised {exc!r} for {value!r}") from exc
    return action.choices is not None and converted not in action.choices


def _run(argv: list[str]) -> tuple[int, str, str]:
    """``main(argv)`` in this process: (exit status, stdout, stderr), a traceback in stderr if it raised."""
    out, err = io.StringIO(), io.StringIO()
    saved_path = list(sys.path)  # --model adds the current folder to sys.path
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as exc:  # argparse's errors
            rc = exc.code
        except BaseException:  # what would reach the user's terminal as a traceback
            traceback.print_exc()
            rc = "raised"
        finally:
            sys.path[:] = saved_path
    return rc, out.getvalue(), err.getvalue()


def _one_line_per_problem(err: str) -> bool:
    """Whether ``err`` is one error line, or (several bad parts of one value, ``--gpus 0,1``) a
    ``N problems:`` line, one ``  - `` line for each and the --help line: ConfigError's form."""
    lines = err.strip().splitlines()
    if len(lines) == 1:
        return lines[0].startswith("memguard: error: ")
    head = re.fullmatch(r"memguard: error: (\d+) problems:", lines[0])
    return (head is not None and len(lines) == int(head.group(1)) + 2
            and all(line.startswith("  - ") for line in lines[1:-1])
            and re.fullmatch(r"memguard: run `memguard [\w-]+ --help` for the options", lines[-1]) is not None)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A folder of its own as the current one: --out and --plot may write files, --model may look for modules."""
    path = tmp_path_factory.mktemp("cli_fuzz")
    old = os.getcwd()
    os.chdir(path)
    yield path
    os.chdir(old)


@FUZZ
@given(data=st.data())
def test_any_value_of_any_option_is_an_exit_status_and_at_most_one_line(workdir, data):
    command, action = data.draw(st.sampled_from(OPTIONS), label="option")
    flag = max(action.option_strings, key=len)
    value = data.draw(values, label="value")
    # argparse drops a "--" value (its end-of-options marker) even in --opt=--, before the type sees it
    assume(value != "--")
    if flag == "--model":
        assume(not _importable(value))
    argv = _command_line(command, flag, value)
    rc, out, err = _run(argv)
    event(f"exit {rc}")  # --hypothesis-show-statistics: how many examples got past the parser

    assert "Traceback" not in err, f"{argv}\n{err}"
    assert rc in (0, 1, 2), f"{argv}: exit {rc}\n{err}"
    if _refuses(action, value):
        assert rc == 2, f"{argv}: {flag} refuses {value!r} but the exit status is {rc}\n{err}"
    if rc == 2:
        assert _one_line_per_problem(err), f"{argv}\n{err}"
        assert out == "", f"{argv}: exit 2 printed on stdout:\n{out}"


# Each kind of malformed value, for the sweep below (the draws above may miss a pair).
MALFORMED = ["", " ", "-1", "0", "abc", "1.5", "1e3", "nan", "1,2", "a=1,b=2", "x,,y", "∞", "１２", "\u200b", "a\nb",
             "\x00", "9" * 400, "9" * 5000, "1" + "0" * 400 + "GB", "-1GiB", "150%"]


def _command_line(command: str | None, flag: str, value: str) -> list[str]:
    if command is None:  # a top-level option, before any sub-command
        return [f"{flag}={value}", "gpus", "-q"]
    model = [] if flag == "--model" else TINY
    return [command, *model, *REST[command], f"{flag}={value}"]


def test_every_option_refuses_each_kind_of_malformed_value_in_one_line(workdir):
    # every (option, value) pair the parser refuses, so none is left to chance; each costs
    # milliseconds since argparse stops before any model is built
    checked = 0
    for command, action in OPTIONS:
        flag = max(action.option_strings, key=len)
        for value in MALFORMED:
            if not _refuses(action, value):  # the hypothesis tests run the values it takes
                continue
            argv = _command_line(command, flag, value)
            rc, out, err = _run(argv)
            assert rc == 2 and "Traceback" not in err, f"{argv}: exit {rc}\n{err}"
            assert _one_line_per_problem(err) and out == "", f"{argv}\n{err}"
            checked += 1
    assert checked > len(OPTIONS) * 3  # most options refuse most of these


# Tiny configs of a decoder (GPT-2, Llama), an encoder (BERT) and an encoder-decoder (T5), whose
# every setting the next test overrides with a malformed or odd value.
TINY_CONFIGS = {
    "gpt2": ["n_layer=1", "n_embd=32", "n_head=2", "vocab_size=64"],
    "llama": ["num_hidden_layers=1", "hidden_size=32", "num_attention_heads=2", "num_key_value_heads=1",
              "intermediate_size=64", "vocab_size=64"],
    "bert": ["num_hidden_layers=1", "hidden_size=32", "num_attention_heads=2", "intermediate_size=64",
             "vocab_size=64"],
    "t5": ["num_layers=1", "d_model=32", "d_ff=64", "num_heads=2", "d_kv=16", "vocab_size=64"],
}
CONFIG_KEYS = {t: sorted(set(c.to_dict()) | set(getattr(c, "attribute_map", {})))
               for t, c in ((t, transformers.AutoConfig.for_model(t)) for t in TINY_CONFIGS)}
json_values = st.one_of(
    scalars,
    st.integers(min_value=-3, max_value=70).map(str),  # small sizes: many build, some do not fit
    st.sampled_from(["true", "false", "null", "[]", "{}", "[1, 2]", '{"a": 1}', '"x"', "1.5", "0.0", "-0.5",
                     "eager", "sdpa", "gelu", "relu", "float16", "bfloat16"]),
)
HF_FUZZ = settings(FUZZ, max_examples=1000 if _THOROUGH else 40)


@HF_FUZZ
@given(data=st.data())
def test_any_hf_config_setting_is_an_exit_status_and_at_most_one_line(workdir, data):
    # every setting of real configs, not just random keys: a value the config takes may still fail
    # when transformers builds the model or memguard traces it
    model_type = data.draw(st.sampled_from(sorted(TINY_CONFIGS)), label="model type")
    key = data.draw(st.sampled_from(CONFIG_KEYS[model_type]), label="key")
    value = data.draw(json_values, label="value")
    argv = ["estimate", "--hf", model_type, "--hf-config", *TINY_CONFIGS[model_type], f"{key}={value}",
            "--seq-len", "8", "--device", "cpu", "-q"]
    rc, out, err = _run(argv)
    event(f"exit {rc}")

    assert "Traceback" not in err, f"{argv}\n{err}"
    assert rc in (0, 2), f"{argv}: exit {rc}\n{err}"  # estimate has no "nothing fits"
    if rc == 2:
        assert _one_line_per_problem(err), f"{argv}\n{err}"
        assert out == "", f"{argv}: exit 2 printed on stdout:\n{out}"


@FUZZ
@given(command=st.text(max_size=16))
def test_an_unknown_sub_command_is_exit_2_and_one_line(command):
    assume(command not in COMMANDS and not command.startswith("-"))  # -h prints the help
    rc, out, err = _run([command])
    assert rc == 2 and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and "invalid choice" in err, err
