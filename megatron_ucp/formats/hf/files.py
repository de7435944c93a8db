"""The non-weight files of a Hugging Face model directory, and its config.json as a template.

An HF directory holds more than its weights and config.json: the tokenizer (tokenizer.json,
tokenizer_config.json, special_tokens_map.json, tokenizer.model, vocab.json / merges.txt,
tiktoken files), chat_template.jinja, generation_config.json, processor / preprocessor configs,
custom modeling code (config.json's `auto_map`: Kimi-K2's configuration_deepseek.py,
modeling_deepseek.py, tokenization_kimi.py), README and licence. import-hf records them (name,
size, sha256: `hf_import.files`) and stores copies of them in the universal checkpoint
(`hf_files/`, up to `STORE_CAP` bytes in all) so that an export finds them after the HF directory
has moved; export-hf carries them into the HF directory it writes (`template`).

Carried: the regular files at the top of the directory but hidden ones (`.gitattributes`, the
hub's `.cache/`), config.json (merged instead: `merged_config`) and the weights and their indexes
(`is_weights`: *.safetensors, *.bin, *.pt, *.pth, *.ckpt, *.h5, *.msgpack, *.gguf, *.onnx, *.npz,
*.index.json): an export's weights are the checkpoint's alone, never a template's. Subdirectories
are not carried (Llama's `original/` holds Meta's own weights).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from megatron_ucp import storage
from megatron_ucp.errors import UCPError
from megatron_ucp.formats.base import HF_FILES
from megatron_ucp.storage import Location, location

log = logging.getLogger(__name__)

STORED_DIR = HF_FILES  # a universal checkpoint's copies of its HF source's files
STORE_CAP = 64 * 2**20  # bytes stored in all; a larger tokenizer set is recorded only
CONFIG_FILE = "config.json"
GENERATION_FILE = "generation_config.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf",
                   ".onnx", ".npz", ".index.json")
# config.json fields that describe no property of the weights: the template's value is kept.
# Informational: the release and hub name, the class spelling, inference and init defaults, the
# context length (no RoPE weight depends on it; GPT-2's learned positions are n_positions) ...
INFORMATIONAL = ("transformers_version", "_name_or_path", "architectures", "use_cache",
                 "initializer_range", "max_position_embeddings",
                 # ... and training settings: the HF model's recipe, which a megatron run may not
                 # have recorded (megatron-core's default aux loss 0.0, dropout of a finetune)
                 "router_aux_loss_coef", "attention_dropout", "hidden_dropout", "resid_pdrop",
                 "embd_pdrop", "attn_pdrop", "summary_first_dropout")
DTYPE_FIELDS = ("dtype", "torch_dtype")  # transformers 5's spelling, and 4's: both are the export's
QUANTIZATION = "quantization_config"  # the export's: only an FP8 export has one
# {transformers 4's spelling: 5's} of a field the export writes in 5's
SPELLINGS = {"rope_scaling": "rope_parameters"}
# fields checked even where the importer reads both values as one model: it does not hold them
CHECKED = ("model_type", "bos_token_id", "eos_token_id", "pad_token_id", QUANTIZATION)


def is_weights(name: str) -> bool:
    return name.endswith(WEIGHT_SUFFIXES)


def carried_names(directory: Location) -> list[str]:
    """The files of an HF directory that an export carries (module doc), sorted."""
    return sorted(n for n in storage.names_in(directory)
                  if not n.startswith(".") and not is_weights(n) and n != CONFIG_FILE)


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def describe(directory: Location) -> dict[str, dict]:
    """`hf_import.files`: {name: {"bytes", "sha256", "stored"}} of the carried files; "stored":
    whether import-hf keeps a copy in the checkpoint (in name order until `STORE_CAP`)."""
    out, stored = {}, 0
    for name in carried_names(directory):
        data = storage.read_bytes(directory / name)
        keep = stored + len(data) <= STORE_CAP
        stored += len(data) if keep else 0
        out[name] = {"bytes": len(data), "sha256": digest(data), "stored": keep}
    skipped = [n for n, r in out.items() if not r["stored"]]
    if skipped:
        log.warning("%s: %d file(s) (e.g. %s) are recorded but not stored in the checkpoint (over "
                    "%d MiB in all): export-hf finds them in this directory only, or pass "
                    "--hf-template", directory, len(skipped), skipped[0], STORE_CAP // 2**20)
    return out


def stored_copies(directory: Location, record: dict[str, dict]) -> dict[str, bytes]:
    """The bytes import-hf stores (`hf_files/`) of the files `record` marks stored, checked
    against the record (a file that changed while the import ran is refused)."""
    out = {}
    for name, entry in record.items():
        if entry.get("stored"):
            data = storage.read_bytes(directory / name)
            if digest(data) != entry["sha256"]:
                raise UCPError(f"{directory / name} changed while it was imported; import again")
            out[name] = data
    return out


@dataclass
class Template:
    """What an export takes from an HF directory: its config.json (None: none) and its files."""

    config: dict | None
    config_file: str  # for messages
    files: dict[str, bytes] = field(default_factory=dict)


def from_dir(directory: str | Path | Location) -> Template:
    """--hf-template DIR: its config.json (if any) and its carried files."""
    directory = location(directory)
    if not directory.is_dir():
        raise UCPError(f"--hf-template {directory}: not a directory; pass the HF model directory "
                       "the export's tokenizer and configs come from")
    config = None
    if (directory / CONFIG_FILE).is_file():
        try:
            config = json.loads(storage.read_bytes(directory / CONFIG_FILE))
        except (OSError, ValueError) as e:
            raise UCPError(f"{directory / CONFIG_FILE}: cannot read it ({e})") from e
    files = {n: storage.read_bytes(directory / n) for n in carried_names(directory)}
    return Template(config, str(directory / CONFIG_FILE), files)


def from_record(record: dict, checkpoint: Location | None) -> Template:
    """The template import-hf recorded (`hf_import`): its config.json, and each recorded file
    from the checkpoint's copy (`hf_files/`) or else the source directory, if its bytes are the
    recorded ones. What is found neither way is not carried, with a warning saying so."""
    source = record.get("path")
    files, lost = {}, []
    for name, entry in sorted((record.get("files") or {}).items()):
        places = [checkpoint / STORED_DIR / name] if checkpoint is not None else []
        places += [location(source) / name] if source else []
        for place in places:
            try:
                data = storage.read_bytes(place)
            except (OSError, UCPError):
                continue
            if len(data) == entry.get("bytes") and digest(data) == entry.get("sha256"):
                files[name] = data
                break
        else:
            lost.append(name)
    if lost:
        log.warning("not carried into the export: %s of the HF model imported from %s (the "
                    "checkpoint holds no copy and that directory lacks or changed them); pass "
                    "--hf-template DIR with the model's files, or --no-hf-template",
                    ", ".join(lost), source)
    return Template(record.get("config"), f"{source}/{CONFIG_FILE} (recorded by import-hf)", files)


_MISSING = object()


class _Conflict(Exception):
    def __init__(self, field_name: str, template, generated):
        super().__init__(field_name)
        self.field, self.template, self.generated = field_name, template, generated


def _same(a, b) -> bool:
    """Equal JSON values (1 and 1.0 alike, never True and 1)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return a == b and (type(a) is type(b) or {type(a), type(b)} <= {int, float})


def _merge(field_name: str, template, generated):
    """One field: the template's where the export does not determine it (None) or agrees, a dict
    merged key by key (the template's other keys kept); else `_Conflict`."""
    if generated is None:
        return None if template is _MISSING else template
    if template is _MISSING or template is None:
        return generated
    if isinstance(template, dict) and isinstance(generated, dict):
        out = dict(template)
        for k, v in generated.items():
            out[k] = _merge(f"{field_name}.{k}", template.get(k, _MISSING), v)
        return out
    if _same(template, generated):
        return template
    raise _Conflict(field_name, template, generated)


def merged_config(generated: dict, template: Template, *, fp8_export: bool, hf_arch) -> dict:
    """config.json of an export with a template: every field of the template's config.json is kept
    where the checkpoint does not determine it (`INFORMATIONAL`, `auto_map`, ...); every field the
    export determines is checked against the template's. A conflict is a `UCPError` naming the
    field, both values and the template file, unless the template's value describes the same model
    (import-hf reads both as the same megatron-core model, e.g. Qwen2's max_window_layers without a
    sliding window) and the field is no token id or model_type (`CHECKED`): then the template's
    is kept. dtype / torch_dtype are the export's, in each spelling the template uses; a
    quantization_config only with `fp8_export` (the template's merged and checked like any other
    field; its scale_fmt must be the export's fp32 scales'). A template field the export
    lacks must not change the model `hf_arch` imports the config as (megatron-core args and run
    facts), else it is refused by name: the checkpoint does not have it."""
    where = template.config_file
    tpl = dict(template.config or {})
    if not fp8_export and tpl.pop(QUANTIZATION, None) is not None:
        log.info("%s: its quantization_config is not carried: the export's weights are not FP8", where)
    # the model the export's own config.json describes (informational fields aside)
    reference = {**generated, **{k: tpl[k] for k in INFORMATIONAL if k in tpl}}
    differ = [k for k in INFORMATIONAL if k in tpl and k in generated and not _same(tpl[k], generated[k])
              and generated[k] is not None]
    if differ:
        log.info("%s: kept the template's %s (the checkpoint's: %s)", where,
                 {k: tpl[k] for k in differ}, {k: generated[k] for k in differ})
    want = _model_or_refuse(reference, hf_arch, where)
    out = dict(reference)
    for k, v in generated.items():
        if k in INFORMATIONAL:
            continue
        try:
            out[k] = _merge(k, tpl.get(k, _MISSING), v)
        except _Conflict as c:
            if k in CHECKED or _model_of_or_none({**reference, k: tpl[k]}, hf_arch) != want:
                raise UCPError(f"config.json field {c.field}: the template {where} says "
                               f"{c.template!r}, the checkpoint has {c.generated!r}; the template is "
                               "another model's (pass the HF directory this checkpoint came from "
                               "as --hf-template, or --no-hf-template)") from None
            log.info("config.json field %s: the template's %r kept (the checkpoint's %r is the same "
                     "model)", c.field, c.template, c.generated)
            out[k] = tpl[k]
    for k in DTYPE_FIELDS:
        if k in tpl or k == "dtype":
            out[k] = generated["dtype"]
    scale_fmt = (out.get(QUANTIZATION) or {}).get("scale_fmt", "float")
    if fp8_export and scale_fmt != "float":
        raise UCPError(f"config.json field {QUANTIZATION}.scale_fmt: the template {where} says "
                       f"{scale_fmt!r}, but the export's FP8 scales are fp32 amax / 448 ('float'), "
                       "not powers of two; export with another --dtype, or pass --no-hf-template")
    extra = {k: v for k, v in tpl.items() if k not in out}
    # what the template adds: its fields the export lacks, its keys of dicts the export has
    added = {**extra, **{k: v for k, v in out.items() if isinstance(v, dict)
                         and v != generated.get(k) and k != QUANTIZATION}}
    if added and _model_of_or_none(_as_read({**out, **extra}), hf_arch) != want:
        for k, v in added.items():  # name the field that changes it
            try:
                got = _model_of(_as_read({**reference, k: v}), hf_arch)
            except UCPError as e:
                raise UCPError(f"config.json field {k}: the template {where} says {v!r}, which the "
                               f"checkpoint's model does not have ({e})") from e
            if got != want:
                raise UCPError(f"config.json field {k}: the template {where} says {v!r}, which "
                               f"describes another model than the checkpoint (megatron-core's "
                               f"{_changed(got, want)[:4]} would differ); pass the HF directory this "
                               "checkpoint came from as --hf-template, or --no-hf-template")
        raise UCPError(f"config.json fields {sorted(added)}: the template {where}'s describe another "
                       "model than the checkpoint together; pass the HF directory this checkpoint "
                       "came from as --hf-template, or --no-hf-template")
    return {**out, **extra}


def _as_read(config: dict) -> dict:
    """`config` as transformers reads it where it holds a field in two releases' spellings: 5.23
    takes transformers 4's rope_scaling over rope_parameters (and rope_theta from the top level)."""
    shadowed = {SPELLINGS[old] for old in SPELLINGS if old in config}
    return {k: v for k, v in config.items() if k not in shadowed}


def _changed(got: tuple[dict, dict], want: tuple[dict, dict]) -> list[str]:
    return sorted({a for part in (0, 1) for a in {*got[part], *want[part]}
                   if got[part].get(a) != want[part].get(a)})


def _model_of(config: dict, hf_arch) -> tuple[dict, dict]:
    """(megatron-core args, run facts) of the model import-hf reads `config` as."""
    cfg = {k: v for k, v in config.items() if k != QUANTIZATION}
    args, run = hf_arch.megatron_args(cfg, "template")
    return vars(args), run


def _model_of_or_none(config: dict, hf_arch) -> tuple[dict, dict] | None:
    try:
        return _model_of(config, hf_arch)
    except UCPError:
        return None


def _model_or_refuse(reference: dict, hf_arch, where: str) -> tuple[dict, dict]:
    try:
        return _model_of(reference, hf_arch)
    except UCPError as e:  # an informational field of the template that the importer refuses
        raise UCPError(f"config.json with the fields of the template {where}: {e}") from e


def template_of(source, hf_template: str | Path | Location | None | bool, arch: str) -> Template | None:
    """The template of an export of `source` as HF `arch`: the directory `hf_template`; None: the
    HF model import-hf read (`hf_import`: its config.json and files), if it was one of `arch`;
    False: none (the export's own config.json and generation_config.json alone)."""
    if hf_template is False:
        return None
    if hf_template is not None and hf_template is not True:
        return from_dir(hf_template)
    extra = source.manifest.extra if isinstance(source.manifest.extra, dict) else {}
    record = extra.get("hf_import")
    if not isinstance(record, dict) or record.get("arch") != arch:
        log.warning("the export carries no tokenizer or other model files (the checkpoint records "
                    "no import of an HF %s model): pass --hf-template DIR, the HF model directory "
                    "they come from", arch)
        return None
    if "files" not in record:
        log.warning("the import-hf record of %s names no model files (an import by an older "
                    "megatron-ucp): the tokenizer is not carried; pass --hf-template DIR",
                    record.get("path"))
    return from_record(record, source.dir)
