"""Pipeline parallelism (``torch.distributed.pipelining``), traced for real, one or several stages per rank.

As :mod:`memguard.estimator._tp_trace` runs PyTorch's tensor parallelism on the fake copy, this
runs PyTorch's own pipeline schedule on it: for each pipeline rank ``r`` of ``pp`` the copy is cut
to stage ``r`` (:func:`split_decoder`: the repeated blocks split evenly, the first stage with the
embeddings, the last with the final norm, the head and the loss), wrapped in a ``PipelineStage``
over a fake process group in which this process is rank ``r``, and one steady-state step of the
schedule (``ScheduleGPipe`` or ``Schedule1F1B``) runs under the recorder. So what the rank keeps in
flight is what the schedule's own action order keeps (``schedules.py``, ``_get_pipeline_order`` /
``_step_microbatches``: GPipe all micro-batches' activations, 1F1B ``pp - r`` of them), together with
the stage's parameters, gradients and optimizer state and the stage's p2p receive buffers
(``stage.py``, ``_prepare_forward_infra`` / ``_prepare_backward_infra``, made on a warm-up step, as
in a running job). The last stage's loss is the model's own (``loss_function``: transformers'
``ForCausalLMLoss``) on each micro-batch's logits; it keeps no outputs. Under the trace the
stage's causal mask is made as on real tensors
(:func:`~memguard.estimator._fake_corrections.unpacked_positions`) and every sent tensor lives as
long as its send's work (:func:`held_sends`).

Under the multi-stage schedules (``Interleaved1F1B``, ``ZBVZeroBubble``) the copy is cut into ``pp *
pp_stages_per_rank`` virtual stages, rank ``r`` keeps the ones torch's layout gives it
(:func:`rank_stage_indices`: ``r, r + pp, ...``; the V layout's ``r`` and ``2 pp - 1 - r``), one
``PipelineStage`` each, and the real ``ScheduleInterleaved1F1B`` / ``ScheduleZBVZeroBubble`` runs them
(:class:`MultiStagePipelineTracer`), so its own action order decides what is in flight.

Known limitations:
    Only transformers decoder models are split (a base model under ``base_model_prefix`` with
    ``layers``, ``embed_tokens`` and ``norm``, called with ``inputs_embeds`` on later stages, and an
    ``lm_head``; Llama, Mistral, Qwen2 and the like); ``loss_fn`` must be None. ``GPipe`` and
    ``1F1B`` (one stage per rank), and ``Interleaved1F1B`` and ``ZBVZeroBubble`` (several virtual
    stages per rank, :class:`MultiStagePipelineTracer`, pipeline stages alone). Inside a stage of a
    single-stage schedule, FSDP2 and tensor parallelism (:class:`ShardedPipelineTracer`); no DDP over
    stages. On real 2- and 4-rank gloo runs (``benchmarks/layouts_cpu.py``, its ``llama-pp*`` cases,
    pipeline stages alone and with FSDP2 or TP inside, and 2 ranks of 2 virtual stages each under
    ``Interleaved1F1B`` and ``ZBVZeroBubble``) every rank's estimate equals that rank's real peak of
    live tensor bytes in every step the replay saw whole; two things the fake run does differently from
    a real one are undone for that (``unpacked_positions`` of :mod:`memguard.estimator._fake_corrections`:
    the stage's causal mask; :func:`held_sends`: send works keep what they send).
    Every rank holds the replica's batch (the first stage reads its ``input_ids``, the last
    its ``labels``). The trace's ``forward`` phase holds the whole schedule, backward included.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any, Iterator

import torch
from torch import nn

from memguard.errors import ConfigError
from memguard.estimator._fake_corrections import unpacked_positions
from memguard.estimator._result import Category
from memguard.estimator._trace import ScalarStub, StepTracer, Trace, TraceSpec, quiet_fake_tensor_log

#: The schedules traced, by the names of ``Layout.pp_schedule`` (torch.distributed.pipelining.schedules).
SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
#: The schedules with several stages per rank, and how they lay the stages out over the ranks
#: (``_utils.py``, ``generate_stage_to_rank_mapping``: ``"loop"``, stage ``s`` on rank ``s % pp``, as
#: ``PipelineScheduleMulti.__init__`` maps them; ``"v"``, which ``ScheduleZBVZeroBubble.__init__`` asks for).
MULTI_STAGE_SCHEDULES = {"Interleaved1F1B": "loop", "ZBVZeroBubble": "v"}


def decoder_parts(model: nn.Module) -> tuple[nn.Module, nn.ModuleList] | None:
    """The base model and its ``layers`` when ``model`` is a transformers decoder that
    :func:`split_decoder` can cut (see the module's Known limitations), else None."""
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    if not isinstance(base, nn.Module) or base is model:
        return None
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not all(
            isinstance(getattr(base, n, None), nn.Module) for n in ("embed_tokens", "norm")):
        return None
    if not isinstance(getattr(model, "lm_head", None), nn.Module):
        return None
    return base, layers


def stage_bounds(num_layers: int, stages: int, stage: int) -> tuple[int, int]:
    """Blocks ``[lo, hi)`` of ``stage``: an even split, the first stages one block longer where the
    blocks do not divide evenly."""
    base, extra = divmod(num_layers, stages)
    lo = stage * base + min(stage, extra)
    return lo, lo + base + (1 if stage < extra else 0)


class DecoderStage(nn.Module):
    """One pipeline stage of a transformers decoder (built by :func:`split_decoder`): the first stage
    takes ``input_ids``, the others the previous stage's hidden states (``inputs_embeds``); the last
    returns logits, the others hidden states."""

    def __init__(self, model: nn.Module, first: bool, last: bool) -> None:
        super().__init__()
        self.model, self.first, self.last = model, first, last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = getattr(self.model, self.model.base_model_prefix)
        kwargs = {"input_ids": x} if self.first else {"inputs_embeds": x}
        hidden = base(use_cache=False, **kwargs).last_hidden_state
        return self.model.lm_head(hidden) if self.last else hidden


def not_a_decoder(model: nn.Module) -> str:
    """The problem of a model :func:`decoder_parts` does not know, said once for every refusal."""
    return (f"pipeline stages are cut from transformers decoder models (a base model with layers, embed_tokens and "
            f"norm, and an lm_head); {type(model).__name__} is not one: drop Layout(pp=...)")


def _decoder_parts_or_raise(model: nn.Module) -> tuple[nn.Module, nn.ModuleList]:
    parts = decoder_parts(model)
    if parts is None:
        raise ConfigError(not_a_decoder(model))
    return parts


def split_decoder(model: nn.Module, stage: int, stages: int) -> DecoderStage:
    """Cut ``model`` in place to pipeline stage ``stage`` of ``stages`` (the blocks outside it
    dropped, the embeddings kept on the first stage only, the final norm and the head on the last
    only) and wrap it in a :class:`DecoderStage`. The same cut serves the estimate and a real job.

    Raises:
        ConfigError: the model is not a decoder :func:`decoder_parts` knows.
    """
    base, layers = _decoder_parts_or_raise(model)
    lo, hi = stage_bounds(len(layers), stages, stage)
    base.layers = nn.ModuleList(list(layers)[lo:hi])
    first, last = stage == 0, stage == stages - 1
    if not first:
        base.embed_tokens = None
    if not last:
        base.norm = nn.Identity()
        model.lm_head = None
    return DecoderStage(model, first, last)


def rank_stage_indices(rank: int, pp: int, stages_per_rank: int, style: str) -> list[int]:
    """The virtual stages rank ``rank`` of ``pp`` holds, ascending, ``stages_per_rank`` of them: under the loop
    layout ``rank, rank + pp, rank + 2 pp, ...``; under the V layout (two per rank) ``rank`` and
    ``2 pp - 1 - rank``. The inverse of torch's ``generate_stage_to_rank_mapping(pp, pp * stages_per_rank,
    style)`` (``_utils.py``), and the stages ``ScheduleZBVZeroBubble._calculate_single_rank_operations`` gives
    a rank (``stage_id_chunk0 = rank``, ``stage_id_chunk1 = num_stages - 1 - rank``)."""
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    mapping = generate_stage_to_rank_mapping(pp, pp * stages_per_rank, style=style)
    return sorted(s for s, r in mapping.items() if r == rank)


def split_decoder_stages(model: nn.Module, indices: list[int], stages: int) -> list[DecoderStage]:
    """The virtual stages ``indices`` of ``stages`` (one rank's, several per rank) of ``model``, each a
    :class:`DecoderStage` cut as :func:`split_decoder` cuts one, and ``model`` cut in place to what they hold
    together (their blocks, in stage order; the embeddings if one is the first stage, the final norm and the
    head if one is the last), so that ``model.parameters()`` are the rank's and each stage's ``parameters()``
    its own. Each stage's model is a shallow copy of ``model`` (and of its base model) with its own child
    modules, so the stages share parameters with ``model`` and none with each other.

    Raises:
        ConfigError: the model is not a decoder :func:`decoder_parts` knows.
    """
    import copy

    base, layers = _decoder_parts_or_raise(model)
    prefix = model.base_model_prefix
    out, kept = [], []
    for stage in indices:
        m, b = copy.copy(model), copy.copy(base)
        m._modules, b._modules = dict(model._modules), dict(base._modules)
        m._modules[prefix] = b
        lo, hi = stage_bounds(len(layers), stages, stage)
        kept += list(layers)[lo:hi]
        b.layers = nn.ModuleList(list(layers)[lo:hi])
        first, last = stage == 0, stage == stages - 1
        if not first:
            b.embed_tokens = None
        if not last:
            b.norm = nn.Identity()
            m.lm_head = None
        out.append(DecoderStage(m, first, last))
    base.layers = nn.ModuleList(kept)
    if 0 not in indices:
        base.embed_tokens = None
    if stages - 1 not in indices:
        base.norm = nn.Identity()
        model.lm_head = None
    return out


def _pipeline_stage(stage_module: nn.Module, stage: int, stages: int, micro_input: torch.Tensor,
                    micro_output: torch.Tensor, device: Any, group: Any) -> Any:
    """The ``PipelineStage`` of ``stage_module`` with its input, output and gradient shapes given (see
    :func:`make_schedule`)."""
    from torch.distributed.pipelining import PipelineStage

    if micro_input.is_floating_point() and not micro_input.requires_grad:
        micro_input = micro_input.detach().requires_grad_(True)
    grad_in = micro_input if micro_input.is_floating_point() else None
    return PipelineStage(stage_module, stage, stages, device, input_args=(micro_input,), output_args=(micro_output,),
                         output_grads=(micro_output,), input_grads=(grad_in,), group=group)


def make_multi_schedule(stage_modules: list[nn.Module], indices: list[int], stages: int, schedule: str,
                        microbatches: int, micro_ids: torch.Tensor, micro_hidden: torch.Tensor,
                        micro_logits: torch.Tensor, loss_fn: Any, device: Any, group: Any = None) -> Any:
    """The ``PipelineStage`` of each of one rank's virtual stages ``indices`` (the first stage takes the ids,
    the others hidden states; the last gives logits, the others hidden states; as :func:`make_schedule`
    gives them) and the schedule over them: ``ScheduleInterleaved1F1B`` or ``ScheduleZBVZeroBubble``
    (``schedules.py``: both take the rank's stages as a list, ``(stages, n_microbatches, loss_fn)``)."""
    from torch.distributed.pipelining import ScheduleInterleaved1F1B, ScheduleZBVZeroBubble

    pstages = [_pipeline_stage(module, s, stages, micro_ids if s == 0 else micro_hidden,
                               micro_logits if s == stages - 1 else micro_hidden, device, group)
               for module, s in zip(stage_modules, indices)]
    cls = {"Interleaved1F1B": ScheduleInterleaved1F1B, "ZBVZeroBubble": ScheduleZBVZeroBubble}[schedule]
    return cls(pstages, n_microbatches=microbatches, loss_fn=loss_fn)


def checkpoint_stage(stage_module: DecoderStage, per_stage: int) -> Any:
    """Checkpoint the first ``per_stage`` of the blocks a stage kept (:func:`split_decoder`), in module
    order: with ``activation_checkpointing=k`` under ``Layout(pp=P)`` every stage checkpoints the first
    ``k`` of its own blocks (all of them where it has ``k`` or fewer), as the layout planner counts
    checkpointed blocks per stage (``memguard/planner/_layouts.py``, ``LayoutProfile.rank_bytes``:
    ``k = min(k, blocks)`` of stage ``s``'s ``blocks``). The estimate (:class:`PipelineTracer`) and
    ``memguard.integrations.parallel.apply`` both checkpoint through this function, with the plain
    estimate's mechanism (:func:`~memguard.estimator._blocks.apply_activation_checkpointing`: a
    non-reentrant ``torch.utils.checkpoint`` call in place of each block's ``forward``, the KV cache
    off); the function it returns undoes it.

    With FSDP2 and/or TP inside the stage (:class:`ShardedPipelineTracer`) it runs right after the cut,
    before ``parallelize_module`` and ``fully_shard``. torchtitan's order is TP, then checkpointing, then
    FSDP2 (``torchtitan/models/llama3/infra/parallelize.py``, ``parallelize_llama``: ``apply_tp``, then
    ``apply_ac``, then ``apply_fsdp``), because its wrapper replaces each block in ``model.layers`` by a
    ``ptd_checkpoint_wrapper`` module (``torchtitan/distributed/activation_checkpoint.py``), which renames
    the block's submodules for a TP plan applied after it. This wrapper overrides the block's ``forward``
    only: module names, submodules and hooks stay as they are, so ``parallelize_module`` (which shards the
    submodules by name and hooks their calls) finds the same modules before or after it, and FSDP2's
    hooks on the block run around the overridden ``forward`` as around the original; the step is
    torchtitan's.
    """
    from memguard.estimator._blocks import apply_activation_checkpointing

    model = stage_module.model
    layers = list(getattr(model, model.base_model_prefix).layers)
    return apply_activation_checkpointing(stage_module, per_stage, layers)


def make_schedule(stage_module: nn.Module, stage: int, stages: int, schedule: str, microbatches: int,
                  micro_input: torch.Tensor, micro_output: torch.Tensor, loss_fn: Any, device: Any,
                  group: Any = None) -> Any:
    """The ``PipelineStage`` of ``stage_module`` (its input, output and gradient shapes given, so no
    shape inference runs over the process group) and its schedule.

    A later stage's input example (floating point: the previous stage's hidden states) is made to
    require grad: a ``PipelineStage`` makes its receive buffers require grad only when the example
    does (``stage.py``, ``_retrieve_recv_activations``: ``effective_requires_grad =
    info.tensor_meta.requires_grad and ...``; ``_utils.py``, ``TensorMeta.from_tensor``), and without it
    the stage computes no input gradient and sends zeros back (``get_bwd_send_ops``), so every earlier
    stage would train on zero gradients and hold none of the memory that gradient takes."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    pstage = _pipeline_stage(stage_module, stage, stages, micro_input, micro_output, device, group)
    cls = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}[schedule]
    return cls(pstage, n_microbatches=microbatches, loss_fn=loss_fn)


def stage_buffers(schedule: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The persistent p2p receive buffers of a schedule's stages, one per micro-batch: the forward
    inputs' (``args_recv_info``) and the output gradients' (``grad_recv_info``), made by the first step
    (``stage.py``, ``_prepare_forward_infra``/``_prepare_backward_infra``) and reused by every step; a stage
    fed by a stage on the same rank (the V layout) gets new ones each step instead (``stage.py``,
    ``set_local_fwd_input``/``set_local_bwd_input``), kept until the next step replaces them. With the
    gradients: an input buffer's ``.grad``, which the split backward of the zero-bubble schedules leaves
    there until the next step's input-gradient step of that micro-batch replaces it (``_backward.py``,
    ``stage_backward_input``: ``inp.grad = dinput``; the full backward, ``stage_backward``, clears it:
    ``val.grad = None``)."""
    out: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    for stage in schedule_stages(schedule):
        for k, infos in enumerate((stage.args_recv_info, stage.grad_recv_info)):
            for recv in infos.values():
                for info in recv:
                    buffer = getattr(info, "buffer", None)
                    if isinstance(buffer, torch.Tensor) and not getattr(info, "is_root_arg", False):
                        out[k].append(buffer)
                        if k == 0 and buffer.is_leaf and buffer.grad is not None:
                            out[1].append(buffer.grad)
    return out


def schedule_stages(schedule: Any) -> list[Any]:
    """The pipeline stages a schedule runs on this rank: ``_stages`` of a multi-stage schedule
    (``PipelineScheduleMulti``), ``_stage`` of a single-stage one (``PipelineScheduleSingle``)."""
    stages = getattr(schedule, "_stages", None)
    return list(stages) if stages is not None else [schedule._stage]


def run_schedule(schedule: Any, batch: dict[str, torch.Tensor]) -> None:
    """One step of ``schedule`` on this pipeline rank: the rank that holds the first stage feeds
    ``input_ids``, the one that holds the last the ``labels`` as the loss's target (under the V layout
    rank 0 holds both). The last stage keeps no outputs (``return_outputs=False``:
    ``schedules.py`` then runs ``forward_one_chunk(..., save_forward_output=False)``, so the stage's
    ``output_chunks`` do not hold every micro-batch's logits until the next step), as a training loop that
    wants the losses only runs it."""
    held = schedule_stages(schedule)
    args = (batch["input_ids"],) if any(s.is_first for s in held) else ()
    kwargs = {"target": batch["labels"], "losses": []} if any(s.is_last for s in held) else {}
    schedule.step(*args, return_outputs=False, **kwargs)


def causal_lm_loss(model: nn.Module) -> Any:
    """The last stage's loss: the model's own ``loss_function`` (transformers' ``ForCausalLMLoss``) on
    logits and labels, as the model's forward computes it."""
    vocab = model.config.vocab_size

    def loss(logits, labels):
        return model.loss_function(logits=logits, labels=labels, vocab_size=vocab)

    return loss


class _HeldWorks(list):
    """The works of one p2p batch, holding the tensors they send (see :func:`held_sends`)."""

    held: tuple[torch.Tensor, ...] = ()


@contextlib.contextmanager
def held_sends() -> Iterator[None]:
    """Sent tensors live as long as their send's work, as on a real process group.

    A real backend's send work keeps the tensor it sends until the work is destroyed, waited or
    not (``ProcessGroupGloo.cpp``: ``SendWork`` holds ``tensor_``; NCCL stashes a work's tensors
    for the caching allocator), and the schedules keep their send works until they wait on them,
    some until the end of the step (``schedules.py``, ``ScheduleGPipe._step_microbatches``:
    ``fwd_sends_to_wait``/``bwd_sends_to_wait``; ``Schedule1F1B``: ``send_work``). The fake
    process group's works hold nothing, so an input gradient the stage sends (popped from
    ``bwd_cache`` by ``get_bwd_send_ops``) died in the trace as soon as the schedule dropped its
    ops. Here every batch of p2p ops (``schedules._batch_p2p``, through which every schedule
    sends) returns its works with the sent tensors attached."""
    from torch.distributed.pipelining import schedules

    original = schedules._batch_p2p

    def batch_p2p(p2p_ops, desc=None):
        works = _HeldWorks(original(p2p_ops, desc=desc))
        works.held = tuple(op.tensor for op in p2p_ops if op.op is torch.distributed.isend)
        return works

    schedules._batch_p2p = batch_p2p
    try:
        yield
    finally:
        schedules._batch_p2p = original


@contextlib.contextmanager
def saved_rng_states() -> Iterator[None]:
    """The CPU generator states a checkpointed block saves, as tensors the trace sees (the CPU target).

    Non-reentrant checkpointing with ``preserve_rng_state=True`` (the default,
    :func:`~memguard.estimator._blocks.apply_activation_checkpointing`) saves the CPU generator's state
    when a block runs forward and keeps it with the block's frame until the block's backward
    recomputes it (``torch/utils/checkpoint.py``, ``_checkpoint_without_reentrant_generator``:
    ``fwd_cpu_state = torch.get_rng_state()``); the recomputation forks the generator, saving its state
    once more while it runs (``recompute_fn``: ``torch.random.fork_rng``, ``cpu_rng_state =
    torch.get_rng_state()``). Each state is a new host tensor (the Mersenne Twister's, 5056 bytes in
    torch 2.13). ``get_rng_state`` is not an operator, so under the fake mode it returns a real tensor the
    recorder never sees, and a schedule keeps one per checkpointed block of every micro-batch in
    flight. Here, inside the fake mode, it returns an empty fake tensor of the state's shape and dtype
    (made and recorded as any allocation of the step) holding the real state, which ``set_rng_state``
    restores; outside the fake mode both are torch's own. On the CUDA target these states are host
    memory, so it is not used there."""
    from torch._subclasses.fake_tensor import is_fake

    get, put = torch.get_rng_state, torch.set_rng_state

    def get_state() -> torch.Tensor:
        state = get()
        if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is None:
            return state
        held = torch.empty(state.shape, dtype=state.dtype)
        held._memguard_rng_state = state
        return held

    def set_state(new_state: torch.Tensor) -> None:
        put(new_state._memguard_rng_state if is_fake(new_state) else new_state)

    torch.get_rng_state, torch.set_rng_state = get_state, set_state
    try:
        yield
    finally:
        torch.get_rng_state, torch.set_rng_state = get, put


@contextlib.contextmanager
def backward_under_modes() -> Iterator[None]:
    """A stage's backward runs under the trace's function modes, as the plain trace's backward does.

    The schedule's backward (``_backward.py``, ``stage_backward``) calls ``torch.autograd.backward``,
    which hands the call to an active ``TorchFunctionMode`` (``autograd/__init__.py``:
    ``has_torch_function`` -> ``handle_torch_function``), and a mode is switched off while it handles a
    call: a checkpointed block's recomputation then ran without the CUDA target's kernel model and
    autocast emulation that its forward ran under, saved other tensors, and torch's checkpoint refused
    it ("A different number of tensors was saved during the original forward and recomputation").
    Here, while a function mode is active, the call goes straight into the autograd engine, as
    :func:`~memguard.estimator._trace._engine_backward` takes the plain trace's backward there; with
    no mode active it is torch's own."""
    from torch.autograd.variable import Variable

    original = torch.autograd.backward

    def backward(tensors, grad_tensors=None, retain_graph=None, create_graph=False, inputs=None, **kwargs):
        if kwargs or not torch._C._is_torch_function_mode_enabled():
            return original(tensors, grad_tensors, retain_graph, create_graph, inputs=inputs, **kwargs)
        tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
        if grad_tensors is None or isinstance(grad_tensors, torch.Tensor):
            grad_tensors = (grad_tensors,) * len(tensors) if grad_tensors is None else (grad_tensors,)
        # autograd/__init__.py, _make_grads: an output without a gradient is a scalar's, seeded with ones
        grads = tuple(torch.ones_like(t) if g is None else g for t, g in zip(tensors, grad_tensors))
        inputs = () if inputs is None else ((inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs))
        Variable._execution_engine.run_backward(tensors, grads, bool(create_graph if retain_graph is None
                                                                     else retain_graph),
                                                create_graph, inputs, allow_unreachable=True, accumulate_grad=True)

    torch.autograd.backward = backward
    try:
        yield
    finally:
        torch.autograd.backward = original


@contextlib.contextmanager
def fake_rank(rank: int, world_size: int) -> Iterator[None]:
    """A fake default process group of ``world_size`` ranks in which this process is ``rank``
    (:func:`~memguard.estimator._fsdp2.fake_world` makes rank 0 only)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from memguard.estimator._fsdp2 import _job_groups_aside

    running = dist.is_initialized()
    with _job_groups_aside() if running else contextlib.nullcontext():
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        try:
            yield
        finally:
            if not running:
                dist.destroy_process_group()


def checkpointed_stage_trace(spec: TraceSpec, checkpoint_blocks: int) -> contextlib.ExitStack:
    """What a trace of checkpointed stages runs under: on the CPU target the generator states checkpointing
    saves (:func:`saved_rng_states`), on any target the recomputation under the trace's modes
    (:func:`backward_under_modes`); nothing without checkpointing."""
    stack = contextlib.ExitStack()
    if checkpoint_blocks and spec.train:
        if spec.cpu_target is not None:
            stack.enter_context(saved_rng_states())
        stack.enter_context(backward_under_modes())
    return stack


def trace_pipeline_rank(model: nn.Module, batch: Any, spec: TraceSpec, *, rank: int, stages: int, schedule: str,
                        microbatches: int, optimizer=None, inner: tuple[int, int, int] = (1, 1, 1),
                        plan: dict[str, Any] | None = None, fsdp: Any = None, stages_per_rank: int = 1,
                        checkpoint_blocks: int = 0) -> Trace:
    """Trace one steady-state step of pipeline rank ``rank`` (see the module's docstring).

    Args:
        inner: ``(dp_replicate, dp_shard, tp)`` inside each stage; with any above 1 the stage is laid out as
            :class:`ShardedPipelineTracer` says, and the first rank of stage ``rank`` is traced.
        plan: the tensor-parallel plan (``tp > 1``).
        fsdp: the :class:`~memguard.estimator._fsdp2.FSDP2Layout` over ``dp_shard`` (or None).
        stages_per_rank: virtual stages per rank under a schedule of :data:`MULTI_STAGE_SCHEDULES`
            (:class:`MultiStagePipelineTracer`; ``stages`` is then the number of pipeline ranks); 1 otherwise.
        checkpoint_blocks: checkpoint the first this many of the stage's blocks (:func:`checkpoint_stage`;
            ``spec.checkpoint_blocks`` must be 0).

    Raises:
        ConfigError: the model cannot be cut into stages, or the schedule cannot run it.
    """
    import math

    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        if schedule in MULTI_STAGE_SCHEDULES and math.prod(inner) != 1:
            raise ConfigError(f"pp_schedule={schedule!r} with dp_replicate, dp_shard or tp inside the stages is not "
                              f"estimated yet: use {' or '.join(map(repr, SINGLE_STAGE_SCHEDULES))} with them")
        if schedule in MULTI_STAGE_SCHEDULES and checkpoint_blocks:
            raise ConfigError(f"activation checkpointing under pp_schedule={schedule!r} (several stages per rank) is "
                              f"not estimated yet: use {' or '.join(map(repr, SINGLE_STAGE_SCHEDULES))} with it")
        if math.prod(inner) == 1:
            if schedule in MULTI_STAGE_SCHEDULES:
                with quiet_fake_tensor_log(), fake_rank(rank, stages), unpacked_positions(), held_sends():
                    return MultiStagePipelineTracer(model, batch, optimizer, None, spec, rank=rank, stages=stages,
                                                    schedule=schedule, microbatches=microbatches,
                                                    stages_per_rank=stages_per_rank).run()
            with quiet_fake_tensor_log(), fake_rank(rank, stages), unpacked_positions(), held_sends(), \
                    checkpointed_stage_trace(spec, checkpoint_blocks):
                return PipelineTracer(model, batch, optimizer, None, spec, rank=rank, stages=stages,
                                      schedule=schedule, microbatches=microbatches,
                                      checkpoint_blocks=checkpoint_blocks).run()
        from memguard.estimator._fsdp2 import FSDP2Layout
        from memguard.estimator._layout import fake_mesh

        layout = fsdp if fsdp is not None else FSDP2Layout(world_size=1, zero_stage=3,
                                                           backend="gloo" if spec.cpu_target is not None else "nccl")
        shape = (stages, *inner)
        with quiet_fake_tensor_log(), fake_mesh(shape, ("pp", "dp_replicate", "dp_shard", "tp"),
                                                rank=rank * math.prod(inner)) as mesh, \
                unpacked_positions(), held_sends(), checkpointed_stage_trace(spec, checkpoint_blocks):
            return ShardedPipelineTracer(model, batch, optimizer, None, spec, rank=rank, stages=stages,
                                         schedule=schedule, microbatches=microbatches, layout=layout, mesh=mesh,
                                         plan=plan, fsdp=fsdp is not None, checkpoint_blocks=checkpoint_blocks).run()
    finally:
        if gc_was_enabled:
            gc.enable()


class PipelineTracer(StepTracer):
    """:class:`~memguard.estimator._trace.StepTracer` for one pipeline rank: the copy cut to its
    stage (:meth:`prepare_model`), the schedule built and warmed up by one unrecorded step after the
    optimizer (:meth:`build_optimizer`), and the recorded forward running the whole schedule step
    (:meth:`forward`; :meth:`backward` has nothing left to do)."""

    def __init__(self, model, batch, optimizer, loss_fn, spec, *, rank: int, stages: int, schedule: str,
                 microbatches: int, checkpoint_blocks: int = 0, **rest: Any) -> None:
        self.rank, self.stages, self.schedule_name, self.microbatches = rank, stages, schedule, microbatches
        self.checkpoint_blocks = checkpoint_blocks
        super().__init__(model, batch, optimizer, loss_fn, spec, **rest)

    def prepare_model(self, fmodel: nn.Module, originals: dict[int, Any], blocks: list[nn.Module]) -> dict[int, Any]:
        """Cut the copy to this rank's stage (:func:`split_decoder`) and checkpoint the first
        ``checkpoint_blocks`` of the stage's blocks (:func:`checkpoint_stage`). The spec's own
        ``checkpoint_blocks`` counts the whole model's blocks, so a pipeline trace leaves it 0 and
        passes the stage's count here (:func:`trace_pipeline_rank`)."""
        self.loss = causal_lm_loss(fmodel) if self.rank == self.stages - 1 else None
        self.stage_module = split_decoder(fmodel, self.rank, self.stages)
        if self.checkpoint_blocks and self.spec.train:
            checkpoint_stage(self.stage_module, self.checkpoint_blocks)
        return originals

    def build_optimizer(self, originals: dict[int, Any]) -> torch.optim.Optimizer:
        opt = super().build_optimizer(originals)
        ids = self.fbatch["input_ids"]
        micro = ids.shape[0] // self.microbatches
        cfg = self.fmodel.config
        with self.mode:
            hidden = torch.empty(micro, ids.shape[1], cfg.hidden_size, dtype=self._dtype())
            logits = torch.empty(micro, ids.shape[1], cfg.vocab_size, dtype=self._dtype())
            micro_ids = torch.empty(micro, ids.shape[1], dtype=ids.dtype)
            # every rank passes the loss: a schedule without one runs no backward (schedules.py,
            # _has_backward); only the last stage calls it
            loss = self.loss or (lambda output, target: output.sum())
            self.schedule = self.make_rank_schedule(micro_ids, hidden, logits, loss)
            del hidden, logits, micro_ids
            with ScalarStub():  # the warm-up step: the stage's p2p buffers, as in a running job
                try:
                    run_schedule(self.schedule, self.fbatch)
                except ConfigError:
                    raise
                except Exception as exc:  # noqa: BLE001 - a model the schedule cannot run is the user's problem
                    raise ConfigError(f"the pipeline schedule could not run stage {self.rank} of the model: "
                                      f"{type(exc).__name__}: {exc}") from exc
            opt.zero_grad(set_to_none=True)
        return opt

    def make_rank_schedule(self, micro_ids: torch.Tensor, hidden: torch.Tensor, logits: torch.Tensor,
                           loss: Any) -> Any:
        """This rank's schedule over its stage (:func:`make_schedule`), given a micro-batch's ids, hidden
        states and logits."""
        inp = micro_ids if self.rank == 0 else hidden
        out = logits if self.rank == self.stages - 1 else hidden
        return make_schedule(self.stage_module, self.rank, self.stages, self.schedule_name, self.microbatches, inp,
                             out, loss, torch.device("cpu"), group=self.pp_group())

    def pp_group(self) -> Any:
        """The pipeline's process group: None, the default one (pipeline stages alone)."""
        return None

    def register(self) -> None:
        """The base's state, and the stage's receive buffers (:func:`stage_buffers`): forward inputs as
        activations, output gradients as temporaries."""
        super().register()
        inputs, grads = stage_buffers(self.schedule)
        for t in inputs:
            self.recorder.register(t, Category.ACTIVATIONS)
        for t in grads:
            self.recorder.register(t, Category.TEMPORARIES)

    def _dtype(self) -> torch.dtype:
        return self.spec.param_dtype or torch.float32

    def forward(self) -> Any:
        trace = self.trace
        trace.phase_starts["forward"] = len(trace.events)
        self.recorder.phase = "forward"
        with self._modes():
            run_schedule(self.schedule, self.fbatch)
        return None

    def backward(self, loss: Any) -> None:
        trace, rec = self.trace, self.recorder
        trace.phase_starts["backward"] = len(trace.events)  # the schedule ran backward inside forward
        rec.phase = "backward"
        for p in self.trainable:
            h = rec.handle_of(p.grad) if p.grad is not None else None
            if h is not None:
                trace.category[h] = Category.GRADS


class MultiStagePipelineTracer(PipelineTracer):
    """:class:`PipelineTracer` for a rank that holds several virtual stages (``Interleaved1F1B``,
    ``ZBVZeroBubble``): the copy cut to the rank's stages (:func:`rank_stage_indices`,
    :func:`split_decoder_stages`), one ``PipelineStage`` each, and the multi-stage schedule over them
    (:func:`make_multi_schedule`), whose own action order (``_PipelineScheduleRuntime._step_microbatches``
    running ``pipeline_order_with_comms``) decides what the rank keeps in flight: interleaved 1F1B's
    warm-up forwards over the rank's stages, ZBV's split backward (``BACKWARD_INPUT`` keeps what the weight
    gradient needs until its ``BACKWARD_WEIGHT``, ``stage.py``, ``backward_state``)."""

    def __init__(self, model, batch, optimizer, loss_fn, spec, *, stages_per_rank: int, **rest: Any) -> None:
        self.stages_per_rank = stages_per_rank
        super().__init__(model, batch, optimizer, loss_fn, spec, **rest)

    def prepare_model(self, fmodel: nn.Module, originals: dict[int, Any], blocks: list[nn.Module]) -> dict[int, Any]:
        self.indices = rank_stage_indices(self.rank, self.stages, self.stages_per_rank,
                                          MULTI_STAGE_SCHEDULES[self.schedule_name])
        num_stages = self.stages * self.stages_per_rank
        self.loss = causal_lm_loss(fmodel) if num_stages - 1 in self.indices else None
        self.stage_modules = split_decoder_stages(fmodel, self.indices, num_stages)
        return originals

    def make_rank_schedule(self, micro_ids: torch.Tensor, hidden: torch.Tensor, logits: torch.Tensor,
                           loss: Any) -> Any:
        return make_multi_schedule(self.stage_modules, self.indices, self.stages * self.stages_per_rank,
                                   self.schedule_name, self.microbatches, micro_ids, hidden, logits, loss,
                                   torch.device("cpu"), group=self.pp_group())


from memguard.estimator._tp_trace import TPTracer  # noqa: E402 - after PipelineTracer, which it does not need


class ShardedPipelineTracer(PipelineTracer, TPTracer):
    """A pipeline rank whose stage is itself laid out over data- and tensor-parallel ranks, as torchtitan's
    ``parallelize_llama`` lays out each pipeline stage (``torchtitan/models/llama3/infra/pipeline.py`` cuts the
    stages, then the same TP and FSDP2 as without pipelining apply to each stage's model chunk):

    * the fake process group has every rank of the layout, over the mesh ``(pp, dp_replicate, dp_shard, tp)``
      (torchtitan's order, ``parallel_dims.py``), and this process is the first rank of stage ``rank``
      (within a stage every rank holds the same: the shards divide evenly, ``check_model_fits``);
    * the copy is cut to the stage (:func:`split_decoder`), then ``parallelize_module`` over the ``tp``
      dimension and ``fully_shard`` of each of the stage's blocks and of the stage module as root, over
      ``dp_shard`` (:class:`~memguard.estimator._tp_trace.TPTracer`);
    * the ``PipelineStage`` runs the FSDP2 root over the ``pp`` dimension's group, so torch's own
      pipelining keeps the stage's parameters unsharded and its gradients unsynchronised until the last
      micro-batch (``stage.py``, ``backward_maybe_with_nosync``: ``set_reshard_after_backward(False)``,
      ``set_requires_gradient_sync(False)``; ``_PipelineSchedule._step_microbatches`` then
      ``stage._post_backward``/``scale_grads``), and the trace records what that keeps.
    """

    def prepare_model(self, fmodel: nn.Module, originals: dict[int, Any], blocks: list[nn.Module]) -> dict[int, Any]:
        """The cut and the stage's checkpointing (:meth:`PipelineTracer.prepare_model`; see
        :func:`checkpoint_stage` for why it may come before TP), then TP and FSDP2 of the stage."""
        PipelineTracer.prepare_model(self, fmodel, originals, blocks)
        kept = getattr(fmodel, fmodel.base_model_prefix).layers  # the stage's blocks (split_decoder kept them)
        stage_blocks = [b for b in blocks if any(b is k for k in kept)]
        return TPTracer.prepare_model(self, fmodel, originals, stage_blocks)

    def fsdp_root(self, fmodel: nn.Module) -> nn.Module:
        return self.stage_module

    def _dtype(self) -> torch.dtype:
        """Under FSDP2's mixed precision the stages hand on hidden states in the policy's ``param_dtype``
        (no ``output_dtype``: :func:`~memguard.estimator._fsdp2.shard_model`), and their receive buffers are
        made in it, as :meth:`memguard.guard._pipeline_step.PipelineRun._dtype` makes them."""
        if self.fsdp and self.layout.mp_dtype is not None:
            return self.layout.mp_dtype
        return super()._dtype()

    def pp_group(self) -> Any:
        return self.mesh["pp"].get_group()
