"""`fragments`: what `megatron_ucp.save` writes. One safetensors file per rank (its optimizer
shard of every parameter it owns, no gathering) and a manifest that indexes them."""

from __future__ import annotations

from pathlib import Path

from megatron_ucp.formats import manifest as mf
from megatron_ucp.formats.fragments.index import (
    Record,
    build_index,
    check_tiling,
    index_part,
    merge_specs,
    part_records,
)
from megatron_ucp.formats.fragments.rank_file import Fragment, rank_file_name, write_rank_file
from megatron_ucp.formats.fragments.source import FragmentSource

NAME = "fragments"
SOURCES = (FragmentSource,)


def from_manifest(ckpt: Path, manifest: mf.Manifest, verify_checksums: bool = True,
                  verify_fragments: bool = False, **_: object) -> FragmentSource:
    return FragmentSource(ckpt, manifest, verify_checksums, verify_fragments)


__all__ = ["NAME", "SOURCES", "from_manifest", "FragmentSource", "Fragment", "Record",
           "build_index", "check_tiling", "index_part", "merge_specs", "part_records",
           "rank_file_name", "write_rank_file"]
