"""A long new turn over a cached history, through the engine: time to first token with the chunk path
(``qml_kernels.attention_chunk``, cuDNN's paged SDPA; chunks of 1,024+ tokens over 8k+ cached ones eager, not from a
prefill graph: ``runner.CHUNK_EAGER_TOKENS``) and without it (as before: Triton's paged prefill, in a prefill graph
up to 4,096 tokens), alternated.

For each (history, new tokens): the history is prefilled once (it stays in the GPU's prefix cache), then requests
of history + fresh random tokens (a new suffix each time, so only the history is found) are timed, the chunk path
on and off in turn, ``--reps`` times each; the medians go to the results. Random weights at the preset's shapes.

    python benchmarks/chunk_turn_h200.py --out DIR [--preset llama-3.1-8b] [--cases 21504:6784,25600:2048]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_common import _served_engine, _timed_request  # noqa: E402 (beside this script)
from qml_kernels import attention_chunk  # noqa: E402
from qml_runtime.sampling_params import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--kv-cache-gib", type=float, default=30.0)
    ap.add_argument("--cases", default="21504:6784,25600:2048,20480:1024,8192:4096,4096:600")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    device = torch.device("cuda")
    engine = _served_engine(args, device)
    engine.start()
    one = SamplingParams(max_tokens=1, temperature=0.0)
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    rows = []
    try:
        for case in args.cases.split(","):
            h, n = map(int, case.split(":"))
            history = torch.randint(0, vocab, (h,), generator=gen).tolist()
            _timed_request(engine, history, one)
            times = {"chunk": [], "triton": []}
            for _ in range(args.reps):
                for mode in times:
                    attention_chunk.ENABLED = engine.runner.eager_long_chunks = mode == "chunk"
                    suffix = torch.randint(0, vocab, (n,), generator=gen).tolist()
                    times[mode].append(_timed_request(engine, history + suffix, one)[0] * 1e3)
            attention_chunk.ENABLED = engine.runner.eager_long_chunks = True
            row = {"history": h, "new": n, **{f"{m}_ms": t for m, t in times.items()},
                   **{f"{m}_median_ms": statistics.median(t) for m, t in times.items()}}
            rows.append(row)
            print(f"history {h:6d} + {n:5d} new: chunk path {row['chunk_median_ms']:7.1f} ms, Triton "
                  f"{row['triton_median_ms']:7.1f} ms (TTFT medians of {args.reps})", flush=True)
    finally:
        engine.shutdown()
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"chunk-turn-{datetime.date.today()}.json"
    out.write_text(json.dumps({"date": str(datetime.datetime.now()), "gpu": torch.cuda.get_device_name(),
                               "torch": torch.__version__, "host": platform.node(), "preset": args.preset,
                               "command": " ".join(sys.argv), "rows": rows}, indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
