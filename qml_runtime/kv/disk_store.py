"""The local-disk KV tier: one file per full KV block, surviving restarts.

Files live in ``root/<hex of fingerprint[:8]>/`` so that models and KV layouts never mix, and
are named ``<hex of block hash>.kvb``: the engine's chained digest, never a client string. An
exclusive ``flock`` on ``.lock`` makes one store the directory's owner (the startup scan
deletes temp files, and two owners would fight over the budget). Format, little-endian::

    offset size  field
         0    8  magic          b"QMLKVBLK"
         8    2  version        1 (raw payload) or 2 (encoded payload, below)
        10    2  header_size    140
        12    4  token_count    n
        16    8  payload_size   bytes of KV payload
        24   32  fingerprint    model + KV layout (dtype, block size, layers, heads, head dim)
        56   32  block_hash     equals the file name
        88   32  parent_hash    previous block of the chain (zeros for the first, or when the
                                writer did not know it); for tooling, never checked on a read
       120   16  checksum       xxh3_128 over bytes [140, end of file)
       136    4  header_crc     crc32 over bytes [0, 136)
       140   4n  tokens         uint32, then zero padding up to align_up(140 + 4n, 4096)
    that offset  payload        payload_size bytes, ending the file: version 1, the KV tensor's raw bytes

Every byte is covered, the header by its CRC (which includes the checksum field) and the rest
by the checksum. The 4 KiB-aligned payload (0.2% of a 2 MiB block) lets a later O_DIRECT or
GPUDirect Storage reader DMA straight into its buffer.

Version 2 (a store opened with ``element_size`` 2 or 4, as the engine's is): the payload is encoded, so
that a restart reads fewer bytes from the disk, its slowest tier (the H200 host's: 1.3-1.5 GB/s cold,
against ~26k tokens/s of prefill, so a restore after a restart recomputes most of a history). KV
values are 16-bit floats (or 32-bit): their high halves (sign, exponent, top of the mantissa) take few
values, their low halves are noise. So each element is split, the low halves are stored as they are
and the high halves compressed with zstd (fast settings, no long matches to look for)::

    offset size  field                 (from the payload's start)
         0    2  codec                 1: low halves raw, then high halves zstd-compressed
         2    2  element_size          2 or 4 bytes
         4    4  reserved              0
         8    8  logical_size          bytes of the KV tensor once decoded
        16   L/2 low halves            of each element, in order (uint8 or uint16 little-endian)
     16+L/2    .  zstd frame            the high halves, in order

Measured on CPU (``benchmarks/disk_codec_cpu.py``): bf16 KV (SmolLM2's, or Gaussian values) stores in
1.44-1.49x fewer bytes, fp16 1.14x, fp32 1.11x; one core decodes 2.5-4 GB/s of KV and encodes
1.3-2.5 GB/s. A block the codec does not shrink is written as version 1.

Crash consistency: ``put`` writes ``.<hash>.<pid>-<n>.tmp`` beside the final name, fsyncs it,
renames it (atomic) and fsyncs the directory (a rename is not durable before that: Pillai et
al., OSDI'14). So a final name always holds a complete file, a True ``put`` survives power
loss, and a crash leaves at worst a temp file for the next startup to delete. Evictions and
recency (file mtimes) are not fsynced: a lost unlink brings back a valid file, and the scan
re-applies the budget. Past that nothing on disk is trusted: a read checks the header, the
exact size, the tokens against the request (a hash collision must not return someone else's
KV) and the checksum; whatever fails is deleted and served as a miss. The checksum catches
corruption, not forgery: the directory is 0700, the files 0600.

Concurrency: the index (LRU-ordered, the in-memory manifest) is rebuilt from the directory at
startup; no manifest file exists to disagree with it. One lock guards it. Data IO runs outside
the lock, so writer threads and the engine thread overlap; renames and unlinks run under it,
so a reader that found a damaged file never deletes a fresh copy renamed in meanwhile.
"""

from __future__ import annotations

import fcntl
import itertools
import logging
import os
import re
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import xxhash

from qml_runtime.kv.block_file import (ENCODABLE_SIZES, HEADER_SIZE, MAGIC, VERSION, VERSION_ENCODED, _HEADER,
                                       _MAX_TOKENS, _Corrupt, _encode, _kv_bytes, check_header, payload_offset,
                                       read_payload)

log = logging.getLogger("qml.kv.disk")

SUFFIX = ".kvb"
_NAME = re.compile(r"[0-9a-f]{64}" + re.escape(SUFFIX))
_TEMP = re.compile(r"\.[0-9a-f]{64}\.\d+-\d+\.tmp")
_LOCK_NAME = ".lock"
# the restore planner's measured rates (qml_runtime.kv.tiers), kept beside the blocks; with its temp file
RATES_NAME = "planner-rates.json"
# the server keeps its replies' generated ids beside the blocks (qml_server.replies_store)
REPLIES_DIR_NAME = "replies"
_SIDE_NAMES = frozenset((_LOCK_NAME, RATES_NAME, RATES_NAME + ".tmp", REPLIES_DIR_NAME))

Bytes = torch.Tensor | bytes | bytearray | memoryview


class StoreBusy(RuntimeError):
    """Another DiskStore, in this process or another, owns the directory."""


def _byte_view(data: Bytes) -> memoryview:
    """A flat byte view of ``data``, without copying."""
    if isinstance(data, torch.Tensor):
        if data.device.type != "cpu" or not data.is_contiguous():
            raise ValueError("the disk store takes contiguous CPU tensors")
        return memoryview(data.detach().reshape(-1).view(torch.uint8).numpy())  # uint8: numpy has no bf16
    return memoryview(data).cast("B")


def _encode_tokens(tokens: Sequence[int]) -> bytes:
    arr = np.asarray(tokens, dtype=np.int64).reshape(-1)
    if len(arr) > _MAX_TOKENS or (arr.size and (arr.min() < 0 or arr.max() >= 1 << 32)):
        raise ValueError("token ids must fit in uint32, at most 65536 per block")
    return arr.astype("<u4").tobytes()  # (the files' byte order on any machine)


def _new_buffer(n: int) -> tuple[torch.Tensor, memoryview]:
    buf = torch.empty(n, dtype=torch.uint8)
    return buf, _byte_view(buf)


def _check_key(name: str, key: bytes) -> None:
    if not isinstance(key, bytes) or len(key) != 32:
        raise ValueError(f"{name} must be 32 bytes")


def _unlink(path: Path) -> str:
    """Delete ``path`` if it exists; never raises. Returns '' or why the delete failed."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        return f" (deleting it failed: {e})"
    return ""


def _write_all(fd: int, data: memoryview | bytearray) -> None:
    view, done = memoryview(data), 0
    while done < len(view):
        done += os.write(fd, view[done:])


class DiskStore:
    """KV blocks on local disk under a byte budget (file sizes), evicted least recently used first.

    ``put`` is meant for background writer threads and ``get``/``get_into`` for the engine
    thread; all may run at once. Disk failures (ENOSPC, EIO) and damaged files never raise:
    ``put`` returns False and reads miss. Wrong arguments (a hash that is not 32 bytes, a GPU
    tensor) raise ValueError. ``StoreBusy`` if another store owns the directory.
    """

    def __init__(self, root: Path | str, fingerprint: bytes, budget_bytes: int, element_size: int = 0):
        """``element_size``: the KV values' bytes (2 for bf16/fp16, 4 for fp32) to write blocks encoded
        (version 2, the module docstring); 0 writes them raw. Both versions are read either way."""
        _check_key("fingerprint", fingerprint)
        if element_size not in (0, *ENCODABLE_SIZES):
            raise ValueError(f"element_size must be 0, 2 or 4, got {element_size}")
        self.fingerprint, self.budget_bytes = fingerprint, int(budget_bytes)
        self.element_size = element_size
        self.dir = Path(root) / fingerprint[:8].hex()
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._lock_file = open(self.dir / _LOCK_NAME, "a+b")  # noqa: SIM115 (held until close())
        try:
            fcntl.flock(self._lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise StoreBusy(f"{self.dir} is in use by another DiskStore") from None
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # block hash -> file size, least recently used first
        self._bytes = 0  # file sizes in the index
        self._reserved = 0  # files being written count against the budget before they exist
        self._last_stamp = 0
        self._seq = itertools.count()
        # bytes_written/bytes_read: of files; kv_bytes_written/kv_bytes_read: of the KV they hold (decoded)
        self._stats = dict.fromkeys(("hits", "misses", "corrupt_deleted", "evictions", "writes",
                                     "write_failures", "bytes_written", "bytes_read", "kv_bytes_written",
                                     "kv_bytes_read", "encoded_writes"), 0)
        self._rebuild()

    def put(self, block_hash: bytes, parent_hash: bytes | None, tokens: Sequence[int], payload: Bytes) -> bool:
        """Store one block durably. True once it is on disk, or if it already was."""
        parent_hash = parent_hash or bytes(32)
        _check_key("block_hash", block_hash)
        _check_key("parent_hash", parent_hash)
        data, tok = _byte_view(payload), _encode_tokens(tokens)
        path = self._path(block_hash)
        with self._lock:
            if block_hash in self._index:  # written before: only refresh its recency
                self._index.move_to_end(block_hash)
                self._touch(path, self._stamp())
                return True
        # encoded outside the lock (CPU work, ~1.5 ms a 2 MiB page): a concurrent put of the same block
        # is settled at the rename below
        parts = _encode(data, self.element_size) if self.element_size else None
        stored = sum(memoryview(p).nbytes for p in parts) if parts else data.nbytes
        size = payload_offset(len(tok) // 4) + stored
        with self._lock:
            # refuse before evicting anything when the block cannot fit at all
            if self._reserved + size > self.budget_bytes or not self._make_room(size):
                self._stats["write_failures"] += 1
                log.warning("disk store: no room for a %d-byte block (budget %d)", size, self.budget_bytes)
                return False
            self._reserved += size
        tmp = self.dir / f".{block_hash.hex()}.{os.getpid()}-{next(self._seq)}.tmp"
        try:
            try:
                self._write_file(tmp, block_hash, parent_hash, tok, parts or [data], stored, parts is not None)
                with self._lock:
                    os.rename(tmp, path)
                    self._bytes += size - self._index.pop(block_hash, 0)  # 0 unless a concurrent put of it
                    self._index[block_hash] = size
                    self._stats["writes"] += 1
                    self._stats["encoded_writes"] += parts is not None
                    self._stats["bytes_written"] += size
                    self._stats["kv_bytes_written"] += data.nbytes
            except OSError:
                _unlink(tmp)
                raise
            finally:
                with self._lock:
                    self._reserved -= size
            self._fsync_dir()  # the file is complete either way; this makes the rename durable
            return True
        except OSError as e:
            log.warning("disk store: writing block %s failed: %s", block_hash.hex()[:16], e)
            with self._lock:
                self._stats["write_failures"] += 1
            return False

    def get(self, block_hash: bytes, tokens: Sequence[int]) -> torch.Tensor | None:
        """The block's payload as a new uint8 CPU tensor, or None on a miss."""
        return self._read(block_hash, tokens, None)

    def get_into(self, block_hash: bytes, tokens: Sequence[int], out: torch.Tensor) -> bool:
        """Read the payload straight into ``out`` (contiguous CPU, e.g. a pinned staging buffer).

        ``out`` must hold exactly the payload's bytes, in any dtype. After False its contents
        are undefined: a damaged file may be partly read into it before the checksum fails.
        """
        return self._read(block_hash, tokens, out) is not None

    def read_path(self, block_hash: bytes) -> str | None:
        """The file to read ``block_hash`` from elsewhere (the disk reader's process), or None (a miss,
        counted) when the index does not hold it. That read's outcome comes back by ``note_read`` or
        ``note_failed``."""
        with self._lock:
            if block_hash in self._index:
                return str(self._path(block_hash))
            self._stats["misses"] += 1
        return None

    def note_read(self, block_hash: bytes, file_bytes: int, kv_bytes: int, target: Path | int | None = None) -> None:
        """A read found ``block_hash`` whole (elsewhere, or ``_read`` with the file open as ``target``): its
        recency and the statistics."""
        with self._lock:
            stamp = self._stamp()
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
            self._stats["hits"] += 1
            self._stats["bytes_read"] += file_bytes
            self._stats["kv_bytes_read"] += kv_bytes
        self._touch(self._path(block_hash) if target is None else target, stamp)

    def note_failed(self, block_hash: bytes, ino: int | None, reason: str) -> None:
        """A read elsewhere found the file of ``block_hash`` (inode ``ino``; None: it could not be opened)
        damaged: deleted, a miss, as ``get_into``'s own. (That file's descriptor is closed by now: a fresh
        copy renamed in meanwhile whose inode took the same number would go too, which is a later miss.)"""
        self._discard(block_hash, ino, reason)

    def contains(self, block_hash: bytes) -> bool:
        """From the in-memory index, without disk IO; a later read may still miss."""
        with self._lock:
            return block_hash in self._index

    __contains__ = contains

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    @property
    def bytes_used(self) -> int:
        with self._lock:
            return self._bytes

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._stats)

    def probe_names(self, max_bytes: int) -> list[bytes]:
        """The least recently used blocks, up to ``max_bytes`` of files: the ones a read-speed probe
        (``cold_read``) disturbs least."""
        names, total = [], 0
        with self._lock:
            for name, size in self._index.items():
                if total + size > max_bytes:
                    break
                names.append(name)
                total += size
        return names

    def cold_read(self, block_hash: bytes) -> int:
        """Drop one block file from the page cache and read it whole, unchecked: the bytes of KV it
        holds (decoded; 0 if it is gone), which is what a restore planner weighs against recomputing.
        For measuring the disk as a restart meets it, not for serving."""
        try:
            fd = os.open(self._path(block_hash), os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return 0
        try:
            size = os.fstat(fd).st_size
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            buf, done = bytearray(size), 0
            view = memoryview(buf)
            while done < size:
                n = os.preadv(fd, [view[done:]], done)
                if n == 0:
                    break
                done += n
            return _kv_bytes(buf[:done])
        except OSError:
            return 0
        finally:
            os.close(fd)

    def close(self) -> None:
        """Release the directory (``contextlib.closing`` works); do not use the store afterwards."""
        self._lock_file.close()

    def _path(self, block_hash: bytes) -> Path:
        return self.dir / (block_hash.hex() + SUFFIX)

    def _stamp(self) -> int:
        """A strictly increasing mtime (ns): LRU order survives restarts, without ties."""
        self._last_stamp = max(time.time_ns(), self._last_stamp + 1)
        return self._last_stamp

    def _touch(self, target: Path | int, stamp: int) -> None:
        try:
            os.utime(target, ns=(stamp, stamp))
        except OSError:
            pass  # recency is advisory; a vanished file shows up as a miss on the next read

    def _write_file(self, tmp: Path, block_hash: bytes, parent_hash: bytes, tok: bytes, parts: list,
                    payload_size: int, encoded: bool) -> None:
        prefix = bytearray(payload_offset(len(tok) // 4))  # header, tokens, zero padding
        prefix[HEADER_SIZE:HEADER_SIZE + len(tok)] = tok
        h = xxhash.xxh3_128(memoryview(prefix)[HEADER_SIZE:])
        for part in parts:
            h.update(part)
        head = _HEADER.pack(MAGIC, VERSION_ENCODED if encoded else VERSION, HEADER_SIZE, len(tok) // 4,
                            payload_size, self.fingerprint, block_hash, parent_hash, h.digest(), 0)[:-4]
        prefix[:HEADER_SIZE] = head + zlib.crc32(head).to_bytes(4, "little")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            _write_all(fd, prefix)
            for part in parts:
                _write_all(fd, memoryview(part).cast("B"))
            with self._lock:
                stamp = self._stamp()
            os.utime(fd, ns=(stamp, stamp))  # rename keeps it; the startup scan orders the LRU by it
            os.fsync(fd)
        finally:
            os.close(fd)

    def _fsync_dir(self) -> None:
        fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _read(self, block_hash: bytes, tokens: Sequence[int], out: torch.Tensor | None) -> torch.Tensor | None:
        try:
            tok = _encode_tokens(tokens)
        except ValueError:  # ids no block can hold: no file is theirs
            tok = None
        with self._lock:
            if tok is None or block_hash not in self._index:
                self._stats["misses"] += 1
                return None
        try:
            fd = os.open(self._path(block_hash), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as e:
            self._discard(block_hash, None, str(e))
            return None
        try:  # fd stays open until _discard has compared inodes, so the inode cannot be reused
            st = os.fstat(fd)
            try:
                buf, view, read = read_payload(fd, st.st_size, self.fingerprint, block_hash, tok,
                                               None if out is None else _byte_view(out), _new_buffer)
            except (_Corrupt, OSError) as e:
                self._discard(block_hash, st.st_ino, str(e))
                return None
            self.note_read(block_hash, read, view.nbytes, fd)
            return buf
        finally:
            os.close(fd)

    def _discard(self, block_hash: bytes, ino: int | None, reason: str) -> None:
        """A read failed: delete the file it read (inode ``ino``) and count a miss. A fresh copy
        that a writer renamed into place meanwhile stays. ``ino`` None: the open failed."""
        path = self._path(block_hash)
        with self._lock:
            self._stats["misses"] += 1
            try:
                if os.stat(path, follow_symlinks=False).st_ino != ino:
                    return  # a fresh copy, or (ino None) a file there that we could not open
            except FileNotFoundError:
                pass
            except OSError as e:
                reason += f" (stat: {e})"
            if ino is not None:
                reason += _unlink(path)
                self._stats["corrupt_deleted"] += 1
            self._bytes -= self._index.pop(block_hash, 0)
        log.warning("disk store: %s %s: %s", "deleted" if ino is not None else "lost", path.name, reason)

    def _make_room(self, size: int) -> bool:
        """Evict LRU files until ``size`` more bytes fit; the caller holds the lock."""
        while self._bytes + self._reserved + size > self.budget_bytes and self._index:
            victim, victim_size = self._index.popitem(last=False)
            self._bytes -= victim_size
            self._stats["evictions"] += 1
            if err := _unlink(self._path(victim)):
                log.warning("disk store: evicting %s%s", victim.hex()[:16], err)
        return self._bytes + self._reserved + size <= self.budget_bytes

    def _rebuild(self) -> None:
        """The startup scan: the directory is the manifest. Reads only headers."""
        names = []
        for entry in os.scandir(self.dir):
            if entry.name in _SIDE_NAMES:
                continue
            if _TEMP.fullmatch(entry.name):  # an interrupted write; we hold the lock, so none is live
                _unlink(Path(entry.path))
            elif _NAME.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                names.append(entry.name)
            else:  # never delete what this store could not have written
                log.warning("disk store: ignoring %s: not a store file", entry.path)
        found = sorted(f for f in map(self._scan_one, names) if f)  # oldest first; names break ties
        for _, _, key, size in found:
            self._index[key] = size
            self._bytes += size
        if found:
            self._last_stamp = found[-1][0]
        with self._lock:
            self._make_room(0)  # the budget may have shrunk since the last run
        log.info("disk store: %d blocks, %d bytes in %s", len(self._index), self._bytes, self.dir)

    def _scan_one(self, name: str) -> tuple[int, str, bytes, int] | None:
        path, key = self.dir / name, bytes.fromhex(name[:64])
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            try:
                st = os.fstat(fd)
                check_header(os.pread(fd, HEADER_SIZE, 0), self.fingerprint, key, st.st_size)  # (not the codec's)
            finally:
                os.close(fd)
        except (_Corrupt, OSError) as e:
            with self._lock:
                self._stats["corrupt_deleted"] += 1
            log.warning("disk store: deleted %s: %s%s", name, e, _unlink(path))
            return None
        return st.st_mtime_ns, name, key, st.st_size
