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


SHAPE = os.path.join(REPO, "tests", "helpers", "shape_proc.py")


def test_a_collective_called_with_a_wrong_shape_ends_the_job_at_once(tmp_path):
    """A caller's error inside the step, not a node failure: an all-gather into tensors of the
    wrong size raises at submission (the traceback, no recovery); an all-reduce whose sizes differ
    between ranks makes gloo abort one process, and the other's failed collective ends the job with
    one line, not a recovery that would meet the same bug."""
    import time

    t0 = time.monotonic()
    run = livemig_run(tmp_path, 2, spares=1, script=SHAPE, workload=["--op", "allgather"], job="gather", timeout=120)
    res = run.report["result"]
    assert run.rc != 0 and res["state"] == "failed", explain(run)
    assert "rank 1 raised RuntimeError: ProcessGroupGloo::allgather: invalid tensor size" in res["reason"], res
    assert "at step 3" in res["reason"] and "dist.all_gather(" in run.stderr, explain(run)  # the traceback
    assert run.report["recoveries"] == [], explain(run)
    assert time.monotonic() - t0 < 30, explain(run)  # start-up included; the end itself takes seconds
    assert res["time"] - res["raised_at"] < 5.0, res

    t0 = time.monotonic()
    run = livemig_run(tmp_path, 2, spares=1, script=SHAPE, workload=["--op", "allreduce"], job="reduce", timeout=120)
    res = run.report["result"]
    assert run.rc != 0 and res["state"] == "failed", explain(run)
    assert "the call differs between ranks (shape, op, order)" in res["reason"], res
    assert time.monotonic() - t0 < 30, explain(run)
