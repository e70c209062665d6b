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
    real_runs = tiers_mod._runs
    monkeypatch.setattr(tiers_mod, "_runs", lambda slots: runs.append(real_runs(slots)) or runs[-1])
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
