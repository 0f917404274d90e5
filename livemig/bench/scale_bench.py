"""`livemig bench scale --ranks N[,N...]`: the control plane at N ranks.

Simulated members (no model, no process per rank) speak the real etcd
protocol against a real etcd and a real coordinator process: they register,
report, and write `ready` exactly as members do, in batched transactions.
One member is then declared dead (the agent's suspect record) and we time
the coordinator's part of the recovery: detect -> fence, reports -> agree +
claim a spare, all ready -> commit.

Progress traffic (`--progress-hz`, default 1: a 1 s step) runs in a thread of
its own from formation to the end, as members' per-step writes would, each
rank keeping to the job's budget as members do (config.progress_budget: at
most budget / N records a second each, 2,000 / N by default); the coordinator's
CPU time per second of steady state (progress on, no recovery) is read from
/proc, and etcd's own counters (its /metrics: keys put, raft proposals) give
the writes per second etcd took in that steady state.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from datetime import timedelta
from typing import Any

from livemig.bench import proc_cpu_s, proc_run_s
from livemig.config import Timeouts, progress_budget
from livemig.coordinator.timeline import read_events
from livemig.rdzv.client import EtcdClient, encode
from livemig.rdzv.embedded import EtcdCluster, free_port
from livemig.rdzv.keys import JobKeys
from livemig.rdzv.membership import GenState, Membership

SIG = [["w", "float32", [4]]]
BATCH = 60  # puts per transaction (etcd's default limit is 128 ops)


def _put_many(client: EtcdClient, items: list[tuple[str, bytes]], lease: int | None = None) -> float:
    """Write `items` in batches; returns the time just before the last batch went out: the
    coordinator can act on the writes from then on, maybe before this call returns (a phase
    timed from the return came out negative on a loaded host)."""
    t, last = client.txn_ops, time.time()
    for i in range(0, len(items), BATCH):
        last = time.time()
        client.txn([], [t.put(k, v, lease) for k, v in items[i : i + BATCH]])
    return last


def wait_until(client: EtcdClient, keys: JobKeys, pred: Any, coord: subprocess.Popen | None = None,
          timeout: float = 120) -> tuple[Membership, float]:  # fmt: skip
    """Poll the table as a member would see it: decoded once per change (its mod revision),
    not on every poll; at 10,000 ranks a decode is ~20 ms of the bench's CPU, which the
    coordinator and etcd, on the same 2 cores, would otherwise lose. A coordinator that
    exited ends the wait at once (its exit code in the error), not at the timeout."""
    deadline = time.monotonic() + timeout
    seen = -1
    while time.monotonic() < deadline:
        if coord is not None and coord.poll() is not None:
            raise RuntimeError(f"the coordinator exited (code {coord.returncode}) before the expected state")
        kv = client.get(keys.membership)
        if kv is not None and kv.mod_revision != seen:
            seen = kv.mod_revision
            m = Membership.from_bytes(kv.value)
            if pred(m):
                return m, time.time()
        time.sleep(0.002)
    raise TimeoutError(f"coordinator did not reach the expected state within {timeout}s")


def etcd_counters(etcd: str) -> dict[str, float]:
    """etcd's counters of keys put and raft proposals committed (its /metrics, on the client
    URL), and the lease keep-alive messages it received."""
    names = {"etcd_mvcc_put_total": "puts", "etcd_server_proposals_committed_total": "proposals"}
    out = {"puts": 0.0, "proposals": 0.0, "keepalives": 0.0}
    with urllib.request.urlopen(etcd.split(",")[0] + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            name, _, value = line.rpartition(" ")
            if name in names:
                out[names[name]] = float(value)
            elif name.startswith('grpc_server_msg_received_total{grpc_method="LeaseKeepAlive"'):
                out["keepalives"] = float(value)
    return out


def keepalive_proposals(client: EtcdClient, etcd: str, leases: int = 100) -> tuple[int, float]:
    """A member's lease keep-alive is answered by etcd's leader without a raft proposal: renew
    `leases` leases once each and count etcd's proposals meanwhile (keep-alives, proposals)."""
    ids = [client.grant(60) for _ in range(leases)]
    try:
        before = etcd_counters(etcd)
        for lease in ids:
            client.keepalive_once(lease)
        after = etcd_counters(etcd)
    finally:
        for lease in ids:
            client.revoke(lease)
    return int(after["keepalives"] - before["keepalives"]), after["proposals"] - before["proposals"]


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
        """Each round writes every rank's record once, its batches spread over the round (as
        members' writes spread over time), so a steady-state window of any length sees the rate."""
        step = 0
        while not self.stop.is_set() and self.hz > 0:
            start = time.monotonic()
            step += 1
            now = time.time()
            items = [(self.keys.progress(r), encode({"step": step, "time": now, "incarnation": inc, "generation": 1,
                                                     "avg_step": 1.0 / self.hz}))
                     for r, inc in enumerate(self.incs)]  # fmt: skip
            batches = range(0, len(items), BATCH)
            for i, at in enumerate(batches):
                _put_many(self.client, items[at : at + BATCH])
                self.writes += len(items[at : at + BATCH])
                slot = start + (i + 1) / (self.hz * len(batches))
                if self.stop.wait(max(0.0, slot - time.monotonic())):
                    return

    @property
    def writes_per_s(self) -> float:
        return self.writes / max(1e-9, time.monotonic() - self.t0)


class _Watchers:
    """`k` members' view of the membership, each its own etcd connection and a watch of the
    head, as runtime/member.py has it: on a change a member receives the head (small, the
    same size at any N) and reads the one row it needs, its own (rank i for watcher i). A
    watcher notes when each head arrived and the bytes it received for it (the head, its
    row); the decode of the head is timed afterwards, once, and added to each arrival."""

    def __init__(self, etcd: str, keys: JobKeys, k: int) -> None:
        from livemig.rdzv.watch import PrefixWatch

        self.keys = keys
        self.clients = [EtcdClient(etcd, timedelta(seconds=30)) for _ in range(k)]
        self.got: list[dict[int, float]] = [{} for _ in range(k)]  # mod revision -> arrival time
        self.bytes: list[dict[int, int]] = [{} for _ in range(k)]  # mod revision -> bytes received for it
        self.raw: dict[int, bytes] = {}
        self.watches = []
        for i, c in enumerate(self.clients):
            _, rev = c.get_with_revision(keys.membership)
            self.watches.append(PrefixWatch(c, keys.membership, lambda evs, i=i: self._on(i, evs), rev + 1))

    def _on(self, i: int, events: list) -> None:
        now = time.time()
        for ev in events:
            if ev.value:
                self.got[i].setdefault(ev.mod_revision, now)
                self.raw.setdefault(ev.mod_revision, ev.value)
                row = self.clients[i].get(self.keys.row(i))  # its own row: is it still a member?
                self.bytes[i][ev.mod_revision] = len(ev.value) + (len(row.value) if row is not None else 0)

    def seen(self, g: int, timeout: float = 60) -> tuple[list[float], float, float]:
        """When each watcher had generation g COMMITTED in hand (arrival plus the decode),
        that decode's time, and the mean bytes a watcher received for that change."""
        deadline = time.monotonic() + timeout
        rev, looked = None, set()
        while time.monotonic() < deadline:
            for r in sorted(set(self.raw) - looked):
                looked.add(r)
                m = Membership.from_bytes(self.raw[r])
                if rev is None and m.state == GenState.COMMITTED and m.generation == g:
                    rev = r
            if rev is not None and all(rev in got for got in self.got) and all(rev in b for b in self.bytes):
                break
            time.sleep(0.05)
        if rev is None:
            return [], float("nan"), float("nan")
        decode = []
        for _ in range(3):
            t0 = time.perf_counter()
            Membership.from_bytes(self.raw[rev])
            decode.append(time.perf_counter() - t0)
        dec = sorted(decode)[1]
        got = [b[rev] for b in self.bytes if rev in b]
        return [got_[rev] + dec for got_ in self.got if rev in got_], dec, sum(got) / max(1, len(got))

    def close(self) -> None:
        for w in self.watches:
            w.cancel()
        for c in self.clients:
            c.close()
        self.watches, self.clients = [], []


def measure(etcd: str, n: int, progress_hz: float = 1.0, steady_s: float = 5.0, watchers: int = 32) -> dict[str, Any]:
    client = EtcdClient(etcd, timedelta(seconds=30))
    job = f"scale{n}-{int(time.time() * 1000) % 100000}"
    keys = JobKeys(job)
    coord = subprocess.Popen([sys.executable, "-m", "livemig.coordinator", "--etcd", etcd, "--job", job,
                              "--world-size", str(n)], stdout=subprocess.DEVNULL)  # fmt: skip
    progress: _Progress | None = None
    watch: _Watchers | None = None
    try:
        lease = client.grant(60)
        inc = [f"sim-{job}-{r}" for r in range(n)]
        regs = [
            (keys.member(r), encode({"incarnation": inc[r], "host": "sim", "pid": r, "rank": r,
                                     "addr": f"tcp://sim:{r}", "state": "running"}))
            for r in range(n)
        ]  # fmt: skip
        sigs = [(keys.signature(r), encode({"incarnation": inc[r], "signature": SIG}))
                for r in range(n)]  # fmt: skip
        _put_many(client, regs, lease)
        _put_many(client, sigs)
        m, _ = wait_until(client, keys, lambda m: m.generation == 1, coord)
        _put_many(client, [(keys.ready(1, r), encode({"incarnation": inc[r], "time": time.time()})) for r in range(n)])
        wait_until(client, keys, lambda m: m.state == GenState.COMMITTED, coord)
        # each simulated member keeps to the job's budget, as runtime/progress.py does
        progress = _Progress(etcd, keys, inc, min(progress_hz, progress_budget() / n))
        progress.start()
        time.sleep(min(1.0, steady_s))  # the first progress batches land before the steady state is measured
        cpu0, w0, etcd0 = proc_cpu_s(coord.pid), time.monotonic(), etcd_counters(etcd)
        time.sleep(steady_s)  # steady state: progress traffic, no recovery
        etcd1, span = etcd_counters(etcd), time.monotonic() - w0
        coord_cpu = (proc_cpu_s(coord.pid) - cpu0) / span
        steady = {f"etcd_{k}_per_s": (etcd1[k] - etcd0[k]) / span for k in ("puts", "proposals")}
        spare_inc = f"sim-{job}-spare"
        client.put(keys.spare("s0"), encode({"incarnation": spare_inc, "state": "warm", "signature": SIG,
                                             "host": "sim", "pid": 0}), lease)  # fmt: skip
        watch = _Watchers(etcd, keys, min(n, watchers)) if watchers > 0 else None
        victim = n - 1
        rev_fault = client.revision(keys.membership)
        run0 = proc_run_s(coord.pid)
        t_fault = time.time()
        client.txn(
            [],
            [
                client.txn_ops.delete(keys.member(victim)),
                client.txn_ops.put(keys.suspect(inc[victim]), encode({"time": t_fault, "reason": "sim"})),
            ],
        )
        m, t_fenced = wait_until(client, keys, lambda m: m.generation == 2, coord)
        t_reported = _put_many(client, [(keys.report(2, r), encode({"incarnation": inc[r], "committed": 10,
                                                                    "avg_step": 10}))
                                        for r in range(n - 1)])  # fmt: skip
        m, t_claimed = wait_until(client, keys, lambda m: m.state == GenState.BUILDING, coord)
        holder = [*inc[:victim], spare_inc, *inc[victim + 1 :]]  # the claimed spare took the victim's rank
        ready = [(keys.ready(2, r), encode({"incarnation": holder[r], "time": time.time()})) for r in range(n)]
        client.put(keys.member(victim), encode({"incarnation": spare_inc, "host": "sim", "pid": 0, "rank": victim,
                                                "addr": "tcp://sim:0", "state": "running"}), lease)  # fmt: skip
        t_ready = _put_many(client, ready)
        m, t_commit = wait_until(client, keys, lambda m: m.state == GenState.COMMITTED and m.generation == 2, coord)
        # the coordinator's CPU from the fault to the commit, per rank: what it spends on each
        # member's report and ready record, which must not grow with N (the guard's figure)
        recovery_cpu = proc_run_s(coord.pid) - run0
        head_bytes = len(client.get(keys.membership).value)
        rows, _ = client.get_prefix(keys.roster_prefix)
        table_bytes = head_bytes + sum(len(kv.value) for kv in rows)
        rows_written = sum(1 for kv in rows if kv.mod_revision > rev_fault)  # by the recovery (fence, claim, commit)
        delivery: dict[str, Any] = {}
        if watch is not None:  # the commit reaching members: latency to k of them, bytes to all n
            # from the coordinator's own record of the commit (written right after its transaction)
            ref = min([e["time"] for e in read_events(client, keys) if e["phase"] == "commit"
                       and e.get("generation") == 2] + [t_commit])  # fmt: skip
            at_watchers, dec, per_member = watch.seen(2)
            seen = sorted(t - ref for t in at_watchers)
            delivery = {"watchers": len(watch.clients), "watchers_seen": len(seen),
                        "delivery_p50_s": seen[len(seen) // 2] if seen else None,
                        "delivery_max_s": seen[-1] if seen else None,
                        "table_decode_s": dec,
                        "bytes_per_member_per_change": per_member,
                        "fanout_mb_per_change": per_member * n / 2**20}  # fmt: skip
        progress.stop.set()
        progress.join(timeout=30)
        # Each phase ends at the coordinator's own record of it (the event goes in the same
        # transaction as the change); when the bench saw the change is printed beside it.
        evs = [e for e in read_events(client, keys) if e.get("generation") == 2]
        at = {ph: min([e["time"] for e in evs if e["phase"] == ph] or [float("nan")])
              for ph in ("fence", "claim", "commit")}  # fmt: skip
        fence, claim, commit = at["fence"] - t_fault, at["claim"] - t_reported, at["commit"] - t_ready
        seen = (t_fenced - t_fault) + (t_claimed - t_reported) + (t_commit - t_ready)
        return {
            "ranks": n, "fence_s": fence, "agree_claim_s": claim, "commit_s": commit,
            "coordinator_total_s": fence + claim + commit, "seen_total_s": seen,
            "members_report_s": t_reported - t_fenced,
            "members_ready_s": t_ready - t_claimed, "table_bytes": table_bytes, "head_bytes": head_bytes,
            "rows_written": rows_written, "recovery_cpu_s": recovery_cpu, "cpu_us_per_rank": recovery_cpu / n * 1e6,
            "progress_writes_per_s": progress.writes_per_s, "coordinator_cpu_per_s": coord_cpu, **steady,
            **delivery,
        }  # fmt: skip
    finally:
        if progress is not None:
            progress.stop.set()
        if watch is not None:
            watch.close()
        coord.terminate()
        coord.wait()
        client.delete_prefix(keys.prefix)
        client.close()


def group_build(world: int, timeout_s: float = 300.0, lazy: bool = False) -> dict[str, Any]:
    """One real gloo group of `world` ranks on this machine: processes forked from one
    that imported torch (so no rank pays the import), connected to one TCPStore, started
    together once all are connected; an allreduce checks the group works. `lazy`: gloo's
    lazy connection (TORCH_GLOO_LAZY_INIT=1), where a pair connects on its first use, so a
    rank connects to the peers its collectives talk to, not to all N-1: the build is then
    mostly the first collective's, which is timed with it."""

    import torch
    import torch.distributed as dist

    port = free_port()
    to = timedelta(seconds=timeout_s)
    pids = []
    for r in range(world):
        pid = os.fork()
        if pid == 0:  # a rank: only its own client store, gloo and os._exit from here
            code = 1
            try:
                torch.set_num_threads(1)
                if lazy:
                    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
                st = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=to)
                st.set(f"up{r}", "1")
                st.wait(["go"])
                t0 = time.time()
                pg = dist.ProcessGroupGloo(dist.PrefixStore("g", st), r, world, to)
                t1 = time.time()
                x = torch.ones(1)
                pg.allreduce([x]).wait()
                t2 = time.time()
                st.set(f"t{r}", f"{t0} {t1} {x.item()} {t2}")
                st.wait(["end"])
                code = 0
            finally:
                os._exit(code)
        pids.append(pid)
    try:
        master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=to)
        master.wait([f"up{r}" for r in range(world)])
        go = time.time()
        master.set("go", "1")
        master.wait([f"t{r}" for r in range(world)])
        rows = [[float(x) for x in master.get(f"t{r}").decode().split()] for r in range(world)]
        master.set("end", "1")
    finally:
        for pid in pids:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
    per = sorted(b - a for a, b, _, _ in rows)
    wall = max(b for _, b, _, _ in rows) - go
    first = max(e for _, _, _, e in rows) - go  # the build and the first allreduce, every rank done
    return {"world": world, "lazy": lazy, "build_wall_s": wall, "per_rank_median_s": per[len(per) // 2],
            "build_and_first_allreduce_s": first,
            "allreduce_ok": all(c == world for _, _, c, _ in rows), "pairs": world * (world - 1) // 2,
            "cpu_ms_per_connection": 1e3 * wall * (os.cpu_count() or 1) / (world * (world - 1))}  # fmt: skip


def _print_group_builds(builds: list[dict[str, Any]], largest: int) -> None:
    """Both connection modes side by side, and the model of a rebuild at `largest` ranks
    (docs/benchmarks.md, "The group build at scale")."""
    cores = os.cpu_count() or 1
    print(
        f"\ngloo group build: one real group per world size and mode, every rank a process on this {cores}-core "
        "machine (full: every pair connects at the build; lazy: TORCH_GLOO_LAZY_INIT=1, a pair on first use)"
    )
    print(f"{'world':>6} {'mode':>5} {'build wall s':>13} {'+1st allreduce s':>17} {'per-rank s':>11} "
          f"{'pairs':>8} {'CPU ms/pair':>12}  allreduce")  # fmt: skip
    for b in builds:
        print(f"{b['world']:>6} {'lazy' if b.get('lazy') else 'full':>5} {b['build_wall_s']:>13.3f} "
              f"{b['build_and_first_allreduce_s']:>17.3f} {b['per_rank_median_s']:>11.3f} {b['pairs']:>8} "
              f"{b['cpu_ms_per_connection']:>12.3f}  {'ok' if b['allreduce_ok'] else 'FAILED'}")  # fmt: skip
    full = [b for b in builds if not b.get("lazy")] or builds
    c = full[-1]["cpu_ms_per_connection"] / 1e3
    n = largest
    print(f"model at {n:,} ranks (measured here up to {full[-1]['world']} ranks sharing {cores} cores; not measured "
          f"at {n:,}):\n"
          f"  full re-initialisation, full mesh (livemig's gloo group per generation today): each rank {n - 1:,} "
          f"connections x {c * 1e3:.3f} ms = {(n - 1) * c:.1f} s on its own CPU; the one store serves "
          f"{n * (n - 1):,} address reads\n"
          f"  full re-initialisation, lazy pairs: each rank connects to the peers its collectives use "
          f"(gloo's ring allreduce: its 2 neighbours), 2 address reads, {2 * n:,} in all\n"
          f"  delta of one rank (only the joiner's pairs rebuilt): the joiner {n - 1:,} connections in a full mesh "
          f"({(n - 1) * c:.1f} s), a few in a ring; each survivor one")  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", default="64,256,1024", help="comma-separated rank counts (default 64,256,1024)")
    p.add_argument("--etcd", help="use this etcd (default: an embedded single node)")
    p.add_argument("--progress-hz", type=float, default=1.0,
                   help="progress writes per rank per second during the run (default 1; 0: none)")  # fmt: skip
    p.add_argument("--steady-s", type=float, default=5.0, help="steady state measured before the fault, s")
    p.add_argument("--watchers", type=int, default=32,
                   help="members whose watch of the table is timed at the recovery's commit (default 32)")  # fmt: skip
    p.add_argument("--group-build", default="16,64,128",
                   help="world sizes of a real gloo group build, forked ranks on this machine ('' : none)")  # fmt: skip
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="recoveries measured per rank count; the fastest is kept, all are listed (default 1)",
    )
    p.add_argument(
        "--quick", action="store_true", help="CI's guard: --steady-s 0.5 --watchers 4 --group-build '' --repeat 3"
    )
    p.add_argument("--json")


GUARD_RATIO = 1.3  # issue 54: 2,000 ranks within 1.3x of 1,000 (CI asserts it of CPU per rank; wall time printed)


def best_of(got: list[dict[str, Any]]) -> dict[str, Any]:
    """The fastest of the recoveries measured at one rank count (a noisy shared machine only
    ever adds time), with every total listed."""
    best = min(got, key=lambda r: r["coordinator_total_s"])
    return {**best, "totals_s": [r["coordinator_total_s"] for r in got],
            "cpu_us_per_rank_min": min(r["cpu_us_per_rank"] for r in got)}  # fmt: skip


def measure_all(etcd: str, counts: list[int], repeat: int, progress_hz: float, steady_s: float,
                watchers: int) -> list[dict[str, Any]]:  # fmt: skip
    """`repeat` recoveries at each rank count, the counts interleaved round by round (1,000,
    2,000, 1,000, ...): a burst of load on the shared machine then lands on both sides of a
    ratio, not on every try of one count."""
    got: dict[int, list[dict[str, Any]]] = {n: [] for n in counts}
    for i in range(max(1, repeat)):
        for n in counts:
            print(f"  {n} ranks ({i + 1}/{max(1, repeat)}) ...", flush=True)
            got[n].append(measure(etcd, n, progress_hz, steady_s, watchers))
    return [best_of(got[n]) for n in counts]


def run(a: argparse.Namespace) -> int:
    if a.quick:
        a.steady_s, a.watchers, a.group_build, a.repeat = 0.5, 4, "", max(a.repeat, 3)
    cluster = None if a.etcd else EtcdCluster(1).start()
    etcd = a.etcd or cluster.endpoints
    rows = []
    try:
        rows = measure_all(etcd, [int(x) for x in a.ranks.split(",")], a.repeat, a.progress_hz, a.steady_s,
                           a.watchers)  # fmt: skip
        client = EtcdClient(etcd, timedelta(seconds=30))
        try:
            kept_alive, proposals = keepalive_proposals(client, etcd)
        finally:
            client.close()
    finally:
        if cluster:
            cluster.stop()
    print(
        "coordinator time per recovery phase with N simulated members (seconds; each phase ends at the "
        "coordinator's record of it, 'seen': when the bench's member-like poll had the change)"
    )
    print(f"{'ranks':>6} {'fence':>7} {'agree+claim':>12} {'commit':>7} {'total':>7} {'seen':>7} "
          f"{'(members report':>15} {'ready)':>7} {'table KB':>9} {'progress/s':>11} {'coord CPU/s':>12} "
          f"{'etcd puts/s':>12} {'CPU us/rank':>12}")  # fmt: skip
    for r in rows:
        print(f"{r['ranks']:>6} {r['fence_s']:>7.3f} {r['agree_claim_s']:>12.3f} {r['commit_s']:>7.3f} "
              f"{r['coordinator_total_s']:>7.3f} {r['seen_total_s']:>7.3f} {r['members_report_s']:>15.3f} "
              f"{r['members_ready_s']:>7.3f} "
              f"{r['table_bytes'] / 1024:>9.1f} {r['progress_writes_per_s']:>11.0f} "
              f"{r['coordinator_cpu_per_s']:>12.3f} {r['etcd_puts_per_s']:>12.0f} "
              f"{r['cpu_us_per_rank_min']:>12.1f}")  # fmt: skip
    ttl = Timeouts.from_env().lease_ttl_s
    budget = progress_budget()
    print(f"\netcd in steady state (no recovery): 'etcd puts/s' is what etcd counted (its /metrics), the members'\n"
          f"progress records at most {budget:,.0f} a second whatever N (LIVEMIG_PROGRESS_BUDGET). Each member's\n"
          f"lease is renewed every TTL/3 = {ttl / 3:.2f} s: N x {3 / ttl:.1f} keep-alives a second, which etcd's\n"
          f"leader answers without a raft proposal (measured now: {kept_alive} keep-alives, {proposals:.0f} "
          f"proposals). At 100,000 ranks: <= {budget:,.0f} puts/s and {100_000 * 3 / ttl:,.0f} "
          f"keep-alives/s;\nwith --node-leases (one lease a node, 8 ranks a node): {100_000 / 8 * 3 / ttl:,.0f} "
          "keep-alives/s.")  # fmt: skip
    if any("watchers" in r for r in rows):
        print("\nthe commit reaching members' watches (each its own connection: the head, then its own row)")
        print(f"{'ranks':>6} {'watchers':>9} {'p50 s':>7} {'max s':>7} {'decode ms':>10} {'B/member':>9} "
              f"{'MB to all ranks':>16}")  # fmt: skip
        for r in rows:
            if "watchers" in r:
                keys = ("delivery_p50_s", "delivery_max_s", "table_decode_s")
                p50, mx, dec = (r.get(k) or float("nan") for k in keys)
                print(f"{r['ranks']:>6} {r['watchers_seen']:>4}/{r['watchers']:<4} {p50:>7.3f} {mx:>7.3f} "
                      f"{dec * 1e3:>10.2f} {r['bytes_per_member_per_change']:>9.0f} "
                      f"{r['fanout_mb_per_change']:>16.3f}")  # fmt: skip
    sizes = [int(x) for x in a.group_build.split(",") if x.strip()]
    builds = [group_build(w, lazy=lazy) for w in sizes for lazy in (False, True)]
    if builds:
        _print_group_builds(builds, max(int(x) for x in a.ranks.split(",")))
    ratios = {f"{b['ranks']}/{x['ranks']}": b["coordinator_total_s"] / x["coordinator_total_s"]
              for x, b in zip(rows, rows[1:], strict=False) if x["coordinator_total_s"] > 0}  # fmt: skip
    per_rank = {f"{b['ranks']}/{x['ranks']}": b["cpu_us_per_rank_min"] / x["cpu_us_per_rank_min"]
                for x, b in zip(rows, rows[1:], strict=False) if x["cpu_us_per_rank_min"] > 0}  # fmt: skip
    for k, v in ratios.items():
        print(f"fence + claim + commit, {k} ranks: {v:.2f}x (fastest of {a.repeat})")
    for k, v in per_rank.items():
        print(f"the coordinator's CPU per rank for a recovery, {k} ranks: {v:.2f}x (least of {a.repeat}; "
              f"issue 54's guard: <= {GUARD_RATIO} from 1,000 to 2,000, docs/benchmarks.md)")  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "group_builds": builds, "ratios": ratios, "cpu_per_rank_ratios": per_rank}, f,
                      indent=2)  # fmt: skip
    return 0
