"""First contact: a script that fails before it trains ends `livemig run` at once, with
the reason on screen, instead of waiting for --max-wall (issue 30, item 1). CI budget ~25 s."""

from __future__ import annotations

import os
import time

import pytest

from tests.e2e.conftest import REPO, explain, livemig_run

BROKEN = os.path.join(REPO, "tests", "helpers", "broken")


@pytest.mark.parametrize(
    "script,line,bound",
    [
        ("syntax_error.py.txt", "SyntaxError: ", 10),
        ("raises_at_import.py", "RuntimeError: boom at import", 10),
        # the worker imports torch and builds its model first: a little longer on 2 busy cores
        ("never_trains.py", "returned without running `for step in ctx.steps(n)`", 15),
    ],
    ids=["syntax-error", "raises-at-import", "never-trains"],
)
def test_a_script_that_fails_before_training_ends_the_run_at_once(tmp_path, script, line, bound):
    t0 = time.monotonic()
    run = livemig_run(tmp_path, 2, spares=1, script=os.path.join(BROKEN, script), workload=[], timeout=120)
    took = time.monotonic() - t0
    assert run.rc != 0, explain(run)
    assert line in run.stdout + run.stderr, explain(run)
    assert took < bound, f"took {took:.1f}s"
    if script != "never_trains.py":  # that one ends through the worker's own error, as a misuse does
        assert "before the job formed" in run.stdout, explain(run)
        assert "no final state: no rank finished the job" in run.stdout


def test_inject_spare_hang_stops_a_spare_and_wedge_is_refused(tmp_path):
    """`livemig inject spare-hang` SIGSTOPs a spare (it used to SIGKILL worker R); wedge and
    break, which only land inside a worker's step, are refused with one line."""
    import signal
    import subprocess
    import sys

    import psutil

    env = dict(os.environ, LIVEMIG_STATE_DIR=str(tmp_path))
    cli = [sys.executable, "-m", "livemig.cli"]
    argv = [*cli, "run", "--nproc", "2", "--spares", "1", "--job", "sh", "--lease-ttl", "2",
            os.path.join(REPO, "examples", "mlp.py"), "--steps", "100000", "--layers", "1"]  # fmt: skip
    job = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        r = subprocess.run([*cli, "inject", "wedge", "--job", "sh", "--rank", "1"], env=env, capture_output=True,
                           text=True, timeout=60)  # fmt: skip
        assert r.returncode == 2 and "livemig run --fault wedge:rank=R:step=S" in r.stderr, r.stderr
        deadline, out = time.monotonic() + 90, None
        while time.monotonic() < deadline:  # until the spare is warm (registered in the pool)
            r = subprocess.run([*cli, "inject", "spare-hang", "--job", "sh"], env=env, capture_output=True,
                               text=True, timeout=60)  # fmt: skip
            if r.returncode == 0:
                out = r.stdout
                break
            time.sleep(0.5)
        assert out, r.stderr
        pid = int(out.split("pid ")[1].split()[0])
        proc = psutil.Process(pid)
        assert proc.status() == psutil.STATUS_STOPPED, proc.status()
        assert proc.environ().get("LIVEMIG_ROLE") == "spare"
        os.kill(pid, signal.SIGCONT)
    finally:
        os.killpg(job.pid, signal.SIGINT)
        try:
            job.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
