"""Prefill attention through cuDNN (torch's SDPA cuDNN backend), for the batches it covers.

cuDNN's fused attention reaches ~580-610 TFLOP/s on the H200 on long prompts where our
Triton kernel reaches ~320-350 (benchmarks/results/engine-h200-llama-3.1-8b-2026-11-30.md,
Llama-3.1-8B heads: 1.11 vs 2.00 ms per layer at 8,892 tokens, 9.67 vs 16.98 ms at 26,926), so
a long fresh prompt (no cached context: every query row's sequence has ``n_q == L``) goes to
it. Below ~4k tokens a call costs a fixed ~0.2 ms (0.19-0.21 ms from 133 to 2,340 tokens, where
Triton takes 0.05-0.20; an earlier run the same day measured ~0.3 ms), so short prompts stay
with Triton (``CUDNN_MIN_TOKENS``). What
torch's SDPA API cannot express stays with the Triton kernel: queries over cached pages
(chunked prefill, prefix hits, decode rows), sliding windows, sinks and soft-capping.

Each sequence's K/V are gathered from its pages into one contiguous run (2 L Hkv Dh
elements, a few microseconds next to the O(L^2) attention) and attended with
``is_causal=True``; GQA goes to cuDNN as is (``enable_gqa``), without repeating K/V.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from qml_kernels.attention import AttentionMetadata


CUDNN_MIN_TOKENS = 4096  # the longest prompt of the batch; the crossover lies between 2,340 and 8,892


@functools.cache
def cudnn_sdpa_works(device_index: int) -> bool:
    """One tiny causal GQA call on the cuDNN backend: the build may lack it, or reject the shapes."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        dev = torch.device("cuda", device_index)
        q = torch.randn(1, 4, 64, 128, device=dev, dtype=torch.bfloat16)
        kv = torch.randn(1, 2, 64, 128, device=dev, dtype=torch.bfloat16)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
        return True
    except Exception:  # RuntimeError when no kernel applies; anything else is the same answer
        return False


def is_fresh_prefill(meta: AttentionMetadata) -> bool:
    """Every sequence computes all of its tokens in this step (no cached context), more than one."""
    cu = meta.cu_seqlens_q_host
    return all(cu[b + 1] - cu[b] == L and L > 1 for b, L in enumerate(meta.context_lens_host))


def supported(q, k_cache, v_cache, meta, scale, sliding_window=None, sinks=None, softcap=None, out=None) -> bool:
    return (q.is_cuda and q.dim() == 3 and q.dtype in (torch.bfloat16, torch.float16)
            and k_cache.dtype == v_cache.dtype == q.dtype and q.shape[2] % 8 == 0 and q.shape[2] <= 128
            and q.shape[1] % k_cache.shape[2] == 0 and q.shape[2] == k_cache.shape[3]
            and sliding_window is None and sinks is None and softcap is None
            and max(meta.context_lens_host) >= CUDNN_MIN_TOKENS and is_fresh_prefill(meta)
            and cudnn_sdpa_works(q.device.index or 0))


def paged_prefill_attention_cudnn(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  meta: AttentionMetadata, scale: float, sliding_window: int | None = None,
                                  sinks: torch.Tensor | None = None, softcap: float | None = None,
                                  out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, H, Dh] (fresh prompts only, see ``supported``) -> out [T, H, Dh]."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    assert sliding_window is None and sinks is None and softcap is None, "cuDNN SDPA: no window/sinks/softcap"
    assert is_fresh_prefill(meta), "cuDNN SDPA serves fresh prompts only (no cached context)"
    out = torch.empty_like(q) if out is None else out
    S, Hkv, Dh = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    cu = meta.cu_seqlens_q_host
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        for b, L in enumerate(meta.context_lens_host):
            pages = meta.block_tables[b, : -(-L // S)]
            k = k_cache[pages].reshape(-1, Hkv, Dh)[:L]  # [L, Hkv, Dh], gathered page by page
            v = v_cache[pages].reshape(-1, Hkv, Dh)[:L]
            qb = q[cu[b]:cu[b + 1]].transpose(0, 1).unsqueeze(0)  # [1, H, L, Dh]
            o = F.scaled_dot_product_attention(qb, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                                               is_causal=True, scale=scale, enable_gqa=True)
            out[cu[b]:cu[b + 1]] = o[0].transpose(0, 1)
    return out
