"""`memguard plan --gpus-per-node K`: the layout search from the command line."""

from __future__ import annotations

import json

import pytest

import memguard
from memguard.cli import EXIT_USAGE, main

from tests.test_cli import FIXED, TINY, tiny_model


def test_gpus_per_node_plans_a_layout_as_the_api_does(capsys):
    args = ["plan", *TINY, *FIXED, "--gpu", "A100-40GB", "--global-batch-size", "8", "--world-size", "2",
            "--gpus-per-node", "2", "--json", "-q"]
    assert main(args) == 0
    cli = json.loads(capsys.readouterr().out)
    model, batch = tiny_model()
    api = memguard.plan(model, batch, global_batch_size=8, gpu="A100-40GB", world_size=2, gpus_per_node=2,
                        precision="32-true", activation_checkpointing=False)
    assert isinstance(api.layout, memguard.Layout)
    assert cli["layout"] == {k: getattr(api.layout, k) for k in ("dp_replicate", "dp_shard", "tp", "pp",
                                                               "pp_schedule", "pp_microbatches", "pp_stages_per_rank")}
    assert cli["micro_batch_size"] == api.micro_batch_size and cli["layout_report"] == list(api.layout_report)


def test_verify_budget_flag_reaches_the_plan(capsys):
    args = ["plan", *TINY, *FIXED, "--gpu", "A100-40GB", "--global-batch-size", "8", "--world-size", "2",
            "--gpus-per-node", "2", "--verify-budget", "0", "--json", "-q"]
    assert main(args) == 0
    assert "verify_budget_s=0" in json.loads(capsys.readouterr().out)["reasons"]["estimate"]
    with pytest.raises(SystemExit) as exc:  # argparse's usage error
        main(["plan", *TINY, *FIXED, "--gpu", "A100-40GB", "--global-batch-size", "8", "--world-size", "2",
              "--gpus-per-node", "2", "--verify-budget", "-3"])
    assert exc.value.code == EXIT_USAGE
    assert "number of seconds >= 0" in capsys.readouterr().err


def test_a_world_size_that_is_not_whole_nodes_is_a_usage_error(capsys):
    args = ["plan", *TINY, *FIXED, "--gpu", "A100-40GB", "--global-batch-size", "8", "--world-size", "3",
            "--gpus-per-node", "2"]
    assert main(args) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "--world-size" in err and "--gpus-per-node" in err and "2 or 4" in err
