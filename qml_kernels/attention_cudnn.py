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

Lengths in buckets: torch builds (and caches) a cuDNN graph per shape, and a build costs
45-76 ms on the H200 (``benchmarks/cudnn_lengths_h200.py``, 2026-12-04: 70 ms at 8,890 tokens,
69 ms at 8,891 right after it, 76 ms at 26,900), against ~1.1 ms a layer for the attention
itself at 8,890. Served, every long prompt of a length not seen before paid it, and real
prompts rarely repeat a length. So each sequence is attended at its length rounded up to
``CUDNN_BUCKET`` tokens (default 128): the padded query rows come after the real ones and the
padded keys after the real keys, so with a causal mask a real row sees exactly the keys it saw
before and its output is unchanged (bit for bit on the H200: the check in the same script);
the padded rows' outputs are dropped. The padded keys are zeros; the padded query rows are
whatever follows the sequence's rows in q's storage (the next sequence's rows, or the slack
the model allocates after the last one: ``query_slack_rows``), or a padded copy when q's
storage ends first. The price: up to ``CUDNN_BUCKET - 1`` more rows of attention (1.6% more at
8,890 tokens with the default, 0.8% at 26,900), against one build per bucket and process.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from qml_kernels.attention import AttentionMetadata


CUDNN_MIN_TOKENS = 4096  # the longest prompt of the batch; the crossover lies between 2,340 and 8,892
# sequences are attended at their length rounded up to a multiple of this (one cuDNN graph per bucket, not
# per length: see the module docstring); QML_CUDNN_BUCKET=1 attends at the exact lengths
CUDNN_BUCKET = max(1, int(os.environ.get("QML_CUDNN_BUCKET", "128")))


def padded_length(L: int, bucket: int | None = None) -> int:
    """The length a sequence of ``L`` tokens is attended at: ``L`` rounded up to the bucket."""
    bucket = CUDNN_BUCKET if bucket is None else bucket
    return -(-L // bucket) * bucket


def query_slack_rows(meta: AttentionMetadata) -> int:
    """Rows a model may allocate after a step's query rows so that the last sequence's padded rows can be read
    in place (no copy of q): none for steps this path does not take. Those keep q where the projection put it:
    a chunk over cached context of 4,096+ rows read the slack buffer, whose token stride is another than the
    fused QKV projection's, and so another of ``attention_chunk``'s graphs (built on a served step, ~70 ms)."""
    fresh = max(meta.context_lens_host, default=0) >= CUDNN_MIN_TOKENS and is_fresh_prefill(meta)
    return CUDNN_BUCKET - 1 if fresh else 0


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


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """[1, H, L, Dh] x [1, Hkv, L, Dh] x 2 -> [1, H, L, Dh]: causal, on cuDNN (tests swap in another backend)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)


def _padded_rows(t: torch.Tensor, start: int, rows: int, real: int) -> torch.Tensor:
    """``rows`` rows of ``t`` [N, ...] from ``start``, the first ``real`` of them t's own: a view when t's
    storage holds them all (the rows past ``real`` are whatever lies there), else a copy padded with zeros."""
    needed = t.storage_offset() + (start + rows - 1) * t.stride(0) + sum((n - 1) * st for n, st in
                                                                         zip(t.shape[1:], t.stride()[1:])) + 1
    if needed * t.element_size() <= t.untyped_storage().nbytes():
        return t.as_strided((rows, *t.shape[1:]), t.stride(), t.storage_offset() + start * t.stride(0))
    out = t.new_empty((rows, *t.shape[1:]))
    out[:real] = t[start:start + real]
    out[real:].zero_()
    return out


def paged_prefill_attention_cudnn(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  meta: AttentionMetadata, scale: float, sliding_window: int | None = None,
                                  sinks: torch.Tensor | None = None, softcap: float | None = None,
                                  out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, H, Dh] (fresh prompts only, see ``supported``) -> out [T, H, Dh]."""
    assert sliding_window is None and sinks is None and softcap is None, "cuDNN SDPA: no window/sinks/softcap"
    assert is_fresh_prefill(meta), "cuDNN SDPA serves fresh prompts only (no cached context)"
    out = torch.empty_like(q) if out is None else out
    S, Hkv, Dh = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    cu = meta.cu_seqlens_q_host
    for b, L in enumerate(meta.context_lens_host):
        Lp = padded_length(L)
        n_pages = -(-L // S)
        # K/V gathered page by page into a run of Lp slots (whole pages); the slots past L are zeroed: only the
        # padded query rows see them, and zeros keep anything non-finite out of the kernel
        kv = []
        for cache in (k_cache, v_cache):
            run = cache.new_empty((-(-Lp // S), S, Hkv, Dh))
            torch.index_select(cache, 0, meta.block_tables[b, :n_pages].long(), out=run[:n_pages])
            run = run.view(-1, Hkv, Dh)[:Lp]
            run[L:].zero_()
            kv.append(run.transpose(0, 1).unsqueeze(0))  # [1, Hkv, Lp, Dh]
        qb = _padded_rows(q, cu[b], Lp, L).transpose(0, 1).unsqueeze(0)  # [1, H, Lp, Dh]
        o = _sdpa(qb, kv[0], kv[1], scale)
        out[cu[b]:cu[b + 1]] = o[0, :, :L].transpose(0, 1)
    return out
