"""A plain PyTorch training loop, guarded by memguard: three lines change (marked ``# memguard``).

The loop without memguard reads::

    for x, y in loader:
        optimizer.zero_grad()
        loss = loss_fn(model, (x, y))
        loss.backward()
        optimizer.step()

With memguard, ``prepare`` plans the micro-batch and precision for a memory budget on the first
step, and ``step`` runs forward, backward, the optimizer step and ``zero_grad`` on the whole batch,
split into micro-batches; on an out-of-memory error it halves the micro-batch and runs the same
batch again. The model and optimizer stay what they were.

Runs on a CPU in a few seconds: ``python examples/plain_pytorch.py``.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import memguard  # memguard


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def main() -> float:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    torch.manual_seed(0)
    x = torch.randn(1024, 64)
    y = (x[:, :8].sum(dim=1) > 0).long() + 2 * (x[:, 8:16].sum(dim=1) > 0).long()  # 4 classes
    loader = DataLoader(TensorDataset(x, y), batch_size=256, shuffle=True)

    model = nn.Sequential(nn.Linear(64, 2048), nn.GELU(), nn.Linear(2048, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = memguard.prepare(model, optimizer, device="cpu", budget_bytes=5 << 20)  # memguard

    for epoch in range(3):
        total = 0.0
        for x_batch, y_batch in loader:
            total += memguard.step(model, optimizer, (x_batch, y_batch), loss_fn)  # memguard
        print(f"epoch {epoch}: mean loss {total / len(loader):.4f}")
    return total / len(loader)


if __name__ == "__main__":
    main()
