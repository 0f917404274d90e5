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

from livemig.comm.group import CollectiveAborted, allreduce_sum, retire, ring_exchange
from livemig.config import Role
from livemig.data import seed_step, step_seed
from livemig.errors import ConfigError, RecoveryError
from livemig.rdzv.membership import GenState
from livemig.runtime.start_sync import check_replicas, sync_start
from livemig.runtime.step_state import Averaged, LocalBlob, Synced

log = logging.getLogger("livemig.runtime.loop")
COMMITS_KEPT = 200  # commit times in the final record, besides those around generation changes


class StepLoop:
    """Mixed into api.Engine; relies on the attributes Engine.__init__ sets."""

    def steps(self, total: int) -> Iterator[int]:
        """Yield step indices, from the agreed resume step after a recovery."""
        if self.model is None and self.optimizer is None:
            raise ConfigError("call ctx.register(model=..., optimizer=...) before ctx.steps()")
        self._total = total
        start = 0
        if self._joining is not None and self._joining.restart:  # the cold path: loaded in place (pull.py)
            m = self.runtime.follow(self._joining.generation, self)
            start = total if m.state == GenState.DONE else self.committed + 1
        elif self._joining is not None and self._joining.redo:  # FSDP2: redo from the boundary held here
            self._fsdp.load_stash()
            start = self.committed + 1
        elif self.role == Role.WORKER:
            self._faults.gate.check_total(total)  # a fault plan's step the job never reaches: refused now
            self.runtime.register(self.rank, host_store=self.rank == 0)
            self._standby.register_signature()
            self.runtime.follow(1, self)
            resumed = self._ckpt.resume()  # --resume-from: this rank's part of the chosen checkpoint
            if resumed is None:
                self._sync_start()  # never after a load: the replicas hold the job's state already
            else:
                self.committed, start = resumed, resumed + 1
                self._ckpt.at_boundary(resumed)  # resharded: written at once (runtime/checkpoint.py)
            if self.reg.fsdp is not None:
                self._fsdp.setup_mirror()  # each rank's shard mirrored on its right neighbour
            self._gathered_gen = self.runtime.gen  # every rank holds rank 0's initial model (or the loaded one)
        elif self.role == Role.SPARE:
            if self._joining is None:
                yield from self._sandbox.shadow(total)  # sandboxed warm-up of the real loop body
                self._standby.wait_for_claim()  # raises _Activate
            if self._joining.migration:
                self._migration.migrate_in()
                start = self.committed + 1
                if self.reg.fsdp is None:  # FSDP2: kept by the take-over (its boundary exchange ran without us)
                    self._at_boundary(self.committed)  # the leaving worker's, handed over at the switch
            else:
                m = self.runtime.follow(self._joining.generation, self)
                start = self.committed + 1
                if m.state == GenState.DONE:
                    start = total
                elif self._st.replay is not None:
                    yield from self._replay_step()
        if self.role != Role.SPARE and self._joining is None:
            self._at_boundary(start - 1)  # the state every rank starts from
        for step in range(start, total):
            self._current = step
            self._zero_regather()
            self._migration.tick()
            self._virtual.new_step()
            if self._virtual.degraded():  # a shrunk job: this rank's body, then those of the ranks it carries
                if self._reducer is not None:
                    self._reducer.disarm()  # the average waits for the step's last body
                yield from self._virtual.run_step(step, own_ran=False)
            else:
                seed_step(step_seed(self.seed, step, self.rank))
                if self._reducer is not None:
                    self._reducer.arm(self.runtime.pg)
                self._step_t0 = time.monotonic()
                self._faults.at(step, "compute")
                yield step
                yield from self._virtual.after_own(step)  # a shrink inside the step (runtime/virtual.py)
            if self.committed != step:
                raise ConfigError(f"step {step} ended without ctx.step(): it is the commit point")
            self._at_boundary(step)
            self._ckpt.at_boundary(step)  # staged here, written in the background
            self._faults.at_boundary(step)
        self._current = None
        self._migration.at_boundary()  # the switch was voted at the last step
        self.after_switch()

    def _sync_start(self) -> None:
        """DDP's start-up broadcast (runtime/start_sync.py), in the group the job formed with."""
        if not self.reg.sync_start or self.world_size < 2 or self.runtime.pg is None:
            return
        if self.reg.fsdp is not None:
            self._fsdp.sync_start()
            return
        try:
            sync_start(self.reg, self.runtime.pg, self.rank, self.timeouts.collective, self.runtime.moved_on)
            if self._zero is not None:  # the shards were cut from this rank's own initial parameters
                self._zero.reset_values()
        except CollectiveAborted as exc:
            # A member lost during the sync: the survivors go on with what they hold (a
            # broadcast that completed only in part is caught by the step-0 replica check).
            self._join_recovery(None, exc)

    def sync_gradients(self) -> None:
        """Average the gradients over the live group and write them to `.grad`, without
        stepping: the user may then read or change `.grad` (clip it, check it) before
        ctx.step(). Idempotent within a step. Fault-aware like ctx.step(): if the
        average fails, this member joins the recovery and returns with the averaged
        gradient (a peer's, fetched, or one redone in the new group), so the user's
        code between sync_gradients() and ctx.step() runs exactly once per step."""
        t = self._in_step("ctx.sync_gradients()")
        if self.reg.fsdp is not None:  # FSDP2 reduced the gradients in backward already
            return
        self._st.uses_sync = True
        self._st.user_synced = t  # .grad may change before ctx.step(): a migrating spare gets what was applied
        self._check_backward(t)
        self._sync_gradients(views=False)  # user code may change .grad: it gets a copy

    def _views_safe(self) -> bool:
        """May ctx.step() hand the optimizer views of the averaged buckets as `.grad`?
        Only if nothing can write `.grad` between the average and zero_grad(): the user
        did not take the average first (sync_gradients: clipping), no GradScaler (it
        unscales in place), and a torch.optim optimizer (they read gradients, never write
        them, and zero_grad() drops them): the buckets stay the step's average, kept for
        a peer's recovery and served to a migrating spare. LIVEMIG_GRAD_VIEWS=0 (read once,
        at start) copies the average into `.grad` always."""
        opt = self.reg.optimizer
        return (self._grad_views and self._scaler is None and opt is not None
                and type(opt).__module__.startswith("torch.optim."))  # fmt: skip

    def _sync_gradients(self, views: bool) -> None:
        t = self._in_step("ctx.sync_gradients()")
        if self._st.synced is not None and self._st.synced.step == t:
            return
        if self._sandbox.active or self.role == Role.LOCAL or self.runtime is None:
            self._st.synced = Synced(t, None)  # a world of one: the gradient is its own average
            return
        if self._st.replay is not None and self._st.replay.step == t:
            avg = self._st.replay.avg
            if avg is None:
                raise RecoveryError(f"the spare replaying step {t} holds no averaged gradient of it")
            self._ensure_grads()
            self._reducer.write_back(avg)
            self._st.synced = Synced(t, avg)
            return
        if self._virtual.defers(t):  # a shrunk job: a later body of this step averages (runtime/virtual.py)
            self._virtual.stash(t)
            return
        if self._zero is not None:
            raise ConfigError(
                "ctx.sync_gradients() / ctx.clip_grad_norm_() with sharding='zero1' are not supported yet: "
                "each rank holds only its slice of the averaged gradient; use ctx.step() alone"
            )
        self._ensure_grads()
        red = self._reducer
        assert red is not None
        first = not self._virtual.degraded()  # shrunk: no overlap, the stashed bodies join the average
        compute_s = time.monotonic() - self._step_t0  # forward + backward: the straggler hook's input
        while True:
            self.runtime.check_fenced()
            self.runtime.enter_collective(t)  # the coordinator's hang detection reads how long we wait
            ctl = torch.tensor([self._migration.vote()])  # planned migration: all 1.0 = switch after this step
            try:
                self._keep_before(t)
                self._mirror_local(t)  # before the vote: nobody commits t unless our mirror holds it
                self._faults.at(t, "allreduce")
                if first:  # the overlapped reduction launched during backward
                    flats = red.finish(self.world_size, self.timeouts.collective, self.runtime.moved_on, ctl)
                else:
                    self._virtual.add_stashed()
                    div = self._virtual.divisor()
                    flats = red.flatten(div)  # pre-divided, as the overlapped path's buckets
                    allreduce_sum(self.runtime.pg, [*flats, ctl], self.timeouts.collective, self.runtime.moved_on)
                    ctl.div_(div)
                self._faults.at_commit_point(t, "average")
            except CollectiveAborted as exc:
                first = False
                self._join_recovery(t, exc)
                if self._st.fetched is not None and self._st.fetched.step == t:  # a peer completed it: we have it
                    self._st.synced = Synced(t, self._st.fetched.flats, False, compute_s)
                    self._st.fetched = None
                    self._virtual.new_step()  # the average holds every body's gradient already
                    return
                if self._virtual.defers(t):  # shrunk meanwhile: the ranks this one carries run their bodies first
                    self._virtual.deferred = t
                    self._virtual.stash(t)
                    return
                continue
            # No copy needed for the kept average: the reducer double-buffers, so these
            # buffers are reused only after the next step's commit replaced self._st.avg.
            red.write_back(flats, views=views)
            self._st.synced = Synced(t, flats, float(ctl[0]) == 1.0, compute_s)
            self.runtime.leave_collective()
            return

    def step(self, scaler: Any = None) -> None:
        """Average gradients over the live group (unless ctx.sync_gradients() did), then
        optimizer.step() (or `scaler.step(optimizer)` and `scaler.update()` with a
        torch.amp.GradScaler registered as an extra) and zero_grad().

        The commit point. If the collective fails, the member joins the
        recovery: either a peer completed this step's average (we fetch it
        and commit, so user code around ctx.step() still runs exactly once)
        or nobody did (we redo the collective in the new group).
        """
        t = self._in_step("ctx.step()")
        if scaler is not None and self.role != Role.LOCAL:
            self.reg.extra_name_of(scaler)  # refused at once if unregistered: a spare could not follow it
        self._scaler = scaler
        self._check_backward(t)
        try:
            if self._sandbox.active:
                self._sandbox.step(t)
                return
            if self.role == Role.LOCAL or self.world_size == 1 and self.runtime is None:
                self._commit(t, None)
                return
            if self._st.replay is not None and self._st.replay.step == t:
                self._finish_replay(t)
                return
            if self.reg.fsdp is not None:
                self._fsdp.step(t)
                self._faults.at(t, "after_step")
                return
            if self._zero is not None:
                if scaler is not None:
                    raise ConfigError("ctx.step(scaler=...) with sharding='zero1' is not supported yet")
                if self._virtual.defers(t):  # a shrunk job: a later body of this step commits it
                    self._virtual.stash(t)
                    return
                self._step_zero1(t)
                if self._virtual.deferred == t:  # shrunk during the reduction: the carried bodies come first
                    return
                self._faults.at(t, "after_step")
                return
            if self._virtual.defers(t):  # a shrunk job: a later body of this step commits it
                self._virtual.stash(t)
                return
            views = self._views_safe()
            self._sync_gradients(views=views)  # a no-op if the user synced already
            if self._virtual.deferred == t:  # shrunk during the average: the carried bodies come first
                return
            synced = self._st.synced
            assert synced is not None
            flats, switch, compute_s = synced.flats, synced.switch, synced.compute_s
            # A leaving worker serves each step's update to the spare catching up. The average
            # itself only when it is what the optimizer stepped with (nothing could change .grad),
            # before our optimizer step so the spare applies it meanwhile; otherwise (clipping,
            # a GradScaler's unscale and skip, any code between sync_gradients() and step())
            # the gradients the optimizer really stepped with, captured at its step.
            raw = views and self._st.user_synced != t
            applied = [] if self._migration.serving(t) and not raw else None
            if applied is None:
                self._migration.serve_avg(t, flats, switch)
            self._commit(t, flats, compute_s=compute_s, applied=applied)
            if applied is not None:
                self._migration.serve_applied(t, applied, switch)
            self._migration.after_commit(t, switch)
            self._faults.at(t, "after_step")
        finally:
            self._scaler = None

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Average the gradients (ctx.sync_gradients()), clip them by their global norm
        and return that norm, as `accelerator.clip_grad_norm_`. Every rank clips the
        same averaged gradient, so every rank computes the same norm."""
        if self.reg.fsdp is not None:  # DTensor gradients: torch's clip all-reduces the norm over the mesh
            self._in_step("ctx.clip_grad_norm_()")
            return self._fsdp.clip_grad_norm_(max_norm, norm_type)
        self.sync_gradients()
        return torch.nn.utils.clip_grad_norm_(self._params, max_norm, norm_type)

    def _in_step(self, what: str) -> int:
        t = self._current
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

    def _join_recovery(self, t: int | None, exc: BaseException) -> None:
        self.runtime.leave_collective()
        if not self.runtime.moved_on() and "moved on" not in str(exc):  # a failure, not a recovery elsewhere
            self.runtime.collective_failed(t, str(exc))
        if self._reducer is not None:
            self._reducer.abandon()  # no bucket may launch on the abandoned group, nor be reused
        log.warning("collective failed; joining recovery",
                    extra={"step": t, "generation": self.runtime.gen, "why": str(exc)})  # fmt: skip
        retire(self.runtime.pg)
        self.runtime.pg = None
        self.runtime.follow(self.runtime.gen + 1, self)

    def _check_backward(self, step: int) -> None:
        """No gradient on any parameter at the user's own step means no backward ran: the
        step trains nothing, which is said once. Called by ctx.sync_gradients() and
        ctx.step(), the two verbs a step ends with (a replayed step holds the average)."""
        if self._no_grad_said or (self._st.replay is not None and self._st.replay.step == step):
            return
        if self._virtual.stashed == step:  # this body's gradient waits for the step's last body
            return
        if not self._params or any(p.grad is not None for p in self._params):
            return
        self._no_grad_said = True
        log.warning(f"ctx.step() at step {step} found no gradient on any parameter: was loss.backward() "
                    "called? this step updates nothing", extra={"step": step, "rank": self.rank})  # fmt: skip

    def _ensure_grads(self) -> None:
        """A parameter backward did not reach still takes part in the reduction, as zeros."""
        for p in self._params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally (as DDP's no_sync; FSDP2's
        set_requires_gradient_sync(False))."""
        if self.reg.fsdp is not None:
            self._fsdp.no_sync(True)
            try:
                yield
            finally:
                self._fsdp.no_sync(False)
            return
        if self._reducer is None:
            yield
            return
        self._reducer.sync = True
        try:
            yield
        finally:
            self._reducer.sync = False

    def _commit(self, t: int, avg: list | None, replay: bool = False, mirror_only: bool = False,
                applied: list | None = None, **info: float) -> None:  # fmt: skip
        if self._zero is not None:
            assert avg is not None
            # mirror_only: the own shard(s) were updated already (comm/zero1.py: overlap with the gather)
            self._zero.update(avg[0], avg[1], part="mirrored" if mirror_only else "all")
            for p in self._params:
                p.grad = None
        else:
            self.reg.step_optimizer(self._scaler, applied)
        self.committed = t
        self._st.avg = Averaged(t, avg) if avg is not None else None
        if replay:  # a migrating spare replaying the group's steps: not a commit of the job's
            return
        self._st.commits.append([t, time.time()])
        self._trim_commits()
        if self.runtime is not None:
            self.runtime.progress(t, generation=self.runtime.gen, **self._last_metrics, **info)

    def _trim_commits(self) -> None:
        """Keep the final record bounded (etcd refuses a request over 1.5 MiB, near 100k
        steps of commit times): the last COMMITS_KEPT commits and those within a few steps
        of each generation change, which is all the report reads."""
        gen = self.runtime.gen if self.runtime is not None else 0
        if gen != self._st.commit_gen:
            self._st.commit_gen = gen
            self._st.gen_steps.append(self._st.commits[-1][0])
        if len(self._st.commits) <= 2 * COMMITS_KEPT:
            return
        st = self._st
        last = st.commits[-1][0]
        st.commits = [c for c in st.commits
                      if c[0] > last - COMMITS_KEPT or any(abs(c[0] - g) <= 5 for g in st.gen_steps)]  # fmt: skip

    # -- the boundary rule (docs/architecture.md) -------------------------------------------
    @property
    def _replays(self) -> bool:
        """Does a spare replay one step (is there state user code changes outside the
        optimizer step: extras, buffers, local=)? Without it the spare starts at the
        resume step directly."""
        return bool(self.reg.extra or self.reg.has_local)

    def _at_boundary(self, step: int) -> None:
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
                    self._join_recovery(None, exc)
        if self.reg.fsdp is not None:
            self._fsdp.at_boundary(step)
            return
        if not self._replays:
            return
        self._st.boundaries[step] = self.reg.pack_boundary()
        self._st.boundaries.pop(step - 2, None)
        if self.reg.has_local:
            self._st.local_blob = LocalBlob(step, self.reg.pack_local())

    def _keep_before(self, t: int) -> None:
        """The parameters before step t's update, the newest two: a spare replaying
        step t runs its forward on exactly these."""
        if not self._replays or t in self._st.before:
            return
        old = self._st.before.pop(t - 2, None)
        if old is None or len(old) != len(self._params):
            old = [torch.empty_like(p) for p in self._params]
        with torch.no_grad():
            for dst, p in zip(old, self._params, strict=True):
                dst.copy_(p)
        self._st.before[t] = old

    def _mirror_local(self, t: int) -> None:
        """Send this rank's local state (buffers, local=) of the boundary before step t
        to the right neighbour; keep the left neighbour's. Runs inside step t's
        collective phase, before the commit vote (or barrier), so whoever commits t
        knows that the mirror holds every rank's boundary t-1."""
        if not self.reg.has_local or self.world_size < 2 or self._virtual.degraded():  # shrunk: no mirror
            return
        if self._st.local_blob is None or self._st.local_blob.step != t - 1:
            raise RecoveryError(f"rank {self.rank} has no local-state snapshot of boundary {t - 1}")
        got = ring_exchange(self.runtime.pg, self._st.local_blob.blob, self.rank, self.world_size,
                            self.timeouts.collective, self.runtime.moved_on)  # fmt: skip
        self._st.mirrored[t - 1] = got
        self._st.mirrored.pop(t - 3, None)

    def _replay_step(self) -> Iterator[int]:
        """A spare that took rank r at resume step s runs the user's body of step s-1
        once more, without collectives, from exactly what r started it with: the
        parameters before that step's update, the replicated extras and
        hyperparameters of boundary s-2, and r's own local state of boundary s-2
        (from its mirror). Forward, buffers, data position and the user's code
        after ctx.step() (a scheduler stepped once, a metric updated with this
        step's loss) then reach boundary s-1 exactly as r's own would have; at
        ctx.step() the parameters after the update are put back."""
        rep = self._st.replay
        assert rep is not None
        t = rep.step
        self._zero_regather()  # the group's first collective after a switch, on every member
        self.reg.load_boundary(rep.boundary)
        if rep.local is not None:
            self.reg.load_local(rep.local)
        self._at_boundary(t - 1)  # a later recovery may need them from us
        with torch.no_grad():
            rep.after = [p.detach().clone() for p in self._params]
            for p, b in zip(self._params, rep.before, strict=True):
                p.copy_(b)
        self._current = t
        seed_step(step_seed(self.seed, t, self.rank))
        if self._reducer is not None:
            self._reducer.disarm()  # the gradients of a replay are thrown away
        yield t
        if self.committed != t:
            raise ConfigError(f"step {t} ended without ctx.step(): it is the commit point")
        self._at_boundary(t)

    def _finish_replay(self, t: int) -> None:
        rep, self._st.replay = self._st.replay, None
        assert rep is not None and rep.after is not None
        if self._scaler is not None:  # changed only by commits: take the source's, as of step t
            self._scaler.load_state_dict(rep.extra[self.reg.extra_name_of(self._scaler)])
        with torch.no_grad():
            for p, a in zip(self._params, rep.after, strict=True):
                p.copy_(a)
                p.grad = None
