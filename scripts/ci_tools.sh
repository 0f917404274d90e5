#!/usr/bin/env bash
# CI as root on a Debian machine: install the operators' tools the checks run for real —
# promtool (Debian's `prometheus`, for the alert-rule tests and `promtool check metrics` on a live
# page). Where one cannot be installed the run fails (LIVEMIG_CI_STRICT=1 makes the tests that
# need it fail rather than skip); on a developer's machine (not root) nothing is installed and
# those tests skip with their reason.
set -uo pipefail
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "ci_tools: not root with apt-get: nothing installed (tests needing promtool skip)"
  exit 0
fi
install() {  # $1: the command that must exist after, then the packages
  local want=$1
  shift
  command -v "$want" >/dev/null && return 0
  export DEBIAN_FRONTEND=noninteractive
  timeout 240 apt-get install -y -q --no-install-recommends "$@" >/tmp/livemig-ci-apt.log 2>&1 \
    || { timeout 240 apt-get update -q >>/tmp/livemig-ci-apt.log 2>&1 \
         && timeout 240 apt-get install -y -q --no-install-recommends "$@" >>/tmp/livemig-ci-apt.log 2>&1; }
  if ! command -v "$want" >/dev/null; then
    echo "ci_tools: could not install $* (see /tmp/livemig-ci-apt.log)" >&2
    tail -5 /tmp/livemig-ci-apt.log >&2
    return 1
  fi
  echo "ci_tools: installed $*"
}
install promtool prometheus || exit 1
