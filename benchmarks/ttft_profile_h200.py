"""Where a fresh prompt's time to first token goes, kernel by kernel, in the engine on the H200.

    python benchmarks/ttft_profile_h200.py --out DIR [--preset qwen3-30b-a3b] [--sizes 130,590,2340,8890,26900]

The engine as served (random weights, CUDA graphs and warm-up as ``qml serve`` sets them up), driven
in-process (no HTTP). For each size: three fresh prompts of random ids timed to their first token,
then one more under the torch profiler: GPU time per kernel and per family (expert GEMMs, dense
GEMMs, attention, routing, norms/RoPE/KV writes, other), the launches, and the wall time the kernels
do not cover (host work and gaps). Writes ``ttft-profile-<preset>-<date>.{json,md}``.
"""
from __future__ import annotations

import argparse
import datetime
import gzip
import json
import shutil
import statistics
import sys
from pathlib import Path

import torch
from engine_h200 import _kernel_rows, _served_engine, _timed_request  # beside this script
from torch.profiler import ProfilerActivity, profile

from qml_runtime.sampling_params import SamplingParams

# kernel-name fragments of each family, first match wins
FAMILIES = (
    ("expert GEMMs", ("_moe_gemm", "_gate_up_kernel", "_down_kernel")),
    ("routing", ("_moe_route", "_moe_router", "_moe_align", "_moe_combine")),
    ("attention", ("attention", "sdpa", "fmha", "flash")),
    ("dense GEMMs", ("nvjet", "gemm", "_linear", "_gemv", "cutlass", "splitK", "cublas")),
    ("norms, RoPE, KV writes", ("rmsnorm", "rope", "kv_write")),
)


def family(kernel: str) -> str:
    for name, parts in FAMILIES:
        if any(p in kernel for p in parts):
            return name
    return "other"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--sizes", default="130,590,2340,8890,26900")
    parser.add_argument("--kv-cache-gib", type=float, default=40.0)
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script (kernel rows stay empty)")
    parser.add_argument("--trace", action="store_true",
                        help="the profiled prompt also records host activity; its Chrome trace is written gzipped "
                             "(ttft-trace-<preset>-<tokens>.json.gz: where the device waits for the host)")
    args = parser.parse_args()
    engine = _served_engine(args, torch.device(args.device))
    engine.start()
    V = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(7)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        fresh = [_timed_request(engine, torch.randint(300, V, (n,), generator=gen).tolist(), one)[0] * 1e3
                 for _ in range(3)]
        activities = [ProfilerActivity.CUDA if args.device == "cuda" else ProfilerActivity.CPU]
        if args.trace and args.device == "cuda":
            activities.append(ProfilerActivity.CPU)
        with profile(activities=activities) as prof:
            wall = _timed_request(engine, torch.randint(300, V, (n,), generator=gen).tolist(), one)[0] * 1e3
        if args.trace:
            args.out.mkdir(parents=True, exist_ok=True)
            raw = args.out / f"ttft-trace-{args.preset}-{n}.json"
            prof.export_chrome_trace(str(raw))
            with open(raw, "rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            raw.unlink()
        kernels = [r for r in _kernel_rows(prof) if not r[0].startswith(("Memcpy", "Memset"))]
        gpu_ms = sum(ms for _, _, ms in kernels)
        families: dict[str, float] = {}
        for k, _, ms in kernels:
            families[family(k)] = families.get(family(k), 0.0) + ms
        row = {"tokens": n, "ttft_ms": [round(t, 1) for t in fresh],
               "ttft_median_ms": round(statistics.median(fresh), 1),
               "profiled_wall_ms": round(wall, 1), "gpu_kernel_ms": round(gpu_ms, 2),
               "launches": sum(c for _, c, _ in kernels),
               "families_ms": {k: round(v, 2) for k, v in sorted(families.items(), key=lambda kv: -kv[1])},
               "top": [{"kernel": k, "calls": c, "ms": round(ms, 3)} for k, c, ms in kernels[:10]]}
        rows.append(row)
        print(json.dumps(row)[:1200], flush=True)
    engine.shutdown()
    import triton

    stamp = datetime.date.today().isoformat()
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    meta = {"date": stamp, "gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
            "preset": args.preset, "command": "python " + " ".join(sys.argv)}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"ttft-profile-{args.preset}-{stamp}"
    (args.out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    names = [name for name, _ in FAMILIES] + ["other"]
    lines = [f"# Time to first token, kernel by kernel: {args.preset} on {meta['gpu']} ({stamp})", "",
             f"`{meta['command']}`; torch {meta['torch']}, triton {meta['triton']}", "",
             "| tokens | TTFT median (ms) | profiled wall | GPU kernels | launches | "
             + " | ".join(names) + " |", "|---:" * (5 + len(names)) + "|"]
    for r in rows:
        fam = r["families_ms"]
        lines.append(f"| {r['tokens']} | {r['ttft_median_ms']} | {r['profiled_wall_ms']} | {r['gpu_kernel_ms']} | "
                     f"{r['launches']} | " + " | ".join(str(fam.get(n, 0.0)) for n in names) + " |")
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
