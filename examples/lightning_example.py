"""A Lightning training run planned and guarded by memguard: one callback (marked ``# memguard``).

The LightningModule keeps its batch size in ``self.batch_size`` and builds its train DataLoader
from it, the convention of Lightning's own ``BatchSizeFinder``. ``MemguardCallback`` plans before
the first step: for a 5 MiB budget the 256-sample batch does not fit at once, so it sets
``batch_size`` to the planned micro-batch and ``accumulate_grad_batches`` to keep 256 samples per
optimizer step; during ``fit`` an out-of-memory error would halve the micro-batch and run the same
samples again. After ``fit`` the module and the Trainer are as they were.

Runs on a CPU in well under a minute: ``python examples/lightning_example.py``.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

try:
    import lightning.pytorch as pl
except ImportError:
    import pytorch_lightning as pl

from memguard.integrations.lightning import MemguardCallback  # memguard


class Classifier(pl.LightningModule):
    def __init__(self, data: TensorDataset, batch_size: int = 256) -> None:
        super().__init__()
        self.data = data
        self.batch_size = batch_size  # the attribute memguard (and BatchSizeFinder) set
        self.net = nn.Sequential(nn.Linear(64, 2048), nn.GELU(), nn.Linear(2048, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, batch_size=len(x))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)


class PrintLoss(pl.Callback):
    def on_train_epoch_end(self, trainer, pl_module):
        print(f"epoch {trainer.current_epoch}: mean loss {trainer.callback_metrics['train_loss']:.4f}")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    pl.seed_everything(0, verbose=False)
    x = torch.randn(1024, 64)
    y = (x[:, :8].sum(dim=1) > 0).long() + 2 * (x[:, 8:16].sum(dim=1) > 0).long()  # 4 classes
    model = Classifier(TensorDataset(x, y))

    memguard_cb = MemguardCallback(budget_bytes=5 << 20)  # memguard: plans for a 5 MiB budget
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=3, callbacks=[memguard_cb, PrintLoss()],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(model)
    plan = memguard_cb.plan
    print(f"trained with micro-batch {memguard_cb.micro_batch_size} x accumulation {plan.grad_accum_steps} "
          f"(global batch {plan.global_batch_size}); batch_size is back to {model.batch_size}")


if __name__ == "__main__":
    main()
