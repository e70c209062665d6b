#!/usr/bin/env bash
# The GPU machine's runs of a session, by name: what the results under benchmarks/results/ came from.
#
# Here (a CPU machine with pip's index), once:   bash benchmarks/gpu_session.sh wheels
#   downloads into .whl/ (git-ignored, ~30 MB) the wheels the GPU machine lacks for the engine, the server and the
#   tests: the device tool's `run` carries it (carry: [".whl"]).
# There (`run` with carry [".whl"]):             bash benchmarks/gpu_session.sh PHASE [PHASE...]
#   installs the wheels into /tmp/site (kept while the machine stays warm), then runs each phase; what a phase
#   writes goes under $OUT/PHASE, packed as $OUT/PHASE.tgz (a call brings back at most 8 files).
#
# Phases (each a few minutes on an H200; a call may run for 10):
#   served        the sessions table: GPU history, host RAM, disk after restart (server_h200.py sessions)
#   served-trace  the same with QML_TURN_TRACE, and the trace's report (turn_trace_report.py); DISK_ALSO="NAME=VALUE ...":
#                 the disk turn again after another restart with each set, in order (QML_DISK_READER=threads ...)
#   build-ab      the build's 38 GPU-history turns with the trace, twice: as the tree is, then with $AB_ENV set
#                 (e.g. AB_ENV="QML_HANDOFF=1", AB_ENV="QML_SWITCH_INTERVAL_US=100"), alternated twice
#   probe         the in-process launch probe of the GPU-history turn (engine_h200.py --sections gputurn)
#   sweep         the turn attention by RunSplit and by tail launch (turn_tail_sweep_h200.py); the fastest split
#                 goes to $OUT/best-split.txt
#   split-ab      build-ab with QML_TURN_SPLIT set to that split (or $SPLIT), the engine's turns served
#   layout        cuDNN's turn attention by KV layout (cudnn_layout_h200.py)
#   waves         the wave model's splits of the turn attention against equal runs at 150, 163 and 280 queries
#   tests         the tests that take the GPU path on a GPU (the turn attention, the engine's GPU turn; or $TESTS)
set -uo pipefail
cd "$(dirname "$0")/.."

WHEELS="gguf starlette uvicorn h11 anyio sniffio click httptools uvloop prometheus-client xxhash zstandard
        llguidance>=1.9 tqdm hypothesis sortedcontainers nvidia-cudnn-frontend pytest pluggy iniconfig
        httpx httpcore certifi idna"

if [ "${1:-}" = wheels ]; then
  mkdir -p .whl
  # shellcheck disable=SC2086  (the list splits into its names)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $WHEELS || exit
  du -sh .whl
  exit 0
fi

OUT=${OUT:?"run on the GPU machine (the device tool sets OUT)"}
if [ ! -f /tmp/site/.installed ]; then
  # all at once; where one wheel does not fit this machine, one by one, so that the others still go in
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>/dev/null ||
    for wheel in .whl/*.whl; do
      python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site "$wheel" ||
        echo "not installed: $wheel"
    done
  touch /tmp/site/.installed
fi
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

pack() {  # pack $OUT/$1 into $OUT/$1.tgz
  tar -czf "$OUT/$1.tgz" -C "$OUT" "$1" && rm -rf "${OUT:?}/$1"
}

served_trace() {  # $1: the directory; the rest: server_h200.py's arguments
  local dir=$1
  shift
  mkdir -p "$dir"
  QML_TURN_TRACE=$dir/trace.jsonl python3 benchmarks/server_h200.py sessions --out "$dir" "$@"
  python3 benchmarks/turn_trace_report.py "$dir/trace.jsonl" --json "$dir/trace-report.json" | tail -3
  # the host-RAM turns (a first step of 30-200 ms: the copy): where the time before their copy goes
  python3 benchmarks/turn_trace_report.py "$dir/trace.jsonl" --min-step-ms 30 --max-step-ms 200 \
    --json "$dir/trace-report-host.json" | tail -1
  # the turns that ran in several steps (a history recomputed in chunks beside its reads from disk), step by step
  python3 benchmarks/turn_trace_report.py "$dir/trace.jsonl" --steps --json "$dir/trace-steps.json" | tail -30
  gzip -f "$dir/trace.jsonl"
}

ab_rounds() {  # $1: the directory, $2: the other side's name, $3: its NAME=VALUE words; the build's turns served
  local dir=$1 side=$2 env=$3 round  # tree / other side, twice, then the report of the two sides
  for round in 1 2; do
    served_trace "$dir/tree-$round" --build-only
    # shellcheck disable=SC2086  (env: one or more NAME=VALUE words)
    (export $env && served_trace "$dir/$side-$round" --build-only)
  done
  python3 benchmarks/turn_trace_report.py "$dir"/tree-*/trace.jsonl.gz "$dir/$side"-*/trace.jsonl.gz \
    --json "$dir/ab-report.json" | tee "$dir/ab-report.txt"
}

for phase in "$@"; do
  echo "=== $phase $(date -u +%FT%TZ)"
  dir=$OUT/$phase
  mkdir -p "$dir"
  case $phase in
    served) python3 benchmarks/server_h200.py sessions --out "$dir" ;;
    served-trace)
      more=()
      for setting in ${DISK_ALSO:-}; do more+=(--disk-also "$setting"); done
      served_trace "$dir" "${more[@]}" ;;
    build-ab)
      : "${AB_ENV:?build-ab needs AB_ENV, e.g. QML_TURN_SPLIT=3x4+1}"
      ab_rounds "$dir" ab "$AB_ENV" ;;
    probe) python3 benchmarks/engine_h200.py --sections gputurn --probes launch --out "$dir" ;;
    sweep)
      python3 benchmarks/turn_tail_sweep_h200.py --out "$dir"
      # the fastest split over the whole turn path, for split-ab (kept beside the packed results)
      python3 -c "import glob, json, sys; rows = [r for f in glob.glob(sys.argv[1] + '/turn-tail-sweep-[hg]*.json')
        for r in json.load(open(f))['rows'] if r.get('split') and 'path_us' in r]
best = min(rows, key=lambda r: r['path_us'])['split'] if rows else None
print('best split:', best)
open(sys.argv[2], 'w').write('' if best is None else '{long}x{weight}+{short}'.format(**best))" "$dir" "$OUT/best-split.txt"
      ;;
    waves)  # the wave model's splits (attention_turn.wave_split) against equal runs, at turns of 5, 6 and 9 tiles
      for qs in "150:3,3x4+1,3x8+2" "163:2,3,2x4+3,2x3+2,2x2+1" "280:1,2,1x6+5,1x4+3,1x3+2"; do
        python3 benchmarks/turn_tail_sweep_h200.py --out "$dir" --queries "${qs%%:*}" --splits "${qs#*:}" --tails none \
          2>&1 | grep -v -i warn
      done ;;
    split-ab)
      split=$(cat "$OUT/best-split.txt" 2>/dev/null || true)
      split=${SPLIT:-$split}
      if [ -z "$split" ]; then echo "split-ab: no split (run sweep first, or set SPLIT=3x4+1)"; continue; fi
      ab_rounds "$dir" "split-$split" "QML_TURN_SPLIT=$split" ;;
    layout) python3 benchmarks/cudnn_layout_h200.py --out "$dir" ;;
    tests) python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/test_attention_turn.py tests/test_attention_turn_engine.py tests/test_prefill_graph_gpu.py} \
             2>&1 | tail -15 | tee "$dir/pytest.txt" ;;
    *) echo "unknown phase: $phase" >&2 ;;
  esac
  pack "$phase"
done
