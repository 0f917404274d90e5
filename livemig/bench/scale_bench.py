"""`livemig bench scale --ranks N[,N...]`: the control plane at N ranks.

Simulated members (no model, no process per rank) speak the real etcd
protocol against a real etcd and a real coordinator process: they register,
report, and write `ready` exactly as members do, in batched transactions.
One member is then declared dead (the agent's suspect record) and we time
the coordinator's part of the recovery: detect -> fence, reports -> agree +
claim a spare, all ready -> commit.

Progress traffic (`--progress-hz`, default 1: every rank writes its progress
record once a second, a 1 s step) runs in a thread of its own from formation
to the end, as members' per-step writes would; the coordinator's CPU time per
second of steady state (progress on, no recovery) is read from /proc.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any

from livemig.rdzv.client import EtcdClient, encode
from livemig.rdzv.embedded import EtcdCluster
from livemig.rdzv.keys import JobKeys
from livemig.rdzv.membership import GenState, Membership

SIG = [["w", "float32", [4]]]
BATCH = 60  # puts per transaction (etcd's default limit is 128 ops)


def _put_many(client: EtcdClient, items: list[tuple[str, bytes]], lease: int | None = None) -> None:
    t = client.txn_ops
    for i in range(0, len(items), BATCH):
        client.txn([], [t.put(k, v, lease) for k, v in items[i : i + BATCH]])


def _wait(client: EtcdClient, keys: JobKeys, pred: Any, timeout: float = 120) -> tuple[Membership, float]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kv = client.get(keys.membership)
        m = Membership.from_bytes(kv.value if kv else None)
        if pred(m):
            return m, time.time()
        time.sleep(0.002)
    raise TimeoutError(f"coordinator did not reach the expected state within {timeout}s")


class _Progress(threading.Thread):
    """Every rank's progress record, `hz` times a second, in batched transactions (the
    members' per-step writes); `writes_per_s` is what it achieved."""

    def __init__(self, etcd: str, keys: JobKeys, incs: list[str], hz: float) -> None:
        super().__init__(daemon=True, name="bench-progress")
        self.client = EtcdClient(etcd, timedelta(seconds=30))
        self.keys, self.incs, self.hz = keys, incs, hz
        self.stop = threading.Event()
        self.writes = 0
        self.t0 = time.monotonic()

    def run(self) -> None:
        step = 0
        while not self.stop.is_set() and self.hz > 0:
            start = time.monotonic()
            step += 1
            now = time.time()
            _put_many(self.client, [(self.keys.progress(r), encode({"step": step, "time": now, "incarnation": inc,
                                                                     "generation": 1, "avg_step": 1.0 / self.hz}))
                                    for r, inc in enumerate(self.incs)])  # fmt: skip
            self.writes += len(self.incs)
            self.stop.wait(max(0.0, 1.0 / self.hz - (time.monotonic() - start)))

    @property
    def writes_per_s(self) -> float:
        return self.writes / max(1e-9, time.monotonic() - self.t0)


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(etcd: str, n: int, progress_hz: float = 1.0, steady_s: float = 5.0) -> dict[str, Any]:
    client = EtcdClient(etcd, timedelta(seconds=30))
    job = f"scale{n}-{int(time.time() * 1000) % 100000}"
    keys = JobKeys(job)
    coord = subprocess.Popen([sys.executable, "-m", "livemig.coordinator", "--etcd", etcd, "--job", job,
                              "--world-size", str(n)], stdout=subprocess.DEVNULL)  # fmt: skip
    try:
        lease = client.grant(60)
        inc = [f"sim-{job}-{r}" for r in range(n)]
        regs = [
            (keys.member(r), encode({"incarnation": inc[r], "host": "sim", "pid": r, "rank": r,
                                     "addr": f"tcp://sim:{r}", "state": "running"}))
            for r in range(n)
        ]  # fmt: skip
        sigs = [(keys.prefix + f"signatures/{r}", encode({"incarnation": inc[r], "signature": SIG}))
                for r in range(n)]  # fmt: skip
        _put_many(client, regs, lease)
        _put_many(client, sigs)
        m, _ = _wait(client, keys, lambda m: m.generation == 1)
        _put_many(client, [(keys.ready(1, r), encode({"incarnation": inc[r], "time": time.time()})) for r in range(n)])
        _wait(client, keys, lambda m: m.state == GenState.COMMITTED)
        progress = _Progress(etcd, keys, inc, progress_hz)
        progress.start()
        cpu0, w0 = _cpu_s(coord.pid), time.monotonic()
        time.sleep(steady_s)  # steady state: progress traffic, no recovery
        coord_cpu = (_cpu_s(coord.pid) - cpu0) / (time.monotonic() - w0)
        spare_inc = f"sim-{job}-spare"
        client.put(keys.spare("s0"), encode({"incarnation": spare_inc, "state": "warm", "signature": SIG,
                                             "host": "sim", "pid": 0}), lease)  # fmt: skip
        victim = n - 1
        t_fault = time.time()
        client.txn(
            [],
            [
                client.txn_ops.delete(keys.member(victim)),
                client.txn_ops.put(keys.suspect(inc[victim]), encode({"time": t_fault, "reason": "sim"})),
            ],
        )
        m, t_fenced = _wait(client, keys, lambda m: m.generation == 2)
        _put_many(client, [(keys.report(2, r), encode({"incarnation": inc[r], "committed": 10, "avg_step": 10}))
                           for r in range(n - 1)])  # fmt: skip
        t_reported = time.time()
        m, t_claimed = _wait(client, keys, lambda m: m.state == GenState.BUILDING)
        ready = [(keys.ready(2, r), encode({"incarnation": m.members[r].incarnation, "time": time.time()}))
                 for r in range(n)]  # fmt: skip
        client.put(keys.member(victim), encode({"incarnation": spare_inc, "host": "sim", "pid": 0, "rank": victim,
                                                "addr": "tcp://sim:0", "state": "running"}), lease)  # fmt: skip
        _put_many(client, ready)
        t_ready = time.time()
        m, t_commit = _wait(client, keys, lambda m: m.state == GenState.COMMITTED and m.generation == 2)
        table_bytes = len(client.get(keys.membership).value)
        progress.stop.set()
        progress.join(timeout=30)
        fence, claim, commit = t_fenced - t_fault, t_claimed - t_reported, t_commit - t_ready
        return {
            "ranks": n, "fence_s": fence, "agree_claim_s": claim, "commit_s": commit,
            "coordinator_total_s": fence + claim + commit, "members_report_s": t_reported - t_fenced,
            "members_ready_s": t_ready - t_claimed, "table_bytes": table_bytes,
            "progress_writes_per_s": progress.writes_per_s, "coordinator_cpu_per_s": coord_cpu,
        }  # fmt: skip
    finally:
        if "progress" in locals():
            progress.stop.set()
        coord.terminate()
        coord.wait()
        client.delete_prefix(keys.prefix)
        client.close()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", default="64,256,1024", help="comma-separated rank counts (default 64,256,1024)")
    p.add_argument("--etcd", help="use this etcd (default: an embedded single node)")
    p.add_argument("--progress-hz", type=float, default=1.0,
                   help="progress writes per rank per second during the run (default 1; 0: none)")  # fmt: skip
    p.add_argument("--steady-s", type=float, default=5.0, help="steady state measured before the fault, s")
    p.add_argument("--json")


def run(a: argparse.Namespace) -> int:
    cluster = None if a.etcd else EtcdCluster(1).start()
    etcd = a.etcd or cluster.endpoints
    rows = []
    try:
        for n in [int(x) for x in a.ranks.split(",")]:
            print(f"  {n} ranks ...", flush=True)
            rows.append(measure(etcd, n, a.progress_hz, a.steady_s))
    finally:
        if cluster:
            cluster.stop()
    print("coordinator time per recovery phase with N simulated members (seconds)")
    print(f"{'ranks':>6} {'fence':>7} {'agree+claim':>12} {'commit':>7} {'total':>7} "
          f"{'(members report':>15} {'ready)':>7} {'table KB':>9} {'progress/s':>11} {'coord CPU/s':>12}")  # fmt: skip
    for r in rows:
        print(f"{r['ranks']:>6} {r['fence_s']:>7.3f} {r['agree_claim_s']:>12.3f} {r['commit_s']:>7.3f} "
              f"{r['coordinator_total_s']:>7.3f} {r['members_report_s']:>15.3f} {r['members_ready_s']:>7.3f} "
              f"{r['table_bytes'] / 1024:>9.1f} {r['progress_writes_per_s']:>11.0f} "
              f"{r['coordinator_cpu_per_s']:>12.3f}")  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0
