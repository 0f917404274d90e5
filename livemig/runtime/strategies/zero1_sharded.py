"""ZeRO-1: the parameters replicated, the optimizer state sharded over the ranks and each
shard mirrored on a buddy (comm/zero1.py holds the shards and the layout).

A step is the reduction, a 1-float barrier (the commit point: anyone past it holds the
slices to finish the step alone), the own shard's update, then the all-gather of the
parameters overlapped with the mirror's update. After any group switch every member first
all-gathers the parameters (`regather`), then goes on with the step it is at.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from livemig.comm.group import CollectiveAborted, allreduce_mean, allreduce_sum
from livemig.config import SHARDING_ENTRY, buddy_stride
from livemig.errors import ConfigError, RecoveryError
from livemig.rdzv.membership import GenState
from livemig.runtime.registry import Layout
from livemig.runtime.step_state import Averaged
from livemig.runtime.strategies.base import Parts, StrategyHost
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
    migrates = False  # refused by the coordinator (coordinator/migrations.py) and never ticked here

    def __init__(self, host: StrategyHost, shards: Shards) -> None:
        super().__init__(host)
        self.shards = shards
        self.parts = Zero1Parts(host, shards)
        self.gathered_gen: int | None = None  # the generation whose group last gathered the parameters

    def signature(self) -> list[list]:
        return [[SHARDING_ENTRY, "zero1", [int(self.shards.mirroring)]]]

    def sync_start(self) -> None:
        super().sync_start()
        self.shards.reset_values()  # the shards were cut from this rank's own initial parameters

    def formed(self) -> None:
        self.gathered_gen = self.h.runtime.gen  # every rank holds rank 0's initial model (or the loaded one)

    # -- the step ----------------------------------------------------------------------------
    def check_user_sync(self) -> None:
        raise ConfigError(
            "ctx.sync_gradients() / ctx.clip_grad_norm_() with sharding='zero1' are not supported yet: "
            "each rank holds only its slice of the averaged gradient; use ctx.step() alone"
        )

    def step(self, t: int) -> None:
        h = self.h
        if h.scaler is not None:
            raise ConfigError("ctx.step(scaler=...) with sharding='zero1' is not supported yet")
        if h.virtual.defers(t):  # a shrunk job: a later body of this step commits it
            h.virtual.stash(t)
            return
        self._step(t)
        if h.virtual.deferred == t:  # shrunk during the reduction: the carried bodies come first
            return
        h.faults.at(t, "after_step")

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
                if z.shrunk:  # no overlap while shrunk: the stashed bodies join the sum first
                    h.reg.ensure_grads()
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
                stop = z.barrier(rt.pg, timeout, rt.moved_on, h.halt.vote()) > 0
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
            z.update(held[0], held[1], part="owned")
            self.gathered_gen = None
            try:
                h.faults.at(t, "gather")

                def mirror_update(held: list = held) -> None:  # overlapped with the gather
                    h.commit(t, held, mirror_only=True)

                z.gather(rt.pg, timeout, rt.moved_on, meanwhile=mirror_update)
                self.gathered_gen = rt.gen
            except CollectiveAborted as exc:  # step t is committed; the new group repeats the gather
                h.join_recovery(t, exc)
        self.regather()
        rt.report.leave_collective()

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
        flats = h.reducer.flatten()
        allreduce_mean(pg, flats, 1, h.timeouts.collective)
        own = [f.chunk(h.world_size)[zero.own.shard].clone() for f in flats]
        mirror = [f.chunk(h.world_size)[zero.mirror.shard].clone() for f in flats] if zero.mirror else None
        zero.update(own, mirror)
        for p in h.reg.params:
            p.grad = None
        h.committed = t

    # -- recovery ------------------------------------------------------------------------------
    def finish_missed(self, m: Membership, t: int) -> bool:
        h = self.h
        if h.st.avg is None or h.st.avg.step != t:
            raise RecoveryError(f"rank {h.rank} does not hold the gradient slices of step {t}")
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

    def replay_needs_avg(self) -> bool:
        return False  # ctx.sync_gradients() is refused with ZeRO-1

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
        me = m.rank_of(h.incarnation)
        for s in need:
            where, part = h.pull.pull_any(m, items.zshard(s), ranks=[r for r in m.members if r != me])
            if part.step != h.committed + 1:
                raise RecoveryError(f"shard {s} from {where} is at step {part.step}, this rank at {h.committed + 1}")
            z.adopt(s, part.state)
            log.info("optimizer shard adopted for a new layout",
                     extra={"shard": s, "source": where, "generation": m.generation, "carried": m.carried})  # fmt: skip

    def switch_layout(self, m: Membership) -> None:
        self.shards.switch(m.carried)


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
            z.mirror.load(section_of((h.rank - buddy_stride(h.world_size)) % h.world_size, "shard"))

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
