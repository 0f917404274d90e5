"""Planned live migration end to end: a healthy worker moves onto a warm spare
while training continues. Central assertions: final state bit-identical to the
fault-free run, every step completed, the leaving worker exits 0 (released, not
fenced), no failure recovery, and the switch step's pause is measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from tests.e2e.conftest import MLP, REPO, STEPS, WORKLOAD, explain, livemig_run
from tests.e2e.test_recovery import assert_exact


def exit_codes(run) -> dict[str, int]:
    return {p["name"]: p["exit_code"] for p in run.report["processes"]}


def assert_same_as_fault_free(run, reference: str) -> None:
    assert_exact(run, reference, recoveries=0)  # nothing failed: no fence, no recovery


# Long enough that the spare, warming up beside the workers on 2 cores (2.5 s and more),
# is warm well before the end: in a 24-step job (1.5 s of training) a migration requested
# at step 6 waited for the spare until the job ended (a CI fresh clone, "the job finished first").
LONG = ["--steps", "80", "--layers", "2", "--batch", "32"]


def test_planned_migration_mid_run(tmp_path, reference_digest):
    ref = reference_digest(2, workload=LONG)
    run = livemig_run(tmp_path, 2, spares=1, faults=("migrate:rank=1:step=6",), workload=LONG)
    assert run.rc == 0 and run.report["result"]["state"] == "done", explain(run)
    assert run.report["steps_completed"] == 80 and run.report["replicas_identical"], explain(run)
    assert run.report["state_digest"] == ref and not run.report["recoveries"], explain(run)
    (mig,) = run.report["migrations"]
    assert mig["kind"] == "migration" and mig["outcome"] == "done" and mig["rank"] == 1, mig
    assert 6 <= mig["switch_step"] < 80 - 1, mig
    assert 0 <= mig["pause_s"] < 5, mig
    assert mig["bytes_streamed"] > 0 and set(mig["phases"]) == {"claim", "stream", "catchup", "switch", "commit"}
    codes = exit_codes(run)
    assert codes["worker-1"] == 0, "the leaving worker must exit cleanly\n" + explain(run)
    assert codes["spare-0"] == 0 and codes["worker-0"] == 0, explain(run)


def test_migration_aborted_when_the_spare_dies_during_catch_up(tmp_path, reference_digest):
    ref = reference_digest(2, workload=LONG)  # the spare must be warm (and claimed) before the end
    run = livemig_run(tmp_path, 2, spares=1, faults=("migrate:rank=1:step=4", "spare-kill:during=claim"),
                      workload=LONG)  # fmt: skip
    assert run.rc == 0 and run.report["steps_completed"] == 80, explain(run)
    assert run.report["state_digest"] == ref and not run.report["recoveries"], explain(run)
    (mig,) = run.report["migrations"]
    assert mig["outcome"] == "aborted" and "spare failed" in mig["aborted"], mig
    codes = exit_codes(run)
    assert codes["worker-1"] == 0, explain(run)  # it kept its rank and finished the job
    assert codes["spare-0"] == -9, explain(run)


def test_a_migration_requested_near_the_last_step_ends_with_the_job(tmp_path, reference_digest):
    """Requested 2 steps before the end: it may switch in time or not, but the job must end
    at once either way (a switch phase whose vote never passed left the spare waiting for an
    average nobody serves, until the recovery timeout)."""
    ref = reference_digest(2)
    t0 = time.monotonic()
    run = livemig_run(tmp_path, 2, spares=1, faults=(f"migrate:rank=1:step={STEPS - 3}",))
    assert time.monotonic() - t0 < 40, explain(run)  # livemig_run's recovery timeout is 60 s
    assert_same_as_fault_free(run, ref)
    for mig in run.report["migrations"]:
        assert mig["outcome"] == "done" or mig.get("aborted") == "the job finished first", mig
    codes = exit_codes(run)
    assert codes["worker-0"] == 0 and codes["worker-1"] == 0 and codes["spare-0"] in (0, -15), explain(run)


def test_a_spare_that_falls_behind_loads_a_newer_snapshot(tmp_path, reference_digest):
    """The claimed spare stalls 3 s once its snapshot is loaded while the group trains on: by then the
    leaving worker no longer keeps the averaged gradients it needs (8 steps). It must load a
    newer snapshot and still switch in, exactly, instead of waiting until the job ends."""
    # 240 steps: the spare warms up beside the workers, stalls 3 s, loads a second snapshot and
    # replays; in 80 steps (~5 s) a loaded CI machine ended the job first, and with a 1.5 s stall
    # a loaded one (steps ~4x slower, two CI runs) trained fewer than 8 steps meanwhile
    longer = ["--steps", "240", *LONG[2:]]
    run = livemig_run(tmp_path, 2, spares=1, workload=longer,
                      faults=("migrate:rank=1:step=4", "spare-hang:during=snapshot:resume=3"))  # fmt: skip
    ref = reference_digest(2, workload=longer)
    assert run.rc == 0, explain(run)
    assert run.report["steps_completed"] == 240 and run.report["replicas_identical"], explain(run)
    assert run.report["state_digest"] == ref and not run.report["recoveries"], explain(run)
    (mig,) = run.report["migrations"]
    assert mig["outcome"] == "done" and mig["resyncs"] >= 1, mig
    codes = exit_codes(run)
    assert codes["worker-1"] == 0 and codes["spare-0"] == 0, explain(run)


def test_straggler_hook_migrates_a_slow_rank(tmp_path, reference_digest):
    # A batch whose forward+backward (~35 ms) is longer than the slowing's 17 ms run windows,
    # so each of the slowed rank's steps is stopped at least once, as a real straggler is slow
    # in every step: with a 7 ms step the SIGSTOP landed mostly in its collective wait, and a
    # CI machine's one-step hiccups of the healthy rank 0 got it migrated instead. The hook
    # judges the median of 3-step windows (coordinator/checks.py judge_windows).
    workload = ["--steps", "60", "--layers", "2", "--batch", "512"]
    run = livemig_run(tmp_path, 2, spares=1, faults=("slow:rank=1:step=2:factor=6",), workload=workload,
                      env={"LIVEMIG_STRAGGLER_FACTOR": "2.5", "LIVEMIG_STRAGGLER_STEPS": "3"})  # fmt: skip
    ref = reference_digest(2, workload=workload)
    assert run.rc == 0, explain(run)
    assert run.report["result"]["state"] == "done" and run.report["steps_completed"] == 60, explain(run)
    assert run.report["replicas_identical"], explain(run)
    assert run.report["state_digest"] == ref and not run.report["recoveries"], explain(run)
    (mig,) = run.report["migrations"]
    assert mig["outcome"] == "done" and mig["rank"] == 1 and mig["reason"].startswith("straggler"), mig
    assert exit_codes(run)["worker-1"] == 0, explain(run)


def test_migrate_command_on_a_running_job(tmp_path):
    """`livemig migrate` from another shell: a bad rank is rejected with a clear
    line, a good one moves the rank; the job finishes exact across replicas."""
    report = tmp_path / "report.json"
    env = dict(os.environ, LIVEMIG_STATE_DIR=str(tmp_path), LIVEMIG_RECOVERY_TIMEOUT="60")
    steps = ["--steps", "200", *WORKLOAD[2:]]
    job = subprocess.Popen([sys.executable, "-m", "livemig.cli", "run", "--nproc", "2", "--spares", "1", "--job",
                            "mig", "--report", str(report), "--lease-ttl", "2", MLP, *steps],
                           cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        cli = [sys.executable, "-m", "livemig.cli", "migrate", "--job", "mig", "--wait", "60"]
        deadline = time.monotonic() + 60
        while True:  # until the job has formed
            st = subprocess.run([sys.executable, "-m", "livemig.cli", "status", "--job", "mig", "--json"],
                                cwd=REPO, env=env, capture_output=True, text=True)  # fmt: skip
            if st.returncode == 0 and json.loads(st.stdout).get("generation", 0) >= 1:
                break
            assert time.monotonic() < deadline, st.stderr
            time.sleep(0.2)
        bad = subprocess.run([*cli, "--rank", "7"], cwd=REPO, env=env, capture_output=True, text=True, timeout=90)
        assert bad.returncode == 4 and "rejected: rank 7 is not a member" in bad.stdout, bad.stdout + bad.stderr
        good = subprocess.run([*cli, "--rank", "0"], cwd=REPO, env=env, capture_output=True, text=True, timeout=90)
        assert good.returncode == 0 and "rank 0 now runs on spare spare-0" in good.stdout, good.stdout + good.stderr
        out, _ = job.communicate(timeout=240)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    rep = json.loads(report.read_text())
    assert job.returncode == 0, out[-3000:]
    assert rep["steps_completed"] == 200 and rep["replicas_identical"], out[-3000:]
    (mig,) = rep["migrations"]
    assert mig["outcome"] == "done" and mig["rank"] == 0
