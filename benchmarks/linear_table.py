"""Write the per-shape GEMM choice (qml_kernels/tuning/linear_h200.json) from an H200 benchmark run.

    python benchmarks/linear_table.py benchmarks/results/gemm-h200-<date>.json

For every model shape benchmarked with both implementations, Triton is listed where it beat
cuBLAS by more than MARGIN (so run-to-run noise does not flip a choice); every other shape
stays on cuBLAS, which is also what unlisted shapes get.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from qml_kernels import load_ops
from qml_kernels.linear import default_config
from qml_kernels.tuning import TABLE_DIR, token_bucket, write_table
from qml_kernels.workbench import spec_for

MARGIN = 0.03
H200_SMS = 132


def main(results_path: str) -> int:
    load_ops()
    rows = [r for r in json.loads(Path(results_path).read_text()) if r["op"] == "linear"]
    ms = {(r["case"], r["impl"]): r["ms"] for r in rows}
    entries = []
    for case in spec_for("linear").model_cases:
        triton, cublas = ms.get((case.name, "triton")), ms.get((case.name, "cublas"))
        if triton is None or cublas is None or triton > (1 - MARGIN) * cublas:
            continue
        T, N, K = case.dims["T"], case.dims["N"], case.dims["K"]
        entries.append({"dtype": "bfloat16", "N": N, "K": K, "T": token_bucket(T), "impl": "triton",
                        "config": default_config(T, N, K, torch.bfloat16, H200_SMS)})
        print(f"{case.name}: triton {triton:.4f} ms vs cublas {cublas:.4f} ms")
    about = ("Fastest verified linear implementation per shape on the NVIDIA H200. Key: dtype, N (output "
             "features), K (input features), T (token bucket: the next power of two >= the call's token count; "
             "measured at T = bucket). impl: 'triton' or 'cublas'; config: LinearConfig fields for triton. "
             f"Shapes not listed run cuBLAS. Made by benchmarks/linear_table.py from {Path(results_path).name} "
             f"(Triton listed only where it beat cuBLAS by more than {MARGIN:.0%}).")
    write_table(TABLE_DIR / "linear_h200.json", "linear", "H200", entries, about=about)
    print(f"{len(entries)} shapes on triton")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
