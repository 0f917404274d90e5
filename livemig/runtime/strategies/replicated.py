"""Plain data parallel: every rank holds the whole model and optimizer state.

The step is one fault-aware average of the gradient buckets (comm/reducer.py), overlapped
with backward, then the same optimizer update on every rank. A rank's replicated state can be
taken from any peer; what the average of a step a peer completed, a survivor that missed it
fetches (runtime/pull.py), so user code around ctx.step() runs once per step everywhere.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from livemig.comm.group import CollectiveAborted, allreduce_sum
from livemig.config import Role, left_of
from livemig.device import training_device
from livemig.errors import RecoveryError
from livemig.runtime.start_sync import sync_start
from livemig.runtime.step_state import Averaged, Replay, Synced
from livemig.runtime.strategies.base import Strategy
from livemig.state import unpack
from livemig.transfer import items

if TYPE_CHECKING:
    from livemig.rdzv.membership import Membership

log = logging.getLogger("livemig.runtime.strategies.replicated")


class Replicated(Strategy):
    """Plain data parallel (see the module doc); the base of the kinds that keep the
    parameters replicated (ZeRO-1 shards only the optimizer state)."""

    name = "replicated"
    follows = True
    pull_loads_model = True  # received in place, or copied by a strict load_state_dict (pull_state)

    # -- start-up ----------------------------------------------------------------------------
    def sync_start(self) -> None:
        h = self.h
        sync_start(h.reg, h.runtime.pg, h.rank, h.timeouts.collective, h.runtime.moved_on)

    # -- the step ----------------------------------------------------------------------------
    def sync_gradients(self, t: int) -> None:
        h = self.h
        h.st.uses_sync = True
        h.st.user_synced = t  # .grad may change before ctx.step(): a migrating spare gets what was applied
        h.check_backward(t)
        self.average(t, views=False)  # user code may change .grad: it gets a copy

    def check_user_sync(self) -> None:
        """May the user take the averaged gradient (ctx.sync_gradients, ctx.clip_grad_norm_)?
        Raises ConfigError where this kind holds no whole average."""

    def views_safe(self) -> bool:
        """May ctx.step() hand the optimizer views of the averaged buckets as `.grad`?
        Only if nothing can write `.grad` between the average and zero_grad(): the user
        did not take the average first (sync_gradients: clipping), no GradScaler (it
        unscales in place), and a torch.optim optimizer (they read gradients, never write
        them, and zero_grad() drops them): the buckets stay the step's average, kept for
        a peer's recovery and served to a migrating spare. LIVEMIG_GRAD_VIEWS=0 (read once,
        at start) copies the average into `.grad` always."""
        h = self.h
        opt = h.reg.optimizer
        return (h.grad_views and h.scaler is None and opt is not None
                and type(opt).__module__.startswith("torch.optim."))  # fmt: skip

    def reduce(self, ctl: torch.Tensor, first: bool) -> list[torch.Tensor]:
        """The step's average of the gradient buckets, with the planned-migration vote `ctl`
        summed alongside; `first`: the overlapped reduction launched during backward is
        finished, else the buckets are flattened again (a retry, or a shrunk job's bodies)."""
        h = self.h
        red, rt = h.reducer, h.runtime
        assert red is not None  # a kind that averages buckets registered a reducer (strategies.pick)
        if first:
            return red.finish(h.world_size, h.timeouts.collective, rt.moved_on, ctl)
        div = h.virtual.divisor()
        exact = h.virtual.reduce_exact(red, ctl, h.timeouts.collective, rt.moved_on)  # shrunk: the full group's bits
        if exact is not None:
            ctl.div_(div)
            return exact
        h.virtual.add_stashed()
        flats = red.flatten(div)  # pre-divided, as the overlapped path's buckets
        allreduce_sum(rt.pg, [*flats, ctl], h.timeouts.collective, rt.moved_on)
        ctl.div_(div)
        return flats

    def average(self, t: int, views: bool) -> None:
        """The fault-aware average of step t into `.grad` (views of the buckets if `views`)."""
        h = self.h
        st = h.st
        if st.synced is not None and st.synced.step == t:
            return
        if h.sandbox.active or h.role == Role.LOCAL or h.runtime is None:
            st.synced = Synced(t, None)  # a world of one: the gradient is its own average
            return
        if h.boundary.replaying(t):
            assert st.replay is not None
            avg = st.replay.avg
            if avg is None:
                raise RecoveryError(f"the spare replaying step {t} holds no averaged gradient of it")
            h.reg.ensure_grads()
            assert h.reducer is not None
            h.reducer.write_back(avg)
            st.synced = Synced(t, avg)
            return
        if h.virtual.defers(t):  # a shrunk job: a later body of this step averages (runtime/virtual.py)
            h.virtual.stash(t)
            return
        self.check_user_sync()
        h.reg.ensure_grads()
        red, rt = h.reducer, h.runtime
        assert red is not None
        first = not h.virtual.degraded()  # shrunk: no overlap, the stashed bodies join the average
        compute_s = time.monotonic() - h.step_t0  # forward + backward: the straggler hook's input
        while True:
            rt.check_fenced()
            rt.report.enter_collective(t)  # the coordinator's hang detection reads how long we wait
            self.regather()  # ZeRO-1: after a group switch, every member's first collective
            # planned migration: all 1.0 = switch after this step; a whole-job stop: any 1.0 = stop after it
            # (runtime/stop.py); averaged with the buckets (NCCL reduces device tensors)
            ctl = torch.tensor([h.migration.vote(), h.halt.vote()], device=training_device(h.reg.params))
            try:
                h.boundary.keep_before(t)
                h.boundary.mirror_local(t)  # before the vote: nobody commits t unless our mirror holds it
                h.faults.at(t, "allreduce")
                flats = self.reduce(ctl, first)
                h.faults.at_commit_point(t, "average")
            except CollectiveAborted as exc:
                first = False
                h.join_recovery(t, exc)
                if st.fetched is not None and st.fetched.step == t:  # a peer completed it: we have it
                    st.synced = Synced(t, st.fetched.flats, False, compute_s)
                    st.fetched = None
                    h.virtual.new_step()  # the average holds every body's gradient already
                    return
                if h.virtual.defers(t):  # shrunk meanwhile: the ranks this one carries run their bodies first
                    h.virtual.deferred = t
                    h.virtual.stash(t)
                    return
                continue
            # No copy needed for the kept average: the reducer double-buffers, so these
            # buffers are reused only after the next step's commit replaced st.avg.
            red.write_back(flats, views=views)
            st.synced = Synced(t, flats, float(ctl[0]) == 1.0, compute_s, float(ctl[1]) > 0)
            rt.report.leave_collective()
            return

    def step(self, t: int) -> None:
        h = self.h
        if h.virtual.defers(t):  # a shrunk job: a later body of this step commits it
            h.virtual.stash(t)
            return
        views = self.views_safe()
        self.average(t, views=views)  # a no-op if the user synced already
        if h.virtual.deferred == t:  # shrunk during the average: the carried bodies come first
            return
        synced = h.st.synced
        assert synced is not None
        flats, switch, compute_s = synced.flats, synced.switch, synced.compute_s
        h.halt.after_commit(t, synced.stop)  # at this step's boundary, after its commit (runtime/stop.py)
        assert flats is not None  # a world of one committed before the strategy (runtime/loop.py step)
        # A leaving worker serves each step's update to the spare catching up. The average
        # itself only when it is what the optimizer stepped with (nothing could change .grad),
        # before our optimizer step so the spare applies it meanwhile; otherwise (clipping,
        # a GradScaler's unscale and skip, any code between sync_gradients() and step())
        # the gradients the optimizer really stepped with, captured at its step.
        raw = views and h.st.user_synced != t
        feeding = h.feed.serving(t)  # and to the follow spares (runtime/follow.py), the same way
        applied: list | None = [] if (h.migration.serving(t) or feeding) and not raw else None
        if applied is None:
            h.migration.serve_avg(t, flats, switch)
            if feeding:
                h.feed.serve(t, {"flat": flats})
        h.commit(t, flats, compute_s=compute_s, applied=applied)
        if applied is not None:
            if h.migration.serving(t):
                h.migration.serve_applied(t, applied, switch)
            if feeding:
                h.feed.serve(t, dict(applied[0]))
        h.migration.after_commit(t, switch)
        h.faults.at(t, "after_step")

    # -- the boundary ------------------------------------------------------------------------
    def at_boundary(self, step: int) -> None:
        h = self.h
        if not h.boundary.replays:
            return
        h.st.boundaries[step] = h.reg.pack_boundary()
        h.st.boundaries.pop(step - 2, None)
        if h.reg.has_local:
            from livemig.runtime.step_state import LocalBlob

            h.st.local_blob = LocalBlob(step, h.reg.pack_local())

    # -- recovery ------------------------------------------------------------------------------
    def finish_missed(self, m: Membership, t: int) -> bool:
        """A peer committed step t, this member did not: fetch its average; ctx.sync_gradients()
        or ctx.step() takes it from there, so the user's code between the two still runs once
        and the commit is the usual one."""
        h = self.h
        _, got = h.pull.pull_any(m, items.AVG)
        if got.step != t:
            raise RecoveryError(f"source holds the average of step {got.step}, need {t}")
        assert h.reducer is not None
        h.reducer.write_back(got.state["flat"])  # same canonical bucket layout as the source
        log.info("fetched the averaged gradient of a step a peer completed", extra={"step": t})
        h.st.fetched = Averaged(t, got.state["flat"])
        return True

    def serve(self, m: Membership) -> None:
        h = self.h
        srv = h.runtime.server
        if srv is None or m.resume_step is None:
            return
        # The left neighbour's local state of boundary resume-2, which its replacement replays
        # step resume-1 from: served also by a survivor that missed that step's commit (it
        # fetched the average and commits on resuming), since this rank is its only mirror.
        left, s = left_of(h.rank, h.world_size), m.resume_step
        blob = h.st.mirrored.get(s - 2)
        if blob is not None:
            srv.publish(m.generation, items.local(left), lambda: (s, {"blob": blob}))
        if h.pull.committed_step() != s - 1:
            return
        # Parameters and optimizer as of our last commit; for the spare's replay of that
        # step (runtime/loop.py), the parameters before it and the boundary before it.
        st = h.st
        replay = {"boundary": st.boundaries.get(h.committed - 1), "before": st.before.get(h.committed),
                  "uses_sync": st.uses_sync} if h.boundary.replays else {}  # fmt: skip
        if h.boundary.replays and h.ckpt.resumed == h.committed:  # no step ran since the load: nothing to
            replay["resumed"] = h.ckpt.resume_path  # replay, the spare loads its rank's part of it
        srv.publish(m.generation, items.STATE, lambda: (h.committed + 1, {**h.reg.state_obj(), **replay}))
        # a follow spare holding our last commit takes the rest: what is not parameters and
        # optimizer state (runtime/follow.py), and not the replay's parameters either
        rest = {k: v for k, v in replay.items() if k != "before"}
        srv.publish(
            m.generation,
            items.STATE_REST,
            lambda: (
                h.committed + 1,
                {"extra": {k: v.state_dict() for k, v in h.reg.extra.items()}, "hparams": h.reg.hparams(), **rest},
            ),
        )
        h.faults.corrupt_next_serve(srv)
        self.serve_step(m)

    def serve_step(self, m: Membership) -> None:
        """Publish what a survivor that missed the last commit finishes it from: the average."""
        h = self.h
        avg = h.st.avg
        if avg is not None and avg.step == h.committed:
            h.runtime.serving.publish(m.generation, items.AVG, lambda: (avg.step, {"flat": avg.flats}))

    def pull_layout(self, m: Membership, step: int) -> tuple[int, str]:
        """A spare's pull of the pieces generation m's layout gives it beyond the replicated
        state (ZeRO-1's shards), at `step`: the bytes and sources added."""
        return 0, ""

    def replay_needs_avg(self) -> bool:
        """Does a spare replaying a step whose body called ctx.sync_gradients() need that
        step's average (the replayed call returns it)?"""
        return True

    def pull_state(self, m: Membership) -> dict[str, Any]:
        """A spare's pull of the state at m's boundary, and of what its replay of the step
        before needs (runtime/loop.py, replay_step)."""
        h = self.h
        t0 = time.monotonic()
        assert m.resume_step is not None
        follower = m.resume_step - 1 >= 0 and h.follower.holds(m.resume_step - 1)
        if follower:  # a follow spare at the group's last commit (runtime/follow.py): the rest only
            addr, got = h.pull.pull_any(m, items.STATE_REST)
            if got.step != m.resume_step:
                raise RecoveryError(f"the source serves the boundary of step {got.step}, need {m.resume_step}")
            h.follower.move_into(h.reg)
            h.lazy.finish()  # the build's fills on the swapped-out tensors are dropped (runtime/lazy_init.py)
            h.reg.load_boundary({"extra": got.state["extra"], "hparams": got.state["hparams"]})
            got.state["before"] = h.follower.before
        else:
            h.follower.release(m.resume_step - 1)  # a follower that fell behind: streamed as any spare
            addr, got = h.pull.pull_any(m, items.STATE, h.pull.into_model())
            h.reg.load_state(got.state)
        nbytes = got.nbytes
        more, where = self.pull_layout(m, got.step)
        nbytes += more
        addr += where
        h.committed = got.step - 1
        h.loaded_step = got.step
        if h.committed >= 0 and h.boundary.replays and got.state.get("resumed"):
            # The job resumed from a checkpoint of this very boundary and no step ran since:
            # rank r's own state of it is its part there (runtime/checkpoint.py), no replay.
            h.ckpt.load(got.state["resumed"])
            h.boundary.keep(h.committed)
        elif h.committed >= 0 and h.boundary.replays:  # replay step resume-1 (runtime/loop.py, replay_step)
            st = got.state
            if st.get("boundary") is None or st.get("before") is None:
                raise RecoveryError(f"the source holds no snapshot of the boundary before step {h.committed}")
            local = None
            if h.reg.has_local and h.world_size > 1:
                where, part = h.pull.pull_buddy_local(m, got.step, "the replay", 2)
                local = unpack(part.state["blob"])
                nbytes += part.nbytes
                addr += f",{where}"
            avg = None
            if st.get("uses_sync") and self.replay_needs_avg():  # the replayed sync_gradients() returns it
                where, part = h.pull.pull_any(m, items.AVG)
                if part.step != h.committed:
                    raise RecoveryError(f"source holds the average of step {part.step}, need {h.committed}")
                avg = part.state["flat"]
                nbytes += part.nbytes
            h.st.replay = Replay(h.committed, unpack(st["boundary"]), local, st["before"], avg, st["extra"])
        elif h.committed < 0:
            # Resumed at step 0 (a rank lost inside the first step): nothing to replay; the
            # state of boundary -1 is the job's start, which this entry's code before the loop
            # built as the rank's own, and step 0's collective phase mirrors its local part.
            h.boundary.keep(h.committed)
        h.stream_info = {"stream_s": time.monotonic() - t0, "bytes": nbytes, "source": addr}
        if follower:
            h.stream_info["follower"] = True
        log.info("state loaded", extra={"resume_step": got.step, "bytes": got.nbytes, "follower": follower,
                                        "seconds": round(got.seconds, 4)})  # fmt: skip
        return h.stream_info
