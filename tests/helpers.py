"""Helpers that several test files share, kept once (a copy per file drifts: one copy of
`assert_same` had lost its numpy dtype check). Independent assemblies of checkpoint files live in
`oracles.py`, the in-memory reference of a run in `reference.py`; this module holds the rest.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

# The model of the Megatron-LM fixtures (tests/fixtures/megatron_lm/README.md "Common settings") as
# a megatron_ucp.testing.tiny_gpt config; a test adds the flags of its fixture's run to a copy.
FIXTURE_MODEL: dict[str, Any] = {
    "num_layers": 3, "hidden_size": 32, "num_attention_heads": 4, "ffn_hidden_size": 128,
    "seq_length": 32, "vocab_size": 256, "dtype": "bf16", "micro_batch_size": 2,
    "global_batch_size": 4}


def assert_same(a: Any, b: Any, where: str) -> None:
    """Bitwise equality of nested checkpoint objects: types, key order, tensors (dtype, shape,
    values), numpy arrays (dtype, values) and plain values."""
    assert type(a) is type(b), (where, type(a), type(b))
    if torch.is_tensor(a):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), (where, list(a), list(b))
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}/{i}")
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), where
    else:
        assert a == b, (where, a, b)


def dump_step_and_finish(st: Any, dump_dir: str, iteration: int) -> dict:
    """The end of a launched rank that resumed a run from a checkpoint by megatron-core's own
    loading code: its local state dumped (what the test compares with the checkpoint's), one train
    step, the process group destroyed. Returns the step's loss, the learning rates and the
    scheduler's step count after it, and `iteration`."""
    from megatron_ucp.testing import scenarios
    from megatron_ucp.testing import tiny_gpt as tg

    scenarios.dump_local_state(st, dump_dir)
    loss = tg.train_step(st)
    lrs = [g["lr"] for g in st.optimizer.param_groups]
    tg.destroy()
    return {"loss": loss, "iteration": iteration, "lr": lrs, "num_steps": st.scheduler.num_steps}


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Two name -> tensor maps (e.g. `oracles.universal_tensors` of two checkpoints) hold the same
    names and, under each, bitwise the same tensor, dtype and shape included (`torch.equal` alone
    ignores the dtype: it finds a tensor equal to its bf16 cast)."""
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    for k, t in a.items():
        assert t.dtype == b[k].dtype and t.shape == b[k].shape and torch.equal(t, b[k]), k
