"""The engine: a background loop that schedules, runs and samples, and the request API around it.

Requests enter through ``generate`` (async, for the server) or ``generate_sync``
(for scripts and notebooks). The loop runs on its own thread: each iteration
takes new requests and aborts from an inbox, schedules one batch, runs it, and
hands each request its new text through a callback. Model errors fail the
requests of that batch, never the loop.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import random
import threading
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import torch

from qml_runtime.config import CacheConfig, ModelConfig, SchedulerConfig
from qml_runtime.detokenizer import IncrementalDetokenizer
from qml_runtime.kv.block_manager import BlockManager
from qml_runtime.kv.cache import KVCache
from qml_runtime.runner import ModelRunner
from qml_runtime.sampling_params import InvalidParameter, RequestOutput, SamplingParams
from qml_runtime.scheduler import Scheduler
from qml_runtime.sequence import Sequence, Status

log = logging.getLogger("qml.engine")

Emit = Callable[[RequestOutput | BaseException], None]


@dataclass
class _Add:
    seq: Sequence
    emit: Emit


@dataclass
class _Abort:
    request_id: str


class Engine:
    def __init__(self, model: torch.nn.Module, tokenizer, model_config: ModelConfig, *, model_id: str,
                 device: torch.device, dtype: torch.dtype, cache: CacheConfig, scheduler: SchedulerConfig,
                 context_length: int | None = None, info: dict | None = None, fingerprint: bytes = b""):
        self.model, self.tokenizer, self.model_config = model, tokenizer, model_config
        self.model_id, self.device, self.dtype = model_id, device, dtype
        self.kv = KVCache(model_config, cache.num_blocks, cache.block_size, device, dtype)
        capacity = cache.num_blocks * cache.block_size
        # one request must fit in the pool, or a full-context request could never be admitted
        self.context_length = min(context_length or model_config.context_length, model_config.context_length, capacity)
        if self.context_length < (context_length or model_config.context_length):
            log.warning("context length capped at %d tokens: that is all the KV cache holds", capacity)
        self.blocks = BlockManager(cache.num_blocks, cache.block_size)
        self.scheduler = Scheduler(scheduler, self.blocks, fingerprint, cache.enable_prefix_caching)
        self.runner = ModelRunner(model, self.kv, device)
        self._info = dict(info or {})
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._emitters: dict[str, Emit] = {}
        self._seqs: dict[str, Sequence] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False

    # --- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="qml-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def info(self) -> dict:
        return {**self._info, "context_length": self.context_length,
                "kv_cache_tokens": self.blocks.num_blocks * self.blocks.block_size}

    # --- requests ---------------------------------------------------------------------

    def _new_sequence(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                      tenant: str | None = None) -> Sequence:
        if not prompt_ids:
            raise InvalidParameter("prompt", "the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt_ids):
            raise InvalidParameter("prompt", f"prompt token ids must be integers in [0, {vocab})")
        need = len(prompt_ids) + params.max_tokens
        if need > self.context_length:
            raise InvalidParameter("max_tokens", f"prompt ({len(prompt_ids)} tokens) + max_tokens "
                                   f"({params.max_tokens}) exceeds the context length ({self.context_length})")
        # the sampler takes int64 seeds: fold any Python int into [0, 2^63)
        seed = params.seed % 2**63 if params.seed is not None else random.getrandbits(63)
        detok = IncrementalDetokenizer(self.tokenizer, params.stop)
        salt = tenant.encode() if tenant else b""
        return Sequence(request_id, prompt_ids, params, detok, seed, salt)

    def submit(self, prompt_ids: list[int], params: SamplingParams, emit: Emit,
               request_id: str | None = None, tenant: str | None = None) -> str:
        """Queue a request; ``emit`` is called from the engine thread with each output.

        ``tenant`` (the authenticated API key's id) salts the request's KV page names:
        tenants never share cached pages.
        """
        request_id = request_id or uuid.uuid4().hex
        seq = self._new_sequence(list(prompt_ids), params, request_id, tenant)
        self._inbox.put(_Add(seq, emit))
        self._wakeup.set()
        return request_id

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))
        self._wakeup.set()

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       tenant: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs. Closing the iterator early aborts the request."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        request_id = self.submit(prompt_ids, params, lambda o: loop.call_soon_threadsafe(outputs.put_nowait, o),
                                 request_id, tenant)
        finished = False
        try:
            while True:
                out = await outputs.get()
                if isinstance(out, BaseException):
                    finished = True
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def generate_sync(self, prompt_ids: list[int], params: SamplingParams, tenant: str | None = None) -> RequestOutput:
        """Run one request to completion from a plain thread; returns the whole output."""
        outputs: queue.SimpleQueue = queue.SimpleQueue()
        request_id = self.submit(prompt_ids, params, outputs.put, tenant=tenant)
        total = RequestOutput(request_id)
        while not total.finished:
            out = outputs.get()
            if isinstance(out, BaseException):
                raise out
            total.text += out.text
            total.token_ids += out.token_ids
            total.finish_reason = out.finish_reason
            total.prompt_tokens, total.completion_tokens = out.prompt_tokens, out.completion_tokens
            total.cached_tokens = out.cached_tokens
        return total

    # --- the loop (engine thread) -----------------------------------------------------

    def _loop(self) -> None:
        while not self._stopping:
            self._drain_inbox()
            if not self.scheduler.has_work():
                self._wakeup.wait()
                self._wakeup.clear()
                continue
            batch = self.scheduler.schedule()
            if not batch:
                # nothing running and the head of the queue does not fit: it never will
                seq = self.scheduler.waiting[0]
                self._fail(seq, MemoryError("the KV cache cannot hold this request"))
                continue
            try:
                tokens = self.runner.step(batch)
            except Exception as exc:  # a failed step fails its requests, not the server
                log.exception("engine step failed; failing %d request(s)", len(batch.seqs))
                for seq in batch.seqs:
                    self._fail(seq, exc)
                continue
            for seq in batch.seqs:
                self.scheduler.commit(seq)  # before any finishes: its pages are named, then released
            for seq, token in zip(batch.seqs, tokens):
                if token is None:
                    continue
                try:
                    self._append(seq, token)
                except Exception as exc:
                    log.exception("request %s failed after its step", seq.request_id)
                    self._fail(seq, exc)
        for seq in list(self._seqs.values()):
            self._finish(seq, "abort", "")

    def _drain_inbox(self) -> None:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(msg, _Add):
                self._seqs[msg.seq.request_id] = msg.seq
                self._emitters[msg.seq.request_id] = msg.emit
                self.scheduler.add(msg.seq)
            elif msg.request_id in self._seqs:
                self._finish(self._seqs[msg.request_id], "abort", "")

    def _append(self, seq: Sequence, token: int) -> None:
        seq.token_ids.append(token)
        p = seq.params
        stop_token = token in p.stop_token_ids or (token in self.tokenizer.eos_token_ids and not p.ignore_eos)
        text = "" if stop_token else seq.detokenizer.push(token)
        reason = None
        if stop_token or seq.detokenizer.stopped:
            reason = "stop"
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.context_length:
            reason = "length"
        if reason is None:
            self._emit(seq, RequestOutput(seq.request_id, text, [token]))
        else:
            self._finish(seq, reason, text, [token])

    def _finish(self, seq: Sequence, reason: str, text: str, tokens: list[int] | None = None) -> None:
        if seq.status is not Status.FINISHED:
            self.scheduler.finish(seq, reason)
        if reason != "abort":
            text += seq.detokenizer.flush()
        self._emit(seq, RequestOutput(seq.request_id, text, tokens or [], reason))
        self._seqs.pop(seq.request_id, None)
        self._emitters.pop(seq.request_id, None)

    def _fail(self, seq: Sequence, exc: BaseException) -> None:
        self.scheduler.finish(seq, "error")
        self._send(seq.request_id, exc)
        self._seqs.pop(seq.request_id, None)
        self._emitters.pop(seq.request_id, None)

    def _emit(self, seq: Sequence, out: RequestOutput) -> None:
        out.prompt_tokens = seq.num_prompt_tokens
        out.completion_tokens = seq.num_output_tokens
        out.cached_tokens = seq.num_cached
        self._send(seq.request_id, out)

    def _send(self, request_id: str, payload: RequestOutput | BaseException) -> None:
        emit = self._emitters.get(request_id)
        if emit is not None:
            try:
                emit(payload)
            except RuntimeError:  # the receiving event loop is closed: nobody is listening
                pass
