"""Qwen3 (dense) and Qwen3-MoE.

Per layer, as Llama (llama.py), with three differences:
- q and k are RMS-normalised per head (weights ``[Dh]``) after the projection and before RoPE
  (inside ``rope_kv_write``'s launch; two ``rmsnorm`` launches with ``QML_FUSED_QK_NORM=0``);
- the head dim is the config's (128 for every Qwen3 size), not ``D / H``;
- Qwen3-MoE: in ``cfg.moe_layers`` the FFN is a router ``[E, D]`` whose logits pick, per token,
  ``A`` of ``E`` SwiGLU experts (softmax, top-k, renormalised over the chosen ones when
  ``norm_topk_prob``), and the experts' outputs are summed with those weights. The other layers
  (HF ``mlp_only_layers``, or every layer when ``decoder_sparse_step`` skips it) keep a dense FFN.

RoPE rotates halves (pairs ``i, i + Dh/2``) for HF folders and GGUF files alike: llama.cpp runs
``qwen3``/``qwen3moe`` with NeoX-style RoPE, and its converter leaves q/k unpermuted (only the
Llama family is permuted for interleaved pairs).
Shape legend: T tokens, D hidden, H heads, Hkv kv heads, Dh head dim, I ffn dim, E experts, V vocab.
"""

from __future__ import annotations

import dataclasses
import os
import re

import torch
from torch import nn

from qml_kernels.linear import linear
from qml_kernels.moe_fused_norms import PendingCombine, fused_ffn_applies, moe_norm_route
from qml_kernels.moe_gemm import moe_block_size, moe_experts, moe_forward
from qml_kernels.rmsnorm import rmsnorm
from qml_runtime.config import ModelConfig
from qml_runtime.models import llama
from qml_runtime.models.llama import _param

# Fold the per-head q/k norms into rope_kv_write's launch (two launches fewer per layer: a
# Qwen3-30B-A3B decode step went from ~790 launches to 648). On the H200 (2026-12-01, 4 layers of
# the 30B-A3B shapes against transformers) fp32 matched exactly and bf16 stayed within transformers'
# own bf16-vs-fp32 spread; ``QML_FUSED_QK_NORM=0`` brings back the two separate norm launches.
FUSED_QK_NORM = os.environ.get("QML_FUSED_QK_NORM", "1") != "0"


class Qwen3Layer(llama.LlamaLayer):
    def __init__(self, cfg: ModelConfig, sparse: bool, device, dtype):
        nn.Module.__init__(self)
        self.fused_qk_norm = FUSED_QK_NORM
        D, Dh = cfg.hidden_size, cfg.head_dim
        qkv_rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * Dh
        self.sparse = sparse
        self.attn_norm = _param(D, device=device, dtype=dtype)
        self.wqkv = _param(qkv_rows, D, device=device, dtype=dtype)
        self.q_norm = _param(Dh, device=device, dtype=dtype)
        self.k_norm = _param(Dh, device=device, dtype=dtype)
        self.wo = _param(D, cfg.num_heads * Dh, device=device, dtype=dtype)
        self.mlp_norm = _param(D, device=device, dtype=dtype)
        if sparse:
            E, I = cfg.num_experts, cfg.moe_intermediate_size
            self.router = _param(E, D, device=device, dtype=dtype)
            self.experts_gate_up = _param(E, 2 * I, D, device=device, dtype=dtype)  # gate rows, then up rows
            self.experts_down = _param(E, D, I, device=device, dtype=dtype)
        else:
            self.w_gate_up = _param(2 * cfg.intermediate_size, D, device=device, dtype=dtype)
            self.w_down = _param(D, cfg.intermediate_size, device=device, dtype=dtype)

    def split_qkv(self, qkv: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().split_qkv(qkv, cfg)
        if self.fused_qk_norm:
            return q, k, v  # normalised inside rope_kv_write (qk_norms)
        T, H, Hkv, Dh = qkv.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        # each (token, head) row of q and k is normalised on its own: [T·H, Dh] rows
        q = rmsnorm(q.reshape(T * H, Dh), self.q_norm, cfg.rms_eps).view(T, H, Dh)
        k = rmsnorm(k.reshape(T * Hkv, Dh), self.k_norm, cfg.rms_eps).view(T, Hkv, Dh)
        return q, k, v

    def qk_norms(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return (self.q_norm, self.k_norm) if self.fused_qk_norm else (None, None)

    def mlp(self, x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
        """x: [T, D] -> [T, D]."""
        if self.sparse:
            router_logits = linear(x, self.router)  # [T, E]
            return moe_forward(x, router_logits, self.experts_gate_up, self.experts_down,
                               cfg.num_experts_per_tok, cfg.norm_topk_prob)
        return super().mlp(x, cfg)

    def feed_forward(self, h: torch.Tensor, residual: torch.Tensor, cfg: ModelConfig):
        """With ``QML_FUSED_MOE_NORM=1``, a decode-sized MoE layer runs between two fused launches
        (qml_kernels.moe_fused_norms): the residual add, RMSNorm, router and routing in one, the two grouped
        GEMMs, and the combine left for the next norm to take in (a ``PendingCombine``). Off by default (no
        faster on the H200 under PDL); larger batches and dense layers always keep the separate ops."""
        k = cfg.num_experts_per_tok
        if not (self.sparse and fused_ffn_applies(h, self.router, k)):
            return super().feed_forward(h, residual, cfg)
        T, E = h.shape[0], cfg.num_experts
        block = moe_block_size(T * k, E)
        x, residual, weights, _, sorted_pairs, offsets, _ = moe_norm_route(
            h, residual, self.mlp_norm, cfg.rms_eps, self.router, k, cfg.norm_topk_prob, block)
        y = moe_experts(x, self.experts_gate_up, self.experts_down, sorted_pairs, offsets, block, k)  # [T·k, D]
        return PendingCombine(y, weights), residual


class Qwen3Model(llama.LlamaModel):
    """Llama's decoder loop over Qwen3 layers (``split_qkv`` adds the q/k norms, ``mlp`` the experts)."""

    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype):
        super().__init__(cfg, device, dtype)
        Ie = cfg.moe_intermediate_size
        self.shards["experts_gate_up"] = {"gate": slice(0, Ie), "up": slice(Ie, 2 * Ie)}  # rows of each expert

    def make_layer(self, cfg: ModelConfig, index: int, device, dtype) -> nn.Module:
        return Qwen3Layer(cfg, index in set(cfg.moe_layers), device, dtype)


# --- checkpoint formats ---------------------------------------------------------------

GGUF_WEIGHTS = {
    **{pat: target for pat, target in llama.GGUF_WEIGHTS.items() if pat != r"rope_freqs\.weight"},
    r"blk\.(\d+)\.attn_q_norm\.weight": ("layers.{}.q_norm", None),
    r"blk\.(\d+)\.attn_k_norm\.weight": ("layers.{}.k_norm", None),
    r"blk\.(\d+)\.ffn_gate_inp\.weight": ("layers.{}.router", None),
    # experts stacked [E, I, D] / [E, D, I] in the file, as in the model
    r"blk\.(\d+)\.ffn_gate_exps\.weight": ("layers.{}.experts_gate_up", "gate"),
    r"blk\.(\d+)\.ffn_up_exps\.weight": ("layers.{}.experts_gate_up", "up"),
    r"blk\.(\d+)\.ffn_down_exps\.weight": ("layers.{}.experts_down", None),
}

HF_WEIGHTS = {
    **llama.HF_WEIGHTS,
    r"model\.layers\.(\d+)\.self_attn\.q_norm\.weight": ("layers.{}.q_norm", None),
    r"model\.layers\.(\d+)\.self_attn\.k_norm\.weight": ("layers.{}.k_norm", None),
    r"model\.layers\.(\d+)\.mlp\.gate\.weight": ("layers.{}.router", None),
    # one tensor per expert in the file: each fills its slice of the stacked parameter
    r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.gate_proj\.weight": ("layers.{}.experts_gate_up[{}]", "gate"),
    r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.up_proj\.weight": ("layers.{}.experts_gate_up[{}]", "up"),
    r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.down_proj\.weight": ("layers.{}.experts_down[{}]", None),
}

_GGUF_ROUTER = re.compile(r"blk\.(\d+)\.ffn_gate_inp\.weight")


def config_from_gguf(meta: dict, tensor_names: set[str]) -> ModelConfig:
    """``qwen3`` and ``qwen3moe`` files; the layers with a router tensor are the sparse ones."""
    arch = meta["general.architecture"]
    ffn_key, expert_ffn_key = f"{arch}.feed_forward_length", f"{arch}.expert_feed_forward_length"
    if ffn_key not in meta and expert_ffn_key in meta:
        meta = {**meta, ffn_key: meta[expert_ffn_key]}  # an all-MoE file may give only the experts' width
    cfg = dataclasses.replace(llama.config_from_gguf(meta, tensor_names), rope_interleaved=False)
    moe_layers = tuple(sorted(int(m.group(1)) for m in map(_GGUF_ROUTER.fullmatch, tensor_names) if m))
    if not moe_layers:
        return cfg
    missing = [k for k in ("expert_count", "expert_used_count", "expert_feed_forward_length")
               if f"{arch}.{k}" not in meta]
    if missing:
        raise ValueError(f"GGUF metadata lacks {', '.join(f'{arch}.{k}' for k in missing)}")
    return dataclasses.replace(
        cfg,
        num_experts=int(meta[f"{arch}.expert_count"]),
        num_experts_per_tok=int(meta[f"{arch}.expert_used_count"]),
        moe_intermediate_size=int(meta[expert_ffn_key]),
        # llama.cpp always renormalises Qwen3-MoE's top-k weights; newer files may say so explicitly
        norm_topk_prob=bool(meta.get(f"{arch}.expert_weights_norm", True)),
        moe_layers=moe_layers,
    )


def config_from_hf(cfg: dict) -> ModelConfig:
    """``Qwen3ForCausalLM`` and ``Qwen3MoeForCausalLM`` config.json files."""
    base = llama.config_from_hf(cfg)
    num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if not num_experts:
        return base
    step = int(cfg.get("decoder_sparse_step", 1))
    dense = set(cfg.get("mlp_only_layers") or ())
    return dataclasses.replace(
        base,
        num_experts=num_experts,
        num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),  # transformers' default
        moe_layers=tuple(i for i in range(base.num_layers) if i not in dense and (i + 1) % step == 0),
    )
