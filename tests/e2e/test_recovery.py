"""Live recovery end to end. The central assertion of every case: the final
state digest equals the fault-free run's, and every step completed."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import psutil

from livemig.coordinator.timeline import PHASES
from tests.e2e.conftest import MLP, REPO, STEPS, explain, livemig_run, reference_of


def assert_exact(run, reference: str, recoveries: int) -> None:
    rep = run.report
    assert run.rc == 0, explain(run)
    assert rep["result"]["state"] == "done", explain(run)
    assert rep["steps_completed"] == STEPS, explain(run)
    assert rep["replicas_identical"], explain(run)
    assert rep["state_digest"] == reference, "final state differs from the fault-free run\n" + explain(run)
    assert len(rep["recoveries"]) == recoveries, explain(run)
    for r in rep["recoveries"]:
        assert r["kind"] == "failure"
        assert set(r["phases"]) == set(PHASES)
        assert r["phases"]["fence"] > 0 and r["phases"]["claim"] > 0 and r["phases"]["build"] >= 0
        assert r["bytes_streamed"] > 0
        assert 0 <= r["downtime_s"] < 30


def test_kill_between_steps(tmp_path, reference_digest):
    ref = reference_digest(2)
    run = livemig_run(tmp_path, 2, spares=1, faults=("kill:rank=1:step=8",))
    assert_exact(run, ref, 1)
    assert run.report["recoveries"][0]["rank"] == 1
    assert "bit-identical" not in run.stdout  # --verify not asked
    # The killed worker was SIGKILLed; the spare finished as rank 1.
    procs = {p["name"]: p for p in run.report["processes"]}
    assert procs["worker-1"]["exit_code"] == -signal.SIGKILL
    assert procs["spare-0"]["exit_code"] == 0


def test_a_reference_run_is_made_once_for_every_process_sharing_the_store(references):
    """Budget: ~0 s (the key is the one test_kill_between_steps asks for). The store is on
    disk under an flock (livemig/references.py): a second cache on the same root, as
    another pytest-xdist worker or a bench has, finds the first's report without a run."""
    from livemig.references import References

    first = reference_of(references, 2)
    other = References(references.root)
    again = reference_of(other, 2)
    assert other.runs == 0 and again.report == first.report


def test_kill_inside_collective(tmp_path, reference_digest):
    ref = reference_digest(2)
    run = livemig_run(tmp_path, 2, spares=1, faults=("kill:rank=1:step=8:during=allreduce",))
    assert_exact(run, ref, 1)


def test_collective_completed_on_some_ranks_only(tmp_path, reference_digest):
    """Rank 2 dies after step 8's average completed everywhere but before it
    committed; rank 1 loses its completed average (drop_avg), rank 0 commits
    step 8. Agreement must resume at 9, and rank 1 must finish step 8 by
    fetching the averaged gradient from rank 0: not redo it, not skip it."""
    ref = reference_digest(3)
    run = livemig_run(tmp_path, 3, spares=1, faults=("kill:rank=2:step=8:during=before_commit",
                                                     "drop_avg:rank=1:step=8"))  # fmt: skip
    assert_exact(run, ref, 1)
    agree = [e for e in run.report["timeline"] if e["phase"] == "agree"]
    assert agree[0]["resume_step"] == 9 and agree[0]["sources"] == [0], agree
    logs = {p["name"]: p["log"] for p in run.report["processes"]}
    assert "fetched the averaged gradient" in open(logs["worker-1"]).read()


def test_two_failures_in_sequence_two_spares(tmp_path, reference_digest):
    ref = reference_digest(2)
    run = livemig_run(tmp_path, 2, spares=2, faults=("kill:rank=1:step=5", "kill:rank=0:step=14"))
    assert_exact(run, ref, 2)
    assert sorted(r["rank"] for r in run.report["recoveries"]) == [0, 1]


def test_failure_without_spare_fails_clearly(tmp_path):
    t0 = time.monotonic()
    run = livemig_run(tmp_path, 2, spares=0, faults=("kill:rank=1:step=5",), extra=("--spare-wait", "2"))
    assert run.rc != 0
    assert run.report["result"]["state"] == "failed"
    assert "no warm spare for rank(s) [1] within 2s" in run.report["result"]["reason"]
    assert "livemig-spare start" in run.stdout
    assert time.monotonic() - t0 < 90


def test_hung_worker_is_fenced_and_stops_itself(tmp_path, reference_digest):
    """SIGSTOP rank 1 past its lease TTL (1 s): it is fenced and replaced;
    SIGCONT it later: it finds itself fenced and exits (code 3) without
    serving state or rejoining."""
    ref = reference_digest(2)
    run = livemig_run(tmp_path, 2, spares=1, faults=("hang:rank=1:step=6:resume=5",),
                      workload=["--steps", "60", "--layers", "2", "--batch", "32"])  # fmt: skip
    rep = run.report
    assert run.rc == 0, explain(run)
    assert rep["steps_completed"] == 60 and rep["replicas_identical"], explain(run)
    assert len(rep["recoveries"]) == 1, explain(run)
    procs = {p["name"]: p for p in rep["processes"]}
    assert procs["worker-1"]["exit_code"] == 3, explain(run)
    log = open(procs["worker-1"]["log"]).read()
    assert any(why in log for why in ("must stop: fenced in generation", "must stop: lease lost", "is fenced: it was "
                                      "replaced")), log[-2000:]  # fmt: skip
    # Digest of a 60-step fault-free run: same workload, no faults.
    ref60 = livemig_run(tmp_path, 2, job="ref60", workload=["--steps", "60", "--layers", "2", "--batch", "32"])
    assert ref60.rc == 0 and ref60.report["state_digest"] == rep["state_digest"], explain(ref60)
    del ref


def test_spare_with_different_model_is_refused(tmp_path, procs):
    """A spare built with another model is refused at claim time with an error
    naming the first mismatch; a matching spare started later is claimed."""
    env = dict(os.environ, LIVEMIG_STATE_DIR=str(tmp_path), PYTHONPATH=REPO)
    job = subprocess.Popen(
        [sys.executable, "-m", "livemig.cli", "run", "--nproc", "2", "--job", "mis", "--lease-ttl", "2",
         "--report", str(tmp_path / "r.json"), MLP, "--steps", "400", "--layers", "2", "--batch", "32"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    procs.procs.append(job)
    line = job.stdout.readline()
    assert "livemig: job mis" in line, line
    bad = procs.spawn([sys.executable, "-m", "livemig.spare_pool.cli", "start", "--job", "mis", "--id", "bad",
                       MLP, "--steps", "400", "--layers", "2", "--batch", "32", "--width", "512"], env=env)  # fmt: skip
    from livemig.agent.jobs import connect
    from livemig.rdzv.keys import JobKeys

    os.environ["LIVEMIG_STATE_DIR"] = str(tmp_path)
    try:
        client = connect("mis", None, timedelta(seconds=5))
    finally:
        del os.environ["LIVEMIG_STATE_DIR"]
    keys = JobKeys("mis")
    deadline = time.time() + 60
    while client.get(keys.spare("bad")) is None and time.time() < deadline:
        time.sleep(0.1)
    assert client.get(keys.spare("bad")) is not None, "the bad spare never registered"
    from livemig.rdzv.membership import Rendezvous

    # a spare may be warm before the job formed (it waits for the run, not the formation)
    m = Rendezvous(client, "mis").read()
    while 1 not in m.members and time.time() < deadline:
        time.sleep(0.1)
        m = Rendezvous(client, "mis").read()
    assert 1 in m.members, "the job never formed"
    assert client.get(keys.result) is None, "the job ended before the fault: make it longer"
    os.kill(m.members[1].pid, signal.SIGKILL)
    out, err = bad.communicate(timeout=60)
    assert bad.returncode == 2
    assert (
        "refused by the job" in err.decode()
        and "entry 0: job has 0.weight float32(1024, 1024), spare has 0.weight float32(512, 512)" in err.decode()
    ), err.decode()
    # --detach: livemig-spare goes to the background with its spare (it stays the spare's agent)
    good = subprocess.run([sys.executable, "-m", "livemig.spare_pool.cli", "start", "--detach", "--job", "mis",
                           "--id", "good", MLP, "--steps", "400", "--layers", "2", "--batch", "32"],
                          env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert good.returncode == 0 and "under agent pid" in good.stdout, good.stdout + good.stderr
    agent = int(good.stdout.split("under agent pid ")[1].split()[0])
    try:
        rest, _ = job.communicate(timeout=180)
        assert job.returncode == 0, line + rest
        deadline = time.time() + 30  # the detached agent and its spare end with the job
        while psutil.pid_exists(agent) and psutil.Process(agent).status() != psutil.STATUS_ZOMBIE:
            assert time.time() < deadline, "the detached livemig-spare outlived the job"
            time.sleep(0.2)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(agent, signal.SIGKILL)
    import json

    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["steps_completed"] == 400 and rep["replicas_identical"]
    assert len(rep["recoveries"]) == 1
