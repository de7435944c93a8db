"""Independent reference: assemble full tensors from per-rank dumps with hand-written Megatron rules.

This deliberately does NOT use megatron_ucp's mapping (sharded_state_dict-derived pieces): it uses
the textbook Megatron layout (column-parallel on dim 0, row-parallel on dim 1, SwiGLU halves,
layer offsets per pipeline stage and virtual chunk, GroupedMLP's fused weights as views of
[local experts, hidden, ffn] and [local experts, ffn, hidden]), so a bug in the library cannot hide
itself. Every expert weight is compared in SequentialMLP form, so the two MoE forms meet here.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

STATES = ("param", "exp_avg", "exp_avg_sq")
COLUMN = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias",
          "word_embeddings.weight", "output_layer.weight",
          "softmax_offset",  # learnable attention sinks: one per head, heads split over TP
          "eh_proj.weight",  # MTP's projection of [embedding, hidden]: column-parallel
          # MLA's projections (local spec): all column-parallel, outputs gathered where needed
          "linear_q_proj.weight", "linear_q_down_proj.weight", "linear_q_up_proj.weight",
          "linear_kv_down_proj.weight", "linear_kv_up_proj.weight",
          # Mamba's mixer: in_proj column-parallel, its per-channel parameters split with the heads
          # (megatron-core 0.19 holds conv1d's as parameters conv1d_weight and conv1d_bias)
          "in_proj.weight", "conv1d.weight", "conv1d.bias", "conv1d_weight", "conv1d_bias",
          "mixer.dt_bias", "mixer.A_log", "mixer.D",
          "mixer.norm.weight")
ROW = ("linear_proj.weight", "linear_fc2.weight", "out_proj.weight")


def tp_axis(name: str) -> int | None:
    if name.endswith(COLUMN):
        return 0
    if name.endswith(ROW):
        return 1
    return None


def sections(name: str, swiglu: bool, coords: dict) -> list[int]:
    """Global sizes of the blocks along the TP axis that TP splits one by one: SwiGLU's gate and
    up halves; Mamba's in_proj [z, x, B, C, dt] and conv1d [x, B, C] (MambaMixer.__init__)."""
    m = coords.get("mamba")
    if m and name.endswith("mixer.in_proj.weight"):
        return [m["d_inner"], m["d_inner"], m["groups_x_state"], m["groups_x_state"], m["heads"]]
    if m and name.endswith(("mixer.conv1d.weight", "mixer.conv1d.bias", "mixer.conv1d_weight",
                            "mixer.conv1d_bias")):
        return [m["d_inner"], m["groups_x_state"], m["groups_x_state"]]
    return [0, 0] if swiglu and name.endswith(("linear_fc1.weight", "linear_fc1.bias")) else [0]


def _split(t: torch.Tensor, sizes: list[int], axis: int, tp_size: int) -> tuple[torch.Tensor, ...]:
    """`t` (full: tp_size 1, or one TP rank's) cut into its blocks: equal ones where sizes are 0."""
    if 0 in sizes:
        return t.chunk(len(sizes), dim=axis)
    return t.split([n // tp_size for n in sizes], dim=axis)


GROUPED = re.compile(r"(.*\.mlp\.experts\.)weight([12])$")


PIPELINE_COPY = "@pipeline-copy"


def global_key(name: str, coords: dict, chunk: int) -> str:
    if name.startswith("embedding.word_embeddings.") and (coords["pp"] > 0 or chunk > 0):
        # the MTP stage's copy of the first stage's embedding (kept equal by megatron-core's
        # embedding-group all-reduce): compared against the first stage's tensor
        return name + PIPELINE_COPY
    if GROUPED.match(name):  # one fused tensor per EP rank: keep them apart
        name = f"{name}@ep{coords['ep']}"
    # Transformer Engine's grouped linear (TEGroupedMLP) holds local expert k as `weight<k>`
    name = re.sub(r"(.*\.mlp\.experts\.)(linear_fc[12])\.(weight|bias)(\d+)$",
                  r"\1local_experts.\4.\2.\3", name)
    m = re.match(r"(.*\.local_experts\.)(\d+)(\..*)", name)
    if m:  # experts are numbered per EP rank
        per_rank = coords["num_experts"] // coords["ep_size"]
        name = f"{m.group(1)}{coords['ep'] * per_rank + int(m.group(2))}{m.group(3)}"
    m = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
    if not m:
        return name
    first, last = coords.get("first_stage_layers"), coords.get("last_stage_layers")
    if first or last:  # uneven pipeline: given first/last stage sizes, the rest split evenly
        pp, n = coords["pp_size"], coords["num_layers"]
        middle = (n - (first or 0) - (last or 0)) // (pp - bool(first) - bool(last))
        sizes = [middle] * pp
        sizes[0], sizes[-1] = first or middle, last or middle
        offset = sum(sizes[:coords["pp"]])
    else:
        per_chunk = coords["num_layers"] // (coords["pp_size"] * coords["vpp"])
        offset = chunk * coords["num_layers"] // coords["vpp"] + coords["pp"] * per_chunk
    return f"decoder.layers.{offset + int(m.group(1))}.{m.group(2)}"


def grouped_experts(key: str, local: torch.Tensor, coords: dict) -> dict[str, torch.Tensor]:
    """GroupedMLP's fused TP-local weight -> {SequentialMLP-style global key: TP-local expert weight}.
    GroupedMLP computes with weight1.view(experts, hidden, -1) and weight2.view(experts, -1, hidden)."""
    m = GROUPED.match(key.split("@")[0])
    per_rank = coords["num_experts"] // coords["ep_size"]
    hidden = local.shape[0] if m.group(2) == "1" else local.shape[1]
    if m.group(2) == "1":
        views, module = local.reshape(per_rank, hidden, -1), "linear_fc1"
    else:
        views, module = local.reshape(per_rank, -1, hidden), "linear_fc2"
    return {f"{m.group(1)}local_experts.{coords['ep'] * per_rank + j}.{module}.weight": v.t()
            for j, v in enumerate(views)}


def fuse_grouped(key: str, experts: dict[str, torch.Tensor], coords: dict, shape) -> torch.Tensor:
    """The inverse of grouped_experts: TP-local expert weights -> the fused local weight."""
    order = list(grouped_experts(key, torch.empty(shape), coords))
    return torch.stack([experts[k].t() for k in order]).reshape(shape)


def load_dumps(dump_dir: Path) -> list[dict]:
    return [torch.load(p, weights_only=False) for p in sorted(Path(dump_dir).glob("rank*.pt"))]


def _join_tp(name: str, shards: list[torch.Tensor], swiglu: bool, coords: dict) -> torch.Tensor:
    axis = tp_axis(name)
    if axis is None:
        for s in shards[1:]:
            assert torch.equal(s, shards[0]), f"replicated {name} differs across TP ranks"
        return shards[0]
    parts = [_split(s, sections(name, swiglu, coords), axis, len(shards)) for s in shards]
    return torch.cat([torch.cat([p[b] for p in parts], dim=axis) for b in range(len(parts[0]))], dim=axis)


def tp_slice(name: str, full: torch.Tensor, coords: dict, swiglu: bool) -> torch.Tensor:
    axis = tp_axis(name)
    if axis is None:
        return full
    blocks = _split(full, sections(name, swiglu, coords), axis, 1)
    return torch.cat([b.chunk(coords["tp_size"], dim=axis)[coords["tp"]] for b in blocks], dim=axis)


def assemble(dump_dir: Path, swiglu: bool = False) -> dict[str, dict]:
    """global key -> {"model", "param", "exp_avg", "exp_avg_sq": full tensors, "step": float}."""
    by_key: dict[str, dict[int, dict]] = {}
    for dump in load_dumps(dump_dir):
        c = dump["coords"]
        for e in dump["params"]:
            key = global_key(e["name"], c, e["chunk"])
            if key.endswith(PIPELINE_COPY):
                continue
            slot = by_key.setdefault(key, {}).setdefault(c["tp"], {"model": e["model"], "frags": [],
                                                                   "coords": c})
            assert torch.equal(slot["model"], e["model"]), f"{key}: DP replicas differ"
            if e["range"] is not None:
                slot["frags"].append(e)
    full = {}
    for key, per_tp in by_key.items():
        tps = [per_tp[t] for t in sorted(per_tp)]
        locals_ = {"model": [t["model"] for t in tps]}
        steps = {f["step"] for t in tps for f in t["frags"]}
        assert len(steps) <= 1, f"{key}: steps {steps}"
        names = {tuple(f.get("states", STATES)) for t in tps for f in t["frags"]}
        assert len(names) <= 1, f"{key}: the ranks hold different optimizer states {names}"
        for s in next(iter(names)) if steps else ():  # no steps: a buffer, no optimizer state
            locals_[s] = []
            for t in tps:
                flat = torch.empty(t["model"].numel(), dtype=torch.float32)
                covered, seen = 0, {}
                for f in t["frags"]:
                    r = tuple(f["range"])
                    if r in seen:  # a replicated state (no distributed optimizer): DP replicas agree
                        assert torch.equal(seen[r], f[s].reshape(-1)), f"{key}: DP replicas differ in {s}"
                        continue
                    seen[r] = f[s].reshape(-1)
                    flat[r[0]:r[1]] = f[s].reshape(-1)
                    covered += r[1] - r[0]
                assert covered == flat.numel(), f"{key}: DP fragments cover {covered}/{flat.numel()}"
                locals_[s].append(flat.view(t["model"].shape))
        if GROUPED.match(key.split("@")[0]):
            coords = tps[0]["coords"]
            split = {s: [grouped_experts(key, x, coords) for x in xs] for s, xs in locals_.items()}
            per_key = {k: {s: [d[k] for d in ds] for s, ds in split.items()} for k in split["model"][0]}
        else:
            per_key = {key: locals_}
        for k, states in per_key.items():
            full[k] = {s: _join_tp(k, xs, swiglu, tps[0]["coords"]) for s, xs in states.items()}
            if steps:
                full[k]["step"] = next(iter(steps))
    return full


VOCAB = ("word_embeddings.weight", "output_layer.weight")


def _fit_vocab(exp: dict, rows: int) -> dict:
    """The saved tensors cut or zero-padded to the target's padded vocabulary (docs/FORMAT.md)."""
    out = dict(exp)
    for k in [k for k in exp if k != "step"]:
        t = exp[k][:rows]
        out[k] = torch.cat([t, t.new_zeros(rows - len(t), *t.shape[1:])]) if len(t) < rows else t
    return out


def _expert_keys(key: str, e: dict, c: dict) -> list[str]:
    return list(grouped_experts(key, e["model"], c)) if GROUPED.match(e["name"]) else [key]


def _want(key: str, e: dict, c: dict, expected: dict, state: str, swiglu: bool) -> torch.Tensor:
    """The reference for dump entry `e` (a TP-local tensor) of one state."""
    tp_local = {k: tp_slice(k, expected[k][state], c, swiglu)
                for k in _expert_keys(key, e, c)}
    return fuse_grouped(key, tp_local, c, e["model"].shape) if GROUPED.match(e["name"]) else tp_local[key]


def compare_to_reference(dump_dir: Path, expected: dict[str, dict], swiglu: bool = False,
                         want_of: dict | None = None) -> int:
    """Assert every rank's model slice and optimizer shard equals the reference bitwise.
    want_of: {state: f}: the rank's shard of that state equals f(the reference's shard) (e.g. a
    state a load rescales over the new shard). Returns the number of tensors compared."""
    n = 0
    for dump in load_dumps(dump_dir):
        c = dump["coords"]
        for e in dump["params"]:
            key = global_key(e["name"], c, e["chunk"]).removesuffix(PIPELINE_COPY)
            if key == "output_layer.weight" and key not in expected:  # tied: same as the embedding
                key = "embedding.word_embeddings.weight"
            if key.endswith(VOCAB):
                expected = {**expected, key: _fit_vocab(expected[key], e["model"].shape[0] * c["tp_size"])}
            step = expected[_expert_keys(key, e, c)[0]].get("step")
            model = _want(key, e, c, expected, "model", swiglu)
            if e["model"].dtype != model.dtype:  # resumed in another precision: master cast to it
                model = _want(key, e, c, expected, "param", swiglu).to(e["model"].dtype)
            assert torch.equal(e["model"], model), f"{c['layout']} rank tp{c['tp']} pp{c['pp']}: model {key}"
            n += 1
            if e["range"] is None:
                continue
            assert e["step"] == step, f"{key}: step {e['step']} != {step}"
            s0, s1 = e["range"]
            for s in e.get("states", STATES):
                where = f"{c['layout']} tp{c['tp']} pp{c['pp']} dp{c['dp']}"
                want = _want(key, e, c, expected, s, swiglu).reshape(-1)[s0:s1]
                if want_of and s in want_of:
                    want = want_of[s](want)
                assert torch.equal(e[s], want), f"{where}: {s} {key}"
                n += 1
    return n
