"""Chat prompts encoded piece by piece between special tokens, with the pieces cached: the same
ids as encoding the whole prompt, and only the new pieces encoded at the next turn."""

from __future__ import annotations

import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from qml_runtime.chat_encoding import PieceEncoder


def whole(tok, messages):
    return tok.encode(tok.render_chat(messages, True), add_special_tokens=False)


texts = st.text(st.characters(codec="utf-8"), max_size=40) | st.sampled_from(
    ["<|im_end|>", "<|im_start|>user", " <|endoftext|> ", "Hello", "\n\n", " ", "don't"])


@given(st.lists(texts, min_size=1, max_size=6))
@settings(max_examples=150, deadline=None)
def test_pieces_give_the_ids_of_the_whole_prompt(engine, contents):
    tok = engine.tokenizer
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": c} for i, c in enumerate(contents)]
    assert tok.apply_chat_template(messages) == whole(tok, messages)
    assert tok._pieces.enabled  # SmolLM2's byte-level BPE cuts cleanly at its special tokens


def test_the_next_turn_encodes_only_its_new_pieces(engine):
    tok = engine.tokenizer
    history = [{"role": "user", "content": "A long first message about tides. " * 50},
               {"role": "assistant", "content": "The moon pulls the sea."}]
    tok.apply_chat_template(history + [{"role": "user", "content": "And the sun?"}])
    pieces = tok._pieces
    misses = pieces.misses
    turn = history + [{"role": "user", "content": "And the sun?"}, {"role": "assistant", "content": "It does too."},
                      {"role": "user", "content": "How much?"}]
    assert tok.apply_chat_template(turn) == whole(tok, turn)
    assert pieces.misses - misses == 2  # the reply and the new question; the rest came from the cache


def metaspace_tokenizer() -> tokenizers.Tokenizer:
    """A tokenizer that marks the first word of a text: a piece encoded alone differs."""
    vocab = {"[UNK]": 0, "a": 1, "b": 2, "▁a": 3, "▁b": 4}
    tk = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tk.decoder = decoders.Metaspace(prepend_scheme="first")
    tk.add_special_tokens([AddedToken("<s>", special=True, normalized=False)])
    return tk


def test_a_tokenizer_whose_pieces_differ_is_encoded_whole():
    tk = metaspace_tokenizer()
    assert tk.encode("a<s>b", add_special_tokens=False).ids != [3, 5, 4]  # "b" alone would be "▁b"
    pe = PieceEncoder(tk)
    assert not pe.enabled
    assert pe.encode("a<s>b") == tk.encode("a<s>b", add_special_tokens=False).ids


def test_no_special_tokens_means_no_pieces():
    tk = tokenizers.Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    pe = PieceEncoder(tk)
    assert not pe.enabled and pe.encode("a a b") == [1, 1, 0]
