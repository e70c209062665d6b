"""The restore plan: copy from host RAM, recompute, or recompute the head of a history while its
tail streams in from disk; and the engine running such plans to the same tokens."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qml_runtime.config import CacheConfig, SchedulerConfig
from qml_runtime.engine import Engine
from qml_runtime.kv.disk_store import RATES_NAME
from qml_runtime.kv.planner import RestorePlanner
from qml_runtime.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0)
BLOCK, TOKENS = 2 * 2**20, 16  # a Llama-3.1-8B page


def h200() -> RestorePlanner:
    return RestorePlanner(prefill_tokens_per_s=31_000, host_bytes_per_s=55e9, disk_bytes_per_s=1.46e9)


def test_host_blocks_are_copied_now():
    plan = h200().plan(["host"] * 100, BLOCK, TOKENS)
    assert (plan.host_now, plan.recompute, plan.load, plan.kind) == (100, 0, 0, "restore")


def test_a_long_history_on_disk_is_split_and_beats_recomputing_it():
    planner = h200()
    plan = planner.plan(["disk"] * 1700, BLOCK, TOKENS)  # ~27k tokens after a restart
    assert plan.kind == "split" and plan.recompute + plan.load == 1700
    # the GPU recomputes ~70% (31k tok/s) while the disk reads the rest (11k tok/s)
    assert 0.6 < plan.recompute / 1700 < 0.8
    assert plan.seconds < 0.8 * plan.recompute_seconds
    # the two halves end together, within a block
    compute = plan.recompute * TOKENS / planner.prefill_tokens_per_s
    read = plan.load * BLOCK / planner.disk_bytes_per_s
    assert abs(compute - read) <= TOKENS / planner.prefill_tokens_per_s + BLOCK / planner.disk_bytes_per_s


def test_a_fast_disk_or_slow_prefill_loads_everything():
    planner = RestorePlanner(prefill_tokens_per_s=20, host_bytes_per_s=10e9, disk_bytes_per_s=3e9)
    plan = planner.plan(["disk"] * 50, BLOCK, TOKENS)
    assert (plan.recompute, plan.load, plan.kind) == (0, 50, "restore")


@given(st.lists(st.sampled_from(["host", "disk"]), max_size=60), st.floats(100, 1e6), st.floats(1e8, 1e11),
       st.floats(1e7, 1e10))
@settings(max_examples=200, deadline=None)
def test_the_plan_is_never_slower_than_recomputing(tiers, prefill, host, disk):
    planner = RestorePlanner(prefill_tokens_per_s=prefill, host_bytes_per_s=host, disk_bytes_per_s=disk)
    plan = planner.plan(tiers, BLOCK, TOKENS)
    assert plan.host_now + plan.recompute + plan.load == len(tiers)
    assert all(t == "host" for t in tiers[:plan.host_now])
    assert plan.seconds <= plan.recompute_seconds + 1e-9


# --- in the engine --------------------------------------------------------------------------

def sibling(engine, disk_dir, planner: RestorePlanner | None = None, **cache) -> Engine:
    cfg = CacheConfig(block_size=16, num_blocks=64, disk_dir=str(disk_dir), disk_bytes=2**30, **cache)
    eng = Engine(engine.model, engine.tokenizer, engine.model_config, model_id="plan", device=engine.device,
                 dtype=engine.dtype, cache=cfg, scheduler=SchedulerConfig(), fingerprint=engine.scheduler.fingerprint)
    if planner is not None:
        eng.tiers.planner = planner
    eng.start()
    return eng


def history(engine) -> tuple[list[int], int]:
    """Run a first turn; returns the second turn's prompt and how many of its full blocks the first
    turn's KV covers."""
    tok = engine.tokenizer
    first = [{"role": "user", "content": "Write two sentences about the moon and the tides."}]
    ids1 = tok.apply_chat_template(first)
    answer = engine.generate_sync(ids1, GREEDY)
    second = first + [{"role": "assistant", "content": answer.text}, {"role": "user", "content": "And the sun?"}]
    ids2 = tok.apply_chat_template(second)
    shared = next(i for i, (a, b) in enumerate(zip(ids1 + answer.token_ids + [-1], ids2)) if a != b)
    return ids2, shared // 16


def write_history(engine, disk_dir) -> Engine:
    """A first server on ``disk_dir`` runs the first turn and stops (its pages written through)."""
    first = sibling(engine, disk_dir)
    try:
        history(first)
    finally:
        first.shutdown()
    return first


@pytest.fixture(scope="module")
def expected(engine):
    ids, blocks = history(engine)
    engine.scheduler.prefix_caching = False
    try:
        return ids, blocks, engine.generate_sync(ids, GREEDY).token_ids
    finally:
        engine.scheduler.prefix_caching = True


@pytest.mark.parametrize("host_bytes", [0, 64 * 2**20], ids=["no-host-tier", "reads-into-host-slots"])
@pytest.mark.parametrize("rates, kind", [
    ((1e9, 1e6), "recompute"),  # a disk far slower than computing: nothing is read
    ((1.0, 1e12), "restore"),  # computing far slower than the disk: everything is read
    (None, "split"),  # even: the head is computed while the tail streams in
])
def test_after_a_restart_each_plan_gives_the_same_tokens(engine, expected, tmp_path, rates, kind, host_bytes):
    ids, blocks, tokens = expected
    first = write_history(engine, tmp_path)
    assert blocks >= 3
    if rates is None:  # per block: reading takes as long as computing
        planner = RestorePlanner(prefill_tokens_per_s=16.0, disk_bytes_per_s=float(first.kv.block_bytes))
    else:
        planner = RestorePlanner(prefill_tokens_per_s=rates[0], disk_bytes_per_s=rates[1])
    planner.alpha = 0.0  # keep the rates fixed while the engine measures
    restarted = sibling(engine, tmp_path, planner, host_bytes=host_bytes)
    try:
        out = restarted.generate_sync(ids, GREEDY)
        stats = restarted.tiers.stats
        if host_bytes and kind != "recompute":
            # what was read from disk stays in host RAM, no longer held
            host = restarted.tiers.host
            assert len(host) >= stats.restored_disk > 0 and not host._held
        assert stats.plans[kind] == 1 and sum(stats.plans.values()) == 1
        assert restarted.stats()["kv_restore_plans"][kind] == 1  # what /metrics exports
        assert out.token_ids == tokens
        if kind == "recompute":
            assert stats.restored_disk == 0 and out.cached_tokens == 0
        elif kind == "restore":
            assert stats.restored_disk == blocks and out.cached_tokens == blocks * 16
        else:
            assert 0 < stats.restored_disk < blocks and out.cached_tokens == stats.restored_disk * 16
    finally:
        restarted.shutdown()


def test_a_split_turns_steps_and_reads_are_traced(engine, expected, tmp_path, monkeypatch):
    """With ``QML_TURN_TRACE`` a split turn's record holds each step (the head recomputed, then the turn after its
    load), the reads' window and when the load was applied, in that order; the report prints them step by step."""
    import json
    import sys
    from pathlib import Path

    from qml_runtime import turn_trace

    ids, blocks, tokens = expected
    first = write_history(engine, tmp_path)
    planner = RestorePlanner(prefill_tokens_per_s=16.0, disk_bytes_per_s=float(first.kv.block_bytes), alpha=0.0)
    restarted = sibling(engine, tmp_path, planner, host_bytes=64 * 2**20)  # (host slots: the reader process)
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setattr(turn_trace, "PATH", str(trace))
    monkeypatch.setattr(turn_trace, "ENABLED", True)
    try:
        out = restarted.generate_sync(ids, GREEDY)  # (its record opens at submit, is written as it finishes)
        assert restarted.tiers.stats.plans["split"] == 1 and out.token_ids == tokens
    finally:
        restarted.shutdown()
    (record,) = [json.loads(line) for line in trace.read_text().splitlines()]
    steps = record["steps"]
    assert len(steps) >= 2 and all(a <= b for a, b, _ in steps)
    assert all(steps[i][1] <= steps[i + 1][0] for i in range(len(steps) - 1))
    head = len(ids) - out.cached_tokens - steps[-1][2]  # the recomputed blocks, before the turn's own step
    assert sum(n for _, _, n in steps[:-1]) == head > 0
    assert record["reads_begun"] <= record["reads_ended"] <= record["load_applied"] <= steps[-1][0]

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import turn_trace_report

    report = tmp_path / "steps.json"
    monkeypatch.setattr(sys, "argv", ["turn_trace_report.py", str(trace), "--steps", "--json", str(report)])
    assert turn_trace_report.main() == 0
    (timeline,) = json.loads(report.read_text())
    assert [st["tokens"] for st in timeline["steps"]] == [n for _, _, n in steps]
    assert timeline["steps"][0]["gap"] is None and all(st["gap"] >= 0 for st in timeline["steps"][1:])
    assert timeline["reads_begun"] <= timeline["load_applied"] <= timeline["emit"]


def test_a_slow_disk_read_makes_the_engine_wait_not_fail(engine, expected, tmp_path, monkeypatch):
    ids, blocks, tokens = expected
    write_history(engine, tmp_path)
    planner = RestorePlanner(prefill_tokens_per_s=1.0, disk_bytes_per_s=1e12, alpha=0.0)
    restarted = sibling(engine, tmp_path, planner)
    get_into = restarted.tiers.disk.get_into
    monkeypatch.setattr(restarted.tiers.disk, "get_into", lambda *a: time.sleep(0.02) or get_into(*a))
    try:
        out = restarted.generate_sync(ids, GREEDY)
        assert out.token_ids == tokens and out.cached_tokens > 0
    finally:
        restarted.shutdown()


def test_a_block_missing_when_the_load_runs_is_computed_instead(engine, expected, tmp_path):
    ids, blocks, tokens = expected
    write_history(engine, tmp_path)
    planner = RestorePlanner(prefill_tokens_per_s=1.0, disk_bytes_per_s=1e12, alpha=0.0)
    restarted = sibling(engine, tmp_path, planner)
    # the index says the blocks are there; the files of the later half are gone
    files = sorted(tmp_path.rglob("*.kvb"), key=lambda f: f.stat().st_mtime)
    for f in files[len(files) // 2:]:
        f.unlink()
    try:
        out = restarted.generate_sync(ids, GREEDY)
        assert out.token_ids == tokens
        assert 0 < out.cached_tokens < blocks * 16
    finally:
        restarted.shutdown()


# --- with the prefill curve measured at start-up (qml_runtime.warmup) ----------------------------

# fresh prefills of Llama-3.1-8B shapes on the H200 (benchmarks/engine_h200.py --sections firstcall)
H200_CURVE = [(2340, 0.0568), (8892, 0.2315), (26926, 0.932), (30000, 1.089)]


def test_the_curve_is_exact_at_its_points_and_grows_faster_than_linearly():
    planner = RestorePlanner(prefill_curve=H200_CURVE)
    for n, s in H200_CURVE:
        assert planner.fresh_seconds(n) == pytest.approx(s)
    times = [planner.fresh_seconds(n) for n in range(0, 60_000, 500)]
    assert all(b > a for a, b in zip(times, times[1:]))
    # per token, a longer history costs more to recompute than a shorter one (attention)
    assert planner.prefill_seconds(20_000, 1000) > planner.prefill_seconds(0, 1000)
    # past the last point: on the line through the last two per-token costs
    assert planner.fresh_seconds(40_000) / 40_000 > 1.089 / 30_000


def test_with_the_curve_a_restarted_server_recomputes_what_the_disk_is_too_slow_for():
    """The H200 sessions bench after a restart: 1,722 blocks on disk, a fresh prefill of ~28k
    tokens/s. The constant guess (1,000 tokens/s) chose to read 917 blocks and took 1.40 s
    against 0.99 s to recompute; with the curve, a 0.5 GB/s disk gets little to do."""
    guessed = RestorePlanner(prefill_tokens_per_s=3352, host_bytes_per_s=5e9, disk_bytes_per_s=0.5e9)
    measured = RestorePlanner(prefill_curve=H200_CURVE, host_bytes_per_s=5e9, disk_bytes_per_s=0.5e9)
    old, new = guessed.plan(["disk"] * 1722, BLOCK, TOKENS), measured.plan(["disk"] * 1722, BLOCK, TOKENS)
    assert old.load > 900
    assert new.load < 500 and new.recompute_seconds == pytest.approx(measured.fresh_seconds(1722 * 16))
    # at the disk's measured 1.46 GB/s the split reads more and ends well before recomputing
    fast = RestorePlanner(prefill_curve=H200_CURVE, host_bytes_per_s=55e9, disk_bytes_per_s=1.46e9)
    plan = fast.plan(["disk"] * 1722, BLOCK, TOKENS)
    assert plan.kind == "split" and plan.seconds < 0.8 * plan.recompute_seconds


def test_the_recompute_cost_depends_on_where_the_blocks_start():
    planner = RestorePlanner(prefill_curve=H200_CURVE, host_bytes_per_s=55e9, disk_bytes_per_s=1.46e9)
    head = planner.plan(["disk"] * 100, BLOCK, TOKENS, start=0)
    tail = planner.plan(["disk"] * 100, BLOCK, TOKENS, start=25_000)
    assert tail.recompute_seconds > head.recompute_seconds


def test_running_prefills_scale_the_curve():
    planner = RestorePlanner(prefill_curve=H200_CURVE, alpha=0.5)
    predicted = planner.prefill_seconds(2048, 2048)
    planner.observe_prefill([(2048, 2048)], 2 * predicted)  # chunked prefill: twice the one-shot time
    assert planner.prefill_scale == pytest.approx(1.5)
    assert planner.prefill_seconds(2048, 2048) == pytest.approx(1.5 * predicted)


@given(st.lists(st.sampled_from(["host", "disk"]), max_size=60),
       st.lists(st.tuples(st.integers(16, 40_000), st.floats(1e-4, 5.0)), min_size=1, max_size=6,
                unique_by=lambda p: p[0]),
       st.floats(1e8, 1e11), st.floats(1e7, 1e10), st.integers(0, 30_000))
@settings(max_examples=200, deadline=None)
def test_with_any_curve_the_plan_is_never_slower_than_recomputing(tiers, curve, host, disk, start):
    planner = RestorePlanner(prefill_curve=sorted(curve), host_bytes_per_s=host, disk_bytes_per_s=disk)
    plan = planner.plan(tiers, BLOCK, TOKENS, start)
    assert plan.host_now + plan.recompute + plan.load == len(tiers)
    assert plan.seconds <= plan.recompute_seconds + 1e-9


def _fresh_seconds_by_scan(curve, tokens):
    """The curve's interpolation as first written: a linear scan for the segment."""
    if tokens <= 0:
        return 0.0
    if len(curve) == 1 or tokens <= curve[0][0]:
        return tokens * curve[0][1] / curve[0][0]
    i = next((i for i in range(1, len(curve)) if tokens <= curve[i][0]), len(curve) - 1)
    (n0, s0), (n1, s1) = curve[i - 1], curve[i]
    r0, r1 = s0 / n0, s1 / n1
    return tokens * max(r0 + (r1 - r0) * (tokens - n0) / (n1 - n0), min(r0, r1))


@given(st.lists(st.sampled_from(["host", "disk"]), max_size=80),
       st.lists(st.tuples(st.integers(16, 40_000), st.floats(1e-4, 5.0)), min_size=1, max_size=6,
                unique_by=lambda p: p[0]),
       st.floats(1e8, 1e11), st.integers(0, 30_000))
@settings(max_examples=200, deadline=None)
def test_the_host_run_and_curve_lookups_agree_with_a_block_by_block_search(tiers, curve, host, start):
    """The plan takes the longest leading host run whose copy beats computing it, searched from the
    longest down, and looks the curve up by bisection: the same answers as trying every run
    length from one up with a linear scan of the curve."""
    curve = sorted(curve)
    planner = RestorePlanner(prefill_curve=curve, host_bytes_per_s=host, disk_bytes_per_s=1e9)
    for tokens in (0, 1, curve[0][0], curve[-1][0], curve[-1][0] + 7, start + 5 * TOKENS):
        assert planner.fresh_seconds(tokens) == _fresh_seconds_by_scan(curve, tokens)
    h = run = 0
    while run < len(tiers) and tiers[run] == "host":
        run += 1
        if run * BLOCK / host < planner.prefill_seconds(start, run * TOKENS):
            h = run
    assert planner.plan(tiers, BLOCK, TOKENS, start).host_now == h


def test_rates_survive_a_restart_and_bad_files_are_ignored(engine, tmp_path):
    first = sibling(engine, tmp_path)
    first.tiers.planner.observe("disk", 1.23e9, 1.0)
    first.shutdown()
    second = sibling(engine, tmp_path)
    try:
        assert second.tiers.planner.disk_bytes_per_s == pytest.approx(1.23e9)
        rates = second.tiers.disk.dir / RATES_NAME
    finally:
        second.shutdown()
    for bad in ("{not json", '{"disk_bytes_per_s": -5, "host_bytes_per_s": "fast"}', "[1, 2]"):
        rates.write_text(bad)
        third = sibling(engine, tmp_path)
        try:
            assert third.tiers.planner.disk_bytes_per_s == RestorePlanner().disk_bytes_per_s
            assert third.tiers.planner.host_bytes_per_s == RestorePlanner().host_bytes_per_s
        finally:
            third.shutdown()


def test_a_run_of_host_blocks_is_copied_whole_when_that_beats_computing_it():
    # the first blocks of a history are the cheapest to compute: one alone is cheaper to compute than
    # to copy at 5 GB/s, the 1,700 together are not
    planner = RestorePlanner(prefill_curve=H200_CURVE, host_bytes_per_s=5e9, disk_bytes_per_s=1e9)
    assert BLOCK / planner.host_bytes_per_s > planner.prefill_seconds(0, TOKENS)
    plan = planner.plan(["host"] * 1700, BLOCK, TOKENS)
    assert (plan.host_now, plan.kind) == (1700, "restore")


def test_only_chunks_from_the_start_of_a_history_scale_the_curve():
    planner = RestorePlanner(prefill_curve=H200_CURVE, alpha=0.5)
    planner.observe_prefill([(27_000, 219)], 1.0)  # a turn over a long history (and maybe its upload)
    assert planner.prefill_scale == 1.0
    planner.observe_prefill([(0, 8892)], 100.0)  # one wild step moves the scale a bounded amount
    assert planner.prefill_scale == pytest.approx(0.5 + 0.5 * 4.0)


def test_the_disk_probe_counts_all_it_read_as_a_provisional_rate():
    """Restores read in their own process and have read faster than the probe: its whole rate counts, and the
    first restore's own measurement replaces it when slower."""
    from qml_runtime.kv import planner_rates

    class Disk:
        def probe_names(self, nbytes):
            return [b"a", b"b", b"c"]

        def cold_read(self, name):
            return 1000

    planner, seen = RestorePlanner(), []
    planner.observe = lambda kind, amount, seconds, provisional=False: seen.append((kind, amount, provisional))
    planner_rates.probe_disk(Disk(), planner, threads=8)
    assert seen == [("disk", 3000, True)]


# --- a host-RAM history split: the head recomputed while the tail is copied in beside it ---------------

def split_planner(**kw) -> RestorePlanner:
    """The H200's measured curve and host link (50 GB/s for the restore's 32 KiB runs), split on."""
    return RestorePlanner(**{"prefill_curve": H200_CURVE, "host_bytes_per_s": 50e9, "host_split": True, **kw})


def test_a_host_history_is_copied_whole_unless_the_split_is_on():
    for planner in (split_planner(host_split=False), split_planner()):
        plan = planner.plan(["host"] * 1708, BLOCK, TOKENS)  # no turn after it: nothing to hide the copy
        assert (plan.host_now, plan.recompute, plan.load, plan.kind) == (1708, 0, 0, "restore")
    plan = split_planner(host_split=False).plan(["host"] * 1708, BLOCK, TOKENS, after=150)
    assert (plan.host_now, plan.kind, plan.prefetch) == (1708, "restore", False)


def test_a_long_host_history_splits_where_the_head_and_turn_meet_the_copy():
    planner = split_planner(beside_scale=1.2)
    n, after = 1708, 150  # the sessions bench's host-RAM turn: 27k tokens of history, 150 new
    plan = planner.plan(["host"] * n, BLOCK, TOKENS, after=after)
    assert plan.kind == "split" and plan.prefetch and plan.host_now == 0 and plan.recompute + plan.load == n
    host_block = BLOCK / planner.host_bytes_per_s
    turn = planner.prefill_seconds(n * TOKENS, after)

    def total(k):
        return max(1.2 * planner.prefill_seconds(0, k * TOKENS) + turn, (n - k) * host_block)

    k = plan.recompute
    assert total(k) < n * host_block  # sooner than copying everything...
    assert total(k) <= min(total(k - 1), total(k + 1))  # ...and the best split, where the two sides meet
    assert abs(1.2 * planner.prefill_seconds(0, k * TOKENS) + turn - (n - k) * host_block) \
        <= 1.2 * planner.prefill_seconds(k * TOKENS, TOKENS) + host_block
    assert 50 < k < 300  # ~2-3k tokens of 27k
    assert plan.seconds < n * host_block < plan.recompute_seconds


def test_a_slower_recompute_beside_the_copy_splits_off_less():
    near = split_planner(beside_scale=1.0).plan(["host"] * 1708, BLOCK, TOKENS, after=150)
    far = split_planner(beside_scale=2.0).plan(["host"] * 1708, BLOCK, TOKENS, after=150)
    assert 0 < far.recompute < near.recompute
    # beside a copy that slows the prefill 200x (one block: 78 ms), copying everything is sooner
    assert split_planner(beside_scale=200.0).plan(["host"] * 1708, BLOCK, TOKENS, after=150).kind == "restore"


def test_a_turn_longer_than_the_copy_does_not_split():
    plan = split_planner().plan(["host"] * 50, BLOCK, TOKENS, after=4000)  # 2 ms of copy, a 4k-token turn
    assert plan.kind == "restore" and plan.host_now == 50


def test_steps_beside_the_copy_teach_the_beside_scale_only():
    planner = split_planner(alpha=0.5, beside_scale=1.0)
    predicted = planner.prefill_seconds(0, 2048)
    planner.observe_prefill([(0, 2048)], 1.5 * predicted, beside=True)
    assert planner.prefill_scale == 1.0 and planner.beside_scale == pytest.approx(1.25)
    planner.observe_prefill([(0, 2048)], 0.5 * predicted, beside=True)  # never below a plain prefill
    assert planner.beside_scale == pytest.approx(1.125)


@given(st.integers(1, 400), st.integers(1, 8000), st.floats(1e8, 1e11), st.floats(1.0, 4.0),
       st.lists(st.tuples(st.integers(16, 40_000), st.floats(1e-4, 5.0)), min_size=1, max_size=6,
                unique_by=lambda p: p[0]), st.integers(0, 30_000))
@settings(max_examples=200, deadline=None)
def test_a_host_split_is_never_slower_than_copying_or_recomputing(n, after, host, beside, curve, start):
    planner = RestorePlanner(prefill_curve=sorted(curve), host_bytes_per_s=host, host_split=True,
                             beside_scale=beside)
    plan = planner.plan(["host"] * n, BLOCK, TOKENS, start, after)
    assert plan.host_now + plan.recompute + plan.load == n
    assert plan.seconds <= plan.recompute_seconds + 1e-9
    if plan.prefetch:  # (a split whose copy waits for the head: the leading run alone was worth copying)
        host_block = BLOCK / host
        turn = max(planner.prefill_seconds(start + n * TOKENS, after), 0.0)
        whole = RestorePlanner(prefill_curve=sorted(curve), host_bytes_per_s=host).plan(["host"] * n, BLOCK, TOKENS,
                                                                                          start)
        split = max(beside * planner.prefill_seconds(start, plan.recompute * TOKENS) + turn, plan.load * host_block)
        assert plan.kind == "split" and plan.host_now == 0 and (whole.host_now, whole.kind) == (n, "restore")
        assert split < max(whole.seconds, turn)


def host_history(engine, planner: RestorePlanner) -> Engine:
    """A sibling with a small GPU pool and a host tier, whose first turn is pushed into host RAM by others."""
    cfg = CacheConfig(block_size=16, num_blocks=12, host_bytes=64 * 2**20)
    eng = Engine(engine.model, engine.tokenizer, engine.model_config, model_id="plan", device=engine.device,
                 dtype=engine.dtype, cache=cfg, scheduler=SchedulerConfig(), fingerprint=engine.scheduler.fingerprint)
    eng.tiers.planner = planner
    eng.start()
    return eng


LONG_FIRST = [{"role": "user", "content": "Here is a list to keep in mind: apples, rivers, copper, violins, maple "
                                         "trees, comets, harbours, lanterns, glaciers, and the number 4217. Write "
                                         "two sentences about the moon and the tides."}]


@pytest.fixture(scope="module")
def long_turn(engine):
    """A second turn after a first of ~110 tokens: its prompt, and its greedy tokens with no cache."""
    tok = engine.tokenizer
    ids1 = tok.apply_chat_template(LONG_FIRST)
    engine.scheduler.prefix_caching = False
    try:
        answer = engine.generate_sync(ids1, GREEDY)
        second = LONG_FIRST + [{"role": "assistant", "content": answer.text},
                               {"role": "user", "content": "And the sun?"}]
        ids2 = tok.apply_chat_template(second)
        return ids1, ids2, engine.generate_sync(ids2, GREEDY).token_ids
    finally:
        engine.scheduler.prefix_caching = True


def test_a_host_history_split_gives_the_same_tokens(engine, long_turn):
    ids1, ids2, tokens = long_turn
    # per block: 1 s to compute (16 tokens/s), 0.9 s to copy: copying beats computing, block by block, but
    # computing the first blocks while the others copy beats copying them all
    planner = RestorePlanner(prefill_tokens_per_s=16.0, alpha=0.0, host_split=True, beside_scale=1.0)
    eng = host_history(engine, planner)
    planner.host_bytes_per_s = eng.kv.block_bytes / 0.9
    plans = []
    real_plan = eng.tiers.plan
    eng.tiers.plan = lambda *a: plans.append((a[2], real_plan(*a))) or plans[-1][1]
    try:
        eng.generate_sync(ids1, GREEDY)
        for q in ("Describe the sea.", "What is a prime number?", "Tell me about Paris.", "Why is grass green?"):
            eng.generate_sync(eng.tokenizer.apply_chat_template([{"role": "user", "content": q}]), GREEDY)
        plans.clear()
        before = eng.tiers.stats.restored_host
        out = eng.generate_sync(ids2, GREEDY)
        on_gpu, plan = plans[-1]
        assert plan.kind == "split" and plan.prefetch and plan.recompute >= 1 and plan.load >= 2
        assert eng.tiers.stats.restored_host - before == plan.load
        assert eng.tiers.stats.plans["split"] == 1
        # what was on the GPU and what was copied, not what was recomputed
        assert out.cached_tokens == on_gpu + plan.load * 16
        assert out.token_ids == tokens
    finally:
        eng.shutdown()


def test_a_landed_restore_teaches_the_host_rate_before_the_next_plan(tmp_path):
    """On a GPU a restore's copy is timed by events and folded into the host rate once it has landed: by the next
    plan at the latest, whatever else the tiers did (a served H100 run planned every restore at the 20 GB/s guess:
    only a gather for a spill asked the events, and kept pages go down in place there)."""
    import torch

    from qml_runtime.kv.cache import KVCache
    from qml_runtime.kv.host_tier import HostTier
    from qml_runtime.kv.tiers import KVTiers
    from qml_runtime.presets import PRESETS

    kv = KVCache(PRESETS["tiny-llama"].config, 8, 4, "cpu", torch.float32)
    tiers = KVTiers(kv, HostTier(kv.block_bytes, 8 * kv.block_bytes, pin=False), None)
    guess = tiers.planner.host_bytes_per_s

    class Landed:  # a CUDA event pair's surface: the copy took 2 ms
        def __init__(self, done: bool):
            self.done = done

        def query(self) -> bool:
            return self.done

        def elapsed_time(self, end) -> float:
            return 2.0

    nbytes = 100 * 10**6  # 100 MB in 2 ms: 50 GB/s
    tiers._timing = [(Landed(True), Landed(True), nbytes), (Landed(False), Landed(False), nbytes)]
    plan = tiers.plan(["host"] * 4, 4)
    assert plan.kind == "restore"
    assert tiers.planner.host_bytes_per_s == pytest.approx(50e9) != guess  # a first measurement replaces the guess
    assert len(tiers._timing) == 1  # the one still copying waits for a later plan


def test_a_probed_disk_rate_gives_way_to_the_first_restore_measured():
    planner = RestorePlanner()
    planner.observe("disk", 1.13e9, 1.0, provisional=True)  # the start-up probe
    assert planner.disk_bytes_per_s == 1.13e9 and "disk_bytes_per_s" not in planner.rates()  # (not saved)
    planner.observe("disk", 0.5e9, 1.0)  # the first restore: replaces the probe, not averaged with it
    assert planner.disk_bytes_per_s == 0.5e9 and planner.rates() == {"disk_bytes_per_s": 0.5e9}
    planner.observe("disk", 1.0e9, 1.0)  # later ones are averaged in, a faster one at alpha
    assert planner.disk_bytes_per_s == pytest.approx(0.8 * 0.5e9 + 0.2 * 1.0e9)


def test_a_faster_first_load_moves_the_probed_disk_rate_only_by_alpha():
    planner = RestorePlanner()
    planner.observe("disk", 1.51e9, 1.0, provisional=True)  # session 35's H100: the probe's 85%...
    planner.observe("disk", 2.04e9, 1.0)  # ...and the first load after it, whose rate the next load did not get
    assert planner.disk_bytes_per_s == pytest.approx(0.8 * 1.51e9 + 0.2 * 2.04e9)
    assert planner.rates() == {"disk_bytes_per_s": planner.disk_bytes_per_s}  # a measurement now: saved


def test_a_slower_disk_counts_more_than_a_faster_one():
    planner = RestorePlanner()
    planner.observe("disk", 1.0e9, 1.0)
    planner.observe("disk", 0.6e9, 1.0)
    assert planner.disk_bytes_per_s == pytest.approx(0.5 * 1.0e9 + 0.5 * 0.6e9)
    planner.observe("disk", 1.2e9, 1.0)
    assert planner.disk_bytes_per_s == pytest.approx(0.8 * 0.8e9 + 0.2 * 1.2e9)
    planner.observe("host", 40e9, 1.0)  # the host copy's rate is averaged evenly both ways
    planner.observe("host", 20e9, 1.0)
    assert planner.host_bytes_per_s == pytest.approx(0.8 * 40e9 + 0.2 * 20e9)


def test_a_disk_rate_too_high_costs_a_split_more_than_one_too_low():
    """Why the disk's rate is learnt unevenly (``RestorePlanner.disk_alpha_down``): planned on a rate 18% above the
    disk's, a split streams blocks the disk brings in late; 18% below, it recomputes a few the disk would have
    brought in sooner, on a GPU that computes a token in less than half the time the disk reads it."""
    true_rate, block_bytes, bt, n = 1.7e9, 2 << 20, 16, 1728  # a 27,648-token Llama-3.1-8B history

    def actual_seconds(assumed: float) -> float:
        planner = RestorePlanner(prefill_curve=[(1024, 0.03), (32768, 1.0)], disk_bytes_per_s=assumed)
        plan = planner.plan(["disk"] * n, block_bytes, bt)
        assert plan.kind == "split"
        recompute = planner.prefill_seconds(0, plan.recompute * bt)
        return max(recompute, plan.load * block_bytes / true_rate)

    best = actual_seconds(true_rate)
    too_high, too_low = actual_seconds(1.18 * true_rate) / best - 1, actual_seconds(true_rate / 1.18) / best - 1
    assert 0 < too_low < too_high
