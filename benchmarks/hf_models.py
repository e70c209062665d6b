"""transformers' side of ``engine_h200.py --sections transformers``: its configs at a preset's
shapes, our weights copied into its Llama, a pair of models with the same random weights, and the
error summary of two sets of logits."""

from __future__ import annotations

import torch

from qml_runtime.config import ModelConfig


def hf_config(cfg: ModelConfig):
    import transformers

    sc = cfg.rope_scaling
    rope = None
    if sc is not None:
        rope = {"rope_type": sc.kind, "factor": sc.factor, "original_max_position_embeddings": sc.original_max_position,
                "low_freq_factor": sc.low_freq_factor, "high_freq_factor": sc.high_freq_factor}
    kw = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
              num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
              num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_eps,
              max_position_embeddings=cfg.context_length, tie_word_embeddings=cfg.tie_word_embeddings,
              rope_theta=cfg.rope_theta, rope_scaling=rope)
    hc = transformers.LlamaConfig(**kw)
    if rope is not None:  # transformers 5 reads rope_parameters; keep theta in it
        hc.rope_parameters = {**rope, "rope_theta": cfg.rope_theta}
    hc._attn_implementation = "sdpa"
    return hc


@torch.no_grad()
def copy_into_hf(ours, hf, cfg: ModelConfig) -> None:
    sd = hf.state_dict()
    q, kv, I = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    sd["model.embed_tokens.weight"].copy_(ours.embed)
    sd["model.norm.weight"].copy_(ours.norm)
    sd["lm_head.weight"].copy_(ours.embed if ours.lm_head is None else ours.lm_head)
    for i, layer in enumerate(ours.layers):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"].copy_(layer.wqkv[:q])
        sd[p + "self_attn.k_proj.weight"].copy_(layer.wqkv[q:q + kv])
        sd[p + "self_attn.v_proj.weight"].copy_(layer.wqkv[q + kv:])
        sd[p + "self_attn.o_proj.weight"].copy_(layer.wo)
        sd[p + "input_layernorm.weight"].copy_(layer.attn_norm)
        sd[p + "post_attention_layernorm.weight"].copy_(layer.mlp_norm)
        sd[p + "mlp.gate_proj.weight"].copy_(layer.w_gate_up[:I])
        sd[p + "mlp.up_proj.weight"].copy_(layer.w_gate_up[I:])
        sd[p + "mlp.down_proj.weight"].copy_(layer.w_down)


def compare(ours: torch.Tensor, theirs: torch.Tensor) -> dict:
    """ours, theirs: [N, V] fp32 -> error summary."""
    rel = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    cos = torch.nn.functional.cosine_similarity(ours, theirs, dim=-1)
    top1 = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    return {"max_rel_diff": round(rel, 5), "min_cosine": round(cos.min().item(), 6), "top1_agree": round(top1, 4)}


def qwen3_hf_config(cfg: ModelConfig):
    import transformers

    kw = {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
          "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
          "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_eps,
          "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.context_length,
          "tie_word_embeddings": cfg.tie_word_embeddings}
    if cfg.num_experts:
        kw |= {"num_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
               "moe_intermediate_size": cfg.moe_intermediate_size, "norm_topk_prob": cfg.norm_topk_prob,
               "decoder_sparse_step": 1,
               "mlp_only_layers": [i for i in range(cfg.num_layers) if i not in cfg.moe_layers]}
        hc = transformers.Qwen3MoeConfig(**kw)
    else:
        hc = transformers.Qwen3Config(**kw)
    hc.rope_parameters = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    hc._attn_implementation = "sdpa"
    return hc


def hf_pair(args, device, dtype):
    """(our model, transformers' model) with the same random weights at the preset's shapes
    (``--layers`` keeps the first N layers, for models two copies of which do not fit)."""
    import dataclasses

    import transformers

    from qml_runtime import models
    from qml_runtime.presets import PRESETS, random_model
    from qml_runtime.weights.hf import HFFolder
    from qml_runtime.weights.loading import load_weights

    preset = PRESETS[args.preset]
    cfg = preset.config
    if args.layers:
        cfg = dataclasses.replace(cfg, num_layers=args.layers,
                                  moe_layers=tuple(i for i in cfg.moe_layers if i < args.layers))
    if preset.hf_architecture == "LlamaForCausalLM":
        ours = random_model(dataclasses.replace(preset, config=cfg), device, dtype)
        # built in the target dtype (not converted after: .to(bf16) would round RoPE's fp32 inverse
        # frequencies, which transformers computes in fp32 explicitly)
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                hf = transformers.LlamaForCausalLM(hf_config(cfg)).eval()
        finally:
            torch.set_default_dtype(torch.float32)
        assert hf.model.rotary_emb.inv_freq.dtype == torch.float32
        copy_into_hf(ours, hf, cfg)
        return ours, hf, cfg
    # other architectures: transformers' own random weights, through a checkpoint folder (its
    # in-memory expert layout differs from the files'), loaded by our HF loader
    import tempfile

    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            hf = getattr(transformers, preset.hf_architecture)(qwen3_hf_config(cfg)).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    with torch.no_grad():  # transformers' init (std 0.02) would leave 1e-6 logits: unit-RMS activations instead
        for name, p in hf.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, p.shape[-1] ** -0.5)
    folder = tempfile.mkdtemp(prefix="qml-hf-")
    hf.save_pretrained(folder, safe_serialization=True)
    arch = models.for_hf(preset.hf_architecture)
    ours = arch.model_cls(cfg, device, dtype)
    load_weights(ours, HFFolder(folder), arch.hf_weights, progress=False)
    return ours, hf, cfg
