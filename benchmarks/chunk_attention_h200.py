"""A prefill chunk's attention over a cached history, by the path the dispatcher takes, against cuDNN's fresh one.

A chunk of n > 512 queries over a history of cached keys is neither a fresh prompt (cuDNN, ``attention_cudnn``)
nor a turn (``attention_turn``, up to 512 queries): it runs Triton's paged prefill kernel. The restore planner
prices recomputing such a chunk from the fresh-prefill curve (cuDNN), and a cut load's blocks, computed as one
6.8k-token chunk after a 21.5k-token head, took far longer than that (sessions-h100-2026-12-06b.md). One layer of
Llama-3.1-8B's heads (32 q / 8 kv, Dh 128, bf16, pages of 16): for each (history, chunk) the time of
``paged_attention`` as dispatched (and which implementation it picked), and of cuDNN's fresh causal attention over
history + chunk tokens (what the curve's difference fresh(h + n) - fresh(h) stands for, in attention).

    python benchmarks/chunk_attention_h200.py --out DIR [--histories 0,4096,21504] [--chunks 512,2048,6784]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
from pathlib import Path

import torch

from qml_kernels import registry
from qml_kernels.attention import AttentionMetadata, paged_attention
from qml_kernels.attention_cudnn import _sdpa
from moe_h200 import time_layer  # beside this script

H, HKV, D, PAGE = 32, 8, 128, 16
REPS = 5


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
            rows.append(row)
            print(f"history {h:6d} chunk {n:5d}: {picked:>10} {dispatched:7.3f} ms (triton {triton_ms:7.3f}); cuDNN "
                  f"fresh {total} - {h}: {fresh_total:.3f} - {fresh_h:.3f} = {fresh_total - fresh_h:.3f} ms",
                  flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"chunk-attention-{datetime.date.today()}.json"
    out.write_text(json.dumps({"date": str(datetime.datetime.now()), "gpu": torch.cuda.get_device_name(),
                               "torch": torch.__version__, "host": platform.node(), "heads": [H, HKV, D],
                               "page": PAGE, "rows": rows}, indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
