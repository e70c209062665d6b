"""What `qml bench serve` and `qml bench sessions` share: the timed HTTP client, prompts, statistics.

httpx is used directly (not the openai client) so that nothing sits between the socket and
the clock. Prompts come in two kinds:

* token ids for ``/v1/completions`` (``IdPrompts``): the server counts exactly the ids it is
  sent, so a prompt size is hit exactly with no calibration. The ids must lie inside the
  server's vocabulary, which ``/v1/models`` does not state; it is learned once from the
  server (see ``vocab_size``) and ids are drawn from its middle (``safe_id_range``), away from
  the byte and control tokens at the start and the special tokens most vocabularies append
  at the end;
* text for the chat API (``filler_text``, ``new_nonce``), sized by calibration (``PromptSizer``
  in ``qml_server.bench``).

Both open with a random nonce, and every measured request carries a fresh ``cache_salt``,
so no page of a prefix cache can be shared with an earlier request.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import re
import secrets
import shlex
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from qml_server.auth import keys_from_env

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
NONCE_DIGITS = 12  # text nonce: decimal digits, which every common tokenizer cuts the same way
NONCE_IDS = 4  # token-id nonce: random ids from the safe range (~10^16 choices for a 128K vocabulary)
MAX_VOCAB_PROBES = 40
FILLER_SEED = 20240723

# the filler's words: common English, so BPE tokenizers cut it as they cut prose
_FILLER_WORDS = ("the model reads every token of a long prompt before it answers and the cache keeps "
                 "pages of keys and values for later turns while a scheduler batches requests from many "
                 "users under one budget of memory time tokens kernels attention layers weights numbers "
                 "river mountain window garden letter station winter summer history science music paper "
                 "quickly slowly carefully often never always because although whenever between during "
                 "seventeen thousand yellow purple ancient modern simple complex careful honest")


class BenchError(RuntimeError):
    """The server refused or broke a request, or a target cannot be met."""


# --- prompts ----------------------------------------------------------------------------------

_filler_cache: list[str] = [""]


def filler_text(n_chars: int, offset: int = 0) -> str:
    """``n_chars`` characters of a fixed pseudo-English text, from ``offset`` (the same for every prompt)."""
    need = offset + n_chars
    if len(_filler_cache[0]) < need:
        rng = random.Random(FILLER_SEED)
        vocabulary = _FILLER_WORDS.split()
        words: list[str] = []
        length = 0
        target = max(need, 2 * len(_filler_cache[0]), 4096)
        while length <= target:  # the joined text is one separator shorter than `length`
            words.append(rng.choice(vocabulary))
            length += len(words[-1]) + 1
        _filler_cache[0] = " ".join(words)
    return _filler_cache[0][offset:need]


def new_nonce() -> str:
    return "".join(secrets.choice("0123456789") for _ in range(NONCE_DIGITS))


def prompt_text(nonce: str, filler_chars: int) -> str:
    return f"{nonce}\n{filler_text(filler_chars)}"


def safe_id_range(vocab_size: int) -> tuple[int, int]:
    """[lo, hi): the middle of the vocabulary, clear of byte/control tokens and trailing special tokens."""
    lo, hi = vocab_size // 16, vocab_size - vocab_size // 16
    if hi - lo < 2:
        raise BenchError(f"a vocabulary of {vocab_size} ids is too small for token-id prompts")
    return lo, hi


class IdPrompts:
    """Token-id prompts of exact sizes: a random nonce of ``NONCE_IDS`` ids, then a fixed filler."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.lo, self.hi = safe_id_range(vocab_size)
        self._filler: list[int] = []
        self._rng = random.Random(FILLER_SEED)
        self._nonce_rng = random.SystemRandom()

    def make(self, n_tokens: int) -> list[int]:
        nonce = [self._nonce_rng.randrange(self.lo, self.hi) for _ in range(min(NONCE_IDS, n_tokens))]
        rest = n_tokens - len(nonce)
        while len(self._filler) < rest:
            self._filler.append(self._rng.randrange(self.lo, self.hi))
        return nonce + self._filler[:rest]


# --- the client -------------------------------------------------------------------------------

@dataclass
class StreamedRun:
    ttft_s: float  # request sent -> first token's chunk
    decode_s: float  # first token's chunk -> last token's chunk
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None
    content_chunks: int
    sent_at: float = 0.0  # perf_counter() when the request went out
    chunk_times: list[float] = field(default_factory=list)  # perf_counter() of every chunk that carried text
    text: str = ""

    @property
    def first_token_at(self) -> float:
        return self.sent_at + self.ttft_s

    @property
    def last_token_at(self) -> float:
        return self.sent_at + self.ttft_s + self.decode_s


def _httpx() -> Any:
    try:
        import httpx
    except ImportError:
        raise BenchError("qml bench needs httpx: pip install httpx") from None
    return httpx


def check(response: Any) -> None:
    if response.status_code == 200:
        return
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:500]
    raise BenchError(f"{response.request.method} {response.request.url} -> HTTP {response.status_code}: {message}")


def error_message(response: Any) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:500]


def metrics_url_for(base_url: str) -> str:
    """``http://host:port/metrics`` for an API root ``http://host:port/v1``."""
    root = base_url.rstrip("/")
    return root.removesuffix("/v1") + "/metrics"


class Client:
    """The few requests the benches make, timed at the socket. One per thread."""

    def __init__(self, base_url: str, api_key: str | None, timeout: float, model: str | None = None,
                 metrics_url: str | None = None):
        httpx = _httpx()
        self.base_url, self.api_key, self.timeout = base_url, api_key, timeout
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url.rstrip("/") + "/", headers=headers, timeout=timeout)
        self.model = model
        self.metrics_url = metrics_url or metrics_url_for(base_url)

    def clone(self) -> Client:
        """A client of its own (own connection) for another thread."""
        return Client(self.base_url, self.api_key, self.timeout, self.model, self.metrics_url)

    def close(self) -> None:
        self.http.close()

    def models(self) -> list[dict]:
        r = self.http.get("models")
        check(r)
        return r.json()["data"]

    def pick_model(self, model: str | None) -> dict:
        """The card of ``model`` (default: the first listed); sets ``self.model``."""
        cards = self.models()
        if not cards:
            raise BenchError("the server lists no models")
        card = next((c for c in cards if c["id"] == model), None) if model else cards[0]
        self.model = model or card["id"]
        return card or {}

    # -- bodies --

    def chat_body(self, messages: str | list[dict], max_tokens: int, **extra: Any) -> dict:
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        return {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}

    def completion_body(self, prompt: str | list[int], max_tokens: int, **extra: Any) -> dict:
        return {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}

    def body(self, prompt: str | list[int] | list[dict], max_tokens: int, **extra: Any) -> tuple[str, dict]:
        """(path, body): token ids or a plain string go to /completions, messages or chat text to /chat."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return "completions", self.completion_body(prompt, max_tokens, **extra)
        return "chat/completions", self.chat_body(prompt, max_tokens, **extra)  # type: ignore[arg-type]

    # -- requests --

    def prompt_tokens(self, path: str, body: dict) -> int:
        r = self.http.post(path, json=body)
        check(r)
        return int(r.json()["usage"]["prompt_tokens"])

    def count_chat_tokens(self, content: str | list[dict]) -> int:
        return self.prompt_tokens("chat/completions", self.chat_body(content, 1, cache_salt=uuid.uuid4().hex))

    def count_text_tokens(self, text: str) -> int:
        """The prompt tokens /v1/completions counts for ``text`` (a BOS included where the tokenizer adds one)."""
        return self.prompt_tokens("completions", self.completion_body(text, 1, cache_salt=uuid.uuid4().hex))

    def stream(self, prompt: str | list[int] | list[dict], max_tokens: int, ignore_eos: bool = False,
               cache_salt: str | None = None, headers: dict | None = None) -> StreamedRun:
        """One streamed request, timed; ``cache_salt`` defaults to a fresh one (nothing shared)."""
        path, body = self.body(prompt, max_tokens, stream=True, stream_options={"include_usage": True},
                               cache_salt=cache_salt or uuid.uuid4().hex)
        if ignore_eos:
            body["ignore_eos"] = True
        first = last = None
        times: list[float] = []
        parts: list[str] = []
        usage = None
        request = self.http.build_request("POST", path, json=body, headers=headers)  # encoded before the clock
        t0 = time.perf_counter()
        with contextlib.closing(self.http.send(request, stream=True)) as r:
            if r.status_code != 200:
                r.read()
                check(r)
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
                    text = choice.get("text")
                    if text is None:
                        text = (choice.get("delta") or {}).get("content")
                    if text or choice.get("finish_reason"):
                        first = now if first is None else first
                        last = now
                    if text:
                        times.append(now)
                        parts.append(text)
        if first is None or last is None:
            raise BenchError("the stream ended without a token")
        if not usage:
            raise BenchError("the server sent no usage chunk (stream_options.include_usage)")
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        return StreamedRun(first - t0, last - first, int(usage["prompt_tokens"]), int(usage["completion_tokens"]),
                           None if cached is None else int(cached), len(times), t0, times, "".join(parts))

    def accepts_token_id(self, token: int) -> tuple[bool, str]:
        r = self.http.post("completions", json=self.completion_body([token], 1, cache_salt=uuid.uuid4().hex))
        if r.status_code == 200:
            return True, ""
        if r.status_code in (400, 422):
            return False, error_message(r)
        check(r)
        return False, ""

    def vocab_size(self, card: dict) -> tuple[int, str]:
        """(the number of token ids the server accepts, how it was learned).

        From the model card if it says (``info.vocab_size``); else from the message refusing an
        id far out of range when it names the range (qml: ``[0, V)``), checked with two probes;
        else by bisection over one-token prompts (``max_tokens=1``).
        """
        stated = (card.get("info") or {}).get("vocab_size") or card.get("vocab_size")
        if isinstance(stated, int) and stated > 0:
            return stated, "model card"
        ok, message = self.accepts_token_id(2**31 - 1)
        if ok:
            raise BenchError("the server accepted token id 2^31-1: it does not check ids against its vocabulary")
        match = re.search(r"\[0,\s*(\d+)\)", message)
        if match:
            v = int(match.group(1))
            if v > 0 and self.accepts_token_id(v - 1)[0] and not self.accepts_token_id(v)[0]:
                return v, "error message"
        if not self.accepts_token_id(0)[0]:
            raise BenchError(f"the server refused the token-id prompt [0]: {message}")
        lo, hi = 0, 256  # lo accepted; hi doubles until refused, then bisection
        for _ in range(MAX_VOCAB_PROBES):
            if self.accepts_token_id(hi)[0]:
                lo, hi = hi, hi * 2
                continue
            break
        for _ in range(MAX_VOCAB_PROBES):
            if hi - lo <= 1:
                return hi, "bisection"
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.accepts_token_id(mid)[0] else (lo, mid)
        raise BenchError("could not find the vocabulary size by bisection")

    def scrape_metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
        """The server's /metrics as {(name, sorted labels): value}, or None if it has none."""
        try:
            r = self.http.get(self.metrics_url)
        except _httpx().HTTPError:
            return None
        if r.status_code != 200:
            return None
        return parse_metrics(r.text)


_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        labels = tuple(sorted(_LABEL.findall(m.group(2) or "")))
        out[(m.group(1), labels)] = value
    return out


def metric_sum(metrics: dict | None, name: str, **labels: str) -> float | None:
    """Sum of the samples named ``name`` whose labels include ``labels``; None without metrics."""
    if metrics is None:
        return None
    total = 0.0
    for (n, ls), v in metrics.items():
        if n == name and all((k, val) in ls for k, val in labels.items()):
            total += v
    return total


# --- statistics -------------------------------------------------------------------------------

def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default)."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summary_ms(seconds: Iterable[float]) -> dict[str, float | int | None]:
    """p50/p90/p99/mean/max in ms (3 decimals) of durations in seconds, and their count."""
    ms = [s * 1e3 for s in seconds]

    def r(x: float | None) -> float | None:
        return None if x is None else round(x, 3)

    return {"n": len(ms), "p50": r(percentile(ms, 50)), "p90": r(percentile(ms, 90)), "p99": r(percentile(ms, 99)),
            "mean": r(sum(ms) / len(ms)) if ms else None, "max": r(max(ms)) if ms else None}


# --- command lines ----------------------------------------------------------------------------

def api_key_from(args: argparse.Namespace) -> str | None:
    return args.api_key or next(iter(keys_from_env(os.environ.get("QML_API_KEY"))), None)


def add_client_arguments(parser: argparse.ArgumentParser) -> None:
    from qml_server.cli import positive_float

    parser.add_argument("--base-url", default=DEFAULT_BASE_URL,
                        help="the server's OpenAI API root (default: %(default)s)")
    parser.add_argument("--api-key", help="bearer key (default: the first key in QML_API_KEY, if set)")
    parser.add_argument("--model", help="model to request (default: the first of /v1/models)")
    parser.add_argument("--timeout", type=positive_float, default=600.0,
                        help="seconds one request may take (default: %(default)s)")


def command_line(words: Sequence[str], args: argparse.Namespace, flags: Sequence[str]) -> str:
    """The run's full command line, defaults included, with the key redacted."""
    argv = list(words)
    for flag in flags:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            argv += [flag, ",".join(map(str, value))]
        else:
            argv += [flag, str(value)]
    if args.api_key:
        argv += ["--api-key", "REDACTED"]
    return shlex.join(argv)
