"""The restore planner's measured rates across restarts, kept beside the disk store.

After a restart the rates of the last run are better first guesses than the defaults (the prefill
curve is measured again at each start). A store with no measured disk rate (a first start on a store
an older run wrote, or one that never read) is probed once, cold, in the background.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

from qml_runtime.kv.disk_store import RATES_NAME, DiskStore
from qml_runtime.kv.planner import RestorePlanner

log = logging.getLogger("qml.kv.tiers")

PROBE_BYTES = 64 << 20  # the start-up disk probe reads this much (~50 ms at 1.4 GB/s)
PROBE_MIN_BLOCKS = 8  # a store with fewer blocks is not probed


def load_rates(planner: RestorePlanner, directory: Path) -> None:
    try:
        saved = json.loads((directory / RATES_NAME).read_text())
    except (OSError, ValueError):
        return
    if isinstance(saved, dict):
        planner.load_rates(saved)
        log.info("restore planner: rates from the last run: host %.1f GB/s, disk %.2f GB/s",
                 planner.host_bytes_per_s / 1e9, planner.disk_bytes_per_s / 1e9)


def save_rates(planner: RestorePlanner, directory: Path) -> None:
    path = directory / RATES_NAME
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(planner.rates()))
        os.replace(tmp, path)
    except OSError as exc:  # a read-only or full disk costs the next start its first guesses, nothing more
        log.warning("could not save the restore planner's rates: %s", exc)


def needs_probe(planner: RestorePlanner, disk: DiskStore) -> bool:
    return "disk_bytes_per_s" not in planner.measured and len(disk) >= PROBE_MIN_BLOCKS


def probe_disk(disk: DiskStore, planner: RestorePlanner, threads: int) -> None:
    """Read a few of the oldest blocks cold, ``threads`` at once as a restore does, and measure. The
    default guess is conservative; a restore planned on it recomputes what the disk could have
    brought in faster (H200: 0.5 GB/s guessed, 1.1-1.5 GB/s measured).

    The rate is counted whole. It used to count 85%, from a restore that read ~1.7 GB/s after a probe of 2.01 on
    the H200, when the restores' reader threads shared the server's GIL with the recompute beside them. Since the
    reads moved to a child process (``disk_reader``) every restore after a restart has read faster than the probe,
    1.1-1.35x: 1.93-2.04 GB/s after probes of 1.48-1.64 on the H200 (sessions-h200-2026-12-06.md), ~1.45 after
    1.19 and 1.87-2.04 after ~1.8 on H100s (sessions-h100-2026-12-06e, -d). At 85% those plans read too little:
    their reads ended 190-240 ms before the head they were split with."""
    names = disk.probe_names(PROBE_BYTES)
    parts = [names[i::threads] for i in range(threads)]
    done = [0] * len(parts)

    def read(i: int) -> None:
        done[i] = sum(disk.cold_read(name) for name in parts[i])

    t0 = time.perf_counter()
    workers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(len(parts))]
    for th in workers:
        th.start()
    for th in workers:
        th.join()
    seconds = time.perf_counter() - t0
    if sum(done) and "disk_bytes_per_s" not in planner.measured:  # a restore may have measured first
        planner.observe("disk", sum(done), seconds, provisional=True)
        log.info("restore planner: disk read %.2f GB/s (probe: %d blocks read cold in %.1f ms)",
                 planner.disk_bytes_per_s / 1e9, len(names), seconds * 1e3)
