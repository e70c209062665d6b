"""A KV block file's format (the layout: ``kv.disk_store``'s docstring): checking, reading and encoding
one, without torch, so that the disk reader's process (``kv.disk_reader``) starts without importing it.
``DiskStore`` keeps the index, the budget and the writes; ``read_payload`` is its read of one file, and the
reader process's.
"""

from __future__ import annotations

import os
import struct
import threading
import zlib

import numpy as np
import xxhash
import zstandard

MAGIC = b"QMLKVBLK"
VERSION = 1  # raw payload; VERSION_ENCODED: the payload as ``_encode`` writes it
VERSION_ENCODED = 2
_CODEC = struct.Struct("<HHIQ")  # codec, element_size, reserved, logical_size
CODEC_HALVES_ZSTD = 1
_HALF = {2: (np.uint16, np.uint8, 8), 4: (np.uint32, np.uint16, 16)}  # element, half, shift
ENCODABLE_SIZES = tuple(_HALF)  # the element sizes a store can encode (``DiskStore(element_size=...)``)
ALIGN = 4096
_HEADER = struct.Struct("<8sHHIQ32s32s32s16sI")
HEADER_SIZE = _HEADER.size  # 140
_MAX_TOKENS = 1 << 16  # blocks hold tens of tokens; a larger count means a damaged header


class _Corrupt(Exception):
    """A file to delete and serve as a miss; the message says why."""


def payload_offset(token_count: int) -> int:
    return -(-(HEADER_SIZE + 4 * token_count) // ALIGN) * ALIGN


def _pread_into(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise _Corrupt("file shorter than its header says")
        done += n


def _kv_bytes(raw: bytes | bytearray) -> int:
    """The KV bytes a whole file read unchecked stands for: its decoded size (version 2), else its size."""
    if len(raw) >= HEADER_SIZE and raw[:8] == MAGIC:
        _, version, _, n, *_ = _HEADER.unpack_from(raw)
        off = payload_offset(n)
        if version == VERSION_ENCODED and len(raw) >= off + _CODEC.size:
            return _CODEC.unpack_from(raw, off)[3]
    return len(raw)


_zstd = threading.local()  # (compressor, decompressor) per thread: zstd contexts are not thread-safe


def _contexts() -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
    if not hasattr(_zstd, "pair"):
        # the high halves repeat no long strings: a tiny match search (hash_log 6, min_match 7) leaves
        # zstd's entropy coder doing the work, ~3x faster than level 1 and a slightly better ratio
        params = zstandard.ZstdCompressionParameters.from_level(1, min_match=7, hash_log=6, chain_log=6,
                                                                search_log=1)
        _zstd.pair = zstandard.ZstdCompressor(compression_params=params), zstandard.ZstdDecompressor()
    return _zstd.pair


def _encode(data: memoryview, element_size: int) -> list | None:
    """Version 2's payload for ``data`` as the parts to write ([codec header, low halves, frame]), or
    None when it would not be smaller than the raw bytes."""
    whole, half, shift = _HALF[element_size]
    if data.nbytes % element_size:
        return None
    x = np.frombuffer(data, dtype=whole)
    low = (x & ((1 << shift) - 1)).astype(half)
    frame = _contexts()[0].compress((x >> shift).astype(half).data)
    if _CODEC.size + low.nbytes + len(frame) >= data.nbytes:
        return None
    return [_CODEC.pack(CODEC_HALVES_ZSTD, element_size, 0, data.nbytes), low.data, frame]


def _decode_into(payload: memoryview, out: memoryview) -> None:
    """Version 2's payload into ``out`` (its logical size); raises _Corrupt on anything inconsistent
    (the checksum has passed, so only a writer's bug or a forged file gets here)."""
    if payload.nbytes < _CODEC.size:
        raise _Corrupt("encoded payload shorter than its codec header")
    codec, element_size, _, logical = _CODEC.unpack_from(payload)
    if codec != CODEC_HALVES_ZSTD or element_size not in _HALF or logical != out.nbytes or logical % element_size:
        raise _Corrupt(f"codec {codec}, element size {element_size}, {logical} bytes: not decodable here")
    whole, half, shift = _HALF[element_size]
    n_low = logical // 2
    low = np.frombuffer(payload, dtype=half, count=logical // element_size, offset=_CODEC.size)
    try:
        high = _contexts()[1].decompress(payload[_CODEC.size + n_low:], max_output_size=n_low)
    except zstandard.ZstdError as e:
        raise _Corrupt(f"zstd: {e}") from None
    if len(high) != n_low:
        raise _Corrupt(f"high halves decode to {len(high)} bytes, expected {n_low}")
    x = np.frombuffer(out, dtype=whole)
    np.left_shift(np.frombuffer(high, dtype=half), shift, out=x, dtype=whole)
    np.bitwise_or(x, low, out=x)


def check_header(raw: bytes, fingerprint: bytes, block_hash: bytes, file_size: int) -> tuple[int, int, bytes, int]:
    """(token_count, payload_size, checksum, version) of a valid header; raises _Corrupt otherwise."""
    if len(raw) < HEADER_SIZE:
        raise _Corrupt("truncated header")
    magic, version, hsize, n, psize, fp, bh, _parent, checksum, crc = _HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise _Corrupt("bad magic")
    if version not in (VERSION, VERSION_ENCODED) or hsize != HEADER_SIZE:
        raise _Corrupt(f"format version {version}, this build reads {VERSION} and {VERSION_ENCODED}")
    if zlib.crc32(raw[:HEADER_SIZE - 4]) != crc:
        raise _Corrupt("header CRC mismatch")
    if fp != fingerprint:
        raise _Corrupt("model fingerprint mismatch")
    if bh != block_hash:
        raise _Corrupt("block hash differs from the file name")
    if n > _MAX_TOKENS or payload_offset(n) + psize != file_size:
        raise _Corrupt(f"file is {file_size} bytes, its header says {payload_offset(n) + psize}")
    return n, psize, checksum, version


def read_payload(fd: int, file_size: int, fingerprint: bytes, block_hash: bytes, tokens: bytes,
                 out: memoryview | None, alloc=None) -> tuple[object, memoryview, int]:
    """Check the block file open on ``fd`` (``file_size`` bytes) and read its KV into ``out`` (a byte view of
    exactly the KV's size), or into ``alloc(n)``'s (buffer, byte view) when ``out`` is None. ``tokens``: the
    request's, packed as the file stores them (uint32 little-endian). Returns (the buffer, its view, bytes
    read from the file). Raises ``_Corrupt`` (delete the file, serve a miss), OSError, or ValueError when
    ``out`` has the wrong size for a valid file (the caller's mistake, not the file's)."""
    prefix = os.pread(fd, ALIGN, 0)  # header and tokens in one read, up to 988 tokens
    n, psize, checksum, version = check_header(prefix, fingerprint, block_hash, file_size)
    off = payload_offset(n)
    if off > len(prefix):
        prefix = os.pread(fd, off, 0)
    if len(prefix) != off:
        raise _Corrupt("file shrank while being read")
    if prefix[HEADER_SIZE:HEADER_SIZE + 4 * n] != tokens:
        raise _Corrupt("stored tokens differ from the request's (hash collision or stale key)")
    h = xxhash.xxh3_128(prefix[HEADER_SIZE:])
    buf = out
    if version == VERSION_ENCODED:
        encoded = memoryview(bytearray(psize))
        _pread_into(fd, encoded, off)
        h.update(encoded)
        if h.digest() != checksum:
            raise _Corrupt("payload checksum mismatch")
        logical = _CODEC.unpack_from(encoded)[3] if psize >= _CODEC.size else -1
        if not 0 <= logical <= 2 * (psize - _CODEC.size):  # the low halves alone are half of it
            raise _Corrupt(f"codec header says {logical} bytes of KV in a {psize}-byte payload")
        if out is None:
            buf, out = alloc(logical)
        elif out.nbytes != logical:
            raise ValueError(f"out has {out.nbytes} bytes, the block's KV {logical}")
        _decode_into(encoded, out)
    else:
        if out is None:
            buf, out = alloc(psize)
        elif out.nbytes != psize:
            raise ValueError(f"out has {out.nbytes} bytes, the block's payload {psize}")
        _pread_into(fd, out, off)
        h.update(out)
        if h.digest() != checksum:
            raise _Corrupt("payload checksum mismatch")
    return buf, out, off + psize
