"""A block the disk writer holds, its file not written yet, is restored from the writer's copy.

A host entry evicted while the disk is busy (or, with no host tier, a page spilled straight to the writer)
leaves every tier but the writer's queue until its file lands. A turn that came then found its history in
no tier and computed that part again (``HostRestores.locate`` asked only the host tier and the disk's
index). Now ``locate`` calls such a block "disk", and the load takes its bytes from ``DiskWriter.copy_of``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from qml_runtime.kv import disk_loads
from qml_runtime.kv.cache import KVCache
from qml_runtime.kv.disk_store import DiskStore
from qml_runtime.kv.disk_writer import DiskWriter
from qml_runtime.kv.host_tier import HostTier
from qml_runtime.kv.prefix import pack
from qml_runtime.kv.tiers import KVTiers
from qml_runtime.presets import PRESETS
from tests.test_kv_tiers import GREEDY, expected, sibling, turns  # noqa: F401 (expected: a fixture)
from tests.test_write_from_host import _run, _stalled_writer, _working_writer

BLOCK = 64


def _name(i: int) -> bytes:
    return b"name%04d" % i * 4


def test_the_writer_hands_out_its_own_copies_until_their_files_land(tmp_path):
    store = DiskStore(tmp_path, b"f" * 32, budget_bytes=2**20)
    writer = DiskWriter(store, BLOCK, SimpleNamespace(written_disk=0, persist_skipped=0), threads=0)
    rows = torch.arange(4 * BLOCK, dtype=torch.int32).remainder(251).to(torch.uint8).view(4, BLOCK)
    writer.put_block(_name(0), pack([0]), rows[0].clone(), None, None)  # an evicted host entry: owned
    writer.put_block(_name(1), pack([1]), rows[1], None, None, borrowed=True)  # a host row read in place
    writer.put_pages(rows[2:].clone(), None, [(_name(2), pack([2]), None), (_name(3), pack([3]), None)])
    data, ready = writer.copy_of(_name(0), pack([0]))
    assert torch.equal(data, rows[0]) and ready is None
    assert writer.copy_of(_name(0), pack([7])) is None  # tokens checked
    assert writer.copy_of(_name(0), [0]) is not None  # (the ids, as locate may pass them)
    assert writer.copy_of(_name(1), pack([1])) is None  # still the host tier's row: found there
    writer.detach(_name(1))  # the row is about to take another page: the writer's own copy from now on
    rows[1].fill_(0)
    assert torch.equal(writer.copy_of(_name(1), pack([1]))[0], torch.arange(BLOCK, 2 * BLOCK).remainder(251).byte())
    assert torch.equal(writer.copy_of(_name(3), pack([3]))[0], rows[3])  # a row of gathered pages
    assert writer.copy_of(b"never handed over", pack([0])) is None
    _run(writer)
    assert all(writer.copy_of(_name(i), pack([i])) is None for i in range(4))  # in their files now
    assert all(store.contains(_name(i)) for i in range(4)) and not writer._owned
    store.close()


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reader", ["process", "threads"])
def test_blocks_evicted_from_host_ram_before_their_files_land_are_restored(tmp_path, monkeypatch, reader, device):
    monkeypatch.setattr(disk_loads, "READER", reader)
    tiers = _tiers(tmp_path, device, host_slots=2)
    writer, kv, disk = tiers._writer, tiers.kv, tiers.disk
    try:
        want = {p: kv.gather_pages(torch.tensor([p], device=device))[0].cpu() for p in range(4)}
        blocks = [(p, _name(p), bytes(pack([p, p, p, p])), None) for p in range(4)]
        tiers.persist(blocks[:2])
        tiers.persist(blocks[2:])  # two host rows: pages 0 and 1 leave host RAM, their writes still queued
        tiers.flush_spills()  # (the deferred copies down, on a GPU)
        names, packed = [_name(0), _name(1)], blocks[0][2] + blocks[1][2]
        assert tiers.host.find(names[0], blocks[0][2]) is None and not disk.contains(names[0])
        assert tiers.locate_run(names, packed) == ["disk", "disk"]
        load = tiers.start_load([("disk", n, t) for _, n, t, _ in blocks[:2]], [4, 5], 0, 8)
        assert (tiers._reader is not None) == (reader == "process")
        assert tiers.apply_load(load) == 2 and tiers.stats.restored_disk == 2
        for page, p in ((4, 0), (5, 1)):
            assert torch.equal(kv.gather_pages(torch.tensor([page], device=device))[0].cpu(), want[p]), page
        assert tiers.host.find(names[1], blocks[1][2]) is not None  # back in host RAM, as a read would be
        assert writer._reads.count == 0  # the load's reads ended (writes may go on)
        _run(writer)
        assert all(disk.contains(n) for _, n, _, _ in blocks) and tiers.stats.written_disk == 4
    finally:
        _working_writer(tiers)
        tiers.close()


@pytest.mark.parametrize("device", DEVICES)
def test_pages_spilled_straight_to_the_writer_are_restored_before_their_files_land(tmp_path, device):
    # no host tier: kept pages are gathered on the device and handed over as they are (on a GPU, a device
    # buffer the load copies from on a side stream once the gather's event has passed)
    tiers = _tiers(tmp_path, device, host_slots=0)
    writer, kv, disk = tiers._writer, tiers.kv, tiers.disk
    try:
        want = {p: kv.gather_pages(torch.tensor([p], device=device))[0].cpu() for p in range(3)}
        blocks = [(p, _name(p), bytes(pack([p, p, p, p])), None) for p in range(3)]
        tiers.persist(blocks)
        assert len(disk) == 0 and writer.copy_of(_name(0), blocks[0][2])[0].device.type == device
        names, packed = [n for _, n, _, _ in blocks], b"".join(t for _, _, t, _ in blocks)
        assert tiers.locate_run(names, packed) == ["disk"] * 3
        load = tiers.start_load([("disk", n, t) for _, n, t, _ in blocks], [5, 6, 7], 0, 12)
        assert tiers.apply_load(load) == 3 and tiers.stats.restored_disk == 3
        for page, p in ((5, 0), (6, 1), (7, 2)):
            assert torch.equal(kv.gather_pages(torch.tensor([page], device=device))[0].cpu(), want[p]), page
        _run(writer)
        assert all(disk.contains(n) for n in names) and writer.copy_of(names[0], blocks[0][2]) is None
    finally:
        _working_writer(tiers)
        tiers.close()


def _tiers(tmp_path, device: str, host_slots: int) -> KVTiers:
    """Tiers over 8 pages of random KV whose disk writer writes nothing until ``_run`` (a disk that is behind)."""
    cfg = PRESETS["tiny-llama"].config
    kv = KVCache(cfg, 8, 4, device, torch.float32)
    kv.data.normal_()
    disk = DiskStore(tmp_path, b"f" * 32, budget_bytes=2**30)
    host = HostTier(kv.block_bytes, host_slots * kv.block_bytes, pin=device == "cuda") if host_slots else None
    tiers = KVTiers(kv, host, disk)
    _stalled_writer(tiers)
    return tiers


@pytest.mark.parametrize("host_blocks", [0, 4], ids=["no-host-tier", "small-host-tier"])
def test_a_turn_while_its_history_waits_for_the_disk_is_served_from_the_writers_copies(engine, expected, tmp_path,
                                                                                       host_blocks):
    eng = sibling(engine, num_blocks=10, host_bytes=host_blocks * engine.kv.block_bytes, disk_dir=str(tmp_path),
                  disk_bytes=2**30)  # 160 tokens of GPU pages
    tiers = eng.tiers
    writer = _stalled_writer(tiers)
    try:
        ids2, cacheable = turns(eng)
        for q in ("Describe the sea.", "What is a prime number?", "Tell me about Paris."):
            eng.generate_sync(eng.tokenizer.apply_chat_template([{"role": "user", "content": q}]), GREEDY)
        assert tiers.stats.written_disk == 0 and len(tiers.disk) == 0 and writer._owned
        out = eng.generate_sync(ids2, GREEDY)
        assert out.cached_tokens == cacheable >= 32, "the history was recomputed"
        assert tiers.stats.restored_disk > 0 and out.token_ids == expected
    finally:
        _run(writer)
        _working_writer(tiers)
        eng.shutdown()
    assert tiers.stats.written_disk > 0
