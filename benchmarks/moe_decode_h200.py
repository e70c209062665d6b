"""The decode expert FFN (``moe_decode``) against the grouped path at Qwen3-30B-A3B shapes on the H200.

    python benchmarks/moe_decode_h200.py --out DIR [--tokens 1,2,4] [--layers 8] [--sections decode,grouped]

For 1, 2 and 4 tokens: ``--layers`` copies of the experts' bf16 weights (9.4 MB an expert, 1.2 GB a
layer, so every call streams from HBM as in a decode step), each with its own random router logits
(uniform routing, what random router weights give, and a skewed one: every token's top choices among 4
hot experts). Timed inside a CUDA graph of one call per layer, back to back:
- ``grouped``: ``moe_forward`` with the decode path off (fused route-and-align, two ``moe_gemm``, combine);
- ``decode``: ``moe_decode_triton`` with routing inline: at the first token count every config of a small
  grid, one kernel's fields at a time from the best so far (each checked against ``moe_decode_ref``
  first); the other counts take the best; and the best config with ``moe_router`` run first.
Prints us per layer and the bandwidth on the chosen experts' bytes. Section ``grouped``: the two
``moe_gemm`` calls alone at decode sizes (16-row segments) for a grid of tile configs, each checked
against the default config's output, timed the same way. Writes the rows as JSON.
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
from gemv_h200 import graph_us  # beside this script: weight copies cycled inside a CUDA graph

from qml_kernels import moe_decode as md
from qml_kernels.moe_decode import MoEDecodeConfig, moe_decode_ref, moe_decode_triton
from qml_kernels.moe_gemm import MoEGemmConfig, moe_forward, moe_gemm_config, moe_gemm_triton
from qml_kernels.moe_routing import moe_align_triton, moe_router_triton

E, TOP_K, D, FFN = 128, 8, 2048, 768
EXPERT_BYTES = 3 * FFN * D * 2


def grid():
    for gn, gk, gw in itertools.product((2, 4, 8), (256, 512, 1024), (4, 8)):
        yield "gate_up", dict(gate_up_block_n=gn, gate_up_block_k=gk, gate_up_warps=gw)
    for dn, dk, dw in itertools.product((1, 2, 4, 8), (128, 256, 512), (4, 8)):
        yield "down", dict(down_block_n=dn, down_block_k=dk, down_warps=dw)


def grouped_grid():
    """moe_gemm configs for 16-row segments: tile width, K step, pipeline depth (4 warps), and warps; each
    with the weights by pointer loads and through TMA."""
    for tma in (False, True):
        for bn, bk, stages in itertools.product((16, 32, 64), (64, 128, 256), (3, 5, 7)):
            yield MoEGemmConfig(16, bn, bk, 4, stages, tma)
        for bn, warps in itertools.product((16, 32), (2, 8)):
            yield MoEGemmConfig(16, bn, 128, warps, 5, tma)


def sweep_grouped(tokens, w_gate_up, w_down, gen, rows, seconds) -> None:
    """The grouped GEMMs alone at decode sizes (segments of 16 rows): the default config and the grid at
    the first token count, the 4 best of those at the others."""
    t0, L = time.perf_counter(), len(w_gate_up)
    top = {}
    for T in tokens:
        P = T * TOP_K
        x = torch.randn(T, D, device="cuda", generator=gen).bfloat16()
        h = torch.randn(P, FFN, device="cuda", generator=gen).bfloat16()
        grouping, distinct = [], 0
        for _ in range(L):
            _, ids = moe_router_triton(torch.randn(T, E, device="cuda", generator=gen), TOP_K, True)
            grouping.append(moe_align_triton(ids, E, 16)[:2])
            distinct += int(torch.unique(ids).numel()) / L
        outs = {"gate-up": [torch.empty(P, FFN, device="cuda", dtype=torch.bfloat16) for _ in range(L)],
                "down": [torch.empty(P, D, device="cuda", dtype=torch.bfloat16) for _ in range(L)]}
        calls = {"gate-up": lambda i, cfg: moe_gemm_triton(x, w_gate_up[i], *grouping[i], 16, TOP_K, True,
                                                           out=outs["gate-up"][i], config=cfg),
                 "down": lambda i, cfg: moe_gemm_triton(h, w_down[i], *grouping[i], 16, 1, out=outs["down"][i],
                                                        config=cfg)}
        for gemm, fn in calls.items():
            expected = fn(0, None).clone()
            nbytes = distinct * (2 if gemm == "gate-up" else 1) * FFN * D * 2
            default_us = graph_us(lambda i: fn(i, None), L)
            best = (moe_gemm_config(16, gemm == "gate-up"), default_us)
            configs = list(grouped_grid()) if T == tokens[0] else top.get(gemm, [])
            timed = []
            for cfg in configs:
                if time.perf_counter() - t0 > seconds:
                    break
                try:
                    torch.testing.assert_close(fn(0, cfg), expected, rtol=2e-2, atol=2e-2)
                    us = graph_us(lambda i, cfg=cfg: fn(i, cfg), L)
                except triton.runtime.errors.OutOfResources:
                    continue
                timed.append((us, cfg))
                rows.append({"section": "grouped", "gemm": gemm, "T": T, **cfg.__dict__, "us": round(us, 2)})
                print(json.dumps(rows[-1]), flush=True)
                if us < best[1]:
                    best = (cfg, us)
            if T == tokens[0]:
                top[gemm] = [cfg for _, cfg in sorted(timed, key=lambda t: t[0])[:4]]
            row = {"section": "grouped", "gemm": gemm, "T": T, "distinct_experts": distinct,
                   "default_us": round(default_us, 2), "default_tb_s": round(nbytes / default_us / 1e6, 2),
                   "best_us": round(best[1], 2), "best_tb_s": round(nbytes / best[1] / 1e6, 2),
                   "best_config": best[0].__dict__}
            rows.append(row)
            print(json.dumps(row), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", default="1,2,4")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--sections", default="decode,grouped")
    parser.add_argument("--seconds", type=float, default=200.0, help="stop a section's sweep after this long")
    args = parser.parse_args()
    t0 = time.perf_counter()
    gen = torch.Generator("cuda").manual_seed(0)
    L = args.layers
    w_gate_up = [(torch.randn(E, 2 * FFN, D, device="cuda", generator=gen) * D**-0.5).bfloat16() for _ in range(L)]
    w_down = [(torch.randn(E, D, FFN, device="cuda", generator=gen) * FFN**-0.5).bfloat16() for _ in range(L)]
    rows, tokens = [], [int(t) for t in args.tokens.split(",")]
    sections = args.sections.split(",")
    if "grouped" in sections:
        sweep_grouped(tokens, w_gate_up, w_down, gen, rows, args.seconds)
    first, best = tokens[0], MoEDecodeConfig()
    for T in tokens if "decode" in sections else []:
        x = torch.randn(T, D, device="cuda", generator=gen).bfloat16()
        for spread in ("uniform", "skewed"):
            logits = [torch.randn(T, E, device="cuda", generator=gen).bfloat16() for _ in range(L)]
            if spread == "skewed":  # 4 hot experts lead every token's choice
                for lg in logits:
                    lg[:, :4] += 8.0
            outs = [torch.empty(T, D, device="cuda", dtype=torch.bfloat16) for _ in range(L)]
            chosen = TOP_K * T * EXPERT_BYTES  # bytes the decode path reads a layer (each pair's expert)
            distinct = sum(int(torch.unique(torch.topk(lg.float(), TOP_K, dim=1).indices).numel()) for lg in logits) / L
            md.MOE_DECODE = False
            grouped = graph_us(lambda i: outs[i].copy_(moe_forward(x, logits[i], w_gate_up[i], w_down[i], TOP_K,
                                                                    True)), L)
            md.MOE_DECODE = True
            ref = moe_decode_ref(x, logits[0], w_gate_up[0], w_down[0], TOP_K, True).float()

            def run(cfg, inline=True):
                got = moe_decode_triton(x, logits[0], w_gate_up[0], w_down[0], TOP_K, True, config=cfg,
                                        route_inline=inline)
                err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
                if not err <= 2e-2:
                    raise AssertionError(f"{cfg}: rel err {err:.2e}")
                return graph_us(lambda i: moe_decode_triton(x, logits[i], w_gate_up[i], w_down[i], TOP_K, True,
                                                            out=outs[i], config=cfg, route_inline=inline), L)

            default_us = run(MoEDecodeConfig())
            best_us = run(best)
            if spread == "uniform" and T == first:  # the sweep at the first token count; the others take its best
                for part, fields in grid():
                    if time.perf_counter() - t0 > args.seconds:
                        break
                    cfg = MoEDecodeConfig(**{**best.__dict__, **fields})
                    try:
                        us = run(cfg)
                    except triton.runtime.errors.OutOfResources:
                        continue
                    rows.append({"T": T, "part": part, **cfg.__dict__, "us": round(us, 2)})
                    if us < best_us:
                        best, best_us = cfg, us
            router_first = run(best, inline=False)
            row = {"T": T, "spread": spread, "distinct_experts": distinct, "grouped_us": round(grouped, 2),
                   "decode_default_us": round(default_us, 2), "decode_best_us": round(best_us, 2),
                   "decode_best_router_first_us": round(router_first, 2), "best_config": best.__dict__,
                   "decode_best_tb_s": round(chosen / best_us / 1e6, 2),
                   "grouped_tb_s_on_distinct": round(distinct * EXPERT_BYTES / grouped / 1e6, 2)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    stamp = datetime.date.today().isoformat()
    meta = {"date": stamp, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "command": "python " + " ".join(sys.argv)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"moe-decode-h200-{stamp}.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
