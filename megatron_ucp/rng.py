"""Random-number-generator state: captured per rank, restored only at the same layout.

At a different layout a rank's old stream has no meaning (TP ranks of the new model-parallel
tracker differ from the old ones), so the generators are re-seeded the way Megatron seeds a run,
`seed + 100 * pp_rank`, offset by the iteration so a resumed run does not replay step 0's streams.
"""

from __future__ import annotations

import random

import numpy as np
import torch
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel


def capture() -> tuple[dict[str, torch.Tensor], dict]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["cuda"] = torch.cuda.get_rng_state().cpu()
    for name, state in tensor_parallel.get_cuda_rng_tracker().get_states().items():
        tensors[f"tracker.{name}"] = state.cpu()
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    meta = {"python": [version, list(mt), gauss],
            "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]}
    return tensors, meta


def restore(tensors: dict[str, torch.Tensor], meta: dict) -> tuple[str, ...]:
    """Set every generator `capture` recorded; returns the names of those restored (the keys of
    `tensors`, then "python" and "numpy")."""
    restored = ["torch_cpu"]
    torch.set_rng_state(tensors["torch_cpu"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["cuda"])
        restored.append("cuda")
    tracker = {k.removeprefix("tracker."): v for k, v in tensors.items() if k.startswith("tracker.")}
    if tracker:
        tensor_parallel.get_cuda_rng_tracker().set_states(tracker)
        restored += [f"tracker.{name}" for name in tracker]
    version, mt, gauss = meta["python"]
    random.setstate((version, tuple(mt), gauss))
    kind, keys, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    return (*restored, "python", "numpy")


def rederived_seed(seed: int, iteration: int, pp_rank: int) -> int:
    """The seed a resume at another layout gives this pipeline stage's generators."""
    return seed + 100 * pp_rank + iteration


def rederive(seed: int, iteration: int) -> None:
    """Seed Python's, numpy's and torch's generators with `rederived_seed`, and megatron-core's
    CUDA generator and model-parallel tracker with `model_parallel_cuda_manual_seed` of it (which
    offsets the tracker's streams by TP and expert rank, as at the start of a run)."""
    s = rederived_seed(seed, iteration, ps.get_pipeline_model_parallel_rank())
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)
    tensor_parallel.model_parallel_cuda_manual_seed(s)
