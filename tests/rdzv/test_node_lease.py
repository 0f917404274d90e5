"""A registration under the node agent's lease (rdzv/lease.py NodeLease, --node-leases) on a
real etcd: it follows the agent's new lease after a re-attach, a fenced process cannot put its
key back (it learns it is fenced), and dropping it never removes a replacement's key."""

from __future__ import annotations

import threading
import time

from livemig.rdzv.client import EtcdClient, decode
from livemig.rdzv.lease import NodeLease, write_node_lease
from livemig.rdzv.membership import Rendezvous
from livemig.rdzv.writes import Writes


def _until(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_a_registration_follows_the_nodes_new_lease_and_a_fenced_one_learns_it(etcd, tmp_path):
    client = EtcdClient(etcd.endpoints)
    rdzv = Rendezvous(client, "node-lease")
    path = str(tmp_path / "node-lease")
    first = client.grant(30)
    write_node_lease(path, first)
    key = rdzv.keys.member(0)
    reg = rdzv.register(key, {"incarnation": "w0", "rank": 0}, "w0", node_lease_file=path)
    try:
        assert isinstance(reg, NodeLease) and client.get(key).lease == first
        # an etcd outage outlived the node lease: its keys went with it, the agent wrote a new one
        client.revoke(first)
        assert client.get(key) is None
        second = client.grant(30)
        write_node_lease(path, second)
        assert _until(lambda: (kv := client.get(key)) is not None and kv.lease == second)
        assert reg.lease_id == second and reg.outages == 1 and not reg.lost.is_set()
    finally:
        reg.stop(revoke=True)
    assert client.get(key) is None  # dropped: it was still ours

    # fenced meanwhile: the re-put is refused and the owner learns it
    lost: list[str] = []
    got = threading.Event()
    reg2 = rdzv.register(key, {"incarnation": "w1", "rank": 0}, "w1", node_lease_file=path,
                         on_lost=lambda why: (lost.append(why), got.set()))  # fmt: skip
    client.put(rdzv.keys.fenced("w1"), b"{}")
    write_node_lease(path, client.grant(30))
    assert got.wait(5) and reg2.lost.is_set() and "fenced" in lost[0].lower(), lost
    reg2.stop(revoke=False)


def test_dropping_a_fenced_registration_keeps_a_replacements_key(etcd, tmp_path):
    """The coordinator's drop (a fence under a shared lease) and the registration's own stop
    delete the key only as they read or put it."""
    client = EtcdClient(etcd.endpoints)
    rdzv = Rendezvous(client, "node-lease-drop")
    path = str(tmp_path / "node-lease")
    write_node_lease(path, client.grant(30))
    key = rdzv.keys.member(1)
    old = rdzv.register(key, {"incarnation": "w1", "rank": 1}, "w1", node_lease_file=path)
    read = client.get(key)
    new = rdzv.register(key, {"incarnation": "s0", "rank": 1}, "s0")  # the spare that took rank 1
    try:
        Writes(client, rdzv, lambda: []).drop(read)
        old.stop(revoke=True)
        assert (decode(client.get(key).value) or {}).get("incarnation") == "s0"
        Writes(client, rdzv, lambda: []).drop(client.get(key))  # as read now: it goes
        assert client.get(key) is None
    finally:
        old.stop(revoke=False)
        new.stop(revoke=True)
