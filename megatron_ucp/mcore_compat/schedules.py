"""megatron-core's recompute and pipeline-schedule internals that the Lynx runtime builds on.

`megatron_ucp.recompute.runtime` re-runs megatron-core's CheckpointFunction recomputation at
another time and posts the 1F1B schedule's p2p ops itself; both need names megatron-core keeps
private (`tensor_parallel.random._*`, `p2p_communication._p2p_ops`, `P2PCommunicator.
_communicate_shapes`). They are the same in 0.16 and 0.19; every call goes through here, so a
release that changes them is handled in this one module.

`selective_recompute_groups` is what megatron-core's per-layer selective recompute can run
(0.16.1 and 0.19.2 checked): it needs nothing but the model's settings (no megatron-core import).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


def _tp_random():
    from megatron.core.tensor_parallel import random as tp_random

    return tp_random


def set_checkpointing() -> None:
    """Mark a checkpointed region as CheckpointFunction does (`random._set_checkpointing`)."""
    _tp_random()._set_checkpointing()


def unset_checkpointing() -> None:
    _tp_random()._unset_checkpointing()


def all_rng_states() -> tuple:
    """The CPU, CUDA and model-parallel tracker RNG states CheckpointFunction saves."""
    return _tp_random()._get_all_rng_states()


def set_all_rng_states(states: tuple) -> None:
    _tp_random()._set_all_rng_states(*states)


@contextlib.contextmanager
def forked_rng() -> Iterator[None]:
    """The RNG states restored on exit, as CheckpointFunction's backward forks them."""
    with _tp_random()._fork_rng():
        yield


def have_transformer_engine() -> bool:
    """Whether megatron-core's tensor_parallel.random found Transformer Engine (its layernorm
    recompute, CheckpointWithoutOutput, calls TE even without fp8)."""
    return bool(_tp_random().HAVE_TE)


def p2p_ops(batched: bool) -> Callable:
    """The function `_communicate` posts its p2p ops with: batched (`batch_isend_irecv`) or not.
    Called with tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next, group,
    prev_pipeline_rank, next_pipeline_rank; returns the requests (a dict or a list)."""
    from megatron.core.pipeline_parallel import p2p_communication

    return p2p_communication._batched_p2p_ops if batched else p2p_communication._p2p_ops


def communicate_shapes(communicator, tensor_send_next, tensor_send_prev, recv_prev: bool,
                       recv_next: bool) -> tuple:
    """(recv_prev_shape, recv_next_shape) as the P2PCommunicator exchanges them first when
    sequence lengths vary (`_communicate_shapes`)."""
    return communicator._communicate_shapes(tensor_send_next, tensor_send_prev, recv_prev, recv_next)


def selective_recompute_groups(model: dict | None = None) -> list[str]:
    """The SELECTIVE groups megatron-core's per-layer recompute can actually run for this model.

    Its `mlp` recompute returns linear_fc2's bias parameter from the checkpoint, which then gets
    the checkpoint node as grad_fn and the backward recurses forever (layers with linear biases,
    the GPT default). Its `layernorm` recompute calls Transformer Engine even with fp8 off
    (`CheckpointWithoutOutput` sets fp8 = `fp8 is not None`), so it needs TE layers.
    """
    model = model or {}
    groups = ["core_attn"]
    if model.get("transformer_impl") == "transformer_engine":
        groups.append("layernorm")
    if not model.get("add_bias_linear", True):
        groups.append("mlp")
    return sorted(groups)
