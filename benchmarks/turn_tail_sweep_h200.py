"""The turn attention by the history's split into cuDNN runs, and its tail kernel (``_turn_tail_merge_kernel``) by
launch: rows a tile, keys a step, warps, stages.

In the H200's profile of the 150-token GPU-history turn the tail kernel (each query over the keys past the history's
whole pages, then the merge with cuDNN's runs) took 0.343 ms over 32 layers, 10.7 us a layer, for ~88 programs
of 64 rows that each take up to 3 key steps and then fold in 3 runs one after the other: latency, not bandwidth
(~14 MB read). This times the whole turn path (q packing, cuDNN's history part, the tail) for each
``attention_turn.TailLaunch`` in a CUDA graph of 32 calls (after 1 s idle, median of 3), takes the tail kernel's
own time from the profiler (median of 64 launches), and checks each launch's output against the default's (bf16,
the same cuDNN part: differences come from the tail alone) and the default against fp32 once.

First, the same for each ``attention_turn.RunSplit`` of ``--splits`` (default tail launch): the history's pages cut
into 3 equal runs (the default: 120 of the H200's 132 SMs busy in one wave of cuDNN programs) or into long runs
and short ones whose programs fill the SMs left over (``3x4+1``: three runs of 4 shares, one of 1), each kernel's
median time from the profiler (cuDNN's among them) and the output against the default's.

    python benchmarks/turn_tail_sweep_h200.py --out DIR [--queries 150] [--context 27339] [--splits 3,3x4+1]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cudnn_layout_h200 import capture, idle_us, write_result  # noqa: E402  (beside this script)
from cudnn_turn_h200 import _inputs  # noqa: E402
from engine_common import _kernel_calls  # noqa: E402

from qml_kernels import attention_turn  # noqa: E402
from qml_kernels.attention import paged_attention_ref  # noqa: E402
from qml_kernels.attention_turn import RunSplit, TailLaunch, turn_attention  # noqa: E402

SPLITS = "3,3x3+1,3x4+1,3x5+1,3x6+2,3x7+2,3x8+2,3x10+3,6,2x6+2"


def _kernels_us(graph) -> dict[str, float]:
    """Each kernel's median device time over two replays (64 calls of the path), from the profiler: name -> us."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            graph.replay()
        torch.cuda.synchronize()
    names = {e.name for e in prof.events() if "CUDA" in str(getattr(e, "device_type", ""))}
    out = {}
    for name in sorted(names):
        calls = _kernel_calls(prof, name)
        if calls is not None and calls["calls"] >= 32:
            out[name[:80]] = calls["median"]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--queries", type=int, default=150)
    p.add_argument("--context", type=int, default=27339)
    p.add_argument("--seconds", type=float, default=240.0, help="stop sweeping after this long")
    p.add_argument("--splits", default=SPLITS, help="RunSplit.parse forms, comma-separated ('' : none)")
    p.add_argument("--tails", choices=("all", "none"), default="all", help="sweep the tail's launches too")
    args = p.parse_args()
    t_start = time.time()
    dev = torch.device("cuda")
    x = _inputs(args.queries, args.context, True, dev)
    kw = {k: x[k] for k in ("q", "k_cache", "v_cache", "meta", "scale")}
    with attention_turn.builds():
        assert attention_turn.supported(**kw), "cuDNN's turn path does not take this shape here"
    ref = paged_attention_ref(**{k: v.float() if isinstance(v, torch.Tensor) else v for k, v in kw.items()})
    default = TailLaunch()
    base = turn_attention(**kw, tail=default)
    base_err = ((base.float() - ref).abs().max() / ref.abs().max()).item()
    splits = [RunSplit.parse(t) for t in args.splits.split(",") if t]
    tails = [default] + [TailLaunch(rows=r, block_n=n, warps=w, stages=s) for r, n, w, s in
                         itertools.product((16, 32, 64), (32, 64, 128), (2, 4), (2, 3))
                         if args.tails == "all"]
    variants = [(split, default) for split in splits] + [(None, cfg) for cfg in tails]
    rows = []
    seen = set()
    for split, cfg in variants:
        if (split, cfg) in seen:
            continue
        seen.add((split, cfg))
        if time.time() - t_start > args.seconds:
            print("time budget spent: stopping", flush=True)
            break
        row = {"split": None if split is None else dataclasses.asdict(split), "rows": cfg.rows,
               "block_n": cfg.block_n, "warps": cfg.warps, "stages": cfg.stages}
        label = (f"split {split.long}x{split.weight}+{split.short}" if split is not None else
                 f"rows {cfg.rows:3d} n {cfg.block_n:3d} warps {cfg.warps} stages {cfg.stages}")
        try:
            out = torch.empty_like(kw["q"])
            def fn(cfg=cfg, out=out, split=split):
                return turn_attention(**kw, out=out, tail=cfg, split=split)
            # the plan afresh: splits of one launch shape share its cuDNN buffers (the runs' tables among them)
            kw["meta"].plans.clear()
            with attention_turn.builds():  # (a split of another run count is another cuDNN launch shape)
                fn()
            torch.cuda.synchronize()
            row["diff_vs_default"] = ((out.float() - base.float()).abs().max() / base.float().abs().max()).item()
            if not row["diff_vs_default"] < 1.6e-2:
                raise AssertionError(f"differs from the default launch by {row['diff_vs_default']:.3g}")
            graph = capture(fn)
            row["path_us"] = sorted(idle_us(graph))[1]
            row["kernels_us"] = _kernels_us(graph)
            row["tail_us"] = next((us for name, us in row["kernels_us"].items() if "_turn_tail_merge" in name),
                                  float("nan"))
            others = sorted(((us, name) for name, us in row["kernels_us"].items() if "_turn_" not in name),
                            reverse=True)
            print(f"{label}: path {row['path_us']:7.1f} us, tail {row['tail_us']:6.2f} us"
                  + (f", {others[0][1][:40]} {others[0][0]:.1f} us" if others else ""), flush=True)
        except Exception as exc:  # noqa: BLE001 - a launch that fails to compile or run is recorded, not fatal
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            print(f"{label}: FAILED {row['error']}", flush=True)
            traceback.print_exc(limit=1)
        rows.append(row)
    write_result(args.out, "turn-tail-sweep" + ("" if args.queries == 150 else f"-q{args.queries}"), {
        "queries": args.queries, "context": args.context, "default_rel_err_vs_fp32": base_err,
        "command": f"python benchmarks/turn_tail_sweep_h200.py --out DIR --queries {args.queries} "
                   f"--context {args.context} --splits '{args.splits}' --tails {args.tails}", "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
