"""Selective activation checkpointing of the CUDA kernels that memguard emulates.

A selective checkpointing policy (``torch.utils.checkpoint.create_selective_checkpoint_contexts``)
decides, per ATen op, whether the op's outputs are saved in forward or recomputed in backward: two
``TorchDispatchMode``\\ s see every op of the checkpointed region, ``_CachingTorchDispatchMode`` in
forward (it calls the policy and stores the outputs of the ops to save) and
``_CachedTorchDispatchMode`` during recomputation (it hands back the stored outputs and runs the
other ops again). On CUDA, ``F.scaled_dot_product_attention`` reaches those modes as one fused op,
``aten._scaled_dot_product_flash_attention`` (or the memory-efficient or cuDNN op), whose outputs
(attention output, logsumexp, RNG state) a policy such as torchtitan's ``_save_list`` saves.
memguard runs that call as its model of the CUDA kernel (:mod:`memguard.estimator._cuda_attention`),
whose allocations would reach the modes as plain ``empty``/``empty_like`` ops; :func:`run_as_aten_op`
shows the policy the ATen op instead, with the kernel's outputs, and runs the kernel with the
checkpointing mode off so that its own allocations are not ops of the region.

Sources: ``torch/utils/checkpoint.py``, ``_CachingTorchDispatchMode.__torch_dispatch__`` and
``_CachedTorchDispatchMode.__torch_dispatch__``: torch 2.13 calls the policy once, after the op,
with ``SelectiveCheckpointContext(is_recompute=False, op_output=out)``, and keys the storage by op
and call index (``func_counter``); torch 2.4 to 2.12 call the policy before the op, in forward and
again in recomputation (``is_recompute=True``), and keep a list per op that recomputation pops.

Known limitations:
    Only the host's own checkpointing modes are recognised (or subclasses of them), and only when
    one of them is the innermost dispatch mode, as ``checkpoint`` makes it; under any other mode
    stack the kernel runs as before (its allocations are the ops the policy sees).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._pytree import tree_map

try:  # the modes' private helpers, as each torch release names them (torch/utils/checkpoint.py)
    from torch.utils.checkpoint import (
        SelectiveCheckpointContext,
        _CachedTorchDispatchMode,
        _CachingTorchDispatchMode,
        _VersionWrapper,
    )
except ImportError:  # pragma: no cover - torch without selective checkpointing
    _CachingTorchDispatchMode = _CachedTorchDispatchMode = None  # type: ignore[assignment,misc]

try:
    from torch.utils.checkpoint import _detach_helper  # torch >= 2.13

    def _detach(x: Any) -> Any:
        return _detach_helper(x)
except ImportError:  # torch 2.4 to 2.12: _maybe_detach(x, any_ret_has_alias_info)
    from torch.utils.checkpoint import _maybe_detach

    def _detach(x: Any) -> Any:
        return _maybe_detach(x, False)  # the fused attention ops return no aliases

_SAVE = ("MUST_SAVE", "PREFER_SAVE")


def _saves(policy: Any) -> bool:
    if isinstance(policy, bool):  # _policy_from_bool: True is MUST_SAVE
        return policy
    return getattr(policy, "name", None) in _SAVE


def _sac_mode() -> Any:
    """The innermost dispatch mode when it is a selective checkpointing mode, else None."""
    if _CachingTorchDispatchMode is None:
        return None
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    mode = _get_current_dispatch_mode()
    if isinstance(mode, (_CachingTorchDispatchMode, _CachedTorchDispatchMode)):
        return mode
    return None


def _without_mode(kernel: Callable[[], Any]) -> Any:
    from torch.utils._python_dispatch import _pop_mode_temporarily

    with _pop_mode_temporarily():
        return kernel()


def _wrap(out: Any) -> Any:
    return tree_map(lambda x: _VersionWrapper(_detach(x)), out)


def _unwrap(mode: Any, entry: Any) -> Any:
    allow = getattr(mode, "allow_cache_entry_mutation", False)
    return tree_map(lambda x: x.get_val(allow), entry)


def run_as_aten_op(op: Any, args: tuple, kwargs: dict, kernel: Callable[[], tuple]) -> tuple:
    """Run ``kernel`` (the emulation of CUDA's ``op``) as the ATen op the checkpointing modes see.

    Args:
        op: the ``torch.ops.aten`` overload CUDA runs (what a policy compares ``func`` with).
        args, kwargs: the arguments CUDA's composite passes to ``op`` (handed to the policy).
        kernel: allocates the op's outputs on fake tensors and returns them as ``op`` returns them.

    Returns:
        ``kernel()``'s outputs; in a recomputation of a region whose policy saved ``op``, the
        outputs saved in forward (nothing is allocated).
    """
    mode = _sac_mode()
    if mode is None:
        return kernel()
    storage = mode.storage
    indexed = hasattr(mode, "func_counter")  # torch 2.13: entries keyed by op and call index
    if isinstance(mode, _CachingTorchDispatchMode):  # forward
        if not indexed:  # torch <= 2.12: the policy is asked before the op runs
            save = _saves(mode.policy_fn(SelectiveCheckpointContext(is_recompute=False), op, *args, **kwargs))
            out = _without_mode(kernel)
            if save:
                storage[op].append(_wrap(out))
            return out
        out = _without_mode(kernel)
        idx = mode.func_counter[op]
        mode.func_counter[op] += 1
        ctx = SelectiveCheckpointContext(is_recompute=False, op_output=out)
        from torch.utils.checkpoint import _RECOMPUTE

        storage[op][idx] = _wrap(out) if _saves(mode.policy_fn(ctx, op, *args, **kwargs)) else _RECOMPUTE
        return out
    # recomputation in backward (_CachedTorchDispatchMode)
    if not indexed:
        if _saves(mode.policy_fn(SelectiveCheckpointContext(is_recompute=True), op, *args, **kwargs)):
            entries = storage.get(op)
            if not entries:
                raise RuntimeError(f"{op} recomputed under selective checkpointing but not found in storage")
            return _unwrap(mode, entries.pop(0))
        return _without_mode(kernel)
    from torch.utils.checkpoint import _CONSUMED, _RECOMPUTE

    idx = mode.func_counter[op]
    mode.func_counter[op] += 1
    entry = storage.get(op, {}).get(idx)
    if entry is None or entry is _CONSUMED:
        raise RuntimeError(f"{op} call {idx} recomputed under selective checkpointing but not found in storage")
    if entry is _RECOMPUTE:
        return _without_mode(kernel)
    storage[op][idx] = _CONSUMED
    return _unwrap(mode, entry)
