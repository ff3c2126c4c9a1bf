"""The Trainer callback shows the plan summary, naming the arguments it changed in the user's script."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.utils.data import Dataset

transformers = pytest.importorskip("transformers")
from memguard.integrations.transformers import MemguardCallback  # noqa: E402


class _Tokens(Dataset):
    def __init__(self, n: int) -> None:
        self.ids = torch.randint(0, 128, (n, 16), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def test_the_trainer_callback_summary_names_the_arguments_it_changed(tmp_path, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="memguard")
    config = transformers.GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[],
                                          per_device_train_batch_size=8, gradient_accumulation_steps=2, max_steps=1)
    # 1.3 MiB cannot hold micro-batch 8 of this model (about 1.6 MiB predicted): the plan must change the arguments
    callback = MemguardCallback(budget_bytes=1300 << 10, activation_checkpointing=False)
    transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=args, train_dataset=_Tokens(16),
                         callbacks=[callback])
    plan = callback.plan
    assert plan.micro_batch_size < 8
    text = caplog.text
    assert f"memguard planned micro-batch {plan.micro_batch_size} x accumulation {plan.grad_accum_steps} x world 1" \
        in text and "1.27 MiB budget, given" in text
    assert (f"  overrides your script:\n    per_device_train_batch_size 8 -> {plan.micro_batch_size}\n"
            f"    gradient_accumulation_steps 2 -> {plan.grad_accum_steps}\n") in text

    caplog.clear()
    monkeypatch.setenv("MEMGUARD_QUIET", "1")
    transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=args, train_dataset=_Tokens(16),
                         callbacks=[MemguardCallback(budget_bytes=1300 << 10, activation_checkpointing=False)])
    assert "memguard planned" not in caplog.text
