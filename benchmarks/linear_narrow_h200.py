"""The token-narrow GEMM (``qml_kernels.linear_narrow``) against cuBLAS at a turn's token counts, on the H200.

    python benchmarks/linear_narrow_h200.py --out DIR [--table PATH] [--seconds 420]

Question: at the ~150 new tokens of a conversation's next turn (run in the 160-token prefill graph), can
Llama-3.1-8B's four GEMMs a layer (qkv 4096->6144, o 4096->4096, gate_up 4096->28672, down 14336->4096) come
closer to their floors (436 MB of weights: 97 us at ~4.5 TB/s; 70 GFLOP at 160 tokens: 91 us at 765 TFLOP/s)
than cuBLAS's 160 us (the engine's profile, 2026-12-04: nvjet tiles of 96 or 192 tokens), with the features
as the MMA's rows and the tokens in 128 + 32 columns? Expected: 120-140 us if the weight stream is what
cuBLAS leaves on the table; at 256 tokens about level. Got (2026-12-05, ``results/linear-narrow-h200-2026-12-05.json``):
no; 161 us at 160 tokens at the best configs against cuBLAS's 146, behind at every token count.

For each token count T and each shape, first every form is checked in bf16 against ``linear_ref``
(max |err| / max |ref| <= 1.6e-2), then timed inside a CUDA graph of back-to-back calls over 8
copies of the weights (``gemv_h200.graph_us``: they exceed L2, as a step's layers do):
- ``cublas``: ``F.linear`` (what the engine runs); ``cublaslt``: the same with cuBLASLt preferred;
- ``swapped``: cuBLAS on ``w @ x^T`` (the same orientation as ours, cuBLAS' tiles);
- ``triton``: ``qml_kernels.linear``'s GEMM with its heuristic config;
- ``narrow``: the heuristic's config (``default_narrow_config``), and every config of a small grid
  (block_f 64/128/256, split_k 1/2/4, 2-4 stages); ``narrow-best`` is the fastest of them per shape.
Per T the layer's sum of the four shapes is printed for each form.

``--table PATH``: a tuning table with the committed entries plus a ``narrow`` entry (the best config)
for each (shape, token bucket) where narrow-best beat cuBLAS by more than 3% at every T measured in the
bucket (``token_bucket``: 160 covers 129-160, 192 161-192, ..., 128 covers 65-128); try it in the engine
with ``QML_LINEAR_TABLE=PATH`` before committing.
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
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).parent))
from gemv_h200 import graph_us  # noqa: E402

from qml_kernels.linear import linear_ref, linear_triton, load_linear_table  # noqa: E402
from qml_kernels.linear_narrow import NarrowConfig, default_narrow_config, linear_narrow, token_tiles  # noqa: E402
from qml_kernels.tuning import token_bucket, write_table  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
# the prefill graphs' buckets a turn runs in (160, 192, 256) first, then eager token counts beside them
TOKENS = (160, 150, 192, 256, 133, 219, 224, 128, 96, 64)
COPIES = 8
TOLERANCE = 1.6e-2
MARGIN = 0.03


def grid(T: int) -> list[NarrowConfig]:
    a, b = token_tiles(T)
    out = []
    for bf, split, stages in itertools.product((64, 128, 256), (1, 2, 4), (2, 3, 4)):
        if (bf + a + b) * 64 * 2 * stages > 200 * 1024:
            continue  # the operand stages alone over the shared memory a block may use
        out.append(NarrowConfig(bf, 64, split, 4 if bf == 64 else 8, stages))
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--table", type=Path, help="write a candidate tuning table here")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--seconds", type=float, default=420.0, help="stop starting new token counts after this")
    args = parser.parse_args()
    t_start = time.perf_counter()
    dev = torch.device("cuda")
    gen = torch.Generator("cuda").manual_seed(0)
    weights = {name: [torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=gen) * k ** -0.5
                      for _ in range(COPIES)] for name, (n, k) in SHAPES.items()}
    result = {"meta": {"gpu": torch.cuda.get_device_name(), "date": str(datetime.date.today()),
                       "torch": torch.__version__, "triton": triton.__version__,
                       "command": " ".join(sys.argv)}, "rows": [], "layer_us": {}}
    for T in map(int, args.tokens.split(",")):
        if time.perf_counter() - t_start > args.seconds:
            print(f"stopping before T={T}: {args.seconds:.0f} s spent", flush=True)
            break
        layer: dict[str, float] = {}
        for name, (N, K) in SHAPES.items():
            ws = weights[name]
            x = torch.randn(T, K, device=dev, dtype=torch.bfloat16, generator=gen)
            ref = linear_ref(x, ws[0])
            forms = {
                "cublas": lambda i: F.linear(x, ws[i]),
                "swapped": lambda i: torch.mm(ws[i], x.T),
                "triton": lambda i: linear_triton(x, ws[i]),
                "narrow": lambda i: linear_narrow(x, ws[i]),
            }
            for c in grid(T):
                forms[f"narrow {c.block_f}/{c.split_k}/{c.num_stages}"] = \
                    lambda i, c=c: linear_narrow(x, ws[i], config=c)
            row = {"T": T, "shape": name, "N": N, "K": K, "tiles": token_tiles(T),
                   "default": default_narrow_config(T, N, K, torch.bfloat16).__dict__, "us": {}, "err": {}}
            for form, fn in forms.items():
                try:
                    out = fn(0)
                    err = rel_err(out.T if form == "swapped" else out, ref)
                except Exception as exc:  # a config the compiler or the launch refuses: noted, not timed
                    row["err"][form] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    continue
                row["err"][form] = round(err, 6)
                if err > TOLERANCE:
                    print(f"T={T} {name} {form}: WRONG, rel. error {err:.3g}", flush=True)
                    continue
                row["us"][form] = round(graph_us(fn, COPIES), 2)
            torch.backends.cuda.preferred_blas_library("cublaslt")
            row["us"]["cublaslt"] = round(graph_us(forms["cublas"], COPIES), 2)
            torch.backends.cuda.preferred_blas_library("cublas")
            narrow = {f: us for f, us in row["us"].items() if f.startswith("narrow ")}
            if narrow:
                best = min(narrow, key=narrow.get)
                row["us"]["narrow-best"], row["best"] = narrow[best], best
            result["rows"].append(row)
            for form in ("cublas", "cublaslt", "swapped", "triton", "narrow", "narrow-best"):
                if form in row["us"]:
                    layer[form] = layer.get(form, 0.0) + row["us"][form]
            print(f"T={T} {name}: " + ", ".join(f"{f} {row['us'].get(f, float('nan')):.1f}" for f in
                  ("cublas", "cublaslt", "swapped", "triton", "narrow", "narrow-best")) + f" ({row.get('best')})",
                  flush=True)
        result["layer_us"][T] = {f: round(us, 1) for f, us in layer.items()}
        print(f"T={T} layer (4 GEMMs) us: {result['layer_us'][T]}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"linear-narrow-h200-{datetime.date.today()}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    if args.table:
        write_candidate_table(result["rows"], args.table)
    return 0


def write_candidate_table(rows: list[dict], path: Path) -> None:
    """The committed table's entries, plus narrow where its best config won at every T of a bucket."""
    committed = Path(__file__).parent.parent / "qml_kernels" / "tuning" / "linear_h200.json"
    table = load_linear_table(committed)
    entries = [{"dtype": k[0], "N": k[1], "K": k[2], "T": k[3], "impl": e.impl, "config": e.config}
               for k, e in table.entries.items()]
    by_bucket: dict[tuple, list[dict]] = {}
    for row in rows:
        by_bucket.setdefault((row["N"], row["K"], token_bucket(row["T"])), []).append(row)
    for (N, K, bucket), group in sorted(by_bucket.items()):
        if not all("narrow-best" in r["us"] and r["us"]["narrow-best"] < (1 - MARGIN) * r["us"]["cublas"]
                   for r in group):
            continue
        # the config with the least time summed over the bucket's token counts
        configs = set.intersection(*({f for f in r["us"] if f.startswith("narrow ")} for r in group))
        best = min(configs, key=lambda f: sum(r["us"][f] for r in group))
        bf, split, stages = map(int, best.split()[1].split("/"))
        entries.append({"dtype": "bfloat16", "N": N, "K": K, "T": bucket, "impl": "narrow",
                        "config": NarrowConfig(bf, 64, split, 4 if bf == 64 else 8, stages)})
        print(f"table: narrow {best} for N={N} K={K} bucket {bucket}")
    write_table(path, "linear", "H200", entries, about=json.loads(committed.read_text())["about"]
                + " Candidate narrow entries: benchmarks/linear_narrow_h200.py.")
    print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
