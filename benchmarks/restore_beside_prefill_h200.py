"""A host-RAM restore beside a prefill on the H200: what each costs the other, by how the copy is made.

    python benchmarks/restore_beside_prefill_h200.py --out DIR [--tokens 2304] [--pages 1550]

Question: a turn whose history is in host RAM could recompute the head of the history while the tail
streams in (the copy ~70 ms for 27k tokens of Llama-3.1-8B, a 2k-token prefill ~50 ms). That pays only if
the two run at once at nearly their own speeds. ``page_copy`` (the runtime's restore) is a kernel: its
persistent programs sit on SMs for the whole copy, where a GEMM's block may not fit beside them. The copy
engines take no SM, but cannot scatter 32 KiB runs fast (``kv-upload-dma``); they can copy each layer's
rows into a staging buffer (one 2D copy per run of consecutive host slots: rows of 64 KiB, K and V of the
layer), which a small kernel then scatters into the pool's pages.

Variants, each with a prefill proxy (``--tokens`` tokens of Llama-3.1-8B's layers: cuBLAS GEMMs, SDPA
causal, SiLU; random weights; in a CUDA graph) on the compute stream and the copy of ``--pages`` pages
(scattered pool pages, consecutive host slots) on a high-priority stream, started together after a spin:
- the prefill alone; each copy alone;
- ``page_copy`` with 64 / 32 / 16 programs, one launch a layer, beside the prefill;
- ``ce``: per layer a ``cudaMemcpy2DAsync`` into staging on one stream, the scatter (``index_copy_``) on
  another after it, beside the prefill.
Ends are CUDA events from the common start. Pages are read back against their host rows.

Written 2026-12-04 for the host-RAM split (``QML_HOST_SPLIT``), with no GPU lent that session: not yet run.

``--gemm``: also the per-layer GEMM time of a turn-sized chunk (T = 128..256) by cuBLAS as torch calls it,
with cuBLASLt preferred, and as the swapped product ``W @ x^T`` (graph of 32 layers over 8 weight sets).
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from gemv_h200 import graph_us
from kv_upload_dma_h200 import _cudart

from qml_kernels.page_copy import PageCopyConfig, page_copy

L, HKV, DH, S = 32, 8, 128, 16
W = S * HKV * DH  # elements of one page's K (or V) of one layer
HID, FF, HEADS = 4096, 14336, 32
SHAPES = {"qkv": (6144, HID), "o": (HID, HID), "gate_up": (2 * FF, HID), "down": (HID, FF)}


def weights(dev, sets: int) -> list[dict]:
    return [{k: torch.randn(n, kk, device=dev, dtype=torch.bfloat16) * 0.02 for k, (n, kk) in SHAPES.items()}
            for _ in range(sets)]


def prefill_proxy(x: torch.Tensor, ws: list[dict]) -> torch.Tensor:
    T = x.shape[0]
    for layer in range(L):
        w = ws[layer % len(ws)]
        qkv = F.linear(x, w["qkv"])
        q = qkv[:, :HID].view(T, HEADS, DH).transpose(0, 1)
        k = qkv[:, HID:HID + HKV * DH].view(T, HKV, DH).transpose(0, 1).repeat_interleave(HEADS // HKV, 0)
        v = qkv[:, HID + HKV * DH:].view(T, HKV, DH).transpose(0, 1).repeat_interleave(HEADS // HKV, 0)
        a = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
        h = F.linear(a.transpose(0, 1).reshape(T, HID), w["o"])
        gu = F.linear(h, w["gate_up"])
        x = F.linear(F.silu(gu[:, :FF]) * gu[:, FF:], w["down"])
        x = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)  # keep values finite
    return x


def graph_of(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=2304)
    parser.add_argument("--pages", type=int, default=1550)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gemm", action="store_true")
    args = parser.parse_args()
    dev = torch.device("cuda")
    rt, rt_path = _cudart()
    rt.cudaMemcpy2DAsync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                                     ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "cudart": rt_path, "command": " ".join(sys.argv), "tokens": args.tokens, "pages": args.pages,
              "runs": {}}
    n = args.pages
    P = max(2048, n + 16)
    pool = torch.zeros(L * 2, P, W, device=dev, dtype=torch.bfloat16)  # [C, P, W]
    host = torch.empty(n, L * 2, W, dtype=torch.bfloat16, pin_memory=True)  # [N, C, W] rows
    for i in range(0, n, 128):  # random rows, made on the device (the CPU would take minutes)
        rows = torch.randint(-2**15, 2**15 - 1, (min(128, n - i), L * 2, W), dtype=torch.int16, device=dev)
        host[i:i + rows.shape[0]].view(torch.int16).copy_(rows)
    pages = torch.randperm(P - 1, device=dev)[:n] + 1
    slots = torch.arange(n, device=dev)
    staging = torch.empty(L, n, 2 * W, device=dev, dtype=torch.bfloat16)
    ws = weights(dev, 2)
    x0 = torch.randn(args.tokens, HID, device=dev, dtype=torch.bfloat16)
    prefill = graph_of(lambda: prefill_proxy(x0, ws))
    restore = torch.cuda.Stream(priority=-1)
    scatter = torch.cuda.Stream(priority=-1)

    def copy_kernel(programs):
        def go():
            with torch.cuda.stream(restore):
                cfg = PageCopyConfig(num_programs=programs)
                for layer in range(L):
                    page_copy(pool, pages, host, slots, 2 * layer, 2 * layer + 2, config=cfg)
            end = torch.cuda.Event(enable_timing=True)
            end.record(restore)
            return end
        return go

    def copy_ce():
        events = []
        for layer in range(L):
            err = rt.cudaMemcpy2DAsync(staging[layer].data_ptr(), 2 * W * 2, host[0, 2 * layer].data_ptr(),
                                       L * 2 * W * 2, 2 * W * 2, n, 1, ctypes.c_void_p(restore.cuda_stream))
            assert err == 0, f"cudaMemcpy2DAsync: error {err}"
            e = torch.cuda.Event()
            e.record(restore)
            events.append(e)
        for layer in range(L):
            scatter.wait_event(events[layer])
            with torch.cuda.stream(scatter):
                pool[2 * layer:2 * layer + 2].index_copy_(1, pages, staging[layer].view(n, 2, W).transpose(0, 1))
        end = torch.cuda.Event(enable_timing=True)
        end.record(scatter)
        return end

    def run(copy, with_prefill: bool) -> dict:
        pool.zero_()
        torch.cuda.synchronize()
        compute = torch.cuda.current_stream()
        torch.cuda._sleep(60_000_000)  # ~30 ms: everything below is queued before the GPU gets to it
        start = torch.cuda.Event(enable_timing=True)
        start.record(compute)
        restore.wait_event(start)
        scatter.wait_event(start)
        copy_end = copy() if copy is not None else None
        pre_end = None
        if with_prefill:
            prefill.replay()
            pre_end = torch.cuda.Event(enable_timing=True)
            pre_end.record(compute)
        torch.cuda.synchronize()
        out = {}
        if copy_end is not None:
            out["copy_ms"] = round(start.elapsed_time(copy_end), 3)
            for i in (0, n // 2, n - 1):  # pages against their host rows
                assert torch.equal(pool[:, pages[i]].cpu(), host[i]), f"page {i} differs"
        if pre_end is not None:
            out["prefill_ms"] = round(start.elapsed_time(pre_end), 3)
        return out

    variants = {"prefill alone": (None, True)}
    for programs in (64, 32, 16):
        variants[f"page_copy {programs} alone"] = (copy_kernel(programs), False)
        variants[f"page_copy {programs} beside"] = (copy_kernel(programs), True)
    variants["ce alone"] = (copy_ce, False)
    variants["ce beside"] = (copy_ce, True)
    for name, (copy, with_prefill) in variants.items():
        runs = [run(copy, with_prefill) for _ in range(args.repeats)]
        result["runs"][name] = runs
        print(f"{name:24s} " + "  ".join(json.dumps(r) for r in runs), flush=True)

    if args.gemm:
        sets = weights(dev, 8)
        result["gemm_us_per_layer"] = {}
        for T in (128, 144, 150, 160, 176, 192, 224, 256):
            x = torch.randn(T, HID, device=dev, dtype=torch.bfloat16)
            xf = torch.randn(T, FF, device=dev, dtype=torch.bfloat16)
            forms = {
                "cublas": lambda w, x=x, xf=xf: (F.linear(x, w["qkv"]), F.linear(x, w["o"]),
                                                 F.linear(x, w["gate_up"]), F.linear(xf, w["down"])),
                "swapped": lambda w, x=x, xf=xf: (torch.mm(w["qkv"], x.T), torch.mm(w["o"], x.T),
                                                  torch.mm(w["gate_up"], x.T), torch.mm(w["down"], xf.T)),
            }
            row = {}
            for lib in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(lib)
                for form, fn in forms.items():  # a layer's four GEMMs a call, 32 calls over the 8 weight sets
                    row[f"{form}/{lib}"] = round(graph_us(lambda i, fn=fn: fn(sets[i]), len(sets)), 2)
            torch.backends.cuda.preferred_blas_library("cublas")
            result["gemm_us_per_layer"][T] = row
            print(f"gemm T={T}: {row}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"restore-beside-prefill-h200-{datetime.date.today()}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
