"""Presets: real shapes with random weights, the byte-level stand-in tokenizer, and the flags that ask for them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from qml_kernels.attention import AttentionMetadata
from qml_runtime import models, presets
from qml_runtime.kv.cache import KVCache
from qml_runtime.loader import load_engine
from qml_runtime.models.llama import LlamaModel
from qml_runtime.presets import PRESETS, ByteTokenizer, random_model
from qml_runtime.sampling_params import SamplingParams
from qml_server.cli import build_parser, main

CPU = torch.device("cpu")


def prefill(model, token_ids: list[int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(final hidden states [T, D], logits [T, V]) of one sequence through a private KV cache."""
    S, T = 16, len(token_ids)
    pages = -(-T // S)
    kv = KVCache(model.cfg, pages, S, CPU, dtype)
    meta = AttentionMetadata.build(list(range(T)), [list(range(pages))], [0, T], [T], CPU)
    with torch.inference_mode():
        hidden = model(torch.tensor(token_ids), torch.arange(T), kv, meta)
        return hidden, model.logits(hidden)


def test_llama_3_1_8b_has_the_published_shape():
    cfg = PRESETS["llama-3.1-8b"].config
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4096, 32, 32, 8, 128)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.context_length) == (14336, 128256, 131072)
    assert cfg.rope_theta == 500000 and cfg.rms_eps == 1e-5 and not cfg.tie_word_embeddings
    s = cfg.rope_scaling
    assert (s.kind, s.factor, s.low_freq_factor, s.high_freq_factor) == ("llama3", 8, 1, 4)
    assert s.original_max_position == 8192
    # built on the meta device: shapes without memory; 8.03B is Meta's own count
    net = LlamaModel(cfg, torch.device("meta"), torch.bfloat16)
    assert sum(p.numel() for p in net.parameters()) == 8_030_261_248


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_llama_gives_finite_logits(dtype):
    model = random_model(PRESETS["tiny-llama"], CPU, dtype)
    ids = ByteTokenizer(512).apply_chat_template([{"role": "user", "content": "The quick brown fox. " * 12}])
    hidden, logits = prefill(model, ids, dtype)
    assert logits.shape == (len(ids), 512)
    assert torch.isfinite(logits).all()
    assert 0.1 < logits.std() < 10  # neither collapsed nor exploding
    assert torch.isfinite(hidden).all()


def test_activations_stay_finite_through_32_layers_in_bf16():
    """The 8B's depth, head dim and GQA ratio at a width a CPU test can afford."""
    cfg = dataclasses.replace(PRESETS["llama-3.1-8b"].config, hidden_size=256, intermediate_size=512,
                              num_heads=2, num_kv_heads=1, vocab_size=512)
    model = random_model(presets.Preset(cfg, "LlamaForCausalLM", "narrow 8B"), CPU, torch.bfloat16)
    ids = list(range(0, 500, 7))
    _, logits = prefill(model, ids, torch.bfloat16)
    assert torch.isfinite(logits).all()
    assert 0.1 < logits.float().std() < 10


# Qwen3-30B-A3B and Qwen3-32B as transformers configures them; the presets must read the same
_QWEN3_HF = {
    "qwen3-30b-a3b": ("Qwen3MoeConfig", {
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 40960,
        "rope_theta": 1e6, "rms_norm_eps": 1e-6, "num_experts": 128, "num_experts_per_tok": 8,
        "moe_intermediate_size": 768, "norm_topk_prob": True, "tie_word_embeddings": False}),
    "qwen3-32b": ("Qwen3Config", {
        "vocab_size": 151936, "hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
        "rope_theta": 1e6, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}),
}


@pytest.mark.parametrize("name, parameters", [("qwen3-30b-a3b", 30_532_122_624), ("qwen3-32b", 32_762_123_264)])
def test_qwen3_presets_have_the_published_shape(name, parameters):
    """The shapes Qwen publishes (30.5B and 32.8B parameters), read the same way from the config
    transformers writes, and counted the same by transformers' model on the meta device."""
    transformers = pytest.importorskip("transformers")
    preset = PRESETS[name]
    net = models.for_hf(preset.hf_architecture).model_cls(preset.config, torch.device("meta"), torch.bfloat16)
    assert sum(p.numel() for p in net.parameters()) == parameters
    cls, kwargs = _QWEN3_HF[name]
    hf_config = getattr(transformers, cls)(**kwargs)
    hf_config.architectures = [preset.hf_architecture]
    assert models.for_hf(preset.hf_architecture).config_from_hf(hf_config.to_dict()) == preset.config
    with torch.device("meta"):
        hf_model = getattr(transformers, preset.hf_architecture)(hf_config)
    assert sum(p.numel() for p in hf_model.parameters()) == parameters


def test_qwen3_moe_preset_runs_at_reduced_width():
    """Qwen3-30B-A3B's 128 experts, top-8, head dim 128 and GQA ratio 8, at a width and depth a
    CPU test can afford, in bf16: finite logits of a sane spread."""
    cfg = dataclasses.replace(PRESETS["qwen3-30b-a3b"].config, hidden_size=128, num_layers=4, num_heads=8,
                              num_kv_heads=1, moe_intermediate_size=32, moe_layers=(0, 1, 2, 3), vocab_size=512)
    model = random_model(presets.Preset(cfg, "Qwen3MoeForCausalLM", "narrow 30B-A3B"), CPU, torch.bfloat16)
    assert model.layers[0].experts_gate_up.shape == (128, 64, 128)
    _, logits = prefill(model, list(range(0, 500, 7)), torch.bfloat16)
    assert torch.isfinite(logits).all()
    assert 0.1 < logits.float().std() < 10


def test_same_seed_same_weights():
    a = random_model(PRESETS["tiny-llama"], CPU, torch.float32)
    b = random_model(PRESETS["tiny-llama"], CPU, torch.float32)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert torch.equal(a.layers[0].attn_norm, torch.ones(64))  # norms are ones
    # matrices: normal(0, 1/sqrt(fan_in))
    assert abs(a.layers[0].w_down.std().item() * 160**0.5 - 1) < 0.05


@pytest.fixture(scope="module")
def tiny_engine():
    engine = load_engine("preset:tiny-llama", device="cpu", random_weights=True, kv_cache_gib=0.01)
    engine.start()
    yield engine
    engine.shutdown()


def test_greedy_generation_runs_to_max_tokens(tiny_engine):
    ids = tiny_engine.tokenizer.apply_chat_template([{"role": "user", "content": "Hello there"}])
    params = SamplingParams(max_tokens=24, temperature=0)
    out = tiny_engine.generate_sync(ids, params)
    assert out.finish_reason == "length" and len(out.token_ids) == 24  # no EOS: always runs to max_tokens
    assert all(0 <= t < 512 for t in out.token_ids)
    assert tiny_engine.generate_sync(ids, params).token_ids == out.token_ids  # greedy is deterministic
    assert tiny_engine.model_id == "tiny-llama-random"
    assert tiny_engine.info()["weights"].startswith("random")


def test_presets_need_random_weights():
    with pytest.raises(ValueError, match="--random-weights"):
        load_engine("preset:tiny-llama", device="cpu")
    with pytest.raises(ValueError, match="preset:<name> only"):
        load_engine(None, device="cpu", random_weights=True)
    with pytest.raises(ValueError, match="unknown preset 'nope'.*tiny-llama"):
        load_engine("preset:nope", device="cpu", random_weights=True)


def test_serve_without_random_weights_says_so(capsys):
    assert main(["serve", "--model", "preset:tiny-llama", "--device", "cpu"]) == 1
    assert "add --random-weights" in capsys.readouterr().err


@pytest.mark.parametrize("value, expected", [("1", True), ("true", True), ("0", False), ("off", False)])
def test_random_weights_env_twin(value, expected):
    assert build_parser({"QML_RANDOM_WEIGHTS": value}).parse_args(["serve"]).random_weights is expected
    assert build_parser({"QML_RANDOM_WEIGHTS": value}).parse_args(["serve", "--random-weights"]).random_weights


# --- the stand-in tokenizer -------------------------------------------------------------------

def test_byte_tokenizer_round_trips_text():
    tok = ByteTokenizer(128256)
    text = "Grüße, 東京! \n\ttabs"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id and ids[1:] == list(text.encode("utf-8"))
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(ids).startswith(tok.bos_token)
    assert tok.vocab_size == 128256 and tok.eos_token_ids == frozenset() and tok.eos_token_id is None


def test_byte_tokenizer_chat_rendering():
    tok = ByteTokenizer(512)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok.render_chat(messages) == "system: Be brief.\nuser: Hi\nassistant: "
    assert tok.render_chat(messages, add_generation_prompt=False, enable_thinking=False) == \
        "system: Be brief.\nuser: Hi\n"
    ids = tok.apply_chat_template(messages)
    assert len(ids) == 1 + len(tok.render_chat(messages).encode()) and max(ids) < 512


def test_byte_tokenizer_decodes_every_other_id_to_one_character():
    tok = ByteTokenizer(128256)
    for i in (257, 300, 128255):
        text = tok.decode([i])
        assert len(text) == 1 and text.isprintable()
    assert ByteTokenizer(512).decode([0xC3, 0xA9, 400]) == "é" + ByteTokenizer(512).decode([400])
    with pytest.raises(ValueError):
        ByteTokenizer(256)
