"""`qml bench sessions`: multi-turn conversations over the chat API, and where each turn's history came from.

``--users U`` conversations are open at once, each ``--turns T`` turns long. Every turn adds a
user message of about ``--turn-tokens`` tokens of text (a decimal nonce, then filler prose,
sized from one calibration of the tokenizer's characters per token) and gets a streamed
reply of exactly ``--reply-tokens`` tokens (``ignore_eos``). The reply's text is appended to
the conversation's messages, as a chat client does, so the history grows turn by turn and
each request sends all of it again. Each conversation has its own ``cache_salt`` for all its
turns: it can reuse its own history and nothing of another's.

The conversations take turns round-robin (turn 1 of every user, then turn 2 of every user, ...),
one request at a time. All U histories compete for the KV memory as in a real deployment,
and each request's effect on the server's counters is its own: around every turn the bench
reads ``/metrics`` and takes the deltas of ``qml:kv_restored_blocks_total{tier="host"|"disk"}``
(pages copied back to the GPU), ``qml:kv_recomputed_blocks_total`` (pages found on disk
but recomputed) and ``qml:kept_reply_reused_tokens_total`` (prompt ids the server took from
the replies it generated instead of encoding their text), and classifies the turn by where
its history came from: ``gpu`` (cached tokens beyond the restored pages, ``PAGE_TOKENS``
tokens each), ``host``, ``disk`` or a mix (``gpu+disk``), ``recomputed`` (history, but
nothing cached) or ``new`` (turn 1).

For every turn the bench records TTFT, ``prompt_tokens`` and ``cached_tokens``. With
``--fresh``, each turn's prompt is also sent again (``max_tokens=1``) with a fresh
``cache_salt``: a full prefill of the same length, shown beside the turn's TTFT. By default
these go after the round's turns (``--fresh-order round``), so that no measured turn follows
the bench's own baseline: a 27k-token prefill draws the H200 to its 700 W power limit, and a
short turn right after it ran at the capped clock (its attention ~228 against ~153 us a layer,
benchmarks/results/restore-h200-2026-12-05.md), so the second user's turn measured the
baseline's heat. ``--fresh-order turn`` sends each right after its turn, as before.

Phases (``--phase``): ``gpu``, nothing between turns (the histories stay in GPU memory if
they fit); ``evict``, before every round but the first, ``--evict-tokens`` tokens of
unrelated token-id prompts (fresh salts) go through the server, pushing the histories out
of the GPU pages into the host and disk tiers.

Across a restart: ``--save FILE`` writes the conversations (messages, salts, turn counts);
restart the server with the same ``--kv-disk-dir``; ``--resume FILE`` plays the next
``--turns`` turns (default 1) of the saved conversations, whose history then comes from disk.
The API key must be the same too: it salts the pages.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from qml_server.bench_common import (
    NONCE_DIGITS,
    BenchError,
    Client,
    IdPrompts,
    _httpx,
    add_client_arguments,
    api_key_from,
    command_line,
    filler_text,
    metric_sum,
    new_nonce,
    percentile,
    prompt_text,
)
from qml_server.cli import positive_int

SAVE_FORMAT = "qml-bench-sessions/1"
PAGE_TOKENS = 16  # qml's KV page; only used to split a turn's cached tokens between the GPU and the restored pages
DEFAULT_USERS, DEFAULT_TURNS, DEFAULT_TURN_TOKENS, DEFAULT_REPLY_TOKENS = 4, 4, 133, 128
PHASES = ("gpu", "evict")
FRESH_ORDERS = ("round", "turn")
RESTORED = "qml:kv_restored_blocks_total"
REUSED_REPLY_IDS = "qml:kept_reply_reused_tokens_total"  # prompt ids taken from kept replies (qml_server.replies)
RECOMPUTED = "qml:kv_recomputed_blocks_total"
# the server's own view of a turn: its time to first token, and the part of it the request waited in the
# engine before its first scheduling (the engine busy with the work of an earlier request)
SERVER_TTFT = "qml:time_to_first_token_seconds_sum"
QUEUE_TIME = "qml:request_queue_time_seconds_sum"
# the restore planner's estimates for the histories it planned (a turn's delta: its plan's) and the disk rate it
# prices reads at (before a turn: what its plan used; after: what its load taught it)
PLANNED = "qml:kv_restore_planned_seconds_total"
RECOMPUTE_PLANNED = "qml:kv_restore_recompute_planned_seconds_total"
RATE = "qml:kv_restore_rate_bytes_per_second"
CALIBRATION_CHARS = 2000


@dataclass
class Conversation:
    id: str
    salt: str
    turns: int  # turns completed
    messages: list[dict]


def calibrate_chars_per_token(client: Client, max_len: int | None) -> float:
    """Characters of filler text per token, from two chat requests (no filler, and up to CALIBRATION_CHARS of it)."""
    chars = min(CALIBRATION_CHARS, (max_len or 2 * CALIBRATION_CHARS) // 2)
    nonce = new_nonce()
    base = client.count_chat_tokens(prompt_text(nonce, 0))
    full = client.count_chat_tokens(prompt_text(nonce, chars))
    if full <= base:
        raise BenchError(f"the server counted no tokens for {chars} characters of text")
    return chars / (full - base)


def user_text(turn: int, chars: int) -> str:
    """A turn's user message: a new nonce, then ``chars`` characters of filler from a turn-dependent place."""
    return f"{new_nonce()}\n{filler_text(chars, offset=(turn * 7919) % 10007)}"


def where_from(turn: int, cached: int | None, restored: dict[str, int] | None) -> str:
    """Where a turn's history came from, from its cached tokens and the restore counters' deltas."""
    if cached is None:
        return "unknown"
    if cached == 0:
        return "new" if turn == 1 else "recomputed"
    if restored is None:
        return "cached"
    parts = ["gpu"] if cached > PAGE_TOKENS * sum(restored.values()) else []
    parts += [tier for tier in ("host", "disk") if restored.get(tier)]
    return "+".join(parts) or "gpu"


def _counters(metrics: dict | None) -> dict[str, float] | None:
    if metrics is None:
        return None
    return {"host": metric_sum(metrics, RESTORED, tier="host") or 0.0,
            "disk": metric_sum(metrics, RESTORED, tier="disk") or 0.0,
            "recomputed": metric_sum(metrics, RECOMPUTED) or 0.0,
            "reply_ids": metric_sum(metrics, REUSED_REPLY_IDS) or 0.0,
            "server_ttft": metric_sum(metrics, SERVER_TTFT) or 0.0, "queue": metric_sum(metrics, QUEUE_TIME) or 0.0,
            "planned": metric_sum(metrics, PLANNED) or 0.0,
            "recompute_planned": metric_sum(metrics, RECOMPUTE_PLANNED) or 0.0}


def _disk_rate(metrics: dict | None) -> float | None:
    """The disk rate the planner prices reads at, GB/s (None: no such metric; a rate is never 0)."""
    rate = metric_sum(metrics, RATE, tier="disk")
    return round(rate / 1e9, 3) if rate else None


def run_sessions(base_url: str, api_key: str | None = None, model: str | None = None, users: int | None = None,
                 turns: int | None = None, turn_tokens: int | None = None, reply_tokens: int | None = None,
                 fresh: bool = False, phase: str = "gpu", evict_tokens: int | None = None,
                 session_ids: bool = False, resume: dict | None = None, resumed_from: str | None = None,
                 metrics_url: str | None = None, timeout: float = 600.0, command: str | None = None,
                 progress: Callable[[str], None] = lambda _: None,
                 first_turn_tokens: int | None = None, fresh_order: str = "round") -> tuple[dict, dict]:
    """Play the conversations; returns (the result record, the conversations' state for ``--save``)."""
    if phase not in PHASES:
        raise BenchError(f"unknown phase {phase!r}: use one of {', '.join(PHASES)}")
    if fresh_order not in FRESH_ORDERS:
        raise BenchError(f"unknown fresh order {fresh_order!r}: use one of {', '.join(FRESH_ORDERS)}")
    if phase == "evict" and not evict_tokens:
        raise BenchError("--phase evict needs --evict-tokens N (more than the GPU's KV pages hold)")
    if resume is not None and users is not None:
        raise BenchError("--users does not go with --resume: the saved conversations are played")
    client = Client(base_url, api_key, timeout, metrics_url=metrics_url)
    try:
        return _run(client, base_url, model, users, turns, turn_tokens, reply_tokens, fresh, phase, evict_tokens,
                    session_ids, resume, resumed_from, command, progress, first_turn_tokens, fresh_order)
    except _httpx().HTTPError as exc:
        raise BenchError(f"{base_url}: {type(exc).__name__}: {exc}") from exc
    finally:
        client.close()


def _run(client: Client, base_url: str, model: str | None, users: int | None, turns: int | None,
         turn_tokens: int | None, reply_tokens: int | None, fresh: bool, phase: str, evict_tokens: int | None,
         session_ids: bool, resume: dict | None, resumed_from: str | None, command: str | None,
         progress: Callable[[str], None], first_turn_tokens: int | None = None,
         fresh_order: str = "round") -> tuple[dict, dict]:
    card = client.pick_model(model)
    notes: list[str] = []
    if resume is not None:
        if resume.get("format") != SAVE_FORMAT:
            raise BenchError(f"not a saved sessions file ({SAVE_FORMAT}): format {resume.get('format')!r}")
        saved = resume["settings"]
        if resume.get("server_model") != client.model:
            notes.append(f"the conversations were saved from model {resume.get('server_model')!r}, "
                         f"and are played on {client.model!r}")
        convs = [Conversation(**c) for c in resume["conversations"]]
        turn_tokens = turn_tokens or saved["turn_tokens"]
        reply_tokens = reply_tokens or saved["reply_tokens"]
        chars_per_token = float(saved["chars_per_token"])
        turns = turns or 1
        # an unmeasured request first: the restarted server's first-call costs stay out of the turns
        client.stream(prompt_text(new_nonce(), 64), max_tokens=2)
    else:
        turn_tokens, reply_tokens = turn_tokens or DEFAULT_TURN_TOKENS, reply_tokens or DEFAULT_REPLY_TOKENS
        turns = turns or DEFAULT_TURNS
        chars_per_token = calibrate_chars_per_token(client, card.get("max_model_len"))
        convs = [Conversation(f"user{i + 1}-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex, 0, [])
                 for i in range(users or DEFAULT_USERS)]
    text_chars = max(0, round(turn_tokens * chars_per_token) - (NONCE_DIGITS + 1))
    # a long first message builds a long history in one turn; the later turns stay short
    first_chars = max(0, round(first_turn_tokens * chars_per_token) - (NONCE_DIGITS + 1)) \
        if first_turn_tokens else text_chars
    progress(f"{len(convs)} conversations x {turns} turns of ~{turn_tokens} tokens ({text_chars} chars, "
             f"{chars_per_token:.2f} chars/token) and {reply_tokens}-token replies; phase {phase}"
             + (f", resumed from {resumed_from}" if resume is not None else ""))

    id_prompts = None
    evictions: list[dict] = []
    records: list[dict] = []
    metrics_seen = client.scrape_metrics() is not None
    if not metrics_seen:
        notes.append(f"no metrics at {client.metrics_url}: where a turn's history came from is unknown")
    for round_index in range(turns):
        if phase == "evict" and (round_index or resume is not None):
            if id_prompts is None:
                id_prompts = IdPrompts(client.vocab_size(card)[0])
            evictions.append(_evict(client, id_prompts, evict_tokens or 0, card.get("max_model_len"),
                                    convs[0].turns + 1, progress))
        round_records: list[tuple[dict, list[dict]]] = []
        for conv in convs:
            turn = conv.turns + 1
            conv.messages.append({"role": "user", "content": user_text(turn, first_chars if turn == 1 else text_chars)})
            scraped = client.scrape_metrics()
            before, rate_before = _counters(scraped), _disk_rate(scraped)
            run = client.stream(conv.messages, max_tokens=reply_tokens, ignore_eos=True, cache_salt=conv.salt,
                                headers={"x-session-id": conv.id} if session_ids else None)
            scraped = client.scrape_metrics()
            after, rate_after = _counters(scraped), _disk_rate(scraped)
            delta = None if before is None or after is None else {k: after[k] - before[k] for k in after}
            restored = None if delta is None else {"host": round(delta["host"]), "disk": round(delta["disk"])}
            record: dict[str, Any] = {
                "user": conv.id, "turn": turn, "prompt_tokens": run.prompt_tokens,
                "cached_tokens": run.cached_tokens, "completion_tokens": run.completion_tokens,
                "ttft_ms": round(run.ttft_s * 1e3, 3),
                "ms_per_token": round(run.decode_s * 1e3 / (run.completion_tokens - 1), 4)
                if run.completion_tokens > 1 else None,
                "restored_blocks": restored,
                "recomputed_disk_blocks": None if delta is None else round(delta["recomputed"]),
                "kept_reply_ids": None if delta is None else round(delta["reply_ids"]),
                # the server's TTFT (from the request reaching it) and its wait for the engine's first scheduling
                "server_ttft_ms": None if delta is None else round(delta["server_ttft"] * 1e3, 3),
                "queue_ms": None if delta is None else round(delta["queue"] * 1e3, 3),
                # the restore plan of a history below the GPU: its estimate and the recompute's (beside server_ttft_ms)
                "planned_ms": round(delta["planned"] * 1e3, 3) if delta and delta["planned"] else None,
                "recompute_planned_ms": round(delta["recompute_planned"] * 1e3, 3)
                if delta and delta["recompute_planned"] else None,
                "planner_disk_gbps": [rate_before, rate_after] if rate_before is not None else None,
                "where": where_from(turn, run.cached_tokens, restored),
                "fresh_ttft_ms": None, "fresh_prompt_tokens": None, "fresh_cached_tokens": None,
            }
            prompt = list(conv.messages)  # (the fresh prefill's: without the reply appended next)
            fresh_now = fresh and fresh_order == "turn"
            if fresh_now:
                _fresh(client, prompt, record)
            conv.messages.append({"role": "assistant", "content": run.text})
            conv.turns = turn
            records.append(record)
            round_records.append((record, prompt))
            progress(f"  {conv.id} turn {turn}: {run.prompt_tokens} prompt tokens, {run.cached_tokens} cached "
                     f"({record['where']}), TTFT {record['ttft_ms']:.1f} ms"
                     + (f" (server {record['server_ttft_ms']:.1f}, queued {record['queue_ms']:.1f})"
                        if record["server_ttft_ms"] is not None else "")
                     + (f", fresh prefill {record['fresh_ttft_ms']:.1f} ms" if fresh_now else ""))
            if run.completion_tokens != reply_tokens:
                notes.append(f"{conv.id} turn {turn}: the reply stopped after {run.completion_tokens} of "
                             f"{reply_tokens} tokens (does the server honour ignore_eos?)")
        if fresh and fresh_order == "round":
            for record, prompt in round_records:
                _fresh(client, prompt, record)
                progress(f"  {record['user']} turn {record['turn']}: fresh prefill {record['fresh_ttft_ms']:.1f} ms")
    settings = {"users": len(convs), "turns": turns, "turn_tokens": turn_tokens, "reply_tokens": reply_tokens,
                "first_turn_tokens": first_turn_tokens,
                "fresh": fresh, "fresh_order": fresh_order if fresh else None, "phase": phase,
                "evict_tokens": evict_tokens, "session_ids": session_ids,
                "chars_per_token": round(chars_per_token, 4), "turn_text_chars": text_chars,
                "page_tokens_assumed": PAGE_TOKENS}
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    result = {
        "date": now, "command": command, "base_url": base_url, "server_model": client.model,
        "server_info": card.get("info"), "max_model_len": card.get("max_model_len"), "api": "chat",
        "phase": phase, "resumed_from": resumed_from, "metrics_url": client.metrics_url,
        "metrics_available": metrics_seen, "settings": settings, "turns": records,
        "by_turn": by_turn(records), "evictions": evictions, "notes": notes,
    }
    state = {"format": SAVE_FORMAT, "saved": now, "base_url": base_url, "server_model": client.model,
             "settings": {"turn_tokens": turn_tokens, "reply_tokens": reply_tokens,
                          "chars_per_token": chars_per_token},
             "conversations": [asdict(c) for c in convs]}
    return result, state


def _fresh(client: Client, prompt: list[dict], record: dict) -> None:
    """The turn's prompt again with nothing reusable (the client's default: a fresh cache_salt): a full prefill."""
    f = client.stream(prompt, max_tokens=1)
    record.update(fresh_ttft_ms=round(f.ttft_s * 1e3, 3), fresh_prompt_tokens=f.prompt_tokens,
                  fresh_cached_tokens=f.cached_tokens)


def _evict(client: Client, prompts: IdPrompts, tokens: int, max_len: int | None, before_turn: int,
           progress: Callable[[str], None]) -> dict:
    """``tokens`` tokens of new token-id prompts (fresh salts, one generated token each)."""
    piece = min(8192, (max_len or 8193) - 1)
    sent, requests, t0 = 0, 0, time.perf_counter()
    while sent < tokens:
        n = min(piece, tokens - sent)
        client.stream(prompts.make(n), max_tokens=1)
        sent, requests = sent + n, requests + 1
    seconds = time.perf_counter() - t0
    progress(f"evict: {sent} tokens in {requests} requests ({seconds:.1f} s) before turn {before_turn}")
    return {"before_turn": before_turn, "tokens": sent, "requests": requests, "seconds": round(seconds, 3)}


def _median(values: list[Any]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def by_turn(records: list[dict]) -> list[dict]:
    """One row per turn index: medians over the conversations, and where their histories came from."""
    rows = []
    for turn in sorted({r["turn"] for r in records}):
        rs = [r for r in records if r["turn"] == turn]
        ttft, fresh_ttft = _median([r["ttft_ms"] for r in rs]), _median([r["fresh_ttft_ms"] for r in rs])
        restored = [r["restored_blocks"] for r in rs if r["restored_blocks"] is not None]
        rows.append({
            "turn": turn,
            "conversations": len(rs),
            "prompt_tokens": _median([r["prompt_tokens"] for r in rs]),
            "cached_tokens": _median([r["cached_tokens"] for r in rs]),
            "computed_tokens": _median([r["prompt_tokens"] - r["cached_tokens"] for r in rs]),
            "kept_reply_ids": _median([r.get("kept_reply_ids") for r in rs]),
            "ttft_ms": ttft,
            "ttft_p90_ms": _p90([r["ttft_ms"] for r in rs]),
            "fresh_ttft_ms": fresh_ttft,
            "fresh_cached_tokens": _median([r["fresh_cached_tokens"] for r in rs]),
            "speedup": round(fresh_ttft / ttft, 2) if fresh_ttft and ttft else None,
            "where": dict(collections.Counter(r["where"] for r in rs)),
            "restored_blocks": {t: sum(x[t] for x in restored) for t in ("host", "disk")} if restored else None,
            "recomputed_disk_blocks": sum(r["recomputed_disk_blocks"] or 0 for r in rs),
            "server_ttft_ms": _median([r.get("server_ttft_ms") for r in rs]),
            "queue_ms": _median([r.get("queue_ms") for r in rs]),
            "planned_ms": _median([r.get("planned_ms") for r in rs]),
        })
    return rows


def _p90(values: list[float]) -> float | None:
    p = percentile(values, 90)
    return None if p is None else round(p, 3)


def markdown(result: dict) -> str:
    def num(x: Any, fmt: str = "{:.1f}") -> str:
        return "—" if x is None else fmt.format(x)

    s = result["settings"]
    lines = [f"`{result['server_model']}` at {result['base_url']}, {result['date']}; chat API; phase {result['phase']}"
             + (f", resumed from {result['resumed_from']}" if result["resumed_from"] else "")
             + f"; {s['users']} conversations, ~{s['turn_tokens']}-token turns, {s['reply_tokens']}-token replies",
             "",
             ("| turn | prompt tokens | cached tokens | TTFT (ms) | fresh-prefill TTFT (ms) | fresh / TTFT | "
              "where restored | restored pages host / disk | computed tokens | ids from kept replies | "
              "server TTFT (ms) | of it queued (ms) | restore plan's estimate (ms) |"),
             "|---:|---:|---:|---:|---:|---:|:---|---:|---:|---:|---:|---:|---:|"]
    for row in result["by_turn"]:
        where = ", ".join(f"{k} ×{v}" for k, v in sorted(row["where"].items()))
        rb = row["restored_blocks"]
        pages = "—" if rb is None else f"{rb['host']} / {rb['disk']}"
        lines.append(f"| {row['turn']} | {num(row['prompt_tokens'], '{:.0f}')} | {num(row['cached_tokens'], '{:.0f}')} "
                     f"| {num(row['ttft_ms'])} | {num(row['fresh_ttft_ms'])} | {num(row['speedup'], '{:.2f}x')} "
                     f"| {where} | {pages} | {num(row['computed_tokens'], '{:.0f}')} "
                     f"| {num(row['kept_reply_ids'], '{:.0f}')} | {num(row.get('server_ttft_ms'))} "
                     f"| {num(row.get('queue_ms'))} | {num(row.get('planned_ms'))} |")
    lines += ["", "(medians over the conversations of each turn)"]
    if result["notes"]:
        lines += ["", *(f"note: {n}" for n in result["notes"])]
    return "\n".join(lines)


# --- command line ---------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_client_arguments(parser)
    parser.add_argument("--users", type=positive_int,
                        help=f"conversations open at once (default: {DEFAULT_USERS}; with --resume, the saved ones)")
    parser.add_argument("--turns", type=positive_int,
                        help=f"turns played per conversation (default: {DEFAULT_TURNS}; with --resume, 1)")
    parser.add_argument("--turn-tokens", type=positive_int,
                        help=f"about this many tokens of text per user turn (default: {DEFAULT_TURN_TOKENS}; "
                             "with --resume, the saved value)")
    parser.add_argument("--first-turn-tokens", type=positive_int,
                        help="about this many tokens in each conversation's first message (default: --turn-tokens): "
                             "a long history at once, then short turns on top of it")
    parser.add_argument("--reply-tokens", type=positive_int,
                        help=f"tokens per assistant reply, with ignore_eos (default: {DEFAULT_REPLY_TOKENS}; "
                             "with --resume, the saved value)")
    parser.add_argument("--fresh", action="store_true",
                        help="after each turn, send its prompt again with a fresh cache_salt: a full prefill "
                             "of the same length, for comparison")
    parser.add_argument("--fresh-order", choices=FRESH_ORDERS, default="round",
                        help="round: the fresh prefills after the round's turns, so no measured turn follows one "
                             "(the power limit's clocks after a long prefill); turn: each right after its turn "
                             "(default: %(default)s)")
    parser.add_argument("--phase", choices=PHASES, default="gpu",
                        help="gpu: nothing between turns; evict: --evict-tokens of unrelated prompts before each "
                             "round but the first, pushing the histories out of GPU memory (default: %(default)s)")
    parser.add_argument("--evict-tokens", type=positive_int, help="tokens of unrelated prompts per eviction")
    parser.add_argument("--session-ids", action="store_true",
                        help="send each conversation's id as the x-session-id header (the server keeps such KV longest)")
    parser.add_argument("--metrics-url", help="the server's Prometheus metrics (default: /metrics beside the API root)")
    parser.add_argument("--save", type=Path, help="write the conversations (messages, salts) to this file")
    parser.add_argument("--resume", type=Path, help="play the next turn(s) of the conversations saved in this file")
    parser.add_argument("--out", type=Path, help="write the result as JSON to this file")


_FLAGS = ("--base-url", "--model", "--users", "--turns", "--turn-tokens", "--first-turn-tokens", "--reply-tokens",
          "--fresh", "--fresh-order", "--phase", "--evict-tokens", "--session-ids", "--metrics-url", "--save",
          "--resume", "--timeout", "--out")


def bench_sessions_command(args: argparse.Namespace) -> int:
    def progress(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        resume = None
        if args.resume:
            try:
                resume = json.loads(args.resume.read_text())
            except (OSError, ValueError) as exc:
                raise BenchError(f"cannot read {args.resume}: {exc}") from exc
        result, state = run_sessions(
            args.base_url, api_key_from(args), args.model, args.users, args.turns, args.turn_tokens,
            args.reply_tokens, args.fresh, args.phase, args.evict_tokens, args.session_ids, resume,
            str(args.resume) if args.resume else None, args.metrics_url, args.timeout,
            command_line(["qml", "bench", "sessions"], args, _FLAGS), progress, args.first_turn_tokens,
            args.fresh_order)
    except BenchError as exc:
        print(f"qml bench sessions: {exc}", file=sys.stderr)
        return 1
    print(markdown(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        progress(f"\nwrote {args.out}")
    if args.save:
        args.save.write_text(json.dumps(state, indent=1) + "\n")
        progress(f"saved {len(state['conversations'])} conversations to {args.save}")
    return 0
