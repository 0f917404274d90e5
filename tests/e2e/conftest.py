"""End-to-end runs: real `livemig run` launcher, etcd, workers, spares, gloo.

The workload is examples/mlp.py shrunk (2 x Linear(1024,1024)) so a run
takes seconds; the reference digest of a fault-free run is computed once
per world size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import pytest

from tests.helpers.logs import process_logs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MLP = os.path.join(REPO, "examples", "mlp.py")
MLP_ZERO1 = os.path.join(REPO, "examples", "mlp_zero1.py")
STEPS = 24
WORKLOAD = ["--steps", str(STEPS), "--layers", "2", "--batch", "32"]


@dataclass
class Run:
    rc: int
    report: dict[str, Any]
    stdout: str
    stderr: str


def livemig_run(tmp_path, nproc: int, spares: int = 0, faults: tuple[str, ...] = (),
                extra: tuple[str, ...] = (), env: dict | None = None, timeout: float = 240,
                workload: list[str] | None = None, job: str = "t", script: str = MLP) -> Run:  # fmt: skip
    report = tmp_path / f"report-{job}.json"
    cmd = [sys.executable, "-m", "livemig.cli", "run", "--nproc", str(nproc), "--spares", str(spares),
           "--job", job, "--report", str(report), "--lease-ttl", "2", *extra]  # fmt: skip
    for f in faults:
        cmd += ["--fault", f]
    cmd += [script, *(workload or WORKLOAD)]
    full_env = dict(os.environ, LIVEMIG_STATE_DIR=str(tmp_path), LIVEMIG_LOG_LEVEL="INFO",
                    LIVEMIG_RECOVERY_TIMEOUT="60", **(env or {}))  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=REPO)
    rep = json.loads(report.read_text()) if report.exists() else {}
    return Run(p.returncode, rep, p.stdout, p.stderr)


def explain(run: Run) -> str:
    """What to print when an assertion fails: output and process logs."""
    return "\n".join([run.stdout[-3000:], run.stderr[-3000:], *process_logs(run.report, 25)])


@pytest.fixture(scope="session")
def reference_digest(tmp_path_factory):
    cache: dict[tuple, str] = {}

    def get(nproc: int, script: str = MLP, env: dict | None = None, workload: list[str] | None = None) -> str:
        key = (nproc, script, tuple(sorted((env or {}).items())), tuple(workload or WORKLOAD))
        if key not in cache:
            name = f"ref{nproc}{'z' if script == MLP_ZERO1 else ''}{len(cache)}"
            run = livemig_run(tmp_path_factory.mktemp(name), nproc, job=name, script=script, env=env,
                              workload=workload)  # fmt: skip
            assert run.rc == 0, explain(run)
            steps = (workload or WORKLOAD)[(workload or WORKLOAD).index("--steps") + 1]
            assert run.report["steps_completed"] == int(steps)
            assert run.report["replicas_identical"], explain(run)
            cache[key] = run.report["state_digest"]
        return cache[key]

    return get
