#!/usr/bin/env bash
# The whole reliability matrix, as in docs/reliability.md; writes faults.json.
set -euo pipefail
livemig bench faults --json "${1:-faults.json}"
