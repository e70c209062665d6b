"""A prefill chunk's attention over a cached history, by the path the dispatcher takes, against cuDNN's fresh one.

A chunk of n > 512 queries over a history of cached keys is neither a fresh prompt (cuDNN, ``attention_cudnn``)
nor a turn (``attention_turn``, up to 512 queries): it runs Triton's paged prefill kernel. The restore planner
prices recomputing such a chunk from the fresh-prefill curve (cuDNN), and a cut load's blocks, computed as one
6.8k-token chunk after a 21.5k-token head, took far longer than that (sessions-h100-2026-12-06b.md). One layer of
Llama-3.1-8B's heads (32 q / 8 kv, Dh 128, bf16, pages of 16): for each (history, chunk) the time of
``paged_attention`` as dispatched (and which implementation it picked), and of cuDNN's fresh causal attention over
history + chunk tokens (what the curve's difference fresh(h + n) - fresh(h) stands for, in attention).
Beside them, candidate chunk paths over the history gathered from its pages (the gather is timed with them), each
checked against the dispatched output: ``flash`` (torch's FlashAttention-2 op, whose causal mask is lower-right
when there are fewer queries than keys), ``cudnn2`` (cuDNN over the history without a mask and over the chunk
causally, the two merged by their log-sum-exps), ``cudnn_mask`` (cuDNN with a lower-right boolean mask), and
cuDNN's paged SDPA through cudnn-frontend as ``qml_kernels.attention_chunk`` launches it (our pages read in place,
causal aligned bottom-right, GQA as is; built before it is timed): ``cudnn_paged`` at the exact query count and
pages, ``cudnn_paged_bucket`` at queries rounded up to 256 and pages to 64 with the real lengths given (whether
bottom-right alignment follows them). (The committed results of 2026-12-06 came from a prototype of that launch in
this script, which copied q into a padded buffer of its own rather than reading its rows in place.)

    python benchmarks/chunk_attention_h200.py --out DIR [--histories 0,4096,21504] [--chunks 512,2048,6784]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
from pathlib import Path

import torch

from qml_kernels import attention_chunk, registry
from qml_kernels.attention import AttentionMetadata, paged_attention
from qml_kernels.attention_cudnn import _sdpa
from moe_h200 import time_layer  # beside this script

H, HKV, D, PAGE = 32, 8, 128, 16
REPS = 5


def _gather(cache: torch.Tensor, meta: AttentionMetadata, total: int) -> torch.Tensor:
    """The sequence's keys (or values) as one run [1, Hkv, total, Dh], gathered through its block table."""
    pages = -(-total // PAGE)
    run = torch.index_select(cache, 0, meta.block_tables[0, :pages].long())
    return run.view(-1, HKV, D)[:total].transpose(0, 1).unsqueeze(0)


def flash_chunk(q, k_cache, v_cache, meta, total, scale):
    k, v = _gather(k_cache, meta, total), _gather(v_cache, meta, total)
    qb = q.transpose(0, 1).unsqueeze(0)
    o = torch.ops.aten._scaled_dot_product_flash_attention(qb, k, v, 0.0, is_causal=True, scale=scale)[0]
    return o[0].transpose(0, 1)


def _cudnn(q, k, v, causal, scale):
    o, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                 scale=scale)[:2]
    return o, lse.reshape(q.shape[0], q.shape[1], q.shape[2])


def cudnn2_chunk(q, k_cache, v_cache, meta, total, scale):
    n = q.shape[0]
    h = total - n
    k, v = _gather(k_cache, meta, total), _gather(v_cache, meta, total)
    qb = q.transpose(0, 1).unsqueeze(0)
    o2, l2 = _cudnn(qb, k[:, :, h:], v[:, :, h:], True, scale)
    if h == 0:
        return o2[0].transpose(0, 1)
    o1, l1 = _cudnn(qb, k[:, :, :h], v[:, :, :h], False, scale)
    lse = torch.logaddexp(l1, l2)
    o = o1 * torch.exp(l1 - lse).unsqueeze(-1) + o2 * torch.exp(l2 - lse).unsqueeze(-1)
    return o[0].transpose(0, 1).to(q.dtype)


def cudnn_mask_chunk(q, k_cache, v_cache, meta, total, scale):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    n = q.shape[0]
    k, v = _gather(k_cache, meta, total), _gather(v_cache, meta, total)
    mask = torch.ones(n, total, dtype=torch.bool, device=q.device).tril(total - n)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k, v, attn_mask=mask,
                                                             scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def _paged(bucket: bool):
    """cuDNN's paged SDPA as ``attention_chunk`` launches it, its bounds exact (rows and pages) or bucketed (rows to
    256, pages to 64)."""

    def run(q, k_cache, v_cache, meta, total, scale):
        n, pages = q.shape[0], -(-total // PAGE)
        rows, max_pages = (-(-n // 256) * 256, -(-pages // 64) * 64) if bucket else (n, pages)
        return attention_chunk.chunk_attention(q, k_cache, v_cache, meta, scale, rows=rows, max_pages=max_pages)
    return run


CANDIDATES = {"cudnn_paged": _paged(False), "cudnn_paged_bucket": _paged(True), "flash": flash_chunk,
              "cudnn2": cudnn2_chunk, "cudnn_mask": cudnn_mask_chunk}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--histories", default="0,4096,21504")
    ap.add_argument("--chunks", default="512,2048,6784")
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for h in map(int, args.histories.split(",")):
        for n in map(int, args.chunks.split(",")):
            total = h + n
            pages = -(-total // PAGE)
            k_cache = torch.randn(pages, PAGE, HKV, D, device=dev, dtype=torch.bfloat16, generator=gen)
            v_cache = torch.randn(pages, PAGE, HKV, D, device=dev, dtype=torch.bfloat16, generator=gen)
            q = torch.randn(n, H, D, device=dev, dtype=torch.bfloat16, generator=gen)
            meta = AttentionMetadata.build(list(range(h, total)), [list(range(pages))], [0, n], [total], dev)
            scale = D ** -0.5
            picked = registry.select("paged_attention", q, k_cache, v_cache, meta, scale).name
            dispatched = time_layer(lambda: paged_attention(q, k_cache, v_cache, meta, scale), dev, REPS)
            with registry.using(paged_attention="triton"):
                triton_ms = time_layer(lambda: paged_attention(q, k_cache, v_cache, meta, scale), dev, REPS)
            qf = torch.randn(1, H, total, D, device=dev, dtype=torch.bfloat16, generator=gen)
            kf = torch.randn(1, HKV, total, D, device=dev, dtype=torch.bfloat16, generator=gen)
            fresh_total = time_layer(lambda: _sdpa(qf, kf, kf, scale), dev, REPS)
            fresh_h = (time_layer(lambda: _sdpa(qf[:, :, :h], kf[:, :, :h], kf[:, :, :h], scale), dev, REPS)
                       if h >= 16 else 0.0)
            row = {"history": h, "chunk": n, "picked": picked, "dispatched_ms": dispatched, "triton_ms": triton_ms,
                   "cudnn_fresh_total_ms": fresh_total, "cudnn_fresh_history_ms": fresh_h,
                   "cudnn_difference_ms": fresh_total - fresh_h}
            print(f"history {h:6d} chunk {n:5d}: {picked:>10} {dispatched:7.3f} ms (triton {triton_ms:7.3f}); cuDNN "
                  f"fresh {total} - {h}: {fresh_total:.3f} - {fresh_h:.3f} = {fresh_total - fresh_h:.3f} ms",
                  flush=True)
            expected = paged_attention(q, k_cache, v_cache, meta, scale).float()
            for name, fn in CANDIDATES.items():
                try:
                    err = (fn(q, k_cache, v_cache, meta, total, scale).float() - expected).abs().max().item()
                    ms = time_layer(lambda: fn(q, k_cache, v_cache, meta, total, scale), dev, REPS)
                    row[name] = {"ms": ms, "max_abs_err": err}
                    print(f"    {name:>10}: {ms:7.3f} ms, max |err| {err:.2e}", flush=True)
                except Exception as e:  # a backend that rejects the shapes is an answer too
                    row[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                    print(f"    {name:>10}: {row[name]['error']}", flush=True)
            rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"chunk-attention-{datetime.date.today()}.json"
    out.write_text(json.dumps({"date": str(datetime.datetime.now()), "gpu": torch.cuda.get_device_name(),
                               "torch": torch.__version__, "host": platform.node(), "heads": [H, HKV, D],
                               "page": PAGE, "rows": rows}, indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
