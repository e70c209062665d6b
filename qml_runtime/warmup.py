"""Start-up warm-up: the eager prefill paths run once before the first request, and the prefill
time is measured for the restore planner.

Why: on the H200 the first prompt longer than the prefill graphs (over 1,024 tokens) took 1.43 s
instead of ~35 ms, and the first one routed to cuDNN (4k+ tokens) 985 ms instead of ~100 ms
(``benchmarks/engine_h200.py --sections firstcall``): Triton compiles each kernel variant at
its first launch (integer arguments are specialised on divisibility by 16, so a length that is
a multiple of 16 and one that is not are two variants), and cuDNN builds a plan per shape. The
CUDA graphs compile what decode and short chunks use; this covers the rest: fresh prompts of
both kinds of length on both attention paths, a chunk over cached context, and a mixed step
(a decode row beside a chunk).

The same prompts, timed a second time, give the planner the fresh-prefill time curve of this
model on this GPU (``RestorePlanner.prefill_curve``): without it, a server restarted on a disk
store weighed reading a history against a guessed prefill speed, and chose to read when
recomputing was faster (sessions bench on the H200: 1.40 s against 0.99 s to recompute).

A turn whose history comes back from host RAM runs eagerly (each layer waits only for its own
restored pages), at a length no graph was captured for. With CUDA's lazy module loading, the first
launch of a kernel loads it, and a load may synchronise the context: on the H200 the first such
turn after start-up stalled 70 ms in its first GEMM, until the restore copying beside it had ended
(`engine_h200.py --sections hostturn --sample-stacks`), so the restore and the compute ran one after
the other (114 ms against 79-88 for later turns). The warm-up therefore also runs short eager
chunks over the longest cached context (both sides of 16: Triton's specialisations, the split-KV
attention and its merge) and every dense weight's GEMM at each row count up to ``GEMM_ROWS``
(cuBLAS picks its kernel by the shape, so each row count may load another one).

The warm-up's pages are taken from the pool and given back unnamed: nothing enters the prefix
cache, nothing is spilled.
"""

from __future__ import annotations

import logging
import time

import torch

from qml_kernels.attention_chunk import MIN_QUERIES
from qml_runtime.sampling_params import SamplingParams
from qml_runtime.scheduler import ScheduledBatch

log = logging.getLogger("qml.warmup")

# fresh prompt lengths, capped by what one step may take: multiples of 16 and not, on both sides
# of the cuDNN threshold (4,096), up to the longest prompt prefilled in one step
FRESH_SIZES = (1500, 2048, 4100, 8192, 16384, 32768)
CHUNK = 4999  # more than the prefill graphs take (4096), not a multiple of 16: the eager path
# also timed (not needed for compiling: the prefill graphs cover them): a short prompt's time is
# mostly fixed costs, which the curve would otherwise extrapolate away
TIMED_SHORT = (128, 512)
# eager chunks over the longest cached context, as a turn restored from host RAM runs (no graph)
TURN_SIZES = (150, 224)
# eager chunks of more than 512 queries over it (a long turn restored from host RAM or disk, the blocks a cut
# restore computes): cuDNN's graphs for the chunk path's row bounds 1024, 2048 and 4096 are built here
# (qml_kernels.attention_chunk; CHUNK's step builds 8192's), not at a served step (50-115 ms each)
LONG_TURN_SIZES = (600, 1100, 2100)
GEMM_ROWS = 1024  # dense GEMMs at every row count up to this (a turn's chunk, eager)
GEMM_ROWS_WIDE = 256  # for weights wider than WIDE_N (the LM head: only the sampled rows)
WIDE_N = 65536


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load_gemm_kernels(model: torch.nn.Module, rows: int = GEMM_ROWS, rows_wide: int = GEMM_ROWS_WIDE,
                      device_type: str = "cuda") -> int:
    """Run ``qml_kernels.linear`` once for each distinct dense weight shape of ``model`` (2-D floating
    parameters on ``device_type``) at every row count from 1 to ``rows`` (``rows_wide`` for weights
    wider than ``WIDE_N``), so that the kernels the GEMM libraries pick for them are loaded before a
    request needs one beside a restore. Returns the GEMMs run."""
    from qml_kernels import linear as linear_module

    shapes = {}
    for p in model.parameters():
        if p.dim() == 2 and p.is_floating_point() and p.device.type == device_type:
            shapes.setdefault((tuple(p.shape), p.dtype), p)
    runs = 0
    with torch.inference_mode():
        for (shape, dtype), weight in shapes.items():
            n, k = shape
            top = rows if n <= WIDE_N else min(rows, rows_wide)
            x = torch.zeros(top, k, dtype=dtype, device=weight.device)
            for m in range(1, top + 1):
                linear_module.linear(x[:m], weight)
                runs += 1
    return runs


def warm_up(engine, sizes: tuple[int, ...] = FRESH_SIZES, chunk: int = CHUNK,
            timed_short: tuple[int, ...] = TIMED_SHORT, turns: tuple[int, ...] = TURN_SIZES + LONG_TURN_SIZES
            ) -> list[tuple[int, float]]:
    """Run the eager paths once, then time fresh prefills; returns [(tokens, seconds)] and hands
    the curve to the restore planner. Call before the engine loop starts (it uses the runner and
    the block pool directly)."""
    runner, blocks, device = engine.runner, engine.blocks, engine.device
    one_step = max(engine.scheduler.config.max_batched_tokens, engine.scheduler.config.max_tokens_alone)
    # no warm-up step larger than a served one (its activations would be the start-up's memory peak);
    # a chunk the prefill graphs then take leaves the eager path to the mixed batch below
    chunk = min(chunk, one_step - 1)
    # the longest prompt is followed by an eager chunk over its cached context (CHUNK tokens: more
    # than the prefill graphs take, not a multiple of 16) and a last token beside another's
    turns = sorted(n for n in turns if n < one_step)

    def limit(turns) -> int:
        """The longest fresh prompt that fits beside the chunk and these turns over its context."""
        after = chunk + sum(turns)  # the tokens computed over the longest prompt's context
        return min(one_step, engine.context_length - after - 10,
                   (blocks.num_free - 2) * blocks.block_size - after - 10 - min(sizes, default=0) - 1)

    # turns long enough for the chunk path are the first to go where the context is short: they never displace a size
    kept = [n for n in turns if n < MIN_QUERIES]
    sizes = tuple(sorted(n for n in sizes if n <= limit(kept)))
    if not sizes:
        return []
    for n in (n for n in turns if n >= MIN_QUERIES):
        if limit(kept + [n]) >= sizes[-1]:
            kept.append(n)
    turns = sorted(kept)
    after = chunk + sum(turns)
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    t_start = time.perf_counter()

    def prompt(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    def run(seqs, counts, eager: bool = False) -> None:
        for seq, n in zip(seqs, counts):
            blocks.grow(seq.block_table, seq.num_computed + n)
        runner.step(ScheduledBatch(list(seqs), list(counts)), eager=eager)

    def fresh(n: int, extra: int = 0):
        """A sequence of n + extra prompt tokens with its first n computed."""
        seq = engine._new_sequence(prompt(n + extra + 1), params, f"warmup-{n}")
        run([seq], [n])
        return seq

    held = []
    try:
        with torch.inference_mode():
            for i, n in enumerate(sizes):  # first pass: compiles and plans
                held.append(fresh(n, after + 8 if i == len(sizes) - 1 else 0))
                if 0 < i < len(sizes) - 1:
                    blocks.release(held.pop().block_table)
            # a chunk over cached context, short eager ones after it (a restored turn's path), then
            # one sequence's last token beside another's last nine (a mixed batch: eager)
            a, b = held[0], held[-1]
            run([b], [chunk])
            for n in turns:
                run([b], [n], eager=True)
            run([a, b] if a is not b else [b], [1, 9] if a is not b else [9])
            for seq in held:
                blocks.release(seq.block_table)
            held = []
            curve = []
            timed = sorted({n for n in timed_short if n < sizes[0]} | set(sizes))
            for n in timed:  # second pass: the time of a fresh prefill, compiled
                _sync(device)
                t0 = time.perf_counter()
                seq = fresh(n)
                _sync(device)
                curve.append((n, time.perf_counter() - t0))
                blocks.release(seq.block_table)
    finally:
        for seq in held:
            blocks.release(seq.block_table)
    gemms = load_gemm_kernels(engine.runner.model) if device.type == "cuda" else 0
    if engine.tiers is not None:
        engine.tiers.planner.prefill_curve = curve
    log.info("warm-up in %.1f s (%d GEMMs to load their kernels); fresh prefill %s", time.perf_counter() - t_start,
             gemms, ", ".join(f"{n} tokens {s * 1e3:.1f} ms" for n, s in curve))
    return curve
