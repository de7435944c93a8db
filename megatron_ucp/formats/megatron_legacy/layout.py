"""The files of a Megatron-LM `--ckpt-format torch` checkpoint (distributed optimizer).

A legacy save holds, per (TP, PP, EP) rank directory `mp_rank_TT[_PPP][_EEE]`, `model_optim_rng.pt`
(model weights in the training dtype with local layer numbers, optimizer hyper-parameters and the
Adam step, scheduler, args, rng state) and `distrib_optim.pt` (fp32 master weights and Adam moments
as flat per-buffer tensors gathered from all DP ranks, one entry per chained optimizer; a run with
megatron-core 0.19's LayerWiseDistributedOptimizer, `--optimizer muon|lion`, instead has one
`layer_wise_optimizer_<dp>.pt` per DP rank, its own parameters' state by position). Neither
file says where a parameter sits in the flat tensors: megatron-core's DDP buffers decide that at
the saving layout, so both directions rebuild the rank's model (`megatron_rebuild`) and ask it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from megatron_ucp.errors import UCPError
from megatron_ucp.formats.megatron_common import RANK_DIR, rank_dir_name, torch_load, world
from megatron_ucp.formats.megatron_rebuild import source_rank

MODEL_FILE = "model_optim_rng.pt"
OPTIM_FILE = "distrib_optim.pt"
# megatron-core 0.19's LayerWiseDistributedOptimizer (`--optimizer muon|lion`): each data-parallel
# rank saves its own parameters' state (a ChainedOptimizer state dict, by position) next to
# model_optim_rng.pt instead of distrib_optim.pt
LAYER_WISE_FILE = "layer_wise_optimizer_{dp}.pt"


def load_file(path: Path, trust_pickle: bool = False) -> Any:
    return torch_load(path, f"every rank directory needs {MODEL_FILE} and {OPTIM_FILE} (saved with "
                            "--use-distributed-optimizer); restore the file", trust_pickle)


def rank_dirs(iter_dir: Path) -> list[Path]:
    return sorted(p for p in iter_dir.iterdir() if p.is_dir() and RANK_DIR.fullmatch(p.name))


def is_iteration(path: Path) -> bool:
    """An iteration directory of a legacy save (holding mp_rank_* directories)."""
    return path.is_dir() and any(path.glob("mp_rank_*/" + MODEL_FILE))


def read_args(path: Path, found: list[Path], trust_pickle: bool = False):
    """The Megatron-LM args of the run (from one rank directory's model file)."""
    m = load_file(path, trust_pickle)
    args = m.get("args") if isinstance(m, dict) else None
    sizes = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "num_layers")
    if args is None or not all(hasattr(args, k) for k in sizes):
        two_part = [p.name for p in found if p.name.count("_") == 3]
        why = (f"the directory names {two_part} are ambiguous without it (mp_rank_TT_XXX is a "
               "pipeline rank with PP>1 but an expert rank with EP>1) and " if two_part else "")
        raise UCPError(f"{path} has no Megatron-LM 'args' (argparse namespace with the parallel "
                       f"sizes and the model architecture); {why}the model cannot be rebuilt. Every "
                       "Megatron-LM save stores args: restore this file from the original save")
    return args


@contextlib.contextmanager
def rank_context(args, rank: int, name: str) -> Iterator[None]:
    """`megatron_rebuild.source_rank`, checking that global rank `rank` is the writer of rank
    directory `name` (its expert-data-parallel rank 0), so the files read match the rebuilt rank."""
    from megatron.core import parallel_state as ps

    with source_rank(args, rank):
        here = rank_dir_name(ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                         ps.get_expert_model_parallel_rank(), args)
        if here != name or ps.get_expert_data_parallel_rank() != 0:
            raise UCPError(f"internal: global rank {rank} is {here}, not the writer of {name}")
        yield


def optimizer_buffers(chunks: list, args) -> list[list]:
    """The buffers of each chained optimizer in the order the legacy save lists them
    (megatron.core.optimizer.get_megatron_optimizer: dense optimizer(s) over all chunks, the first
    chunk alone when overlapping param gather with the optimizer step, then the expert optimizer)."""
    if getattr(args, "overlap_param_gather_with_optimizer_step", False):
        groups = [chunks[:1], chunks[1:]]
    else:
        groups = [chunks]
    out = [[b for c in group for b in c.buffers] for group in groups]
    expert = [b for c in chunks for b in c.expert_parallel_buffers]
    if expert:
        out.append(expert)
    return out


def flat_offsets(buffer) -> dict:
    """param -> start in the legacy flat tensor of `buffer`. get_parameter_state_dp_zero writes
    bucket after bucket, each without its end padding: bucket b starts at the sum of the earlier
    buckets' numel_unpadded; inside it a param keeps its DDP offset from the bucket start."""
    starts = [0]
    for bucket in buffer.buckets:
        starts.append(starts[-1] + bucket.numel_unpadded)
    return {p: start - buffer.buckets[b].offset + starts[b]
            for p, (start, _end, b) in buffer.param_index_map.items()}


def layer_wise_ranks(args, name: str) -> Iterator[tuple[int, int]]:
    """(data-parallel rank, global rank) of every rank whose state is saved in rank directory
    `name` (a LayerWiseDistributedOptimizer run: each DP rank writes `LAYER_WISE_FILE`)."""
    from megatron.core import parallel_state as ps

    for rank in range(world(args)):
        with source_rank(args, rank):
            here = rank_dir_name(ps.get_tensor_model_parallel_rank(),
                                 ps.get_pipeline_model_parallel_rank(),
                                 ps.get_expert_model_parallel_rank(), args)
            dp = ps.get_data_parallel_rank()
        if here == name:
            yield dp, rank
