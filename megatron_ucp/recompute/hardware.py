"""A `Profile` stated from published hardware figures, for planning without a GPU to measure on.

Every figure used is in `GPUS` / the constants below and is copied into `profile.notes`; the
profile's source is "published". Use a measured profile (`megatron-ucp profile-recompute` on the
GPU) whenever one exists: these numbers are a model, not a measurement.

Times, per micro-batch of one layer at tensor-parallel size t (sequence parallel on when t > 1 and
the model config says `sequence_parallel: true`):
- GEMMs: FLOPs / (peak dense bf16 FLOP/s x MFU). Forward FLOPs (s sequence, b micro-batch, h hidden,
  d = h / heads, g query groups, f ffn): qkv 2sbh(h + 2gd), core attention 4bs^2h (QK^T and
  attention x V, megatron's unfused attention computes the full s x s), proj 2sbh^2, MLP 4sbhf
  (6sbhf with SwiGLU); all / t. Backward = 2x forward (data and weight gradients).
- Memory-bound work (layernorms, softmax + dropout of the attention scores, GeLU, bias-dropout-add):
  bytes moved / (HBM bandwidth x HBM_EFFICIENCY); backward moves 2x the forward bytes.
- TP collectives (sequence parallel: all-gather before qkv and fc1, reduce-scatter after proj and fc2,
  the same again in the backward; without it an all-reduce after proj and fc2): ring time
  alpha + (t - 1) / t x bytes / NVLink bandwidth per direction x NVLINK_EFFICIENCY, inside the
  module it belongs to.
Activation bytes: Korthikanti et al. 2022 (arXiv 2205.05198), section 4.1 / Table 2: one layer keeps
sbh(34 + 5as/h) bytes with 16-bit activations and 1-byte dropout masks; with tensor + sequence
parallelism all of it / t; with tensor parallelism only, sbh(10 + 24/t + 5as/(ht)). Split over the
modules as what a recompute of that module frees (megatron-core 0.16's --recompute-modules):
  input_layernorm 2sbh (its output, the qkv input)      pre_mlp_layernorm 2sbh (its output)
  qkv 8sbh (the layer input 2 + q, k, v 6: kept by the   core_attn 5as^2b (scores after softmax 2,
      core-attention checkpoint)                                dropout mask 1, dropout output 2)
  proj 5sbh (its input 2, dropout mask 1, the residual   mlp 17sbh (GeLU input 8, fc2 input 8,
      entering pre_mlp_layernorm 2)                             dropout mask 1)
GeLU's 8sbh are 2sbf generally (SwiGLU: 4sbf + 2sbf for fc1 output and fc2 input). 16-bit elements
scale with the model dtype (fp32: 4 bytes), masks stay 1 byte.
Stage ends: embedding keeps its dropout mask (sbh / t bytes); the last stage keeps the final
layernorm input, the output-layer input (gathered: 2sbh) and the fp32 logits for the cross entropy
(4sbV / t). Embedding / output costs follow the same FLOP and byte rules (output GEMM 2sbhV / t).
p2p: one stage boundary message (the hidden states, / t with sequence parallelism) over InfiniBand
(TP8 fills a node, so every pipeline hop leaves it) or NVLink: alpha + bytes / bandwidth.
"""

from __future__ import annotations

from pathlib import Path

from megatron_ucp.recompute.profile import LinkCost, ModuleCost, Profile, StageEnds

# Published figures (dense bf16 Tensor Core peak, HBM bandwidth, NVLink bandwidth per direction,
# InfiniBand per GPU): NVIDIA A100 datasheet (SXM4 80GB: 312 TFLOP/s, 2039 GB/s, NVLink 3 600 GB/s
# total), DGX A100 (8x HDR 200 Gb/s, one per GPU); NVIDIA H100 datasheet (SXM5: 989 TFLOP/s,
# 3.35 TB/s, NVLink 4 900 GB/s total), DGX H100 (8x NDR 400 Gb/s, one per GPU).
GPUS = {
    "A100-80GB": {"flops": 312e12, "hbm_bytes_s": 2.039e12, "nvlink_bytes_s": 300e9,
                  "ib_bytes_s": 25e9, "memory_bytes": 80 * 2**30},
    "H100-80GB": {"flops": 989e12, "hbm_bytes_s": 3.35e12, "nvlink_bytes_s": 450e9,
                  "ib_bytes_s": 50e9, "memory_bytes": 80 * 2**30},
}
MFU = 0.5  # fraction of peak FLOP/s a GEMM reaches (stated assumption, typical of Megatron GPT runs)
HBM_EFFICIENCY = 0.7  # fraction of HBM bandwidth memory-bound kernels reach (stated assumption)
NVLINK_EFFICIENCY = 0.8  # NCCL ring bus bandwidth / NVLink bandwidth (stated assumption)
NVLINK_ALPHA_S = 10e-6  # latency of one NCCL collective inside a node (stated assumption)
IB_ALPHA_S = 20e-6  # latency of one NCCL send/recv across nodes (stated assumption)
NVLINK_P2P_ALPHA_S = 8e-6

MODEL_DEFAULTS = {"ffn_hidden_size": None, "num_query_groups": None, "micro_batch_size": 1,
                  "swiglu": False, "dtype": "bf16", "normalization": "LayerNorm",
                  "add_bias_linear": True, "position_embedding_type": "learned_absolute",
                  "untie_embeddings": False, "sequence_parallel": False}
MODEL_REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size")
# Fields of a model config (the profiler's too); anything else is refused.
MODEL_FIELDS = set(MODEL_DEFAULTS) | set(MODEL_REQUIRED) | {"extra"}
DTYPE_BYTES = {"bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp32": 4, "float32": 4}


class ModelConfigError(ValueError):
    """A model config that cannot be used; the message names the file and the field."""


def normalize_model(data: dict, where: str = "model config") -> dict:
    """The model fields with defaults filled in ('-' in keys read as '_')."""
    if not isinstance(data, dict):
        raise ModelConfigError(f"{where}: expected a mapping of model fields, got {type(data).__name__}")
    given = {str(k).replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(given) - MODEL_FIELDS)
    if unknown:
        raise ModelConfigError(f"{where}: unknown field(s) {unknown}; accepted: {sorted(MODEL_FIELDS)}")
    for name in MODEL_REQUIRED:
        if name not in given:
            raise ModelConfigError(f"{where}: field {name!r} is required")
    model = {**MODEL_DEFAULTS, **given}
    for name in (*MODEL_REQUIRED, "micro_batch_size"):
        if not isinstance(model[name], int) or isinstance(model[name], bool) or model[name] <= 0:
            raise ModelConfigError(f"{where}: field {name!r} must be a positive integer, "
                                   f"not {model[name]!r}")
    model["ffn_hidden_size"] = model["ffn_hidden_size"] or 4 * model["hidden_size"]
    model["num_query_groups"] = model["num_query_groups"] or model["num_attention_heads"]
    if model["hidden_size"] % model["num_attention_heads"]:
        raise ModelConfigError(f"{where}: hidden_size {model['hidden_size']} is not a multiple of "
                               f"num_attention_heads {model['num_attention_heads']}")
    if model["num_attention_heads"] % model["num_query_groups"]:
        raise ModelConfigError(f"{where}: num_attention_heads {model['num_attention_heads']} is not "
                               f"a multiple of num_query_groups {model['num_query_groups']}")
    if model["dtype"] not in DTYPE_BYTES:
        raise ModelConfigError(f"{where}: field 'dtype' is {model['dtype']!r}; use one of "
                               f"{sorted(DTYPE_BYTES)}")
    return model


def load_model_config(path: str | Path) -> dict:
    """A model config from YAML: the top-level 'model' mapping if present, else the whole file."""
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ModelConfigError(f"{path}: cannot read the model config ({e})") from None
    except yaml.YAMLError as e:
        raise ModelConfigError(f"{path}: not valid YAML ({e})") from None
    if isinstance(data, dict) and isinstance(data.get("model"), dict):
        data = data["model"]
    return normalize_model(data, str(path))


def check_tp(model: dict, tp: int, where: str = "model config") -> None:
    """Refuse a TP size the model's heads, groups or FFN cannot be split by."""
    for name in ("num_attention_heads", "num_query_groups", "ffn_hidden_size"):
        if model[name] % tp:
            raise ModelConfigError(f"{where}: {name} {model[name]} is not divisible by --tp {tp}")


def _ring_s(nbytes: float, tp: int, gpu: dict) -> float:
    """One ring all-gather or reduce-scatter of `nbytes` (the full tensor) over tp GPUs on NVLink."""
    if tp == 1:
        return 0.0
    return NVLINK_ALPHA_S + (tp - 1) / tp * nbytes / (gpu["nvlink_bytes_s"] * NVLINK_EFFICIENCY)


def published_profile(model_cfg: dict, tp: int, micro_batch: int | None = None,
                      gpu: str = "A100-80GB", p2p_link: str = "infiniband") -> Profile:
    """The Profile of one layer of `model_cfg` at TP `tp` from published figures (see module doc)."""
    if gpu not in GPUS:
        raise ModelConfigError(f"unknown GPU {gpu!r}; published figures exist for {sorted(GPUS)}")
    if p2p_link not in ("infiniband", "nvlink"):
        raise ModelConfigError(f"p2p_link must be 'infiniband' or 'nvlink', not {p2p_link!r}")
    model = normalize_model({k: v for k, v in model_cfg.items()})
    if micro_batch is not None:
        model["micro_batch_size"] = int(micro_batch)
    check_tp(model, tp)
    g = GPUS[gpu]
    s, b, h = model["seq_length"], model["micro_batch_size"], model["hidden_size"]
    a, groups, f = model["num_attention_heads"], model["num_query_groups"], model["ffn_hidden_size"]
    vocab, e = model["vocab_size"], DTYPE_BYTES[model["dtype"]]
    d = h // a
    sp = tp > 1 and bool(model["sequence_parallel"])
    sbh = s * b * h
    split = tp if sp else 1  # what layernorms, dropouts and residuals are divided by
    gemm_s_per_flop = 1.0 / (g["flops"] * MFU)
    mem_s_per_byte = 1.0 / (g["hbm_bytes_s"] * HBM_EFFICIENCY)
    hidden_bytes = e * sbh  # one full [s, b, h] tensor
    if sp:
        gather_s = _ring_s(hidden_bytes, tp, g)  # all-gather or reduce-scatter
        attn_out_comm_s = mlp_out_comm_s = gather_s
        qkv_comm_s = mlp_in_comm_s = gather_s
    else:
        qkv_comm_s = mlp_in_comm_s = 0.0
        attn_out_comm_s = mlp_out_comm_s = 2 * _ring_s(hidden_bytes, tp, g)  # all-reduce = RS + AG
    gelu_elems = 2 * s * b * f if model["swiglu"] else s * b * f  # fc1 output
    # (forward FLOPs, forward bytes moved, forward communication s, act bytes kept)
    mods = {
        "input_layernorm": (0.0, 2 * e * sbh / split, 0.0, e * sbh / split),
        "qkv": (2 * sbh * (h + 2 * groups * d) / tp, 0.0, qkv_comm_s,
                e * sbh / split + e * s * b * (h + 2 * groups * d) / tp),
        "core_attn": (4 * b * s * s * h / tp, (4 * e + 1) * a * s * s * b / tp, 0.0,
                      (2 * e + 1) * a * s * s * b / tp),
        "proj": (2 * sbh * h / tp, (3 * e + 1) * sbh / split, attn_out_comm_s,
                 e * sbh / tp + sbh / split + e * sbh / split),
        "pre_mlp_layernorm": (0.0, 2 * e * sbh / split, 0.0, e * sbh / split),
        "mlp": ((6 if model["swiglu"] else 4) * sbh * f / tp,
                2 * e * gelu_elems / tp + (3 * e + 1) * sbh / split, mlp_in_comm_s + mlp_out_comm_s,
                e * gelu_elems / tp + e * s * b * f / tp + sbh / split),
    }
    layer = [ModuleCost(name, fwd_s=flops * gemm_s_per_flop + moved * mem_s_per_byte + comm,
                        bwd_s=2 * flops * gemm_s_per_flop + 2 * moved * mem_s_per_byte + comm,
                        act_bytes=int(act))
             for name, (flops, moved, comm, act) in mods.items()]
    output_flops = 2 * sbh * vocab / tp
    logits_bytes = 4 * s * b * vocab / tp  # fp32 logits for the cross entropy
    ends = StageEnds(
        embedding_fwd_s=3 * e * sbh / split * mem_s_per_byte,
        embedding_bwd_s=3 * e * sbh / split * mem_s_per_byte,
        embedding_act_bytes=int(sbh / split),
        output_fwd_s=(output_flops * gemm_s_per_flop + 3 * logits_bytes * mem_s_per_byte
                      + (_ring_s(hidden_bytes, tp, g) if sp else 0.0)),
        output_bwd_s=(2 * output_flops * gemm_s_per_flop + 2 * logits_bytes * mem_s_per_byte
                      + (_ring_s(hidden_bytes, tp, g) if sp else 0.0)),
        output_act_bytes=int(e * sbh / split + e * sbh + logits_bytes),
    )
    boundary = int(e * sbh / (tp if sp else 1))
    if p2p_link == "infiniband":
        p2p = LinkCost(alpha_s=IB_ALPHA_S, bytes_per_s=g["ib_bytes_s"])
    else:
        p2p = LinkCost(alpha_s=NVLINK_P2P_ALPHA_S, bytes_per_s=g["nvlink_bytes_s"])
    allreduce = LinkCost(alpha_s=2 * NVLINK_ALPHA_S,
                         bytes_per_s=g["nvlink_bytes_s"] * NVLINK_EFFICIENCY / 2)
    notes = (f"published figures for {gpu}: {g['flops'] / 1e12:.0f} TFLOP/s dense bf16 peak x MFU "
             f"{MFU}; HBM {g['hbm_bytes_s'] / 1e12:.3f} TB/s x {HBM_EFFICIENCY}; NVLink "
             f"{g['nvlink_bytes_s'] / 1e9:.0f} GB/s per direction x {NVLINK_EFFICIENCY}, alpha "
             f"{NVLINK_ALPHA_S * 1e6:.0f} us; p2p over {p2p_link} "
             f"{p2p.bytes_per_s / 1e9:.0f} GB/s, alpha {p2p.alpha_s * 1e6:.0f} us; activation bytes "
             f"from Korthikanti et al. 2022 (arXiv 2205.05198) Table 2, "
             f"{'tensor+sequence' if sp else 'tensor'} parallel at tp={tp}; megatron's unfused "
             "(non-flash) core attention; see megatron_ucp/recompute/hardware.py")
    return Profile(device=f"{gpu} (published figures)", source="published", model=model, tp=tp,
                   layer=layer, layer_input_bytes=boundary, ends=ends, p2p=p2p,
                   tp_allreduce=allreduce, compute_slots=None, notes=notes)
