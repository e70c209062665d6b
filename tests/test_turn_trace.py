"""The served TTFT trace (qml_runtime.turn_trace): a streamed chat request's stamps, in order, in one line."""

from __future__ import annotations

import json

from starlette.testclient import TestClient

from qml_runtime import turn_trace
from qml_runtime.presets import load_preset_engine
from qml_server.app import create_app


def test_a_streamed_chat_request_writes_its_points_in_order(tmp_path, monkeypatch):
    path = tmp_path / "trace.jsonl"
    monkeypatch.setattr(turn_trace, "PATH", str(path))
    monkeypatch.setattr(turn_trace, "ENABLED", True)
    engine = load_preset_engine("preset:tiny-llama", True, device="cpu", kv_cache_gib=0.02)
    body = {"model": engine.model_id, "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": 3, "stream": True}
    with TestClient(create_app(engine)) as client:
        for _ in range(2):
            with client.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                chunks = [line for line in r.iter_lines() if line.startswith("data: ")]
            assert chunks[-1] == "data: [DONE]"
        # a request without a stream writes its line once collected
        r = client.post("/v1/chat/completions", json={**body, "stream": False})
        assert r.status_code == 200
    lines = path.read_text().splitlines()
    assert len(lines) == 3
    records = [json.loads(line) for line in lines]
    assert records[0]["id"].startswith("chatcmpl-") and records[0]["id"] != records[1]["id"]
    # the points a CPU engine passes (no prefill graph: no staged/replayed), each once, in the order they happen
    # (a streamed request's response starts once its first step runs: "announced", before its token)
    order = ["handler", "prompt", "submit", "drained", "admit", "scheduled", "step", "announced", "token", "emit",
             "first_out", "sent"]
    for rec in records[:2]:
        assert [p for p in order if p in rec] == order
        assert [rec[p] for p in order] == sorted(rec[p] for p in order)
    assert "sent" not in records[2] and "announced" not in records[2] and records[2]["emit"] <= records[2]["first_out"]
    spans = [turn_trace.gaps(rec) for rec in records]
    assert [("total" in s, "step->announced" in s, "step->token" in s) for s in spans] == \
        [(True, True, False), (True, True, False), (False, False, True)]
    assert abs(sum(v for k, v in spans[0].items() if k != "total") - spans[0]["total"]) < 1e-6
    assert not turn_trace._records  # nothing left behind


def test_disabled_it_records_nothing(monkeypatch):
    monkeypatch.setattr(turn_trace, "ENABLED", False)
    turn_trace.stamp("x", "handler")
    turn_trace.done("x")
    assert "x" not in turn_trace._records


def test_the_report_compares_the_sides_of_an_ab(tmp_path, capsys, monkeypatch):
    """``benchmarks/turn_trace_report.py`` over an A/B's files (``gpu_session.sh build-ab``): each file's medians,
    each side's pooled over its runs (``tree-1``, ``tree-2`` -> ``tree``), and the difference from the first side;
    turns whose first step ran longer than ``--max-step-ms`` left out, gzipped files read as they are."""
    import gzip
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import turn_trace_report

    def record(submit_ms: float, step_ms: float) -> dict:
        t = {"handler": 0.0, "submit": 0.001, "drained": 0.001 + submit_ms / 1e3}
        t["step"] = t["drained"] + 0.0005
        t["token"] = t["step"] + step_ms / 1e3
        t["sent"] = t["token"] + 0.0002
        return {"id": "x", **t}

    files = []
    for name, submits in (("tree-1", (0.3, 0.5)), ("tree-2", (0.4,)), ("ab-1", (0.1, 0.2)), ("ab-2", (0.1,))):
        (tmp_path / name).mkdir()
        lines = "".join(json.dumps(record(ms, 11.0)) + "\n" for ms in submits) + json.dumps(record(9.0, 400.0)) + "\n"
        path = tmp_path / name / ("trace.jsonl.gz" if name.endswith("2") else "trace.jsonl")
        path.write_bytes(gzip.compress(lines.encode()) if path.suffix == ".gz" else lines.encode())
        files.append(str(path))
    out = tmp_path / "report.json"

    def run(*args: str) -> dict:
        monkeypatch.setattr(sys, "argv", ["turn_trace_report.py", *args, "--json", str(out)])
        assert turn_trace_report.main() == 0
        return json.loads(out.read_text())

    report = run(*files)
    assert report["sides"]["tree"]["submit->drained"] == 0.4 and report["sides"]["ab"]["submit->drained"] == 0.1
    assert report["sides"]["tree"]["step->token"] == 11.0  # the 400 ms turns are not GPU-history turns
    printed = capsys.readouterr().out
    assert "(pooled)" in printed and "-0.300" in printed
    # the other kind of turn (a history restored from host RAM: a longer first step), columns in the points' order
    report = run(files[0], "--min-step-ms", "300", "--max-step-ms", "500")
    assert len(report["rows"]) == 1 and report["medians"]["step->token"] == 400.0
    assert list(report["medians"]) == ["handler->submit", "submit->drained", "drained->step", "step->token",
                                       "token->sent", "total"]
