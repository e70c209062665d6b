"""Every cuDNN execution plan for a fresh prompt's causal attention, against the one torch picks.

    python benchmarks/cudnn_plans_h200.py --out DIR [--tokens 8890,26900] [--heads 32,4]

torch's ``scaled_dot_product_attention`` on the cuDNN backend builds one graph per shape and runs the
plan cuDNN's heuristics rank first. At 26,900 tokens that plan is ~494 of the ~780 ms of kernels of a
Qwen3-30B-A3B prompt (``ttft_profile_h200.py``), ~576 TFLOP/s. This script builds the same operation
with cudnn-frontend (needs ``nvidia-cudnn-frontend``, which the GPU machine lacks: bring its wheel),
asks for the plans of heuristics modes A, B and FALLBACK, and for each plan that builds: checks its
output against torch's, then times it (``moe_h200.time_layer``: CUDA events, median of ``--reps``).
Layout as the engine calls it: q ``[1, H, T, 128]`` as a view of ``[T, H, 128]``, k and v
``[1, Hkv, T, 128]`` contiguous. Writes ``cudnn-plans-h200-<date>.json``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from moe_h200 import time_layer  # beside this script


def plans_for(T: int, H: int, Hkv: int, D: int, reps: int) -> dict:
    import cudnn
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev, bf16 = torch.device("cuda"), torch.bfloat16
    q = torch.randn(T, H, D, device=dev, dtype=bf16).unsqueeze(0).transpose(1, 2)  # [1, H, T, D] view
    k = torch.randn(1, Hkv, T, D, device=dev, dtype=bf16)
    v = torch.randn(1, Hkv, T, D, device=dev, dtype=bf16)
    scale = 1 / math.sqrt(D)
    flops = 2 * T * T * D * H  # causal: 4 H D per visible pair, T^2 / 2 pairs

    def torch_sdpa():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)

    ref = torch_sdpa()
    result = {"T": T, "H": H, "Hkv": Hkv, "D": D}
    ms = time_layer(torch_sdpa, dev, reps)
    result["torch"] = {"ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1)}
    print(f"T={T} torch sdpa (cuDNN): {ms:.3f} ms, {flops / ms / 1e9:.1f} TFLOP/s", flush=True)

    g = cudnn.pygraph(io_data_type=cudnn.data_type.BFLOAT16, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT)
    qt, kt, vt = g.tensor_like(q), g.tensor_like(k), g.tensor_like(v)
    o, _ = g.sdpa(name="sdpa", q=qt, k=kt, v=vt, attn_scale=scale, generate_stats=False,
                  diagonal_band_right_bound=0, diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT)
    out = torch.empty(T, H, D, device=dev, dtype=bf16).unsqueeze(0).transpose(1, 2)
    o.set_output(True).set_dim(list(out.shape)).set_stride(list(out.stride()))
    g.validate()
    g.build_operation_graph()
    modes = [cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK]
    try:
        g.create_execution_plans(modes)
    except Exception as e:  # B is not offered everywhere
        result["modes_error"] = str(e)[:300]
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    n = g.get_execution_plan_count()
    result["plans"] = []
    for i in range(n):
        row = {"index": i}
        try:
            row["name"] = g.get_plan_name_at_index(i)
            g.build_plan_at_index(i)
            ws = torch.empty(max(1, g.get_workspace_size_plan_at_index(i)), device=dev, dtype=torch.uint8)
            pack = {qt: q, kt: k, vt: v, o: out}
            run = lambda: g.execute_plan_at_index(pack, ws, index=i)
            out.zero_()
            run()
            torch.cuda.synchronize()
            row["max_abs_diff"] = float((out.float() - ref.float()).abs().max())
            ms = time_layer(run, dev, reps)
            row.update(ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1))
        except Exception as e:
            row["error"] = (str(e) or traceback.format_exc())[:300]
        result["plans"].append(row)
        print(f"T={T} plan {row}", flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", default="8890,26900")
    parser.add_argument("--heads", default="32,4", help="query heads, KV heads (Qwen3-30B-A3B: 32,4)")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    torch.backends.cudnn.version()  # loads torch's libcudnn, which the frontend binds to
    import cudnn
    H, Hkv = map(int, args.heads.split(","))
    meta = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
            "cudnn_frontend": getattr(cudnn, "__version__", "?"), "command": "python " + " ".join(sys.argv)}
    rows = [plans_for(T, H, Hkv, 128, args.reps) for T in map(int, args.tokens.split(","))]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"cudnn-plans-h200-{meta['date']}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
