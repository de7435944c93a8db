"""Export any checkpoint `formats.open_source` reads as a Hugging Face transformers model directory.

Writes `config.json`, `generation_config.json`, `model-0000i-of-0000n.safetensors` shards and
`model.safetensors.index.json`; with a template (`--hf-template DIR`, else the HF model import-hf
read: `files`), also the template's tokenizer, configs and code, and config.json keeps every field
of the template's that the model does not determine (those it determines are checked against it).
The model weights are the fp32 master weights cast to the chosen dtype (what megatron-core's
optimizer writes into the model); dtype fp8 writes the linear weights as blockwise FP8
(DeepSeek-V3's form, `fp8`) and the rest in bf16. Optimizer state is not exported: HF directories
have none. Tensors are streamed: one universal tensor is read, split into its HF
tensors, written and dropped before the next, so peak memory is about the largest tensor (an FP8
one: a few fp32 copies of it while it is quantized).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_ucp import storage
from megatron_ucp.errors import UCPError
from megatron_ucp.formats import group_job
from megatron_ucp.formats import tensor_transforms as transforms
from megatron_ucp.formats.hf import archs, files, fp8
from megatron_ucp.formats.hf.archs import Rule
from megatron_ucp.formats.manifest import Manifest
from megatron_ucp.progress import Progress, bar
from megatron_ucp.storage import (
    DTYPE_NAMES,
    DTYPE_TO_ST,
    Location,
    Reader,
    SafetensorsWriter,
    location,
    staged_dir,
)

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}  # torch's / HF's names
FP8 = "fp8"  # the dtype choice writing blockwise FP8 linear weights (the rest in bf16)
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
GENERATION_FILE = "generation_config.json"
DEFAULT_SHARD_BYTES = 5 * 10**9  # transformers' own default max_shard_size ("5GB")
MEGATRON_ROPE_BASE = 10000.0  # GPTModel's rotary_base default
EMBEDDING = "embedding.word_embeddings.weight"


@dataclass
class Planned:
    """One universal tensor to read (vocab rows trimmed) and the HF tensors it becomes."""

    rule: Rule
    shape: tuple[int, ...]
    outputs: list[tuple[str, tuple[int, ...]]]  # an FP8 weight is followed by its scale_inv
    shards: list[int]  # the shard file of each output
    dtype: torch.dtype  # its HF tensors before writing: the export's, fp32 for `archs.keeps_fp32`
    dtypes: list[torch.dtype]  # of each output as written
    fp8_block: tuple[int, int] | None = None  # its HF tensors are quantized in these blocks


def shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def true_vocab(manifest: Manifest, override: int | None) -> int:
    """Rows of the embedding to export: the true vocabulary, never padding Megatron added."""
    if EMBEDDING not in manifest.params:
        raise UCPError(f"the checkpoint has no {EMBEDDING}; it is not a GPT model with an "
                       "embedding (a pipeline stage alone cannot be exported)")
    rows = manifest.params[EMBEDDING].shape[0]
    vocab = override or manifest.true_vocab
    if vocab is None:
        log.info("the checkpoint records no true vocabulary (save with vocab_size=...): exporting "
                 "all %d embedding rows; pass --vocab-size to drop Megatron's padding rows", rows)
        vocab = rows
    if not 0 < vocab <= rows:
        raise UCPError(f"vocabulary size {vocab} does not fit the checkpoint's {rows} embedding rows")
    return vocab


def plan(arch: str, manifest: Manifest, vocab: int, dtype: torch.dtype,
         max_shard_bytes: int, fp8_block: tuple[int, int] | None = None) -> tuple[list[Planned], int]:
    """Every universal tensor's HF tensors and shard, in write order; and the number of shards.
    fp8_block: the linear weights (`HFArch.fp8_quantized`) become FP8 in these blocks.

    Refuses a checkpoint lacking a tensor the architecture needs, or holding one it has no place
    for (never a silent drop)."""
    hf_arch = archs.get(arch)
    renames = hf_arch.release_names(_token_ids(manifest, arch))
    rules = [dataclasses.replace(r, hf=tuple(renames.get(n, n) for n in r.hf))
             for r in hf_arch.rules(manifest.model)]
    wanted = {r.megatron for r in rules}
    missing = [r.megatron for r in rules if r.megatron not in manifest.params]
    if missing:
        raise UCPError(f"the checkpoint lacks parameter(s) {missing[:3]} that HF {arch} needs for "
                       "this model config; it is not a complete model of that architecture")
    extra = [n for n in manifest.params if n not in wanted]
    if extra:
        raise UCPError(f"parameter(s) {extra[:3]}{' ...' if len(extra) > 3 else ''} have no place in "
                       f"HF {arch}; refusing to drop them (export a model {arch} can represent)")
    heads = transforms.Heads.of(manifest.model)
    out, shard, used = [], 0, 0
    for r in rules:
        block = fp8_block if fp8_block is not None and hf_arch.fp8_quantized(r) else None
        tensor_dtype = torch.float32 if archs.keeps_fp32(r.megatron) or block else dtype
        spec = manifest.params[r.megatron].spec
        shape = (vocab, *spec.shape[1:]) if spec.vocab_rows else spec.shape
        shapes = transforms.hf_shapes(r.kind, shape, heads, len(r.hf))
        if r.kind in ("qkv", "qkv_cat", "qkv_conv1d"):
            transforms.check_qkv_rows(shape[0], heads, f"parameter {r.megatron}")
        if r.slot:  # experts stacked in one HF tensor: written with the last expert's rule
            if r.slot[0] != r.slot[1] - 1:
                out.append(Planned(r, shape, [], [], tensor_dtype, [], block))
                continue
            shapes = [(r.slot[1], *s) for s in shapes]
        outputs, dtypes = [], []
        for name, s in zip(r.hf, shapes):
            outputs.append((name, s))
            dtypes.append(fp8.FP8_DTYPE if block else tensor_dtype)
            if block:
                outputs.append((fp8.scale_name(name), fp8.scale_shape(s, block)))
                dtypes.append(torch.float32)
        shards = []
        for (_, s), d in zip(outputs, dtypes):
            nbytes = d.itemsize * math.prod(s)
            if used and used + nbytes > max_shard_bytes:  # a tensor larger than a shard goes alone
                shard, used = shard + 1, 0
            used += nbytes
            shards.append(shard)
        out.append(Planned(r, shape, outputs, shards, tensor_dtype, dtypes, block))
    return out, shard + 1


def _import_record(manifest: Manifest) -> dict:
    """What import-hf recorded of the HF model this checkpoint came from (`extra`), or {}."""
    record = manifest.extra.get("hf_import") if isinstance(manifest.extra, dict) else None
    return record if isinstance(record, dict) else {}


def _token_ids(manifest: Manifest, arch: str) -> dict:
    """bos/eos/pad ids of the HF model this checkpoint was imported from (`import-hf`), if any, and
    the HF settings of that model the megatron model does not hold (`HFArch.recorded_hf`)."""
    record = _import_record(manifest)
    if record.get("arch") != arch:
        return {}
    cfg = record.get("config") or {}
    keys = ("bos_token_id", "eos_token_id", "pad_token_id", *archs.get(arch).recorded_hf)
    return {k: cfg[k] for k in keys if k in cfg}


def run_hints(manifest: Manifest, args_hints: dict, activation: str | None) -> dict:
    """Facts about the run that megatron-core's model config does not hold (the MLP activation,
    rotary settings): given, else the Megatron-LM args', else import-hf's record."""
    hints = {k: v for k, v in (_import_record(manifest).get("megatron") or {}).items()
             if v is not None}
    hints.update({k: v for k, v in args_hints.items() if v is not None})
    if activation is not None:
        hints["activation"] = activation
    return hints


def rope_base(manifest: Manifest, hints: dict, override: float | None) -> float:
    """rope_theta: given, else the model config's / Megatron-LM args' rotary_base, else megatron's
    default (megatron_ucp.save does not record GPTModel's rotary_base)."""
    for value in (override, manifest.model.get("rotary_base"), hints.get("rotary_base")):
        if value is not None:
            return float(value)
    if manifest.model.get("position_embedding_type") == "rope":
        log.info("the checkpoint does not record rotary_base: rope_theta=%g (megatron-core's "
                 "default); pass --rope-theta if the run used another", MEGATRON_ROPE_BASE)
    return MEGATRON_ROPE_BASE


def check_written(out_dir: Path, planned: list[Planned], n_shards: int) -> None:
    """Before the directory is committed: the index names exactly the planned tensors, and each
    shard's header holds exactly its tensors at the planned dtype and shape."""
    index = json.loads((out_dir / INDEX_FILE).read_text())["weight_map"]
    expected = {name: (shard_name(s, n_shards), shape, d)
                for p in planned for (name, shape), s, d in zip(p.outputs, p.shards, p.dtypes)}
    if set(index) != set(expected):
        raise UCPError(f"{out_dir}: internal error, the index names other tensors than planned; "
                       "nothing was committed")
    reader, by_file = Reader(), {}
    for name, (file, shape, tensor_dtype) in expected.items():
        if index[name] != file:
            raise UCPError(f"{out_dir}: internal error, the index puts {name} in {index[name]}, "
                           f"it was written to {file}; nothing was committed")
        reader.check(out_dir / file, name, DTYPE_TO_ST[tensor_dtype], shape)
        by_file.setdefault(file, set()).add(name)
    for file, names in by_file.items():
        stray = set(reader.open(out_dir / file).keys()) - names
        if stray:
            raise UCPError(f"{out_dir}: internal error, {file} holds unplanned {sorted(stray)[:3]}")


def prepare(manifest: Manifest, arch: str, *, dtype: str | None = None,
            max_shard_bytes: int = DEFAULT_SHARD_BYTES, vocab_size: int | None = None,
            rope_theta: float | None = None, activation: str | None = None, hints: dict | None = None,
            fp8_block_size: tuple[int, int] | None = None) -> tuple[list[Planned], int, dict]:
    """(the planned HF tensors, the number of shards, config.json) of an export of the model that
    `manifest` describes as HF `arch` (the arguments: `export`'s), refusing what it cannot hold."""
    hf_arch = archs.get(arch)
    hints = run_hints(manifest, hints or {}, activation)
    model = dict(manifest.model)  # and what the parameter shapes show that it does not record
    model.update(hf_arch.model_from_shapes(model, {n: p.spec.shape for n, p in manifest.params.items()}))
    hf_arch.check_exportable(model, hints)
    vocab = true_vocab(manifest, vocab_size)
    if dtype is None:
        saved = manifest.params[EMBEDDING].spec.dtype
        dtype = next(k for k, v in DTYPES.items() if DTYPE_NAMES[v] == saved)
    dtype = DTYPE_ALIASES.get(dtype, dtype)
    if dtype not in (*DTYPES, FP8):
        raise UCPError(f"unknown dtype {dtype!r}; choose one of {[*DTYPES, *DTYPE_ALIASES, FP8]}")
    block = fp8_block(hf_arch, model, manifest, dtype, fp8_block_size)
    torch_dtype = torch.bfloat16 if dtype == FP8 else DTYPES[dtype]
    planned, n_shards = plan(arch, manifest, vocab, torch_dtype, max_shard_bytes, block)
    if model.get("max_sequence_length") is None:  # an import-hf checkpoint of a RoPE model
        model["max_sequence_length"] = (_import_record(manifest).get("config") or {}).get(
            "max_position_embeddings")
    config = hf_arch.hf_config(model, vocab=vocab, dtype=DTYPE_NAMES[torch_dtype],
                               rope_theta=rope_base(manifest, hints, rope_theta), hints=hints,
                               tokens=_token_ids(manifest, arch))
    if block is not None:
        config["quantization_config"] = fp8.quantization_config(block)
        _note_partial_blocks(planned, block)
    return planned, n_shards, config


def export(source, out: str | Path, arch: str, *, dtype: str | None = None,
           max_shard_bytes: int = DEFAULT_SHARD_BYTES, progress: Progress = True,
           vocab_size: int | None = None, rope_theta: float | None = None,
           activation: str | None = None, hints: dict | None = None, distributed: bool = False,
           fp8_block_size: tuple[int, int] | None = None,
           hf_template: str | Path | Location | None | bool = None) -> Path:
    """Write the model of `source` (any `formats.open_source` source) as HF `arch` to the new
    directory `out`; returns it.

    dtype: "fp32", "bf16" or "fp16", or torch's names float32, bfloat16, float16 (default: the
    checkpoint's model dtype); or "fp8": the linear weights transformers' FP8 quantizer replaces
    as blockwise e4m3 + weight_scale_inv (`fp8`), the rest bf16, config.json's quantization_config
    DeepSeek-V3's. fp8_block_size: its (rows, cols) blocks (default: those of the FP8 HF model
    import-hf read, else 128 x 128). vocab_size: the true vocabulary (default: the checkpoint's record,
    else every embedding row). rope_theta: default
    the model config's rotary_base, else 10000. activation: the run's MLP activation ("swiglu",
    "gelu", "openai_gelu"; megatron_ucp.save does not record it): default the Megatron-LM args',
    else import-hf's record, else megatron-core's default (gelu; swiglu for gated MLPs).
    hints: Megatron-LM args facts (`archs.hints_from_args`) the model config lacks.
    hf_template: an HF model directory whose non-weight files (tokenizer, generation and processor
    configs, chat template, remote code: `files` says which) are copied into `out`, its
    generation_config.json winning over the derived one, and whose config.json fields are kept
    where the checkpoint does not determine them and checked where it does (`files.merged_config`:
    a conflict is refused by name); never its weights. Default: the HF model import-hf read (its
    recorded config.json; its files from the checkpoint's copies or that directory, if they are
    the recorded bytes). False: none.
    distributed: every process of the initialized process group (torchrun) calls this; each writes
    a balanced set of the shards, rank 0 commits once (`_export_distributed`): the same bytes.
    """
    t0 = time.perf_counter()
    out = location(out)
    if max_shard_bytes <= 0:
        raise UCPError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    planned, n_shards, config = prepare(source.manifest, arch, dtype=dtype, max_shard_bytes=max_shard_bytes,
                                        vocab_size=vocab_size, rope_theta=rope_theta, activation=activation,
                                        hints=hints, fp8_block_size=fp8_block_size)
    template = files.template_of(source, hf_template, arch)
    carried = {} if template is None else template.files
    if template is not None and template.config is not None:
        config = files.merged_config(config, template, fp8_export=files.QUANTIZATION in config,
                                     hf_arch=archs.get(arch))
    if distributed:
        return _export_distributed(source, out, planned, n_shards, config, carried)
    done = bar(progress, len(planned), f"{source.origin.get('kind', source.format)} -> hf {arch}",
               "tensor")
    with staged_dir(out, CONFIG_FILE, check=lambda d: check_written(d, planned, n_shards)) as partial:
        try:
            total = write_shards(partial, source, planned, n_shards, done)
        finally:
            done.close()
        _write_metadata(partial, planned, n_shards, total, config, carried)
    log.info("exported %d tensors (%.1f MiB, %d shard(s)) as HF %s to %s in %.2fs",
             sum(len(p.outputs) for p in planned), total / 2**20, n_shards, arch, out,
             time.perf_counter() - t0)
    return out


def fp8_block(hf_arch: archs.HFArch, model: dict, manifest: Manifest, dtype: str,
              block: tuple[int, int] | None) -> tuple[int, int] | None:
    """The FP8 blocks of an export of `dtype` (None: not FP8): the given ones, else those of the FP8
    HF model import-hf read (so that its export gives back its bytes), else DeepSeek-V3's 128 x 128.
    Refuses an architecture whose FP8 form transformers cannot load (`HFArch.fp8_refusal`)."""
    if dtype != FP8:
        if block is not None:
            raise UCPError(f"an FP8 block size ({list(block)}) is for dtype fp8 only, not {dtype}")
        return None
    why = hf_arch.fp8_refusal(model)
    if why:
        raise UCPError(f"cannot export as HF {hf_arch.name} with dtype fp8: {why}")
    if block is None:
        recorded = (_import_record(manifest).get("quantization") or {}).get("weight_block_size")
        block = tuple(recorded) if recorded else fp8.DEFAULT_BLOCK
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise UCPError(f"FP8 block size {list(block)}: needs two positive sizes (rows, cols)")
    return (block[0], block[1])


def _note_partial_blocks(planned: list[Planned], block: tuple[int, int]) -> None:
    """Say which FP8 weights end in partial blocks (a dimension `block` does not divide): valid
    DeepSeek-V3 form, but transformers 5.23's CPU dequantization (Fp8Dequantize, its loading
    without a GPU) derives the block from the scale grid's shape and misreads them."""
    partial = [name for p in planned if p.fp8_block for (name, shape), d in zip(p.outputs, p.dtypes)
               if d == fp8.FP8_DTYPE and fp8.partial_blocks(shape, block)]
    if partial:
        log.warning("%d FP8 weight(s) end in partial %dx%d blocks (e.g. %s), as DeepSeek-V3's "
                    "kv_a_proj_with_mqa: transformers 5.23's CPU dequantization derives the block from "
                    "the scale grid and misreads them (its GPU FP8Linear takes it from the config)",
                    len(partial), *block, partial[0])


def _write_metadata(out_dir: Location, planned: list[Planned], n_shards: int, total: int, config: dict,
                    carried: dict[str, bytes], check: Callable[[], None] = lambda: None) -> None:
    """The index, the template's files (`carried`: its generation_config.json over the derived
    one) and configs; config.json last, after `check`: it is what makes a directory (a store
    prefix: its create-only put is the commit) an HF model."""
    weight_map = {name: shard_name(s, n_shards) for p in planned for (name, _), s in zip(p.outputs, p.shards)}
    _write_json(out_dir / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
    for name, data in carried.items():
        storage.put(out_dir / name, data)
    if GENERATION_FILE not in carried:
        _write_json(out_dir / GENERATION_FILE, generation_config(config))
    check()
    _write_json(out_dir / CONFIG_FILE, config, create_only=True)


def _export_distributed(source, out: Path, planned: list[Planned], n_shards: int, config: dict,
                        carried: dict[str, bytes]) -> Path:
    """`export` as one job of the process group (`group_job.run`): the shards planned as one
    process plans them, each process reading only the universal tensors its share needs; rank 0
    writes the index, checks, and commits once with config.json last (in a store: its create-only
    put). The output is byte for byte the single-process export."""
    import torch.distributed as dist

    shard_bytes = [0] * n_shards
    for p in planned:
        for (_, shape), shard, d in zip(p.outputs, p.shards, p.dtypes):
            shard_bytes[shard] += math.prod(shape) * d.itemsize

    def write_share(partial: Path, mine: list[int]) -> int:
        return write_shards(partial, source, planned, n_shards, None, shards=set(mine))

    def finish(staged, totals: list[int]) -> None:  # rank 0
        _write_metadata(staged.partial, planned, n_shards, sum(totals), config, carried,
                        lambda: check_written(staged.partial, planned, n_shards))
        staged.commit()

    group_job.run(out, CONFIG_FILE, shard_bytes, lambda shard: shard_name(shard, n_shards),
                  write_share, finish, f"exporting to {out}")
    log.info("exported %d shard(s) as HF to %s from %d processes", n_shards, out,
             dist.get_world_size())
    return out


def _needed(planned: list[Planned], shards: set[int] | None) -> list[bool]:
    """Per planned tensor: whether it must be read for these shard files (all when None). The
    slices of a stacked HF tensor (experts) are needed where their last one writes."""
    if shards is None:
        return [True] * len(planned)
    out, stacked_needed = [False] * len(planned), False
    for i in reversed(range(len(planned))):
        p = planned[i]
        if p.outputs:
            stacked_needed = out[i] = any(s in shards for s in p.shards)
        elif p.rule.slot:
            out[i] = stacked_needed
    return out


def hf_tensors(source, planned: list[Planned], needed: list[bool] | None = None,
               done=None) -> Iterator[tuple[str, int, torch.Tensor]]:
    """(HF name, shard, tensor) of the planned tensors, in write order: read one universal tensor,
    split it, encode its HF tensors, drop it (a stacked HF tensor: once its last expert is read).
    needed: per planned tensor, whether to read it (default all)."""
    heads = transforms.Heads.of(source.manifest.model)
    experts: list[list[torch.Tensor]] = []  # the slices of a stacked HF tensor read so far
    for p, want in zip(planned, needed or [True] * len(planned)):
        if not want:
            if done is not None:
                done.update(1)
            continue
        t = source.read(p.rule.megatron, "param", (0,) * len(p.shape), p.shape)
        parts = transforms.split(p.rule.kind, t, heads, p.rule.megatron, len(p.rule.hf))
        del t
        if p.rule.slot:
            experts.append([part.to(p.dtype) for part in parts])
            if not p.outputs:
                if done is not None:
                    done.update(1)
                continue
            parts = [torch.stack(slices) for slices in zip(*experts)]
            experts = []
        for (name, _), shard, tensor in zip(p.outputs, p.shards, _encode(p, parts)):
            yield name, shard, tensor
        if done is not None:
            done.update(1)


def write_shards(out_dir: Path, source, planned: list[Planned], n_shards: int,
                 done, shards: set[int] | None = None) -> int:
    """Stream the planned tensors into their shard files (`hf_tensors`). shards: only these shard
    files (a distributed export's share; a tensor none of whose outputs go there is not read).
    Returns the bytes written."""
    writers: dict[int, SafetensorsWriter] = {}  # (shards are planned in write order: at most two open)
    total = 0
    for name, shard, tensor in hf_tensors(source, planned, _needed(planned, shards), done):
        if shards is not None and shard not in shards:
            continue
        if shard not in writers:
            writers[shard] = _open_shard(out_dir, planned, shard, n_shards)
        writers[shard].write(name, tensor)
        total += tensor.numel() * tensor.element_size()
        if writers[shard].complete:
            writers.pop(shard).close()
    if writers:
        raise UCPError(f"{out_dir}: internal error, shard(s) {sorted(writers)} not complete; nothing "
                       "was committed")
    return total


def _encode(p: Planned, parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors written for `p`'s HF tensors `parts`: each in its dtype, or an FP8 weight and its
    scale_inv."""
    if p.fp8_block is None:
        return [part.to(p.dtype).contiguous() for part in parts]
    out = []
    for (name, _), part in zip(p.outputs[::2], parts):
        out += fp8.quantize(part, p.fp8_block, f"{name} (from {p.rule.megatron})")
    return out


def generation_config(config: dict) -> dict:
    """generation_config.json as transformers derives it from a model config."""
    return {"_from_model_config": True,
            **{k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
               if config.get(k) is not None}}


def _open_shard(out_dir: Path, planned: list[Planned], shard: int, n_shards: int) -> SafetensorsWriter:
    entries = [(name, d, shape) for p in planned
               for (name, shape), s, d in zip(p.outputs, p.shards, p.dtypes) if s == shard]
    # transformers refuses safetensors files whose metadata names another framework
    return SafetensorsWriter(out_dir / shard_name(shard, n_shards), entries, {"format": "pt"})


def _write_json(path: Location, obj: dict, create_only: bool = False) -> None:
    text = json.dumps(obj, indent=2, sort_keys=True) + "\n"
    storage.put(path, text.encode(), create_only=create_only)
