"""An L2 prefetch of the next weight stream across a latency-bound gap: measured, and not kept.

    python benchmarks/l2_prefetch_h200.py --out DIR [--gaps-us 0,2,4,8] [--programs 16,64,132]

A decode layer has the shape ``[gap of small kernels] -> [GEMV over a weight]``: this times 48 such
layers in one CUDA graph (each layer its own weight, so nothing stays in L2 from the layer before),
the gap a one-program kernel that spins for ``gap`` us, the GEMV ``qml_kernels.gemv`` at one token,
with and without ``l2_prefetch`` of the layer's weight launched just before its gap. Shapes: the
output projections of Qwen3-30B-A3B (2048 x 4096, 16.8 MB) and Llama-3.1-8B (4096 x 4096, 33.5 MB).
Also the GEMV alone with its weight cold (after a 256 MB scrub) and warm (read just before).
Expected: with a gap long enough to stream the weight (4 us for 16.8 MB at 4.2 TB/s) the layer costs
about the gap plus an L2-speed GEMV, not the gap plus an HBM-speed one. Writes ``l2-prefetch-<date>.json``.

Measured on the H200 (2026-12-04, ``results/l2-prefetch-h200-2026-12-04.json``): the GEMV does run faster
from L2 (16.8 MB: 9.35 us cold, 5.92 after a read of its weight), but after the prefetch it did not, at
any gap: Qwen3's layer with an 8 us gap 17.01 us without, 17.04 / 17.73 / 17.94 with the prefetch on
16 / 64 / 132 programs (Llama's 33.6 MB, which cannot stay in L2 beside the rest: 21.54 -> 24.24-25.30).
On 16 programs with no gap the prefetch kernel alone took ~11 us: each SM issues the bulk requests at a
bounded rate. In the engine's decode step (the forward prefetching the output projection's weight after
the QKV projection and the next layer's first 16 MB of QKV after the feed-forward, ``pdl_h200.py``,
tokens unchanged) batch 1 went 3.078 -> 3.367 ms (Qwen3-30B-A3B; 3.226 with the output projection's
prefetch alone, 3.244 with the QKV's alone) and 4.622 -> 4.847 (Llama-3.1-8B). Not kept: the hook left
the forward, and the kernel stays here to reproduce the measurement.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from graph_timing import graph_ms  # noqa: E402  (beside this script)

from qml_kernels import pdl  # noqa: E402
from qml_kernels.gemv import GemvConfig, gemv_triton  # noqa: E402

LAYERS = 48


@triton.jit
def _spin_kernel(ns):
    start = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    now = start
    while now - start < ns:
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                        pack=1)


@triton.jit
def _issue_prefetch(base_ptr, nbytes, part, parts, LANES: tl.constexpr):
    """Lane i of ``part`` (of ``parts``) asks L2 for its share of bytes [0, nbytes) of ``base_ptr``
    (a byte pointer, 16-byte aligned; shares are multiples of 16 bytes)."""
    units = tl.cdiv(nbytes, 16)  # 16-byte units: the instruction's alignment and size granule
    per_lane = tl.cdiv(units, parts * LANES)
    lane = part * LANES + tl.arange(0, LANES)
    start = tl.minimum(lane * per_lane, units)
    size = (tl.minimum(start + per_lane, units) - start) * 16
    addr = base_ptr + start.to(tl.int64) * 16
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [addr, size.to(tl.uint32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _l2_prefetch_kernel(base_ptr, nbytes, PDL: tl.constexpr, LANES: tl.constexpr):
    _issue_prefetch(base_ptr, nbytes, tl.program_id(0), tl.num_programs(0), LANES)
    # after the requests (weights only, never written in a step): qml_kernels.pdl's rules from here
    pdl.enter(PDL)


def l2_prefetch(t: torch.Tensor, programs: int) -> None:
    """Ask L2 for all of ``t`` (contiguous, 16-byte aligned, a multiple of 16 bytes): ``programs`` one-warp
    programs, each lane one ``cp.async.bulk.prefetch.L2.global`` over its share, issued before the wait."""
    _l2_prefetch_kernel[(programs,)](t.view(-1).view(torch.uint8), t.numel() * t.element_size(), LANES=32,
                                     num_warps=1, **pdl.launch_args(t))


def spin(us: float) -> None:
    if us > 0:
        _spin_kernel[(1,)](int(us * 1000), num_warps=1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--gaps-us", default="0,2,4,8")
    parser.add_argument("--programs", default="16,64,132")
    args = parser.parse_args()
    dev = torch.device("cuda")
    gaps = [float(g) for g in args.gaps_us.split(",")]
    programs = [int(p) for p in args.programs.split(",")]
    rows = []
    scrub = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)
    for name, (n, k), cfg in (("qwen3-30b-a3b wo", (2048, 4096), GemvConfig(2, 1024, 4)),
                              ("llama-3.1-8b wo", (4096, 4096), GemvConfig(4, 512, 4))):
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        out = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
        ref = gemv_triton(x, ws[0], config=cfg).clone()
        mb = n * k * 2 / 1e6
        # the GEMV alone: cold (scrubbed) and warm (its weight read just before)
        cold = graph_ms(lambda: [(scrub.add_(1), gemv_triton(x, w, out, cfg)) for w in ws[:8]]) - graph_ms(
            lambda: [scrub.add_(1) for _ in range(8)])
        warm = graph_ms(lambda: [(w.sum(), gemv_triton(x, w, out, cfg)) for w in ws[:8]]) - graph_ms(
            lambda: [w.sum() for w in ws[:8]])
        row = {"weight": name, "mb": mb, "gemv_cold_us": cold / 8 * 1e3, "gemv_warm_us": warm / 8 * 1e3}
        print(f"{name} ({mb:.1f} MB): GEMV cold {row['gemv_cold_us']:.2f} us, after a read {row['gemv_warm_us']:.2f}",
              flush=True)
        for gap in gaps:
            base = graph_ms(lambda: [(spin(gap), gemv_triton(x, w, out, cfg)) for w in ws]) / LAYERS * 1e3
            row[f"gap{gap:g}_none_us"] = base
            line = f"  gap {gap:g} us: no prefetch {base:.2f} us a layer"
            for p in programs:
                t = graph_ms(lambda: [(l2_prefetch(w, p), spin(gap), gemv_triton(x, w, out, cfg))
                                      for w in ws]) / LAYERS * 1e3
                row[f"gap{gap:g}_prefetch{p}_us"] = t
                line += f", prefetch on {p} programs {t:.2f}"
            print(line, flush=True)
        l2_prefetch(ws[0], 64)
        torch.testing.assert_close(gemv_triton(x, ws[0], config=cfg), ref, rtol=0, atol=0)  # a hint: same values
        rows.append(row)
    meta = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": triton.__version__, "command": "python " + " ".join(sys.argv)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"l2-prefetch-{meta['date']}.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
