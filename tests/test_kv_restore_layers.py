"""Restores from host RAM by layer: the pool's per-layer events, the zero-copy layout, and the runner.

On the GPU a restore reads the pinned host rows in place, one layer per launch on a side stream,
and the prefill waits for layer i's event before reading layer i (qml_runtime.kv.tiers
``_upload_layers``; measured in benchmarks/kv_upload_h200.py). Here, without a GPU, the events
are stand-ins and the waits are recorded: what is checked is which wait comes before which read.
"""

from __future__ import annotations

import pytest
import torch

from qml_kernels.page_copy import page_copy_ref
from qml_runtime.config import CacheConfig, SchedulerConfig
from qml_runtime.cuda_graphs import DecodeGraphs, PrefillGraphs
from qml_runtime.engine import Engine
from qml_runtime.kv.cache import KVCache
from qml_runtime.presets import PRESETS
from qml_runtime.sampling_params import SamplingParams
from qml_runtime.scheduler import ScheduledBatch


def _recording(kv: KVCache) -> list:
    waits = []
    kv._wait = waits.append
    return waits


def test_a_layer_waits_for_its_own_restore_event_and_settle_waits_for_the_last():
    cfg = PRESETS["tiny-llama"].config
    kv = KVCache(cfg, 6, 4, "cpu", torch.float32)
    waits = _recording(kv)
    events = [f"layer{i}" for i in range(cfg.num_layers)]
    assert not kv.restoring
    kv.layer(0)
    assert waits == []  # nothing in flight: no wait
    kv.restore_events(events)
    assert kv.restoring
    kv.layer(1)
    kv.layer(0)
    assert waits == ["layer1", "layer0"]
    kv.settle()
    assert waits[-1] == events[-1] and not kv.restoring
    kv.settle()
    assert len(waits) == 3  # settled: no second wait
    with pytest.raises(AssertionError):
        kv.restore_events(events[:-1])  # one event per layer


@pytest.mark.parametrize("op", ["gather", "scatter"])
def test_whole_pool_copies_come_after_restores_in_flight(op):
    cfg = PRESETS["tiny-llama"].config
    kv = KVCache(cfg, 6, 4, "cpu", torch.float32)
    waits = _recording(kv)
    kv.restore_events([f"layer{i}" for i in range(cfg.num_layers)])
    pages = torch.tensor([1, 4])
    if op == "gather":
        kv.gather_pages(pages)
    else:
        kv.scatter_pages(pages, torch.zeros(2, kv.block_bytes, dtype=torch.uint8))
    assert waits == [f"layer{cfg.num_layers - 1}"] and not kv.restoring


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_chunk_views_put_host_rows_where_scatter_pages_does(dtype):
    """The zero-copy restore's layout: page_copy over ``chunk_views`` writes each host row into the
    same pool elements as the staging path's ``scatter_pages``, and touches no other page."""
    cfg = PRESETS["tiny-llama"].config
    a = KVCache(cfg, 9, 4, "cpu", dtype)
    a.data.normal_()
    b = KVCache(cfg, 9, 4, "cpu", dtype)
    b.data.copy_(a.data)
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(7, a.block_bytes // a.data.element_size(), generator=gen).to(dtype).view(torch.uint8)
    pages, slots = torch.tensor([8, 0, 5, 3]), torch.tensor([6, 2, 0, 4])
    a.scatter_pages(pages, table[slots])
    pool, rows = b.chunk_views(table)
    page_copy_ref(pool, pages, rows, slots)
    assert torch.equal(a.data, b.data)
    # a range of chunks (one layer's K and V) writes only that layer
    c = KVCache(cfg, 9, 4, "cpu", dtype)
    pool, rows = c.chunk_views(table)
    page_copy_ref(pool, pages, rows, slots, 2, 4)
    assert torch.equal(c.data[1][:, pages], a.data[1][:, pages])
    assert not c.data[0].any() and not c.data[2:].any()


@pytest.fixture()
def graphed(engine):
    eng = Engine(engine.model, engine.tokenizer, engine.model_config, model_id="t", device=engine.device,
                 dtype=engine.dtype, cache=CacheConfig(block_size=16, num_blocks=64), scheduler=SchedulerConfig())
    eng.runner.graphs = DecodeGraphs(engine.model, eng.kv, engine.device, 4, eng.context_length, capture=False)
    eng.runner.prefill_graphs = PrefillGraphs(engine.model, eng.kv, engine.device, eng.context_length,
                                              capture=False, buckets=(16, 64))
    return eng


def _sequence(eng: Engine, n: int):
    params = SamplingParams(max_tokens=4, temperature=0.0)
    seq = eng._new_sequence(list(range(300, 300 + n)), params, f"r{n}")
    eng.blocks.grow(seq.block_table, n)
    return seq


def test_a_prefill_with_pages_arriving_runs_eagerly_and_waits_layer_by_layer(graphed):
    eng = graphed
    L = eng.model_config.num_layers
    waits = _recording(eng.kv)
    used = []
    run = eng.runner.prefill_graphs.run
    eng.runner.prefill_graphs.run = lambda seq, n: used.append(n) or run(seq, n)
    with torch.inference_mode():
        plain = eng.runner.step(ScheduledBatch([_sequence(eng, 40)], [40]))[0]
        assert used == [40] and waits == []  # nothing restoring: the padded (graph) path
        eng.kv.restore_events([f"layer{i}" for i in range(L)])
        restoring = eng.runner.step(ScheduledBatch([_sequence(eng, 40)], [40]))[0]
    assert used == [40], "a prefill ran through a graph while pages were still arriving"
    # each layer waited for its own event, in order, and the step settled the restore after the forward
    assert waits == [f"layer{i}" for i in range(L)] + [f"layer{L - 1}"]
    assert not eng.kv.restoring
    assert restoring == plain  # the same prompt: the eager path gives the same token


def test_a_decode_graph_replay_waits_for_the_whole_restore_first(graphed):
    eng = graphed
    L = eng.model_config.num_layers
    waits = _recording(eng.kv)
    seq = _sequence(eng, 20)
    with torch.inference_mode():
        eng.runner.step(ScheduledBatch([seq], [20]))
        seq.token_ids.append(301)
        eng.blocks.grow(seq.block_table, seq.num_tokens)
        eng.kv.restore_events([f"layer{i}" for i in range(L)])
        replayed = []
        run = eng.runner.graphs.run
        eng.runner.graphs.run = lambda seqs, prev=None: (replayed.append(list(waits)), run(seqs, prev))[1]
        eng.runner.step(ScheduledBatch([seq], [1]))
    assert replayed == [[f"layer{L - 1}"]], "the replay did not wait for the restore's last layer first"
    assert not eng.kv.restoring


def test_spilling_evicted_pages_does_not_wait_for_a_restore_in_flight():
    """The turn that restores its history evicts pages for its new tokens after the restore is queued:
    copying those out must not make the compute stream wait for the whole restore (the prefill would
    then run after it instead of beside it), while copying out a finished request's pages does."""
    from qml_runtime.kv.host_tier import HostTier
    from qml_runtime.kv.tiers import KVTiers

    cfg = PRESETS["tiny-llama"].config
    kv = KVCache(cfg, 8, 4, "cpu", torch.float32)
    kv.data.normal_()
    waits = _recording(kv)
    tiers = KVTiers(kv, HostTier(kv.block_bytes, 4 * kv.block_bytes, pin=False), None)
    events = [f"layer{i}" for i in range(cfg.num_layers)]
    kv.restore_events(events)
    tiers.spill(5, b"name-5", (1, 2, 3, 4))
    tiers.flush_spills()
    assert kv.restoring and waits == []
    slot = tiers.host.find(b"name-5", (1, 2, 3, 4))
    assert torch.equal(tiers.host.slots[slot], kv.gather_pages(torch.tensor([5]), settle=False)[0])
    tiers._gather([3])  # a finished request's pages (write-through): after the restore
    assert waits == [events[-1]] and not kv.restoring


def test_pages_evicted_in_lru_order_copy_down_in_runs_of_host_slots(monkeypatch):
    """Pages evicted in LRU order reach host slots out of order; the gather follows the slots, so a
    run of consecutive slots is one copy (a copy per page cost ~64 ms of a host turn on the H200),
    and every page lands in its own slot."""
    from qml_runtime.kv import tiers as tiers_mod
    from qml_runtime.kv.host_tier import HostTier
    from qml_runtime.kv.tiers import KVTiers

    cfg = PRESETS["tiny-llama"].config
    kv = KVCache(cfg, 8, 4, "cpu", torch.float32)
    kv.data.normal_()
    tiers = KVTiers(kv, HostTier(kv.block_bytes, 8 * kv.block_bytes, pin=False), None)
    tiers.defer_persist = True
    pages = [6, 2, 7, 0, 5]
    tiers.persist([(p, b"name-%d" % p, (p,), None) for p in pages])  # slots 0..4, in this order
    slot_of = {p: tiers.host.find(b"name-%d" % p, (p,)) for p in pages}
    assert sorted(slot_of.values()) == list(range(5)) and tiers.deferred == 5
    runs = []
    real_runs = tiers_mod.slot_runs
    monkeypatch.setattr(tiers_mod, "slot_runs", lambda slots: runs.append(real_runs(slots)) or runs[-1])
    for p in (5, 0, 7, 2, 6):  # evicted oldest-first: the reverse of the slot order
        tiers.spill(p, b"name-%d" % p, (p,))
    tiers.flush_spills()
    assert runs == [[(0, 0, 5)]]  # one batch, one run of five slots
    want = kv.gather_pages(torch.tensor(pages))
    for i, p in enumerate(pages):
        assert torch.equal(tiers.host.slots[slot_of[p]], want[i])


def test_the_pump_waits_while_a_restore_is_in_flight():
    """Deferred copies share the link with nothing the turn waits on: while a restore's pages are
    still arriving the pump queues no chunk, then it queues ``pump_pages`` at a time."""
    from qml_runtime.kv.host_tier import HostTier
    from qml_runtime.kv.tiers import KVTiers

    cfg = PRESETS["tiny-llama"].config
    kv = KVCache(cfg, 8, 4, "cpu", torch.float32)
    kv.data.normal_()
    waits = _recording(kv)
    tiers = KVTiers(kv, HostTier(kv.block_bytes, 8 * kv.block_bytes, pin=False), None)
    tiers.defer_persist, tiers.pump_pages = True, 2
    tiers.persist([(p, b"name-%d" % p, (p,), None) for p in (1, 2, 3)])
    kv.restore_events([f"layer{i}" for i in range(cfg.num_layers)])
    assert tiers.pump() and tiers.deferred == 3  # a restore in flight: nothing moves
    kv.settle()
    assert waits[-1] == f"layer{cfg.num_layers - 1}" and not kv.restoring
    assert tiers.pump() and tiers.deferred == 1  # two pages; one left
    assert not tiers.pump() and tiers.deferred == 0
    want = kv.gather_pages(torch.tensor([1, 2, 3]))
    for i, p in enumerate((1, 2, 3)):
        assert torch.equal(tiers.host.slots[tiers.host.find(b"name-%d" % p, (p,))], want[i])


def test_an_older_restore_handed_in_later_leaves_the_newer_events():
    """A split's copy holds its events until its turn (``apply_load``); restores launched after it on the
    same stream cover its copies, so handing its events in then must not replace theirs."""
    cfg = PRESETS["tiny-llama"].config
    kv = KVCache(cfg, 6, 4, "cpu", torch.float32)
    waits = _recording(kv)
    older = [f"older{i}" for i in range(cfg.num_layers)]
    newer = [f"newer{i}" for i in range(cfg.num_layers)]
    kv.restore_events(newer, 2)
    kv.restore_events(older, 1)
    kv.layer(0)
    assert waits == ["newer0"]
    kv.settle()  # the newer one waited for: the older one is done too, but its events may come in still
    kv.restore_events(older, 1)
    kv.layer(1)
    assert waits[-1] == "older1"


def _tiers_with_fake_layered_copies(monkeypatch, num_blocks=10, host_slots=8):
    """KVTiers on CPU whose host-RAM restores take the layered path with stand-in events (the copy itself
    done at once): which step waits for which copy is what is checked."""
    from qml_runtime.kv.host_tier import HostTier
    from qml_runtime.kv.tiers import KVTiers

    cfg = PRESETS["tiny-llama"].config
    kv = KVCache(cfg, num_blocks, 4, "cpu", torch.float32)
    waits = _recording(kv)
    tiers = KVTiers(kv, HostTier(kv.block_bytes, host_slots * kv.block_bytes, pin=False), None)

    def layers(pages, sources, hold=False):
        for src, d, s, n in sources:
            for j in range(n):
                kv.write_page(pages[d + j], src[s + j])
        tiers._uploads += 1
        events = [f"copy{tiers._uploads}-layer{i}" for i in range(cfg.num_layers)]
        if not hold:
            kv.restore_events(events, tiers._uploads)
        return events

    tiers._in_place = True
    monkeypatch.setattr(tiers, "_upload_layers", layers)
    return kv, tiers, waits


def _host_blocks(tiers, count):
    """``count`` blocks in host RAM with random rows: [(name, packed tokens)], their rows."""
    from qml_runtime.kv.prefix import pack

    blocks, rows = [], []
    for i in range(count):
        name, tokens = b"block-%d" % i, pack(list(range(4 * i, 4 * i + 4)))
        slot, _ = tiers.host.reserve(name, tokens)
        tiers.host.slots[slot].copy_(torch.randint(0, 255, (tiers.block_bytes,), dtype=torch.uint8))
        blocks.append((name, tokens))
        rows.append(tiers.host.slots[slot].clone())
    return blocks, rows


def test_a_split_tail_is_copied_at_once_and_waited_for_only_by_the_turn(monkeypatch):
    kv, tiers, waits = _tiers_with_fake_layered_copies(monkeypatch)
    blocks, rows = _host_blocks(tiers, 5)
    names, packed = [n for n, _ in blocks], b"".join(t for _, t in blocks)
    assert tiers.locate_run(names, packed) == ["host"] * 5
    pages = [7, 3, 8]  # the tail: blocks 2..4 (the head, blocks 0..1, is recomputed)
    load = tiers.start_load([("host", n, t) for n, t in blocks[2:]], pages, 8, 20, prefetch=2)
    for page, row in zip(pages, rows[2:]):  # copied already
        assert torch.equal(kv.data[:, :, page].reshape(-1).view(torch.uint8), row)
    assert not kv.restoring  # the head's steps do not wait for it
    kv.layer(0)
    assert waits == []
    assert tiers.apply_load(load) == 3 and tiers.stats.restored_host == 3
    kv.layer(1)  # the turn's step does, layer by layer
    assert waits == ["copy1-layer1"]


def test_a_sequence_leaving_before_its_split_tail_lands_orders_its_pages_after_the_copy(monkeypatch):
    kv, tiers, waits = _tiers_with_fake_layered_copies(monkeypatch)
    blocks, _ = _host_blocks(tiers, 3)
    tiers.locate_run([n for n, _ in blocks], b"".join(t for _, t in blocks))
    load = tiers.start_load([("host", n, t) for n, t in blocks[1:]], [4, 5], 4, 12, prefetch=1)
    tiers.drop_load(load)
    assert waits == [f"copy1-layer{kv.data.shape[0] - 1}"]  # the next user of pages 4 and 5 comes after it
    assert not kv.restoring


def test_a_sequence_leaving_during_its_disk_reads_gives_their_host_slots_back(tmp_path, monkeypatch):
    import threading

    from qml_runtime.kv.disk_store import DiskStore
    from qml_runtime.kv.host_tier import HostTier
    from qml_runtime.kv.prefix import pack, unpack
    from qml_runtime.kv.tiers import KVTiers

    cfg = PRESETS["tiny-llama"].config
    kv = KVCache(cfg, 8, 4, "cpu", torch.float32)
    disk = DiskStore(tmp_path, bytes(32), budget_bytes=1 << 30)
    tiers = KVTiers(kv, HostTier(kv.block_bytes, 4 * kv.block_bytes, pin=False), disk)
    try:
        blocks = [(bytes([i]) * 32, pack([i, i, i, i])) for i in range(2)]
        for name, tokens in blocks:
            assert disk.put(name, None, unpack(tokens), bytes(kv.block_bytes))
        gate = threading.Event()
        get_into = disk.get_into
        monkeypatch.setattr(disk, "get_into", lambda *a: gate.wait(10) and get_into(*a))
        load = tiers.start_load([("disk", n, t) for n, t in blocks], [2, 3], 0, 8)
        assert len(tiers.host._held) == 2
        tiers.drop_load(load)
        assert len(tiers.host._held) == 2  # still being read into
        gate.set()
        for f in load.futures:
            f.result(timeout=10)
        tiers.drop_load(tiers.start_load([], [], 0, 0))  # (reaped on the next load or drop)
        assert not tiers.host._held
        assert all(tiers.host.find(n, t) is not None for n, t in blocks)  # read whole: kept in host RAM
    finally:
        tiers.close()


def test_reusing_a_host_slot_waits_only_for_a_restore_that_reads_it():
    """A split's tail copies for most of the turn; the engine thread meanwhile keeps finished requests' pages in
    host RAM, evicting old entries: only a slot the copy reads must wait for it (on the host)."""
    from qml_runtime.kv.host_tier import HostTier
    from qml_runtime.kv.tiers import KVTiers

    class Event:
        def __init__(self):
            self.waited = False

        def query(self):
            return self.waited

        def synchronize(self):
            self.waited = True

    cfg = PRESETS["tiny-llama"].config
    kv = KVCache(cfg, 8, 4, "cpu", torch.float32)
    tiers = KVTiers(kv, HostTier(kv.block_bytes, 8 * kv.block_bytes, pin=False), None)
    copy = Event()
    tiers._reads.append(({1, 2, 3}, copy))
    tiers._settle_slot(5)
    assert not copy.waited
    tiers._settle_slot(2)
    assert copy.waited
    tiers._settle_slot(2)
    assert tiers._reads == []  # done: forgotten


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the layered copy reads pinned host rows from a GPU")
def test_on_a_gpu_a_split_tail_lands_in_its_pages_and_the_pool_waits_only_once_applied():
    from qml_runtime.kv.host_tier import HostTier
    from qml_runtime.kv.tiers import KVTiers

    cfg = PRESETS["tiny-llama"].config
    kv = KVCache(cfg, 16, 4, "cuda", torch.float16)
    tiers = KVTiers(kv, HostTier(kv.block_bytes, 8 * kv.block_bytes, pin=True), None)
    blocks, rows = _host_blocks(tiers, 6)
    tiers.locate_run([n for n, _ in blocks], b"".join(t for _, t in blocks))
    pages = [11, 4, 9, 13]
    load = tiers.start_load([("host", n, t) for n, t in blocks[2:]], pages, 8, 24, prefetch=2)
    assert load.held is not None and not kv.restoring
    assert tiers.apply_load(load) == 4 and kv.restoring
    kv.settle()
    for page, row in zip(pages, rows[2:]):
        assert torch.equal(kv.data[:, :, page].reshape(-1).view(torch.uint8).cpu(), row)
    tiers.close()


def _restore_five_on_a_gpu(monkeypatch, **settings) -> tuple:
    """A restore of five host blocks into pages 11, 4, 9, 13, 2 of a tiny-llama pool on the GPU, with
    ``host_restores.<setting>`` set to each value: (config, cache, tiers, the blocks' host rows, pages), the
    copy in flight."""
    from qml_runtime.kv import host_restores
    from qml_runtime.kv.host_tier import HostTier
    from qml_runtime.kv.tiers import KVTiers

    for setting, value in settings.items():
        monkeypatch.setattr(host_restores, setting, value)
    cfg = PRESETS["tiny-llama"].config
    kv = KVCache(cfg, 16, 4, "cuda", torch.float16)
    tiers = KVTiers(kv, HostTier(kv.block_bytes, 8 * kv.block_bytes, pin=True), None)
    blocks, rows = _host_blocks(tiers, 5)
    names, packed = [n for n, _ in blocks], b"".join(t for _, t in blocks)
    tiers.locate_run(names, packed)
    pages = [11, 4, 9, 13, 2]
    assert tiers.restore_host(names, packed, pages) == 5 and kv.restoring
    return cfg, kv, tiers, rows, pages


def _landed(kv, tiers, rows, pages) -> None:
    kv.settle()
    for page, row in zip(pages, rows):
        assert torch.equal(kv.data[:, :, page].reshape(-1).view(torch.uint8).cpu(), row)
    tiers.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the layered copy reads pinned host rows from a GPU")
@pytest.mark.parametrize("groups", ["", "halves", "2,3"])
def test_on_a_gpu_a_restore_in_layer_groups_lands_and_each_layer_waits_for_its_group(monkeypatch, groups):
    """``QML_RESTORE_GROUPS``: one launch copies several layers; a layer's event is its group's (the last layer's
    group ends the restore)."""
    from qml_runtime.kv.host_restores import layer_groups

    cfg, kv, tiers, rows, pages = _restore_five_on_a_gpu(monkeypatch, RESTORE_GROUPS=groups, RESTORE_STAGED=0)
    events = kv._restoring
    for lo, hi in layer_groups(cfg.num_layers, groups):
        assert all(events[layer] is events[lo] for layer in range(lo, hi))
        assert hi == cfg.num_layers or events[hi] is not events[lo]
    _landed(kv, tiers, rows, pages)


def test_the_staged_copies_fill_a_region_as_page_copy_reads_it():
    """``staged_copies``' 2D copies (here applied to byte buffers) put rows' chunks where the staging view
    that page_copy scatters from has them: the restore through the copy engines lands what page_copy_ref does."""
    from qml_runtime.kv.host_restores import staged_copies

    C, W, N = 6, 8, 10
    table = torch.randn(N, C, W, generator=torch.Generator().manual_seed(0)).to(torch.float16)
    runs = [(0, 7, 2), (2, 1, 3), (5, 9, 1)]  # (staging row, host row, count): three slot runs, six pages
    pages = torch.tensor([3, 0, 5, 1, 4, 2])
    slots = torch.tensor([7, 8, 1, 2, 3, 9])
    elem = table.element_size()
    for c_lo, c_n in ((0, 2), (2, 4), (4, 2)):
        staging = torch.zeros(2 * C * W + 6 * c_n * W, dtype=table.dtype)  # a row's width each side, as the ring
        region = C * W * elem
        host_bytes, stage_bytes = table.view(-1).view(torch.uint8), staging.view(torch.uint8)
        for dst, dst_pitch, src, src_pitch, width, height in staged_copies(runs, 0, C * W * elem, W * elem, region,
                                                                            c_lo, c_n):
            for h in range(height):
                stage_bytes[dst + h * dst_pitch:dst + h * dst_pitch + width] = \
                    host_bytes[src + h * src_pitch:src + h * src_pitch + width]
        rows = staging.as_strided((6, C, W), (c_n * W, W, 1), C * W - c_lo * W)
        got = page_copy_ref(torch.zeros(C, 6, W, dtype=table.dtype), pages, rows, torch.arange(6), c_lo, c_lo + c_n)
        want = page_copy_ref(torch.zeros(C, 6, W, dtype=table.dtype), pages, table, slots, c_lo, c_lo + c_n)
        assert torch.equal(got, want) and got[c_lo:c_lo + c_n].abs().sum() > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the staged restore copies pinned host rows on a GPU")
@pytest.mark.parametrize("per", [1, 2])
def test_on_a_gpu_a_staged_restore_lands_and_each_layer_waits_for_its_group(monkeypatch, per):
    """``QML_RESTORE_STAGED``: 2D copies into a staging ring and page_copy out of it; the pages hold the rows. The
    tiers warm the path up at start with a restore of one page."""
    from qml_runtime.kv.host_restores import HostRestores, layer_groups

    staged_pages = []
    upload_staged = HostRestores._upload_staged

    def counted(self, staging, pool, pages_d, *args):
        staged_pages.append(pages_d.numel())
        return upload_staged(self, staging, pool, pages_d, *args)

    monkeypatch.setattr(HostRestores, "_upload_staged", counted)
    cfg, kv, tiers, rows, pages = _restore_five_on_a_gpu(monkeypatch, RESTORE_STAGED=per)
    assert staged_pages == [1, 5]  # the warm-up's page, then the restore's five
    events = kv._restoring
    for lo, hi in layer_groups(cfg.num_layers, [per] * cfg.num_layers):
        assert all(events[layer] is events[lo] for layer in range(lo, hi))
    _landed(kv, tiers, rows, pages)
