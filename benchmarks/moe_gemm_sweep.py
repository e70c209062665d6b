"""Sweep the grouped GEMM's launch configs at Qwen3-30B-A3B shapes on the H200 (prefill sizes).

    python benchmarks/moe_gemm_sweep.py --out DIR [--tokens 512,2048,8192] [--grid full|tma|order]
    python benchmarks/moe_gemm_sweep.py --out DIR --grid grouped --tokens 8890,26900

``--grid grouped``: the rows kept grouped by expert between the two GEMMs (``moe_experts_grouped``) against
pair order, at 128-row segments with the launcher's tiles: gate-up writing grouped rows; the down GEMM reading
them through TMA, by pointer, or as ``torch._grouped_mm``; and the whole layer (both GEMMs and the combine),
each checked against pair order first.

For each token count, uniform random routing (what random router weights give), both GEMMs of an
expert FFN (gate-up with the fused SwiGLU, down) are timed for every (alignment block, tile) combination;
each config's output is first compared with the default config's. Prints and writes the best per
(GEMM, T) and the whole table as JSON, so ``moe_gemm_config`` can be set from measurements.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import sys
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

from qml_kernels.moe_gemm import MoEGemmConfig, moe_block_size, moe_gemm_config, moe_gemm_triton
from qml_kernels.moe_routing import draw_expert_ids, moe_align_triton, moe_combine_triton

E, K_TOP, D, I = 128, 8, 2048, 768


def configs(grid: str = "full"):
    if grid == "order":  # the launcher's prefill tiles in both launch orders (MoEGemmConfig.columns_first)
        for block_size in (64, 128):
            for swiglu in (True, False):
                base = moe_gemm_config(block_size, swiglu)
                for cfg in (base, dataclasses.replace(base, columns_first=not base.columns_first)):
                    yield block_size, cfg
        # and tiles around them, columns first
        for block_size, block_m, block_n, block_k, warps, stages in (
                (128, 64, 64, 64, 4, 3), (128, 64, 128, 64, 4, 3), (128, 128, 64, 64, 4, 3), (128, 128, 64, 64, 8, 4),
                (128, 128, 128, 64, 8, 4), (64, 64, 64, 64, 4, 4), (64, 64, 128, 64, 4, 3), (64, 64, 64, 128, 4, 3)):
            yield block_size, MoEGemmConfig(block_m, block_n, block_k, warps, stages, tma_weights=True)
        return
    if grid == "tma":  # the launcher's prefill tiles and a few around them, weights by pointer and by TMA
        for block_size in (64, 128):
            base = moe_gemm_config(block_size)
            for cfg in (base, dataclasses.replace(base, num_stages=4), dataclasses.replace(base, block_k=128),
                        dataclasses.replace(base, block_n=2 * base.block_n, num_warps=8)):
                for tma in (False, True):
                    yield block_size, dataclasses.replace(cfg, tma_weights=tma)
        return
    for block_size, block_m, block_n, block_k, warps, stages in itertools.product(
            (64, 128), (64, 128), (64, 128, 256), (32, 64), (4, 8), (3, 4)):
        if block_m > block_size or (block_n == 256 and block_m == 128):
            continue
        yield block_size, MoEGemmConfig(block_m, block_n, block_k, warps, stages)


def grouped_mm_row(name: str, T: int, ids: torch.Tensor, x, h, w_gate_up, w_down, flops: int) -> dict:
    """torch._grouped_mm (CUTLASS) on the same product: the GEMM alone on rows already in expert order
    (``gemm_us``), and with what it needs around it to do our kernel's work (``with_gather_us``: the
    activation rows gathered into expert order; gate-up also the SwiGLU over its [T·k, 2I] output)."""
    order = ids.flatten().argsort(stable=True)  # pairs in expert order
    offs = torch.bincount(ids.flatten(), minlength=E).cumsum(0).to(torch.int32)
    if name == "gate-up":
        w, rows = w_gate_up.transpose(1, 2), order // K_TOP
        a_src = x
    else:
        w, rows, a_src = w_down.transpose(1, 2), order, h
    a = a_src[rows].contiguous()
    gemm = lambda: torch._grouped_mm(a, w, offs=offs)

    def whole():
        y = torch._grouped_mm(a_src[rows], w, offs=offs)
        if name == "gate-up":
            gate, up = y.chunk(2, dim=-1)
            y = torch.nn.functional.silu(gate) * up
        return y

    us = do_bench(gemm, warmup=10, rep=50, return_mode="median") * 1e3
    whole_us = do_bench(whole, warmup=10, rep=50, return_mode="median") * 1e3
    return {"gemm": name, "T": T, "kernel": "torch._grouped_mm", "gemm_us": round(us, 1),
            "TFLOP_per_s": round(flops / us / 1e6, 1), "with_gather_us": round(whole_us, 1)}


def grouped_rows(T: int, ids: torch.Tensor, x, w_gate_up, w_down) -> list[dict]:
    """Pair order against grouped rows at 128-row segments (see the module docstring): us per call."""
    sorted_pairs, offsets, inverse = moe_align_triton(ids, E, 128)
    rows = inverse.long()
    weights = torch.softmax(torch.randn(T, K_TOP, device="cuda"), dim=-1)
    gu, dn = moe_gemm_config(128, True), moe_gemm_config(128, False)
    pointer = dataclasses.replace(dn, tma_weights=False)  # no TMA for the weights, nor for the rows
    h = moe_gemm_triton(x, w_gate_up, sorted_pairs, offsets, 128, K_TOP, True)  # pair order
    hs = moe_gemm_triton(x, w_gate_up, sorted_pairs, offsets, 128, K_TOP, True, sorted_out=True)
    torch.testing.assert_close(hs[rows], h, rtol=0, atol=0)
    y = moe_gemm_triton(h, w_down, sorted_pairs, offsets, 128, 1)
    down = {
        "down, pair order (gathered rows)": lambda: moe_gemm_triton(h, w_down, sorted_pairs, offsets, 128, 1),
        "down, grouped rows through TMA": lambda: moe_gemm_triton(hs, w_down, sorted_pairs, offsets, 128, 1,
                                                                  sorted_in=True, sorted_out=True, config=dn),
        "down, grouped rows by pointer": lambda: moe_gemm_triton(hs, w_down, sorted_pairs, offsets, 128, 1,
                                                                 sorted_in=True, sorted_out=True, config=pointer),
        "down, torch._grouped_mm on grouped rows": lambda: torch._grouped_mm(hs, w_down.transpose(1, 2),
                                                                             offs=offsets[1:]),
    }
    cases = {
        "gate-up, pair order": lambda: moe_gemm_triton(x, w_gate_up, sorted_pairs, offsets, 128, K_TOP, True),
        "gate-up, grouped rows out": lambda: moe_gemm_triton(x, w_gate_up, sorted_pairs, offsets, 128, K_TOP, True,
                                                             sorted_out=True, config=gu),
        **down,
        "layer, pair order": lambda: moe_combine_triton(moe_gemm_triton(
            moe_gemm_triton(x, w_gate_up, sorted_pairs, offsets, 128, K_TOP, True), w_down, sorted_pairs, offsets,
            128, 1), weights),
        "layer, grouped rows (our down)": lambda: moe_combine_triton(moe_gemm_triton(
            moe_gemm_triton(x, w_gate_up, sorted_pairs, offsets, 128, K_TOP, True, sorted_out=True), w_down,
            sorted_pairs, offsets, 128, 1, sorted_in=True, sorted_out=True), weights, inverse),
        "layer, grouped rows (torch._grouped_mm down)": lambda: moe_combine_triton(torch._grouped_mm(
            moe_gemm_triton(x, w_gate_up, sorted_pairs, offsets, 128, K_TOP, True, sorted_out=True),
            w_down.transpose(1, 2), offs=offsets[1:]), weights, inverse),
    }
    for name, fn in down.items():  # each down variant's rows against pair order's
        torch.testing.assert_close(fn()[rows] if "grouped" in name else fn(), y, rtol=2e-2, atol=2e-2)
    out = []
    for name, fn in cases.items():
        us = do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3
        out.append({"T": T, "case": name, "us": round(us, 1)})
        print(f"T={T:<6} {name:<48} {us:9.1f} us", flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", default="512,2048,8192")
    parser.add_argument("--grid", choices=("full", "tma", "order", "grouped"), default="full",
                        help="tma: the launcher's prefill tiles and neighbours, each with and without TMA weight loads; "
                             "order: the launcher's tiles in both launch orders, and torch._grouped_mm beside them")
    args = parser.parse_args()
    gen = torch.Generator("cuda").manual_seed(0)
    w_gate_up = (torch.randn(E, 2 * I, D, device="cuda", generator=gen) * D**-0.5).bfloat16()
    w_down = (torch.randn(E, D, I, device="cuda", generator=gen) * I**-0.5).bfloat16()
    rows, best = [], {}
    for T in (int(t) for t in args.tokens.split(",")):
        ids = draw_expert_ids(T, E, K_TOP, torch.Generator().manual_seed(T)).cuda()
        x = torch.randn(T, D, device="cuda", generator=gen).bfloat16()
        h = torch.randn(T * K_TOP, I, device="cuda", generator=gen).bfloat16()
        if args.grid == "grouped":
            rows += grouped_rows(T, ids, x, w_gate_up, w_down)
            continue
        default_block = moe_block_size(T * K_TOP, E)
        grouping = {b: moe_align_triton(ids, E, b)[:2] for b in (64, 128)}
        gemms = {"gate-up": lambda b, cfg: moe_gemm_triton(x, w_gate_up, *grouping[b], b, K_TOP, True, config=cfg),
                 "down": lambda b, cfg: moe_gemm_triton(h, w_down, *grouping[b], b, 1, config=cfg)}
        for name, fn in gemms.items():
            expected = fn(default_block, None)
            flops = 2 * T * K_TOP * (2 * I if name == "gate-up" else D) * (D if name == "gate-up" else I)
            for block_size, cfg in configs(args.grid):
                try:
                    got = fn(block_size, cfg)
                    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
                    us = do_bench(lambda: fn(block_size, cfg), warmup=10, rep=50, return_mode="median") * 1e3
                except triton.runtime.errors.OutOfResources:
                    continue
                row = {"gemm": name, "T": T, "block_size": block_size, **cfg.__dict__, "us": round(us, 1),
                       "TFLOP_per_s": round(flops / us / 1e6, 1), "default": block_size == default_block and cfg
                       == moe_gemm_config(block_size, name == "gate-up")}
                rows.append(row)
                if (name, T) not in best or us < best[name, T]["us"]:
                    best[name, T] = row
            default_us = next(r["us"] for r in rows if r.get("default") and r["gemm"] == name and r["T"] == T)
            print(f"{name:<8}T={T:<6} default {default_us:8.1f} us   best {best[name, T]}", flush=True)
            if args.grid == "order" and hasattr(torch, "_grouped_mm"):
                rows.append(grouped_mm_row(name, T, ids, x, h, w_gate_up, w_down, flops))
                print(f"{name:<8}T={T:<6} torch._grouped_mm {rows[-1]}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.date.today().isoformat()
    meta = {"date": stamp, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "command": "python " + " ".join(sys.argv)}
    (args.out / f"moe-gemm-sweep-{stamp}.json").write_text(json.dumps({**meta, "best": list(best.values()),
                                                                        "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
