"""The host-RAM restore through the copy engines: wide 2D copies into a device staging ring, scattered into the
pages by page_copy on the compute stream, against the zero-copy kernel the runtime runs (GPU only).

Why: the zero-copy page_copy moves a 27k-token Llama-3.1-8B history (1,708 pages, 3.58 GB) at ~50.7 GB/s
whatever its runs (per layer or 2-32 layers a launch: ``kv_upload_dma_h200.py``, 2026-12-05 on an H100), and
one flat pinned copy moves 54.5 GB/s: 65.7 against 70.6 ms, ~5 ms of the host-RAM turn. A page's row in host
RAM is ``[C, W]`` (C = 64 chunks: 32 layers x K, V), so g layers of every page are one 2D copy of ``n`` rows of
g x 64 KiB (source pitch 2 MiB) into a staging region ``[n, 2g, W]``; page_copy then moves the region into
the scattered pages on the device (HBM to HBM, ~1.2 ms a GB). The copy stream fills region k while the
compute stream scatters region k - 1; each region is reused once its scatter is done (events both ways).

Variants, each timed three times between events on the compute stream (from the first copy's launch to the
last layer landed), each checked on six pages:

- ``2D w KiB``: the copy engines alone, all 1,708 rows in 2D copies of w KiB wide (64 ... 2048): the rate the
  run width allows;
- ``staged g-layer groups, R regions``: the pipeline above (g = 1, 2, 4, 8; R = 2, 3);
- ``zero-copy layered``: the runtime's path (32 page_copy launches from the pinned rows, 64 programs);
- the two best-known paths again with a stand-in for the turn's compute beside them on a third stream
  (bf16 GEMMs of 160 x 4096 x 14336 for the whole copy's length): the zero-copy kernel takes 64 programs'
  SMs from it, the staged path only its scatters'.

    python benchmarks/kv_upload_staged_h200.py     # writes $OUT/staged.json (or ./staged.json)
"""

from __future__ import annotations

import json
import os

import torch

from kv_upload_dma_h200 import C, N, P, W, _host_rows_and_pool, n, timed
from qml_kernels.page_copy import PageCopyConfig, page_copy
from qml_runtime.kv.dma import copy_2d_to_device, cudart

KIB = 1024


def main() -> None:
    dev = torch.device("cuda")
    host, pool = _host_rows_and_pool(dev)
    pages = torch.randperm(P, generator=torch.Generator().manual_seed(0))[:n]
    slots = torch.arange(n)
    pd, sd = pages.to(dev), slots.to(dev)
    nbytes = n * C * W * 2
    copy_stream = torch.cuda.Stream()
    load_stream = torch.cuda.Stream()
    compute = torch.cuda.current_stream()
    row_bytes = C * W * 2
    # the staging ring: regions of up to 8 layers of every page, with one row's width each side so a region can
    # be seen as [n, C, W] rows whose chunks start at the group's first (page_copy indexes by the pool's chunk)
    max_chunks = 16
    region_elems = n * max_chunks * W
    staging = torch.empty(2 * C * W + 3 * region_elems, dtype=torch.bfloat16, device=dev)
    x = torch.randn(160, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.randn(4096, 14336, device=dev, dtype=torch.bfloat16)

    def region_rows(r: int, lo: int, chunks: int) -> torch.Tensor:
        """Region r as rows [n, C, W] whose chunk lo is the region's first element."""
        offset = C * W + r * region_elems - lo * W
        return staging.as_strided((n, C, W), (chunks * W, W, 1), offset)

    def copy_2d(dst_ptr: int, dst_pitch: int, lo: int, chunks: int, stream) -> None:
        copy_2d_to_device(dst_ptr, dst_pitch, host[0, lo].data_ptr(), row_bytes, chunks * W * 2, n, stream)

    def gemms_beside() -> None:  # the turn's compute stand-in, queued first so it covers the whole copy
        with torch.cuda.stream(load_stream):
            for _ in range(1800):
                torch.mm(x, w)

    def check() -> bool:
        picks = torch.linspace(0, n - 1, 6).long().tolist()
        return all(torch.equal(pool[:, pages[i]].cpu(), host[slots[i]]) for i in picks)

    res = {}
    for width_kib in (64, 128, 256, 512, 1024, 2048):  # w KiB = w / 32 chunks a copy
        chunks = width_kib * KIB // (W * 2)
        dst = torch.empty(n * C * W, dtype=torch.bfloat16, device=dev)

        def dma(chunks=chunks, dst=dst):
            copy_stream.wait_stream(compute)
            for lo in range(0, C, chunks):
                copy_2d(dst.data_ptr() + lo * n * W * 2, chunks * W * 2, lo, chunks, copy_stream)
            compute.wait_stream(copy_stream)
        res[f"2D {width_kib} KiB"] = timed(pool, dma)
        del dst

    def staged(layers: int, regions: int):
        chunks = 2 * layers
        assert chunks <= max_chunks and regions <= 3

        def run():
            landed = [None] * regions  # event: the region's scatter is done, it may be filled again
            copy_stream.wait_stream(compute)
            for k, lo in enumerate(range(0, C, chunks)):
                r = k % regions
                if landed[r] is not None:
                    copy_stream.wait_event(landed[r])
                rows = region_rows(r, lo, chunks)
                copy_2d(rows.data_ptr() + lo * W * 2, chunks * W * 2, lo, chunks, copy_stream)
                filled = torch.cuda.Event()
                filled.record(copy_stream)
                compute.wait_event(filled)
                page_copy(pool, pd, rows, sd, lo, lo + chunks, config=PageCopyConfig(num_programs=132))
                landed[r] = torch.cuda.Event()
                landed[r].record(compute)
        return run

    for layers in (1, 2, 4, 8):
        for regions in (2, 3):
            res[f"staged {layers}-layer groups, {regions} regions"] = timed(pool, staged(layers, regions))
            res[f"staged {layers}/{regions} ok"] = check()

    def zero_copy():
        for layer in range(32):
            page_copy(pool, pd, host, sd, 2 * layer, 2 * layer + 2, config=PageCopyConfig(num_programs=64))
    res["zero-copy layered 64 progs"] = timed(pool, zero_copy)
    res["zero-copy ok"] = check()
    res["zero-copy layered, GEMMs beside"] = timed(pool, zero_copy, before=gemms_beside)
    res["staged 2-layer groups, 3 regions, GEMMs beside"] = timed(pool, staged(2, 3), before=gemms_beside)
    res["staged beside ok"] = check()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(1800):
        torch.mm(x, w)
    e.record()
    torch.cuda.synchronize()
    res["GEMMs alone ms"] = round(s.elapsed_time(e), 2)
    for k, val in res.items():
        if isinstance(val, list):
            gbs = [round(nbytes / a / 1e6, 1) for a, _ in val]
            print(f"{k:48s} device ms {[a for a, _ in val]}  host ms {[b for _, b in val]}  GB/s {gbs}")
        else:
            print(k, val)
    with open(os.environ.get("OUT", ".") + "/staged.json", "w") as f:
        json.dump({"bytes": nbytes, "rows": N, "pages": n, "cudart": cudart()._name, "results": res,
                   "device": torch.cuda.get_device_name(), "torch": torch.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
