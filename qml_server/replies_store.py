"""Kept replies on disk, beside the KV disk tier, so a conversation resumed after a restart still
finds its replies' generated ids (and with them the KV the disk tier holds under those ids).

One file per kept conversation, named by a digest of (tenant, text), in ``<store>/replies`` (the
KV store's directory for this model: ids mean nothing to another model). A file is::

    MAGIC (8) | header length (4, little endian) | header (JSON: tenant, text bytes, ids, cuts)
    | text (UTF-8) | ids (int32, little endian) | SHA-256 of all the above (32)

written to a temp file and renamed (no fsync: losing the last replies in a crash only costs a
re-encoded history). A file that is short, damaged or of another version is deleted on load and
never fails the server. Writes and deletes run on one background thread, off the event loop.
The files hold the conversations' text: the directory is created owner-only (0700), as the
KV store's is, and it is as sensitive as the KV files beside it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import sys
import threading
from array import array
from pathlib import Path

log = logging.getLogger("qml.server")

MAGIC = b"QMLRPLY1"
_BIG_ENDIAN = sys.byteorder == "big"  # the file's ids are little endian
SUFFIX = ".rep"


def file_name(tenant: str, text: str) -> str:
    digest = hashlib.sha256(tenant.encode("utf-8", "surrogatepass") + b"\x00" + text.encode("utf-8", "surrogatepass"))
    return digest.hexdigest() + SUFFIX


def encode(tenant: str, text: str, ids: array, cuts: list[tuple[int, int]]) -> bytes:
    body = text.encode("utf-8", "surrogatepass")
    ids_le = array("i", ids)
    if ids_le.itemsize != 4:
        raise ValueError("int32 arrays are needed")
    if _BIG_ENDIAN:
        ids_le.byteswap()
    header = json.dumps({"tenant": tenant, "text_bytes": len(body), "ids": len(ids), "cuts": cuts}).encode()
    data = MAGIC + struct.pack("<I", len(header)) + header + body + ids_le.tobytes()
    return data + hashlib.sha256(data).digest()


def decode(data: bytes) -> tuple[str, str, array, list[tuple[int, int]]]:
    """(tenant, text, ids, cuts); ValueError for anything but a whole, intact file of this version."""
    if len(data) < len(MAGIC) + 4 + 32 or not data.startswith(MAGIC):
        raise ValueError("not a reply file")
    payload, digest = data[:-32], data[-32:]
    if hashlib.sha256(payload).digest() != digest:
        raise ValueError("checksum mismatch")
    (n,) = struct.unpack_from("<I", payload, len(MAGIC))
    start = len(MAGIC) + 4
    header = json.loads(payload[start:start + n])
    text_end = start + n + header["text_bytes"]
    text = payload[start + n:text_end].decode("utf-8", "surrogatepass")
    ids = array("i")
    ids.frombytes(payload[text_end:])
    if _BIG_ENDIAN:
        ids.byteswap()
    cuts = [(int(c), int(k)) for c, k in header["cuts"]]
    if len(ids) != header["ids"] or not cuts or cuts[-1] != (len(text), len(ids)):
        raise ValueError("inconsistent reply file")
    return header["tenant"], text, ids, cuts


class ReplyStore:
    def __init__(self, directory: Path | str):
        self.dir = Path(directory)
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name="qml-replies", daemon=True)
        self._thread.start()

    def load(self) -> list[tuple[str, str, array, list[tuple[int, int]]]]:
        """Every intact entry, least recently written first; damaged files are deleted."""
        found = []
        for path in self.dir.glob("*" + SUFFIX):
            try:
                entry = decode(path.read_bytes())
                if path.name != file_name(entry[0], entry[1]):
                    raise ValueError("misnamed reply file")
                found.append((path.stat().st_mtime_ns, path.name, entry))
            except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
                log.warning("kept replies: deleting %s: %s", path, exc)
                _unlink(path)
        for tmp in self.dir.glob(".*.tmp"):  # writes a crash interrupted
            _unlink(tmp)
        return [entry for _, _, entry in sorted(found)]

    def save(self, tenant: str, text: str, ids: array, cuts: list[tuple[int, int]]) -> None:
        self._jobs.put(("save", tenant, text, ids, list(cuts)))

    def delete(self, tenant: str, text: str) -> None:
        self._jobs.put(("delete", tenant, text))

    def flush(self) -> None:
        """Wait until every write and delete asked so far is done."""
        done = threading.Event()
        self._jobs.put(("flush", done))
        done.wait()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job[0] == "flush":
                    job[1].set()
                elif job[0] == "save":
                    _, tenant, text, ids, cuts = job
                    path = self.dir / file_name(tenant, text)
                    tmp = self.dir / f".{path.name}.{os.getpid()}.tmp"
                    tmp.write_bytes(encode(tenant, text, ids, cuts))
                    os.replace(tmp, path)
                else:
                    _unlink(self.dir / file_name(job[1], job[2]))
            except OSError as exc:  # a full or failing disk: the reply is simply not kept across restarts
                log.warning("kept replies: %s failed: %s", job[0], exc)


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
