"""Which dtype convention an estimate assumed for a model whose parameters are not all one dtype.

A PEFT model on a 16-bit base is the common case: ``get_peft_model(..., autocast_adapter_dtype=True)``
(peft ``tuners_utils.cast_adapter_dtype``, the default) upcasts the adapter weights to float32 while
the base stays bfloat16, and each LoRA layer casts its input to the adapter's dtype
(``LoraLayer._cast_input_dtype`` in peft ``tuners/tuners_utils.py``). What a step then saves
depends on what the front-end does to that model, and the trace follows the precision as
:mod:`memguard.vocab` defines it:

- ``32-true``: the dtypes as built, no autocast (a plain loop, Lightning's ``"32-true"``, whose
  ``Precision.convert_module`` returns the module unchanged, and the HF Trainer without
  ``bf16``/``fp16``): the adapters save float32 activations.
- ``*-mixed``: the dtypes as built, under autocast (Lightning's ``"bf16-mixed"``, ``MixedPrecision``;
  the HF Trainer's ``bf16=True``, which Accelerate runs as autocast around the model as loaded,
  ``Accelerator.prepare_model``): the adapters' matmuls save 16-bit copies.
- ``*-true``: every floating parameter cast (Lightning's ``HalfPrecision.convert_module``:
  ``module.to(dtype)``), the adapters and their optimizer state included.
- DeepSpeed with 16 bits casts every parameter too (``DeepSpeedEngine._cast_module_mixed_precision``,
  called from ``_configure_distributed_model``); FSDP2's ``MixedPrecisionPolicy(param_dtype=...)`` casts
  each parameter for compute and keeps the sharded ones as built.

:func:`dtype_note` says which of these an estimate assumed, in ``Estimate.notes``.
"""

from __future__ import annotations

from typing import Iterable

import torch



def built_dtypes(params: Iterable[torch.Tensor]) -> tuple[tuple[str, int, int], ...]:
    """``(dtype, frozen elements, trainable elements)`` of the floating parameters as the user built them
    (each parameter once), largest first."""
    seen: set[int] = set()
    counts: dict[torch.dtype, list[int]] = {}
    for p in params:
        if id(p) in seen or not p.is_floating_point():
            continue
        seen.add(id(p))
        counts.setdefault(p.dtype, [0, 0])[1 if p.requires_grad else 0] += p.numel()
    rows = [(str(d).removeprefix("torch."), frozen, trainable) for d, (frozen, trainable) in counts.items()]
    return tuple(sorted(rows, key=lambda r: -(r[1] + r[2])))


def _describe(rows: tuple[tuple[str, int, int], ...]) -> str:
    parts = []
    for dtype, frozen, trainable in rows:
        what = [f"{n:,} {word}" for n, word in ((frozen, "frozen"), (trainable, "trainable")) if n]
        parts.append(f"{dtype} ({', '.join(what)})")
    return " and ".join(parts)


def dtype_note(rows: tuple[tuple[str, int, int], ...], precision: str, strategy: str, zero_stage: int) -> str | None:
    """One sentence for ``Estimate.notes`` saying how the precision treated parameters of several dtypes, or
    None when they are all one dtype (nothing to choose between).

    Args:
        rows: :func:`built_dtypes` of the user's model.
        precision: the precision estimated (the user's, before ZeRO's ``*-mixed`` -> ``*-true``).
        strategy: ``"ddp"``, ``"deepspeed"`` or ``"fsdp2"``.
        zero_stage: the sharding level.
    """
    if len(rows) < 2:
        return None
    built = f"parameters in {_describe(rows)}"
    if precision == "32-true":
        return (f"{built}: kept as built, no autocast (a plain loop, Lightning's '32-true', the HF Trainer "
                "without bf16/fp16); PEFT casts each adapter's input to the adapter's dtype, so float32 adapters "
                "save float32 activations. Under autocast (the HF Trainer's bf16=True) estimate precision="
                "'bf16-mixed'; with every weight cast (Lightning's 'bf16-true') precision='bf16-true'")
    dtype = "float16" if precision.startswith("16") else "bfloat16"
    if strategy == "deepspeed" and zero_stage >= 1:
        return (f"{built}: all cast to {dtype}, as DeepSpeed casts every parameter (engine "
                "_cast_module_mixed_precision), adapters included")
    if precision.endswith("-mixed") and strategy == "fsdp2":
        return (f"{built}: sharded as built; FSDP2's MixedPrecisionPolicy casts each one to {dtype} for compute")
    if precision.endswith("-mixed"):
        return (f"{built}: kept as built, under {dtype} autocast (the HF Trainer's bf16/fp16=True, which "
                "Accelerate runs as autocast around the model as loaded; Lightning's '*-mixed'): the adapters' "
                "matmuls save 16-bit inputs, their weights, gradients and optimizer state keep their dtype")
    return (f"{built}: all cast to {dtype}, as Lightning's precision='{precision}' casts the whole module "
            "(module.to(dtype)), adapters and their optimizer state included; a loop that keeps float32 adapters "
            "on the 16-bit base is precision='32-true' (or '*-mixed' under autocast)")
