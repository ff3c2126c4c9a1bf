"""Corrections for kernels whose fake (meta) implementation under-reports what they allocate.

A fake tensor op returns outputs of the right shapes, except where the real kernel sizes an
output at run time from a library's own query. Each correction here recomputes such an output
size the way the real kernel would, and the recorder replaces the fake output with one of that
size. Found by comparing the trace with a real CPU step under ``torch.profiler`` on the model zoo
(``benchmarks/accuracy_cpu.py``).

* ``aten.mkldnn_rnn_layer`` (CPU LSTM/GRU through oneDNN): the meta kernel returns an empty
  workspace, while oneDNN's training workspace (gates and states of every time step, saved for
  backward; ``workspace_desc().get_size()`` in aten/src/ATen/native/mkldnn/RNN.cpp) is as large
  as the output several times over. Its size is affine in the sequence length for fixed batch and
  widths, so memguard runs the real kernel at sequence lengths 1 and 2 with the same batch and
  widths (small, random data) and extrapolates; results are cached per shape.
* Reduced ``mse_loss``, ``smooth_l1_loss``, ``binary_cross_entropy`` and ``soft_margin_loss``:
  the real kernels compute the unreduced loss into a buffer the size of the broadcast inputs and
  return the 0-dim result as a view of it (measured on torch 2.13: ``F.mse_loss(a, b)`` of two
  64x128 fp32 tensors has a 32768-byte storage; ``l1_loss`` and ``cross_entropy`` do not), so the
  whole buffer lives as long as the loss does. The meta kernels return a 4-byte scalar.

:func:`unpacked_positions` answers transformers' packed-sequence check on fake positions as the real
run answers it for positions the model makes itself (no decoder cache: ``use_cache=False``, as the
HF Trainer runs, or a pipeline stage).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch

@functools.lru_cache(maxsize=256)
def _rnn_workspace_bytes(shapes: tuple, dtypes: tuple, flags: tuple, seq_dim: int, seq_len: int) -> int:
    """Real oneDNN workspace bytes of an ``mkldnn_rnn_layer`` call, extrapolated in sequence length."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.utils._python_dispatch import _disable_current_modes

    def run(length: int) -> int:
        tensors = []
        for i, (shape, dtype) in enumerate(zip(shapes, dtypes)):
            shape = list(shape)
            if i == 0:
                shape[seq_dim] = length
            tensors.append(torch.zeros(shape, dtype=dtype))
        out = torch.ops.aten.mkldnn_rnn_layer.default(*tensors, *flags)
        return out[3].untyped_storage().nbytes()

    with unset_fake_temporarily(), _disable_current_modes():  # (no_grad would drop the workspace)
        one, two = run(1), run(2)
    return max(0, one + (seq_len - 1) * (two - one))


def _mkldnn_rnn_layer(args: tuple, out: Any) -> Any:
    input_, *weights_and_states = args[:7]
    flags = tuple(tuple(a) if isinstance(a, list) else a for a in args[7:])
    batch_first = bool(args[14])
    seq_dim = 1 if batch_first else 0
    train = bool(args[15])
    if not train or out[3].untyped_storage().nbytes() > 0:
        return out
    tensors = (input_, *weights_and_states)
    shapes = tuple(tuple(t.shape) for t in tensors)
    dtypes = tuple(t.dtype for t in tensors)
    nbytes = _rnn_workspace_bytes(shapes, dtypes, flags, seq_dim, int(input_.shape[seq_dim]))
    workspace = torch.empty(nbytes, dtype=out[3].dtype if out[3].dtype.itemsize == 1 else torch.uint8)
    return (out[0], out[1], out[2], workspace)


def _reduction_arg(index: int) -> Callable[[tuple, Any], Any]:
    def fix(args: tuple, out: Any) -> Any:
        reduction = args[index] if len(args) > index else 1  # at::Reduction::Mean is the default
        if reduction == 0 or not isinstance(out, torch.Tensor) or out.dim() != 0:
            return out  # Reduction::None returns the full tensor already
        numel = torch.broadcast_shapes(args[0].shape, args[1].shape).numel()
        if numel <= 1:
            return out
        buffer = torch.empty(numel, dtype=out.dtype)
        return buffer[0]  # a 0-dim view: the storage is the whole unreduced buffer

    return fix


#: op -> correction(args, fake_outputs) -> corrected outputs (called under the fake mode)
CORRECTIONS: dict[Any, Callable[[tuple, Any], Any]] = {
    torch.ops.aten.mkldnn_rnn_layer.default: _mkldnn_rnn_layer,
    torch.ops.aten.mse_loss.default: _reduction_arg(2),
    torch.ops.aten.smooth_l1_loss.default: _reduction_arg(2),
    torch.ops.aten.binary_cross_entropy.default: _reduction_arg(3),
    torch.ops.aten.soft_margin_loss.default: _reduction_arg(2),
}


@contextlib.contextmanager
def unpacked_positions() -> Iterator[None]:
    """The causal mask of a transformers decoder as a real run makes it, for positions the model makes.

    Called with no decoder cache (``use_cache=False``: the HF Trainer's ``TrainingArguments.use_cache``
    default, a pipeline stage) and no ``position_ids``, transformers makes ``arange(seq)`` positions
    and asks whether they pack several sequences (``masking_utils.py``, ``_preprocess_mask_arguments``
    -> ``find_packed_sequence_indices``, 5.x). On real tensors the answer is read from the data
    (``arange``: one sequence, ``None``), so ``create_causal_mask`` may skip the mask
    (``_ignore_causal_mask_sdpa``) and SDPA takes the grouped key/value heads as they are
    (``sdpa_attention.py``, ``use_gqa_in_sdpa``: no mask). On fake tensors the data cannot be read
    (``is_tracing``), so the positions count as packed, a ``(seq, seq)`` mask is made and ``repeat_kv``
    copies every layer's keys and values to all query heads, kept for backward: the trace held those
    copies where the real step does not. Here a fake call answers what the real one does for the
    positions the model makes (only for those: given packed ``position_ids`` would be read as one
    sequence)."""
    try:
        from transformers import masking_utils
    except ImportError:  # no transformers: no decoder to cut
        yield
        return
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    from torch._subclasses.fake_tensor import is_fake

    def find(position_ids: torch.Tensor) -> torch.Tensor | None:
        return None if is_fake(position_ids) else original(position_ids)

    masking_utils.find_packed_sequence_indices = find
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original
