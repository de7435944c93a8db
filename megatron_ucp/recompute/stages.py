"""What the planner knows of a stage before choosing anything: the recompute choices a layer
can take, the pipeline partitions Megatron-LM accepts, and each stage's static memory.

Static memory per stage (megatron's distributed optimizer, Megatron-LM defaults): 16-bit weights
2 B + fp32 main gradients 4 B + (fp32 master weights 4 B + Adam moments 8 B) / DP per parameter;
fp32 models 4 + 4 + 8 / DP. Parameters: the stage's layers at its TP shard, the embedding (+ learned
position embedding) on the first stage, the final norm and the output layer (or the tied copy of the
embedding, as megatron keeps it when pp > 1) on the last. Allocator overhead, CUDA context and
communication buffers are not modelled: pass a lower limit to keep room for them.
"""

from __future__ import annotations

import itertools
import math

from megatron_ucp.mcore_compat.schedules import selective_recompute_groups
from megatron_ucp.recompute.hardware import DTYPE_BYTES
from megatron_ucp.recompute.profile import SELECTIVE

GIB = 2**30


class PlannerError(ValueError):
    """A planning request that cannot be served; the message says which input and what to do."""


class NothingFitsError(PlannerError):
    """No plan fits the memory limit; `min_limit_bytes` is the smallest limit that fits."""

    def __init__(self, message: str, min_limit_bytes: int):
        super().__init__(message)
        self.min_limit_bytes = min_limit_bytes


def runnable_groups(model: dict | None = None) -> list[str]:
    """The SELECTIVE groups megatron-core can actually recompute for this model
    (`mcore_compat.schedules.selective_recompute_groups`: its `mlp` recompute hangs with linear
    biases, its `layernorm` recompute needs Transformer Engine)."""
    return selective_recompute_groups(model)


def selective_names(groups: list[str] | None = None) -> list[str]:
    groups = sorted(SELECTIVE) if groups is None else sorted(groups)
    return ["selective:" + "+".join(c) for n in range(1, len(groups) + 1)
            for c in itertools.combinations(groups, n)]


def all_choices(model: dict | None = None) -> list[str]:
    """Every choice of one layer; with `model`, only the selective groups it can run."""
    groups = None if model is None else runnable_groups(model)
    return ["none", *selective_names(groups), "full:inline", "full:p2p_wait"]


def num_microbatches(global_batch_size: int, micro_batch_size: int, dp: int) -> int:
    if global_batch_size % (micro_batch_size * dp):
        raise PlannerError(f"--global-batch {global_batch_size} is not a multiple of --micro-batch "
                           f"{micro_batch_size} x --dp {dp}")
    return global_batch_size // (micro_batch_size * dp)


def stage_params(model: dict, tp: int, layers_per_stage: list) -> list[int]:
    """Parameters held by one TP rank of each pipeline stage."""
    h, f = model["hidden_size"], model["ffn_hidden_size"]
    a, g = model["num_attention_heads"], model["num_query_groups"]
    d, bias = h // a, bool(model.get("add_bias_linear", True))
    fc1_out = 2 * f if model.get("swiglu") else f
    norm = 2 * h if model.get("normalization", "LayerNorm") == "LayerNorm" else h
    qkv_out = a * d + 2 * g * d
    layer = (h * qkv_out // tp + (qkv_out // tp if bias else 0) + a * d * h // tp + (h if bias else 0)
             + h * fc1_out // tp + (fc1_out // tp if bias else 0) + f * h // tp + (h if bias else 0)
             + 2 * norm)
    embedding = model["vocab_size"] * h // tp
    if model.get("position_embedding_type", "learned_absolute") == "learned_absolute":
        embedding += model["seq_length"] * h
    pp = len(layers_per_stage)
    output = norm + (model["vocab_size"] * h // tp if model.get("untie_embeddings") or pp > 1 else 0)
    params = [n * layer for n in layers_per_stage]
    params[0] += embedding
    params[-1] += output
    return params


def bytes_per_param(dtype: str, dp: int) -> float:
    """Distributed optimizer: weights + fp32 main grads + (fp32 master + Adam m, v) / DP."""
    if DTYPE_BYTES[dtype] == 4:
        return 4 + 4 + 8 / dp
    return DTYPE_BYTES[dtype] + 4 + 12 / dp


def static_bytes(model: dict, tp: int, dp: int, layers_per_stage: list) -> list[int]:
    per = bytes_per_param(model.get("dtype", "bf16"), dp)
    return [int(math.ceil(p * per)) for p in stage_params(model, tp, layers_per_stage)]


def megatron_partitions(num_layers: int, pp: int, vpp: int | None = None) -> list[list[int]]:
    """Every layers-per-stage split megatron-LM accepts: first f, last l, middle stages even (>= 1)."""
    vpp = vpp or 1
    if pp == 1:
        return [[num_layers]]
    if vpp > 1:
        if num_layers % (pp * vpp):
            raise PlannerError(f"an interleaved schedule needs num_layers ({num_layers}) divisible by "
                               f"pp x vpp ({pp} x {vpp})")
        return [[num_layers // pp] * pp]
    out = []
    if pp == 2:
        return [[first, num_layers - first] for first in range(1, num_layers)]
    for middle in range(1, (num_layers - 2) // (pp - 2) + 1):
        rest = num_layers - middle * (pp - 2)
        for first in range(1, rest):
            out.append([first, *[middle] * (pp - 2), rest - first])
    return out


def most_even_partitions(num_layers: int, pp: int, vpp: int | None = None) -> list[list[int]]:
    """The partitions megatron-LM accepts with the smallest largest stage (the even one if it exists)."""
    parts = megatron_partitions(num_layers, pp, vpp)
    if num_layers % pp == 0 and [num_layers // pp] * pp in parts:
        return [[num_layers // pp] * pp]
    smallest = min(max(p) for p in parts)
    return [p for p in parts if max(p) == smallest]
