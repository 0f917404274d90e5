#!/usr/bin/env bash
# Chaos mode: kill a random worker of a running job every N seconds for M minutes.
#
#   scripts/chaos.sh JOB [EVERY_SECONDS=20] [MINUTES=5] [KIND=kill]
#
# Start the job with enough spares first, e.g.
#   livemig run --nproc 4 --spares 3 --job chaos examples/mlp.py --steps 5000 &
# KIND may be kill, hang (SIGSTOP: detected by the lease, then fenced) or slow.
# Each injection is printed; `livemig status --job JOB` shows the generations go by.
set -euo pipefail
job=${1:?usage: scripts/chaos.sh JOB [EVERY_SECONDS] [MINUTES] [KIND]}
every=${2:-20}
minutes=${3:-5}
kind=${4:-kill}
end=$(( $(date +%s) + minutes * 60 ))
while [ "$(date +%s)" -lt "$end" ]; do
  world=$(livemig status --job "$job" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["world_size"])')
  rank=$(( RANDOM % world ))
  livemig inject "$kind" --job "$job" --rank "$rank" --for "$every" 2>&1 || true
  [ "$kind" = slow ] || sleep "$every"
done
