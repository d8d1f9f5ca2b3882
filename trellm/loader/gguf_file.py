"""A lean GGUF parser: metadata as Python values, tensors as zero-copy numpy views.

``gguf.GGUFReader`` builds a numpy memmap view per metadata element, which takes
~7 s for a 49k-token vocabulary on a 2-core machine; this reads the same header in
well under a second. Tensor bytes are left in the memory map and handed to
``gguf.quants.dequantize`` unchanged, so the arithmetic is the gguf package's.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_SCALARS = {  # GGUF value type -> struct format
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d",
}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
_PLAIN_DTYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                 GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                 GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                 GGMLQuantizationType.I64: np.int64}


class GGUFFormatError(ValueError):
    pass


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: np.ndarray
    """ggml order (fastest-varying first), a numpy array as GGUFReader reports it."""
    tensor_type: GGMLQuantizationType
    data: np.ndarray
    """Row-major view: plain types as their numpy dtype with shape reversed; quantized
    types as uint8 [rows..., bytes per row] (what gguf.quants.dequantize expects)."""


@dataclass(frozen=True)
class GGUFFile:
    version: int
    fields: dict[str, Any]
    tensors: list[GGUFTensor]


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str):
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.buf):
            raise GGUFFormatError("file ends inside its header")
        (v,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return v

    def string(self) -> str:
        n = self.scalar("Q")
        if self.pos + n > len(self.buf):
            raise GGUFFormatError("a string runs past the end of the file")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar("I"), self.scalar("Q")
            if etype in _NUMPY:
                dt = np.dtype(_NUMPY[etype]).newbyteorder("<")
                end = self.pos + count * dt.itemsize
                if end > len(self.buf):
                    raise GGUFFormatError("an array runs past the end of the file")
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos).tolist()
                self.pos = end
                return arr
            return [self.value(etype) for _ in range(count)]
        raise GGUFFormatError(f"unknown metadata value type {vtype}")


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF file's header and map its tensors (little-endian files only)."""
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(mm))
    if bytes(mm[:4]) != _MAGIC:
        raise GGUFFormatError("not a GGUF file (bad magic bytes)")
    cur.pos = 4
    version = cur.scalar("I")
    if version not in (2, 3):
        raise GGUFFormatError(f"unsupported GGUF version {version}")
    n_tensors, n_kv = cur.scalar("Q"), cur.scalar("Q")
    fields: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        fields[key] = cur.value(cur.scalar("I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = tuple(cur.scalar("Q") for _ in range(cur.scalar("I")))
        infos.append((name, dims, cur.scalar("I"), cur.scalar("Q")))
    align = fields.get("general.alignment", 32)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        # The spec asks for a power of two; anything else misplaces every tensor.
        raise GGUFFormatError(f"general.alignment must be a positive power of two, got {align!r:.40}")
    start = (cur.pos + align - 1) // align * align
    tensors = [_tensor(mm, start, *info) for info in infos]
    return GGUFFile(version, fields, tensors)


def _tensor(mm: np.ndarray, start: int, name: str, dims: tuple[int, ...], tcode: int, offset: int) -> GGUFTensor:
    try:
        ttype = GGMLQuantizationType(tcode)
    except ValueError:
        raise GGUFFormatError(f"tensor {name} has unknown type {tcode}") from None
    block, type_size = GGML_QUANT_SIZES[ttype]
    n = int(np.prod(dims)) if dims else 1
    nbytes = n // block * type_size
    begin = start + offset
    if begin + nbytes > mm.shape[0]:
        raise GGUFFormatError(f"tensor {name} runs past the end of the file (truncated download?)")
    raw = mm[begin:begin + nbytes]
    rows = tuple(reversed(dims))
    if ttype in _PLAIN_DTYPES:
        data = raw.view(_PLAIN_DTYPES[ttype]).reshape(rows)
    else:  # quantized and BF16: raw bytes per row, as gguf.quants.dequantize expects
        data = raw.reshape(rows[:-1] + (dims[0] // block * type_size,))
    return GGUFTensor(name, np.array(dims, dtype=np.uint64), ttype, data)


class _Field:
    """The one method of ``gguf.ReaderField`` our loaders use."""

    __slots__ = ("_value",)

    def __init__(self, value: Any):
        self._value = value

    def contents(self) -> Any:
        return self._value


class GGUFReaderView:
    """A ``gguf.GGUFReader``-shaped view (``fields[k].contents()``, ``tensors``, ``path``)
    over ``read_gguf``, so code written against the gguf package's reader works unchanged."""

    def __init__(self, path: str | Path):
        f = read_gguf(path)
        self.path = str(path)
        self.version = f.version
        self.fields = {k: _Field(v) for k, v in f.fields.items()}
        self.tensors = f.tensors
