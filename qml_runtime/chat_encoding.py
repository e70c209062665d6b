"""Encoding chat prompts piece by piece, between special tokens, with the pieces cached.

Why: each turn of a conversation sends the whole conversation, and the server encodes all of
it again: 24k tokens took 23 ms with SmolLM2's tokenizer on this machine's CPU, more than the
14 ms the next turn of a 27k-token conversation should take in all on the H200 when its KV is
already on the GPU. The rendered prompt is the earlier turns' text plus a little more, and a
chat template puts special tokens (``<|im_start|>``, ``<|eot_id|>``, ...) between messages.

A special token is a hard boundary for the tokenizer: it is matched before the model sees the
text, and the text on each side is encoded on its own. So the prompt can be cut at the special
tokens, each piece encoded alone (or found in a cache: the earlier turns' pieces are the same
strings), and the ids joined, giving the same ids as encoding the whole. That holds for byte-level
BPE (SmolLM2, Llama 3, Qwen); a tokenizer whose pre-tokenizer treats the start of a text
specially (SentencePiece's "prepend a space to the first word") would not give the same ids for
a piece encoded alone. Whether it holds is checked once per tokenizer on probe conversations; if
not, prompts are encoded whole, as before.
"""

from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict

import tokenizers

MAX_CACHED_TOKENS = 4_000_000  # ~16 MB of int32 ids


class PieceEncoder:
    def __init__(self, backend: tokenizers.Tokenizer):
        self.backend = backend
        # special tokens matched as they are (not normalised, not eating the spaces around them)
        specials = {t.content: i for i, t in backend.get_added_tokens_decoder().items()
                    if t.special and not t.normalized and not t.lstrip and not t.rstrip}
        self._ids = specials
        self._split = (re.compile("(" + "|".join(map(re.escape, sorted(specials, key=len, reverse=True))) + ")")
                       if specials else None)
        self._cache: OrderedDict[str, array] = OrderedDict()
        self._cached_tokens = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0
        self.enabled = self._split is not None and self._agrees()

    def _whole(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def _agrees(self) -> bool:
        """Pieces joined == the whole, on conversations in this tokenizer's own special tokens."""
        marks = sorted(self._ids, key=self._ids.get)[:4]
        bodies = ["Hello there, how are you?", "\n I'm  fine,\tthanks!\n\n", " leading space", "naïve café 東京 🙂",
                  "x", "  ", "\n", "'s don't", "1234567 + 89"]
        # and words of its own vocabulary, so that a difference in ids cannot hide behind unknown tokens
        n = self.backend.get_vocab_size(with_added_tokens=False)
        words = [self.backend.decode([i]) for i in range(0, n, max(1, n // 12))]
        bodies += [w for w in words if w and w not in self._ids]
        probes = []
        for m in marks:
            for a in bodies:
                for b in bodies:
                    probes.append(f"{a}{m}{b}")
                    probes.append(f"{m}user\n{a}{m}{m}assistant\n{b}{m}")
        whole = self.backend.encode_batch(probes, add_special_tokens=False)
        split = [self._split.split(p) for p in probes]
        texts = sorted({piece for pieces in split for piece in pieces[0::2] if piece})
        alone = dict(zip(texts, (e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False))))
        for pieces, enc in zip(split, whole):
            ids = []
            for i, piece in enumerate(pieces):
                ids.extend([self._ids[piece]] if i % 2 else alone.get(piece, []))
            if ids != enc.ids:
                return False
        return True

    def encode(self, text: str) -> list[int]:
        """The ids of ``text`` (no BOS added: a chat template writes its own)."""
        if not self.enabled:
            return self._whole(text)
        pieces = self._split.split(text)  # text, special, text, special, ..., text
        found: dict[int, array | list[int]] = {}
        todo = []
        with self._lock:
            for i in range(0, len(pieces), 2):
                piece = pieces[i]
                if not piece:
                    continue
                hit = self._cache.get(piece)
                if hit is None:
                    todo.append(i)
                else:
                    self._cache.move_to_end(piece)
                    found[i] = hit
                    self.hits += 1
        if todo:
            self.misses += len(todo)
            encoded = self.backend.encode_batch([pieces[i] for i in todo], add_special_tokens=False)
            for i, enc in zip(todo, encoded):
                found[i] = enc.ids
            self._remember([(pieces[i], found[i]) for i in todo])
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if i % 2:
                ids.append(self._ids[piece])
            elif piece:
                ids.extend(found[i])
        return ids

    def _remember(self, items: list[tuple[str, list[int]]]) -> None:
        with self._lock:
            for piece, ids in items:
                if piece in self._cache or len(ids) > MAX_CACHED_TOKENS // 4:
                    continue
                self._cache[piece] = array("i", ids)
                self._cached_tokens += len(ids)
            while self._cached_tokens > MAX_CACHED_TOKENS and self._cache:
                _, old = self._cache.popitem(last=False)
                self._cached_tokens -= len(old)
