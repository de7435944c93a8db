"""Read a Hugging Face transformers model directory as a source of universal tensors.

The source holds the HF weights as fp32 master weights, zero Adam moments and Adam step 0 (HF
directories carry no optimizer state). Its manifest is weights-only (`Manifest.weights_only`), so
`megatron_ucp.conversion.import_hf` writes a weights-only universal checkpoint: the weights in
their HF dtype and no optimizer state, from which `megatron_ucp.load` starts a fresh optimizer at
any layout with the run's own hyper-parameters and schedule (`extra`: `fresh_optimizer`,
`run_hyperparameters`). weights_only=False keeps the zero moments (the full form, which readers of
format version 4 and older read). Blockwise FP8 weights (DeepSeek-V3/R1, Kimi-K2: F8_E4M3 with a
`weight_scale_inv` per block, `fp8`) are dequantized to fp32 as they are read (their spec dtype:
float32); the manifest's record says so.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch

from megatron_ucp.errors import UCPError
from megatron_ucp.formats import tensor_transforms as transforms
from megatron_ucp.formats.base import Source
from megatron_ucp.formats.hf import archs, files, fp8
from megatron_ucp.formats.manifest import RUN_HYPERPARAMETERS, Manifest, ParamEntry
from megatron_ucp.formats.megatron_rebuild import import_specs
from megatron_ucp.layout import Layout
from megatron_ucp.spec import ParamSpec
from megatron_ucp.storage import (
    DTYPE_NAMES,
    ST_TO_DTYPE,
    Location,
    Reader,
    ReadsFiles,
    location,
)

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
FLOAT_ST = ("F32", "BF16", "F16")  # the float weights read as they are
FRESH = "fresh_optimizer"  # manifest `extra` key: the optimizer state is new (zero moments, step 0)
RECORD = "hf_import"  # manifest `extra` key: where the weights came from (arch, HF config)


def is_hf_dir(path: str | Location) -> bool:
    path = location(path)
    return (path / CONFIG_FILE).is_file() and (
        (path / INDEX_FILE).is_file() or any(path.glob("*.safetensors")))


class HFDir(ReadsFiles):
    """The tensors of an HF model directory: name -> safetensors file, shapes and dtypes from the
    headers, data read on demand."""

    def __init__(self, path: str | Path):
        self.dir = location(path)
        if not (self.dir / CONFIG_FILE).is_file():
            raise UCPError(f"{self.dir}: no {CONFIG_FILE}; pass a Hugging Face model directory "
                           "(save_pretrained output)")
        try:
            self.config = json.loads((self.dir / CONFIG_FILE).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise UCPError(f"{self.dir / CONFIG_FILE}: cannot read it ({e})") from e
        self.reader = Reader()
        self.where = self._index()
        self.stored: dict[str, str] = {}  # a name as the importer reads it -> as the file spells it
        self.fp8 = fp8.scheme_of(self.config, str(self.dir))  # None: no quantization_config

    def rename(self, renames: dict[str, str]) -> None:
        """Read tensor `old` as `new` ({old: new}: another transformers release's spelling of it),
        where the directory holds `old` and not `new`."""
        for old, new in renames.items():
            if old in self.where and new not in self.where:
                self.where[new] = self.where.pop(old)
                self.stored[new] = old

    def alias(self, name: str, existing: str) -> None:
        """Read tensor `name` as `existing` where the directory holds `existing` and not `name`
        (a copy some checkpoints of an architecture leave out: GLM-4.6's MTP layers)."""
        if existing in self.where and name not in self.where:
            self.where[name] = self.where[existing]
            self.stored[name] = self.stored.get(existing, existing)

    def _index(self) -> dict[str, Path]:
        index = self.dir / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
                raise UCPError(f"{index}: not a safetensors index ({e})") from e
            where = {name: self.dir / file for name, file in weight_map.items()}
            held = {path: set(self.reader.open(path).keys()) for path in set(where.values())}
            for name, path in where.items():  # the index must not promise what a file lacks
                if name not in held[path]:
                    raise UCPError(f"{index} puts tensor {name!r} in {path.name}, which does not "
                                   "hold it; the directory is incomplete or mixes two models")
            return where
        files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            found = [p.name for p in self.dir.glob("*.bin")]
            raise UCPError(f"{self.dir}: no safetensors weights{f' (found {found})' if found else ''};"
                           " only safetensors is read (no pickle): re-save the model with "
                           "save_pretrained(..., safe_serialization=True)")
        where: dict[str, Path] = {}
        for path in files:
            for name in self.reader.open(path).keys():
                if name in where:
                    raise UCPError(f"{self.dir}: tensor {name!r} is in both {where[name].name} and "
                                   f"{path.name}; keep one model per directory")
                where[name] = path
        return where

    def header(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(safetensors dtype, shape) of tensor `name`."""
        view = self.reader.open(self.where[name]).get_slice(self.stored.get(name, name))
        return view.get_dtype(), tuple(view.get_shape())

    def tensor(self, name: str) -> torch.Tensor:
        return self.reader.read(self.where[name], self.stored.get(name, name))

    def weight(self, name: str) -> torch.Tensor:
        """Tensor `name`'s values: an FP8 weight dequantized to fp32 with its scale_inv (checked by
        HFSource), any other as stored."""
        t = self.tensor(name)
        if t.dtype != fp8.FP8_DTYPE:
            return t
        return fp8.dequantize(t, self.tensor(fp8.scale_name(name)), self.fp8.block)

    def stacked(self, name: str) -> torch.Tensor:
        """A tensor of all experts of a layer (GPT-OSS), kept while its experts are read in turn."""
        if getattr(self, "_stacked", (None,))[0] != name:
            self._stacked = (None, None)  # drop the previous one first
            self._stacked = (name, self.weight(name))
        return self._stacked[1]


class HFSource(ReadsFiles, Source):
    """An HF model directory of a supported architecture as universal tensors (see module doc)."""

    format = "hf"  # its name in the `formats` registry

    def __init__(self, path: str | Path, weights_only: bool = True, **_: object):
        self.hf = HFDir(path)
        self.dir = self.hf.dir
        self.reader = self.hf.reader
        where = str(self.dir)
        self.hf_arch = archs.of_hf_config(self.hf.config, where)
        self.arch = self.hf_arch.name
        mtp = self.hf_arch.mtp_layers_held(self.hf.config, self.hf.where)
        config = self.hf_arch.import_config(self.hf)
        args, run = self.hf_arch.megatron_args(config, where, mtp_layers=mtp)
        # HF vocabularies carry no padding rows; export-hf reads max_sequence_length back from
        # the record below
        specs, model = import_specs(args, run, args.padded_vocab_size)
        self.heads = transforms.Heads.of(model)
        self.rules = {r.megatron: r for r in self.hf_arch.rules(model)}
        if set(self.rules) != set(specs):  # the name map disagrees with megatron-core's model
            raise UCPError(f"internal error: HF {self.arch} name map and megatron-core's model "
                           f"differ: {sorted(set(self.rules) ^ set(specs))[:4]}; please report it")
        self.fp8_tensors: set[str] = set()  # the FP8 weights, dequantized on read
        self.ignored = self._check_tensors(specs)
        params = {n: ParamEntry(ParamSpec(**{**vars(s), "dtype": self._dtype(n)}), 0.0)
                  for n, s in specs.items()}
        record = {"arch": self.arch, "path": where, "config": self.hf.config, "megatron": run,
                  "files": files.describe(self.dir)}
        if self.hf.fp8 is not None:
            record["quantization"] = self.hf.fp8.record(len(self.fp8_tensors))
        self.manifest = Manifest("universal", 0, Layout(), 1, model, params,
                                 {"param_groups": [], "grad_scaler": None}, None,
                                 {FRESH: True, RUN_HYPERPARAMETERS: True, RECORD: record}, seed=1234,
                                 weights_only=weights_only)
        self.origin = {"kind": "hf", "path": where, "arch": self.arch}
        self._last: tuple[str, torch.Tensor] | None = None

    def _check_tensors(self, specs: dict[str, ParamSpec]) -> list[str]:
        """Every tensor the model needs is there at the shape its config implies, and every tensor
        there is used (or a known non-parameter buffer). Returns the names skipped."""
        used = set()
        for name, rule in self.rules.items():
            shapes = transforms.hf_shapes(rule.kind, specs[name].shape, self.heads, len(rule.hf))
            if rule.slot:  # one expert's slice of a tensor stacking all experts
                shapes = [(rule.slot[1], *shape) for shape in shapes]
            for hf_name, shape in zip(rule.hf, shapes):
                if hf_name not in self.hf.where:
                    raise UCPError(f"{self.dir}: tensor {hf_name!r} is missing; HF {self.arch} with "
                                   f"this config.json needs it (for megatron's {name})")
                dtype, got = self.hf.header(hf_name)
                if got != tuple(shape):
                    raise UCPError(f"{self.dir}: tensor {hf_name!r} has shape {list(got)}, but "
                                   f"config.json implies {list(shape)}; the weights do not match "
                                   "the config")
                used.add(hf_name)
                if self._check_dtype(hf_name, dtype, got):
                    used.add(fp8.scale_name(hf_name))
        skipped, unknown = [], []
        for hf_name in self.hf.where:
            if hf_name in used:
                continue
            self._refuse_stray_scale(hf_name)
            if any(re.search(p, hf_name) for p in self.hf_arch.ignored_hf):
                skipped.append(hf_name)
            elif hf_name == "lm_head.weight" and self._tied_copy(hf_name):
                skipped.append(hf_name)
            else:
                unknown.append(hf_name)
        if unknown:
            raise UCPError(f"{self.dir}: tensor(s) {unknown[:3]}{' ...' if len(unknown) > 3 else ''}"
                           f" have no place in megatron-core's model of this HF {self.arch} config; "
                           "refusing to drop them (is config.json the weights' own config?)")
        return skipped

    def _check_dtype(self, name: str, dtype: str, shape: tuple[int, ...]) -> bool:
        """A weight's dtype is imported: a float, or blockwise FP8 with its scale_inv (True)."""
        where = f"{self.dir} ({self.hf.where[name].name})"
        if dtype in FLOAT_ST:
            return False
        if dtype != fp8.FP8_ST:
            raise UCPError(f"{where}: tensor {name!r} is {dtype}; only F32, BF16 and F16 weights and "
                           f"blockwise FP8 ones ({fp8.FP8_ST} with a weight_scale_inv per block) are "
                           "imported (dequantize first)")
        scale = fp8.scale_name(name)
        fp8.check_weight(self.hf.fp8, name, shape, self.hf.header(scale) if scale in self.hf.where else None,
                         where)
        self.fp8_tensors.add(name)  # (GPT-OSS: once per expert of a stacked tensor)
        return True

    def _refuse_stray_scale(self, name: str) -> None:
        """A scale with no FP8 weight of this scheme to apply to: never dropped silently."""
        where = f"{self.dir} ({self.hf.where[name].name})"
        weight = name.removesuffix(fp8.SCALE_SUFFIX)
        dtype = self.hf.header(weight)[0] if weight in self.hf.where else None
        if name.endswith(fp8.SCALE_SUFFIX) and dtype not in (None, fp8.FP8_ST):
            raise UCPError(f"{where}: tensor {name!r} scales {weight!r}, which is {dtype}, not "
                           f"{fp8.FP8_ST}; a scale of an unquantized weight would be silently ignored")
        if fp8.other_scheme(name):
            raise UCPError(f"{where}: tensor {name!r} belongs to another FP8 scheme (static activation "
                           "or per-tensor weight scales); only blockwise FP8 (quantization_config."
                           "activation_scheme 'dynamic', weight_block_size [rows, cols], weight_scale_inv "
                           "per block) is dequantized on import")

    def _tied_copy(self, name: str) -> bool:
        """A tied model's lm_head saved anyway: fine if it is the embedding's copy."""
        emb = self.rules["embedding.word_embeddings.weight"].hf[0]
        if not torch.equal(self.hf.weight(name), self.hf.weight(emb)):
            raise UCPError(f"{self.dir}: config.json says tie_word_embeddings, but {name} differs "
                           f"from {emb}; fix the config (tie_word_embeddings: false)")
        return True

    def _dtype(self, name: str) -> str:
        """The model dtype recorded in the spec: the HF weights' (megatron runs may train in
        another). A tensor joined from HF tensors of different dtypes is float32, which holds each
        exactly (a weights-only checkpoint stores the weight in this dtype); so is a dequantized FP8
        weight (e4m3 times an fp32 block scale is an fp32 value, not a bf16 one)."""
        dtypes = {self.hf.header(n)[0] for n in self.rules[name].hf}
        if fp8.FP8_ST in dtypes:
            return "float32"
        return DTYPE_NAMES[ST_TO_DTYPE[dtypes.pop()]] if len(dtypes) == 1 else "float32"

    def step(self, name: str) -> float:
        return 0.0

    def hf_files(self) -> dict[str, bytes]:
        """The HF directory's tokenizer, configs and code the checkpoint stores (`files`)."""
        return files.stored_copies(self.dir, self.manifest.extra[RECORD]["files"])

    def read(self, name: str, state: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        box = tuple(slice(o, o + n) for o, n in zip(offset, shape))
        if state != "param":  # fresh Adam moments
            return torch.zeros(shape, dtype=torch.float32)
        if self._last is None or self._last[0] != name:
            self._last = None  # drop the previous tensor before assembling the next
            rule = self.rules[name]
            if rule.slot:
                parts = [self.hf.stacked(n)[rule.slot[0]].to(torch.float32) for n in rule.hf]
            else:
                parts = [self.hf.weight(n).to(torch.float32) for n in rule.hf]
            self._last = (name, transforms.join(rule.kind, parts, self.heads, name))
        return self._last[1][box]

    def rng_ranks(self) -> list[int]:
        return []

    def rng(self, rank: int) -> tuple[dict[str, torch.Tensor], dict]:
        return {}, {}
