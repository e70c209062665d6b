"""Where a batch-1 decode step's time goes between the CUDA graph and the engine's loop.

    python benchmarks/decode_overhead.py --out DIR [--preset qwen3-30b-a3b] [--steps 256]

The engine's decode step on the H200 (3.19-3.22 ms for Qwen3-30B-A3B) is ~0.2 ms longer than its
CUDA graph's forward and logits head (2.97 ms, ``decode_ablation.py``). This script builds the
preset's engine, decodes ``--steps`` greedy tokens of one request (the engine's ms per token), and
then, with the engine idle, replays the same batch-1 decode graph four ways, ``--steps`` times each
with nothing waited for in between:

- ``replay``: ``graph.replay()`` alone (the forward, the head and the sampler);
- ``replay + copies``: with the step's device work around it as ``DecodeGraphs.run`` and
  ``ModelRunner.launch`` queue it: five host-to-device copies of the staged inputs, the previous
  step's tokens copied into the input row, the tokens copied back to pinned memory and an event;
- ``replay + one copy``: the same with one host-to-device copy of all staged inputs;
- ``run``: ``DecodeGraphs.run`` itself, its host work included (staging built from a sequence).

Writes ``decode-overhead-<preset>-<date>.json``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _device_ms(step, n: int) -> float:
    """Milliseconds per call of ``step`` over ``n`` calls queued back to back (events around them)."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(n):
        step()
    end.record()
    host_ms = (time.perf_counter() - t0) * 1e3 / n
    end.synchronize()
    return round(start.elapsed_time(end) / n, 4), round(host_ms, 4)


def forward_graphs(engine, reps: int) -> dict:
    """The forward and head over one token after 70 and 256 cached keys in graphs of their own (as
    ``decode_ablation.py`` times them), with the attention's split count chosen for that context or for
    the decode graphs' longest one (as the engine captures them), and with the sampler after the head."""
    from graph_timing import graph_ms

    from qml_kernels.attention import AttentionMetadata

    model, kv, graphs = engine.runner.model, engine.kv, engine.runner.graphs
    dev, S = kv.data.device, kv.block_size
    longest = graphs.max_pages * S
    out = {}
    for L in (70, 256):
        pages = -(-(L + 1) // S)
        ids, pos = torch.tensor([300], device=dev), torch.tensor([L], device=dev)
        for split_for in ("context", "longest"):
            # tables as wide as the graphs' (the launcher checks they can hold the context it sizes for)
            table = list(range(pages)) + [0] * (graphs.max_pages - pages)
            meta = AttentionMetadata.build([L], [table], [0, 1], [L + 1], dev)
            if split_for == "longest":
                meta.context_lens_host = [longest]
            for sampler in (False, True):
                def step(meta=meta, sampler=sampler, ids=ids, pos=pos):
                    logits = model.logits(model(ids, pos, kv, meta))
                    return graphs.sampling.sample(logits) if sampler else logits
                with torch.inference_mode():
                    ms = [graph_ms(step, reps) for _ in range(3)]
                name = f"{L} keys, splits for the {split_for}" + (", sampler" if sampler else "")
                out[name] = [round(m, 4) for m in ms]
                print(f"{name}: {out[name]} ms", flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--kv-cache-gib", type=float, default=20.0)
    args = parser.parse_args()

    from engine_common import _timed_request

    from qml_runtime.loader import load_engine
    from qml_runtime.sampling_params import SamplingParams

    engine = load_engine(f"preset:{args.preset}", random_weights=True, device="cuda", kv_cache_gib=args.kv_cache_gib,
                         max_num_seqs=64, max_tokens_alone=8192, progress=False)
    engine.start()
    V = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=args.steps + 1, temperature=0.0, ignore_eos=True)
    engine_ms = []
    for _ in range(3):
        stamps = _timed_request(engine, torch.randint(300, V, (64,), generator=gen).tolist(), params)
        engine_ms.append((stamps[-1] - stamps[0]) / args.steps * 1e3)
    print(f"engine: {[round(m, 3) for m in engine_ms]} ms a token", flush=True)

    graphs = engine.runner.graphs
    graph, tokens, _ = graphs._graphs[1]
    B, dev = 1, tokens.device
    host, tables, host_f, host_i = graphs._staging[0]
    pinned_tokens = torch.empty(B, dtype=tokens.dtype, pin_memory=True)
    # inputs of a real position: token 300 at position 70 in page 0's slot 70 of a 71-token context
    host[:, :B] = torch.tensor([[300], [70], [70], [71]])
    packed_host = torch.zeros(host.numel() + tables.numel() + 2 * host_f.numel(), dtype=torch.int64, pin_memory=True)
    packed_dev = torch.zeros_like(packed_host, device=dev)

    def copies(one: bool):
        if one:
            packed_dev.copy_(packed_host, non_blocking=True)
        else:
            graphs.inputs[:, :B].copy_(host[:, :B], non_blocking=True)
            graphs.context_lens[:B].copy_(host[3, :B], non_blocking=True)
            graphs.block_tables[:B, :8].copy_(tables[:B, :8], non_blocking=True)
            graphs.sampling.floats[:, :B].copy_(host_f[:, :B], non_blocking=True)
            graphs.sampling.ints[:, :B].copy_(host_i[:, :B], non_blocking=True)
        graphs.inputs[0, :B].copy_(tokens[:B])

    def replay():
        graph.replay()

    def with_copies(one: bool):
        def step():
            copies(one)
            graph.replay()
            pinned_tokens.copy_(tokens[:B], non_blocking=True)
            torch.cuda.Event().record()
        return step

    class Seq:  # what DecodeGraphs.run reads of a sequence
        num_computed, token_ids, block_table, custom_sampling = 70, [300] * 71, list(range(8)), False
        params = SamplingParams(max_tokens=1, temperature=0.0)
        seed, num_output_tokens, grammar = 0, 1, None

    graphs.inputs[2].fill_(-1)
    results = {"engine_ms_per_token": [round(m, 4) for m in engine_ms],
               "engine_median": round(statistics.median(engine_ms), 4)}
    variants = {"replay": replay, "replay + copies": with_copies(False), "replay + one copy": with_copies(True)}
    try:
        seq = Seq()
        graphs.run([seq])
        variants["run"] = lambda: graphs.run([seq])
    except Exception as exc:  # noqa: BLE001  (the sequence stand-in is short of what run reads: report, do not fail the rest)
        print(f"run: not timed ({exc!r})", flush=True)
    with torch.inference_mode():
        for name, step in variants.items():
            rows = [_device_ms(step, args.steps) for _ in range(3)]
            results[name] = {"device_ms": [r[0] for r in rows], "host_ms_to_queue": [r[1] for r in rows]}
            print(f"{name}: device {results[name]['device_ms']} ms a step, host {results[name]['host_ms_to_queue']}",
                  flush=True)
    results["graphs"] = forward_graphs(engine, args.steps)
    engine.shutdown()
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.date.today().isoformat()
    meta = {"date": stamp, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "command": "python " + " ".join(sys.argv)}
    (args.out / f"decode-overhead-{args.preset}-{stamp}.json").write_text(json.dumps({**meta, **results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
