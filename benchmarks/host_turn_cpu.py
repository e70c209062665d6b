"""The engine's host time for the next turn of a long conversation, on CPU.

On the H200 a turn over a ~27k-token history cached in GPU pages (~150 new tokens) took
29.4 ms to its first token, of which ~15 ms GPU kernels: the host's work before and around
the launch is serial with the GPU for a request's first step. This script measures that
host work on CPU, with the tiny-llama preset (random weights), so it can be cut without a GPU.

A first request of ``--history`` random ids is prefilled (its pages stay cached); then each
turn is a new request whose prompt is the previous prompt + its generated token + ``--new``
fresh ids, with max_tokens=1. The engine loop is driven on this thread (``Engine._iterate``),
so nothing waits on a thread switch. Per turn, the wall time of each phase is taken with
perf_counter wrappers; ``compute`` (the model forward, the logits head, the sampler) is what
the GPU does on the H200, and ``host`` is the turn minus it. Later turns run under cProfile.

By default the 150-token step goes through the prefill-graph path run eagerly (``PrefillGraphs``,
capture=False), as the H200 turn does through its graph, and a host-RAM tier is on, as in the
sessions benchmark (``--host-gib 0``: none; ``--eager``: the runner's eager ``_prepare`` path).

``--tier host``: each turn finds the history in the host-RAM tier, not on GPU pages, as the next
turn of a conversation does on a busy server. Before each turn (untimed) another conversation,
another tenant's, takes every page of the pool, evicting this one's (kept in host RAM when its
turn ended), and ends as a request does: named, kept in host RAM, cached on the GPU. The turn
then restores its history from host RAM into pages it takes from that conversation. Its
``schedule`` is split into ``restorable``, ``plan``, ``restore_host``, ``register`` (the restored
pages) and the rest; ``upload`` (``KVTiers._upload``, the copy itself) is taken out of them and
counted as compute: here a memcpy through the CPU staging path, on the H200 per-layer kernels on
the restore stream (whose host side the CPU path does not run). ``--coarse``: no timer around
calls made per block (``register`` before ``register_run``), for totals without their cost.

    python benchmarks/host_turn_cpu.py               # 10 timed turns, then 3 under cProfile
    python benchmarks/host_turn_cpu.py --turns 20 --eager --host-gib 0
    python benchmarks/host_turn_cpu.py --tier host   # the history restored from host RAM each turn

The first request takes ~40-60 s on 2 cores (the reference attention); each turn ~0.5 s. Results:
benchmarks/results/host-turn-cpu-2026-12-01.md (host time to the token 3.98 -> 1.91 ms a turn).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import pstats
import random
import statistics
import tempfile
import time
from collections import defaultdict

import torch

from qml_runtime import cuda_graphs, runner
from qml_runtime.config import CacheConfig, SchedulerConfig
from qml_runtime.cuda_graphs import PrefillGraphs
from qml_runtime.engine import Engine
from qml_runtime.kv.prefix import model_fingerprint
from qml_runtime.presets import PRESETS, ByteTokenizer, random_model
from qml_runtime.sampling_params import SamplingParams
from qml_runtime.sequence import Sequence

# what the GPU does on the H200 (timed, then subtracted); the host phases, nested ones indented. The
# top-level host phases and "other" (the loop, waking, emitting) add up to "host".
COMPUTE = ["forward", "logits", "sample"]
PHASES = ["submit", "schedule", "  cached_prefix", "  restorable", "step_host", "  prepare", "  graph_stage",
          "commit", "finish", "  sched_finish", "  persist", "other"]
# --tier host: the schedule of a restore, split; "upload" (the copy into the pages, inside restore_host) is
# taken out of "host", "schedule" and "restore_host" as compute is; "sched_rest": the rest of "schedule"
RESTORE = ["  plan", "  grow", "  restore_host", "  upload", "  register", "  sched_rest"]


def build(args) -> Engine:
    preset = PRESETS["tiny-llama"]
    # the preset says 4,096 positions; RoPE has no table to outgrow, so a longer context is only a number
    cfg = dataclasses.replace(preset.config, context_length=args.max_model_len)
    dev = torch.device("cpu")
    net = random_model(dataclasses.replace(preset, config=cfg), dev, torch.float32)
    cache = CacheConfig(block_size=16, num_blocks=args.blocks, host_bytes=int(args.host_gib * 2**30),
                        disk_dir=args.disk, disk_bytes=(8 << 30) if args.disk else 0)
    eng = Engine(net, ByteTokenizer(cfg.vocab_size), cfg, model_id="tiny-llama-random", device=dev,
                 dtype=torch.float32, cache=cache, scheduler=SchedulerConfig(max_batched_tokens=args.chunk),
                 context_length=args.max_model_len, fingerprint=model_fingerprint("host-turn", cfg, 16))
    if not args.eager:  # the host side of the H200's graph path, without a capture
        eng.runner.prefill_graphs = PrefillGraphs(net, eng.kv, dev, eng.context_length, capture=False)
    return eng


class Timers:
    """perf_counter wrappers around methods; seconds per phase for the current turn."""

    def __init__(self):
        self.turn: dict[str, float] = defaultdict(float)
        self.running: set[str] = set()
        self.first: dict[str, float] = {}  # perf_counter at the turn's first call of each labelled method

    def wrap(self, owner, attr: str, label: str, inside: str | None = None) -> None:
        """``inside``: only calls made while the method labelled so runs count."""
        fn = getattr(owner, attr)

        def timed(*a, **kw):
            if (inside is not None and inside not in self.running) or label in self.running:
                return fn(*a, **kw)  # (outside its caller, or nested in a call under the same label)
            self.running.add(label)
            t0 = time.perf_counter()
            self.first.setdefault(label, t0)
            try:
                return fn(*a, **kw)
            finally:
                self.turn[label] += time.perf_counter() - t0
                self.running.discard(label)

        setattr(owner, attr, timed)


def instrument(eng: Engine, per_block: bool = True) -> Timers:
    t = Timers()
    sched, run = eng.scheduler, eng.runner
    for owner, attr, label in [(eng, "submit", "submit"), (sched, "schedule", "schedule"),
                               (sched, "_cached_prefix", "  cached_prefix"), (sched, "_restorable", "  restorable"),
                               (run, "step", "step"), (run, "_prepare", "  prepare"), (sched, "commit", "commit"),
                               (eng, "_finish", "finish"), (sched, "finish", "  sched_finish"),
                               (eng.model, "forward", "forward"), (eng.model, "logits", "logits")]:
        t.wrap(owner, attr, label)
    if eng.tiers is not None:
        t.wrap(eng.tiers, "persist", "  persist")
        t.wrap(sched, "_admit", "admit")
        restore = [(eng.tiers, "plan", "  plan"), (eng.tiers, "restore_host", "  restore_host"),
                   (eng.tiers, "_upload", "  upload"), (eng.blocks, "grow", "  grow"),
                   # a restore's pages since the copy goes first: taken, the evicted ones' spill, their names
                   # dropped and their host entries' recency after the copy (``BlockManager.take``)
                   (eng.blocks, "take", "  grow"), (eng.tiers, "spill_first", "  grow"),
                   (eng.blocks, "forget", "  grow")]
        if eng.tiers.host is not None:
            restore.append((eng.tiers.host, "touch_all", "  grow"))
        if per_block:  # (before register_run, register was called once per block, each call then timed)
            restore += [(eng.blocks, "register", "  register"), (eng.blocks, "register_run", "  register")]
        for owner, attr, label in restore:
            if hasattr(owner, attr):  # (register_run: after the change that added it)
                t.wrap(owner, attr, label, inside="admit")
    if run.prefill_graphs is not None:
        t.wrap(run.prefill_graphs, "run", "  graph_stage")  # its compute is subtracted below
    for module in (runner, cuda_graphs):  # the sampler, wherever it is called from
        t.wrap(module, "sample", "sample")
    return t


def fill_pool(eng: Engine, tokens: list[int]) -> None:
    """Another conversation (``tokens``, another tenant) takes every free page, evicting the cached ones
    (to host RAM), and ends as a finished request does: named pages, kept in host RAM, left cached."""
    S = eng.blocks.block_size
    n = eng.blocks.num_free * S
    other = Sequence("other", tokens[:n], SamplingParams(max_tokens=1), None, salt=b"other")
    eng.blocks.grow(other.block_table, n)
    other.num_computed = n
    eng.scheduler.commit(other)  # its pages named, as its steps would
    eng.tiers.flush_spills()
    table = list(other.block_table)
    eng.blocks.release(other.block_table)
    eng._queue_persist(table, other.block_names)  # as the engine's _finish queues it
    eng._persist(everything=True)


def turn(eng: Engine, prompt: list[int]) -> tuple[list[int], float]:
    """Submit one request and drive the loop until it ends; its generated ids and when the first came."""
    outs, first = [], []

    def emit(out):
        if not first:
            first.append(time.perf_counter())
        outs.append(out)

    eng.submit(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), emit)
    while not (outs and (isinstance(outs[-1], BaseException) or outs[-1].finished)):
        eng._iterate(None)
    if isinstance(outs[-1], BaseException):
        raise outs[-1]
    return [t for o in outs for t in o.token_ids], first[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--history", type=int, default=27000, help="tokens of the first request")
    p.add_argument("--new", type=int, default=150, help="fresh ids per turn")
    p.add_argument("--turns", type=int, default=10, help="timed turns")
    p.add_argument("--profile-turns", type=int, default=3, help="turns after them, under cProfile")
    p.add_argument("--blocks", type=int, default=2400, help="KV pages of 16 tokens")
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--chunk", type=int, default=1024, help="max batched tokens (the first prefill's chunks)")
    p.add_argument("--host-gib", type=float, default=0.25, help="host-RAM tier (0: none)")
    p.add_argument("--disk", action="store_true", help="also a disk tier, in a temporary directory")
    p.add_argument("--eager", action="store_true", help="the runner's eager _prepare path, no prefill graphs")
    p.add_argument("--tier", choices=["gpu", "host"], default="gpu", help="where each turn finds the history")
    p.add_argument("--coarse", action="store_true", help="no timer around calls made per block (register)")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        args.disk = tmp if args.disk else None
        # one thread: the host code is single-threaded, and torch's thread pool, sharing 2 cores with
        # anything else, made the host phases' small tensor ops wait
        torch.set_num_threads(1)
        eng = build(args)
        prompt = [rng.randrange(256) for _ in range(args.history)]
        t0 = time.perf_counter()
        prompt += turn(eng, prompt)[0]
        print(f"first request: {args.history} tokens prefilled in {time.perf_counter() - t0:.1f} s; "
              f"{eng.blocks.num_cached} pages cached")
        timers = instrument(eng, per_block=not args.coarse)
        other = [rng.randrange(256) for _ in range(args.blocks * 16)] if args.tier == "host" else []
        rows = []
        prof = cProfile.Profile()
        for k in range(args.turns + args.profile_turns):
            prompt += [rng.randrange(256) for _ in range(args.new)]
            if args.tier == "host":
                fill_pool(eng, other)
            timers.turn.clear()
            timers.first.clear()
            profiled = k >= args.turns
            hits = eng.scheduler.prefix_hits
            if profiled:
                prof.enable()
            t0 = time.perf_counter()
            out, first = turn(eng, prompt)
            wall, ttft = time.perf_counter() - t0, first - t0
            prompt += out
            if profiled:
                prof.disable()
                continue
            ms = {name: timers.turn.get(name, 0.0) * 1e3 for name in PHASES + COMPUTE + RESTORE + ["step"]}
            compute = sum(ms[c] for c in COMPUTE)
            ms["step_host"] = ms["step"] - compute
            if not args.eager:
                ms["  graph_stage"] -= compute
            ms["  sched_rest"] = ms["schedule"] - sum(ms[p] for p in ["  cached_prefix", "  restorable", "  plan",
                                                                       "  grow", "  restore_host", "  register"])
            for phase in ("schedule", "  restore_host"):  # the copy is the GPU's work too
                ms[phase] -= ms["  upload"]
            compute += ms["  upload"]
            host = wall * 1e3 - compute
            ms["other"] = host - sum(ms[p] for p in PHASES if not p.startswith(" ") and p != "other")
            # the engine thread's time from its schedule's start to the restore's copy (``_upload``: on the H200
            # the first layer's copy is launched in it), and the same from the submit on the caller's thread
            marks = timers.first
            if "  upload" in marks:
                ms["to_copy"] = (marks["  upload"] - marks["schedule"]) * 1e3
                ms["submit_to_copy"] = (marks["  upload"] - t0) * 1e3
            rows.append({**ms, "total": wall * 1e3, "compute": compute, "host": host,
                         "host_ttft": ttft * 1e3 - compute, "cached": eng.scheduler.prefix_hits - hits})
        report(args, rows, prof)
        if eng.tiers is not None:
            print(f"\ntier stats: {eng.tiers.stats}")
        eng.shutdown()


def report(args, rows: list[dict], prof: cProfile.Profile) -> None:
    cols = ["total", "compute", "host", "host_ttft"] + PHASES
    if args.tier == "host":  # the restore's phases after "restorable", and when its copy began
        cols[cols.index("  restorable") + 1:cols.index("  restorable") + 1] = RESTORE
        cols[4:4] = ["submit_to_copy", "to_copy"]
    print(f"\n{args.turns} turns over a {args.history}-token history in {args.tier} pages, {args.new} new ids each "
          f"({'eager' if args.eager else 'prefill-graph'} path, host tier {args.host_gib} GiB, "
          f"disk {'on' if args.disk else 'off'}); ms per turn")
    print(f"{'turn':>5} {'cached':>7} " + " ".join(f"{c.strip():>13}" for c in cols))
    for i, r in enumerate(rows):
        print(f"{i:>5} {r['cached']:>7} " + " ".join(f"{r[c]:>13.3f}" for c in cols))
    print(f"{'med':>5} {'':>7} " + " ".join(f"{statistics.median(r[c] for r in rows):>13.3f}" for c in cols))
    print("compute: forward + logits + sample (+ upload: the restore's copy), the GPU's work on the H200;\n"
          "host: total - compute; "
          "host_ttft: the same up to the token's emit (in _finish: before persist, after sched_finish);\n"
          "step_host: runner.step - compute; graph_stage: PrefillGraphs.run - compute; indented phases are\n"
          "inside the one above; other: host - the top-level phases (the loop, tier flushes, emitting)")
    if args.profile_turns:
        for key, pattern in (("cumulative", r"qml_runtime/(?!models/)"), ("tottime", "")):
            text = io.StringIO()
            stats = pstats.Stats(prof, stream=text)
            if key == "tottime":
                stats.strip_dirs()
            stats.sort_stats(key).print_stats(*([pattern] if pattern else []), args.top)
            body = text.getvalue()
            print(f"\n--- cProfile of {args.profile_turns} turns, by {key}"
                  f"{' (qml_runtime, models excluded)' if pattern else ''} ---")
            print(body[body.find("   ncalls"):].rstrip())


if __name__ == "__main__":
    main()
