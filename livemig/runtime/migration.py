"""Planned migration: the leaving worker serves, the catching-up spare replays.

The leaving worker serves a snapshot and then each step's averaged gradient
while training goes on; the spare loads the snapshot, replays the averages,
and both switch at a step voted inside the gradient collective
(docs/architecture.md, "Planned migration").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from livemig.config import Role
from livemig.errors import RecoveryError, TransferError, WithdrawnError
from livemig.rdzv.membership import GenState, Membership
from livemig.runtime.control import _Released, _Requeue
from livemig.runtime.step_state import Outgoing
from livemig.state import flatten, unflatten, unpack
from livemig.transfer import items
from livemig.transfer.client import pull

AVG_KEEP = 8  # averaged gradients a leaving worker keeps for its catching-up spare


log = logging.getLogger("livemig.runtime.migration")


class Migration:
    """Mixed into api.Engine; relies on the attributes Engine.__init__ sets."""

    def _migration_plan(self) -> tuple[Membership, dict] | None:
        """The migration of our group in progress, if any."""
        rt = self.runtime
        if rt is None or rt.m.state != GenState.MIGRATING or rt.m.migration.get("from_gen") != rt.gen:
            return None
        m = rt.m
        return m, m.migration

    def _migration_tick(self) -> None:
        """At a step boundary: the leaving worker takes its snapshot once the spare
        asks for it; every staying member starts building the new group."""
        if self.role == Role.LOCAL or self._zero is not None:
            return
        if self._out.leaving is not None:
            self._leave(self._out.leaving)  # the switch step is done, user code after ctx.step() too
        rt = self.runtime
        plan = self._migration_plan()
        if plan is None:
            if self._out.gen is not None and rt.m.generation != self._out.gen:
                rt.server.withdraw()  # the migration was resolved: stop serving its items
                self._out = Outgoing()
                if self._reducer is not None:
                    self._reducer.keep(2)
            return
        m, mig = plan
        if mig.get("leaving") == self.incarnation:
            # "snapshot" first; "snapshot/k" when the spare fell more than AVG_KEEP steps behind
            # (a retry that raced our first publish leaves "snapshot" wanted too: the newest counts)
            snaps = [w for w in list(rt.server.wanted) if items.is_snapshot(w)]
            for w in snaps:
                rt.server.wanted.discard(w)
            if self._out.gen == m.generation:
                snaps = [w for w in snaps if w != self._out.snap]
            want = max(snaps, key=lambda w: int(w.partition("/")[2] or 0), default=None)
            if want is not None:
                if self._out.gen == m.generation and self._out.snap:
                    rt.server.withdraw(self._out.snap)  # the spare asked for a newer one: free the old copy
                tensors: list[torch.Tensor] = []
                skel = flatten(self.state_obj(), tensors)
                snap = unflatten(skel, [x.clone() for x in tensors])  # training goes on: serve a copy
                step = self.committed + 1
                rt.server.publish(m.generation, want, lambda: (step, snap))
                self._out = Outgoing(m.generation, step, want)
                if self._reducer is not None:
                    self._reducer.keep(AVG_KEEP + 1)  # serve averages straight from the buckets
                log.info("migration: snapshot served", extra={"step": step, "generation": m.generation,
                                                              "item": want})  # fmt: skip
        elif m.rank_of(self.incarnation) is not None:
            rt.prebuild(m, m.rank_of(self.incarnation))

    def _vote(self) -> float:
        """1.0 when this member is ready to switch to the migration's group."""
        plan = self._migration_plan()
        if plan is None or plan[1].get("phase") != "switch":
            return 0.0
        m, mig = plan
        if mig.get("leaving") == self.incarnation:
            return 1.0 if self._out.gen == m.generation else 0.0
        return 1.0 if self.runtime.prebuilt(m.generation) is not None else 0.0

    def _serving_migration(self, t: int) -> bool:
        """Does this (leaving) worker serve step t's update to a catching-up spare?"""
        return self._out.serves(t)

    def _serve_avg(self, t: int, flats: list[torch.Tensor], final: bool) -> None:
        """Leaving worker: publish step t's averaged gradient and the step's hyperparameters
        (the average is what the optimizer steps with: loop.step says when)."""
        if self._serving_migration(t):
            self._publish_step(t, {"flat": flats, "hparams": self.reg.hparams(), "final": final})

    def _serve_applied(self, t: int, applied: list, final: bool) -> None:
        """Leaving worker: publish what step t's optimizer step really applied (Registry.step_optimizer)."""
        self._publish_step(t, {**applied[0], "hparams": self.reg.hparams(), "final": final})

    def _publish_step(self, t: int, item: dict) -> None:
        rt, g = self.runtime, self._out.gen
        rt.server.publish(g, items.step_avg(t), lambda: (t, item))
        rt.server.withdraw(items.step_avg(t - AVG_KEEP))
        rt.server.wanted.discard(items.step_avg(t))

    def _after_commit(self, t: int, switch: bool) -> None:
        if not switch:
            return
        plan = self._migration_plan()
        if plan is None:
            return
        m, mig = plan
        if mig.get("leaving") == self.incarnation:
            self._out.leaving = m.generation  # leave at the next boundary
            return
        rt = self.runtime
        rank = m.rank_of(self.incarnation)
        rt.switch_to(m.generation)
        rt.put(rt.keys.ready(m.generation, rank), {"incarnation": self.incarnation, "switched": t,
                                                   "time": time.time()})  # fmt: skip

    def _leave(self, g: int) -> None:
        """The leaving worker after the switch step: hand over what user code changed
        outside the optimizer (buffers, registered extras, hyperparameters a scheduler
        set), serve until the spare switched, then exit."""
        rt, t = self.runtime, self.committed
        self._out.leaving = None
        tail = {"local": self.reg.pack_local(), "boundary": self.reg.pack_boundary()}
        rt.server.publish(g, items.tail(t), lambda: (t, tail))
        m = rt.wait_membership(lambda x: x.generation != g or x.state != GenState.MIGRATING,
                               "the spare to take over this rank")  # fmt: skip
        if m.generation == g and m.state == GenState.COMMITTED:
            log.info("released: rank handed over to a spare (planned migration)", extra={"generation": g})
            raise _Released()
        # The migration failed during its switch: recovery decides whether we stay.
        self._join_recovery(self.committed, RuntimeError("migration failed during the switch"))

    def _migrate_in(self) -> None:
        """A spare claimed for a planned migration: load the leaving worker's snapshot,
        replay the group's averaged gradients until the switch step, then switch."""
        rt, act = self.runtime, self._joining
        assert act is not None
        g, rank = act.generation, act.rank
        m = rt.wait_membership(lambda x: x.generation >= g, f"generation {g}")
        if m.generation != g or m.state != GenState.MIGRATING:
            raise _Requeue()
        addr, secret = m.migration["addr"], rt.secret()
        rt.prebuild(m, rank)  # phase 1 in the background, while we catch up
        deadline = time.monotonic() + self.timeouts.recovery.total_seconds()

        def fetch(item: str, alloc: Callable | None = None) -> Any:
            while True:
                moved = rt.moved_to_other(g)
                if moved():
                    raise _Requeue()
                try:
                    return pull(addr, rt.job, secret, g, item, self.timeouts.collective.total_seconds(), alloc,
                                abort=moved)  # fmt: skip
                except WithdrawnError:
                    raise  # the group ran ahead of what the source keeps: the caller loads a newer snapshot
                except TransferError as exc:
                    if time.monotonic() > deadline:
                        raise RecoveryError(f"migration: could not pull {item} from {addr}: {exc}") from exc
                time.sleep(0.005)

        def load_snapshot(item: str, resyncs: int = 0) -> dict:
            t0 = time.monotonic()
            got = fetch(item, self._into_model())
            self.reg.load_state(got.state)
            self.committed, self._loaded_step = got.step - 1, got.step
            self._stream_info = {"stream_s": time.monotonic() - t0, "bytes": got.nbytes, "source": addr}
            self._faults.stall_after_snapshot()  # a test fault (spare-hang:during=snapshot), before we report
            rec = {"incarnation": self.incarnation, "loaded": got.step, "resyncs": resyncs, **self._stream_info}
            rt.put(rt.keys.catchup(g), {**rec, "applied": self.committed, "time": time.time()})
            return rec

        rec = load_snapshot(items.snapshot())
        red, resyncs = self._reducer, 0
        while True:
            t = self.committed + 1
            try:
                got = fetch(items.step_avg(t))
            except WithdrawnError as exc:
                # The group ran more than AVG_KEEP steps ahead (this process was starved or
                # slow to load): start over from a newer snapshot instead of waiting forever.
                resyncs += 1
                log.warning("migration: fell behind the group; loading a newer snapshot",
                            extra={"step": t, "resyncs": resyncs, "why": str(exc)})  # fmt: skip
                rec = load_snapshot(items.snapshot(resyncs), resyncs)
                continue
            self.reg.set_hparams(got.state["hparams"])
            if "stepped" in got.state:  # the update as applied (clipped, unscaled, or skipped)
                self.reg.apply_step(got.state)
                self.committed, self._avg = t, None
            else:  # the average is what the optimizer stepped with
                self._ensure_grads()
                if red is not None:
                    red.write_back(got.state["flat"])
                self._commit(t, None, replay=True)
            if got.state["final"]:
                tail = fetch(items.tail(t)).state
                self.reg.load_local(unpack(tail["local"]))  # buffers and local= at the switch boundary
                self.reg.load_boundary(unpack(tail["boundary"]))  # extras, hyperparameters
                break
            rt.put(rt.keys.catchup(g), {**rec, "applied": t, "time": time.time()})
        while rt.prebuilt(g) is None:  # the group is built once every member joined it
            if rt.moved_to_other(g)():
                raise _Requeue()
            if time.monotonic() > deadline:
                raise RecoveryError(f"migration: the group of generation {g} was not built in time")
            time.sleep(0.005)
        rt.register(rank)
        rt.switch_to(g)
        rt.put(rt.keys.ready(g, rank), {"incarnation": self.incarnation, "switched": self.committed,
                                        "time": time.time(), **self._stream_info})  # fmt: skip
        log.info("migration: switched in", extra={"rank": rank, "generation": g, "step": self.committed})
