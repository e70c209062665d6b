"""Qwen3 and Qwen3-MoE against transformers' own models, with the same random weights, in fp32.

Tiny configs, random weights (norms near 1, matrices of unit gain), written as a Hugging Face
folder by ``save_pretrained`` (one tensor per expert, as the real checkpoints) and as a GGUF
file (experts stacked), then loaded by qml. Logits are compared by max |diff| relative to the
logits' max |value|, bound 1e-4: the same weights in fp32, so only summation order differs.
With random router weights the top-k choices have clear margins, so both pick the same experts.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from qml_kernels import registry
from qml_kernels.attention import AttentionMetadata
from qml_runtime import models
from qml_runtime.kv.cache import KVCache
from qml_runtime.loader import load_engine
from qml_runtime.models.qwen3 import Qwen3Model
from qml_runtime.sampling_params import SamplingParams
from qml_runtime.weights.gguf import GGUFFile
from qml_runtime.weights.hf import HFFolder
from qml_runtime.weights.loading import WeightLoadError, load_weights

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

REL_TOL = 1e-4
VOCAB = 160
CPU = torch.device("cpu")

# name -> (HF config class, its arguments, the layers that must have experts)
CONFIGS = {
    # head_dim 32 with hidden 64 and 4 heads (not D/H = 16), tied embeddings as the small Qwen3s
    "qwen3": ("Qwen3Config", {"intermediate_size": 96, "tie_word_embeddings": True}, ()),
    # 7 experts (prime), top-3, renormalised; layer 1 dense (mlp_only_layers)
    "qwen3-moe": ("Qwen3MoeConfig", {"intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 7,
                                     "num_experts_per_tok": 3, "norm_topk_prob": True, "mlp_only_layers": [1]},
                  (0, 2)),
    # experts every second layer, top-2 of 5, the chosen probabilities used as they are
    "qwen3-moe-step2": ("Qwen3MoeConfig", {"intermediate_size": 80, "moe_intermediate_size": 24, "num_experts": 5,
                                           "num_experts_per_tok": 2, "norm_topk_prob": False,
                                           "decoder_sparse_step": 2},
                        (1,)),
}
COMMON = {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
          "max_position_embeddings": 512}


def _hf_model(name: str):
    cls, extra, _ = CONFIGS[name]
    torch.manual_seed(sum(map(ord, name)))
    model = getattr(transformers, cls.replace("Config", "ForCausalLM"))(getattr(transformers, cls)(**COMMON, **extra))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norms: near one, but not exactly (a wrong norm must show)
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:  # unit gain whatever the fan-in; the router's logits of order 1
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return model.eval()


def _write_tokenizer(folder) -> None:
    """A word-level tokenizer with one word per model id (``w0`` ... ``w159``)."""
    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": None, "eos_token": None}))


@pytest.fixture(scope="module", params=list(CONFIGS))
def hf(request, tmp_path_factory):
    """(name, transformers model, HF folder written by save_pretrained)."""
    model = _hf_model(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder, safe_serialization=True)
    _write_tokenizer(folder)
    return request.param, model, folder


def prefill_logits(model, token_ids: list[int], page_size: int = 4) -> torch.Tensor:
    """Logits at every position of one sequence, through a private paged KV cache: [T, V]."""
    T = len(token_ids)
    pages = -(-T // page_size)
    kv = KVCache(model.cfg, pages, page_size, CPU, torch.float32)
    # pages in reverse order, so a wrong page lookup cannot pass by accident
    table = list(reversed(range(pages)))
    slots = [table[p // page_size] * page_size + p % page_size for p in range(T)]
    meta = AttentionMetadata.build(slots, [table], [0, T], [T], CPU)
    with torch.inference_mode():
        return model.logits(model(torch.tensor(token_ids), torch.arange(T), kv, meta))


def _hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def _rel(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    assert ours.shape == theirs.shape and torch.isfinite(ours).all()
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


def _load_folder(folder) -> Qwen3Model:
    source = HFFolder(folder)
    arch = models.for_hf(source.architecture)
    net = arch.model_cls(arch.config_from_hf(source.config), CPU, torch.float32)
    ignore = (r"lm_head\.weight",) if net.cfg.tie_word_embeddings else ()
    load_weights(net, source, arch.hf_weights, ignore=ignore, progress=False)
    return net


PROMPT = [3, 141, 59, 26, 53, 58, 97, 93, 23, 84, 62, 64, 33, 8, 32, 79, 50, 28, 88, 41, 97, 16, 9]  # 23 tokens


def test_config_from_hf_folder(hf):
    name, hf_model, folder = hf
    cfg = _load_folder(folder).cfg
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (64, 4, 2, 32)
    assert cfg.moe_layers == CONFIGS[name][2] and not cfg.rope_interleaved
    if cfg.moe_layers:
        hc = hf_model.config
        assert (cfg.num_experts, cfg.num_experts_per_tok) == (hc.num_experts, hc.num_experts_per_tok)
        assert (cfg.moe_intermediate_size, cfg.norm_topk_prob) == (hc.moe_intermediate_size, hc.norm_topk_prob)
    # transformers agrees on which layers have experts
    sparse = tuple(i for i, layer in enumerate(hf_model.model.layers) if hasattr(layer.mlp, "experts"))
    assert sparse == cfg.moe_layers


def test_logits_match_transformers(hf):
    name, hf_model, folder = hf
    rel = _rel(prefill_logits(_load_folder(folder), PROMPT), _hf_logits(hf_model, PROMPT))
    assert rel < REL_TOL, f"{name}: max relative logit difference {rel:.2e}"


def test_single_token(hf):
    """One token: every expert but the top-k gets no work."""
    name, hf_model, folder = hf
    rel = _rel(prefill_logits(_load_folder(folder), [77]), _hf_logits(hf_model, [77]))
    assert rel < REL_TOL, f"{name}: {rel:.2e}"


def test_moe_kernels_in_the_model_match_transformers(hf):
    """The model with its MoE ops forced to Triton (the interpreter on CPU)."""
    name, hf_model, folder = hf
    if not CONFIGS[name][2]:
        pytest.skip("dense model: no experts")
    with registry.using(moe_router="triton", moe_align="triton", moe_gemm="triton", moe_combine="triton"):
        ours = prefill_logits(_load_folder(folder), PROMPT[:9])
    rel = _rel(ours, _hf_logits(hf_model, PROMPT[:9]))
    assert rel < REL_TOL, f"{name}: {rel:.2e}"


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_moe_decode_path_with_fused_norms_matches_transformers(hf, monkeypatch, impl):
    """Up to four tokens a MoE layer runs between the fused entry (norm, router, routing) and exit (combine,
    next norm) of ``qml_kernels.moe_fused_norms``: with the references it equals the separate ops bit for bit
    (the references are their compositions), with the Triton kernels (interpreter) it matches transformers."""
    from qml_kernels import moe_fused_norms

    name, hf_model, folder = hf
    if not CONFIGS[name][2]:
        pytest.skip("dense model: no experts")
    model = _load_folder(folder)
    calls = []
    real = moe_fused_norms.moe_norm_route
    monkeypatch.setattr("qml_runtime.models.qwen3.moe_norm_route", lambda *a: calls.append(a) or real(*a))
    ops = ("moe_norm_route", "moe_combine_rmsnorm", "moe_gemm")
    with registry.using(**dict.fromkeys(ops, impl)):
        for prompt in ([77], PROMPT[:3]):
            monkeypatch.setattr(moe_fused_norms, "FUSED_MOE_NORM", True)
            fused = prefill_logits(model, prompt)
            monkeypatch.setattr(moe_fused_norms, "FUSED_MOE_NORM", False)
            separate = prefill_logits(model, prompt)
            if impl == "reference":
                assert torch.equal(fused, separate), f"{name} ({len(prompt)} tokens)"
            rel = _rel(fused, _hf_logits(hf_model, prompt))
            assert rel < REL_TOL, f"{name} {impl} ({len(prompt)} tokens): {rel:.2e}"
    assert len(calls) == 2 * len(CONFIGS[name][2]), "the fused entry ran once per MoE layer and prompt"


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_qk_norms_folded_or_not_match_transformers(hf, monkeypatch, impl, fused):
    """``QML_FUSED_QK_NORM``: the per-head q/k norms applied inside ``rope_kv_write`` (the default)
    or by two ``rmsnorm`` launches, with the reference and the Triton kernels (interpreter), over
    23 tokens and over one."""
    from qml_runtime.models import qwen3

    name, hf_model, folder = hf
    monkeypatch.setattr(qwen3, "FUSED_QK_NORM", fused)
    model = _load_folder(folder)
    assert all(layer.fused_qk_norm is fused for layer in model.layers)
    with registry.using(rope_kv_write=impl, rmsnorm=impl):
        for prompt in (PROMPT, [77]):
            rel = _rel(prefill_logits(model, prompt), _hf_logits(hf_model, prompt))
            assert rel < REL_TOL, f"{name} {impl} fused={fused} ({len(prompt)} tokens): {rel:.2e}"


def test_engine_from_folder_generates_as_transformers(hf):
    """load_engine on the folder; greedy decoding through the paged cache equals transformers' generate."""
    name, hf_model, folder = hf
    engine = load_engine(str(folder), device="cpu", kv_cache_gib=0.01, progress=False)
    assert engine.info()["parameters"] == sum(p.numel() for p in hf_model.parameters())  # a tied head once
    engine.start()
    try:
        ours = engine.generate_sync(PROMPT[:11], SamplingParams(max_tokens=10, temperature=0.0)).token_ids
    finally:
        engine.shutdown()
    with torch.inference_mode():
        theirs = hf_model.generate(torch.tensor([PROMPT[:11]]), max_new_tokens=10, do_sample=False)[0, 11:].tolist()
    assert ours == theirs, name


class _Edited:
    """An HF folder with some tensors hidden and others renamed."""

    def __init__(self, folder, hide=(), rename=None):
        self.inner, self.hide, self.rename = HFFolder(folder), set(hide), dict(rename or {})

    def names(self):
        return [self.rename.get(n, n) for n in self.inner.names() if n not in self.hide]

    def load(self, name, dtype, device):
        original = {v: k for k, v in self.rename.items()}.get(name, name)
        return self.inner.load(original, dtype, device)


def test_every_expert_slice_must_be_written(tmp_path):
    """A stacked expert parameter is complete only when every expert's tensors arrived; an expert
    index past the stack is named."""
    hf_model = _hf_model("qwen3-moe")
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    arch = models.for_hf("Qwen3MoeForCausalLM")
    cfg = arch.config_from_hf(HFFolder(tmp_path).config)
    up = "model.layers.2.mlp.experts.6.up_proj.weight"
    with pytest.raises(WeightLoadError, match=r"does not provide: layers\.2\.experts_gate_up"):
        load_weights(Qwen3Model(cfg, CPU, torch.float32), _Edited(tmp_path, hide=[up]), arch.hf_weights,
                     progress=False)
    with pytest.raises(WeightLoadError, match=r"experts_gate_up\[7\], past .* 7 slices"):
        load_weights(Qwen3Model(cfg, CPU, torch.float32), _Edited(tmp_path, rename={up: up.replace(".6.", ".7.")}),
                     arch.hf_weights, progress=False)


# -- GGUF ------------------------------------------------------------------------------------

def _write_gguf(path, name: str, hf_model) -> None:
    """The transformers model as a GGUF file, named and shaped as llama.cpp writes qwen3/qwen3moe."""
    gguf = pytest.importorskip("gguf")
    cfg = hf_model.config
    moe = CONFIGS[name][0] == "Qwen3MoeConfig"
    arch = "qwen3moe" if moe else "qwen3"
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in {"block_count": cfg.num_hidden_layers, "context_length": cfg.max_position_embeddings,
                       "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
                       "attention.head_count": cfg.num_attention_heads,
                       "attention.head_count_kv": cfg.num_key_value_heads,
                       "attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
                       "vocab_size": VOCAB}.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.rope.freq_base", 1e6)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    if moe:
        w.add_uint32(f"{arch}.expert_count", cfg.num_experts)
        w.add_uint32(f"{arch}.expert_used_count", cfg.num_experts_per_tok)
        w.add_uint32(f"{arch}.expert_feed_forward_length", cfg.moe_intermediate_size)
        if not cfg.norm_topk_prob:  # llama.cpp's Qwen3-MoE files leave it out: renormalised is the default
            w.add_bool(f"{arch}.expert_weights_norm", False)
    names = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
             "input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
             "self_attn.q_proj.weight": "attn_q", "self_attn.k_proj.weight": "attn_k",
             "self_attn.v_proj.weight": "attn_v", "self_attn.o_proj.weight": "attn_output",
             "self_attn.q_norm.weight": "attn_q_norm", "self_attn.k_norm.weight": "attn_k_norm",
             "mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up", "mlp.down_proj.weight": "ffn_down",
             "mlp.gate.weight": "ffn_gate_inp", "mlp.experts.down_proj": "ffn_down_exps"}
    for key, tensor in hf_model.state_dict().items():
        if key == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                w.add_tensor("output.weight", tensor.numpy())
            continue
        key = key.removeprefix("model.")
        if not key.startswith("layers."):
            w.add_tensor(names[key], tensor.numpy())
            continue
        _, layer, rest = key.split(".", 2)
        if rest == "mlp.experts.gate_up_proj":  # [E, 2I, D]: gate rows then up rows, stored apart in GGUF
            gate, up = tensor.chunk(2, dim=1)
            w.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(gate.numpy()))
            w.add_tensor(f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(up.numpy()))
        else:
            w.add_tensor(f"blk.{layer}.{names[rest]}.weight", np.ascontiguousarray(tensor.numpy()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_file_matches_transformers(hf, tmp_path):
    name, hf_model, _ = hf
    path = tmp_path / f"{name}.gguf"
    _write_gguf(path, name, hf_model)
    source = GGUFFile(path)
    arch = models.for_gguf(source.architecture)
    cfg = arch.config_from_gguf(source.metadata, set(source.tensors))
    assert cfg.moe_layers == CONFIGS[name][2] and not cfg.rope_interleaved
    assert cfg.norm_topk_prob == bool(getattr(hf_model.config, "norm_topk_prob", True))
    net = arch.model_cls(cfg, CPU, torch.float32)
    load_weights(net, source, arch.gguf_weights, progress=False)
    rel = _rel(prefill_logits(net, PROMPT), _hf_logits(hf_model, PROMPT))
    assert rel < REL_TOL, f"{name}: max relative logit difference {rel:.2e}"
