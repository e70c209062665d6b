"""Why the turn's attention took ~228 us a layer in the engine against ~153-165 alone (H200).

In ``engine-h200-gputurn-cudnnturn-on-2026-12-04.json`` (150 new tokens over a 27,339-token history,
Llama-3.1-8B, the 160-token prefill graph) cuDNN's SDPA kernel took 7.31 ms over 32 layers, 228 us each,
where ``cudnn_turn_h200.py`` had timed the same path at 153 us (cuDNN) + 12 (packing, tail, merge): as
slow as its 4-run launch (two waves of programs, 220 us). Candidates, each a form here:

- the metadata: the prefill graph sizes its launches for two sequences (the turn, and the padding rows
  that fill the bucket: ``cuda_graphs.PrefillGraphs._forward``), so the cuDNN launch holds 2 x 3 runs of
  entries, and its block tables are as wide as the engine's context (5,120 pages at 81,920 tokens), not
  the history's 1,709; ``alone``: one sequence as ``cudnn_turn_h200.py`` had it; ``wide-table``: one
  sequence, the engine's table width; ``graph-meta``: as the prefill graph built it until 2026-12-05 (two
  sequences, the capture's host lists, the replay's device lengths: 6 entries); ``graph-meta-history-1``: as
  it builds it since (``history_seqs=1``: the padding sequence gets no cuDNN entries, 3);
- the neighbours: ``in-layer``: each form inside 32 layers of the turn's GEMMs (qkv, o, gate_up, down on
  cuBLAS, distinct weights and KV per layer, as the engine's graph runs them), its time minus the GEMMs'
  alone, and the cuDNN kernel's own time read from the profiler over one replay.

- where the pages lie (none of the forms above reproduced the 228 us on 2026-12-05): ``--pool-pages`` (the
  engine's 5,120), ``--order`` (the engine's history is one ascending run from its FIFO free list),
  ``--weight-sets`` (the model's 32 sets of weights beside the pool) and ``--pool-layout engine`` (each
  layer's K and V as views of one ``[L, 2, P, S, Hkv, D]`` tensor, as ``KVCache`` holds them, a layer's K and
  V pages 160 MiB apart at 5,120 pages, rather than separate allocations).

Every form's output is checked against ``paged_attention_ref`` first (fp32; the graph-meta form on its
150 real rows). Times from CUDA graphs (``gemv_h200.graph_us``: 5 replays, median).

    python benchmarks/turn_attention_engine_h200.py --out DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).parent))
from gemv_h200 import graph_us  # noqa: E402

from qml_kernels import attention_turn  # noqa: E402
from qml_kernels.attention import AttentionMetadata, block_tables_tensor, paged_attention_ref  # noqa: E402
from qml_kernels.attention_turn import turn_attention  # noqa: E402

H, HKV, DH, S, HID, FF = 32, 8, 128, 16, 4096, 14336
LAYERS, WEIGHT_SETS = 32, 4
N_NEW, HISTORY, BUCKET, ENGINE_PAGES = 150, 27339, 160, 5120
TOLERANCE = 1.6e-2


def metas(table: list[int], dev) -> dict[str, tuple[AttentionMetadata, int]]:
    """form -> (metadata, query rows of the launch)."""
    L = HISTORY + N_NEW
    slots = [table[p // S] * S + p % S for p in range(HISTORY, L)]
    out = {"alone": (AttentionMetadata.build(slots, [table], [0, N_NEW], [L], dev), N_NEW)}
    wide = table + [0] * (ENGINE_PAGES - len(table))
    out["wide-table"] = (AttentionMetadata.build(slots, [wide], [0, N_NEW], [L], dev), N_NEW)
    # as PrefillGraphs captures and replays: two sequences (the turn; the padding rows, writing no K/V),
    # host lists that only size the launch, the replay's lengths on the device
    pad = BUCKET - N_NEW
    graph_meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots + [-1] * pad, dtype=torch.int64, device=dev),
        block_tables=block_tables_tensor([wide, [0] * ENGINE_PAGES]).to(dev),
        cu_seqlens_q=torch.tensor([0, N_NEW, BUCKET], dtype=torch.int32, device=dev),
        context_lens=torch.tensor([L, pad], dtype=torch.int32, device=dev),
        cu_seqlens_q_host=[0, BUCKET - 1, BUCKET],
        context_lens_host=[min(ENGINE_PAGES * S, 32768)] * 2)
    out["graph-meta"] = (graph_meta, BUCKET)
    out["graph-meta-history-1"] = (dataclasses.replace(graph_meta, history_seqs=1), BUCKET)
    return out


def kernel_us(fn, name_part: str) -> tuple[float, int]:
    """The summed GPU time (us) and count of kernels whose name holds ``name_part`` over one replay of a
    graph of ``fn``, read from the profiler."""
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if name_part in e.name]
    return sum(e.device_time_total for e in events), len(events)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--pool-pages", type=int, default=0,
                        help="pages of each layer's K and V pool (default: the history's + 64; the engine's 10 GiB "
                             "pool is 5,120)")
    parser.add_argument("--order", choices=("random", "ascending", "descending"), default="random",
                        help="the history's pages in the pool: a random draw, or one ascending / descending run")
    parser.add_argument("--forms", default="", help="comma-separated forms to run (default: all)")
    parser.add_argument("--weight-sets", type=int, default=WEIGHT_SETS,
                        help="distinct sets of the four GEMMs' weights the layers cycle through (32: the model's)")
    parser.add_argument("--pool-layout", choices=("separate", "engine"), default="separate",
                        help="each layer's K and V their own allocation, or views of one [L, 2, P, S, Hkv, D] "
                             "tensor as the engine's KVCache has them (a layer's K and V pages then lie P pages "
                             "apart, 160 MiB at 5,120 pages)")
    parser.add_argument("--tag", default="", help="appended to the output file's name")
    args = parser.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(dev).manual_seed(0)
    pages = -(-(HISTORY + N_NEW) // S)
    P = max(args.pool_pages, pages + 64)
    if args.order == "random":
        table = torch.randperm(P, generator=gen, device=dev)[:pages].tolist()
    else:
        table = list(range(P - pages, P)) if args.order == "ascending" else list(range(P - 1, P - pages - 1, -1))
    if args.pool_layout == "engine":
        data = torch.empty(LAYERS, 2, P, S, HKV, DH, device=dev, dtype=torch.bfloat16).normal_(generator=gen)
        kv = [(data[layer, 0], data[layer, 1]) for layer in range(LAYERS)]
    else:
        kv = [(torch.randn(P, S, HKV, DH, generator=gen, device=dev).bfloat16(),
               torch.randn(P, S, HKV, DH, generator=gen, device=dev).bfloat16()) for _ in range(LAYERS)]
    q_all = torch.randn(BUCKET, H, DH, generator=gen, device=dev).bfloat16()
    scale = 1.0 / math.sqrt(DH)
    ws = [{"qkv": torch.randn(6144, HID, device=dev, dtype=torch.bfloat16) * 0.02,
           "o": torch.randn(HID, HID, device=dev, dtype=torch.bfloat16) * 0.02,
           "gate_up": torch.randn(2 * FF, HID, device=dev, dtype=torch.bfloat16) * 0.02,
           "down": torch.randn(HID, FF, device=dev, dtype=torch.bfloat16) * 0.02} for _ in range(args.weight_sets)]
    x = torch.randn(BUCKET, HID, device=dev, dtype=torch.bfloat16)
    xf = torch.randn(BUCKET, FF, device=dev, dtype=torch.bfloat16)
    result = {"meta": {"gpu": torch.cuda.get_device_name(), "date": str(datetime.date.today()),
                       "torch": torch.__version__, "triton": triton.__version__, "command": " ".join(sys.argv),
                       "case": f"{N_NEW} new over {HISTORY} keys, bucket {BUCKET}, table {ENGINE_PAGES} pages",
                       "pool_pages": P, "order": args.order, "pool_layout": args.pool_layout},
              "forms": {}}

    def gemms(w):
        F.linear(x, w["qkv"]), F.linear(x, w["o"]), F.linear(x, w["gate_up"]), F.linear(xf, w["down"])

    def layers(attend):
        def run():
            for layer in range(LAYERS):
                gemms(ws[layer % len(ws)])
                if attend is not None:
                    attend(layer)
        return run

    gemms_only = graph_us(lambda _: layers(None)(), 1)
    result["gemms_only_us_per_layer"] = round(gemms_only / LAYERS, 2)
    print(f"GEMMs alone: {gemms_only / LAYERS:.1f} us a layer", flush=True)
    for form, (meta, rows) in metas(table, dev).items():
        if args.forms and form not in args.forms.split(","):
            continue
        q = q_all[:rows]
        out = torch.empty_like(q)
        E, split, R, pages = attention_turn._launch_shape(q, kv[0][0], meta, 132)
        row = {"rows": rows, "launch": [E, split.runs, R, pages]}
        try:
            with attention_turn.builds():
                if not attention_turn.supported(q, kv[0][0], kv[0][1], meta, scale):
                    raise RuntimeError("attention_turn does not take this launch")
                turn_attention(q, kv[0][0], kv[0][1], meta, scale, out=out)
            ref = paged_attention_ref(q[:N_NEW].float(), kv[0][0].float(), kv[0][1].float(),
                                      metas(table, dev)["alone"][0], scale)
            err = ((out[:N_NEW].float() - ref).abs().max() / ref.abs().max()).item()
            row["rel_err"] = float(f"{err:.2e}")
            if not err <= TOLERANCE:
                row["error"] = "differs from the reference"
                raise RuntimeError(row["error"])

            def attend(layer, q=q, meta=meta, out=out):
                turn_attention(q, kv[layer][0], kv[layer][1], meta, scale, out=out)

            row["alone_us"] = round(graph_us(lambda _: [attend(i) for i in range(LAYERS)], 1) / LAYERS, 2)
            with_gemms = graph_us(lambda _: layers(attend)(), 1)
            row["in_layer_us"] = round((with_gemms - gemms_only) / LAYERS, 2)
            cudnn_alone, n = kernel_us(lambda: [attend(i) for i in range(LAYERS)], "sdpa")
            cudnn_in_layer, n2 = kernel_us(layers(attend), "sdpa")
            row["cudnn_kernel_alone_us"] = round(cudnn_alone / max(n, 1), 2)
            row["cudnn_kernel_in_layer_us"] = round(cudnn_in_layer / max(n2, 1), 2)
        except Exception as exc:  # noqa: BLE001 - recorded, the other forms still run
            row.setdefault("error", f"{type(exc).__name__}: {str(exc)[:300]}")
        result["forms"][form] = row
        print(f"{form}: {json.dumps(row)}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"turn-attention-engine-h200{args.tag}-{datetime.date.today()}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
