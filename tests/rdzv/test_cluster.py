"""A 3-member etcd cluster: survive one member's death, fail clearly without quorum."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

from livemig.errors import EtcdUnavailableError
from livemig.rdzv.client import EtcdClient
from livemig.rdzv.membership import Membership, Rendezvous
from livemig.rdzv.watch import PrefixWatch


def test_one_member_down_nothing_lost_then_quorum_loss(etcd3):
    client = EtcdClient(etcd3.endpoints, timedelta(seconds=4))
    rdzv = Rendezvous(client, "ha")
    seen: list[int] = []
    lock = threading.Lock()

    def on_events(events):
        with lock:
            seen.extend(int(e.value) for e in events if e.key == rdzv.keys.generation)

    _, rev = client.get_prefix(rdzv.keys.prefix)
    watch = PrefixWatch(client, rdzv.keys.prefix, on_events, start_revision=rev + 1)
    keeper = rdzv.register(rdzv.keys.member(0), {"rank": 0}, "w0", ttl_s=2)

    stop = threading.Event()
    bumps: list[int] = []

    def bumper():
        while not stop.is_set():
            g = rdzv.generation()
            if rdzv.commit_change(g, Membership()):
                bumps.append(g + 1)
            time.sleep(0.01)

    t = threading.Thread(target=bumper)
    t.start()
    time.sleep(0.5)
    # Kill the member this client is talking to, to force a real failover.
    current = client.raw.endpoint_in_use.netloc
    idx = next(i for i, m in enumerate(etcd3.members) if m.client_url.endswith(current))
    etcd3.kill_member(idx)
    time.sleep(2.0)
    stop.set()
    t.join(timeout=10)
    final = rdzv.generation()
    assert bumps == list(range(1, final + 1)), "a CAS bump was lost or duplicated"
    deadline = time.time() + 5
    while time.time() < deadline:
        with lock:
            if seen and seen[-1] == final:
                break
        time.sleep(0.05)
    with lock:
        assert seen == list(range(1, final + 1)), "the watch lost or repeated events"
    assert watch.reconnects >= 1, "the watch never had to fail over"
    assert client.get(rdzv.keys.member(0)) is not None, "registration lost during failover"
    assert not keeper.lost.is_set()

    # Second member down: no quorum. Calls fail clearly, within their timeout.
    others = [i for i in range(3) if i != idx]
    etcd3.kill_member(others[0])
    short = EtcdClient(etcd3.all_endpoints(), timedelta(seconds=2))
    t0 = time.monotonic()
    with pytest.raises(EtcdUnavailableError, match="quorum"):
        short.put("/livemig/ha/x", b"1")
    assert time.monotonic() - t0 < 2.0 + 1.5

    # A member returns: quorum is back and calls succeed again.
    etcd3.restart_member(idx)
    etcd3.wait_healthy(20)
    short.put("/livemig/ha/x", b"2")
    assert short.get("/livemig/ha/x").value == b"2"
    watch.cancel()
    keeper.stop()
