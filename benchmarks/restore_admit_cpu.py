"""The engine thread's time from a host-RAM turn's schedule to its restore's copy, on CPU, without a model.

On the H200 the next turn of a 27k-token conversation whose history sits in host RAM waits for its copy
(3.58 GB, ~71 ms at ~50 GB/s) to start, and the copy starts only once the scheduler has found the history,
planned the restore and taken ~1,700 pages for it (evicting another conversation's). Everything before that
launch adds to the turn's TTFT one for one; everything after it hides behind the copy. ``host_turn_cpu.py
--tier host`` measures this inside the whole engine (a model on CPU, ~1 min a start, a few % of noise per
turn on a shared 2-core machine); here only the scheduler and the tiers run, so many turns can be timed.

Each repeat builds a scheduler over ``--blocks`` pages with a host tier (the GPU's path: kept pages deferred
and pumped down in place, the reference copies on CPU), runs a ``--history``-token conversation through it
to its end (its pages kept in host RAM), lets another tenant's conversation take every page of the pool
(evicting it; ended and kept too, its copies pumped down), then schedules the next turn (``--new`` fresh
tokens) with the copy itself replaced by a marker: ``to_copy`` is the time from ``Scheduler.schedule``'s call
to the copy's entry (``KVTiers._upload``; with ``--layered``, to the first ``page_copy`` launch of the GPU's
path, ``KVTiers._upload_layers``, run on CPU with stand-ins for CUDA's streams and events), ``schedule`` the
whole call, in ms. Medians over ``--repeats``.

    python benchmarks/restore_admit_cpu.py                 # 40 repeats, ~10 s
    python benchmarks/restore_admit_cpu.py --layered       # up to the GPU path's first copy launch
    python benchmarks/restore_admit_cpu.py --layered --busy-writers 4   # beside a disk writer kept busy
    PYTHONPATH=/path/to/other/tree python benchmarks/restore_admit_cpu.py   # another tree, same script

``--busy-writers 4`` (session 36, this 2-core machine, 25 turns a run): ``to_copy`` 1.83-2.06 ms alone, 2.56-2.86
beside the writer (its upper quartile 3.7), 2.37 beside one thread. A trial that also paused the writers between
a write's stages while the engine held them (not only before a write) gave 2.28 against 2.56 in the same pair of
runs: not kept (a borrowed host row's write cannot pause once begun: the tier's ``detach`` waits for it).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

import torch

from qml_runtime.config import SchedulerConfig
from qml_runtime.kv.block_manager import BlockManager
from qml_runtime.kv.cache import KVCache
from qml_runtime.kv.host_tier import HostTier
from qml_runtime.kv.prefix import pack
from qml_runtime.kv.tiers import KVTiers
from qml_runtime.presets import PRESETS
from qml_runtime.sampling_params import SamplingParams
from qml_runtime.scheduler import Scheduler
from qml_runtime.sequence import Sequence


def build(args) -> Scheduler:
    # pages of 16 tokens of tiny-llama's small cache: the bookkeeping of 1,700 pages is timed, not their bytes
    cfg = PRESETS["tiny-llama"].config
    kv = KVCache(cfg, args.blocks, 16, "cpu", torch.float32)
    host = HostTier(kv.block_bytes, 3 * args.blocks * kv.block_bytes, pin=False)
    tiers = KVTiers(kv, host, None)
    tiers.defer_persist = tiers.save_in_place = True  # the GPU's path (the reference copies on CPU)
    blocks = BlockManager(args.blocks, 16)
    blocks.on_evict = tiers.spill_many
    return Scheduler(SchedulerConfig(max_batched_tokens=args.chunk), blocks, b"fp", tiers=tiers)


def run_to_end(sched: Scheduler, tokens: list[int], salt: bytes) -> Sequence:
    """A request scheduled chunk by chunk to its end (pages computed in place), finished and kept in host RAM
    as the engine keeps it (``KVTiers.persist``, then the pump)."""
    seq = Sequence("r", tokens, SamplingParams(max_tokens=1), None, salt=salt)
    sched.add(seq)
    while seq.num_computed < seq.num_tokens:
        batch = sched.schedule()
        sched.tiers.flush_spills()
        for q, n in zip(batch.seqs, batch.num_tokens):
            q.num_computed += n
            sched.commit(q)
    table, names = list(seq.block_table), list(seq.block_names)
    sched.finish(seq, "stop")
    sched.tiers.persist([(p, *sched.blocks.named(p), names[i - 1] if i else None)
                         for i, p in enumerate(table) if sched.blocks.named(p) is not None])
    while sched.tiers.pump(max_pages=10**6):
        pass
    return seq


class _Stream:
    """A CUDA stream or event stand-in: what the layered restore calls on them does nothing here."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: True


def fake_cuda() -> None:
    """``--layered``: ``KVTiers._upload_layers`` runs on CPU, its streams and events stand-ins, its pinned index
    plain memory: the host's Python of the H200's restore path is timed up to its first ``page_copy`` call."""
    import contextlib

    torch.cuda.current_stream = lambda device=None: _Stream()
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    torch.cuda.Event = torch.cuda.Stream = _Stream  # (the staged restore's DMA stream too)
    try:  # the restore's index, built where ``_upload_layers`` looks it up
        from qml_runtime.kv import host_restores

        rows = host_restores.int64_rows
        host_restores.int64_rows = lambda *r, pin=False: rows(*r)
    except ImportError:  # (a tree from before host_restores: torch.tensor(..., pin_memory=True))
        tensor = torch.tensor
        torch.tensor = lambda *a, pin_memory=False, **k: tensor(*a, **k)


def one_turn(args, rng: random.Random, writer=None) -> dict[str, float]:
    """``writer``: a busy disk writer (``busy_writers``), held around the schedule."""
    sched = build(args)
    history = [rng.randrange(32000) for _ in range(args.history)]
    run_to_end(sched, history, b"a")
    run_to_end(sched, [rng.randrange(32000) for _ in range(args.blocks * 16 - 1)], b"b")  # takes every page
    prompt = history + [rng.randrange(32000) for _ in range(args.new)]
    # packed on the caller's thread, as ``Engine.submit`` hands it over
    seq = Sequence("turn", prompt, SamplingParams(max_tokens=1), None, salt=b"a", packed_prompt=pack(prompt))
    marks = {}
    if args.layered:  # the GPU's path up to its first copy's launch, with stand-ins for CUDA (``fake_cuda``)
        import qml_kernels.page_copy

        def copy(*a, **k):
            marks.setdefault("copy", time.perf_counter())

        qml_kernels.page_copy.page_copy = copy  # (imported by ``_upload_layers`` when it runs)
        try:  # the staged restore (QML_RESTORE_STAGED, the default since session 28) starts with a 2D copy
            from qml_runtime.kv import dma

            dma.copy_2d_to_device = copy
        except ImportError:  # (a tree from before it)
            pass
        tiers = sched.tiers
        tiers._in_place, tiers._restore_stream = True, _Stream()
    else:
        def upload(pages, sources, hold=False):
            marks.setdefault("copy", time.perf_counter())

        sched.tiers._upload = upload
    sched.add(seq)
    gc.collect()
    if writer is not None:  # as the engine's loop holds the writes around its schedule (``hold_writes``)
        writer.hold()
    t0 = time.perf_counter()
    batch = sched.schedule()
    t1 = time.perf_counter()
    if writer is not None:
        writer.release()
    assert batch.seqs == [seq] and seq.num_cached >= args.history - 16, "the history was not restored"
    return {"to_copy": (marks["copy"] - t0) * 1e3, "schedule": (t1 - t0) * 1e3}


def busy_writers(threads: int, block_bytes: int, element_size: int):
    """``--busy-writers``: a disk writer with ``threads`` threads (``DiskWriter``, writing ``DiskStore`` files in a
    temporary directory) kept busy with random blocks of ``block_bytes`` the whole run, as after a burst of long
    prompts whose pages go down to disk while the next turn is scheduled. Its writes begun go on through the
    engine thread's hold; the hold stops those not begun."""
    import os
    import tempfile
    import threading

    from qml_runtime.kv.disk_store import DiskStore
    from qml_runtime.kv.disk_writer import DiskWriter
    from qml_runtime.kv.tiers import TierStats

    store = DiskStore(tempfile.mkdtemp(prefix="qml-busy-"), b"busy-fp".ljust(32, b"-"), 2 << 30,
                      element_size=element_size)
    writer = DiskWriter(store, block_bytes, TierStats(), threads=threads)
    dtype = torch.bfloat16 if element_size == 2 else torch.uint8
    data = torch.randn(block_bytes // 2).to(torch.bfloat16).view(dtype) if element_size == 2 \
        else torch.randint(0, 255, (block_bytes,), dtype=torch.uint8)

    def feed() -> None:
        n = 0
        while True:
            if writer.pending_bytes > 8 * block_bytes:
                time.sleep(0.001)
                continue
            n += 1
            writer.put_block(os.urandom(32), pack(list(range(n, n + 16))), data.clone(), None, None)

    threading.Thread(target=feed, daemon=True).start()
    time.sleep(1.0)  # (the writer's threads in their stride)
    return writer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--history", type=int, default=27000)
    p.add_argument("--new", type=int, default=150)
    p.add_argument("--blocks", type=int, default=2400, help="pages of 16 tokens in the pool")
    p.add_argument("--chunk", type=int, default=8192, help="max batched tokens")
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--layered", action="store_true",
                   help="time up to the GPU path's first page_copy call (KVTiers._upload_layers, CUDA faked), "
                        "not up to KVTiers._upload")
    p.add_argument("--busy-writers", type=int, default=0,
                   help="a disk writer of this many threads writing 2 MiB blocks beside every turn (busy_writers)")
    p.add_argument("--raw", action="store_true", help="--busy-writers: files written raw, not encoded")
    args = p.parse_args()
    if args.layered:
        fake_cuda()
    writer = busy_writers(args.busy_writers, 2 << 20, 0 if args.raw else 2) if args.busy_writers else None
    torch.set_num_threads(1)
    rng = random.Random(0)
    rows = [one_turn(args, rng, writer) for _ in range(args.repeats)]
    for key in ("to_copy", "schedule"):
        values = sorted(r[key] for r in rows)
        print(f"{key:>9}: median {statistics.median(values):.3f} ms, quartiles {values[len(values) // 4]:.3f}"
              f"-{values[3 * len(values) // 4]:.3f}, min {values[0]:.3f} ({len(values)} turns)")


if __name__ == "__main__":
    main()
