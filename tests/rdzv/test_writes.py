"""The leader's named writes (livemig/rdzv/writes.py) on a real etcd: each is refused once the
leadership is gone, a claim is refused when its spare changed since it was read, and a record
put only if absent has one winner."""

from __future__ import annotations

from livemig.rdzv.client import EtcdClient, decode
from livemig.rdzv.election import LeaderElection
from livemig.rdzv.membership import GenState, Member, Membership, Rendezvous
from livemig.rdzv.writes import Claim, Delete, Put, Writes, delete_prefix_if, put_if_absent


def _leader(etcd, job: str) -> tuple[EtcdClient, Rendezvous, LeaderElection, Writes]:
    client = EtcdClient(etcd.endpoints)
    rdzv = Rendezvous(client, job)
    election = LeaderElection(client, job, "leader-a", ttl_s=2)
    assert election.try_acquire()
    return client, rdzv, election, Writes(client, rdzv, election.guard)


def test_a_deposed_leader_writes_nothing(etcd):
    client, rdzv, election, w = _leader(etcd, "w-deposed")
    m = Membership(state=GenState.FORMING, world_size=1, members={0: Member(0, "w0")})
    assert w.first_generation(m, extra=[Put(rdzv.keys.config, {"world_size": 1})])
    assert rdzv.read().generation == 1 and decode(client.get(rdzv.keys.config).value) == {"world_size": 1}
    assert w.record(Put(rdzv.keys.result, {"state": "x"}), Delete(rdzv.keys.config))
    assert client.get(rdzv.keys.config) is None
    client.delete(rdzv.keys.leader)  # an operator (or a restore) took the key: every write is refused
    assert not w.record(Put(rdzv.keys.result, {"state": "y"}))
    new = Membership(state=GenState.RECOVERING, world_size=1, members={})
    assert not w.new_generation(1, new, fence=["w0"])
    assert rdzv.read().generation == 1 and not rdzv.is_fenced("w0")
    election.resign()


def test_a_claim_is_refused_when_its_spare_changed_since_it_was_read(etcd):
    client, rdzv, election, w = _leader(etcd, "w-claim")
    keys = rdzv.keys
    m = Membership(state=GenState.COMMITTED, world_size=2, members={0: Member(0, "w0")})
    assert w.first_generation(m)
    client.put(keys.spare("s1"), b'{"state": "warm"}')
    kv = client.get(keys.spare("s1"))
    client.put(keys.spare("s1"), b'{"state": "warm", "again": 1}')  # re-registered after the read
    m = rdzv.read()
    claim = Claim(kv, keys.assignment("s1"), {"generation": 1, "rank": 1}, {"state": "claimed"})
    assert not w.update_generation(Membership(generation=1, state=GenState.BUILDING, world_size=2,
                                              members=dict(m.members)), claims=[claim])  # fmt: skip
    assert rdzv.read().state == GenState.COMMITTED and client.get(keys.assignment("s1")) is None
    fresh = Claim(client.get(keys.spare("s1")), keys.assignment("s1"), {"generation": 1, "rank": 1},
                  {"state": "claimed"})  # fmt: skip
    assert w.update_generation(Membership(generation=1, state=GenState.BUILDING, world_size=2,
                                          members=dict(m.members)), claims=[fresh])  # fmt: skip
    assert rdzv.read().state == GenState.BUILDING
    assert decode(client.get(keys.assignment("s1")).value) == {"generation": 1, "rank": 1}
    assert decode(client.get(keys.spare("s1")).value) == {"state": "claimed"}
    election.resign()


def test_a_record_put_if_absent_has_one_winner(etcd):
    client = EtcdClient(etcd.endpoints)
    assert put_if_absent(client, "/livemig/w-once/result", {"state": "failed"})
    assert not put_if_absent(client, "/livemig/w-once/result", {"state": "done"})
    assert decode(client.get("/livemig/w-once/result").value) == {"state": "failed"}
    run = client.get("/livemig/w-once/result")
    client.put("/livemig/w-once/result", b"changed")
    assert not delete_prefix_if(client, "/livemig/w-once/", "/livemig/w-once/result", run)  # changed since
    assert delete_prefix_if(client, "/livemig/w-once/", "/livemig/w-once/result", client.get("/livemig/w-once/result"))
    assert client.get("/livemig/w-once/result") is None
