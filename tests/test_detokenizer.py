"""Incremental detokenization and stop strings, on the real SmolLM2 tokenizer."""

from __future__ import annotations

import pytest

from qml_runtime.detokenizer import IncrementalDetokenizer
from qml_runtime.tokenizer import Tokenizer
from qml_runtime.weights.gguf import GGUFFile


@pytest.fixture(scope="module")
def tok(smollm_path):
    return Tokenizer.from_gguf(GGUFFile(smollm_path).metadata)


def stream(tok, text: str, stop=()) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, tuple(stop))
    pieces = [detok.push(t) for t in tok.encode(text, add_special_tokens=False)]
    pieces.append(detok.flush())
    return pieces, detok


@pytest.mark.parametrize("text", [
    "Hello world, this is plain ASCII.",
    "Café, naïve, Straße — ünïcödé",  # multi-byte characters split over byte-level tokens
    "日本語のテキストと絵文字 🐉🔥👩‍👩‍👧",  # 3- and 4-byte characters, ZWJ sequences
    "  leading and trailing spaces  \n\n\ttabs",
    "def f(x):\n    return {'a': [1, 2, 3]}\n",
])
def test_streamed_pieces_join_to_decode(tok, text):
    pieces, _ = stream(tok, text)
    assert "".join(pieces) == tok.decode(tok.encode(text, add_special_tokens=False))
    assert all("\ufffd" not in p for p in pieces), "half a UTF-8 character was released"


@pytest.mark.parametrize("text, stop, expected", [
    ("The answer is 42. END and more", ["END"], "The answer is 42. "),
    ("one, two, three", [", t"], "one"),  # stop string spanning several tokens
    ("alpha beta gamma", ["delta"], "alpha beta gamma"),  # no stop: everything, held text flushed
    ("abc xyz abc", ["xyz", "abc x"], ""),  # the earliest match wins, even from the second string
    ("Zürich 🐉 dragons", ["🐉"], "Zürich "),  # a multi-byte stop string
])
def test_stop_strings(tok, text, stop, expected):
    pieces, detok = stream(tok, text, stop)
    assert "".join(pieces) == expected
    assert detok.stopped == any(s in text for s in stop)


def test_text_that_may_start_a_stop_string_is_held_back(tok):
    detok = IncrementalDetokenizer(tok, ("STOP",))
    released = "".join(detok.push(t) for t in tok.encode("ab ST", add_special_tokens=False))
    assert not released.endswith("ST")  # "ST" could become "STOP"
    assert detok.flush().endswith("ST")  # at the end it is just text
