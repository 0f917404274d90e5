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
from collections.abc import Generator, Iterator
from typing import Any

import torch

from livemig.comm.group import CollectiveAborted
from livemig.config import Role
from livemig.data import seed_step, step_seed
from livemig.errors import ConfigError
from livemig.rdzv.membership import GenState
from livemig.runtime.member_fields import MemberFields
from livemig.runtime.step_state import Averaged

log = logging.getLogger("livemig.runtime.loop")
COMMITS_KEPT = 200  # commit times in the final record, besides those around generation changes


class StepLoop(MemberFields):
    """Mixed into api.Engine, over the member's fields (runtime/member_fields.py)."""

    def steps(self, total: int) -> Iterator[int]:
        """Yield step indices, from the agreed resume step after a recovery."""
        if self.model is None and self.optimizer is None:
            raise ConfigError("call ctx.register(model=..., optimizer=...) before ctx.steps()")
        if self.steps_called:
            raise ConfigError(
                "ctx.steps() was called a second time in one run of the function (once per epoch?): call it "
                "once with the total, for step in ctx.steps(epochs * steps_per_epoch), and take the epoch as "
                'step // steps_per_epoch (README, "Epochs")'
            )
        self.steps_called = True
        self._total = total
        start = yield from self._enter(total)
        if self.role != Role.SPARE and self.joining is None:
            self.boundary.keep(start - 1)  # the state every rank starts from
        for step in range(start, total):
            self.current = step
            self.strategy.regather()
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
        self.migration.at_boundary()  # the switch was voted at the last step
        self.pull.after_switch()

    def _enter(self, total: int) -> Generator[int, None, int]:
        """Where this entry of the function starts (returned: the first step to run), by why it
        was entered: a cold restart, an FSDP2 redo, a worker forming the job, a spare (its
        warm-up, then claimed or migrated in; a claimed spare's replay is yielded here)."""
        joining = self.joining
        recorded = self.preloop.leave()  # the collectives before the loop (runtime/preloop.py)
        if joining is not None and joining.restart:  # the cold path: loaded in place (runtime/pull.py)
            m = self.runtime.follow(joining.generation, self.pull)
            return total if m.state == GenState.DONE else self.committed + 1
        if joining is not None and joining.redo:  # FSDP2: redo from the boundary held here
            self.strategy.redo_from_stash()
            return self.committed + 1
        if self.role == Role.WORKER:
            self.faults.gate.check_total(total)  # a fault plan's step the job never reaches: refused now
            self.preloop.register()
            self.preloop.publish(recorded)
            self.standby.register_signature()
            self.runtime.follow(1, self.pull)
            self.preloop.formed()
            resumed = self.ckpt.resume()  # --resume-from: this rank's part of the chosen checkpoint
            if resumed is not None:
                self.committed = resumed
                self.ckpt.at_boundary(resumed)  # resharded: written at once (runtime/checkpoint.py)
            elif self.reg.sync_start and self.world_size > 1 and self.runtime.pg is not None:
                try:  # DDP's start-up broadcast, never after a load: the replicas hold the job's state then
                    self.strategy.sync_start()
                except CollectiveAborted as exc:
                    # A member lost during the sync: the survivors go on with what they hold (a
                    # broadcast that completed only in part is caught by the step-0 replica check).
                    self.join_recovery(None, exc)
            self.strategy.formed()  # what is mirrored from now on (FSDP2: each rank's shard on its right neighbour)
            return self.committed + 1
        if self.role != Role.SPARE:
            return 0
        if joining is None:
            yield from self.sandbox.shadow(total)  # sandboxed warm-up of the real loop body
            self.standby.wait_for_claim()  # raises Activate
        assert self.joining is not None
        if self.joining.migration:
            self.migration.migrate_in()
            start = self.committed + 1
            self.strategy.handover.after_migrate_in(self.committed)  # the leaving worker's, handed over at the switch
            return start
        m = self.runtime.follow(self.joining.generation, self.pull)
        start = self.committed + 1
        if m.state == GenState.DONE:
            return total
        if self.st.replay is not None:
            yield from self.boundary.replay_step()
        return start

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
