"""Fragments -> universal: one full tensor per parameter and state, streamed, no process group."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from tqdm import tqdm

from megatron_ucp import manifest as mf
from megatron_ucp.errors import UCPError
from megatron_ucp.fragments import FragmentSource
from megatron_ucp.universal import commit, write_params, write_rng


def convert(fragments_dir: str | Path, universal_dir: str | Path, *, progress: bool = True,
            max_file_bytes: int = 2**31, workers: int = 1) -> Path:
    """Consolidate a fragment checkpoint into a universal directory; returns its path.

    Peak memory is about one parameter state (the tensor being written), not the model.
    """
    t0 = time.perf_counter()
    ckpt = mf.resolve(fragments_dir)
    manifest = mf.read(ckpt)
    if manifest["kind"] != "fragments":
        raise UCPError(f"{ckpt}: already a {manifest['kind']} checkpoint; nothing to convert")
    source = FragmentSource(ckpt, manifest)
    out = Path(universal_dir)
    if out.exists() and any(out.iterdir()):
        raise UCPError(f"{out} exists and is not empty; choose a new directory")
    partial = out.with_name(f".{out.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)

    true_vocab = manifest["model"].get("unpadded_vocab_size")
    # the universal form keeps each spec, not the fragment index (the slices of the saving layout)
    params = {n: _without_padding({k: v for k, v in spec.items() if k != "slices"}, true_vocab)
              for n, spec in manifest["params"].items()}
    bar = tqdm(total=len(params), desc="consolidate", unit="param", disable=not progress)
    shapes = {n: s["shape"] for n, s in params.items()}
    entries = write_params(partial, params,
                           lambda n, s: source.read(n, s, (0,) * len(shapes[n]), tuple(shapes[n])),
                           max_file_bytes, bar, workers)
    bar.close()
    write_rng(partial, {r: source.rng(r) for r in range(manifest["layout_world_size"])})
    universal = {k: v for k, v in manifest.items() if k not in ("files", "bytes")}
    universal["kind"] = "universal"
    universal["params"] = {n: {**spec, "step": source.step(n), "tensors": entries[n]}
                           for n, spec in params.items()}
    universal["converted_from"] = {"kind": "fragments", "path": str(ckpt)}
    commit(partial, out, universal)
    if progress:
        print(f"[megatron-ucp] {len(params)} parameters, {source.reader.bytes_read / 2**20:.1f} MiB "
              f"read, written to {out} in {time.perf_counter() - t0:.2f}s")
    return out


def _without_padding(spec: dict, true_vocab: int | None) -> dict:
    """Vocab-row params keep only the true vocabulary rows; the loader re-pads for its target."""
    if spec.get("vocab_rows") and true_vocab and spec["shape"][0] > true_vocab:
        return {**spec, "shape": [true_vocab, *spec["shape"][1:]]}
    return spec
