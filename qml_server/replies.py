"""The ids the model generated for a reply, found again when the client sends the reply back.

Why: a chat client sends each turn's whole conversation, and the server tokenizes it again. The
history's KV is in the prefix cache under the ids the model *generated* for its replies, but text
decoded from generated ids does not always encode back to them (a reply can end inside a word, and
BPE merges differently across the boundary; a random-weights model's ids never round-trip), so the
prefix-cache match stops where the last reply begins and the reply, plus everything after it, is
prefilled again: on a 27k-token history with 64-token replies that was 219 tokens computed for a
133-token turn (benchmarks/results/sessions-h200-2026-12-01.md).

What: when a chat completion finishes, its rendered prompt text plus the reply's text is kept
with the prompt's ids plus the generated ids (only if the generated ids decode to exactly that
text). The next request's rendered prompt is checked against what was kept: when it starts with a
kept text, its ids are the kept ids followed by the rest of the text encoded on its own. A chat
template writes the reply between special tokens (``<|eot_id|>``, ``<|im_end|>``), where the
tokenizer cuts anyway, so the rest encodes as it would in the whole; the reply itself keeps the
model's own tokens, as a stateful API that holds the previous response would. A client that
edits a reply, or a template that rewrites it (trims it, drops its reasoning), gets a text that
no longer starts with the kept one: a miss, and the prompt is encoded whole, as before.

Scope: per tenant (the API key and the request's ``cache_salt``, as for the KV cache), so one
tenant's replies never shape another's tokenization (``usage`` would reveal them). A conversation is
one entry: a reply that extends a kept text (the same conversation's next turn, whose ids start with
the kept ids) takes its place and keeps its earlier cut points, so a turn sent again (a retry, a
regenerated answer) still finds the replies before it. Bounded: ``max_entries`` entries and
``max_tokens`` ids in all, least recently used first out. With a ``ReplyStore`` (the server's KV disk
tier is on) every change is mirrored to disk and the entries are loaded on start, so the replies
survive a restart as the KV does.
"""

from __future__ import annotations

import bisect
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from qml_server.replies_store import ReplyStore


@dataclass
class _Kept:
    tenant: str
    text: str
    ids: array
    # (characters, ids) at the end of each kept reply of the conversation, ascending; the last is the whole
    cuts: list[tuple[int, int]] = field(default_factory=list)


class ReplyMemory:
    def __init__(self, max_entries: int = 1024, max_tokens: int = 8_000_000, store: ReplyStore | None = None):
        if max_entries < 1 or max_tokens < 1:
            raise ValueError("ReplyMemory: max_entries and max_tokens must be >= 1")
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self._entries: OrderedDict[tuple[str, str], _Kept] = OrderedDict()  # LRU order, oldest first
        self._tokens = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.reused_tokens = 0
        self.store = store
        if store is not None:
            for tenant, text, ids, cuts in store.load():  # oldest first, as if remembered again
                self._entries[(tenant, text)] = _Kept(tenant, text, ids, cuts)
                self._tokens += len(ids)
                self._shrink()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tokens(self) -> int:
        return self._tokens

    def remember(self, tenant: str, text: str, ids: list[int] | array) -> None:
        """Keep ``text`` (a rendered prompt and its reply) -> ``ids`` for ``tenant``'s next turns (a list, or a
        uint32 array as the server's prompts come: taken by its bytes, on the event loop's thread)."""
        if not text or not ids or len(ids) > self.max_tokens:
            return
        if isinstance(ids, array) and ids.typecode == "I":
            as_int32 = array("i")
            as_int32.frombytes(ids.tobytes())  # (token ids are < 2^31: the same values)
        else:
            as_int32 = array("i", ids)
        kept = _Kept(tenant, text, as_int32, [(len(text), len(ids))])
        with self._lock:
            for key, e in list(self._entries.items()):
                if e.tenant == tenant and text.startswith(e.text) and kept.ids[:len(e.ids)] == e.ids:
                    # the conversation's earlier turn: this one extends it, and keeps its cut points
                    kept.cuts = e.cuts + [c for c in kept.cuts if c[0] > e.cuts[-1][0]]
                    self._drop(key)
            if (tenant, text) in self._entries:  # the same text with other ids (a twin choice): the newer wins
                self._drop((tenant, text))
            self._entries[(tenant, text)] = kept
            self._tokens += len(kept.ids)
            if self.store is not None:
                self.store.save(tenant, text, kept.ids, kept.cuts)
            self._shrink()

    def _shrink(self) -> None:
        while len(self._entries) > self.max_entries or self._tokens > self.max_tokens:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: tuple[str, str]) -> None:
        self._tokens -= len(self._entries.pop(key).ids)
        if self.store is not None:
            self.store.delete(*key)

    def longest_prefix(self, tenant: str, text: str) -> tuple[int, array] | None:
        """(characters, ids) of the longest kept reply of ``tenant`` (with what came before it) that ``text``
        starts with; the ids as a uint32 ``array("I")``, the form the engine takes a prompt in without a check
        or a copy per id (``Engine.submit``; a list of a 27k-token history was ~0.4 ms to make here and
        ~0.6 ms to check and pack there)."""
        with self._lock:
            best: tuple[int, int, _Kept] | None = None
            for e in self._entries.values():
                if e.tenant != tenant:
                    continue
                # another conversation (of a keyless server: every user's) fails at its first cut, one compare
                if not text.startswith(e.text[:e.cuts[0][0]]):
                    continue
                # the cut points that text starts with form a head of e.cuts: the last one is found by bisection
                n = bisect.bisect_left(e.cuts, True, lo=1, key=lambda c: not text.startswith(e.text[:c[0]]))
                if best is None or e.cuts[n - 1][0] > best[0]:
                    best = (*e.cuts[n - 1], e)
            if best is None:
                self.misses += 1
                return None
            chars, n_ids, e = best
            self._entries.move_to_end((tenant, e.text))
            self.hits += 1
            self.reused_tokens += n_ids
            ids = array("I")
            ids.frombytes(e.ids[:n_ids].tobytes())  # (kept ids are >= 0: the same bytes as int32)
            return chars, ids

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"entries": len(self._entries), "tokens": self._tokens, "hits": self.hits, "misses": self.misses,
                    "reused_tokens": self.reused_tokens}
