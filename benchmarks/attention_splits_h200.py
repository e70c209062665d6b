"""Split counts of the paged attention's split-KV launches, timed as the engine runs them: a CUDA graph of
one call per layer (each layer its own K/V, under PDL when the build has it), on the GPU.

The split count is chosen on the host from shapes (``prefill_num_splits``, ``decode_num_splits``). The
earlier sweeps (``attention_turn_sweep.py``) timed one layer's inputs called back to back, eagerly; this
times a graph of ``--layers`` distinct layers with a 64 MiB scrub between calls (what the layer's other
kernels do to L2: Qwen3-30B-A3B's short decode caches would otherwise stay in it), minus a graph of the
scrubs alone. Cases: the next turn of a conversation (Llama-3.1-8B heads, new tokens over a cached history)
and a batch-1 decode step at short and long contexts (Qwen3-30B-A3B and Llama-3.1-8B heads); each split
count's output is checked against the automatic one's.

    python benchmarks/attention_splits_h200.py --out DIR

Written on 2026-12-03 (session 15), first run in session 16: results/attention-splits-h200-2026-12-03.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
from attention_pipeline_h200 import LLAMA, PREFILL_SPLIT_CASES, QWEN  # beside this script: the same shapes
from graph_timing import scrubbed_graph_ms

from qml_kernels.attention_decode import (
    PAGED_DECODE_ATTENTION_SPEC,
    PagedDecodeAttentionConfig,
    decode_num_splits,
    paged_decode_attention_triton,
)
from qml_kernels.attention_prefill import (
    PAGED_PREFILL_ATTENTION_SPEC,
    PagedPrefillAttentionConfig,
    paged_prefill_attention_triton,
    prefill_num_splits,
)
from qml_kernels.workbench.spec import Case

# the next turn of a conversation: fewer layers over the longer histories (each layer its own ~112 MB of K/V)
PREFILL = tuple((case, 8 if case.dims["seqs"][0][1] > 20000 else 16) for case in PREFILL_SPLIT_CASES)
DECODE = tuple((Case(f"{name}-decode-ctx{L}", {**dims, "ctx": [L]}), layers)
               for name, dims, layers in (("qwen3-30b-a3b", QWEN, 48), ("llama3.1-8b", LLAMA, 32))
               for L in (130, 386, 1024, 4096))


def _run(case: Case, layers: int, spec, launch, config_cls, auto: int, counts, scrub, dev) -> list[dict]:
    inputs = []
    for i in range(layers):
        gen = torch.Generator(dev).manual_seed(i)
        inputs.append(spec.make_inputs(case, torch.bfloat16, dev, gen))
    want = launch(**inputs[0], config=config_cls()).float()
    scrub_ms = scrubbed_graph_ms([lambda: None] * layers, scrub)
    rows = []
    for splits in (None, *sorted(set(counts) - {auto})):
        config = config_cls(num_splits=splits)
        got = launch(**inputs[0], config=config).float()
        err = ((got - want).abs().max() / want.abs().max()).item()
        outs = [torch.empty_like(x["q"]) for x in inputs]
        calls = [lambda x=x, o=o: launch(**x, out=o, config=config) for x, o in zip(inputs, outs)]
        ms = scrubbed_graph_ms(calls, scrub) - scrub_ms
        row = {"case": case.name, "splits": auto if splits is None else splits, "auto": splits is None,
               "us_per_layer": round(ms * 1e3 / layers, 2), "rel_err": float(f"{err:.2e}")}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    scrub = torch.zeros(32 << 20, dtype=torch.bfloat16, device=dev)  # 64 MiB: more than the H200's 50 MB of L2
    import triton
    meta = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
            "torch": torch.__version__, "triton": triton.__version__,
            "command": "python benchmarks/attention_splits_h200.py --out DIR"}
    rows, failed = [], []
    runs = [(case, layers, "decode") for case, layers in DECODE]
    runs += [(case, layers, "prefill") for case, layers in PREFILL]
    for case, layers, kind in runs:
        d = case.dims
        try:
            if kind == "decode":
                auto = decode_num_splits(1, d["Hkv"], max(d["ctx"]), PagedDecodeAttentionConfig())
                rows += _run(case, layers, PAGED_DECODE_ATTENTION_SPEC, paged_decode_attention_triton,
                             PagedDecodeAttentionConfig, auto, (1, 2, 3, 4, 8, 16), scrub, dev)
            else:
                config = PagedPrefillAttentionConfig()
                tile = config.tiles(d["Dh"], d["H"] // d["Hkv"])[0] // (d["H"] // d["Hkv"])
                tiles = sum(-(-n_q // tile) for n_q, _ in d["seqs"])
                auto = prefill_num_splits(tiles * d["Hkv"], max(L for _, L in d["seqs"]), config, d["Dh"])
                rows += _run(case, layers, PAGED_PREFILL_ATTENTION_SPEC, paged_prefill_attention_triton,
                             PagedPrefillAttentionConfig, auto, (1, 4, 5, 6, 7, 8, 10, 13), scrub, dev)
        except Exception as exc:  # one case's trouble (memory, a compile error) leaves the others' rows
            failed.append(f"{case.name}: {type(exc).__name__}: {str(exc)[:200]}")
            print("failed", failed[-1], flush=True)
        # written after every case: a run cut short keeps what it timed
        (args.out / "attention-splits.json").write_text(json.dumps({"meta": meta, "rows": rows, "failed": failed},
                                                                   indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
