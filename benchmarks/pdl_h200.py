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

``--restore``: instead, per variant, a turn over a ``--history-tokens`` history that other prompts
pushed down to host RAM: restored layer by layer beside the turn's prefill (each layer's kernels
wait on its copy's event), its 32 greedy tokens compared with the first variant's, and the blocks
restored from host RAM reported (the check fails if there were none).
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


def restore_child(preset: str, device: str, history_tokens: int) -> dict:
    """A turn whose history comes back from host RAM, layer by layer beside the turn's prefill (the
    compute stream waits on each layer's copy event): its greedy tokens, and how many blocks came
    from host RAM. A PDL launch that ran ahead of an event wait would read pages not yet copied."""
    import torch

    from engine_common import _timed_request
    from qml_runtime.loader import load_engine
    from qml_runtime.sampling_params import SamplingParams

    from qml_runtime.presets import PRESETS

    cfg = PRESETS[preset].config
    # K and V per token: bf16 on the GPU, fp32 on CPU (the engine's default dtypes)
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * (2 if device == "cuda" else 4)
    # a GPU pool of the turn and a little more, under two histories: the other prompts evict the history
    gib = (history_tokens + 600) * per_token / 2**30
    engine = load_engine(f"preset:{preset}", random_weights=True, device=device, kv_cache_gib=gib,
                         kv_host_gib=4 * gib, max_num_seqs=8, progress=False)
    engine.start()
    V = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(7)
    draw = lambda n: torch.randint(300, V, (n,), generator=gen).tolist()  # noqa: E731
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)  # noqa: E731
    try:
        history, first = draw(history_tokens), []
        _timed_request(engine, history, greedy(16), first)
        for _ in range(2):  # other prompts push the history's pages down to host RAM
            _timed_request(engine, draw(history_tokens), greedy(1))
        before = engine.tiers.stats.restored_host
        turn = []
        _timed_request(engine, history + first + draw(200), greedy(32), turn)
        return {"tokens": first + turn, "restored_host_blocks": engine.tiers.stats.restored_host - before}
    finally:
        engine.shutdown()


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
    parser.add_argument("--restore", action="store_true",
                        help="instead: a turn restored from host RAM under each variant (tokens must match)")
    parser.add_argument("--history-tokens", type=int, default=6000)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = (restore_child(args.child, args.device, args.history_tokens) if args.restore
                  else child(args.child, args.steps, args.concurrency, args.kv_cache_gib, args.device))
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    import torch
    import triton

    variants = [dict(kv.split("=", 1) for kv in v.split()) for v in args.variants.split(";")]
    names = [" ".join(f"{k}={v}" for k, v in env.items()) for env in variants]
    results, failed = {}, []
    for preset in args.presets.split(","):
        runs = {}
        for name, env in zip(names, variants):
            cmd = [sys.executable, __file__, "--child", preset, "--steps", str(args.steps),
                   "--concurrency", str(args.concurrency), "--kv-cache-gib", str(args.kv_cache_gib),
                   "--device", args.device, "--history-tokens", str(args.history_tokens)]
            cmd += ["--restore"] if args.restore else []
            run = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True)
            line = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
            if run.returncode != 0 or not line:
                print(run.stdout[-2000:], run.stderr[-4000:], flush=True)
                failed.append(f"{preset} [{name}]")
                continue
            runs[name] = json.loads(line[0][len("RESULT "):])
        first = runs.get(names[0])
        if args.restore:
            row = {n: {"restored_host_blocks": r["restored_host_blocks"],
                       "same_tokens_as_first": first is not None and r["tokens"] == first["tokens"]}
                   for n, r in runs.items()}
            for n, r in row.items():
                print(f"{preset} restore [{n}]: {r['restored_host_blocks']} blocks from host RAM, "
                      f"tokens as [{names[0]}]: {r['same_tokens_as_first']}", flush=True)
            results[preset] = {"restore": row}
            continue
        row = {}
        for batch in ("batch1", f"batch{args.concurrency}"):
            tokens = (lambda r: r["batch1"]["tokens"]) if batch == "batch1" else (lambda r: r[f"{batch}_tokens"])
            row[batch] = {n: {"median": r[batch]["median"], "ms_per_step": r[batch]["ms_per_step"],
                              "same_tokens_as_first": first is not None and tokens(r) == tokens(first)}
                          for n, r in runs.items()}
            for n, r in row[batch].items():
                print(f"{preset} {batch} [{n}]: {r['median']:.3f} ms/step {r['ms_per_step']}, "
                      f"tokens as [{names[0]}]: {r['same_tokens_as_first']}", flush=True)
        results[preset] = row
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    meta = {"date": datetime.date.today().isoformat(), "gpu": gpu, "torch": torch.__version__,
            "triton": triton.__version__, "command": "python " + " ".join(sys.argv)}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = f"pdl-h200-{'restore-' if args.restore else ''}{meta['date']}.json"
        (args.out / name).write_text(json.dumps({**meta, "results": results}, indent=1))
    same = all(r["same_tokens_as_first"] and r.get("restored_host_blocks", 1) > 0
               for row in results.values() for b in row.values() for r in b.values())
    if failed:
        print("failed:", ", ".join(failed), flush=True)
    return 0 if same and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
