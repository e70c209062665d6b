"""The disk tier's background writer (``qml_runtime.kv.disk_writer``): several threads write what the
engine hands over, each block once, and account for what they hold."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from qml_runtime.kv.disk_store import DiskStore
from qml_runtime.kv.disk_writer import DiskWriter
from qml_runtime.kv.prefix import pack

BLOCK = 64  # bytes of a block here


def _name(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def test_threads_write_every_block_once(tmp_path):
    store = DiskStore(tmp_path, b"f" * 32, budget_bytes=2**20)
    stats = SimpleNamespace(written_disk=0)
    writer = DiskWriter(store, BLOCK, stats, threads=4)
    calls, lock = {}, threading.Lock()
    put = store.put

    def slow_put(name, *a):
        with lock:
            calls[name] = calls.get(name, 0) + 1
        time.sleep(0.01)  # long enough for the copies queued behind it to reach another thread
        return put(name, *a)

    store.put = slow_put
    rows = torch.arange(8 * BLOCK, dtype=torch.uint8).view(8, BLOCK)
    blocks = [(_name(i), pack([i]), None) for i in range(8)]
    writer.put_pages(rows.clone(), None, blocks)
    writer.put_pages(rows.clone(), None, blocks)  # the same pages again, before the first landed
    for i in range(4):
        writer.put_block(_name(i), pack([i]), rows[i].clone(), None, None)
    writer.join()
    assert writer.pending_bytes == 0 and stats.written_disk == 8
    assert calls == {_name(i): 1 for i in range(8)}
    for i in range(8):
        assert torch.equal(store.get(_name(i), [i]), rows[i])
    writer.close()
    assert not any(t.is_alive() for t in writer._threads)
    store.close()


def test_a_failed_write_is_not_counted_and_the_writers_go_on(tmp_path):
    store = DiskStore(tmp_path, b"f" * 32, budget_bytes=2**20)
    stats = SimpleNamespace(written_disk=0)
    writer = DiskWriter(store, BLOCK, stats, threads=2)
    put = store.put
    store.put = lambda name, *a: False if name == _name(1) else put(name, *a)  # a full or failing disk
    rows = torch.ones(3, BLOCK, dtype=torch.uint8)
    writer.put_pages(rows, None, [(_name(i), pack([i]), None) for i in range(3)])
    writer.join()
    assert stats.written_disk == 2 and store.contains(_name(0)) and not store.contains(_name(1))
    assert not writer._writing  # the failed name may be queued again
    writer.close()
    store.close()


def test_a_block_is_queued_until_its_write_ends_written_or_not(tmp_path):
    store = DiskStore(tmp_path, b"f" * 32, budget_bytes=2**20)
    writer = DiskWriter(store, BLOCK, SimpleNamespace(written_disk=0), threads=1)
    gate = threading.Event()
    put = store.put
    store.put = lambda name, *a: (gate.wait(5), False if name == _name(2) else put(name, *a))[1]
    rows = torch.ones(3, BLOCK, dtype=torch.uint8)
    writer.put_pages(rows, None, [(_name(i), pack([i]), None) for i in range(2)])
    writer.put_block(_name(2), pack([2]), rows[2].clone(), None, None)
    assert all(writer.queued(_name(i)) for i in range(3)) and not writer.queued(_name(3))
    gate.set()
    writer.join()
    # written (0, 1) or failed (2): no longer queued; a failed one may be handed over again
    assert not any(writer.queued(_name(i)) for i in range(3))
    assert store.contains(_name(0)) and not store.contains(_name(2))
    writer.close()
    store.close()


def test_writes_wait_while_a_restore_reads(tmp_path, monkeypatch):
    """A restore's disk reads go first: a write not yet begun waits until they end (or for at most
    READS_FIRST_MAX_S, so a cache fill is never held up for good)."""
    from qml_runtime.kv import disk_writer as writer_mod

    store = DiskStore(tmp_path, b"f" * 32, budget_bytes=2**20)
    writer = DiskWriter(store, BLOCK, SimpleNamespace(written_disk=0), threads=2)
    rows = torch.ones(2, BLOCK, dtype=torch.uint8)
    writer.reads_started()
    writer.reads_started()  # two loader threads' parts
    writer.put_block(_name(0), pack([0]), rows[0].clone(), None, None)
    time.sleep(0.2)
    assert not store.contains(_name(0)) and writer.queued(_name(0))
    writer.reads_done()
    time.sleep(0.1)
    assert not store.contains(_name(0))  # one part still reads
    writer.reads_done()
    writer.join()
    assert store.contains(_name(0))
    # reads that never pause do not stop the writer: the bound counts from when they began, not from
    # each write (reads that began 60 s ago, a bound of 30 s: the write goes at once)
    monkeypatch.setattr(writer_mod, "READS_FIRST_MAX_S", 30.0)
    writer.reads_started()
    writer._reads.since -= 60.0
    writer.reads_started()  # another restore joins them: still the same stretch of reads
    writer.put_block(_name(1), pack([1]), rows[1].clone(), None, None)
    for _ in range(100):  # (well under the 30 s a write would wait counted from itself)
        if store.contains(_name(1)):
            break
        time.sleep(0.05)
    assert store.contains(_name(1)) and writer._reads.count == 2
    writer.close()
    store.close()


def test_writes_wait_while_the_engine_holds_them(tmp_path, monkeypatch):
    """While the engine thread schedules and launches a step (``hold``), writes not yet begun wait until
    ``release``; a hold longer than HOLD_MAX_S does not stop them, and reads and holds together wait for both."""
    from qml_runtime.kv import disk_writer as writer_mod

    store = DiskStore(tmp_path, b"f" * 32, budget_bytes=2**20)
    writer = DiskWriter(store, BLOCK, SimpleNamespace(written_disk=0), threads=2)
    rows = torch.ones(3, BLOCK, dtype=torch.uint8)
    writer.hold()
    writer.put_block(_name(0), pack([0]), rows[0].clone(), None, None)
    time.sleep(0.1)  # (well under HOLD_MAX_S)
    assert not store.contains(_name(0)) and writer.queued(_name(0))
    writer.reads_started()
    writer.release()
    time.sleep(0.1)
    assert not store.contains(_name(0))  # the read still holds it
    writer.reads_done()
    writer.join()
    assert store.contains(_name(0))
    # a hold that lasts: the write goes once the hold in force began HOLD_MAX_S ago
    monkeypatch.setattr(writer_mod, "HOLD_MAX_S", 0.3)
    writer.hold()
    t0 = time.monotonic()
    writer.put_block(_name(1), pack([1]), rows[1].clone(), None, None)
    writer.join()
    assert store.contains(_name(1)) and time.monotonic() - t0 >= 0.25 and writer._holds.count == 1
    writer.release()
    writer.put_block(_name(2), pack([2]), rows[2].clone(), None, None)
    writer.join()
    assert store.contains(_name(2)) and writer._holds.count == 0
    writer.close()
    store.close()


def test_a_borrowed_row_detached_before_its_write_is_written_as_it_was(tmp_path):
    # a kept page's write reads its host-tier row in place; when the row is about to take another page's
    # bytes, detach gives the queued block its own copy: the file holds the old bytes, not the new ones
    store = DiskStore(tmp_path, b"f" * 32, budget_bytes=2**20)
    stats = SimpleNamespace(written_disk=0)
    writer = DiskWriter(store, BLOCK, stats, threads=0)  # nothing written until a thread is started below
    rows = torch.zeros(2, BLOCK, dtype=torch.uint8)
    rows[0].fill_(5)
    rows[1].fill_(6)
    writer.put_block(_name(0), pack([0]), rows[0], None, None, borrowed=True)
    writer.put_block(_name(1), pack([1]), rows[1], None, None, borrowed=True)
    assert writer.pending_bytes == 2 * BLOCK and writer.queued(_name(0))
    writer.detach(_name(0))
    rows[0].fill_(9)  # the row takes another page
    writer.detach(b"never handed over")  # nothing to do
    thread = threading.Thread(target=writer._loop, daemon=True)
    thread.start()
    writer.join()
    assert torch.equal(store.get(_name(0), [0]), torch.full((BLOCK,), 5, dtype=torch.uint8))
    assert torch.equal(store.get(_name(1), [1]), rows[1])  # read in place
    assert writer.pending_bytes == 0 and stats.written_disk == 2 and not writer._borrowed
    writer.detach(_name(1))  # written: nothing left to detach
    writer._queue.put(None)
    thread.join(timeout=10)
    store.close()


def test_owned_blocks_count_as_pending_until_written(tmp_path):
    # a host entry evicted to make room is handed over as its own copy: its bytes wait in the writer's queue
    # like gathered pages do, and the engine's budget for that backlog must see them
    store = DiskStore(tmp_path, b"f" * 32, budget_bytes=2**20)
    writer = DiskWriter(store, BLOCK, SimpleNamespace(written_disk=0), threads=0)
    writer.put_block(_name(0), pack([0]), torch.ones(BLOCK, dtype=torch.uint8), None, None)
    writer.put_block(_name(1), pack([1]), torch.ones(BLOCK, dtype=torch.uint8), None, None, borrowed=True)
    assert writer.pending_bytes == 2 * BLOCK
    writer.detach(_name(1))  # now a copy: still waiting to be written
    assert writer.pending_bytes == 2 * BLOCK
    thread = threading.Thread(target=writer._loop, daemon=True)
    thread.start()
    writer.join()
    assert writer.pending_bytes == 0 and store.contains(_name(0)) and store.contains(_name(1))
    writer._queue.put(None)
    thread.join(timeout=10)
    store.close()


def test_a_row_detached_while_the_disk_is_behind_is_dropped_not_copied(tmp_path, monkeypatch):
    """Past ``backlog_bytes`` waiting to be written, detach gives the block up (the row is not copied on the
    engine thread): it is counted as skipped, no longer queued, and never written; the others are."""
    store = DiskStore(tmp_path, b"f" * 32, budget_bytes=2**20)
    stats = SimpleNamespace(written_disk=0, persist_skipped=0)
    writer = DiskWriter(store, BLOCK, stats, threads=0, backlog_bytes=BLOCK)
    rows = torch.full((2, BLOCK), 4, dtype=torch.uint8)
    writer.put_block(_name(0), pack([0]), rows[0], None, None, borrowed=True)
    writer.put_block(_name(1), pack([1]), rows[1], None, None, borrowed=True)
    monkeypatch.setattr(torch.Tensor, "clone", lambda self: pytest.fail("the row was copied"))
    writer.detach(_name(0))
    monkeypatch.undo()
    assert stats.persist_skipped == 1 and not writer.queued(_name(0)) and writer.queued(_name(1))
    assert writer.pending_bytes == BLOCK
    thread = threading.Thread(target=writer._loop, daemon=True)
    thread.start()
    writer.join()
    assert not store.contains(_name(0)) and store.contains(_name(1)) and stats.written_disk == 1
    assert writer.pending_bytes == 0 and not writer._borrowed
    writer._queue.put(None)
    thread.join(timeout=10)
    store.close()


def test_detaching_a_row_being_written_waits_for_the_write(tmp_path):
    store = DiskStore(tmp_path, b"f" * 32, budget_bytes=2**20)
    writer = DiskWriter(store, BLOCK, SimpleNamespace(written_disk=0), threads=1)
    inside, release, put = threading.Event(), threading.Event(), store.put
    order = []

    def gated_put(name, *a):
        inside.set()
        release.wait(timeout=30)
        ok = put(name, *a)
        order.append("written")
        return ok

    store.put = gated_put
    row = torch.full((BLOCK,), 3, dtype=torch.uint8)
    writer.put_block(_name(0), pack([0]), row, None, None, borrowed=True)
    assert inside.wait(timeout=30)  # the writer is reading the row now

    def detach():
        writer.detach(_name(0))
        order.append("detached")

    detacher = threading.Thread(target=detach)
    detacher.start()
    release.set()
    detacher.join(timeout=30)
    writer.join()
    assert order == ["written", "detached"]  # the row was free again only after its write
    assert torch.equal(store.get(_name(0), [0]), row)
    writer.close()
    store.close()
