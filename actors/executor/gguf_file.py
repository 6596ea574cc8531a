"""A GGUF file's metadata and tensor table, read in one pass over its header.

The `gguf` package's reader makes a numpy view for every part of every metadata value: the
embedded model's vocabulary and merges (~100,000 strings) took it over 2 s, paid by every
worker start and by the Tokenizer's. Here the header is unpacked with `struct` straight into
Python values; the tensors stay views into a read-only memory map, shaped as the `gguf`
package's dequantizer expects them (quantized types as rows of bytes).

Versions 2 and 3, little-endian. Malformed input raises `ValueError` naming what is wrong.

`dequantize` computes Q4_1 and Q8_0 (the embedded model's types) over whole tensors, in
bounded pieces, with the same float32 operations as the `gguf` package, so the values are
bit-equal; its row-group loop took twice as long. Other types, the K-quants among them, go to
the `gguf` package (its Q4_K, Q6_K and Q5_K take 1.3, 2.6 and 3.5 times its Q4_1's time).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quant_shape_to_byte_shape

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_ARRAY_DEPTH = 4  # arrays of arrays nest this deep at most (real files: 1)

# value type -> struct format of one item (8: string, 9: array are read apart)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY = 8, 9
# plain (unquantized) tensor types and their numpy item type
_PLAIN = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
          GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True, eq=False)  # equality over arrays means nothing here
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # as the file lists it (innermost first)
    data: np.ndarray  # numpy order; quantized types as rows of bytes


class GGUFFile:
    """`fields`: every metadata key with its value (arrays as lists); `tensors`: in file order."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._map = np.memmap(self.path, mode="r")
        self._buf = memoryview(self._map)
        self._pos = 0
        if bytes(self._take(4)) != MAGIC:
            raise ValueError("not a GGUF file (bad magic)")
        version = self._unpack("I")
        if version not in VERSIONS:
            raise ValueError(f"GGUF version {version} is not supported (only {VERSIONS}; a "
                             f"big-endian file reads as a huge version)")
        tensor_count, kv_count = self._unpack("Q"), self._unpack("Q")
        self.fields: dict[str, Any] = {}
        for _ in range(self._count(kv_count, 13)):  # a key's length, its type, a value
            key = self._string()
            if key in self.fields:
                raise ValueError(f"metadata key {key!r} appears twice")
            self.fields[key] = self._value(self._unpack("I"))
        infos = [self._tensor_info() for _ in range(self._count(tensor_count, 24))]
        alignment = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment!r} is not a power of two")
        start = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("a tensor name appears twice")

    # -- the header ------------------------------------------------------------------------

    def _take(self, size: int) -> memoryview:
        end = self._pos + size
        if size < 0 or end > len(self._buf):
            raise ValueError(f"truncated: {size} bytes wanted at offset {self._pos}, "
                             f"the file has {len(self._buf)}")
        view = self._buf[self._pos:end]
        self._pos = end
        return view

    def _unpack(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        return struct.unpack("<" + fmt, self._take(size))[0]

    def _count(self, count: int, least_bytes_each: int) -> int:
        """`count` items, refused at once when even the smallest could not fit in the file."""
        if count * least_bytes_each > len(self._buf) - self._pos:
            raise ValueError(f"a count of {count} at offset {self._pos} overruns the file")
        return count

    def _string(self) -> str:
        size = self._unpack("Q")
        try:
            return str(self._take(size), "utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"a string at offset {self._pos - size} is not UTF-8") from exc

    def _value(self, kind: int, depth: int = 0) -> Any:
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item_kind, count = self._unpack("I"), self._unpack("Q")
            if item_kind in _SCALARS:
                item = _SCALARS[item_kind]
                fmt = f"<{self._count(count, struct.calcsize(item))}{item}"
                return list(struct.unpack(fmt, self._take(struct.calcsize(fmt))))
            if item_kind == _STRING:
                return [self._string() for _ in range(self._count(count, 8))]
            if item_kind == _ARRAY:
                if depth >= MAX_ARRAY_DEPTH:
                    raise ValueError(f"arrays nest deeper than {MAX_ARRAY_DEPTH} at offset "
                                     f"{self._pos}")
                return [self._value(_ARRAY, depth + 1) for _ in range(self._count(count, 12))]
            raise ValueError(f"an array of value type {item_kind} at offset {self._pos}")
        raise ValueError(f"value type {kind} at offset {self._pos} is not a GGUF type")

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        dims = self._unpack("I")
        if dims > 8:
            raise ValueError(f"tensor {name!r} has {dims} dimensions")
        shape = tuple(self._unpack("Q") for _ in range(dims))
        return name, shape, self._unpack("I"), self._unpack("Q")

    def _tensor(self, start: int, name: str, shape: tuple[int, ...], kind: int,
                offset: int) -> GGUFTensor:
        try:
            qtype = GGMLQuantizationType(kind)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ValueError(f"tensor {name!r} has unknown type {kind}") from None
        count = math.prod(shape)  # exact: a shape that overflows 64 bits is refused below
        np_shape = tuple(reversed(shape))
        if qtype in _PLAIN:
            item, items = _PLAIN[qtype], count
        else:
            if shape and shape[0] % block:  # blocks run along the innermost dimension
                raise ValueError(f"tensor {name!r}: rows of {shape[0]} values are not whole "
                                 f"{qtype.name} blocks of {block}")
            item, items = np.uint8, count // block * type_size
            np_shape = quant_shape_to_byte_shape(np_shape, qtype)
        begin = start + offset
        end = begin + items * np.dtype(item).itemsize
        if end > len(self._map):  # begin <= end
            raise ValueError(f"tensor {name!r} ends past the end of the file")
        data = self._map[begin:end].view(item).reshape(np_shape)
        return GGUFTensor(name, qtype, shape, np.asarray(data))


_PIECE_BLOCKS = 1 << 16  # blocks dequantized at a time: bounds the temporaries


def dequantize(tensor: GGUFTensor) -> np.ndarray:
    """The tensor's values as float32, in numpy order (F32 as stored, F16 widened; the types
    the `gguf` package cannot dequantize raise its `NotImplementedError`)."""
    kind = tensor.tensor_type
    if kind not in (GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0):
        return gguf_dequantize(tensor.data, kind)
    block, type_size = GGML_QUANT_SIZES[kind]
    data = tensor.data
    blocks = data.reshape(-1, type_size)
    out = np.empty((blocks.shape[0], block), np.float32)
    for start in range(0, blocks.shape[0], _PIECE_BLOCKS):
        piece, values = blocks[start:start + _PIECE_BLOCKS], out[start:start + _PIECE_BLOCKS]
        scale = _halves(piece, 0)
        if kind is GGMLQuantizationType.Q4_1:  # scale, minimum, 16 bytes of two nibbles each
            quants = piece[:, 4:]
            values[:, :block // 2] = quants & 0x0F
            values[:, block // 2:] = quants >> 4
            values *= scale
            values += _halves(piece, 2)
        else:  # Q8_0: scale, 32 signed bytes
            values[:] = piece[:, 2:].view(np.int8)
            values *= scale
    return out.reshape(*data.shape[:-1], data.shape[-1] // type_size * block)


def _halves(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The float16 at `offset` of each block, as a float32 column."""
    return np.ascontiguousarray(blocks[:, offset:offset + 2]).view(np.float16).astype(np.float32)
