"""Where a served TTFT goes, from a ``QML_TURN_TRACE`` file (``qml_runtime.turn_trace``): per request the time
between consecutive points, grouped by how long the first step ran on the device side (``step`` -> ``token``).

    QML_TURN_TRACE=/tmp/trace.jsonl python benchmarks/server_h200.py sessions --out DIR
    python benchmarks/turn_trace_report.py /tmp/trace.jsonl [--max-step-ms 30] [--json OUT]

Prints one row per request whose first step took less than ``--max-step-ms`` (the GPU-history turns; a
host-RAM restore or a fresh prefill takes longer), then the medians of those rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from qml_runtime.turn_trace import gaps

def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", type=Path)
    p.add_argument("--max-step-ms", type=float, default=30.0)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    rows = []
    for line in args.trace.read_text().splitlines():
        rec = json.loads(line)
        if "step" in rec and "token" in rec and (rec["token"] - rec["step"]) * 1e3 < args.max_step_ms:
            rows.append(gaps(rec))
    if not rows:
        print("no request with a first step under", args.max_step_ms, "ms")
        return 1
    keys = [k for k in dict.fromkeys(k for r in rows for k in r)]
    print(" ".join(f"{k:>18s}" for k in keys))
    for r in rows:
        print(" ".join(f"{r[k]:18.3f}" if k in r else f"{'':>18s}" for k in keys))
    med = {k: round(statistics.median([r[k] for r in rows if k in r]), 3) for k in keys}
    print(" ".join(f"{med[k]:18.3f}" for k in keys), " <- medians of", len(rows))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "medians": med}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
