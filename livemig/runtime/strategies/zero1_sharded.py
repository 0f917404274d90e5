"""ZeRO-1: the parameters replicated, the optimizer state sharded over the ranks and each
shard mirrored on a buddy (comm/zero1.py holds the shards and the layout).

A step is the reduction, a 1-float barrier (the commit point: anyone past it holds the
slices to finish the step alone), the own shard's update, then the all-gather of the
parameters overlapped with the mirror's update. A step whose whole average the user takes
(ctx.sync_gradients(), ctx.clip_grad_norm_(), a GradScaler) averages the whole gradient as
plain data parallel does; after the user's code each shard's slices are cut from the gradient
as the user left it, and the same barrier commits it (WholeAverage). After any group switch every member first
all-gathers the parameters (`regather`), then goes on with the step it is at.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from livemig.comm.group import CollectiveAborted, allreduce_mean, allreduce_sum, broadcast_tensors
from livemig.config import SHARDING_ENTRY, left_of
from livemig.device import training_device
from livemig.errors import RecoveryError
from livemig.rdzv.membership import GenState
from livemig.runtime.registry import Layout
from livemig.runtime.step_state import Averaged, Synced
from livemig.runtime.strategies.base import Handover, Parts, StrategyHost
from livemig.runtime.strategies.replicated import Replicated
from livemig.state import digest
from livemig.transfer import items

if TYPE_CHECKING:
    from livemig.comm.zero1 import Zero1 as Shards
    from livemig.rdzv.membership import Membership

log = logging.getLogger("livemig.runtime.strategies.zero1_sharded")


class Zero1(Replicated):
    """Sharded optimizer state (see the module doc); `shards` is comm.zero1.Zero1."""

    name = "zero1"
    layout = Layout(optimizer_sharded=True, optimizer_in_shards=True)

    def __init__(self, host: StrategyHost, shards: Shards) -> None:
        super().__init__(host)
        self.shards = shards
        self.parts = Zero1Parts(host, shards)
        self.gathered_gen: int | None = None  # the generation whose group last gathered the parameters
        self.whole = WholeAverage(self)
        self.moves = Zero1Handover(host, shards)
        self.handover = self.moves

    def signature(self) -> list[list]:
        return [[SHARDING_ENTRY, "zero1", [int(self.shards.mirroring)]]]

    def sync_start(self) -> None:
        super().sync_start()
        self.shards.reset_values()  # the shards were cut from this rank's own initial parameters

    def formed(self) -> None:
        self.gathered_gen = self.h.runtime.gen  # every rank holds rank 0's initial model (or the loaded one)

    # -- the step ----------------------------------------------------------------------------
    def step(self, t: int) -> None:
        h = self.h
        if h.virtual.defers(t):  # a shrunk job: a later body of this step commits it
            h.virtual.stash(t)
            return
        if h.st.user_synced == t or h.scaler is not None:
            self.whole.step(t)
        else:
            self._step(t)
        if h.virtual.deferred == t:  # shrunk during the reduction: the carried bodies come first
            return
        h.faults.at(t, "after_step")

    def reduce(self, ctl: torch.Tensor, first: bool) -> list[torch.Tensor]:
        """The whole average of a step the user takes it in (WholeAverage.reduce)."""
        return self.whole.reduce(ctl, first)

    def _step(self, t: int) -> None:
        """Reduction (reduce-scatter + exchange, or allreduce + slicing), barrier,
        own shard update, all-gather overlapped with the mirror's update. A shrunk job
        (runtime/virtual.py) allreduces the sum of its bodies' gradients and steps every
        shard its layout gives this rank (comm/zero1.py, Zero1.switch)."""
        h = self.h
        z, red, rt = self.shards, h.reducer, h.runtime
        assert red is not None
        timeout, first = h.timeouts.collective, True
        while h.committed < t:
            rt.check_fenced()
            rt.report.enter_collective(t)
            self.regather()
            if h.committed >= t:
                break
            try:
                h.boundary.keep_before(t)
                h.faults.at(t, "allreduce")
                if z.shrunk:  # no overlap while shrunk: every body's gradient joins the full group's reduction
                    h.reg.ensure_grads()
                    flats = h.virtual.reduce_exact(red, None, timeout, rt.moved_on)
                    if flats is None:  # no full-width group: the survivors' sum, within the bound
                        h.virtual.add_stashed()
                        flats = red.flatten(h.virtual.divisor())
                        allreduce_sum(rt.pg, flats, timeout, rt.moved_on)
                    held: list = [z.slices_shrunk(flats), None]
                else:
                    if first:  # reductions launched during backward
                        reduced = red.finish(h.world_size, timeout, rt.moved_on)
                    else:  # a retry; after a grow, without the stashed body of the rank handed back
                        h.reg.ensure_grads()
                        h.virtual.add_stashed()
                        reduced = red.reduce(rt.pg, red.flatten(h.world_size), timeout, rt.moved_on)
                    held = list(z.slices(rt.pg, reduced, timeout, rt.moved_on))
                h.st.avg = Averaged(t, held)  # held: enough to finish step t alone
                h.boundary.mirror_local(t)  # before the barrier: whoever passes it knows the mirror holds t
                sums = z.barrier(rt.pg, timeout, rt.moved_on, h.halt.vote(), h.migration.vote())
                stop, switch = votes(h.world_size, sums)
                h.faults.at_commit_point(t, "barrier result")
            except CollectiveAborted as exc:
                first = False
                h.join_recovery(t, exc)
                if h.committed < t and h.virtual.defers(t):  # shrunk meanwhile: carried bodies first
                    h.virtual.deferred = t
                    h.virtual.stash(t)
                    return
                continue
            # Update our shard(s), then gather the parameters while the mirror(s) are updated.
            h.halt.after_commit(t, stop)  # a whole-job stop after t (runtime/stop.py)
            self.update_and_gather(t, held, switch)
        self.regather()
        rt.report.leave_collective()

    def update_and_gather(self, t: int, held: list, switch: bool = False) -> None:
        """Past step t's barrier: update our shard(s), then gather the parameters while the
        mirror(s) are updated (that update commits t, and runs even if the gather fails: the
        new group then repeats the gather). A leaving worker of a planned migration then
        serves the step to its spare (Zero1Handover), and `switch` moves the members to the
        migration's group after this step."""
        h, z, rt = self.h, self.shards, self.h.runtime
        z.update(held[0], held[1], part="owned")
        self.gathered_gen = None
        try:
            h.faults.at(t, "gather")

            def mirror_update(held: list = held) -> None:  # overlapped with the gather
                h.commit(t, held, mirror_only=True)

            z.gather(rt.pg, h.timeouts.collective, rt.moved_on, meanwhile=mirror_update)
            self.gathered_gen = rt.gen
        except CollectiveAborted as exc:
            h.join_recovery(t, exc)
            return
        if h.migration.serving(t):
            h.migration.serve_item(t, self.moves.item(held), switch)
        h.migration.after_commit(t, switch)

    def regather(self) -> None:
        """All-gather the parameters unless this generation's group already did."""
        h = self.h
        rt = h.runtime
        if rt is None:
            return
        while self.gathered_gen != rt.gen and rt.m.state != GenState.DONE:
            rt.check_fenced()
            try:
                self.shards.gather(rt.pg, h.timeouts.collective, rt.moved_on)
                self.gathered_gen = rt.gen
            except CollectiveAborted as exc:
                h.join_recovery(h.current, exc)

    def apply_update(self, avg: list | None, mirror_only: bool, applied: list | None) -> None:
        assert avg is not None
        # mirror_only: the own shard(s) were updated already (comm/zero1.py: overlap with the gather)
        self.shards.update(avg[0], avg[1], part="mirrored" if mirror_only else "all")
        for p in self.h.reg.params:
            p.grad = None

    def warmup_step(self, t: int, pg: Any) -> None:
        """No peers: this rank's slices of the local gradient."""
        h, zero = self.h, self.shards
        assert h.reducer is not None
        skip = found_inf(h.scaler, h.reg.optimizer) if h.scaler is not None else False  # as a job step does
        flats = h.reducer.flatten()
        allreduce_mean(pg, flats, 1, h.timeouts.collective)
        own = [f.chunk(h.world_size)[zero.own.shard].clone() for f in flats]
        mirror = [f.chunk(h.world_size)[zero.mirror.shard].clone() for f in flats] if zero.mirror else None
        if h.scaler is not None:
            h.scaler.update()
        if not skip:
            zero.update(own, mirror)
        for p in h.reg.params:
            p.grad = None
        h.committed = t

    # -- recovery ------------------------------------------------------------------------------
    def finish_missed(self, m: Membership, t: int) -> bool:
        """A peer passed step t's barrier: so did every member reach it, holding its slices;
        this one finishes the step alone from them."""
        h = self.h
        if h.st.avg is None or h.st.avg.step != t:
            raise RecoveryError(f"rank {h.rank} does not hold the gradient slices of step {t}")
        if h.scaler is not None:  # a GradScaler's step (a whole-average one): its update
            h.scaler.update()  # follows the commit point, as on the members that passed the barrier
        h.commit(t, h.st.avg.flats)  # a peer passed the barrier: finish the step alone
        log.info("finished a step a peer committed, from the slices held here", extra={"step": t})
        return True

    def serve_step(self, m: Membership) -> None:
        """Every shard held: a spare's, and a survivor's whose layout changes."""
        h = self.h

        def provider(sh: Any) -> Callable[[], tuple[int, Any]]:
            return lambda: (h.committed + 1, sh.state())

        for sh in self.shards.held():
            h.runtime.serving.publish(m.generation, items.zshard(sh.shard), provider(sh))
        synced = h.st.synced  # a step the user took the whole average of: a peer that missed it, or
        if synced is None or synced.step != h.committed:  # a replay; the next step's average may have
            synced = self.whole.before  # completed before its barrier failed: the committed one was kept
        if synced is not None and synced.step == h.committed and synced.flats is not None:
            step, flats = synced.step, synced.flats
            h.runtime.serving.publish(m.generation, items.AVG, lambda: (step, {"flat": flats}))

    def pull_layout(self, m: Membership, step: int) -> tuple[int, str]:
        """The shards m's layout gives a spare (its own, the one it mirrors), from their holders."""
        h, z = self.h, self.shards
        nbytes, addr = 0, ""
        for s in z.stage(m.carried, every=True):
            where, part = h.pull.pull_any(m, items.zshard(s), ranks=[r for r in m.members if r != h.rank])
            if part.step != step:
                raise RecoveryError(f"shard {s} from {where} is at step {part.step}, state at {step}")
            z.adopt(s, part.state)
            nbytes += part.nbytes
            addr += f",{where}"
        z.switch(m.carried)
        return nbytes, addr

    def stage_layout(self, m: Membership) -> None:
        """Pull the shards generation m's layout gives this member that it does not hold (a
        shrink hands a lost rank's shard to its carrier and moves mirrors; a grow hands shards
        back), from the members serving them. Kept aside until m commits (switch_layout): a
        generation abandoned before its commit changes nothing."""
        h, z = self.h, self.shards
        need = z.stage(m.carried)
        me = m.rank_of(h.incarnation, h.rank)
        for s in need:
            where, part = h.pull.pull_any(m, items.zshard(s), ranks=[r for r in m.members if r != me])
            if part.step != h.committed + 1:
                raise RecoveryError(f"shard {s} from {where} is at step {part.step}, this rank at {h.committed + 1}")
            z.adopt(s, part.state)
            log.info("optimizer shard adopted for a new layout",
                     extra={"shard": s, "source": where, "generation": m.generation, "carried": m.carried})  # fmt: skip

    def switch_layout(self, m: Membership) -> None:
        self.shards.switch(m.carried)


class WholeAverage:
    """ZeRO-1's steps whose whole average the user takes (ctx.sync_gradients(), clipping, a
    GradScaler): the average as plain data parallel's, and this member's own contribution
    kept for a retry after the user's code ran (docs/architecture.md, ZeRO-1)."""

    def __init__(self, zero: Zero1) -> None:
        self.zero = zero
        self.h = zero.h
        self.shards = zero.shards
        self.kept: tuple[int | None, list[torch.Tensor]] | None = None  # (step, own contribution to its average)
        # the last committed step's whole average while the next one's is taken: that one may complete
        # and its barrier fail, and a spare replaying the committed step needs its average (serve_step)
        self.before: Synced | None = None

    def reduce(self, ctl: torch.Tensor, first: bool) -> list[torch.Tensor]:
        """The whole average of a step the user takes it in (ctx.sync_gradients(), clipping,
        a GradScaler), as plain data parallel's: each member holds all of it (the average's
        attempts regather the parameters first after a group switch). In reduce-scatter
        mode the slices are reduce-scattered as in a plain ZeRO-1 step (a spare that joins
        the retry reduces as a first attempt does) and gathered whole. This member's own
        contribution is kept: a retry of the step after the user's code ran sends it again."""
        h = self.h
        red = h.reducer
        assert red is not None
        if h.st.synced is not None and h.st.synced.step == h.committed:
            self.before = h.st.synced
        if first:  # .grad still holds the local gradient: the buckets were filled from it
            self.kept = (h.current, red.flatten(h.world_size))
            return self.average_of([], ctl, True)
        if self.shards.shrunk and h.runtime.full:  # shrunk: a holder's average, or the full group's bits
            had = self.from_holder(None, ctl)
            if had is not None:
                return had
            self.kept = (h.current, [])  # a holder is asked first on any retry: nothing to send again
            out = h.virtual.reduce_exact(red, ctl, h.timeouts.collective, h.runtime.moved_on)
            if out is not None:
                return out
        h.virtual.add_stashed()
        mine = red.flatten(h.virtual.divisor())
        self.kept = (h.current, [f.clone() for f in mine])
        return self.average_of(mine, ctl, False)

    def from_holder(self, held: list[torch.Tensor] | None, ctl: torch.Tensor) -> list[torch.Tensor] | None:
        """A shrunk generation's retry of a step's whole average: the survivors that completed it
        before the loss (`held`: their average; a carrier's holds the carried rank's gradient only
        inside the sum) and those that did not run this together: a flag per member says who
        holds it, the lowest holder broadcasts it (its bits, the full group's), and every member
        returns it; None where nobody holds it (the caller reduces through the full-width group).
        The votes are summed after it, as the plain retry sums them."""
        h = self.h
        rt, red, timeout = h.runtime, h.reducer, h.timeouts.collective
        assert red is not None
        me, n = rt.pg.rank(), rt.pg.size()
        flags = torch.zeros(n)
        if held is not None:
            flags[me] = 1.0
        allreduce_sum(rt.pg, [flags], timeout, rt.moved_on)
        holders = [i for i in range(n) if flags[i] > 0]
        if not holders:
            return None
        out = [f.clone() for f in held] if held is not None else [torch.zeros_like(f) for f in red.flatten()]
        broadcast_tensors(rt.pg, out, holders[0], timeout, rt.moved_on)
        allreduce_sum(rt.pg, [ctl], timeout, rt.moved_on)
        log.info("a shrunk step's average taken from a survivor that completed it",
                 extra={"step": h.current, "holder": holders[0]})  # fmt: skip
        return out

    def average_of(self, flats: list[torch.Tensor], ctl: torch.Tensor, first: bool) -> list[torch.Tensor]:
        """The collectives of one attempt, the same on every member: the overlapped
        reduction (first) or a synchronous one of `flats` (pre-divided)."""
        h = self.h
        red, rt, timeout = h.reducer, h.runtime, h.timeouts.collective
        assert red is not None
        if red.scatter and not self.shards.shrunk:
            if first:
                slices = red.finish(h.world_size, timeout, rt.moved_on, ctl)
            else:
                slices = red.reduce(rt.pg, flats, timeout, rt.moved_on)
                allreduce_sum(rt.pg, [ctl], timeout, rt.moved_on)
                ctl.div_(h.world_size)
            return self.shards.whole(rt.pg, slices, timeout, rt.moved_on)
        if first:
            return red.finish(h.world_size, timeout, rt.moved_on, ctl)
        allreduce_sum(rt.pg, [*flats, ctl], timeout, rt.moved_on)
        return flats

    def step(self, t: int) -> None:
        """A step whose whole average the user took (ctx.sync_gradients(),
        ctx.clip_grad_norm_()) or a GradScaler unscales: the average as plain data parallel's,
        the user's code, then each shard's slices of the gradient as the user left it
        (clipped, unscaled), the barrier (the commit point, as in a plain ZeRO-1 step: anyone
        past it holds what it needs to finish the step alone), the updates and the gather.
        A retry after a failed barrier first redoes the average with this member's kept
        gradient, for the members that lack it (contribute_again)."""
        h, zero = self.h, self.zero
        z, red, rt = self.shards, h.reducer, h.runtime
        assert red is not None
        zero.average(t, views=False)  # a no-op if the user synced
        if h.virtual.deferred == t:  # shrunk during the average: the carried bodies come first
            return
        skip = found_inf(h.scaler, h.reg.optimizer) if h.scaler is not None else False
        held: list = [None, None] if skip else list(z.slices_of(red.flatten()))
        layout = z.layout
        timeout, first = h.timeouts.collective, True
        while h.committed < t:
            rt.check_fenced()
            rt.report.enter_collective(t)
            if not first:
                zero.regather()
                if h.committed >= t:
                    break
                if z.layout != layout and not skip:  # a shrink or grow meanwhile: the slices of the
                    held = list(z.slices_of(red.flatten()))  # shards held now, from the same gradient
                    layout = z.layout
            try:
                if not first:
                    self.contribute_again(t)
                h.st.avg = Averaged(t, held)  # before the barrier: whoever passes it knows we hold them
                sums = z.barrier(rt.pg, timeout, rt.moved_on, h.halt.vote(), h.migration.vote())
                stop, switch = votes(h.world_size, sums)
                h.faults.at_commit_point(t, "barrier result")
            except CollectiveAborted as exc:
                first = False
                h.join_recovery(t, exc)
                continue
            h.halt.after_commit(t, stop)  # a whole-job stop after t (runtime/stop.py)
            if h.scaler is not None:
                h.scaler.update()  # after the commit point: a retry's spare starts from the scale before it
            zero.update_and_gather(t, held, switch)
        self.before = None
        zero.regather()
        rt.report.leave_collective()

    def contribute_again(self, t: int) -> None:
        """A retry of step t after this member's average and user code ran (nobody passed
        the barrier): the members that lack the average (a spare that took a lost rank, a
        survivor whose average failed) redo it, so this member sends its kept gradient
        again, in the same collectives, and keeps what it already has."""
        h = self.h
        kept = self.kept
        if kept is None or kept[0] != t:
            raise RecoveryError(f"rank {h.rank} kept no gradient of step {t} to average again")
        h.boundary.mirror_local(t)
        ctl = torch.zeros(2, device=training_device(h.reg.params))  # the average's votes: counted at the barrier
        if self.shards.shrunk and h.runtime.full:  # shrunk since: hand our whole average to who lacks it
            synced = h.st.synced
            if synced is None or synced.step != t or synced.flats is None:
                raise RecoveryError(f"rank {h.rank} kept no whole average of step {t} to hand on")
            self.from_holder(list(synced.flats), ctl)
            return
        self.average_of([f.clone() for f in kept[1]], ctl, first=False)


def votes(world: int, sums: list[float]) -> tuple[bool, bool]:
    """The barrier's votes: (a whole-job stop after this step: anyone asked, runtime/stop.py;
    a planned migration's switch after it: every member is ready, runtime/migration.py)."""
    return sums[0] > 0, sums[1] > world - 0.5


def found_inf(scaler: Any, optimizer: Any) -> bool:
    """A GradScaler's part of a ZeRO-1 step before the commit point, without its step(): that
    would call optimizer.step(), which the shards replace. Unscale the gradient (unless the
    user did, to clip) and say whether it found inf/nan (the same on every member and mirror:
    all hold the same average): then no shard moves. The scale's update follows the commit."""
    from torch.amp.grad_scaler import OptState

    if not scaler.is_enabled():
        return False
    state = scaler._per_optimizer_states[id(optimizer)]  # torch's own record of this step's unscale
    if state["stage"] is not OptState.UNSCALED:
        scaler.unscale_(optimizer)
    return sum(float(v.item()) for v in state["found_inf_per_device"].values()) > 0


class Zero1Handover(Handover):
    """A planned migration of a ZeRO-1 rank: the snapshot is the replicated state and the
    shards the rank holds (its own, the one it mirrors); each step is repeated from the slices
    those shards stepped with, and the parameters come gathered (the other shards' updates
    are their owners'). The leaving worker serves them after the step's gather
    (Zero1.update_and_gather)."""

    def __init__(self, host: StrategyHost, shards: Shards) -> None:
        super().__init__(host)
        self.shards = shards

    def snapshot(self) -> dict[str, Any]:
        return {**self.h.reg.state_obj(), "zshards": {str(s.shard): s.state() for s in self.shards.held()}}

    def item(self, held: list) -> dict[str, Any]:
        """What the leaving worker serves of a step (replay_update repeats it): the slices the
        held shards stepped with (None: a step a GradScaler skipped), the gathered parameters,
        a GradScaler's state after its update."""
        h = self.h
        assert h.reducer is not None
        own, mirror = held
        item: dict[str, Any] = {"own": None if own is None else [x.clone() for x in own],
                                "params": h.reducer.param_flats()}  # fmt: skip
        if mirror is not None:
            item["mirror"] = [x.clone() for x in mirror]
        if h.scaler is not None:
            item["scaler"] = h.reg.extra_state_of(h.scaler)
        return item

    def load_snapshot(self, state: dict[str, Any]) -> None:
        h, z = self.h, self.shards
        h.reg.load_state(state)
        got = state["zshards"]
        held = [s.shard for s in z.held()]
        if sorted(int(k) for k in got) != held:
            raise RecoveryError(f"the leaving worker handed over optimizer shards {sorted(got)}, "
                                f"rank {h.rank} holds {held}")  # fmt: skip
        for sh in z.held():
            sh.load(got[str(sh.shard)])

    def replay_update(self, t: int, item: dict[str, Any]) -> None:
        h = self.h
        assert h.reducer is not None
        self.shards.update(item["own"], item.get("mirror"))  # own None: a step the scaler skipped
        h.reducer.write_params(item["params"])
        h.reg.load_extra_state(item.get("scaler"))
        h.committed, h.st.avg = t, None


class Zero1Parts(Parts):
    """A rank's optimizer shard (and the one it mirrors) in its checkpoint part and final record."""

    sections = ("shard",)

    def __init__(self, host: StrategyHost, shards: Shards) -> None:
        self.h = host
        self.shards = shards

    def checkpoint_part(self, rank: int) -> dict[str, Any]:
        return {"shard": self.shards.shards[rank].state()}  # a carried rank's: its carrier owns it

    def load_checkpoint_part(self, mine: dict[str, Any], section_of: Callable[[int, str], Any]) -> None:
        z, h = self.shards, self.h
        z.own.load(mine["shard"])
        if z.mirror is not None:
            z.mirror.load(section_of(left_of(h.rank, h.world_size), "shard"))

    def load_resharded(self, world: int, section_of: Callable[[int, str], Any]) -> None:
        """The shards re-split over this world size (comm/zero1.py)."""
        z = self.shards
        shards = [section_of(r, "shard") for r in range(world)]
        z.own.load_resharded(shards)
        if z.mirror is not None:
            z.mirror.load_resharded(shards)

    def final_record(self) -> dict[str, Any]:
        """The report checks each mirror against its owner's shard."""
        z = self.shards
        rec: dict[str, Any] = {"shard_digest": digest(z.own.tensors_for_digest())}
        if z.mirror is not None:
            rec["mirror_of"] = z.mirror.shard
            rec["mirror_digest"] = digest(z.mirror.tensors_for_digest())
        return rec

    def final_record_of(self, rank: int) -> dict[str, Any]:
        """A carried rank's shard, owned here in the shrunk layout, and the shard that rank
        mirrors at full width where this member holds a copy of it."""
        z = self.shards
        rec: dict[str, Any] = {}
        if rank in z.shards:
            rec["shard_digest"] = digest(z.shards[rank].tensors_for_digest())
        left = (rank - z.stride) % z.world
        if z.mirroring and left in z.shards:
            rec["mirror_of"] = left
            rec["mirror_digest"] = digest(z.shards[left].tensors_for_digest())
        return rec
