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

from qml_server import bench, bench_common
from qml_server.cli import build_parser, main

KEY = "bench-test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_tiny_server(*flags: str) -> tuple[subprocess.Popen, str]:
    """`qml serve --model preset:tiny-llama --random-weights` on the CPU; returns it and its API root once healthy."""
    port = free_port()
    env = {**os.environ, "QML_LOG_LEVEL": "warning"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "qml_server", "serve", "--model", "preset:tiny-llama", "--random-weights",
         "--device", "cpu", "--port", str(port), *flags],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"qml serve exited early:\n{proc.stdout.read()}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return proc, f"{base}/v1"
        except httpx.HTTPError:
            pass  # not listening yet
        time.sleep(0.2)  # not listening, or 503 while the engine starts
    proc.kill()
    pytest.fail("qml serve did not become healthy in 120 s")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()  # SIGTERM: the engine flushes its KV writes
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def server():
    proc, url = start_tiny_server("--kv-cache-gib", "0.05", "--api-key", KEY)
    yield url
    stop_server(proc)


def test_bench_serve_end_to_end(server, tmp_path, capsys):
    """The default: token-id prompts on /v1/completions hit every size exactly, with no calibration."""
    out = tmp_path / "bench.json"
    rc = main(["bench", "serve", "--base-url", server, "--api-key", KEY, "--prompt-tokens", "40,100",
               "--repeats", "3", "--decode-tokens", "16", "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    result = json.loads(out.read_text())
    assert set(result) >= {"date", "command", "server_model", "server_info", "settings", "api", "prompts", "ttft",
                           "decode", "concurrency", "reference", "notes"}
    assert result["server_model"] == "tiny-llama-random"
    assert result["command"].startswith("qml bench serve ") and KEY not in result["command"]
    assert "--api completions" in result["command"]
    assert result["api"] == result["settings"]["api"] == "completions"
    assert result["prompts"]["vocab_size"] == 512 and result["prompts"]["token_id_range"] == [32, 480]
    assert result["calibration_requests"] == 0
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
    # a tiny model on a busy CI core can stream all 16 tokens before the client reads the first: they then
    # arrive in one read (0 ms/token, no rate) instead of spread out; timing is not what this checks
    assert decode["ms_per_token"] >= 0 and decode["cached_tokens"] == 0
    assert decode["tokens_per_s"] is None or decode["tokens_per_s"] > 0
    assert result["concurrency"] is None and result["reference"] is None
    assert result["notes"] == []
    # the markdown table on stdout
    assert "| prompt tokens | TTFT median (ms)" in captured.out and "| 100 |" in captured.out
    assert "ms/token" in captured.out and "API: completions" in captured.out


def test_bench_serve_chat_api(server):
    """--api chat: sizes counted with the chat template, calibrated to hit exactly; the template's tokens reported."""
    result = bench.run_bench(server, KEY, prompt_tokens=[60, 150], repeats=2, decode_tokens=4, api="chat")
    assert result["api"] == "chat" and result["calibration_requests"] > 0
    # the byte tokenizer's plain rendering adds "user: " + "\n" + "assistant: " around the text
    assert result["prompts"]["chat_template_tokens"] == len("user: \nassistant: ")
    for row in result["ttft"]:
        assert row["prompt_tokens"] == [row["target_prompt_tokens"]] * 2 and row["cached_tokens"] == [0, 0]
    assert result["decode"]["prompt_tokens"] == 60 and result["decode"]["completion_tokens"] == 4
    assert "API: chat" in bench.markdown(result)


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_bench_serve_length_step(server, api):
    """--length-step: run i of a size is i·step tokens longer, hit exactly on both APIs (chat calibrates each)."""
    result = bench.run_bench(server, KEY, prompt_tokens=[60, 90], repeats=3, decode_tokens=4, api=api,
                             length_step=5)
    assert [row["prompt_tokens"] for row in result["ttft"]] == [[60, 65, 70], [90, 95, 100]]
    assert all(row["prompt_tokens_miss"] == 0 for row in result["ttft"]) and result["notes"] == []
    assert result["settings"]["length_step"] == 5
    with pytest.raises(bench.BenchError, match="length-step"):
        bench.run_bench(server, KEY, prompt_tokens=[60], decode_tokens=4, length_step=-1)


def test_bench_serve_concurrency(server, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", "serve", "--base-url", server, "--api-key", KEY, "--concurrency", "4",
               "--concurrency-prompt-tokens", "64", "--concurrency-rounds", "2", "--decode-tokens", "12",
               "--concurrency-only", "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    result = json.loads(out.read_text())
    assert result["ttft"] == [] and result["decode"] is None
    c = result["concurrency"]
    assert c["conversations"] == 4 and c["rounds"] == 2 and c["requests"] == 8 and c["prompt_tokens"] == 64
    assert c["generated_tokens"] == 8 * 12 and c["cached_tokens"] == 0
    assert c["output_tokens_per_s"] > 0 and c["wall_s"] > 0
    assert c["steady_tokens_per_s"] is not None and c["steady_tokens_per_s"] > 0
    for key in ("ttft_ms", "itl_ms", "tpot_ms"):
        s = c[key]
        # gaps between tokens may be 0 when a busy client reads several chunks at once (a request never is)
        assert s["p50"] > 0 if key == "ttft_ms" else s["p50"] >= 0, (key, s)
        assert s["p50"] <= s["p90"] <= s["p99"] <= s["max"], (key, s)
    # a gap between successive text chunks: at most one per token after the first (held-back bytes merge chunks)
    assert c["ttft_ms"]["n"] == 8 and 0 < c["itl_ms"]["n"] <= 8 * 11
    assert "| 4 x 2 | 64 | 12 |" in captured.out


def test_bench_serve_reference_table(server, capsys):
    rc = main(["bench", "serve", "--base-url", server, "--api-key", KEY, "--prompt-tokens", "133",
               "--repeats", "1", "--decode-tokens", "4", "--reference", "llama-3.1-8b"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "source: issue 4, item 7" in out
    assert "| 598 | — | ≤20 | 40.4 | 25.5 | 77.9 |" in out  # not measured: the references alone
    assert "| decode ms/token |" in out and "| 4.97 | 4.99 | 5.10 |" in out and "≥4500" in out


def test_reference_numbers():
    ref = bench.REFERENCE["llama-3.1-8b"]
    assert ref["prompt_tokens"] == (133, 598, 2340, 8892, 26926)
    engines = {n: (t, d) for n, t, d in ref["engines"]}
    assert engines["SGLang 0.5.22"] == ((14.1, 25.5, 73.3, 313.7, 937.0), 4.99)
    assert bench.reference_name("auto", "llama-3.1-8b-random", {}) == "llama-3.1-8b"
    assert bench.reference_name("auto", "Meta-Llama-3.1-8B-Instruct", {}) == "llama-3.1-8b"
    assert bench.reference_name("auto", "tiny-llama-random", {}) is None
    assert bench.reference_name("none", "llama-3.1-8b-random", {}) is None
    result = {"ttft": [{"target_prompt_tokens": 133, "ttft_median_ms": 9.5},
                       {"target_prompt_tokens": 2340, "ttft_median_ms": 70.0}],
              "decode": {"ms_per_token": 4.2},
              "concurrency": {"conversations": 32, "prompt_tokens": 2048, "steady_tokens_per_s": 4600.0,
                              "output_tokens_per_s": 3000.0}}
    cmp = bench.compare_with_reference(result, "llama-3.1-8b")
    assert [r["meets_target"] for r in cmp["ttft"]] == [True, None, False, None, None]
    assert cmp["decode"]["meets_target"] is True and cmp["concurrency"]["meets_target"] is True


def test_bench_reports_a_bad_key(server, capsys):
    assert main(["bench", "serve", "--base-url", server, "--api-key", "wrong", "--prompt-tokens", "40"]) == 1
    assert "HTTP 401" in capsys.readouterr().err


def test_bench_refuses_impossible_sizes(server):
    with pytest.raises(bench.BenchError, match="chat template and the nonce alone take"):
        bench.run_bench(server, KEY, prompt_tokens=[5], decode_tokens=4, api="chat")
    with pytest.raises(bench.BenchError, match="exceeds the server's context"):
        bench.run_bench(server, KEY, prompt_tokens=[5000], decode_tokens=4)
    with pytest.raises(bench.BenchError, match="exceeds the server's context"):
        bench.run_bench(server, KEY, prompt_tokens=[40], decode_tokens=4, concurrency=2,
                        concurrency_prompt_tokens=5000)


def test_bench_without_a_server(capsys):
    url = f"http://127.0.0.1:{free_port()}/v1"
    assert main(["bench", "serve", "--base-url", url, "--prompt-tokens", "40", "--timeout", "5"]) == 1
    assert "ConnectError" in capsys.readouterr().err


def test_nonces_and_filler():
    assert len({bench.new_nonce() for _ in range(100)}) == 100
    assert all(len(n) == bench.NONCE_DIGITS and n.isdigit() for n in (bench.new_nonce() for _ in range(10)))
    assert all(len(bench.filler_text(n)) == n for n in (0, 1, 7, 1000, 30000))
    assert bench.filler_text(5000).startswith(bench.filler_text(1234))
    assert bench_common.filler_text(10, offset=5) == bench.filler_text(15)[5:]


def test_token_id_prompts():
    prompts = bench_common.IdPrompts(128256)
    assert (prompts.lo, prompts.hi) == (8016, 120240)  # clear of Llama 3's special tokens at 128000+
    a, b = prompts.make(300), prompts.make(300)
    assert len(a) == len(b) == 300 and all(prompts.lo <= t < prompts.hi for t in a + b)
    assert a[:bench.NONCE_IDS] != b[:bench.NONCE_IDS] and a[bench.NONCE_IDS:] == b[bench.NONCE_IDS:]
    assert len(prompts.make(2)) == 2 and len(prompts.make(1000)) == 1000


class _FakeVocabClient(bench_common.Client):
    """A client whose server accepts ids below ``vocab`` and names no range when it refuses one."""

    def __init__(self, vocab: int):
        self.vocab, self.probes = vocab, 0

    def accepts_token_id(self, token: int) -> tuple[bool, str]:
        self.probes += 1
        return token < self.vocab, "token out of range"


def test_vocab_size_by_bisection():
    for vocab in (257, 512, 32000, 128256, 151936):
        client = _FakeVocabClient(vocab)
        assert client.vocab_size({}) == (vocab, "bisection") and client.probes <= 40
    assert _FakeVocabClient(7).vocab_size({"info": {"vocab_size": 999}}) == (999, "model card")


def test_percentiles_and_metrics_parsing():
    assert bench_common.percentile([], 50) is None
    assert bench_common.percentile([3.0], 99) == 3.0
    assert bench_common.percentile([1, 2, 3, 4], 50) == 2.5
    assert bench_common.percentile(list(range(101)), 90) == 90
    s = bench_common.summary_ms([0.001, 0.002, 0.003])
    assert s["n"] == 3 and s["p50"] == 2.0 and s["max"] == 3.0
    text = ('# HELP x\nqml:kv_restored_blocks_total{model_name="m",tier="host"} 3.0\n'
            'qml:kv_restored_blocks_total{model_name="m",tier="disk"} 5.0\nqml:up 1\n')
    m = bench_common.parse_metrics(text)
    assert bench_common.metric_sum(m, "qml:kv_restored_blocks_total") == 8
    assert bench_common.metric_sum(m, "qml:kv_restored_blocks_total", tier="disk") == 5
    assert bench_common.metric_sum(m, "qml:missing") == 0 and bench_common.metric_sum(None, "qml:up") is None
    assert bench_common.metrics_url_for("http://h:1/v1/") == "http://h:1/metrics"


def test_flags():
    args = build_parser({}).parse_args(["bench", "serve"])
    assert args.prompt_tokens == [133, 598, 2340, 8892, 26926] and args.repeats == 3 and args.decode_tokens == 256
    assert args.base_url == "http://127.0.0.1:8000/v1" and args.api == "completions"
    assert args.concurrency is None and args.concurrency_prompt_tokens == 2048 and args.reference == "auto"
    assert args.length_step == 0
    with pytest.raises(SystemExit):
        build_parser({}).parse_args(["bench", "serve", "--prompt-tokens", "10,x"])
    with pytest.raises(SystemExit):
        build_parser({}).parse_args(["bench", "serve", "--api", "responses"])
    assert main(["bench"]) == 2  # no subcommand: help
