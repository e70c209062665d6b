"""Programmatic dependent launch (``qml_kernels.pdl``) on and off: the engine's decode step, and
whether the greedy tokens stay the same.

    python benchmarks/pdl_h200.py --out DIR [--presets qwen3-30b-a3b,llama-3.1-8b] [--steps 128]
        [--variants "QML_PDL=0;QML_PDL=1"]

For each preset, one engine process per ``--variants`` environment (by default ``QML_PDL=0`` and
``=1``; the flags are read at import), each decoding ``--steps`` greedy tokens after 64-token random
prompts at batch 1 and ``--concurrency``, three rounds each, from the engine's CUDA graphs.
Reported: ms per decode step (median of the rounds; the first request's tokens, first to last),
and whether each process produced the first one's tokens (batch 1, and a batch queued before the
engine starts, so that every process batches it the same way).
PDL changes when kernels start, not what they compute, so the tokens must be identical: a missing
wait would show here as a diverging sequence. Writes ``pdl-h200-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _submit_all(engine, prompts: list[list[int]], params) -> tuple[list, threading.Event]:
    """Queue every prompt from this thread, without waiting: (tokens per prompt, set when all end)."""
    tokens, left, done = [[] for _ in prompts], [len(prompts)], threading.Event()

    def emit_for(i):
        def emit(out):
            if isinstance(out, BaseException):
                raise out
            tokens[i].extend(out.token_ids)
            if out.finished:
                left[0] -= 1
                if not left[0]:
                    done.set()
        return emit

    for i, ids in enumerate(prompts):
        engine.submit(ids, params, emit_for(i))
    return tokens, done


def child(preset: str, steps: int, concurrency: int, kv_cache_gib: float, device: str) -> dict:
    import torch

    from engine_common import _concurrent_requests
    from qml_runtime.loader import load_engine
    from qml_runtime.sampling_params import SamplingParams

    engine = load_engine(f"preset:{preset}", random_weights=True, device=device, kv_cache_gib=kv_cache_gib,
                         max_num_seqs=64, max_tokens_alone=8192, progress=False)
    V = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    # the batch's token check: queued before the loop starts, so the first step admits all of them and
    # both processes run the same batches (requests arriving from threads would be batched by timing,
    # and a bf16 GEMM of other rows rounds differently)
    batch_tokens, done = _submit_all(engine, [torch.randint(300, V, (64,), generator=gen).tolist()
                                              for _ in range(concurrency)], params)
    engine.start()
    done.wait()
    out = {f"batch{concurrency}_tokens": batch_tokens}
    try:
        for batch in (1, concurrency):
            ms, tokens = [], []
            for _ in range(3):
                prompts = [torch.randint(300, V, (64,), generator=gen).tolist() for _ in range(batch)]
                toks = [[] for _ in prompts]
                stamps = _concurrent_requests(engine, prompts, params, toks)
                ms.append((stamps[0][-1] - stamps[0][0]) / steps * 1e3)
                tokens += toks
            out[f"batch{batch}"] = {"ms_per_step": [round(m, 3) for m in ms], "median": round(statistics.median(ms), 3)}
            if batch == 1:  # one sequence at a time: the same batches in both processes
                out["batch1"]["tokens"] = tokens
    finally:
        engine.shutdown()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--presets", default="qwen3-30b-a3b,llama-3.1-8b")
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--kv-cache-gib", type=float, default=20.0)
    parser.add_argument("--variants", default="QML_PDL=0;QML_PDL=1",
                        help="';'-separated environments, one engine process each; tokens compared to the first")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (tiny presets)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.steps, args.concurrency, args.kv_cache_gib, args.device)), flush=True)
        return 0
    import torch
    import triton

    variants = [dict(kv.split("=", 1) for kv in v.split()) for v in args.variants.split(";")]
    names = [" ".join(f"{k}={v}" for k, v in env.items()) for env in variants]
    results = {}
    for preset in args.presets.split(","):
        runs = {}
        for name, env in zip(names, variants):
            cmd = [sys.executable, __file__, "--child", preset, "--steps", str(args.steps),
                   "--concurrency", str(args.concurrency), "--kv-cache-gib", str(args.kv_cache_gib),
                   "--device", args.device]
            run = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True)
            line = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
            if run.returncode != 0 or not line:
                print(run.stdout[-2000:], run.stderr[-4000:], flush=True)
                continue
            runs[name] = json.loads(line[0][len("RESULT "):])
        row = {}
        for batch in ("batch1", f"batch{args.concurrency}"):
            tokens = (lambda r: r["batch1"]["tokens"]) if batch == "batch1" else (lambda r: r[f"{batch}_tokens"])
            first = runs.get(names[0])
            row[batch] = {n: {"median": r[batch]["median"], "ms_per_step": r[batch]["ms_per_step"],
                              "same_tokens_as_first": first is not None and tokens(r) == tokens(first)}
                          for n, r in runs.items()}
            for n, r in row[batch].items():
                print(f"{preset} {batch} [{n}]: {r['median']:.3f} ms/step {r['ms_per_step']}, "
                      f"tokens as [{names[0]}]: {r['same_tokens_as_first']}", flush=True)
        results[preset] = row
    meta = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "torch": torch.__version__, "triton": triton.__version__, "command": "python " + " ".join(sys.argv)}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"pdl-h200-{meta['date']}.json").write_text(json.dumps({**meta, "results": results}, indent=1))
    same = all(r["same_tokens_as_first"] for row in results.values() for b in row.values() for r in b.values())
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
