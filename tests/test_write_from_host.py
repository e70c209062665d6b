"""A finished request's kept pages are written through to disk from their host-RAM copies
(``KVTiers.persist`` -> ``HostWrites.hand_over`` -> the writer reads the pinned row in place): no device gather
and no second copy down for them, and a host row is never given other bytes while a queued write
still reads it (``DiskWriter.detach``)."""

from __future__ import annotations

import threading

import pytest
import torch

from qml_runtime.kv.cache import KVCache
from qml_runtime.kv.disk_store import DiskStore
from qml_runtime.kv.disk_writer import DiskWriter
from qml_runtime.kv.host_tier import HostTier
from qml_runtime.kv.prefix import pack, unpack
from qml_runtime.kv.tiers import KVTiers
from qml_runtime.presets import PRESETS


def _tiers(tmp_path, slots: int, pages: int = 8, gpu_path: bool = False) -> KVTiers:
    cfg = PRESETS["tiny-llama"].config
    kv = KVCache(cfg, pages, 4, "cpu", torch.float32)
    kv.data.normal_()
    disk = DiskStore(tmp_path, b"f" * 32, budget_bytes=2**30)
    tiers = KVTiers(kv, HostTier(kv.block_bytes, slots * kv.block_bytes, pin=False), disk)
    if gpu_path:  # deferred copies written in place by page_save, as on the GPU (the reference copies here)
        tiers.defer_persist = tiers.save_in_place = True
    return tiers


def _page(tiers: KVTiers, page: int) -> torch.Tensor:
    return tiers.kv.gather_pages(torch.tensor([page]))[0].clone()


def _kept(pages: list[int]) -> list[tuple[int, bytes, bytes, None]]:
    return [(p, b"name%04d" % p * 4, bytes(pack([p])), None) for p in pages]


def _on_disk(tiers: KVTiers, page: int) -> torch.Tensor | None:
    name, tokens = b"name%04d" % page * 4, pack([page])
    return tiers.disk.get(name, unpack(bytes(tokens)))


@pytest.mark.parametrize("gpu_path", [False, True], ids=["copied-at-end", "deferred-in-place"])
def test_kept_pages_are_written_from_their_host_rows_without_a_device_gather(tmp_path, monkeypatch, gpu_path):
    tiers = _tiers(tmp_path, slots=8, gpu_path=gpu_path)
    monkeypatch.setattr(tiers, "_write_through", lambda *a: pytest.fail("gathered on the device for the writer"))
    pages = [6, 2, 7, 0, 5]
    want = {p: _page(tiers, p) for p in pages}
    tiers.persist(_kept(pages))
    if gpu_path:
        assert len(tiers._host_writes) == 5 and not tiers._writer.queued(b"name0006" * 4)  # until the pump
        assert tiers._on_disk(b"name0006" * 4)  # (so a second persist of the page hands nothing over)
        tiers.pump_pages = 2
        tiers.pump()  # one chunk: its two pages go to the writer
        assert len(tiers._host_writes) == 3
    tiers.flush()  # the rest of the copies queued, every write done
    assert not tiers._host_writes and not tiers._host_writes._waiting_names
    for p in pages:
        assert torch.equal(_on_disk(tiers, p), want[p]), f"page {p}"
    assert tiers.stats.written_disk == 5 and tiers.pending_write_bytes == 0
    tiers.close()


def _stalled_writer(tiers: KVTiers) -> DiskWriter:
    """The tiers' writer swapped for one with no threads: what is handed over stays queued (a disk that is behind)."""
    tiers._writer.close()
    tiers._writer = DiskWriter(tiers.disk, tiers.row_bytes, tiers.stats, threads=0)
    return tiers._writer


def _run(writer: DiskWriter) -> None:
    """Write what a thread-less writer holds, on a thread of its own, then stop it."""
    thread = threading.Thread(target=writer._loop, daemon=True)
    thread.start()
    writer.join()
    writer._queue.put(None)
    thread.join(timeout=30)


def _working_writer(tiers: KVTiers) -> None:
    """A writer with threads back in the stalled one's place, for ``close()`` (whose wait for the writes would never
    end on a writer with none)."""
    tiers._writer = DiskWriter(tiers.disk, tiers.row_bytes, tiers.stats)


def test_a_host_row_reused_while_its_write_is_queued_keeps_the_old_bytes_for_the_disk(tmp_path):
    tiers = _tiers(tmp_path, slots=1)  # one host row: each kept page evicts the one before
    writer = _stalled_writer(tiers)
    want = {p: _page(tiers, p) for p in (3, 4)}
    tiers.persist(_kept([3]))
    assert writer.queued(b"name0003" * 4) and tiers._host_writes._borrowed  # handed over, reading the row in place
    tiers.persist(_kept([4]))  # evicts page 3's entry: the row takes page 4's bytes
    assert torch.equal(tiers.host.slots[0], want[4]) and tiers._host_writes._borrowed == {0: b"name0004" * 4}
    _run(writer)
    _working_writer(tiers)
    for p in (3, 4):
        got = _on_disk(tiers, p)
        assert got is not None, f"page {p} not on disk"
        assert torch.equal(got, want[p]), f"page {p}"
    tiers.close()


def test_a_kept_page_evicted_before_its_host_copy_is_written_from_a_copy(tmp_path):
    # deferred: page 3's copy into its row waits for the pump when page 4 evicts it; its write goes the
    # eviction's way (copied now, then a clone to the writer), and page 4's from its row once pumped
    tiers = _tiers(tmp_path, slots=1, gpu_path=True)
    want = {p: _page(tiers, p) for p in (3, 4)}
    tiers.persist(_kept([3]))
    assert tiers._host_writes and not tiers._writer.queued(b"name0003" * 4)
    tiers.persist(_kept([4]))
    assert list(tiers._host_writes._waiting.values())[0][0] == b"name0004" * 4  # page 3's registration went with it
    tiers.flush()
    for p in (3, 4):
        assert torch.equal(_on_disk(tiers, p), want[p]), f"page {p}"
    assert not tiers._host_writes._waiting_names
    tiers.close()


def test_a_writer_too_far_behind_takes_no_host_writes(tmp_path, monkeypatch):
    from qml_runtime.kv import tiers as tiers_module

    monkeypatch.setattr(tiers_module, "MAX_PENDING_WRITE_BYTES", 0)
    tiers = _tiers(tmp_path, slots=4)
    tiers.persist(_kept([1, 2]))
    tiers.flush()
    assert tiers.stats.persist_skipped == 2 and tiers.stats.kept_host == 2 and len(tiers.disk) == 0
    assert not tiers._host_writes and not tiers._host_writes._waiting_names
    tiers.close()
