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

from livemig.comm.group import CollectiveAborted, retire, ring_exchange
from livemig.config import Role
from livemig.data import seed_step, step_seed
from livemig.errors import ConfigError, RecoveryError
from livemig.rdzv.membership import GenState
from livemig.runtime.member_fields import MemberFields
from livemig.runtime.start_sync import check_replicas
from livemig.runtime.step_state import Averaged

log = logging.getLogger("livemig.runtime.loop")
COMMITS_KEPT = 200  # commit times in the final record, besides those around generation changes


class StepLoop(MemberFields):
    """Mixed into api.Engine, over the member's fields (runtime/member_fields.py)."""

    def steps(self, total: int) -> Iterator[int]:
        """Yield step indices, from the agreed resume step after a recovery."""
        if self.model is None and self.optimizer is None:
            raise ConfigError("call ctx.register(model=..., optimizer=...) before ctx.steps()")
        self._total = total
        start = 0
        if self.joining is not None and self.joining.restart:  # the cold path: loaded in place (pull.py)
            m = self.runtime.follow(self.joining.generation, self)
            start = total if m.state == GenState.DONE else self.committed + 1
        elif self.joining is not None and self.joining.redo:  # FSDP2: redo from the boundary held here
            self.strategy.redo_from_stash()
            start = self.committed + 1
        elif self.role == Role.WORKER:
            self.faults.gate.check_total(total)  # a fault plan's step the job never reaches: refused now
            self.runtime.register(self.rank, host_store=self.rank == 0)
            self.standby.register_signature()
            self.runtime.follow(1, self)
            resumed = self.ckpt.resume()  # --resume-from: this rank's part of the chosen checkpoint
            if resumed is None:
                self._sync_start()  # never after a load: the replicas hold the job's state already
            else:
                self.committed, start = resumed, resumed + 1
                self.ckpt.at_boundary(resumed)  # resharded: written at once (runtime/checkpoint.py)
            self.strategy.formed()  # what is mirrored from now on (FSDP2: each rank's shard on its right neighbour)
        elif self.role == Role.SPARE:
            if self.joining is None:
                yield from self.sandbox.shadow(total)  # sandboxed warm-up of the real loop body
                self.standby.wait_for_claim()  # raises Activate
            if self.joining.migration:
                self.migration.migrate_in()
                start = self.committed + 1
                self.strategy.after_migrate_in(self.committed)  # the leaving worker's, handed over at the switch
            else:
                m = self.runtime.follow(self.joining.generation, self)
                start = self.committed + 1
                if m.state == GenState.DONE:
                    start = total
                elif self.st.replay is not None:
                    yield from self._replay_step()
        if self.role != Role.SPARE and self.joining is None:
            self.keep_boundary(start - 1)  # the state every rank starts from
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
            self.keep_boundary(step)
            self.ckpt.at_boundary(step)  # staged here, written in the background
            self.faults.at_boundary(step)
        self.current = None
        self.migration.at_boundary()  # the switch was voted at the last step
        self.after_switch()

    def _sync_start(self) -> None:
        """DDP's start-up broadcast (runtime/start_sync.py), in the group the job formed with."""
        if not self.reg.sync_start or self.world_size < 2 or self.runtime.pg is None:
            return
        try:
            self.strategy.sync_start()
        except CollectiveAborted as exc:
            # A member lost during the sync: the survivors go on with what they hold (a
            # broadcast that completed only in part is caught by the step-0 replica check).
            self.join_recovery(None, exc)

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
            if self.st.replay is not None and self.st.replay.step == t:
                self._finish_replay(t)
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

    def after_switch(self) -> None:
        """Called by the runtime after it followed a new generation outside a step."""
        self.strategy.regather()

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
            self.runtime.set_busy(True)
        try:
            yield
        finally:
            if self.runtime is not None:
                self.runtime.set_busy(False)

    def join_recovery(self, t: int | None, exc: BaseException) -> None:
        self.runtime.leave_collective()
        if not self.runtime.moved_on() and "moved on" not in str(exc):  # a failure, not a recovery elsewhere
            self.runtime.collective_failed(t, str(exc))
        if self.reducer is not None:
            self.reducer.abandon()  # no bucket may launch on the abandoned group, nor be reused
        log.warning("collective failed; joining recovery",
                    extra={"step": t, "generation": self.runtime.gen, "why": str(exc)})  # fmt: skip
        retire(self.runtime.pg)
        self.runtime.pg = None
        self.runtime.follow(self.runtime.gen + 1, self)

    def check_backward(self, step: int) -> None:
        """No gradient on any parameter at the user's own step means no backward ran: the
        step trains nothing, which is said once. Called by ctx.sync_gradients() and
        ctx.step(), the two verbs a step ends with (a replayed step holds the average)."""
        if self._no_grad_said or (self.st.replay is not None and self.st.replay.step == step):
            return
        if self.virtual.stashed == step:  # this body's gradient waits for the step's last body
            return
        if not self.params or any(p.grad is not None for p in self.params):
            return
        self._no_grad_said = True
        log.warning(f"ctx.step() at step {step} found no gradient on any parameter: was loss.backward() "
                    "called? this step updates nothing", extra={"step": step, "rank": self.rank})  # fmt: skip

    def ensure_grads(self) -> None:
        """A parameter backward did not reach still takes part in the reduction, as zeros."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)

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
        self.st.commits.append([t, time.time()])
        self._trim_commits()
        if self.runtime is not None:
            self.runtime.progress(t, generation=self.runtime.gen, **self._last_metrics, **info)

    def _trim_commits(self) -> None:
        """Keep the final record bounded (etcd refuses a request over 1.5 MiB, near 100k
        steps of commit times): the last COMMITS_KEPT commits and those within a few steps
        of each generation change, which is all the report reads."""
        gen = self.runtime.gen if self.runtime is not None else 0
        if gen != self.st.commit_gen:
            self.st.commit_gen = gen
            self.st.gen_steps.append(int(self.st.commits[-1][0]))
        if len(self.st.commits) <= 2 * COMMITS_KEPT:
            return
        st = self.st
        last = st.commits[-1][0]
        st.commits = [c for c in st.commits
                      if c[0] > last - COMMITS_KEPT or any(abs(c[0] - g) <= 5 for g in st.gen_steps)]  # fmt: skip

    # -- the boundary rule (docs/architecture.md) -------------------------------------------
    @property
    def replays(self) -> bool:
        """Does a spare replay one step (is there state user code changes outside the
        optimizer step: extras, buffers, local=)? Without it the spare starts at the
        resume step directly."""
        return bool(self.reg.extra or self.reg.has_local)

    def keep_boundary(self, step: int) -> None:
        """All user code of `step` ran (after ctx.step() included): keep what a spare
        resuming after `step` needs, the newest two boundaries."""
        if step == 0 and self.role == Role.WORKER and self.runtime is not None and self.world_size > 1:
            # Replicated state must be equal on every rank (a spare takes it from any peer):
            # checked here in the group the job formed with, and by the coordinator from these.
            digests = self.reg.replica_digests()
            self.runtime.put(self.runtime.keys.extras_check(self.rank), {
                "incarnation": self.incarnation, "digests": digests})  # fmt: skip
            if self.runtime.gen == 1 and self.runtime.pg is not None:  # every member is a worker of the start
                try:
                    check_replicas(self.reg, self.runtime.pg, self.rank, self.world_size, self.timeouts.collective,
                                   self.runtime.moved_on, digests)  # fmt: skip
                except CollectiveAborted as exc:  # a member lost: the coordinator's check still runs
                    self.join_recovery(None, exc)
        self.strategy.at_boundary(step)

    def keep_before(self, t: int) -> None:
        """The parameters before step t's update, the newest two: a spare replaying
        step t runs its forward on exactly these."""
        if not self.replays or t in self.st.before:
            return
        old = self.st.before.pop(t - 2, None)
        if old is None or len(old) != len(self.params):
            old = [torch.empty_like(p) for p in self.params]
        with torch.no_grad():
            for dst, p in zip(old, self.params, strict=True):
                dst.copy_(p)
        self.st.before[t] = old

    def mirror_local(self, t: int) -> None:
        """Send this rank's local state (buffers, local=) of the boundary before step t
        to the right neighbour; keep the left neighbour's. Runs inside step t's
        collective phase, before the commit vote (or barrier), so whoever commits t
        knows that the mirror holds every rank's boundary t-1."""
        if not self.reg.has_local or self.world_size < 2 or self.virtual.degraded():  # shrunk: no mirror
            return
        if self.st.local_blob is None or self.st.local_blob.step != t - 1:
            raise RecoveryError(f"rank {self.rank} has no local-state snapshot of boundary {t - 1}")
        got = ring_exchange(self.runtime.pg, self.st.local_blob.blob, self.rank, self.world_size,
                            self.timeouts.collective, self.runtime.moved_on)  # fmt: skip
        self.st.mirrored[t - 1] = got
        self.st.mirrored.pop(t - 3, None)

    def _replay_step(self) -> Iterator[int]:
        """A spare that took rank r at resume step s runs the user's body of step s-1
        once more, without collectives, from exactly what r started it with: the
        parameters before that step's update, the replicated extras and
        hyperparameters of boundary s-2, and r's own local state of boundary s-2
        (from its mirror). Forward, buffers, data position and the user's code
        after ctx.step() (a scheduler stepped once, a metric updated with this
        step's loss) then reach boundary s-1 exactly as r's own would have; at
        ctx.step() the parameters after the update are put back."""
        rep = self.st.replay
        assert rep is not None
        t = rep.step
        self.strategy.regather()  # the group's first collective after a switch, on every member
        self.reg.load_boundary(rep.boundary)
        if rep.local is not None:
            self.reg.load_local(rep.local)
        self.keep_boundary(t - 1)  # a later recovery may need them from us
        with torch.no_grad():
            rep.after = [p.detach().clone() for p in self.params]
            for p, b in zip(self.params, rep.before, strict=True):
                p.copy_(b)
        self.current = t
        seed_step(step_seed(self.seed, t, self.rank))
        if self.reducer is not None:
            self.reducer.disarm()  # the gradients of a replay are thrown away
        yield t
        if self.committed != t:
            raise ConfigError(f"step {t} ended without ctx.step(): it is the commit point")
        self.keep_boundary(t)

    def _finish_replay(self, t: int) -> None:
        rep, self.st.replay = self.st.replay, None
        assert rep is not None and rep.after is not None
        if self.scaler is not None:  # changed only by commits: take the source's, as of step t
            self.scaler.load_state_dict(rep.extra[self.reg.extra_name_of(self.scaler)])
        with torch.no_grad():
            for p, a in zip(self.params, rep.after, strict=True):
                p.copy_(a)
                p.grad = None
