#!/usr/bin/env bash
# Run tests under CPU load, as a shared CI machine or a developer's laptop runs them: a test
# that waits for a time instead of a condition, or depends on which of two processes the
# scheduler runs first, fails here before it fails in CI (README, "Tests under load").
#
#   tests/stress.sh [--load N] [--repeat K] [PYTEST ARGS...]    (default: tests/e2e, N = cores, K = 1)
#
# The load is N busy processes (stress-ng --cpu N where it is installed, else a Python loop of
# our own), started before each pytest run and killed after it, also when the run fails or is
# interrupted. Each run's wall time and result are printed; the exit status is 1 if any run
# failed. Before a capability lands: `tests/stress.sh --repeat 3 tests/e2e/test_<yours>.py`.
set -uo pipefail
cd "$(dirname "$0")/.."
load=$(nproc 2>/dev/null || echo 2)
repeat=1
while [ $# -gt 0 ]; do
  case "$1" in
    --load) load="$2"; shift 2 ;;
    --repeat) repeat="$2"; shift 2 ;;
    -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) break ;;
  esac
done
[ $# -gt 0 ] || set -- tests/e2e
case "$load$repeat" in *[!0-9]*) echo "stress.sh: --load and --repeat take whole numbers" >&2; exit 2 ;; esac

pids=()
start_load() {
  pids=()
  if [ "$load" -eq 0 ]; then return; fi
  if command -v stress-ng >/dev/null; then
    stress-ng --cpu "$load" --quiet >/dev/null 2>&1 &
    pids+=($!)
  else
    for _ in $(seq "$load"); do
      python3 -c 'while True: pass' &
      pids+=($!)
    done
  fi
}
stop_load() {
  for p in "${pids[@]:-}"; do
    [ -n "$p" ] && kill "$p" 2>/dev/null
  done
  for p in "${pids[@]:-}"; do
    [ -n "$p" ] && wait "$p" 2>/dev/null
  done
  pids=()
}
trap 'stop_load; exit 130' INT TERM
trap stop_load EXIT

failed=0
for k in $(seq "$repeat"); do
  start_load
  t0=$(date +%s)
  python -m pytest -q -p no:cacheprovider "$@"
  rc=$?
  stop_load
  echo "stress.sh: run $k/$repeat under a load of $load: exit $rc in $(( $(date +%s) - t0 )) s"
  [ "$rc" -eq 0 ] || failed=1
done
exit "$failed"
