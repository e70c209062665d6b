"""Restoring a 27k-token Llama-3.1-8B history from pinned host rows: the zero-copy page_copy kernel against the
copy engines, on the GPU.

The host-RAM turn of the sessions bench copies ~1,708 pages of 2 MiB (3.58 GB) up, layer by layer
(``KVTiers._upload_layers``: 32 page_copy launches reading the pinned rows in place, ~50 GB/s), against the
55 GB/s the device README gives for one large pinned copy. If the copy engines moved the same scattered
32 KiB runs faster, the turn would gain a few ms. Variants, each timed three times between CUDA events
(the first zero-copy run includes its compile), each checked on six pages against the host rows:

- page_copy per layer (32 launches) with 32, 64 and 128 programs (scattered destination pages);
- ``cudaMemcpy2DAsync`` per (layer, K/V) chunk: 64 copies of ``n`` rows of 32 KiB, which needs the
  destination pages to be consecutive (the pool would have to hand out a run of pages);
- ``cudaMemcpyBatchAsync`` per layer (3,416 copies of 32 KiB each, scattered pages), through ctypes (refused
  here: it was called on the legacy default stream, which the batch API does not take;
  ``kv_upload_ce_h200.py`` calls it on a side stream);
- one flat copy of the same bytes (the ceiling);
- page_copy over g layers a launch (g = 2 ... 32, and the graded ``halves``), as ``QML_RESTORE_GROUPS`` has it.

    python benchmarks/kv_upload_dma_h200.py     # writes $OUT/dma.json (or ./dma.json)
"""

from __future__ import annotations

import ctypes
import json
import os
import time

import numpy as np
import torch

from qml_kernels.page_copy import PageCopyConfig, page_copy
from qml_runtime.kv.dma import cudart

C, W, P, N, n = 64, 16384, 2048, 1800, 1708  # chunks (32 layers x K/V), elements a chunk, pool pages, rows, pages


class _Loc(ctypes.Structure):  # cudaMemLocation
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Attr(ctypes.Structure):  # cudaMemcpyAttributes
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _Loc), ("dstLocHint", _Loc), ("flags", ctypes.c_uint)]


def _host_rows_and_pool(dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """N random pinned host rows ``[N, C, W]`` and an empty pool ``[C, P, W]`` (bf16)."""
    host = torch.empty((N, C, W), dtype=torch.bfloat16, pin_memory=True)
    for i in range(0, N, 100):
        host[i:i + 100].copy_(torch.randn((min(100, N - i), C, W), device=dev, dtype=torch.bfloat16))
    return host, torch.zeros((C, P, W), dtype=torch.bfloat16, device=dev)


def _batch_addresses(pool: torch.Tensor, host: torch.Tensor, pages: torch.Tensor,
                     slots: torch.Tensor) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per layer, the destination and source addresses of its 2 x n runs (K, V of row ``slots[i]`` into page
    ``pages[i]``), for ``cudaMemcpyBatchAsync``."""
    pg, sl = pages.numpy().astype(np.uint64), slots.numpy().astype(np.uint64)
    per_layer = []
    for layer in range(C // 2):
        cs = np.array([2 * layer, 2 * layer + 1], dtype=np.uint64)
        dst = (pool.data_ptr() + (cs[:, None] * P + pg[None, :]) * (W * 2)).ravel()
        src = (host.data_ptr() + (sl[None, :] * C + cs[:, None]) * (W * 2)).ravel()
        per_layer.append((np.ascontiguousarray(dst), np.ascontiguousarray(src)))
    return per_layer


def timed(pool: torch.Tensor, fn, reps: int = 3, before=None) -> list[tuple[float, float]]:
    """(device ms, host ms) of ``fn`` ``reps`` times, between events on the current stream, the pool zeroed
    first; ``before`` (if given) runs after the zeroing, untimed (work queued to run beside ``fn``)."""
    out = []
    for _ in range(reps):
        pool.zero_()
        torch.cuda.synchronize()
        if before is not None:
            before()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        s.record()
        fn()
        e.record()
        host_ms = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        out.append((round(s.elapsed_time(e), 2), round(host_ms, 2)))
    return out


def main() -> None:
    dev = torch.device("cuda")
    host, pool = _host_rows_and_pool(dev)
    pages_scat = torch.randperm(P, generator=torch.Generator().manual_seed(0))[:n]
    slots_cons = torch.arange(n)
    nbytes = n * C * W * 2
    rt = cudart()  # the runtime torch mapped (qml_runtime.kv.dma)
    version = ctypes.c_int()
    rt.cudaRuntimeGetVersion(ctypes.byref(version))
    print("cudart", rt._name, version.value)

    def check(pages, slots, k=6):
        picks = torch.linspace(0, n - 1, k).long().tolist()
        return all(torch.equal(pool[:, pages[i]].cpu(), host[slots[i]]) for i in picks)

    res = {}
    pd, sd = pages_scat.to(dev), slots_cons.to(dev)
    for progs in (32, 64, 128):
        config = PageCopyConfig(num_programs=progs)

        def zero_copy(config=config):
            for layer in range(32):
                page_copy(pool, pd, host, sd, 2 * layer, 2 * layer + 2, config=config)
        res[f"zero-copy layered {progs} progs"] = timed(pool, zero_copy)
        if progs == 32:
            res["zero-copy ok"] = check(pages_scat, slots_cons)

    # the same kernel over several layers a launch: a page's bytes of g layers are one host run of g x 64 KiB
    # (the 2D copies below say the 32 KiB runs, not the kernel, cost the ~3.7 ms over a flat copy); "halves"
    # is the runtime's graded form (QML_RESTORE_GROUPS=halves: 16, 8, 4, 2, 1, 1 layers), whose last layer
    # alone keeps the turn's compute after the copy to one layer's
    from qml_runtime.kv.host_restores import layer_groups

    config = PageCopyConfig(num_programs=64)
    for name, sizes in (("2", [2] * 16), ("4", [4] * 8), ("8", [8] * 4), ("16", [16] * 2), ("32", [32]),
                        ("halves", "halves")):
        groups = layer_groups(C // 2, sizes)

        def grouped(groups=groups):
            for lo, hi in groups:
                page_copy(pool, pd, host, sd, 2 * lo, 2 * hi, config=config)
        res[f"zero-copy {name}-layer groups 64 progs"] = timed(pool, grouped)
    res["zero-copy groups ok"] = check(pages_scat, slots_cons)

    p0 = 100  # the consecutive destination pages start here

    def two_d():
        for c in range(C):
            err = rt.cudaMemcpy2DAsync(pool[c, p0].data_ptr(), W * 2, host[0, c].data_ptr(), C * W * 2, W * 2, n,
                                       4, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
            assert err == 0, err
    res["2D contiguous pages (64 copies)"] = timed(pool, two_d)
    res["2D ok"] = check(torch.arange(p0, p0 + n), slots_cons)

    def flat():
        pool.view(-1)[:n * C * W].copy_(host.view(-1)[:n * C * W], non_blocking=True)
    res["one flat copy"] = timed(pool, flat)

    # cudaMemcpyBatchAsync: per layer, 2 chunks x n copies of W*2 bytes, in stream order
    per_layer = _batch_addresses(pool, host, pages_scat, slots_cons)
    count = 2 * n
    sizes = np.full(count, W * 2, dtype=np.uint64)
    attr = _Attr(1, _Loc(2, 0), _Loc(1, 0), 0)  # stream order; source on the host, destination device 0
    idx = (ctypes.c_size_t * 1)(0)
    fail = ctypes.c_size_t(0)

    def batch(with_fail):  # 12.8's signature had failIdx, CUDA 13's is said not to: both are tried
        def run():
            for dst, src in per_layer:
                args = [dst.ctypes.data_as(ctypes.c_void_p), src.ctypes.data_as(ctypes.c_void_p),
                        sizes.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(count), ctypes.byref(attr), idx,
                        ctypes.c_size_t(1)]
                if with_fail:
                    args.append(ctypes.byref(fail))
                args.append(ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
                err = rt.cudaMemcpyBatchAsync(*args)
                assert err == 0, f"cudaMemcpyBatchAsync error {err}"
        return run
    for with_fail in ((False, True) if version.value >= 13000 else (True,)):
        try:
            res[f"batch per layer (failIdx={with_fail})"] = timed(pool, batch(with_fail))
            res[f"batch ok (failIdx={with_fail})"] = check(pages_scat, slots_cons)
            break
        except Exception as e:
            res[f"batch failIdx={with_fail} error"] = repr(e)
            torch.cuda.synchronize()
    for k, val in res.items():
        if isinstance(val, list):
            gbs = [round(nbytes / a / 1e6, 1) for a, _ in val]
            print(f"{k:40s} device ms {[a for a, _ in val]}  host ms {[b for _, b in val]}  GB/s {gbs}")
        else:
            print(k, val)
    with open(os.environ.get("OUT", ".") + "/dma.json", "w") as f:
        json.dump({"bytes": nbytes, "results": res, "cudart": version.value}, f, indent=1)


if __name__ == "__main__":
    main()
