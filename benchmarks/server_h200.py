"""Drive `qml serve` + `qml bench` on the GPU machine: the seed table and the sessions table.

    python benchmarks/server_h200.py serve --out DIR      # qml bench serve (+ --concurrency 32)
    python benchmarks/server_h200.py sessions --out DIR   # histories in GPU, host RAM, disk after restart

``serve``: starts ``qml serve --model preset:llama-3.1-8b --random-weights``, runs ``qml bench
serve`` with the seed table's sizes and 32 concurrent 2k-token conversations, stops it.

``sessions``: one server with a small GPU pool, a host tier and a disk tier:
1. ``qml bench sessions`` builds U conversations of 20 turns of ~133 tokens on a ~23k-token first
   message (~27k tokens of history each);
2. the next turn (133 tokens) with the history in GPU memory, beside a fresh full prefill (sent after
   the round's turns; ``--gpu-orders round,turn``: also a turn with each sent right after its turn);
3. unrelated prompts push the histories out of the GPU pool; the next turn comes from host RAM;
4. the server is stopped, the store's files are dropped from the page cache
   (``posix_fadvise(DONTNEED)``: a cold read, without root), a new server starts on the same
   directory, and the next turn's history comes from disk.
Everything the benches print and write lands under --out, with the server logs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

PORT = 8011
BASE = f"http://127.0.0.1:{PORT}"


PRESET = "llama-3.1-8b"
SERVE_FLAGS: list[str] = []


def start_server(out: Path, name: str, *flags: str, env: dict | None = None) -> subprocess.Popen:
    log = open(out / f"server-{name}.log", "w")
    cmd = [sys.executable, "-m", "qml_server", "serve", "--model", f"preset:{PRESET}", "--random-weights",
           "--port", str(PORT), *SERVE_FLAGS, *flags]
    print("$", " ".join(cmd), flush=True)
    env = None if env is None else {**os.environ, **env}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    t0 = time.time()
    while time.time() - t0 < 300:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see server-{name}.log")
        try:
            if httpx.get(f"{BASE}/health", timeout=2).status_code == 200:
                print(f"server up in {time.time() - t0:.1f} s", flush=True)
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("server did not come up in 300 s")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def bench(out: Path, name: str, *args: str) -> int:
    cmd = [sys.executable, "-m", "qml_server", "bench", *args, "--base-url", f"{BASE}/v1"]
    print("$", " ".join(cmd), flush=True)
    with open(out / f"bench-{name}.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    print((out / f"bench-{name}.log").read_text()[-3000:], flush=True)
    return rc


def drop_page_cache(directory: Path) -> int:
    """Evict the store's files from the page cache, so the next read comes from the disk."""
    n = 0
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            finally:
                os.close(fd)
    return n


def run_serve(out: Path, prompt_tokens: str, concurrency: int, repeats: int = 3, length_step: int = 0) -> int:
    proc = start_server(out, "serve")
    try:
        return bench(out, "serve", "serve", "--prompt-tokens", prompt_tokens, "--concurrency", str(concurrency),
                     "--repeats", str(repeats), "--length-step", str(length_step),
                     "--concurrency-prompt-tokens", "2048", "--out", str(out / "bench-serve.json"))
    finally:
        stop_server(proc)


def run_sessions(out: Path, users: int, turns: int, turn_tokens: int, tier_flags: str, evict_tokens: int,
                 first_turn_tokens: int, gpu_orders: tuple[str, ...] = ("round",), build_only: bool = False,
                 disk_also: list[str] = ()) -> int:
    store = Path("/tmp/qml-kv-store")
    shutil.rmtree(store, ignore_errors=True)
    flags = (*tier_flags.split(), "--kv-disk-dir", str(store))
    rc = 0
    proc = start_server(out, "sessions-1", *flags)
    try:
        rc |= bench(out, "sessions-build", "sessions", "--users", str(users), "--turns", str(turns),
                    "--turn-tokens", str(turn_tokens), "--first-turn-tokens", str(first_turn_tokens),
                    "--reply-tokens", "64", "--session-ids",
                    "--save", str(out / "conv-build.json"), "--out", str(out / "sessions-build.json"))
        conv = out / "conv-build.json"
        if build_only:  # (its turns 2 on are GPU-history turns: enough for an A/B of the served path)
            return rc
        for i, order in enumerate(gpu_orders):  # a turn each, the fresh prefills after the round or each turn
            name = "gpu" if i == 0 else f"gpu-{order}"
            rc |= bench(out, f"sessions-{name}", "sessions", "--resume", str(conv), "--turn-tokens", "133",
                        "--fresh", "--fresh-order", order, "--save", str(out / f"conv-{name}.json"),
                        "--out", str(out / f"sessions-{name}.json"))
            conv = out / f"conv-{name}.json"
        rc |= bench(out, "sessions-host", "sessions", "--resume", str(conv), "--turn-tokens", "133",
                    # no --fresh here: its full prefills would fill the disk budget the histories need
                    "--phase", "evict", "--evict-tokens", str(evict_tokens),
                    "--save", str(out / "conv-host.json"), "--out", str(out / "sessions-host.json"))
    finally:
        stop_server(proc)
    files = drop_page_cache(store)
    print(f"dropped {files} store files from the page cache", flush=True)
    proc = start_server(out, "sessions-2", *flags)
    try:
        rc |= bench(out, "sessions-disk", "sessions", "--resume", str(out / "conv-host.json"), "--turn-tokens", "133",
                    "--fresh", "--out", str(out / "sessions-disk.json"))
        metrics = httpx.get(f"{BASE}/metrics", timeout=10).text
        (out / "metrics-after-restart.txt").write_text(metrics)
    finally:
        stop_server(proc)
    for k, setting in enumerate(disk_also, 2):  # the same disk turn again, after another restart with NAME=VALUE set
        name, _, value = setting.partition("=")
        label = f"disk{k}-{name.lower()}-{value.lower()}"
        print(f"dropped {drop_page_cache(store)} store files from the page cache; {setting}", flush=True)
        proc = start_server(out, f"sessions-{label}", *flags, env={name: value})
        try:
            rc |= bench(out, f"sessions-{label}", "sessions", "--resume", str(out / "conv-host.json"),
                        "--turn-tokens", "133", "--fresh", "--out", str(out / f"sessions-{label}.json"))
        finally:
            stop_server(proc)
    return rc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("serve", "sessions"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--users", type=int, default=2)
    # 20 turns of ~133 tokens on a first message of ~23k: histories of ~27k tokens, as in issue 5
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--turn-tokens", type=int, default=133)
    parser.add_argument("--first-turn-tokens", type=int, default=23000)
    parser.add_argument("--preset", default=PRESET)
    parser.add_argument("--prompt-tokens", default="133,598,2340,8892,26926")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="serve: TTFT runs per prompt size (median)")
    parser.add_argument("--length-step", type=int, default=0,
                        help="serve: run i of a size i times this many tokens longer (qml bench serve --length-step)")
    # a GPU pool of 82k tokens: the two ~28k-token histories fit, 100k tokens of other prompts push
    # them out to host RAM; the disk budget holds everything written (the machine has 64 GB of disk)
    parser.add_argument("--tier-flags", default="--kv-cache-gib 10 --kv-host-gib 40 --kv-disk-gib 40",
                        help="sessions: the pool and tier budgets")
    parser.add_argument("--evict-tokens", type=int, default=100000)
    parser.add_argument("--gpu-orders", default="round",
                        help="sessions: the GPU-history turn once per order of its fresh prefills, comma-separated "
                             "(qml bench sessions --fresh-order: round, turn), each a turn further")
    parser.add_argument("--serve-flags", default="", help="more `qml serve` flags, space-separated")
    parser.add_argument("--build-only", action="store_true",
                        help="sessions: only the conversations' build (38 GPU-history turns at the defaults)")
    parser.add_argument("--disk-also", action="append", default=[], metavar="NAME=VALUE",
                        help="sessions: the disk turn again after one more restart with this variable set (repeatable)")
    args = parser.parse_args()
    globals()["PRESET"] = args.preset
    SERVE_FLAGS.extend(args.serve_flags.split())
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    rc = run_serve(args.out, args.prompt_tokens, args.concurrency, args.repeats,
                   args.length_step) if args.mode == "serve" else run_sessions(
        args.out, args.users, args.turns, args.turn_tokens, args.tier_flags, args.evict_tokens,
        args.first_turn_tokens, tuple(args.gpu_orders.split(",")), args.build_only, args.disk_also)
    print(json.dumps({"mode": args.mode, "rc": rc, "seconds": round(time.time() - t0, 1)}), flush=True)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
