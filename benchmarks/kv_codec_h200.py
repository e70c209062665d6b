"""The KV codec on the H200: a 27k-token history restored from encoded host rows against raw ones.

    python benchmarks/kv_codec_h200.py --out DIR [--pages 1708] [--programs 32,64,128]

1,708 Llama-3.1-8B pages (bf16, 32 layers x K/V chunks of 16,384 values) in pinned host rows, restored into
scattered pool pages one layer per launch, as ``KVTiers._upload_layers`` does:
- raw: ``page_copy`` from raw rows (the runtime today: ~71 ms, 50.5 GB/s);
- encoded: ``kv_load`` from rows encoded by ``kv_codec`` (expected ~77% of the bytes over the link: ~55 ms
  if the link, not the decode, sets the pace);
and the other way, pool pages into host rows: ``page_save`` against ``kv_save``.
The values: normal bf16 (one scale), as the benchmarks' random-weight KV; a real model's KV compressed
alike on CPU (SmolLM2: 99.8% of groups of 32 within 15 exponents). Each variant three times between CUDA
events; the pages read back and compared bit for bit with what was saved. Writes ``kv-codec-h200-<date>.json``.

Written 2026-12-04 (session 22) with no GPU lent: not yet run.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import triton

from qml_kernels.kv_codec import SEGMENT, KVCodecConfig, encode_chunks_ref, encoded_chunk_bytes, kv_load, kv_save
from qml_kernels.page_copy import PageCopyConfig, page_copy, page_save

L, W = 32, 16 * 8 * 128  # Llama-3.1-8B: layers; values of a page's K (or V) of one layer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--pages", type=int, default=1708)
    parser.add_argument("--programs", default="32,64,128")
    parser.add_argument("--segments", default="1,4,8", help="kv_load: segments decoded a step")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    dev = torch.device("cuda")
    n, C = args.pages, 2 * L
    P = 2 * n + 64  # the saved pages and the restored ones apart: a restore must not overwrite its own source
    E = encoded_chunk_bytes(W)
    gen = torch.Generator(device=dev).manual_seed(0)
    pool = torch.randn(C, P, W, device=dev, generator=gen).to(torch.bfloat16)
    raw_rows = torch.empty(n, C, W, dtype=torch.bfloat16, pin_memory=True)
    enc_rows = torch.empty(n, C, E, dtype=torch.uint8, pin_memory=True)
    order = torch.randperm(P, device=dev, generator=gen)
    source, pages = order[:n], order[n:2 * n]  # the history's pages as saved; where they are restored
    for i in range(0, n, 64):  # rows made on the device, encoded by the reference (the format's definition)
        part = pool[:, source[i:i + 64]].transpose(0, 1).contiguous()  # [k, C, W]
        raw_rows[i:i + part.shape[0]].copy_(part.cpu())
        enc_rows[i:i + part.shape[0]].copy_(encode_chunks_ref(part).cpu())
    flags = enc_rows[:, :, :W // SEGMENT].to(torch.float32).mean().item()
    link = (E - 2 * W + (W // SEGMENT) * (flags * 1024 + (1 - flags) * 784)) / (2 * W)
    print(f"{n} pages, {n * C * W * 2 / 1e9:.2f} GB raw; raw segments {flags:.4f}; "
          f"the load reads {link:.4f} of the raw bytes", flush=True)
    slots = torch.arange(n, device=dev)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "command": " ".join(sys.argv), "pages": n, "raw_segments": flags, "link_fraction": link, "runs": {}}
    stream = torch.cuda.Stream(priority=-1)

    def timed(fn) -> float:
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for layer in range(L):
                fn(2 * layer, 2 * layer + 2)
            b.record()
        b.synchronize()
        return a.elapsed_time(b)

    def check_restored() -> bool:
        return all(torch.equal(pool[:, pages[i]].view(torch.int16), pool[:, source[i]].view(torch.int16))
                   for i in (0, n // 2, n - 1))

    for programs in (int(p) for p in args.programs.split(",")):
        variants = {
            f"page_copy raw {programs}": lambda lo, hi, p=programs: page_copy(
                pool, pages, raw_rows, slots, lo, hi, config=PageCopyConfig(num_programs=p)),
        }
        for segs in (int(x) for x in args.segments.split(",")):
            variants[f"kv_load encoded {programs} x{segs}"] = lambda lo, hi, p=programs, k=segs: kv_load(
                pool, pages, enc_rows, slots, lo, hi, config=KVCodecConfig(num_programs=p, segments=k))
        for name, fn in variants.items():
            times = []
            for _ in range(args.repeats):
                pool[:, pages] = 0
                times.append(round(timed(fn), 3))
                assert check_restored(), f"{name}: restored pages differ from the saved ones"
            best = min(times)
            result["runs"][name] = {"ms": times, "kv_gb_per_s": round(n * C * W * 2 / best / 1e6, 1)}
            print(f"{name:26s} {times} ms; {n * C * W * 2 / best / 1e6:.1f} GB/s of KV", flush=True)
    # the other way: pages into host rows (the pump), then back into other pages to check
    for programs in (16, 32, 64):
        for name, fn in {
            f"page_save raw {programs}": lambda lo, hi, p=programs: page_save(
                raw_rows, slots, pool, source, lo, hi, config=PageCopyConfig(num_programs=p)),
            f"kv_save encoded {programs}": lambda lo, hi, p=programs: kv_save(
                enc_rows, slots, pool, source, lo, hi, config=KVCodecConfig(num_programs=p)),
        }.items():
            times = [round(timed(fn), 3) for _ in range(args.repeats)]
            result["runs"][name] = {"ms": times, "kv_gb_per_s": round(n * C * W * 2 / min(times) / 1e6, 1)}
            print(f"{name:26s} {times} ms; {n * C * W * 2 / min(times) / 1e6:.1f} GB/s of KV", flush=True)
    pool[:, pages] = 0
    timed(lambda lo, hi: kv_load(pool, pages, enc_rows, slots, lo, hi))
    assert check_restored(), "pages saved by kv_save and loaded by kv_load differ"
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"kv-codec-h200-{datetime.date.today()}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
