"""Generation CAS, fencing and leases against a real etcd."""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta

import pytest

from livemig.errors import FencedError, StaleGenerationError
from livemig.rdzv.client import EtcdClient, encode
from livemig.rdzv.membership import Member, Membership, Rendezvous, new_incarnation
from livemig.rdzv.watch import PrefixWatch

HELPER = os.path.join(os.path.dirname(__file__), "..", "helpers", "rdzv_proc.py")


def test_concurrent_cas_one_winner_per_round(etcd, procs):
    """8 processes race to bump one generation: every value is won exactly once."""
    start_at = time.time() + 4.0  # all processes are up and connected by then
    children = [
        procs.python(HELPER, "cas_race", "--etcd", etcd.endpoints, "--job", "race",
                     "--name", f"p{i}", "--rounds", "10", "--start-at", str(start_at))
        for i in range(8)
    ]  # fmt: skip
    won: list[int] = []
    for c in children:
        out, err = c.communicate(timeout=120)
        assert c.returncode == 0, err.decode()
        won += [int(x) for x in out.split()]
    rdzv = Rendezvous(EtcdClient(etcd.endpoints), "race")
    final = rdzv.generation()
    assert final == 80
    assert sorted(won) == list(range(1, 81)), "a generation was won twice or lost"


def test_fenced_zombie_cannot_write(etcd):
    client = EtcdClient(etcd.endpoints)
    rdzv = Rendezvous(client, "fence")
    zombie, other = new_incarnation("worker"), new_incarnation("worker")
    m = Membership(world_size=2, members={0: Member(0, other), 1: Member(1, zombie)})
    assert rdzv.commit_change(0, m)
    g = rdzv.generation()
    rdzv.fenced_put(g, zombie, rdzv.keys.progress(1), encode({"step": 1}))  # allowed at g

    # The coordinator fences the zombie in generation g+1.
    m2 = Membership(world_size=2, members={0: Member(0, other)}, reason="test")
    assert rdzv.commit_change(g, m2, fence=[zombie])
    with pytest.raises(FencedError, match="fenced"):
        rdzv.fenced_put(g, zombie, rdzv.keys.progress(1), encode({"step": 2}))
    # A stale CAS from the zombie's view also fails.
    assert not rdzv.commit_change(g, Membership(reason="zombie"))

    # It reconnects with a new client and the current generation: still fenced.
    client2 = EtcdClient(etcd.endpoints)
    rdzv2 = Rendezvous(client2, "fence")
    with pytest.raises(FencedError):
        rdzv2.fenced_put(rdzv2.generation(), zombie, rdzv2.keys.progress(1), b"x")
    with pytest.raises(FencedError):
        rdzv2.register(rdzv2.keys.member(1), {"rank": 1}, zombie)
    # An unfenced member with a stale generation gets the stale error.
    with pytest.raises(StaleGenerationError):
        rdzv2.fenced_put(g, other, rdzv2.keys.progress(0), b"x")
    kv = client2.get(rdzv2.keys.progress(1))
    assert kv is not None and b"\x02" not in kv.value[-1:]  # step 2 never landed


def test_lease_expiry_removes_registration_and_fires_watch(etcd, procs):
    client = EtcdClient(etcd.endpoints)
    rdzv = Rendezvous(client, "lease")
    child = procs.python(
        HELPER,
        "register",
        "--etcd",
        etcd.endpoints,
        "--job",
        "lease",
        "--ttl",
        "1",
        "--rank",
        "3",
        "--name",
        new_incarnation("worker"),
    )
    assert child.stdout.readline().strip() == b"registered"
    assert client.get(rdzv.keys.member(3)) is not None
    deleted = threading.Event()
    _, rev = client.get_prefix(rdzv.keys.members_prefix)

    def on_events(events):
        if any(e.kind == "delete" and e.key == rdzv.keys.member(3) for e in events):
            deleted.set()

    watch = PrefixWatch(client, rdzv.keys.members_prefix, on_events, start_revision=rev + 1)
    time.sleep(2.5)  # keep-alive holds it well past one TTL
    assert client.get(rdzv.keys.member(3)) is not None, "keep-alive did not renew the lease"
    os.killpg(child.pid, signal.SIGKILL)
    t0 = time.monotonic()
    assert deleted.wait(timeout=1 + 1 + 0.5), "registration outlived TTL + 1 s"
    assert time.monotonic() - t0 <= 2.0 + 0.5
    assert client.get(rdzv.keys.member(3)) is None
    watch.cancel()


def test_lease_loss_reported_to_owner(etcd):
    client = EtcdClient(etcd.endpoints)
    rdzv = Rendezvous(client, "loss")
    lost = threading.Event()
    keeper = rdzv.register(rdzv.keys.member(0), {"rank": 0}, "w0", on_lost=lambda r: lost.set(), ttl_s=1)
    client.revoke(keeper.lease_id)  # what a fence does
    assert lost.wait(3), "owner was not told its lease is gone"
    keeper.stop()


def test_generation_record_roundtrip_large_world(etcd):
    """A 4096-rank member table fits one value and one transaction."""
    client = EtcdClient(etcd.endpoints, timedelta(seconds=10))
    rdzv = Rendezvous(client, "big")
    members = {
        r: Member(r, f"worker-host{r}-{r}-abcdef12", f"host{r}", 1000 + r, f"tcp://10.0.{r // 256}.{r % 256}:29500")
        for r in range(4096)
    }
    m = Membership(world_size=4096, members=members)
    assert rdzv.commit_change(0, m, fence=[f"old-{i}" for i in range(100)])
    back = rdzv.read()
    assert back.generation == 1 and back.world_size == 4096
    assert back.members[4095] == members[4095]


def test_the_head_of_10000_ranks_is_small_and_every_row_comes_back_field_for_field():
    """The head does not grow with the world (a member receives it on every change) and a
    row is small with realistic records (DNS host names, incarnations and addresses that name
    them, claimed spares): packed and read back, field for field, through the versions."""
    import os

    from livemig.rdzv import roster
    from livemig.rdzv.membership import Member, Membership

    members = {}
    for r in range(10_000):
        host = f"gpu-node-{r // 8:05d}.rack{r // 512:02d}.training.example-cluster.internal"
        role, pre = ("spare", "spare") if r % 97 == 0 else ("worker", "worker")
        inc = f"{pre}-{host}-{100000 + r}-{os.urandom(4).hex()}"
        members[r] = Member(r, inc, host, 200000 + r, f"tcp://{host}:{40000 + r % 20000}", role,
                            f"spare-{host}-abc123" if role == "spare" else "",
                            None if role == "spare" else r // 8)  # fmt: skip
    members[7] = Member(7, "odd-incarnation", "h", 1, "ipc:///tmp/x", "observer", "", None)  # no pattern: kept whole
    m = Membership(generation=12, state="committed", world_size=10_000, members=members, store="10.0.0.1:29500",
                   sources=[r for r in range(10_000) if r != 4321])  # fmt: skip
    packed = roster.rows_of(members)
    m.rows = {"n": len(packed), "digest": roster.digest(packed)}
    head = m.to_bytes()
    assert len(head) < 600, f"{len(head)} bytes"  # every source listed as two runs, not 9,999 numbers
    stored = [(r, roster.encode_versions([[3, row]])) for r, row in packed.items()]
    assert max(len(v) for _, v in stored) < 200
    back = Membership.assemble(head, stored)
    assert back.members == members and back.generation == 12 and back.sources == m.sources
