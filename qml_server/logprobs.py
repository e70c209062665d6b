"""Token log-probabilities in OpenAI's two response shapes.

Chat: ``choices[].logprobs = {"content": [{"token", "logprob", "bytes", "top_logprobs":
[{"token", "logprob", "bytes"}, ...]}, ...], "refusal": null}``, exactly ``top_logprobs``
alternatives per token.

Completions (the legacy shape): ``{"tokens", "token_logprobs", "top_logprobs": [{token:
logprob}, ...], "text_offset"}``, where each dict holds the ``logprobs`` best tokens and
the sampled one (so up to ``logprobs + 1`` entries), and ``text_offset`` is where each
token's text starts in the completion, counted across a stream's chunks.

A token's text is what the tokenizer decodes it to alone; a token holding part of a
UTF-8 character decodes to U+FFFD, and its ``bytes`` are those of that text. The values
are the engine's (the log-softmax of the model's raw logits: qml_runtime.logits).
"""

from __future__ import annotations

from typing import Any

from qml_runtime.sampling_params import TokenLogprob

# JSON has no -Infinity; OpenAI reports vanishing probabilities as -9999.0
FLOOR = -9999.0


def _value(logprob: float) -> float:
    return logprob if logprob >= FLOOR else FLOOR  # NaN, too, ends at the floor


class TokenText:
    """Token id -> its text, memoised (the same alternatives come up at every position)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text


def chat_logprobs(texts: TokenText, entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
    if entries is None:
        return None

    def one(token_id: int, logprob: float) -> dict[str, Any]:
        text = texts(token_id)
        return {"token": text, "logprob": _value(logprob), "bytes": list(text.encode("utf-8"))}

    content = [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]
    return {"content": content, "refusal": None}


class CompletionLogprobs:
    """The legacy shape for one choice; keeps the text offset from one streamed chunk to the next."""

    def __init__(self, texts: TokenText):
        self.texts = texts
        self.offset = 0

    def __call__(self, entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if entries is None:
            return None
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            text = self.texts(e.token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(_value(e.logprob))
            top = {self.texts(t): _value(lp) for t, lp in e.top}
            top.setdefault(text, _value(e.logprob))
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out
