"""One step: the fault-aware average, the commit point, joining a recovery.

`ctx.steps()` yields the agreed steps and `ctx.step()` commits one: the
gradient average over the live group, then the optimizer step. A failed
collective joins the recovery (runtime/member.py) and either finishes the
step from a peer's completed average or redoes it in the new group, so user
code around ctx.step() runs exactly once per step on every rank.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch

from livemig.config import Role
from livemig.data import seed_step, step_seed
from livemig.errors import ConfigError
from livemig.runtime.member_fields import MemberFields
from livemig.runtime.step_state import Averaged

log = logging.getLogger("livemig.runtime.loop")
COMMITS_KEPT = 200  # commit times in the final record, besides those around generation changes


class StepLoop(MemberFields):
    """Mixed into api.Engine, over the member's fields (runtime/member_fields.py)."""

    def steps(self, total: int | None = None) -> Iterator[int]:
        """Yield step indices, from the agreed resume step after a recovery. Inside
        `for epoch in ctx.epochs(...)`, the epoch's steps (global indices; `total` is then
        optional and, if given, the epoch's step count)."""
        if self.epoch_loop.plan is not None:
            yield from self.epoch_loop.steps(total)
            return
        self.entry.check("ctx.steps()")
        if total is None or int(total) < 0:
            raise ConfigError(f"ctx.steps(total): give the job's number of steps (got {total!r})")
        self.steps_called = True
        total = int(total)
        start, replay = self.entry.start(total)
        if start is None:  # a spare in standby: a sandboxed warm-up of the real loop body, then its claim
            yield from self.sandbox.shadow(total)
            self.standby.wait_for_claim()  # raises Activate
        elif replay:
            yield from self.boundary.replay_step()
        yield from self.run(start or 0, total)
        self.migration.at_boundary()  # the switch was voted at the last step
        self.pull.after_switch()

    def epochs(self, epochs: int, steps_per_epoch: int) -> Iterator[int]:
        """Yield epoch indices for the port of `for epoch in range(E): sampler.set_epoch(epoch);
        for batch in loader:`, with `for step in ctx.steps():` inside each epoch (global step
        indices, `steps_per_epoch` of them). A process entering the function again (a claimed
        spare, a cold restart, a migration) starts at the epoch of the step it resumes at, so the
        code around an epoch's steps (set_epoch, a snapshot saved by rank 0, an evaluation) runs
        once per epoch; its collectives are answered from the rank's record there
        (runtime/epochs.py, runtime/preloop.py)."""
        self.entry.check("ctx.epochs()")
        self.steps_called = True
        return self.epoch_loop.begin(epochs, steps_per_epoch)

    def run(self, start: int, end: int) -> Iterator[int]:
        """Steps [start, end): each one's body yielded, committed, its boundary reached."""
        for step in range(start, end):
            self.current = step
            self.preloop.live = True  # every rank is past what this process runs from here on
            self.strategy.regather()
            self.feed.tick()  # a follow spare asked for a snapshot (runtime/follow.py)
            self.migration.tick()
            self.virtual.new_step()
            if self.virtual.degraded():  # a shrunk job: this rank's body, then those of the ranks it carries
                if self.reducer is not None:
                    self.reducer.disarm()  # the average waits for the step's last body
                yield from self.virtual.run_step(step, own_ran=False)
            else:
                seed_step(step_seed(self.seed, step, self.rank))
                self.strategy.begin_step()  # the average overlapped with backward is armed
                self.step_t0 = time.monotonic()
                self.faults.at(step, "compute")
                yield step
                yield from self.virtual.after_own(step)  # a shrink inside the step (runtime/virtual.py)
            if self.committed != step:
                raise ConfigError(f"step {step} ended without ctx.step(): it is the commit point")
            self.boundary.reached(step)  # kept, staged for a checkpoint, the fault plan's boundary faults
        self.current = None

    def sync_gradients(self) -> None:
        """Average the gradients over the live group and write them to `.grad`, without
        stepping: the user may then read or change `.grad` (clip it, check it) before
        ctx.step(). Idempotent within a step. Fault-aware like ctx.step(): if the
        average fails, this member joins the recovery and returns with the averaged
        gradient (a peer's, fetched, or one redone in the new group), so the user's
        code between sync_gradients() and ctx.step() runs exactly once per step."""
        self.strategy.sync_gradients(self.in_step("ctx.sync_gradients()"))

    def step(self, scaler: Any = None) -> None:
        """Average gradients over the live group (unless ctx.sync_gradients() did), then
        optimizer.step() (or `scaler.step(optimizer)` and `scaler.update()` with a
        torch.amp.GradScaler registered as an extra) and zero_grad().

        The commit point. If the collective fails, the member joins the
        recovery: either a peer completed this step's average (we fetch it
        and commit, so user code around ctx.step() still runs exactly once)
        or nobody did (we redo the collective in the new group).
        """
        t = self.in_step("ctx.step()")
        if scaler is not None and self.role != Role.LOCAL:
            self.reg.extra_name_of(scaler)  # refused at once if unregistered: a spare could not follow it
        self.scaler = scaler
        self.check_backward(t)
        try:
            if self.sandbox.active:
                self.sandbox.step(t)
                return
            if self.role == Role.LOCAL or self.world_size == 1 and self.runtime is None:
                self.commit(t, None)
                return
            if self.boundary.replaying(t):  # a claimed spare's replayed step: it holds the update
                self.boundary.finish_replay(t)
                return
            self.strategy.step(t)
        finally:
            self.scaler = None

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Average the gradients (ctx.sync_gradients()), clip them by their global norm
        and return that norm, as `accelerator.clip_grad_norm_`. Every rank clips the
        same averaged gradient, so every rank computes the same norm."""
        self.in_step("ctx.clip_grad_norm_()")
        return self.strategy.clip_grad_norm_(max_norm, norm_type)

    def in_step(self, what: str) -> int:
        t = self.current
        if t is None:
            raise ConfigError(f"{what} called outside `for step in ctx.steps(...)`")
        return t

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """A legitimately long pause of this rank (rank 0 writing a checkpoint): the
        others wait for it in the next collective, and it is not taken for hung."""
        if self.runtime is not None:
            self.runtime.report.set_busy(True)
        try:
            yield
        finally:
            if self.runtime is not None:
                self.runtime.report.set_busy(False)

    def join_recovery(self, t: int | None, exc: BaseException) -> None:
        self.runtime.report.leave_collective()
        if not self.runtime.moved_on() and "moved on" not in str(exc):  # a failure, not a recovery elsewhere
            self.runtime.report.collective_failed(t, str(exc))
        if self.reducer is not None:
            self.reducer.abandon()  # no bucket may launch on the abandoned group, nor be reused
        log.warning("collective failed; joining recovery",
                    extra={"step": t, "generation": self.runtime.gen, "why": str(exc)})  # fmt: skip
        self.runtime.comm.retire(self.runtime.pg)
        self.runtime.pg = None
        self.runtime.follow(self.runtime.gen + 1, self.pull)

    def check_backward(self, step: int) -> None:
        """No gradient on any parameter at the user's own step means no backward ran: the
        step trains nothing, which is said once. Called by ctx.sync_gradients() and
        ctx.step(), the two verbs a step ends with (a replayed step holds the average)."""
        if self._no_grad_said or self.boundary.replaying(step):
            return
        if self.virtual.stashed == step:  # this body's gradient waits for the step's last body
            return
        if not self.params or any(p.grad is not None for p in self.params):
            return
        self._no_grad_said = True
        log.warning(f"ctx.step() at step {step} found no gradient on any parameter: was loss.backward() "
                    "called? this step updates nothing", extra={"step": step, "rank": self.rank})  # fmt: skip

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally (as DDP's no_sync; FSDP2's
        set_requires_gradient_sync(False))."""
        with self.strategy.no_sync():
            yield

    def commit(self, t: int, avg: list | None, replay: bool = False, mirror_only: bool = False,
                applied: list | None = None, **info: float) -> None:  # fmt: skip
        self.strategy.apply_update(avg, mirror_only, applied)
        self.committed = t
        self.st.avg = Averaged(t, avg) if avg is not None else None
        if replay:  # a migrating spare replaying the group's steps: not a commit of the job's
            return
        self.st.record_commit(t, self.runtime.gen if self.runtime is not None else 0, COMMITS_KEPT)
        if self.runtime is not None:
            self.runtime.report.commit(t, self._last_metrics, generation=self.runtime.gen, **info)
