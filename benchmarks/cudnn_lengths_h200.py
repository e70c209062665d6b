"""cuDNN's fused attention at a prompt length it has not seen: the first call's cost, and lengths padded to buckets.

    python benchmarks/cudnn_lengths_h200.py --out DIR [--lengths 8890,8891,8900,26900] [--bucket 512]

Served, the first prompt of each length above 4,096 tokens (``qml_kernels.attention_cudnn``) was 50-85 ms slower
than the next ones of the same length (serve-h200-qwen3-30b-a3b-2026-12-04.md): torch builds a cuDNN graph per
shape and caches it, so with real prompts, every one a new length, every long prompt would pay the build. A
causal attention padded at the end computes the real rows exactly as before (a real query row sees only keys at
or before it), so lengths rounded up to ``--bucket`` share graphs. For each length, one layer of Qwen3-30B-A3B's
heads (32 q / 4 kv, Dh 128, bf16): the first call (host wall time, the build included) and the steady time
(median of 5, CUDA events), unpadded and padded, and the largest difference of the real rows between the two.
Writes ``cudnn-lengths-<date>.json``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from moe_h200 import time_layer  # beside this script
from torch.nn.attention import SDPBackend, sdpa_kernel

H, HKV, DH = 32, 4, 128


def attend(q, k, v):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def timed(fn) -> tuple[float, float, torch.Tensor]:
    """(first call's wall ms, steady median ms of 5, output)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    first = (time.perf_counter() - t0) * 1e3
    return first, time_layer(fn, torch.device("cuda"), 5), out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--lengths", default="8890,8891,8900,26900")
    parser.add_argument("--bucket", type=int, default=512)
    args = parser.parse_args()
    gen = torch.Generator("cuda").manual_seed(0)
    attend(*(torch.randn(1, h, 64, DH, device="cuda", dtype=torch.bfloat16) for h in (H, HKV, HKV)))  # cuDNN loaded
    rows = []
    for L in (int(x) for x in args.lengths.split(",")):
        Lp = -(-L // args.bucket) * args.bucket
        q = torch.randn(1, H, Lp, DH, device="cuda", dtype=torch.bfloat16, generator=gen)
        k = torch.randn(1, HKV, Lp, DH, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn(1, HKV, Lp, DH, device="cuda", dtype=torch.bfloat16, generator=gen)
        exact = [t[:, :, :L].contiguous() for t in (q, k, v)]
        first, steady, out = timed(lambda: attend(*exact))  # noqa: B023
        first_p, steady_p, out_p = timed(lambda: attend(q, k, v))  # noqa: B023
        diff = (out_p[:, :, :L].float() - out.float()).abs().max().item()
        row = {"tokens": L, "padded_to": Lp, "first_ms": round(first, 2), "steady_ms": round(steady, 3),
               "padded_first_ms": round(first_p, 2), "padded_steady_ms": round(steady_p, 3), "max_abs_diff": diff}
        rows.append(row)
        print(row, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.date.today().isoformat()
    meta = {"date": stamp, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "cudnn": torch.backends.cudnn.version(), "command": "python " + " ".join(sys.argv)}
    (args.out / f"cudnn-lengths-{stamp}.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
