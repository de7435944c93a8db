"""What each megatron-core release writes in a torch_dist checkpoint (formats/megatron_dist reads
every release's files, whichever release is installed).

* 0.13-0.15's `flattened_range` optimizer form (`fully_sharded_model_space`), which 0.16 and later
  no longer load: read only.
* 0.16's `--dist-ckpt-optim-fully-reshardable` content metadata.
* 0.19 keeps the common state inside the .distcp files (no `common.pt`).
* The RNG state: one shard per (PP, TP) rank; with expert parallelism Megatron-LM core_v0.16.x keeps
  one per (PP, TP, DP) rank instead (0.13-0.15 and 0.17-0.19: per (PP, TP)).
"""

from __future__ import annotations

COMMON_STATE_KEY = "common_state/shard_0_1"  # megatron-core 0.19: the common state, in the .distcp files
FLATTENED = "fully_sharded_model_space"  # the flattened_range form of megatron-core 0.13-0.15
# common.pt['content_metadata'] of a `--dist-ckpt-optim-fully-reshardable` save (megatron-core 0.16)
FULLY_RESHARDABLE_CONTENT = {"distrib_optim_sharding_type": "fully_reshardable",
                             "distrib_optim_fully_reshardable_mem_efficient": False,
                             "singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def rng_shard_dp_forms(dp: int, ep: int) -> list[tuple[int, int] | None]:
    """The DP parts of the RNG shard keys a save writes for every (PP, TP) rank: None (the per
    (PP, TP) form) and, with expert parallelism, (dp_rank, dp) for each DP rank (core_v0.16.x's
    form). A load wants the keys its own release writes, so both forms are written and any release
    resumes (a load ignores stored keys it does not ask for)."""
    return [None] + ([(d, dp) for d in range(dp)] if ep > 1 else [])
