"""Text <-> token ids, built from a GGUF file's metadata or a Hugging Face tokenizer folder.

A GGUF stores no tokenizer.json: only the vocabulary, the merges, a token type per token and a
pre-tokenizer *name* (``tokenizer.ggml.pre``). The split regexes behind each name live in
llama.cpp (``llm_tokenizer_bpe`` in src/llama-vocab.cpp); the table below restates them in the
``tokenizers`` regex dialect, using the original tokenizer.json patterns where llama.cpp had to
rewrite one for ``std::regex``. The result is a ``tokenizers.Tokenizer`` that gives the ids of
the model's own tokenizer.json. (transformers' GGUF loader falls back to the GPT-2 split for
names it lacks, "smollm" among them, and then differs where 2+ spaces precede a digit.)

Special tokens: CONTROL tokens (``<|im_start|>``) are registered as special added tokens and
USER_DEFINED ones (``<think>``) as plain added tokens, so both are matched whole when they are
written in the text, as llama.cpp does when it parses specials.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from qml_runtime.chat_encoding import PieceEncoder
from qml_runtime.chat_template import ChatTemplate, ChatTemplateError

__all__ = ["PRE_TOKENIZER_SPLITS", "Tokenizer", "UnsupportedTokenizer"]

log = logging.getLogger(__name__)

SUPPORTED_GGUF_MODELS = ("gpt2",)

# llama.cpp token types (gguf TokenType)
_CONTROL, _USER_DEFINED = 3, 4


class UnsupportedTokenizer(ValueError):
    """The file describes a tokenizer this engine cannot build."""


# --- split regexes, by family -------------------------------------------------------------
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_EACH_NUMBER = r"\p{N}"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SEED_CODER = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}"
               r"| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+")
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTION}"
          rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTION}"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PUNCT_RUNS = r"[\p{P}\$\+<=>\^~\|]+"
_BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"


@dataclass(frozen=True)
class _PreTokenizer:
    splits: tuple[str, ...]  # applied in order; each isolates its matches within the previous pieces
    ignore_merges: bool = False  # a whole piece that is itself a token is emitted without merging
    add_bos: bool = False  # llama.cpp's default when the file has no tokenizer.ggml.add_bos_token


_GPT2_PRE = _PreTokenizer((_GPT2,))
_LLAMA3_PRE = _PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)


def _family(names: str, pre: _PreTokenizer) -> dict[str, _PreTokenizer]:
    return dict.fromkeys(names.split(), pre)


PRE_TOKENIZER_SPLITS: dict[str, _PreTokenizer] = {
    # llama.cpp's "default" is the legacy Falcon-era chain, kept for files that name it.
    "default": _PreTokenizer((_PUNCT_RUNS, _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")),
    **_family("gpt-2 phi-2 mpt olmo jais trillion granite-docling exaone4 jina-es jina-de jina-v2-es "
              "jina-v2-de jina-v1-en jina-v2-code roberta-bpe gigachat a.x-4.0 mellum modern-bert", _GPT2_PRE),
    # every number character on its own, then the GPT-2 pattern (StarCoder-style vocabularies)
    **_family("smollm starcoder refact command-r codeshell exaone minerva-7b mellum2",
              _PreTokenizer((_EACH_NUMBER, _GPT2))),
    **_family("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano", _LLAMA3_PRE),
    **_family("dbrx smaug-bpe glm4 chatglm-bpe", _PreTokenizer((_LLAMA3,))),
    **_family("qwen2 deepseek-r1-qwen kormo f2llmv2 megrez stablelm2 hunyuan solar-open",
              _PreTokenizer((_QWEN2,))),
    "qwen35": _PreTokenizer((_QWEN35,)),
    "tekken": _PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True),
    **_family("gpt-4o llama4 kanana2 talkie minimax-m2", _PreTokenizer((_GPT4O,))),
    "seed-coder": _PreTokenizer((_SEED_CODER,)),
    "falcon": _PreTokenizer((_PUNCT_RUNS, _GPT2, r"[0-9][0-9][0-9]")),
    **_family("poro-chat bloom gpt3-finnish", _PreTokenizer((_BLOOM,))),
}


def _byte_level_pre_tokenizer(pre: _PreTokenizer) -> pre_tokenizers.PreTokenizer:
    steps = [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in pre.splits]
    # The splits above replace ByteLevel's own GPT-2 regex; it only maps bytes to its alphabet.
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)


def _byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the alphabet byte-level vocabularies are written in)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in spelling)
    spelling.update({b: chr(256 + i) for i, b in enumerate(shifted)})
    return spelling


def _added_tokens(tokens: list[str], types: list[int] | None) -> tuple[list[AddedToken], list[AddedToken]]:
    if not types:
        return [], []
    special = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL]
    plain = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED]
    return special, plain


def _special_id(metadata: Mapping[str, Any], key: str, n_vocab: int) -> int | None:
    value = metadata.get(f"tokenizer.ggml.{key}")
    if value is None:
        return None
    if not 0 <= int(value) < n_vocab:
        log.warning("GGUF %s = %s is outside the vocabulary (%d tokens); ignored", key, value, n_vocab)
        return None
    return int(value)


def _gguf_byte_level(metadata: Mapping[str, Any]) -> tuple[tokenizers.Tokenizer, bool]:
    """The backend tokenizer for ``tokenizer.ggml.model == "gpt2"`` and the default add_bos."""
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    types: list[int] | None = metadata.get("tokenizer.ggml.token_type")
    merges_text = metadata.get("tokenizer.ggml.merges")
    if merges_text is None:
        raise UnsupportedTokenizer("byte-level BPE GGUF without tokenizer.ggml.merges")
    if types is not None and len(types) < len(tokens):
        raise ValueError(f"GGUF has {len(tokens)} tokens but only {len(types)} token types")

    pre_name = metadata.get("tokenizer.ggml.pre")
    pre = PRE_TOKENIZER_SPLITS.get(pre_name)
    if pre is None:
        log.warning("%s GGUF pre-tokenizer %r; splitting text with the GPT-2 pattern, which may "
                    "tokenize differently from the model's training", "unknown" if pre_name else "no", pre_name)
        pre = _GPT2_PRE

    spelling = _byte_spelling()
    alphabet = set(spelling.values())
    added_special, added_plain = _added_tokens(tokens, types)
    added_text = {t.content for t in (*added_special, *added_plain)}
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        # Added tokens keep their raw text (they are matched in the raw input); a normal token
        # written outside the byte alphabet is re-spelled byte by byte, as transformers does.
        if token not in added_text and not set(token) <= alphabet:
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, index)
    # llama.cpp cuts a merge at the first space after its first character
    merges = []
    for line in merges_text:
        cut = line.find(" ", 1)
        merges.append((line[:cut], line[cut + 1:]))

    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    if added_special:
        backend.add_special_tokens(added_special)
    if added_plain:
        backend.add_tokens(added_plain)
    return backend, pre.add_bos


class Tokenizer:
    """A ``tokenizers.Tokenizer`` with the model's special tokens, BOS policy and chat template."""

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token_id: int | None, eos_token_id: int | None,
                 add_bos: bool | None, extra_eos_ids: Iterable[int] = (), chat_template: str | None = None):
        """``add_bos``: True/False to have ``encode`` prepend BOS (or not) itself; None when the
        backend's post-processor already adds what the model wants (a tokenizer.json)."""
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        if add_bos is None:
            self._bos_prefix: list[int] = []
            self.add_bos = bos_token_id is not None and backend.encode("").ids[:1] == [bos_token_id]
        else:
            self.add_bos = add_bos and bos_token_id is not None
            self._bos_prefix = [bos_token_id] if self.add_bos else []
        self.eos_token_ids = frozenset(i for i in (eos_token_id, *extra_eos_ids) if i is not None)
        self.chat_template = (ChatTemplate(chat_template, bos_token=self.bos_token, eos_token=self.eos_token)
                              if chat_template else None)
        self._pieces: PieceEncoder | None = None  # built at the first chat prompt

    # --- construction ---------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Build from a GGUF metadata dict (``GGUFFile(path).metadata``)."""
        model = metadata.get("tokenizer.ggml.model")
        if model not in SUPPORTED_GGUF_MODELS:
            raise UnsupportedTokenizer(
                f"GGUF tokenizer.ggml.model = {model!r} is not supported; supported: "
                f"{', '.join(map(repr, SUPPORTED_GGUF_MODELS))} (byte-level BPE)")
        backend, default_add_bos = _gguf_byte_level(metadata)
        n_vocab = len(metadata["tokenizer.ggml.tokens"])
        return cls(
            backend,
            bos_token_id=_special_id(metadata, "bos_token_id", n_vocab),
            eos_token_id=_special_id(metadata, "eos_token_id", n_vocab),
            add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", default_add_bos)),
            extra_eos_ids=(_special_id(metadata, "eot_token_id", n_vocab),
                           _special_id(metadata, "eom_token_id", n_vocab)),
            chat_template=metadata.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Build from a Hugging Face folder: tokenizer.json, tokenizer_config.json and, if there,
        chat_template.jinja and generation_config.json (whose eos ids also end a turn)."""
        path = Path(path)
        backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        # As in transformers 5, tokenizer.json's post-processor decides what encode() adds;
        # tokenizer_config.json's add_bos_token is only a record of it.
        generation_eos = _read_json(path / "generation_config.json").get("eos_token_id")
        if isinstance(generation_eos, int):
            generation_eos = [generation_eos]
        return cls(backend, bos_token_id=_token_id(backend, config.get("bos_token")),
                   eos_token_id=_token_id(backend, config.get("eos_token")), add_bos=None,
                   extra_eos_ids=generation_eos or (), chat_template=_hf_chat_template(path, config))

    # --- vocabulary -----------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.backend.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_token_id is None else self.backend.id_to_token(self.eos_token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    # --- text <-> ids ---------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in it become their ids. BOS is
        prepended only if ``add_special_tokens`` and the model asks for it (``add_bos``)."""
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        return self._bos_prefix + ids if add_special_tokens else ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        # int() also accepts numpy / torch scalars, which the Rust side rejects
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # --- chat -----------------------------------------------------------------------------
    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text of a conversation, through the model's chat template."""
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template; send a plain prompt (completions) instead")
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, **extra)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> list[int]:
        """Token ids of the rendered conversation. The template writes its own BOS, so none is added."""
        return self.encode_chat(self.render_chat(messages, add_generation_prompt, **extra))

    def encode_chat(self, text: str, continuation: bool = False) -> list[int]:
        """Ids of a rendered chat prompt (no BOS added: the template writes its own, so a
        ``continuation`` of one, the text after a kept reply, is encoded the same way): the pieces
        between special tokens that an earlier turn already sent come from a cache
        (qml_runtime.chat_encoding)."""
        if self._pieces is None:
            self._pieces = PieceEncoder(self.backend)
        return self._pieces.encode(text)

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, eos={self.eos_token!r}, "
                f"add_bos={self.add_bos}, chat_template={self.chat_template is not None})")


# --- Hugging Face folder helpers ----------------------------------------------------------
def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_id(backend: tokenizers.Tokenizer, token: str | dict | None) -> int | None:
    # tokenizer_config.json writes a special token as a string or as a serialized AddedToken
    if isinstance(token, dict):
        token = token.get("content")
    return backend.token_to_id(token) if token else None


def _hf_chat_template(path: Path, config: dict) -> str | None:
    # A separate chat_template.jinja wins over the config's entry, as in transformers.
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template") or _read_json(path / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {entry["name"]: entry["template"] for entry in template}
        template = named.get("default", next(iter(named.values()), None))
    return template or None
