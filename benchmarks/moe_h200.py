"""One MoE layer of Qwen3-30B-A3B on the H200 under balanced and skewed routing, kernel by kernel.

    python benchmarks/moe_h200.py --out DIR                       # H200: Qwen3-30B-A3B shapes
    python benchmarks/moe_h200.py --out DIR --device cpu --tiny   # the script itself, on CPU

Random router weights spread tokens almost evenly over the 128 experts, which flatters a
grouped GEMM; real routers have hot experts. Each routing here is made by biasing random
router logits:

- ``uniform``: no bias (what random weights give);
- ``hot4``: 4 experts get +4, so every token picks them and its other 4 at random: half of
  the pairs on 4 experts;
- ``hot8``: 8 experts get +4: every token picks exactly those 8 (all the work on 8 experts,
  each with T rows, 120 idle).

For each (T, routing) the layer (``moe_forward``) is timed as a whole (CUDA events, median),
and its kernels by torch.profiler (router, align, the two grouped GEMMs, combine). Bytes are
the expert weights the routing touches; FLOPs are 2·T·k·(3·D·I).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from qml_kernels.moe_gemm import moe_forward

SHAPES = {"qwen3-30b-a3b": dict(E=128, k=8, D=2048, I=768), "tiny": dict(E=16, k=4, D=64, I=32)}
ROUTINGS = {"uniform": 0, "hot4": 4, "hot8": 8}


def logits_for(T: int, E: int, hot: int, gen: torch.Generator, device) -> torch.Tensor:
    logits = torch.randn(T, E, generator=gen).to(device)
    if hot:
        logits[:, :hot] += 4.0  # larger than any spread of the others: always in the top-k
    return logits


def touched_bytes(logits: torch.Tensor, k: int, D: int, I: int, elem: int) -> int:
    experts = logits.topk(k, dim=-1).indices.unique().numel()
    return experts * 3 * D * I * elem


def time_layer(fn, device, reps: int) -> float:
    if device.type != "cuda":
        t = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
        return statistics.median(t) * 1e3
    for _ in range(3):
        fn()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def kernel_times(fn, device) -> dict[str, float]:
    """Per-kernel GPU time of one call (us), by kernel name."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    out: dict[str, float] = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us:
            out[e.key[:60]] = round(out.get(e.key[:60], 0.0) + us, 1)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a small MoE (CPU check of the script)")
    parser.add_argument("--tokens", default="1,8,128,2048,8192")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = SHAPES["tiny" if args.tiny else "qwen3-30b-a3b"]
    E, k, D, I = shape["E"], shape["k"], shape["D"], shape["I"]
    gen = torch.Generator().manual_seed(0)
    w_gate_up = (torch.randn(E, 2 * I, D, generator=gen) * D ** -0.5).to(device, dtype)
    w_down = (torch.randn(E, D, I, generator=gen) * I ** -0.5).to(device, dtype)
    elem = w_gate_up.element_size()
    rows = []
    for T in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(T, D, generator=gen).to(device, dtype)
        for name, hot in ROUTINGS.items():
            if hot > E or hot > k and name != "uniform":
                continue
            logits = logits_for(T, E, hot, gen, device)

            def layer():
                return moe_forward(x, logits, w_gate_up, w_down, k, True)

            ms = time_layer(layer, device, args.reps)
            nbytes = touched_bytes(logits, k, D, I, elem)
            flops = 2 * T * k * 3 * D * I
            row = {"tokens": T, "routing": name, "ms": round(ms, 4),
                   "experts_touched": nbytes // (3 * D * I * elem),
                   "weight_GB_per_s": round(nbytes / ms / 1e6, 1), "TFLOP_per_s": round(flops / ms / 1e9, 2)}
            if device.type == "cuda":
                row["kernels_us"] = kernel_times(layer, device)
            rows.append(row)
            print(json.dumps(row), flush=True)
    import triton

    meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "triton": triton.__version__,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "shape": shape, "dtype": str(dtype), "command": "python " + " ".join(sys.argv)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "moe-layer.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# One MoE layer, {meta['device']} ({meta['date']})", "", f"`{meta['command']}`", "",
             f"torch {meta['torch']}, triton {meta['triton']}, {shape}, {meta['dtype']}", "",
             "| tokens | routing | experts touched | ms | weights GB/s | TFLOP/s |", "|---:|---|---:|---:|---:|---:|"]
    lines += [f"| {r['tokens']} | {r['routing']} | {r['experts_touched']} | {r['ms']} | {r['weight_GB_per_s']} | "
              f"{r['TFLOP_per_s']} |" for r in rows]
    (args.out / "moe-layer.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
