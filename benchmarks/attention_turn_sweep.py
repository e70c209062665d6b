"""Launch configs of the paged prefill attention for the next turn of a long conversation, on the GPU.

The GPU-history turn (150 new tokens over ~27k cached, Llama-3.1-8B heads) spends ~9 of its ~15 ms
of kernels in this attention's split-KV launch (benchmarks/results/engine-h200-gputurn-*.json).
This times the launcher (split kernel + merge) over a grid of tiles, warps, pipeline stages and
split counts on the turn's shapes, each variant checked against the default config's output, and
prints one line per (variant, case) as it goes (a run cut short still reports what it timed).

    python benchmarks/attention_turn_sweep.py --out DIR [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import time
from pathlib import Path

import torch

from qml_kernels.attention_prefill import (
    PAGED_PREFILL_ATTENTION_SPEC,
    PagedPrefillAttentionConfig,
    paged_prefill_attention_triton,
)
from qml_kernels.workbench.spec import Case

LLAMA = {"H": 32, "Hkv": 8, "Dh": 128, "fused_q": True, "S": 16, "shuffle": True}
CASES = (
    Case("turn150-ctx27339", {**LLAMA, "seqs": ((150, 27339),)}, edge="the sessions bench's GPU turn"),
    Case("turn219-ctx27339", {**LLAMA, "seqs": ((219, 27339),)}, edge="a turn before kept replies"),
    Case("2x150-ctx27339", {**LLAMA, "seqs": ((150, 27339), (150, 27190))}, edge="two users' turns in one step"),
    Case("turn133-ctx8000", {**LLAMA, "seqs": ((133, 8000),)}, edge="a turn over a shorter history"),
)


def _time(fn, calls: int = 10, reps: int = 7) -> float:
    """Median ms of one call of ``fn``, from batches of ``calls`` queued back to back between two CUDA
    events (a call's Python launch overlaps the calls before it: timed one by one, each call also
    counted the ~50-100 us the host took to launch it, and the split counts' order drowned in it)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / calls)
    times.sort()
    return times[len(times) // 2]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--quick", action="store_true", help="five tiles, every split count from 1 to 16")
    p.add_argument("--budget-s", type=float, default=220.0, help="stop starting new variants after this")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    t_start = time.perf_counter()
    inputs = {}
    for case in CASES:
        gen = torch.Generator(dev).manual_seed(0)
        inputs[case.name] = PAGED_PREFILL_ATTENTION_SPEC.make_inputs(case, torch.bfloat16, dev, gen)
    base = PagedPrefillAttentionConfig()
    expected = {name: paged_prefill_attention_triton(**x, config=base).float() for name, x in inputs.items()}
    flops = {name: PAGED_PREFILL_ATTENTION_SPEC.flops(x) for name, x in inputs.items()}

    if args.quick:  # the default tile and its neighbours, every split count
        grid = [(128, 64, 4, 3), (128, 64, 4, 2), (64, 64, 4, 3), (128, 128, 8, 3), (128, 128, 8, 2)]
        split_counts = (None, *range(1, 17))
    else:
        grid = [(m, n, w, s) for m, n, w, s in itertools.product((64, 128, 256), (32, 64, 128), (4, 8), (2, 3))
                if not (m == 256 and w == 4) and not (m == 64 and w == 8)]
        grid = [(128, 64, 4, 3), (128, 64, 4, 4)] + [g for g in grid if g != (128, 64, 4, 3)]
        split_counts = (None, 4, 6, 8, 12, 16)
    rows = []
    for m, n, w, s in grid:
        if time.perf_counter() - t_start > args.budget_s:
            print(f"budget spent: stopped before m{m} n{n} w{w} s{s}", flush=True)
            break
        for splits in split_counts:
            config = PagedPrefillAttentionConfig(block_m=m, block_n=n, split_num_warps=w, num_stages=s,
                                                 num_splits=splits)
            for name, x in inputs.items():
                row = {"block_m": m, "block_n": n, "warps": w, "stages": s, "splits": splits or "auto", "case": name}
                try:
                    got = paged_prefill_attention_triton(**x, config=config).float()
                    ref = expected[name]
                    err = ((got - ref).abs().max() / ref.abs().max()).item()
                    row["rel_err"] = float(f"{err:.2e}")
                    if not math.isfinite(err) or err > 2e-2:
                        row["error"] = "output differs from the default config's"
                    else:
                        ms = _time(lambda: paged_prefill_attention_triton(**x, config=config))
                        row["us"], row["tflops"] = round(ms * 1e3, 1), round(flops[name] / ms / 1e9, 1)
                except Exception as exc:  # out of resources, a compile error: not a candidate
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
    best = {}
    for row in rows:
        if "us" in row and (row["case"] not in best or row["us"] < best[row["case"]]["us"]):
            best[row["case"]] = row
    default = {r["case"]: r for r in rows if "us" in r and (r["block_m"], r["block_n"], r["warps"], r["stages"],
                                                           r["splits"]) == (128, 64, 4, 3, "auto")}
    for name, row in best.items():
        print(f"best {name}: {row} (default {default.get(name, {}).get('us')} us)", flush=True)
    import triton
    meta = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
            "torch": torch.__version__, "triton": triton.__version__,
            "command": "python benchmarks/attention_turn_sweep.py --out DIR" + (" --quick" if args.quick else "")}
    (args.out / "attention-turn-sweep.json").write_text(json.dumps({"meta": meta, "rows": rows, "best": best},
                                                                   indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
