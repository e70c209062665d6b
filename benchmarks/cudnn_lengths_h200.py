"""cuDNN's fused attention at a prompt length it has not seen: the first call's cost, and lengths padded to buckets.

    python benchmarks/cudnn_lengths_h200.py --out DIR [--lengths 8890,8891,8900,26900] [--bucket 512]
    python benchmarks/cudnn_lengths_h200.py --out DIR --engine [--preset qwen3-30b-a3b] [--buckets 1,128]

Served, the first prompt of each length above 4,096 tokens (``qml_kernels.attention_cudnn``) was 50-85 ms slower
than the next ones of the same length (serve-h200-qwen3-30b-a3b-2026-12-04.md): torch builds a cuDNN graph per
shape and caches it, so with real prompts, every one a new length, every long prompt would pay the build. A
causal attention padded at the end computes the real rows exactly as before (a real query row sees only keys at
or before it), so lengths rounded up to ``--bucket`` share graphs. For each length, one layer of Qwen3-30B-A3B's
heads (32 q / 4 kv, Dh 128, bf16): the first call (host wall time, the build included) and the steady time
(median of 5, CUDA events), unpadded and padded, and the largest difference of the real rows between the two.
Writes ``cudnn-lengths-<date>.json``.

``--engine``: the same question in the engine as served, under each ``--buckets`` value of
``QML_CUDNN_BUCKET`` (one process each; 1 attends at the exact lengths): after a 4,500-token warm-up prompt,
one fresh prompt of each of ``--lengths`` in turn, its time to first token and its 8 greedy tokens, which
must be the same under every bucket (a padded row or key reaching a real row would change them). Writes
``cudnn-buckets-<preset>-<date>.json``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

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


def engine_child(preset: str, lengths: list[int], kv_cache_gib: float) -> dict:
    """In this process's engine (its QML_CUDNN_BUCKET): each length's first time to first token and tokens."""
    from engine_common import _served_engine, _timed_request

    from qml_runtime.sampling_params import SamplingParams

    engine = _served_engine(SimpleNamespace(preset=preset, kv_cache_gib=kv_cache_gib), "cuda")
    engine.start()
    V = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    rows = []
    try:
        _timed_request(engine, torch.randint(300, V, (4500,), generator=gen).tolist(), params)
        for L in lengths:
            tokens = []
            stamps = _timed_request(engine, torch.randint(300, V, (L,), generator=gen).tolist(), params, tokens)
            rows.append({"tokens": L, "ttft_ms": round(stamps[0] * 1e3, 2), "generated": tokens})
    finally:
        engine.shutdown()
    return {"rows": rows}


def engine_mode(args) -> int:
    runs = {}
    for bucket in args.buckets.split(","):
        cmd = [sys.executable, __file__, "--out", str(args.out), "--engine", "--child", "--preset", args.preset,
               "--lengths", args.lengths, "--kv-cache-gib", str(args.kv_cache_gib)]
        run = subprocess.run(cmd, env={**os.environ, "QML_CUDNN_BUCKET": bucket}, capture_output=True, text=True)
        line = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
        if run.returncode != 0 or not line:
            print(run.stdout[-2000:], run.stderr[-4000:], flush=True)
            return 1
        runs[bucket] = json.loads(line[0][len("RESULT "):])["rows"]
    first = next(iter(runs.values()))
    same = all(r["generated"] == f["generated"] for rows in runs.values() for r, f in zip(rows, first))
    print("tokens | " + " | ".join(f"TTFT ms, bucket {b}" for b in runs))
    for i, L in enumerate(int(x) for x in args.lengths.split(",")):
        print(f"{L} | " + " | ".join(f"{rows[i]['ttft_ms']:.1f}" for rows in runs.values()))
    print(f"the same greedy tokens under every bucket: {same}")
    stamp = datetime.date.today().isoformat()
    meta = {"date": stamp, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "cudnn": torch.backends.cudnn.version(), "command": "python " + " ".join(sys.argv)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"cudnn-buckets-{args.preset}-{stamp}.json").write_text(
        json.dumps({**meta, "same_tokens": same, "runs": runs}, indent=1))
    return 0 if same else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--lengths", default="8890,8891,8900,26900")
    parser.add_argument("--bucket", type=int, default=512)
    parser.add_argument("--engine", action="store_true", help="in the served engine, under each of --buckets")
    parser.add_argument("--buckets", default="1,128")
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--kv-cache-gib", type=float, default=20.0)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine and args.child:
        print("RESULT " + json.dumps(engine_child(args.preset, [int(x) for x in args.lengths.split(",")],
                                                  args.kv_cache_gib)), flush=True)
        return 0
    if args.engine:
        return engine_mode(args)
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
