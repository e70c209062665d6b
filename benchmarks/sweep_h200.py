"""Sweep the launch configs of the memory-bound kernels on the H200 and print the best per shape.

Run on the GPU machine:  python benchmarks/sweep_h200.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
from pathlib import Path

import torch
import triton

from qml_kernels import load_ops
from qml_kernels.workbench.spec import spec_for
from qml_kernels.workbench.sweep import best_per_case, config_grid, sweep

GRIDS = {
    "rmsnorm": dict(block_t=[None, 1, 2, 4, 8, 16], num_warps=[4, 8, 16]),
    "add_rmsnorm": dict(block_t=[None, 1, 2, 4, 8], num_warps=[4, 8, 16]),
    "rope": dict(block_h=[None, 1, 2, 4, 8, 16], num_warps=[2, 4, 8]),
    "dequantize": dict(values_per_program=[2048, 4096, 8192, 16384], num_warps=[4, 8]),
    "paged_decode_attention": dict(block_n=[None, 32, 128], num_stages=[3, 5], target_programs=[264, 1056]),
    "paged_prefill_attention": dict(block_m=[64, 128], block_n=[64, 128], num_warps=[4, 8], num_stages=[2, 3]),
}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--ops", nargs="*", default=list(GRIDS))
    parser.add_argument("--cases", default="", help="regex: only model cases whose name matches")
    args = parser.parse_args()
    load_ops()
    lines = [f"# Launch-config sweep on the H200 ({datetime.date.today()})", "",
             f"- GPU: {torch.cuda.get_device_name()} ; torch {torch.__version__} ; triton {triton.__version__}",
             f"- command: `python {' '.join(sys.argv)}`", "- bf16, model-size cases with >= 1M elements", ""]
    for op in args.ops:
        spec = spec_for(op)
        # decode sizes of the row-wise kernels are launch-bound: not worth tuning
        cases = [c for c in spec.model_cases if not re.search(r"-T(1|128)$", c.name) and re.search(args.cases, c.name)]
        rows = sweep(op, config_grid(op, **GRIDS[op]), cases=cases)
        default = {r.case: r for cfg, r in rows if cfg == spec.launch_config()}
        lines += [f"## {op}", "", "| case | default GB/s | best GB/s | % of copy BW | best config |", "|---|---|---|---|---|"]
        for case, (cfg, r) in best_per_case(rows).items():
            d = default.get(case)
            lines.append(f"| {case} | {d.gbps:.0f} | {r.gbps:.0f} | {100 * r.frac_bandwidth:.1f} | {cfg} |"
                         if d else f"| {case} | - | {r.gbps:.0f} | {100 * r.frac_bandwidth:.1f} | {cfg} |")
        lines.append("")
        print("\n".join(lines[-(len(cases) + 4):]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"sweep-h200-{'-'.join(args.ops) if args.ops != list(GRIDS) else 'all'}-{datetime.date.today()}.md"
     ).write_text("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
