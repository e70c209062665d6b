"""The host-RAM turn's restore on the copy engines (``cudaMemcpyBatchAsync``) against the page_copy kernel, alone and
beside the turn's compute, on the GPU.

In the in-process host turn (27k-token Llama-3.1-8B history, 1,708 pages, 3.58 GB) the restore ran at ~46.5 GB/s,
against 50.5 for the same copies alone (``kv-upload-dma-h200-2026-12-03.md``): the kernel's 64 programs share the
SMs with the prefill that waits for them, layer by layer. The copy engines need no SM; the runs are scattered
32 KiB pieces, which one 2D copy cannot take, but the batch API takes a list of copies per call (2 x 1,708 a
layer). Its earlier attempt here was refused (``cudaErrorInvalidValue``) on the legacy default stream, which the
batch API does not accept; here it runs on a side stream, as the runtime's restore does.

Variants, each three times (device ms from one event before the first copy to the last kernel of the turn):
- ``alone``: the 32 layers' copies, nothing else;
- ``turn``: the compute stream waits for layer l's event, then runs one Llama-3.1-8B layer's GEMMs for 150
  tokens (q/k/v, o, gate/up, down) and an attention-sized GEMM over 27k keys, as the restoring turn does.
Checked: six pages read back against their host rows after each copy method.

    python benchmarks/kv_upload_ce_h200.py --out DIR     # DIR/kv-upload-ce.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time
from pathlib import Path

import numpy as np
import torch
from kv_upload_dma_h200 import C, N, P, W, _Attr, _batch_addresses, _cudart, _host_rows_and_pool, _Loc, n

from qml_kernels.page_copy import PageCopyConfig, page_copy

LAYERS = C // 2



def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    dev = torch.device("cuda")
    host, pool = _host_rows_and_pool(dev)
    pages = torch.randperm(P, generator=torch.Generator().manual_seed(0))[:n]
    slots = torch.randperm(N, generator=torch.Generator().manual_seed(1))[:n]
    nbytes = n * C * W * 2
    rt, path = _cudart()
    version = ctypes.c_int()
    rt.cudaRuntimeGetVersion(ctypes.byref(version))
    side = torch.cuda.Stream(dev, priority=-1)
    compute = torch.cuda.current_stream(dev)
    res: dict = {"cudart": [path, version.value], "bytes": nbytes}

    # one layer of Llama-3.1-8B for 150 tokens, and an attention-sized product (150 x 4 heads' rows over 27k keys)
    x = torch.randn(150, 4096, device=dev, dtype=torch.bfloat16)
    ws = [torch.randn(4096, k, device=dev, dtype=torch.bfloat16) / 64 for k in (6144, 4096, 28672)]
    wd = torch.randn(14336, 4096, device=dev, dtype=torch.bfloat16) / 64
    q = torch.randn(8, 600, 128, device=dev, dtype=torch.bfloat16)
    kk = torch.randn(8, 128, 27339, device=dev, dtype=torch.bfloat16)

    def layer_compute():
        for w in ws:
            x @ w
        torch.randn(150, 14336, device=dev, dtype=torch.bfloat16) @ wd
        torch.bmm(q, kk)

    def check() -> bool:
        picks = torch.linspace(0, n - 1, 6).long().tolist()
        return all(torch.equal(pool[:, pages[i]].cpu(), host[slots[i]]) for i in picks)

    pd, sd = pages.to(dev), slots.to(dev)
    config = PageCopyConfig(num_programs=64)

    def kernel_layer(layer: int) -> None:
        page_copy(pool, pd, host, sd, 2 * layer, 2 * layer + 2, config=config)

    # the batch API's per-layer arrays: dst/src addresses of the 2 x n runs of one layer
    per_layer = _batch_addresses(pool, host, pages, slots)
    count = 2 * n
    sizes = np.full(count, W * 2, dtype=np.uint64)
    idx = (ctypes.c_size_t * 1)(0)
    fail = ctypes.c_size_t(0)
    chosen: dict = {}

    def batch_call(layer: int, attr, with_fail: bool) -> int:
        dst, src = per_layer[layer]
        call = [dst.ctypes.data_as(ctypes.c_void_p), src.ctypes.data_as(ctypes.c_void_p),
                sizes.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(count), ctypes.byref(attr), idx,
                ctypes.c_size_t(1)]
        if with_fail:
            call.append(ctypes.byref(fail))
        call.append(ctypes.c_void_p(side.cuda_stream))
        return rt.cudaMemcpyBatchAsync(*call)

    # find the signature and attributes the runtime takes (on the side stream)
    attempts = []
    for with_fail in (False, True):
        for hints in (((2, 0), (1, 0)), ((0, 0), (0, 0)), ((4, 0), (1, 0))):
            for flags in (0, 1):
                attr = _Attr(1, _Loc(*hints[0]), _Loc(*hints[1]), flags)
                with torch.cuda.stream(side):
                    err = batch_call(0, attr, with_fail)
                side.synchronize()
                rt.cudaGetLastError()  # a refused call leaves its error for torch's next check otherwise
                attempts.append([with_fail, hints, flags, err])
                if err == 0 and "attr" not in chosen:
                    chosen.update(attr=attr, with_fail=with_fail, hints=hints, flags=flags)
        if chosen:  # (CUDA 13's signature has no failIdx: the other would pass the stream as failIdx)
            break
    res["batch attempts (failIdx, hints, flags, error)"] = attempts
    print("batch attempts:", attempts, flush=True)

    def ce_layer(layer: int) -> None:
        err = batch_call(layer, chosen["attr"], chosen["with_fail"])
        assert err == 0, f"cudaMemcpyBatchAsync: error {err}"

    methods = {"page_copy 64 programs": kernel_layer}
    if chosen:
        methods["copy engines (batch API)"] = ce_layer
        if chosen["flags"] == 0:  # also the overlap-with-compute hint, if the runtime takes it
            attr1 = _Attr(1, _Loc(*chosen["hints"][0]), _Loc(*chosen["hints"][1]), 1)
            with torch.cuda.stream(side):
                ok = batch_call(0, attr1, chosen["with_fail"]) == 0
            side.synchronize()
            if ok:
                def ce_overlap_layer(layer: int) -> None:
                    err = batch_call(layer, attr1, chosen["with_fail"])
                    assert err == 0, f"cudaMemcpyBatchAsync: error {err}"
                methods["copy engines, prefer overlap"] = ce_overlap_layer

    for _ in range(3):  # warm the GEMMs
        layer_compute()
    torch.cuda.synchronize()
    for name, copy_layer in methods.items():
        for mode in ("alone", "turn"):
            runs = []
            for _ in range(3):
                pool.zero_()
                torch.cuda.synchronize()
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                copied = torch.cuda.Event(enable_timing=True)
                start.record(compute)
                side.wait_stream(compute)
                t0 = time.perf_counter()
                events = []
                with torch.cuda.stream(side):
                    for layer in range(LAYERS):
                        copy_layer(layer)
                        ev = torch.cuda.Event()
                        ev.record(side)
                        events.append(ev)
                    copied.record(side)
                queued = (time.perf_counter() - t0) * 1e3
                if mode == "turn":
                    for ev in events:
                        compute.wait_event(ev)
                        layer_compute()
                compute.wait_stream(side)
                end.record(compute)
                torch.cuda.synchronize()
                runs.append({"ms": round(start.elapsed_time(end), 2), "copies_ms": round(start.elapsed_time(copied), 2),
                             "queue_ms": round(queued, 2)})
            ok = check()
            res[f"{name}, {mode}"] = {"runs": runs, "ok": ok,
                                      "gb_s": [round(nbytes / r["copies_ms"] / 1e6, 1) for r in runs]}
            print(f"{name:32s} {mode:6s} {runs} ok={ok}", flush=True)
    # the compute alone (its 32 layers, no copies)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(LAYERS):
        layer_compute()
    e.record()
    torch.cuda.synchronize()
    res["compute alone ms"] = round(s.elapsed_time(e), 2)
    print("compute alone", res["compute alone ms"], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv-upload-ce.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
