"""The decode GEMV against cuBLAS at Llama-3.1-8B and Qwen3-30B-A3B shapes on the H200; writes
the linear tuning table's GEMV entries.

    python benchmarks/gemv_h200.py --out DIR [--table qml_kernels/tuning/linear_h200.json]

For each weight shape (N, K) and 1, 2, 4 tokens: every ``GemvConfig`` of a small grid is checked
against the fp32 reference, then timed inside a CUDA graph of back-to-back calls over copies of
the weight that together exceed the L2 cache twice (as in a decode step, where every layer's
weight comes from HBM and calls follow each other without host gaps); cuBLAS the same way.
Where the best config beats cuBLAS by more than 3%, the table gets a ``gemv`` entry for
(bfloat16, N, K, T); entries of other implementations in the table are kept.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import triton

from qml_kernels.gemv import GemvConfig, gemv_triton
from qml_kernels.tuning import write_table

SHAPES = {  # name: (N, K), in the order swept (the ones cuBLAS streams slowest first)
    "llama-o": (4096, 4096), "llama-qkv": (6144, 4096), "qwen-qkv": (5120, 2048), "qwen-o": (2048, 4096),
    "llama-down": (4096, 14336), "llama-gate-up": (28672, 4096), "qwen-router": (128, 2048),
    "llama-lm-head": (128256, 4096), "qwen-lm-head": (151936, 2048),
}
CONFIGS = [GemvConfig(n, k, w) for n, k, w in itertools.product((2, 4, 8), (256, 512, 1024), (4, 8))]
L2_BYTES = 60 * 2**20


def graph_us(fn_for, copies: int) -> float:
    """GPU time per call of ``fn_for(i)`` (i over the weight copies), replayed from a CUDA graph."""
    calls = max(4 * copies, 16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(copies):
            fn_for(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in range(calls):
            fn_for(c % copies)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return sorted(times)[2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--table", type=Path, default=Path("qml_kernels/tuning/linear_h200.json"))
    parser.add_argument("--seconds", type=float, default=150.0, help="stop sweeping after this long")
    parser.add_argument("--margin", type=float, default=1.03,
                        help="list the GEMV where cuBLAS takes this many times as long (below 1: also where it is "
                             "slower alone, for an A/B in the engine, where our kernels overlap under PDL and "
                             "cuBLAS' do not; with QML_LINEAR_TABLE)")
    args = parser.parse_args()
    t_start = time.perf_counter()
    gen = torch.Generator("cuda").manual_seed(0)
    rows, entries = [], []
    for name, (N, K) in SHAPES.items():
        size = N * K * 2
        copies = max(1, min(8, -(-2 * L2_BYTES // size)))
        ws = [torch.randn(N, K, device="cuda", generator=gen).bfloat16() * K**-0.5 for _ in range(copies)]
        for T in (1, 2, 4):
            if time.perf_counter() - t_start > args.seconds:
                print(f"time is up: {name} T={T} and later not swept", flush=True)
                break
            x = torch.randn(T, K, device="cuda", generator=gen).bfloat16()
            ref = x.float() @ ws[0].float().T
            outs = [torch.empty(T, N, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
            cublas = graph_us(lambda i: torch.matmul(x, ws[i].T, out=outs[i]), copies)
            best = None
            for cfg in CONFIGS:
                try:
                    got = gemv_triton(x, ws[0], config=cfg)
                    err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
                    if not err <= 1.6e-2:
                        print(f"{name} T={T} {cfg}: rel err {err:.2e}: skipped", flush=True)
                        continue
                    us = graph_us(lambda i, cfg=cfg: gemv_triton(x, ws[i], out=outs[i], config=cfg), copies)
                except triton.runtime.errors.OutOfResources:
                    continue
                rows.append({"shape": name, "N": N, "K": K, "T": T, **cfg.__dict__, "us": round(us, 2)})
                if best is None or us < best[1]:
                    best = (cfg, us)
            if best is None:
                continue
            gbps = lambda us: size / us / 1e3  # noqa: E731
            print(f"{name:<14} T={T}  cuBLAS {cublas:7.2f} us ({gbps(cublas):6.0f} GB/s)   gemv {best[1]:7.2f} us "
                  f"({gbps(best[1]):6.0f} GB/s) {best[0]}", flush=True)
            rows.append({"shape": name, "N": N, "K": K, "T": T, "impl": "cublas", "us": round(cublas, 2)})
            if best[1] < cublas / args.margin:
                entries.append({"dtype": "bfloat16", "N": N, "K": K, "T": T, "impl": "gemv", "config": best[0]})
    stamp = datetime.date.today().isoformat()
    meta = {"date": stamp, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "command": "python " + " ".join(sys.argv)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"gemv-h200-{stamp}.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    old = json.loads(args.table.read_text()) if args.table.exists() else {"entries": []}
    kept = [e for e in old["entries"] if e["impl"] != "gemv"]
    about = ("Fastest verified linear implementation per shape on the NVIDIA H200. Key: dtype, N (output "
             "features), K (input features), T (token bucket: the next power of two >= the call's token count; "
             "measured at T = bucket). impl: 'triton', 'gemv' or 'cublas'; config: the implementation's launch "
             "config. Shapes not listed run cuBLAS. GEMM entries: benchmarks/linear_table.py (Triton listed only "
             "where it beat cuBLAS by more than 3%; none did). GEMV entries: benchmarks/gemv_h200.py "
             f"({stamp}, GPU time inside CUDA graphs, weights from HBM; listed where cuBLAS took more than "
             f"{args.margin:g}x its time).")
    write_table(args.table, "linear", "H200", kept + entries, about=about)
    print(f"wrote {len(entries)} gemv entries to {args.table}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
