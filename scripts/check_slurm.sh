#!/usr/bin/env bash
# The Slurm deployment on a real Slurm (scripts/check_slurm.py says what it checks): installs
# Debian's slurmctld, slurmd, slurm-client and munge where missing (root with apt-get), then runs
# the check. .ci/run calls it after the tests when it runs as root (LIVEMIG_CI_STRICT=1: a skip
# is a failure). Elsewhere it prints `SKIPPED: <reason>` and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! command -v slurmd >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  pkgs="slurmctld slurmd slurm-client munge"
  timeout 240 apt-get install -y -q --no-install-recommends $pkgs >/tmp/livemig-slurm-apt.log 2>&1 \
    || { timeout 240 apt-get update -q >>/tmp/livemig-slurm-apt.log 2>&1 \
         && timeout 240 apt-get install -y -q --no-install-recommends $pkgs >>/tmp/livemig-slurm-apt.log 2>&1; } \
    || { echo "check_slurm: could not install $pkgs (/tmp/livemig-slurm-apt.log)" >&2; tail -5 /tmp/livemig-slurm-apt.log >&2; }
fi
exec timeout 600 python3 scripts/check_slurm.py
