"""`qml bench sessions` against real `qml serve --model preset:tiny-llama --random-weights` processes."""

from __future__ import annotations

import json

import pytest

from qml_server import bench_sessions
from qml_server.bench_common import BenchError
from qml_server.cli import build_parser, main
from tests.test_bench import start_tiny_server, stop_server


@pytest.fixture(scope="module")
def server():
    proc, url = start_tiny_server("--kv-cache-gib", "0.05")
    yield url
    stop_server(proc)


def test_sessions_history_stays_on_the_gpu(server, tmp_path, capsys):
    out = tmp_path / "sessions.json"
    rc = main(["bench", "sessions", "--base-url", server, "--users", "2", "--turns", "3", "--turn-tokens", "60",
               "--reply-tokens", "8", "--fresh", "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    result = json.loads(out.read_text())
    assert result["api"] == "chat" and result["phase"] == "gpu" and result["metrics_available"]
    assert result["command"].startswith("qml bench sessions ") and "--fresh" in result["command"]
    s = result["settings"]
    assert s["users"] == 2 and s["turns"] == 3 and s["reply_tokens"] == 8 and s["chars_per_token"] == 1.0
    turns = result["turns"]
    assert [(r["turn"], r["user"]) for r in turns][:2] == [(1, turns[0]["user"]), (1, turns[1]["user"])]
    assert len(turns) == 6 and len({r["user"] for r in turns}) == 2
    for r in turns:
        assert r["completion_tokens"] == 8 and r["ttft_ms"] > 0 and r["fresh_ttft_ms"] > 0
        # the fresh prompt (another cache_salt, so another tenant) encodes the replies from their text; the
        # conversation's own turns reuse their generated ids (qml_server.replies). A generated id re-encodes
        # to 0-3 byte ids here (a stray byte decodes to U+FFFD, 3 bytes; a stray BOS to nothing)
        assert r["fresh_cached_tokens"] == 0
        assert abs(r["fresh_prompt_tokens"] - r["prompt_tokens"]) <= 2 * 8 * (r["turn"] - 1)
        assert r["restored_blocks"] == {"host": 0, "disk": 0} and r["recomputed_disk_blocks"] == 0
        # the server's side of the same turn: its TTFT (from the request's arrival) within the client's, and
        # the engine's wait before scheduling it within that
        assert 0 < r["server_ttft_ms"] <= r["ttft_ms"] and 0 <= r["queue_ms"] <= r["server_ttft_ms"]
        assert r["planned_ms"] is None and r["recompute_planned_ms"] is None  # (no history below the GPU)
        assert r["planner_disk_gbps"] is None  # (no disk tier)
        if r["turn"] == 1:
            assert r["cached_tokens"] == 0 and r["where"] == "new" and r["kept_reply_ids"] == 0
        else:
            # at least every full page of the previous turn's prompt, which this prompt starts with
            previous = next(p for p in turns if p["user"] == r["user"] and p["turn"] == r["turn"] - 1)
            assert r["cached_tokens"] >= previous["prompt_tokens"] // 16 * 16 > 0
            assert r["prompt_tokens"] > previous["prompt_tokens"] + 60 and r["where"] == "gpu"
            # the previous prompt and its reply came back as the ids the server had for them
            assert r["kept_reply_ids"] >= previous["prompt_tokens"] + 8 - 4
    rows = result["by_turn"]
    assert [row["turn"] for row in rows] == [1, 2, 3]
    assert rows[0]["where"] == {"new": 2} and rows[2]["where"] == {"gpu": 2}
    assert rows[1]["cached_tokens"] > 0 and rows[1]["fresh_cached_tokens"] == 0 and rows[1]["speedup"] > 0
    assert "| turn | prompt tokens | cached tokens | TTFT (ms) | fresh-prefill TTFT (ms)" in captured.out
    assert "gpu ×2" in captured.out


def test_sessions_survive_a_restart_through_the_disk_tier(tmp_path, capsys):
    kv_dir, saved, out = tmp_path / "kv", tmp_path / "conversations.json", tmp_path / "resumed.json"
    flags = ("--kv-cache-gib", "0.05", "--kv-disk-dir", str(kv_dir))
    proc, url = start_tiny_server(*flags)
    try:
        rc = main(["bench", "sessions", "--base-url", url, "--users", "2", "--turns", "2", "--turn-tokens", "50",
                   "--reply-tokens", "6", "--save", str(saved)])
        assert rc == 0, capsys.readouterr().err
    finally:
        stop_server(proc)  # SIGTERM: pending disk writes are flushed
    state = json.loads(saved.read_text())
    assert state["format"] == bench_sessions.SAVE_FORMAT and len(state["conversations"]) == 2
    assert all(c["turns"] == 2 and len(c["messages"]) == 4 for c in state["conversations"])
    assert state["settings"]["turn_tokens"] == 50 and state["settings"]["reply_tokens"] == 6

    proc, url = start_tiny_server(*flags)
    try:
        rc = main(["bench", "sessions", "--base-url", url, "--resume", str(saved), "--fresh", "--out", str(out)])
        captured = capsys.readouterr()
        assert rc == 0, captured.err
    finally:
        stop_server(proc)
    result = json.loads(out.read_text())
    assert result["resumed_from"] == str(saved) and result["settings"]["reply_tokens"] == 6
    assert [r["turn"] for r in result["turns"]] == [3, 3]
    for r in result["turns"]:
        assert r["cached_tokens"] > 0 and r["fresh_cached_tokens"] == 0
        assert r["restored_blocks"]["disk"] > 0 and r["restored_blocks"]["host"] == 0
        assert r["restored_blocks"]["disk"] * 16 == r["cached_tokens"]  # the whole history came from disk
        assert r["where"] == "disk"
        # the turn's restore plan, as /metrics exports it: never slower than recomputing, by its own estimate
        assert 0 < r["planned_ms"] <= r["recompute_planned_ms"]
        assert len(r["planner_disk_gbps"]) == 2 and all(rate > 0 for rate in r["planner_disk_gbps"])
    assert result["by_turn"][0]["where"] == {"disk": 2} and "disk ×2" in captured.out
    assert result["by_turn"][0]["planned_ms"] > 0 and "restore plan's estimate (ms) |" in captured.out


@pytest.mark.parametrize("order", ["round", "turn"])
def test_sessions_fresh_prefills_go_after_the_round(server, monkeypatch, order):
    # by default no measured turn follows the bench's own full prefill (the power limit's clocks after one)
    sent = []
    stream = bench_sessions.Client.stream

    def logged(self, messages, *args, cache_salt=None, **kwargs):
        sent.append(("turn" if cache_salt else "fresh", len(messages)))
        return stream(self, messages, *args, cache_salt=cache_salt, **kwargs)

    monkeypatch.setattr(bench_sessions.Client, "stream", logged)
    result, _ = bench_sessions.run_sessions(server, users=2, turns=2, turn_tokens=20, reply_tokens=4, fresh=True,
                                            fresh_order=order)
    # turn k of a conversation sends 2k - 1 messages; its fresh prefill sends the same ones
    if order == "round":
        assert sent == [("turn", 1), ("turn", 1), ("fresh", 1), ("fresh", 1),
                        ("turn", 3), ("turn", 3), ("fresh", 3), ("fresh", 3)]
    else:
        assert sent == [("turn", 1), ("fresh", 1)] * 2 + [("turn", 3), ("fresh", 3)] * 2
    assert result["settings"]["fresh_order"] == order
    assert all(r["fresh_ttft_ms"] > 0 and r["fresh_cached_tokens"] == 0 for r in result["turns"])
    with pytest.raises(BenchError, match="unknown fresh order"):
        bench_sessions.run_sessions(server, users=1, fresh=True, fresh_order="later")


def test_sessions_evict_phase_pushes_history_to_disk(tmp_path, capsys):
    # a KV pool of ~1400 tokens: 3000 tokens of other prompts push every history out
    proc, url = start_tiny_server("--kv-cache-gib", "0.001", "--kv-disk-dir", str(tmp_path / "kv"))
    try:
        result, state = bench_sessions.run_sessions(url, users=2, turns=2, turn_tokens=40, reply_tokens=4,
                                                    phase="evict", evict_tokens=3000)
    finally:
        stop_server(proc)
    assert [e["before_turn"] for e in result["evictions"]] == [2] and result["evictions"][0]["tokens"] == 3000
    second = [r for r in result["turns"] if r["turn"] == 2]
    # every history was found on disk; the restore plan may read it back or, where its measured
    # rates say computing is faster (a 3-layer model on a busy CPU), recompute it
    for r in second:
        if r["where"] == "recomputed":
            assert r["recomputed_disk_blocks"] > 0 and r["cached_tokens"] == 0
        else:
            assert r["cached_tokens"] > 0 and r["restored_blocks"]["disk"] > 0 and "disk" in r["where"]
    assert len(state["conversations"]) == 2


def test_where_from():
    assert bench_sessions.where_from(1, 0, {"host": 0, "disk": 0}) == "new"
    assert bench_sessions.where_from(2, 0, {"host": 0, "disk": 0}) == "recomputed"
    assert bench_sessions.where_from(2, 160, {"host": 0, "disk": 0}) == "gpu"
    assert bench_sessions.where_from(2, 160, {"host": 0, "disk": 10}) == "disk"
    assert bench_sessions.where_from(2, 160, {"host": 4, "disk": 2}) == "gpu+host+disk"
    assert bench_sessions.where_from(2, 160, None) == "cached"
    assert bench_sessions.where_from(2, None, None) == "unknown"


def test_sessions_refusals(server, tmp_path, capsys):
    with pytest.raises(BenchError, match="needs --evict-tokens"):
        bench_sessions.run_sessions(server, phase="evict")
    with pytest.raises(BenchError, match="does not go with --resume"):
        bench_sessions.run_sessions(server, users=2, resume={})
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "something else"}')
    assert main(["bench", "sessions", "--base-url", server, "--resume", str(bad)]) == 1
    assert "not a saved sessions file" in capsys.readouterr().err


def test_sessions_flags():
    args = build_parser({}).parse_args(["bench", "sessions"])
    assert args.users is None and args.turns is None and args.phase == "gpu" and not args.fresh
    args = build_parser({}).parse_args(["bench", "sessions", "--users", "8", "--turn-tokens", "200", "--fresh"])
    assert args.users == 8 and args.turn_tokens == 200 and args.fresh
    with pytest.raises(SystemExit):
        build_parser({}).parse_args(["bench", "sessions", "--phase", "host"])


def test_first_turn_tokens_builds_a_long_history_then_short_turns():
    proc, url = start_tiny_server()
    try:
        result, _ = bench_sessions.run_sessions(url, users=1, turns=3, turn_tokens=20, reply_tokens=4,
                                                first_turn_tokens=400)
    finally:
        stop_server(proc)
    prompts = [r["prompt_tokens"] for r in result["turns"]]
    assert 400 <= prompts[0] < 460  # the long first message (and the chat template's few tokens)
    for before, after in zip(prompts, prompts[1:]):
        assert 20 <= after - before - 4 < 60  # each later turn: ~20 new tokens, plus the 4-token reply
    assert result["settings"]["first_turn_tokens"] == 400
