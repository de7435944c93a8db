"""crc32 of tensors: one, many in threads, and two combined without reading their bytes again."""

from __future__ import annotations

import functools
import os
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch

from megatron_ucp.storage.safetensors_codec import tensor_bytes


def crc32(t: torch.Tensor) -> int:
    return zlib.crc32(tensor_bytes(t))


def crc32_many(tensors: list[torch.Tensor], workers: int | None = None) -> list[int]:
    """crc32 of each tensor, computed by a few threads (zlib releases the GIL on large buffers):
    a rank file's checksums go into its header, so they are all needed before its first byte."""
    workers = workers or min(8, os.cpu_count() or 1)
    if workers <= 1 or len(tensors) <= 1:
        return [crc32(t) for t in tensors]
    with ThreadPoolExecutor(workers, thread_name_prefix="megatron-ucp-crc") as pool:
        return list(pool.map(crc32, tensors))


def _gf2_times(matrix: list[int], vector: int) -> int:
    total, i = 0, 0
    while vector:
        if vector & 1:
            total ^= matrix[i]
        vector >>= 1
        i += 1
    return total


def _squared(op: list[int]) -> list[int]:
    """An operator applied twice: twice the zeros appended."""
    return [_gf2_times(op, op[n]) for n in range(32)]


_ONE_ZERO_BIT = [0xEDB88320] + [1 << n for n in range(31)]  # crc32's polynomial, reflected


@functools.cache  # (deterministic: threads racing on it compute the same operator)
def _zero_bytes_operator(k: int) -> list[int]:
    """The operator that appends 2**k zero bytes (one byte: one zero bit squared three times)."""
    return _squared(_zero_bytes_operator(k - 1) if k else _squared(_squared(_ONE_ZERO_BIT)))


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """crc32 of A + B from crc32(A), crc32(B) and len(B) (zlib's crc32_combine, which Python's zlib
    does not expose): a tensor written from several checked fragments gets its checksum without
    reading its bytes again. One 32x32 GF(2) product per set bit of len2 (the operators for 2**k
    zero bytes are built once)."""
    k = 0
    while len2 > 0:
        if len2 & 1:
            crc1 = _gf2_times(_zero_bytes_operator(k), crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2
