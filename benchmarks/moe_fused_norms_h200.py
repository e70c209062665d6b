"""The MoE layer's decode entry and exit (``qml_kernels.moe_fused_norms``) against the separate ops they
replace, timed as the engine runs them: a CUDA graph of one call per layer (each layer its own router
weights and activations, under PDL when the build has it), with a 64 MiB L2 scrub between layers (the
experts' ~75 MB stream evicts the router between two layers), minus a graph of the scrubs alone.

    python benchmarks/moe_fused_norms_h200.py --out DIR [--layers 48]

Rows (Qwen3-30B-A3B shapes: D 2048, 128 experts, top-8, one token), microseconds a layer:
- entry: ``add_rmsnorm`` + ``linear`` (router) + ``moe_route`` (its warps: default, 1, 2), against
  ``moe_norm_route`` at several launch configs;
- route alone: ``moe_route`` at 1, 2, 4 warps;
- exit: ``moe_combine`` + ``add_rmsnorm`` against ``moe_combine_rmsnorm`` at several warp counts.
Each fused variant's outputs are compared with the separate ops' (x, residual within bf16 rounding; the
chosen experts equal unless two logits tie within a rounding).
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
from graph_timing import scrubbed_graph_ms  # beside this script

from qml_kernels.linear import linear
from qml_kernels.moe_fused_norms import MoEFusedNormsConfig, moe_combine_rmsnorm_triton, moe_norm_route_triton
from qml_kernels.moe_route import moe_route_triton
from qml_kernels.moe_routing import moe_combine
from qml_kernels.rmsnorm import add_rmsnorm

D, E, K, BLOCK = 2048, 128, 8, 16
ENTRY_CONFIGS = [dict(block_en=8, block_kc=256, entry_warps=4), dict(block_en=4, block_kc=2048, entry_warps=8),
                 dict(block_en=2, block_kc=2048, entry_warps=4), dict(block_en=2, block_kc=2048, entry_warps=2),
                 dict(block_en=4, block_kc=1024, entry_warps=4), dict(block_en=1, block_kc=2048, entry_warps=2),
                 dict(block_en=8, block_kc=2048, entry_warps=8)]
EXIT_WARPS = (2, 4, 8, 16)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--layers", type=int, default=48)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import triton

    dev, dt, L = torch.device("cuda"), torch.bfloat16, args.layers
    gen = torch.Generator(dev).manual_seed(0)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, device=dev)).to(dt)

    layers = [dict(h=randn(1, D), res=randn(1, D, scale=2.0), norm=randn(D, scale=0.1) + 1.0,
                   router=randn(E, D, scale=D**-0.5), y=randn(K, D),
                   weights=torch.softmax(torch.randn(1, K, generator=gen, device=dev), dim=1)) for _ in range(L)]
    scrub = torch.zeros(32 << 20, dtype=dt, device=dev)
    base = scrubbed_graph_ms([lambda: None] * L, scrub, reps=30)
    meta = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
            "torch": torch.__version__, "triton": triton.__version__, "layers": L,
            "command": f"python benchmarks/moe_fused_norms_h200.py --out DIR --layers {L}"}
    rows = []

    def timed(name, call, **extra):
        us = (scrubbed_graph_ms([lambda x=x: call(x) for x in layers], scrub, reps=30) - base) * 1e3 / L
        row = {"name": name, "us_per_layer": round(us, 2), **extra}
        rows.append(row)
        print(json.dumps(row), flush=True)
        (args.out / "moe-fused-norms.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))

    def separate_entry(x, warps=None):
        xn, s = add_rmsnorm(x["h"], x["res"], x["norm"], 1e-6)
        return (xn, s, *moe_route_triton(linear(xn, x["router"]), K, True, BLOCK, num_warps=warps))

    for warps in (None, 1, 2):
        timed(f"entry separate (route warps {warps or 'default'})", lambda x, w=warps: separate_entry(x, w))
    want = separate_entry(layers[0])
    for cfg in ENTRY_CONFIGS:
        config = MoEFusedNormsConfig(**cfg)
        got = moe_norm_route_triton(layers[0]["h"], layers[0]["res"], layers[0]["norm"], 1e-6, layers[0]["router"],
                                    K, True, BLOCK, config=config)
        check = {"x_err": float((got[0].float() - want[0].float()).abs().max()),
                 "res_equal": bool(torch.equal(got[1], want[1])), "ids_equal": bool(torch.equal(got[3], want[3]))}
        timed(f"entry fused {cfg}", lambda x, c=config: moe_norm_route_triton(
            x["h"], x["res"], x["norm"], 1e-6, x["router"], K, True, BLOCK, config=c), **check)
    logits = [linear(add_rmsnorm(x["h"], x["res"], x["norm"], 1e-6)[0], x["router"]) for x in layers]
    for i, x in enumerate(layers):
        x["logits"] = logits[i]
    for warps in (1, 2, 4):
        timed(f"route alone, {warps} warps", lambda x, w=warps: moe_route_triton(x["logits"], K, True, BLOCK,
                                                                                 num_warps=w))
    timed("exit separate", lambda x: add_rmsnorm(moe_combine(x["y"], x["weights"]), x["res"], x["norm"], 1e-6))
    want = add_rmsnorm(moe_combine(layers[0]["y"], layers[0]["weights"]), layers[0]["res"], layers[0]["norm"], 1e-6)
    for warps in EXIT_WARPS:
        config = MoEFusedNormsConfig(exit_warps=warps)
        got = moe_combine_rmsnorm_triton(layers[0]["y"], layers[0]["weights"], layers[0]["res"], layers[0]["norm"],
                                         1e-6, config=config)
        err = float((got[0].float() - want[0].float()).abs().max())
        timed(f"exit fused, {warps} warps", lambda x, c=config: moe_combine_rmsnorm_triton(
            x["y"], x["weights"], x["res"], x["norm"], 1e-6, config=c), x_err=err)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
