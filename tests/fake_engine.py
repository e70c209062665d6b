"""A stand-in for qml_runtime.engine.Engine, for server tests.

Byte-level tokenizer (one token per UTF-8 byte, plus BOS), a toy chat template, and
a "model" that always answers with the same reply, one token per output, cut at
max_tokens (with made-up logprobs when asked: the reply's token at -0.5, then the
next byte values at -1, -2, ...). It records what it was asked and whether each request ran to its end
or was closed early (aborted), which is what the disconnect tests check.

Like the real engine it has a queue: with ``max_running`` set, requests beyond it
wait (in arrival order) for a running one to end, and with ``hold`` the running ones
stop before their first token until ``release()``; that is how the overload tests
fill the queue. ``stats()`` and ``set_queue_time_observer()`` follow the contract of
qml_server.metrics.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from qml_runtime.sampling_params import RequestOutput, SamplingParams, TokenLogprob

BOS = 256
VOCAB_SIZE = 257
REPLY = "Hello! I am a fake engine, answering the same words every time."
KV_BYTES_PER_TOKEN = 1024  # what the fake pretends one token of K/V costs


class FakeTemplateError(ValueError):
    """Like qml_runtime.chat_template.ChatTemplateError: a ValueError."""


class FakeTokenizer:
    vocab_size = VOCAB_SIZE

    def __init__(self) -> None:
        self.last_template_kwargs: dict = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([BOS] if add_special_tokens else []) + list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> list[int]:
        # Real templates refuse some conversations; this one wants system turns first.
        for i, m in enumerate(messages):
            if m["role"] in ("system", "developer") and i > 0:
                raise FakeTemplateError("system messages must come before the conversation")
        self.last_template_kwargs = dict(extra)
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""))


@dataclass
class Call:
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str
    tenant: str | None = None
    session: str | None = None
    follow: str | None = None


class FakeEngine:
    def __init__(
        self,
        *,
        reply: str = REPLY,
        context_length: int = 256,
        model_id: str = "fake-model",
        token_delay: float = 0.0,
        first_token_delay: float = 0.0,
        fail_at_start: BaseException | None = None,
        fail_after_tokens: int | None = None,
        max_running: int | None = None,
        hold: bool = False,
    ) -> None:
        self.model_id = model_id
        self.context_length = context_length
        self.tokenizer = FakeTokenizer()
        self.reply_ids = self.tokenizer.encode(reply, add_special_tokens=False)
        self.token_delay = token_delay
        self.first_token_delay = first_token_delay  # stands for a long prefill
        self.fail_at_start = fail_at_start
        self.fail_after_tokens = fail_after_tokens
        self.calls: list[Call] = []
        self.finished: list[str] = []  # ran to their finish_reason
        self.aborted: list[str] = []  # closed or cancelled before that
        self.started = 0
        self.stopped = 0
        self._last_prompt: list[int] = []
        self.max_running = max_running
        self.hold = hold
        self.waiting: list[str] = []  # request ids, in arrival order
        self.running: dict[str, int] = {}  # request id -> tokens it holds in the "KV cache"
        self.prefix_queries = 0
        self.prefix_hits = 0
        self._observe_queue_time: Callable[[float], None] | None = None

    def start(self) -> None:
        self.started += 1

    def shutdown(self) -> None:
        self.stopped += 1

    def info(self) -> dict:
        return {
            "architecture": "fake",
            "parameters": 0,
            "quant_types": [],
            "device": "cpu",
            "context_length": self.context_length,
            "model_path": "/srv/models/fake.gguf",
        }

    def stats(self) -> dict:
        capacity = 4 * self.context_length
        return {
            "num_requests_running": len(self.running),
            "num_requests_waiting": len(self.waiting),
            "kv_cache_usage": min(1.0, sum(self.running.values()) / capacity),
            "prefix_cache_queries": self.prefix_queries,
            "prefix_cache_hits": self.prefix_hits,
            "kv_tier_bytes": {"gpu": len(self._last_prompt) * KV_BYTES_PER_TOKEN},
        }

    def set_queue_time_observer(self, observe: Callable[[float], None] | None) -> None:
        self._observe_queue_time = observe

    def release(self) -> None:
        """Let held requests produce their tokens."""
        self.hold = False

    async def _wait_for_a_slot(self, request_id: str, num_tokens: int) -> None:
        arrived = time.monotonic()
        self.waiting.append(request_id)
        # Polling keeps the fake free of loop-bound primitives: tests drive it from several loops.
        while self.waiting[0] != request_id or (
            self.max_running is not None and len(self.running) >= self.max_running
        ):
            await asyncio.sleep(0.001)
        self.waiting.remove(request_id)
        self.running[request_id] = num_tokens
        if self._observe_queue_time is not None:
            self._observe_queue_time(time.monotonic() - arrived)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, tenant: str | None = None,
        session: str | None = None, follow: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        self.calls.append(Call(list(prompt_ids), params, request_id, tenant, session, follow))
        # Imitates prefix caching: tokens shared with the previous prompt count as cached.
        cached = _common_prefix(self._last_prompt, prompt_ids)
        self._last_prompt = list(prompt_ids)
        self.prefix_queries += len(prompt_ids)
        self.prefix_hits += cached
        done = False
        try:
            await self._wait_for_a_slot(request_id, len(prompt_ids))
            if self.fail_at_start is not None:
                raise self.fail_at_start
            while self.hold:
                await asyncio.sleep(0.001)
            await asyncio.sleep(self.first_token_delay)
            budget = min(params.max_tokens, self.context_length - len(prompt_ids))
            for produced, token in enumerate(self.reply_ids[:budget], start=1):
                if self.fail_after_tokens is not None and produced > self.fail_after_tokens:
                    raise RuntimeError("fake engine failure")
                if produced > 1:
                    await asyncio.sleep(self.token_delay)
                finish = None
                if produced == len(self.reply_ids):
                    finish = "stop"
                elif produced == budget:
                    finish = "length"
                done = finish is not None  # set before the yield: the consumer closes us right after
                yield RequestOutput(
                    request_id,
                    self.tokenizer.decode([token]),
                    [token],
                    finish,
                    prompt_tokens=len(prompt_ids),
                    completion_tokens=produced,
                    cached_tokens=cached,
                    logprobs=None if params.logprobs is None else [fake_logprob(token, params.logprobs)],
                )
                if done:
                    return
        finally:
            # A real engine aborts here: GeneratorExit (aclose) or CancelledError both land in this finally.
            (self.finished if done else self.aborted).append(request_id)
            if request_id in self.waiting:
                self.waiting.remove(request_id)
            self.running.pop(request_id, None)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def fake_logprob(token: int, k: int) -> TokenLogprob:
    return TokenLogprob(token, -0.5, tuple([(token, -0.5)] + [((token + j) % 256, -float(j)) for j in range(1, k)]))
