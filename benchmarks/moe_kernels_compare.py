"""The MoE routing kernels and the decode GEMM tiles, before and after the multi-program alignment
(commit c432811 is before), on the H200; run from the repo root of a git checkout.

    python benchmarks/moe_kernels_compare.py [--old-ref c432811]
    python benchmarks/moe_kernels_compare.py --old-file OLD.py   # no git: the old module as a file

"bench" columns: the workbench's method (L2 cleared before each call, median; host launch cost
can show). "graph" columns: GPU time per call inside a CUDA graph of 20 calls, as the engine's
decode replays them. Old and new outputs are checked equal first (the alignment bit-exact).
"""
import argparse
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from triton.testing import do_bench

from qml_kernels.moe_gemm import MoEGemmConfig, moe_block_size, moe_gemm_triton
from qml_kernels.moe_routing import draw_expert_ids, moe_align_triton, moe_combine_triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cudnn_layout_h200 import capture  # noqa: E402  (beside this script)

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--old-ref", default="c432811")
parser.add_argument("--old-file", help="the old qml_kernels/moe_routing.py as a file (a checkout without .git)")
args = parser.parse_args()

# the old routing module under another name (its launchers only; it re-registers the ops' names)
path = args.old_file
if path is None:
    path = tempfile.NamedTemporaryFile("w", suffix="_old_moe_routing.py", delete=False).name
    old_source = subprocess.check_output(["git", "show", f"{args.old_ref}:qml_kernels/moe_routing.py"], text=True)
    open(path, "w").write(old_source)
spec = importlib.util.spec_from_file_location("old_moe_routing", path)
old = sys.modules["old_moe_routing"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)


def bench_us(fn):
    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def graph_us(fn, calls=20):
    return do_bench(capture(fn, calls).replay, return_mode="median") * 1e3 / calls


E, k, D, Ie = 128, 8, 2048, 768
gen = torch.Generator("cuda").manual_seed(0)
w_gate_up = (torch.randn(E, 2 * Ie, D, device="cuda", generator=gen) * D**-0.5).bfloat16()
w_down = (torch.randn(E, D, Ie, device="cuda", generator=gen) * Ie**-0.5).bfloat16()
print(f"{'op':<10}{'T':>6}{'old bench':>11}{'new bench':>11}{'old graph':>11}{'new graph':>11}  (us)")
for T in (1, 16, 128, 2048, 8192):
    ids = draw_expert_ids(T, E, k, torch.Generator().manual_seed(T)).cuda()
    block = moe_block_size(T * k, E)
    sorted_pairs, offsets, _ = moe_align_triton(ids, E, block)
    assert all(torch.equal(a, b) for a, b in zip(old.moe_align_triton(ids, E, block), moe_align_triton(ids, E, block)))
    x = torch.randn(T, D, device="cuda", generator=gen).bfloat16()
    h = torch.randn(T * k, Ie, device="cuda", generator=gen).bfloat16()
    y = torch.randn(T * k, D, device="cuda", generator=gen).bfloat16()
    weights = torch.softmax(torch.randn(T, k, device="cuda", generator=gen), dim=-1)
    torch.testing.assert_close(old.moe_combine_triton(y, weights), moe_combine_triton(y, weights))
    grouping = (sorted_pairs, offsets, block)
    before = MoEGemmConfig()  # the default tiles, which 16-row segments used before
    pairs = {
        "align": (lambda: old.moe_align_triton(ids, E, block), lambda: moe_align_triton(ids, E, block)),
        "combine": (lambda: old.moe_combine_triton(y, weights), lambda: moe_combine_triton(y, weights)),
        "gate-up": (lambda: moe_gemm_triton(x, w_gate_up, *grouping, k, True, config=before),
                    lambda: moe_gemm_triton(x, w_gate_up, *grouping, k, True)),
        "down": (lambda: moe_gemm_triton(h, w_down, *grouping, 1, config=before),
                 lambda: moe_gemm_triton(h, w_down, *grouping, 1)),
    }
    for name in ("gate-up", "down"):
        old_out, new_out = (f() for f in pairs[name])
        torch.testing.assert_close(old_out, new_out, rtol=2e-2, atol=2e-2)
    for name, (old_fn, new_fn) in pairs.items():
        times = [bench_us(old_fn), bench_us(new_fn), graph_us(old_fn), graph_us(new_fn)]
        print(f"{name:<10}{T:>6}" + "".join(f"{t:>11.1f}" for t in times), flush=True)
