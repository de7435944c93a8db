"""The cost profile of one transformer layer and of the links between ranks, as plain data.

A profile is what the simulator and planner need and nothing else: per-module forward/backward
seconds and saved-activation bytes for ONE micro-batch of ONE layer at the profiled TP size, the
embedding and output-layer (with loss) costs, and alpha-beta fits of p2p and TP all-reduce time.
It is written as JSON (`save`/`load`) so a GPU profile can be planned with on a CPU box.

Module names are fixed (MODULES) and follow a megatron-core GPT layer; the selective recompute
groups (SELECTIVE) are the ones megatron-core 0.16 can recompute in place per layer
(`--recompute-modules core_attn layernorm mlp`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

FORMAT_VERSION = 1
# Forward order of one megatron-core GPT layer (local or TE spec).
MODULES = ("input_layernorm", "qkv", "core_attn", "proj", "pre_mlp_layernorm", "mlp")
# Selective recompute groups -> the modules they recompute (megatron-core `recompute_modules`).
SELECTIVE = {"core_attn": ("core_attn",), "layernorm": ("input_layernorm", "pre_mlp_layernorm"),
             "mlp": ("mlp",)}


class ProfileError(ValueError):
    """A profile file that cannot be used; the message names the file and the field."""


@dataclass
class ModuleCost:
    """One module of one layer, one micro-batch: times in seconds, bytes autograd keeps."""

    name: str
    fwd_s: float
    bwd_s: float
    act_bytes: int


@dataclass
class LinkCost:
    """time(bytes) = alpha_s + bytes / bytes_per_s (fitted over the measured message sizes)."""

    alpha_s: float
    bytes_per_s: float
    samples: list = field(default_factory=list)  # [[bytes, seconds], ...] as measured

    def time(self, nbytes: float) -> float:
        return self.alpha_s + nbytes / self.bytes_per_s if nbytes > 0 else 0.0


@dataclass
class StageEnds:
    """Costs outside the transformer layers: embedding (first stage), output layer + loss (last)."""

    embedding_fwd_s: float = 0.0
    embedding_bwd_s: float = 0.0
    embedding_act_bytes: int = 0
    output_fwd_s: float = 0.0
    output_bwd_s: float = 0.0
    output_act_bytes: int = 0


@dataclass
class Profile:
    """Costs of one micro-batch through one layer, plus links. See module docstring."""

    device: str  # e.g. "cpu-gloo", "NVIDIA H100 80GB HBM3-nccl", "A100-80GB (published figures)"
    source: str  # "measured" or "published"
    model: dict  # hidden_size, ffn_hidden_size, num_attention_heads, num_query_groups,
    #              seq_length, micro_batch_size, vocab_size, num_layers, swiglu, dtype
    tp: int  # the TP size the layer costs were taken at
    layer: list  # [ModuleCost] in MODULES order
    layer_input_bytes: int  # hidden states entering a layer (what a full recompute keeps)
    ends: StageEnds
    p2p: LinkCost  # one send/recv between adjacent pipeline stages
    tp_allreduce: LinkCost | None = None  # inside the layer times already; kept for windows
    compute_slots: int | None = None  # ranks sharing the compute (CPU cores); None: one per rank
    version: int = FORMAT_VERSION
    notes: str = ""

    def module(self, name: str) -> ModuleCost:
        for m in self.layer:
            if m.name == name:
                return m
        raise KeyError(name)

    @property
    def layer_fwd_s(self) -> float:
        return sum(m.fwd_s for m in self.layer)

    @property
    def layer_bwd_s(self) -> float:
        return sum(m.bwd_s for m in self.layer)

    @property
    def layer_act_bytes(self) -> int:
        return sum(m.act_bytes for m in self.layer)

    @property
    def boundary_bytes(self) -> int:
        """Bytes of one p2p message (the hidden states of one micro-batch at this TP)."""
        return self.layer_input_bytes

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict, where: str = "<profile>") -> Profile:
        if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
            raise ProfileError(f"{where}: not a megatron-ucp recompute profile of version "
                               f"{FORMAT_VERSION} (field 'version' is {data.get('version')!r}); "
                               "write it again with `megatron-ucp profile-recompute`")
        try:
            layer = [ModuleCost(**m) for m in data["layer"]]
            names = tuple(m.name for m in layer)
            if names != MODULES:
                raise ProfileError(f"{where}: field 'layer' lists modules {names}, expected {MODULES}")
            for m in layer:
                if m.fwd_s < 0 or m.bwd_s < 0 or m.act_bytes < 0:
                    raise ProfileError(f"{where}: module {m.name!r} has a negative cost")
            tp_ar = data.get("tp_allreduce")
            return cls(device=data["device"], source=data["source"], model=dict(data["model"]),
                       tp=int(data["tp"]), layer=layer,
                       layer_input_bytes=int(data["layer_input_bytes"]),
                       ends=StageEnds(**data["ends"]), p2p=LinkCost(**data["p2p"]),
                       tp_allreduce=LinkCost(**tp_ar) if tp_ar else None,
                       compute_slots=data.get("compute_slots"), notes=data.get("notes", ""))
        except KeyError as e:
            raise ProfileError(f"{where}: missing field {e.args[0]!r}") from None
        except TypeError as e:
            raise ProfileError(f"{where}: malformed entry ({e})") from None


def write_json(data: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


def read_json(path: str | Path, error: type[ValueError], what: str) -> dict:
    """The JSON object in `path`; `error` naming the file when it cannot be read or parsed."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise error(f"{path}: cannot read a {what} ({e})") from None


def save(profile: Profile, path: str | Path) -> None:
    write_json(profile.to_json(), path)


def load(path: str | Path) -> Profile:
    return Profile.from_json(read_json(path, ProfileError, "recompute profile"), str(path))
