"""Disk reads of restores in a child process, straight into the host tier's shared rows.

Why a process: reader threads in the server's process took the GIL at every step of a block's read (open,
each read, the checksum, the decode and the numpy calls around them all release it and take it back), and
the engine thread, which releases it at every kernel launch, waited for them each time. On an H100 host a
27k-token turn after a restart launched its 21k-token head in 1,087 ms beside eight reader threads, against
168 ms for a whole fresh prompt alone, and the split came out slower than recomputing everything
(benchmarks/results/sessions-h100-2026-12-06b.md). On a 2-core CPU machine, a loop of small torch ops took 18 ms
alone, 123 ms beside eight reader threads (reading 1.01 GB/s), and 32 ms beside the reader process's eight
(1.27 GB/s; benchmarks/disk_reader_gil_cpu.py, results/disk-reader-gil-cpu-2026-12-06.md).

The host tier's rows live in a memfd (``HostTier(shared=True)``) that the child maps too; the parent sends
(path, block hash, packed tokens, row offset, row size) and the child's threads check and read each file
into that row (``block_file.read_payload``: the header, the tokens, the checksum, the decode) and answer
with the outcome. The index (recency, statistics, deleting a damaged file) stays with the parent's
``DiskStore`` (``note_read``, ``note_failed``). The child imports no torch, and ends when its stdin closes
(the parent's ``close``, or the parent's death).

Messages are pickles behind a 4-byte length, both ways: a list of reads
``(key, path, block_hash, tokens, offset, size)`` to the child, and one result
``(key, status, file_bytes, kv_bytes, inode, t0, t1, reason)`` a block back, ``status`` one of "ok",
"corrupt" (delete the file: a miss), "gone" (it could not be opened) and "error" (a wrong row size, or the
child gone: a miss, the file kept).
"""

from __future__ import annotations

import logging
import mmap
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("qml.kv.tiers")

_LEN = struct.Struct("<I")
Result = tuple  # (key, status, file_bytes, kv_bytes, inode, t0, t1, reason)


def _send(stream, obj) -> None:
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LEN.pack(len(body)) + body)
    stream.flush()


def _receive(stream):
    """The next message, or None at the end of the stream."""
    head = stream.read(_LEN.size)
    if len(head) < _LEN.size:
        return None
    body = stream.read(_LEN.unpack(head)[0])
    return pickle.loads(body)


class DiskReader:
    """The parent's side: ``read`` sends reads to the child; each one's ``done(result)`` is called once, on the
    listener thread (keep it short). A child that dies fails what it had (status "error") and every later
    read at once: ``alive`` tells the caller to read some other way."""

    def __init__(self, fd: int, size: int, fingerprint: bytes, threads: int):
        root = str(Path(__file__).resolve().parents[2])  # the directory qml_runtime is imported from
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "qml_runtime.kv.disk_reader", str(fd), str(size), fingerprint.hex(), str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(fd,), env=env)
        self._lock = threading.Lock()
        self._pending: dict[int, Callable[[Result], None]] = {}
        self._next = 0
        self.alive = True
        self._listener = threading.Thread(target=self._listen, name="qml-kv-reader-listener", daemon=True)
        self._listener.start()

    def read(self, reads: list[tuple[str, bytes, bytes, int, int]], done: list[Callable[[Result], None]]) -> list[int]:
        """Send ``reads`` [(path, block hash, packed tokens, row offset, row size)], in order, ``done[i]`` to be
        called with read i's result; returns their keys (each result carries its own)."""
        with self._lock:
            keys = list(range(self._next, self._next + len(reads)))
            self._next += len(reads)
            self._pending.update(zip(keys, done))
            alive = self.alive
        if alive:
            try:
                _send(self._proc.stdin, [(key, *r) for key, r in zip(keys, reads)])
                return keys
            except (OSError, ValueError) as exc:  # the child is gone (a broken pipe)
                log.warning("disk reader process: sending reads failed: %s", exc)
                self._lost()
        for key in keys:  # (failed: their callbacks, unless _lost called them already)
            self._finish((key, "error", 0, 0, None, 0.0, 0.0, "the reader process is gone"))
        return keys

    def _finish(self, result: Result) -> None:
        with self._lock:
            done = self._pending.pop(result[0], None)
        if done is not None:
            done(result)

    def _listen(self) -> None:
        try:
            while True:
                result = _receive(self._proc.stdout)
                if result is None:
                    break
                self._finish(result)
        except Exception:  # noqa: BLE001 (a garbled message: the child is not trusted any more)
            log.exception("disk reader process: a result could not be read")
        self._lost()

    def _lost(self) -> None:
        with self._lock:
            was, self.alive = self.alive, False
            pending, self._pending = self._pending, {}
        if was and not self._closing():
            log.warning("disk reader process stopped answering; restores read on threads from now on")
        for key, done in pending.items():
            done((key, "error", 0, 0, None, 0.0, 0.0, "the reader process is gone"))

    def _closing(self) -> bool:
        return self._proc.stdin is None or self._proc.stdin.closed

    def close(self) -> None:
        """Let the child finish what it has and end (idempotent)."""
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            try:
                self._proc.stdin.close()
            except OSError:
                pass
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._listener.join(timeout=10)


def _child(fd: int, size: int, fingerprint: bytes, threads: int) -> None:
    from qml_runtime.kv.block_file import _Corrupt, read_payload

    rows = memoryview(mmap.mmap(fd, size))
    inbox: queue.Queue = queue.Queue()
    out, out_lock = sys.stdout.buffer, threading.Lock()

    def read_one(key, path, block_hash, tokens, offset, nbytes) -> Result:
        t0 = time.perf_counter()
        try:
            f = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as exc:
            return key, "gone", 0, 0, None, t0, time.perf_counter(), str(exc)
        ino = None
        try:
            st = os.fstat(f)
            ino = st.st_ino
            if offset < 0 or offset + nbytes > size:
                raise ValueError(f"row [{offset}, {offset + nbytes}) outside the {size}-byte host tier")
            _, view, read = read_payload(f, st.st_size, fingerprint, block_hash, tokens,
                                         rows[offset:offset + nbytes])
            return key, "ok", read, view.nbytes, ino, t0, time.perf_counter(), ""
        except (_Corrupt, OSError) as exc:
            return key, "corrupt", 0, 0, ino, t0, time.perf_counter(), str(exc)
        except ValueError as exc:
            return key, "error", 0, 0, ino, t0, time.perf_counter(), str(exc)
        finally:
            os.close(f)

    def work() -> None:
        while (item := inbox.get()) is not None:
            result = read_one(*item)
            with out_lock:
                _send(out, result)

    workers = [threading.Thread(target=work, daemon=True) for _ in range(threads)]
    for w in workers:
        w.start()
    stdin = sys.stdin.buffer
    while (reads := _receive(stdin)) is not None:
        for item in reads:
            inbox.put(item)
    for _ in workers:
        inbox.put(None)
    for w in workers:
        w.join()


if __name__ == "__main__":
    _child(int(sys.argv[1]), int(sys.argv[2]), bytes.fromhex(sys.argv[3]), int(sys.argv[4]))
