"""Execute a recompute plan inside megatron-core's 1F1B schedule (Lynx's overlapped recomputation).

Megatron-core's full recompute (`tensor_parallel.checkpoint`) re-runs a checkpointed layer's forward
inside that layer's backward. Here a "full" layer runs through `DeferredCheckpointFunction`
instead: the same no-grad forward that keeps only the layer's inputs and the RNG states, but the
recomputation may happen EARLIER, while the stage waits for the output gradient of that
micro-batch (the p2p receive that precedes every backward of the non-interleaved schedule, which
in the warm-up/cool-down is the pipeline bubble). The backward then only back-propagates through
the kept recomputed graph. The recomputation is the very code of megatron's CheckpointFunction
backward (inputs detached, forward under the saved CPU/CUDA/tracker RNG states, current states
restored), so gradients are bitwise those of megatron's own full recompute of the same layers.

Pieces, used together by `forward_backward_func(plan)`:
- `apply_plan(model_chunks, plan, stage)` sets each local layer's recompute: megatron-core's own
  per-layer selective flags, or a full-recompute forward (window "p2p_wait" or "inline");
- `OverlapP2PCommunicator`, a megatron `P2PCommunicator` whose two "receive the output gradient"
  calls post their p2p ops, recompute the next backward micro-batch, then wait;
- `RUNTIME`, the per-process FIFO of micro-batches forwarded and not yet backwarded, and its
  counters of recomputations done in waits and inline.
Interleaved (vpp) and forward-only calls go to megatron-core's schedule unchanged.
"""

from __future__ import annotations

import functools
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import schedules
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator, is_single_shape
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import get_model_config, unwrap_model
from torch.utils.checkpoint import detach_variable

from megatron_ucp.mcore_compat import schedules as mcore
from megatron_ucp.recompute.plan import LayerPlan, Plan, PlanError

# TransformerLayer.forward's arguments in `_forward_attention` order (positional calls are mapped)
_LAYER_ARGS = ("hidden_states", "attention_mask", "context", "context_mask", "rotary_pos_emb",
               "rotary_pos_cos", "rotary_pos_sin", "rotary_pos_cos_sin", "attention_bias",
               "inference_context", "packed_seq_params", "sequence_len_offset", "padding_mask")
# The tensors megatron's TransformerBlock._checkpointed_forward hands to tensor_parallel.checkpoint,
# in its order; every other argument is bound into the recomputed function.
_CHECKPOINT_ARGS = ("hidden_states", "attention_mask", "context", "context_mask", "rotary_pos_emb",
                    "padding_mask")


# ------------------------------------------------------------------------ deferred checkpoint

@dataclass(eq=False)
class _Checkpoint:
    """One full-recompute layer of one micro-batch: what its recomputation needs and made."""

    window: str  # "p2p_wait" or "inline"
    run_function: Callable | None = None
    rng_states: tuple | None = None  # CPU, CUDA and tracker states before the forward
    ctx: weakref.ref | None = None  # the autograd node (its saved tensors: the layer inputs);
    #                                 weak, so a graph dropped without a backward is freed
    outputs: tuple | None = None  # recomputed outputs (with their graph), until the backward
    detached_inputs: tuple | None = None


def _recompute(cp: _Checkpoint) -> None:
    """CheckpointFunction.backward's recomputation, kept for a later backward (same ops, order)."""
    mcore.set_checkpointing()
    inputs = cp.ctx().saved_tensors
    with mcore.forked_rng():
        mcore.set_all_rng_states(cp.rng_states)
        detached_inputs = detach_variable(inputs)
        with torch.enable_grad():
            outputs = cp.run_function(*detached_inputs)
    mcore.unset_checkpointing()
    cp.outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
    cp.detached_inputs = detached_inputs


class DeferredCheckpointFunction(torch.autograd.Function):
    """megatron-core's CheckpointFunction whose recomputation may run before the backward.

    forward(run_function, checkpoint, *args): as CheckpointFunction with
    distribute_saved_activations=False. backward: back-propagates through the outputs
    `RUNTIME.recompute_next` kept, or recomputes now (inline) when there are none.
    """

    @staticmethod
    def forward(ctx, run_function, cp: _Checkpoint, *args):
        mcore.set_checkpointing()
        cp.run_function = run_function
        cp.rng_states = mcore.all_rng_states()
        with torch.no_grad():
            outputs = run_function(*args)
        ctx.save_for_backward(*args)
        ctx.checkpoint = cp
        cp.ctx = weakref.ref(ctx)
        mcore.unset_checkpointing()
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("Checkpointing is not compatible with .grad(), please use .backward() "
                               "if possible")
        cp = ctx.checkpoint
        if cp.outputs is None:
            _recompute(cp)
            RUNTIME.counts["inline"] += 1
        mcore.set_checkpointing()
        outputs, detached_inputs = cp.outputs, cp.detached_inputs
        # drop every reference to the recomputed graph and the node: freed after this backward
        cp.outputs = cp.detached_inputs = cp.ctx = cp.run_function = None
        ctx.checkpoint = None
        outputs, grads = zip(*filter(lambda x: torch.is_tensor(x[0]) and x[0].requires_grad,
                                     zip(outputs, grads)))
        torch.autograd.backward(outputs, grads)
        input_grads = tuple(inp.grad if isinstance(inp, torch.Tensor) else inp
                            for inp in detached_inputs)
        mcore.unset_checkpointing()
        return (None, None) + input_grads


# ---------------------------------------------------------------------------------- runtime

@dataclass
class OverlapRuntime:
    """Micro-batches forwarded on this stage and not yet backwarded, oldest first.

    `forward_step` opens one group per micro-batch (around the user's forward_step_func); every
    full-recompute layer run inside it joins that group. The non-interleaved schedule receives
    the output gradient (send_forward_recv_backward or recv_backward) exactly once before each
    backward, in forward order, so that call takes the oldest group: `recompute_next`.
    """

    pending: deque = field(default_factory=deque)  # [[_Checkpoint, ...] per micro-batch]
    current: list | None = None  # the group of the forward running now
    active: bool = False  # inside forward_backward_func's schedule call
    counts: dict = field(default_factory=lambda: {"in_wait": 0, "inline": 0})

    def register(self, window: str) -> _Checkpoint:
        cp = _Checkpoint(window)
        if self.current is not None:
            self.current.append(cp)
        return cp

    def forward_step(self, forward_step_func: Callable) -> Callable:
        @functools.wraps(forward_step_func)  # callers may inspect its signature
        def step(*args, **kwargs):
            self.current = []
            self.pending.append(self.current)
            try:
                return forward_step_func(*args, **kwargs)
            finally:
                self.current = None

        return step

    def recompute_next(self, in_wait: bool) -> int:
        """Take the micro-batch whose backward comes next; recompute its "p2p_wait" layers now
        if this is a wait (the last stage has none: its layers recompute inline). Returns how
        many layers were recomputed."""
        if not self.pending:
            return 0
        group = self.pending.popleft()
        if not in_wait:
            return 0
        done = 0
        for cp in group:
            if cp.window == "p2p_wait" and cp.ctx is not None and cp.ctx() is not None \
                    and cp.outputs is None:
                _recompute(cp)
                done += 1
        self.counts["in_wait"] += done
        return done

    def reset(self) -> None:
        self.pending.clear()
        self.current = None


RUNTIME = OverlapRuntime()


def recompute_counts() -> dict:
    """Layer recomputations since `reset_counts`: {"in_wait": n, "inline": n}."""
    return dict(RUNTIME.counts)


def reset_counts() -> None:
    RUNTIME.counts.update(in_wait=0, inline=0)


# ------------------------------------------------------------------------------ applying a plan

def _full_recompute_forward(layer: TransformerLayer, window: str) -> Callable:
    """A forward for `layer` that runs it as megatron's per-layer full recompute does, deferred."""
    layer_forward = type(layer).forward

    def forward(*args, **kwargs):
        if not (layer.training and torch.is_grad_enabled()):  # eval / no_grad: megatron's path too
            return layer_forward(layer, *args, **kwargs)
        kwargs.update(zip(_LAYER_ARGS, args))
        if kwargs.get("inference_context") is not None:
            return layer_forward(layer, **kwargs)
        tensors = [kwargs.pop(name, None) for name in _CHECKPOINT_ARGS]

        def run(hidden_states, attention_mask, context, context_mask, rotary_pos_emb, padding_mask):
            return layer_forward(layer, hidden_states=hidden_states, attention_mask=attention_mask,
                                 context=context, context_mask=context_mask,
                                 rotary_pos_emb=rotary_pos_emb, padding_mask=padding_mask, **kwargs)

        return DeferredCheckpointFunction.apply(run, RUNTIME.register(window), *tensors)

    return forward


def _local_layers(model_chunks: list) -> list[TransformerLayer]:
    layers = []
    for chunk in model_chunks:
        decoder = getattr(unwrap_model(chunk), "decoder", None)
        if decoder is None:
            raise PlanError(f"{type(unwrap_model(chunk)).__name__} has no `decoder` TransformerBlock;"
                            " recompute plans apply to megatron-core GPT-style models")
        layers.extend(m for m in decoder.layers if isinstance(m, TransformerLayer))
    return layers


def _check_model(config, plan: Plan, stage: int) -> None:
    """Refuse a model/plan pair the runtime cannot execute exactly."""
    if config.recompute_granularity is not None:
        raise PlanError(f"the model uses megatron's recompute_granularity="
                        f"{config.recompute_granularity!r}: drop --recompute-granularity (and "
                        "--recompute-method / --recompute-num-layers / --recompute-modules); the "
                        "recompute plan decides every layer's recomputation")
    for flag in ("fp8", "fp4"):
        if getattr(config, flag, None):
            raise PlanError(f"--overlap-recompute does not support {flag} (megatron recomputes "
                            f"{flag} layers with Transformer Engine's checkpoint); drop --{flag}-format")
    if config.distribute_saved_activations:
        raise PlanError("--overlap-recompute does not support --distribute-saved-activations")
    if getattr(config, "cpu_offloading", False) or getattr(config, "fine_grained_activation_offloading",
                                                           False):
        raise PlanError("--overlap-recompute does not combine with activation offloading; drop "
                        "--cpu-offloading / --fine-grained-activation-offloading")
    if getattr(config, "cuda_graph_impl", "none") not in (None, "none"):
        raise PlanError(f"--overlap-recompute does not combine with CUDA graphs "
                        f"(cuda_graph_impl={config.cuda_graph_impl!r}); drop --cuda-graph-impl")
    have = {"tp": config.tensor_model_parallel_size or 1, "pp": config.pipeline_model_parallel_size or 1,
            "vpp": config.virtual_pipeline_model_parallel_size or None}
    for key, value in have.items():
        planned = plan.layout.get(key)
        planned = (planned or None) if key == "vpp" else int(planned or 1)
        if planned != value:
            raise PlanError(f"plan field 'layout.{key}' is {planned} but the model runs with "
                            f"{key}={value}; plan again for this layout")
    num_layers = plan.model.get("num_layers", len(plan.layers))
    if num_layers != config.num_layers or len(plan.layers) != config.num_layers:
        raise PlanError(f"plan is for {num_layers} layers ({len(plan.layers)} in field 'layers') but "
                        f"the model has num_layers={config.num_layers}; plan again for this model")
    if config.virtual_pipeline_model_parallel_size and any(
            lp.window == "p2p_wait" for lp in plan.layers if lp.recompute == "full"):
        raise PlanError("the interleaved (virtual pipeline) schedule has no p2p_wait windows in this "
                        "runtime: use a plan whose full layers have window 'inline', or drop "
                        "--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank")
    if not 0 <= stage < len(plan.layers_per_stage):
        raise PlanError(f"pipeline stage {stage} is not in the plan's 'layers_per_stage' "
                        f"{plan.layers_per_stage}")


def _reset_layer(layer: TransformerLayer) -> None:
    layer.recompute_input_layernorm = False
    layer.recompute_pre_mlp_layernorm = False
    layer.recompute_mlp = False
    if hasattr(layer.self_attention, "checkpoint_core_attention"):
        layer.self_attention.checkpoint_core_attention = False
    layer.__dict__.pop("forward", None)


def _set_selective(layer: TransformerLayer, lp: LayerPlan) -> None:
    """megatron-core's TransformerLayer/Attention __init__ for recompute_modules=lp.modules, for
    this layer only (fp8/fp4 and CUDA graphs, which need more there, are refused earlier)."""
    if "core_attn" in lp.modules:
        if not hasattr(layer.self_attention, "checkpoint_core_attention"):
            raise PlanError(f"plan layer {lp.index}: selective 'core_attn' needs an attention module "
                            f"with core-attention checkpointing, not {type(layer.self_attention).__name__}")
        layer.self_attention.checkpoint_core_attention = True
    if "layernorm" in lp.modules:
        if not mcore.have_transformer_engine():
            # CheckpointWithoutOutput(fp8=False) sets `self.fp8 = fp8 is not None` (True) and then
            # calls Transformer Engine's FP8GlobalStateManager: megatron's own
            # --recompute-modules layernorm fails the same way without TE
            raise PlanError(f"plan layer {lp.index}: selective 'layernorm' needs Transformer Engine "
                            "(megatron-core 0.16.1's layernorm recompute calls it even without fp8); "
                            "install transformer_engine or plan without the 'layernorm' group")
        layer.recompute_input_layernorm = not isinstance(layer.input_layernorm, IdentityOp)
        layer.recompute_pre_mlp_layernorm = not isinstance(layer.pre_mlp_layernorm, IdentityOp)
    if "mlp" in lp.modules:
        if layer.is_moe_layer:
            raise PlanError(f"plan layer {lp.index}: selective 'mlp' recomputes dense MLPs; this "
                            "layer is a MoE layer (megatron-core would silently skip it)")
        if layer.config.add_bias_linear:
            # the MLP returns linear_fc2's bias parameter itself; as an output of megatron's
            # CheckpointFunction the parameter gets that node as grad_fn, and its backward then
            # back-propagates into itself forever (megatron's own --recompute-modules mlp hangs)
            raise PlanError(f"plan layer {lp.index}: selective 'mlp' hangs in megatron-core 0.16.1 "
                            "when linear layers have biases (the checkpointed MLP returns its bias "
                            "parameter); use --disable-bias-linear or plan without the 'mlp' group")
        layer.recompute_mlp = True


def apply_plan(model_chunks, plan: Plan, stage: int) -> None:
    """Set every local TransformerLayer's recompute as `plan` says (idempotent).

    `stage` is this rank's pipeline stage. "selective" sets megatron-core's own per-layer flags;
    "full" runs the layer through DeferredCheckpointFunction (window "p2p_wait" or "inline");
    "none" leaves it plain. Refuses (PlanError) a model already using megatron's recompute, or
    whose layout, layer count or partition differs from the plan's.
    """
    chunks = model_chunks if isinstance(model_chunks, list) else [model_chunks]
    config = get_model_config(chunks[0])
    _check_model(config, plan, stage)
    layers = _local_layers(chunks)
    partition = " ".join(plan.megatron_args) or "(an even split)"
    if len(layers) != plan.layers_per_stage[stage]:
        raise PlanError(f"pipeline stage {stage} holds {len(layers)} layers but the plan's "
                        f"'layers_per_stage' {plan.layers_per_stage} gives it "
                        f"{plan.layers_per_stage[stage]}; run with the plan's partition {partition}")
    for layer in layers:
        index = layer.layer_number - 1  # megatron's layer_number is global and 1-based
        lp = plan.layers[index]
        if lp.stage != stage:
            raise PlanError(f"plan layer {index} is on stage {lp.stage}, but the model has it on "
                            f"stage {stage}; run with the plan's partition {partition}")
        key = (lp.recompute, tuple(lp.modules), lp.window)
        if getattr(layer, "_ucp_recompute", None) == key:
            continue
        _reset_layer(layer)
        if lp.recompute == "selective":
            _set_selective(layer, lp)
        elif lp.recompute == "full":
            layer.forward = _full_recompute_forward(layer, lp.window)
        layer._ucp_recompute = key


# ------------------------------------------------------------------------------- p2p and schedule

class OverlapP2PCommunicator(P2PCommunicator):
    """megatron's P2PCommunicator; receiving an output gradient overlaps the next recomputation.

    `send_forward_recv_backward` and `recv_backward` post their p2p ops as `_communicate` does,
    run `runtime.recompute_next` while they are in flight, then wait and return what megatron's
    methods return. Every other method is megatron's.
    """

    def __init__(self, pp_group, config, runtime: OverlapRuntime):
        super().__init__(pp_group=pp_group, config=config)
        if config.use_ring_exchange_p2p:
            raise PlanError("--overlap-recompute needs isend/irecv p2p ops; ring exchange "
                            "(--use-ring-exchange-p2p) blocks: drop it")
        self.runtime = runtime

    def _post_recv_next(self, tensor_send_next: torch.Tensor | None, tensor_shape) -> tuple:
        """`_communicate(tensor_send_next, recv_next=True, wait_on_reqs=False)`, batched or not
        (megatron asserts wait_on_reqs for batched ops; the ops are the same, waited later)."""
        config = self.config
        if config.variable_seq_lengths or config.mtp_standalone:
            _, recv_next_shape = mcore.communicate_shapes(self, tensor_send_next, None, False, True)
        else:
            recv_next_shape = tensor_shape
        if config.pipeline_dtype is None:
            raise RuntimeError("dtype must be provided if recv_next is True")
        if tensor_shape is None:
            raise RuntimeError("tensor_shape must be specified if recv_next is True. Common "
                               "tensor_shape is (seq_length, micro_batch_size, hidden_size)")
        tensor_recv_next = torch.empty(recv_next_shape, requires_grad=True,
                                       device=torch.cuda.current_device(), dtype=config.pipeline_dtype)
        p2p_func = mcore.p2p_ops(batched=config.batch_p2p_comm)
        reqs = p2p_func(tensor_send_prev=None, tensor_recv_prev=None, tensor_send_next=tensor_send_next,
                        tensor_recv_next=tensor_recv_next, group=self.pp_group,
                        prev_pipeline_rank=self.prev_rank, next_pipeline_rank=self.next_rank)
        return tensor_recv_next, list(reqs.values()) if isinstance(reqs, dict) else list(reqs)

    def _wait(self, reqs: list) -> None:
        for req in reqs:
            req.wait()
        if self.config.batch_p2p_comm and self.config.batch_p2p_sync:
            torch.cuda.synchronize()  # as _communicate, against batch_isend_irecv races

    def _recv_next_overlapped(self, sends: list, shapes: list, timer: str) -> list:
        grads = []
        for i, (send, shape) in enumerate(zip(sends, shapes)):
            if self.config.timers is not None:
                self.config.timers(timer, log_level=2).start()
            grad, reqs = self._post_recv_next(send, shape)
            if i == 0:
                self.runtime.recompute_next(in_wait=True)
            self._wait(reqs)
            if self.config.timers is not None:
                self.config.timers(timer).stop()
            grads.append(grad)
        if not grads:
            self.runtime.recompute_next(in_wait=False)
        return grads

    def send_forward_recv_backward(self, output_tensors, tensor_shapes, is_last_stage: bool):
        if is_last_stage:  # no receive to wait for: the layers recompute inline in the backward
            self.runtime.recompute_next(in_wait=False)
            return super().send_forward_recv_backward(output_tensors, tensor_shapes, is_last_stage)
        unwrap = not isinstance(output_tensors, list)
        sends = [output_tensors] if unwrap else output_tensors
        shapes = tensor_shapes if isinstance(tensor_shapes, list) else [tensor_shapes]
        grads = self._recv_next_overlapped(sends, shapes, "forward-send-backward-recv")
        return grads[0] if unwrap else grads

    def recv_backward(self, tensor_shapes, is_last_stage: bool):
        if is_last_stage:
            self.runtime.recompute_next(in_wait=False)
            return super().recv_backward(tensor_shapes, is_last_stage)
        unwrap = is_single_shape(tensor_shapes)
        shapes = [tensor_shapes] if unwrap else tensor_shapes
        grads = self._recv_next_overlapped([None] * len(shapes), shapes, "backward-recv")
        return grads[0] if unwrap else grads


def _default_pg_collection() -> ProcessGroupCollection:
    """The groups forward_backward_pipelining_without_interleaving builds when given none."""
    pg_collection = ProcessGroupCollection()
    pg_collection.tp = ps.get_tensor_model_parallel_group()
    pg_collection.pp = ps.get_pipeline_model_parallel_group()
    pg_collection.embd = ps.get_embedding_group(check_initialized=False)
    pg_collection.pos_embd = ps.get_position_embedding_group(check_initialized=False)
    pg_collection.cp = ps.get_context_parallel_group()
    pg_collection.dp_cp = ps.get_data_parallel_group(with_context_parallel=True,
                                                     partial_data_parallel=False)
    return pg_collection


def forward_backward_func(plan: Plan) -> Callable:
    """A forward-backward function (megatron-core's signature) that executes `plan`.

    Each call applies the plan to `model` (idempotent). A non-interleaved pipelined training call
    runs megatron-core's `forward_backward_pipelining_without_interleaving` with an
    OverlapP2PCommunicator; forward-only, interleaved and unpipelined calls go to megatron-core's
    schedule for the layout unchanged (full layers then recompute inline).
    """

    def forward_backward(*, forward_step_func, data_iterator, model, num_microbatches: int,
                         seq_length: int, micro_batch_size: int, forward_only: bool = False,
                         p2p_communicator: P2PCommunicator | None = None,
                         pg_collection: ProcessGroupCollection | None = None, **kwargs):
        chunks = model if isinstance(model, list) else [model]
        stage = (p2p_communicator.pp_group.rank() if p2p_communicator is not None
                 else ps.get_pipeline_model_parallel_rank())
        apply_plan(chunks, plan, stage)
        stock = schedules.get_forward_backward_func()
        common = dict(data_iterator=data_iterator, model=model, num_microbatches=num_microbatches,
                      seq_length=seq_length, micro_batch_size=micro_batch_size,
                      forward_only=forward_only, **kwargs)
        if forward_only or stock is not schedules.forward_backward_pipelining_without_interleaving:
            return stock(forward_step_func=forward_step_func, p2p_communicator=p2p_communicator,
                         pg_collection=pg_collection, **common)
        if p2p_communicator is None and pg_collection is None:
            pp_group, config = ps.get_pipeline_model_parallel_group(), get_model_config(chunks[0])
            pg_collection = _default_pg_collection()
        elif p2p_communicator is not None and pg_collection is not None:
            if type(p2p_communicator) is not P2PCommunicator:
                raise ValueError(f"--overlap-recompute replaces the schedule's P2PCommunicator; got a "
                                 f"{type(p2p_communicator).__name__}, whose behaviour it would drop")
            pp_group, config = p2p_communicator.pp_group, p2p_communicator.config
        else:
            raise ValueError("Invalid combination of p2p_communicator, pg_collection provide none or "
                             "provide all the process groups")
        if RUNTIME.active:
            raise RuntimeError("forward_backward_func(plan) called inside itself")
        RUNTIME.reset()
        RUNTIME.active = True
        try:
            return stock(forward_step_func=RUNTIME.forward_step(forward_step_func),
                         p2p_communicator=OverlapP2PCommunicator(pp_group, config, RUNTIME),
                         pg_collection=pg_collection, **common)
        finally:
            RUNTIME.active = False
            RUNTIME.reset()

    return forward_backward
