"""The coordinator: leader-elected, drives every generation change.

It is a loop over snapshots of the job's keys (woken by a watch, at least
every 0.2 s): each pass looks at the current generation's state and does the
one thing that moves it forward. All writes carry the leader guard, so a
deposed coordinator cannot change the job; a standby that takes over
continues from the state in etcd.

    gen 0 --all N workers registered--> g1 FORMING --all ready--> COMMITTED
    COMMITTED --member dead (agent report, lease gone)--> g+1 RECOVERING (fenced)
    RECOVERING --all survivors reported--> agree resume step, claim spare(s): BUILDING
    BUILDING --all ready (spare streamed, groups built)--> COMMITTED (phase 2)
    COMMITTED --every member wrote its final record--> DONE
    no warm spare within spare_wait, no state left, timeouts --> FAILED

Leading (the election, the pass loop, a new leader's take-over) is coordinator/leader.py;
this file is one pass's move. Every decision that changes the membership is a
coordinator/recovery.py `Plan`: a RECOVERING generation's (`plan`, unit-tested on views),
the cold path's (`plan_cold`), a shrunk job's grow (`plan_grow`), the checks'
(coordinator/checks.py) and a migration's failure (coordinator/migrations.py); `_apply` is
its one writer, through the leader's named etcd writes (rdzv/writes.py).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
from dataclasses import replace
from typing import Any

from livemig.config import (
    ENV_INCARNATION,
    Role,
    Timeouts,
    exit_with_parent,
    outage_grace_s,
    stride_of,
)
from livemig.coordinator.checks import Checks
from livemig.coordinator.cold import ColdPath
from livemig.coordinator.leader import Leader
from livemig.coordinator.migrations import Migrations
from livemig.coordinator.prune import stale_ops
from livemig.coordinator.recovery import Plan, Policy, Spare, View, matching, plan, plan_cold, plan_grow
from livemig.coordinator.sharding import (
    first_mismatch,
    has_local_state,
)
from livemig.coordinator.shrink import ShrinkPolicy
from livemig.coordinator.snapshot import Snapshot, as_number, node_of, safe_decode
from livemig.coordinator.store_host import StoreHost
from livemig.coordinator.timeline import Timeline, measured
from livemig.errors import LivemigError
from livemig.rdzv.client import EtcdClient, conform, decode
from livemig.rdzv.election import LeaderElection
from livemig.rdzv.membership import GenState, Member, Membership, Rendezvous, new_incarnation
from livemig.rdzv.writes import Claim, Delete, Op, Put, Writes

log = logging.getLogger("livemig.coordinator")


def held_by_node(lease_only: dict[int, float], node: dict[int, int | None], now: float, settle: float) -> set[int]:
    """The ranks to hold back this pass: every rank of a node whose latest lease-only loss
    (first seen at lease_only[rank]) is younger than settle. Held by node, not by rank: a
    node's ranks whose leases expire one after the other wait for the last one's settle, so
    the first is not fenced alone when its own settle ends before the node key or the next
    rank's lease is seen gone (a CI run fenced a lost node's ranks as [3], then [2])."""
    newest: dict[int, float] = {}
    for r, first in lease_only.items():
        n = node[r]
        if n is not None:
            newest[n] = max(newest.get(n, first), first)
    return {r for r, n in node.items() if n in newest and now - newest[n] < settle}


class Coordinator:
    """One job's coordinator: led by its `Leader` (coordinator/leader.py), it makes one move of
    the generation's state machine per pass (`run_pass`), each decision a `Plan` written by
    `_apply`. What the checks, the planned migration, the cold path and the shrink policy
    remember between passes is theirs; `_since` is when each (generation, state) was first
    seen, which the timeouts are measured from."""

    def __init__(self, client: EtcdClient, job: str, world_size: int,
                 timeouts: Timeouts | None = None, host: str = "127.0.0.1") -> None:  # fmt: skip
        self.client = client
        self.timeouts = timeouts or Timeouts.from_env()
        self.rdzv = Rendezvous(client, job, self.timeouts)
        self.keys = self.rdzv.keys
        self.job = job
        self.world_size = world_size
        self.host = host
        self.id = os.environ.get(ENV_INCARNATION) or new_incarnation(Role.COORDINATOR)
        self.election = LeaderElection(client, job, self.id, self.timeouts.lease_ttl_s,
                                       lambda reason: self.leader.lost(reason))  # fmt: skip
        self.leader = Leader(client, self.rdzv, self.election, self)
        self.writes = Writes(client, self.rdzv, self.election.guard)  # every write: guarded by the leadership
        self.timeline = Timeline(self.keys, self.writes)
        self.stores = StoreHost(host, self.keys, self.timeouts)  # this leader's c10d store process
        self._since: dict[tuple[int, str], float] = {}  # when we first saw (generation, state)
        self.migrations = Migrations(self.keys, self.writes, self.timeline, self.stores, self.timeouts, self.id,
                                     self.pick_spare)  # fmt: skip
        self.cold = ColdPath()  # the cold path: a restart from a checkpoint (coordinator/cold.py)
        self.checks = Checks(self.keys)  # hangs, links, bugs, extras, stragglers: what they remember is theirs
        self.outage_grace_s = outage_grace_s(self.timeouts)
        self._lease_dead: dict[tuple[int, str], float] = {}  # (generation, incarnation) -> lease first seen gone
        self._in_grace = False
        self._measured: set[int] = set()  # generations whose `measured` event is written
        self._pruned: tuple[int, Membership] | None = None  # (pass, table) of a prune that found nothing
        self._notes: tuple[int, Membership, dict[int, list]] | None = None  # _measure's, by pass and table
        # --min-nproc / --shrink-wait: train on the survivors with no spare (runtime/virtual.py)
        self.shrink = ShrinkPolicy(world_size)

    def run(self) -> str:
        """Lead until the job is done or failed (coordinator/leader.py); returns the final state."""
        try:
            return self.leader.run()
        finally:
            self.stores.stop()

    def stepped_down(self) -> None:
        """Leadership lost: the next leadership measures its waits afresh."""
        self._since.clear()

    def standby(self) -> None:
        """A candidate that does not lead starts its c10d store once the job trains (never during
        its start-up, whose imports it would compete with): a takeover then finds it up, instead
        of waiting ~1 s for its torch import inside the recovery's claim (a lost node that held
        the leader cost the lease TTL plus that second)."""
        self.stores.start_once_trained(self.rdzv.read)

    def takeover(self) -> None:
        """A new leader re-issues an in-flight build against its own store; a planned
        migration still catching up is aborted (its background builds used the old store)."""
        m = self.rdzv.read()
        if m.state == GenState.MIGRATING and m.migration.get("phase") == "catchup" and m.store != self.stores.addr:
            kvs, _ = self.client.get_prefix(self.keys.prefix)
            self.migrations.abort(Snapshot(kvs, self.rdzv), "coordinator takeover")
            return
        if m.generation > 0 and m.state in (GenState.FORMING, GenState.BUILDING) and m.store != self.stores.addr:
            new = replace(m, store=self.stores.addr, reason="coordinator takeover")
            self.writes.new_generation(m.generation, new, extra=[self.timeline.op(m.generation + 1, "takeover",
                                                                                  leader=self.id)])  # fmt: skip

    # -- one pass ----------------------------------------------------------------------------
    def run_pass(self, s: Snapshot) -> None:
        """One pass of the leader over a snapshot of the job's keys (not a training step): see
        what changed since the last pass and drive the generation's state machine one move on."""
        m = s.m
        key = (m.generation, m.state)
        first_seen = self._since.setdefault(key, time.monotonic())
        if m.state not in (GenState.DONE, GenState.FAILED):
            bug = self.checks.bug(s)
            if bug is not None:
                return self._fail(m, *bug)
        if m.generation == 0:
            return self._form(s)
        if m.state == GenState.MIGRATING:
            failed = self.migrations.migrating(s, first_seen)
            return None if failed is None else self._apply(s, failed, first_seen)
        if m.state in (GenState.FORMING, GenState.BUILDING, GenState.COMMITTED, GenState.RECOVERING):
            grace = self._outage_grace()
            dead = self._whole_nodes(s, s.dead(m.members, grace), grace)
            if dead and m.stop:  # its checkpoint would lack the lost ranks' parts: the newest complete one stands
                return self._fail(m, f"rank(s) {dead} lost while the job was stopping ({m.stop.get('reason', '')}): "
                                     "resume from the newest complete checkpoint")  # fmt: skip
            if dead:
                return self._fence(s, Plan("fence", ranks=tuple(dead)))
        if m.state in (GenState.FORMING, GenState.BUILDING):
            return self._phase2(s, first_seen)
        if m.state == GenState.RECOVERING:
            return self._recover(s, first_seen)
        if m.state == GenState.COMMITTED:
            return self._committed(s, first_seen)
        if m.state in (GenState.DONE, GenState.FAILED) and not s.get(self.keys.result):
            self._write_result(m)

    def _committed(self, s: Snapshot, since: float) -> None:
        """A COMMITTED generation trains: its checks first (the first that decides acts), a
        shrunk job's grow, a requested planned migration; then pruning, and the job's end."""
        m = s.m
        self.stores.start()  # training runs: the store's import competes with no start-up now
        self._measure(s)
        if m.stop or self._stop(s):  # stopping: no check, grow or migration starts; the members leave
            return self._maybe_done(s)
        differ = self.checks.extras_differ(s)
        if differ:
            return self._fail(m, differ)
        decided = self.checks.links(s) or self.checks.hung(s)
        if decided is None and m.carried:
            grow = plan_grow(m, self._spares(s, self._signature(s)), self.shrink)
            if grow.action == "wait":
                self._refuse(grow.refuse)  # a grow that goes ahead has _apply write its refusals
            else:
                decided = grow
        if decided is not None:
            return self._apply(s, decided, since)
        if self.migrations.maybe_migrate(s):
            return None
        if not m.carried and s.get(self.keys.migrate_request) is None:  # a shrunk job's carriers are slow
            request = self.checks.straggler(s)  # by design: not stragglers
            if request is not None:
                return self._apply(s, request, since)
        self._prune(s)
        return self._maybe_done(s)

    def _stop(self, s: Snapshot) -> bool:
        """The whole job was told to stop (`keys.stop`, agent/drain.py): mark the committed
        table; every member votes it inside its next step's collective, so all agree on the
        step whose boundary they checkpoint before leaving (runtime/stop.py)."""
        req = s.get(self.keys.stop)
        if not isinstance(req, dict):
            return False
        m = s.m
        why = str(req.get("reason", "stop requested"))
        new = replace(m, stop={"reason": why, "time": time.time()})
        if self.writes.update_generation(new, extra=[self.timeline.op(m.generation, "stop", reason=why)]):
            log.warning("the job stops: a checkpoint at the next step's boundary, then exit", extra={"why": why})
        return True

    def _measure(self, s: Snapshot) -> None:
        """Once every member committed a step in this generation, write how its start was
        measured (a `measured` event: coordinator/timeline.py `measured`), once: the report and the
        metrics endpoint both read the recovery's figures from it, so they agree and never
        change after (a member's notes of an earlier generation are gone once it moved on)."""
        m = s.m
        if m.generation in self._measured:
            return
        mine = f"{self.keys.timeline_prefix}{m.generation:08d}/"
        if any(k.endswith("-measured") for k in s.keys_under(mine)):  # written before a takeover
            self._measured.add(m.generation)
            return
        # the notes kept from the last pass, updated from the records that changed since (all of
        # them read again for a new table or after a full read): O(N) once, not every pass
        kept = self._notes
        changed = s.progress_changed(kept[0]) if kept is not None and kept[1] is m else None
        notes: dict[int, list] = kept[2] if kept is not None and changed is not None else {}
        if changed is None:
            changed = [(r, s.get(self.keys.progress(r))) for r in m.members]
        for r, rec in changed:
            note = rec.get("note") if isinstance(rec, dict) else None
            if r in m.members and isinstance(note, list) and note and note[0] == m.generation:
                notes[r] = [note]
            else:
                notes.pop(r, None)
        self._notes = (s.pass_no, m, notes)
        if len(notes) < len(m.members):
            return
        got = measured(notes, len(m.members)).get(m.generation)
        if got is not None:
            self._measured.add(m.generation)
            self.timeline.record(m.generation, "measured", before=got["before"], after=got["after"],
                                 step_s=got["step_s"])  # fmt: skip

    def _outage_grace(self) -> bool:
        """True within LIVEMIG_ETCD_OUTAGE_GRACE (default 2 x the lease TTL) of this
        coordinator's last failed etcd call: leases that expired during an outage are
        being re-attached by live members. An ordinary expired lease, seen by a
        coordinator that reached etcd all along, stays a failure."""
        since = time.monotonic() - self.client.last_failure
        if since < self.outage_grace_s and not self._in_grace:
            log.warning("etcd outage just ended: missing registrations get a grace period",
                        extra={"grace_s": self.outage_grace_s})  # fmt: skip
        self._in_grace = since < self.outage_grace_s
        return self._in_grace

    def _whole_nodes(self, s: Snapshot, dead: list[int], grace: bool) -> list[int]:
        """A lost node is one recovery (docs/reliability.md, "Node loss"). In a job of several
        nodes, every member started by an agent whose node key is gone (its lease expired:
        the node died or was cut off) is dead with it, fenced in the same transaction. A
        member whose lease alone is gone (no agent report) while its agent's key lives is
        held back, with every other such member of its node, until the node's latest such
        death is lease_ttl/2 + 0.5 s old, so the leases of one node's processes, which expire
        within a keep-alive interval of each other, are not fenced one generation each."""
        m = s.m
        run = s.get(self.keys.run) or {}
        if not isinstance(run.get("nnodes"), int) or run["nnodes"] < 2:
            return dead
        lost = set() if grace else {mem.node for mem in m.members.values()
                                    if mem.node is not None and self.keys.node(mem.node) not in s.kv}  # fmt: skip
        out = sorted(set(dead) | {r for r, mem in m.members.items() if mem.node in lost})
        now = time.monotonic()
        settle = self.timeouts.lease_ttl_s / 2 + 0.5
        lease_only: dict[int, float] = {}  # rank -> when its lease was first seen gone (its agent said nothing)
        for r in out:
            mem = m.members[r]
            if s.get(self.keys.suspect(mem.incarnation)) is None and mem.node not in lost and mem.node is not None:
                lease_only[r] = self._lease_dead.setdefault((m.generation, mem.incarnation), now)
        held = held_by_node(lease_only, {r: m.members[r].node for r in out}, now, settle)
        if lost and out:
            log.warning("node(s) lost: their ranks are fenced together", extra={"nodes": sorted(lost), "ranks": out})
        return [r for r in out if r not in held]

    def _stride(self, s: Snapshot) -> int:
        """The buddy stride the members use (config.buddy_stride): from the job's run."""
        return stride_of(s.get(self.keys.run))

    def _guard(self) -> list:
        return [self.election.guard()]

    def _form(self, s: Snapshot) -> None:
        regs = {r: s.get(self.keys.member(r)) for r in range(self.world_size)}
        sigs = s.under(self.keys.signatures_prefix)
        if not all(regs.values()) or not all(str(r) in sigs for r in range(self.world_size)):
            return
        ref = sigs["0"]["signature"]
        for r in range(1, self.world_size):
            diff = first_mismatch(ref, sigs[str(r)]["signature"])
            if diff:
                return self._fail(s.m, f"rank {r}'s model differs from rank 0's ({diff}); "
                                  "every worker must build the same model")  # fmt: skip
        members = {r: Member(r, x["incarnation"], x["host"], x["pid"], x["addr"], node=node_of(x))
                   for r, x in regs.items()}  # fmt: skip
        m = Membership(state=GenState.FORMING, world_size=self.world_size, members=members,
                       store=self.stores.for_generation(s, members), leader=self.id)  # fmt: skip
        # checkpoint_dir: set by the script (ctx.checkpoints), for the cold path (coordinator/cold.py)
        cfg = {"world_size": self.world_size, "signature": ref, "created": time.time(),
               "checkpoint_dir": sigs["0"].get("checkpoint_dir") or None}  # fmt: skip
        self.writes.first_generation(m, extra=[Put(self.keys.config, cfg), self.timeline.op(1, "form")])

    def _fence(self, s: Snapshot, p: Plan) -> None:
        """A "fence" plan: `p.ranks` (of `p.table`, default the current one) fenced into a
        RECOVERING generation, with the plan's events (at that generation) and records. With no
        ranks it rebuilds the group with the same members (a failed collective that names
        nobody, a grow)."""
        m = s.m
        dead = list(p.ranks)
        table = m.members if p.table is None else p.table
        incs = [table[r].incarnation for r in dead]
        suspects = [s.get(self.keys.suspect(i)) for i in incs]
        detected = min((x["time"] for x in suspects if x), default=time.time())
        fault = min((x.get("fault_time") or x["time"] for x in suspects if x), default=detected)
        members = {r: mem for r, mem in s.registered(table).items() if r not in dead}
        new = Membership(state=GenState.RECOVERING, world_size=m.world_size, members=members,
                         kind=p.kind, failed_rank=dead[0] if dead else None, leader=self.id, restarts=m.restarts,
                         carried=m.carried if p.carried is None else p.carried,  # a dead carrier's ranks: vacant
                         reason=p.reason or f"rank(s) {dead} failed in generation {m.generation}")  # fmt: skip
        g = m.generation + 1
        extra: list[Op] = [Delete(self.keys.suspect(i)) for i in incs]
        # detect and fence are recorded in the fencing transaction itself
        extra.append(self.timeline.op(g, "detect", at=detected, ranks=dead, fault_time=fault,
                                      reasons=[x.get("reason") for x in suspects if x]))  # fmt: skip
        extra.append(self.timeline.op(g, "fence", ranks=dead, fenced=incs))
        extra += [self.timeline.op(g, phase, **details) for phase, details in p.events]
        if not self.writes.new_generation(m.generation, new, fence=incs, extra=[*extra, *p.extra]):
            return
        for r in dead:  # revoke: the fenced process learns it within one keep-alive
            kv = s.kv.get(self.keys.member(r))
            if kv is None or not kv.lease:
                continue
            if (decode(kv.value) or {}).get("lease") == "node":  # the node's processes share it (--node-leases):
                self.writes.drop(kv)  # its key goes; the process learns its fence from the member table
            else:
                self.writes.revoke(kv.lease)
        log.warning("fenced", extra={"generation": g, "ranks": dead})

    def _phase2(self, s: Snapshot, since: float) -> None:
        m = s.m
        folder = self.keys.recovery_prefix(m.generation) + "ready/"
        ready = s.under(folder)  # kept up to date pass by pass: the last one only copies it
        if s.count_matching(folder, m.members) < len(m.members):  # counted from the changed records
            if time.monotonic() - since > self.timeouts.recovery.total_seconds():
                missing = [r for r in m.members if str(r) not in ready]
                self._fail(m, f"rank(s) {missing} did not build generation {m.generation} within "
                              f"{self.timeouts.recovery.total_seconds():.0f}s")  # fmt: skip
            return
        new = replace(m, state=GenState.COMMITTED, members=s.registered(m.members))  # a claimed spare's address
        # The events go in the commit's own transaction: a leader killed right after
        # phase 2 cannot leave a committed generation without its timeline.
        events = []
        if m.state == GenState.BUILDING:
            for x in ready.values():
                if "stream_s" in x:
                    events.append(
                        self.timeline.op(
                            m.generation,
                            "stream",
                            at=as_number(x.get("time"), time.time()) - as_number(x.get("build_s")),
                            seconds=as_number(x["stream_s"]),
                            bytes=x.get("bytes", 0),
                            source=x.get("source", ""),
                            follower=bool(x.get("follower")),  # it held the state: the rest streamed only
                        )
                    )
            last = max(x.get("time", 0.0) for x in ready.values()) or time.time()
            # how the members formed the group (comm/communicator.py): the re-forms so far, summed
            comm = sorted({str(x.get("comm", "swap")) for x in ready.values()})
            reconfigures = sum(int(as_number(x.get("reconfigures", 0))) for x in ready.values())
            reused = sum(1 for x in ready.values() if x.get("reused"))  # members re-forming an object that trained
            events.append(self.timeline.op(m.generation, "build", at=last, comm=",".join(comm),
                                           reconfigures=reconfigures, reused=reused))  # fmt: skip
        events.append(self.timeline.op(m.generation, "commit"))
        if self.writes.update_generation(new, extra=events):
            log.info("committed", extra={"generation": m.generation})

    def _signature(self, s: Snapshot) -> list:
        """The job's registered state's signature (what a spare must match), from its config."""
        return (s.get(self.keys.config) or {}).get("signature", [])

    def _recover(self, s: Snapshot, since: float) -> None:
        """A RECOVERING generation: decide (coordinator/recovery.py, `plan`), then write."""
        m = s.m
        cfg = s.get(self.keys.config) or {}
        self.cold.use_job_config(cfg)
        sig = cfg.get("signature", [])
        folder = self.keys.recovery_prefix(m.generation) + "report/"
        reports = s.under(folder)  # kept up to date pass by pass: the last one only copies it
        waited = time.monotonic() - since
        if s.count_matching(folder, m.members) < len(m.members) and waited <= self._policy().recovery_s:
            return  # plan's first answer, counted from the changed reports: wait for the survivors
        view = View(m, reports, sig, stride_of(s.get(self.keys.run)), self._spares(s, sig), self._any_spare(s),
                    time.monotonic() - since, bool(self.cold.dir))  # fmt: skip
        self._apply(s, plan(view, self._policy()), since)

    def _policy(self) -> Policy:
        return Policy(self.timeouts.recovery.total_seconds(), self.timeouts.spare_wait_s, self.shrink,
                      self.cold.forced, self.job)  # fmt: skip

    def _apply(self, s: Snapshot, p: Plan, since: float) -> None:
        """Write what a plan decided: the one place a decision reaches etcd."""
        m = s.m
        if p.agreed and not self._since.get((m.generation, "agreed")):
            self._since[(m.generation, "agreed")] = time.monotonic()
            self.timeline.record(m.generation, "agree", resume_step=p.resume, sources=list(p.sources))
        self._refuse(p.refuse)
        if p.no_shrink and not self._since.get((m.generation, "no-shrink")):
            self._since[(m.generation, "no-shrink")] = time.monotonic()
            log.warning("cannot shrink", extra={"generation": m.generation, "why": p.no_shrink})
        if p.action == "fence":
            self._fence(s, p)
        elif p.action == "fail":
            self._fail(m, p.reason)
        elif p.action == "cold":
            self._restart_cold(s, p.reason, since)
        elif p.action == "fresh":
            self._request_fresh(s, list(p.ranks), since, p.reason)
        elif p.action == "claim":
            self._write_claim(s, p)
        elif p.action == "suspect":  # as if the agents had seen them die: the next pass fences them
            now = time.time()
            suspects = [Put(self.keys.suspect(m.members[r].incarnation), {"rank": r, "why": why, "time": now})
                        for r, why in p.suspects]  # fmt: skip
            events = [self.timeline.op(m.generation, phase, **details) for phase, details in p.events]
            self.writes.record(*suspects, *events)
        elif p.action == "request" and p.request is not None:
            self.writes.record_once(self.keys.migrate_request, p.request)

    def pick_spare(self, s: Snapshot) -> Spare | None:
        """The oldest warm spare whose model matches the job's, refusing (in etcd) those whose
        model differs: a planned migration's spare."""
        ok, refuse = matching(self._spares(s, self._signature(s)))
        self._refuse(refuse)
        return ok[0] if ok else None

    def _refuse(self, refuse: tuple[tuple[str, str], ...]) -> None:
        """Tell each spare whose model differs from the job's why it is refused (its assignment key)."""
        for sid, reason in refuse:
            log.error("spare refused", extra={"spare": sid, "reason": reason})
        self.writes.record(*[Put(self.keys.assignment(sid), {"refused": reason}) for sid, reason in refuse])

    def _spares(self, s: Snapshot, signature: list) -> tuple[Spare, ...]:
        """The warm spares nobody claimed or fenced, follow spares first (they hold the state
        already: runtime/follow.py), then oldest first, each with how its model differs from the
        job's `signature` (a plan refuses those)."""
        out = []

        def order(kv: Any) -> tuple[bool, int]:
            info = safe_decode(kv.key, kv.value) or {}
            return not info.get("follow"), kv.create_revision

        for kv in sorted((s.kv[k] for k in s.keys_under(self.keys.spares_prefix)), key=order):
            sid = kv.key[len(self.keys.spares_prefix) :]
            info = safe_decode(kv.key, kv.value)
            if not info or "incarnation" not in info:
                continue
            if info.get("state") != "warm" or s.kv.get(self.keys.assignment(sid)) is not None:
                continue
            if s.kv.get(self.keys.fenced(info["incarnation"])) is not None:
                continue
            out.append(Spare(sid, kv, info, first_mismatch(signature, info.get("signature", [])) or ""))
        return tuple(out)

    def _any_spare(self, s: Snapshot) -> bool:
        return bool(s.keys_under(self.keys.spares_prefix))

    def _request_fresh(self, s: Snapshot, ranks: list[int], since: float, why: str) -> None:
        """Ask the agents, once per generation, for a fresh process for each of `ranks` (each
        agent starts those of the ranks it launched; they register as spares); fail the job
        with one line if they are not warm within the recovery timeout."""
        m = s.m
        key = self.keys.cold_request(m.generation)
        if s.get(key) is None:
            event = self.timeline.op(m.generation, "fresh", ranks=ranks, reason=why)
            if self.writes.record_once(key, {"ranks": ranks, "time": time.time()}, event):
                log.warning("asking the agents for fresh processes", extra={"generation": m.generation, "ranks": ranks})
        elif time.monotonic() - since > self.timeouts.recovery.total_seconds():
            limit = self.timeouts.recovery.total_seconds()
            self._fail(m, f"{why}; no fresh process for rank(s) {ranks} was warm within {limit:.0f}s "
                          "(is the agent of their node alive?)")  # fmt: skip

    def _restart_cold(self, s: Snapshot, why: str, since: float) -> None:
        """The cold path (docs/reliability.md): live recovery cannot serve this failure (the
        state it needs died with the lost ranks), so the job restarts from its newest complete
        checkpoint at the same world size: survivors load it in place, each lost rank is taken
        by a warm spare or a fresh process from its node's agent. Only with no checkpoint, or
        --max-restarts spent, does the job fail, saying why."""
        m = s.m
        reports = s.under(self.keys.recovery_prefix(m.generation) + "report/")
        done = [x.get("committed") for x in reports.values() if isinstance(x.get("committed"), int)]
        cfg = s.get(self.keys.config) or {}
        self.cold.use_job_config(cfg)
        sig = cfg.get("signature", [])
        checkpoint = self.cold.plan(m, why, max(done, default=None), has_local_state(sig))
        p = plan_cold(View(m, reports, sig, spares=self._spares(s, sig)), why, checkpoint)
        if p.action == "claim" and not self._since.get((m.generation, "cold")):
            self._since[(m.generation, "cold")] = time.monotonic()
            log.warning("cold path: restarting from a checkpoint",
                        extra={"generation": m.generation, "why": why, "step": p.resume})  # fmt: skip
        self._apply(s, p, since)

    def _write_claim(self, s: Snapshot, p: Plan) -> None:
        """A "claim" plan: spares `p.picks` for `p.vacant` in the same generation, now BUILDING
        from `p.resume`; `p.carry`: lost ranks no spare is left for, carried by survivors."""
        m = s.m
        assert p.resume is not None
        vacant, resume = list(p.vacant), p.resume
        members = dict(m.members)
        carried = {v: c for v, c in m.carried.items() if c in members and v not in vacant}  # a shrunk job's
        if p.carry:
            stride = stride_of(s.get(self.keys.run))
            carried = {v: c for v, c in self.shrink.carriers(m, list(p.carry), stride, p.mode).items()
                       if v not in vacant}  # fmt: skip
        claims: list[Claim] = []
        ops: list[Op] = []
        for rank, sp in zip(vacant, p.picks, strict=True):
            info = sp.info
            members[rank] = Member(rank, info["incarnation"], info.get("host", ""), info.get("pid", 0),
                                   "", role=Role.SPARE, spare_id=sp.sid)  # fmt: skip
            claimed = dict(info, state="claimed", claim={"generation": m.generation, "rank": rank})
            claims.append(Claim(sp.kv, self.keys.assignment(sp.sid), {"generation": m.generation, "rank": rank},
                                claimed))  # fmt: skip
        new = replace(m, state=GenState.BUILDING, members=members, resume_step=resume, carried=carried,
                      sources=list(p.sources), store=self.stores.for_generation(s, members))  # fmt: skip
        restart = p.restart
        if restart is not None:
            new = replace(new, kind="restart", restart=restart, restarts=m.restarts + 1)
            ops.append(self.timeline.op(m.generation, "restart", path=restart["path"], step=restart["step"],
                                        redone=restart.get("redone"), count=m.restarts + 1,
                                        reason=restart.get("reason", "")))  # fmt: skip
        if p.carry:
            new = replace(new, kind="shrink")
            ops.append(self.timeline.op(m.generation, "shrink", ranks=list(p.carry),
                                        carried={str(v): c for v, c in carried.items()}, physical=len(members),
                                        virtual=m.world_size, resume_step=resume))  # fmt: skip
        if p.picks:
            ops.append(self.timeline.op(m.generation, "claim", spares=[sp.sid for sp in p.picks], ranks=vacant))
        ok = self.writes.update_generation(new, extra=ops, claims=claims)
        if ok and p.picks:
            log.info("claimed", extra={"generation": m.generation, "spares": [sp.sid for sp in p.picks]})
        if ok and p.carry:
            log.warning("shrunk: the survivors carry the lost rank(s)",
                        extra={"generation": m.generation, "carried": carried, "physical": len(members)})  # fmt: skip

    def _prune(self, s: Snapshot) -> None:
        """Remove what finished generations left behind (coordinator/prune.py). A pass that
        found nothing to prune is not repeated while the table and the folders it reads stay
        as they were (it reads every member of the table)."""
        k = self.keys
        read = (k.recoveries_prefix, k.timeline_prefix, k.suspects_prefix, k.assignments_prefix, k.members_prefix)
        if self._pruned is not None and self._pruned[1] is s.m and s.unchanged_since(read, self._pruned[0]):
            return
        ops = stale_ops(s, self.keys)
        self._pruned = None if ops else (s.pass_no, s.m)
        if ops and self.writes.record(*ops):
            log.info("pruned", extra={"generation": s.m.generation, "ops": len(ops)})

    def _maybe_done(self, s: Snapshot) -> None:
        m = s.m
        finals = s.under(self.keys.final_prefix)
        if m.members and all(
            finals.get(str(r), {}).get("incarnation") == mem.incarnation for r, mem in m.members.items()
        ):
            new = replace(m, state=GenState.DONE)
            if self.writes.update_generation(new):
                self._write_result(new)

    def _fail(self, m: Membership, reason: str, detail: str = "") -> None:
        log.error("job failed", extra={"reason": reason})
        new = replace(m, state=GenState.FAILED, reason=reason)
        if m.generation == 0:
            self.writes.first_generation(new)
        else:
            self.writes.update_generation(new)
        self._write_result(new, detail)

    def _write_result(self, m: Membership, detail: str = "") -> None:
        res = {"state": str(m.state), "reason": m.reason if m.state == GenState.FAILED else "",
               "generation": m.generation, "time": time.time()}  # fmt: skip
        if m.state == GenState.DONE and m.stop:  # stopped at a checkpoint: a restart resumes from it
            finals = self.client.get_prefix(self.keys.final_prefix)[0]
            recs = (conform(kv.value, {}, {"stopped": (int,)}) for kv in finals)
            steps = [int(f["stopped"]) for f in recs if f and "stopped" in f]
            if steps:
                res.update(state="stopped", reason=m.stop.get("reason", ""), step=min(steps))
            else:  # every member trained its last step before the stop reached it: the job is done
                log.info("a stop came after the last step: the job is done", extra={"reason": m.stop.get("reason")})
        if detail:
            res["traceback"], res["raised_at"] = detail, self.checks.bug_time
        self.writes.record(Put(self.keys.result, res))


def main(argv: list[str] | None = None) -> int:
    import argparse

    from livemig import logs

    p = argparse.ArgumentParser(prog="python -m livemig.coordinator")
    p.add_argument("--etcd", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1", help="address members reach the group store at")
    a = p.parse_args(argv)
    logs.setup(role=Role.COORDINATOR)
    exit_with_parent()
    try:
        timeouts = Timeouts.from_env()
        client = EtcdClient(a.etcd, timeouts.etcd)
        coord = Coordinator(client, a.job, a.world_size, timeouts, a.host or socket.gethostname())

        def on_term(_signum: int, _frame: object) -> None:
            raise KeyboardInterrupt()

        signal.signal(signal.SIGTERM, on_term)
        try:
            state = coord.run()
        except KeyboardInterrupt:  # the agent stops (a drain, the job's end): hand the lead on at once
            coord.election.resign()  # a candidate elsewhere takes it now, not a lease TTL later
            return 0
    except LivemigError as exc:
        print(f"livemig coordinator: error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0 if state in (GenState.DONE, "deposed") else 4
