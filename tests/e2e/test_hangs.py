"""Failures that do not kill the process: a rank whose training thread is stuck while
its lease and progress threads live on is found from progress reports, fenced,
killed by its agent and replaced within the documented bound, exactly."""

from __future__ import annotations

import os

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
