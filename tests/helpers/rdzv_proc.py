"""Child-process roles for rdzv tests (each a real process with its own client)."""

from __future__ import annotations

import argparse
import sys
import time
from datetime import timedelta

from livemig.config import Timeouts
from livemig.rdzv.client import EtcdClient, encode
from livemig.rdzv.election import LeaderElection
from livemig.rdzv.membership import Membership, Rendezvous


def cas_race(a: argparse.Namespace) -> None:
    """Bump the generation `rounds` times by CAS; print each generation won."""
    client = EtcdClient(a.etcd, timedelta(seconds=10))
    rdzv = Rendezvous(client, a.job)
    # start together
    while time.time() < a.start_at:
        time.sleep(0.001)
    won = []
    attempts = 0
    while len(won) < a.rounds and attempts < a.rounds * 200:
        attempts += 1
        g = rdzv.generation()
        if rdzv.commit_change(g, Membership(reason=a.name)):
            won.append(g + 1)
    print(" ".join(map(str, won)), flush=True)


def register(a: argparse.Namespace) -> None:
    client = EtcdClient(a.etcd)
    rdzv = Rendezvous(client, a.job, Timeouts(lease_ttl=timedelta(seconds=a.ttl)))
    rdzv.register(rdzv.keys.member(a.rank), {"rank": a.rank}, a.name)
    print("registered", flush=True)
    time.sleep(3600)


def leader(a: argparse.Namespace) -> None:
    client = EtcdClient(a.etcd)
    el = LeaderElection(client, a.job, a.name, a.ttl)
    el.campaign(timeout=60)
    print("leader", time.time(), flush=True)
    while True:
        # Keep writing with the leader guard; the old leader's writes must fail.
        ok, _ = client.txn([el.guard()], [client.txn_ops.put(f"/livemig/{a.job}/lastwriter", encode(a.name))])
        print("write", ok, flush=True)
        time.sleep(0.2)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("role")
    p.add_argument("--etcd", required=True)
    p.add_argument("--job", default="t")
    p.add_argument("--name", default="p")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--start-at", type=float, default=0.0)
    p.add_argument("--ttl", type=int, default=1)
    p.add_argument("--rank", type=int, default=0)
    a = p.parse_args()
    {"cas_race": cas_race, "register": register, "leader": leader}[a.role](a)
    sys.exit(0)


if __name__ == "__main__":
    main()
