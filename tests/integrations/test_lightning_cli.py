"""MemguardCallback through LightningCLI: its planning options are named, typed parameters that jsonargparse
sees (``--trainer.callbacks.init_args.budget_bytes=...``), checked before anything runs."""

from __future__ import annotations

import pytest

pytest.importorskip("jsonargparse")
L = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.cli import LightningCLI  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from memguard.integrations.lightning import MemguardCallback  # noqa: E402

CALLBACK = "memguard.integrations.lightning.MemguardCallback"


class TinyRegression(L.LightningModule):
    """A LightningModule as LightningCLI builds it: its constructor arguments are CLI options too."""

    def __init__(self, width: int = 32, batch_size: int = 16) -> None:
        super().__init__()
        self.batch_size = batch_size  # the attribute the callback sets from the plan (batch_arg_name)
        self.net = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=self.batch_size)


def _cli(*args: str) -> LightningCLI:
    return LightningCLI(TinyRegression, run=False, save_config_callback=None, args=[
        "--trainer.accelerator=cpu", "--trainer.max_steps=2", "--trainer.logger=false",
        "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false", *args])


def test_lightning_cli_passes_typed_plan_options_to_the_callback(tmp_path):
    cli = _cli(f"--trainer.default_root_dir={tmp_path}", f"--trainer.callbacks+={CALLBACK}",
               "--trainer.callbacks.init_args.budget_bytes=300000000",
               "--trainer.callbacks.init_args.activation_checkpointing=false",
               "--trainer.callbacks.init_args.global_batch_size=32")
    (callback,) = [c for c in cli.trainer.callbacks if isinstance(c, MemguardCallback)]
    # the named options reach memguard.plan as they would through **plan_options
    assert callback.plan_options == {"budget_bytes": 300_000_000, "activation_checkpointing": False}
    assert callback.global_batch_size == 32
    cli.trainer.fit(cli.model)
    plan = callback.plan
    assert plan is not None and plan.budget_bytes == 300_000_000 and not plan.activation_checkpointing
    assert plan.micro_batch_size * plan.grad_accum_steps == 32  # one process: the whole global batch
    assert cli.trainer.global_step == 2  # it trained under the plan (the callback restores batch_size after fit)


def test_lightning_cli_rejects_a_badly_typed_option_before_training(capsys):
    # jsonargparse checks the type from the signature: a size written as text is an argument error
    with pytest.raises(SystemExit):
        _cli(f"--trainer.callbacks+={CALLBACK}", "--trainer.callbacks.init_args.budget_bytes=lots")
    assert "budget_bytes" in capsys.readouterr().err


def test_named_options_and_plan_options_are_one_set():
    # the named parameters and **plan_options feed one dict; None means "not given"
    cb = MemguardCallback(budget_bytes=1 << 30, headroom=None, cache=True, keep_outputs=False)
    assert cb.plan_options == {"budget_bytes": 1 << 30, "cache": True, "keep_outputs": False}
    with pytest.raises(Exception, match="headroom"):
        MemguardCallback(headroom=2.0)  # checked as memguard.plan checks it


def test_the_trainer_callback_names_the_same_options():
    pytest.importorskip("transformers")
    import inspect

    from memguard.integrations.transformers import MemguardCallback as TrainerCallback

    cb = TrainerCallback(budget_bytes=1 << 30, activation_checkpointing=True, torch_version=None)
    assert cb.plan_options == {"budget_bytes": 1 << 30, "activation_checkpointing": True}
    named = set(inspect.signature(TrainerCallback).parameters)
    # the Lightning callback's named options, less those the HF Trainer fixes itself (its ZeRO stage and offload)
    assert set(inspect.signature(MemguardCallback).parameters) - named == {
        "batch_arg_name", "zero_stage", "offload_optimizer"}
