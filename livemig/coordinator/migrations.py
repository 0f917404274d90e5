"""Planned migration, the coordinator's side (docs/architecture.md, "Planned
migration"): take a request (`livemig migrate`, a fault plan, the straggler hook),
claim a warm spare, let it stream and catch up while the group trains, vote the
switch step, commit, or abort and leave the group as it was. It writes its own
transactions (the claim, the switch, the commit, an abort) through the leader's
named writes (rdzv/writes.py); a failure during a migration is a recovery, which
it returns as a `Plan` for the coordinator to write (coordinator/recovery.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import TYPE_CHECKING

from livemig.config import Role, Timeouts
from livemig.coordinator.recovery import Plan, Spare
from livemig.coordinator.snapshot import Snapshot, as_number
from livemig.coordinator.timeline import Timeline
from livemig.rdzv.keys import JobKeys
from livemig.rdzv.membership import GenState, Member, Membership
from livemig.rdzv.writes import Claim, Delete, Op, Put, Writes

if TYPE_CHECKING:
    from livemig.coordinator.store_host import StoreHost

log = logging.getLogger("livemig.coordinator")

MIGRATION_SWITCH_LAG = 2  # steps a migrating spare may trail the group when the switch is voted


def _table_before(m: Membership) -> dict[int, Member]:
    """A MIGRATING generation's table with the leaving worker back in its rank."""
    old = dict(m.members)
    old[int(m.migration["rank"])] = Member.from_dict(m.migration["leaving_member"])
    return old


class Migrations:
    """The coordinator's side of a planned migration. It keeps no state of its own (the
    table in etcd is the state); `pick_spare` is the coordinator's choice of a warm spare
    (refusing, in etcd, those whose model differs), `leader` this leader's id."""

    def __init__(self, keys: JobKeys, writes: Writes, timeline: Timeline, stores: StoreHost, timeouts: Timeouts,
                 leader: str, pick_spare: Callable[[Snapshot], Spare | None]) -> None:  # fmt: skip
        self.keys = keys
        self.writes = writes
        self.timeline = timeline
        self.stores = stores
        self.timeouts = timeouts
        self.leader = leader
        self.pick_spare = pick_spare

    def maybe_migrate(self, s: Snapshot) -> bool:
        """Start a requested migration: claim a spare, move to g+1 MIGRATING. True if it acted
        (False: no request, or one that waits for a spare while the job trains on)."""
        m = s.m
        req = s.get(self.keys.migrate_request)
        if req is None:
            return False
        rank, rid = req.get("rank"), req.get("id", "")
        reject = ""
        if not isinstance(rank, int) or rank not in m.members:
            reject = f"rank {rank!r} is not a member of the job (world size {m.world_size})"
        elif m.carried:
            reject = "planned migration of a shrunk job (survivors carrying lost ranks) is not supported yet"
        elif m.world_size < 2:
            reject = "a job of one rank has no group to keep training while the spare catches up"
        spare = None if reject else self.pick_spare(s)
        if not reject and spare is None:
            if time.time() - as_number(req.get("time")) > self.timeouts.spare_wait.total_seconds():
                reject = (f"no warm spare within {self.timeouts.spare_wait.total_seconds():.0f}s "
                          "(LIVEMIG_SPARE_WAIT): start one with `livemig-spare start`")  # fmt: skip
            else:
                return False  # wait for a spare; the job trains on
        if reject:
            log.error("migration request rejected", extra={"rank": rank, "reason": reject})
            res = {"id": rid, "state": "rejected", "rank": rank, "reason": reject, "time": time.time()}
            self.writes.record(Delete(self.keys.migrate_request), Put(self.keys.migrate_result, res))
            return True
        assert spare is not None
        sid, kv, info = spare.sid, spare.kv, spare.info
        leaving = m.members[rank]
        members = dict(m.members)
        members[rank] = Member(rank, info["incarnation"], info.get("host", ""), info.get("pid", 0), "",
                               role=Role.SPARE, spare_id=sid)  # fmt: skip
        g = m.generation + 1
        mig = {"id": rid, "rank": rank, "from_gen": m.group_gen, "leaving": leaving.incarnation,
               "leaving_member": asdict(leaving), "addr": leaving.addr, "phase": "catchup",
               "requested": as_number(req.get("time"), time.time()), "reason": str(req.get("reason", "")),
               "spare": sid}  # fmt: skip
        new = Membership(state=GenState.MIGRATING, world_size=m.world_size, members=members,
                         store=self.stores.for_generation(s, members),
                         kind="migration", leader=self.leader, migration=mig,
                         reason=f"planned migration of rank {rank}: {req.get('reason') or 'requested'}")  # fmt: skip
        claimed = dict(info, state="claimed", claim={"generation": g, "rank": rank, "migration": True})
        claim = Claim(kv, self.keys.assignment(sid), {"generation": g, "rank": rank, "migration": True}, claimed)
        ops: list[Op] = [Delete(self.keys.migrate_request),
               self.timeline.op(g, "request", at=mig["requested"], rank=rank, reason=mig["reason"], id=rid),
               self.timeline.op(g, "claim", spares=[sid], ranks=[rank])]  # fmt: skip
        if self.writes.new_generation(m.generation, new, extra=ops, claims=[claim]):
            log.warning("planned migration started", extra={"generation": g, "rank": rank, "spare": sid})
        return True

    def migrating(self, s: Snapshot, since: float) -> Plan | None:
        """One pass over a MIGRATING generation: abort, vote the switch, commit, or (a member
        lost meanwhile) the recovery to write, returned."""
        m = s.m
        mig, g = m.migration, m.generation
        rank = int(mig["rank"])
        spare = m.members[rank]
        old = _table_before(m)
        ready = s.under(self.keys.recovery_prefix(g) + "ready/")
        switched = {int(r) for r, x in ready.items()
                    if x.get("switched") is not None and int(r) in m.members
                    and x.get("incarnation") == m.members[int(r)].incarnation}  # fmt: skip
        dead = [r for r, mem in m.members.items() if r != rank and not s.alive(r, mem)]
        spare_dead = not s.alive(rank, spare)
        leaving_dead = rank not in switched and (
            s.get(self.keys.suspect(old[rank].incarnation)) is not None
            or (s.get(self.keys.member(rank)) or {}).get("incarnation")
            not in (old[rank].incarnation, spare.incarnation)
        )
        finals = s.under(self.keys.final_prefix)
        finished = all(finals.get(str(r), {}).get("incarnation") == mem.incarnation for r, mem in old.items())
        bound = self.timeouts.recovery.total_seconds()
        timed_out = time.monotonic() - since > bound
        if mig.get("phase") == "catchup" and not switched and (spare_dead or finished or timed_out):
            why = ("the spare failed" if spare_dead else "the job finished first" if finished
                   else f"the spare did not catch up within {bound:.0f}s")  # fmt: skip
            self.abort(s, why)
            return None
        if mig.get("phase") == "switch" and not switched and finished and not spare_dead:
            # The vote never passed before the last step: every old member has ended, so no
            # vote can pass now; the spare would wait for an average nobody will serve.
            self.abort(s, "the job finished first")
            return None
        if dead or leaving_dead or spare_dead:
            # A failure during the migration: recover from the table that holds the state.
            table = m.members if rank in switched else old
            lost = [r for r in dead if r in table]
            if rank in switched and spare_dead:
                lost.append(rank)
            if rank not in switched and leaving_dead:
                lost.append(rank)
            more: list[Op] = [] if rank in switched else [Delete(self.keys.assignment(spare.spare_id))]
            res = {
                "id": mig.get("id", ""),
                "state": "done" if rank in switched else "aborted",
                "rank": rank,
                "reason": f"a failure during the migration (ranks {sorted(set(lost))})",
                "time": time.time(),
            }
            more.append(Put(self.keys.migrate_result, res))
            # The report's outcome of this migration (agent/report.py) reads the timeline: without
            # an event it said "incomplete" for one a failure ended, moved or not.
            more.append(self.timeline.op(m.generation, "ended", state=res["state"], reason=res["reason"], rank=rank))
            return Plan("fence", ranks=tuple(sorted(set(lost))), table=table, extra=tuple(more))
        if mig.get("phase") == "catchup":
            cu = s.get(self.keys.catchup(g))
            if not cu or cu.get("incarnation") != spare.incarnation:
                return None
            progress = [(s.get(self.keys.progress(r)) or {}).get("step", -1) for r in m.members]
            lag = max(progress) - int(cu["applied"])
            built = all(ready.get(str(r), {}).get("incarnation") == mem.incarnation for r, mem in m.members.items())
            if lag > MIGRATION_SWITCH_LAG or not built:
                return None  # once every group is built the switch needs no store: a leader change is harmless
            new = replace(m, migration=dict(mig, phase="switch", lag_at_switch=lag))
            events = [self.timeline.op(g, "stream", at=cu["time"], seconds=cu.get("stream_s", 0.0),
                                       bytes=cu.get("bytes", 0), source=cu.get("source", ""), loaded=cu["loaded"],
                                       resyncs=as_number(cu.get("resyncs"))),
                      self.timeline.op(g, "catchup", lag=lag, applied=cu["applied"])]  # fmt: skip
            if self.writes.update_generation(new, extra=events):
                log.info("migration: spare caught up; members vote the switch", extra={"generation": g, "lag": lag})
            return None
        if switched == set(m.members):
            at = min(as_number(ready[str(r)].get("time"), time.time()) for r in m.members)
            step = min(ready[str(r)]["switched"] for r in m.members)
            # The spare registered its address at the switch: the table a later recovery
            # pulls from must hold it (an empty one left nothing to pull from).
            new = replace(m, state=GenState.COMMITTED, members=s.registered(m.members),
                          migration=dict(mig, phase="done", switch_step=step))  # fmt: skip
            res = {"id": mig.get("id", ""), "state": "done", "rank": rank, "generation": g, "switch_step": step,
                   "spare": spare.spare_id, "time": time.time()}  # fmt: skip
            # every newer snapshot the spare loaded, also after the catch-up was recorded (a
            # final snapshot taken once the switch was voted)
            resyncs = as_number(ready.get(str(rank), {}).get("resyncs"))
            events = [self.timeline.op(g, "switch", at=at, step=step, resyncs=resyncs), self.timeline.op(g, "commit"),
                      Put(self.keys.migrate_result, res)]  # fmt: skip
            if self.writes.update_generation(new, extra=events):
                log.warning("planned migration done", extra={"generation": g, "rank": rank, "switch_step": step})
        return None

    def abort(self, s: Snapshot, why: str) -> None:
        """Nobody switched: the old table and group go on (generation g+1 with continues=g)."""
        m = s.m
        mig = m.migration
        new = Membership(state=GenState.COMMITTED, world_size=m.world_size, members=_table_before(m), store=m.store,
                         kind="abort", leader=self.leader, continues=int(mig["from_gen"]),
                         reason=f"migration of rank {mig['rank']} aborted: {why}")  # fmt: skip
        res = {"id": mig.get("id", ""), "state": "aborted", "rank": mig["rank"], "reason": why, "time": time.time()}
        ops: list[Op] = [Delete(self.keys.assignment(m.members[int(mig["rank"])].spare_id)),
               Put(self.keys.migrate_result, res),
               self.timeline.op(m.generation, "abort", reason=why, rank=mig["rank"])]  # fmt: skip
        if self.writes.new_generation(m.generation, new, extra=ops):
            log.warning("planned migration aborted", extra={"rank": mig["rank"], "why": why})
