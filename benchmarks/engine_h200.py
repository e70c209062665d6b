"""The engine on the GPU: correctness against transformers, cuDNN prefill attention, speed.

    python benchmarks/engine_h200.py --out DIR [--preset llama-3.1-8b] [--sections all]

Sections (each runs on its own; a failure is recorded and the next one runs):

- ``attention``: the cuDNN prefill path against the fp32 reference on ragged fresh batches,
  then cuDNN vs our Triton kernel on whole prompts of the seed table's sizes (TFLOP/s).
- ``transformers``: the preset's shapes with random weights, the same weights copied into
  transformers' model: logits over a 512-token prompt, then 64 greedy decode steps replayed
  from our CUDA graphs, each against transformers' logits at that position (teacher-forced
  on our tokens).
- ``engine``: the engine itself (no HTTP): TTFT per prompt size (median of new random
  prompts), decode ms/token over 256 tokens with and without CUDA graphs, 32 concurrent
  requests of 2k-token prompts (aggregate tokens/s).
- ``profile``: per-kernel GPU time of one eager decode step and one 2,340-token prefill.
- ``overlap``: decode with and without overlap (the next step launched before the last one's
  tokens are read): the same greedy tokens (one request; 8 requests admitted together), and
  ms per step at 1 and ``--concurrency`` sequences.
- ``graphprofile``: the engine's served decode (CUDA graphs, as ``engine`` runs it) under the
  profiler, at 1 and ``--concurrency`` sequences: kernel time per step beside the step's wall
  time, so the gap between the kernels (launch latency, idle SMs) shows.
- ``hostturn``, ``gputurn``, ``afterfresh`` (``engine_turns.py``): the next turn of a 27k-token
  conversation, its history restored from host RAM, in GPU memory, or in GPU memory right after an
  unrelated long prompt (the sessions bench's cases, without the server); ``--timeline``: the
  device's work per stream and bin, ``--sample-stacks``: the engine thread's stack every ms;
  ``gputurn``'s ``--probes``: ``launch`` (host stamps and graph events of unprofiled turns),
  ``clock`` (the profiled turn after idle and after GEMMs).
- ``prefillprobe``: fresh prefills of 1k-4k tokens timed in two engine starts, three of them
  profiled (GPU kernel time, launches, host syncs): where a mid-size prefill's time goes.

Writes ``engine-<gpu>.json`` and ``.md`` under --out as it goes. Also runs on CPU with
``--preset tiny-llama --device cpu`` (small sizes), which is how the script itself is tested.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_common import (
    RESULTS,
    _concurrent_requests,
    _kernel_rows,
    _loop_counters,
    _served_engine,
    _timed_request,
    free_memory,
    record,
    sync,
)
from engine_turns import section_afterfresh, section_gputurn, section_hostturn

from qml_kernels.attention import AttentionMetadata, paged_attention_ref
from qml_kernels.workbench.spec import Case
from qml_runtime.kv.cache import KVCache
from qml_runtime.sampling_params import SamplingParams

SEED_SIZES = (133, 598, 2340, 8892, 26926)


# --- attention -------------------------------------------------------------------------------

def _fresh_prompts(lens: list[int], device, gen):
    """Fresh prompts of these lengths over a shuffled paged cache, Llama-3.1-8B heads, q a view of a
    fused QKV row as in the engine: the prefill OpSpec's own inputs -> (q, k_cache, v_cache, meta)."""
    from qml_kernels.attention_prefill import PAGED_PREFILL_ATTENTION_SPEC

    case = Case("engine-bench", {"seqs": tuple((L, L) for L in lens), "H": 32, "Hkv": 8, "Dh": 128, "S": 16,
                                 "shuffle": True, "fused_q": True})
    inputs = PAGED_PREFILL_ATTENTION_SPEC.make_inputs(case, torch.bfloat16, device, gen)
    return inputs["q"], inputs["k_cache"], inputs["v_cache"], inputs["meta"]


def section_attention(args, device) -> None:
    from triton.testing import do_bench

    from qml_kernels.attention_cudnn import paged_prefill_attention_cudnn, supported
    from qml_kernels.attention_prefill import paged_prefill_attention_triton

    gen = torch.Generator().manual_seed(1)
    H, Dh = 32, 128
    scale = Dh**-0.5
    for lens in ([4133], [598, 37, 5000], [8892]):
        q, kc, vc, meta = _fresh_prompts(lens, device, gen)
        assert supported(q, kc, vc, meta, scale), f"cuDNN path does not take fresh prompts {lens}"
        ref = paged_attention_ref(q.float(), kc.float(), vc.float(), meta, scale)
        for name, fn in (("cudnn", paged_prefill_attention_cudnn), ("triton", paged_prefill_attention_triton)):
            out = fn(q, kc, vc, meta, scale).float()
            err = ((out - ref).abs().max() / ref.abs().max()).item()
            record("attention", **{f"{name}_rel_err_{'+'.join(map(str, lens))}": f"{err:.2e}"})
            assert err < 2e-2, f"{name} attention off by {err:.2e} (relative to max |out|) on {lens}"
    rows = []
    for L in args.sizes:
        q, kc, vc, meta = _fresh_prompts([L], device, gen)
        flops = 2 * L * L * H * Dh  # causal: half of 4 L^2 H Dh
        row = {"tokens": L}
        for name, fn in (("cudnn", paged_prefill_attention_cudnn), ("triton", paged_prefill_attention_triton)):
            ms = do_bench(lambda: fn(q, kc, vc, meta, scale), warmup=5, rep=30)
            row[f"{name}_ms"], row[f"{name}_tflops"] = round(ms, 3), round(flops / ms / 1e9, 1)
        rows.append(row)
        print(row, flush=True)
    record("attention", prefill_per_layer=rows)


# --- transformers ----------------------------------------------------------------------------
# the models' plumbing (configs, weight copies, the error summary) is in hf_models.py beside this file

def _ours_vs_theirs(args, device, dtype) -> dict:
    """Our prefill logits and 64 graph-replayed greedy decode steps against transformers' logits
    (teacher-forced on our tokens), both models in ``dtype``; with the transformers model's own
    logits in the other precision for the noise floor when dtype is bf16."""
    from hf_models import compare, hf_pair  # beside this script

    from qml_runtime.cuda_graphs import DecodeGraphs

    ours, hf, cfg = hf_pair(args, device, dtype)
    n_prompt, n_decode, S = args.hf_prompt, args.hf_decode, 16
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(1, cfg.vocab_size, (n_prompt,), generator=gen).tolist()
    total = n_prompt + n_decode
    kv = KVCache(cfg, -(-total // S) + 1, S, device, dtype)
    table = list(range(-(-total // S)))
    with torch.inference_mode():
        meta = AttentionMetadata.build(list(range(n_prompt)), [table], [0, n_prompt], [n_prompt], device)
        hidden = ours(torch.tensor(prompt, device=device), torch.arange(n_prompt, device=device), kv, meta)
        prefill_logits = ours.logits(hidden)  # [n_prompt, V]
    graphs = DecodeGraphs(ours, kv, device, 1, total, capture=device.type == "cuda")
    # a sequence as the engine holds one: greedy, its KV in pages `table`
    seq = SimpleNamespace(token_ids=prompt + [int(prefill_logits[-1].argmax())], num_computed=n_prompt,
                          block_table=table, seed=0, num_output_tokens=1,
                          params=SamplingParams(temperature=0.0, max_tokens=n_decode + 1))
    decode_logits = []
    for _ in range(n_decode):
        nxt = int(graphs.run([seq])[0])  # sampled in the graph: greedy
        decode_logits.append(graphs.last_logits[0].clone())
        assert nxt == int(decode_logits[-1].argmax()), "the graph's greedy token is not its logits' argmax"
        seq.num_computed += 1
        seq.num_output_tokens += 1
        seq.token_ids.append(nxt)
    tokens = seq.token_ids[n_prompt:n_prompt + n_decode]
    ids = torch.tensor([prompt + tokens], device=device)
    with torch.inference_mode():
        theirs = hf(ids).logits[0].float()  # [total, V]
    result = {"layers": cfg.num_layers, "dtype": str(dtype).removeprefix("torch."),
              "prefill": compare(prefill_logits.float(), theirs[:n_prompt]),
              "decode": compare(torch.stack(decode_logits).float(), theirs[n_prompt:])}
    del ours, kv, graphs
    free_memory()
    if dtype != torch.float32:  # the noise floor: transformers itself in this dtype against fp32
        hf32 = hf.float()
        with torch.inference_mode():
            ref32 = hf32(ids).logits[0].float()
        result["transformers_itself_vs_fp32"] = {"prefill": compare(theirs[:n_prompt], ref32[:n_prompt]),
                                                 "decode": compare(theirs[n_prompt:], ref32[n_prompt:])}
        del hf32
    del hf
    free_memory()
    return result


def section_transformers(args, device) -> None:
    """fp32 on both sides: the kernels must agree to rounding. bf16: a dense model within 1% cosine;
    a mixture of experts is reported only: its bf16 router logits tie or nearly tie often (8-bit
    mantissas, 128 experts), and a tie broken the other way (we take the lower expert id;
    torch.topk leaves the order unspecified) routes a token elsewhere. transformers' own bf16
    against its fp32 is recorded beside it for scale."""
    import transformers

    from qml_runtime.presets import PRESETS

    results = {}
    for dtype in (torch.float32, torch.bfloat16) if device.type == "cuda" else (torch.float32,):
        results[str(dtype).removeprefix("torch.")] = r = _ours_vs_theirs(args, device, dtype)
        print(r, flush=True)
    record("transformers", preset=args.preset, prompt_tokens=args.hf_prompt, decode_steps=args.hf_decode,
           transformers_version=transformers.__version__, **results)
    f32 = results["float32"]
    assert min(f32["prefill"]["min_cosine"], f32["decode"]["min_cosine"]) > 0.9999, "fp32 logits disagree"
    assert min(f32["prefill"]["top1_agree"], f32["decode"]["top1_agree"]) >= 0.98, "fp32 argmaxes disagree"
    if "bfloat16" in results and not PRESETS[args.preset].config.num_experts:
        b = results["bfloat16"]
        assert min(b["prefill"]["min_cosine"], b["decode"]["min_cosine"]) > 0.99, "bf16 logits disagree"


# --- engine ----------------------------------------------------------------------------------

def section_engine(args, device) -> None:
    t0 = time.perf_counter()
    engine = _served_engine(args, device)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.start()  # captures the decode graphs
    record("engine", load_s=round(load_s, 1), start_s=round(time.perf_counter() - t0, 1),
           kv_cache_tokens=engine.blocks.num_blocks * engine.blocks.block_size,
           decode_graph_buckets=engine.runner.graphs.buckets if engine.runner.graphs else None,
           prefill_graph_buckets=engine.runner.prefill_graphs.buckets if engine.runner.prefill_graphs else None)
    V = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(3)

    def loop_split():
        """Engine-thread time per step since the last call: schedule / launch / wait / post (ms)."""
        now = _loop_counters(engine)
        was, loop_split.last = loop_split.last, now
        steps = max(1, now["steps"] - was["steps"])
        per = {k: (now[k] - was[k]) * 1e3 / steps for k in ("schedule", "step", "post", "launch")}
        per["wait"] = per.pop("step") - per["launch"]
        return {k: round(v, 3) for k, v in per.items()} | {"steps": steps}

    loop_split.last = _loop_counters(engine)

    def prompt(n):
        return torch.randint(300, V, (n,), generator=gen).tolist()

    one = SamplingParams(max_tokens=1, temperature=0.0)
    for n in (args.sizes[0], args.sizes[-1]):
        _timed_request(engine, prompt(n), one)  # warm-up: compiles, allocator
    ttft, loops = {}, {}
    for n in args.sizes:
        loop_split()
        times = [_timed_request(engine, prompt(n), one)[0] * 1e3 for _ in range(3)]
        ttft[n] = round(statistics.median(times), 2)
        loops[n] = loop_split()
        print(f"TTFT {n}: {sorted(round(t, 2) for t in times)} ms; per step {loops[n]}", flush=True)
    record("engine", ttft_ms=ttft, ttft_loop_ms=loops)
    decode = SamplingParams(max_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True)

    for mode in ("graphs", "eager"):
        saved = engine.runner.graphs
        if mode == "eager":
            engine.runner.graphs = None
        try:
            stamps = _timed_request(engine, prompt(args.sizes[0]), decode)
        finally:
            engine.runner.graphs = saved
        ms = (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3
        record("engine", **{f"decode_ms_per_token_{mode}": round(ms, 3), f"decode_loop_ms_{mode}": loop_split()})
    # 32 conversations at once, each a new 2k-token prompt and 256 generated tokens
    N, n_ctx = args.concurrency, args.concurrency_prompt
    t0 = time.perf_counter()
    results = _concurrent_requests(engine, [prompt(n_ctx) for _ in range(N)], decode)
    wall = time.perf_counter() - t0
    record("engine", concurrency_loop_ms=loop_split())
    total = sum(len(r) for r in results)
    steady = statistics.median((r[-1] - r[len(r) // 2]) / (len(r) - 1 - len(r) // 2) for r in results) * 1e3
    record("engine", concurrency={"requests": N, "prompt_tokens": n_ctx, "tokens_each": args.decode_tokens,
                                  "wall_s": round(wall, 2), "output_tokens_per_s": round(total / wall, 1),
                                  "steady_ms_per_step": round(steady, 3),
                                  "median_ttft_ms": round(statistics.median(r[0] for r in results) * 1e3, 1)})
    engine.shutdown()  # the engine and model go with this frame; main() empties the cache


# --- first calls -------------------------------------------------------------------------------

def section_firstcall(args, device) -> None:
    """What a prompt length the server has not seen yet costs (compiles, cuDNN plans), and where a
    short turn over a long cached history spends its time."""
    engine = _served_engine(args, device)
    engine.start()
    V = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(5)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    order = [133, 598, 1100, 2340, 2340, 2341, 2600, 3000, 4100, 4100, 5000, 8892, 8892, 8893, 9500, 12000,
             26926, 26926, 26927, 30000]
    order = [n for n in order if n < engine.context_length]
    firsts = []
    for n in order:
        ids = torch.randint(300, V, (n,), generator=gen).tolist()
        t = _timed_request(engine, ids, one)[0] * 1e3
        firsts.append({"tokens": n, "ttft_ms": round(t, 1)})
        print(f"fresh {n}: {t:.1f} ms", flush=True)
    record("firstcall", engine_fresh_in_order=firsts)
    # cuDNN SDPA alone: a new length vs a seen one
    from torch.nn.attention import SDPBackend, sdpa_kernel
    H, Hkv, Dh = engine.model_config.num_heads, engine.model_config.num_kv_heads, engine.model_config.head_dim
    sdpa = []
    for L in (5000, 5000, 5001, 5003, 7000, 7000, 16001, 16001) if device.type == "cuda" else ():
        q = torch.randn(1, H, L, Dh, device=device, dtype=torch.bfloat16)
        kv = torch.randn(1, Hkv, L, Dh, device=device, dtype=torch.bfloat16)
        sync(device)
        t0 = time.perf_counter()
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
        sync(device)
        sdpa.append({"L": L, "ms": round((time.perf_counter() - t0) * 1e3, 2)})
    record("firstcall", cudnn_sdpa_in_order=sdpa)
    print("cuDNN SDPA:", sdpa, flush=True)
    # a 219-token turn over a cached 27k-token history (the sessions bench's GPU-history case)
    hist = torch.randint(300, V, (min(27120, engine.context_length // 2),), generator=gen).tolist()
    _timed_request(engine, hist, one)
    turns = []
    for i in range(4):
        hist = hist + torch.randint(300, V, (219,), generator=gen).tolist()
        was = _loop_counters(engine)
        t = _timed_request(engine, hist, one)[0] * 1e3
        now = _loop_counters(engine)
        split = {k: round((now[k] - was[k]) * 1e3, 2) for k in ("schedule", "step", "post", "launch")}
        turns.append({"ttft_ms": round(t, 2), "steps": now["steps"] - was["steps"], "loop_ms": split})
        print(f"turn over {len(hist) - 219} cached: {t:.1f} ms {split}", flush=True)
    record("firstcall", turn_over_27k_history=turns)
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile
        hist = hist + torch.randint(300, V, (219,), generator=gen).tolist()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            _timed_request(engine, hist, one)
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
        (args.out / "firstcall-turn-profile.txt").write_text(table)
        print(table, flush=True)
    engine.shutdown()


# --- profile ---------------------------------------------------------------------------------

def section_profile(args, device) -> None:
    from torch.profiler import ProfilerActivity, profile

    from qml_runtime.presets import PRESETS, random_model

    preset = PRESETS[args.preset]
    cfg = preset.config
    dtype = torch.bfloat16
    model = random_model(preset, device, dtype)
    S, ctx = 16, 2340
    kv = KVCache(cfg, -(-(ctx + 1) // S) + 1, S, device, dtype)
    table = list(range(-(-(ctx + 1) // S)))
    ids = torch.randint(300, cfg.vocab_size, (ctx,), device=device)
    pos = torch.arange(ctx, device=device)
    prefill_meta = AttentionMetadata.build(list(range(ctx)), [table], [0, ctx], [ctx], device)
    decode_meta = AttentionMetadata.build([ctx], [table], [0, 1], [ctx + 1], device)

    def prefill():
        model.logits(model(ids, pos, kv, prefill_meta)[-1:])

    def decode():
        model.logits(model(ids[:1], pos[:1] + ctx, kv, decode_meta))

    tables = {}
    with torch.inference_mode():
        for name, fn in (("prefill_2340", prefill), ("decode_b1_ctx2340", decode)):
            for _ in range(3):
                fn()
            sync(device)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn()
                sync(device)
            rows = _kernel_rows(prof)
            total = sum(r[2] for r in rows)
            tables[name] = {"total_gpu_ms": round(total, 3),
                            "kernels": [{"kernel": k, "calls": c, "ms": round(ms, 3)} for k, c, ms in rows[:14]]}
            print(name, "GPU total", round(total, 3), "ms", flush=True)
            for k, c, ms in rows[:14]:
                print(f"  {ms:8.3f} ms  {c:5d}x  {k}", flush=True)
    record("profile", **tables)


def section_prefillprobe(args, device) -> None:
    """Fresh prefills between 1k and 4k tokens, timed and profiled in two engine starts: is the
    time on the GPU (kernels) or on the host (launches, syncs), and does it change between starts?"""
    from torch.profiler import ProfilerActivity, profile

    sizes = [1024, 1100, 1500, 2048, 2340, 3000, 4100]
    host_ops = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "aten::item",
                "aten::_local_scalar_dense", "cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx")
    for start in range(2):
        engine = _served_engine(args, device)
        engine.start()
        V = engine.model_config.vocab_size
        gen = torch.Generator().manual_seed(11 + start)
        one = SamplingParams(max_tokens=1, temperature=0.0)
        ttft = {}
        for n in [n for n in sizes if n < engine.context_length]:
            times = [_timed_request(engine, torch.randint(300, V, (n,), generator=gen).tolist(), one)[0] * 1e3
                     for _ in range(3)]
            ttft[n] = [round(t, 1) for t in times]
            print(f"start {start}: fresh {n}: {ttft[n]} ms", flush=True)
        profiles = {}
        for n in [n for n in (1500, 2048, 2340) if n < engine.context_length]:
            ids = torch.randint(300, V, (n,), generator=gen).tolist()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                wall = _timed_request(engine, ids, one)[0] * 1e3
            gpu_rows = _kernel_rows(prof)
            counts = {e.key: e.count for e in prof.key_averages() if e.key in host_ops}
            cpu_ms = {e.key: round(e.self_cpu_time_total / 1e3, 2) for e in prof.key_averages() if e.key in host_ops}
            kernels = [r for r in gpu_rows if not r[0].startswith(("Memcpy", "Memset"))]
            profiles[n] = {"ttft_ms_profiled": round(wall, 1),
                           "gpu_kernel_ms": round(sum(r[2] for r in kernels), 2),
                           "kernel_launches": sum(r[1] for r in kernels),
                           "host_calls": counts, "host_self_ms": cpu_ms,
                           "top": [{"kernel": k, "calls": c, "ms": round(ms, 3)} for k, c, ms in gpu_rows[:12]]}
            print(f"start {start}: profile {n}:", json.dumps(profiles[n])[:1500], flush=True)
        record("prefillprobe", **{f"start{start}": {"ttft_ms": ttft, "profiles": profiles}})
        engine.shutdown()
        del engine
        free_memory()


def section_graphprofile(args, device) -> None:
    from torch.profiler import ProfilerActivity, profile

    engine = _served_engine(args, device)
    engine.warmup = False  # only the decode graphs matter here
    engine.start()
    V = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(5)
    steps = 64
    decode = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    try:
        for batch in (1, args.concurrency):
            prompts = [torch.randint(300, V, (64,), generator=gen).tolist() for _ in range(batch)]
            _timed_request(engine, prompts[0], decode)  # the graphs' first replays
            cuda = device.type == "cuda"
            with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
                stamps = _concurrent_requests(engine, prompts, decode)
            # the decode span of the first request: from its first token to its last
            wall_ms = (stamps[0][-1] - stamps[0][0]) / steps * 1e3
            rows = _kernel_rows(prof, cuda)  # on CPU: the ops' own time (the script's own check)
            # everything the requests ran, prefills included (64-token prompts: small beside 64 steps)
            per_step = sum(r[2] for r in rows) / (steps + 1)
            kernels = sum(r[1] for r in rows) / (steps + 1)
            print(f"batch {batch}: {wall_ms:.3f} ms per step, kernels {per_step:.3f} ms, {kernels:.0f} per step",
                  flush=True)
            for k, c, ms in rows[:18]:
                print(f"  {ms / (steps + 1) * 1e3:8.1f} us/step {c / (steps + 1):6.1f}x  {k}", flush=True)
            record("graphprofile", **{f"batch{batch}": {
                "wall_ms_per_step": round(wall_ms, 3), "kernel_ms_per_step": round(per_step, 3),
                "kernels_per_step": round(kernels, 1),
                "kernels": [{"kernel": k, "calls_per_step": round(c / (steps + 1), 2),
                             "us_per_step": round(ms / (steps + 1) * 1e3, 1)} for k, c, ms in rows[:18]]}})
    finally:
        engine.shutdown()


def section_overlap(args, device) -> None:
    engine = _served_engine(args, device)
    engine.warmup = False
    engine.start()
    V = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(11)
    steps = args.decode_tokens
    decode = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)

    try:
        results = {}
        for batch, prompt_len in ((1, 128), (8, 128), (args.concurrency, 128)):
            prompts = [torch.randint(300, V, (prompt_len,), generator=gen).tolist() for _ in range(batch)]
            row = {}
            for overlap in (False, True, False, True):  # twice each: the first pair warms the graphs
                engine.overlap = overlap
                tokens = [[] for _ in prompts]
                stamps = _concurrent_requests(engine, prompts, decode, tokens)[0]
                # steady decode: the middle half of the first request's tokens
                a, b = len(stamps) // 4, 3 * len(stamps) // 4
                row[f"overlap={overlap}"] = {"ms_per_step": round((stamps[b] - stamps[a]) / (b - a) * 1e3, 3),
                                             "tokens": tokens}
            same = row["overlap=False"]["tokens"] == row["overlap=True"]["tokens"]
            results[f"batch{batch}"] = {"same_tokens": same, **{k: v["ms_per_step"] for k, v in row.items()}}
            print(f"batch {batch}: same tokens {same}; ms/step without {row['overlap=False']['ms_per_step']}"
                  f" with {row['overlap=True']['ms_per_step']}", flush=True)
        record("overlap", **results)
    finally:
        engine.overlap = True
        engine.shutdown()


SECTIONS = {"overlap": section_overlap, "graphprofile": section_graphprofile,
            "attention": section_attention, "transformers": section_transformers, "engine": section_engine,
            "profile": section_profile, "firstcall": section_firstcall, "prefillprobe": section_prefillprobe,
            "hostturn": section_hostturn, "gputurn": section_gputurn, "afterfresh": section_afterfresh}


def write(out: Path, stem: str, meta: dict) -> None:
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "results": RESULTS}, indent=1, default=str))
    lines = [f"# Engine on {meta['gpu']} ({meta['date']})", "", f"`{meta['command']}`", "",
             f"torch {meta['torch']}, triton {meta['triton']}, preset {meta['preset']}", ""]
    for name, values in RESULTS.items():
        lines += [f"## {name}", "", "```", json.dumps(values, indent=1, default=str), "```", ""]
    (out / f"{stem}.md").write_text("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--preset", default="llama-3.1-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--sections", default="attention,transformers,engine,profile")
    parser.add_argument("--sizes", default=",".join(map(str, SEED_SIZES)))
    parser.add_argument("--hf-prompt", type=int, default=512)
    parser.add_argument("--hf-decode", type=int, default=64)
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--concurrency-prompt", type=int, default=2000)
    parser.add_argument("--kv-cache-gib", type=float, default=40.0)
    parser.add_argument("--layers", type=int, default=0, help="transformers check: first N layers only")
    parser.add_argument("--profile-loop", action="store_true",
                        help="run each engine's loop thread under cProfile; its stats go to OUT/loop-*.txt")
    parser.add_argument("--turns", type=int, default=3, help="hostturn: turns over the history")
    parser.add_argument("--gputurn-sizes", default="219,150",
                        help="gputurn: new tokens of the timed and profiled turns (empty: the probes alone)")
    parser.add_argument("--probes", default="launch",
                        help="gputurn: probes after the turns, comma-separated: clock (the profiled turn after idle "
                             "and after GEMMs), launch (host stamps and graph events of unprofiled turns)")
    parser.add_argument("--timeline", action="store_true",
                        help="hostturn: the device's timeline from the burst's last prompt through the first turn; "
                             "gputurn: through the profiled turns (OUT/*-timeline.txt, *-trace.json)")
    parser.add_argument("--call-timers", action="store_true",
                        help="hostturn, afterfresh: the engine thread's ms in the tiers' and loop's methods per turn")
    parser.add_argument("--sample-stacks", action="store_true",
                        help="hostturn: the engine thread's stack sampled every ms through the first turn, and the GC's "
                             "collections (OUT/hostturn-turn1-stacks.txt)")
    parser.add_argument("--profile-turn", action="store_true",
                        help="hostturn, gputurn: cProfile of one turn's loop iterations (OUT/*-cprofile*.txt); hostturn: and a torch profile of the third")
    parser.add_argument("--kv-disk-gib", type=float, default=0,
                        help="hostturn: a disk tier of this size in a temporary directory, as the server's")
    args = parser.parse_args()
    args.sizes = [int(s) for s in args.sizes.split(",")]
    device = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    import triton

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    meta = {"gpu": gpu, "date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "triton": triton.__version__, "preset": args.preset, "command": "python " + " ".join(sys.argv)}
    stem = "engine-h200" if "H200" in gpu else f"engine-{device.type}"
    if args.profile_loop:
        from loop_profile import profile_engine_loops  # beside this script

        profile_engine_loops(args.out)
    failed = []
    for name in args.sections.split(","):
        t0 = time.perf_counter()
        try:
            SECTIONS[name](args, device)
        except Exception as exc:
            traceback.print_exc()
            failed.append(name)
            record(name, error=f"{type(exc).__name__}: {exc}")
        record(name, seconds=round(time.perf_counter() - t0, 1))
        write(args.out, stem, meta)
        free_memory()
    print("failed sections:", failed or "none", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
