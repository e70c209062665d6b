"""A finished request's pages go to the tiers after it, a chunk at a time (``Engine._persist``): a request
that arrives meanwhile is scheduled first, a page taken for another block in between is skipped, and
nothing is lost at shutdown."""

from __future__ import annotations

from qml_runtime import kept_pages
from qml_runtime.config import CacheConfig, SchedulerConfig
from qml_runtime.engine import Engine
from qml_runtime.sampling_params import SamplingParams

ONE = SamplingParams(max_tokens=1, temperature=0)


def _engine(engine, scheduler: SchedulerConfig | None = None, **cache) -> Engine:
    """Not started: the test drives the loop (``_iterate``) on its own thread."""
    cfg = CacheConfig(block_size=16, **cache)
    return Engine(engine.model, engine.tokenizer, engine.model_config, model_id="persist", device=engine.device,
                  dtype=engine.dtype, cache=cfg, scheduler=scheduler or SchedulerConfig(),
                  fingerprint=engine.scheduler.fingerprint)


def _drive(eng: Engine, outs: list, until) -> int:
    """Run loop iterations until ``until()``; how many it took."""
    for n in range(1, 200):
        eng._iterate(None)
        if until():
            return n
    raise AssertionError(f"not done after 200 iterations: {outs}")


def _prompt(eng: Engine, text: str) -> list[int]:
    return eng.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def test_a_request_that_arrives_meanwhile_goes_before_the_last_ones_pages(engine, monkeypatch):
    monkeypatch.setattr(kept_pages, "PERSIST_CHUNK", 1)
    monkeypatch.setattr(kept_pages, "PERSIST_IDLE_CHUNK", 1)  # (after a step, too)
    monkeypatch.setattr(kept_pages, "PERSIST_SHARE", 0.0)  # one chunk after a step
    eng = _engine(engine, num_blocks=64, host_bytes=64 * 2**20)
    persisted = []
    persist = eng.tiers.persist
    eng.tiers.persist = lambda pages: (persisted.extend(p for p, *_ in pages), persist(pages))[1]
    try:
        a_out, b_out = [], []
        eng.submit(_prompt(eng, "Count with me: " + " ".join(str(i) for i in range(20))), ONE, a_out.append)
        _drive(eng, a_out, lambda: a_out and a_out[-1].finished)
        left = sum(len(t) - i for t, _, i, _ in eng._to_persist)
        full = sum(eng.blocks.named(p) is not None for t, _, _, _ in eng._to_persist for p in t)
        # nothing of A after its own step: its client's next turn may be on its way already
        assert left >= 3 and full >= 3 and persisted == []
        eng.submit(_prompt(eng, "Hello"), ONE, b_out.append)  # arrives before the loop is idle
        eng._iterate(None)  # takes B and runs its step before anything of A (one chunk after it)
        assert b_out and b_out[-1].finished
        assert sum(len(t) - i for t, _, i, _ in eng._to_persist) >= left - 1
        _drive(eng, b_out, lambda: not eng._to_persist)
        assert eng.tiers.stats.kept_host >= full  # A's full pages (and B's) reached the host tier after all
    finally:
        eng.shutdown()


def test_while_idle_a_new_request_waits_for_one_small_chunk(engine, monkeypatch):
    """Idle, the loop hands pages over ``PERSIST_IDLE_CHUNK`` at a time (beside a step, ``PERSIST_CHUNK``) and
    checks the inbox between chunks: a turn that arrives meanwhile waits for the chunk in hand only."""
    monkeypatch.setattr(kept_pages, "PERSIST_IDLE_CHUNK", 2)
    monkeypatch.setattr(kept_pages, "PERSIST_SHARE", 0.0)
    eng = _engine(engine, num_blocks=64, host_bytes=64 * 2**20)
    calls, b_out = [], []
    persist = eng.tiers.persist

    def persist_and_meet_a_request(pages):
        calls.append(len(pages))
        if len(calls) == 1:  # B arrives while the first idle chunk is being handed over
            eng.submit(_prompt(eng, "Hello"), ONE, b_out.append)
        return persist(pages)

    try:
        a_out = []
        eng.submit(_prompt(eng, "Count with me: " + " ".join(str(i) for i in range(30))), ONE, a_out.append)
        _drive(eng, a_out, lambda: a_out and a_out[-1].finished)
        eng.tiers.persist = persist_and_meet_a_request
        calls.clear()
        left = sum(len(t) - i for t, _, i, _ in eng._to_persist)
        assert left >= 6
        eng._iterate(None)  # idle: one chunk of 2 pages, then B is in the inbox and the loop returns
        assert calls == [2] and not b_out
        assert sum(len(t) - i for t, _, i, _ in eng._to_persist) == left - 2
        eng._iterate(None)  # B is scheduled and run before any more of A's pages
        assert b_out and b_out[-1].finished
        _drive(eng, b_out, lambda: not eng._to_persist)
        assert sum(calls) >= left  # A's pages went down after all
    finally:
        eng.shutdown()


def test_a_queue_of_prompts_does_not_starve_the_pages_of_those_before(engine, monkeypatch):
    """Back to back, the loop is never idle: after each step the pages of the requests that ended
    before it go down for a share of that step's time, so a later prompt does not evict them first.
    Those of the request that ended in the step itself wait for the next."""
    monkeypatch.setattr(kept_pages, "PERSIST_CHUNK", 1)
    monkeypatch.setattr(kept_pages, "PERSIST_SHARE", 1e3)  # the whole backlog after a step
    # one prompt a step
    eng = _engine(engine, SchedulerConfig(max_batched_tokens=96), num_blocks=64, host_bytes=64 * 2**20)
    try:
        outs = [[] for _ in range(3)]
        for i, out in enumerate(outs):  # all queued at once: the loop is not idle between them
            eng.submit(_prompt(eng, f"Prompt {i}: " + " ".join(str(j) for j in range(20))), ONE, out.append)
        _drive(eng, outs[0], lambda: outs[0] and outs[0][-1].finished)
        assert not outs[1]
        (first, _, done, _), = eng._to_persist
        assert done == 0 < len(first)  # none after its own step
        _drive(eng, outs[1], lambda: outs[1] and outs[1][-1].finished)
        assert not outs[2]
        # the first's went after the second's step, in full; the second's waits for the next
        (second, _, done, _), = eng._to_persist
        assert second is not first and done == 0
        _drive(eng, outs[2], lambda: all(o and o[-1].finished for o in outs) and not eng._to_persist)
    finally:
        eng.shutdown()


def test_a_page_taken_for_another_block_before_its_turn_is_skipped(engine):
    eng = _engine(engine, num_blocks=64, host_bytes=64 * 2**20)
    got = []
    eng.tiers.persist = got.extend
    try:
        out = []
        eng.submit(_prompt(eng, "Count with me: " + " ".join(str(i) for i in range(20))), ONE, out.append)
        _drive(eng, out, lambda: out and out[-1].finished and not eng._to_persist)
        table = [p for p in range(eng.blocks.num_blocks) if eng.blocks.named(p) is not None]
        assert len(table) >= 3
        names = [eng.blocks.named(p)[0] for p in table]
        got.clear()
        eng._queue_persist(table, names)  # as _finish queues a request's pages
        reused = table[1]
        name = eng.blocks._name[reused]
        eng.blocks._name[reused] = b"another block".ljust(32, b".")  # evicted and filled again meanwhile
        eng._persist(everything=True)
        eng.blocks._name[reused] = name
        assert [p for p, *_ in got] == [p for p in table if p != reused]
        # the others keep their own chain's parents
        assert got[0][3] is None and all(g[3] == names[table.index(g[0]) - 1] for g in got[1:])
    finally:
        eng.shutdown()


def test_a_shutdown_keeps_what_had_not_gone_down_yet(engine, tmp_path, monkeypatch):
    """The queue is emptied before the tiers close: a restart on the same store finds the request's pages."""
    monkeypatch.setattr(kept_pages, "PERSIST_CHUNK", 1)
    monkeypatch.setattr(kept_pages, "PERSIST_SHARE", 0.0)  # one chunk after a step
    eng = _engine(engine, num_blocks=64, disk_dir=str(tmp_path), disk_bytes=2**30)
    ids = _prompt(eng, "Count with me: " + " ".join(str(i) for i in range(20)))
    out = []
    eng.submit(ids, ONE, out.append)
    _drive(eng, out, lambda: out and out[-1].finished)
    assert sum(len(t) - i for t, _, i, _ in eng._to_persist) >= 3  # most of its pages still queued
    eng._stopping = True
    eng._loop()  # what the loop thread runs as it stops
    assert not eng._to_persist
    eng.shutdown()
    again = _engine(engine, num_blocks=64, disk_dir=str(tmp_path), disk_bytes=2**30)
    again.start()
    try:
        assert again.generate_sync(ids + [ids[-1]], ONE).cached_tokens == len(ids) // 16 * 16 >= 48
    finally:
        again.shutdown()


def test_flush_kv_waits_for_the_pages_and_their_disk_writes(engine, tmp_path, monkeypatch):
    import time

    monkeypatch.setattr(kept_pages, "PERSIST_CHUNK", 1)
    monkeypatch.setattr(kept_pages, "PERSIST_SHARE", 0.0)
    eng = _engine(engine, num_blocks=64, disk_dir=str(tmp_path), disk_bytes=2**30)
    put = eng.tiers.disk.put
    eng.tiers.disk.put = lambda *a: (time.sleep(0.05), put(*a))[1]  # a slow disk
    eng.start()
    try:
        ids = _prompt(eng, "Count with me: " + " ".join(str(i) for i in range(20)))
        eng.generate_sync(ids, ONE)
        eng.flush_kv()
        assert len(eng.tiers.disk) == len(ids) // 16 >= 3 and not eng._to_persist
    finally:
        eng.shutdown()
    eng.flush_kv()  # stopped: nothing left to wait for, and no thread to ask


def test_pages_go_down_while_a_long_prefill_runs_not_after_it(engine, monkeypatch):
    """A finished request's pages are handed over while the next prompt's prefill runs (``runner.step``'s
    ``while_running``), so nothing is left to do between that step's token and the request after it."""
    monkeypatch.setattr(kept_pages, "PERSIST_CHUNK", 1)
    monkeypatch.setattr(kept_pages, "PERSIST_SHARE", 0.0)  # after a step: one chunk only
    eng = _engine(engine, num_blocks=64, host_bytes=64 * 2**20)
    in_step, during, after = [False], [], []
    persist = eng.tiers.persist
    eng.tiers.persist = lambda pages: ((during if in_step[0] else after).extend(p for p, *_ in pages),
                                       persist(pages))[1]
    step = eng.runner.step

    def watched(batch, *a, while_running=None, **kw):
        def hook():
            in_step[0] = True
            try:
                while_running()
            finally:
                in_step[0] = False
        return step(batch, *a, while_running=hook if while_running else None, **kw)

    eng.runner.step = watched
    try:
        a_out, b_out = [], []
        eng.submit(_prompt(eng, "Count with me: " + " ".join(str(i) for i in range(20))), ONE, a_out.append)
        _drive(eng, a_out, lambda: a_out and a_out[-1].finished)
        left = sum(len(t) - i for t, _, i, _ in eng._to_persist)
        assert left >= 3 and not during
        after.clear()
        long_prompt = _prompt(eng, "And now the other way: " + " ".join(str(i) for i in range(30, 0, -1)))
        assert len(long_prompt) >= 64
        eng.submit(long_prompt, ONE, b_out.append)
        eng._iterate(None)  # B's prefill, one step
        assert b_out and b_out[-1].finished
        assert len(during) >= left - 1 and not after  # all of A's named pages went during B's step
        (_, _, done, _), = eng._to_persist  # B's own wait for the idle loop
        assert done == 0
        # and the tokens are what a step without the hook gives
        again = _engine(engine, num_blocks=64, host_bytes=64 * 2**20)
        again.start()
        try:
            assert again.generate_sync(long_prompt, ONE).token_ids == b_out[-1].token_ids
        finally:
            again.shutdown()
    finally:
        eng.shutdown()


def test_a_failure_handing_pages_over_beside_a_step_does_not_fail_its_requests(engine, monkeypatch):
    monkeypatch.setattr(kept_pages, "PERSIST_CHUNK", 1)
    monkeypatch.setattr(kept_pages, "PERSIST_SHARE", 0.0)  # A's pages wait for B's step
    eng = _engine(engine, num_blocks=64, host_bytes=64 * 2**20)
    try:
        a_out, b_out = [], []
        eng.submit(_prompt(eng, "Count with me: " + " ".join(str(i) for i in range(20))), ONE, a_out.append)
        _drive(eng, a_out, lambda: a_out and a_out[-1].finished)
        assert eng._to_persist

        def broken(pages):
            raise RuntimeError("a tiers bug")

        eng.tiers.persist = broken
        eng.submit(_prompt(eng, "And now the other way: " + " ".join(str(i) for i in range(30, 0, -1))), ONE,
                   b_out.append)
        eng._iterate(None)  # B's prefill; A's pages fail to go down beside it
        assert b_out and b_out[-1].finished and b_out[-1].finish_reason == "length"
    finally:
        eng.shutdown()


def test_an_expected_request_holds_the_idle_loops_background_work(engine, monkeypatch):
    """While a request is on its way (``expect_request``: the server is parsing and tokenizing it), the idle loop
    hands no pages to the tiers; ``submit`` ends the hold, and the request runs before the pages go."""
    monkeypatch.setattr(kept_pages, "PERSIST_IDLE_CHUNK", 1)
    eng = _engine(engine, num_blocks=64, host_bytes=64 * 2**20)
    calls, b_out = [], []
    persist = eng.tiers.persist
    # (pages handed over, whether B had its token by then)
    eng.tiers.persist = lambda pages: (calls.append((len(pages), bool(b_out))), persist(pages))[1]
    try:
        a_out = []
        eng.submit(_prompt(eng, "Count with me: " + " ".join(str(i) for i in range(30))), ONE, a_out.append)
        _drive(eng, a_out, lambda: a_out and a_out[-1].finished)
        calls.clear()
        assert eng._to_persist
        eng.expect_request(60.0)
        eng._wakeup.set()  # (the wait for the request returns at once here)
        eng._iterate(None)
        assert calls == [] and eng._expecting() > 0
        eng._persist(everything=True)  # the idle hand-over stops before its first chunk too
        assert calls == []
        eng.submit(_prompt(eng, "Hello"), ONE, b_out.append)
        assert eng._expecting() == 0
        eng._iterate(None)  # B first
        assert b_out and b_out[-1].finished
        _drive(eng, b_out, lambda: not eng._to_persist)
        assert calls and all(b_had_its_token for _, b_had_its_token in calls)  # then A's pages
    finally:
        eng.shutdown()


def test_after_a_step_a_waiting_request_goes_before_earlier_pages(engine, monkeypatch):
    """After a step, the pages of requests that ended before it go down only while nobody waits in the inbox."""
    monkeypatch.setattr(kept_pages, "PERSIST_CHUNK", 1)
    eng = _engine(engine, num_blocks=64, host_bytes=64 * 2**20)
    calls = []
    persist = eng.tiers.persist
    eng.tiers.persist = lambda pages: (calls.append(len(pages)), persist(pages))[1]
    try:
        a_out, b_out = [], []
        eng.submit(_prompt(eng, "Count with me: " + " ".join(str(i) for i in range(20))), ONE, a_out.append)
        _drive(eng, a_out, lambda: a_out and a_out[-1].finished)
        eng.loop_steps += 1  # A ended in an earlier step than the one that just ran
        calls.clear()
        eng.submit(_prompt(eng, "Hello"), ONE, b_out.append)
        eng._persist(budget_s=60.0)  # as after a step, with B in the inbox
        assert calls == []
        eng._iterate(None)
        assert b_out and b_out[-1].finished
        eng._persist(budget_s=60.0)  # nobody waits: A's pages go
        assert sum(calls) > 0
    finally:
        eng.shutdown()
