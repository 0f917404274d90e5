"""Leader election with real processes: failover within one TTL, old leader fenced."""

from __future__ import annotations

import os
import signal
import time

from livemig.rdzv.client import EtcdClient, decode
from livemig.rdzv.election import LeaderElection

HELPER = os.path.join(os.path.dirname(__file__), "..", "helpers", "rdzv_proc.py")


def _leader_proc(procs, etcd, name):
    return procs.python(HELPER, "leader", "--etcd", etcd.endpoints, "--job", "elect", "--name", name, "--ttl", "1")


def test_leader_failover_within_ttl(etcd, procs):
    a = _leader_proc(procs, etcd, "a")
    assert a.stdout.readline().startswith(b"leader")
    b = _leader_proc(procs, etcd, "b")
    client = EtcdClient(etcd.endpoints)
    time.sleep(1.0)
    assert client.get("/livemig/elect/leader").value == b"a"
    os.killpg(a.pid, signal.SIGKILL)
    t_kill = time.time()
    line = b.stdout.readline().split()
    assert line[0] == b"leader"
    took = float(line[1]) - t_kill
    assert took <= 1 + 0.75, f"standby took {took:.2f}s to lead (TTL 1 s)"
    assert b.stdout.readline().strip() == b"write True"
    assert decode(client.get("/livemig/elect/lastwriter").value) == "b"


def test_deposed_leader_writes_refused(etcd):
    c1, c2 = EtcdClient(etcd.endpoints), EtcdClient(etcd.endpoints)
    old = LeaderElection(c1, "depose", "old", ttl_s=1)
    assert old.try_acquire()
    guard = old.guard()
    # The old leader is "paused" past its TTL: stop renewing and let it lapse.
    old.keeper._stop.set()
    new = LeaderElection(c2, "depose", "new", ttl_s=1)
    new.campaign(timeout=5)
    ok, _ = c1.txn([guard], [c1.txn_ops.put("/livemig/depose/x", b"old")])
    assert not ok, "a deposed leader's write went through"
    ok, _ = c2.txn([new.guard()], [c2.txn_ops.put("/livemig/depose/x", b"new")])
    assert ok


def test_a_coordinator_whose_leader_key_was_deleted_steps_down_and_leads_again(etcd, procs, tmp_path):
    """Every write of a coordinator is guarded by its leader key: once the key is gone each
    of them fails, pass after pass. It must notice, step down and campaign again."""
    import subprocess

    from livemig.rdzv.keys import JobKeys

    out = open(tmp_path / "coordinator.log", "wb")  # noqa: SIM115 - closed below
    procs.python("-m", "livemig.coordinator", "--etcd", etcd.endpoints, "--job", "lk", "--world-size", "2",
                 stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    client = EtcdClient(etcd.endpoints)
    key = JobKeys("lk").leader
    deadline = time.monotonic() + 30
    while (first := client.get(key)) is None:
        assert time.monotonic() < deadline, (tmp_path / "coordinator.log").read_text()
        time.sleep(0.1)
    client.delete(key)
    deadline = time.monotonic() + 5
    while (again := client.get(key)) is None:
        assert time.monotonic() < deadline, "the coordinator never took the lead again\n" + (
            tmp_path / "coordinator.log").read_text()  # fmt: skip
        time.sleep(0.05)
    out.close()
    assert again.value == first.value and again.lease != first.lease  # the same candidate, a new term
    assert "stepping down" in (tmp_path / "coordinator.log").read_text()
