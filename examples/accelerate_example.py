"""An Accelerate training loop planned and guarded by memguard (lines marked ``# memguard``).

memguard plans first, for a 5 MiB budget: the 256-sample global batch does not fit at once, so the
plan accumulates micro-batches. ``accelerator_kwargs(plan)`` builds the Accelerator with the
plan's accumulation and precision, the DataLoader yields the plan's micro-batch, and ``step``
runs each batch under ``accelerator.accumulate`` with ``accelerator.backward``, stepping the
optimizer every ``grad_accum_steps`` batches. An out-of-memory error would halve the micro-batch
and run the optimizer step's samples again.

Runs on a CPU in well under a minute: ``python examples/accelerate_example.py``.
"""

from __future__ import annotations

import logging

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import memguard  # memguard
from memguard.integrations.accelerate import accelerator_kwargs, prepare, step  # memguard


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    torch.manual_seed(0)
    x = torch.randn(1024, 64)
    y = (x[:, :8].sum(dim=1) > 0).long() + 2 * (x[:, 8:16].sum(dim=1) > 0).long()  # 4 classes
    model = nn.Sequential(nn.Linear(64, 2048), nn.GELU(), nn.Linear(2048, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    plan = memguard.plan(model, (x[:8], y[:8]), global_batch_size=256, device="cpu", budget_bytes=5 << 20,  # memguard
                         optimizer=optimizer, loss_fn=loss_fn, precision="32-true")
    accelerator = Accelerator(**accelerator_kwargs(plan))  # memguard: mixed precision, accumulation, cpu
    model, optimizer = prepare(accelerator, model, optimizer, plan=plan, loss_fn=loss_fn)  # memguard
    loader = accelerator.prepare(DataLoader(TensorDataset(x, y), batch_size=plan.micro_batch_size, shuffle=True))

    for epoch in range(3):
        total = 0.0
        for batch in loader:
            total += step(accelerator, model, optimizer, batch)  # memguard: forward, backward, step every k
        print(f"epoch {epoch}: mean loss {total / len(loader):.4f}")
    print(f"trained with micro-batch {plan.micro_batch_size} x accumulation {plan.grad_accum_steps} "
          f"(global batch {plan.global_batch_size})")


if __name__ == "__main__":
    main()
