#!/usr/bin/env bash
# Run livemig's unit tests and one FSDP2 kill test on another torch, in a venv of its own:
#   scripts/check_torch.sh 2.13.0            # CI's floor check (.ci/run), the CPU build from disk
#   PIP_CONSTRAINT=/dev/null scripts/check_torch.sh 2.15.0   # by hand: a release past the machine's cap
#   scripts/check_torch.sh host              # the torch of the python on PATH (--system-site-packages)
# Why: CI runs the full suite on one torch (README's test command); the private torch APIs
# livemig rests on (tests/unit/test_torch_api.py) and FSDP2's recovery must hold on every
# version pyproject.toml admits. Exits with pytest's status; the venv is removed unless
# LIVEMIG_KEEP_VENV=1. Timeouts: pytest's own (pyproject.toml), the whole run by CHECK_TORCH_TIMEOUT_S (default 900).
set -uo pipefail
cd "$(dirname "$0")/.."
want="${1:?usage: scripts/check_torch.sh VERSION|host}"
venv="${CHECK_TORCH_VENV:-${TMPDIR:-/tmp}/livemig-torch-$want}"
python="${PYTHON:-python3}"
rm -rf "$venv"
if [ "$want" = host ]; then
  "$python" -m venv --system-site-packages "$venv" || exit 1
  torch_req=()
else
  "$python" -m venv "$venv" || exit 1
  torch_req=("torch==$want")
fi
cleanup() { [ "${LIVEMIG_KEEP_VENV:-0}" = 1 ] || rm -rf "$venv"; }
trap cleanup EXIT
# The chosen torch is a constraint, so livemig's range can never replace it (a torch outside
# the range fails the install with pip's one line instead).
pin="$(mktemp)"
if [ "$want" = host ]; then
  "$venv/bin/python" -c 'import torch; print("torch==" + torch.__version__)' > "$pin" || exit 1
else
  echo "torch==$want" > "$pin"
fi
"$venv/bin/pip" install -q -c "$pin" "${torch_req[@]}" -e '.[etcd]' 'pytest>=8' 'pytest-timeout>=2.2' 'pytest-xdist>=3.5' \
  'pyyaml>=6' 'prometheus_client>=0.20' 2>&1 | grep -v "is ignored: it is neither"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "check_torch: the install failed" >&2; exit 1; }
rm -f "$pin"
echo "check_torch: $("$venv/bin/python" -c 'import torch, sys; print("torch", torch.__version__, "python", sys.version.split()[0])')"
timeout "${CHECK_TORCH_TIMEOUT_S:-900}" "$venv/bin/python" -m pytest -q -p no:cacheprovider --durations=5 \
  tests/unit \
  "tests/e2e/test_fsdp2.py::test_two_kills_between_steps_and_in_a_reduce_scatter_are_exact_and_keep_the_mesh"
