"""Constrained decoding: a grammar decides which tokens may come next, through llguidance.

Why llguidance: it reads our ``tokenizers.Tokenizer`` as it is (its JSON), so the grammar
sees exactly the model's tokens, special tokens included and kept out of text; it compiles
JSON Schema and Lark (with JSON Schema embedded) to one grammar form; and it computes a
step's allowed-token bitmask in Rust, off the GIL, in tens of microseconds for JSON over a
49k vocabulary (rows of a batch in parallel through its executor).

A request's grammar travels as llguidance's serialized form (a string) in
``SamplingParams.grammar``. Each sequence gets its own ``GrammarMatcher``, since a matcher
is the state of one parse (an ``n > 1`` request's choices diverge from the first token).
The logits processor (qml_runtime.logits) sets the logits of disallowed tokens to -inf, last,
after bias and penalties, so greedy decoding and every sampling filter only ever see allowed
tokens. The engine advances the matcher with each sampled token and ends the sequence
(``"stop"``) once the grammar has accepted and can take nothing more.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import llguidance
import torch

# JSON as people write it on one line: ", " and ": ", no other whitespace. Flexible whitespace
# lets a small model pad with newlines until max_tokens; a schema can override this with its
# own "x-guidance" options.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}

log = logging.getLogger("qml.constrained")


class GrammarError(ValueError):
    """A schema or grammar llguidance cannot compile, or a token the grammar refused."""


@contextlib.contextmanager
def _as_grammar_error(errors: tuple[type[Exception], ...] = ()) -> Iterator[None]:
    """``errors``, and any bug llguidance hits, as GrammarError. Its Rust panics (some schemas trigger
    them) arrive as pyo3's PanicException, a BaseException: an engine loop's ``except Exception``
    would not stop one, and a server would answer 500 for what is a bad schema."""
    try:
        yield
    except errors as exc:
        raise GrammarError(str(exc)[:500]) from None
    except BaseException as exc:
        if type(exc).__name__ != "PanicException":
            raise
        raise GrammarError(f"llguidance failed: {str(exc)[:500]}") from None


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """The grammar of the JSON values ``schema`` allows (written in ``JSON_STYLE``)."""
    with _as_grammar_error((ValueError, TypeError, OverflowError)):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)
    return check_grammar(grammar)


def lark_grammar(lark: str) -> str:
    """The grammar of a Lark text (llguidance's dialect: ``%json {schema}`` embeds a JSON Schema)."""
    return check_grammar(llguidance.LLMatcher.grammar_from_lark(lark))


def check_grammar(grammar: str) -> str:
    """``grammar`` if it compiles (without a tokenizer: the grammar itself), else GrammarError."""
    with _as_grammar_error((ValueError, TypeError, OverflowError)):
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        raise GrammarError(messages[0] if messages else "the grammar does not compile")
    return grammar


def json_schema_with_style(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with ``JSON_STYLE`` as its x-guidance options unless it sets its own (for a schema
    embedded in a Lark grammar, where the compile-time defaults do not reach)."""
    own = schema.get("x-guidance")
    return {**schema, "x-guidance": {**JSON_STYLE, **(own if isinstance(own, dict) else {})}}


class GrammarMatcher:
    """One sequence's parse: which tokens may come next, and whether the grammar is done."""

    def __init__(self, matcher: llguidance.LLMatcher, mask_words: int):
        self.matcher = matcher
        self.mask_words = mask_words  # int32 words of its bitmask: one bit per token of the tokenizer view

    def accept(self, token: int) -> None:
        """Advance by the sampled ``token`` (one the mask allowed, so a refusal is a bug or a limit hit)."""
        with _as_grammar_error():
            accepted = self.matcher.consume_token(token)
        if not accepted:
            raise GrammarError(f"the grammar refused token {token}: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar has accepted and allows no further token: the sequence must end here."""
        return self.matcher.is_stopped()


class Grammars:
    """The engine's side of llguidance: its view of the tokenizer and the compiled grammars.

    The tokenizer view (a token trie, ~0.2 s for 49k tokens) is built by ``prepare`` (the server calls
    it on a thread at start-up) or else at the first constrained request. Compiled matchers are kept per
    grammar (LRU): a repeated schema, and each choice of an ``n > 1`` request, starts from a copy
    instead of compiling again.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, cache_size: int = 64):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's logits width, which may exceed the tokenizer's
        self.cache_size = cache_size
        self._lock = threading.Lock()  # requests arrive from the server's loop and from plain threads
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    def _tokenizer(self) -> llguidance.LLTokenizer:
        if self._ll_tokenizer is None:
            n_vocab = max(self.vocab_size, self.tokenizer.vocab_size)
            self._ll_tokenizer = llguidance.LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=n_vocab,
                                                        eos_token=sorted(self.tokenizer.eos_token_ids))
        return self._ll_tokenizer

    def prepare(self) -> None:
        """Build the tokenizer view now (a server calls this on a thread at start-up, so the first
        constrained request does not pay for it on the event loop). Failing here is not an error:
        the first constrained request then reports it."""
        try:
            with self._lock:
                self._tokenizer()
        except Exception as exc:  # a tokenizer llguidance cannot read: requests will say so
            log.info("structured output unavailable for this tokenizer: %s", exc)

    def matcher(self, grammar: str) -> GrammarMatcher:
        """A fresh matcher at the start of ``grammar``; GrammarError if it does not compile."""
        with self._lock:
            compiled = self._compiled.get(grammar)
            if compiled is None:
                with _as_grammar_error((ValueError, TypeError)):
                    compiled = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)
                if compiled.is_error():
                    raise GrammarError(compiled.get_error())
                self._compiled[grammar] = compiled
                if len(self._compiled) > self.cache_size:
                    self._compiled.popitem(last=False)
            self._compiled.move_to_end(grammar)
            return GrammarMatcher(compiled.deep_copy(), -(-self._ll_tokenizer.vocab_size // 32))


class TokenMasks:
    """Applies the grammars of a step's constrained rows to their logits."""

    def __init__(self):
        self._executor: llguidance.LLExecutor | None = None  # its threads start at the first use
        self._shifts: dict[torch.device, torch.Tensor] = {}

    def apply(self, logits: torch.Tensor, rows: list[int], matchers: list[GrammarMatcher]) -> None:
        """logits fp32 [B, V], in place: in each of ``rows``, the tokens its matcher refuses get -inf.

        The bitmasks (one bit per token, 32 tokens a word) are computed on the host, all rows at
        once, and unpacked on the logits' device: 4 bytes per 32 tokens cross, not a [B, V] mask.
        """
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        V = logits.shape[1]
        words = matchers[0].mask_words
        bitmask = torch.zeros(len(rows), words, dtype=torch.int32)  # [B', V/32]
        with _as_grammar_error():
            self._executor.unsafe_compute_mask_ptr([(m.matcher, i) for i, m in enumerate(matchers)],
                                                   bitmask.data_ptr(), words * 4, len(rows))
        dev = logits.device
        shifts = self._shifts.get(dev)
        if shifts is None:
            shifts = self._shifts[dev] = torch.arange(32, dtype=torch.int32, device=dev)
        packed = bitmask.to(dev, non_blocking=True)
        allowed = ((packed[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :V]  # [B', V]
        index = torch.tensor(rows, dtype=torch.int64).to(dev, non_blocking=True)
        logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(~allowed, float("-inf")))
