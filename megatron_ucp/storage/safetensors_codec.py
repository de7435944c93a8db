"""The safetensors codec: the dtype table and the header (built from known shapes, parsed and
checked against the file's size). `writer.SafetensorsWriter` streams a file with it.

safetensors layout (https://github.com/huggingface/safetensors): 8-byte little-endian header length
N, N bytes of JSON header {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__":
{str: str}}, then the raw little-endian tensor bytes. Writing the header first from the known
shapes lets us stream one tensor at a time instead of holding the whole file in memory.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable

import torch

DTYPE_TO_ST = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    # blockwise FP8 Hugging Face weights (formats/hf/fp8.py); e5m2 so that its refusal is the HF reader's
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
ST_TO_DTYPE = {v: k for k, v in DTYPE_TO_ST.items()}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
NAME_TO_DTYPE = {v: k for k, v in DTYPE_NAMES.items()}

# a parsed header entry: (dtype, shape, begin, end) with begin/end absolute offsets in the file
Entry = tuple[torch.dtype, tuple[int, ...], int, int]


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's raw bytes without a copy (a copy only if it is not contiguous). Host tensors
    only: device state reaches files through `megatron_ucp.staging`."""
    if t.device.type != "cpu":
        raise ValueError(f"a {t.device} tensor reached the file writer; stage it to host memory "
                         "first (megatron_ucp.staging.HostStager)")
    t = t.detach().contiguous()
    return memoryview(t.view(torch.uint8).reshape(-1).numpy())


TensorSpec = tuple[torch.dtype, tuple[int, ...]]  # a tensor's dtype and shape


def encode_header(entries: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
                  metadata: dict[str, str] | None = None
                  ) -> tuple[bytes, int, list[str], dict[str, TensorSpec]]:
    """(the file's first bytes: length and JSON header padded to 8 bytes, the data's byte count,
    the tensor names in file order, name -> (dtype, shape))."""
    order: list[str] = []
    expected: dict[str, TensorSpec] = {}
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, dtype, shape in entries:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": DTYPE_TO_ST[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        order.append(name)
        expected[name] = (dtype, tuple(shape))
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, offset, order, expected


def header_length(first: bytes, size: int, bad) -> int:
    """The header's byte count from a file's first bytes (`bad(why)` makes the error to raise)."""
    if len(first) < 8:
        raise bad(f"{size} bytes, shorter than a safetensors header")
    (n,) = struct.unpack("<Q", first[:8])
    if 8 + n > size:
        raise bad(f"its header claims {n} bytes but the object holds {size}")
    return n


def parse_header(raw: bytes, size: int, bad) -> tuple[dict[str, str], dict[str, Entry]]:
    """(metadata, name -> entry) of a JSON header of `len(raw)` bytes in a file of `size` bytes,
    each entry checked to lie inside the file and to have a known dtype."""
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad(f"header is not JSON ({e})") from None
    meta = header.pop("__metadata__", None) or {}
    start = 8 + len(raw)
    entries: dict[str, Entry] = {}
    for key, e in header.items():
        begin, end = e["data_offsets"]
        if e["dtype"] not in ST_TO_DTYPE or start + end > size or begin > end:
            raise bad(f"tensor {key!r} lies outside the object or has dtype {e['dtype']}")
        entries[key] = (ST_TO_DTYPE[e["dtype"]], tuple(e["shape"]), start + begin, start + end)
    return meta, entries
