"""`livemig run --verify` says why (issue 50): both runs fingerprint every step
(runtime/prints.py), and a mismatch names the first step and rank where they parted, and
whether that is before the first fault (the reference itself is not reproducible) or after it
(state that did not move with the rank). tests/helpers/verify_proc.py makes each mistake."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.e2e.conftest import REPO, RUN_ENV

VERIFY = os.path.join(REPO, "tests", "helpers", "verify_proc.py")


def _verify(tmp_path, job: str, *args: str, fault: str = "kill:rank=1:step=6") -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "livemig.cli", "run", "--nproc", "2", "--spares", "1", "--job", job,
           "--lease-ttl", "2", "--fault", fault, "--verify", VERIFY, *args]  # fmt: skip
    env = {**os.environ, "LIVEMIG_STATE_DIR": str(tmp_path), **RUN_ENV}
    work = tmp_path / "work"  # the script's working directory (the state directory is elsewhere)
    work.mkdir(exist_ok=True)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=work)


def test_verify_names_the_step_and_the_cause(tmp_path):
    ok = _verify(tmp_path, "fine")
    assert ok.returncode == 0 and "bit-identical: yes" in ok.stdout, ok.stdout + ok.stderr
    assert "first difference" not in ok.stdout and "warning: the reference run wrote" not in ok.stderr

    r = _verify(tmp_path, "unseeded", "--unseeded")
    assert r.returncode == 1 and "bit-identical: no" in r.stdout, r.stdout + r.stderr
    assert "verify: first difference at step 0 on rank 0: the reference itself differs from step 0: is the " \
           "model seeded?" in r.stdout, r.stdout  # fmt: skip

    r = _verify(tmp_path, "cached", "--cached-rng")
    assert r.returncode == 1, r.stdout + r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("verify: first difference"))
    assert "step(s) after the fault of rank(s) [1] at step 6" in line and "not registered" in line, line
    step = int(line.split(" at step ")[1].split()[0])
    assert 6 < step <= 9, line  # the first step the spare drew data for, not the end of the run

    r = _verify(tmp_path, "own", "--own", "snap.pt")
    assert "warning: the reference run wrote snap.pt under the working directory" in r.stderr, r.stderr
    assert r.returncode == 1 and "first difference at step 0" in r.stdout, r.stdout


def test_a_shrunk_run_is_compared_rank_by_rank_and_is_bit_identical(tmp_path):
    """3 ranks, no spare, --min-nproc 2: rank 0 is lost at step 10 and carried by a survivor to
    the end. The carrier writes the carried rank's final record, so every rank is compared; a
    shrunk step reduces every rank's gradient in the full-width group (runtime/virtual.py
    reduce_exact), so even AdamW on examples/ddp_port.py (whose noise-gradient bias ended
    2.2e-4 off when the carrier summed first) ends bit for bit the fault-free run's."""
    import json

    report = tmp_path / "shrunk.json"
    cmd = [sys.executable, "-m", "livemig.cli", "run", "--nproc", "3", "--spares", "0", "--min-nproc", "2",
           "--job", "shrunk", "--lease-ttl", "2", "--report", str(report), "--fault", "kill:rank=0:step=10",
           "--verify", os.path.join(REPO, "examples", "ddp_port.py"), "--steps", "30"]  # fmt: skip
    env = {**os.environ, "LIVEMIG_STATE_DIR": str(tmp_path), **RUN_ENV}
    work = tmp_path / "work"
    work.mkdir()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=work)
    rep = json.loads(report.read_text())
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(rep["rank_digests"], key=int) == ["0", "1", "2"], rep["rank_digests"]  # rank 0's by its carrier
    assert rep["members"]["0"]["role"] == "carried", rep["members"]
    assert rep["shrunk"]["carried"] and rep["bit_identical"], rep.get("ranks_differing")
    assert "bit-identical: yes" in r.stdout and "bits may differ" not in r.stdout, r.stdout
