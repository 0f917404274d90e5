#!/usr/bin/env bash
# livemig's GPU checks on a machine with a GPU, no network and a torch that must not be replaced:
#
#   scripts/gpu_check.sh --wheels DIR [--quick]
#
# Fetches nothing and never installs or replaces torch: livemig's other dependencies come from
# DIR, a folder of wheels prepared elsewhere (`scripts/gpu_wheels.sh DIR --python-version 3.12`
# makes one, etcd's binary included, <= 60 MB), installed into a scratch folder put on
# PYTHONPATH; livemig itself runs from this checkout. Prints one line per check (PASS, FAIL or
# `SKIP <reason>`, livemig/bench/gpu_check.py) and exits 1 if any failed. Whole run <= 4 minutes,
# --quick <= 2 (GPU_CHECK_TIMEOUT_S bounds it: default 240, 120 with --quick).
set -uo pipefail
cd "$(dirname "$0")/.."
wheels="" quick=()
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) wheels="${2:?--wheels needs a folder}"; shift 2 ;;
    --quick) quick=(--quick); shift ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown argument $1 (expected --wheels DIR, --quick)" >&2; exit 2 ;;
  esac
done
python="${PYTHON:-python3}"
if ! "$python" -c 'import torch' 2>/dev/null; then
  echo "gpu_check: $python cannot import torch: this check runs on the host's torch and installs none" >&2
  exit 2
fi
site="$(mktemp -d "${TMPDIR:-/tmp}/livemig-gpu-site.XXXXXX")"
trap 'rm -rf "$site"' EXIT
if [ -n "$wheels" ]; then
  [ -d "$wheels" ] || { echo "gpu_check: --wheels $wheels is not a folder" >&2; exit 2; }
  shopt -s nullglob
  files=()
  for w in "$wheels"/*.whl; do
    base="$(basename "$w")"
    dist="${base%%-*}"
    case "$dist" in
      torch|nvidia_*|triton) echo "gpu_check: ignoring $base: the host's torch is never replaced"; continue ;;
    esac
    # a package the host already has stays the host's (its torch was built against it)
    if "$python" -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$dist" 2>/dev/null; then
      continue
    fi
    files+=("$w")
  done
  if [ "${#files[@]}" -gt 0 ]; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "${files[@]}" \
      || { echo "gpu_check: installing the wheels of $wheels failed" >&2; exit 2; }
  fi
fi
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
missing="$("$python" - <<'PY'
import importlib.util
names = ["pyetcd", "zmq", "msgpack", "blake3", "cryptography", "psutil", "grpc", "google.protobuf", "numpy"]
print(" ".join(n for n in names if importlib.util.find_spec(n) is None))
PY
)"
if [ -n "$missing" ]; then
  echo "gpu_check: livemig's dependencies are missing: $missing (pass --wheels DIR: scripts/gpu_wheels.sh makes one)" >&2
  exit 2
fi
limit="${GPU_CHECK_TIMEOUT_S:-$([ ${#quick[@]} -gt 0 ] && echo 120 || echo 240)}"
timeout "$limit" "$python" -m livemig.bench.gpu_check "${quick[@]}"
rc=$?
[ "$rc" -eq 124 ] && echo "gpu_check: the checks did not finish within ${limit}s" >&2
exit "$rc"
