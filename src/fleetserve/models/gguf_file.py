"""A lean GGUF header reader: metadata scalars and tensor locations, tensor bytes memory-mapped.

`gguf.GGUFReader` builds numpy views for every element of every metadata array; on a 49k-token
vocabulary that is ~4 s per open. The engine needs the arrays (tokens, merges) only for the
one-time tokenizer conversion, which transformers does by itself, so this reader steps over
them. Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (little-endian only).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32

# value type id -> struct format of one scalar
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (GGUF lists dims innermost first)
    qtype: int  # gguf.GGMLQuantizationType value
    data: np.ndarray  # raw bytes [rows, bytes_per_row] (or the float view for F32)


class _Cursor:
    def __init__(self, buf: Any) -> None:
        self.buf = buf
        self.pos = 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("Q")
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int, keep_arrays: bool) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype != _ARRAY:
            raise ValueError(f"unknown GGUF value type {vtype} at byte {self.pos}")
        etype, count = self.scalar("I"), self.scalar("Q")
        if etype in _SCALARS and not keep_arrays:
            self.pos += count * struct.calcsize(_SCALARS[etype])  # skipped, not parsed
            return None
        if etype == _STRING and not keep_arrays:
            for _ in range(count):
                self.pos += 8 + struct.unpack_from("<Q", self.buf, self.pos)[0]
            return None
        return [self.value(etype, keep_arrays) for _ in range(count)]


def _bytes_per_row(qtype: int, row_elements: int) -> int:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    if row_elements % block:
        raise ValueError(f"row of {row_elements} elements is not a multiple of block {block}")
    return row_elements // block * size


def read_gguf(path: str, max_array_len: int = 64) -> tuple[dict[str, Any], list[GGUFTensorInfo]]:
    """(metadata, tensors) of a GGUF file; arrays longer than `max_array_len` read as None."""
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(buf)
    if bytes(buf[:4]) != _MAGIC:
        raise ValueError(f"{path} is not a GGUF file (bad magic)")
    cur.pos = 4
    version = cur.scalar("I")
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version} is too old; version 2+ is supported")
    num_tensors, num_kv = cur.scalar("Q"), cur.scalar("Q")
    meta: dict[str, Any] = {}
    for _ in range(num_kv):
        key = cur.string()
        vtype = cur.scalar("I")
        if vtype == _ARRAY:
            # Peek at the length: small arrays (e.g. languages) are kept, vocabularies are not.
            count = struct.unpack_from("<Q", buf, cur.pos + 4)[0]
            meta[key] = cur.value(vtype, keep_arrays=count <= max_array_len)
        else:
            meta[key] = cur.value(vtype, keep_arrays=True)
    infos = []
    for _ in range(num_tensors):
        name = cur.string()
        dims = [cur.scalar("Q") for _ in range(cur.scalar("I"))]
        qtype, offset = cur.scalar("I"), cur.scalar("Q")
        infos.append((name, dims, qtype, offset))
    alignment = int(meta.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-cur.pos // alignment) * alignment
    # np.memmap keeps its own mapping alive; the header mmap can go.
    whole = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = []
    for name, dims, qtype, offset in infos:
        row_bytes = _bytes_per_row(qtype, dims[0])
        num_rows = int(np.prod(dims[1:])) if len(dims) > 1 else 1
        start = data_start + offset
        flat = whole[start : start + row_bytes * num_rows]
        raw = flat if len(dims) == 1 else flat.reshape(num_rows, row_bytes)
        tensors.append(GGUFTensorInfo(name, tuple(reversed(dims)), qtype, raw))
    buf.close()
    return meta, tensors
