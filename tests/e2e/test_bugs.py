"""Bugs are not node failures: an exception in the training function ends the job at
once, with the rank, the step and the traceback, and no spare is used."""

from __future__ import annotations

import os

from tests.e2e.conftest import REPO, explain, livemig_run

BUG = os.path.join(REPO, "tests", "helpers", "bug_proc.py")


def test_user_exception_ends_the_job_fast_with_its_traceback(tmp_path):
    run = livemig_run(tmp_path, 2, spares=1, script=BUG, workload=[])
    res = run.report["result"]
    assert run.rc != 0 and res["state"] == "failed", explain(run)
    assert "rank 1 raised ZeroDivisionError: division by zero at step 5" in res["reason"]
    assert "print(1 / 0)" in run.stderr and "ZeroDivisionError" in run.stderr  # the traceback, on the launcher's stderr
    assert res["time"] - res["raised_at"] < 5.0, res
    assert run.report["recoveries"] == [] and not any(m.get("role") == "spare" for m in run.report["members"].values())


def test_bad_registration_everywhere_ends_the_job_with_one_line(tmp_path):
    run = livemig_run(tmp_path, 2, spares=1, script=BUG, workload=["--bad-register"], timeout=120)
    res = run.report["result"]
    assert run.rc != 0 and "ctx.register(thing=...): a int has no state_dict" in res["reason"], explain(run)
    assert "before training" in res["reason"]


def test_on_error_replace_recovers_then_gives_up(tmp_path):
    run = livemig_run(tmp_path, 2, spares=1, script=BUG, workload=[], extra=("--on-error", "replace:1"))
    res = run.report["result"]
    assert len(run.report["recoveries"]) == 1, explain(run)  # the spare took rank 1 and met the same bug
    assert res["state"] == "failed" and "1 retries used" in res["reason"], explain(run)
