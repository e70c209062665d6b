"""What disk reads beside it cost a thread that launches many small ops (the engine thread launching a prefill):
reader threads in its process against the reader process (``kv.disk_reader``), on CPU.

Each torch op releases the GIL and takes it back; a reader thread that wants the GIL gets it then, and the
op's thread waits until the reader lets go again. This script writes ``--blocks`` encoded blocks of
``--block-kib`` (bf16-like values, as the engine's store writes them), then times a loop of ``--ops`` small
torch ops alone, beside k threads reading the blocks cold (``DiskStore.get_into``), and beside a
``DiskReader`` child with k threads reading them cold into a shared ``HostTier``. Each line gives the loop's
time and the reads' rate.

    python benchmarks/disk_reader_gil_cpu.py                 # k = 1, 2, 4, 8
    python benchmarks/disk_reader_gil_cpu.py --threads 8 --blocks 600

Results: benchmarks/results/disk-reader-gil-cpu-2026-12-06.md.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import sys
import tempfile
import threading
import time
from array import array

import torch

from qml_runtime.kv.disk_reader import DiskReader
from qml_runtime.kv.disk_store import DiskStore
from qml_runtime.kv.host_tier import HostTier

TOKENS = list(range(16))


def drop_cache(disk: DiskStore) -> None:
    for path in disk.dir.glob("*.kvb"):
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def op_loop(n: int) -> float:
    x = torch.randn(64, 64)
    t0 = time.perf_counter()
    for _ in range(n):
        x.add(1).mul(2).relu()
    return time.perf_counter() - t0


def threads_read(disk: DiskStore, names: list[bytes], row: int, k: int):
    it, lock = iter(names), threading.Lock()

    def work():
        out = torch.empty(row, dtype=torch.uint8)
        while True:
            with lock:
                name = next(it, None)
            if name is None:
                return
            assert disk.get_into(name, TOKENS, out)

    workers = [threading.Thread(target=work) for _ in range(k)]
    for w in workers:
        w.start()
    return lambda: [w.join() for w in workers]


def child_read(reader: DiskReader, disk: DiskStore, names: list[bytes], row: int, slots: int):
    left, landed = [len(names)], threading.Event()

    def done(result):
        assert result[1] == "ok", result
        left[0] -= 1
        if not left[0]:
            landed.set()

    reads = [(disk.read_path(n), n, array("I", TOKENS).tobytes(), (i % slots) * row, row) for i, n in enumerate(names)]
    reader.read(reads, [done] * len(reads))
    return landed.wait


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=300)
    ap.add_argument("--block-kib", type=int, default=1024)
    ap.add_argument("--ops", type=int, default=3000, help="iterations of 3 small torch ops")
    ap.add_argument("--threads", type=int, nargs="*", default=[1, 2, 4, 8])
    ap.add_argument("--switch-interval-us", type=float, default=500, help="sys.setswitchinterval (the engine's: 500)")
    args = ap.parse_args()
    sys.setswitchinterval(args.switch_interval_us / 1e6)
    row = args.block_kib << 10
    machine = platform.processor() or platform.machine()
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S')}, {machine}, {os.cpu_count()} cores, "
          f"python {sys.version.split()[0]}, torch {torch.__version__}; switch interval "
          f"{sys.getswitchinterval() * 1e3:.1f} ms")
    print(f"# {args.blocks} blocks of {args.block_kib} KiB, read cold; the loop: {args.ops} x 3 small torch ops")
    with tempfile.TemporaryDirectory() as root:
        disk = DiskStore(root, bytes(32), 1 << 40, element_size=2)
        gen = torch.Generator().manual_seed(0)
        names = []
        for i in range(args.blocks):
            kv = (torch.randn(row // 2, generator=gen) * 0.1).to(torch.bfloat16).view(torch.uint8)
            names.append(hashlib.sha256(str(i).encode()).digest())
            disk.put(names[-1], None, TOKENS, kv)
        host = HostTier(row, 64 * row, pin=False)
        op_loop(args.ops)  # (warm)
        print(f"loop alone: {op_loop(args.ops) * 1e3:.1f} ms")
        for k in args.threads:
            reader = DiskReader(host.fd, host.capacity * row, bytes(32), k)
            for how in ("threads", "process"):
                drop_cache(disk)
                t0 = time.perf_counter()
                wait = (threads_read(disk, names, row, k) if how == "threads"
                        else child_read(reader, disk, names, row, host.capacity))
                loop = op_loop(args.ops)
                wait()
                seconds = time.perf_counter() - t0
                print(f"{k} {how:>7}: loop {loop * 1e3:7.1f} ms; reads {args.blocks * row / seconds / 1e9:.2f} GB/s "
                      f"of KV ({seconds * 1e3:.0f} ms)")
            reader.close()
        disk.close()


if __name__ == "__main__":
    main()
