"""How fast the GPU machine's local disk gives back KV block files, cold, by reader threads.

    python benchmarks/disk_read_h200.py --out DIR [--dir /tmp/qml-disk-probe] [--blocks 1000]

Writes ``--blocks`` files shaped like the disk store's (a 4 KiB header and a 2 MiB payload: one
Llama-3.1-8B page), fsyncs them, then for each thread count and read mode drops the files from the
page cache (``posix_fadvise(DONTNEED)``, as ``server_h200.py sessions`` does before a restart) and
reads them all: buffered ``preadv`` into one buffer per thread (what ``DiskStore.get_into`` does), or
``O_DIRECT`` into page-aligned buffers (no page cache). The store reads with 4 threads
(``tiers.LOADER_THREADS``) and measured 1.2-1.4 GB/s; if more requests in flight or O_DIRECT read
faster, a restore from disk could stream more of a history instead of recomputing it.

``--store``: the same through ``DiskStore`` itself (header, checksum, and the version-2 encoding of
bf16 values drawn from a normal distribution, or raw), read cold with ``get_into`` by each thread
count: the KV bytes per second a restore's loader threads get, decoding included.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HEADER, PAYLOAD = 4096, 2 << 20


def drop(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_all(paths, threads: int, direct: bool) -> float:
    size = HEADER + PAYLOAD
    buffers = [mmap.mmap(-1, size) for _ in range(threads)]  # page-aligned, as O_DIRECT needs

    def part(i):
        buf = memoryview(buffers[i])
        for p in paths[i::threads]:
            fd = os.open(p, os.O_RDONLY | (os.O_DIRECT if direct else 0))
            try:
                got = os.preadv(fd, [buf], 0)
                assert got == size, (p, got)
            finally:
                os.close(fd)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(part, range(threads)))
    return time.perf_counter() - t0


def store_reads(args) -> list[dict]:
    """Blocks written through ``DiskStore`` raw and encoded, read back cold by thread count."""
    import torch

    from qml_runtime.kv.disk_store import DiskStore

    gen = torch.Generator().manual_seed(0)
    pages = [(torch.randn(PAYLOAD // 2, generator=gen) * 0.5).to(torch.bfloat16).view(torch.uint8)
             for _ in range(8)]  # (8 distinct pages, reused: the disk cannot tell)
    rows = []
    for element_size in (2, 0):
        root = args.dir / f"store-{element_size}"
        store = DiskStore(root, bytes(32), budget_bytes=1 << 40, element_size=element_size)
        names = [i.to_bytes(4, "big") * 8 for i in range(1, args.blocks + 1)]
        t0 = time.perf_counter()
        for i, name in enumerate(names):
            assert store.put(name, None, list(range(16)), pages[i % len(pages)])
        write_s = time.perf_counter() - t0
        files = [p for p in store.dir.iterdir() if p.is_file()]
        stored = sum(p.stat().st_size for p in files)
        kv = args.blocks * PAYLOAD
        rows.append({"mode": f"store put, element_size {element_size}", "threads": 1,
                     "kv_GB/s": round(kv / write_s / 1e9, 2), "stored_over_kv": round(stored / kv, 3)})
        print(rows[-1], flush=True)
        for threads in (int(t) for t in args.threads.split(",")):
            drop(files)
            outs = [torch.empty(PAYLOAD, dtype=torch.uint8) for _ in range(threads)]

            def part(i):
                for name in names[i::threads]:
                    assert store.get_into(name, list(range(16)), outs[i])

            t0 = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(part, range(threads)))
            s = time.perf_counter() - t0
            rows.append({"mode": f"store get_into cold, element_size {element_size}", "threads": threads,
                         "kv_GB/s": round(kv / s / 1e9, 2), "file_GB/s": round(stored / s / 1e9, 2)})
            print(rows[-1], flush=True)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(4) as pool:  # warm: the page cache holds them now, so this is the decode
            list(pool.map(lambda i: [store.get_into(n, list(range(16)), outs[i % len(outs)])
                                     for n in names[i::4]], range(4)))
        rows.append({"mode": f"store get_into, page cache, element_size {element_size}", "threads": 4,
                     "kv_GB/s": round(kv / (time.perf_counter() - t0) / 1e9, 2)})
        print(rows[-1], flush=True)
        store.close()
        shutil.rmtree(root, ignore_errors=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/qml-disk-probe"))
    parser.add_argument("--blocks", type=int, default=1000)
    parser.add_argument("--threads", default="1,4,8,16,32")
    parser.add_argument("--store", action="store_true", help="read through DiskStore, raw and encoded")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    if args.store:
        rows = store_reads(args)
        shutil.rmtree(args.dir, ignore_errors=True)
        (args.out / f"disk-read-store-{time.strftime('%Y-%m-%d')}.json").write_text(json.dumps(
            {"date": time.strftime("%Y-%m-%d"), "blocks": args.blocks, "dir": str(args.dir), "rows": rows}, indent=1))
        return 0
    data = os.urandom(HEADER + PAYLOAD)
    paths = []
    t0 = time.perf_counter()
    for i in range(args.blocks):
        p = str(args.dir / f"{i:06d}.blk")
        with open(p, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        paths.append(p)
    write_s = time.perf_counter() - t0
    nbytes = args.blocks * (HEADER + PAYLOAD)
    rows = [{"mode": "write+fsync", "threads": 1, "GB/s": round(nbytes / write_s / 1e9, 2)}]
    print(rows[-1], flush=True)
    for direct in (False, True):
        for threads in (int(t) for t in args.threads.split(",")):
            drop(paths)
            s = read_all(paths, threads, direct)
            rows.append({"mode": "O_DIRECT" if direct else "buffered", "threads": threads,
                         "GB/s": round(nbytes / s / 1e9, 2), "ms_per_block": round(s / args.blocks * 1e3, 3)})
            print(rows[-1], flush=True)
    drop(paths)
    warm = read_all(paths, 4, False)  # now in the page cache: the ceiling of the read path itself
    s = read_all(paths, 4, False)
    rows.append({"mode": "buffered, page cache", "threads": 4, "GB/s": round(nbytes / s / 1e9, 2),
                 "first_pass_GB/s": round(nbytes / warm / 1e9, 2)})
    print(rows[-1], flush=True)
    shutil.rmtree(args.dir, ignore_errors=True)
    (args.out / f"disk-read-{time.strftime('%Y-%m-%d')}.json").write_text(json.dumps(
        {"date": time.strftime("%Y-%m-%d"), "blocks": args.blocks, "block_bytes": HEADER + PAYLOAD,
         "dir": str(args.dir), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
