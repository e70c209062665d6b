"""The sampler kernel alone on the H200: microseconds per call in a CUDA graph, this module's kernel
against another version of ``qml_kernels/sampling.py`` (a file, e.g. from ``git show REV:qml_kernels/sampling.py``).

    python benchmarks/sampler_h200.py --out DIR [--before FILE] [--vocab 151936,128256] [--batch 1,8,32]

Rows: greedy (temperature 0: pass 1 alone, the batch-1 decode step's case), and sampled with the
engine's common filters (temperature 0.7, top-k 50, top-p 0.9: the bisection passes). Logits are fp32
``randn * 4`` as a head's would be. Before timing, both versions' tokens are compared on the same
inputs: greedy rows must match exactly; sampled rows too, since both draw with the same counters and
keep the same sets (a difference is reported, not hidden). Each timing is the median of 20 replays of
a graph of 20 calls, divided by 20. Writes ``sampler-h200-<date>.json``.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

CALLS = 20


def load_module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def inputs(B: int, V: int, sampled: bool, device: str) -> dict:
    gen = torch.Generator(device=device).manual_seed(B * 7 + V)
    logits = torch.randn(B, V, generator=gen, device=device) * 4
    f = lambda v: torch.full((B,), v, dtype=torch.float32, device=device)
    return {"logits": logits, "temperature": f(0.7 if sampled else 0.0),
            "top_k": torch.full((B,), 50 if sampled else 0, dtype=torch.int64, device=device),
            "top_p": f(0.9 if sampled else 1.0), "min_p": f(0.0),
            "seeds": torch.arange(B, dtype=torch.int64, device=device) + 12345,
            "steps": torch.full((B,), 17, dtype=torch.int64, device=device)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--before", type=Path, help="another sampling.py to time beside this one")
    parser.add_argument("--vocab", default="151936,128256")
    parser.add_argument("--batch", default="1,8,32")
    parser.add_argument("--device", default="cuda", help="cpu: a check of the script (no timing)")
    args = parser.parse_args()
    from graph_timing import graph_ms

    from qml_kernels import sampling
    versions = {"now": sampling.sample_triton}
    if args.before:
        versions["before"] = load_module(args.before, "sampling_before").sample_triton
    rows, mismatches = [], []
    for V in map(int, args.vocab.split(",")):
        for B in map(int, args.batch.split(",")):
            for sampled in (False, True):
                kind = "sampled (T 0.7, top-k 50, top-p 0.9)" if sampled else "greedy"
                x = inputs(B, V, sampled, args.device)
                tokens = {name: fn(**x) for name, fn in versions.items()}
                if "before" in tokens and not torch.equal(tokens["now"], tokens["before"]):
                    mismatches.append({"V": V, "B": B, "rows": kind})
                row = {"V": V, "B": B, "rows": kind}
                for name, fn in versions.items():
                    if args.device == "cuda":
                        out = torch.empty(B, dtype=torch.int64, device=args.device)
                        row[f"{name}_us"] = round(graph_ms(lambda fn=fn: [fn(**x, out=out) for _ in range(CALLS)])
                                                  * 1e3 / CALLS, 2)
                rows.append(row)
                print(row, flush=True)
    meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "command": "python " + " ".join(sys.argv)}
    import triton
    meta["triton"] = triton.__version__
    print("token mismatches between versions:", mismatches or "none")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"sampler-h200-{meta['date']}.json").write_text(
        json.dumps({"meta": meta, "rows": rows, "mismatches": mismatches}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
