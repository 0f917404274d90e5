"""`livemig bench footprint`: the job prefix's size in etcd over a long job.

Simulated members (as in `bench scale`: the real etcd protocol, no model) drive a
real coordinator process through S steps (one progress write per rank and step)
and R recoveries (a warm spare, an agent's suspect record, reports, the claim,
ready, the commit; the agent removes the fence key of the process it reaped).
The key count and bytes under /livemig/<job>/ are read once the coordinator has
pruned what the finished generations left (coordinator/prune.py): they must not
grow with steps or recoveries. tests/rdzv/test_footprint.py runs it small.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

from livemig.rdzv.client import EtcdClient, encode
from livemig.rdzv.embedded import EtcdCluster
from livemig.rdzv.keys import JobKeys
from livemig.rdzv.membership import GenState, Membership, Rendezvous

SIG = [["w", "float32", [4]]]
BATCH = 60  # puts per transaction (etcd's default limit is 128 ops)


class SimJob:
    """n simulated members of one job and a real coordinator process."""

    def __init__(self, etcd: str, n: int, job: str | None = None, timeout: float = 60.0) -> None:
        self.client = EtcdClient(etcd, timedelta(seconds=30))
        self.job = job or f"foot{n}-{int(time.time() * 1000) % 100000}"
        self.keys = JobKeys(self.job)
        self.n = n
        self.timeout = timeout
        self.step = 0
        self.spares = 0
        self.coord = subprocess.Popen([sys.executable, "-m", "livemig.coordinator", "--etcd", etcd, "--job",
                                       self.job, "--world-size", str(n)], stdout=subprocess.DEVNULL)  # fmt: skip
        self.lease = self.client.grant(600)
        self.inc = [f"sim-{self.job}-{r}" for r in range(n)]

    def close(self) -> None:
        self.coord.terminate()
        self.coord.wait()
        self.client.delete_prefix(self.keys.prefix)
        self.client.close()

    def _put_many(self, items: list[tuple[str, bytes]], lease: int | None = None) -> None:
        t = self.client.txn_ops
        for i in range(0, len(items), BATCH):
            self.client.txn([], [t.put(k, v, lease) for k, v in items[i : i + BATCH]])

    def _wait(self, pred: Any, what: str) -> Membership:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            kv = self.client.get(self.keys.membership)
            m = Membership.from_bytes(kv.value if kv else None)
            if pred(m):
                return Rendezvous(self.client, self.job).read()  # the rows too
            time.sleep(0.005)
        raise TimeoutError(f"the coordinator did not reach {what} within {self.timeout:.0f}s")

    def _register(self, rank: int, inc: str) -> tuple[str, bytes]:
        # a realistic record: a real host name and address, not a short placeholder
        return self.keys.member(rank), encode({"incarnation": inc, "host": f"node-{rank // 8:04d}.cluster.example",
                                               "pid": 100000 + rank, "rank": rank, "state": "running",
                                               "addr": f"tcp://10.{rank // 65536}.{rank // 256 % 256}.{rank % 256}"
                                                       ":45123"})  # fmt: skip

    def form(self) -> None:
        k = self.keys
        self._put_many([self._register(r, self.inc[r]) for r in range(self.n)], self.lease)
        self._put_many([(k.signature(r), encode({"incarnation": self.inc[r], "signature": SIG}))
                        for r in range(self.n)])  # fmt: skip
        self._wait(lambda m: m.generation == 1, "generation 1")
        self._put_many([(k.ready(1, r), encode({"incarnation": self.inc[r], "time": time.time()}))
                        for r in range(self.n)])  # fmt: skip
        self._wait(lambda m: m.state == GenState.COMMITTED, "the first commit")

    def train(self, steps: int) -> None:
        """One progress record per rank and step, as members write them."""
        for _ in range(steps):
            now = time.time()
            self._put_many([(self.keys.progress(r), encode({"step": self.step, "time": now, "incarnation": self.inc[r],
                                                             "generation": 0, "loss": 0.5, "compute_s": 0.01}))
                            for r in range(self.n)])  # fmt: skip
            self.step += 1

    def recover(self, victim: int) -> None:
        """A worker dies; a warm spare takes its rank; one generation change."""
        k, t = self.keys, self.client.txn_ops
        m0 = self._wait(lambda m: m.state == GenState.COMMITTED, "a committed generation")
        sid, spare_inc = f"s{self.spares}", f"sim-{self.job}-spare{self.spares}"
        self.spares += 1
        info = {"incarnation": spare_inc, "state": "warm", "signature": SIG, "host": "standby-0001.example", "pid": 1}
        self.client.put(k.spare(sid), encode(info), self.lease)
        dead = self.inc[victim]
        suspect = {"time": time.time(), "reason": "sim", "by": "agent"}
        self.client.txn([], [t.delete(k.member(victim)), t.put(k.suspect(dead), encode(suspect))])
        g = m0.generation + 1
        m = self._wait(lambda m: m.generation == g, f"generation {g}")
        self._put_many([(k.report(g, r), encode({"incarnation": m.members[r].incarnation, "committed": self.step - 1,
                                                 "avg_step": self.step - 1, "mirrors": [], "time": time.time()}))
                        for r in m.members])  # fmt: skip
        self.client.delete(k.fenced(dead))  # the agent reaped the process: it can write nothing
        m = self._wait(lambda m: m.generation == g and m.state == GenState.BUILDING, f"the claim of generation {g}")
        self.inc[victim] = spare_inc
        self.client.put(*self._register(victim, spare_inc), self.lease)
        self.client.delete(k.spare(sid))  # a spare that joined drops its standby registration
        self._put_many([(k.ready(g, r), encode({"incarnation": m.members[r].incarnation, "time": time.time()}))
                        for r in range(self.n)])  # fmt: skip
        self._wait(lambda m: m.generation == g and m.state == GenState.COMMITTED, f"the commit of generation {g}")

    def footprint(self) -> dict[str, int]:
        """Keys and bytes under the job's prefix once the coordinator has pruned."""
        deadline = time.monotonic() + self.timeout
        while True:
            self.train(1)  # a write wakes the coordinator, as a member's progress does
            kvs, _ = self.client.get_prefix(self.keys.prefix)
            m = Membership.from_bytes(next((kv.value for kv in kvs if kv.key == self.keys.membership), None))
            g = m.generation
            old = [p for h in range(g) for p in (self.keys.recovery_prefix(h), f"{self.keys.timeline_prefix}{h:08d}/")]
            stale = [kv.key for kv in kvs if kv.key.startswith((self.keys.suspects_prefix, *old))]
            if not stale or time.monotonic() > deadline:
                return {"generation": g, "keys": len(kvs), "bytes": sum(len(kv.key) + len(kv.value) for kv in kvs),
                        "stale_keys": len(stale)}  # fmt: skip
            time.sleep(0.05)


def measure(etcd: str, n: int, steps: int, recoveries: int) -> list[dict[str, Any]]:
    job = SimJob(etcd, n)
    rows = []
    try:
        job.form()
        per = max(1, steps // max(1, recoveries + 1))
        rows.append({"after": "formed", "steps": job.step, **job.footprint()})
        for i in range(recoveries):
            job.train(per)
            job.recover(i % n)
            if i + 1 in (1, 5) or i + 1 == recoveries:
                rows.append({"after": f"recovery {i + 1}", "steps": job.step, **job.footprint()})
        job.train(max(0, steps - job.step))
        rows.append({"after": "end", "steps": job.step, **job.footprint()})
    finally:
        job.close()
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--steps", type=int, default=10000)
    p.add_argument("--recoveries", type=int, default=20)
    p.add_argument("--etcd", help="use this etcd (default: an embedded single node)")
    p.add_argument("--json")


def run(a: argparse.Namespace) -> int:
    cluster = None if a.etcd else EtcdCluster(1).start()
    try:
        rows = measure(a.etcd or cluster.endpoints, a.ranks, a.steps, a.recoveries)
    finally:
        if cluster:
            cluster.stop()
    print(f"job prefix in etcd, {a.ranks} simulated ranks ({a.steps} steps, {a.recoveries} recoveries)")
    print(f"{'after':>12} {'steps':>7} {'generation':>10} {'keys':>6} {'KiB':>8}")
    for r in rows:
        print(f"{r['after']:>12} {r['steps']:>7} {r['generation']:>10} {r['keys']:>6} {r['bytes'] / 1024:>8.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0 if all(r["stale_keys"] == 0 for r in rows) else 1
