"""Restores' disk reads in a child process (``kv.disk_reader``), into the host tier's shared rows."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from array import array

import pytest
import torch

from qml_runtime.kv import disk_loads
from qml_runtime.kv.disk_reader import DiskReader
from qml_runtime.kv.disk_store import DiskStore
from qml_runtime.kv.host_tier import HostTier
from tests.test_kv_tiers import GREEDY, expected, sibling, turns  # noqa: F401 (expected: a fixture)

ROW = 4096


def packed(tokens) -> bytes:
    return array("I", tokens).tobytes()


def read_all(reader: DiskReader, reads: list) -> list[tuple]:
    results, landed = [None] * len(reads), threading.Event()

    def done(i):
        def record(result):
            results[i] = result
            if all(r is not None for r in results):
                landed.set()
        return record

    reader.read(reads, [done(i) for i in range(len(reads))])
    assert landed.wait(30)
    return results


@pytest.fixture
def store(tmp_path):
    disk = DiskStore(tmp_path, bytes(32), 2**30, element_size=2)
    gen = torch.Generator().manual_seed(0)
    blocks = []
    for i in range(6):
        kv = (torch.randn(ROW // 2, generator=gen) * 0.1).to(torch.bfloat16).view(torch.uint8)
        name = hashlib.sha256(bytes([i])).digest()
        assert disk.put(name, None, range(i, i + 16), kv)
        blocks.append((name, kv))
    yield disk, blocks
    disk.close()


def test_the_child_reads_blocks_into_the_shared_rows_and_reports_damage(store):
    disk, blocks = store
    host = HostTier(ROW, 8 * ROW, pin=False)
    assert host.fd is not None  # (Linux: a memfd)
    raw = bytearray(open(disk.read_path(blocks[3][0]), "rb").read())
    raw[-1] ^= 0x01  # a bit flipped in the payload
    with open(disk.read_path(blocks[3][0]), "wb") as f:
        f.write(raw)
    os.unlink(disk.read_path(blocks[4][0]))
    reads = [(disk.read_path(name), name, packed(range(i, i + 16)), (7 - i) * ROW, ROW)
             for i, (name, _) in enumerate(blocks)]
    reads[2] = (*reads[2][:2], packed(range(99, 115)), *reads[2][3:])  # the request's tokens differ
    reads[5] = (*reads[5][:3], 0, ROW // 2)  # a row of the wrong size
    reader = DiskReader(host.fd, host.capacity * ROW, bytes(32), threads=3)
    try:
        results = read_all(reader, reads)
    finally:
        reader.close()
    assert [r[1] for r in results] == ["ok", "ok", "corrupt", "corrupt", "gone", "error"]
    assert "tokens differ" in results[2][7] and "checksum" in results[3][7]
    for i in (0, 1):
        assert results[i][3] == ROW and results[i][2] > 0  # KV bytes, and the (encoded) file's bytes read
        assert torch.equal(host.slots[7 - i], blocks[i][1])
    assert not host.slots[7 - 5].any()  # the wrong-sized row was left alone


def test_a_read_sent_to_a_dead_child_fails_at_once(store):
    disk, blocks = store
    host = HostTier(ROW, 2 * ROW, pin=False)
    reader = DiskReader(host.fd, host.capacity * ROW, bytes(32), threads=1)
    reader._proc.kill()
    reader._listener.join(10)
    assert not reader.alive
    name = blocks[0][0]
    (result,) = read_all(reader, [(disk.read_path(name), name, packed(range(16)), 0, ROW)])
    assert result[1] == "error" and "gone" in result[7]
    reader.close()


def restart(engine, tmp_path):
    """A first engine's turn written to disk, then a second engine on the same store (host RAM tier on);
    returns (the second engine, the next turn's prompt, its cacheable tokens)."""
    cache = dict(num_blocks=64, disk_dir=str(tmp_path), disk_bytes=2**30, host_bytes=2**26)
    first = sibling(engine, **cache)
    try:
        ids2, cacheable = turns(first)
    finally:
        first.shutdown()
    return sibling(engine, **cache), ids2, cacheable


def test_after_a_restart_the_history_comes_back_through_the_reader_process(engine, expected, tmp_path):
    restarted, ids2, cacheable = restart(engine, tmp_path)
    try:
        out = restarted.generate_sync(ids2, GREEDY)
        tiers = restarted.tiers
        assert isinstance(tiers._reader, DiskReader) and tiers._reader.alive
        assert tiers.stats.restored_disk > 0 and tiers._writer._reads.count == 0
        assert out.cached_tokens == cacheable >= 32 and out.token_ids == expected and tiers.stats.cuts == 0
        assert tiers.disk.stats()["hits"] >= tiers.stats.restored_disk  # the parent's index saw the reads
    finally:
        restarted.shutdown()
    assert restarted.tiers._reader._proc.returncode == 0  # the child ended with the engine


def test_a_damaged_file_read_by_the_child_is_deleted_and_recomputed(engine, expected, tmp_path):
    restarted, ids2, cacheable = restart(engine, tmp_path)
    try:
        disk = restarted.tiers.disk
        files = sorted(disk.dir.glob("*.kvb"))
        raw = bytearray(files[0].read_bytes())
        raw[-1] ^= 0x80
        files[0].write_bytes(raw)
        out = restarted.generate_sync(ids2, GREEDY)
        assert out.token_ids == expected and isinstance(restarted.tiers._reader, DiskReader)
        assert disk.stats()["corrupt_deleted"] == 1 and not files[0].exists()
        assert not restarted.tiers.host._held  # every slot held for a read went back, past the damaged one too
    finally:
        restarted.shutdown()


def test_with_the_child_gone_loads_read_on_threads(engine, expected, tmp_path):
    restarted, ids2, cacheable = restart(engine, tmp_path)
    try:
        reader = restarted.tiers._disk_reader()
        reader._proc.kill()
        reader._listener.join(10)
        out = restarted.generate_sync(ids2, GREEDY)
        assert restarted.tiers.stats.restored_disk > 0 and restarted.tiers._disk_reader() is None
        assert out.cached_tokens == cacheable and out.token_ids == expected
    finally:
        restarted.shutdown()


def test_threads_when_asked(engine, expected, tmp_path, monkeypatch):
    monkeypatch.setattr(disk_loads, "READER", "threads")
    restarted, ids2, cacheable = restart(engine, tmp_path)
    try:
        out = restarted.generate_sync(ids2, GREEDY)
        assert restarted.tiers._reader is None and restarted.tiers.stats.restored_disk > 0
        assert out.token_ids == expected
    finally:
        restarted.shutdown()


class StallingReader:
    """In place of the reader process: reads the first ``answer`` blocks it is sent at once (really, into the
    host rows), and the others only when ``release`` is called."""

    alive = True

    def __init__(self, tiers, answer: int):
        self.tiers, self.answer, self.held = tiers, answer, []

    def read(self, reads, done):
        for read, callback in zip(reads, done):
            if self.answer > 0:
                self.answer -= 1
                self._read(read, callback)
            else:
                self.held.append((read, callback))

    def _read(self, read, callback):
        path, name, tokens, offset, size = read
        slot = self.tiers.host.slots[offset // self.tiers.host.block_bytes]
        t0 = time.perf_counter()
        ok = self.tiers.disk.get_into(name, list(array("I", tokens)), slot)
        callback((None, "ok" if ok else "corrupt", size, size, None, t0, time.perf_counter(), ""))

    def release(self):
        held, self.held = self.held, []
        for read, callback in held:
            self._read(read, callback)

    def close(self):
        self.release()


def test_a_stalled_load_is_cut_and_its_late_blocks_computed(engine, expected, tmp_path, monkeypatch):
    monkeypatch.setattr(disk_loads, "CUT", True)  # (QML_RESTORE_CUT=1)
    restarted, ids2, cacheable = restart(engine, tmp_path)
    tiers = restarted.tiers
    tiers._reader.close()
    stalled = tiers._reader = StallingReader(tiers, answer=1)
    try:
        out = restarted.generate_sync(ids2, GREEDY)
        assert stalled.held and tiers.stats.cuts == 1  # the load was cut while the rest were out
        assert tiers.stats.restored_disk == 1 and tiers.stats.skipped_disk >= len(stalled.held)
        # the same text; the usage counts what was restored, not what was computed after the cut
        assert out.token_ids == expected and out.cached_tokens == 16 < cacheable
        assert restarted.stats()["kv_restore_cuts"] == 1
        held = set(tiers.host._held)
        assert held  # the late reads' slots stay held until their reads end...
        stalled.release()
        tiers._reap_dropped()
        assert not tiers.host._held and tiers._writer._reads.count == 0  # ...then go back
    finally:
        restarted.shutdown()


def test_a_stalled_load_waits_unless_cuts_are_on(engine, expected, tmp_path):
    restarted, ids2, cacheable = restart(engine, tmp_path)
    tiers = restarted.tiers
    tiers._reader.close()
    stalled = tiers._reader = StallingReader(tiers, answer=1)
    try:
        timer = threading.Timer(0.5, stalled.release)  # the rest come in later: the turn waits for them
        timer.start()
        out = restarted.generate_sync(ids2, GREEDY)
        assert tiers.stats.cuts == 0 and out.cached_tokens == cacheable and out.token_ids == expected
    finally:
        timer.join()
        restarted.shutdown()


def test_the_child_ends_when_the_server_is_killed():
    """kill -9 of the server closes the child's pipe: it ends too, holding nothing of the store."""
    import subprocess
    import sys
    from pathlib import Path

    script = ("import os, signal\n"
              "from qml_runtime.kv.host_tier import HostTier\n"
              "from qml_runtime.kv.disk_reader import DiskReader\n"
              "host = HostTier(4096, 4 * 4096, pin=False)\n"
              "reader = DiskReader(host.fd, host.capacity * 4096, bytes(32), 2)\n"
              "import threading\n"
              "answered = threading.Event()\n"  # (the child is up and answering before the kill)
              "reader.read([('/nonexistent', bytes(32), b'', 0, 4096)], [lambda result: answered.set()])\n"
              "assert answered.wait(30)\n"
              "print(reader._proc.pid, flush=True)\n"
              "os.kill(os.getpid(), signal.SIGKILL)\n")
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=root, timeout=60)
    assert run.returncode == -9
    child = int(run.stdout.split()[0])

    def running() -> bool:  # (a zombie no one reaps has ended too)
        try:
            return open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    for _ in range(200):
        if not running():
            break
        time.sleep(0.05)
    assert not running()
