"""Turning generated tokens into streamed text: incremental decoding and stop strings.

A token can end in the middle of a UTF-8 character (byte-level BPE) and a stop
string can span tokens, so text is released only when it is final: complete
characters that cannot be the start of a stop string.
"""

from __future__ import annotations

from typing import Protocol


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Feed tokens one by one; ``push`` returns the text that may be sent now.

    Decoding is done over a short window of recent tokens, because decoding a
    token alone loses context the tokenizer needs (merged bytes, leading spaces).
    """

    def __init__(self, tokenizer: _Decoder, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = 0  # tokens already turned into text
        self.text = ""  # all text decoded so far (stop string cut off once found)
        self._sent = 0  # characters of self.text already released
        self.stopped = False  # a stop string was found

    def _decode_new(self) -> str:
        prefix = self.tokenizer.decode(self._ids[self._prefix_offset:self._read_offset], skip_special_tokens=True)
        full = self.tokenizer.decode(self._ids[self._prefix_offset:], skip_special_tokens=True)
        if full.endswith("\ufffd") or len(full) < len(prefix):
            return ""  # an incomplete UTF-8 sequence: wait for the next token
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full[len(prefix):]

    def push(self, token_id: int) -> str:
        """Add a token; return newly releasable text (possibly empty)."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        new = self._decode_new()
        if not new:
            return ""
        start = max(0, len(self.text) - self._hold)
        self.text += new
        for s in self.stop:
            idx = self.text.find(s, start)
            if idx != -1:
                self.text = self.text[:idx]
                self.stopped = True
        if self.stopped:
            return self._release(len(self.text))
        return self._release(len(self.text) - self._held_back())

    def _held_back(self) -> int:
        """Length of the longest tail of the text that could still grow into a stop string."""
        for n in range(min(self._hold, len(self.text)), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def flush(self) -> str:
        """At the end of generation: release whatever was held back."""
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        out = self.text[self._sent:upto] if upto > self._sent else ""
        self._sent = max(self._sent, upto)
        return out
