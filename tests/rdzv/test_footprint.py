"""A bounded etcd footprint: the job prefix holds as many keys after 5 recoveries as
after 1 (the coordinator prunes what finished generations left, the agent removes the
fence key of a process it reaped), while the timeline archive keeps every recovery
for the report. Simulated members against a real coordinator and a real etcd."""

from __future__ import annotations

from livemig.bench.footprint_bench import SimJob
from livemig.coordinator.timeline import read_events


def test_key_count_after_5_recoveries_equals_that_after_1(etcd):
    job = SimJob(etcd.endpoints, 3, job="footprint")
    try:
        job.form()
        job.train(5)
        job.recover(1)
        after_1 = job.footprint()
        for victim in (2, 0, 1, 2):
            job.train(5)
            job.recover(victim)
        after_5 = job.footprint()
        kvs, _ = job.client.get_prefix(job.keys.prefix)
        events = read_events(job.client, job.keys)
    finally:
        job.close()
    assert after_1["generation"] == 2 and after_5["generation"] == 6
    assert after_1["stale_keys"] == after_5["stale_keys"] == 0
    assert after_5["keys"] == after_1["keys"], (after_1, after_5)
    names = [kv.key[len(job.keys.prefix) :] for kv in kvs]
    assert not [n for n in names if n.startswith(("fenced/", "suspects/", "assignments/", "spares/"))], names
    assert {n.split("/")[1] for n in names if n.startswith("recovery/")} <= {"6"}, names
    # the report still sees every recovery: the archive holds the folded events
    assert [e["generation"] for e in events if e["phase"] == "detect"] == [2, 3, 4, 5, 6]
