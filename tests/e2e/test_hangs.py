"""Failures that do not kill the process: a rank whose training thread is stuck while
its lease and progress threads live on is found from progress reports, fenced,
killed by its agent and replaced within the documented bound, exactly."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest

from tests.e2e.conftest import REPO, explain, livemig_run
from tests.e2e.test_recovery import assert_exact

HANG_S = 3.0
ENV = {"LIVEMIG_HANG_TIMEOUT": str(HANG_S)}


@pytest.mark.parametrize("during", ["compute", "before_commit"])
def test_wedged_rank_is_replaced_within_the_bound(tmp_path, reference_digest, during):
    """compute: the others wait in step 8's collective, rank 1 never enters it;
    before_commit: rank 1 is stuck inside step 8's collective while rank 0 completed
    it and waits in step 9's."""
    ref = reference_digest(2)
    run = livemig_run(tmp_path, 2, spares=1, faults=(f"wedge:rank=1:step=8:during={during}",), env=ENV)
    assert_exact(run, ref, 1)
    (hang,) = [e for e in run.report["timeline"] if e["phase"] == "hang"]
    assert hang["ranks"] == [1], hang
    # documented bound: the hang timeout, plus a progress-thread tick and a coordinator pass
    assert HANG_S <= hang["waited_s"] < HANG_S + 1.0, hang
    codes = {p["name"]: p["exit_code"] for p in run.report["processes"]}
    assert codes["worker-1"] == -9, explain(run)  # the wedged process is gone: killed by its agent


def test_a_busy_rank_is_not_hung(tmp_path):
    run = livemig_run(tmp_path, 2, spares=1, script=os.path.join(REPO, "tests", "helpers", "busy_proc.py"),
                      workload=[], env={"LIVEMIG_HANG_TIMEOUT": "1.5"})  # fmt: skip
    assert run.rc == 0 and run.report["steps_completed"] == 12, explain(run)
    assert run.report["recoveries"] == [] and not [e for e in run.report["timeline"] if e["phase"] == "hang"]


def test_livemig_spare_kills_its_fenced_spare(tmp_path, procs):
    """On a standby host `livemig-spare start` is the spare's agent: a spare that is
    fenced and does not exit (here: fenced while warm, so nothing tells it) is killed
    LIVEMIG_FENCED_KILL_S after the fence, and its fence key removed once reaped. Its
    --metrics-port answers for the whole job meanwhile."""
    import subprocess
    import sys
    import time

    from livemig.rdzv.client import decode
    from livemig.rdzv.keys import JobKeys

    env = dict(os.environ, LIVEMIG_STATE_DIR=str(tmp_path), PYTHONPATH=REPO, LIVEMIG_FENCED_KILL_S="2")
    mlp = os.path.join(REPO, "examples", "mlp.py")
    job = subprocess.Popen(
        [sys.executable, "-m", "livemig.cli", "run", "--nproc", "2", "--job", "agent", "--lease-ttl", "2",
         mlp, "--steps", "2000", "--layers", "2", "--batch", "32"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    procs.procs.append(job)
    assert "livemig: job agent" in job.stdout.readline()
    from livemig.rdzv.embedded import free_port

    port = free_port()  # and the standby host's metrics endpoint, which answers for the whole job
    spare = procs.spawn([sys.executable, "-m", "livemig.spare_pool.cli", "start", "--job", "agent", "--id", "s1",
                         "--metrics-port", str(port), mlp, "--steps", "2000", "--layers", "2", "--batch", "32"],
                        env=env)  # fmt: skip
    client = etcd_of("agent", tmp_path)
    keys = JobKeys("agent")
    deadline = time.time() + 90
    while client.get(keys.spare("s1")) is None and time.time() < deadline:
        time.sleep(0.1)
    kv = client.get(keys.spare("s1"))
    assert kv is not None, "the spare never registered warm"
    inc = decode(kv.value)["incarnation"]
    from tests.e2e.test_operability import scrape

    page = scrape(port)
    assert page is not None and page["livemig_world_size{}"] == 2.0, page
    assert sum(v for k, v in page.items() if k.startswith("livemig_spares_warm{")) == 1.0, page
    assert sum(v for k, v in page.items() if k.startswith("livemig_members{")) == 2.0, page
    client.put(keys.fenced(inc), b"fenced by the test")
    t0 = time.monotonic()
    spare.wait(timeout=30)
    took = time.monotonic() - t0
    assert spare.returncode == 128 + 9, spare.returncode  # killed by its agent
    assert 2.0 <= took < 2.0 + 2.0, took
    assert client.get(keys.fenced(inc)) is None  # reaped: the fence key goes


def etcd_of(job: str, tmp_path):  # -> EtcdClient
    from livemig.agent.jobs import connect

    os.environ["LIVEMIG_STATE_DIR"] = str(tmp_path)
    try:
        return connect(job, None, timedelta(seconds=5))
    finally:
        del os.environ["LIVEMIG_STATE_DIR"]
