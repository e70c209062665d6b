"""Kept pages going down to host RAM (``KVTiers.pump``): written into the host rows in place
(``qml_kernels.page_save``, no device staging), a chunk at a time between steps, and as much as
the link moves in half a step beside a long prefill, so a burst of prompts leaves no backlog for the
turn after it."""

from __future__ import annotations

import pytest
import torch

from qml_runtime.config import CacheConfig, SchedulerConfig
from qml_runtime.engine import Engine
from qml_runtime.kv.block_manager import Evicted
from qml_runtime.kv.cache import KVCache
from qml_runtime.kv.host_tier import HostTier
from qml_runtime.kv.tiers import PUMP_SHARE, KVTiers
from qml_runtime.presets import PRESETS
from qml_runtime.sampling_params import SamplingParams
from tests.test_kv_tiers import GREEDY, expected, sibling, turns  # noqa: F401  (expected: a fixture)


def _tiers(pages: int = 8, slots: int = 8) -> KVTiers:
    cfg = PRESETS["tiny-llama"].config
    kv = KVCache(cfg, pages, 4, "cpu", torch.float32)
    kv.data.normal_()
    tiers = KVTiers(kv, HostTier(kv.block_bytes, slots * kv.block_bytes, pin=False), None)
    tiers.defer_persist = tiers.save_in_place = True  # the GPU's path (the reference copies on CPU)
    return tiers


def test_the_pump_writes_kept_pages_into_their_slots_without_a_gather(monkeypatch):
    tiers = _tiers()
    monkeypatch.setattr(tiers, "_gather", lambda *a, **k: pytest.fail("staged through a device gather"))
    tiers.host.slots.fill_(7)
    pages = [6, 2, 7, 0, 5]
    tiers.persist([(p, b"name-%d" % p, (p,), None) for p in pages])
    tiers.pump_pages = 2
    assert tiers.pump() and tiers.deferred == 3  # one chunk between steps
    assert not tiers.pump(max_pages=10, beside_step=True) and tiers.deferred == 0  # the rest beside a step
    assert not tiers._pending  # nothing went the spill way
    want = tiers.kv.gather_pages(torch.tensor(pages))
    for i, p in enumerate(pages):
        assert torch.equal(tiers.host.slots[tiers.host.find(b"name-%d" % p, (p,))], want[i])
    assert bool((tiers.host.slots[len(pages):] == 7).all())  # other slots untouched


def test_beside_a_step_the_pump_takes_what_the_link_moves_in_half_of_it():
    tiers = _tiers()
    tiers.planner.host_bytes_per_s = 10 * tiers.block_bytes  # ten pages a second
    assert PUMP_SHARE == 0.5
    assert tiers.pages_beside(1.0) == 5 and tiers.pages_beside(0.15) == 0
    tiers.persist([(p, b"name-%d" % p, (p,), None) for p in range(7)])
    tiers.pump_pages = 1
    assert tiers.pump(tiers.pages_beside(1.0), beside_step=True) and tiers.deferred == 2


def test_the_pump_waits_for_a_restore_even_beside_a_step():
    tiers = _tiers()
    tiers.persist([(p, b"name-%d" % p, (p,), None) for p in (1, 2)])
    tiers.kv._restoring = ["event"] * tiers.kv.data.shape[0]  # a restore's layers still arriving
    assert tiers.pump(8, beside_step=True) and tiers.deferred == 2
    tiers.kv._restoring = None
    assert not tiers.pump(8, beside_step=True) and tiers.deferred == 0


def test_a_long_prefill_takes_the_backlog_down_beside_it(engine, expected, monkeypatch):  # noqa: F811
    """The engine never pumps between steps here: only a long prompt's prefill does, so the finished
    turn's kept pages reach host RAM during it. The next turn, its history evicted by more prompts,
    comes back from host RAM with the same greedy reply as without a cache."""
    eng = sibling(engine, num_blocks=12, host_bytes=64 * 2**20)
    beside, stepping = [], [False]
    pump = type(eng.tiers).pump

    def recorded(self, max_pages=None, beside_step=False, **kwargs):
        before = self.deferred
        more = pump(self, max_pages, beside_step, **kwargs)
        if beside_step:
            beside.append((before, max_pages, self.deferred, stepping[0]))
        return more

    step = eng.runner.step

    def step_flagged(*args, **kwargs):
        stepping[0] = True
        try:
            return step(*args, **kwargs)
        finally:
            stepping[0] = False

    monkeypatch.setattr(type(eng.tiers), "pump", recorded)
    eng.runner.step = step_flagged
    eng._pump = lambda: False  # no chunk between steps or while idle
    eng.pump_beside_min_tokens = 64  # the tiny model's "long" prompt
    try:
        eng.tiers.defer_persist = eng.tiers.save_in_place = True
        ids2, cacheable = turns(eng)
        kept = eng.tiers.deferred
        assert kept >= cacheable // 16 >= 2  # the first turn's pages wait for a copy
        long = "Count with me: " + " ".join(str(i) for i in range(22))
        ids = eng.tokenizer.apply_chat_template([{"role": "user", "content": long}])
        assert len(ids) >= 64
        eng.generate_sync(ids, SamplingParams(max_tokens=1, temperature=0))
        assert beside and beside[0][0] == kept and beside[0][1] > 0
        assert beside[0][2] == 0 and not eng.tiers._pending  # all of it beside the prefill
        assert beside[0][3]  # queued once the step was (runner.step's while_running), not before it
        for q in ("Describe the sea.", "What is a prime number?", "Tell me about Paris.", "Why is grass green?"):
            eng.generate_sync(eng.tokenizer.apply_chat_template([{"role": "user", "content": q}]), GREEDY)
        restored = eng.tiers.stats.restored_host
        out = eng.generate_sync(ids2, GREEDY)
        assert out.cached_tokens == cacheable and out.token_ids == expected
        assert eng.tiers.stats.restored_host > restored
    finally:
        eng.shutdown()


def test_switched_off_the_long_prefill_leaves_the_backlog(engine, monkeypatch):
    """``QML_PUMP_BESIDE=0`` (``tiers.pump_beside``): the kept pages wait for the pump between steps."""
    monkeypatch.setenv("QML_PUMP_BESIDE", "0")
    eng = sibling(engine, num_blocks=12, host_bytes=64 * 2**20)
    assert eng.tiers.pump_beside is False
    try:
        _long_prefill_after_a_turn(eng, monkeypatch)
    finally:
        eng.shutdown()


def _long_prefill_after_a_turn(eng, monkeypatch, before_prefill=lambda: None) -> None:
    """A turn whose pages wait for their copy down, then (after ``before_prefill()``) a long prompt's prefill
    with the pump between steps off and every pump call recorded: none may come, and the kept pages still wait."""
    calls = []
    monkeypatch.setattr(type(eng.tiers), "pump", lambda self, *a, **k: calls.append((a, k)) or True)
    eng._pump = lambda: False
    eng.pump_beside_min_tokens = 64  # the tiny model's "long" prompt counts as long (``before_prefill`` may change it)
    eng.tiers.defer_persist = eng.tiers.save_in_place = True
    turns(eng)
    kept = eng.tiers.deferred
    assert kept >= 2
    before_prefill()
    long = "Count with me: " + " ".join(str(i) for i in range(22))
    eng.generate_sync(eng.tokenizer.apply_chat_template([{"role": "user", "content": long}]),
                      SamplingParams(max_tokens=1, temperature=0))
    assert calls == [] and eng.tiers.deferred >= kept


def test_a_short_prefill_leaves_the_backlog_to_the_pump_between_steps(engine, monkeypatch):
    """A prefill of fewer new tokens than ``pump_beside_min_tokens`` (a conversation's next turn) runs without
    the pump's copies beside it, even in a tight pool: the kept pages wait for the pump between steps."""
    eng = sibling(engine, num_blocks=12, host_bytes=64 * 2**20)

    def short_and_tight():
        assert eng._pool_tight()
        eng.pump_beside_min_tokens = 10_000  # more than the prompt below has

    try:
        _long_prefill_after_a_turn(eng, monkeypatch, short_and_tight)
    finally:
        eng.shutdown()


def test_a_roomy_pool_leaves_the_backlog_to_the_pump_between_steps(engine, monkeypatch):
    """With more pages surely empty than the longest request takes, no allocation is about to evict a kept
    page: a long prefill runs without the pump's copies beside it (they cost it SMs and bandwidth), and the
    kept pages still wait for the pump between steps."""
    eng = Engine(engine.model, engine.tokenizer, engine.model_config, model_id="tiers", device=engine.device,
                 dtype=engine.dtype, cache=CacheConfig(block_size=16, num_blocks=48, host_bytes=64 * 2**20),
                 scheduler=SchedulerConfig(), fingerprint=engine.scheduler.fingerprint, context_length=320)
    eng.start()

    def roomy():  # 20 pages of 320 tokens; 48 - the cached ones empty
        assert not eng._pool_tight()

    try:
        _long_prefill_after_a_turn(eng, monkeypatch, roomy)
        blocks = eng.scheduler.blocks  # the same pool with fewer pages surely empty than a request's 20
        monkeypatch.setattr(type(blocks), "num_free", property(lambda self: 19 + self.num_cached))
        assert eng._pool_tight()
    finally:
        eng.shutdown()


class _FakeEvent:
    def __init__(self, done: bool):
        self.done, self.queries = done, 0

    def query(self) -> bool:
        self.queries += 1
        return self.done


def test_evicting_saved_pages_asks_once_per_batch_not_per_page(monkeypatch):
    """Pages saved by the pump are evicted for a restore: the compute stream waits for the copies
    still reading them, asking the driver once per pump batch (batches finish in order on the copy
    stream, so the newest finished or waited-for batch covers the older ones)."""
    tiers = _tiers(pages=8, slots=16)
    waited = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type(
        "S", (), {"wait_event": lambda self, e: waited.append(e)})())
    old, new = _FakeEvent(done=True), _FakeEvent(done=False)
    tiers._saving = {p: (1, old) for p in (0, 1, 2)} | {p: (2, new) for p in (3, 4, 5)}
    tiers._save_seq = 2
    for p in (3, 0, 4, 1, 5, 2, 6):  # interleaved, and a page the pump never saved
        tiers.spill(p, b"name-%d" % p, (p,))
    assert waited == [new] and new.queries == 1  # one wait covers batch 2 and the older batch 1
    assert old.queries == 0 and not tiers._saving
    done = _FakeEvent(done=True)
    tiers._saving = {7: (3, done)}
    tiers.spill(7, b"name-7", (7,))
    assert done.queries == 1 and waited == [new] and tiers._saved_seq == 3  # finished: no wait


def test_spill_many_leaves_what_spills_one_by_one_leave(monkeypatch):
    """``spill_many`` (one call per ``BlockManager.grow``) against ``spill`` page by page on twin tiers: pages kept
    in host RAM (some still being saved by the pump, in two batches), one kept but not copied yet (deferred), and
    pages the host tier does not hold (new slots, evicting old entries). Same host LRU order, slots,
    pending copies, deferred pages, stats, and the compute stream waits for the newest pump batch only."""
    def state(tiers):
        return (list(tiers.host._lru.items()), sorted(tiers.host._free), list(tiers._pending),
                dict(tiers._deferred), tiers._saving, tiers.stats.spilled_host)

    runs, waits = [], []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type(
        "S", (), {"wait_event": lambda self, e: waits[-1].append(e)})())
    for one_by_one in (True, False):
        tiers = _tiers(pages=8, slots=6)
        tiers.persist([(p, b"name-%d" % p, (p,), None) for p in (0, 1, 2, 3, 4)])  # 5 slots, deferred
        tiers.pump_pages = 4
        tiers.pump()  # pages 0-3 go down (the reference copies at once on CPU); page 4 stays deferred
        old, new = _FakeEvent(done=False), _FakeEvent(done=False)
        tiers._saving = {0: (1, old), 1: (1, old), 2: (2, new), 3: (2, new)}
        tiers._save_seq = 2
        evicted = [(p, b"name-%d" % p, (p,)) for p in (2, 0, 4, 5, 3, 6, 1)]  # 5 and 6: not in host RAM
        waits.append([])
        if one_by_one:
            for page, name, tokens in evicted:
                tiers.spill(page, name, tokens)
        else:
            tiers.spill_many(Evicted(*map(list, zip(*evicted))))
        runs.append(state(tiers))
    assert runs[0] == runs[1]
    assert waits[1] == [new] and not runs[1][4]  # one wait, for batch 2, which covers batch 1
    # pages 5 and 6 took host slots, evicting the oldest entries (1 among them: page 1 came back as a spill)
    assert runs[1][5] == 3
