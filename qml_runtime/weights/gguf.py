"""A memory-mapped GGUF reader: metadata, tensor infos, and tensor data.

Layout (little-endian, ggml docs/gguf.md): magic "GGUF", version, tensor count,
metadata count, the metadata key/values, the tensor infos, padding to
``general.alignment`` (32 by default), then the tensor data. Tensor dims are in
ggml ``ne`` order (``dims[0]`` is the contiguous axis); ``GGUFTensor.shape`` gives
them reversed, in torch order.
"""

from __future__ import annotations

import mmap
import os
import struct
import warnings
from dataclasses import dataclass
from math import prod
from typing import Any

import numpy as np
import torch

from qml_kernels.ggml_types import GGMLType, tensor_nbytes
from qml_kernels.gguf_dequant import dequantize, dequantize_ref

GGUF_MAGIC = 0x46554747  # b"GGUF" read as a little-endian u32
DEFAULT_ALIGNMENT = 32

# metadata value type id -> struct format of a scalar (strings and arrays are handled apart)
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY_TYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
                6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """The file is not a GGUF file this reader understands."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    qtype: GGMLType
    shape: tuple[int, ...]  # torch order: the last axis is contiguous in the file
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def n_elements(self) -> int:
        return prod(self.shape)


class _Cursor:
    """Sequential little-endian reads over a buffer, with bounds checks."""

    def __init__(self, buf, path: str):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise GGUFError(f"{self.path}: truncated header (wanted {n} bytes at offset {self.pos})")
        view = memoryview(self.buf)[self.pos:self.pos + n]
        self.pos += n
        return view

    def scalar(self, fmt: str):
        size = struct.calcsize("<" + fmt)
        return struct.unpack_from("<" + fmt, self.take(size))[0]

    def string(self) -> str:
        n = self.scalar("Q")
        return bytes(self.take(n)).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALAR_FORMATS:
            return self.scalar(_SCALAR_FORMATS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar("I"), self.scalar("Q")
            if etype in _NUMPY_TYPES:
                # numeric arrays (token types, scores) are read in one go, not element by element
                dt = np.dtype(_NUMPY_TYPES[etype]).newbyteorder("<")
                arr = np.frombuffer(self.take(count * dt.itemsize), dtype=dt)
                return arr.tolist()
            return [self.value(etype) for _ in range(count)]
        raise GGUFError(f"{self.path}: unknown metadata value type {vtype} at offset {self.pos}")


class GGUFFile:
    """An open GGUF file. ``metadata`` maps keys to Python values; ``tensors`` maps names to infos.

    Tensor bytes are not read until asked for: ``raw(name)`` is a zero-copy uint8 view
    of the mapped file, ``load(name)`` dequantizes to a torch tensor.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                raise GGUFError(f"{self.path}: empty file")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        cur = _Cursor(self._map, self.path)
        if cur.scalar("I") != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (bad magic)")
        self.version = cur.scalar("I")
        if self.version not in (2, 3):
            raise GGUFError(f"{self.path}: GGUF version {self.version} is not supported (2 and 3 are)")
        n_tensors, n_kv = cur.scalar("Q"), cur.scalar("Q")

        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.scalar("I"))

        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar("I")
            dims = [cur.scalar("Q") for _ in range(n_dims)]
            qtype_id, rel_offset = cur.scalar("I"), cur.scalar("Q")
            try:
                qtype = GGMLType(qtype_id)
            except ValueError:
                raise GGUFError(f"{self.path}: tensor {name!r} has unknown ggml type {qtype_id}") from None
            infos.append((name, qtype, tuple(reversed(dims)), rel_offset))

        align = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-cur.pos // align) * align
        self.tensors: dict[str, GGUFTensor] = {}
        for name, qtype, shape, rel_offset in infos:
            nbytes = tensor_nbytes(qtype, prod(shape))
            t = GGUFTensor(name, qtype, shape, data_start + rel_offset, nbytes)
            if t.offset + nbytes > len(self._map):
                raise GGUFError(f"{self.path}: tensor {name!r} runs past the end of the file (truncated?)")
            self.tensors[name] = t

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def arch_get(self, key: str, default: Any = None) -> Any:
        """A key under the architecture's namespace, e.g. ``arch_get("block_count")``."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def names(self) -> list[str]:
        return list(self.tensors)

    def raw(self, name: str) -> torch.Tensor:
        t = self.tensors[name]
        arr = np.frombuffer(self._map, dtype=np.uint8, count=t.nbytes, offset=t.offset)
        # the map is read-only; torch warns about that, but nothing writes through this view
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return torch.from_numpy(arr)

    def load(self, name: str, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
        """Dequantize ``name`` to ``dtype`` on ``device``.

        On a GPU the quantized bytes are copied over (3-4x fewer than the result) and
        decoded there by the dispatched kernel; on CPU the vectorised reference runs
        (a forced Triton setting would mean the interpreter: far too slow for weights).
        """
        t = self.tensors[name]
        device = torch.device(device)
        if device.type == "cpu":
            return dequantize_ref(self.raw(name), t.qtype, t.shape, dtype)
        return dequantize(self.raw(name).to(device), t.qtype, t.shape, dtype)

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:
            pass  # tensors still view the map; it is released when they are

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

