"""Every key of the job's schema (enumerated from JobKeys, so a new key is covered when it
is added) gets random hostile values: bytes that are not msgpack, msgpack of the wrong
type, records with fields of the wrong type or missing. Every in-process reader of the
prefix (a coordinator pass, `livemig status`, the run report) must go on without an
exception, and a coordinator must not form a job from them. Seeded: a failure names the
seed, the key and the value to replay."""

from __future__ import annotations

import inspect
import random
from datetime import timedelta

import msgpack
import pytest

from livemig.agent import report
from livemig.cli import status
from livemig.coordinator.coordinator import Coordinator, Snapshot
from livemig.rdzv.client import EtcdClient
from livemig.rdzv.keys import JobKeys

JOB = "every"
FIELDS = ["incarnation", "host", "pid", "addr", "state", "step", "time", "generation", "rank", "members",
          "world_size", "signature", "digest", "digests", "steps", "commits", "role", "run_id", "nnodes",
          "nproc_per_node", "why", "ranks", "phase", "spare", "stop", "kind", "target", "node_rank"]  # fmt: skip


def schema_keys(k: JobKeys) -> list[str]:
    """One concrete key for every key and prefix of the schema."""
    out = []
    for name, attr in inspect.getmembers(type(k)):
        if name.startswith("_"):
            continue
        if isinstance(attr, property):
            key = getattr(k, name)
            out.append(key + "x" if key.endswith("/") else key)
        elif inspect.isfunction(attr):
            params = list(inspect.signature(attr).parameters.values())[1:]
            args = [1 if p.annotation in (int, "int") else "w1" for p in params]
            out.append(getattr(k, name)(*args))
    return sorted({key for key in out if key != k.prefix + "x"})


def hostile(rng: random.Random, depth: int = 0):
    kind = rng.randrange(9 if depth < 2 else 6)
    if kind == 0:
        return rng.randrange(-(2**40), 2**40)
    if kind == 1:
        return rng.choice(["", "x" * rng.randrange(1, 50), "\u0000", "-1", "nan"])
    if kind == 2:
        return rng.choice([None, True, False, 1e308, float("nan"), -0.0])
    if kind == 3:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 20)))
    if kind == 4:
        return rng.choice([[], {}, [1, 2, 3]])
    if kind == 5:
        return rng.randrange(5)
    if kind == 6:
        return [hostile(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    if kind == 7:  # a record with some of the fields livemig reads, each of a random type
        return {f: hostile(rng, depth + 1) for f in rng.sample(FIELDS, rng.randrange(1, 8))}
    keys = [rng.choice([rng.randrange(4), -1, None, b"k", 2.5]) if rng.random() < 0.3 else str(rng.randrange(4))
            for _ in range(rng.randrange(1, 4))]  # fmt: skip
    return {key: hostile(rng, depth + 1) for key in keys}


def raw_value(rng: random.Random) -> bytes:
    if rng.random() < 0.2:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))  # not msgpack, mostly
    v = hostile(rng)
    try:
        return msgpack.packb(v, use_bin_type=True)
    except (TypeError, ValueError):
        return b"\xc1"


def OWNED(k: JobKeys) -> set[str]:  # noqa: N802
    """Written only by the leading coordinator, by CAS: a corrupt one ends the job
    (test_a_corrupt_membership_table_ends_the_job_with_one_line)."""
    return {k.leader, k.membership}


@pytest.fixture
def client(etcd):
    c = EtcdClient(etcd.endpoints, timedelta(seconds=5))
    yield c
    c.delete_prefix(JobKeys(JOB).prefix)
    c.close()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_hostile_values_under_every_key_break_no_reader(client, seed):
    keys = JobKeys(JOB)
    coord = Coordinator(client, JOB, 2)
    coord.election.try_acquire()
    rng = random.Random(seed)
    all_keys = schema_keys(keys)
    assert len(all_keys) >= 30, all_keys  # the enumeration found the schema
    try:
        for round_ in range(4):
            planted = {}
            for key in all_keys:
                if key in OWNED(keys):
                    continue
                planted[key] = raw_value(rng)
                client.put(key, planted[key])
            where = f"seed {seed} round {round_}: {planted}"
            kvs, _ = client.get_prefix(keys.prefix)
            snap = Snapshot(kvs, coord.rdzv)
            try:
                coord.run_pass(snap)
            except Exception as exc:  # noqa: BLE001 - the assertion names it
                pytest.fail(f"coordinator pass raised {exc!r}; {where}")
            assert snap.m.generation == 0 or snap.m.world_size == 2, where
            try:
                status.render(status.collect(client, JOB), as_json=True)
                status.render(status.collect(client, JOB), as_json=False)
            except Exception as exc:  # noqa: BLE001
                pytest.fail(f"livemig status raised {exc!r}; {where}")
            try:
                report.build(client, JOB, 2, 1.0)
            except Exception as exc:  # noqa: BLE001
                pytest.fail(f"the run report raised {exc!r}; {where}")
            client.delete_prefix(keys.prefix)
            coord.election.try_acquire()
    finally:
        coord.election.resign()


def test_a_corrupt_membership_table_ends_the_job_with_one_line(client):
    """The table is written only by the leading coordinator, by CAS: nothing can be decided
    from a corrupt one, so the run fails with a reason instead of a coordinator that crashes
    or loops on it."""
    from livemig.rdzv.client import decode
    from livemig.rdzv.membership import GenState

    keys = JobKeys(JOB)
    client.put(keys.membership, b"\xc1 not a table")
    coord = Coordinator(client, JOB, 2)
    assert coord.run() == GenState.FAILED
    res = decode(client.get(keys.result).value)
    assert res["state"] == "failed" and "membership table in etcd is not a valid record" in res["reason"], res
    assert "\n" not in res["reason"]
