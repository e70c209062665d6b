"""Llama (and the many models shaped like it: SmolLM2, Mistral, ...).

Per layer: RMSNorm -> fused QKV projection -> RoPE -> paged causal GQA attention ->
output projection -> residual; RMSNorm -> fused gate-up projection -> SwiGLU ->
down projection -> residual. The residual add is fused into the next RMSNorm.
Shape legend: T tokens, D hidden, H heads, Hkv kv heads, Dh head dim, I ffn dim, V vocab.
"""

from __future__ import annotations

import torch
from torch import nn

from qml_kernels.activations import swiglu
from qml_kernels.attention import AttentionMetadata, paged_attention
from qml_kernels.attention_cudnn import query_slack_rows
from qml_kernels.linear import linear
from qml_kernels.moe_fused_norms import combine_add_rmsnorm
from qml_kernels.rmsnorm import add_rmsnorm, rmsnorm
from qml_kernels.rope import RopeScaling, rope_cos_sin, rope_inv_freq
from qml_kernels.rope_kv_write import rope_kv_write
from qml_runtime.config import ModelConfig
from qml_runtime.kv.cache import KVCache


def _param(*shape: int, device, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype), requires_grad=False)


class LlamaLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, device, dtype):
        super().__init__()
        D, Dh = cfg.hidden_size, cfg.head_dim
        qkv_rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * Dh
        self.attn_norm = _param(D, device=device, dtype=dtype)
        self.wqkv = _param(qkv_rows, D, device=device, dtype=dtype)
        self.wo = _param(D, cfg.num_heads * Dh, device=device, dtype=dtype)
        self.mlp_norm = _param(D, device=device, dtype=dtype)
        self.w_gate_up = _param(2 * cfg.intermediate_size, D, device=device, dtype=dtype)
        self.w_down = _param(D, cfg.intermediate_size, device=device, dtype=dtype)

    def split_qkv(self, qkv: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fused projection [T, (H + 2Hkv) Dh] -> q [T, H, Dh], k, v [T, Hkv, Dh] (views of it)."""
        T, H, Hkv, Dh = qkv.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q, k, v = qkv.split([H * Dh, Hkv * Dh, Hkv * Dh], dim=-1)
        return q.view(T, H, Dh), k.view(T, Hkv, Dh), v.view(T, Hkv, Dh)

    def qk_norms(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Per-head q/k RMSNorm weights for ``rope_kv_write`` to apply before it rotates (none here)."""
        return None, None

    def mlp(self, x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
        """x: [T, D] -> [T, D]."""
        return linear(swiglu(linear(x, self.w_gate_up)), self.w_down)

    def feed_forward(self, h: torch.Tensor, residual: torch.Tensor, cfg: ModelConfig):
        """The attention's output h and the residual stream -> (the FFN's output, the new residual): the
        residual add and RMSNorm, then ``mlp``. The output may be a ``PendingCombine`` (qwen3.py), which the
        next norm takes in (``combine_add_rmsnorm``)."""
        x, residual = add_rmsnorm(h, residual, self.mlp_norm, cfg.rms_eps)
        return self.mlp(x, cfg), residual


class LlamaModel(nn.Module):
    """The decoder loop shared by the Llama family and the models that differ from it only inside
    a layer (qwen3.py: per-head q/k norms, experts): they give their own layers."""

    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        D, V = cfg.hidden_size, cfg.vocab_size
        self.embed = _param(V, D, device=device, dtype=dtype)
        self.layers = nn.ModuleList(self.make_layer(cfg, i, device, dtype) for i in range(cfg.num_layers))
        self.norm = _param(D, device=device, dtype=dtype)
        self.lm_head = None if cfg.tie_word_embeddings else _param(V, D, device=device, dtype=dtype)
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        I = cfg.intermediate_size
        self.shards = {
            "wqkv": {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv)},
            "w_gate_up": {"gate": slice(0, I), "up": slice(I, 2 * I)},
        }
        # llama3-style GGUFs carry per-frequency divisors (rope_freqs.weight) instead of metadata
        self.register_buffer("rope_freq_divisors", torch.ones(cfg.rotary_dim // 2, device=device), persistent=False)
        self._inv_freq: tuple[torch.Tensor, float] | None = None

    def make_layer(self, cfg: ModelConfig, index: int, device, dtype) -> nn.Module:
        return LlamaLayer(cfg, device, dtype)

    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._inv_freq is None:
            inv_freq, scale = rope_inv_freq(self.cfg.rotary_dim, self.cfg.rope_theta, self.cfg.rope_scaling)
            self._inv_freq = (inv_freq.to(positions.device) / self.rope_freq_divisors.float(), scale)
        return rope_cos_sin(positions, *self._inv_freq)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] -> final-normed hidden states [T, D]."""
        cfg = self.cfg
        T = input_ids.shape[0]
        H, Dh = cfg.num_heads, cfg.head_dim
        cos, sin = self.rope_tables(positions)  # [T, R/2]
        scale = Dh**-0.5
        h = self.embed[input_ids]  # [T, D]
        residual = None
        # a long prompt's rotated q goes to a buffer with rows to spare after it: cuDNN attends each prompt at
        # its length rounded up to a bucket and reads the padded rows there instead of from a copy
        slack = query_slack_rows(meta) if h.is_cuda else 0
        for i, layer in enumerate(self.layers):
            if residual is None:
                x, residual = rmsnorm(h, layer.attn_norm, cfg.rms_eps), h
            else:
                x, residual = combine_add_rmsnorm(h, residual, layer.attn_norm, cfg.rms_eps)
            q, k, v = layer.split_qkv(linear(x, layer.wqkv), cfg)  # [T, H, Dh], [T, Hkv, Dh] x 2
            k_cache, v_cache = kv.layer(i)
            # one launch: q rotates in place (inside the fused qkv buffer for Llama) or into the buffer with
            # slack, rotated k and v go to their cache slots
            q_norm, k_norm = layer.qk_norms()
            q_out = q.new_empty((T + slack, H, Dh))[:T] if slack else q
            rope_kv_write(q, k, v, cos, sin, k_cache, v_cache, meta.slot_mapping, cfg.rope_interleaved, out=q_out,
                          q_norm=q_norm, k_norm=k_norm, norm_eps=cfg.rms_eps)
            q = q_out
            o = paged_attention(q, k_cache, v_cache, meta, scale)  # [T, H, Dh]
            h = linear(o.reshape(T, H * Dh), layer.wo)  # [T, D]
            h, residual = layer.feed_forward(h, residual, cfg)  # [T, D], or a MoE layer's PendingCombine
        out, _ = combine_add_rmsnorm(h, residual, self.norm, cfg.rms_eps)
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [B, D] -> logits [B, V] in fp32."""
        head = self.embed if self.lm_head is None else self.lm_head
        return linear(hidden, head).float()


# --- checkpoint formats ---------------------------------------------------------------

GGUF_WEIGHTS = {
    r"token_embd\.weight": ("embed", None),
    r"output_norm\.weight": ("norm", None),
    r"output\.weight": ("lm_head", None),
    r"rope_freqs\.weight": ("rope_freq_divisors", None),
    r"blk\.(\d+)\.attn_norm\.weight": ("layers.{}.attn_norm", None),
    r"blk\.(\d+)\.attn_q\.weight": ("layers.{}.wqkv", "q"),
    r"blk\.(\d+)\.attn_k\.weight": ("layers.{}.wqkv", "k"),
    r"blk\.(\d+)\.attn_v\.weight": ("layers.{}.wqkv", "v"),
    r"blk\.(\d+)\.attn_output\.weight": ("layers.{}.wo", None),
    r"blk\.(\d+)\.ffn_norm\.weight": ("layers.{}.mlp_norm", None),
    r"blk\.(\d+)\.ffn_gate\.weight": ("layers.{}.w_gate_up", "gate"),
    r"blk\.(\d+)\.ffn_up\.weight": ("layers.{}.w_gate_up", "up"),
    r"blk\.(\d+)\.ffn_down\.weight": ("layers.{}.w_down", None),
}

HF_WEIGHTS = {
    r"model\.embed_tokens\.weight": ("embed", None),
    r"model\.norm\.weight": ("norm", None),
    r"lm_head\.weight": ("lm_head", None),
    r"model\.layers\.(\d+)\.input_layernorm\.weight": ("layers.{}.attn_norm", None),
    r"model\.layers\.(\d+)\.self_attn\.q_proj\.weight": ("layers.{}.wqkv", "q"),
    r"model\.layers\.(\d+)\.self_attn\.k_proj\.weight": ("layers.{}.wqkv", "k"),
    r"model\.layers\.(\d+)\.self_attn\.v_proj\.weight": ("layers.{}.wqkv", "v"),
    r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight": ("layers.{}.wo", None),
    r"model\.layers\.(\d+)\.post_attention_layernorm\.weight": ("layers.{}.mlp_norm", None),
    r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight": ("layers.{}.w_gate_up", "gate"),
    r"model\.layers\.(\d+)\.mlp\.up_proj\.weight": ("layers.{}.w_gate_up", "up"),
    r"model\.layers\.(\d+)\.mlp\.down_proj\.weight": ("layers.{}.w_down", None),
}


def config_from_gguf(meta: dict, tensor_names: set[str]) -> ModelConfig:
    arch = meta["general.architecture"]

    def get(key, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        return value

    D, H = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", D // H))
    scaling = None
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in ("linear", "yarn"):
        scaling = RopeScaling(kind, float(get("rope.scaling.factor")),
                              int(meta.get(f"{arch}.rope.scaling.original_context_length", 0)),
                              beta_fast=float(meta.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
                              beta_slow=float(meta.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"])
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=D,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=H,
        num_kv_heads=int(get("attention.head_count_kv", H)),
        head_dim=head_dim,
        rotary_dim=int(meta.get(f"{arch}.rope.dimension_count", head_dim)),
        rms_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rope_interleaved=True,
        context_length=int(get("context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
    )


def rope_scaling_from_hf(cfg: dict) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from either the older rope_theta/rope_scaling keys or rope_parameters."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return theta, None
    return theta, RopeScaling(
        kind=kind,
        factor=float(params["factor"]),
        original_max_position=int(params.get("original_max_position_embeddings", 0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        beta_fast=float(params.get("beta_fast", 32.0)),
        beta_slow=float(params.get("beta_slow", 1.0)),
        truncate=bool(params.get("truncate", True)),
        attention_factor=params.get("attention_factor"),
    )


def config_from_hf(cfg: dict) -> ModelConfig:
    D, H = cfg["hidden_size"], cfg["num_attention_heads"]
    theta, scaling = rope_scaling_from_hf(cfg)
    head_dim = cfg.get("head_dim") or D // H
    return ModelConfig(
        architecture=cfg.get("model_type", "llama"),
        vocab_size=cfg["vocab_size"],
        hidden_size=D,
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=H,
        num_kv_heads=cfg.get("num_key_value_heads") or H,
        head_dim=head_dim,
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        rope_interleaved=False,
        context_length=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )
