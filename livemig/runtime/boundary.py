"""The boundary rule (docs/architecture.md, "Exact state, rank by rank"): what a member keeps
at each step boundary so that a spare resuming there gets exactly the state the lost rank had,
and the spare's replay of the step before its resume step.

A boundary is reached when all user code of a step ran (ctx.step() and what follows it). The
loop then calls `reached(step)`, which runs the boundary's listeners in order: the kept
records (`keep`: the replica check at step 0, the strategy's snapshot), the background
checkpoint's staging and the fault plan's boundary faults. Inside a step, the strategy keeps
the parameters before the update (`keep_before`) and mirrors the rank's local state on its
buddy (`mirror_local`); a spare that took a rank replays the step before the resume step
(`replay_step`, `finish_replay`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch

from livemig.comm.group import CollectiveAborted, ring_exchange
from livemig.config import Role
from livemig.data import seed_step, step_seed
from livemig.errors import ConfigError, RecoveryError
from livemig.runtime.registry import load_extra
from livemig.runtime.start_sync import check_replicas

if TYPE_CHECKING:
    from livemig.comm.reducer import GradReducer
    from livemig.config import Timeouts
    from livemig.runtime.member import MemberRuntime
    from livemig.runtime.registry import Registry
    from livemig.runtime.step_state import StepState
    from livemig.runtime.strategies.base import Strategy
    from livemig.runtime.virtual import VirtualRanks

log = logging.getLogger("livemig.runtime.boundary")


class BoundaryHost(Protocol):
    """What the boundary rule reads of its member (api.Engine's fields, runtime/member_fields.py)."""

    seed: int
    role: Role
    incarnation: str
    timeouts: Timeouts
    runtime: MemberRuntime  # None outside `livemig run`: tested before use
    rank: int
    world_size: int
    reg: Registry
    reducer: GradReducer | None
    strategy: Strategy
    scaler: Any
    committed: int
    current: int | None
    st: StepState
    virtual: VirtualRanks

    def join_recovery(self, t: int | None, exc: BaseException) -> None: ...


class Boundary:
    """One member's boundary records and the ordered listeners of a reached boundary."""

    def __init__(self, host: BoundaryHost) -> None:
        self.h = host
        #: Run in order by `reached(step)`; api.Engine appends the checkpoint's staging and the
        #: fault plan's boundary faults after `keep` (a checkpoint stages what `keep` kept).
        self.listeners: list[Callable[[int], None]] = [self.keep]

    def reached(self, step: int) -> None:
        """All user code of `step` ran: every listener, in order."""
        for listener in self.listeners:
            listener(step)

    @property
    def replays(self) -> bool:
        """Does a spare replay one step (is there state user code changes outside the
        optimizer step: extras, buffers, local=)? Without it the spare starts at the
        resume step directly."""
        return bool(self.h.reg.extra or self.h.reg.has_local)

    def keep(self, step: int) -> None:
        """Keep what a spare resuming after `step` needs, the newest two boundaries."""
        h = self.h
        if step == 0 and h.role == Role.WORKER and h.runtime is not None and h.world_size > 1:
            # Replicated state must be equal on every rank (a spare takes it from any peer):
            # checked here in the group the job formed with, and by the coordinator from these.
            digests = h.reg.replica_digests()
            h.runtime.put(h.runtime.keys.extras_check(h.rank), {"incarnation": h.incarnation, "digests": digests})
            if h.runtime.gen == 1 and h.runtime.pg is not None:  # every member is a worker of the start
                try:
                    check_replicas(h.reg, h.runtime.pg, h.rank, h.world_size, h.timeouts.collective,
                                   h.runtime.moved_on, digests)  # fmt: skip
                except CollectiveAborted as exc:  # a member lost: the coordinator's check still runs
                    h.join_recovery(None, exc)
        h.strategy.at_boundary(step)

    def keep_before(self, t: int) -> None:
        """The parameters before step t's update, the newest two: a spare replaying
        step t runs its forward on exactly these."""
        st, params = self.h.st, self.h.reg.params
        if not self.replays or t in st.before:
            return
        old = st.before.pop(t - 2, None)
        if old is None or len(old) != len(params):
            old = [torch.empty_like(p) for p in params]
        with torch.no_grad():
            for dst, p in zip(old, params, strict=True):
                dst.copy_(p)
        st.before[t] = old

    def mirror_local(self, t: int) -> None:
        """Send this rank's local state (buffers, local=) of the boundary before step t
        to the right neighbour; keep the left neighbour's. Runs inside step t's
        collective phase, before the commit vote (or barrier), so whoever commits t
        knows that the mirror holds every rank's boundary t-1."""
        h = self.h
        if not h.reg.has_local or h.world_size < 2 or h.virtual.degraded():  # shrunk: no mirror
            return
        if h.st.local_blob is None or h.st.local_blob.step != t - 1:
            raise RecoveryError(f"rank {h.rank} has no local-state snapshot of boundary {t - 1}")
        got = ring_exchange(h.runtime.pg, h.st.local_blob.blob, h.rank, h.world_size,
                            h.timeouts.collective, h.runtime.moved_on)  # fmt: skip
        h.st.mirrored[t - 1] = got
        h.st.mirrored.pop(t - 3, None)

    # -- a claimed spare's replay of the step before its resume step ----------------------
    def replay_step(self) -> Iterator[int]:
        """A spare that took rank r at resume step s runs the user's body of step s-1
        once more, without collectives, from exactly what r started it with: the
        parameters before that step's update, the replicated extras and
        hyperparameters of boundary s-2, and r's own local state of boundary s-2
        (from its mirror). Forward, buffers, data position and the user's code
        after ctx.step() (a scheduler stepped once, a metric updated with this
        step's loss) then reach boundary s-1 exactly as r's own would have; at
        ctx.step() the parameters after the update are put back."""
        h = self.h
        rep = h.st.replay
        assert rep is not None
        t = rep.step
        h.strategy.regather()  # the group's first collective after a switch, on every member
        h.reg.load_boundary(rep.boundary)
        if rep.local is not None:
            h.reg.load_local(rep.local)
        self.keep(t - 1)  # a later recovery may need them from us
        with torch.no_grad():
            rep.after = [p.detach().clone() for p in h.reg.params]
            for p, b in zip(h.reg.params, rep.before, strict=True):
                p.copy_(b)
        h.current = t
        seed_step(step_seed(h.seed, t, h.rank))
        if h.reducer is not None:
            h.reducer.disarm()  # the gradients of a replay are thrown away
        yield t
        if h.committed != t:
            raise ConfigError(f"step {t} ended without ctx.step(): it is the commit point")
        self.keep(t)

    def replaying(self, t: int) -> bool:
        """Is ctx.step() at step t the end of a spare's replay (it holds the update already)?"""
        return self.h.st.replay is not None and self.h.st.replay.step == t

    def finish_replay(self, t: int) -> None:
        """ctx.step() of the replayed step: put back the parameters after its update (and a
        GradScaler's state as of step t), so the replay changed only what user code changes."""
        h = self.h
        rep, h.st.replay = h.st.replay, None
        assert rep is not None and rep.after is not None
        if h.scaler is not None:  # changed only by commits: take the source's, as of step t
            load_extra(h.scaler, rep.extra[h.reg.extra_name_of(h.scaler)])
        with torch.no_grad():
            for p, a in zip(h.reg.params, rep.after, strict=True):
                p.copy_(a)
                p.grad = None
