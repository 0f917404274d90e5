"""Run one script as N rank processes and collect the JSON line each prints last: the unit
tests that need several real processes on gloo (test_torch_group.py, test_collectives.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from livemig.rdzv.embedded import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_ranks(worker: str, world: int, *args: str, timeout: float = 120) -> dict[int, dict]:
    """`python worker *args RANK WORLD PORT` for each rank; rank -> its last line, parsed. A
    process that fails or outlives `timeout` fails the test; none is left behind."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": REPO}
    procs = [subprocess.Popen([sys.executable, worker, *args, str(r), str(world), str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
             for r in range(world)]  # fmt: skip
    out: dict[int, dict] = {}
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            assert p.returncode == 0, stderr[-3000:]
            rec = json.loads(stdout.strip().splitlines()[-1])
            out[rec["rank"]] = rec
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out
