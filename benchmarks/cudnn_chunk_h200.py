"""``attention_chunk`` (cuDNN's paged SDPA, ragged rows, causal bottom-right) checked and timed against the paths a
long prefill chunk took before it: Triton's paged prefill, and for fresh prompts ``attention_cudnn``.

One layer of Llama-3.1-8B's heads (32 q / 8 kv, Dh 128, bf16) over a pool of 4,096 pages of 16 slots, each
sequence's pages scattered through it; q is the first third of a fused qkv projection's rows (token stride
(H + 2 Hkv) Dh) and out a separate buffer with guard rows after it (which must stay untouched). For each case: the
largest difference from Triton's output, the time at the default bounds (rows and table width rounded up to powers
of two), at exact bounds (rows to 128, the table's own width), at a table as wide as the pool, the first call's
time (the graph's build), Triton's time and the dispatched path's; and the step as one launch (``together``: its
own graph for the count of sequences) against the default, a launch a sequence on the one-sequence graphs.

    python benchmarks/cudnn_chunk_h200.py --out DIR [--pool PAGES] [--cases 0,2,8]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time
from pathlib import Path

import torch

from qml_kernels import attention_chunk, registry
from qml_kernels.attention import AttentionMetadata, paged_attention
from moe_h200 import time_layer  # beside this script

H, HKV, D, PAGE, POOL = 32, 8, 128, 16, 4096
REPS = 5
# (cached history, new queries) per sequence
CASES = [
    [(21504, 6784)], [(0, 6784)], [(4096, 2048)], [(21504, 512)], [(0, 27648)], [(8192, 1000), (0, 3000)],
    [(9000, 4100)], [(16000, 16400)], [(27000, 600)], [(8192, 1000), (4096, 900)],
    [(8192, 1000), (0, 3000), (4096, 700)],
]


def make(case, gen, dev, pool):
    T = sum(n for _, n in case)
    perm = torch.randperm(pool, generator=gen).tolist()
    tables, slots, cu, lens, used = [], [], [0], [], 0
    for h, n in case:
        pages = -(-(h + n) // PAGE)
        table = perm[used:used + pages]
        used += pages
        tables.append(table)
        slots += [table[p // PAGE] * PAGE + p % PAGE for p in range(h, h + n)]
        cu.append(cu[-1] + n)
        lens.append(h + n)
    meta = AttentionMetadata.build(slots, tables, cu, lens, dev)
    qkv = torch.randn(T, (H + 2 * HKV) * D, device=dev, dtype=torch.bfloat16, generator=torch.Generator(
        device=dev).manual_seed(1))
    q = qkv[:, :H * D].view(T, H, D)
    return q, meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--pool", type=int, default=POOL, help="pages in the pool")
    ap.add_argument("--cases", default=None, help="indices into CASES (default: all)")
    args = ap.parse_args()
    cases = CASES if args.cases is None else [CASES[int(i)] for i in args.cases.split(",")]
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(args.pool, PAGE, HKV, D, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn(args.pool, PAGE, HKV, D, device=dev, dtype=torch.bfloat16)
    scale = D ** -0.5
    rows = []
    for case in cases:
        q, meta = make(case, gen, dev, args.pool)
        T = q.shape[0]
        row = {"case": case, "supported": attention_chunk.supported(q, k_cache, v_cache, meta, scale)}
        with registry.using(paged_attention="triton"):
            expected = paged_attention(q, k_cache, v_cache, meta, scale).float()
            row["triton_ms"] = time_layer(lambda: paged_attention(q, k_cache, v_cache, meta, scale), dev, REPS)
        row["dispatched"] = registry.select("paged_attention", q, k_cache, v_cache, meta, scale).name
        row["dispatched_ms"] = time_layer(lambda: paged_attention(q, k_cache, v_cache, meta, scale), dev, REPS)
        width = meta.block_tables.shape[1]
        bounds = {"default": {}, "exact": {"rows": -(-meta.max_q_len // 128) * 128, "max_pages": width},
                  "pool_wide": {"max_pages": args.pool}, "together": {"together": True}}
        for name, kw in bounds.items():
            try:
                guard = torch.full((T + 256, H, D), 7.0, device=dev, dtype=torch.bfloat16)
                out = guard[:T]
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                attention_chunk.chunk_attention(q, k_cache, v_cache, meta, scale, out=out, **kw)
                torch.cuda.synchronize()
                first = (time.perf_counter() - t0) * 1e3
                err = (out.float() - expected).abs().max().item()
                guard_ok = bool((guard[T:] == 7.0).all().item())
                ms = time_layer(lambda: attention_chunk.chunk_attention(q, k_cache, v_cache, meta, scale, out=out,
                                                                        **kw), dev, REPS)
                row[name] = {"ms": ms, "first_call_ms": first, "max_abs_err": err, "guard_untouched": guard_ok,
                             "launches": attention_chunk.launch_shapes(q, k_cache, meta, kw.get("rows"),
                                                                       kw.get("max_pages"), kw.get("together", False))}
            except Exception as e:  # noqa: BLE001 - cuDNN declining a shape is an answer too
                row[name] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        rows.append(row)
        print(json.dumps(row), flush=True)
        print(f"{case}: triton {row['triton_ms']:.3f} ms, dispatched {row['dispatched']} {row['dispatched_ms']:.3f};",
              "; ".join(f"{name} " + (row[name]["error"][:80] if "error" in row[name] else
                                      f"{row[name]['ms']:.3f} ms (first {row[name]['first_call_ms']:.1f}, err "
                                      f"{row[name]['max_abs_err']:.1e}, guard {row[name]['guard_untouched']})")
                        for name in bounds), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"cudnn-chunk-{datetime.date.today()}-pool{args.pool}.json"
    out.write_text(json.dumps({"date": str(datetime.datetime.now()), "gpu": torch.cuda.get_device_name(),
                               "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
                               "host": platform.node(), "heads": [H, HKV, D], "page": PAGE, "pool": args.pool,
                               "rows": rows}, indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
