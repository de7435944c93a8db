"""The precision-aware optimizer's state (`--use-precision-aware-optimizer`: Transformer Engine's
FusedAdam inside megatron-core's DistributedOptimizer) read as fp32 and written back in TE's dtypes.

FusedAdam keeps, for each parameter shard (its optimizer param: a view of the model's bf16 weight),
the state in its own dtypes (`FusedAdam.name_to_dtype_map`, megatron-core's `--exp-avg-dtype`,
`--exp-avg-sq-dtype`, `--main-params-dtype`):
- moments in fp32, bf16, fp16 or fp8 (uint8, a Float8Tensor); fp16 and fp8 ones with one fp32 scale
  per tensor, i.e. per DP shard;
- the master weight in fp32 or fp16 (scaled), or, for a bf16 weight with an fp32 master and
  `store_param_remainders` (megatron-core's default), only the master's low 16 bits (int16) under
  the weight's bits, the weight rounded from the master by TE's kernel.
The universal form holds their fp32 values: TE's `get_unscaled_state` (every dtype widens to fp32
exactly; fp16 / fp8 ones times their scale), the master rebuilt from weight and remainder as TE's
kernel does (`join_master`). A load stages fp32 tensors (`stage`) and gives them back through TE's
`set_scaled_state` (`write`), which derives each scale over the new shard, and writes the weight
the master implies. fp32 weights are FusedAdam's own master (it updates them in place).
"""

from __future__ import annotations

import torch

SCALED_STATE_NOTE = ("fp16 / fp8 optimizer state has one scale per tensor shard: at another DP or "
                     "TP size TE's set_scaled_state rescales it over the new shards, so it holds the "
                     "saved values to its own precision, not bitwise")
FP16_MASTER_NOTE = ("fp16 master weights: the model's bf16 weights are re-derived from the "
                    "unscaled masters at the load (as the next step does), so the first resumed "
                    "forward may differ from the uninterrupted run's by one bf16 ulp")
MOMENTS = ("exp_avg", "exp_avg_sq")


def note(hyperparameters: dict) -> str:
    """What a load at another layout changes for an optimizer with these recorded dtypes ("")."""
    notes = [SCALED_STATE_NOTE] if any(hyperparameters.get(k) in ("float16", "uint8") for k in (
        "exp_avg_dtype", "exp_avg_sq_dtype", "master_weight_dtype")) else []
    if hyperparameters.get("master_weight_dtype") == "float16":
        notes.append(FP16_MASTER_NOTE)
    return "; ".join(notes)


def join_master(weight: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master weight of a bf16 `weight` and its int16 `remainder`: the weight's bits over
    the remainder's, with the rounding TE's kernel applied undone (a negative remainder rounded the
    weight up)."""
    high = weight.contiguous().view(torch.int16).to(torch.int32)
    low = remainder.to(torch.int32)
    high = torch.where(low < 0, high - 1, high)
    return ((high << 16) | (low & 0xFFFF)).view(torch.float32)


def split_master(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(bf16 weight as int16 bits, int16 remainder) of an fp32 master, as TE's kernel leaves them."""
    bits = master.contiguous().view(torch.int32)
    high, low = bits >> 16, (bits & 0xFFFF).to(torch.int16)
    return torch.where(low < 0, high + 1, high).to(torch.int16), low


def _remainders(optimizer, shard: torch.Tensor) -> bool:
    return bool(optimizer.store_param_remainders) and shard.dtype == torch.bfloat16


def read(optimizer, shard: torch.Tensor) -> dict[str, torch.Tensor]:
    """{"param": fp32 master, "exp_avg", "exp_avg_sq"} of one FusedAdam param (flat shard): fp32
    values, bf16 moments as they are (no device copy; a save widens them on the host); a state
    not created yet is absent."""
    state = optimizer.state[shard]
    out = {k: optimizer.get_unscaled_state(shard, k, skip_unscale=True) for k in MOMENTS if k in state}
    if shard.dtype == torch.float32:
        out["param"] = shard.detach()
    elif "master_param" in state:
        out["param"] = (join_master(shard.detach(), state["master_param"])
                        if _remainders(optimizer, shard)
                        else optimizer.get_unscaled_state(shard, "master_param").float())
    return out


def stage(optimizer, shard: torch.Tensor, weights_only: bool) -> dict[str, torch.Tensor]:
    """fp32 tensors a load fills for one FusedAdam param (the master alone: weights_only), its
    state created first as its first step would."""
    if "master_param" not in optimizer.state[shard]:
        optimizer.initialize_state(shard, _remainders(optimizer, shard))
    keys = ("param",) if weights_only else ("param", *MOMENTS)
    return {k: torch.empty(shard.numel(), dtype=torch.float32, device=shard.device) for k in keys}


@torch.no_grad()
def write(optimizer, shard: torch.Tensor, staged: dict[str, torch.Tensor]) -> None:
    """Give `stage`'s filled tensors to FusedAdam in its dtypes and write the model weight."""
    for k in MOMENTS:
        if k in staged:
            optimizer.set_scaled_state(shard, k, staged[k])
    master = staged["param"]
    if _remainders(optimizer, shard):
        high, low = split_master(master)
        shard.view(torch.int16).copy_(high)
        optimizer.set_scaled_state(shard, "master_param", low)
        return
    shard.copy_(master)  # the weight TE's kernel writes: the master cast (round to nearest even)
    if optimizer.master_weights:  # (an fp32 weight's master copy is unused by FusedAdam: kept equal)
        optimizer.set_scaled_state(shard, "master_param", master)  # (scales its argument in place)
