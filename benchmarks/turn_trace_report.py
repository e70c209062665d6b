"""Where a served TTFT goes, from a ``QML_TURN_TRACE`` file (``qml_runtime.turn_trace``): per request the time
between consecutive points, grouped by how long the first step ran on the device side (``step`` -> ``token``).

    QML_TURN_TRACE=/tmp/trace.jsonl python benchmarks/server_h200.py sessions --out DIR
    python benchmarks/turn_trace_report.py /tmp/trace.jsonl [--max-step-ms 30] [--json OUT]
    python benchmarks/turn_trace_report.py /tmp/trace.jsonl --min-step-ms 30 --max-step-ms 200   # host-RAM turns
    python benchmarks/turn_trace_report.py DIR/tree-1/trace.jsonl.gz DIR/tree-2/... DIR/ab-1/... DIR/ab-2/...

    python benchmarks/turn_trace_report.py /tmp/trace.jsonl --steps     # the turns that ran in several steps

One file: one row per request whose first step took less than ``--max-step-ms`` (the GPU-history turns; a
host-RAM restore or a fresh prefill takes longer), then the medians of those rows. Several files (an A/B, as
``benchmarks/gpu_session.sh build-ab`` writes them; ``.gz`` read as is): the medians of each, then of each side,
the files pooled by their directory's name less a trailing ``-N`` (``tree-1``, ``tree-2`` -> ``tree``), and each
side's difference from the first.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import statistics
from pathlib import Path

from qml_runtime.turn_trace import ORDER, gaps


def records(path: Path) -> list[dict]:
    """The records of a trace file (``.gz`` read as is)."""
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    return [json.loads(line) for line in text.splitlines()]


def turn_rows(path: Path, max_step_ms: float, min_step_ms: float = 0.0) -> list[dict[str, float]]:
    """The spans (``turn_trace.gaps``) of the requests in ``path`` whose first step took from ``min_step_ms`` to
    under ``max_step_ms``."""
    rows = []
    for rec in records(path):
        if "step" in rec and "token" in rec and min_step_ms <= (rec["token"] - rec["step"]) * 1e3 < max_step_ms:
            rows.append(gaps(rec))
    return rows


def timeline(rec: dict) -> dict:
    """A request's steps and disk reads, ms from its ``scheduled`` point: each step's start, time and tokens, the
    gap before it, its reads' window and when its load was applied, and the first token's ``emit``."""
    zero = rec.get("scheduled", rec.get("submit", 0.0))

    def ms(t: float) -> float:
        return round((t - zero) * 1e3, 2)

    steps, out = rec.get("steps", []), {"id": rec.get("id", "")}
    out["steps"] = [{"at": ms(a), "ms": round((b - a) * 1e3, 2), "tokens": n,
                     "gap": round((a - steps[i - 1][1]) * 1e3, 2) if i else None} for i, (a, b, n) in enumerate(steps)]
    for point in ("reads_begun", "reads_ended", "load_applied", "emit"):
        if point in rec:
            out[point] = ms(rec[point])
    return out


def step_report(paths: list[Path], json_out: Path | None) -> int:
    """``--steps``: the timeline of every request that ran in more than one step before its first token."""
    found = [timeline(rec) for path in paths for rec in records(path) if len(rec.get("steps", [])) > 1]
    if not found:
        print("no request ran in more than one step (a trace from before steps were recorded has none)")
        return 1
    for t in found:
        reads = (f"reads {t['reads_begun']:.1f}-{t['reads_ended']:.1f}" if "reads_begun" in t else "no reads timed")
        print(f"{t['id'][:24]}: {len(t['steps'])} steps, {reads}, applied {t.get('load_applied', float('nan')):.1f},"
              f" first token {t.get('emit', float('nan')):.1f} ms after scheduled")
        for st in t["steps"]:
            gap = "" if st["gap"] is None else f" (gap {st['gap']:.2f})"
            print(f"    at {st['at']:9.2f} ms: {st['tokens']:6d} tokens in {st['ms']:8.2f} ms{gap}")
    if json_out:
        json_out.write_text(json.dumps(found, indent=1))
    return 0


def medians(rows: list[dict[str, float]], keys: list[str]) -> dict[str, float]:
    return {k: round(statistics.median(v), 3) for k in keys if (v := [r[k] for r in rows if k in r])}


def span_order(key: str) -> tuple[int, int]:
    """A column's place: spans by their points' order along a request (``turn_trace.ORDER``), ``total`` last."""
    if "->" not in key:
        return (len(ORDER), 0)
    a, b = key.split("->")
    return (ORDER.index(a), ORDER.index(b))


def side_of(path: Path) -> str:
    return re.sub(r"-\d+$", "", path.parent.name) or str(path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("traces", type=Path, nargs="+")
    p.add_argument("--max-step-ms", type=float, default=30.0)
    p.add_argument("--min-step-ms", type=float, default=0.0,
                   help="with --max-step-ms, another kind of turn: 30 to 200 ms, a history restored from host RAM")
    p.add_argument("--json", type=Path)
    p.add_argument("--steps", action="store_true", help="the requests that ran in several steps, step by step")
    args = p.parse_args()
    if args.steps:
        return step_report(args.traces, args.json)
    by_file = {path: turn_rows(path, args.max_step_ms, args.min_step_ms) for path in args.traces}
    rows = [r for rs in by_file.values() for r in rs]
    if not rows:
        print("no request with a first step from", args.min_step_ms, "to under", args.max_step_ms, "ms")
        return 1
    keys = sorted(dict.fromkeys(k for r in rows for k in r), key=span_order)
    print(f"{'':>14s} " + " ".join(f"{k:>18s}" for k in keys))
    if len(args.traces) == 1:
        for r in rows:
            print(f"{'':>14s} " + " ".join(f"{r[k]:18.3f}" if k in r else f"{'':>18s}" for k in keys))
        med = medians(rows, keys)
        print(f"{'medians':>14s} " + " ".join(f"{med.get(k, float('nan')):18.3f}" for k in keys), " of", len(rows))
        if args.json:
            args.json.write_text(json.dumps({"rows": rows, "medians": med}, indent=1))
        return 0
    for path, rs in by_file.items():
        med = medians(rs, keys)
        print(f"{path.parent.name[:14]:>14s} " + " ".join(f"{med.get(k, float('nan')):18.3f}" for k in keys),
              " of", len(rs))
    sides: dict[str, list[dict[str, float]]] = {}
    for path, rs in by_file.items():
        sides.setdefault(side_of(path), []).extend(rs)
    pooled = {side: medians(rs, keys) for side, rs in sides.items()}
    first = next(iter(pooled.values()))
    for side, med in pooled.items():
        print(f"{side[:14]:>14s} " + " ".join(f"{med.get(k, float('nan')):18.3f}" for k in keys),
              " of", len(sides[side]), "(pooled)")
    for side, med in list(pooled.items())[1:]:
        print(f"{('- ' + next(iter(pooled)))[:14]:>14s} " + " ".join(
            f"{med.get(k, float('nan')) - first.get(k, float('nan')):+18.3f}" for k in keys), f" ({side})")
    if args.json:
        args.json.write_text(json.dumps({"files": {str(p): medians(rs, keys) for p, rs in by_file.items()},
                                         "sides": pooled}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
