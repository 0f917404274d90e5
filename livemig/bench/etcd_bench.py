"""`livemig bench etcd`: latency of the etcd operations recovery relies on.

Measures, against a fresh embedded etcd (or --etcd): a plain put, a
generation CAS commit (Rendezvous.commit_change: compare + table + fence in
one transaction), and watch delivery (put -> callback in another client).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from datetime import timedelta

from livemig.rdzv.client import EtcdClient
from livemig.rdzv.embedded import EtcdCluster
from livemig.rdzv.membership import Member, Membership, Rendezvous
from livemig.rdzv.watch import PrefixWatch


def _summary(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {
        "median_ms": statistics.median(s) * 1e3,
        "p90_ms": s[int(0.9 * (len(s) - 1))] * 1e3,
        "min_ms": s[0] * 1e3,
        "max_ms": s[-1] * 1e3,
        "n": len(s),
    }


def measure(endpoints: str, n: int, world: int) -> dict[str, dict[str, float]]:
    client = EtcdClient(endpoints, timedelta(seconds=10))
    watcher_client = EtcdClient(endpoints, timedelta(seconds=10))
    rdzv = Rendezvous(client, f"bench-{int(time.time() * 1000)}")
    members = {r: Member(r, f"worker-host-{r}-0123abcd", "host", 1000 + r) for r in range(world)}
    put, cas, watch = [], [], []
    for i in range(n):
        t0 = time.perf_counter()
        client.put(rdzv.keys.progress(0), str(i).encode())
        put.append(time.perf_counter() - t0)
    for _ in range(n):
        g = rdzv.generation()
        t0 = time.perf_counter()
        assert rdzv.commit_change(g, Membership(world_size=world, members=members), fence=["x"])
        cas.append(time.perf_counter() - t0)
    got = threading.Event()
    w = PrefixWatch(watcher_client, rdzv.keys.scratch("w"), lambda ev: got.set())
    for i in range(n):
        got.clear()
        t0 = time.perf_counter()
        client.put(rdzv.keys.scratch("w"), str(i).encode())
        if not got.wait(5):
            raise RuntimeError("watch event not delivered within 5 s")
        watch.append(time.perf_counter() - t0)
    w.cancel()
    client.delete_prefix(rdzv.keys.prefix)
    return {"put": _summary(put), "cas_commit": _summary(cas), "watch_delivery": _summary(watch)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--etcd", help="measure this etcd instead of a fresh embedded one")
    p.add_argument("--cluster", type=int, default=1, help="embedded members (1 or 3; default 1)")
    p.add_argument("-n", type=int, default=200, help="samples per operation (default 200)")
    p.add_argument("--world", type=int, default=64, help="ranks in the committed table (default 64)")
    p.add_argument("--json", help="also write the figures to this file")


def run(a: argparse.Namespace) -> int:
    cluster = None
    endpoints = a.etcd
    if not endpoints:
        cluster = EtcdCluster(size=a.cluster).start()
        endpoints = cluster.endpoints
    try:
        res = measure(endpoints, a.n, a.world)
    finally:
        if cluster:
            cluster.stop()
    print(f"etcd at {endpoints} ({a.cluster if cluster else 'external'} member(s)), n={a.n}")
    for name, s in res.items():
        print(
            f"  {name:<15} median {s['median_ms']:.2f} ms  p90 {s['p90_ms']:.2f} ms  "
            f"min {s['min_ms']:.2f}  max {s['max_ms']:.2f}"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0
