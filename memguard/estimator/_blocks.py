"""Finding a model's repeated blocks and wrapping them in activation checkpointing.

One mechanism serves the estimator (on its private copy of the model) and the guard (on the
user's model): :func:`apply_activation_checkpointing` overrides ``forward`` on the first
``num_blocks`` blocks with a non-reentrant :func:`torch.utils.checkpoint.checkpoint` call and
returns a function that undoes it.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

_MARK = "_memguard_checkpointed"


def find_container(model: nn.Module) -> nn.Module | None:
    """The ``ModuleList``/``Sequential`` holding the model's repeated blocks, or None."""
    best, best_key = None, (0, 0)
    for container in model.modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(container.children())
        if len(children) < 2 or len({type(c) for c in children}) != 1:
            continue
        if not any(True for _ in children[0].parameters()):
            continue
        key = (len(children), sum(p.numel() for p in children[0].parameters()))
        if key > best_key:
            best, best_key = container, key
    return best


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: the longest ``nn.ModuleList``/``nn.Sequential`` of ≥ 2 children
    of one class (transformer layers, ResNet stages' blocks), preferring more parameters on ties.

    Returns an empty list when the model has no repeated structure.
    """
    container = find_container(model)
    return list(container.children()) if container is not None else []


def apply_activation_checkpointing(
    model: nn.Module, num_blocks: int, blocks: list[nn.Module] | None = None
) -> Callable[[], None]:
    """Checkpoint the first ``num_blocks`` repeated blocks of ``model`` (see :func:`find_blocks`).

    Non-reentrant checkpointing keeps only each block's inputs and recomputes the rest in
    backward. Blocks already wrapped by memguard are left alone.

    When a block is wrapped, transformers' KV cache is turned off (every ``config.use_cache`` in the
    model), as transformers does under its own gradient checkpointing ("Caching is incompatible with
    gradient checkpointing": ``GradientCheckpointingLayer`` sets ``use_cache=False`` before
    checkpointing a layer, transformers/modeling_layers.py, 5.x; 4.x models did the same in their
    ``forward``): the backward replay would otherwise append each recomputed layer's keys and values
    to the cache a second time, and the copies stay alive until the step ends. The estimate and the
    guard both checkpoint through this function, so they train the model the same way.

    Args:
        blocks: the blocks to choose from (default: :func:`find_blocks`).

    Returns:
        A function that restores the original ``forward`` of every block wrapped here and the
        ``use_cache`` settings it turned off.
    """
    wrapped: list[nn.Module] = []
    for block in (find_blocks(model) if blocks is None else blocks)[: max(0, num_blocks)]:
        if getattr(block, _MARK, False):
            continue
        original = block.forward

        @functools.wraps(original)
        def forward(*args, __original=original, **kwargs):
            if not torch.is_grad_enabled():
                return __original(*args, **kwargs)
            return checkpoint(__original, *args, use_reentrant=False, **kwargs)

        block.forward = forward
        setattr(block, _MARK, True)
        wrapped.append(block)

    caching = []
    if wrapped:
        for module in model.modules():
            cfg = getattr(module, "config", None)
            if getattr(cfg, "use_cache", False) is True:
                cfg.use_cache = False
                caching.append(cfg)

    def undo() -> None:
        for block in wrapped:
            block.__dict__.pop("forward", None)
            block.__dict__.pop(_MARK, None)
        for cfg in caching:
            cfg.use_cache = True

    return undo


def hidden_size(model: nn.Module) -> int | None:
    """The model's hidden size: ``config.hidden_size`` (or ``d_model``/``n_embd``) when the model
    has an HF-style config, else the most common ``in_features`` of its Linear layers."""
    config = getattr(model, "config", None)
    for name in ("hidden_size", "d_model", "n_embd", "dim"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    counts: dict[int, int] = {}
    for m in model.modules():
        if isinstance(m, nn.Linear):
            counts[m.in_features] = counts.get(m.in_features, 0) + 1
    return max(counts, key=lambda k: (counts[k], k)) if counts else None
