#!/usr/bin/env bash
# Kill one given rank every N seconds, M times (a flaky node that keeps dying).
#
#   scripts/kill_loop.sh JOB RANK [EVERY_SECONDS=15] [TIMES=3]
set -euo pipefail
job=${1:?usage: scripts/kill_loop.sh JOB RANK [EVERY_SECONDS] [TIMES]}
rank=${2:?rank}
every=${3:-15}
times=${4:-3}
for _ in $(seq "$times"); do
  sleep "$every"
  livemig inject kill --job "$job" --rank "$rank"
done
