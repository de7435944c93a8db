"""Independent assemblies of the files every megatron-ucp writer and reader handles.

Nothing here goes through megatron_ucp's readers, writers or layout code (the format modules'
key names, state names, flat offsets, stacking or q/k/v orders): files are opened with
safetensors, torch.load and torch.distributed.checkpoint's own FileSystemReader, and sliced with
the rules Megatron-LM's files follow, written out by hand (tests/fixtures/megatron_lm/README.md and
the shared fixtures' README: parameters in reverse state-dict order, starts aligned to 64
elements, a tied embedding in a bucket of its own at PP > 1, TP shards concatenated along the
known dim, SwiGLU gate halves then up halves). So a bug shared by a format's reader and writer
(both wrong the same way, so every round trip agrees) shows here as a value in the wrong place.

Writer tests: read what the writer wrote with these functions and compare with the universal
tensors it was given (`universal_tensors`). Reader tests: the same functions on the source.
"""

from __future__ import annotations

import io
import itertools
import json
import math
import re
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint import FileSystemReader

STATES = ("param", "exp_avg", "exp_avg_sq")
COLUMN = ("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "linear_qkv.bias",
          "linear_fc1.weight", "linear_fc1.bias",
          "core_attention.softmax_offset")  # split on dim 0 over TP (the sinks: one per head)
ROW = ("linear_proj.weight", "linear_fc2.weight")  # split on dim 1
WORD = "embedding.word_embeddings.weight"


def load(path: Path):
    return torch.load(path, map_location="cpu", weights_only=False)


# ------------------------------------------------------------------------------------ universal


def universal_tensors(udir: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """manifest.json and {"<param>/<state>": tensor}, read with safetensors directly."""
    manifest = json.loads((Path(udir) / "manifest.json").read_text())
    tensors = {}
    for name, p in manifest["params"].items():
        for state, e in p["tensors"].items():
            with safe_open(str(Path(udir) / e["file"]), "pt") as f:
                tensors[f"{name}/{state}"] = f.get_tensor(e["key"])
    return manifest, tensors


def assert_holds_universal(full: dict[str, dict], udir: Path, model_dtype: torch.dtype | None,
                           states: tuple[str, ...] = STATES, step: float | None = None) -> int:
    """`full` (name -> {"model": training-dtype weight, state: fp32 tensor, "step"}) assembled
    from a written checkpoint holds exactly the universal tensors of `udir` it was written from:
    the same parameters, every state bitwise, the model weight the master cast to `model_dtype`.
    Returns the number of tensors compared."""
    manifest, tensors = universal_tensors(udir)
    assert set(full) == set(manifest["params"]), sorted(set(full) ^ set(manifest["params"]))
    n = 0
    for name, got in full.items():
        # a persistent buffer (MoE expert_bias) carries its value only, in its own dtype
        buffer = manifest["params"][name].get("buffer", False)
        for s in ("param",) if buffer else states:
            want = tensors[f"{name}/{s}"]
            assert got[s].dtype == want.dtype and got[s].shape == want.shape, (name, s)
            assert torch.equal(got[s], want), f"{name}/{s} differs from the universal tensor"
            n += 1
        if model_dtype is not None:
            dtype = got["model"].dtype if buffer else model_dtype
            assert torch.equal(got["model"], tensors[f"{name}/param"].to(dtype)), f"{name} model"
        if step is not None and "step" in got:
            assert got["step"] == step == manifest["params"][name]["step"], name
    return n


# -------------------------------------------------------------------- flat DistributedOptimizer


def buckets(names_numels: list[tuple[str, int]], own_bucket: set[str]) -> list[list[tuple[str, int, int]]]:
    """megatron-core DDP's buckets of one buffer: [[(name, start in the bucket, numel)]...].
    Parameters in reverse order, each start rounded up to 64 elements; a name in `own_bucket`
    (the tied embedding / output layer at PP > 1) gets a bucket of its own."""
    out: list[list] = [[]]
    rel = 0
    for name, numel in reversed(names_numels):
        if name in own_bucket and out[-1]:
            out.append([])
            rel = 0
        rel = -(-rel // 64) * 64
        out[-1].append((name, rel, numel))
        rel += numel
        if name in own_bucket:
            out.append([])
            rel = 0
    return [b for b in out if b]


def flat_layout(names_numels: list[tuple[str, int]], own_bucket: set[str]) -> tuple[dict, int]:
    """name -> start in a legacy distrib_optim.pt tensor (the buckets one after another, each
    without its end padding), and that tensor's length."""
    starts, base = {}, 0
    for bucket in buckets(names_numels, own_bucket):
        for name, start, _ in bucket:
            starts[name] = base + start
        last_name, last_start, last_numel = bucket[-1]
        base += last_start + last_numel
    return starts, base


def full_tensor(name: str, copies: list[tuple[int, torch.Tensor]], swiglu: bool) -> torch.Tensor:
    """Concatenate TP shards along the known dim; replicated copies must all be equal."""
    by_tp: dict[int, torch.Tensor] = {}
    for tp, t in copies:
        if tp in by_tp:
            assert torch.equal(by_tp[tp], t), f"{name}: replicated copies differ"
        by_tp[tp] = t
    shards = [by_tp[r] for r in sorted(by_tp)]
    if len(shards) == 1:
        return shards[0]
    if name.endswith(ROW):
        return torch.cat(shards, dim=1)
    if name.endswith(COLUMN):
        if swiglu and "linear_fc1" in name:
            halves = [s.chunk(2, dim=0) for s in shards]
            return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        return torch.cat(shards, dim=0)
    for s in shards[1:]:
        assert torch.equal(s, shards[0]), f"{name}: TP-replicated copies differ"
    return shards[0]


def layer_offset(args, pp: int, chunk: int) -> int:
    """Global index of the first layer of pipeline stage `pp`, virtual chunk `chunk`."""
    if args.virtual_pipeline_model_parallel_size:
        per_virtual = args.num_layers // (args.pipeline_model_parallel_size
                                          * args.virtual_pipeline_model_parallel_size)
        return chunk * args.num_layers // args.virtual_pipeline_model_parallel_size + pp * per_virtual
    first = args.decoder_first_pipeline_num_layers
    if first:
        rest = (args.num_layers - first) // max(args.pipeline_model_parallel_size - 1, 1)
        return 0 if pp == 0 else first + (pp - 1) * rest
    return pp * args.num_layers // args.pipeline_model_parallel_size


# --------------------------------------------------------------- Megatron-LM --ckpt-format torch


def universal_name(local: str, layer_offset: int, expert_offset: int, moe: bool = False) -> str:
    """moe: the layer is a MoE layer, whose pre-MLP norm keeps its name (Transformer Engine's)."""
    m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", local)
    if not m:
        return local
    layer, rest = int(m.group(1)) + layer_offset, m.group(2)
    rest = re.sub(r"^input_layernorm\.(weight|bias)$", r"self_attention.linear_qkv.layer_norm_\1", rest)
    if not moe:
        rest = re.sub(r"^pre_mlp_layernorm\.(weight|bias)$", r"mlp.linear_fc1.layer_norm_\1", rest)
    e = re.fullmatch(r"mlp\.experts\.local_experts\.(\d+)\.(.+)", rest)
    if e:
        rest = f"mlp.experts.experts.{int(e.group(1)) + expert_offset}.{e.group(2)}"
    return f"decoder.layers.{layer}.{rest}"


def split_grouped(sd: dict[str, torch.Tensor], experts: int) -> dict[str, torch.Tensor]:
    """GroupedMLP's fused `mlp.experts.weight1`/`weight2` as SequentialMLP's per-expert local
    tensors: GroupedMLP computes with weight1.view(experts, hidden, -1) and
    weight2.view(experts, -1, hidden), each expert's matrix transposed to Linear's [out, in]."""
    out = {}
    for k, t in sd.items():
        m = re.fullmatch(r"(.*\.mlp\.experts\.)weight([12])", k)
        if not m:
            out[k] = t
            continue
        hidden = t.shape[0] if m.group(2) == "1" else t.shape[1]
        views = t.reshape(experts, hidden, -1) if m.group(2) == "1" else t.reshape(experts, -1, hidden)
        for j, v in enumerate(views):
            out[f"{m.group(1)}local_experts.{j}.linear_fc{m.group(2)}.weight"] = v.t()
    return out


def legacy_iteration(ckpt: Path) -> Path:
    it = int((Path(ckpt) / "latest_checkpointed_iteration.txt").read_text())
    return Path(ckpt) / f"iter_{it:07d}"


def legacy_reference(ckpt: Path) -> dict[str, dict]:
    """Universal name -> {"weight": [(tp, model tensor)...], state: [(tp, fp32 tensor)...],
    "step": {steps}} of a `--ckpt-format torch` save (distributed optimizer)."""
    out: dict[str, dict] = {}
    for rank_dir in sorted(legacy_iteration(ckpt).iterdir()):
        m, optim = load(rank_dir / "model_optim_rng.pt"), load(rank_dir / "distrib_optim.pt")
        args = m["args"]
        pp_size, ep_size = args.pipeline_model_parallel_size, args.expert_model_parallel_size
        parts = [int(x) for x in rank_dir.name.split("_")[2:]]
        tp = parts[0]
        pp = parts[1] if pp_size > 1 else 0
        ep = parts[-1] if ep_size > 1 else 0
        entries = optim if isinstance(optim, list) else [optim]
        chunk_keys = sorted(k for k in m if re.fullmatch(r"model\d*", k))
        tied = not args.untie_embeddings_and_output_weights
        opt = m["optimizer"]
        opts = opt if isinstance(opt, list) else [opt]  # a list: the chained dense + expert optimizers
        groups = [g for o in opts for g in o["optimizer"]["param_groups"]]
        steps = {g["step"] for g in groups}
        for c, key in enumerate(chunk_keys):
            sd = {k: v for k, v in m[key].items() if torch.is_tensor(v)}
            own = ({WORD, "output_layer.weight"} & set(sd) if tied and pp_size > 1 else set())
            slices: dict[str, dict] = {}
            for e, entry in enumerate(entries):
                if entry is None:
                    continue
                # a second entry: the expert optimizer (EP > 1); at EP1 the experts share the
                # dense optimizer's buffer
                names = [(k, v.numel()) for k, v in sd.items()
                         if len(entries) == 1 or ("experts" in k) == (e == 1)]
                starts, total = flat_layout(names, own)
                (flat,) = entry[c].values()  # one (param dtype, grad dtype) buffer per chunk
                assert flat["numel_unpadded"] == total == flat["param"].numel(), rank_dir
                assert set(flat) == {"numel_unpadded", *STATES}, (rank_dir, sorted(flat))
                for name, numel in names:
                    s = starts[name]
                    slices[name] = {st: flat[st][s:s + numel].view(sd[name].shape) for st in STATES}
            experts_per_rank = (args.num_experts or 0) // ep_size
            if experts_per_rank:
                sd = split_grouped(sd, experts_per_rank)
                split = {}
                for local, states in slices.items():
                    per_state = {st: split_grouped({local: t}, experts_per_rank) for st, t in states.items()}
                    for k in per_state[STATES[0]]:
                        split[k] = {st: per_state[st][k] for st in STATES}
                slices = split
            for local, weight in sd.items():
                if local == "output_layer.weight" and tied:
                    name = WORD  # the same tensor (full_tensor checks the copies agree)
                else:
                    head = local.split("pre_mlp_layernorm.")[0]
                    name = universal_name(local, layer_offset(args, pp, c), ep * experts_per_rank,
                                          moe=f"{head}mlp.linear_fc1.weight" not in sd)
                d = out.setdefault(name, {"weight": [], "step": set()})
                d["weight"].append((tp, weight))
                d["step"] |= steps
                for st, t in slices.get(local, {}).items():
                    d.setdefault(st, []).append((tp, t))
    return out


def gated(args) -> bool:
    """Whether linear_fc1 holds gate rows then up rows on each TP rank (SwiGLU, GPT-OSS's
    quick GEGLU)."""
    return bool(args.swiglu or getattr(args, "quick_geglu", False))


def legacy_full(ckpt: Path) -> dict[str, dict]:
    """Universal name -> {"model": full training-dtype weight, state: full fp32 tensor, "step"}
    of a `--ckpt-format torch` save, assembled by hand."""
    args = load(next(legacy_iteration(ckpt).iterdir()) / "model_optim_rng.pt")["args"]
    out = {}
    for name, copies in legacy_reference(ckpt).items():
        (step,) = copies["step"]
        out[name] = {"model": full_tensor(name, copies["weight"], gated(args)), "step": step,
                     **{s: full_tensor(name, copies[s], gated(args)) for s in STATES}}
    return out


# ---------------------------------------------------------- Megatron-LM --ckpt-format torch_dist


def dist_iteration(ckpt: Path) -> Path:
    ckpt = Path(ckpt)
    if (ckpt / ".metadata").exists():
        return ckpt
    it = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    return ckpt / f"iter_{it:07d}"


def load_keys(ckpt: Path, keys: list[str]) -> dict:
    """Read the named tensors/objects of a torch_dist directory without a process group."""
    ckpt = dist_iteration(ckpt)
    meta = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    sd = {k: torch.empty(tuple(meta[k].size), dtype=meta[k].properties.dtype)
          if hasattr(meta[k], "size") else io.BytesIO() for k in keys}
    dcp.load(sd, checkpoint_id=str(ckpt), no_dist=True)
    return sd


def dist_common(ckpt: Path) -> dict:
    """The common state of a torch_dist save: `common.pt` (megatron-core <= 0.18), else the pickled
    object `common_state/shard_0_1` in the .distcp files (0.19: a one-element list)."""
    it = dist_iteration(ckpt)
    if (it / "common.pt").exists():
        return load(it / "common.pt")
    (common,) = load_keys(it, ["common_state/shard_0_1"])["common_state/shard_0_1"]
    return common


def tensor_keys(ckpt: Path) -> dict[str, tuple[int, ...]]:
    meta = FileSystemReader(str(dist_iteration(ckpt))).read_metadata().state_dict_metadata
    return {k: tuple(v.size) for k, v in meta.items() if hasattr(v, "size")}


def model_key(name: str, stacked_layers: bool = True) -> tuple[str, tuple[int, ...]]:
    """'decoder.layers.1.x.weight' -> ('decoder.layers.x.weight', (1,)); experts stacked too:
    'decoder.layers.1.mlp.experts.experts.3.w' -> ('decoder.layers.mlp.experts.experts.w', (1, 3)).
    stacked_layers=False: a model whose layers differ (first layers dense, then MoE) keeps the
    global layer number in the key, 'decoder.layers.1.mlp.experts.experts.w' (3,)."""
    m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
    if not m:
        return name, ()
    rest, index = m.group(2), (int(m.group(1)),)
    e = re.fullmatch(r"(mlp\.experts\.experts)\.(\d+)\.(.+)", rest)
    if e:
        rest, index = f"{e.group(1)}.{e.group(3)}", (*index, int(e.group(2)))
    if not stacked_layers:
        return f"decoder.layers.{index[0]}.{rest}", index[1:]
    return f"decoder.layers.{rest}", index


def megatron_key(keyed: tuple[str, tuple[int, ...]], stored) -> tuple[str, tuple[int, ...]]:
    """The key Megatron-LM stored: the local GPT spec declares a MoE layer's pre-MLP norm under
    the fused name `mlp.linear_fc1.layer_norm_*`, which megatron-ucp calls `pre_mlp_layernorm.*`."""
    key, index = keyed
    alt = key.replace("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_")
    return (alt, index) if key not in stored and alt in stored else keyed


def fully_reshardable_full(ckpt: Path, names: list[str], buffers: tuple[str, ...] = (),
                           stacked_layers: bool = True) -> dict[str, dict]:
    """Universal name -> {"model", state...} from a fully_reshardable torch_dist checkpoint
    (`<model key>[stacked index]` and `optimizer.state.<state>.<model key>[stacked index]`).
    Also asserts that the checkpoint holds no tensor these names do not account for and that the
    names fill every stacked index. `buffers` (e.g. the MoE router's expert_bias) have no optimizer
    state: their "param" is the stored value in fp32. stacked_layers: see model_key."""
    stored = tensor_keys(ckpt)
    keyed = {n: megatron_key(model_key(n, stacked_layers), stored) for n in names}
    model_keys = sorted({k for k, _ in keyed.values()})
    buffer_keys = {keyed[n][0] for n in buffers}
    wanted = model_keys + [f"optimizer.state.{s}.{k}" for k in model_keys if k not in buffer_keys
                           for s in STATES]
    assert set(stored) == set(wanted), sorted(set(stored) ^ set(wanted))
    for k in model_keys:
        indices = {i for key, i in keyed.values() if key == k}
        assert len(indices) == math.prod(stored[k][:len(next(iter(indices)))]), k
    t = load_keys(ckpt, wanted)
    return {n: {"model": t[k][i], "param": t[k][i].float()} if n in buffers else
            {"model": t[k][i], **{s: t[f"optimizer.state.{s}.{k}"][i] for s in STATES}}
            for n, (k, i) in keyed.items()}


def raw_chunks(ckpt: Path) -> dict[str, list[tuple[tuple[int, ...], torch.Tensor]]]:
    """Tensor key -> [(chunk offsets, chunk)] of a torch_dist directory, read by hand: `.metadata`
    unpickled, each chunk's bytes (file, offset, length from its storage_data) torch.load'ed on
    their own; no torch.distributed.checkpoint reader or planner, no resharding."""
    import pickle

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    ckpt = dist_iteration(ckpt)
    with open(ckpt / ".metadata", "rb") as f:
        meta = pickle.load(f)
    out: dict[str, list] = {}
    for index, info in meta.storage_data.items():
        if not isinstance(meta.state_dict_metadata[index.fqn], TensorStorageMetadata):
            continue
        assert not getattr(info, "transform_descriptors", None), index  # plain torch.save chunks
        with open(ckpt / info.relative_path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        out.setdefault(index.fqn, []).append(
            (tuple(index.offset), torch.load(io.BytesIO(data), weights_only=True)))
    return out


def flattened_full(ckpt: Path, names: list[str]) -> dict[str, dict]:
    """Universal name -> {"model", state...} from a megatron-core 0.13-0.15 torch_dist checkpoint
    whose optimizer is `fully_sharded_model_space` (ShardedTensors with a flattened_range).

    Rule (megatron-core 0.15 dist_checkpointing/strategies/torch.py): the state of model tensor
    `<key>` ([layers..., *shape]) is `optimizer.state.<fp32_param|exp_avg|exp_avg_sq>.<key>` of shape
    [layers..., *chunks per axis, chunk numel], where the chunk is the TP-local tensor (split on
    the COLUMN/ROW dim, `tp_local`); each DP rank saved a contiguous range of that flattened chunk
    at offset [layer..., chunk index..., range start]. Here the ranges are read one by one
    (`raw_chunks`), must tile each chunk exactly, and are put at the chunk's TP place."""
    args = load(dist_iteration(ckpt) / "common.pt")["args"]
    tp = args.tensor_model_parallel_size
    stored = tensor_keys(ckpt)
    keyed = {n: megatron_key(model_key(n), stored) for n in names}
    model_keys = sorted({k for k, _ in keyed.values()})
    opt_keys = {(s, k): f"optimizer.state.{'fp32_param' if s == 'param' else s}.{k}"
                for k in model_keys for s in STATES}
    assert set(stored) == set(model_keys) | set(opt_keys.values()), \
        sorted(set(stored) ^ (set(model_keys) | set(opt_keys.values())))
    chunks = raw_chunks(ckpt)
    model = load_keys(ckpt, model_keys)
    out = {}
    for n, (k, index) in keyed.items():
        shape = stored[k][len(index):]
        local = tp_local(n, shape, tp)
        grid = tuple(s // c for s, c in zip(shape, local))
        entry = {"model": model[k][index]}
        for s in STATES:
            key = opt_keys[(s, k)]
            assert stored[key] == (*stored[k][:len(index)], *grid, math.prod(local)), (key, stored[key])
            ranges: dict[tuple, list] = {}
            for offset, t in chunks[key]:
                if offset[:len(index)] == index:
                    ranges.setdefault(offset[len(index):-1], []).append((offset[-1], t.reshape(-1)))
            full = torch.empty(shape, dtype=torch.float32)
            for at in itertools.product(*(range(g) for g in grid)):
                parts = sorted(ranges.pop(at), key=lambda p: p[0])
                starts = [0] + list(itertools.accumulate(t.numel() for _, t in parts))
                assert [o for o, _ in parts] == starts[:-1] and starts[-1] == math.prod(local), (key, at)
                box = tuple(slice(i * c, (i + 1) * c) for i, c in zip(at, local))
                full[box] = torch.cat([t for _, t in parts]).view(local)
            assert not ranges, (key, sorted(ranges))
            entry[s] = full
        out[n] = entry
    return out


# one dense GPT layer's parameters in the legacy state-dict order (linear_proj is registered
# before linear_qkv)
LAYER = ("self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.layer_norm_bias",
         "self_attention.core_attention.softmax_offset",  # learnable sinks (softmax_type learnable)
         "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
         "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
         "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight",  # QK-norm
         "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.layer_norm_bias",
         "mlp.linear_fc1.weight", "mlp.linear_fc1.bias",
         "mlp.linear_fc2.weight", "mlp.linear_fc2.bias")


def stage_order(args, pp: int, shapes: dict[str, tuple]) -> list[str]:
    """Universal names of a dense GPT's pipeline stage `pp` in state-dict order (the last stage's
    tied output layer as `output_layer.weight`), those `shapes` (universal shapes) has."""
    first, last = pp == 0, pp == args.pipeline_model_parallel_size - 1
    lo = layer_offset(args, pp, 0)
    hi = args.num_layers if last else layer_offset(args, pp + 1, 0)
    order = [WORD, "embedding.position_embeddings.weight"] if first else []
    order += [f"decoder.layers.{i}.{n}" for i in range(lo, hi) for n in LAYER]
    if last:
        order += ["decoder.final_layernorm.weight", "decoder.final_layernorm.bias"]
        if args.pipeline_model_parallel_size > 1 or args.untie_embeddings_and_output_weights:
            order.append("output_layer.weight")
    return [n for n in order if (WORD if n == "output_layer.weight" else n) in shapes]


def tp_local(name: str, shape: tuple, tp_size: int) -> tuple[int, ...]:
    axis = 0 if name.endswith(COLUMN) else 1 if name.endswith(ROW) else None
    return tuple(s // tp_size if d == axis else s for d, s in enumerate(shape))


def dp_reshardable_full(ckpt: Path, shapes: dict[str, tuple]) -> dict[str, dict]:
    """Universal name -> {"model", state...} from a dp_reshardable torch_dist checkpoint of a
    dense GPT (PP, TP; no VPP, no experts): each model-parallel rank's (mp = pp * TP + tp) flat
    buckets `optimizer.distributed.dp_group_idx_<mp>.gbuf_idx_0.dtype_(<param>, torch.float32)
    .bucket_idx_<b>.<state>`, sliced with `buckets`; the model tensors stacked as in
    fully_reshardable."""
    args = dist_common(ckpt)["args"]
    assert not args.virtual_pipeline_model_parallel_size and not args.num_experts
    tp_size, pp_size = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    dtype = "torch.bfloat16" if args.bf16 else "torch.float16" if args.fp16 else "torch.float32"
    tied = not args.untie_embeddings_and_output_weights
    stored = tensor_keys(ckpt)
    copies: dict[str, dict[str, list]] = {}
    flat_keys = []
    for pp in range(pp_size):
        order = stage_order(args, pp, shapes)
        own = {WORD, "output_layer.weight"} & set(order) if tied and pp_size > 1 else set()
        for tp in range(tp_size):
            mp = pp * tp_size + tp
            local = {n: tp_local(n, shapes[WORD if n == "output_layer.weight" else n], tp_size)
                     for n in order}
            for b, bucket in enumerate(buckets([(n, math.prod(local[n])) for n in order], own)):
                prefix = (f"optimizer.distributed.dp_group_idx_{mp}.gbuf_idx_0.dtype_({dtype}, "
                          f"torch.float32).bucket_idx_{b}")
                flat = load_keys(ckpt, [f"{prefix}.{s}" for s in STATES])
                flat_keys += list(flat)
                for name, start, numel in bucket:
                    key = WORD if name == "output_layer.weight" and tied else name
                    for s in STATES:
                        assert start + numel <= flat[f"{prefix}.{s}"].numel(), (prefix, name)
                        piece = flat[f"{prefix}.{s}"][start:start + numel].view(local[name])
                        copies.setdefault(key, {}).setdefault(s, []).append((tp, piece))
    flats = {k for k in stored if k.startswith("optimizer.distributed.")}
    assert flats == set(flat_keys), sorted(flats ^ set(flat_keys))
    model = load_keys(ckpt, sorted({model_key(n)[0] for n in copies}))
    return {n: {"model": model[model_key(n)[0]][model_key(n)[1]],
                **{s: full_tensor(n, c[s], gated(args)) for s in STATES}} for n, c in copies.items()}


# ------------------------------------- Megatron-LM DeepSeek-V3 shape (MLA, MoE, MTP), TP1 EP1


# one layer's parameters (local spec, MLA attention, dense or MoE MLP) in registration order, as
# Megatron-LM's model state dict lists them; the router's expert_bias is a buffer (no optimizer
# state, in no flat buffer). `{e}`: each expert in turn.
MLA_MOE_LAYER = ("input_layernorm.weight", "self_attention.linear_proj.weight",
                 "self_attention.linear_q_proj.weight", "self_attention.linear_q_down_proj.weight",
                 "self_attention.linear_q_up_proj.weight", "self_attention.linear_kv_down_proj.weight",
                 "self_attention.linear_kv_up_proj.weight", "self_attention.q_layernorm.weight",
                 "self_attention.kv_layernorm.weight", "pre_mlp_layernorm.weight",
                 "mlp.linear_fc1.weight", "mlp.linear_fc2.weight", "mlp.router.weight",
                 "mlp.router.expert_bias", "mlp.experts.experts.{e}.linear_fc1.weight",
                 "mlp.experts.experts.{e}.linear_fc2.weight", "mlp.shared_experts.linear_fc1.weight",
                 "mlp.shared_experts.linear_fc2.weight")
EXPERT_BIAS = "mlp.router.expert_bias"


def mla_moe_universal(layer_rest: str, dense_mlp: bool) -> str:
    """A layer's local parameter name (after `decoder.layers.<i>.` / `transformer_layer.`) ->
    its universal name, which is the TE spec's: MLA's q/kv latent norms are fused into the up
    projections, a dense MLP's pre-MLP norm into linear_fc1; MLA's input norm and a MoE layer's
    pre-MLP norm stay separate modules there too."""
    fused = {"self_attention.q_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
             "self_attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight"}
    if dense_mlp:
        fused["pre_mlp_layernorm.weight"] = "mlp.linear_fc1.layer_norm_weight"
    layer_rest = re.sub(r"^mlp\.experts\.local_experts\.", "mlp.experts.experts.", layer_rest)
    return fused.get(layer_rest, layer_rest)


def _stage_layers(args, pp: int) -> range:
    """Global layers of pipeline stage `pp` (uneven first or last stage; no VPP)."""
    n, size = args.num_layers, args.pipeline_model_parallel_size
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    if size == 1:
        return range(n)
    if first:
        rest = (n - first) // (size - 1)
        return range(0, first) if pp == 0 else range(first + (pp - 1) * rest, first + pp * rest)
    if last:
        rest = (n - last) // (size - 1)
        return range(n - last, n) if pp == size - 1 else range(pp * rest, (pp + 1) * rest)
    return range(pp * n // size, (pp + 1) * n // size)


def _layer_order(present: set[str], experts: int) -> list[str]:
    """The names of `present` (local, one layer) in registration order."""
    order: list[str] = []
    for n in MLA_MOE_LAYER:
        if "{e}" not in n:
            order.append(n)
        elif n.endswith("linear_fc1.weight"):  # expert by expert: its fc1, then its fc2
            order += [w.format(e=e) for e in range(experts) for w in (n, n.replace("fc1", "fc2"))]
    assert present <= set(order), sorted(present - set(order))
    return [n for n in order if n in present]


def _mla_moe_stage(args, pp: int, layer_names: dict[int, set[str]], mtp_names: set[str]) -> list[
        tuple[str, str]]:
    """(local name in the stage's state dict, universal name) of stage `pp`'s parameters and
    buffers in registration order: the word embedding (first stage, and the MTP stage's copy),
    its layers, then on the last stage the final norm, the MTP layer(s) (enorm, hnorm, eh_proj,
    the transformer layer, final norm) and the output layer."""
    last = pp == args.pipeline_model_parallel_size - 1
    mtp = bool(getattr(args, "mtp_num_layers", None)) and last
    experts = args.num_experts or 0
    out = [(WORD, WORD)] if pp == 0 or mtp else []
    layers = _stage_layers(args, pp)
    for local, g in enumerate(layers):
        dense = "mlp.linear_fc1.weight" in layer_names[g]
        out += [(f"decoder.layers.{local}.{n}", f"decoder.layers.{g}.{mla_moe_universal(n, dense)}")
                for n in _layer_order(layer_names[g], experts)]
    if last:
        out.append(("decoder.final_layernorm.weight", "decoder.final_layernorm.weight"))
        if mtp:
            inner = {n.removeprefix("mtp.layers.0.transformer_layer.") for n in mtp_names
                     if n.startswith("mtp.layers.0.transformer_layer.")}
            dense = "mlp.linear_fc1.weight" in inner
            out += [(f"mtp.layers.0.{n}", f"mtp.layers.0.{n}") for n in
                    ("enorm.weight", "hnorm.weight", "eh_proj.weight")]
            out += [(f"mtp.layers.0.mtp_model_layer.{n}",
                     f"mtp.layers.0.transformer_layer.{mla_moe_universal(n, dense)}")
                    for n in _layer_order(inner, experts)]
            out.append(("mtp.layers.0.final_layernorm.weight", "mtp.layers.0.final_layernorm.weight"))
        out.append(("output_layer.weight", "output_layer.weight"))
    return out


def _mla_moe_names(stored_model_keys: dict[str, tuple]) -> tuple[dict[int, set[str]], set[str]]:
    """Per global layer the local names its stored tensors stand for, and the MTP layer's names,
    from torch_dist model keys (layers not stacked: a first-k-dense model's layers differ;
    experts stacked on dim 0 of `mlp.experts.experts.<w>`)."""
    layers: dict[int, set[str]] = {}
    mtp: set[str] = set()
    for key, shape in stored_model_keys.items():
        m = re.fullmatch(r"(decoder\.layers\.(\d+)\.|mtp\.layers\.0\.transformer_layer\.)(.+)", key)
        if not m:
            if key.startswith("mtp."):
                mtp.add(key)
            continue
        rest = m.group(3)
        e = re.fullmatch(r"mlp\.experts\.experts\.(.+)", rest)
        names = {f"mlp.experts.experts.{i}.{e.group(1)}" for i in range(shape[0])} if e else {rest}
        if m.group(2) is None:
            mtp |= {f"mtp.layers.0.transformer_layer.{n}" for n in names}
        else:
            layers.setdefault(int(m.group(2)), set()).update(names)
    return layers, mtp


def _mla_moe_key(universal_local: str) -> tuple[str, tuple[int, ...]]:
    """torch_dist key and stacked index of a local name (global layer numbers; experts stacked)."""
    e = re.fullmatch(r"(.*\.mlp\.experts\.experts)\.(\d+)\.(.+)", universal_local)
    return (f"{e.group(1)}.{e.group(3)}", (int(e.group(2)),)) if e else (universal_local, ())


def mla_moe_dp_reshardable_full(ckpt: Path) -> dict[str, dict]:
    """Universal name -> {"model", state...} (a buffer: {"model", "param"}) of a dp_reshardable
    torch_dist save of the DeepSeek-V3 shape at TP1 EP1 (experts in the dense buffers; PP, DP
    any): stage pp's parameters in reverse registration order (`_mla_moe_stage`) cut into the
    buckets of `buckets` (at PP > 1 the word embedding, shared by the first and the MTP stage, in a
    bucket of its own), read from `optimizer.distributed.dp_group_idx_<pp>.gbuf_idx_0.dtype_(<param>,
    torch.float32).bucket_idx_<b>.<state>` (core_v0.19.0 stores the padded bucket)."""
    args = dist_common(ckpt)["args"]
    assert args.tensor_model_parallel_size == 1 and args.expert_model_parallel_size == 1
    assert not args.virtual_pipeline_model_parallel_size
    dtype = "torch.bfloat16" if args.bf16 else "torch.float32"
    stored = tensor_keys(ckpt)
    model_keys = {k: v for k, v in stored.items() if not k.startswith("optimizer.")}
    layers, mtp = _mla_moe_names(model_keys)
    used: set[str] = set()
    out: dict[str, dict] = {}
    flat_keys: list[str] = []
    model = load_keys(ckpt, sorted(model_keys))
    for pp in range(args.pipeline_model_parallel_size):
        stage = _mla_moe_stage(args, pp, layers, mtp)
        global_of = {}  # the local names of a stage -> torch_dist names (global layer numbers)
        for local, universal in stage:
            m = re.fullmatch(r"decoder\.layers\.\d+\.(.+)", local)
            g = re.fullmatch(r"decoder\.layers\.(\d+)\..+", universal)
            src = f"decoder.layers.{g.group(1)}.{m.group(1)}" if m else \
                local.replace(".mtp_model_layer.", ".transformer_layer.")
            global_of[local] = src
            key, index = _mla_moe_key(src)
            used.add(key)
            out.setdefault(universal, {"model": model[key][index]})
        universal_of = dict(stage)
        params = [(local, out[universal_of[local]]["model"].numel()) for local, _ in stage
                  if not local.endswith(EXPERT_BIAS)]
        own = {WORD} if args.pipeline_model_parallel_size > 1 else set()  # shared over stages
        for b, bucket in enumerate(buckets(params, own)):
            prefix = (f"optimizer.distributed.dp_group_idx_{pp}.gbuf_idx_0.dtype_({dtype}, "
                      f"torch.float32).bucket_idx_{b}")
            flat = load_keys(ckpt, [f"{prefix}.{s}" for s in STATES])
            flat_keys += list(flat)
            _, last_start, last_numel = bucket[-1]
            assert flat[f"{prefix}.param"].numel() >= last_start + last_numel, prefix  # (padded)
            for local, start, numel in bucket:
                entry = out[universal_of[local]]
                for s in STATES:
                    piece = flat[f"{prefix}.{s}"][start:start + numel].view(entry["model"].shape)
                    assert s not in entry or torch.equal(entry[s], piece), (local, s)  # a copy
                    entry[s] = piece
    assert used == set(model_keys), sorted(used ^ set(model_keys))
    flats = {k for k in stored if k.startswith("optimizer.distributed.")}
    assert flats == set(flat_keys), sorted(flats ^ set(flat_keys))
    for name, entry in out.items():
        if name.endswith(EXPERT_BIAS):
            entry["param"] = entry["model"].float()
    return out


def mla_moe_legacy_full(ckpt: Path) -> dict[str, dict]:
    """The same from a `--ckpt-format torch` save (TP1 EP1, any PP and DP): each stage's model
    state dict (its registration order, local layer numbers) and its `distrib_optim.pt` flat
    tensor (the buckets of `buckets` one after another)."""
    out: dict[str, dict] = {}
    for rank_dir in sorted(legacy_iteration(ckpt).iterdir()):
        m, optim = load(rank_dir / "model_optim_rng.pt"), load(rank_dir / "distrib_optim.pt")
        args = m["args"]
        assert args.tensor_model_parallel_size == 1 and args.expert_model_parallel_size == 1
        pp = int(rank_dir.name.split("_")[3]) if args.pipeline_model_parallel_size > 1 else 0
        sd = {k: v for k, v in m["model"].items() if torch.is_tensor(v)}
        layers: dict[int, set[str]] = {}
        mtp: set[str] = set()
        lo = _stage_layers(args, pp).start
        for k in sd:
            x = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", k)
            if x:
                layers.setdefault(int(x.group(1)) + lo, set()).add(
                    re.sub(r"^mlp\.experts\.local_experts\.", "mlp.experts.experts.", x.group(2)))
            elif k.startswith("mtp."):
                mtp.add(re.sub(r"\.mlp\.experts\.local_experts\.", ".mlp.experts.experts.",
                               k.replace(".mtp_model_layer.", ".transformer_layer.")))
        stage = _mla_moe_stage(args, pp, layers, mtp)
        state_dict_names = [re.sub(r"\.mlp\.experts\.local_experts\.", ".mlp.experts.experts.", k)
                            for k in sd]
        assert [local for local, _ in stage] == state_dict_names, rank_dir  # the order rule holds
        tensors = dict(zip(state_dict_names, sd.values()))
        params = [(n, tensors[n].numel()) for n, _ in stage if not n.endswith(EXPERT_BIAS)]
        # flat_layout, except that core_v0.19.0 closes the bucket before the shared embedding at
        # the embedding's 64-aligned start (`_compute_per_buffer_param_layout`), so that bucket's
        # unpadded length is aligned too
        starts, total = {}, 0
        cut = buckets(params, {WORD} if args.pipeline_model_parallel_size > 1 else set())
        for i, bucket in enumerate(cut):
            starts.update({n: total + start for n, start, _ in bucket})
            end = bucket[-1][1] + bucket[-1][2]
            total += -(-end // 64) * 64 if i + 1 < len(cut) and cut[i + 1][0][0] == WORD else end
        entries = optim if isinstance(optim, list) else [optim]
        assert len(entries) == 1 and entries[0]["buckets_coalesced"], rank_dir
        (flat,) = entries[0][0].values()
        assert flat["numel_unpadded"] == total == flat["param"].numel(), rank_dir
        (step,) = {g["step"] for g in m["optimizer"]["optimizer"]["param_groups"]}
        for local, universal in stage:
            t = tensors[local]
            entry = out.setdefault(universal, {"model": t, "step": step})
            assert torch.equal(entry["model"], t), universal  # the embedding's copies agree
            if local.endswith(EXPERT_BIAS):
                entry["param"] = t.float()
                continue
            for s in STATES:
                piece = flat[s][starts[local]:starts[local] + t.numel()].view(t.shape)
                assert s not in entry or torch.equal(entry[s], piece), (local, s)
                entry[s] = piece
    return out


# ------------------------------------------------------------------------------- loaded dumps


def local_to_universal(local: str, pp: int, first: int | None) -> str:
    """TP1 dump (megatron_ucp.testing.scenarios.dump_local_state): local name -> universal name
    (layer offset of an uneven pipeline stage of `first` layers; no experts)."""
    if local == "output_layer.weight":
        return WORD
    return universal_name(local, first if pp and first else 0, 0)


def assert_dumps_hold(dump_dir: Path, manifest: dict, tensors: dict, first: int | None,
                      ranks: int, step: float = 6.0) -> None:
    """Every TP1 rank's dumped model weight is the universal master cast to bf16, its optimizer
    range holds the universal values (at `step`), and the ranges cover every parameter once."""
    covered = dict.fromkeys(manifest["params"], 0)
    for rank in range(ranks):
        dump = load(Path(dump_dir) / f"rank{rank}.pt")
        pp = dump["coords"]["pp"]
        for e in dump["params"]:
            name = local_to_universal(e["name"], pp, first)
            assert torch.equal(e["model"], tensors[f"{name}/param"].to(torch.bfloat16)), name
            if e["range"] is not None:
                a, b = e["range"]
                assert e["step"] == step, name
                for s in STATES:
                    assert torch.equal(e[s], tensors[f"{name}/{s}"].reshape(-1)[a:b]), (name, s)
                if e["name"] != "output_layer.weight":  # the tied copy on the last stage
                    covered[name] += b - a
    assert covered == {n: math.prod(p["shape"]) for n, p in manifest["params"].items()}


def assert_universal_is_dump(udir: Path, dump_dir: Path, swiglu: bool = False) -> int:
    """A universal checkpoint of a megatron_ucp save holds, bitwise, the state the saving run
    dumped (tests/reference.py's hand assembly of the per-rank dumps): every parameter, its
    master weight, Adam moments and step. Returns the number of tensors compared."""
    from reference import STATES as DUMP_STATES
    from reference import assemble

    manifest, tensors = universal_tensors(udir)
    expected = {}
    for key, states in assemble(dump_dir, swiglu).items():
        if key == "output_layer.weight" and WORD in manifest["params"] and "output_layer.weight" \
                not in manifest["params"]:
            continue  # the tied copy on the last stage (the same tensor as the embedding)
        expected[universal_name(key, 0, 0)] = states
    assert set(expected) == set(manifest["params"]), sorted(set(expected) ^ set(manifest["params"]))
    n = 0
    for name, states in expected.items():
        assert manifest["params"][name]["step"] == states.get("step", 0.0), name
        for s in DUMP_STATES:
            if s not in states:  # a persistent buffer: no optimizer state
                continue
            assert torch.equal(tensors[f"{name}/{s}"], states[s]), f"{name}/{s}"
            n += 1
    return n


def dist_shapes(ckpt: Path) -> dict[str, tuple[int, ...]]:
    """Universal name -> shape of a dense torch_dist checkpoint's parameters, from its stacked
    model tensors (`decoder.layers.<key>` is [layers, ...])."""
    out = {}
    for key, shape in tensor_keys(ckpt).items():
        if key.startswith("optimizer."):
            continue
        if key.startswith("decoder.layers."):
            rest = key[len("decoder.layers."):]
            out.update({f"decoder.layers.{i}.{rest}": shape[1:] for i in range(shape[0])})
        else:
            out[key] = shape
    return out


# ------------------------------------ Megatron-LM --ckpt-format fsdp_dtensor / torch_dcp (FSDP)


def fsdp_dtensor_full(ckpt: Path) -> dict[str, dict]:
    """Universal name -> {"param", "exp_avg", "exp_avg_sq", "step"} of a bf16 Megatron-FSDP run's
    fsdp_dtensor save, read by hand: `model.module.<name>` (Float16Module's prefix) is the fp32
    main weight, `optimizer.state.module.module.module.<name>.<state>` (the FSDP adapter,
    MegatronFSDP, Float16Module) its Adam state. Asserts that the save holds no other tensors
    (its rng states aside)."""
    meta = tensor_keys(ckpt)
    opt = "optimizer.state.module.module.module."
    names = [k[len("model.module."):] for k in meta if k.startswith("model.module.")]
    wanted = {f"model.module.{n}" for n in names} | {
        f"{opt}{n}.{s}" for n in names for s in ("exp_avg", "exp_avg_sq", "step")}
    assert {k for k in meta if not k.startswith("rng_state.")} == wanted
    t = load_keys(ckpt, sorted(wanted))
    return {universal_name(n, 0, 0): {"param": t[f"model.module.{n}"],
                                      "exp_avg": t[f"{opt}{n}.exp_avg"],
                                      "exp_avg_sq": t[f"{opt}{n}.exp_avg_sq"],
                                      "step": float(t[f"{opt}{n}.step"])} for n in names}


# the parameters of the local-spec GPT layer in the model's registration order
GPT_LAYER = ("input_layernorm.weight", "input_layernorm.bias", "self_attention.linear_proj.weight",
             "self_attention.linear_proj.bias", "self_attention.linear_qkv.weight",
             "self_attention.linear_qkv.bias", "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias",
             "mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc2.weight",
             "mlp.linear_fc2.bias")


def torch_dcp_full(ckpt: Path, layers: int) -> dict[str, dict]:
    """Universal name -> {"model", "param", "exp_avg", "exp_avg_sq", "step"} of a bf16 torch
    FSDP2 run's torch_dcp save (dense GPT, untied output layer), read by hand. The optimizer
    state is addressed by position: Megatron-LM's param groups are (0) the parameters with weight
    decay, (1) the biases and 1-D parameters (no weight decay), each in the model's registration
    order (embeddings, layers, final norm, output layer); `optimizer.fp32_from_fp16_params.<g>.<i>`
    is the master weight of group g's i-th parameter, `optimizer.optimizer.state.<n>.*` the
    state of the n-th parameter counted over both groups. Asserts that the save holds no other
    tensors (its rng states aside)."""
    model = ["embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
             *[f"decoder.layers.{i}.{p}" for i in range(layers) for p in GPT_LAYER],
             "decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight"]
    meta = tensor_keys(ckpt)
    groups = [[n for n in model if len(meta[f"model.{n}"]) > 1 and not n.endswith(".bias")],
              [n for n in model if len(meta[f"model.{n}"]) == 1 or n.endswith(".bias")]]
    keys, n = {}, 0
    for g, names in enumerate(groups):
        for i, name in enumerate(names):
            keys[name] = {"model": f"model.{name}", "param": f"optimizer.fp32_from_fp16_params.{g}.{i}",
                          **{s: f"optimizer.optimizer.state.{n}.{s}"
                             for s in ("exp_avg", "exp_avg_sq", "step")}}
            n += 1
    wanted = {k for v in keys.values() for k in v.values()}
    assert {k for k in meta if not k.startswith("rng_state.")} == wanted
    t = load_keys(ckpt, sorted(wanted))
    return {universal_name(name, 0, 0): {s: float(t[k]) if s == "step" else t[k] for s, k in v.items()}
            for name, v in keys.items()}


# ----------------------------------------------------------------------------- Hugging Face


def split_qkv(t: torch.Tensor, heads: int, groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v rows of megatron's fused linear_qkv weight or bias: per query group g (in order)
    the rows of its heads // groups query heads, then its key head, then its value head."""
    per_group = heads // groups
    d = t.shape[0] // (groups * (per_group + 2))
    g = t.reshape(groups, (per_group + 2) * d, *t.shape[1:])
    flat = (-1, *t.shape[1:])
    return (g[:, :per_group * d].reshape(flat), g[:, per_group * d:(per_group + 1) * d].reshape(flat),
            g[:, (per_group + 1) * d:].reshape(flat))


def hf_expected(master: dict[str, torch.Tensor], arch: str, heads: int, groups: int, vocab: int,
                linear_key_heads: int = 0) -> dict[str, torch.Tensor]:
    """The tensors a transformers `arch` (llama, qwen2, mistral, mixtral, qwen3, qwen3_moe, gpt2,
    deepseek_v2, deepseek_v3, kimi_k2, glm4_moe, gpt_oss, nemotron_h or qwen3_next) checkpoint of the
    megatron-core GPT with full master weights `master` (universal names) holds, by the textbook
    correspondences:
    megatron's fused linear_qkv rows are per query group [q heads of the group; k; v] (head_dim
    rows each), SwiGLU's linear_fc1 is [gate; up], GPT-2's Conv1D stores [in, out], and the
    vocabulary rows beyond `vocab` are padding."""
    out = {}
    layers = sorted({int(n.split(".")[2]) for n in master if n.startswith("decoder.layers.")})

    def qkv(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return split_qkv(t, heads, groups)

    def have(name: str) -> bool:
        return name in master

    if arch in ("llama", "qwen2", "mistral", "mixtral", "qwen3", "qwen3_moe"):
        out["model.embed_tokens.weight"] = master[WORD][:vocab]
        out["model.norm.weight"] = master["decoder.final_layernorm.weight"]
        if have("output_layer.weight"):
            out["lm_head.weight"] = master["output_layer.weight"][:vocab]
        for i in layers:
            m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
            out[h + "input_layernorm.weight"] = master[m + "self_attention.linear_qkv.layer_norm_weight"]
            # a MoE layer keeps its own pre-MLP norm; a dense MLP's is fused into fc1
            norm = ("mlp.linear_fc1.layer_norm_weight" if have(m + "mlp.linear_fc1.weight")
                    else "pre_mlp_layernorm.weight")
            out[h + "post_attention_layernorm.weight"] = master[m + norm]
            for kind in ("weight", "bias"):
                if have(m + f"self_attention.linear_qkv.{kind}"):
                    q, k, v = qkv(master[m + f"self_attention.linear_qkv.{kind}"])
                    out.update({h + f"self_attn.q_proj.{kind}": q, h + f"self_attn.k_proj.{kind}": k,
                                h + f"self_attn.v_proj.{kind}": v})
                if have(m + f"mlp.linear_fc1.{kind}"):
                    gate, up = master[m + f"mlp.linear_fc1.{kind}"].chunk(2)
                    out.update({h + f"mlp.gate_proj.{kind}": gate, h + f"mlp.up_proj.{kind}": up})
                for mine, theirs in (("self_attention.linear_proj", "self_attn.o_proj"),
                                     ("mlp.linear_fc2", "mlp.down_proj")):
                    if have(m + f"{mine}.{kind}"):
                        out[h + f"{theirs}.{kind}"] = master[m + f"{mine}.{kind}"]
            for mine, theirs in (("q_layernorm", "q_norm"), ("k_layernorm", "k_norm")):  # Qwen3
                if have(m + f"self_attention.{mine}.weight"):
                    out[h + f"self_attn.{theirs}.weight"] = master[m + f"self_attention.{mine}.weight"]
            if have(m + "mlp.router.weight") and arch == "qwen3_moe":  # Hub layout: per expert
                out[h + "mlp.gate.weight"] = master[m + "mlp.router.weight"]
                experts = {int(n.split(".")[6]) for n in master if n.startswith(m + "mlp.experts.experts.")}
                for e in sorted(experts):
                    x, y = f"{m}mlp.experts.experts.{e}.", f"{h}mlp.experts.{e}."
                    out[y + "gate_proj.weight"], out[y + "up_proj.weight"] = \
                        master[x + "linear_fc1.weight"].chunk(2)
                    out[y + "down_proj.weight"] = master[x + "linear_fc2.weight"]
            elif have(m + "mlp.router.weight"):  # Mixtral: w1 gate, w3 up, w2 down per expert
                out[h + "block_sparse_moe.gate.weight"] = master[m + "mlp.router.weight"]
                experts = {int(n.split(".")[6]) for n in master if n.startswith(m + "mlp.experts.experts.")}
                for e in sorted(experts):
                    x, y = f"{m}mlp.experts.experts.{e}.", f"{h}block_sparse_moe.experts.{e}."
                    out[y + "w1.weight"], out[y + "w3.weight"] = master[x + "linear_fc1.weight"].chunk(2)
                    out[y + "w2.weight"] = master[x + "linear_fc2.weight"]
    elif arch == "gpt2":
        out["transformer.wte.weight"] = master[WORD][:vocab]
        out["transformer.wpe.weight"] = master["embedding.position_embeddings.weight"]
        out["transformer.ln_f.weight"] = master["decoder.final_layernorm.weight"]
        out["transformer.ln_f.bias"] = master["decoder.final_layernorm.bias"]
        if have("output_layer.weight"):
            out["lm_head.weight"] = master["output_layer.weight"][:vocab]
        for i in layers:
            m, h = f"decoder.layers.{i}.", f"transformer.h.{i}."
            for kind in ("weight", "bias"):
                out[h + f"ln_1.{kind}"] = master[m + f"self_attention.linear_qkv.layer_norm_{kind}"]
                out[h + f"ln_2.{kind}"] = master[m + f"mlp.linear_fc1.layer_norm_{kind}"]
            out[h + "attn.c_attn.weight"] = torch.cat(qkv(master[m + "self_attention.linear_qkv.weight"])).t()
            out[h + "attn.c_attn.bias"] = torch.cat(qkv(master[m + "self_attention.linear_qkv.bias"]))
            for mine, theirs in (("self_attention.linear_proj", "attn.c_proj"),
                                 ("mlp.linear_fc1", "mlp.c_fc"), ("mlp.linear_fc2", "mlp.c_proj")):
                out[h + f"{theirs}.weight"] = master[m + f"{mine}.weight"].t()
                out[h + f"{theirs}.bias"] = master[m + f"{mine}.bias"]
    elif arch in ("deepseek_v2", "deepseek_v3", "kimi_k2"):  # (DeepSeek-V3's tensors; V2: no expert bias)
        out.update(_deepseek_v3_expected(master, vocab, len(layers)))
    elif arch == "glm4_moe":
        out.update(_glm4_moe_expected(master, heads, groups, vocab, len(layers)))
    elif arch == "gpt_oss":
        out.update(_gpt_oss_expected(master, heads, groups, vocab, layers))
    elif arch == "nemotron_h":
        out.update(_nemotron_h_expected(master, heads, groups, vocab, layers))
    elif arch == "qwen3_next":
        out.update(_qwen3_next_expected(master, heads, groups, vocab, layers, linear_key_heads))
    else:
        raise ValueError(arch)
    return {k: v.contiguous() for k, v in out.items()}


def _glm4_moe_expected(master: dict[str, torch.Tensor], heads: int, groups: int, vocab: int,
                       layers: int) -> dict:
    """GLM-4.5's tensors: Llama's attention (linear_qkv per query group [q heads; k; v], weight
    and bias; o_proj without bias) with Qwen3's q_norm / k_norm, and DeepSeek-V3's MoE, dense MLP
    and MTP tensors (MTP layer k is decoder layer `layers + k`)."""
    attention = {k: v for k, v in master.items() if ".self_attention." in k}
    out = _deepseek_v3_expected({k: v for k, v in master.items() if k not in attention}, vocab, layers)
    for name, t in attention.items():
        parts = name.split(".")
        if parts[0] == "decoder":
            h, rest = f"model.layers.{parts[2]}.", parts[4:]
        else:  # mtp.layers.<k>.transformer_layer.self_attention.
            h, rest = f"model.layers.{layers + int(parts[2])}.", parts[5:]
        suffix = ".".join(rest)
        if suffix in ("linear_qkv.weight", "linear_qkv.bias"):
            kind = rest[1]
            q, k, v = split_qkv(t, heads, groups)
            out.update({h + f"self_attn.q_proj.{kind}": q, h + f"self_attn.k_proj.{kind}": k,
                        h + f"self_attn.v_proj.{kind}": v})
        else:
            out[h + {"linear_qkv.layer_norm_weight": "input_layernorm.weight",
                     "linear_proj.weight": "self_attn.o_proj.weight",
                     "q_layernorm.weight": "self_attn.q_norm.weight",
                     "k_layernorm.weight": "self_attn.k_norm.weight"}[suffix]] = t
    return out


# DeepSeek-V3: megatron-core's MLA / MoE names and DeepSeek's, one for one
_DSV3_NAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attn.q_a_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_experts.down_proj.weight",
    "enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
    "final_layernorm.weight": "shared_head.norm.weight",
}


def _deepseek_v3_expected(master: dict[str, torch.Tensor], vocab: int, layers: int) -> dict:
    """DeepSeek-V3's tensors: MTP layer k is decoder layer `layers + k` and repeats the embedding
    and output layer; SwiGLU fc1 rows are [gate; up]."""
    out = {"model.embed_tokens.weight": master[WORD][:vocab],
           "model.norm.weight": master["decoder.final_layernorm.weight"]}
    head = master.get("output_layer.weight", master[WORD])[:vocab]
    if "output_layer.weight" in master:
        out["lm_head.weight"] = head
    for name, t in master.items():
        parts = name.split(".")
        if parts[0] == "decoder" and parts[1] == "layers":
            h, rest = f"model.layers.{parts[2]}.", parts[3:]
        elif parts[0] == "mtp":
            h = f"model.layers.{layers + int(parts[2])}."
            rest = parts[4:] if parts[3] == "transformer_layer" else parts[3:]
            out[h + "embed_tokens.weight"] = master[WORD][:vocab]
            out[h + "shared_head.head.weight"] = head
        else:
            continue
        suffix = ".".join(rest)
        if suffix.endswith("linear_fc1.weight"):
            gate, up = t.chunk(2)
            stem = suffix.removesuffix("linear_fc1.weight").replace("experts.experts.", "experts.")
            out[h + stem + "gate_proj.weight"], out[h + stem + "up_proj.weight"] = gate, up
        elif rest[:3] == ["mlp", "experts", "experts"]:  # an expert's fc2
            out[h + f"mlp.experts.{rest[3]}.down_proj.weight"] = t
        else:
            out[h + _DSV3_NAMES[suffix]] = t
    return out


def _nemotron_h_expected(master: dict[str, torch.Tensor], heads: int, groups: int, vocab: int,
                         layers: list[int]) -> dict:
    """Nemotron-H's tensors (Hub layout, `backbone.`): each layer a `norm` and a `mixer`, which is
    the Mamba-2 mixer, the attention, the MLP or the MoE, whichever the megatron layer holds.
    Mamba-2's in_proj is [z; x; B; C; dt] and conv1d [x; B; C] on both sides (transformers splits
    in_proj into [gate; xBC; dt] and xBC into [x; B; C]); a tied embedding is stored as lm_head too."""
    out = {"backbone.embeddings.weight": master[WORD][:vocab],
           "backbone.norm_f.weight": master["decoder.final_norm.weight"],
           "lm_head.weight": master.get("output_layer.weight", master[WORD])[:vocab]}
    for i in layers:
        m, h = f"decoder.layers.{i}.", f"backbone.layers.{i}."
        if m + "mixer.in_proj.weight" in master:  # Mamba-2
            out[h + "norm.weight"] = master[m + "mixer.in_proj.layer_norm_weight"]
            for name in ("in_proj.weight", "conv1d.weight", "conv1d.bias", "A_log", "D", "dt_bias",
                         "norm.weight", "out_proj.weight"):
                out[h + "mixer." + name] = master[m + "mixer." + name]
        elif m + "self_attention.linear_qkv.weight" in master:
            out[h + "norm.weight"] = master[m + "self_attention.linear_qkv.layer_norm_weight"]
            q, k, v = split_qkv(master[m + "self_attention.linear_qkv.weight"], heads, groups)
            out.update({h + "mixer.q_proj.weight": q, h + "mixer.k_proj.weight": k,
                        h + "mixer.v_proj.weight": v,
                        h + "mixer.o_proj.weight": master[m + "self_attention.linear_proj.weight"]})
        elif m + "mlp.router.weight" in master:  # MoE, experts one tensor each
            out[h + "norm.weight"] = master[m + "pre_mlp_layernorm.weight"]
            out[h + "mixer.gate.weight"] = master[m + "mlp.router.weight"]
            out[h + "mixer.gate.e_score_correction_bias"] = master[m + "mlp.router.expert_bias"]
            for mine, theirs in (("linear_fc1", "up_proj"), ("linear_fc2", "down_proj")):
                shared = master[m + f"mlp.shared_experts.{mine}.weight"]
                out[h + f"mixer.shared_experts.{theirs}.weight"] = shared
                experts = {int(n.split(".")[6]) for n in master if n.startswith(m + "mlp.experts.experts.")}
                for e in sorted(experts):
                    out[h + f"mixer.experts.{e}.{theirs}.weight"] = \
                        master[m + f"mlp.experts.experts.{e}.{mine}.weight"]
        else:  # MLP: up_proj, relu2, down_proj
            out[h + "norm.weight"] = master[m + "mlp.linear_fc1.layer_norm_weight"]
            out[h + "mixer.up_proj.weight"] = master[m + "mlp.linear_fc1.weight"]
            out[h + "mixer.down_proj.weight"] = master[m + "mlp.linear_fc2.weight"]
    return out


def _gpt_oss_expected(master: dict[str, torch.Tensor], heads: int, groups: int, vocab: int,
                      layers: list[int]) -> dict:
    """GPT-OSS's tensors: the experts of a layer stacked (expert first), gate_up_proj `[hidden,
    2 * ffn]` with gate and up columns alternating, down_proj `[ffn, hidden]`; sinks per head."""
    out = {"model.embed_tokens.weight": master[WORD][:vocab],
           "model.norm.weight": master["decoder.final_layernorm.weight"]}
    if "output_layer.weight" in master:
        out["lm_head.weight"] = master["output_layer.weight"][:vocab]
    for i in layers:
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[h + "input_layernorm.weight"] = master[m + "self_attention.linear_qkv.layer_norm_weight"]
        out[h + "post_attention_layernorm.weight"] = master[m + "pre_mlp_layernorm.weight"]  # MoE layers
        for kind in ("weight", "bias"):
            q, k, v = split_qkv(master[m + f"self_attention.linear_qkv.{kind}"], heads, groups)
            out.update({h + f"self_attn.q_proj.{kind}": q, h + f"self_attn.k_proj.{kind}": k,
                        h + f"self_attn.v_proj.{kind}": v})
            out[h + f"self_attn.o_proj.{kind}"] = master[m + f"self_attention.linear_proj.{kind}"]
            out[h + f"mlp.router.{kind}"] = master[m + f"mlp.router.{kind}"]
        out[h + "self_attn.sinks"] = master[m + "self_attention.core_attention.softmax_offset"]
        experts = sorted({int(n.split(".")[6]) for n in master if n.startswith(m + "mlp.experts.experts.")})
        fc = [(master[f"{m}mlp.experts.experts.{e}.linear_fc1.weight"],
               master[f"{m}mlp.experts.experts.{e}.linear_fc1.bias"],
               master[f"{m}mlp.experts.experts.{e}.linear_fc2.weight"],
               master[f"{m}mlp.experts.experts.{e}.linear_fc2.bias"]) for e in experts]
        # rows [gate; up] -> pairs (gate_j, up_j) -> columns gate_0, up_0, gate_1, up_1, ...
        out[h + "mlp.experts.gate_up_proj"] = torch.stack(
            [torch.stack(w1.chunk(2), dim=1).reshape(w1.shape).t() for w1, _, _, _ in fc])
        out[h + "mlp.experts.gate_up_proj_bias"] = torch.stack(
            [torch.stack(b1.chunk(2), dim=1).reshape(-1) for _, b1, _, _ in fc])
        out[h + "mlp.experts.down_proj"] = torch.stack([w2.t() for _, _, w2, _ in fc])
        out[h + "mlp.experts.down_proj_bias"] = torch.stack([b2 for _, _, _, b2 in fc])
    return out


# ------------------------------------------------------- hybrid (Mamba) models, Megatron-LM files
# megatron-core's hybrid model (`--hybrid-layer-pattern`, one symbol per layer: M Mamba, * attention,
# - MLP, E MoE; `|` cuts pipeline stages). Universal names are the torch_dist keys of the TE spec:
# a Mamba layer's input norm is `mixer.in_proj.layer_norm_weight`, the attention and MLP layers'
# norms are fused into linear_qkv / linear_fc1, a MoE layer keeps `pre_mlp_layernorm`. The Mamba
# mixer's in_proj is [z, x, B, C, dt] and its conv1d [x, B, C] along dim 0, each section split
# over TP on its own; A_log, D, dt_bias and the gated norm split with the heads (dim 0).


def hybrid_stage_layers(pattern: str) -> list[range]:
    """The global layers of each pipeline stage of a pattern (its `|` cuts; none: one stage)."""
    out, start = [], 0
    for stage in pattern.split("/")[0].split("|"):
        out.append(range(start, start + len(stage)))
        start += len(stage)
    return out


def args_hybrid_pattern(args) -> str:
    """A hybrid run's layer pattern in its Megatron-LM args: core_v0.19.0's `--hybrid-layer-pattern`,
    core_v0.16.1's `--hybrid-override-pattern`."""
    return getattr(args, "hybrid_layer_pattern", None) or args.hybrid_override_pattern


def hybrid_sections(args) -> dict[str, list[int]]:
    """Section sizes (dim 0, TP 1) of the Mamba mixer's in_proj and conv1d, from the run's args:
    d_inner = 2 x hidden (megatron-core's expand), heads d_inner / head dim, B and C groups x state."""
    d_inner = 2 * args.hidden_size
    heads = args.mamba_num_heads or d_inner // args.mamba_head_dim
    bc = args.mamba_num_groups * args.mamba_state_dim
    return {"mixer.in_proj.weight": [d_inner, d_inner, bc, bc, heads],
            "mixer.conv1d.weight": [d_inner, bc, bc], "mixer.conv1d.bias": [d_inner, bc, bc]}


def hybrid_universal_name(local: str, pattern: str, layer_offset: int) -> str:
    """A local (legacy state-dict) name of a hybrid model's stage -> its universal name."""
    m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", local)
    if not m:
        return local
    layer = int(m.group(1)) + layer_offset
    symbol, rest = pattern.split("/")[0].replace("|", "")[layer], m.group(2)
    rename = {"M": {"norm.weight": "mixer.in_proj.layer_norm_weight",
                    "mixer.conv1d_weight": "mixer.conv1d.weight", "mixer.conv1d_bias": "mixer.conv1d.bias"},
              "*": {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight"},
              "-": {"pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}}.get(symbol, {})
    rest = rename.get(rest, rest)
    rest = re.sub(r"^mlp\.experts\.local_experts\.", "mlp.experts.experts.", rest)  # EP1: global index
    return f"decoder.layers.{layer}.{rest}"


def hybrid_full_tensor(name: str, copies: list[tuple[int, torch.Tensor]], sections: dict) -> torch.Tensor:
    """TP shards of a hybrid model's tensor put together: sectioned tensors section by section,
    the per-head Mamba tensors and column-parallel ones on dim 0, out_proj and row-parallel ones
    on dim 1; replicated copies must agree."""
    by_tp: dict[int, torch.Tensor] = {}
    for tp, t in copies:
        assert tp not in by_tp or torch.equal(by_tp[tp], t), f"{name}: replicated copies differ"
        by_tp[tp] = t
    shards = [by_tp[r] for r in sorted(by_tp)]
    if len(shards) == 1:
        return shards[0]
    rest = re.sub(r"^decoder\.layers\.\d+\.", "", name)
    if rest in sections:
        local = [n // len(shards) for n in sections[rest]]
        parts = [s.split(local, dim=0) for s in shards]
        return torch.cat([p[i] for i in range(len(local)) for p in parts], dim=0)
    if rest in ("mixer.A_log", "mixer.D", "mixer.dt_bias", "mixer.norm.weight") or name.endswith(COLUMN):
        return torch.cat(shards, dim=0)
    if rest == "mixer.out_proj.weight" or name.endswith(ROW):
        return torch.cat(shards, dim=1)
    for s in shards[1:]:
        assert torch.equal(s, shards[0]), f"{name}: TP-replicated copies differ"
    return shards[0]


def hybrid_legacy_full(ckpt: Path) -> dict[str, dict]:
    """Universal name -> {"model", state..., "step"} of a hybrid model's `--ckpt-format torch` save
    (distributed optimizer, untied output layer, EP1): each rank's `distrib_optim.pt` buffer sliced
    with `flat_layout` over its model_optim_rng.pt state dict (registration order), the TP shards
    put together with `hybrid_full_tensor`."""
    copies: dict[str, dict] = {}
    for rank_dir in sorted(legacy_iteration(ckpt).iterdir()):
        m, optim = load(rank_dir / "model_optim_rng.pt"), load(rank_dir / "distrib_optim.pt")
        args = m["args"]
        assert args.untie_embeddings_and_output_weights and args.expert_model_parallel_size == 1
        assert not args.virtual_pipeline_model_parallel_size
        pattern = args_hybrid_pattern(args)
        parts = [int(x) for x in rank_dir.name.split("_")[2:]]
        tp, pp = parts[0], parts[1] if args.pipeline_model_parallel_size > 1 else 0
        sd = {k: v for k, v in m["model"].items() if torch.is_tensor(v)}
        starts, total = flat_layout([(k, v.numel()) for k, v in sd.items()], set())
        assert optim["buckets_coalesced"] and set(optim) == {"buckets_coalesced", 0}, rank_dir
        (flat,) = optim[0].values()  # one (param dtype, grad dtype) buffer
        assert flat["numel_unpadded"] == total == flat["param"].numel(), rank_dir
        (step,) = {g["step"] for g in m["optimizer"]["optimizer"]["param_groups"]}
        offset = hybrid_stage_layers(pattern)[pp].start
        for local, weight in sd.items():
            d = copies.setdefault(hybrid_universal_name(local, pattern, offset), {"step": step})
            d.setdefault("model", []).append((tp, weight))
            for s in STATES:
                t = flat[s][starts[local]:starts[local] + weight.numel()].view(weight.shape)
                d.setdefault(s, []).append((tp, t))
    sections = hybrid_sections(args)
    return {n: {"step": c["step"], **{k: hybrid_full_tensor(n, c[k], sections)
                                      for k in ("model", *STATES)}} for n, c in copies.items()}


def hybrid_layer_params(symbol: str, experts: int = 0, conv1d_module: bool = False) -> list[str]:
    """A hybrid layer's parameters (no biases, RMSNorm; a MoE layer of `experts` SequentialMLP
    experts) in registration order, under their universal names. A module registers its own
    parameters before its submodules': megatron-core 0.19's Mamba mixer holds conv1d as two
    parameters, so conv1d, dt_bias, A_log, D come before its in_proj, gated norm and out_proj;
    0.16's holds an nn.Conv1d submodule (`conv1d_module`), so dt_bias, A_log, D come first, then
    in_proj, conv1d, the gated norm and out_proj. The layer's norm after its mixer; attention's
    linear_proj before linear_qkv; a MoE layer its norm, router, then each expert."""
    if symbol == "E":
        return ["pre_mlp_layernorm.weight", "mlp.router.weight"] + [
            f"mlp.experts.experts.{j}.linear_fc{k}.weight" for j in range(experts) for k in (1, 2)]
    if symbol == "M" and conv1d_module:
        return ["mixer.dt_bias", "mixer.A_log", "mixer.D", "mixer.in_proj.weight", "mixer.conv1d.weight",
                "mixer.conv1d.bias", "mixer.norm.weight", "mixer.out_proj.weight",
                "mixer.in_proj.layer_norm_weight"]
    return {"M": ["mixer.conv1d.weight", "mixer.conv1d.bias", "mixer.dt_bias", "mixer.A_log", "mixer.D",
                  "mixer.in_proj.weight", "mixer.norm.weight", "mixer.out_proj.weight",
                  "mixer.in_proj.layer_norm_weight"],
            "*": ["self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_proj.weight",
                  "self_attention.linear_qkv.weight"],
            "-": ["mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.weight",
                  "mlp.linear_fc2.weight"]}[symbol]


def hybrid_dp_reshardable_full(ckpt: Path, common: dict | None = None) -> dict[str, dict]:
    """Universal name -> {"model", state...} of a hybrid model's dp_reshardable torch_dist save
    (TP, no PP, untied output layer; MoE at EP1, its experts in the dense buffer): each TP rank's flat bucket
    `optimizer.distributed.dp_group_idx_<tp>.gbuf_idx_0.dtype_(<param>, torch.float32)
    .bucket_idx_0.<state>` sliced with `buckets` over the registration order (embedding, the
    layers of `hybrid_layer_params`, final norm, output layer), the TP-local shapes derived by hand
    (`hybrid_full_tensor`'s rules), and the model tensors (one key per section for in_proj and
    conv1d, concatenated; the experts of a MoE layer stacked, `mlp.experts.experts.linear_fc<k>.weight`
    [experts, ...]). `common`: the common state's fields used here, where this megatron-core
    cannot unpickle the checkpoint's (a core_v0.19.0 save read under 0.16)."""
    common = dist_common(ckpt) if common is None else common
    args = common["args"]
    assert args.pipeline_model_parallel_size == 1 and args.expert_model_parallel_size == 1
    assert not args.num_experts or args.tensor_model_parallel_size == 1  # (expert TP not sliced here)
    assert args.untie_embeddings_and_output_weights
    tp_size, pattern = args.tensor_model_parallel_size, args_hybrid_pattern(args)
    sections = hybrid_sections(args)
    stored = tensor_keys(ckpt)
    # the buffers' Mamba order: megatron-core <= 0.18 (which writes common.pt) has a conv1d
    # submodule, 0.19 not; megatron-ucp notes the form it wrote (it writes common.pt under 0.19 too)
    note = common.get("megatron_ucp") or {}
    conv1d_module = note.get("mamba_conv1d_module", (dist_iteration(ckpt) / "common.pt").exists())
    names = [WORD] + [f"decoder.layers.{i}.{n}" for i, sym in enumerate(pattern)
                      for n in hybrid_layer_params(sym, args.num_experts or 0, conv1d_module)]
    names += ["decoder.final_norm.weight", "output_layer.weight"]

    def key_parts(name: str) -> list[str]:
        expert = re.fullmatch(r"(decoder\.layers\.\d+\.mlp\.experts\.experts)\.\d+\.(.+)", name)
        if expert:
            return [f"{expert.group(1)}.{expert.group(2)}"]
        rest = re.sub(r"^decoder\.layers\.\d+\.", "", name)
        if rest in sections:
            pieces = ("z", "x", "B", "C", "dt") if "in_proj" in rest else ("x", "B", "C")
            return [f"{name}.{s}" for s in pieces]
        return [name]

    model_keys = list(dict.fromkeys(k for n in names for k in key_parts(n)))
    flat_keys = {k for k in stored if k.startswith("optimizer.distributed.")}
    assert set(stored) == set(model_keys) | flat_keys, sorted(set(stored) ^ (set(model_keys) | flat_keys))
    model = load_keys(ckpt, model_keys)

    def model_tensor(name: str) -> torch.Tensor:
        expert = re.fullmatch(r"decoder\.layers\.\d+\.mlp\.experts\.experts\.(\d+)\..+", name)
        if expert:  # stacked: [experts, ...]
            (key,) = key_parts(name)
            assert model[key].shape[0] == args.num_experts, key
            return model[key][int(expert.group(1))]
        return torch.cat([model[k] for k in key_parts(name)], dim=0)

    full_model = {n: model_tensor(n) for n in names}

    def local_shape(name: str) -> tuple[int, ...]:
        shape = list(full_model[name].shape)
        rest = re.sub(r"^decoder\.layers\.\d+\.", "", name)
        heads = ("mixer.A_log", "mixer.D", "mixer.dt_bias", "mixer.norm.weight")
        axis = (0 if rest in sections or rest in heads or name.endswith(COLUMN)
                else 1 if rest == "mixer.out_proj.weight" or name.endswith(ROW) else None)
        if axis is not None:
            shape[axis] //= tp_size
        return tuple(shape)

    dtype = "torch.bfloat16" if args.bf16 else "torch.float32"
    copies: dict[str, dict[str, list]] = {}
    read = set()
    for tp in range(tp_size):
        (bucket,) = buckets([(n, math.prod(local_shape(n))) for n in names], set())
        prefix = (f"optimizer.distributed.dp_group_idx_{tp}.gbuf_idx_0.dtype_({dtype}, "
                  f"torch.float32).bucket_idx_0")
        flat = load_keys(ckpt, [f"{prefix}.{s}" for s in STATES])
        read |= set(flat)
        for name, start, numel in bucket:
            for s in STATES:
                assert start + numel <= flat[f"{prefix}.{s}"].numel(), (prefix, name)
                piece = flat[f"{prefix}.{s}"][start:start + numel].view(local_shape(name))
                copies.setdefault(name, {}).setdefault(s, []).append((tp, piece))
    assert {k for k in flat_keys if not k.endswith(("optimizer/shard_0_1", "numel/shard_0_1",
                                                    "numel_unpadded/shard_0_1"))} == read
    return {n: {"model": full_model[n], **{s: hybrid_full_tensor(n, c[s], sections) for s in STATES}}
            for n, c in copies.items()}


def _qwen3_next_expected(master: dict[str, torch.Tensor], heads: int, groups: int, vocab: int,
                         layers: list[int], key_heads: int) -> dict[str, torch.Tensor]:
    """HF Qwen3-Next (Hub layout: experts one tensor each) of a megatron-core Gated DeltaNet GPT,
    row by row: gated attention's linear_qkv per query group is [q heads; their gates; k; v] and
    HF's q_proj per head [query; gate]; a linear-attention layer's in_proj is [q; k; v; z; beta;
    alpha] over all heads, HF's in_proj_qkvz per key head g [q_g; k_g; v and z of the value heads g
    serves] and in_proj_ba per key head [beta; alpha of those heads]; HF's gated norm is megatron's
    zero-centered out_norm plus 1; every other norm is stored as w in both."""
    out = {"model.embed_tokens.weight": master[WORD][:vocab],
           "model.norm.weight": master["decoder.final_layernorm.weight"]}
    if "output_layer.weight" in master:
        out["lm_head.weight"] = master["output_layer.weight"][:vocab]
    for i in layers:
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        if m + "self_attention.in_proj.weight" in master:
            a = m + "self_attention."
            out[h + "input_layernorm.weight"] = master[a + "in_proj.layer_norm_weight"]
            value_heads, v_dim = master[a + "A_log"].shape[0], master[a + "out_norm.weight"].shape[0]
            per = value_heads // key_heads
            k_dim = (master[a + "conv1d.weight"].shape[0] - value_heads * v_dim) // (2 * key_heads)
            w = master[a + "in_proj.weight"]
            qk, vv = key_heads * k_dim, value_heads * v_dim
            q, k, v, z = w[:qk], w[qk:2 * qk], w[2 * qk:2 * qk + vv], w[2 * qk + vv:2 * qk + 2 * vv]
            b, alpha = w[2 * qk + 2 * vv:2 * qk + 2 * vv + value_heads], w[2 * qk + 2 * vv + value_heads:]
            qkvz, ba = [], []
            for g in range(key_heads):
                heads_of_g = range(g * per, (g + 1) * per)
                qkvz += [q[g * k_dim:(g + 1) * k_dim], k[g * k_dim:(g + 1) * k_dim]]
                qkvz += [v[j * v_dim:(j + 1) * v_dim] for j in heads_of_g]
                qkvz += [z[j * v_dim:(j + 1) * v_dim] for j in heads_of_g]
                ba += [b[j:j + 1] for j in heads_of_g] + [alpha[j:j + 1] for j in heads_of_g]
            out[h + "linear_attn.in_proj_qkvz.weight"] = torch.cat(qkvz)
            out[h + "linear_attn.in_proj_ba.weight"] = torch.cat(ba)
            for mine, theirs in (("conv1d.weight", "conv1d.weight"), ("A_log", "A_log"),
                                 ("dt_bias", "dt_bias"), ("out_proj.weight", "out_proj.weight")):
                out[h + "linear_attn." + theirs] = master[a + mine]
            out[h + "linear_attn.norm.weight"] = master[a + "out_norm.weight"] + 1
        else:
            a = m + "self_attention."
            out[h + "input_layernorm.weight"] = master[a + "linear_qkv.layer_norm_weight"]
            w, per = master[a + "linear_qkv.weight"], heads // groups
            d = w.shape[0] // (groups * (2 * per + 2))
            q_rows, k_rows, v_rows = [], [], []
            for g in range(groups):
                block = w[g * (2 * per + 2) * d:(g + 1) * (2 * per + 2) * d]
                for j in range(per):  # each head's query, then its gate
                    q_rows += [block[j * d:(j + 1) * d], block[(per + j) * d:(per + j + 1) * d]]
                k_rows.append(block[2 * per * d:(2 * per + 1) * d])
                v_rows.append(block[(2 * per + 1) * d:])
            out[h + "self_attn.q_proj.weight"] = torch.cat(q_rows)
            out[h + "self_attn.k_proj.weight"] = torch.cat(k_rows)
            out[h + "self_attn.v_proj.weight"] = torch.cat(v_rows)
            out[h + "self_attn.o_proj.weight"] = master[a + "linear_proj.weight"]
            out[h + "self_attn.q_norm.weight"] = master[a + "q_layernorm.weight"]
            out[h + "self_attn.k_norm.weight"] = master[a + "k_layernorm.weight"]
        if m + "mlp.router.weight" in master:
            out[h + "post_attention_layernorm.weight"] = master[m + "pre_mlp_layernorm.weight"]
            out[h + "mlp.gate.weight"] = master[m + "mlp.router.weight"]
            experts = {int(n.split(".")[6]) for n in master if n.startswith(m + "mlp.experts.experts.")}
            for e in sorted(experts):
                x, y = f"{m}mlp.experts.experts.{e}.", f"{h}mlp.experts.{e}."
                gate, up = master[x + "linear_fc1.weight"].chunk(2)
                out[y + "gate_proj.weight"], out[y + "up_proj.weight"] = gate, up
                out[y + "down_proj.weight"] = master[x + "linear_fc2.weight"]
            s = m + "mlp.shared_experts."
            out[h + "mlp.shared_expert.gate_proj.weight"], out[h + "mlp.shared_expert.up_proj.weight"] = \
                master[s + "linear_fc1.weight"].chunk(2)
            out[h + "mlp.shared_expert.down_proj.weight"] = master[s + "linear_fc2.weight"]
            out[h + "mlp.shared_expert_gate.weight"] = master[s + "gate_weight"]
        else:
            out[h + "post_attention_layernorm.weight"] = master[m + "mlp.linear_fc1.layer_norm_weight"]
            gate, up = master[m + "mlp.linear_fc1.weight"].chunk(2)
            out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate, up
            out[h + "mlp.down_proj.weight"] = master[m + "mlp.linear_fc2.weight"]
    return out
