"""Check every kernel at real shapes in bf16 and benchmark it against the H200's ceilings.

Run on the GPU machine:  python benchmarks/kernels_h200.py --out benchmarks/results
Writes kernels-h200-<date>.md (tables) and .json (raw rows). For each op with a
Triton implementation: correctness on the small cases in fp32/fp16/bf16 and on the
model-size cases in bf16, then the median time of the Triton kernel and of the
PyTorch reference (eager torch, the baseline a user already has) on the model cases.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch
import triton

from qml_kernels import load_ops, registry
from qml_kernels.workbench import all_specs, bench, check, table


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--ops", nargs="*", help="only these ops")
    parser.add_argument("--name", default="kernels-h200", help="file name prefix of the results")
    args = parser.parse_args()
    out = Path(args.out)
    load_ops()
    assert torch.cuda.is_available(), "this script measures the GPU"
    stamp = datetime.date.today().isoformat()
    header = [
        f"# Kernel checks and benchmarks on the H200 ({stamp})",
        "",
        f"- GPU: {torch.cuda.get_device_name()} ; torch {torch.__version__} (CUDA {torch.version.cuda}) ;"
        f" triton {triton.__version__} ; python {platform.python_version()}",
        f"- command: `python {' '.join(sys.argv)}`",
        "- ceilings: copy 4.22 TB/s (read + write), bf16 matmul 765 TFLOP/s (measured on this card)",
        "- bench: triton.testing.do_bench median, inputs rotated over > 2x L2; reference = the op's PyTorch"
        " reference (eager torch)",
        "",
    ]
    sections, rows, failures = [], [], 0
    for op, spec in all_specs().items():
        if args.ops and op not in args.ops:
            continue
        if "triton" not in registry.implementations(op):
            continue
        t0 = time.perf_counter()
        small = check(op, "triton", dtypes=list(spec.dtypes))
        large = check(op, "triton", cases=list(spec.model_cases), dtypes=[torch.bfloat16]) if spec.model_cases \
            else None
        ok = small.ok and (large is None or large.ok)
        failures += not ok
        # the baselines a user already has: a vendor library where one is registered, else eager torch
        baselines = [i for i in registry.implementations(op) if i not in ("triton", "reference")] or ["reference"]
        results = bench(op, "triton") + [r for impl in baselines for r in bench(op, impl)]
        rows += [r.row() for r in results]
        sections += [f"## {op}: {'correct' if ok else 'FAILED'} ({time.perf_counter() - t0:.0f} s)", "", "```",
                     str(small), *([str(large)] if large else []), "", table(results), "```", ""]
        print(f"{op}: {'correct' if ok else 'FAILED'}", flush=True)
        # written after every op, so a run cut short by a time limit keeps what it measured
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{args.name}-{stamp}.md").write_text("\n".join(header + sections))
        (out / f"{args.name}-{stamp}.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(header + sections))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
