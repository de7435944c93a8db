"""Human-readable summary of a checkpoint of any supported format: layout, iteration, parameter
table and sizes. megatron-ucp's own formats are read from their manifest alone; the others
(Megatron-LM torch / torch_dist, Hugging Face, DeepSpeed) through their source (`formats.open_source`),
which for Megatron-LM rebuilds the run's model from its args."""

from __future__ import annotations

import math
from pathlib import Path

from megatron_ucp import formats, te_state
from megatron_ucp.formats import manifest as mf
from megatron_ucp.storage import list_files, location


def inspect(path: str | Path, trust_pickle: bool = False, lora_base: str | Path | None = None) -> str:
    if mf.is_checkpoint(path):
        ckpt = mf.resolve(path)
        m = mf.read(ckpt)
        kind = f"{m.kind} (format {mf.FORMAT} v{m.version})"
    else:
        source = formats.open_source(path, progress=False, verify_checksums=False,
                                     trust_pickle=trust_pickle, lora_base=lora_base)
        ckpt, m = location(source.dir), source.manifest
        kind = f"{source.format} (read as universal tensors)"
    params = m.params
    numel = sum(math.prod(p.shape) for p in params.values())
    sizes = [n for p, n in list_files(ckpt) if p.name != mf.MANIFEST]  # (a store: one listing)
    files, size = sizes, sum(sizes)
    cfg = m.model
    lines = [
        f"checkpoint   {ckpt}",
        f"kind         {kind}",
        f"iteration    {m.iteration}",
        f"saved at     {m.layout} ({m.layout_world_size} ranks)",
        f"model        {cfg.get('num_layers')} layers, hidden {cfg.get('hidden_size')}, "
        f"heads {cfg.get('num_attention_heads')} (groups {cfg.get('num_query_groups')}), "
        f"ffn {cfg.get('ffn_hidden_size')}, vocab {cfg.get('vocab_size')}",
        f"features     {', '.join(features(cfg)) or 'dense GPT'}",
        f"parameters   {len(params)} tensors, {numel:,} elements",
        f"files        {len(files)} data files, {size / 2**20:.2f} MiB",
        f"extra        {m.extra}",
        *optimizer_lines(m),
        *fp8_lines(m),
        *hf_weight_lines(m),
        *lora_lines(None if mf.is_checkpoint(path) else source),
        "",
    ]
    width = max([64, *map(len, params)])  # MTP and expert names run past 64
    lines.append(f"{'name':<{width}} {'shape':>14} {'dtype':>9} {'tp_axis':>7} {'blocks':>6} "
                 f"{'optimizer':>9}")
    for name, p in params.items():
        shape = "x".join(map(str, p.shape))
        tp = "-" if p.spec.tp_axis is None else str(p.spec.tp_axis)
        fam = "-" if p.spec.buffer or m.weights_only else p.spec.optimizer
        lines.append(f"{name:<{width}} {shape:>14} {p.spec.dtype:>9} {tp:>7} {p.spec.tp_blocks:>6} "
                     f"{fam:>9}")
    return "\n".join(lines)


def optimizer_lines(m: mf.Manifest) -> list[str]:
    """The optimizers the run trained with and how many tensors each family's state covers; a
    weights-only checkpoint has none."""
    if m.weights_only:
        return ["optimizer    weights only, optimizer starts fresh (no optimizer state on disk: a "
                "load gives the run's optimizer zero state and step 0)"]
    counts: dict[str, int] = {}
    for p in m.params.values():
        if not p.spec.buffer:
            counts[p.spec.optimizer] = counts.get(p.spec.optimizer, 0) + 1
    out = [f"optimizer    state of {', '.join(f'{f} ({n} tensors)' for f, n in sorted(counts.items()))}"]
    for o in m.optimizer.get("optimizers", []):
        hyper = o.get("hyperparameters")
        out.append(f"             {o['family']}: {o['class']}" + (f" {hyper}" if hyper else ""))
        if o.get("note"):
            out.append(f"             note: {o['note']}")
    return out


def fp8_lines(m: mf.Manifest) -> list[str]:
    """The FP8 recipes of the run's Transformer Engine modules and which modules carry FP8 state."""
    if not m.te_state:
        return []
    modules = m.te_state["modules"]
    out = [f"fp8          {', '.join(f'{r}: {n} modules' for r, n in te_state.summary(m.te_state).items())}"
           f" ({m.te_state['file']})"]
    layers = sorted({int(n.split(".")[2]) for n in modules if n.startswith("decoder.layers.")})
    kinds = sorted({n.split(".", 3)[3].replace("._extra_state", "") for n in modules
                    if n.startswith("decoder.layers.")})
    if layers:
        out.append(f"             layers {layers[0]}-{layers[-1]}: {', '.join(kinds)}")
    others = sorted(n for n in modules if not n.startswith("decoder.layers."))
    if others:
        out.append(f"             also {', '.join(others)}")
    return out


def hf_weight_lines(m: mf.Manifest) -> list[str]:
    """What import-hf recorded of the HF directory: its other files (`files`, stored copies) and
    how it read quantized HF weights (`quantization`): FP8 dequantized."""
    record = m.extra.get("hf_import") if isinstance(m.extra, dict) else None
    if not isinstance(record, dict):
        return []
    out = []
    files = record.get("files")
    if isinstance(files, dict) and files:
        stored = sum(1 for e in files.values() if isinstance(e, dict) and e.get("stored"))
        names = ", ".join(sorted(files)[:4]) + (", ..." if len(files) > 4 else "")
        out.append(f"hf files     {len(files)} ({names}) of {record.get('path')}, {stored} stored in "
                   "hf_files/ (export-hf carries them)")
    q = record.get("quantization")
    if isinstance(q, dict):
        rows, cols = q.get("weight_block_size") or ("?", "?")
        out.append(f"hf weights   {q.get('fp8_tensors')} blockwise FP8 ({q.get('fmt')}) tensors in "
                   f"{rows}x{cols} blocks, dequantized to {q.get('dequantized_to')} by import-hf")
    return out


def features(cfg: dict) -> list[str]:
    """What makes the model more than a dense GPT, as the manifest's model config records it."""
    get, out = cfg.get, []
    if get("hybrid_layer_pattern"):
        out.append(f"hybrid {get('hybrid_layer_pattern')}")
    if get("multi_latent_attention"):
        out.append(f"MLA (q_lora_rank {get('q_lora_rank')}, kv_lora_rank {get('kv_lora_rank')})")
    if get("num_moe_experts"):
        shared = ", shared expert" if get("moe_shared_expert_intermediate_size") else ""
        out.append(f"MoE {get('num_moe_experts')} experts top-{get('moe_router_topk')}{shared}")
    if get("mtp_num_layers"):
        out.append(f"MTP {get('mtp_num_layers')}")
    mla_yarn = get("multi_latent_attention") and get("rope_type") == "yarn"
    if get("position_embedding_type") == "yarn" or mla_yarn:
        out.append("YaRN")
    if get("softmax_type", "vanilla") != "vanilla":
        out.append(f"softmax {get('softmax_type')}")
    if get("window_size"):
        out.append(f"window {get('window_size')}")
    if get("qk_layernorm"):
        out.append("QK-norm")
    return out


def lora_lines(source) -> list[str]:
    """A Megatron-Bridge LoRA checkpoint's adapters (read merged into its base checkpoint)."""
    lora = None if source is None else source.lora
    if lora is None:
        return []
    return [f"LoRA         adapter checkpoint (Megatron-Bridge peft LoRA): rank {lora.dim}, alpha "
            f"{lora.alpha:g} (scale {lora.scale:g}), dropout {lora.dropout:g} ({lora.dropout_position}), "
            f"target modules {', '.join(lora.target_modules)}",
            f"LoRA base    {source.base_dir} (recorded: {lora.pretrained_checkpoint}); the tensors "
            "above are the base weights with the adapters merged"]
