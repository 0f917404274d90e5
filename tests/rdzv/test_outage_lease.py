"""A registration rides through an etcd outage (every member SIGSTOPped for 3 x its
TTL): its owner is not told it is lost, and once etcd answers the expired lease is
replaced and the key put back. A lease without an outage budget (the leader's) is
lost as before, and a revoked lease (a fence) is lost at once."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

from livemig.config import Timeouts
from livemig.errors import EtcdUnavailableError
from livemig.rdzv.client import EtcdClient, decode, through_outage
from livemig.rdzv.embedded import EtcdCluster
from livemig.rdzv.lease import LeaseKeeper
from livemig.rdzv.membership import Rendezvous

TTL = 1


@pytest.fixture
def own_etcd():
    with EtcdCluster(size=1) as cluster:
        yield cluster


def _outage(cluster: EtcdCluster, seconds: float) -> None:
    cluster.pause()
    try:
        time.sleep(seconds)
    finally:
        cluster.resume()


def test_registration_is_reattached_after_an_outage(own_etcd):
    client = EtcdClient(own_etcd.endpoints, timedelta(seconds=2))
    rdzv = Rendezvous(client, "outage", Timeouts(etcd_outage=timedelta(seconds=20)))
    lost = threading.Event()
    keeper = rdzv.register(rdzv.keys.member(0), {"rank": 0, "incarnation": "w0"}, "w0",
                           on_lost=lambda r: lost.set(), ttl_s=TTL)  # fmt: skip
    leader = LeaseKeeper(client, TTL, name="leader")  # no budget: an outage loses it
    first = keeper.lease_id
    _outage(own_etcd, 3 * TTL + 1)
    deadline = time.monotonic() + 10
    while keeper.outages == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert keeper.outages == 1 and not lost.is_set(), keeper.lost_reason
    assert keeper.lease_id != first  # the old lease expired with etcd stopped: a new one
    kv = client.get(rdzv.keys.member(0))
    assert kv is not None and kv.lease == keeper.lease_id and decode(kv.value)["rank"] == 0
    assert leader.lost.is_set()
    time.sleep(2 * TTL)  # the new lease is kept alive
    assert client.get(rdzv.keys.member(0)) is not None and not lost.is_set()
    keeper.stop()


def test_a_fenced_owner_does_not_reregister_after_an_outage(own_etcd):
    """Fenced (the fence key written, its lease left to expire) just before etcd stops:
    the re-attach is a fenced write, so the owner learns it is fenced instead."""
    client = EtcdClient(own_etcd.endpoints, timedelta(seconds=2))
    rdzv = Rendezvous(client, "outage2", Timeouts(etcd_outage=timedelta(seconds=20)))
    lost: list[str] = []
    keeper = rdzv.register(rdzv.keys.member(0), {"rank": 0}, "w1", on_lost=lost.append, ttl_s=TTL)
    client.put(rdzv.keys.fenced("w1"), b"1")
    _outage(own_etcd, 3 * TTL + 1)
    deadline = time.monotonic() + 10
    while not lost and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lost and "re-register" in lost[0] and "fenced" in lost[0], lost
    assert keeper.outages == 0 and client.get(rdzv.keys.member(0)) is None
    keeper.stop()


def test_a_registration_made_during_an_outage_lands_once_etcd_is_back(own_etcd):
    """A spare that finishes warming up while etcd is stopped registers once etcd answers
    (through_outage), instead of exiting with "etcd unreachable"."""
    client = EtcdClient(own_etcd.endpoints, timedelta(seconds=1))
    rdzv = Rendezvous(client, "outage3", Timeouts(etcd_outage=timedelta(seconds=20)))
    key = rdzv.keys.spare("s0")
    own_etcd.pause()
    try:
        with pytest.raises(EtcdUnavailableError):  # one call alone gives up after its timeout
            rdzv.register(key, {"state": "warm"}, "s0", ttl_s=TTL)
        done: list = []
        t = threading.Thread(target=lambda: done.append(
            through_outage(lambda: rdzv.register(key, {"state": "warm"}, "s0", ttl_s=TTL), 20, "test")))  # fmt: skip
        t.start()
        time.sleep(2.5)
        assert not done  # still waiting for etcd
    finally:
        own_etcd.resume()
    t.join(timeout=15)
    assert done, "the registration did not land after etcd came back"
    kv = client.get(key)
    assert kv is not None and kv.lease == done[0].lease_id
    done[0].stop()


def test_through_outage_gives_up_after_its_budget(own_etcd):
    client = EtcdClient(own_etcd.endpoints, timedelta(seconds=1))
    own_etcd.pause()
    try:
        t0 = time.monotonic()
        with pytest.raises(EtcdUnavailableError):
            through_outage(lambda: client.get("/x"), 2.0, "test")
        # at least the budget; the upper bound only proves it gave up (not the test's timeout):
        # on a loaded machine the last 1 s call returns seconds late (6 s failed under stress.sh)
        assert 2.0 <= time.monotonic() - t0 < 20.0
    finally:
        own_etcd.resume()


def test_a_lease_stopped_while_its_renewal_is_in_flight_is_not_lost(etcd):
    """A claimed spare stops (and revokes) its spare lease while the keeper's thread may
    be inside a renewal; that renewal then finds the lease gone. Before the fix the
    keeper reported it lost, and the spare, just claimed, stopped itself (CI, stop 26:
    test_zero1_kill_between_steps failed with "no warm spare"). Forced here: the renewal
    waits until stop() has revoked the lease, then asks a real etcd."""
    client = EtcdClient(etcd.endpoints, timedelta(seconds=2))
    in_renewal, revoked = threading.Event(), threading.Event()
    real = client.keepalive_once

    def renewal_across_the_revoke(lease_id: int) -> int:
        in_renewal.set()
        assert revoked.wait(10)
        return real(lease_id)

    client.keepalive_once = renewal_across_the_revoke  # type: ignore[method-assign]
    lost: list[str] = []
    keeper = LeaseKeeper(client, 3, lost.append, name="spares")
    assert in_renewal.wait(10)  # the thread is inside a renewal (one per ttl / 3 = 1 s)
    keeper.stop(revoke=True)
    revoked.set()
    keeper._thread.join(10)
    assert real(keeper.lease_id) <= 0, "the lease was revoked"
    assert not keeper.lost.is_set() and lost == []


def test_a_lease_stopped_while_it_is_reattached_is_revoked_too(etcd):
    """After an outage in which its lease expired, the keeper grants a new lease and the
    owner re-registers under it. A stop(revoke=True) during that re-attach revoked the
    lease it saw, the old one, and the new one kept the re-registered keys alive for a
    TTL (a claimed spare still listed as a spare). Forced here: the re-attach waits until
    stop() has returned; the key written under the new lease must then be gone."""
    client = EtcdClient(etcd.endpoints, timedelta(seconds=2))
    real = client.keepalive_once
    first = threading.Event()

    def renewal_after_an_outage(lease_id: int) -> int:
        if not first.is_set():  # the first renewal fails, and the lease expires meanwhile
            first.set()
            client.revoke(lease_id)
            raise EtcdUnavailableError("etcd unreachable (test)")
        return real(lease_id)

    client.keepalive_once = renewal_after_an_outage  # type: ignore[method-assign]
    in_reattach, stopped = threading.Event(), threading.Event()

    def reattach(lease: int) -> None:
        client.put("/test/spare", b"listed", lease=lease)
        in_reattach.set()
        assert stopped.wait(10)

    keeper = LeaseKeeper(client, 3, name="spares", outage_budget_s=30.0, reattach=reattach)
    assert in_reattach.wait(15)
    keeper.stop(revoke=True)
    stopped.set()
    keeper._thread.join(10)
    assert not keeper._thread.is_alive()
    assert client.get("/test/spare") is None, "the re-attached lease outlived stop(revoke=True)"
    assert not keeper.lost.is_set()
