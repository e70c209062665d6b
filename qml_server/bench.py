"""`qml bench serve`: time to first token, decode speed and throughput under concurrency of a running server.

Every measured prompt is new. A prefix cache (ours, vLLM's, SGLang's radix tree) names a KV
page by its tokens *and everything before them* (a chained hash), so a prompt that opens with
a random nonce shares no page with any earlier prompt past that point: its whole prefill is
computed, which is what a TTFT for N new tokens means. Every measured request also carries a
fresh ``cache_salt``, which qml (like vLLM) folds into its page names, so not even a chat
template's fixed header is reused. The bench records the ``cached_tokens`` the server gives
for every run, so a server that ignores the salt cannot hide it.

Two ways to send a prompt (``--api``):

* ``completions`` (the default): a list of token ids on ``/v1/completions``. The server
  counts exactly the ids it is sent, so every size is hit exactly, with no chat template
  around it. The ids are drawn from the middle of the server's vocabulary (learned once, see
  ``bench_common.Client.vocab_size``), the first ``NONCE_IDS`` of them at random.
* ``chat``: text in one user message on ``/v1/chat/completions``, sized the way the server
  counts it (``usage.prompt_tokens``, chat template included). The filler text after a
  decimal nonce is cut to the length that makes the count hit the target, found with
  ``max_tokens=1`` requests that all share one calibration nonce; each run's own count is
  recorded and any miss reported. The tokens the template adds around the text are reported
  (``chat_template_tokens``: the chat count minus ``/v1/completions``' count of the same text).

TTFT: from sending a streamed request (``max_tokens=1``) to the first chunk carrying a token
(text, or the finish chunk if the token decoded to no text); median of ``--repeats`` runs. The runs of a
size have the same length unless ``--length-step N`` gives run i ``i·N`` more tokens: real prompts rarely
repeat a length, and a server that builds something per length (a kernel plan, a graph) pays for it in each
such run, not only in the first.
Decode: one streamed request of ``--decode-tokens`` tokens with ``ignore_eos``, after one
unmeasured warm-up of the same shape; ms/token = (last token's arrival - first token's
arrival) / (tokens - 1), tokens counted by ``usage`` (``stream_options.include_usage``).

Concurrency (``--concurrency N``): N conversations at once, one thread and one connection
each, each streaming ``--concurrency-rounds`` requests one after the other: a new prompt of
``--concurrency-prompt-tokens`` tokens and ``--decode-tokens`` generated tokens (``ignore_eos``),
after one unmeasured warm-up round of N 2-token requests. Reported: ``output_tokens_per_s``
(all generated tokens / the wall time from the first request sent to the last token, vLLM's
"output token throughput"), ``steady_tokens_per_s`` (tokens arriving while all N conversations
are under way: from the moment every one has its first token to the moment the first one
ends, which leaves out the ramp of the first prefills and the tail), and TTFT, inter-token
latency (gaps between successive text chunks of a request) and time-per-output-token
percentiles (p50/p90/p99).

For Llama-3.1-8B and Qwen3-30B-A3B (``--reference``, by default recognised from the model's
name) the results are printed beside the reference numbers of issues 4 and 6 (``REFERENCE``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from qml_server.bench_common import (  # noqa: F401  (re-exported: the names tests and callers use)
    DEFAULT_BASE_URL,
    NONCE_DIGITS,
    NONCE_IDS,
    BenchError,
    Client,
    IdPrompts,
    StreamedRun,
    _httpx,
    add_client_arguments,
    api_key_from,
    command_line,
    filler_text,
    new_nonce,
    prompt_text,
    summary_ms,
)
from qml_server.cli import positive_int

DEFAULT_PROMPT_TOKENS = (133, 598, 2340, 8892, 26926)
DEFAULT_CONCURRENCY_PROMPT_TOKENS = 2048
MAX_PROBES = 24  # chat API: calibration requests per prompt size before settling for the closest count
APIS = ("completions", "chat")

# Reference numbers for Llama-3.1-8B (source: issue 4, item 7) and Qwen3-30B-A3B (issue 6): TTFT
# in ms at these prompt sizes; decode in ms/token; the concurrency target on the H200. Kept verbatim.
REFERENCE = {
    "llama-3.1-8b": {
        "source": "issue 4, item 7",
        "prompt_tokens": (133, 598, 2340, 8892, 26926),
        "engines": (
            # (name, TTFT ms per prompt size, decode ms/token)
            ("vLLM 0.32", (24.3, 40.4, 78.1, 291.4, 976.2), 4.97),
            ("SGLang 0.5.22", (14.1, 25.5, 73.3, 313.7, 937.0), 4.99),
            ("llama.cpp", (25.0, 77.9, 251.9, 992.7, 3504.0), 5.10),
        ),
        # upper bounds for TTFT and ms/token
        "target": ("qml target", (10.0, 20.0, 62.0, 250.0, 850.0), 4.4),
        # lower bound: generated tokens/s with `conversations` at once, `prompt_tokens`-token contexts
        "concurrency_target": {"conversations": 32, "prompt_tokens": 2048, "tokens_per_s": 4500.0},
    },
    # Source: issue 6 (the sizes there are approximate, "~130" etc.; these are the ones we send).
    "qwen3-30b-a3b": {
        "source": "issue 6",
        "prompt_tokens": (130, 590, 2340, 8890, 26900),
        "engines": (
            ("vLLM 0.32", (25.7, 61.3, 83.3, 267.2, 943.3), 3.97),
            ("SGLang 0.5.22", (23.1, 28.1, 61.5, 206.3, 889.8), 3.59),
            ("llama.cpp", (66.2, 204.6, 612.1, 2294.7, 7252.8), 5.06),
        ),
        "target": ("qml target", (17.0, 24.0, 50.0, 170.0, 750.0), 2.6),
    },
}


class PromptSizer:
    """Chat API: finds, per target, the filler length whose prompt the server counts as exactly that many tokens.

    All probes use one calibration nonce of the same length as the measured ones, and every
    (filler length, tokens) point is kept: later targets start from what earlier ones learned.
    """

    def __init__(self, client: Client, progress: Callable[[str], None]):
        self.client, self.progress = client, progress
        self.nonce = new_nonce()
        self.points: dict[int, int] = {}  # filler chars -> prompt tokens
        self.requests = 0

    def _measure(self, chars: int) -> int:
        if chars not in self.points:
            self.points[chars] = self.client.count_chat_tokens(prompt_text(self.nonce, chars))
            self.requests += 1
        return self.points[chars]

    def fixed_tokens(self) -> int:
        """The prompt's tokens with no filler: chat template + nonce."""
        return self._measure(0)

    def chars_for(self, target: int) -> tuple[int, int]:
        """(filler chars, prompt tokens): the tokens equal ``target`` unless no length gives it."""
        base = self.fixed_tokens()
        if target <= base:
            raise BenchError(f"a {target}-token prompt is impossible: the chat template and the nonce "
                             f"alone take {base} tokens")
        for _ in range(MAX_PROBES):
            hits = [c for c, n in self.points.items() if n == target]
            if hits:
                return min(hits), target
            lo = max(c for c, n in self.points.items() if n < target)
            above = [c for c, n in self.points.items() if n > target and c > lo]
            if above:
                hi = min(above)
                if hi - lo <= 1:
                    break  # the count jumps over the target between two adjacent lengths
                n_lo, n_hi = self.points[lo], self.points[hi]
                guess = lo + round((target - n_lo) * (hi - lo) / (n_hi - n_lo))
                if n_hi - n_lo <= 4:  # close: bisect, which cannot stall at one end
                    guess = (lo + hi) // 2
                guess = min(max(guess, lo + 1), hi - 1)
            else:
                n_lo = self.points[lo]
                chars_per_token = lo / (n_lo - base) if n_lo > base else 4.0
                guess = lo + max(1, round((target - n_lo) * chars_per_token))
            self._measure(guess)
        best = min(self.points, key=lambda c: (abs(self.points[c] - target), c))
        self.progress(f"  no filler length gives exactly {target} tokens; closest: {self.points[best]}")
        return best, self.points[best]


class ChatPrompts:
    """Chat API prompts of (calibrated) sizes: a fresh decimal nonce, then the filler text."""

    def __init__(self, client: Client, progress: Callable[[str], None]):
        self.sizer = PromptSizer(client, progress)
        self.progress = progress
        self._chars: dict[int, int] = {}

    def make(self, n_tokens: int) -> str:
        if n_tokens not in self._chars:
            t0 = time.perf_counter()
            self._chars[n_tokens], _ = self.sizer.chars_for(n_tokens)
            self.progress(f"{n_tokens} tokens: filler of {self._chars[n_tokens]} chars ({self.sizer.requests} "
                          f"calibration requests so far, {time.perf_counter() - t0:.1f} s)")
        return prompt_text(new_nonce(), self._chars[n_tokens])


def run_bench(base_url: str = DEFAULT_BASE_URL, api_key: str | None = None, model: str | None = None,
              prompt_tokens: Sequence[int] = DEFAULT_PROMPT_TOKENS, repeats: int = 3, decode_tokens: int = 256,
              decode_prompt_tokens: int | None = None, timeout: float = 600.0, command: str | None = None,
              progress: Callable[[str], None] = lambda _: None, api: str = "completions",
              concurrency: int | None = None, concurrency_prompt_tokens: int = DEFAULT_CONCURRENCY_PROMPT_TOKENS,
              concurrency_rounds: int = 1, concurrency_only: bool = False, reference: str = "auto",
              length_step: int = 0) -> dict:
    """Measure TTFT per prompt size, decode speed and (with ``concurrency``) throughput; returns the result record.
    ``length_step``: run i of a size has i · length_step more tokens (0: all runs of a size have its length)."""
    if api not in APIS:
        raise BenchError(f"unknown API {api!r}: use one of {', '.join(APIS)}")
    if decode_tokens < 2:
        raise BenchError("--decode-tokens must be at least 2 (ms/token is measured between tokens)")
    if concurrency_only and not concurrency:
        raise BenchError("--concurrency-only needs --concurrency N")
    if length_step < 0:
        raise BenchError(f"--length-step must be >= 0, got {length_step}")
    if reference not in ("auto", "none", *REFERENCE):
        raise BenchError(f"unknown reference {reference!r}: use auto, none or one of {', '.join(REFERENCE)}")
    decode_prompt_tokens = decode_prompt_tokens or min(prompt_tokens)
    client = Client(base_url, api_key, timeout)
    try:
        return _measure_all(client, base_url, model, list(prompt_tokens), repeats, decode_tokens,
                            decode_prompt_tokens, command, progress, api, concurrency, concurrency_prompt_tokens,
                            concurrency_rounds, concurrency_only, reference, length_step)
    except _httpx().HTTPError as exc:  # refused connection, timeout, broken stream
        raise BenchError(f"{base_url}: {type(exc).__name__}: {exc}") from exc
    finally:
        client.close()


def _measure_all(client: Client, base_url: str, model: str | None, prompt_tokens: list[int], repeats: int,
                 decode_tokens: int, decode_prompt_tokens: int, command: str | None, progress: Callable[[str], None],
                 api: str, concurrency: int | None, concurrency_prompt_tokens: int, concurrency_rounds: int,
                 concurrency_only: bool, reference: str, length_step: int = 0) -> dict:
    card = client.pick_model(model)
    max_len = card.get("max_model_len")
    shapes = [] if concurrency_only else [*((s, 1) for s in prompt_tokens), (decode_prompt_tokens, decode_tokens)]
    if concurrency:
        shapes.append((concurrency_prompt_tokens, decode_tokens))
    shapes += [(s + (repeats - 1) * length_step, 1) for s in ([] if concurrency_only else prompt_tokens)]
    for size, new in shapes:
        if max_len and size + new > max_len:
            raise BenchError(f"a {size}-token prompt + {new} new tokens exceeds the server's context "
                             f"({max_len} tokens)")
    notes: list[str] = []
    api_info: dict[str, Any] = {"api": api}
    prompts: IdPrompts | ChatPrompts
    if api == "completions":
        vocab, how = client.vocab_size(card)
        prompts = IdPrompts(vocab)
        api_info.update(vocab_size=vocab, vocab_size_from=how, token_id_range=[prompts.lo, prompts.hi],
                        nonce_ids=NONCE_IDS)
        progress(f"token-id prompts on /v1/completions: vocabulary of {vocab} ids ({how}), "
                 f"ids drawn from [{prompts.lo}, {prompts.hi})")
    else:
        prompts = ChatPrompts(client, progress)
        fixed = prompts.sizer.fixed_tokens()
        text = prompt_text(prompts.sizer.nonce, 0)
        try:
            template = fixed - client.count_text_tokens(text)
        except BenchError as exc:
            template = None
            notes.append(f"could not count the chat template's tokens through /v1/completions: {exc}")
        api_info.update(nonce_digits=NONCE_DIGITS, chat_template_tokens=template, fixed_tokens=fixed)
        progress(f"chat prompts on /v1/chat/completions: the template adds {template} tokens around the text; "
                 f"template + nonce = {fixed} tokens")

    ttft: list[dict] = []
    decode: dict | None = None
    if not concurrency_only:
        for target in prompt_tokens:
            # with a length step each run is a length the server has not seen (as real prompts are): a server
            # that builds something per length pays it in every run, not only the first
            lengths = [target + i * length_step for i in range(repeats)]
            runs = [client.stream(prompts.make(n), max_tokens=1) for n in lengths]
            row = {
                "target_prompt_tokens": target,
                "prompt_tokens": [r.prompt_tokens for r in runs],
                "prompt_tokens_miss": max(abs(r.prompt_tokens - n) for r, n in zip(runs, lengths)),
                "ttft_ms": [round(r.ttft_s * 1e3, 3) for r in runs],
                "ttft_median_ms": round(statistics.median(r.ttft_s for r in runs) * 1e3, 3),
                "cached_tokens": [r.cached_tokens for r in runs],
            }
            ttft.append(row)
            progress(f"{target} tokens: TTFT median {row['ttft_median_ms']:.1f} ms  runs {row['ttft_ms']}  "
                     f"cached {row['cached_tokens']}")
            if row["prompt_tokens_miss"]:
                notes.append(f"{lengths}-token prompts came out as {row['prompt_tokens']} tokens")
            if any(row["cached_tokens"]):
                notes.append(f"{target}-token prompts had cached tokens {row['cached_tokens']} "
                             "(does the server ignore cache_salt?)")
        decode = _decode(client, prompts, decode_tokens, decode_prompt_tokens, notes, progress)

    conc = None
    if concurrency:
        conc = run_concurrency(client, prompts, concurrency, concurrency_prompt_tokens, decode_tokens,
                               concurrency_rounds, notes, progress)
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "base_url": base_url,
        "server_model": client.model,
        "server_info": card.get("info"),
        "max_model_len": max_len,
        "api": api,
        "settings": {"api": api, "prompt_tokens": list(prompt_tokens), "repeats": repeats,
                     "decode_tokens": decode_tokens, "decode_prompt_tokens": decode_prompt_tokens,
                     "nonce_digits": NONCE_DIGITS, "concurrency": concurrency,
                     "concurrency_prompt_tokens": concurrency_prompt_tokens if concurrency else None,
                     "concurrency_rounds": concurrency_rounds if concurrency else None,
                     "concurrency_only": concurrency_only, "length_step": length_step},
        "prompts": api_info,
        "calibration_requests": prompts.sizer.requests if isinstance(prompts, ChatPrompts) else 0,
        "ttft": ttft,
        "decode": decode,
        "concurrency": conc,
        "notes": notes,
    }
    ref = reference_name(reference, client.model, card)
    result["reference"] = compare_with_reference(result, ref) if ref else None
    return result


def _decode(client: Client, prompts: IdPrompts | ChatPrompts, decode_tokens: int, decode_prompt_tokens: int,
            notes: list[str], progress: Callable[[str], None]) -> dict:
    progress(f"decode: {decode_tokens} tokens after a {decode_prompt_tokens}-token prompt (one warm-up first)")
    client.stream(prompts.make(decode_prompt_tokens), max_tokens=decode_tokens, ignore_eos=True)
    run = client.stream(prompts.make(decode_prompt_tokens), max_tokens=decode_tokens, ignore_eos=True)
    if run.completion_tokens < 2:
        raise BenchError(f"the decode request produced {run.completion_tokens} token(s)")
    ms_per_token = run.decode_s * 1e3 / (run.completion_tokens - 1)
    if run.completion_tokens != decode_tokens:
        notes.append(f"the decode request stopped after {run.completion_tokens} of {decode_tokens} tokens "
                     "(does the server honour ignore_eos?)")
    decode = {
        "prompt_tokens": run.prompt_tokens,
        "completion_tokens": run.completion_tokens,
        "ms_per_token": round(ms_per_token, 4),
        "tokens_per_s": round(1e3 / ms_per_token, 2) if ms_per_token > 0 else None,
        "ttft_ms": round(run.ttft_s * 1e3, 3),
        "cached_tokens": run.cached_tokens,
        "content_chunks": run.content_chunks,
    }
    progress(f"  {decode['ms_per_token']:.3f} ms/token ({decode['tokens_per_s']} tokens/s)")
    return decode


# --- concurrency ------------------------------------------------------------------------------

def _in_threads(client: Client, n: int, work: Callable[[Client, int], Any]) -> list[Any]:
    """``work(own_client, i)`` for i in range(n), on n threads released together; results in order."""
    results: list[Any] = [None] * n
    errors: list[Exception] = []
    barrier = threading.Barrier(n)
    clients = [client.clone() for _ in range(n)]

    def thread(i: int) -> None:
        try:
            barrier.wait()
            results[i] = work(clients[i], i)
        except Exception as exc:  # noqa: BLE001  (re-raised below, on the caller's thread)
            errors.append(exc)
            barrier.abort()
        finally:
            clients[i].close()

    threads = [threading.Thread(target=thread, args=(i,), name=f"bench-{i}", daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if real or errors:
        raise (real or errors)[0]
    return results


def run_concurrency(client: Client, prompts: IdPrompts | ChatPrompts, conversations: int, prompt_tokens: int,
                    decode_tokens: int, rounds: int, notes: list[str], progress: Callable[[str], None]) -> dict:
    """``conversations`` streams at once, ``rounds`` requests each; throughput and latency percentiles."""
    bodies = [[prompts.make(prompt_tokens) for _ in range(rounds)] for _ in range(conversations)]
    warm = [prompts.make(prompt_tokens) for _ in range(conversations)]
    progress(f"concurrency: {conversations} conversations x {rounds} round(s) of a {prompt_tokens}-token prompt "
             f"and {decode_tokens} tokens (one warm-up round first)")
    _in_threads(client, conversations, lambda c, i: c.stream(warm[i], max_tokens=2, ignore_eos=True))

    def conversation(c: Client, i: int) -> list[StreamedRun]:
        return [c.stream(p, max_tokens=decode_tokens, ignore_eos=True) for p in bodies[i]]

    runs_by_conv: list[list[StreamedRun]] = _in_threads(client, conversations, conversation)
    runs = [r for conv in runs_by_conv for r in conv]
    start = min(r.sent_at for r in runs)
    end = max(r.last_token_at for r in runs)
    generated = sum(r.completion_tokens for r in runs)
    # steady: every conversation has its first token, none has ended yet
    w0 = max(conv[0].first_token_at for conv in runs_by_conv)
    w1 = min(conv[-1].last_token_at for conv in runs_by_conv)
    steady = None
    if w1 > w0:
        tokens = 0.0
        for r in runs:
            per_chunk = r.completion_tokens / r.content_chunks if r.content_chunks else 0.0
            tokens += per_chunk * sum(1 for t in r.chunk_times if w0 < t <= w1)
        steady = tokens / (w1 - w0)
    else:
        notes.append(f"concurrency: the {conversations} conversations never all ran at once (is the server's "
                     "--max-num-seqs smaller?), so there is no steady window")
    gaps = [b - a for r in runs for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)]
    tpot = [r.decode_s / (r.completion_tokens - 1) for r in runs if r.completion_tokens > 1]
    misses = sorted({r.prompt_tokens for r in runs if r.prompt_tokens != prompt_tokens})
    if misses:
        notes.append(f"concurrency: {prompt_tokens}-token prompts came out as {misses} tokens")
    short = sum(1 for r in runs if r.completion_tokens != decode_tokens)
    if short:
        notes.append(f"concurrency: {short} request(s) stopped before {decode_tokens} tokens")
    result = {
        "conversations": conversations,
        "rounds": rounds,
        "requests": len(runs),
        "prompt_tokens": prompt_tokens,
        "decode_tokens": decode_tokens,
        "generated_tokens": generated,
        "wall_s": round(end - start, 4),
        "output_tokens_per_s": round(generated / (end - start), 2),
        "steady_tokens_per_s": None if steady is None else round(steady, 2),
        "steady_window_s": round(max(0.0, w1 - w0), 4),
        "ttft_ms": summary_ms(r.ttft_s for r in runs),
        "itl_ms": summary_ms(gaps),
        "tpot_ms": summary_ms(tpot),
        "cached_tokens": sum(r.cached_tokens or 0 for r in runs),
    }
    progress(f"  {result['output_tokens_per_s']} tokens/s overall, {result['steady_tokens_per_s']} steady; "
             f"TTFT p50/p90/p99 {_pcts(result['ttft_ms'])} ms; ITL {_pcts(result['itl_ms'])} ms")
    return result


def _pcts(summary: dict) -> str:
    return " / ".join("—" if summary[k] is None else f"{summary[k]:.1f}" for k in ("p50", "p90", "p99"))


# --- reference numbers ------------------------------------------------------------------------

def reference_name(reference: str, model_id: str | None, card: dict) -> str | None:
    """Which REFERENCE entry applies: the one named, or for ``auto`` the one the model's id contains."""
    if reference == "none":
        return None
    if reference != "auto":
        return reference
    normalized = (model_id or "").lower().replace("_", "-").replace(" ", "-")
    return next((name for name in REFERENCE if name in normalized), None)


def compare_with_reference(result: dict, name: str) -> dict:
    ref = REFERENCE[name]
    measured = {row["target_prompt_tokens"]: row["ttft_median_ms"] for row in result["ttft"]}
    _, target_ttft, target_decode = ref["target"]
    rows = []
    for i, size in enumerate(ref["prompt_tokens"]):
        rows.append({
            "prompt_tokens": size,
            "measured_ttft_ms": measured.get(size),
            "target_ttft_ms": target_ttft[i],
            "meets_target": None if size not in measured else measured[size] <= target_ttft[i],
            **{engine: ttft[i] for engine, ttft, _ in ref["engines"]},
        })
    decode = result["decode"]
    ms = decode["ms_per_token"] if decode else None
    out = {
        "model": name,
        "source": ref["source"],
        "engines": [engine for engine, _, _ in ref["engines"]],
        "ttft": rows,
        "decode": {"measured_ms_per_token": ms, "target_ms_per_token": target_decode,
                   "meets_target": None if ms is None else ms <= target_decode,
                   **{engine: d for engine, _, d in ref["engines"]}},
        "concurrency": None,
    }
    conc, goal = result.get("concurrency"), ref.get("concurrency_target")
    if goal:
        same = bool(conc) and conc["conversations"] == goal["conversations"] \
            and conc["prompt_tokens"] == goal["prompt_tokens"]
        got = conc["steady_tokens_per_s"] if same else None
        out["concurrency"] = {**goal, "measured_steady_tokens_per_s": got,
                              "measured_output_tokens_per_s": conc["output_tokens_per_s"] if same else None,
                              "meets_target": None if got is None else got >= goal["tokens_per_s"]}
    return out


# --- report -----------------------------------------------------------------------------------

def markdown(result: dict) -> str:
    """The result as markdown tables: TTFT per prompt size, decode, concurrency, reference."""
    api = result.get("api", "chat")
    prompts = result.get("prompts") or {}
    how = ("token-id prompts on /v1/completions (exact sizes)" if api == "completions" else
           f"chat prompts on /v1/chat/completions (sizes include the chat template's "
           f"{prompts.get('chat_template_tokens')} tokens)")
    lines = [f"`{result['server_model']}` at {result['base_url']}, {result['date']}; API: {api}: {how}"]
    if result["ttft"]:
        lines += ["", "| prompt tokens | TTFT median (ms) | TTFT runs (ms) | cached tokens | API |",
                  "|---:|---:|:---|:---|:---|"]
        for row in result["ttft"]:
            size = str(row["target_prompt_tokens"])
            if row["prompt_tokens_miss"]:
                size += f" (sent {'/'.join(map(str, row['prompt_tokens']))})"
            runs = " / ".join(f"{t:.1f}" for t in row["ttft_ms"])
            cached = "/".join(str(c) for c in row["cached_tokens"])
            lines.append(f"| {size} | {row['ttft_median_ms']:.1f} | {runs} | {cached} | {api} |")
    d = result["decode"]
    if d:
        lines += ["", "| decode | prompt tokens | ms/token | tokens/s |", "|---|---:|---:|---:|",
                  (f"| {d['completion_tokens']} tokens | {d['prompt_tokens']} | {d['ms_per_token']:.2f} | "
                   f"{d['tokens_per_s']} |")]
    c = result.get("concurrency")
    if c:
        steady = "—" if c["steady_tokens_per_s"] is None else f"{c['steady_tokens_per_s']:.1f}"
        lines += ["", ("| conversations | prompt tokens | tokens each | output tokens/s | steady tokens/s | "
                       "TTFT p50/p90/p99 (ms) | ITL p50/p90/p99 (ms) | TPOT p50/p90/p99 (ms) |"),
                  "|---:|---:|---:|---:|---:|---:|---:|---:|",
                  (f"| {c['conversations']} x {c['rounds']} | {c['prompt_tokens']} | {c['decode_tokens']} | "
                   f"{c['output_tokens_per_s']:.1f} | {steady} | {_pcts(c['ttft_ms'])} | {_pcts(c['itl_ms'])} | "
                   f"{_pcts(c['tpot_ms'])} |")]
    ref = result.get("reference")
    if ref:
        lines += ["", *reference_table(ref, api)]
    if result["notes"]:
        lines += ["", *(f"note: {n}" for n in result["notes"])]
    return "\n".join(lines)


def _num(x: float | None, fmt: str = "{:.1f}") -> str:
    return "—" if x is None else fmt.format(x)


def reference_table(ref: dict, api: str) -> list[str]:
    engines = ref["engines"]
    lines = [f"Beside the reference numbers for {ref['model']} (source: {ref['source']}); TTFT in ms:", "",
             f"| prompt tokens | qml measured ({api}) | qml target | {' | '.join(engines)} |",
             "|---:|---:|---:|" + "---:|" * len(engines)]
    for row in ref["ttft"]:
        lines.append(f"| {row['prompt_tokens']} | {_num(row['measured_ttft_ms'])} | ≤{row['target_ttft_ms']:g} | "
                     + " | ".join(f"{row[e]:.1f}" for e in engines) + " |")
    d = ref["decode"]
    lines.append(f"| decode ms/token | {_num(d['measured_ms_per_token'], '{:.2f}')} | ≤{d['target_ms_per_token']:g} | "
                 + " | ".join(f"{d[e]:.2f}" for e in engines) + " |")
    c = ref.get("concurrency")
    if c:
        measured = _num(c["measured_steady_tokens_per_s"])
        if c["measured_output_tokens_per_s"] is not None:
            measured += f" (overall {c['measured_output_tokens_per_s']:.1f})"
        lines.append(f"| tokens/s, {c['conversations']} conversations x {c['prompt_tokens']}-token prompts, steady "
                     f"| {measured} | ≥{c['tokens_per_s']:g} | "
                     + " | ".join("—" for _ in engines) + " |")
    return lines


# --- command line ---------------------------------------------------------------------------

def token_sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of positive integers: {text!r}")
    return sizes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_client_arguments(parser)
    parser.add_argument("--api", choices=APIS, default="completions",
                        help="completions: token-id prompts of exact sizes (default); chat: text prompts in a "
                             "chat message, sized with the chat template included")
    parser.add_argument("--prompt-tokens", type=token_sizes, default=list(DEFAULT_PROMPT_TOKENS),
                        help="prompt sizes for TTFT, as the server counts them "
                             f"(default: {','.join(map(str, DEFAULT_PROMPT_TOKENS))})")
    parser.add_argument("--repeats", type=positive_int, default=3, help="new prompts per size; TTFT is their median "
                                                                        "(default: %(default)s)")
    parser.add_argument("--length-step", type=int, default=0,
                        help="run i of each size gets i times this many more tokens, so that every prompt has a "
                             "length the server has not seen, as real prompts do (default: 0, every run of a size "
                             "the same length)")
    parser.add_argument("--decode-tokens", type=positive_int, default=256,
                        help="tokens generated for the decode measurement, and per concurrency request "
                             "(default: %(default)s)")
    parser.add_argument("--decode-prompt-tokens", type=positive_int,
                        help="prompt size for the decode measurement (default: the smallest --prompt-tokens)")
    parser.add_argument("--concurrency", type=positive_int,
                        help="also measure N conversations streaming at once: aggregate tokens/s, TTFT and "
                             "inter-token latency percentiles")
    parser.add_argument("--concurrency-prompt-tokens", type=positive_int, default=DEFAULT_CONCURRENCY_PROMPT_TOKENS,
                        help="prompt size of each concurrent request (default: %(default)s)")
    parser.add_argument("--concurrency-rounds", type=positive_int, default=1,
                        help="requests each concurrent conversation sends, one after the other (default: %(default)s)")
    parser.add_argument("--concurrency-only", action="store_true",
                        help="skip the single-request TTFT and decode measurements")
    parser.add_argument("--reference", default="auto", choices=("auto", "none", *REFERENCE),
                        help="print the results beside this model's reference numbers (auto: when the model's "
                             "id names one)")
    parser.add_argument("--out", type=Path, help="write the result as JSON to this file")


_FLAGS = ("--base-url", "--model", "--api", "--prompt-tokens", "--repeats", "--length-step", "--decode-tokens",
          "--decode-prompt-tokens", "--concurrency", "--concurrency-prompt-tokens", "--concurrency-rounds",
          "--concurrency-only", "--reference", "--timeout", "--out")


def bench_serve_command(args: argparse.Namespace) -> int:
    try:
        result = run_bench(args.base_url, api_key_from(args), args.model, args.prompt_tokens, args.repeats,
                           args.decode_tokens, args.decode_prompt_tokens, args.timeout,
                           command_line(["qml", "bench", "serve"], args, _FLAGS),
                           progress=lambda msg: print(msg, file=sys.stderr, flush=True), api=args.api,
                           concurrency=args.concurrency, concurrency_prompt_tokens=args.concurrency_prompt_tokens,
                           concurrency_rounds=args.concurrency_rounds, concurrency_only=args.concurrency_only,
                           reference=args.reference, length_step=args.length_step)
    except BenchError as exc:
        print(f"qml bench serve: {exc}", file=sys.stderr)
        return 1
    print(markdown(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.out}", file=sys.stderr)
    return 0
