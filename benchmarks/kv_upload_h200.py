"""Restoring a history from host RAM on the H200: the staging path against the zero-copy page copy.

    python benchmarks/kv_upload_h200.py --out DIR

Llama-3.1-8B pages (2 MiB: 32 layers x K/V x 16 slots x 8 heads x 128 dims, bf16); a 27k-token
history is 1,708 pages. Measures, with the bytes checked after each variant:
- ``staging``: the runtime's earlier path (``KVTiers._upload``: host runs -> GPU staging -> scatter);
- ``zero-copy``: ``qml_kernels.page_copy`` reading the pinned rows in place, by program count;
- per layer: 32 launches of one layer each (what a restore overlapped with the prefill issues);
- overlap: the per-layer copies on a side stream beside a stream of GEMMs standing in for the prefill.
``--sections save``: the other way, kept pages into pinned host rows (``qml_kernels.page_save``
against a device gather and one D2H copy), alone and beside GEMMs. ``--sections duplex``: a restore
beside kept pages going down, both directions of the link at once.
Also times the turn's attention (219 queries over 27k cached keys) by prefill-attention config.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from qml_kernels.attention import AttentionMetadata
from qml_kernels.attention_prefill import PagedPrefillAttentionConfig, paged_prefill_attention_triton
from qml_kernels.page_copy import PageCopyConfig, page_copy_triton
from qml_runtime.kv.cache import KVCache
from qml_runtime.kv.host_tier import HostTier, slot_runs
from qml_runtime.kv.tiers import KVTiers
from qml_runtime.presets import PRESETS


def timed(fn, reps: int = 3) -> float:
    """Median seconds of ``fn`` over ``reps`` runs, synchronised around each."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def upload_section(results: dict) -> None:
    dev = torch.device("cuda")
    cfg = PRESETS["llama-3.1-8b"].config
    P, N, n = 2048, 1800, 1708
    kv = KVCache(cfg, P, 16, dev, torch.bfloat16)
    host = HostTier(kv.block_bytes, N * kv.block_bytes, pin=True)
    assert host.slots.is_pinned()
    for i in range(0, N, 256):  # random bytes, made on the GPU
        rows = min(256, N - i)
        host.slots[i:i + rows].copy_(torch.randint(0, 256, (rows, kv.block_bytes), dtype=torch.uint8, device=dev))
    tiers = KVTiers(kv, host, None)
    C, W = 2 * cfg.num_layers, kv.data[0, 0, 0].numel()
    pool = kv.data.view(C, P, W)
    table = host.slots.view(torch.bfloat16).view(N, C, W)
    gen = torch.Generator().manual_seed(0)
    pages = torch.randperm(P, generator=gen)[:n]
    nbytes = n * kv.block_bytes
    rows = []

    def verify(slots: torch.Tensor, name: str) -> None:
        got = kv.gather_pages(pages.to(dev)).cpu()
        ok = torch.equal(got, host.slots[slots])
        rows.append({"variant": name, "bytes_ok": ok})
        assert ok, f"{name}: pages differ from their host rows"

    for layout, slots in (("consecutive", torch.arange(n)), ("scattered", torch.randperm(N, generator=gen)[:n])):
        runs = [(host.slots, i, s, k) for i, s, k in slot_runs(slots.tolist())]
        for layered in (False, True):  # KVTiers._upload as the runtime calls it: staging, or by layer
            tiers.layered = layered
            name = f"{'layered' if layered else 'staging'}/{layout}"
            kv.data.zero_()
            s = timed(lambda: (tiers._upload(pages.tolist(), runs), kv.settle()))
            verify(slots, name)
            rows.append({"variant": name, "ms": round(s * 1e3, 2), "GB/s": round(nbytes / s / 1e9, 1),
                         "runs": len(runs)})
            print(rows[-1], flush=True)
        pages_d, slots_d = pages.to(dev), slots.to(dev)
        for programs in (16, 32, 64):
            for block, warps in ((2048, 4), (4096, 8)):
                config = PageCopyConfig(num_programs=programs, max_block=block, num_warps=warps)
                kv.data.zero_()
                try:
                    s = timed(lambda: page_copy_triton(pool, pages_d, table, slots_d, config=config))
                except Exception as exc:  # the launcher may refuse a host pointer
                    rows.append({"variant": "zero-copy", "error": repr(exc)[:300]})
                    print(rows[-1], flush=True)
                    results["upload"] = rows
                    return
                name = f"zero-copy/{layout}/p{programs}/b{block}/w{warps}"
                verify(slots, name)
                rows.append({"variant": name, "ms": round(s * 1e3, 2), "GB/s": round(nbytes / s / 1e9, 1)})
                print(rows[-1], flush=True)
    # the layered restore beside device-to-host copies of as many bytes on another stream (what spills
    # and the disk writer's copies do while a restore runs)
    down = torch.empty(n, kv.block_bytes, dtype=torch.uint8, pin_memory=True)
    staged = torch.empty(n, kv.block_bytes, dtype=torch.uint8, device=dev)
    other = torch.cuda.Stream()
    runs = [(host.slots, i, s, k) for i, s, k in slot_runs(torch.arange(n).tolist())]
    tiers.layered = True

    def d2h():
        with torch.cuda.stream(other):
            down.copy_(staged, non_blocking=True)

    def restore_beside_d2h():
        other.wait_stream(torch.cuda.current_stream())
        d2h()
        tiers._upload(pages.tolist(), runs)
        kv.settle()
        torch.cuda.current_stream().wait_stream(other)

    s_d2h, s_both = timed(d2h), timed(restore_beside_d2h)
    rows.append({"variant": "layered beside D2H", "d2h_ms": round(s_d2h * 1e3, 2), "both_ms": round(s_both * 1e3, 2),
                 "d2h_GB/s": round(nbytes / s_d2h / 1e9, 1)})
    print(rows[-1], flush=True)
    # per layer: 32 launches, and beside GEMMs on another stream
    slots_d = torch.randperm(N, generator=gen)[:n].to(dev)
    pages_d = pages.to(dev)
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)

    def gemms():
        for _ in range(60):
            a @ b

    side = torch.cuda.Stream()
    for programs in (16, 32, 64):
        config = PageCopyConfig(num_programs=programs)

        def per_layer():
            for layer in range(cfg.num_layers):
                page_copy_triton(pool, pages_d, table, slots_d, 2 * layer, 2 * layer + 2, config=config)

        def both():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                per_layer()
            gemms()
            torch.cuda.current_stream().wait_stream(side)

        s_copy, s_gemm, s_both = timed(per_layer), timed(gemms), timed(both)
        rows.append({"variant": f"per-layer/p{programs}", "copy_ms": round(s_copy * 1e3, 2),
                     "copy_GB/s": round(nbytes / s_copy / 1e9, 1), "gemms_ms": round(s_gemm * 1e3, 2),
                     "both_ms": round(s_both * 1e3, 2)})
        print(rows[-1], flush=True)
    results["upload"] = rows


def save_section(results: dict) -> None:
    """The other way: 1,708 kept pages from the pool into pinned host rows. ``page_save`` writes the
    rows in place by program count, against the gathered path (device staging, then one D2H copy),
    alone and beside a stream of GEMMs standing in for a long prefill (how much each slows it)."""
    from qml_kernels.page_copy import page_save_triton

    dev = torch.device("cuda")
    cfg = PRESETS["llama-3.1-8b"].config
    P, N, n = 2048, 1800, 1708
    kv = KVCache(cfg, P, 16, dev, torch.bfloat16)
    kv.data.normal_()
    host = HostTier(kv.block_bytes, N * kv.block_bytes, pin=True)
    pool, table = kv.chunk_views(host.slots)
    gen = torch.Generator().manual_seed(1)
    pages, slots = torch.randperm(P, generator=gen)[:n], torch.randperm(N, generator=gen)[:n]
    pages_d, slots_d = pages.to(dev), slots.to(dev)
    nbytes = n * kv.block_bytes
    want = kv.gather_pages(pages_d).cpu()
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    side = torch.cuda.Stream()

    def gemms():
        for _ in range(120):
            a @ b

    def staged_copy():  # what flush_spills does: gather on the device, one D2H copy per run
        staging = kv.gather_pages(pages_d, settle=False)
        down = host.slots[:n]
        down.copy_(staging, non_blocking=True)

    variants = {"gathered+D2H": staged_copy}
    for programs in (8, 16, 32):
        config = PageCopyConfig(num_programs=programs)
        variants[f"page_save/p{programs}"] = (
            lambda config=config: page_save_triton(table, slots_d, pool, pages_d, config=config))
    rows = []
    s_gemm = timed(gemms)
    for name, fn in variants.items():
        host.slots.zero_()
        s_copy = timed(fn)
        ok = None
        if name.startswith("page_save"):
            ok = torch.equal(host.slots[slots], want)
            assert ok, f"{name}: rows differ from their pages"

        def both(fn=fn):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            gemms()
            torch.cuda.current_stream().wait_stream(side)

        s_both = timed(both)
        rows.append({"variant": name, "ms": round(s_copy * 1e3, 2), "GB/s": round(nbytes / s_copy / 1e9, 1),
                     "bytes_ok": ok, "gemms_ms": round(s_gemm * 1e3, 2), "both_ms": round(s_both * 1e3, 2)})
        print(rows[-1], flush=True)
    results["save"] = rows


def duplex_section(results: dict) -> None:
    """A restore (host rows -> 1,708 pages, ``page_copy``, as one launch and as 32 per-layer launches on
    a high-priority stream) beside kept pages going down (1,708 other pages -> other rows: ``page_save``
    or a gather + D2H copy) on a second stream: do the two directions of the link overlap? If they do,
    the pump need not stop for a restore, nor keep to one chunk at a time while idle."""
    from qml_kernels.page_copy import page_save_triton

    dev = torch.device("cuda")
    cfg = PRESETS["llama-3.1-8b"].config
    n = 1708
    P, N = 2 * n + 64, 2 * n + 64
    kv = KVCache(cfg, P, 16, dev, torch.bfloat16)
    kv.data.normal_()
    host = HostTier(kv.block_bytes, N * kv.block_bytes, pin=True)
    host.slots.copy_(torch.randint(0, 256, host.slots.shape, dtype=torch.uint8, device=dev))
    down_buf = torch.empty((n, kv.block_bytes), dtype=torch.uint8, pin_memory=True)
    pool, table = kv.chunk_views(host.slots)
    gen = torch.Generator().manual_seed(3)
    pages, slots = torch.randperm(P, generator=gen), torch.randperm(N, generator=gen)
    up_pages, up_slots = pages[:n].to(dev), slots[:n].to(dev)
    down_pages, down_slots = pages[n:2 * n].to(dev), slots[n:2 * n].to(dev)
    nbytes = n * kv.block_bytes
    up_stream = torch.cuda.Stream(priority=-1)
    down_stream = torch.cuda.Stream()
    chunks = pool.shape[0]
    restore_cfg, save_cfg = PageCopyConfig(num_programs=32), PageCopyConfig(num_programs=16)

    def restore():
        page_copy_triton(pool, up_pages, table, up_slots, config=restore_cfg)

    def restore_layers():
        for c in range(0, chunks, 2):
            page_copy_triton(pool, up_pages, table, up_slots, c, c + 2, config=restore_cfg)

    def save():
        page_save_triton(table, down_slots, pool, down_pages, config=save_cfg)

    def gathered():
        staging = kv.gather_pages(down_pages, settle=False)
        down_buf.copy_(staging, non_blocking=True)

    marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]  # start, restore's end, save's end
    ends: dict[str, list] = {}

    def together(up, down, name):
        def run():
            marks[0].record()
            up_stream.wait_stream(torch.cuda.current_stream())
            down_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(down_stream):
                down()
                marks[2].record()
            with torch.cuda.stream(up_stream):
                up()
                marks[1].record()
            torch.cuda.current_stream().wait_stream(up_stream)
            torch.cuda.current_stream().wait_stream(down_stream)
            torch.cuda.synchronize()
            ends.setdefault(name, []).append((marks[0].elapsed_time(marks[1]), marks[0].elapsed_time(marks[2])))
        return run

    rows = []
    for name, fn in (("restore", restore), ("restore/layers", restore_layers), ("save", save),
                     ("gathered", gathered), ("restore+save", together(restore, save, "restore+save")),
                     ("restore/layers+save", together(restore_layers, save, "restore/layers+save")),
                     ("restore+gathered", together(restore, gathered, "restore+gathered")),
                     ("restore/layers+gathered", together(restore_layers, gathered, "restore/layers+gathered"))):
        s = timed(fn)
        rows.append({"variant": name, "ms": round(s * 1e3, 2), "GB/s per direction": round(nbytes / s / 1e9, 1)})
        if name in ends:  # each stream's own end, from the start (median over the runs)
            up_ms, down_ms = (sorted(col)[len(col) // 2] for col in zip(*ends[name]))
            rows[-1].update(restore_end_ms=round(up_ms, 2), down_end_ms=round(down_ms, 2))
        print(rows[-1], flush=True)
    want = host.slots[slots[:n]].to(dev)
    assert torch.equal(kv.gather_pages(up_pages).view(torch.uint8), want.view(torch.uint8).view(n, -1)), \
        "restored pages differ from their rows"
    results["duplex"] = rows


def turn_attention_section(results: dict, n_q: int = 219) -> None:
    """``n_q`` new queries (219; 150 with kept replies) over a 27,339-token context, Llama-3.1-8B heads,
    one layer."""
    from triton.testing import do_bench

    dev = torch.device("cuda")
    H, Hkv, Dh, S = 32, 8, 128, 16
    L = 27339
    pages = -(-L // S)
    g = torch.Generator(device=dev).manual_seed(2)
    kc = torch.randn(pages + 8, S, Hkv, Dh, device=dev, dtype=torch.bfloat16, generator=g)
    vc = torch.randn(pages + 8, S, Hkv, Dh, device=dev, dtype=torch.bfloat16, generator=g)
    q = torch.randn(n_q, H, Dh, device=dev, dtype=torch.bfloat16, generator=g)
    table = torch.randperm(pages + 8, device=dev, generator=g)[:pages].tolist()
    meta = AttentionMetadata.build([0] * n_q, [table], [0, n_q], [L], dev)
    scale = Dh**-0.5
    flops = 4 * n_q * L * H * Dh
    base = paged_prefill_attention_triton(q, kc, vc, meta, scale).float()
    rows = []
    for block_m in (64, 128, 256):
        for block_n in (32, 64, 128):
            for warps in (4, 8, 16):
                for stages in (2, 3):
                    if block_m == 256 and warps == 4 or block_n == 32 and block_m != 64:
                        continue
                    config = PagedPrefillAttentionConfig(block_m=block_m, block_n=block_n, num_warps=warps,
                                                         num_stages=stages)
                    try:
                        out = paged_prefill_attention_triton(q, kc, vc, meta, scale, config=config).float()
                        err = ((out - base).abs().max() / base.abs().max()).item()
                        ms = do_bench(lambda: paged_prefill_attention_triton(q, kc, vc, meta, scale, config=config),
                                      warmup=5, rep=40)
                    except Exception as exc:
                        rows.append({"config": [block_m, block_n, warps, stages], "error": repr(exc)[:200]})
                        continue
                    rows.append({"config": [block_m, block_n, warps, stages], "us": round(ms * 1e3, 1),
                                 "TFLOP/s": round(flops / ms / 1e9, 1), "err_vs_default": f"{err:.1e}"})
                    print(rows[-1], flush=True)
    # cuDNN through torch SDPA at the same shape (no causal corner: the 219x219 triangle is ~1% of
    # the keys), with the history's keys cut into s runs folded into the batch (no LSE merge here)
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    k = kc[torch.tensor(table, device=dev)].reshape(-1, Hkv, Dh)[:L]
    for s in (1, 2, 4, 7, 8):
        Ls = L // s
        kk = k[:Ls * s].view(s, Ls, Hkv, Dh).transpose(1, 2)
        qq = q.transpose(0, 1).unsqueeze(0).expand(s, H, n_q, Dh).contiguous()
        try:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                ms = do_bench(lambda: F.scaled_dot_product_attention(qq, kk, kk, enable_gqa=True), warmup=5, rep=40)
            tflops = 4 * n_q * Ls * s * H * Dh / ms / 1e9
            rows.append({"cudnn_splits": s, "us": round(ms * 1e3, 1), "TFLOP/s": round(tflops, 1)})
        except Exception as exc:
            rows.append({"cudnn_splits": s, "error": repr(exc)[:200]})
        print(rows[-1], flush=True)
    results[f"turn_attention_{n_q}"] = rows


def turn_attention_rule_section(results: dict) -> None:
    """The split-KV launch's warps and key step across turn sizes (new queries over 27,339 keys,
    Llama-3.1-8B heads, one layer): the config's defaults (128 keys a step and 8 warps until c65adea,
    since then the 4-warp split launch) against 64 keys with 4 warps, whose programs are small
    enough for two per SM (so also with 264 programs at once)."""
    from triton.testing import do_bench

    dev = torch.device("cuda")
    H, Hkv, Dh, S, L = 32, 8, 128, 16, 27339
    pages = -(-L // S)
    g = torch.Generator(device=dev).manual_seed(3)
    kc = torch.randn(pages + 8, S, Hkv, Dh, device=dev, dtype=torch.bfloat16, generator=g)
    vc = torch.randn(pages + 8, S, Hkv, Dh, device=dev, dtype=torch.bfloat16, generator=g)
    table = torch.randperm(pages + 8, device=dev, generator=g)[:pages].tolist()
    configs = {"default": PagedPrefillAttentionConfig(),
               "n64_w4": PagedPrefillAttentionConfig(block_n=64, num_warps=4),
               "n64_w4_264": PagedPrefillAttentionConfig(block_n=64, num_warps=4, concurrent_programs=264)}
    rows = []
    for n_q in (64, 100, 133, 150, 180, 219, 256, 300, 400):
        q = torch.randn(n_q, H, Dh, device=dev, dtype=torch.bfloat16, generator=g)
        meta = AttentionMetadata.build([0] * n_q, [table], [0, n_q], [L], dev)
        row = {"queries": n_q}
        for name, config in configs.items():
            ms = do_bench(lambda: paged_prefill_attention_triton(q, kc, vc, meta, Dh**-0.5, config=config),
                          warmup=5, rep=40)
            row[name] = round(ms * 1e3, 1)
        rows.append(row)
        print(row, flush=True)
    results["turn_attention_rule"] = rows


def restore_section(results: dict, preset: str = "llama-3.1-8b", device: str = "cuda") -> None:
    """A conversation pushed off the GPU into host RAM and resumed, Llama-3.1-8B shapes (random
    weights): the pages restored layer by layer (zero copy, the prefill waiting per layer) must give
    the same tokens as the same restore through staging, and as the history computed again."""
    import logging

    from qml_runtime.kv.cache import KVCache as _KV
    from qml_runtime.loader import load_engine

    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("qml.kv.tiers").setLevel(logging.DEBUG)
    from qml_runtime.sampling_params import SamplingParams

    cfg = PRESETS[preset].config
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gib = 300 * _KV.bytes_per_block(cfg, 16, dtype) / 2**30  # 4,800 tokens of GPU pages
    engine = load_engine(f"preset:{preset}", random_weights=True, device=device, kv_cache_gib=gib,
                         kv_host_gib=8 if device == "cuda" else 0.5, progress=False, max_tokens_alone=8192)
    engine.start()
    gen = torch.Generator().manual_seed(4)
    V = cfg.vocab_size
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    history = torch.randint(300, V, (3000,), generator=gen).tolist()
    turn = history + torch.randint(300, V, (50,), generator=gen).tolist()
    rows = []
    try:
        for layered in (True, False, True):
            engine.tiers.layered = layered
            first = engine.generate_sync(history, greedy)
            for _ in range(3):  # new prompts push the history's pages down to host RAM
                p = torch.randint(300, V, (2400,), generator=gen).tolist()
                engine.generate_sync(p, greedy)
            before = engine.tiers.stats.restored_host
            t0 = time.perf_counter()
            resumed = engine.generate_sync(turn, greedy)
            ttft = time.perf_counter() - t0
            restored = engine.tiers.stats.restored_host - before
            engine.scheduler.prefix_caching = False
            try:
                fresh = engine.generate_sync(turn, greedy)
            finally:
                engine.scheduler.prefix_caching = True
            same = resumed.token_ids == fresh.token_ids
            rows.append({"layered": layered, "restored_pages": restored, "cached_tokens": resumed.cached_tokens,
                         "first_cached": first.cached_tokens, "rates": engine.tiers.planner.rates(),
                         "same_tokens_as_recomputed": same, "first_tokens": first.token_ids[:4],
                         "resumed": resumed.token_ids, "recomputed": fresh.token_ids,
                         "request_s": round(ttft, 3)})
            print({k: v for k, v in rows[-1].items() if k not in ("resumed", "recomputed")}, flush=True)
    finally:
        engine.shutdown()
    results["restore"] = rows
    assert all(r["restored_pages"] > 100 for r in rows), "the history did not come back from host RAM"
    # the first turn restores fewer blocks (the turn's own were not cached yet), so the same amount
    # restored is compared: staged (second) against layered (third), bit for bit the same pages
    staged, layered = rows[1], rows[2]
    assert staged["cached_tokens"] == layered["cached_tokens"]
    assert staged["resumed"] == layered["resumed"], "layered and staged restores gave different tokens"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sections", default="upload,restore,attention")
    parser.add_argument("--preset", default="llama-3.1-8b", help="restore section's model")
    parser.add_argument("--device", default="cuda", help="restore section's device (cpu: a dry run)")
    parser.add_argument("--queries", type=int, default=219, help="attention section's new queries")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import triton
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    results = {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__, "date": time.strftime("%Y-%m-%d")}
    for name in args.sections.split(","):
        try:
            if name == "restore":
                restore_section(results, args.preset, args.device)
            elif name == "attention-rule":
                turn_attention_rule_section(results)
            elif name == "attention":
                turn_attention_section(results, args.queries)
            elif name == "save":
                save_section(results)
            elif name == "duplex":
                duplex_section(results)
            else:
                upload_section(results)
        except Exception as exc:
            results[f"{name}_error"] = repr(exc)[:500]
            print(name, "failed:", repr(exc), flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the section's pool and host rows are gone with its frame
    (args.out / f"kv-upload-h200-{results['date']}.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
