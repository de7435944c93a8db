"""What Llama, Qwen2, Qwen3, Mixtral and Qwen3-MoE share: RMSNorm, SwiGLU, rotary positions, no
LayerNorm biases, one name map for the embedding, attention and dense MLP, and one config.json
shape. Each of them is a subclass in its own module, which says what it changes.
"""

from __future__ import annotations

from megatron_ucp.formats.hf.archs._base import (
    Entry,
    HFArch,
    Refuse,
    Rule,
    check_common,
    check_defaults,
    check_whole_head_rotary,
    check_yarn_record,
    fail,
    features,
    fill,
    hf_rope,
    linear_rope_factor,
    refuse_hybrid,
    refuse_partial_rotary,
    require,
    yarn_args,
    yarn_rope,
)
from megatron_ucp.formats.tensor_transforms import Heads

GLOBAL: list[Entry] = [
    ("embedding.word_embeddings.weight", "copy", ("model.embed_tokens.weight",), ""),
    ("decoder.final_layernorm.weight", "copy", ("model.norm.weight",), ""),
    ("output_layer.weight", "copy", ("lm_head.weight",), "untied"),
]
ATTENTION: list[Entry] = [
    ("decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight", "copy",
     ("model.layers.{i}.input_layernorm.weight",), ""),
    ("decoder.layers.{i}.self_attention.linear_qkv.weight", "qkv",
     ("model.layers.{i}.self_attn.q_proj.weight", "model.layers.{i}.self_attn.k_proj.weight",
      "model.layers.{i}.self_attn.v_proj.weight"), ""),
    ("decoder.layers.{i}.self_attention.linear_qkv.bias", "qkv",
     ("model.layers.{i}.self_attn.q_proj.bias", "model.layers.{i}.self_attn.k_proj.bias",
      "model.layers.{i}.self_attn.v_proj.bias"), "qkv_bias"),
    ("decoder.layers.{i}.self_attention.linear_proj.weight", "copy",
     ("model.layers.{i}.self_attn.o_proj.weight",), ""),
    ("decoder.layers.{i}.self_attention.linear_proj.bias", "copy",
     ("model.layers.{i}.self_attn.o_proj.bias",), "linear_bias"),
    # the pre-MLP norm: fused into a dense MLP's fc1 (DENSE_MLP), its own module in a MoE layer
]
MOE_NORM: list[Entry] = [
    ("decoder.layers.{i}.pre_mlp_layernorm.weight", "copy",
     ("model.layers.{i}.post_attention_layernorm.weight",), ""),
]
DENSE_MLP: list[Entry] = [
    ("decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight", "copy",
     ("model.layers.{i}.post_attention_layernorm.weight",), ""),
    ("decoder.layers.{i}.mlp.linear_fc1.weight", "gate_up",
     ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"), ""),
    ("decoder.layers.{i}.mlp.linear_fc1.bias", "gate_up",
     ("model.layers.{i}.mlp.gate_proj.bias", "model.layers.{i}.mlp.up_proj.bias"), "linear_bias"),
    ("decoder.layers.{i}.mlp.linear_fc2.weight", "copy", ("model.layers.{i}.mlp.down_proj.weight",), ""),
    ("decoder.layers.{i}.mlp.linear_fc2.bias", "copy", ("model.layers.{i}.mlp.down_proj.bias",),
     "linear_bias"),
]


class LlamaLike(HFArch):
    """A rotary decoder: `layer` entries per layer, `expert` entries per expert of a MoE layer."""

    layer: list[Entry] = ATTENTION + DENSE_MLP
    expert: list[Entry] = []
    qk_norm = False  # RMSNorm over each head's q and k (megatron-core: qk_layernorm)
    # config.json's sliding_window alone turns on a window (Mixtral: no use_sliding_window flag)
    window_without_flag = False
    # config.json's sliding_window is megatron-core's window_size on every layer (Mistral)
    every_layer_window = False
    qkv_bias_always = False  # q/k/v biases whatever attention_bias says (Qwen2)
    moe_sibling = "mixtral"  # the architecture of this one's MoE models, named when refusing one

    def rules(self, cfg: dict) -> list[Rule]:
        feats = features(cfg)
        out = fill(GLOBAL, feats)
        experts = (cfg.get("num_moe_experts") or 0) if self.expert else 0
        for i in range(cfg["num_layers"]):
            out += fill(self.layer, feats, i=i)
            for e in range(experts):
                out += fill(self.expert, feats, i=i, e=e)
        return out

    # ------------------------------------------------------------------ export

    def check_exportable(self, cfg: dict, hints: dict) -> None:
        arch = self.name
        refuse_hybrid(arch, cfg)
        self.check_qk_norm(cfg)
        allowed = ("qk_layernorm",) if self.qk_norm else ()
        if self.every_layer_window:
            check_every_layer_window(arch, cfg)
            allowed += ("window_size",)
        check_common(arch, cfg, allowed=allowed)
        h = Heads.of(cfg)
        if h.heads % h.groups:
            raise fail(arch, "num_query_groups", h.groups, "does not divide num_attention_heads")
        check_rotary(arch, cfg, hints)
        feats = features(cfg)
        self.check_biases(cfg, feats)
        self.check_moe(cfg, feats)

    def check_qk_norm(self, cfg: dict) -> None:
        """Refuse a model with QK-norm where it is none (`check_common`), without it where it is."""

    def check_biases(self, cfg: dict, feats: set[str]) -> None:
        """Refuse the biases this architecture has no place for."""

    def check_moe(self, cfg: dict, feats: set[str]) -> None:
        """A dense architecture: refuse a MoE model, naming its MoE sibling."""
        if "moe" in feats:
            raise fail(self.name, "num_moe_experts", cfg.get("num_moe_experts"),
                       f"a MoE model is --arch {self.moe_sibling}")

    def config_fields(self, cfg: dict, *, rope_theta: float, hints: dict, tokens: dict) -> dict:
        h = Heads.of(cfg)
        out = {"hidden_size": cfg["hidden_size"], "num_hidden_layers": cfg["num_layers"],
               "num_attention_heads": h.heads, "num_key_value_heads": h.groups, "head_dim": h.head_dim,
               "intermediate_size": cfg.get("moe_ffn_hidden_size") or cfg["ffn_hidden_size"],
               "hidden_act": "silu", "max_position_embeddings": cfg.get("max_sequence_length"),
               "rms_norm_eps": cfg.get("layernorm_epsilon", 1e-5),
               "attention_dropout": cfg.get("attention_dropout", 0.0),
               "rope_parameters": rope_parameters(cfg, float(rope_theta), hints)}
        if out["max_position_embeddings"] is None:  # unknown: transformers' default, as the source's
            del out["max_position_embeddings"]
        return out

    # ------------------------------------------------------------------ import

    def args_of(self, d: dict, args: dict, refuse: Refuse, mtp_layers: int) -> tuple[dict, dict]:
        if d["hidden_act"] != "silu":
            raise refuse("hidden_act", "megatron-core's SwiGLU MLP uses silu")
        rope = hf_rope(d)
        theta = float(rope["rope_theta"])
        refuse_partial_rotary(d, refuse, f"transformers' {self.name} rotates whole heads: its "
                              "apply_rotary_pos_emb has no pass-through channels (its default RoPE "
                              "ignores the factor, its scaled ones fail on it), so megatron-core's "
                              "rotary_percent would compute another model")
        scaling = rope_args(d, rope, refuse)
        run = {"activation": "swiglu", "rotary_base": theta, **scaling}
        if self.every_layer_window:
            if d.get("sliding_window") is not None:
                window = d["sliding_window"]
                if isinstance(window, bool) or not isinstance(window, int) or window < 1:
                    raise refuse("sliding_window", "a window is a positive number of tokens (or null)")
                # transformers' window counts the token itself (kv > q - sliding_window),
                # megatron-core's window_size (w, 0) does not
                args["window_size"] = [window - 1, 0]
        elif d.get("use_sliding_window") or (self.window_without_flag and d.get("sliding_window")):
            raise refuse("sliding_window", "megatron-core's local attention has no sliding window")
        bias_attn, bias_mlp = bool(d.get("attention_bias")), bool(d.get("mlp_bias"))
        if self.qk_norm and bias_attn:
            raise refuse("attention_bias", f"HF {self.name} has no MLP biases; megatron-core's "
                         "add_bias_linear puts biases on every linear layer or none")
        if bias_attn != bias_mlp:
            raise refuse("attention_bias", f"with mlp_bias={bias_mlp}: megatron-core's "
                         "add_bias_linear puts biases on every linear layer or none")
        heads = d["num_attention_heads"]
        groups = d.get("num_key_value_heads") or heads
        if heads % groups:
            raise refuse("num_key_value_heads", f"does not divide num_attention_heads={heads}")
        args.update(num_layers=d["num_hidden_layers"], hidden_size=d["hidden_size"],
                    num_attention_heads=heads, group_query_attention=groups != heads,
                    num_query_groups=groups, ffn_hidden_size=d["intermediate_size"],
                    kv_channels=d.get("head_dim") or d["hidden_size"] // heads,
                    normalization="RMSNorm", layernorm_epsilon=d["rms_norm_eps"], swiglu=True,
                    add_bias_linear=bias_attn, add_qkv_bias=self.qkv_bias_always or bias_attn,
                    position_embedding_type="rope", rotary_base=theta,
                    max_position_embeddings=d["max_position_embeddings"],
                    attention_dropout=d.get("attention_dropout", 0.0))
        args.update(scaling)
        if self.qk_norm:
            args["qk_layernorm"] = True
        self.moe_args(d, args, refuse)
        return args, run

    def moe_args(self, d: dict, args: dict, refuse: Refuse) -> None:
        """A MoE architecture's settings in `args` (a dense one has none)."""


def check_every_layer_window(arch: str, cfg: dict) -> None:
    """A window_size megatron-core applies on every layer as transformers' sliding_window: (w, 0)."""
    window = cfg.get("window_size")
    if window is None:
        return
    if len(window) != 2 or window[1] != 0 or window[0] < 0:
        raise fail(arch, "window_size", window, f"HF {arch}'s sliding window looks back only, (w, 0) "
                   "with w >= 0")
    if cfg.get("window_attn_skip_freq") is not None:
        raise fail(arch, "window_attn_skip_freq", cfg["window_attn_skip_freq"], f"HF {arch} has the "
                   "sliding window on every layer")
    if cfg.get("chunk_attention_size") is not None:
        raise fail(arch, "chunk_attention_size", cfg["chunk_attention_size"], f"HF {arch} has no "
                   "chunked attention")


def check_rotary(arch: str, cfg: dict, hints: dict) -> None:
    """RMSNorm, SwiGLU, RoPE on whole heads: default, Llama 3 scaling (rope_scaling), linear
    (seq_len_interpolation_factor) or YaRN, one at a time (transformers' rope_parameters holds one)."""
    yarn = cfg.get("position_embedding_type") == "yarn"
    if yarn:
        check_yarn_record(arch, cfg)
    else:
        require(arch, cfg, "position_embedding_type", "rope", "HF {arch} uses rotary position embeddings")
    require(arch, cfg, "normalization", "RMSNorm", "HF {arch} uses RMSNorm")
    require(arch, cfg, "gated_linear_unit", True, "HF {arch} has a SwiGLU MLP (gate_proj/up_proj)")
    if cfg.get("rotary_interleaved", False):
        raise fail(arch, "rotary_interleaved", True, "HF rotates the two halves of each head")
    if hints.get("activation") not in (None, "swiglu"):
        raise fail(arch, "activation", hints["activation"], f"HF {arch} needs SwiGLU (silu)")
    check_whole_head_rotary(arch, cfg, hints)
    llama3, linear = hints.get("use_rope_scaling") or cfg.get("rope_scaling"), linear_rope_factor(cfg, hints)
    if linear is not None and (yarn or llama3):
        raise fail(arch, "seq_len_interpolation_factor", linear, "megatron-core's YaRN does not apply it"
                   if yarn else "megatron-core applies it on top of Llama 3 RoPE scaling, which "
                   "transformers' rope_parameters (one rope_type) cannot say")
    if llama3 and yarn:
        raise fail(arch, "rope_scaling", True, "megatron-core's YaRN does not apply Llama 3 RoPE scaling")
    if llama3 and not hints.get("rope_scaling_factor"):
        raise fail(arch, "rope_scaling", True, "Llama 3 RoPE scaling's factor is not recorded: export "
                   "from a Megatron-LM checkpoint (its --rope-scaling-factor) or an import-hf one")


def rope_parameters(cfg: dict, theta: float, hints: dict) -> dict:
    """transformers' rope_parameters of a GPTModel's RoPE (`check_rotary` passed)."""
    if cfg.get("position_embedding_type") == "yarn":
        return yarn_rope(cfg, theta)
    linear = linear_rope_factor(cfg, hints)
    if linear is not None:
        return {"rope_type": "linear", "rope_theta": theta, "factor": float(linear)}
    if hints.get("use_rope_scaling") or cfg.get("rope_scaling"):
        return {**LLAMA3_ROPE, "rope_type": "llama3", "rope_theta": theta,
                "factor": float(hints["rope_scaling_factor"])}
    return {"rope_type": "default", "rope_theta": theta}


# why megatron-core runs none of transformers' other RoPE kinds
NOT_IN_MEGATRON_CORE = {
    "dynamic": "megatron-core has no dynamic NTK scaling (transformers recomputes the rotary base "
               "for sequences past max_position_embeddings)",
    "longrope": "megatron-core has no LongRoPE (per-frequency short_factor / long_factor)",
}


def rope_args(d: dict, rope: dict, refuse: Refuse) -> dict:
    """The Megatron-LM args of a config's RoPE kind (`hf_rope`), also the import's run record:
    llama3: GPTModel's rope_scaling and its factor; linear: GPTModel's seq_len_interpolation_factor
    (megatron-core divides the positions by it, transformers the inverse frequencies: the same
    angles); yarn: GPTModel's YaRN (`yarn_args`). Any other kind is refused by name."""
    kind = rope["rope_type"]
    if kind == "default":
        return {}
    if kind == "llama3":  # Llama 3.1-3.3
        return {"use_rope_scaling": True, "rope_scaling_factor": llama3_factor(rope, refuse)}
    if kind == "linear":
        factor = rope.get("factor")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
            raise refuse("rope_parameters.factor", "linear RoPE scaling divides the positions by a "
                         "positive factor")
        return {"rotary_seq_len_interpolation_factor": float(factor)}
    if kind == "yarn":
        return yarn_args(d, rope, refuse)
    why = NOT_IN_MEGATRON_CORE.get(kind, "megatron-core's GPTModel has no such RoPE")
    raise refuse("rope_parameters.rope_type", f"{kind!r} RoPE scaling is not imported: {why} "
                 "(imported: default, llama3, linear, yarn)")


# megatron-core's Llama 3 RoPE scaling (RotaryEmbedding._apply_scaling) fixes these three
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def llama3_factor(rope: dict, refuse: Refuse) -> float:
    """The factor of a config's llama3 RoPE scaling (`hf_rope`: transformers 5's rope_parameters
    or 4's rope_scaling), refused by field where megatron-core's fixed settings differ."""
    for k, fixed in LLAMA3_ROPE.items():
        if float(rope.get(k, fixed)) != fixed:
            raise refuse(f"rope_parameters.{k}", f"megatron-core's Llama 3 RoPE scaling has {k}={fixed:g} "
                         "fixed (RotaryEmbedding._apply_scaling)")
    if rope.get("attention_factor") not in (None, 1.0):
        raise refuse("rope_parameters.attention_factor", "megatron-core's Llama 3 RoPE scaling does "
                     "not scale cos/sin")
    return float(rope.get("factor", 8.0))


def check_softmax_moe(arch: str, name: str, cfg: dict, feats: set[str], dense: str,
                      extra: tuple[tuple[str, object, str], ...] = ()) -> None:
    """Mixtral's and Qwen3-MoE's MoE: no biases, softmax top-k routing in every layer, no shared
    or grouped experts. `name`: the model's name in messages; `dense`: its dense sibling arch."""
    if feats & {"qkv_bias", "linear_bias"}:
        raise fail(arch, "add_bias_linear" if "linear_bias" in feats else "add_qkv_bias", True,
                   f"{name} has no biases")
    if "moe" not in feats:
        raise fail(arch, "num_moe_experts", cfg.get("num_moe_experts"), f"{name} is a MoE model; "
                   f"a dense model is --arch {dense}")
    check_defaults(arch, cfg, [
        ("moe_router_score_function", "softmax", f"{name}'s router scores are a softmax"),
        ("moe_router_topk_scaling_factor", None, f"{name} does not scale routing weights"),
        ("moe_router_enable_expert_bias", False, f"{name}'s router has no expert bias"),
        ("moe_shared_expert_intermediate_size", None, f"{name} has no shared experts"),
        ("moe_router_num_groups", None, f"{name} routes without expert groups"),
        ("moe_layer_freq", 1, f"every {name} layer is a MoE layer"), *extra])
