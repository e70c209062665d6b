"""The paged prefill attention's K/V pipeline on the GPU: page ids loaded two blocks ahead of their
gathers (``prefetch_pages``, the direct launch's default) against loaded beside them (before).

Compiled for sm_90a with Triton 3.6, the loop that loads a block's page ids and gathers its K/V
in the same iteration waited for each block's K/V right after issuing them (``async_wait
{num = 0}`` at the top of the loop, whatever num_stages): the load latency was exposed at every
block, hidden only by another program on the SM. With the ids carried in registers the gathers
go ``num_stages - 1`` blocks ahead (``num = 2`` at 3 stages), at the price of a third K/V buffer
in shared memory (131 KB at 128 x 64 tiles: one program per SM instead of two).

Cases: fresh or chunked prompts (direct launches: 8 warps, one program per SM either way) and the
next turn of a long conversation (split-KV launches, 4 warps, two programs per SM before). With
``--wide``, also the split launch with the ids ahead at other tiles, stages and warps, and the turns
at every split count from 2 to 16. Every variant is checked against ``paged_attention_ref`` in fp32
before it is timed (a CUDA graph of ten launches between two events).

    python benchmarks/attention_pipeline_h200.py --out DIR [--wide]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import time
from pathlib import Path

import torch
from gemv_h200 import graph_us  # beside this script: the CUDA-graph timing loop

from qml_kernels.attention import paged_attention_ref
from qml_kernels.attention_prefill import (
    PAGED_PREFILL_ATTENTION_SPEC,
    PagedPrefillAttentionConfig,
    paged_prefill_attention_triton,
)
from qml_kernels.workbench.spec import Case

LLAMA = {"H": 32, "Hkv": 8, "Dh": 128, "S": 16, "shuffle": True}
QWEN = {"H": 32, "Hkv": 4, "Dh": 128, "S": 16, "shuffle": True}
PREFILL_SPLIT_CASES = (
    Case("turn150-ctx27339", {**LLAMA, "fused_q": True, "seqs": ((150, 27339),)}, edge="the sessions bench's GPU turn"),
    Case("turn219-ctx27339", {**LLAMA, "fused_q": True, "seqs": ((219, 27339),)}, edge="a longer turn"),
    Case("2x150-ctx27339", {**LLAMA, "fused_q": True, "seqs": ((150, 27339), (150, 27190))}, edge="two users"),
    Case("turn133-ctx8000", {**LLAMA, "fused_q": True, "seqs": ((133, 8000),)}, edge="a shorter history"),
)
PREFILL_DIRECT_CASES = (
    Case("fresh2340-llama", {**LLAMA, "fused_q": True, "seqs": ((2340, 2340),)},
         edge="a fresh prompt (Triton below 4k)"),
    Case("fresh2340-qwen3", {**QWEN, "seqs": ((2340, 2340),)}, edge="Qwen3-30B-A3B heads"),
    Case("chunk1024-ctx32000", {**LLAMA, "fused_q": True, "seqs": ((1024, 32000),)}, edge="a long chunk"),
)
# (name, config fields): "before" is the form before the page ids were loaded ahead, "default" today's
# defaults; --wide adds the tiles swept to pick them
PREFILL_CONFIGS = (
    ("before", {"prefetch_pages": False}),
    ("default", {}),
)
PREFILL_WIDE = (
    ("split-ahead", {"split_prefetch_pages": True}),
    ("split-ahead-n32-s4", {"split_prefetch_pages": True, "block_n": 32, "split_num_stages": 4}),
    ("ahead-s2", {"num_stages": 2, "split_num_stages": 2, "split_prefetch_pages": True}),
    ("ahead-w8", {"split_num_warps": 8, "split_prefetch_pages": True}),
    ("ahead-n128-w8", {"block_n": 128, "split_num_warps": 8, "split_prefetch_pages": True}),
    ("ahead-m256-w8", {"block_m": 256, "split_num_warps": 8, "split_prefetch_pages": True}),
)
TOLERANCE = 1.6e-2  # bf16, as tests/test_attention_prefill_triton.py


def _time(fn) -> float:
    """Median ms of one call of ``fn`` replayed from a CUDA graph, as the engine runs decode and short
    prefills, and without the ~50-100 us of a Python launch, which kernels this short would otherwise
    be timed by. (The 2026-12-02 runs used 10 calls a graph and 7 replays; this is 16 and 5.)"""
    return graph_us(lambda _: fn(), 1) / 1e3


def _reference(x: dict) -> torch.Tensor:
    up = {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in x.items()}
    return paged_attention_ref(**up)


def _sweep(spec, launch, config_cls, cases, configs, split_counts, rows: list, budget_at: float, op: str,
           dev: torch.device = torch.device("cuda"), dtype: torch.dtype = torch.bfloat16) -> None:
    for case in cases:
        gen = torch.Generator(dev).manual_seed(0)
        x = spec.make_inputs(case, dtype, dev, gen)
        ref = _reference(x)
        flops, nbytes = spec.flops(x), spec.bytes_moved(x)
        for cname, fields in configs:
            for splits in split_counts:
                if time.perf_counter() > budget_at:
                    print(f"budget spent: stopped at {op} {case.name} {cname}", flush=True)
                    return
                row = {"op": op, "case": case.name, "config": cname, "splits": splits or "auto"}
                try:
                    config = config_cls(**fields, num_splits=splits)
                    got = launch(**x, config=config).float()
                    err = ((got - ref).abs().max() / ref.abs().max()).item()
                    row["rel_err"] = float(f"{err:.2e}")
                    if not math.isfinite(err) or err > TOLERANCE:
                        row["error"] = "differs from the reference"
                    else:
                        ms = _time(lambda: launch(**x, config=config))
                        row["us"] = round(ms * 1e3, 1)
                        row["tflops"] = round(flops / ms / 1e9, 1)
                        row["gbps"] = round(nbytes / ms / 1e6, 1)
                except Exception as exc:  # out of shared memory, a compile error: not a candidate
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
        del x, ref
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def _summary(rows: list) -> list[str]:
    lines = []
    for key in dict.fromkeys((r["op"], r["case"]) for r in rows):
        mine = [r for r in rows if (r["op"], r["case"]) == key and "us" in r]
        base = next((r for r in mine if r["config"] == "before" and r["splits"] == "auto"), None)
        dflt = next((r for r in mine if r["config"] == "default" and r["splits"] == "auto"), None)
        best = min(mine, key=lambda r: r["us"], default=None)
        if not (base and dflt and best):
            continue
        lines.append(f"{key[0]:8s} {key[1]:20s} before {base['us']:8.1f} us | default {dflt['us']:8.1f} us "
                     f"({base['us'] / dflt['us']:.2f}x) | best {best['us']:8.1f} us {best['config']} "
                     f"splits={best['splits']} ({base['us'] / best['us']:.2f}x)")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--budget-s", type=float, default=240.0, help="stop starting new variants after this")
    p.add_argument("--wide", action="store_true", help="also the other tiles, stages and warps, and the turns at "
                   "every split count from 2 to 16")
    args = p.parse_args()
    wide_prefill = args.wide
    args.out.mkdir(parents=True, exist_ok=True)
    budget_at = time.perf_counter() + args.budget_s
    rows: list = []
    _sweep(PAGED_PREFILL_ATTENTION_SPEC, paged_prefill_attention_triton, PagedPrefillAttentionConfig,
           PREFILL_SPLIT_CASES, PREFILL_CONFIGS + PREFILL_WIDE * wide_prefill,
           (None, *(range(2, 17) if wide_prefill else ())),
           rows, budget_at, "prefill")
    _sweep(PAGED_PREFILL_ATTENTION_SPEC, paged_prefill_attention_triton, PagedPrefillAttentionConfig,
           PREFILL_DIRECT_CASES, PREFILL_CONFIGS + PREFILL_WIDE * wide_prefill, (None,), rows, budget_at, "prefill")
    import triton
    meta = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
            "torch": torch.__version__, "triton": triton.__version__,
            "command": "python benchmarks/attention_pipeline_h200.py --out DIR" + (" --wide" if args.wide else "")}
    summary = _summary(rows)
    (args.out / "attention-pipeline.json").write_text(json.dumps({"meta": meta, "rows": rows, "summary": summary},
                                                                  indent=1))
    print("\n".join(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
