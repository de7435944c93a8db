"""Every offline conversion, in one place: convert, reshard, import-hf, import-deepspeed and
export-hf (the CLI commands and the library API), on a CPU box.

A reader (`formats.open_source`) yields universal tensors and a writer consumes them; the registry
picks both by format name, so this module is where a source meets a target. Under torchrun a
conversion to universal or HF is one job (`distributed=True`): the writer's files are shared out
among the processes and rank 0 commits once (`formats.group_job`), byte for byte the
single-process output. The universal form is layout-free, so "resharding" to it means
consolidating once and checking that the target layout can hold the model; the target run then
loads it directly at its layout (`megatron_ucp.load`, or Megatron-LM with `--universal-checkpoint`).
The Megatron-LM targets (`torch`, `torch_dist`) are written at the target layout and need the
source run's args, so their source must be a Megatron-LM checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_ucp import formats, storage
from megatron_ucp.errors import UCPError
from megatron_ucp.formats import manifest as mf
from megatron_ucp.formats.base import Source
from megatron_ucp.layout import Layout
from megatron_ucp.progress import Progress
from megatron_ucp.storage import Location, location, refuse_non_empty, staged_dir
from megatron_ucp.validation import check_layout

log = logging.getLogger(__name__)

# --target-format value -> format name, and the formats whose checkpoints carry Megatron-LM run
# args (a Megatron-LM target's source): both declared by the registry
TARGET_FORMATS = formats.TARGETS
MEGATRON_SOURCES = formats.MEGATRON_SOURCES


@dataclass
class ReshardSummary:
    source_kind: str
    output: Path
    params: int
    elements: int
    bytes_written: int
    seconds: float
    target_format: str = "universal"

    def __str__(self) -> str:
        mib = self.bytes_written / 2**20
        return (f"[megatron-ucp] resharded {self.source_kind} -> {self.target_format} {self.output}: "
                f"{self.params} parameters, {self.elements:,} elements, {mib:.1f} MiB written in "
                f"{self.seconds:.2f}s ({mib / max(self.seconds, 1e-9):.1f} MiB/s)")


def convert(load: str | Path, universal_dir: str | Path, *, progress: Progress = True,
            max_file_bytes: int = 2**31, workers: int = 1, fmt: str | None = None,
            trust_pickle: bool = False, distributed: bool = False) -> Path:
    """Consolidate a checkpoint (a fragment checkpoint, or a Megatron-LM one) into a new universal
    directory; returns its path. fmt: the source format (detected when None). trust_pickle: load
    Megatron-LM files with the plain unpickler (otherwise only the types Megatron-LM writes).

    Every fragment of a fragment checkpoint is read whole once and its checksum checked. Peak
    memory is about two parameter states per writer, not the model. workers > 1 writes the data
    files in forked processes. distributed: one job of the initialized process group (torchrun,
    gloo), every process converting a balanced share of the files, rank 0 committing once; the
    output is byte for byte that of workers=max(workers, world size) in one process.
    """
    refuse_non_empty(location(universal_dir))  # before a possibly long source rebuild
    source = _open(load, fmt, progress, trust_pickle)
    if source.format == "universal":
        raise UCPError(f"{source.dir}: already a universal checkpoint; nothing to convert")
    return formats.get("universal").write(source, universal_dir, progress=progress,
                                          max_file_bytes=max_file_bytes, workers=workers,
                                          distributed=distributed)


def _open(load: str | Path, fmt: str | None, progress: Progress, trust_pickle: bool,
          lora_base: str | Path | None = None):
    """The source a conversion reads (every fragment it touches checked whole; a megatron-ucp
    source's data files checked against its manifest, so none of their parameters is left out)."""
    source = formats.open_source(load, fmt, progress=progress, verify_fragments=True,
                                 trust_pickle=trust_pickle, lora_base=lora_base)
    source.check_files()  # (a no-op but for megatron-ucp's own formats)
    return source


def convert_legacy(load_dir: str | Path, universal_dir: str | Path, progress: Progress = True,
                   workers: int = 1, trust_pickle: bool = False) -> Path:
    """A Megatron-LM `--ckpt-format torch` checkpoint -> a universal directory."""
    return convert(load_dir, universal_dir, progress=progress, workers=workers,
                   fmt="megatron_torch", trust_pickle=trust_pickle)


def convert_torch_dist(load_dir: str | Path, universal_dir: str | Path, progress: Progress = True,
                       max_file_bytes: int = 2**31, workers: int = 1,
                       trust_pickle: bool = False) -> Path:
    """A Megatron-LM `--ckpt-format torch_dist` checkpoint -> a universal directory."""
    return convert(load_dir, universal_dir, progress=progress, max_file_bytes=max_file_bytes,
                   workers=workers, fmt="megatron_torch_dist", trust_pickle=trust_pickle)


def write_legacy(universal_dir: str | Path, save_dir: str | Path, target: Layout, args_template,
                 **options) -> Path:
    """A megatron-ucp checkpoint -> Megatron-LM `--ckpt-format torch` at `target`
    (`formats.megatron_legacy.write` documents the options)."""
    return formats.get("megatron_torch").write(_adam_source(universal_dir, "torch"), save_dir,
                                               target, args_template, **options)


def write_torch_dist(universal_dir: str | Path, save_dir: str | Path, target: Layout,
                     args_template, **options) -> Path:
    """A megatron-ucp checkpoint -> Megatron-LM `--ckpt-format torch_dist` at `target`
    (`formats.megatron_dist.write` documents the options)."""
    return formats.get("megatron_torch_dist").write(_adam_source(universal_dir, "torch_dist"),
                                                    save_dir, target, args_template, **options)


def _adam_source(universal_dir: str | Path, target_format: str) -> Source:
    """The megatron-ucp checkpoint as a source of a Megatron-LM target whose optimizer state
    megatron-ucp writes (`_refuse_unwritable`). A weights-only one (import-hf) is refused: it has
    no optimizer state and no hyper-parameters, which Megatron-LM's optimizer files hold (the full
    form of an import, zero moments and no param groups, is refused by the writers likewise)."""
    source = formats.open_megatron_ucp(universal_dir)
    if source.manifest.weights_only:
        raise UCPError(f"{source.dir}: a weights-only checkpoint (no optimizer state, no optimizer "
                       "hyper-parameters; manifest weights_only), which a Megatron-LM --ckpt-format "
                       f"{target_format} checkpoint must carry. Load it with megatron_ucp.load (in "
                       "Megatron-LM: --ckpt-format universal, or --universal-checkpoint, with --load "
                       "on it): the optimizer starts fresh at any layout")
    return _refuse_unwritable(source, target_format)


# the optimizer families whose state megatron-ucp writes into each Megatron-LM target format:
# Adam's (DistributedOptimizer) and a LayerWiseDistributedOptimizer run's (Muon or Lion for the
# matrices, Adam for the rest: megatron-core 0.19, `--optimizer muon|lion`); not SGD's
# (megatron-core's DistributedOptimizer takes no SGD, a plain-DDP run has no such files)
DIST_TARGETS = ("torch_dist", "bridge")  # torch_dist files: two optimizer forms, an expert TP
WRITTEN_FAMILIES = {"torch": ("adam", "muon", "lion"), "torch_dist": ("adam", "muon", "lion"),
                    "bridge": ("adam",)}  # (Bridge: runs with Adam are read and written)


def _refuse_unwritable(source: Source, target_format: str) -> Source:
    """`source` unless it holds state of an optimizer family that megatron-ucp does not write
    into Megatron-LM `target_format` optimizer files (refused by name)."""
    written = WRITTEN_FAMILIES[target_format]
    other = sorted({p.spec.optimizer for p in source.manifest.params.values()
                    if not p.spec.buffer and p.spec.optimizer not in written})
    if other:
        raise UCPError(f"{source.dir}: holds {', '.join(other)} optimizer state; megatron-ucp writes "
                       f"Megatron-LM --ckpt-format {target_format} optimizer state for "
                       f"{' / '.join(written)} only. Resume from the megatron-ucp checkpoint "
                       "(megatron_ucp.load / install()), or export the weights (export-hf)")
    return source


def reshard(load: str | Path, save: str | Path, target: Layout | None = None,
            target_format: str = "universal", progress: Progress = True, *,
            first_stage_layers: int | None = None,
            last_stage_layers: int | None = None, workers: int = 1,
            optim_sharding: str | None = None, expert_tensor_parallel: int | None = None,
            trust_pickle: bool = False, distributed: bool = False,
            lora_base: str | Path | None = None) -> ReshardSummary:
    """Convert `load` to `target_format` at `target`.

    target_format "torch": a stock Megatron-LM `--ckpt-format torch` checkpoint at `target`;
    "torch_dist": a Megatron-LM `--ckpt-format torch_dist` checkpoint with the optimizer in the
    `fully_reshardable` form (resume with --dist-ckpt-optim-fully-reshardable). A Megatron-LM
    Muon/Lion run (LayerWiseDistributedOptimizer: Muon or Lion state for the matrices, Adam for
    the rest) is written in that optimizer's own forms: torch_dist model-space chained states,
    torch `layer_wise_optimizer_<dp>.pt` per DP rank. Both need a Megatron-LM source (its args
    describe the run). first/last_stage_layers set an uneven pipeline split at the target
    (default: the source's when PP is unchanged, else an even split).
    optim_sharding: torch_dist, "fully_reshardable" (default) or "dp_reshardable"; bridge, the same
        (default dp_reshardable, Bridge's own).
    expert_tensor_parallel: torch_dist only, the target's expert TP size (MoE). A legacy torch
    checkpoint cannot hold ETP != TP: only expert-DP rank 0 writes it, so with ETP < TP the TP
    ranks that share an expert shard write no rank directory.
    lora_base: a Megatron-Bridge LoRA checkpoint's base checkpoint (--base; default the recorded one).
    workers: processes writing the universal data files (universal target).
    trust_pickle: load Megatron-LM files with the plain unpickler (see `convert`)."""
    t0 = time.perf_counter()
    if target_format not in TARGET_FORMATS:
        raise UCPError(f"--target-format {target_format}: unknown; choose one of {list(TARGET_FORMATS)}")
    out = location(save)
    if optim_sharding is not None and target_format not in DIST_TARGETS:
        raise UCPError(f"--target-optim-sharding applies to --target-format torch_dist and bridge only "
                       f"(the {target_format} form has one optimizer layout)")
    if expert_tensor_parallel is not None and target_format not in DIST_TARGETS:
        raise UCPError("--target-etp applies to --target-format torch_dist and bridge only: a Megatron-LM "
                       "torch checkpoint is written by expert-data-parallel rank 0 alone, so it "
                       "cannot hold an expert TP other than TP; the universal form is "
                       "layout-free (the loading run chooses its ETP)")
    if distributed and target_format != "universal":
        raise UCPError(f"--target-format {target_format} runs as one process; run it without "
                       "torchrun (the universal target can be written by a distributed job)")
    if target_format != "universal":
        if lora_base is not None:
            raise UCPError(f"--base {lora_base}: a Megatron-Bridge LoRA checkpoint is merged into its base "
                           "for --target-format universal (and export-hf); reshard the merged universal "
                           "checkpoint further")
        kind = formats.detect(load)
        options = {k: v for k, v in (("sharding", optim_sharding),
                                     ("expert_tensor_parallel", expert_tensor_parallel)) if v}
        manifest = _reshard_to_megatron(load, out, target, kind, target_format, progress,
                                        first_stage_layers, last_stage_layers, trust_pickle, options)
    else:
        refuse_non_empty(out)
        source = _open(load, None, progress, trust_pickle, lora_base)
        kind = source.format
        if target is not None:  # before writing anything the target could not use
            check_layout(source.manifest.model, target, str(source.dir))
        if kind == "universal" and distributed:
            raise UCPError(f"{source.dir}: already universal: the copy runs as one process; run "
                           "it without torchrun")
        if kind == "universal":
            # staged like every writer: a copy killed half-way must not leave a partial `out`
            # (it would block the retry and could hold a manifest without its data files)
            with staged_dir(out, mf.MANIFEST) as partial:
                storage.download(source.dir, partial)
        else:
            formats.get("universal").write(source, out, progress=progress, workers=workers,
                                           distributed=distributed)
        manifest = mf.read(out)
    written = sum(n for _, n in storage.list_files(out))
    return ReshardSummary(kind, out, len(manifest.params),
                          sum(math.prod(p.shape) for p in manifest.params.values()),
                          written, time.perf_counter() - t0,
                          target_format=target_format)


def _reshard_to_megatron(load, out: Location, target: Layout | None, kind: str, target_format: str,
                         progress: Progress, first: int | None, last: int | None,
                         trust_pickle: bool, options: dict) -> mf.Manifest:
    """Megatron-LM -> Megatron-LM `target_format` at target, streamed: the target writer reads
    the source's tensors box by box (`UniversalView`), nothing in between on disk (in a store:
    written locally, then uploaded with the tracker file last, `storage.staged_dir`). Returns the
    manifest the universal form of the source would have."""
    if kind not in MEGATRON_SOURCES:
        raise UCPError(f"{load}: --target-format {target_format} needs a Megatron-LM checkpoint "
                       "(torch, torch_dist, fsdp_dtensor or torch_dcp) source, "
                       f"this is a {kind} checkpoint. A Megatron-LM checkpoint stores the run's "
                       "args (model architecture, optimizer and run settings) that the written "
                       f"checkpoint must carry; a {kind} checkpoint has no Megatron-LM args. "
                       "Convert the original Megatron-LM checkpoint instead, or call "
                       "megatron_ucp.conversion.write_legacy / write_torch_dist with an args template")
    if target is None:
        raise UCPError(f"--target-format {target_format}: writing a Megatron-LM checkpoint needs a "
                       "target layout (rank files, flat buffers and args depend on it); pass "
                       "target=Layout(...) (CLI: --target-tp/--target-pp/--target-dp ...)")
    refuse_non_empty(out)
    src = formats.get(kind).run_fields(load, trust_pickle)
    if first is None and last is None and src.layout.pp == target.pp:
        first = getattr(src.args, "decoder_first_pipeline_num_layers", None)
        last = getattr(src.args, "decoder_last_pipeline_num_layers", None)
    rng = src.rng_by_position
    if rng and src.layout != target:  # per-rank states belong to the source ranks: rank 0's
        rng = rng.get((0, 0), next(iter(rng.values())))
    source = UniversalView(_refuse_unwritable(_open(load, kind, progress, trust_pickle), target_format))
    formats.get(TARGET_FORMATS[target_format]).write(
        source, out, target, src.args, rng_state=rng,
        num_floating_point_operations_so_far=src.num_floating_point_operations_so_far,
        first_stage_layers=first, last_stage_layers=last, progress=progress, **options)
    return source.manifest


class UniversalView(Source):
    """A source seen as its universal form would hold it, without writing that form: the manifest
    `universal.write` would write (vocab rows cut to the true vocabulary, the run state as its
    JSON holds it) over the source's own reads. So a Megatron-LM target written from it is the
    one written from the converted universal checkpoint, byte for byte."""

    def __init__(self, source: Source):
        from megatron_ucp.formats.manifest import Manifest, ParamEntry
        from megatron_ucp.formats.universal.writer import without_padding

        self.source, self.dir, self.origin, self.args = source, source.dir, source.origin, source.args
        self.format = source.format
        header = source.manifest
        params = {n: ParamEntry(without_padding(p.spec, header.true_vocab), source.step(n))
                  for n, p in header.params.items()}
        universal = Manifest.universal(header, params, source.origin)
        # the run state through JSON, as the universal manifest.json would give it back
        run_state = json.loads(json.dumps({k: getattr(universal, k) for k in _RUN_STATE}))
        self.manifest = dataclasses.replace(universal, **run_state)

    @property
    def bytes_read(self) -> int:
        return self.source.bytes_read

    def read(self, name: str, state: str, offset: tuple[int, ...], shape: tuple[int, ...]):
        return self.source.read(name, state, offset, shape)

    def read_into(self, name: str, state: str, offset: tuple[int, ...], shape: tuple[int, ...],
                  out) -> None:
        self.source.read_into(name, state, offset, shape, out)

    def step(self, name: str) -> float:
        return self.manifest.params[name].step

    def rng_ranks(self) -> list[int]:
        return []  # a Megatron-LM run's generator states go to its writers (`run_fields`)

    def te_states(self) -> dict:
        return self.source.te_states()


_RUN_STATE = ("model", "optimizer", "scheduler", "extra")


def import_hf(hf_dir: str | Path, out: str | Path, *, progress: Progress = True,
              max_file_bytes: int = 2**31, weights_only: bool = True) -> Path:
    """`megatron-ucp import-hf`: an HF model directory -> a new weights-only universal checkpoint
    (the weights in their HF dtype, no optimizer state on disk) that `megatron_ucp.load` reads at
    any layout, starting the optimizer fresh (zero state, step 0).
    weights_only=False: the full form instead (fp32 master weights, zero Adam moments, step 0;
    three to six times the bytes), which megatron-ucp before format version 5 reads."""
    refuse_non_empty(location(out))
    source = formats.open_source(hf_dir, "hf", weights_only=weights_only)
    if source.ignored:
        log.info("skipped %d non-parameter tensor(s) of the HF checkpoint, e.g. %s",
                 len(source.ignored), source.ignored[0])
    return formats.get("universal").write(source, out, progress=progress,
                                          max_file_bytes=max_file_bytes)


def import_deepspeed(ds_dir: str | Path, out: str | Path, name_map: str | Path, *,
                     trust_pickle: bool = False, progress: Progress = True,
                     max_file_bytes: int = 2**31) -> Path:
    """`megatron-ucp import-deepspeed`: a DeepSpeed universal folder -> a new universal checkpoint
    with the optimizer state (fp32 master weights, both Adam moments, step) that
    `megatron_ucp.load` reads at any layout."""
    refuse_non_empty(location(out))
    source = formats.open_source(ds_dir, "deepspeed", name_map=name_map, trust_pickle=trust_pickle)
    log.info("%d DeepSpeed parameters -> megatron-core (name map %s); hyper-parameters: %s",
             len(source.rules), source.map.path,
             "from the name map" if source.map.optimizer else "the loading run's own "
             "(zero/optimizer_state.pt is not read)")
    return formats.get("universal").write(source, out, progress=progress,
                                          max_file_bytes=max_file_bytes)


def export_hf(src: str | Path, out: str | Path, arch: str, *, dtype: str | None = None,
              max_shard_bytes: int | None = None, progress: Progress = True,
              vocab_size: int | None = None, rope_theta: float | None = None,
              activation: str | None = None, trust_pickle: bool = False,
              distributed: bool = False, fp8_block_size: tuple[int, int] | None = None,
              hf_template: str | Path | None | bool = None,
              lora_base: str | Path | None = None) -> Path:
    """`megatron-ucp export-hf`: open any supported checkpoint at `src` and write it as a Hugging
    Face model directory of `arch` (`formats.hf.export` documents the options; distributed: under
    torchrun, every process a share of the shards; hf_template: the HF directory whose tokenizer,
    configs and config.json fields are carried, None: the one import-hf read, False: none;
    lora_base: a Bridge LoRA checkpoint's base checkpoint, where it is not the recorded one)."""
    from megatron_ucp.formats import hf
    from megatron_ucp.formats.megatron_common import null_tokenizer_vocab

    hf.archs.get(arch)  # before opening (a Megatron-LM source rebuilds its model to open)
    refuse_non_empty(location(out))
    # every fragment read is read whole and its checksum checked, as `convert` does
    source = formats.open_source(src, progress=progress, verify_fragments=True,
                                 trust_pickle=trust_pickle, lora_base=lora_base)
    args = source.args  # a Megatron-LM source's run args
    hints = hf.archs.hints_from_args(args) if args is not None else {}
    if vocab_size is None and args is not None:  # Megatron-LM keeps the padding rows: drop them
        vocab_size = null_tokenizer_vocab(args)
    sizes = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
    return hf.export(source, out, arch, dtype=dtype, **sizes, progress=progress,
                     vocab_size=vocab_size, rope_theta=rope_theta, activation=activation,
                     hints=hints, distributed=distributed, fp8_block_size=fp8_block_size,
                     hf_template=hf_template)
