#!/usr/bin/env bash
# The whole suite N times in a row with a busy neighbour on the same machine
# (bench/neighbour.py: simulated engines serving and restarting, writes to /dev/kmsg, a CPU
# hog). Stops at the first failing run. One line per run goes to the log.
#
#   bench/soak.sh [RUNS] [LOG]        # default 5 runs, bench/results/soak-<date>.txt
#
# `memory` instead: one daemon on a quiet simulated host for MINUTES (default 60), niced,
# scraped and read as Prometheus and a dashboard would; its RSS every 10 s, then the slope
# after warm-up and the verdict, flat or GROWING (exit 1). bench/memory_soak.py says how.
#
#   bench/soak.sh memory [MINUTES] [LOG]   # default bench/results/soak-memory-<date>.txt
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "memory" ]; then
  LOG="${3:-bench/results/soak-memory-$(date -u +%Y%m%dT%H%M%SZ).txt}"
  mkdir -p "$(dirname "$LOG")"
  export PYTHONPATH="$PWD/daemon${PYTHONPATH:+:$PYTHONPATH}"
  exec nice -n 10 python3 bench/memory_soak.py --minutes "${2:-60}" --log "$LOG"
fi
RUNS="${1:-5}"
LOG="${2:-bench/results/soak-$(date -u +%Y%m%dT%H%M%SZ).txt}"
mkdir -p "$(dirname "$LOG")"
# this checkout's code, whatever `pip install -e` pointed at last
export PYTHONPATH="$PWD/daemon${PYTHONPATH:+:$PYTHONPATH}"
python3 bench/neighbour.py --hogs "${SOAK_HOGS:-1}" >"$LOG.neighbour" 2>&1 &
NEIGHBOUR=$!
trap 'kill $NEIGHBOUR 2>/dev/null; wait $NEIGHBOUR 2>/dev/null' EXIT
# the neighbour says what it runs once its engines answer: wait for that line (30 s at most)
for _ in $(seq 1 300); do [ -s "$LOG.neighbour" ] && break; sleep 0.1; done
{
  echo "soak: $RUNS runs of 'python3 -m pytest -q' at $(git rev-parse --short HEAD), $(nproc) cores"
  echo "beside: $(head -1 "$LOG.neighbour" 2>/dev/null)"
} | tee "$LOG"
for i in $(seq 1 "$RUNS"); do
  start=$(date +%s)
  # --durations: where a slow run spent its time, read from the log afterwards
  python3 -m pytest -q -p no:cacheprovider --durations=30 >"$LOG.run$i" 2>&1
  rc=$?
  end=$(date +%s)
  summary=$(tail -1 "$LOG.run$i")
  echo "run $i: exit $rc in $((end - start)) s, load $(cut -d' ' -f1-3 /proc/loadavg): $summary" | tee -a "$LOG"
  if [ "$rc" -ne 0 ]; then
    grep -E "^(FAILED|ERROR) " "$LOG.run$i" | tee -a "$LOG"
    exit "$rc"
  fi
done
echo "soak: $RUNS of $RUNS runs passed" | tee -a "$LOG"
