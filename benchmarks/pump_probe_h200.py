"""Kept pages pumped down beside a prefill, in-process: what a fresh 27k-token prompt and the next
turn cost right after another long request ended (its ~1,700 kept pages not yet in host RAM).

    python benchmarks/pump_probe_h200.py --out DIR [--configs 11,00,01,10] [--profile 11]

Per configuration (``QML_PUMP_BESIDE`` and ``QML_SAVE_IN_PLACE`` as two digits, switched on the
running engine): a fresh prompt A, at once a fresh prompt B (A's pages still deferred: the sessions
bench's "fresh" after a turn), then A's history + 133 tokens (B's pages deferred: the next user's
turn). TTFTs, the engine loop's split and the backlog when each request arrives; ``--profile``
adds the GPU kernels of B under one configuration. The sessions bench saw, with both on, fresh
prompts at ~3 s instead of ~0.95 s and a GPU-history turn at 214 ms instead of 29.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).parent))
from engine_h200 import _kernel_rows, _loop_counters, _served_engine, _timed_request

from qml_runtime.sampling_params import SamplingParams


def drain(engine, timeout: float = 30.0) -> None:
    """Wait until the idle loop has pumped every kept page down and the copies have run."""
    t0 = time.time()
    while engine.tiers.deferred and time.time() - t0 < timeout:
        time.sleep(0.02)
    torch.cuda.synchronize()


def timed(engine, ids, params) -> dict:
    was = _loop_counters(engine)
    backlog = engine.tiers.deferred
    t = _timed_request(engine, ids, params)[0] * 1e3
    now = _loop_counters(engine)
    return {"ttft_ms": round(t, 1), "deferred_at_submit": backlog,
            "loop_ms": {k: round((now[k] - was[k]) * 1e3, 1) for k in ("schedule", "step", "post")},
            "steps": now["steps"] - was["steps"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--preset", default="llama-3.1-8b")
    parser.add_argument("--kv-cache-gib", type=float, default=10.0)
    parser.add_argument("--configs", default="11,00,01,10,11")
    parser.add_argument("--profile", default="", help="a configuration whose fresh B is profiled")
    parser.add_argument("--tokens", type=int, default=27120)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    engine = _served_engine(args, device, kv_host_gib=4 * args.kv_cache_gib)
    engine.start()
    V = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(7)
    one = SamplingParams(max_tokens=1, temperature=0.0)

    def prompt(n):
        return torch.randint(300, V, (n,), generator=gen).tolist()

    _timed_request(engine, prompt(4000), one)  # warm-up
    drain(engine)
    rows = []
    for cfg in args.configs.split(","):
        engine.tiers.pump_beside, engine.tiers.save_in_place = cfg[0] == "1", cfg[1] == "1"
        drain(engine)
        a = prompt(args.tokens)
        row = {"config": cfg, "fresh_a": timed(engine, a, one)}
        b = prompt(args.tokens)
        if cfg == args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                row["fresh_b"] = timed(engine, b, one)
            kernels = _kernel_rows(prof)[:25]
            (args.out / f"probe-profile-{cfg}.txt").write_text(
                prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))
            for name, calls, ms in kernels:
                print(f"  {ms:9.2f} ms {calls:6d}  {name}", flush=True)
        else:
            row["fresh_b"] = timed(engine, b, one)
        row["turn_a"] = timed(engine, a + prompt(133), one)
        row["stats"] = {k: v for k, v in vars(engine.tiers.stats).items() if isinstance(v, (int, float))}
        rows.append(row)
        print(json.dumps(row), flush=True)
    (args.out / "pump-probe.json").write_text(json.dumps(
        {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
         "torch": torch.__version__, "triton": triton.__version__, "command": " ".join(sys.argv),
         "rows": rows}, indent=1))
    for r in rows:
        print(f"{r['config']}: fresh A {r['fresh_a']['ttft_ms']} ms, fresh B {r['fresh_b']['ttft_ms']} ms "
              f"(deferred {r['fresh_b']['deferred_at_submit']}), turn A {r['turn_a']['ttft_ms']} ms "
              f"(deferred {r['turn_a']['deferred_at_submit']})", flush=True)
    engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
