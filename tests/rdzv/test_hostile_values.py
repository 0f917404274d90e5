"""Values under a job's prefix that decode but are wrong (a field missing, a field of the
wrong type) are logged once and ignored by the coordinator, like garbage: a pass never
fails on them, so it never retries the same deterministic error forever."""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest

from livemig.coordinator.coordinator import Coordinator, Snapshot
from livemig.rdzv.client import EtcdClient, encode
from livemig.rdzv.membership import GenState, Member, Membership


@pytest.fixture
def coord(etcd):
    client = EtcdClient(etcd.endpoints, timedelta(seconds=3))
    c = Coordinator(client, "hostile", 2)
    c.election.try_acquire()
    yield c
    c.election.resign()
    client.delete_prefix(c.keys.prefix)
    client.close()


def _pass(c: Coordinator) -> Snapshot:
    kvs, _ = c.client.get_prefix(c.keys.prefix)
    snap = Snapshot(kvs, c.rdzv)
    c.run_pass(snap)  # raises if a pass fails on a value
    return snap


WRONG = {
    "member lacks addr": lambda k: (k.member(0), {"incarnation": "w0", "host": "h", "pid": 1}),
    "member pid is a string": lambda k: (k.member(1), {"incarnation": "w1", "host": "h", "pid": "1", "addr": "a"}),
    "signature is a dict": lambda k: (k.prefix + "signatures/0", {"incarnation": "w0", "signature": {}}),
    "progress without step": lambda k: (k.progress(0), {"time": 1.0, "waiting_step": 3}),
    "spare without incarnation": lambda k: (k.spare("s"), {"state": "warm", "signature": []}),
}


@pytest.mark.parametrize("case", sorted(WRONG))
def test_a_registration_lacking_a_field_is_ignored_and_logged_once(coord, case, caplog):
    key, value = WRONG[case](coord.keys)
    coord.client.put(key, encode(value))
    with caplog.at_level(logging.ERROR, logger="livemig.coordinator"):
        for _ in range(3):
            snap = _pass(coord)
            assert snap.get(key) is None
    assert snap.m.generation == 0  # nothing formed from a half record
    lines = [r for r in caplog.records if r.getMessage() == "ignoring a malformed value" and r.key == key]
    assert len(lines) == 1, [r.__dict__ for r in caplog.records]
    assert "lacks field" in lines[0].why


def test_wrong_recovery_records_do_not_break_a_recovery_pass(coord, caplog):
    """A RECOVERING generation whose reports and suspects are half records: the pass
    waits for real ones (and fences silent survivors after its timeout) instead of
    failing with a KeyError on every pass."""
    k = coord.keys
    members = {0: Member(0, "w0", "h", 1, "a"), 1: Member(1, "w1", "h", 2, "b")}
    m = Membership(generation=0, state=GenState.FORMING, world_size=2, members=members)
    assert coord.rdzv.commit_change(0, m)
    rec = Membership(state=GenState.RECOVERING, world_size=2, members={0: members[0]})
    assert coord.rdzv.commit_change(1, rec)
    coord.client.put(k.member(0), encode({"incarnation": "w0", "host": "h", "pid": 1, "addr": "a"}))
    coord.client.put(k.report(2, 0), encode({"incarnation": "w0"}))  # no committed step
    coord.client.put(k.suspect("w0"), encode({"why": "no time"}))  # a suspect without a time
    with caplog.at_level(logging.ERROR, logger="livemig.coordinator"):
        for _ in range(3):
            snap = _pass(coord)
    assert snap.m.generation == 2 and snap.m.state == GenState.RECOVERING  # still waiting for a real report
    assert not [r for r in caplog.records if r.getMessage() == "coordinator pass failed; retrying"]
    ignored = {r.key for r in caplog.records if r.getMessage() == "ignoring a malformed value"}
    assert ignored == {k.report(2, 0), k.suspect("w0")}
