"""The engine's callers' side: what another thread does to hand it a request (the server's event loop, a script).

A prompt becomes a ``Sequence`` on the caller's thread (its ids checked and packed, its grammar compiled, its
detokenizer made), then goes to the engine thread's inbox; the caller gets its outputs through ``emit``, an async
iterator (``generate``) or a whole ``RequestOutput`` (``generate_sync``). The engine thread's side, which drains
the inbox, is ``qml_runtime.engine``.
"""

from __future__ import annotations

import asyncio
import queue
import random
import threading
import uuid
from array import array
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import numpy as np

from qml_runtime import turn_trace
from qml_runtime.constrained import GrammarError
from qml_runtime.detokenizer import IncrementalDetokenizer
from qml_runtime.kv.prefix import pack
from qml_runtime.sampling_params import InvalidParameter, RequestOutput, SamplingParams
from qml_runtime.sequence import Sequence

Emit = Callable[[RequestOutput | BaseException], None]

# QML_HANDOFF=1 (a GPU's engine): a request submitted to an idle engine from another thread (the server's event
# loop) has its submitter wait, without the GIL, until the request's first step is launched, at most this long.
# Otherwise the submitter goes on with its own work (the handler awaiting its first output) while the engine
# thread schedules and stages the step, and the two share the GIL (``Engine.start`` sets the switch interval).
# The other way round, once such a request's first token is out the engine does not launch a decode step ahead
# before it waits for the one in flight (``Engine._first_token_out``). Off until an A/B on the GPU says (on CPU a
# step's while_running comes after its compute: there the submitter would only wait).
HANDOFF_S = 0.005


@dataclass
class _Add:
    seq: Sequence
    emit: Emit
    follow: str | None = None  # a request whose prompt this one shares: admitted once that one's is cached


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Flush:
    done: threading.Event


def _packed_ids(ids: list | array, vocab: int) -> bytes | None:
    """The ids packed as the prefix cache names them (``kv.prefix.pack``) if every one is an int (bool
    and other subclasses included) in [0, vocab), else None. On the caller's thread, before the
    request reaches the engine: a check per id in Python took ~1.1 ms for a 27k-token conversation
    every turn, this ~0.45 ms (the types as a set, the range on the packed uint32), and the scheduler
    then names the prompt's blocks from these bytes without packing it again (~0.15 ms). A uint32
    ``array("I")`` (the server's chat prompts) holds ints >= 0 by construction: its bytes are taken as
    they are (~0.01 ms for 27k ids) and only the range is checked."""
    if isinstance(ids, array) and ids.typecode == "I":
        packed = ids.tobytes()
    else:
        if not all(issubclass(t, int) for t in set(map(type, ids))):
            return None
        try:
            packed = pack(ids)
        except OverflowError:  # negative, or past 2^32: outside any vocabulary
            return None
    return packed if not ids or int(np.frombuffer(packed, dtype=np.uint32).max()) < vocab else None


class Requests:
    """``Engine``'s request API (a mixin: the engine's state is its own)."""

    def _new_sequence(self, prompt_ids: list[int] | array, params: SamplingParams, request_id: str,
                      tenant: str | None = None, session: str | None = None) -> Sequence:
        if not prompt_ids:
            raise InvalidParameter("prompt", "the prompt is empty")
        vocab = self.model_config.vocab_size
        packed = _packed_ids(prompt_ids, vocab)
        if packed is None:
            raise InvalidParameter("prompt", f"prompt token ids must be integers in [0, {vocab})")
        bad = [t for t, _ in params.logit_bias if t >= vocab]
        if bad:
            raise InvalidParameter("logit_bias", f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab})")
        need = len(prompt_ids) + params.max_tokens
        if need > self.context_length:
            raise InvalidParameter("max_tokens", f"prompt ({len(prompt_ids)} tokens) + max_tokens "
                                   f"({params.max_tokens}) exceeds the context length ({self.context_length})")
        # the sampler takes int64 seeds: fold any Python int into [0, 2^63)
        seed = params.seed % 2**63 if params.seed is not None else random.getrandbits(63)
        grammar = None
        if params.grammar is not None:
            try:  # on the caller's thread: compiling a new grammar must not stall the engine loop
                grammar = self.grammars.matcher(params.grammar)
            except GrammarError as exc:
                raise InvalidParameter("grammar", f"the grammar does not compile: {exc}") from None
        detok = IncrementalDetokenizer(self.tokenizer, params.stop)
        salt = tenant.encode() if tenant else b""
        return Sequence(request_id, prompt_ids, params, detok, seed, salt, retain=session is not None,
                        grammar=grammar, packed_prompt=packed)

    def submit(self, prompt_ids: list[int] | array, params: SamplingParams, emit: Emit,
               request_id: str | None = None, tenant: str | None = None, session: str | None = None,
               follow: str | None = None, announce: bool = False) -> str:
        """Queue a request; ``emit`` is called from the engine thread with each output.

        ``tenant`` (the authenticated API key's id) salts the request's KV page names:
        tenants never share cached pages. ``session`` (a client's conversation id) raises
        the retention priority of the request's pages. ``follow`` names a request submitted
        before with the same prompt (another choice of it): this one is admitted once that
        one has sampled its first token, so it finds the prompt's pages in the prefix cache.
        ``announce``: emit an empty output (no text, no tokens) once the request's first step
        is on the device, before its first token: a server starts its response then (headers,
        a chat stream's role), while the prefill runs, instead of after the token. A request
        refused before it runs gets its error first, as without.
        """
        request_id = request_id or uuid.uuid4().hex
        self.expect_request()
        hand_over = (self.hand_over and self._thread is not None and threading.current_thread() is not self._thread
                     and self.idle)
        try:
            # (a uint32 array, as the server's chat prompts come, is checked by its bytes: _packed_ids)
            seq = self._new_sequence(prompt_ids if isinstance(prompt_ids, array) else list(prompt_ids), params,
                                     request_id, tenant, session)
            seq.announce = announce
            seq.started = threading.Event() if hand_over else None
            turn_trace.stamp(request_id, "submit")
            self._inbox.put(_Add(seq, emit, follow))
        finally:
            self._expected_until = 0.0  # in the inbox (or refused): nothing more to wait for
        self._wakeup.set()
        if seq.started is not None:
            seq.started.wait(HANDOFF_S)
        return request_id

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))
        self._wakeup.set()

    def flush_kv(self, timeout: float | None = 120.0) -> None:
        """Wait until the pages of every request finished so far have gone to the KV tiers and the disk
        writes queued for them have landed (tests, notebooks, a caller about to read the store). On
        the engine thread when it runs: the tiers are not shared with other threads."""
        if self.tiers is None:
            return
        if self._thread is None:
            self._settle_tiers()
            return
        done = threading.Event()
        self._inbox.put(_Flush(done))
        self._wakeup.set()
        if not done.wait(timeout):
            raise TimeoutError(f"the KV tiers did not settle in {timeout} s")

    announces = True  # generate() takes ``announce`` (servers check for it: other engines may not)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       tenant: str | None = None, session: str | None = None,
                       follow: str | None = None, announce: bool = False) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (``announce``: see ``submit``). Closing the iterator early aborts the
        request."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        request_id = self.submit(prompt_ids, params, lambda o: loop.call_soon_threadsafe(outputs.put_nowait, o),
                                 request_id, tenant, session, follow, announce)
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

    def generate_sync(self, prompt_ids: list[int], params: SamplingParams, tenant: str | None = None,
                      session: str | None = None, n: int = 1) -> RequestOutput | list[RequestOutput]:
        """Run one request to completion from a plain thread; returns the whole output.

        With ``n > 1``: n choices of the prompt (``SamplingParams.for_choice``), sharing its
        KV through the prefix cache; returns the list of their outputs.
        """
        queues = [queue.SimpleQueue() for _ in range(n)]
        first = None
        for i, outputs in enumerate(queues):
            rid = self.submit(prompt_ids, params.for_choice(i), outputs.put, tenant=tenant, session=session,
                              follow=first)
            first = first or rid
        totals = [self._gather(outputs) for outputs in queues]
        return totals[0] if n == 1 else totals

    @staticmethod
    def _gather(outputs: queue.SimpleQueue) -> RequestOutput:
        total = None
        while total is None or not total.finished:
            out = outputs.get()
            if isinstance(out, BaseException):
                raise out
            if total is None:
                total = RequestOutput(out.request_id, logprobs=[] if out.logprobs is not None else None)
            total.text += out.text
            total.token_ids += out.token_ids
            if out.logprobs is not None:
                total.logprobs += out.logprobs
            total.finish_reason = out.finish_reason
            total.prompt_tokens, total.completion_tokens = out.prompt_tokens, out.completion_tokens
            total.cached_tokens = out.cached_tokens
        return total
