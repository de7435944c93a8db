"""Megatron-Bridge LoRA fine-tuning checkpoints: the adapters merged into the base weights.

A Bridge PEFT run (`cfg.peft` a `megatron.bridge.peft.lora.LoRA`) saves the adapter weights only
(`checkpointing.apply_peft_adapter_filter_to_state_dict`) and records the checkpoint it started
from as `checkpoint.pretrained_checkpoint` in run_config.yaml (as given to the run: absolute, or
relative to the directory the run was started in). Read as universal tensors, such a checkpoint is
the base model with every adapted linear weight merged, as Bridge's own `LoRAMerge.merge`
(peft/lora_merge.py) does it:

    W' = W + (alpha / dim) * (linear_out.weight @ linear_in.weight)

in the model dtype (the adapters are kept in it: `lora_dtype` None), on the global tensors of the
torch_dist save. Why that is the merge at every TP: `ParallelLinearAdapter` (peft/utils.py) builds
`linear_in` (A, [dim, in]) and `linear_out` (B, [out, dim]) as megatron-core parallel linears whose
sharded state dicts put each TP shard where the base weight's is: for a column-parallel base
(linear_qkv, linear_fc1) A is split on dim and B on out as the base weight's rows (a gated
linear_fc1's B through the same `apply_swiglu_sharded_factory` as the weight, so its rows are the
global [gate; up] rows of the weight); for a row-parallel base (linear_proj, linear_fc2) A is split
on in as the weight's columns and B is whole per rank. The global B @ A is then exactly the update of
the global (fused QKV, [gate; up]) weight; Bridge's TP merge gathers A (column) or B (row) to compute
its shard of the same product. Dropout has no weights: nothing to merge.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_ucp.errors import UCPError
from megatron_ucp.formats.dcp_reader import DistReader

LORA = "megatron.bridge.peft.lora.LoRA"
# the adapters merged: Bridge's target module name -> the submodule of a decoder layer holding it
TARGETS = {"linear_qkv": "self_attention", "linear_proj": "self_attention",
           "linear_fc1": "mlp", "linear_fc2": "mlp"}
# PEFT transforms of Bridge 0.6.2 not merged, and what to do instead
NOT_MERGED = {
    "megatron.bridge.peft.dora.DoRA": "DoRA rescales each merged column by its learned magnitude "
    "vector, which megatron-ucp does not merge",
    "megatron.bridge.peft.canonical_lora.CanonicalLoRA": "canonical LoRA keeps separate q/k/v and "
    "gate/up adapters (linear_q, linear_k, ...), which megatron-ucp does not fuse into linear_qkv / "
    "linear_fc1",
    "megatron.bridge.peft.lora.VLMLoRA": "a vision-language model's LoRA is not mapped",
}
ADAPTER = ".adapter."
PRETRAINED_FLAG = "--base"


@dataclass(frozen=True)
class LoRAAdapters:
    """What a Bridge LoRA run's run_config.yaml `peft` section says about its adapters."""

    dim: int
    alpha: float
    dropout: float
    dropout_position: str
    target_modules: tuple[str, ...]
    pretrained_checkpoint: str | None  # as recorded by the run
    ckpt: Path  # the LoRA checkpoint's iteration directory

    @property
    def scale(self) -> float:
        return self.alpha / self.dim  # (ParallelLinearAdapter.forward, LoRAMerge.merge)


def lora_of(run_config: dict, ckpt: Path) -> LoRAAdapters | None:
    """The LoRA adapters of a Bridge run config, None when the run is not a PEFT run; a PEFT
    transform or a target megatron-ucp does not merge is refused by name."""
    peft = run_config.get("peft")
    if not peft:
        return None
    where = f"{ckpt / 'run_config.yaml'}: peft"
    target = peft.get("_target_") if isinstance(peft, dict) else None
    if target in NOT_MERGED:
        raise UCPError(f"{where}._target_ {target}: {NOT_MERGED[target]}; merge the adapters with "
                       "Megatron-Bridge (AutoBridge.export_hf_weights / save_hf_pretrained, which merge "
                       "PEFT adapters) and import the merged model (import-hf)")
    if target != LORA:
        raise UCPError(f"{where}._target_ {target!r}: megatron-ucp merges {LORA} adapters only")
    if (run_config.get("model") or {}).get("num_moe_experts"):
        raise UCPError(f"{where}: LoRA on a MoE model (model.num_moe_experts="
                       f"{run_config['model']['num_moe_experts']}): expert and router adapters are not "
                       "merged by megatron-ucp; merge with Megatron-Bridge and import the merged model")
    unknown = [m for m in peft.get("target_modules") or [] if m not in TARGETS]
    if unknown or peft.get("exclude_modules") or peft.get("canonical_mapping"):
        what = (f"target_modules {unknown}" if unknown else
                f"exclude_modules {peft.get('exclude_modules')}" if peft.get("exclude_modules") else
                f"canonical_mapping {peft.get('canonical_mapping')}")
        raise UCPError(f"{where}.{what}: megatron-ucp merges LoRA adapters named by module "
                       f"({', '.join(TARGETS)}), not patterns or exclusions; merge with Megatron-Bridge")
    if not peft.get("target_modules"):
        raise UCPError(f"{where}.target_modules is empty: no adapters to merge")
    return LoRAAdapters(int(peft["dim"]), float(peft["alpha"]), float(peft.get("dropout") or 0.0),
                        str(peft.get("dropout_position", "pre")), tuple(peft["target_modules"]),
                        (run_config.get("checkpoint") or {}).get("pretrained_checkpoint"), ckpt)


def base_dir(lora: LoRAAdapters, override: str | Path | None) -> Path:
    """The base checkpoint the adapters merge into: `override` (--base), else the recorded one."""
    if override is not None:
        if not Path(override).exists():
            raise UCPError(f"{PRETRAINED_FLAG} {override}: no such directory (the base checkpoint of the "
                           f"LoRA checkpoint {lora.ckpt})")
        return Path(override)
    recorded = lora.pretrained_checkpoint
    if not recorded:
        raise UCPError(f"{lora.ckpt / 'run_config.yaml'}: a LoRA checkpoint without "
                       "checkpoint.pretrained_checkpoint; name its base checkpoint with "
                       f"{PRETRAINED_FLAG} DIR")
    if not Path(recorded).exists():
        raise UCPError(f"{lora.ckpt / 'run_config.yaml'}: the base checkpoint "
                       f"checkpoint.pretrained_checkpoint={recorded} does not exist (from {Path.cwd()}); "
                       f"it moved: name it with {PRETRAINED_FLAG} DIR")
    return Path(recorded)


class MergedReader:
    """The base checkpoint's DistReader whose adapted linear weights are served merged (module
    doc); every other key and attribute is the base reader's."""

    def __init__(self, base: DistReader, adapters: DistReader, lora: LoRAAdapters):
        self.base, self.adapters, self.lora = base, adapters, lora
        self.merged: dict[str, tuple[str, str]] = {}  # base weight key -> (A key, B key)
        found = {k for k in adapters.meta if ADAPTER in k and not k.startswith("optimizer")}
        for key in base.meta:
            prefix, _, leaf = key.rpartition(".")
            module = prefix.rpartition(".")[2]
            if leaf != "weight" or module not in lora.target_modules:
                continue
            a, b = f"{prefix}.adapter.linear_in.weight", f"{prefix}.adapter.linear_out.weight"
            if a not in found or b not in found:
                raise UCPError(f"{lora.ckpt}: no LoRA adapter {a} / {b} for the base weight {key} "
                               f"(peft.target_modules names {module}); the checkpoint is incomplete")
            self.merged[key] = (a, b)
        unused = sorted(found - {k for ab in self.merged.values() for k in ab})
        if unused:
            raise UCPError(f"{lora.ckpt}: adapter tensors {unused[:4]} adapt no base weight megatron-ucp "
                           "merges; merge with Megatron-Bridge")
        self._cache: tuple[str, torch.Tensor] | None = None

    def __getattr__(self, name):
        return getattr(self.base, name)

    def tensor(self, key: str) -> torch.Tensor:
        if key not in self.merged:
            return self.base.tensor(key)
        if self._cache is None or self._cache[0] != key:
            self._cache = (key, self._merge(key))
        return self._cache[1]

    def _merge(self, key: str) -> torch.Tensor:
        w = self.base.tensor(key)
        a, b = (self.adapters.tensor(k) for k in self.merged[key])
        if a.shape[:-2] != w.shape[:-2] or b.shape[-2] != w.shape[-2] or a.shape[-1] != w.shape[-1] or \
                a.shape[-2] != self.lora.dim or b.shape[-1] != self.lora.dim:
            raise UCPError(f"{self.lora.ckpt}: LoRA adapter of {key}: linear_in {tuple(a.shape)}, linear_out "
                           f"{tuple(b.shape)} do not fit the base weight {tuple(w.shape)} at rank "
                           f"{self.lora.dim}; the base checkpoint is not this run's")
        if a.dtype != w.dtype or b.dtype != w.dtype:
            raise UCPError(f"{self.lora.ckpt}: LoRA adapter of {key} is {a.dtype}, the base weight "
                           f"{w.dtype}: a lora_dtype merge is not mapped")
        merged = torch.empty_like(w)
        for at in torch.cartesian_prod(*(torch.arange(n) for n in w.shape[:-2])).reshape(-1, w.dim() - 2) \
                if w.dim() > 2 else [()]:  # one 2-D merge per stacked layer, as LoRAMerge.merge
            i = tuple(int(x) for x in at)
            merged[i] = w[i] + self.lora.scale * (b[i] @ a[i])
        return merged
