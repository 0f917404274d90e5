"""The reliability matrix (livemig/bench/faults_bench.py), one test per case.

Every case asserts: all steps completed, final digest equal to the
fault-free run's, the expected number of recoveries, the case's own check,
and (fixture) no process of the test outlives it. Set
LIVEMIG_FAULTS_QUICK=1 to skip the cases marked slow.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from datetime import timedelta

import psutil
import pytest

from livemig.bench.faults_bench import MATRIX, MLP, WORKLOAD, run_case
from tests.helpers.logs import process_logs


@pytest.fixture(autouse=True)
def state_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LIVEMIG_STATE_DIR", str(tmp_path))
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    deadline = time.time() + 10
    while time.time() < deadline:
        left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()
                and p.status() != psutil.STATUS_ZOMBIE]  # fmt: skip
        if not left:
            return
        time.sleep(0.2)
    raise AssertionError(f"processes outlived the test: {[(p.pid, p.cmdline()[:4]) for p in left]}")


def _explain(row: dict) -> str:
    return "\n".join([row["notes"], *process_logs(row["report"], 15)])


@pytest.mark.parametrize("case", MATRIX, ids=[c.name for c in MATRIX])
def test_fault_case(case, references):
    if case.slow and os.environ.get("LIVEMIG_FAULTS_QUICK"):
        pytest.skip("slow case (LIVEMIG_FAULTS_QUICK=1)")
    if case.needs_root and (os.geteuid() != 0 or not shutil.which("ip")):
        pytest.skip("needs root and iproute2 (network namespaces)")
    row = run_case(case, references)
    assert row["ok"], _explain(row)


def test_malformed_values_under_job_prefix_are_ignored(tmp_path, references):
    """Garbage written under the job's prefix is logged and ignored; the job finishes exactly."""
    import json

    from livemig.agent.jobs import connect
    from livemig.rdzv.keys import JobKeys

    env = dict(os.environ, LIVEMIG_STATE_DIR=str(tmp_path))
    job = subprocess.Popen(
        [sys.executable, "-m", "livemig.cli", "run", "--nproc", "2", "--spares", "1", "--job", "junk",
         "--lease-ttl", "2", "--fault", "kill:rank=1:step=12", "--report", str(tmp_path / "r.json"),
         MLP, *WORKLOAD], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        assert "livemig: job junk" in job.stdout.readline()
        client = connect("junk", None, timedelta(seconds=5))
        keys = JobKeys("junk")
        for key, raw in [(keys.spare("garbage"), b"\xc1\xff not msgpack"), (keys.member(7), b"\x93\x01\x02\x03"),
                         (keys.suspect("nobody"), b"{]"), (keys.prefix + "signatures/junk", b"\x00"),
                         (keys.report(5, 0), b"\xff")]:  # fmt: skip
            client.put(key, raw)
        out, _ = job.communicate(timeout=180)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, out
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["steps_completed"] == 40 and rep["state_digest"] == references.get(2, MLP, WORKLOAD).digest
    coord = next(p for p in rep["processes"] if p["role"] == "coordinator")
    assert "ignoring a malformed value" in open(coord["log"]).read()
