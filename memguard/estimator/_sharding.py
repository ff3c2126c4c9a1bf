"""Per-rank model-state bytes under DDP and DeepSpeed ZeRO, as category factors.

The trace counts the whole model on one rank. Sharding is applied by scaling the ``params``,
``grads``, ``optimizer`` and optimizer-step temporaries categories of the timeline (see
``analysis.scan``) and adding constant bytes, so that a rank holds what a real DeepSpeed 0.19.8
engine holds (deepspeed/runtime/zero/stage_1_and_2.py, stage3.py, partitioned_param_coordinator.py;
each term cites its line below; checked against real 2- and 4-rank CPU engines in
benchmarks/deepspeed_cpu.py). Per rank, with Ψ parameters, P = Ψ_t/N the rank's partition of the
trainable ones, b the weights' bytes (2 in fp16/bf16, 4 in fp32) and s the optimizer's state bytes
per parameter (read from the trace: 8 for Adam):

* ZeRO-1: weights bΨ and gradients bΨ_t on every rank through backward; when backward ends
  (reduce_gradients, without ``overlap_comm``) the partition's gradient copy bP
  (``grads_in_partition``); the fp32 master partition 4P (even in fp32: the partition is cloned) and
  the optimizer state sP at rest.
* ZeRO-2: as ZeRO-1 but the gradients are reduced in backward's hooks and only bP survive. With
  CPU offload: ``bΨ``.
* The ZeRO-1/2 step (``step()``): the module's gradients are freed, the partition's fp32 gradient
  4P is made (a second copy in 16-bit training, the flat copy itself in fp32) and the torch
  optimizer steps the flat partition with its temporaries; then the updated partitions are
  all-gathered (on gloo, the CPU target, through a staging buffer of the whole flat bΨ). DeepSpeed's
  ``estimate_zero2_model_states_mem_needs`` (``2Ψ + 18Ψ/N``) counts the fp32 gradient resident: it
  is the step's (tests/estimator/test_sharding.py adds it back to compare).
* ZeRO-3: the parameter partition bΨ/N, the flat gradient partition bP in the weights' dtype (kept
  allocated), the fp32 master 4P and sP at rest; in forward and backward ``2b·largest_layer``
  gathered parameters (DeepSpeed's estimator), released by the step, which makes the fp32 gradient
  4P. Under the default ``stage3_max_reuse_distance`` (1e9) the whole model is gathered by the end of
  forward and released module by module in backward; those bytes follow the activations' shape
  (the ``activations`` factor; ``pricing.estimate_from_trace`` reports them as params). With the
  engine's config, parameters under ``stage3_param_persistence_threshold`` stay gathered all the time.
* Buffers are never partitioned: every rank holds them whole, in the dtypes the engine leaves them
  (the user's, unless ``data_types.buffer_dtype`` / ``keep_in_fp32_modules`` change them;
  :mod:`memguard.estimator._deepspeed_precision`), at every stage.
* With bf16 masters and optimizer states (``"bf16-true"``) the master partition is 2P and Adam's
  state 4P; the step's gradient partition is the flat 16-bit copy itself (``.to`` of its own dtype).
  Under ``torch_autocast`` the weights, gradients and masters are fp32 (b = 4) and the reduce
  buckets are one per communication dtype.
* Buckets (only with the engine's config, :class:`ZeroBuckets`): the reduce bucket,
  ``reduce_bucket_size`` elements of the weights' dtype allocated whole whatever the model's size
  (DeepSpeed's default 5e8 is a 2 GB fp32 buffer), twice with ``overlap_comm``; at stages 1-2 from
  backward's first gradient hook to the step, at stage 3 for the engine's life.
* The blocks whose lifetimes are not the traced ones' (the stage 1-2 buckets and partition copy,
  ZeRO-3's gathered layers) are put into the trace as blocks of their own and the module's
  gradients freed where the step begins (``_pricing``), so the peak falls where the engine's does.
* DDP without ZeRO (``world_size > 1``): every rank holds everything, plus gradient buckets as
  large as all gradients (torch.nn.parallel.DistributedDataParallel docs,
  ``gradient_as_bucket_view``: "the saved memory size will be equal to the total gradients size").

``allgather_bucket_size`` allocates nothing measurable on the CPU engines (all_gather_dp_groups
gathers into the flat buffer; the step peaks with 5e8 and with 65536 are the same), and
``stage3_prefetch_bucket_size`` / ``stage3_max_live_parameters`` do not matter while the reuse
distance keeps the whole model gathered; neither is modelled.

Under ZeRO, DeepSpeed's fp16/bf16 modes keep the module's weights in 16 bits and run without
autocast (engine.py: the model is cast with ``module.half()``/``module.bfloat16()``), so a
``*-mixed`` precision with ``zero_stage >= 1`` is traced with 16-bit weights; no cached fp32→16-bit
weight casts exist then.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

@dataclass(frozen=True)
class ZeroBuckets:
    """The bucket settings of a DeepSpeed ``zero_optimization`` block, in elements.

    Defaults are DeepSpeed 0.19.8's (deepspeed/runtime/zero/config.py, DeepSpeedZeroConfig):
    ``reduce_bucket_size`` 5e8, ``allgather_bucket_size`` 5e8, ``stage3_prefetch_bucket_size``
    5e7, ``stage3_max_live_parameters`` 1e9, ``stage3_param_persistence_threshold`` 1e5,
    ``stage3_max_reuse_distance`` 1e9, ``contiguous_gradients`` True.
    """

    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    prefetch_bucket_size: int = 50_000_000
    max_live_parameters: int = 1_000_000_000
    param_persistence_threshold: int = 100_000
    max_reuse_distance: int = 1_000_000_000
    overlap_comm: bool | None = None  # None: DeepSpeed's default (False for stages 1-2, True for stage 3)
    contiguous_gradients: bool = True

    _KEYS = {
        "reduce_bucket_size": "reduce_bucket_size",
        "allgather_bucket_size": "allgather_bucket_size",
        "stage3_prefetch_bucket_size": "prefetch_bucket_size",
        "stage3_max_live_parameters": "max_live_parameters",
        "stage3_param_persistence_threshold": "param_persistence_threshold",
        "stage3_max_reuse_distance": "max_reuse_distance",
        "overlap_comm": "overlap_comm",
        "contiguous_gradients": "contiguous_gradients",
    }

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "ZeroBuckets":
        """From a ``zero_optimization`` block or a whole DeepSpeed config; absent keys (and
        ``"auto"``, which DeepSpeed drops inside this block) take DeepSpeed's defaults."""
        zero = config.get("zero_optimization", config) if isinstance(config, Mapping) else {}
        kw: dict[str, Any] = {}
        for key, field_name in cls._KEYS.items():
            value = zero.get(key)
            if value is None or isinstance(value, str):
                continue
            kw[field_name] = bool(value) if isinstance(value, bool) else int(value)
        return cls(**kw)


@dataclass(frozen=True)
class ShardFactors:
    """Factors for the ``params``, ``grads`` and ``optimizer`` categories, and extra constant bytes.

    ``extra`` holds bytes that exist on the rank but not in the single-device trace: DDP's
    gradient buckets (category ``grads``) and ZeRO-3's gathered largest layer (``params``).
    """

    params: float = 1.0
    grads: float = 1.0
    optimizer: float = 1.0
    extra_grads: int = 0
    extra_params: int = 0
    optimizer_temporaries: float = 1.0
    activations: float = 1.0  # ZeRO-3: > 1 when gathered parameters follow the activations
    # ZeRO-1/2: the module's gradients are freed when the optimizer step begins (see model_state_factors)
    release_grads_at_step: bool = False
    # ZeRO-1: bytes of gradients allocated when backward ends (the partition's copy, grads_in_partition)
    grads_at_end_of_backward: int = 0
    # ZeRO-1/2: bytes of the reduce bucket(s), allocated when backward begins and gone by the step
    bucket_in_backward: int = 0
    # ZeRO-3: bytes of gathered parameters held from forward's start until the step (two largest layers)
    gathered_in_passes: int = 0
    # ZeRO-2: bytes of the last rank's gradient partition, allocated at backward's first bucket
    # reduction (when a gradient no longer fits the bucket of first_reduce_elements), gone by the step
    partition_at_first_reduce: int = 0
    first_reduce_elements: int = 0

    def as_dict(self) -> dict[str, float]:
        out = {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
               "optimizer_temporaries": self.optimizer_temporaries}
        if self.activations != 1.0:
            out["activations"] = self.activations
        return out

    @property
    def gathered_share(self) -> float:
        """The share of the scaled activations that is ZeRO-3's gathered parameters."""
        return 1.0 - 1.0 / self.activations if self.activations > 1.0 else 0.0


@dataclass(frozen=True)
class TracedStates:
    """What a single-device trace measured of the model states (:func:`model_state_factors`' input).

    Attributes:
        params, grads, optimizer: bytes of each category in the trace (params and optimizer at
            rest, grads after a full backward).
        num_params, num_trainable: Ψ over all and trainable parameters.
        largest_layer: parameters of the largest single module (DeepSpeed's largest layer; ZeRO-3
            gathers one at a time).
        temporaries: peak bytes of the trace's optimizer-step temporaries, and
            largest_param_bytes: bytes of the largest traced parameter tensor they belong to (the
            step's temporaries per parameter byte; DeepSpeed's optimizer steps one flat partition).
            0: the traced temporaries are scaled by 1/N. trainable_param_bytes: the traced
            trainable parameters' bytes (for a foreach step, whose temporaries cover them all).
        activations: peak bytes of the trace's activations (ZeRO-3's gathered parameters
            follow them: gathered module by module in forward, released module by module in backward).
        param_numels: numel of every parameter tensor (ZeRO-3 persistence threshold).
        buffers: bytes of the model's buffers in the trace (inside ``params``).
        grads_at_start: the traced step starts with gradients (a micro-batch after the first).
    """

    params: int
    grads: int
    optimizer: int
    num_params: int
    num_trainable: int
    largest_layer: int
    temporaries: int = 0
    largest_param_bytes: int = 0
    activations: int = 0
    param_numels: tuple[int, ...] = ()
    trainable_param_bytes: int = 0
    buffers: int = 0
    grads_at_start: bool = False


@dataclass(frozen=True)
class ZeroSetup:
    """How the model states are sharded (:func:`model_state_factors`' other input).

    Attributes:
        zero_stage: the ZeRO stage 0-3 (0: DDP, no sharding).
        world_size: data-parallel ranks.
        sixteen_bit: training in fp16/bf16 (DeepSpeed then keeps fp32 master weights and grads).
        offload_optimizer: ZeRO-Offload (optimizer state and step on the host).
        state_scale: multiply the traced optimizer bytes per parameter by this to get fp32 bytes
            (2 when the trace ran with 16-bit parameters, whose optimizer state is 16-bit too).
        buckets: the engine's ``zero_optimization`` settings (:class:`ZeroBuckets`). None: unknown;
            the bucket buffers and ZeRO-3's persistent parameters are then left out, and ZeRO-3's
            parameter retention takes DeepSpeed's default ``stage3_max_reuse_distance``.
        gloo: the ranks talk through gloo (the CPU target), whose all-gather into one tensor stages
            the whole output in a buffer of its own (see ``model_state_factors``).
        master_bytes: bytes per element of the master partition (2: DeepSpeed's bf16 masters,
            ``bf16_master_weights_and_grads`` with ``bf16_optimizer_states``).
        comm_dtype_bytes: element bytes of each reduce bucket's communication dtype (``torch_autocast``
            keeps one bucket per dtype); empty: one bucket of the weights' dtype.
        buffer_bytes: the model's buffers on every rank (never partitioned), in the engine's dtypes;
            None: as traced.
    """

    zero_stage: int
    world_size: int
    sixteen_bit: bool
    offload_optimizer: bool = False
    state_scale: float = 1.0
    buckets: ZeroBuckets | None = None
    gloo: bool = False
    master_bytes: int = 4
    comm_dtype_bytes: tuple[int, ...] = ()
    buffer_bytes: int | None = None


def model_state_factors(traced: TracedStates, setup: ZeroSetup) -> ShardFactors:
    """Scale factors that turn single-device traced bytes (``traced``) into one rank's bytes under
    ``setup``."""
    zero_stage, world_size, sixteen_bit = setup.zero_stage, setup.world_size, setup.sixteen_bit
    offload_optimizer, state_scale, buckets = setup.offload_optimizer, setup.state_scale, setup.buckets
    traced_params, traced_grads, traced_optimizer = traced.params, traced.grads, traced.optimizer
    num_params, num_trainable, largest_layer = traced.num_params, traced.num_trainable, traced.largest_layer
    traced_temporaries, largest_param_bytes = traced.temporaries, traced.largest_param_bytes
    traced_activations, param_numels = traced.activations, traced.param_numels
    trainable_param_bytes = traced.trainable_param_bytes
    n = max(1, world_size)
    if zero_stage == 0:
        buckets_ddp = traced_grads if n > 1 else 0  # DDP docs: buckets as large as all gradients
        return ShardFactors(extra_grads=buckets_ddp)

    p_bytes = 2 if sixteen_bit else 4  # DeepSpeed keeps module weights in the training dtype
    # fp32 master partition, in fp32 training too. stage_1_and_2.py, DeepSpeedZeroOptimizer.__init__:
    # ``weights_partition = self.parallel_partitioned_bit16_groups[i][partition_id].detach().clone()
    # .to(device=self.device, dtype=self.master_weights_and_grads_dtype)`` (a clone whatever the dtype).
    # stage3.py, DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions: the partition is shared only
    # when ``self.fp16_partitioned_groups_flat[i].device == self.device``, a torch.device compared with
    # the accelerator's device-name string (``get_accelerator().current_device_name()``, "cpu" or
    # "cuda:0"), which is False: the ``else`` branch, ``converted.clone().detach()``, runs.
    # 4 bytes; 2 with bf16 masters (base_optimizer.py _configure_master_weights: torch.bfloat16)
    master = setup.master_bytes
    # buffers are never partitioned: every rank holds them whole (engine.py _cast_module_mixed_precision,
    # "Buffers are never ZeRO-partitioned"; ZeRO-3's partition_parameters converts nn.Parameters only)
    buffers = traced.buffers if setup.buffer_bytes is None else setup.buffer_bytes
    # the reduce buckets: one per communication dtype (torch_autocast), else one of the weights' dtype
    comm = setup.comm_dtype_bytes or (2 if sixteen_bit else 4,)
    # Adam: 8 ("8_optimizer_states_32bit")
    states = state_scale * traced_optimizer / num_trainable if num_trainable else 0.0
    psi, psi_t = num_params, num_trainable
    part = psi_t / n  # one rank's partition of the trainable parameters

    extra_params = 0
    extra_grads = 0
    grads_at_end = 0
    bucket = 0
    partition_early = 0
    gathered_in_passes = 0
    activations = 1.0
    if zero_stage < 3:
        params_b = p_bytes * psi + buffers
        if zero_stage == 1:
            # full gradients on every rank, plus the partition's own copy: stage_1_and_2.py,
            # reduce_ipg_grads ("zero stage 1 - partition only optimizer state"): with
            # contiguous_gradients, copy_grads_in_partition copies into ``self.grads_in_partition =
            # torch.empty(total_size, dtype=self.dtype)`` (the parameters of this partition). Without
            # overlap_comm the gradient hooks reduce nothing at stage 1 (process_gradients:
            # ``if self.partition_gradients or self.overlap_comm``); reduce_gradients runs when backward
            # has ended (engine.py allreduce_gradients, at the accumulation boundary), so the copy
            # appears then, after backward's own temporaries are gone
            grads_b = p_bytes * psi_t
            if _contiguous(buckets):
                if buckets is not None and buckets.overlap_comm:
                    grads_b += p_bytes * part  # reduced in the hooks, during backward
                elif buckets is None or psi_t > buckets.reduce_bucket_size:
                    grads_at_end = int(p_bytes * part)
                # else every gradient fits the bucket: reduce_independent_p_g_buckets_and_remove_grads
                # copies each into it and frees its own storage (``grad_reduc.data =
                # new_grad_tensor.data.view_as(grad_reduc)``) before reduce_ipg_grads makes the copy,
                # so the copy (P) takes the place of gradients (Ψ) and is never the peak
        else:
            grads_b = p_bytes * part  # stage 2: only grads_in_partition survives the reduction
        host_part = (master + states) * part
        if buckets is not None and _contiguous(buckets):
            # stage_1_and_2.py, setup_buckets (every backward): ``torch.empty(int(self.reduce_bucket_size),
            # dtype=self._gradient_reduction_buffer_dtype())``, a second one when overlap_comm; the
            # dtype is the weights' (use_grad_accum_attribute is False when gradient_accumulation_dtype,
            # the engine's data_types.grad_accum_dtype, defaults to the weights' dtype: engine.py
            # get_data_types; a different one is refused by _deepspeed_config)
            # Allocated at the first gradient hook of each backward (process_gradients -> setup_buckets)
            # and let go when the reduction ends (_release_ipg_buffers: ``bucket.buffer.clear()``; at
            # stage 1 the gradients of other ranks' parameters stay views into it until step()'s
            # free_grad_in_param_list): from the start of backward to the optimizer step
            copies = 2 if buckets.overlap_comm else 1  # DeepSpeedZeroConfig: overlap_comm defaults False below stage 3
            # one per communication dtype, each of the weights' dtype (setup_buckets: for bucket in ipg_buckets)
            bucket = int(buckets.reduce_bucket_size) * p_bytes * copies * len(comm)
            if zero_stage == 2 and psi_t > buckets.reduce_bucket_size and not traced.grads_at_start \
                    and not offload_optimizer:
                # The worst rank is the last: its partition holds the model's last parameters, whose
                # gradients backward makes first. The first full bucket is reduced (reduce_ipg_grads)
                # while the activations are all still live, and copy_grads_in_partition then allocates
                # the rank's whole partition at once (``if self.grads_in_partition is None: ...
                # torch.empty(int(total_size), dtype=self.dtype)``). So bP is there from that
                # reduction (the hook of the first gradient that overflows the bucket) to the step;
                # the module's own gradients live only until their hook copies
                # them into the bucket (``grad_reduc.data = new_grad_tensor.data.view_as(grad_reduc)``)
                # or, one oversized gradient at a time, until the next hook reduces it.
                partition_early = int(p_bytes * part)
                grads_b = 0.0
                if largest_param_bytes > buckets.reduce_bucket_size * p_bytes:
                    # an oversized gradient is not copied into the bucket but held until the next hook
                    # reduces it (``self.extra_large_param_to_reduce[comm_dtype] = param``): one at a
                    # time, at most the largest parameter's
                    partition_early += int(largest_param_bytes)
        # step() (stage_1_and_2.py), per group: free_grad_in_param_list(params_not_in_partition);
        # ``flat_grad_partition = self.flatten(self.averaged_gradients[i])`` (p_bytes * P, the partition's
        # grads copied); ``single_grad_partition = flat_grad_partition.to(fp32)`` (a second 4P copy in
        # 16-bit, the same tensor in fp32); ``del flat_grad_partition``;
        # free_grad_in_param_list(params_in_partition); then the optimizer steps the fp32 partition
        # with single_grad_partition as its grad. So the module's gradients are gone when the torch
        # optimizer runs (release_grads_at_step), and its step holds the fp32 gradient 4P beside its
        # own temporaries; the moment before, the partition's grads, the flat copy and (16-bit) the
        # fp32 copy coexist.
        # (``.to`` of the master's own dtype returns the flat copy itself: fp32 training, bf16 masters)
        before_step = p_bytes * part + p_bytes * part + (master * part if master != p_bytes else 0)
        if setup.gloo and n > 1:
            # after the torch optimizer (fp32 gradient and its temporaries gone), step() ends with
            # all_gather_dp_groups -> all_gather_into_tensor of the whole flat 16-bit buffer; gloo's
            # allgather (torch ProcessGroupGloo.cpp, AsyncAllgatherWork: ``flatOutputTensor =
            # newLikeFlat(outputs[0])``) gathers into a buffer of that size and copies it out: a
            # measured 15.07 MiB ``c10d::_allgather_base_ > aten::empty`` on a 4-rank fp32 Llama of
            # 3.95M parameters, its step's peak there
            before_step = max(before_step, p_bytes * psi_t)
        step_copy = master * part
        grads_in_step = 0.0
    else:
        # the parameter partition: stage3.py, _create_fp16_partitions_with_defragmentation
        # (``self.lp_param_buffer``, the ds_tensor of every parameter, Ψ/N in the weights' dtype)
        params_b = p_bytes * psi / n + buffers
        # the gradient partition: stage3.py, _setup_for_real_optimizer: ``self.grad_partitions_flat_buffer =
        # torch.zeros(sum(p.partition_numel() ...), dtype=self.gradient_accumulation_dtype)``, allocated
        # once and kept; the per-module grads are reduced into it. The engine passes the weights' dtype
        # (engine.py get_data_types: grad_accum_dtype defaults to the model dtype), so bP
        grads_b = 0.0
        extra_grads += int(p_bytes * part)
        host_part = (master + states) * part  # the flat fp32 grad buffer above is DeepSpeed's "4_grads_32bit"
        # DeepSpeed's estimator (estimate_zero3_model_states_mem_needs): largest_layer_memory =
        # 4 * largest_layer_params (two 16-bit layers: the one in use and the one prefetched); in forward
        # and backward only: the step finds every parameter released (the measured bf16 rank's step
        # holds no gathered parameter)
        gathered_in_passes = int(2 * p_bytes * largest_layer)
        persistent = 0
        if buckets is not None:
            persistent = sum(k for k in param_numels if k <= buckets.param_persistence_threshold)
            # parameters at or under stage3_param_persistence_threshold stay gathered
            # (parameter_offload.py, DeepSpeedZeRoOffload.mark_persistent_parameters: ds_persist)
            params_b += p_bytes * persistent
            if _contiguous(buckets):
                # stage3.py, _setup_for_real_optimizer: ``bucket.buffer = torch.empty(self.reduce_bucket_size,
                # dtype=dtype)``, kept for the engine's life; one per communication dtype, each of its dtype
                extra_grads += int(buckets.reduce_bucket_size) * sum(comm)
        # partitioned_param_coordinator.py, PartitionedParameterCoordinator.__params_to_release: a
        # module's parameters are kept gathered when they recur within stage3_max_reuse_distance
        # elements of the trace. Every forward module recurs in backward after at most 2Ψ
        # elements, so with the default (1e9, which memguard's to_config never changes) and
        # Ψ <= 5e8 nothing is released in forward: the whole model is gathered at the end of
        # forward and released module by module in backward.
        # (On one rank the partition is the whole parameter: nothing is gathered beyond it.)
        reuse = (buckets or ZeroBuckets()).max_reuse_distance
        if n > 1 and reuse >= 2 * psi and traced_activations > 0:
            gathered = p_bytes * (psi - persistent) - gathered_in_passes
            if gathered > 0:
                activations = 1.0 + gathered / traced_activations
        # _prepare_fp32_grad_for_sub_group: ``self.flatten(self.averaged_gradients[i]).to(<master dtype>)``
        step_copy = master * part
        grads_in_step = 0.0
    if offload_optimizer:
        host_part = 0.0  # optimizer state, fp32 grads and master params live in host memory
        if zero_stage == 2:
            grads_b = 0.0  # stage_1_and_2.py: gpu_mem = 2 * total_params with cpu_offload
        if zero_stage == 3:
            grads_b = 0.0
            extra_grads -= int(p_bytes * part)  # the flat gradient partition is pinned host memory
            params_b = p_bytes * psi / n + buffers  # stage3.py: largest_layer_memory + 2 * total_params / total_gpus

    def ratio(target: float, traced: int) -> float:
        return target / traced if traced else 0.0

    # The optimizer step's temporaries. DeepSpeed steps one flat fp32 partition: the torch
    # optimizer's temporaries per parameter byte (read from the trace, whose largest parameter
    # tensor sets their peak) times the partition's bytes, plus the flat gradient copy above where
    # the traced gradients (still live in the step) do not already stand for it.
    if offload_optimizer:
        temporaries = 0.0
    elif traced_temporaries and largest_param_bytes:
        # a single-tensor step (torch's CPU default) peaks on its largest parameter; a foreach step
        # (the CUDA default) makes its temporaries for every parameter at once: more than a few
        # temporaries per byte of the largest tensor means the latter
        per_byte = traced_temporaries / largest_param_bytes
        if per_byte > _MAX_TEMPORARIES_PER_BYTE and trainable_param_bytes:
            per_byte = traced_temporaries / trainable_param_bytes
        need = per_byte * master * part + step_copy
        if zero_stage < 3:
            need = max(need, before_step)
        temporaries = max(0.0, need - grads_in_step) / traced_temporaries
    else:
        temporaries = 1.0 / n
    # fp32 grads and master params are owned by the optimizer in DeepSpeed; count them there.
    return ShardFactors(
        optimizer_temporaries=temporaries,
        params=ratio(params_b, traced_params),
        grads=ratio(grads_b, traced_grads),
        optimizer=ratio(host_part, traced_optimizer) if traced_optimizer else 0.0,
        extra_params=extra_params,
        extra_grads=max(0, extra_grads) + (0 if traced_optimizer or host_part == 0 else int(host_part)),
        activations=activations,
        release_grads_at_step=zero_stage in (1, 2) and not offload_optimizer,
        grads_at_end_of_backward=grads_at_end if not offload_optimizer else 0,
        bucket_in_backward=bucket,
        partition_at_first_reduce=partition_early,
        first_reduce_elements=int(buckets.reduce_bucket_size) if partition_early else 0,
        gathered_in_passes=gathered_in_passes,
    )


#: More temporaries per parameter byte than any torch optimizer's single-tensor step makes (Adam: 2).
_MAX_TEMPORARIES_PER_BYTE = 8


def _contiguous(buckets: ZeroBuckets | None) -> bool:
    return True if buckets is None else buckets.contiguous_gradients
