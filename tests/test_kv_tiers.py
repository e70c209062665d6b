"""The KV tiers below the GPU: host RAM and disk, restored by name, surviving an engine restart."""

from __future__ import annotations

import hashlib
import threading
import time

import pytest
import torch

from qml_runtime.config import CacheConfig, SchedulerConfig
from qml_runtime.engine import Engine
from qml_runtime.kv.host_tier import HostTier
from qml_runtime.kv.planner import RestorePlanner
from qml_runtime.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0)


def test_host_tier_is_lru_and_checks_tokens():
    host = HostTier(block_bytes=8, budget_bytes=16, pin=False)  # two slots
    a, _ = host.reserve(b"a", (1,))
    b, _ = host.reserve(b"b", (2,))
    assert host.find(b"a", (1,)) == a  # a is now the most recent
    assert host.find(b"a", (9,)) is None  # same name, other tokens: a collision is a miss
    c, evicted = host.reserve(b"c", (3,))
    assert [e[0] for e in evicted] == [b"b"] and c == b  # b's slot, after its bytes are spilled
    assert host.find(b"b", (2,)) is None and len(host) == 2


def test_held_host_slots_are_not_evicted_and_a_discarded_name_frees_its_slot():
    host = HostTier(block_bytes=8, budget_bytes=16, pin=False)  # two slots
    a, _ = host.reserve(b"a", (1,))
    b, _ = host.reserve(b"b", (2,))
    assert (a, b) == (0, 1)  # ascending: pages spilled together copy as one run
    host.hold(a)
    c, evicted = host.reserve(b"c", (3,))  # a is the oldest, but held: b goes
    assert [e[0] for e in evicted] == [b"b"] and c == b
    host.hold(c)
    assert host.reserve(b"d", (4,)) == (None, [])  # everything held: no room, nothing evicted
    host.discard(b"a")
    assert host.find(b"a", (1,)) is None
    d, evicted = host.reserve(b"d", (4,))
    assert d == a and evicted == []
    host.release(c)
    e, evicted = host.reserve(b"e", (5,))
    assert [x[0] for x in evicted] == [b"c"] and e == c


def test_planner_weighs_copying_against_recomputing():
    planner = RestorePlanner(prefill_tokens_per_s=30_000, host_bytes_per_s=55e9, disk_bytes_per_s=1.46e9)
    block, tokens = 2 * 2**20, 16  # a Llama-3.1-8B page on the H200
    assert planner.worth_restoring("host", block, tokens)
    assert not planner.worth_restoring("disk", block, tokens)  # 1.4 ms to read vs 0.5 ms to recompute
    for _ in range(30):
        planner.observe("prefill", 1000, 1.0)  # a slow machine: 1000 tokens/s
    assert planner.worth_restoring("disk", block, tokens)


def sibling(engine, **cache) -> Engine:
    cfg = CacheConfig(block_size=16, **cache)
    eng = Engine(engine.model, engine.tokenizer, engine.model_config, model_id="tiers", device=engine.device,
                 dtype=engine.dtype, cache=cfg, scheduler=SchedulerConfig(), fingerprint=engine.scheduler.fingerprint)
    eng.start()
    return eng


def turns(engine):
    """Run the first turn; returns the second turn's prompt and how many of its tokens a cache can
    hold from the first (the full pages of the prefix both share)."""
    tok = engine.tokenizer
    first = [{"role": "user", "content": "Name three colours."}]
    ids1 = tok.apply_chat_template(first)
    answer = engine.generate_sync(ids1, GREEDY)
    second = first + [{"role": "assistant", "content": answer.text},
                      {"role": "user", "content": "And three animals?"}]
    ids2 = tok.apply_chat_template(second)
    history = ids1 + answer.token_ids
    shared = next(i for i, (a, b) in enumerate(zip(history + [-1], ids2)) if a != b)
    return ids2, shared // 16 * 16


@pytest.fixture(scope="module")
def expected(engine):
    ids2, _ = turns(engine)
    engine.scheduler.prefix_caching = False
    try:
        return engine.generate_sync(ids2, GREEDY).token_ids
    finally:
        engine.scheduler.prefix_caching = True


def test_pages_pushed_off_the_gpu_come_back_from_host_ram(engine, expected, tmp_path, monkeypatch):
    import json

    from qml_runtime import turn_trace

    eng = sibling(engine, num_blocks=10, host_bytes=64 * 2**20)  # 160 tokens of GPU pages
    try:
        ids2, cacheable = turns(eng)
        for q in ("Describe the sea.", "What is a prime number?", "Tell me about Paris.", "Why is grass green?",
                  "How do birds fly?"):
            eng.generate_sync(eng.tokenizer.apply_chat_template([{"role": "user", "content": q}]), GREEDY)
        assert eng.tiers.stats.spilled_host + eng.tiers.stats.kept_host > 0
        trace = tmp_path / "trace.jsonl"  # (QML_TURN_TRACE) the restore's points, between drained and scheduled
        monkeypatch.setattr(turn_trace, "PATH", str(trace))
        monkeypatch.setattr(turn_trace, "ENABLED", True)
        out = eng.generate_sync(ids2, GREEDY)
        assert eng.tiers.stats.restored_host > 0 and out.cached_tokens == cacheable >= 32
        assert out.token_ids == expected
    finally:
        eng.shutdown()
    (record,) = [json.loads(line) for line in trace.read_text().splitlines()]
    points = ["submit", "drained", "admit", "located", "planned", "evicted", "restore", "scheduled", "step", "token",
              "emit"]
    assert [p for p in turn_trace.ORDER if p in record] == points
    assert [record[p] for p in points] == sorted(record[p] for p in points)


def test_a_conversation_survives_a_restart_on_disk(engine, expected, tmp_path):
    first = sibling(engine, num_blocks=64, disk_dir=str(tmp_path), disk_bytes=2**30)
    try:
        ids2, cacheable = turns(first)
    finally:
        first.shutdown()  # flushes the writes and releases the store
    assert first.tiers.stats.written_disk > 0
    restarted = sibling(engine, num_blocks=64, disk_dir=str(tmp_path), disk_bytes=2**30)
    try:
        out = restarted.generate_sync(ids2, GREEDY)
        assert restarted.tiers.stats.restored_disk > 0
        assert restarted.tiers._writer._reads.count == 0  # the load's reads ended: writes may go on
        assert out.cached_tokens == cacheable >= 32
        assert out.token_ids == expected
        # another tenant finds nothing of it
        assert restarted.generate_sync(ids2, GREEDY, tenant="someone-else").cached_tokens == 0
    finally:
        restarted.shutdown()


def test_a_damaged_block_on_disk_is_recomputed_not_an_error(engine, expected, tmp_path):
    first = sibling(engine, num_blocks=64, disk_dir=str(tmp_path), disk_bytes=2**30)
    try:
        ids2, _ = turns(first)
    finally:
        first.shutdown()
    files = sorted(tmp_path.rglob("*.kvb"))
    assert files
    for f in files:  # flip a byte in every payload
        data = bytearray(f.read_bytes())
        data[-100] ^= 0xFF
        f.write_bytes(bytes(data))
    restarted = sibling(engine, num_blocks=64, disk_dir=str(tmp_path), disk_bytes=2**30)
    try:
        out = restarted.generate_sync(ids2, GREEDY)
        assert out.token_ids == expected and out.cached_tokens == 0
        assert restarted.tiers.disk.stats()["corrupt_deleted"] >= 1
    finally:
        restarted.shutdown()


def test_tier_activity_reaches_the_metrics(engine, tmp_path):
    from prometheus_client.parser import text_string_to_metric_families
    from starlette.testclient import TestClient

    from qml_server.app import create_app

    eng = sibling(engine, num_blocks=10, host_bytes=64 * 2**20)
    try:
        ids2, _ = turns(eng)
        for q in ("Describe the sea.", "What is a prime number?", "Tell me about Paris.", "Why is grass green?",
                  "How do birds fly?"):
            eng.generate_sync(eng.tokenizer.apply_chat_template([{"role": "user", "content": q}]), GREEDY)
        eng.generate_sync(ids2, GREEDY)
        # the last request's pages go down after its client has its last token: the counters settle first (CI
        # once scraped 14 spilled blocks while the stats read 16 just after)
        eng.flush_kv()
        with TestClient(create_app(eng)) as client:
            text = client.get("/metrics").text
        samples = {(s.name, s.labels.get("tier", s.labels.get("plan"))): s.value
                   for f in text_string_to_metric_families(text) for s in f.samples}
        assert samples[("qml:kv_restore_plans_total", "restore")] == eng.tiers.stats.plans["restore"] >= 1
        assert samples[("qml:kv_restored_blocks_total", "host")] == eng.tiers.stats.restored_host > 0
        written_down = eng.tiers.stats.spilled_host + eng.tiers.stats.kept_host
        assert samples[("qml:kv_spilled_blocks_total", "host")] == written_down > 0
        assert samples[("qml:kv_tier_bytes", "host")] == eng.tiers.host.bytes_used > 0
        # the plans' estimates (summed) and the rate a host copy is priced at; no disk tier, so no disk rate
        planned = eng.tiers.stats.planned_seconds
        assert planned > 0 and samples[("qml:kv_restore_planned_seconds_total", None)] == pytest.approx(planned)
        assert samples[("qml:kv_restore_recompute_planned_seconds_total", None)] >= planned
        assert samples[("qml:kv_restore_rate_bytes_per_second", "host")] == eng.tiers.planner.host_bytes_per_s > 0
        assert ("qml:kv_restore_rate_bytes_per_second", "disk") not in samples
    finally:
        eng.shutdown()


def test_files_written_at_the_end_of_a_request_name_their_parent(engine, tmp_path):
    eng = sibling(engine, num_blocks=64, disk_dir=str(tmp_path), disk_bytes=2**30)
    try:
        turns(eng)
    finally:
        eng.shutdown()
    files = list(tmp_path.rglob("*.kvb"))
    parents = {f.read_bytes()[88:120] for f in files}
    names = {bytes.fromhex(f.name.removesuffix(".kvb")) for f in files}
    assert eng.tiers.stats.written_disk == len(files)  # each page counted once
    assert bytes(32) in parents and parents - {bytes(32)} <= names  # a chain: the first page has none


def test_a_writer_too_far_behind_skips_write_through_and_serving_goes_on(engine, tmp_path, monkeypatch, caplog):
    from qml_runtime.kv import tiers as tiers_module

    monkeypatch.setattr(tiers_module, "MAX_PENDING_WRITE_BYTES", 0)  # always "behind"
    eng = sibling(engine, num_blocks=64, disk_dir=str(tmp_path), disk_bytes=2**30)
    try:
        with caplog.at_level("WARNING", logger="qml.kv.tiers"):
            ids2, _ = turns(eng)
            eng.flush_kv()  # (a request's pages go to the tiers after its output: on the engine thread)
            skipped_first = eng.tiers.stats.persist_skipped
            out = eng.generate_sync(ids2, GREEDY)
            eng.flush_kv()
        assert out.finish_reason in ("stop", "length")
        assert eng.tiers.stats.persist_skipped > skipped_first > 0 and eng.tiers.stats.written_disk == 0
        # said once, with the count, not at each request's end (a served run logged it 1,092 times in 40 s)
        behind = [r.getMessage() for r in caplog.records if "disk writer behind" in r.getMessage()]
        assert len(behind) == 1 and f": {skipped_first} pages not written through" in behind[0]
        monkeypatch.setattr(tiers_module, "BEHIND_WARN_INTERVAL_S", 0.0)  # the interval over: the pages since then
        with caplog.at_level("WARNING", logger="qml.kv.tiers"):
            eng.generate_sync(ids2, GREEDY)
            eng.flush_kv()
        behind = [r.getMessage() for r in caplog.records if "disk writer behind" in r.getMessage()]
        assert len(behind) == 2 and "in the last" in behind[1]
    finally:
        eng.shutdown()
    assert not list(tmp_path.rglob("*.kvb"))


def test_a_first_measurement_replaces_the_guess_and_only_measurements_are_saved():
    planner = RestorePlanner()
    assert planner.rates() == {}
    planner.observe("disk", 1.2e9, 1.0)
    assert planner.disk_bytes_per_s == pytest.approx(1.2e9)  # not averaged with the 0.5 GB/s guess
    planner.observe("disk", 2.2e9, 1.0)
    assert planner.disk_bytes_per_s == pytest.approx(0.8 * 1.2e9 + 0.2 * 2.2e9)
    assert set(planner.rates()) == {"disk_bytes_per_s"}
    fixed = RestorePlanner(alpha=0.0, disk_bytes_per_s=7.0)
    fixed.observe("disk", 1e9, 1.0)
    assert fixed.disk_bytes_per_s == 7.0


def test_a_restart_on_a_store_with_no_measured_disk_rate_probes_the_disk(engine, expected, tmp_path, monkeypatch):
    import qml_runtime.kv.planner_rates as planner_rates

    monkeypatch.setattr(planner_rates, "PROBE_MIN_BLOCKS", 2)  # the small model's conversation leaves a few blocks
    first = sibling(engine, num_blocks=64, disk_dir=str(tmp_path), disk_bytes=2**30)
    try:
        turns(first)
    finally:
        first.shutdown()
    assert len(first.tiers.disk) >= 2
    assert "disk_bytes_per_s" not in first.tiers.planner.rates()  # it never read: nothing measured to keep
    restarted = sibling(engine, num_blocks=64, disk_dir=str(tmp_path), disk_bytes=2**30)
    try:
        for _ in range(200):  # the probe runs on its own thread
            if "disk_bytes_per_s" in restarted.tiers.planner.measured:
                break
            time.sleep(0.01)
        assert "disk_bytes_per_s" in restarted.tiers.planner.measured
        assert restarted.tiers.planner.disk_bytes_per_s != RestorePlanner().disk_bytes_per_s
        assert len(restarted.tiers.disk) == len(first.tiers.disk)  # the probe read; it removed nothing
    finally:
        restarted.shutdown()


def assert_named_gpu_pages_in_host_ram(eng) -> None:
    """Every named GPU page is in host RAM, with the same bytes."""
    for page in range(eng.blocks.num_blocks):
        named = eng.blocks.named(page)
        if named is not None:
            slot = eng.tiers.host.find(*named)
            assert slot is not None, f"page {page} is not in host RAM"
            assert torch.equal(eng.tiers.host.slots[slot], eng.kv.gather_pages(torch.tensor([page]))[0])


def test_a_finished_requests_pages_reach_host_ram_at_once_and_their_eviction_copies_nothing(engine, expected):
    eng = sibling(engine, num_blocks=10, host_bytes=64 * 2**20)
    try:
        ids2, cacheable = turns(eng)
        # the copy follows the last token to the client: a request after it runs once it is queued
        eng.generate_sync(eng.tokenizer.encode("Hi"), SamplingParams(max_tokens=1, temperature=0))
        # that request's token reaches this thread before the engine thread's hand-over after its step: the
        # flush goes through the engine thread after it. (Without it a busy 2-core machine once read kept 0)
        eng.flush_kv()
        kept = eng.tiers.stats.kept_host
        assert kept >= cacheable // 16, "the first turn's named pages were not copied to host RAM when it ended"
        assert_named_gpu_pages_in_host_ram(eng)
        spilled = eng.tiers.stats.spilled_host
        eng.generate_sync(eng.tokenizer.apply_chat_template([{"role": "user", "content": "Describe the sea."}]),
                          GREEDY)  # evicts the first turn's pages: already in host RAM
        assert eng.tiers.stats.spilled_host - spilled <= 1  # at most a page not named when the turn ended
        out = eng.generate_sync(ids2, GREEDY)
        assert out.cached_tokens == cacheable and out.token_ids == expected
    finally:
        eng.shutdown()


def _deferred_owners_agree(eng) -> None:
    """Each deferred copy still targets a slot that host RAM files under its page's name."""
    lru = {slot: name for name, (slot, _) in eng.tiers.host._lru.items()}
    for slot, page in list(eng.tiers._deferred_slots.items()):
        assert eng.tiers._deferred[page] == slot
        assert lru.get(slot) == eng.blocks.named(page)[0]


def test_kept_pages_go_down_in_chunks_between_steps(engine, expected, monkeypatch):
    """With ``defer_persist`` (the GPU default) a finished request's pages only get host slots when
    it ends; the engine copies them down ``pump_pages`` at a time while idle, until all are there."""
    eng = sibling(engine, num_blocks=10, host_bytes=64 * 2**20)
    chunks = []
    pump = type(eng.tiers).pump

    def counted(self, *args, **kwargs):
        before = self.deferred
        more = pump(self, *args, **kwargs)
        chunks.append(before - self.deferred)
        return more

    monkeypatch.setattr(type(eng.tiers), "pump", counted)
    try:
        eng.tiers.defer_persist, eng.tiers.pump_pages = True, 2
        ids2, cacheable = turns(eng)
        deadline = time.monotonic() + 30
        while eng.tiers.deferred and time.monotonic() < deadline:
            time.sleep(0.01)
        assert eng.tiers.deferred == 0 and eng.tiers.stats.kept_host >= cacheable // 16
        assert max(chunks) == 2 and sum(chunks) >= cacheable // 16  # two pages a call, over several calls
        assert_named_gpu_pages_in_host_ram(eng)
        out = eng.generate_sync(ids2, GREEDY)
        assert out.cached_tokens == cacheable and out.token_ids == expected
    finally:
        eng.shutdown()


@pytest.mark.parametrize("disk", [False, True])
def test_a_kept_page_evicted_before_its_copy_is_copied_as_a_spill(engine, expected, tmp_path, disk):
    """No pump at all: every kept page leaves the GPU (evicted by other prompts, or its host slot taken
    by newer pages of a small host tier, written to disk first when there is one) before its deferred
    copy ran. The next turn still restores the right bytes from host RAM or disk."""
    extra = {"disk_dir": str(tmp_path), "disk_bytes": 2**30} if disk else {}
    eng = sibling(engine, num_blocks=10, host_bytes=3 * 2**20 if disk else 64 * 2**20, **extra)  # disk: 4 slots
    eng.tiers.pump = lambda *a, **k: False  # the engine never copies kept pages down on its own
    try:
        eng.tiers.defer_persist = True
        ids2, cacheable = turns(eng)
        assert eng.tiers.deferred > 0
        _deferred_owners_agree(eng)
        for q in ("Describe the sea.", "What is a prime number?", "Tell me about Paris.", "Why is grass green?"):
            eng.generate_sync(eng.tokenizer.apply_chat_template([{"role": "user", "content": q}]), GREEDY)
            _deferred_owners_agree(eng)
        if disk:
            eng.flush_kv()  # the writer drains: what the host tier gave up is on disk
        out = eng.generate_sync(ids2, GREEDY)
        assert out.cached_tokens == cacheable >= 32 and out.token_ids == expected
        assert eng.tiers.stats.restored_host + eng.tiers.stats.restored_disk > 0
    finally:
        eng.shutdown()


def test_a_full_host_tier_waits_only_for_the_slot_it_evicts(engine, tmp_path, monkeypatch):
    """Each page a full host tier takes evicts one entry (written to disk first): only copies into that
    slot are waited for. Flushing every pending spill at each eviction once serialised a restore's
    spills page by page."""
    from qml_runtime.kv import tiers as tiers_mod

    inside, counts = [False], {"evictions": 0, "flushes": 0}
    flush, reserve, queue = (tiers_mod.KVTiers.flush_spills, tiers_mod.KVTiers._reserve_host,
                             tiers_mod.KVTiers._queue_disk_write)

    def counted_flush(self):
        counts["flushes"] += inside[0]
        return flush(self)

    def counted_reserve(self, name, tokens):
        inside[0] = True
        try:
            return reserve(self, name, tokens)
        finally:
            inside[0] = False

    def counted_queue(self, *args):
        counts["evictions"] += inside[0]
        return queue(self, *args)

    monkeypatch.setattr(tiers_mod.KVTiers, "flush_spills", counted_flush)
    monkeypatch.setattr(tiers_mod.KVTiers, "_reserve_host", counted_reserve)
    monkeypatch.setattr(tiers_mod.KVTiers, "_queue_disk_write", counted_queue)
    # no write-through at the end of requests (neither from the host rows nor gathered): what host RAM evicts
    # is not on disk yet
    monkeypatch.setattr(tiers_mod.HostWrites, "register", lambda *a: None)
    monkeypatch.setattr(tiers_mod.KVTiers, "_write_through", lambda *a: None)
    eng = sibling(engine, num_blocks=10, host_bytes=4 * engine.kv.block_bytes, disk_dir=str(tmp_path),
                  disk_bytes=2**30)
    try:
        for q in ("Describe the sea.", "What is a prime number?", "Tell me about Paris.", "Why is grass green?"):
            eng.generate_sync(eng.tokenizer.apply_chat_template([{"role": "user", "content": q}]), GREEDY)
        eng.flush_kv()
        assert counts["evictions"] >= 4, "the host tier never had to evict to disk"
        # a flush only where the evicted slot's copy was still pending: a minority of evictions
        assert counts["flushes"] < counts["evictions"] / 2, counts
        assert eng.tiers.stats.written_disk > 0  # evicted host entries went to disk
    finally:
        eng.shutdown()


def test_a_host_entry_evicted_while_the_disk_is_behind_is_dropped_not_copied(engine, tmp_path, monkeypatch):
    """With more than MAX_PENDING_WRITE_BYTES waiting for the disk, an entry host RAM evicts leaves the cache:
    no copy of its row for the writer (2 MiB of the engine thread's time a Llama-3.1-8B page) and no wait for
    its slot; it counts as skipped, and serving goes on with the same replies."""
    from qml_runtime.kv import tiers as tiers_mod

    monkeypatch.setattr(tiers_mod.HostWrites, "register", lambda *a: None)  # nothing written through either
    monkeypatch.setattr(tiers_mod.KVTiers, "_write_through", lambda *a: None)

    def refuse(what):  # an Exception (pytest.fail's is not one): the engine fails the request, the test sees it
        def call(*args):
            raise AssertionError(what)
        return call

    monkeypatch.setattr(tiers_mod.KVTiers, "_queue_disk_write", refuse("an evicted entry was copied"))
    monkeypatch.setattr(tiers_mod.KVTiers, "_settle_slot", refuse("an evicted entry's slot was settled"))
    monkeypatch.setattr(tiers_mod, "MAX_PENDING_WRITE_BYTES", 0)  # the disk is always behind
    eng = sibling(engine, num_blocks=10, host_bytes=4 * engine.kv.block_bytes, disk_dir=str(tmp_path),
                  disk_bytes=2**30)
    prompts = ("Describe the sea.", "What is a prime number?", "Tell me about Paris.", "Why is grass green?")
    try:
        replies = [eng.generate_sync(eng.tokenizer.apply_chat_template([{"role": "user", "content": q}]),
                                     GREEDY).token_ids for q in prompts]
        eng.flush_kv()
        assert eng.tiers.stats.persist_skipped >= 4 and eng.tiers.stats.written_disk == 0
        assert len(eng.tiers.host) <= eng.tiers.host.capacity
    finally:
        eng.shutdown()
    engine.scheduler.prefix_caching = False
    try:
        assert replies == [engine.generate_sync(engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": q}]), GREEDY).token_ids for q in prompts]
    finally:
        engine.scheduler.prefix_caching = True


def test_a_page_handed_to_the_disk_writer_is_not_handed_over_again_while_queued(engine, tmp_path):
    """A conversation's history is kept again at each turn's end; while its first write is still queued
    (a disk behind), it is not gathered and queued a second time."""
    eng = sibling(engine, num_blocks=64, disk_dir=str(tmp_path), disk_bytes=2**30)
    tiers = eng.tiers
    gate = threading.Event()
    put = tiers.disk.put
    tiers.disk.put = lambda *a: (gate.wait(10), put(*a))[1]  # the disk holds every write back
    handed = []
    put_pages = tiers._writer.put_pages
    tiers._writer.put_pages = lambda staging, ready, blocks: (handed.extend(n for n, _, _ in blocks),
                                                              put_pages(staging, ready, blocks))[1]
    try:
        turns(eng)
        gate.set()
        eng.flush_kv()  # the first turn's pages are written
        gate.clear()
        handed.clear()
        # its pages under other names, as a later turn's new pages would be: not on disk, not queued
        pages = [(p, hashlib.sha256(name).digest(), tokens, None) for p in range(eng.blocks.num_blocks)
                 if (named := eng.blocks.named(p)) is not None for name, tokens in [named]]
        assert pages
        tiers.persist(pages)  # kept by one turn...
        tiers.persist(pages)  # ...and again by the next, before any of it landed
        assert sorted(handed) == sorted(n for _, n, _, _ in pages), "a queued page was handed over again"
        gate.set()
        eng.flush_kv()
        assert all(tiers.disk.contains(n) for _, n, _, _ in pages)
    finally:
        gate.set()
        eng.shutdown()


def test_disk_writes_wait_while_the_engine_schedules_and_launches_a_step(engine, tmp_path, monkeypatch):
    """The writer threads are held from a step's scheduling until its kernels are queued (``runner.step``'s
    while_running), not while the host waits for the device, nor between steps; ``QML_QUIET_WRITES=0``
    switches it off."""
    eng = sibling(engine, num_blocks=64, disk_dir=str(tmp_path), disk_bytes=2**30)
    writer = eng.tiers._writer
    log, held = [], [0]
    hold, release = writer.hold, writer.release

    def counted_hold():
        held[0] += 1
        log.append("hold")
        hold()

    def counted_release():
        held[0] -= 1
        log.append("release")
        release()

    step = eng.runner.step

    def watched_step(batch, *args, while_running=None, **kwargs):
        log.append(("step", held[0]))

        def running():
            while_running()
            log.append(("running", held[0]))
        return step(batch, *args, while_running=running, **kwargs)

    monkeypatch.setattr(writer, "hold", counted_hold)
    monkeypatch.setattr(writer, "release", counted_release)
    eng.runner.step = watched_step
    try:
        turns(eng)
        steps = [e for e in log if isinstance(e, tuple)]
        assert steps and all(e == ("step", 1) for e in steps[::2]) and all(e == ("running", 0) for e in steps[1::2])
        assert held[0] == 0 and log.count("hold") == log.count("release") >= len(steps) // 2
    finally:
        eng.shutdown()
    assert eng.tiers.stats.written_disk > 0 and writer._holds.count == 0  # the writes went on between the holds
    monkeypatch.setenv("QML_QUIET_WRITES", "0")
    off = sibling(engine, num_blocks=64, disk_dir=str(tmp_path / "off"), disk_bytes=2**30)
    try:
        assert off.tiers.hold_writes() is off.tiers.hold_writes() and off.tiers._writer._holds.count == 0
    finally:
        off.shutdown()


def test_waiting_for_blocks_from_disk_does_not_hold_the_writes(engine, tmp_path, monkeypatch):
    """When everything runnable waits for a load from disk, the engine thread launches nothing: the writer
    threads are not held meanwhile (the loop waits up to 50 ms at a time there)."""
    import concurrent.futures

    first = sibling(engine, num_blocks=64, disk_dir=str(tmp_path), disk_bytes=2**30)
    try:
        ids2, _ = turns(first)
    finally:
        first.shutdown()
    restarted = sibling(engine, num_blocks=64, disk_dir=str(tmp_path), disk_bytes=2**30)
    seen, wait = [], concurrent.futures.wait
    read = restarted.tiers._read_disk

    def slow_read(*args):  # the reads take long enough that the loop waits for them
        time.sleep(0.2)
        return read(*args)

    def watched_wait(*args, **kwargs):
        seen.append(restarted.tiers._writer._holds.count)
        return wait(*args, **kwargs)

    restarted.tiers._read_disk = slow_read
    monkeypatch.setattr(concurrent.futures, "wait", watched_wait)
    try:
        restarted.generate_sync(ids2, GREEDY)
        assert restarted.tiers.stats.restored_disk > 0
    finally:
        restarted.shutdown()
    assert seen and all(count == 0 for count in seen), seen
