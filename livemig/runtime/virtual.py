"""Virtual ranks: a shrunk job's lost ranks, run by the survivors (`livemig run --min-nproc`).

With no warm spare within --shrink-wait, the coordinator commits a generation whose group
is the survivors and gives each lost rank a carrier (Membership.carried: the survivor that
mirrored its local state). The job keeps its N ranks: every step, a carrier runs the loop
body once for itself and once for each rank it carries, with that rank's `ctx.rank`, RNG
seed, data position and local state swapped in, so the step sees the same samples and the
same global batch as the fault-free run. Bodies run in descending rank order (rank 0, if
among them, last); only the last body's ctx.step() averages and steps the optimizer: an
earlier body's gradient is stashed here and added to the last one's before the average
(divided by N, the virtual world). So an earlier body's code after ctx.step() runs before
the step's update, and what it changes of the replicated state (extras, hyperparameters)
is put back before the next body: replicated state changes once per step, as the
fault-free run's; each rank's local state changes once per step, as its own would.

A shrink lands inside a step. A survivor whose average is redone (nobody committed the
step) and that now carries a rank whose body has not run defers its own ctx.step(): its
gradient is stashed, and the carried ranks' bodies run after its own, the last one
averaging. A carried rank whose local state the carrier holds only at an older boundary
(its mirror) has the missing steps replayed first, gradients dropped, from the parameters
and replicated state the carrier kept of those steps (the replay rule of a spare).

LIVEMIG_SHRINK_DROP=1 is torchft's semantics, kept to measure against (`livemig bench
downtime`'s torchft_style row): no carried body runs, the lost ranks' batches are dropped
and the average is over the survivors, so the global batch shrinks and the run diverges.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from livemig.comm.group import CollectiveAborted, wait_all
from livemig.config import ENV_SHRINK_DROP, buddy_of
from livemig.data import seed_step, step_seed
from livemig.errors import RecoveryError
from livemig.state import unpack

if TYPE_CHECKING:
    from livemig.comm.reducer import GradReducer
    from livemig.runtime.member import MemberRuntime
    from livemig.runtime.registry import Registry
    from livemig.runtime.self_faults import SelfFaults
    from livemig.runtime.step_state import StepState

log = logging.getLogger("livemig.runtime.virtual")


class VirtualHost(Protocol):
    """What a shrunk job's carried ranks use of their member (api.Engine's fields)."""

    seed: int
    rank: int
    world_size: int
    runtime: MemberRuntime
    reg: Registry
    committed: int
    current: int | None
    step_t0: float
    st: StepState
    faults: SelfFaults

    @property
    def params(self) -> list[torch.nn.Parameter]: ...


class VirtualRanks:
    """Owned by api.Engine (`engine.virtual`): the ranks this process carries in a shrunk
    job, their local state, the gradient stashed between the bodies of a step."""

    def __init__(self, engine: VirtualHost) -> None:
        self.e = engine
        self.active: int | None = None  # the carried rank whose body runs now
        self.replaying: int | None = None  # the step replayed for a carried rank (its gradient dropped)
        self.states: dict[int, tuple[int, torch.Tensor | None]] = {}  # rank -> (boundary, its local state)
        self.acc: dict[int, list[torch.Tensor | None]] = {}  # rank -> its body's stashed gradient, this step
        self.base: list[torch.Tensor] | None = None  # the last body's own gradient, before the stashes joined
        self.stashed: int | None = None  # the step whose running body's gradient is stashed already
        self.deferred: int | None = None  # a step whose own ctx.step() gave way to carried bodies
        self.ran: set[int] = set()  # ranks whose body of the current step ran
        self.drop = os.environ.get(ENV_SHRINK_DROP) == "1"  # torchft's semantics, for comparison

    # -- who -----------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """The rank the running body is (ctx.rank)."""
        return self.e.rank if self.active is None else self.active

    def carried(self) -> list[int]:
        rt = self.e.runtime
        if rt is None or not rt.carried or self.drop:
            return []
        return sorted(v for v, c in rt.carried.items() if c == self.e.rank)

    def degraded(self) -> bool:
        rt = self.e.runtime
        return rt is not None and bool(rt.carried)

    def divisor(self) -> int:
        """What the summed gradient is divided by: the virtual world (the same global batch),
        or with LIVEMIG_SHRINK_DROP the survivors (torchft's average over fewer batches)."""
        rt = self.e.runtime
        if self.drop and rt is not None and rt.carried:
            return self.e.world_size - len(rt.carried)
        return self.e.world_size

    def _refresh(self) -> None:
        """Ranks newly carried take their local state from this rank's mirror of them."""
        mine = self.carried()
        for v in list(self.states):
            if v not in mine:
                self.states.pop(v)
        e = self.e
        for v in mine:
            if v in self.states:
                continue
            if not e.reg.has_local:
                self.states[v] = (e.committed, None)
                continue
            held = sorted(b for b in e.st.mirrored if b <= e.committed)
            if not held:
                raise RecoveryError(f"rank {e.rank} carries rank {v} but holds none of its local state")
            self.states[v] = (held[-1], e.st.mirrored[held[-1]])
            log.warning("carrying a lost rank", extra={"rank": e.rank, "carries": v, "from_boundary": held[-1]})

    def order(self) -> list[int]:
        return sorted([self.e.rank, *self.carried()], reverse=True)

    # -- inside a body -------------------------------------------------------------------
    def defers(self, t: int) -> bool:
        """At this body's average: do bodies of carried ranks still have to run for step t
        (this body is not the step's last)?"""
        if self.replaying == t:
            return True
        if not self.degraded():
            return False
        self._refresh()
        running = self.rank
        return any(v not in self.ran and v != running for v in self.order())

    def stash(self, t: int) -> None:
        """Keep this body's gradient for the step's last body; .grad is cleared (the next
        body's zero_grad() cannot touch it). A replayed body's gradient is dropped."""
        params = self.e.params
        if self.replaying != t and self.stashed != t:
            self.acc[self.rank] = [None if p.grad is None else p.grad.detach().clone() for p in params]
        for p in params:
            p.grad = None
        self.stashed = t

    def add_stashed(self) -> None:
        """The last body: the earlier bodies' gradients join its own before the average. Only
        those of ranks still run here: a rank handed to a spare meanwhile (grow) redoes its
        own, so its stash goes, and so does the running body's if it is that rank's."""
        if not self.acc:
            return
        keep = {self.e.rank, *self.carried()}
        # every parameter holds a gradient here: the reduction gave each a zero one (Registry.ensure_grads)
        own = cast(list[torch.Tensor], [p.grad for p in self.e.params])
        if self.base is None:  # kept: an attempt that fails (a grow) is summed again from it
            self.base = [g.detach().clone() for g in own]
        for g, b in zip(own, self.base, strict=True):
            if self.rank in keep:
                g.copy_(b)
            else:
                g.zero_()
        for r, grads in sorted(self.acc.items()):
            if r not in keep:
                continue
            for mine, theirs in zip(own, grads, strict=True):
                if theirs is not None:
                    mine.add_(theirs)

    def exact_inputs(self, red: GradReducer) -> dict[int, list[torch.Tensor]] | None:
        """Each rank's pre-divided buckets for reduce_exact: the running body's gradient as it
        left it (before any add_stashed), the stashed ones of the bodies before it. None where
        no full-width group exists (NCCL, a planned migration's switch while shrunk,
        LIVEMIG_SHRINK_DROP): the caller sums over the survivors, within the bound
        (docs/architecture.md)."""
        rt = self.e.runtime
        full = rt.full if rt is not None else {}
        if not full or not self.degraded():
            return None
        self._refresh()
        keep = {self.e.rank, *self.carried()}
        if set(full) != keep:
            log.warning("full-width group does not match the ranks carried here",
                        extra={"endpoints": sorted(full), "ranks": sorted(keep)})  # fmt: skip
            return None
        world = self.e.world_size
        ins: dict[int, list[torch.Tensor]] = {}
        for r in sorted(keep):
            if r == self.rank:
                own = self.base if self.base is not None else [p.grad for p in self.e.params]
                ins[r] = red.flatten_grads(own, world)
            elif r in self.acc:
                ins[r] = red.flatten_grads(self.acc[r], world)
            else:
                raise RecoveryError(f"rank {self.e.rank} carries rank {r} but holds no gradient of its body this step")
        return ins

    def reduce_exact(self, red: GradReducer, ctl: torch.Tensor | None, timeout: timedelta,
                     should_abort: Callable[[], bool]) -> list[torch.Tensor] | None:  # fmt: skip
        """A shrunk step's whole average, bit for bit the fault-free group's: every rank's
        buckets (exact_inputs()) enter the full-width group through its own
        endpoint (MemberRuntime.full), in the reduction the fault-free step runs (an
        allreduce of each bucket; reduce-scatter mode: reduce-scatter, then an all-gather of
        the slices, which copies their bits). `ctl` (the votes) is summed alongside from this
        process's own endpoint, zeros from the carried ones: the sum is the survivors' as
        before, not divided. None where exact_inputs() is."""
        ins = self.exact_inputs(red)
        if ins is None:
            return None
        full = self.e.runtime.full
        outs: dict[int, list[torch.Tensor]] = {}
        works: list[Any] = []
        try:
            for r, flats in ins.items():
                pg = full[r]
                if red.scatter:
                    outs[r] = [torch.empty(n, dtype=f.dtype, device=f.device)
                               for n, f in zip(red.shard_sizes, flats, strict=True)]  # fmt: skip
                    works += [pg.reduce_scatter([o], [list(f.chunk(red.shard_world))])
                              for o, f in zip(outs[r], flats, strict=True)]  # fmt: skip
                else:
                    works += [pg.allreduce([f]) for f in flats]
                if ctl is not None:
                    works.append(pg.allreduce([ctl if r == self.e.rank else torch.zeros_like(ctl)]))
        except Exception as exc:  # noqa: BLE001 - a broken group refuses the launch
            raise CollectiveAborted(f"collective failed at launch: {exc}") from exc
        wait_all(works, timeout, should_abort, poll=not red.scatter)
        if not red.scatter:
            return ins[self.e.rank]
        wholes = {r: [torch.empty_like(f) for f in ins[r]] for r in ins}
        try:
            works = [full[r].allgather([list(w.chunk(red.shard_world))], [o])
                     for r in ins for w, o in zip(wholes[r], outs[r], strict=True)]  # fmt: skip
        except Exception as exc:  # noqa: BLE001
            raise CollectiveAborted(f"collective failed at launch: {exc}") from exc
        wait_all(works, timeout, should_abort)
        return wholes[self.e.rank]

    def new_step(self) -> None:
        self.acc, self.base = {}, None

    # -- the loop ------------------------------------------------------------------------
    def run_step(self, step: int, own_ran: bool) -> Iterator[int]:
        """The bodies of `step` besides this rank's own (own_ran: it ran already, its
        ctx.step() deferred), then any carried rank's catch-up to the boundary."""
        e = self.e
        self._refresh()
        self.deferred = None  # taken: the last body below averages
        self.ran = {e.rank} if own_ran else set()
        pre = self._replicated_before(step)
        if own_ran:
            yield from self._catch_up(step - 1)  # carried ranks reach boundary step-1 first
        while e.committed != step:
            todo = [v for v in self.order() if v not in self.ran]
            if not todo:
                raise RecoveryError(
                    f"rank {e.rank}: no body of step {step} averaged it (order {self.order()}, ran "
                    f"{sorted(self.ran)}, committed {e.committed}, carried {e.runtime.carried})"
                )
            v = todo[0]
            if self.ran:
                e.reg.load_boundary(unpack(pre))  # an earlier body's changes of replicated state go
            yield from self._body(step, v)
            self.ran.add(v)
            self.deferred = None  # a shrink inside that body deferred its commit to the bodies left
        self.ran = set()

    def after_own(self, step: int) -> Iterator[int]:
        """After this rank's own body of `step` on the plain path: a shrink inside it may have
        deferred the commit (the carried bodies run now) or left carried ranks a step behind."""
        e = self.e
        if self.deferred == step and e.committed != step:
            yield from self.run_step(step, own_ran=True)
        elif self.degraded() and e.committed == step:
            self._refresh()
            yield from self._catch_up(step)

    def _replicated_before(self, step: int) -> torch.Tensor:
        """The replicated state (extras, hyperparameters) of boundary step-1, to put back
        after each body but the last."""
        blob = self.e.st.boundaries.get(step - 1)
        return blob if blob is not None else self.e.reg.pack_boundary()

    def _body(self, step: int, v: int) -> Iterator[int]:
        e = self.e
        e.current = step
        self.stashed = None
        carried = v != e.rank
        own = self._swap_in(v) if carried else None
        seed_step(step_seed(e.seed, step, v))
        e.step_t0 = time.monotonic()
        if not carried:
            e.faults.at(step, "compute")  # the fault plan's points are this process's own rank's
        try:
            yield step
        finally:
            self.active = None
        if carried:
            self._swap_out(v, step, own)

    @contextlib.contextmanager
    def as_rank(self, v: int, boundary: int) -> Iterator[None]:
        """Carried rank v's local state in place, as of `boundary`, for a moment (its
        checkpoint part is staged from it: runtime/checkpoint.py); nothing is kept of it."""
        have = self.states.get(v)
        if have is None or have[0] != boundary:
            raise RecoveryError(f"rank {self.e.rank} holds carried rank {v}'s local state of boundary "
                                f"{None if have is None else have[0]}, not {boundary}")  # fmt: skip
        own = self._swap_in(v)
        try:
            yield
        finally:
            self.active = None
            if own is not None:
                self.e.reg.load_local(unpack(own))

    def _swap_in(self, v: int) -> torch.Tensor | None:
        e = self.e
        own = e.reg.pack_local() if e.reg.has_local else None
        blob = self.states[v][1]
        if blob is not None:
            e.reg.load_local(unpack(blob))
        self.active = v
        return own

    def _swap_out(self, v: int, step: int, own: torch.Tensor | None) -> None:
        e = self.e
        blob = e.reg.pack_local() if e.reg.has_local else None
        self.states[v] = (step, blob)
        if blob is not None and buddy_of(v, e.world_size) == e.rank:
            e.st.mirrored[step] = blob  # its buddy's mirror slot: served to a spare that takes it back (grow)
            e.st.mirrored.pop(step - 3, None)
        if own is not None:
            e.reg.load_local(unpack(own))

    def _catch_up(self, boundary: int) -> Iterator[int]:
        """Replay the steps up to `boundary` for each carried rank whose local state is
        older: from the parameters before each step and the replicated state of the
        boundary before it, as this rank kept them (runtime/loop.py, the boundary rule)."""
        e = self.e
        for v in self.carried():
            while self.states[v][0] < boundary:
                k = self.states[v][0] + 1
                before, rep = e.st.before.get(k), e.st.boundaries.get(k - 1)
                if before is None or rep is None:
                    raise RecoveryError(f"rank {e.rank} cannot replay step {k} for rank {v}: it kept no "
                                        "parameters or replicated state of it")  # fmt: skip
                yield from self._replay(k, v, before, rep, boundary + 1)

    def _replay(self, k: int, v: int, before: list, rep: torch.Tensor, back_to: int) -> Iterator[int]:
        e = self.e
        own_rep = e.reg.pack_boundary()
        with torch.no_grad():
            now = [p.detach().clone() for p in e.params]
            for p, b in zip(e.params, before, strict=True):
                p.copy_(b)
        e.reg.load_boundary(unpack(rep))
        own = self._swap_in(v)
        e.current, self.replaying = k, k
        seed_step(step_seed(e.seed, k, v))
        log.info("replaying a step for a carried rank", extra={"rank": e.rank, "carries": v, "step": k})
        try:
            yield k
        finally:
            self.active, self.replaying = None, None
        self._swap_out(v, k, own)
        with torch.no_grad():
            for p, x in zip(e.params, now, strict=True):
                p.copy_(x)
                p.grad = None
        e.reg.load_boundary(unpack(own_rep))
        e.current = back_to
