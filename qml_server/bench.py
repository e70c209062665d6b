"""`qml bench serve`: time to first token and decode speed of a running server, over the OpenAI chat API.

Every measured prompt is new. A prefix cache (ours, vLLM's, SGLang's radix tree) names a KV
page by its tokens *and everything before them* (a chained hash), so a prompt whose first
message opens with a random nonce shares no page with any earlier prompt past that point,
even when the rest of its text is identical: its whole prefill is computed, which is what a
TTFT for N new tokens means. The chat template's fixed header, rendered before the first
message, could still be shared (Llama 3.1's system block, SmolLM2's default system prompt), so
every measured request also carries a fresh ``cache_salt``, which qml (like vLLM) folds into its
page names: nothing at all is reused. The bench records the ``cached_tokens`` the server gives
for every run, so a server that ignores the salt cannot hide it.

Prompt sizes are counted the way the server counts them (``usage.prompt_tokens``, chat
template included): the filler text after the nonce is cut to the length that makes the count
hit the target exactly, found with ``max_tokens=1`` requests that all share one calibration
nonce (so they prefill little after the first) and never the measured runs' nonces. The nonce
is a fixed number of decimal digits, which every common tokenizer splits into a fixed number
of tokens, so a calibrated length holds for the fresh nonces too; each run's own count is
recorded and any miss reported.

TTFT: from sending a streamed request (``max_tokens=1``) to the first chunk carrying a token
(content, or the finish chunk if the token decoded to no text); median of ``--repeats`` runs.
Decode: one streamed request of ``--decode-tokens`` tokens with ``ignore_eos``, after one
unmeasured warm-up of the same shape; ms/token = (last token's arrival - first token's
arrival) / (tokens - 1), tokens counted by ``usage`` (``stream_options.include_usage``).

httpx is used directly (not the openai client) so that nothing sits between the socket and
the clock.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import secrets
import shlex
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qml_server.auth import keys_from_env
from qml_server.cli import positive_float, positive_int

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
DEFAULT_PROMPT_TOKENS = (133, 598, 2340, 8892, 26926)
NONCE_DIGITS = 12
MAX_PROBES = 24  # calibration requests per prompt size before settling for the closest count

# the filler's words: common English, so BPE tokenizers cut it as they cut prose
_FILLER_WORDS = ("the model reads every token of a long prompt before it answers and the cache keeps "
          "pages of keys and values for later turns while a scheduler batches requests from many "
          "users under one budget of memory time tokens kernels attention layers weights numbers "
          "river mountain window garden letter station winter summer history science music paper "
          "quickly slowly carefully often never always because although whenever between during "
          "seventeen thousand yellow purple ancient modern simple complex careful honest")


class BenchError(RuntimeError):
    """The server refused or broke a request, or a target cannot be met."""


@dataclass
class StreamedRun:
    ttft_s: float  # request sent -> first token's chunk
    decode_s: float  # first token's chunk -> last token's chunk
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None
    content_chunks: int


def filler_text(n_chars: int) -> str:
    """The first ``n_chars`` characters of a fixed pseudo-English text (the same for every prompt)."""
    rng = random.Random(20240723)
    vocabulary = _FILLER_WORDS.split()
    words: list[str] = []
    length = 0
    while length <= n_chars:  # the joined text is one separator shorter than `length`
        words.append(rng.choice(vocabulary))
        length += len(words[-1]) + 1
    return " ".join(words)[:n_chars]


def new_nonce() -> str:
    return "".join(secrets.choice("0123456789") for _ in range(NONCE_DIGITS))


def prompt_text(nonce: str, filler_chars: int) -> str:
    return f"{nonce}\n{filler_text(filler_chars)}"


class ChatClient:
    """The few requests the bench makes, timed at the socket."""

    def __init__(self, base_url: str, api_key: str | None, timeout: float):
        httpx = _httpx()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url.rstrip("/") + "/", headers=headers, timeout=timeout)
        self.model: str | None = None

    def close(self) -> None:
        self.http.close()

    def models(self) -> list[dict]:
        r = self.http.get("models")
        _check(r)
        return r.json()["data"]

    def _body(self, content: str, max_tokens: int, **extra: Any) -> dict:
        return {"model": self.model, "messages": [{"role": "user", "content": content}],
                "max_tokens": max_tokens, "temperature": 0, **extra}

    def count_prompt_tokens(self, content: str) -> int:
        r = self.http.post("chat/completions", json=self._body(content, 1))
        _check(r)
        return int(r.json()["usage"]["prompt_tokens"])

    def stream(self, content: str, max_tokens: int, ignore_eos: bool = False) -> StreamedRun:
        body = self._body(content, max_tokens, stream=True, stream_options={"include_usage": True},
                          cache_salt=uuid.uuid4().hex)
        if ignore_eos:
            body["ignore_eos"] = True
        first = last = None
        chunks = 0
        usage = None
        request = self.http.build_request("POST", "chat/completions", json=body)  # encoded before the clock starts
        t0 = time.perf_counter()
        with contextlib.closing(self.http.send(request, stream=True)) as r:
            if r.status_code != 200:
                r.read()
                _check(r)
            for line in r.iter_lines():
                now = time.perf_counter()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    raise BenchError(f"the server failed mid-stream: {event['error'].get('message')}")
                usage = event.get("usage") or usage
                for choice in event.get("choices") or ():
                    content_delta = (choice.get("delta") or {}).get("content")
                    if content_delta or choice.get("finish_reason"):
                        first = now if first is None else first
                        last = now
                        chunks += bool(content_delta)
        if first is None or last is None:
            raise BenchError("the stream ended without a token")
        if not usage:
            raise BenchError("the server sent no usage chunk (stream_options.include_usage)")
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        return StreamedRun(first - t0, last - first, int(usage["prompt_tokens"]), int(usage["completion_tokens"]),
                           None if cached is None else int(cached), chunks)


def _httpx() -> Any:
    try:
        import httpx
    except ImportError:
        raise BenchError("qml bench needs httpx: pip install httpx") from None
    return httpx


def _check(response: Any) -> None:
    if response.status_code == 200:
        return
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:500]
    raise BenchError(f"{response.request.method} {response.request.url} -> HTTP {response.status_code}: {message}")


class PromptSizer:
    """Finds, per target, the filler length whose prompt the server counts as exactly that many tokens.

    All probes use one calibration nonce of the same length as the measured ones, and every
    (filler length, tokens) point is kept: later targets start from what earlier ones learned.
    """

    def __init__(self, client: ChatClient, progress: Callable[[str], None]):
        self.client, self.progress = client, progress
        self.nonce = new_nonce()
        self.points: dict[int, int] = {}  # filler chars -> prompt tokens
        self.requests = 0

    def _measure(self, chars: int) -> int:
        if chars not in self.points:
            self.points[chars] = self.client.count_prompt_tokens(prompt_text(self.nonce, chars))
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


def run_bench(base_url: str = DEFAULT_BASE_URL, api_key: str | None = None, model: str | None = None,
              prompt_tokens: Sequence[int] = DEFAULT_PROMPT_TOKENS, repeats: int = 3, decode_tokens: int = 256,
              decode_prompt_tokens: int | None = None, timeout: float = 600.0, command: str | None = None,
              progress: Callable[[str], None] = lambda _: None) -> dict:
    """Measure TTFT per prompt size and decode speed on a running server; returns the result record."""
    if decode_tokens < 2:
        raise BenchError("--decode-tokens must be at least 2 (ms/token is measured between tokens)")
    decode_prompt_tokens = decode_prompt_tokens or min(prompt_tokens)
    client = ChatClient(base_url, api_key, timeout)
    try:
        return _measure_all(client, base_url, model, prompt_tokens, repeats, decode_tokens, decode_prompt_tokens,
                            command, progress)
    except _httpx().HTTPError as exc:  # refused connection, timeout, broken stream
        raise BenchError(f"{base_url}: {type(exc).__name__}: {exc}") from exc
    finally:
        client.close()


def _measure_all(client: ChatClient, base_url: str, model: str | None, prompt_tokens: Sequence[int], repeats: int,
                 decode_tokens: int, decode_prompt_tokens: int, command: str | None,
                 progress: Callable[[str], None]) -> dict:
    cards = client.models()
    if not cards:
        raise BenchError("the server lists no models")
    card = next((c for c in cards if c["id"] == model), None) if model else cards[0]
    client.model = model or card["id"]
    max_len = (card or {}).get("max_model_len")
    for size, new in [*((s, 1) for s in prompt_tokens), (decode_prompt_tokens, decode_tokens)]:
        if max_len and size + new > max_len:
            raise BenchError(f"a {size}-token prompt + {new} new tokens exceeds the server's context "
                             f"({max_len} tokens)")
    sizer = PromptSizer(client, progress)
    notes: list[str] = []
    ttft = []
    for target in prompt_tokens:
        t_calib = time.perf_counter()
        chars, _ = sizer.chars_for(target)
        progress(f"{target} tokens: filler of {chars} chars ({sizer.requests} calibration requests so far, "
                 f"{time.perf_counter() - t_calib:.1f} s)")
        runs = [client.stream(prompt_text(new_nonce(), chars), max_tokens=1) for _ in range(repeats)]
        row = {
            "target_prompt_tokens": target,
            "prompt_tokens": [r.prompt_tokens for r in runs],
            "prompt_tokens_miss": max(abs(r.prompt_tokens - target) for r in runs),
            "ttft_ms": [round(r.ttft_s * 1e3, 3) for r in runs],
            "ttft_median_ms": round(statistics.median(r.ttft_s for r in runs) * 1e3, 3),
            "cached_tokens": [r.cached_tokens for r in runs],
        }
        ttft.append(row)
        progress(f"  TTFT median {row['ttft_median_ms']:.1f} ms  runs {row['ttft_ms']}  "
                 f"cached {row['cached_tokens']}")
        if row["prompt_tokens_miss"]:
            notes.append(f"{target}-token prompts came out as {row['prompt_tokens']} tokens")
        if any(row["cached_tokens"]):
            notes.append(f"{target}-token prompts had cached tokens {row['cached_tokens']} "
                         "(a chat-template header before the first message is all they can share)")

    chars, _ = sizer.chars_for(decode_prompt_tokens)
    progress(f"decode: {decode_tokens} tokens after a {decode_prompt_tokens}-token prompt (one warm-up first)")
    client.stream(prompt_text(new_nonce(), chars), max_tokens=decode_tokens, ignore_eos=True)
    run = client.stream(prompt_text(new_nonce(), chars), max_tokens=decode_tokens, ignore_eos=True)
    if run.completion_tokens < 2:
        raise BenchError(f"the decode request produced {run.completion_tokens} token(s)")
    ms_per_token = run.decode_s * 1e3 / (run.completion_tokens - 1)
    decode = {
        "prompt_tokens": run.prompt_tokens,
        "completion_tokens": run.completion_tokens,
        "ms_per_token": round(ms_per_token, 4),
        "tokens_per_s": round(1e3 / ms_per_token, 2) if ms_per_token > 0 else None,
        "ttft_ms": round(run.ttft_s * 1e3, 3),
        "cached_tokens": run.cached_tokens,
        "content_chunks": run.content_chunks,
    }
    if run.completion_tokens != decode_tokens:
        notes.append(f"the decode request stopped after {run.completion_tokens} of {decode_tokens} tokens "
                     "(does the server honour ignore_eos?)")
    progress(f"  {decode['ms_per_token']:.3f} ms/token ({decode['tokens_per_s']} tokens/s)")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "base_url": base_url,
        "server_model": client.model,
        "server_info": (card or {}).get("info"),
        "max_model_len": max_len,
        "settings": {"prompt_tokens": list(prompt_tokens), "repeats": repeats, "decode_tokens": decode_tokens,
                     "decode_prompt_tokens": decode_prompt_tokens, "nonce_digits": NONCE_DIGITS},
        "calibration_requests": sizer.requests,
        "ttft": ttft,
        "decode": decode,
        "notes": notes,
    }


def markdown(result: dict) -> str:
    """The result as two markdown tables (TTFT per prompt size, then decode)."""
    lines = [f"`{result['server_model']}` at {result['base_url']}, {result['date']}", "",
             "| prompt tokens | TTFT median (ms) | TTFT runs (ms) | cached tokens |",
             "|---:|---:|:---|:---|"]
    for row in result["ttft"]:
        size = str(row["target_prompt_tokens"])
        if row["prompt_tokens_miss"]:
            size += f" (sent {'/'.join(map(str, row['prompt_tokens']))})"
        runs = " / ".join(f"{t:.1f}" for t in row["ttft_ms"])
        cached = "/".join(str(c) for c in row["cached_tokens"])
        lines.append(f"| {size} | {row['ttft_median_ms']:.1f} | {runs} | {cached} |")
    d = result["decode"]
    decode_row = (f"| {d['completion_tokens']} tokens | {d['prompt_tokens']} | {d['ms_per_token']:.2f} | "
                  f"{d['tokens_per_s']} |")
    lines += ["", "| decode | prompt tokens | ms/token | tokens/s |", "|---|---:|---:|---:|", decode_row]
    if result["notes"]:
        lines += ["", *(f"note: {n}" for n in result["notes"])]
    return "\n".join(lines)


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
    parser.add_argument("--base-url", default=DEFAULT_BASE_URL,
                        help="the server's OpenAI API root (default: %(default)s)")
    parser.add_argument("--api-key", help="bearer key (default: the first key in QML_API_KEY, if set)")
    parser.add_argument("--model", help="model to request (default: the first of /v1/models)")
    parser.add_argument("--prompt-tokens", type=token_sizes, default=list(DEFAULT_PROMPT_TOKENS),
                        help="prompt sizes for TTFT, as the server counts them "
                             f"(default: {','.join(map(str, DEFAULT_PROMPT_TOKENS))})")
    parser.add_argument("--repeats", type=positive_int, default=3, help="new prompts per size; TTFT is their median "
                                                                        "(default: %(default)s)")
    parser.add_argument("--decode-tokens", type=positive_int, default=256,
                        help="tokens generated for the decode measurement (default: %(default)s)")
    parser.add_argument("--decode-prompt-tokens", type=positive_int,
                        help="prompt size for the decode measurement (default: the smallest --prompt-tokens)")
    parser.add_argument("--timeout", type=positive_float, default=600.0,
                        help="seconds one request may take (default: %(default)s)")
    parser.add_argument("--out", type=Path, help="write the result as JSON to this file")


def command_line(args: argparse.Namespace) -> str:
    """The run's full command line, defaults included, with the key redacted."""
    argv = ["qml", "bench", "serve", "--base-url", args.base_url,
            "--prompt-tokens", ",".join(map(str, args.prompt_tokens)), "--repeats", str(args.repeats),
            "--decode-tokens", str(args.decode_tokens), "--timeout", str(args.timeout)]
    for flag, value in (("--model", args.model), ("--decode-prompt-tokens", args.decode_prompt_tokens),
                        ("--out", args.out)):
        if value is not None:
            argv += [flag, str(value)]
    if args.api_key:
        argv += ["--api-key", "REDACTED"]
    return shlex.join(argv)


def bench_serve_command(args: argparse.Namespace) -> int:
    api_key = args.api_key or next(iter(keys_from_env(os.environ.get("QML_API_KEY"))), None)
    try:
        result = run_bench(args.base_url, api_key, args.model, args.prompt_tokens, args.repeats,
                           args.decode_tokens, args.decode_prompt_tokens, args.timeout, command_line(args),
                           progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    except BenchError as exc:
        print(f"qml bench serve: {exc}", file=sys.stderr)
        return 1
    print(markdown(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.out}", file=sys.stderr)
    return 0
