"""End-to-end runs: real `livemig run` launcher, etcd, workers, spares, gloo.

The workload is examples/mlp.py shrunk (2 x Linear(1024,1024)) so a run
takes seconds; each fault-free reference runs once per session, shared by every
test that asks for the same settings (the `references` fixture).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import pytest

from livemig.references import Reference, References
from tests.helpers.logs import process_logs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MLP = os.path.join(REPO, "examples", "mlp.py")
MLP_ZERO1 = os.path.join(REPO, "examples", "mlp_zero1.py")
STATEFUL = os.path.join(REPO, "examples", "stateful.py")
STEPS = 24
WORKLOAD = ["--steps", str(STEPS), "--layers", "2", "--batch", "32"]
RUN_ENV = {"LIVEMIG_LOG_LEVEL": "INFO", "LIVEMIG_RECOVERY_TIMEOUT": "60"}  # what livemig_run adds


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
    if spares and os.environ.get("LIVEMIG_TEST_FOLLOW") == "1" and "--follow" not in extra:
        extra = ("--follow", "1", *extra)  # the suite with a follow spare (README)
    cmd = [sys.executable, "-m", "livemig.cli", "run", "--nproc", str(nproc), "--spares", str(spares),
           "--job", job, "--report", str(report), "--lease-ttl", "2", *extra]  # fmt: skip
    for f in faults:
        cmd += ["--fault", f]
    cmd += [script, *(workload or WORKLOAD)]
    full_env = {**os.environ, "LIVEMIG_STATE_DIR": str(tmp_path), **RUN_ENV, **(env or {})}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=REPO)
    rep = json.loads(report.read_text()) if report.exists() else {}
    return Run(p.returncode, rep, p.stdout, p.stderr)


def explain(run: Run) -> str:
    """What to print when an assertion fails: output and process logs."""
    return "\n".join([run.stdout[-3000:], run.stderr[-3000:], *process_logs(run.report, 25)])


def reference_of(references: References, nproc: int, script: str = MLP, workload: list[str] | None = None,
                 env: dict | None = None) -> Reference:  # fmt: skip
    """The fault-free run with these settings, from the session's shared cache."""
    return references.get(nproc, script, list(workload or WORKLOAD), {**RUN_ENV, **(env or {})})


def rank_files(out) -> dict[int, dict]:
    """The per-rank JSON files a script wrote into a directory (rank<r>.json)."""
    return {int(f.stem[4:]): json.loads(f.read_text()) for f in out.glob("rank*.json")}


@pytest.fixture(scope="session")
def stateful_reference(references):
    """examples/stateful.py's fault-free run: (report, each rank's dumped state). Without
    the step sleep the faulted runs add (it changes no state), so they all share one."""

    def get(nproc: int, args: tuple = (), steps: int = 16) -> tuple[dict, dict[int, dict]]:
        ref = reference_of(references, nproc, STATEFUL, ["--steps", str(steps), *args], {"STATEFUL_DUMP": "{out}"})
        return ref.report, rank_files(ref.out)

    return get


@pytest.fixture(scope="session")
def reference_digest(references):
    def get(nproc: int, script: str = MLP, env: dict | None = None, workload: list[str] | None = None) -> str:
        return reference_of(references, nproc, script, workload, env).digest

    return get
