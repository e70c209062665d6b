"""`qml bench serve` against a real `qml serve --model preset:tiny-llama --random-weights` process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from qml_server import bench
from qml_server.cli import build_parser, main

KEY = "bench-test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    port = free_port()
    env = {**os.environ, "QML_LOG_LEVEL": "warning"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "qml_server", "serve", "--model", "preset:tiny-llama", "--random-weights",
         "--device", "cpu", "--port", str(port), "--kv-cache-gib", "0.05", "--api-key", KEY],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"qml serve exited early:\n{proc.stdout.read()}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("qml serve did not become healthy in 120 s")
    yield f"{base}/v1"
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def test_bench_serve_end_to_end(server, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", "serve", "--base-url", server, "--api-key", KEY, "--prompt-tokens", "40,100",
               "--repeats", "3", "--decode-tokens", "16", "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    result = json.loads(out.read_text())
    assert set(result) >= {"date", "command", "server_model", "server_info", "settings", "ttft", "decode"}
    assert result["server_model"] == "tiny-llama-random"
    assert result["command"].startswith("qml bench serve ") and KEY not in result["command"]
    assert result["settings"]["prompt_tokens"] == [40, 100] and result["settings"]["repeats"] == 3
    assert [row["target_prompt_tokens"] for row in result["ttft"]] == [40, 100]
    for row in result["ttft"]:
        target = row["target_prompt_tokens"]
        assert row["prompt_tokens"] == [target] * 3 and row["prompt_tokens_miss"] == 0
        assert len(row["ttft_ms"]) == 3 and all(t > 0 for t in row["ttft_ms"])
        assert row["ttft_median_ms"] == sorted(row["ttft_ms"])[1]
        assert row["cached_tokens"] == [0, 0, 0]  # every prompt new: no prefix cache hit
    decode = result["decode"]
    assert decode["completion_tokens"] == 16 and decode["prompt_tokens"] == 40
    assert decode["ms_per_token"] > 0 and decode["tokens_per_s"] > 0 and decode["cached_tokens"] == 0
    assert result["notes"] == []
    # the markdown table on stdout
    assert "| prompt tokens | TTFT median (ms)" in captured.out and "| 100 |" in captured.out
    assert "ms/token" in captured.out


def test_bench_reports_a_bad_key(server, capsys):
    assert main(["bench", "serve", "--base-url", server, "--api-key", "wrong", "--prompt-tokens", "40"]) == 1
    assert "HTTP 401" in capsys.readouterr().err


def test_bench_refuses_impossible_sizes(server):
    with pytest.raises(bench.BenchError, match="chat template and the nonce alone take"):
        bench.run_bench(server, KEY, prompt_tokens=[5], decode_tokens=4)
    with pytest.raises(bench.BenchError, match="exceeds the server's context"):
        bench.run_bench(server, KEY, prompt_tokens=[5000], decode_tokens=4)


def test_bench_without_a_server(capsys):
    url = f"http://127.0.0.1:{free_port()}/v1"
    assert main(["bench", "serve", "--base-url", url, "--prompt-tokens", "40", "--timeout", "5"]) == 1
    assert "ConnectError" in capsys.readouterr().err


def test_nonces_and_filler():
    assert len({bench.new_nonce() for _ in range(100)}) == 100
    assert all(len(n) == bench.NONCE_DIGITS and n.isdigit() for n in (bench.new_nonce() for _ in range(10)))
    assert all(len(bench.filler_text(n)) == n for n in (0, 1, 7, 1000, 30000))
    assert bench.filler_text(5000).startswith(bench.filler_text(1234))


def test_flags():
    args = build_parser({}).parse_args(["bench", "serve"])
    assert args.prompt_tokens == [133, 598, 2340, 8892, 26926] and args.repeats == 3 and args.decode_tokens == 256
    assert args.base_url == "http://127.0.0.1:8000/v1"
    with pytest.raises(SystemExit):
        build_parser({}).parse_args(["bench", "serve", "--prompt-tokens", "10,x"])
    assert main(["bench"]) == 2  # no subcommand: help
