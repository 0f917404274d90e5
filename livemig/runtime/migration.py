"""Planned migration: the leaving worker serves, the catching-up spare replays.

The leaving worker serves a snapshot and then each step's averaged gradient
while training goes on; the spare loads the snapshot, replays the averages,
and both switch at a step voted inside the gradient collective
(docs/architecture.md, "Planned migration").

A collaborator of api.Engine (`engine.migration`, made anew when the user's function is
entered again): it owns the leaving worker's side (`Outgoing`); what it uses of the Engine
is named in `MigrationHost`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from livemig.config import Role
from livemig.errors import RecoveryError, TransferError, WithdrawnError
from livemig.rdzv.membership import GenState, Membership
from livemig.runtime.control import Released, Requeue
from livemig.runtime.step_state import Outgoing, StepState

if TYPE_CHECKING:
    from livemig.runtime.member import MemberRuntime
    from livemig.runtime.strategies.base import Strategy
from livemig.state import flatten, unflatten, unpack
from livemig.transfer import items
from livemig.transfer.puller import pull

AVG_KEEP = 8  # averaged gradients a leaving worker keeps for its catching-up spare


log = logging.getLogger("livemig.runtime.migration")


class MigrationHost(Protocol):
    """What a planned migration uses of its Engine: the member runtime, the registered state,
    the step counter it advances while catching up, and the strategy that snapshots and
    replays the state of its kind of parallelism."""

    runtime: MemberRuntime
    role: Role
    incarnation: str
    timeouts: Any
    reg: Any
    committed: int
    reducer: Any
    joining: Any
    faults: Any
    st: StepState
    loaded_step: int | None
    stream_info: dict[str, Any]
    strategy: Strategy
    follower: Any  # a follow spare's held state (runtime/follow.py Follower)

    def join_recovery(self, t: int | None, exc: BaseException) -> None: ...


class Migration:
    """Both sides of a planned migration, for one Engine."""

    def __init__(self, host: MigrationHost) -> None:
        self.e = host
        self.out = Outgoing()  # the leaving worker's side
        self.switch_at: tuple[int, int] | None = None  # FSDP2: (generation, step) to switch to at the boundary

    @property
    def leaving(self) -> int | None:
        """The generation this worker leaves for at the next boundary (the switch was voted)."""
        return self.out.leaving

    def _plan(self) -> tuple[Membership, dict] | None:
        """The migration of our group in progress, if any."""
        rt = self.e.runtime
        if rt is None or rt.m.state != GenState.MIGRATING or rt.m.migration.get("from_gen") != rt.gen:
            return None
        m = rt.m
        return m, m.migration

    def tick(self) -> None:
        """At a step boundary: the leaving worker takes its snapshot once the spare
        asks for it; every staying member starts building the new group."""
        if self.e.role == Role.LOCAL or not self.e.strategy.migrates:
            return
        self.at_boundary()
        rt = self.e.runtime
        plan = self._plan()
        if plan is None:
            if self.out.gen is not None and rt.m.generation != self.out.gen:
                rt.serving.withdraw()  # the migration was resolved: stop serving its items
                self.out = Outgoing()
                if self.e.reducer is not None:
                    self.e.reducer.keep(2)
            return
        m, mig = plan
        if mig.get("leaving") == self.e.incarnation:
            self.refuse_stale(rt.serving)
            # "snapshot" first; "snapshot/k" when the spare fell more than AVG_KEEP steps behind
            # (a retry that raced our first publish leaves "snapshot" wanted too: the newest counts)
            snaps = [w for w in list(rt.serving.wanted) if items.is_snapshot(w)]
            for w in snaps:
                rt.serving.wanted.discard(w)
            if self.out.gen == m.generation:
                snaps = [w for w in snaps if w != self.out.snap]
            want = max(snaps, key=lambda w: int(w.partition("/")[2] or 0), default=None)
            if want is None and items.UPDATES in rt.serving.wanted:
                self.serve_updates(m.generation)
            if want is not None:
                if self.out.gen == m.generation and self.out.snap:
                    rt.serving.withdraw(self.out.snap)  # the spare asked for a newer one: free the old copy
                tensors: list[torch.Tensor] = []
                skel = flatten(self.e.strategy.handover.snapshot(), tensors)  # FSDP2: its shards and its mirror's
                snap = unflatten(skel, [x.clone() for x in tensors])  # training goes on: serve a copy
                step = self.e.committed + 1
                rt.serving.publish(m.generation, want, lambda: (step, snap))
                self._serve_from(m.generation, step, want)
                log.info("migration: snapshot served", extra={"step": step, "generation": m.generation,
                                                              "item": want})  # fmt: skip
        elif (rank := m.rank_of(self.e.incarnation, rt.rank)) is not None:
            rt.prebuild(m, rank)

    def serve_updates(self, g: int) -> None:
        """A current follower was claimed (runtime/follow.py): it holds the state already, so
        this worker serves no snapshot, only its updates from the next step on (and the step,
        for the follower to reach the step before it from its feed)."""
        rt = self.e.runtime
        rt.serving.wanted.discard(items.UPDATES)
        if self.out.gen != g:  # else: updates are served already, from out.step
            self._serve_from(g, self.e.committed + 1, items.UPDATES)
        start = self.out.step
        assert start is not None
        rt.serving.publish(g, items.UPDATES, lambda: (start, {}))
        log.info("migration: updates served to a follower", extra={"step": start, "generation": g})

    def _serve_from(self, g: int, step: int, item: str) -> None:
        """From now on this worker serves generation g's spare every update from `step` on
        (after a snapshot of that boundary, or to a follower that holds the state)."""
        self.out = Outgoing(g, step, item)
        if self.e.reducer is not None:
            self.e.reducer.keep(AVG_KEEP + 1)  # serve averages straight from the buckets

    def refuse_stale(self, server: Any) -> None:
        """An update a spare asks for that this worker no longer keeps (or never served) is
        answered as withdrawn, so that the spare loads a newer snapshot: the server remembers
        only the last names it withdrew, and a spare stalled longer than that would wait for it."""
        out = self.out
        if out.step is None:
            return
        oldest = out.step if out.newest is None else max(out.step, out.newest - AVG_KEEP + 1)
        for w in list(server.wanted):
            k = items.step_of_avg(w)
            if k is not None and k < oldest:
                server.refuse(w)

    def at_boundary(self) -> None:
        """After the switch step and all its user code: the leaving worker hands over and
        exits; a staying member of an FSDP2 job moves to the new group here rather than at the
        commit, so that collectives user code runs after ctx.step() on the mesh still meet the
        leaving rank, and the boundary's local-state exchange (runtime/strategies/fsdp2.py) includes it."""
        if self.out.leaving is not None:
            self.leave(self.out.leaving)  # the switch step is done, user code after ctx.step() too
        if self.switch_at is not None:
            g, t = self.switch_at
            self.switch_at = None
            self._switch(g, t)

    def vote(self) -> float:
        """1.0 when this member is ready to switch to the migration's group."""
        plan = self._plan()
        if plan is None or plan[1].get("phase") != "switch":
            return 0.0
        m, mig = plan
        if mig.get("leaving") == self.e.incarnation:
            return 1.0 if self.out.gen == m.generation else 0.0
        return 1.0 if self.e.runtime.prebuilt(m.generation) is not None else 0.0

    def serving(self, t: int) -> bool:
        """Does this (leaving) worker serve step t's update to a catching-up spare?"""
        return self.out.serves(t)

    def serve_avg(self, t: int, flats: list[torch.Tensor], final: bool) -> None:
        """Leaving worker: publish step t's averaged gradient and the step's hyperparameters
        (the average is what the optimizer steps with: loop.step says when)."""
        if self.serving(t):
            self._publish_step(t, {"flat": flats, "hparams": self.e.reg.hparams(), "final": final})

    def serve_applied(self, t: int, applied: list, final: bool) -> None:
        """Leaving worker: publish what step t's optimizer step really applied (Registry.step_optimizer)."""
        self._publish_step(t, {**applied[0], "hparams": self.e.reg.hparams(), "final": final})

    def serve_shard(self, t: int, own: torch.Tensor, left: torch.Tensor | None, final: bool) -> None:
        """Leaving FSDP2 worker: step t's reduced, clipped gradient shard (what its optimizer
        steps with), the left neighbour's that its mirror steps with, the hyperparameters."""
        item: dict[str, Any] = {"own": own}
        if left is not None:
            item["left"] = left
        self.serve_item(t, item, final)

    def serve_item(self, t: int, item: dict[str, Any], final: bool) -> None:
        """Leaving worker: publish step t's update as its kind of parallelism repeats it
        (strategy.handover.replay_update), with the step's hyperparameters."""
        self._publish_step(t, {**item, "hparams": self.e.reg.hparams(), "final": final})

    def _publish_step(self, t: int, item: dict) -> None:
        rt, g = self.e.runtime, self.out.gen
        assert g is not None  # serves() said this worker serves the migration of generation g
        rt.serving.publish(g, items.step_avg(t), lambda: (t, item))
        self.out.newest = t
        rt.serving.withdraw(items.step_avg(t - AVG_KEEP))
        rt.serving.wanted.discard(items.step_avg(t))

    def after_commit(self, t: int, switch: bool) -> None:
        if not switch:
            return
        plan = self._plan()
        if plan is None:
            return
        m, mig = plan
        if mig.get("leaving") == self.e.incarnation:
            self.out.leaving = m.generation  # leave at the next boundary
            return
        if self.e.strategy.switch_at_boundary:
            self.switch_at = (m.generation, t)  # at the boundary (at_boundary)
            return
        self._switch(m.generation, t)

    def _switch(self, g: int, t: int) -> None:
        rt = self.e.runtime
        rank = rt.m.rank_of(self.e.incarnation, rt.rank) if rt.m.generation == g else None
        if rank is None:  # the migration was resolved otherwise meanwhile (a failure): recovery decides
            return
        rt.switch_to(g)
        rt.put(rt.keys.ready(g, rank), {"incarnation": self.e.incarnation, "switched": t,
                                        "time": time.time()})  # fmt: skip

    def leave(self, g: int) -> None:
        """The leaving worker after the switch step: hand over what user code changed
        outside the optimizer (buffers, registered extras, hyperparameters a scheduler
        set), serve until the spare switched, then exit."""
        rt, t = self.e.runtime, self.e.committed
        self.out.leaving = None
        # and this rank's commit times so far: the spare's final record replaces ours, and the run
        # report reads every recovery's downtime from them (an earlier one's would be lost)
        st = self.e.st
        tail = {"local": self.e.reg.pack_local(), "boundary": self.e.reg.pack_boundary(),
                "commits": [list(c) for c in st.commits], "gen_steps": list(st.gen_steps)}  # fmt: skip
        if st.mirrored.get(t) is not None:  # FSDP2: our copy of the left neighbour's local state
            tail["mirrored"] = st.mirrored[t]
        rt.serving.publish(g, items.tail(t), lambda: (t, tail))
        # a spare that fell behind after the switch was voted loads the state after step t (this
        # worker trains no more: the tensors stay as they are while it waits) and then the tail
        state = self.e.strategy.handover.snapshot
        rt.serving.publish(g, items.final_snapshot(), lambda: (t + 1, state()))
        m = rt.wait_membership(lambda x: x.generation != g or x.state != GenState.MIGRATING,
                               "the spare to take over this rank")  # fmt: skip
        if m.generation == g and m.state == GenState.COMMITTED:
            log.info("released: rank handed over to a spare (planned migration)", extra={"generation": g})
            raise Released()
        # The migration failed during its switch: recovery decides whether we stay.
        self.e.join_recovery(self.e.committed, RuntimeError("migration failed during the switch"))

    def _inherit_commits(self, tail: dict) -> None:
        """The leaving worker's commit times become the start of ours (the final record is the rank's)."""
        st = self.e.st
        num = (int, float)
        old = [list(c) for c in tail.get("commits") or [] if isinstance(c, list) and len(c) == 2
               and all(isinstance(x, num) for x in c)]  # fmt: skip
        st.commits = [*old, *st.commits]
        st.inherited_to = max((int(c[0]) for c in old), default=-1)
        st.gen_steps = [*(s for s in tail.get("gen_steps") or [] if isinstance(s, int)), *st.gen_steps]

    def follow_in(self, fetch: Callable) -> dict | None:
        """A current follower claimed for the migration: its held state replaces the snapshot.
        The leaving worker serves its updates from its next boundary (`serve_updates`); the
        follower's feed fills the steps before it. None (the snapshot path) where the follower
        holds nothing or cannot reach that step (its feed withdrawn, its feeder gone)."""
        e, fol = self.e, self.e.follower
        if fol.held is None:
            return None
        t0 = time.monotonic()
        start = fetch(items.UPDATES).step
        fol.move_into(e.reg)
        e.committed = fol.step
        g = e.joining.generation
        if not fol.catch_up_to(start - 1, time.monotonic() + e.timeouts.collective.total_seconds(),
                               e.runtime.moved_to_other(g)):  # fmt: skip
            log.warning("migration: the follower could not reach the leaving worker's step; loading its snapshot",
                        extra={"step": fol.step, "needed": start - 1})  # fmt: skip
            return None
        e.loaded_step = e.committed + 1  # replay_update advanced committed with the follower's step
        e.stream_info = {"stream_s": time.monotonic() - t0, "bytes": 0, "source": "follower", "follower": True}
        rec = self._loaded(g, 0)
        log.info("migration: a follower takes the rank, no snapshot", extra={"step": e.committed, "start": start})
        return rec

    def _loaded(self, g: int, resyncs: int) -> dict:
        """The catch-up's start, for the coordinator (stream_info set): what was loaded, from
        where, and the step applied so far."""
        e = self.e
        rec = {"incarnation": e.incarnation, "loaded": e.loaded_step, "resyncs": resyncs, **e.stream_info}
        e.runtime.put(e.runtime.keys.catchup(g), {**rec, "applied": e.committed, "time": time.time()})
        return rec

    def migrate_in(self) -> None:
        """A spare claimed for a planned migration: load the leaving worker's snapshot,
        replay the group's averaged gradients until the switch step, then switch."""
        rt, act = self.e.runtime, self.e.joining
        assert act is not None
        g, rank = act.generation, act.rank
        m = rt.wait_membership(lambda x: x.generation >= g, f"generation {g}")
        if m.generation != g or m.state != GenState.MIGRATING:
            raise Requeue()
        addr, secret = m.migration["addr"], rt.secret()
        rt.prebuild(m, rank)  # phase 1 in the background, while we catch up
        deadline = time.monotonic() + self.e.timeouts.recovery.total_seconds()

        def fetch(item: str, alloc: Callable | None = None, once: bool = False) -> Any:
            """Pull `item`, retrying until the deadline (once: a TransferError if not served now)."""
            while True:
                moved = rt.moved_to_other(g)
                if moved():
                    raise Requeue()
                try:
                    return pull(addr, rt.job, secret, g, item, self.e.timeouts.collective.total_seconds(), alloc,
                                abort=moved)  # fmt: skip
                except WithdrawnError:
                    raise  # the group ran ahead of what the source keeps: the caller loads a newer snapshot
                except TransferError as exc:
                    if once:
                        raise
                    if time.monotonic() > deadline:
                        raise RecoveryError(f"migration: could not pull {item} from {addr}: {exc}") from exc
                time.sleep(0.005)

        strategy = self.e.strategy

        def group_at(k: int, seconds: float) -> bool:
            """Until the source serves the average of the k-th step past the snapshot (the
            group committed it), at most `seconds`. False when it or the snapshot's own
            step's average is withdrawn: the snapshot is behind the group
            already (the spare loads a newer one next)."""
            assert self.e.loaded_step is not None  # a snapshot was loaded before the stall (load_snapshot)
            wait = self.e.timeouts.collective.total_seconds()
            try:
                pull(addr, rt.job, secret, g, items.step_avg(self.e.loaded_step), wait)
            except WithdrawnError:
                return False
            except TransferError:
                pass  # not committed yet: the snapshot is current
            end, item = time.monotonic() + seconds, items.step_avg(self.e.loaded_step + k - 1)
            while time.monotonic() < end and not rt.moved_to_other(g)():
                try:
                    pull(addr, rt.job, secret, g, item, wait)
                    return True
                except WithdrawnError:
                    return False  # more than the kept averages past it: this snapshot is behind too
                except TransferError:
                    time.sleep(0.005)  # not served yet
            return True

        def load_snapshot(item: str, resyncs: int = 0, once: bool = False) -> dict:
            t0 = time.monotonic()
            got = fetch(item, strategy.handover.snapshot_alloc(), once)
            strategy.handover.load_snapshot(got.state)  # FSDP2: copies of the shard and its mirror, replayed here
            self.e.committed, self.e.loaded_step = got.step - 1, got.step
            self.e.stream_info = {"stream_s": time.monotonic() - t0, "bytes": got.nbytes, "source": addr}
            self.e.faults.stall_after_snapshot(group_at)  # a test fault (spare-hang:during=snapshot), before we report
            return self._loaded(g, resyncs)

        def newer(resyncs: int) -> tuple[dict, bool]:
            """After falling behind: a newer snapshot, or (the switch was voted meanwhile and the
            leaving worker trains no more) its state after the switch step, then final."""
            while True:
                for item, final in ((items.snapshot(resyncs), False), (items.final_snapshot(), True)):
                    try:
                        return load_snapshot(item, resyncs, once=True), final
                    except WithdrawnError:
                        raise RecoveryError(f"migration: {item} was withdrawn by {addr}") from None
                    except TransferError:
                        pass  # not served (yet)
                if time.monotonic() > deadline:
                    raise RecoveryError(f"migration: no newer snapshot from {addr} in time")
                time.sleep(0.005)

        def take_tail(t: int) -> None:
            tail = fetch(items.tail(t)).state
            self.e.reg.load_local(unpack(tail["local"]))  # buffers and local= at the switch boundary
            self.e.reg.load_boundary(unpack(tail["boundary"]))  # extras, hyperparameters
            self._inherit_commits(tail)
            strategy.handover.take_over(tail)

        rec = self.follow_in(fetch) or load_snapshot(items.snapshot())
        resyncs = 0
        while True:
            t = self.e.committed + 1
            try:
                got = fetch(items.step_avg(t))
            except WithdrawnError as exc:
                # The group ran more than AVG_KEEP steps ahead (this process was starved or
                # slow to load): start over from a newer snapshot instead of waiting forever.
                resyncs += 1
                log.warning("migration: fell behind the group; loading a newer snapshot",
                            extra={"step": t, "resyncs": resyncs, "why": str(exc)})  # fmt: skip
                rec, final = newer(resyncs)
                if final:
                    take_tail(self.e.committed)
                    break
                continue
            self.e.reg.set_hparams(got.state["hparams"])
            strategy.handover.replay_update(t, got.state)
            if got.state["final"]:
                take_tail(t)
                break
            rt.put(rt.keys.catchup(g), {**rec, "applied": t, "time": time.time()})
        while rt.prebuilt(g) is None:  # the group is built once every member joined it
            if rt.moved_to_other(g)():
                raise Requeue()
            if time.monotonic() > deadline:
                raise RecoveryError(f"migration: the group of generation {g} was not built in time")
            time.sleep(0.005)
        rt.register(rank)
        rt.switch_to(g)
        rt.put(rt.keys.ready(g, rank), {"incarnation": self.e.incarnation, "switched": self.e.committed,
                                        "time": time.time(), "resyncs": resyncs, **self.e.stream_info})  # fmt: skip
        log.info("migration: switched in", extra={"rank": rank, "generation": g, "step": self.e.committed})
