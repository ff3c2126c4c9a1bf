"""One training step of a pipeline stage (``torch.distributed.pipelining``), and its OOM recovery.

:func:`memguard.integrations.parallel.apply` cuts a transformers decoder to this rank's stage with
the estimate's own cut (:func:`memguard.estimator._pipeline.split_decoder`), lays the stage out
over its data- and tensor-parallel ranks (FSDP2 and/or TP, as the estimate's
:class:`~memguard.estimator._pipeline.ShardedPipelineTracer`) and records a :class:`PipelineRun`;
:meth:`PipelineRun.step` runs one optimizer step of the whole pipeline on one batch (every rank
holds its data-parallel replica's batch: the first stage reads ``input_ids``, the last ``labels``),
and returns the global batch's loss on every rank. ``memguard.step`` dispatches a model cut to a
stage here (:func:`pipeline_run_of`).

The stage and its schedule are built as the estimate builds them
(:func:`memguard.estimator._pipeline.make_schedule`: a ``PipelineStage`` over the ``pp`` group given
its input, output and gradient shapes, so no shape inference runs over the process group; a later
stage's input example requires grad there; ``ScheduleGPipe`` or ``Schedule1F1B``), one per
micro-batch shape, when a batch of that shape first arrives. **The loss is the batch's mean.** The
schedule calls the loss once per micro-batch and, by default, divides every gradient by the number
of micro-batches afterwards (``schedules.py``, ``perform_reduce_grad(self._n_microbatches if
self.scale_grads else 1)`` -> ``stage.scale_grads``): the mean of the micro-batches' means, which is
the batch's mean only when every micro-batch has as many counted labels. Here each micro-batch's
loss is its summed token loss divided by the whole batch's count of counted labels (transformers'
``ForCausalLMLoss`` with ``num_items_in_batch``, as its Trainer does under gradient accumulation) and
``scale_grads`` is off, so the micro-batches' losses and gradients add up to the batch's, whatever
the split. With FSDP2 inside the stages (``dp_shard``, ``dp_replicate``) each data-parallel rank
passes its own share, the count is the global batch's (one all-reduce) and ``num_items_in_batch``
is that count over the data-parallel size, since FSDP2 averages the gradients over the
data-parallel ranks (transformers' Trainer does the same with ``average_tokens_across_devices``:
the count gathered over the ranks, the loss scaled by their number); the loss returned is the
global batch's.

OOM recovery ("drain"): a pipeline rank cannot leave its schedule when it runs out of memory, since
its peers would wait forever in a receive. So each micro-batch's forward and backward
(``PipelineStage.forward_one_chunk`` / ``backward_one_chunk``), the loss and the stage's gradient
reduction (``perform_reduce_grad``) run inside a guard: after an OOM
(:func:`memguard.guard._oom.is_oom_error`) or any other error on a rank, the rank drops what it
holds for the step (its cached outputs and their graphs), frees memory and, for the rest of the
schedule, computes nothing but hands zeros of the known shapes onward (a forward's output, a
backward's input gradient, the loss), so the schedule still posts every send and receive its peers
expect. After the schedule, one all-gather of ``[oom, error, loss]`` over every rank of the job
tells every rank what happened. On an OOM every rank logs it (logger ``"memguard"``), drops its
gradients (and FSDP2's per-step state), doubles the number of micro-batches (halving the
micro-batch) and runs the same batch again; any other error is raised on its rank and a
:class:`~memguard.errors.PeerFailedError` on the others. The optimizer steps once the schedule ran
everywhere without a failure.

A stage laid out over several ranks (FSDP2 and/or tensor parallelism inside it) drains as one.
Its ranks run collectives with each other inside the compute (FSDP2's all-gathers and
reduce-scatters, TP's redistributions), which a drained rank no longer joins. So the stage's ranks
agree, on a gloo group of their own, at every one of those collectives and after every unit of
compute, and all of them drain at the same point:

1. **Agreements.** The stage carries a :class:`memguard.guard._tp.TensorParallelRankGroup`
   (:func:`memguard.guard._tp.stage_rank_group`, the protocol of :mod:`memguard.guard._sharded`
   and :mod:`memguard.guard._tp`, armed for the whole schedule): one agreement before each FSDP2
   all-gather / reduce-scatter and at each TP ``ParallelStyle`` boundary, forward and backward.
   Here, besides, every rank of the stage agrees once after each forward, loss, backward and
   gradient reduction it computed, before the schedule posts that unit's sends and its next
   receives.
2. **A failure in compute** (between agreements): the failing rank drains and runs one agreement
   with its outcome at once. Every peer of its stage is then in, or reaches before it next waits on
   anything, its next agreement (a collective's inside the same unit, or the one after the unit),
   where the two meet: a peer inside a collective's agreement leaves the compute with
   :class:`~memguard.guard._sharded.PeerAbort`, one at a unit's end leaves it finished; both
   drain. Every collective issued before was issued by every rank of the stage, and from that unit
   on none of them computes, so no collective and no agreement is left unmatched. (Agreeing after
   each unit is what makes this hold: without it a peer could finish the unit, then wait on a
   receive from a next-stage rank whose own collective waits on the drained rank's send.) The
   other stages learn of it at the end-of-schedule all-gather; until then they compute on the zeros
   (or a mix of zeros and real values, identically shaped on every rank, so their own collectives
   still match), and every result of the attempt is dropped.
3. **A failure inside a collective** (after its agreement passed: FSDP2's all-gather output, a TP
   redistribution's output cannot be allocated) cannot be recovered: its peers wait in a collective
   it never joins. The failing rank records the error in the store and aborts its process groups
   (:meth:`~memguard.guard._sharded.ShardedRankGroup.stop`), its stage peers raise the same error
   (:class:`~memguard.errors.OOMRecoveryError` for an OOM), and the other stages' ranks, blocked in
   a receive from them, fail once those processes exit and raise a
   :class:`~memguard.errors.PeerFailedError`. The job must then be restarted with a smaller batch.

Cost. Measured with ``tests/integrations/parallel_pipeline_mesh_worker.py``'s ``time_steps`` (medians of 9
interleaved steps with and without the agreements, 4 gloo ranks on a shared, busy 2-core CPU host;
``PYTHONPATH=. python -c "import pathlib, tempfile; from tests.integrations import
test_parallel_pipeline_mesh as t; print(t._run(pathlib.Path(tempfile.mkdtemp()), t.LAYOUTS['pp2-tp2'],
schedule='1F1B', microbatches=4, time_steps=9, seq=256, vocab=4096)[0])"``, and ``'pp2-dp_shard2'``
with ``microbatches=2``) on the 4-block Llama of ``tests/integrations/parallel_pipeline_worker.py``:
``Layout(pp=2, tp=2)``, 8 rows of 256 tokens in 4 micro-batches, 289 agreements per step on the
first stage and 293 on the last, a step of 1.37 s against 0.85 s without them (about 1.8 ms per
agreement); ``Layout(pp=2, dp_shard=2)``, 4 rows per rank in 2 micro-batches, 31 and 33 agreements,
0.40 s against 0.30 s in one run and 0.57 s against 0.52 s in another (the host's load varies). A
model this small computes little between agreements; the cost weighs less
as the blocks grow.

Known limitations:
    Only the stage's compute, the loss and the gradient reduction are guarded: an OOM while the
    schedule makes a receive buffer or the zeros it sends for a missing gradient, or in the
    optimizer step, is not recovered (it is raised, and the peers may wait in their next receive).
    The micro-batch count doubles only while it divides the batch's rows; then an
    :class:`~memguard.errors.OOMRecoveryError` is raised on every rank. The smaller micro-batch is
    kept for later steps. Under GPipe halving the micro-batch saves little: the schedule holds every
    micro-batch's activations before its first backward, as many bytes at any split (only the
    per-micro-batch temporaries shrink), so 1F1B is the schedule to recover under. The last stage
    keeps no micro-batch's outputs (``return_outputs=False``), where the estimate's schedule keeps
    them (:func:`memguard.estimator._pipeline.run_schedule`): under 1F1B the estimate of the last
    rank is above its real peak by about those outputs. The batch must be a mapping with
    ``input_ids`` and ``labels`` (no attention mask: the stages run unpadded causal attention, as the
    estimate traces them); under tensor parallelism the ranks of a stage must pass the same batch.
    With several ranks per stage each agreement is a host all-reduce of a few int32 values on the
    stage's gloo group (see :mod:`memguard.guard._tp` for their number and cost), and the stage's
    ranks move in step at each of them. A peer killed outright (by the operating system's OOM
    killer) is not recovered: the others' next agreement, collective or receive fails. After an
    unrecoverable stop (3.) the ranks of the other stages read no recorded error: they raise a
    :class:`~memguard.errors.PeerFailedError` naming the lost connection.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memguard.errors import ConfigError, OOMRecoveryError, PeerFailedError
from memguard.guard._distributed import ERROR, OK, OOM
from memguard.guard._oom import free_memory, is_oom_error, oom_summary, release_exception

logger = logging.getLogger("memguard")

#: The label transformers' losses ignore (``loss_utils.py``, ``ForCausalLMLoss(ignore_index=-100)``).
IGNORE_INDEX = -100


def counted_labels(labels: torch.Tensor) -> torch.Tensor:
    """How many labels the causal-LM loss counts in ``labels``: every row's labels after its first
    (``ForCausalLMLoss`` pads each row with ``ignore_index`` and shifts by one), not ``IGNORE_INDEX``."""
    return (labels[..., 1:] != IGNORE_INDEX).sum()


@dataclass
class _Drain:
    """What one run of the schedule did on this rank: the first error (None: none), whether it was an OOM,
    and whether the rank drained for a peer of its stage."""

    error: BaseException | None = None
    oom: bool = False
    peer: bool = False  # drained because a peer of this stage failed
    outside: bool = False  # the error came from the schedule itself (a receive, a send), not the guarded compute
    zeros: dict[tuple, torch.Tensor] = field(default_factory=dict)

    def zeros_like_meta(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """One zero tensor per shape, shared by every placeholder (it is only ever sent, never written)."""
        key = (shape, dtype, str(device))
        if key not in self.zeros:
            self.zeros[key] = torch.zeros(shape, dtype=dtype, device=device)
        return self.zeros[key]


#: Each model cut to a stage -> its run, so that ``memguard.step`` can hand a pipeline model to
#: :meth:`PipelineRun.step` (memguard/ cannot import the integrations that build it).
_RUNS: "weakref.WeakKeyDictionary[nn.Module, PipelineRun]" = weakref.WeakKeyDictionary()


def pipeline_run_of(model: Any) -> "PipelineRun | None":
    """The :class:`PipelineRun` of a model cut to a pipeline stage by ``parallel.apply``, else None."""
    try:
        return _RUNS.get(model)
    except TypeError:  # not weak-referenceable: not one
        return None


def _innermost(exc: BaseException) -> BaseException:
    """The error ``exc`` was raised from, innermost first (the stage wraps its compute's errors:
    ``stage.py``, ``forward_one_chunk``: ``raise RuntimeError(exc_msg) from e``)."""
    seen: set[int] = set()
    while exc.__cause__ is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc = exc.__cause__
    return exc


def _in_chain(exc: BaseException, kind: type) -> BaseException | None:
    """The first error of type ``kind`` in ``exc``'s chain of causes and contexts, else None."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        if isinstance(e, kind):
            return e
        seen.add(id(e))
        todo += [e.__cause__, e.__context__]
    return None


class PipelineRun:
    """This rank's pipeline stage and the schedules that run it (see the module docstring).

    Attributes:
        model: the model, cut in place to this rank's stage (its parameters are the stage's).
        stage_module: the :class:`~memguard.estimator._pipeline.DecoderStage` the ``PipelineStage`` runs.
        rank, stages: this rank's stage index and the number of stages.
        schedule_name: ``"GPipe"`` or ``"1F1B"``.
        microbatches: micro-batches per step now (doubled after each OOM).
        stage, schedule: the ``PipelineStage`` and schedule of the last step (None before the first).
        stage_ranks: every stage's global ranks (one per stage without FSDP2 or TP inside).
        rank_group: this stage's :class:`~memguard.guard._tp.TensorParallelRankGroup` (None with one rank per
            stage).
        data_parallel_size: the data-parallel ranks inside a stage (``dp_replicate x dp_shard``).
        activation_dtype: the dtype of the hidden states the stages hand on (and of their gradients), which
            sizes the stage's receive buffers; None: the parameters' dtype.
    """

    def __init__(self, model: nn.Module, stage_module: nn.Module, *, rank: int, stages: int, schedule: str,
                 microbatches: int, device: torch.device, group: Any = None,
                 stage_ranks: list[list[int]] | None = None, rank_group: Any = None,
                 data_parallel_size: int = 1, activation_dtype: torch.dtype | None = None) -> None:
        self.model, self.stage_module = model, stage_module
        self.rank, self.stages, self.schedule_name, self.microbatches = rank, stages, schedule, microbatches
        self.device, self.group = torch.device(device), group
        self.stage_ranks = stage_ranks if stage_ranks is not None else [[r] for r in range(stages)]
        self.rank_group, self.data_parallel_size = rank_group, data_parallel_size
        self.activation_dtype = activation_dtype
        self.world_size = sum(len(r) for r in self.stage_ranks)
        cfg = model.config
        self.hidden_size, self.vocab_size = int(cfg.hidden_size), int(cfg.vocab_size)
        self.stage: Any = None
        self.schedule: Any = None
        self._built: tuple | None = None
        self._items: torch.Tensor | None = None
        self._rows = 0
        self._drain = _Drain()
        _RUNS[model] = self

    # ---- building --------------------------------------------------------------------------

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.stages - 1

    def _dtype(self) -> torch.dtype:
        """The dtype of what the stage sends and receives. It must be the dtype the stage computes in: a
        ``PipelineStage`` given its shapes makes its receive buffers from them (``stage.py``,
        ``_setup_forward_recv_info`` / ``_create_grad_recv_info``; ``_utils.py``, ``_make_tensor_from_meta``:
        ``torch.empty_strided``, uninitialised) and sends whatever the stage returned (``get_fwd_send_ops``),
        without comparing the two unless ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (``_runtime_validate``); gloo then
        receives a bf16 message of half the bytes into an fp32 buffer without an error, which leaves half of it
        as it was allocated."""
        if self.activation_dtype is not None:
            return self.activation_dtype
        for p in self.model.parameters():
            if p.is_floating_point():
                return p.dtype
        return torch.get_default_dtype()

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of one micro-batch: its summed token loss over the batch's counted labels
        (transformers' ``ForCausalLMLoss``, the model's own ``loss_function``, with ``num_items_in_batch``)."""
        return self.model.loss_function(logits=logits, labels=labels, vocab_size=self.vocab_size,
                                        num_items_in_batch=self._items)

    def _build(self, rows: int, seq: int, microbatches: int) -> None:
        """The stage and schedule for micro-batches of ``rows // microbatches`` rows of ``seq`` tokens,
        made by the estimate's :func:`~memguard.estimator._pipeline.make_schedule` (which makes a later
        stage's input example require grad)."""
        from memguard.estimator._pipeline import make_schedule

        key = (rows, seq, microbatches)
        if self._built == key:
            return
        self.stage = self.schedule = None  # the previous shape's receive buffers go
        free_memory()
        micro, dtype = rows // microbatches, self._dtype()
        # the examples are meta tensors: a PipelineStage keeps their shape, stride, dtype and requires_grad
        # only (_utils.py, TensorMeta.from_tensor) and makes its buffers on its own device; under tensor
        # parallelism the hidden states between stages are whole (the plans hand plain, replicated tensors on)
        hidden = torch.empty(micro, seq, self.hidden_size, dtype=dtype, device="meta")
        inp = torch.empty(micro, seq, dtype=torch.long, device="meta") if self.first else hidden
        out = torch.empty(micro, seq, self.vocab_size, dtype=dtype, device="meta") if self.last else hidden
        # every rank passes a loss: a schedule without one runs no backward (schedules.py, _has_backward);
        # only the last stage calls it
        loss = self._guarded_loss if self.last else (lambda output, target: output.sum())
        schedule = make_schedule(self.stage_module, self.rank, self.stages, self.schedule_name, microbatches,
                                 inp, out, loss, self.device, group=self.group)
        schedule.scale_grads = False  # the losses already sum to the batch's mean (module docstring)
        self._shapes = {"in": tuple(inp.shape), "out": tuple(out.shape), "dtype": dtype}
        del hidden, inp, out
        self._guard_stage(schedule._stage)
        self.stage, self.schedule, self._built = schedule._stage, schedule, key

    def build_for(self, batch: Mapping[str, torch.Tensor]) -> None:
        """Build the stage and schedule for ``batch``'s micro-batch shape now (the first :meth:`step` on a
        batch of that shape then uses them).

        Raises:
            ConfigError: the batch is not one the schedule can split.
        """
        rows, seq = self._check_batch(batch)
        self._build(rows, seq, self.microbatches)

    # ---- the drain ---------------------------------------------------------------------------

    @property
    def _drained(self) -> bool:
        return self._drain.error is not None or self._drain.peer

    def _drop(self) -> None:
        """Drop what the stage holds for the step (this run of the schedule is lost)."""
        stage = self.stage
        if stage is not None:
            # the micro-batches' outputs and graphs: their backward will not run (the wrapped backward
            # skips them), and the sends already posted hold what they send (stage.py, get_fwd_send_ops)
            stage.fwd_cache.clear()
            stage.output_chunks.clear()
        for p in self.model.parameters():
            p.grad = None
        free_memory()  # before any placeholder is made

    def _fail(self, exc: BaseException, where: str) -> None:
        """Record the first error of this run and drop what the stage holds for the step."""
        if self._drain.error is None:
            self._drain.error, self._drain.oom = exc, is_oom_error(exc)
            if self._drain.oom:
                release_exception(exc)  # the failed frames' activations and graph
            else:
                exc.add_note(f"memguard: raised on pipeline stage {self.rank}, in {where} (of {self.microbatches} "
                             "micro-batches); the other stages stopped with a PeerFailedError")
        self._drop()

    def _agree_after(self) -> bool:
        """The agreement after a unit of compute on a stage of several ranks (module docstring, 1.): whether
        every rank of the stage computed it. A peer's failure drains this rank too."""
        rg = self.rank_group
        if rg is None or rg.world_size == 1:
            return True
        codes, _ = rg.agree(OK, [self._rows])
        if max(codes) == OK:
            return True
        self._drain.peer = True
        self._drop()
        return False

    def _failed(self, exc: BaseException, where: str) -> None:
        """An error left a unit of compute: a peer's failure met at an agreement, this rank's own failure in
        compute (drained, then told to the stage's peers at once), or one inside a collective (every rank
        stops: module docstring, 3.).

        Raises:
            ShardingStopped: the failure cannot be recovered (the process groups are torn down).
        """
        from memguard.guard._sharded import PeerAbort, ShardingStopped

        rg = self.rank_group
        if rg is not None:
            stopped = _in_chain(exc, ShardingStopped)
            if stopped is not None:
                raise stopped
            if _in_chain(exc, PeerAbort) is not None:  # a peer failed: its report met at an agreement
                self._drain.peer = True
                self._drop()
                return
            inside, rg._inside = rg._inside, None
            if inside is not None:  # inside a TP boundary: the peers wait in its collective
                if rg.peer_stopped():
                    raise ShardingStopped(rg.stopped_error(exc)) from exc
                raise ShardingStopped(rg.stop(exc, inside)) from exc
        self._fail(exc, where)
        if rg is not None and rg.world_size > 1:
            rg.agree(OOM if self._drain.oom else ERROR, [self._rows])  # meets each peer's next agreement

    def _guarded(self, compute: Any, where: str) -> tuple[bool, Any]:
        """``compute()`` unless drained; ``(whether it ran on every rank of the stage, its result)``."""
        if self._drained:
            return False, None
        try:
            out = compute()
        except Exception as exc:  # noqa: BLE001 - drained, then raised after the schedule
            self._failed(exc, where)
            del exc
            return False, None
        if not self._agree_after():
            return False, None
        return True, out

    def _placeholder_outputs(self) -> tuple[torch.Tensor]:
        """A forward's output after a failure: zeros of the output's shape, which the stage sends on; the
        last stage sends nothing (its output only reaches the loss, which returns zero after a failure)."""
        if self.last:
            return (torch.empty(0, device=self.device),)
        return (self._drain.zeros_like_meta(self._shapes["out"], self._shapes["dtype"], self.device),)

    def _guard_stage(self, stage: Any) -> None:
        """Wrap the stage's per-micro-batch compute and its gradient reduction (instance attributes shadow
        ``_PipelineStageBase``'s ``forward_one_chunk`` / ``backward_one_chunk`` / ``perform_reduce_grad``,
        which every single-stage schedule calls)."""
        forward, backward, reduce = stage.forward_one_chunk, stage.backward_one_chunk, stage.perform_reduce_grad

        def forward_one_chunk(fwd_chunk_id, args, kwargs=None, save_forward_output=True):
            ok, out = self._guarded(lambda: forward(fwd_chunk_id, args, kwargs,
                                                    save_forward_output=save_forward_output),
                                    f"the forward of micro-batch {fwd_chunk_id}")
            if ok:
                return out
            del out
            outputs = self._placeholder_outputs()
            # what forward_one_chunk caches (stage.py): the outputs to send, no inputs to keep
            stage.fwd_cache[fwd_chunk_id] = (outputs, [])
            return outputs[0]

        def backward_one_chunk(bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
            ok, out = self._guarded(lambda: backward(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                                     last_backward=last_backward),
                                    f"the backward of micro-batch {bwd_chunk_id}")
            if ok:
                return out
            stage.fwd_cache.pop(bwd_chunk_id, None)
            # what backward_one_chunk caches for get_bwd_send_ops: the input gradients to send back
            stage.bwd_cache[bwd_chunk_id] = ((None,) if self.first else
                                             (self._drain.zeros_like_meta(self._shapes["in"], self._shapes["dtype"],
                                                                          self.device),))
            return None

        def perform_reduce_grad(grad_scale_factor):
            # FSDP2's reduce-scatters (post_backward of every group, stage.py); skipped once drained
            self._guarded(lambda: reduce(grad_scale_factor), "the reduction of the stage's gradients")

        stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk
        stage.perform_reduce_grad = perform_reduce_grad

    def _guarded_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        ok, out = self._guarded(lambda: self._loss(logits, labels), "the loss")
        if ok:
            return out
        return self._drain.zeros_like_meta((), torch.float32, self.device)

    # ---- the step ------------------------------------------------------------------------------

    def _check_batch(self, batch: Any) -> tuple[int, int]:
        if not (isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), torch.Tensor)
                and isinstance(batch.get("labels"), torch.Tensor)):
            raise ConfigError("a pipeline step takes a mapping with 'input_ids' and 'labels' tensors (the first stage "
                              "reads the ids, the last computes the model's loss on the labels), on every rank")
        ids = batch["input_ids"]
        if ids.dim() != 2 or tuple(batch["labels"].shape) != tuple(ids.shape):
            raise ConfigError(f"input_ids must be (rows, seq) and labels the same shape; got {tuple(ids.shape)} and "
                              f"{tuple(batch['labels'].shape)}")
        rows, seq = ids.shape
        if rows % self.microbatches:
            raise ConfigError(f"the batch's {rows} rows do not split into {self.microbatches} micro-batches: use a "
                              f"batch that is a multiple of {self.microbatches}, or set Layout(pp_microbatches=...) to "
                              f"a divisor of {rows}")
        return int(rows), int(seq)

    def _counted(self, labels: torch.Tensor) -> torch.Tensor:
        """``num_items_in_batch`` of this rank's micro-batches' losses (module docstring): the batch's counted
        labels, or with data-parallel ranks the global batch's over their number."""
        import torch.distributed as dist

        items = counted_labels(labels)
        if self.data_parallel_size == 1:
            return items.to(self.device)
        total = items.to(torch.float64).reshape(1)
        dist.all_reduce(total)  # every rank of the job: each data-parallel share counted pp x tp times
        copies = self.world_size // self.data_parallel_size
        return (total[0] / (copies * self.data_parallel_size)).to(torch.float32).to(self.device)

    def _run_once(self, batch: Mapping[str, torch.Tensor], rows: int, seq: int) -> torch.Tensor:
        """One run of the schedule over the batch; ``[oom, error, loss]`` of every rank of the job (one
        all-gather).

        Raises:
            OOMRecoveryError, PeerFailedError, or the failing rank's error: an unrecoverable failure inside a
                stage's collective (module docstring, 3.).
        """
        import contextlib

        import torch.distributed as dist

        from memguard.guard._sharded import ShardingStopped

        self._drain = _Drain()
        self._rows = rows
        loss = 0.0
        rg = self.rank_group
        try:
            self._build(rows, seq, self.microbatches)
            losses: list[torch.Tensor] = []
            kwargs = {"target": batch["labels"].to(self.device), "losses": losses} if self.last else {}
            args = (batch["input_ids"].to(self.device),) if self.first else ()
            armed = rg.armed(rows, rows // self.microbatches) if rg is not None else contextlib.nullcontext()
            with armed:
                # return_outputs=False: the last stage keeps no micro-batch's logits for a merged output
                # (schedules.py, forward_one_chunk(save_forward_output=return_outputs) -> output_chunks);
                # the step returns the loss only
                self.schedule.step(*args, return_outputs=False, **kwargs)
            if self.last and not self._drained:
                loss = float(sum(x.detach().float() for x in losses))
        except ShardingStopped as stopped:
            raise stopped.error from stopped
        except Exception as exc:  # noqa: BLE001 - outside the guarded compute: told to the peers, then raised
            if self._drain.error is None:
                self._drain.error, self._drain.oom, self._drain.outside = exc, is_oom_error(exc), True
        err = self._drain.error
        mine = torch.tensor([float(err is not None and self._drain.oom), float(err is not None and not self._drain.oom),
                             loss], dtype=torch.float64)
        everyone = [torch.zeros_like(mine) for _ in range(self.world_size)]
        try:
            dist.all_gather(everyone, mine)  # every rank of the job, whatever its stage and coordinates
        except Exception as exc:
            if err is not None and not self._drain.outside:  # this rank's own error in compute
                raise err from exc
            raise PeerFailedError(f"the connection to a peer was lost at the end of the pipeline schedule ({exc}); "
                                  "this rank stops too so that no rank waits forever", rank=-1) from exc
        return torch.stack(everyone)

    def step(self, optimizer: torch.optim.Optimizer, batch: Mapping[str, torch.Tensor]) -> float:
        """One optimizer step of the pipeline on ``batch`` (this data-parallel rank's share, the same on every
        stage); the global batch's loss on every rank. On an OOM on any rank, every rank reruns the batch with
        twice the micro-batches (see the module docstring)."""
        rows, seq = self._check_batch(batch)
        self._items = self._counted(batch["labels"])
        for p in self.model.parameters():
            p.grad = None
        last_ranks = self.stage_ranks[-1]
        while True:
            status = self._run_once(batch, rows, seq)
            err, self._drain.error = self._drain.error, None
            errors = [r for r in range(self.world_size) if status[r, 1]]
            if errors:
                if err is not None and not self._drain.oom:
                    raise err
                raise PeerFailedError(f"pipeline rank {errors[0]} failed in the pipeline step with an error that is "
                                      "not an out-of-memory error (that rank raises it); this rank stops too",
                                      rank=errors[0])
            ooms = [r for r in range(self.world_size) if status[r, 0]]
            if not ooms:
                break
            where = f"this rank: {oom_summary(_innermost(err))}" if err is not None else "not this rank"
            del err
            self._reset()
            micro = rows // self.microbatches
            if micro <= 1 or rows % (2 * self.microbatches):
                logger.warning("memguard: pipeline rank(s) %s ran out of memory at %d micro-batches of %d row(s) (%s); "
                               "the micro-batch cannot be halved further", ooms, self.microbatches, micro, where)
                advice = ("a smaller batch, more pipeline stages, or Layout(pp_schedule='1F1B') (GPipe holds every "
                          "micro-batch's activations at once, whatever their size)") if self.schedule_name == "GPipe" \
                    else "a smaller batch or more pipeline stages"
                raise OOMRecoveryError(f"pipeline rank(s) {ooms} ran out of memory at {self.microbatches} "
                                       f"micro-batches of {micro} row(s), and the batch's {rows} rows do not split "
                                       f"into {2 * self.microbatches}: use {advice}", micro_batch_size=micro)
            logger.warning("memguard: pipeline rank(s) %s ran out of memory at %d micro-batches of %d row(s) (%s); "
                           "gradients dropped, running the same batch again as %d micro-batches of %d row(s)",
                           ooms, self.microbatches, micro, where, 2 * self.microbatches, micro // 2)
            self.microbatches *= 2
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(sum(status[r, 2] for r in last_ranks) / len(last_ranks))

    def _reset(self) -> None:
        """After a failed run: no gradients, FSDP2's per-step state reset (on a stage of several ranks), no
        stage or schedule (the next run builds them for its micro-batch)."""
        params = list(self.model.parameters())
        if self.rank_group is not None:
            self.rank_group.reset(params)  # FSDP2: _reset_iter_state, the partial (unsharded) gradients dropped
        for p in params:
            p.grad = None
        self.stage = self.schedule = self._built = None
        self._drain = _Drain()
        free_memory()
