"""Porting an Accelerator-first script to memguard: the loop before, the loop after, the same weights.

Most Accelerate scripts (transformers' ``run_clm_no_trainer.py`` among them) build the
``Accelerator`` first, from the script's own arguments, then prepare the model, optimizer and
dataloader and run Accelerate's gradient-accumulation loop with clipping. :func:`train_before` is
that loop; :func:`train_after` is the same script with memguard (lines marked ``# memguard``):

* the Accelerator is built as before: memguard plans on the first step, within what it fixes
  (its precision, accumulation and processes): the plan-on-first-step mode of
  :func:`memguard.integrations.accelerate.prepare`;
* ``prepare(accelerator, model, optimizer, ...)`` prepares the model and optimizer (it calls
  ``accelerator.prepare`` itself) and takes the clipping threshold; the dataloader is prepared as
  before, with the script's batch size;
* the loop body (``accumulate``, forward, ``backward``, clipping, ``step``, ``zero_grad``) becomes one
  ``step(accelerator, model, optimizer, batch)`` per dataloader batch, which splits the batch into
  the plan's micro-batches when it does not fit, and halves them on an out-of-memory error.

The plan summary says what runs: the plan's micro-batch within each dataloader batch and the
Accelerator's accumulation. ``python examples/port_accelerate.py`` trains both loops on a CPU and
prints the largest weight difference.
"""

from __future__ import annotations

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from memguard.integrations.accelerate import prepare, step  # memguard

batch_size, gradient_accumulation_steps, max_grad_norm, epochs = 32, 2, 0.5, 2


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def _setup():
    torch.manual_seed(0)
    x = torch.randn(256, 64)
    y = (x[:, :8].sum(dim=1) > 0).long() + 2 * (x[:, 8:16].sum(dim=1) > 0).long()
    model = nn.Sequential(nn.Linear(64, 1024), nn.GELU(), nn.Linear(1024, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(1))
    return model, optimizer, loader


def train_before() -> nn.Module:
    """The Accelerator-first loop, as Accelerate documents gradient accumulation with clipping."""
    model, optimizer, loader = _setup()
    accelerator = Accelerator(gradient_accumulation_steps=gradient_accumulation_steps, cpu=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for _ in range(epochs):
        for batch in loader:
            with accelerator.accumulate(model):
                loss = loss_fn(model, batch)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
    return accelerator.unwrap_model(model)


def train_after(**plan_options) -> nn.Module:
    """The same script with memguard: the Accelerator first, the plan made on the first step."""
    model, optimizer, loader = _setup()
    accelerator = Accelerator(gradient_accumulation_steps=gradient_accumulation_steps, cpu=True)
    model, optimizer = prepare(accelerator, model, optimizer, loss_fn=loss_fn,  # memguard: plans on the first step
                               max_grad_norm=max_grad_norm, **plan_options)
    loader = accelerator.prepare(loader)
    for _ in range(epochs):
        for batch in loader:
            step(accelerator, model, optimizer, batch)  # memguard: accumulate, backward, clip, step, zero_grad
    return accelerator.unwrap_model(model)


def max_difference(a: nn.Module, b: nn.Module) -> float:
    """The largest absolute difference between two models' weights."""
    return max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def main() -> float:
    before = train_before()
    # 1 MiB holds the model states and about half a batch's activations: each batch of 32 runs as two
    # micro-batches of 16, so the sums are grouped otherwise and the weights differ by float rounding only
    after = train_after(budget_bytes=1 << 20)
    diff = max_difference(before, after)
    print(f"max weight difference: {diff:.3g}")
    return diff


if __name__ == "__main__":
    main()
