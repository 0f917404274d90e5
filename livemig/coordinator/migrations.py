"""Planned migration, the coordinator's side (docs/architecture.md, "Planned
migration"): take a request (`livemig migrate`, a fault plan, the straggler hook),
claim a warm spare, let it stream and catch up while the group trains, vote the
switch step, commit, or abort and leave the group as it was. A collaborator of
the Coordinator: it acts through its _guard, pick_spare and the timeline.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, replace
from typing import Any

from livemig.config import Role
from livemig.coordinator.sharding import sharding_of
from livemig.coordinator.snapshot import Snapshot, as_number
from livemig.rdzv.client import encode
from livemig.rdzv.membership import GenState, Member, Membership

log = logging.getLogger("livemig.coordinator")

MIGRATION_SWITCH_LAG = 2  # steps a migrating spare may trail the group when the switch is voted


def _table_before(m: Membership) -> dict[int, Member]:
    """A MIGRATING generation's table with the leaving worker back in its rank."""
    old = dict(m.members)
    old[int(m.migration["rank"])] = Member.from_dict(m.migration["leaving_member"])
    return old


class Migrations:
    """The coordinator's side of a planned migration. It keeps no state of its own (the
    table in etcd is the state): it acts through its coordinator's client, keys, guard,
    timeline, stores and spare picking."""

    def __init__(self, coord: Any) -> None:
        self.coord = coord

    def maybe_migrate(self, s: Snapshot) -> bool:
        """Start a requested migration: claim a spare, move to g+1 MIGRATING. True if it acted."""
        m = s.m
        req = s.get(self.coord.keys.migrate_request)
        if req is None:
            if not m.carried:  # a shrunk job's carriers are slow by design: not stragglers
                self.coord.checks.straggler(s)
            return False
        t = self.coord.client.txn_ops
        rank, rid = req.get("rank"), req.get("id", "")
        reject = ""
        if not isinstance(rank, int) or rank not in m.members:
            reject = f"rank {rank!r} is not a member of the job (world size {m.world_size})"
        elif (mode := sharding_of((s.get(self.coord.keys.config) or {}).get("signature", []))[0]) == "zero1":
            reject = f"planned migration of a job with sharded state ({mode}) is not supported yet"
        elif m.carried:
            reject = "planned migration of a shrunk job (survivors carrying lost ranks) is not supported yet"
        elif m.world_size < 2:
            reject = "a job of one rank has no group to keep training while the spare catches up"
        spare = None if reject else self.coord.pick_spare(s)
        if not reject and spare is None:
            if time.time() - as_number(req.get("time")) > self.coord.timeouts.spare_wait.total_seconds():
                reject = (f"no warm spare within {self.coord.timeouts.spare_wait.total_seconds():.0f}s "
                          "(LIVEMIG_SPARE_WAIT): start one with `livemig-spare start`")  # fmt: skip
            else:
                return False  # wait for a spare; the job trains on
        if reject:
            log.error("migration request rejected", extra={"rank": rank, "reason": reject})
            res = {"id": rid, "state": "rejected", "rank": rank, "reason": reject, "time": time.time()}
            self.coord.client.txn(self.coord._guard(), [t.delete(self.coord.keys.migrate_request),
                                            t.put(self.coord.keys.migrate_result, encode(res))])  # fmt: skip
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
                         store=self.coord.stores.for_generation(s, members),
                         kind="migration", leader=self.coord.id, migration=mig,
                         reason=f"planned migration of rank {rank}: {req.get('reason') or 'requested'}")  # fmt: skip
        claimed = dict(info, state="claimed", claim={"generation": g, "rank": rank, "migration": True})
        compare = [
            *self.coord._guard(),
            t.mod(kv.key) == kv.mod_revision,
            t.version(self.coord.keys.assignment(sid)) == 0,
        ]
        ops = [t.put(self.coord.keys.assignment(sid), encode({"generation": g, "rank": rank, "migration": True})),
               t.put(kv.key, encode(claimed), kv.lease), t.delete(self.coord.keys.migrate_request),
               self.coord.timeline.op(g, "request", at=mig["requested"], rank=rank, reason=mig["reason"], id=rid),
               self.coord.timeline.op(g, "claim", spares=[sid], ranks=[rank])]  # fmt: skip
        if self.coord.rdzv.commit_change(m.generation, new, guard=compare, extra=ops):
            log.warning("planned migration started", extra={"generation": g, "rank": rank, "spare": sid})
        return True

    def migrating(self, s: Snapshot, since: float) -> None:
        m = s.m
        mig, g = m.migration, m.generation
        rank = int(mig["rank"])
        spare = m.members[rank]
        old = _table_before(m)
        t = self.coord.client.txn_ops
        ready = s.under(self.coord.keys.recovery_prefix(g) + "ready/")
        switched = {int(r) for r, x in ready.items()
                    if x.get("switched") is not None and int(r) in m.members
                    and x.get("incarnation") == m.members[int(r)].incarnation}  # fmt: skip
        dead = [r for r, mem in m.members.items() if r != rank and not s.alive(r, mem)]
        spare_dead = not s.alive(rank, spare)
        leaving_dead = rank not in switched and (
            s.get(self.coord.keys.suspect(old[rank].incarnation)) is not None
            or (s.get(self.coord.keys.member(rank)) or {}).get("incarnation")
            not in (old[rank].incarnation, spare.incarnation)
        )
        finals = s.under(self.coord.keys.final_prefix)
        finished = all(finals.get(str(r), {}).get("incarnation") == mem.incarnation for r, mem in old.items())
        bound = self.coord.timeouts.recovery.total_seconds()
        timed_out = time.monotonic() - since > bound
        if mig.get("phase") == "catchup" and not switched and (spare_dead or finished or timed_out):
            why = ("the spare failed" if spare_dead else "the job finished first" if finished
                   else f"the spare did not catch up within {bound:.0f}s")  # fmt: skip
            return self.abort(s, why)
        if mig.get("phase") == "switch" and not switched and finished and not spare_dead:
            # The vote never passed before the last step: every old member has ended, so no
            # vote can pass now; the spare would wait for an average nobody will serve.
            return self.abort(s, "the job finished first")
        if dead or leaving_dead or spare_dead:
            # A failure during the migration: recover from the table that holds the state.
            table = m.members if rank in switched else old
            lost = [r for r in dead if r in table]
            if rank in switched and spare_dead:
                lost.append(rank)
            if rank not in switched and leaving_dead:
                lost.append(rank)
            more = [] if rank in switched else [t.delete(self.coord.keys.assignment(spare.spare_id))]
            res = {
                "id": mig.get("id", ""),
                "state": "done" if rank in switched else "aborted",
                "rank": rank,
                "reason": f"a failure during the migration (ranks {sorted(set(lost))})",
                "time": time.time(),
            }
            more.append(t.put(self.coord.keys.migrate_result, encode(res)))
            return self.coord._fence(s, sorted(set(lost)), table, more)
        if mig.get("phase") == "catchup":
            cu = s.get(self.coord.keys.catchup(g))
            if not cu or cu.get("incarnation") != spare.incarnation:
                return None
            progress = [(s.get(self.coord.keys.progress(r)) or {}).get("step", -1) for r in m.members]
            lag = max(progress) - int(cu["applied"])
            built = all(ready.get(str(r), {}).get("incarnation") == mem.incarnation for r, mem in m.members.items())
            if lag > MIGRATION_SWITCH_LAG or not built:
                return None  # once every group is built the switch needs no store: a leader change is harmless
            new = replace(m, migration=dict(mig, phase="switch", lag_at_switch=lag))
            events = [self.coord.timeline.op(g, "stream", at=cu["time"], seconds=cu.get("stream_s", 0.0),
                                       bytes=cu.get("bytes", 0), source=cu.get("source", ""), loaded=cu["loaded"],
                                       resyncs=as_number(cu.get("resyncs"))),
                      self.coord.timeline.op(g, "catchup", lag=lag, applied=cu["applied"])]  # fmt: skip
            if self.coord.rdzv.update(new, guard=self.coord._guard(), extra=events):
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
            events = [self.coord.timeline.op(g, "switch", at=at, step=step), self.coord.timeline.op(g, "commit"),
                      t.put(self.coord.keys.migrate_result, encode(res))]  # fmt: skip
            if self.coord.rdzv.update(new, guard=self.coord._guard(), extra=events):
                log.warning("planned migration done", extra={"generation": g, "rank": rank, "switch_step": step})
        return None

    def abort(self, s: Snapshot, why: str) -> None:
        """Nobody switched: the old table and group go on (generation g+1 with continues=g)."""
        m = s.m
        mig = m.migration
        t = self.coord.client.txn_ops
        new = Membership(state=GenState.COMMITTED, world_size=m.world_size, members=_table_before(m), store=m.store,
                         kind="abort", leader=self.coord.id, continues=int(mig["from_gen"]),
                         reason=f"migration of rank {mig['rank']} aborted: {why}")  # fmt: skip
        res = {"id": mig.get("id", ""), "state": "aborted", "rank": mig["rank"], "reason": why, "time": time.time()}
        ops = [t.delete(self.coord.keys.assignment(m.members[int(mig["rank"])].spare_id)),
               t.put(self.coord.keys.migrate_result, encode(res)),
               self.coord.timeline.op(m.generation, "abort", reason=why, rank=mig["rank"])]  # fmt: skip
        if self.coord.rdzv.commit_change(m.generation, new, guard=self.coord._guard(), extra=ops):
            log.warning("planned migration aborted", extra={"rank": mig["rank"], "why": why})
