"""A step with ZeRO-1 sharded optimizer state (comm/zero1.py holds the shards).

Reduction, a 1-float barrier (the commit point: anyone past it holds the
slices to finish the step alone), the own shard's update, then the
all-gather of the parameters overlapped with the mirror's update.
"""

from __future__ import annotations

import logging

from livemig.comm.group import CollectiveAborted, allreduce_sum
from livemig.rdzv.membership import GenState
from livemig.runtime.step_state import Averaged

log = logging.getLogger("livemig.runtime.zero1_step")


class Zero1Steps:
    """Mixed into api.Engine; relies on the attributes Engine.__init__ sets."""

    def _step_zero1(self, t: int) -> None:
        """Reduction (reduce-scatter + exchange, or allreduce + slicing), barrier,
        own shard update, all-gather overlapped with the mirror's update. A shrunk job
        (runtime/virtual.py) allreduces the sum of its bodies' gradients and steps every
        shard its layout gives this rank (comm/zero1.py, Zero1.switch).

        Recovery keeps one order on every member: after a group switch each
        member first all-gathers the parameters (_zero_regather), then goes on
        with the step it is at."""
        z, red, rt = self._zero, self._reducer, self.runtime
        assert red is not None
        timeout, first = self.timeouts.collective, True
        while self.committed < t:
            rt.check_fenced()
            rt.enter_collective(t)
            self._zero_regather()
            if self.committed >= t:
                break
            try:
                self._keep_before(t)
                self._faults.at(t, "allreduce")
                if z.shrunk:  # no overlap while shrunk: the stashed bodies join the sum first
                    self._ensure_grads()
                    self._virtual.add_stashed()
                    flats = red.flatten(self._virtual.divisor())
                    allreduce_sum(rt.pg, flats, timeout, rt.moved_on)
                    held: list = [z.slices_shrunk(flats), None]
                else:
                    if first:  # reductions launched during backward
                        reduced = red.finish(self.world_size, timeout, rt.moved_on)
                    else:  # a retry; after a grow, without the stashed body of the rank handed back
                        self._ensure_grads()
                        self._virtual.add_stashed()
                        reduced = red.reduce(rt.pg, red.flatten(self.world_size), timeout, rt.moved_on)
                    held = list(z.slices(rt.pg, reduced, timeout, rt.moved_on))
                self._st.avg = Averaged(t, held)  # held: enough to finish step t alone
                self._mirror_local(t)  # before the barrier: whoever passes it knows the mirror holds t
                z.barrier(rt.pg, timeout, rt.moved_on)
                self._faults.at_commit_point(t, "barrier result")
            except CollectiveAborted as exc:
                first = False
                self._join_recovery(t, exc)
                if self.committed < t and self._virtual.defers(t):  # shrunk meanwhile: carried bodies first
                    self._virtual.deferred = t
                    self._virtual.stash(t)
                    return
                continue
            # Update our shard(s), then gather the parameters while the mirror(s) are updated.
            z.update(held[0], held[1], part="owned")
            self._gathered_gen = None
            try:
                self._faults.at(t, "gather")
                z.gather(rt.pg, timeout, rt.moved_on,
                         meanwhile=lambda held=held: self._commit(t, held, mirror_only=True))  # fmt: skip
                self._gathered_gen = rt.gen
            except CollectiveAborted as exc:  # step t is committed; the new group repeats the gather
                self._join_recovery(t, exc)
        self._zero_regather()
        rt.leave_collective()

    def _zero_regather(self) -> None:
        """All-gather the parameters unless this generation's group already did."""
        if self._zero is None:
            return
        rt = self.runtime
        while self._gathered_gen != rt.gen and rt.m.state != GenState.DONE:
            rt.check_fenced()
            try:
                self._zero.gather(rt.pg, self.timeouts.collective, rt.moved_on)
                self._gathered_gen = rt.gen
            except CollectiveAborted as exc:
                self._join_recovery(self._current, exc)

    def after_switch(self) -> None:
        """Called by the runtime after it followed a new generation outside a step."""
        self._zero_regather()
