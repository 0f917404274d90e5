"""The user's view: `@livemig.elastic()` and `Context`.

A worker runs the user's function once. A spare runs it in standby: the
model and optimizer are built (warm process, allocator, kernels), then
`ctx.steps()` blocks until the coordinator claims the spare for a rank; the
function is then unwound and entered again with that rank, so everything
user code derives from `ctx.rank` before the loop is exactly what a worker
started with that rank would have; the streamed state is loaded and the loop
starts at the agreed step.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from livemig import logs
from livemig.comm.group import (
    CollectiveAborted,
    allreduce_mean,
    release_all,
    retire,
)
from livemig.comm.reducer import GradReducer
from livemig.config import (
    ENV_INCARNATION,
    ENV_RANK,
    ENV_ROLE,
    ENV_SELF_FAULT,
    ENV_SPARE_ID,
    ENV_WORLD_SIZE,
    ENV_ZERO1_MIRROR,
    SHARDING_ENTRY,
    Timeouts,
    exit_with_parent,
)  # fmt: skip
from livemig.data import step_seed
from livemig.errors import ConfigError, FencedError, LivemigError, RecoveryError, TransferError
from livemig.faults import parse_self_fault
from livemig.rdzv.client import decode
from livemig.rdzv.membership import GenState, Membership, new_incarnation
from livemig.rdzv.watch import wait_for
from livemig.state import digest, flatten, signature, unflatten
from livemig.transfer.client import pull

log = logging.getLogger("livemig.api")


class _Activate(BaseException):
    """Unwinds the user's function in a spare once it is claimed (never caught by user code
    that catches Exception)."""

    def __init__(self, generation: int, rank: int, migration: bool = False) -> None:
        self.generation, self.rank, self.migration = generation, rank, migration


class _Stop(BaseException):
    """A standby spare was asked to exit (`livemig-spare stop`)."""


class _Released(BaseException):
    """This worker's rank moved to a spare (planned migration): exit cleanly."""


class _Requeue(BaseException):
    """The migration this spare was claimed for was aborted: back to standby."""


AVG_KEEP = 8  # averaged gradients a leaving worker keeps for its catching-up spare


class Context:
    """What the training function sees. Attributes are valid after set-up:

    rank, world_size: this process's place in the job (a spare in standby
    sees rank 0 until it is claimed). generation: the membership generation
    whose process group it trains in.
    """

    def __init__(self, seed: int = 0, timeouts: Timeouts | None = None) -> None:
        self.seed = seed
        self.role = os.environ.get(ENV_ROLE, "local")
        if self.role not in ("worker", "spare", "local"):
            raise ConfigError(f"{ENV_ROLE}={self.role!r}: expected worker or spare")
        self.incarnation = os.environ.get(ENV_INCARNATION) or new_incarnation(self.role)
        self.timeouts = timeouts or Timeouts.from_env()
        self.runtime: Any = None
        self.rank = int(os.environ.get(ENV_RANK, "0"))
        self.world_size = int(os.environ.get(ENV_WORLD_SIZE, "1"))
        self.spare_id = os.environ.get(ENV_SPARE_ID, "")
        self._joining: _Activate | None = None
        self._started = time.monotonic()
        self._spare_keeper: Any = None
        self._standby_info: dict[str, float] = {}  # how the spare waited: bench warmup reads it
        self._sandbox_pg: Any = None
        self._warm_s: float | None = None
        self._reset_user_state()
        self._self_fault = parse_self_fault(os.environ[ENV_SELF_FAULT]) if os.environ.get(
            ENV_SELF_FAULT) else None  # fmt: skip
        if self.role != "local":
            from livemig.member import MemberRuntime

            exit_with_parent()
            self.runtime = MemberRuntime(self.incarnation, self.timeouts)

    def _reset_user_state(self) -> None:
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.extra: dict[str, Any] = {}
        self._params: list[torch.nn.Parameter] = []
        if getattr(self, "_reducer", None) is not None:
            self._reducer.remove()
        self._reducer: GradReducer | None = None
        self._zero: Any = None  # comm.zero1.Zero1 when registered with sharding="zero1"
        self._gathered_gen: int | None = None  # zero1: generation whose group last gathered the parameters
        self.committed = -1  # last step whose optimizer update is applied here
        self._current: int | None = None  # step being run (between yield and ctx.step())
        self._avg: tuple[int, list] | None = None  # averaged gradient of the last commit
        self._commits: list[list[float]] = []
        self._last_metrics: dict[str, float] = {}
        self._total = 0
        self._loaded_step: int | None = None
        self._stream_info: dict[str, Any] = {}
        self._mig_gen: int | None = None  # leaving worker: the migration generation it serves
        self._mig_step: int | None = None  # leaving worker: the step its snapshot was taken before
        self._leaving: int | None = None  # leaving worker: the switch was voted; leave at the next boundary
        self._step_t0 = 0.0

    @property
    def generation(self) -> int:
        return self.runtime.gen if self.runtime else 0

    # -- registration --------------------------------------------------------------------
    def register(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 sharding: str | None = None, mirror: bool | None = None, **extra: Any) -> None:  # fmt: skip
        """Name what moves on migration: anything with state_dict/load_state_dict.

        sharding="zero1" shards the optimizer state over the data-parallel
        ranks (comm/zero1.py); `optimizer` is then a template (class and
        param groups) that ctx.step() applies to this rank's shard. The shard
        is mirrored on the next rank unless mirror=False (or
        LIVEMIG_ZERO1_MIRROR=0), without which a lost shard cannot be recovered.
        """
        for name, obj in extra.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise ConfigError(f"ctx.register({name}=...): object has no state_dict/load_state_dict")
        if sharding not in (None, "zero1"):
            raise ConfigError(f"ctx.register(sharding={sharding!r}): expected None or 'zero1'")
        if sharding and optimizer is None:
            raise ConfigError("ctx.register(sharding='zero1') needs the optimizer whose state it shards")
        self.model, self.optimizer, self.extra = model, optimizer, extra
        self._params = [p for p in model.parameters() if p.requires_grad] if model is not None else []
        if self._reducer is not None:
            self._reducer.remove()
        self._reducer, self._zero = None, None
        if not self._params or self.role == "local":
            return  # a single local process: plain optimizer steps, sharded or not
        zero = sharding == "zero1"
        scatter = False
        if zero:
            from livemig.comm.zero1 import reduce_mode

            scatter = reduce_mode(self.runtime.backend if self.runtime else "gloo") == "reduce_scatter"
        self._reducer = GradReducer(self._params, shard_world=self.world_size if zero else 0, scatter=scatter)
        if zero:
            from livemig.comm.zero1 import Zero1

            if mirror is None:
                mirror = os.environ.get(ENV_ZERO1_MIRROR, "1") not in ("0", "false", "no")
            self._zero = Zero1(self._reducer, self._params, optimizer, self.rank, self.world_size, mirror)

    def signature(self) -> list:
        sig = signature(self.model.state_dict()) if self.model is not None else []
        if self._zero is not None:  # a spare must shard the same way as the job
            sig.append([SHARDING_ENTRY, "zero1", [int(self._zero.mirror is not None)]])
        return sig

    def state_obj(self) -> dict[str, Any]:
        """What every replica holds alike (with zero1 the optimizer lives in the shards)."""
        opt = self.optimizer.state_dict() if self.optimizer is not None and self._zero is None else {}
        return {
            "model": self.model.state_dict() if self.model is not None else {},
            "optimizer": opt,
            "extra": {k: v.state_dict() for k, v in self.extra.items()},
        }

    def state_digest(self) -> str:
        tensors: list[torch.Tensor] = []
        s = self.state_obj()
        flatten({"model": s["model"], "optimizer": s["optimizer"]}, tensors)
        return digest(tensors)

    def log(self, **metrics: float) -> None:
        """Metrics shown in `livemig run`'s progress lines (e.g. loss=...)."""
        self._last_metrics = {k: float(v) for k, v in metrics.items()}

    # -- the loop ------------------------------------------------------------------------------
    def steps(self, total: int) -> Iterator[int]:
        """Yield step indices, from the agreed resume step after a recovery."""
        if self.model is None and self.optimizer is None:
            raise ConfigError("call ctx.register(model=..., optimizer=...) before ctx.steps()")
        self._total = total
        start = 0
        if self.role == "worker":
            self.runtime.register(self.rank)
            self._register_signature()
            self.runtime.follow(1, self)
            self._gathered_gen = self.runtime.gen  # every rank built the same initial model
        elif self.role == "spare":
            if self._joining is None:
                yield from self._shadow(total)  # sandboxed warm-up of the real loop body
                self._standby()  # raises _Activate
            if self._joining.migration:
                self._migrate_in()
                start = self.committed + 1
            else:
                m = self.runtime.follow(self._joining.generation, self)
                start = self.committed + 1
                if m.state == GenState.DONE:
                    start = total
        for step in range(start, total):
            self._current = step
            self._zero_regather()
            self._migration_tick()
            torch.manual_seed(step_seed(self.seed, step, self.rank))
            if self._reducer is not None:
                self._reducer.arm(self.runtime.pg)
            self._step_t0 = time.monotonic()
            yield step
            if self.committed != step:
                raise ConfigError(f"step {step} ended without ctx.step(): it is the commit point")
        self._current = None
        if self._leaving is not None:  # the switch was voted at the last step
            self._leave(self._leaving)
        self.after_switch()

    def step(self) -> None:
        """Average gradients over the live group, then optimizer.step() and zero_grad().

        The commit point. If the collective fails, the member joins the
        recovery: either a peer completed this step's average (we fetch it
        and commit, so user code around ctx.step() still runs exactly once)
        or nobody did (we redo the collective in the new group).
        """
        t = self._current
        if t is None:
            raise ConfigError("ctx.step() called outside `for step in ctx.steps(...)`")
        if self._sandbox_pg is not None:
            self._sandbox_step(t)
            return
        if self.role == "local" or self.world_size == 1 and self.runtime is None:
            self._commit(t, None)
            return
        if self._zero is not None:
            self._step_zero1(t)
            return
        self._ensure_grads()
        red = self._reducer
        assert red is not None
        first = True
        compute_s = time.monotonic() - self._step_t0  # forward + backward: the straggler hook's input
        while True:
            self.runtime.check_fenced()
            ctl = torch.tensor([self._vote()])  # planned migration: all 1.0 = switch after this step
            try:
                self._maybe_self_fault(t, "allreduce")
                if first:  # the overlapped reduction launched during backward
                    flats = red.finish(self.world_size, self.timeouts.collective, self.runtime.moved_on, ctl)
                else:
                    flats = red.flatten()
                    allreduce_mean(self.runtime.pg, [*flats, ctl], self.world_size, self.timeouts.collective,
                                   should_abort=self.runtime.moved_on)  # fmt: skip
                self._maybe_self_fault(t, "before_commit")
                if self._drop_avg(t):
                    raise CollectiveAborted("test fault: average dropped")
            except CollectiveAborted as exc:
                first = False
                self._join_recovery(t, exc)
                if self.committed == t:
                    return  # a peer's completed average was fetched and applied
                continue
            red.write_back(flats)
            # No copy needed for the kept average: the reducer double-buffers, so these
            # buffers are reused only after the next step's commit replaced self._avg.
            switch = float(ctl[0]) == 1.0
            self._serve_avg(t, flats, switch)  # before our optimizer step: the spare applies it meanwhile
            self._commit(t, flats, compute_s=compute_s)
            self._after_commit(t, switch)
            return

    def _join_recovery(self, t: int | None, exc: BaseException) -> None:
        if self._reducer is not None:
            self._reducer.disarm()  # no bucket may launch on the abandoned group
        log.warning("collective failed; joining recovery",
                    extra={"step": t, "generation": self.runtime.gen, "why": str(exc)})  # fmt: skip
        retire(self.runtime.pg)
        self.runtime.pg = None
        self.runtime.follow(self.runtime.gen + 1, self)

    # -- ZeRO-1 (comm/zero1.py) --------------------------------------------------------------
    def _step_zero1(self, t: int) -> None:
        """Reduction (reduce-scatter + exchange, or allreduce + slicing), barrier,
        own shard update, all-gather overlapped with the mirror's update.

        Recovery keeps one order on every member: after a group switch each
        member first all-gathers the parameters (_zero_regather), then goes on
        with the step it is at."""
        z, red, rt = self._zero, self._reducer, self.runtime
        assert red is not None
        timeout, first = self.timeouts.collective, True
        while self.committed < t:
            rt.check_fenced()
            self._zero_regather()
            if self.committed >= t:
                break
            try:
                self._maybe_self_fault(t, "allreduce")
                if first:  # reductions launched during backward
                    reduced = red.finish(self.world_size, timeout, rt.moved_on)
                else:
                    reduced = red.reduce(rt.pg, red.flatten(), self.world_size, timeout, rt.moved_on)
                own, mirror = z.slices(rt.pg, reduced, timeout, rt.moved_on)
                self._avg = (t, [own, mirror])  # held: enough to finish step t alone
                z.barrier(rt.pg, timeout, rt.moved_on)
                self._maybe_self_fault(t, "before_commit")
                if self._drop_avg(t):
                    raise CollectiveAborted("test fault: barrier result dropped")
            except CollectiveAborted as exc:
                first = False
                self._join_recovery(t, exc)
                continue
            # Update our shard, then gather the parameters while the mirror is updated.
            z.own.update(own)
            self._gathered_gen = None
            held = [own, mirror]
            try:
                z.gather(rt.pg, timeout, rt.moved_on,
                         meanwhile=lambda held=held: self._commit(t, held, mirror_only=True))  # fmt: skip
                self._gathered_gen = rt.gen
            except CollectiveAborted as exc:  # step t is committed; the new group repeats the gather
                self._join_recovery(t, exc)
        self._zero_regather()

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

    # -- spare warm-up (livemig/sandbox) -----------------------------------------------------
    def _shadow(self, total: int) -> Iterator[int]:
        """Run the user's loop body K times against a world-of-one group.

        Warms the allocator, autograd, kernels, the optimizer's state
        allocation, gloo and the data path. Nothing survives: on activation
        the user's function is entered again and builds everything anew."""
        from livemig.sandbox import shadow_steps, world_of_one

        k = min(shadow_steps(), total)
        if k == 0:
            return
        self._sandbox_pg = world_of_one(self.timeouts.collective)
        try:
            for step in range(k):
                self._current = step
                torch.manual_seed(step_seed(self.seed, step, self.rank))
                yield step
                if self.committed != step:
                    raise ConfigError(f"step {step} ended without ctx.step(): it is the commit point")
        finally:
            self._sandbox_pg = None
            self._current, self.committed, self._commits = None, -1, []
            self._avg = None

    def _ensure_grads(self) -> None:
        """A parameter backward did not reach still takes part in the reduction, as zeros."""
        for p in self._params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)

    def _sandbox_step(self, t: int) -> None:
        self._ensure_grads()
        if self._zero is not None:  # no peers: this rank's slices of the local gradient
            red = self._reducer
            flats = red.flatten()
            allreduce_mean(self._sandbox_pg, flats, 1, self.timeouts.collective)
            own = [f.chunk(self.world_size)[self._zero.own.shard].clone() for f in flats]
            mirror = [f.chunk(self.world_size)[self._zero.mirror.shard].clone()
                      for f in flats] if self._zero.mirror else None  # fmt: skip
            self._zero.update(own, mirror)
            for p in self._params:
                p.grad = None
            self.committed = t
            return
        if self._reducer is not None:
            flats = self._reducer.flatten()
            allreduce_mean(self._sandbox_pg, flats, 1, self.timeouts.collective)
            self._reducer.write_back(flats)
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad()
        self.committed = t

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally (as DDP's no_sync)."""
        if self._reducer is None:
            yield
            return
        self._reducer.sync = True
        try:
            yield
        finally:
            self._reducer.sync = False

    def _commit(self, t: int, avg: list | None, replay: bool = False, mirror_only: bool = False,
                **info: float) -> None:  # fmt: skip
        if self._zero is not None:
            assert avg is not None
            if mirror_only:  # the own shard was updated already (comm/zero1.py: overlap with the gather)
                if self._zero.mirror is not None:
                    self._zero.mirror.update(avg[1])
            else:
                self._zero.update(avg[0], avg[1])
            for p in self._params:
                p.grad = None
        elif self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad()
        self.committed = t
        self._avg = (t, avg) if avg is not None else None
        if replay:  # a migrating spare replaying the group's steps: not a commit of the job's
            return
        self._commits.append([t, time.time()])
        if self.runtime is not None:
            self.runtime.progress(t, generation=self.runtime.gen, **self._last_metrics, **info)

    # -- test faults ----------------------------------------------------------------------
    def _maybe_self_fault(self, t: int, at: str) -> None:
        f = self._self_fault
        if f and f[0] == "selfkill" and f[1] == t and f[2] == at and self.role == "worker":
            import signal
            import threading

            if at == "before_commit":
                os.kill(os.getpid(), signal.SIGKILL)
            # Die while our gradients are in flight: peers may or may not complete.
            threading.Timer(0.002, os.kill, (os.getpid(), signal.SIGKILL)).start()

    def _drop_avg(self, t: int) -> bool:
        f = self._self_fault
        if f and f[0] == "drop_avg" and f[1] == t and self.role == "worker":
            self._self_fault = None
            return True
        return False

    # -- called by MemberRuntime.follow ----------------------------------------------------
    def committed_step(self) -> int | None:
        if self.role == "spare" and self._loaded_step is None:
            return None  # holds no state yet
        return self.committed

    def avg_step(self) -> int | None:
        return self._avg[0] if self._avg else None

    def catch_up(self, m: Membership) -> dict[str, Any] | None:
        """Reach the agreed boundary (resume_step) of generation m."""
        if m.resume_step is None:
            return None
        target = m.resume_step - 1  # last step that must be committed here
        if self.committed_step() == target:
            return self._stream_info if self.role == "spare" else None
        if self.committed_step() is None or (self.role == "spare" and self._current is None):
            return self._pull_state(m)
        if self.committed == target - 1 and self._current == target:
            if self._zero is None:
                self._fetch_avg(m, target)
            elif self._avg is not None and self._avg[0] == target:
                self._commit(target, self._avg[1])  # a peer passed the barrier: finish the step alone
                log.info("finished a step a peer committed, from the slices held here", extra={"step": target})
            else:
                raise RecoveryError(f"rank {self.rank} does not hold the gradient slices of step {target}")
            return None
        raise RecoveryError(
            f"rank {self.rank} committed step {self.committed} and cannot reach the agreed resume step {m.resume_step}"
        )

    def serve(self, m: Membership) -> None:
        srv = self.runtime.server
        if srv is None or m.resume_step is None or self.committed_step() != m.resume_step - 1:
            return
        srv.publish(m.generation, "state", lambda: (self.committed + 1, self.state_obj()))
        key = self.runtime.keys.inject_corrupt(self.rank)
        if self.runtime.client.get(key) is not None:  # fault injection (`livemig inject corrupt`)
            self.runtime.client.delete(key)
            srv.hooks.corrupt_next = True
            log.warning("fault injection: the first chunk served will be corrupted", extra={"rank": self.rank})
        if self._zero is not None:
            for sh in (self._zero.own, self._zero.mirror):
                if sh is not None:
                    srv.publish(m.generation, f"zshard/{sh.shard}", lambda sh=sh: (self.committed + 1, sh.state()))
        elif self._avg is not None and self._avg[0] == self.committed:
            avg = self._avg
            srv.publish(m.generation, "avg", lambda: (avg[0], {"flat": avg[1]}))

    def _sources(self, m: Membership, ranks: list[int] | None = None) -> list[str]:
        ranks = m.sources if ranks is None else ranks
        return [m.members[r].addr for r in ranks if r in m.members and m.members[r].addr and r != self.rank]

    def _pull_any(self, m: Membership, item: str, alloc: Callable | None = None,
                  ranks: list[int] | None = None) -> Any:  # fmt: skip
        """Pull `item`, striped over every source (or `ranks`), retrying until the recovery deadline."""
        secret = self.runtime.secret()
        deadline = time.monotonic() + self.timeouts.recovery.total_seconds()
        last = ""
        while time.monotonic() < deadline:
            if self.runtime.m.generation != m.generation:
                raise CollectiveAborted("generation moved on during the transfer")
            addrs = self._sources(m, ranks)
            if addrs:
                moved = self.runtime.moved_to_other(m.generation)
                try:
                    got = pull(addrs, self.runtime.job, secret, m.generation, item,
                               self.timeouts.collective.total_seconds(), alloc, abort=moved)  # fmt: skip
                    return ",".join(got.sources_used), got
                except TransferError as exc:
                    if moved():
                        raise CollectiveAborted("generation moved on during the transfer") from exc
                    last = str(exc)
            time.sleep(0.02)
        raise RecoveryError(f"could not pull {item} from the sources of generation {m.generation}: {last}")

    def _fetch_avg(self, m: Membership, t: int) -> None:
        _, got = self._pull_any(m, "avg")
        if got.step != t:
            raise RecoveryError(f"source holds the average of step {got.step}, need {t}")
        assert self._reducer is not None
        self._reducer.write_back(got.state["flat"])  # same canonical bucket layout as the source
        log.info("fetched the averaged gradient of a step a peer completed", extra={"step": t})
        self._commit(t, got.state["flat"])

    def _into_model(self) -> Callable[[int, dict], torch.Tensor | None]:
        """A transfer destination for a state object: its first tensors, the model's,
        are received in place into the spare's own parameters."""
        model_tensors = list(self.model.state_dict().values()) if self.model is not None else []

        def alloc(i: int, meta: dict) -> torch.Tensor | None:
            if i < len(model_tensors) and list(model_tensors[i].shape) == meta["shape"]:
                return model_tensors[i]
            return None

        return alloc

    def _pull_state(self, m: Membership) -> dict[str, Any]:
        t0 = time.monotonic()
        addr, got = self._pull_any(m, "state", self._into_model())
        self._load_state(got.state)
        nbytes = got.nbytes
        if self._zero is not None:  # our shard from its mirror, the shard we mirror from its owner
            n = self.world_size
            for sh in (self._zero.own, self._zero.mirror):
                if sh is None:
                    continue
                holders = [sh.shard, (sh.shard + 1) % n] if self._zero.mirror is not None else [sh.shard]
                where, part = self._pull_any(m, f"zshard/{sh.shard}", ranks=holders)
                if part.step != got.step:
                    raise RecoveryError(f"shard {sh.shard} from {where} is at step {part.step}, state at {got.step}")
                sh.load(part.state)
                nbytes += part.nbytes
                addr += f",{where}"
        self.committed = got.step - 1
        self._loaded_step = got.step
        self._stream_info = {"stream_s": time.monotonic() - t0, "bytes": nbytes, "source": addr}
        log.info("state loaded", extra={"resume_step": got.step, "bytes": got.nbytes,
                                        "seconds": round(got.seconds, 4)})  # fmt: skip
        return self._stream_info

    # -- planned migration (docs/architecture.md) ---------------------------------------------
    def _migration_plan(self) -> tuple[Membership, dict] | None:
        """The migration of our group in progress, if any."""
        rt = self.runtime
        if rt is None or rt.m.state != GenState.MIGRATING or rt.m.migration.get("from_gen") != rt.gen:
            return None
        m = rt.m
        return m, m.migration

    def _migration_tick(self) -> None:
        """At a step boundary: the leaving worker takes its snapshot once the spare
        asks for it; every staying member starts building the new group."""
        if self.role == "local" or self._zero is not None:
            return
        if self._leaving is not None:
            self._leave(self._leaving)  # the switch step is done, user code after ctx.step() too
        rt = self.runtime
        plan = self._migration_plan()
        if plan is None:
            if self._mig_gen is not None and rt.m.generation != self._mig_gen:
                rt.server.withdraw()  # the migration was resolved: stop serving its items
                self._mig_gen = self._mig_step = None
                if self._reducer is not None:
                    self._reducer.keep(2)
            return
        m, mig = plan
        if mig.get("leaving") == self.incarnation:
            if self._mig_gen != m.generation and "snapshot" in rt.server.wanted:
                rt.server.wanted.discard("snapshot")
                tensors: list[torch.Tensor] = []
                skel = flatten(self.state_obj(), tensors)
                snap = unflatten(skel, [x.clone() for x in tensors])  # training goes on: serve a copy
                step = self.committed + 1
                rt.server.publish(m.generation, "snapshot", lambda: (step, snap))
                self._mig_gen, self._mig_step = m.generation, step
                if self._reducer is not None:
                    self._reducer.keep(AVG_KEEP + 1)  # serve averages straight from the buckets
                log.info("migration: snapshot served", extra={"step": step, "generation": m.generation})
        elif m.rank_of(self.incarnation) is not None:
            rt.prebuild(m, m.rank_of(self.incarnation))

    def _vote(self) -> float:
        """1.0 when this member is ready to switch to the migration's group."""
        plan = self._migration_plan()
        if plan is None or plan[1].get("phase") != "switch":
            return 0.0
        m, mig = plan
        if mig.get("leaving") == self.incarnation:
            return 1.0 if self._mig_gen == m.generation else 0.0
        return 1.0 if self.runtime.prebuilt(m.generation) is not None else 0.0

    def _hparams(self) -> list[dict]:
        if self.optimizer is None:
            return []
        return [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]

    def _set_hparams(self, hparams: list[dict]) -> None:
        for grp, hp in zip(self.optimizer.param_groups if self.optimizer else [], hparams, strict=True):
            grp.update(hp)

    def _serve_avg(self, t: int, flats: list[torch.Tensor], final: bool) -> None:
        """Leaving worker: publish step t's averaged gradient and the step's hyperparameters."""
        if self._mig_gen is None or self._mig_step is None or t < self._mig_step:
            return
        rt, g = self.runtime, self._mig_gen
        item = {"flat": flats, "hparams": self._hparams(), "final": final}
        rt.server.publish(g, f"avg/{t}", lambda: (t, item))
        rt.server.withdraw(f"avg/{t - AVG_KEEP}")
        rt.server.wanted.discard(f"avg/{t}")

    def _after_commit(self, t: int, switch: bool) -> None:
        if not switch:
            return
        plan = self._migration_plan()
        if plan is None:
            return
        m, mig = plan
        if mig.get("leaving") == self.incarnation:
            self._leaving = m.generation  # leave at the next boundary
            return
        rt = self.runtime
        rank = m.rank_of(self.incarnation)
        rt.switch_to(m.generation)
        rt.put(rt.keys.ready(m.generation, rank), {"incarnation": self.incarnation, "switched": t,
                                                   "time": time.time()})  # fmt: skip

    def _leave(self, g: int) -> None:
        """The leaving worker after the switch step: hand over what user code changed
        outside the optimizer (buffers, registered extras, hyperparameters a scheduler
        set), serve until the spare switched, then exit."""
        rt, t = self.runtime, self.committed
        self._leaving = None
        tail = {"buffers": {k: v.clone() for k, v in self.model.named_buffers()} if self.model else {},
                "extra": {k: v.state_dict() for k, v in self.extra.items()}, "hparams": self._hparams()}  # fmt: skip
        rt.server.publish(g, f"tail/{t}", lambda: (t, tail))
        m = rt.wait_membership(lambda x: x.generation != g or x.state != GenState.MIGRATING,
                               "the spare to take over this rank")  # fmt: skip
        if m.generation == g and m.state == GenState.COMMITTED:
            log.info("released: rank handed over to a spare (planned migration)", extra={"generation": g})
            raise _Released()
        # The migration failed during its switch: recovery decides whether we stay.
        self._join_recovery(self.committed, RuntimeError("migration failed during the switch"))

    def _migrate_in(self) -> None:
        """A spare claimed for a planned migration: load the leaving worker's snapshot,
        replay the group's averaged gradients until the switch step, then switch."""
        rt, act = self.runtime, self._joining
        assert act is not None
        g, rank = act.generation, act.rank
        m = rt.wait_membership(lambda x: x.generation >= g, f"generation {g}")
        if m.generation != g or m.state != GenState.MIGRATING:
            raise _Requeue()
        addr, secret = m.migration["addr"], rt.secret()
        rt.prebuild(m, rank)  # phase 1 in the background, while we catch up
        deadline = time.monotonic() + self.timeouts.recovery.total_seconds()

        def fetch(item: str, alloc: Callable | None = None) -> Any:
            while True:
                moved = rt.moved_to_other(g)
                if moved():
                    raise _Requeue()
                try:
                    return pull(addr, rt.job, secret, g, item, self.timeouts.collective.total_seconds(), alloc,
                                abort=moved)  # fmt: skip
                except TransferError as exc:
                    if time.monotonic() > deadline:
                        raise RecoveryError(f"migration: could not pull {item} from {addr}: {exc}") from exc
                time.sleep(0.005)

        t0 = time.monotonic()
        got = fetch("snapshot", self._into_model())
        self._load_state(got.state)
        self.committed, self._loaded_step = got.step - 1, got.step
        self._stream_info = {"stream_s": time.monotonic() - t0, "bytes": got.nbytes, "source": addr}
        rec = {"incarnation": self.incarnation, "loaded": got.step, **self._stream_info}
        rt.put(rt.keys.catchup(g), {**rec, "applied": self.committed, "time": time.time()})
        red = self._reducer
        while True:
            t = self.committed + 1
            got = fetch(f"avg/{t}")
            self._set_hparams(got.state["hparams"])
            self._ensure_grads()
            if red is not None:
                red.write_back(got.state["flat"])
            self._commit(t, None, replay=True)
            if got.state["final"]:
                tail = fetch(f"tail/{t}").state
                bufs = dict(self.model.named_buffers()) if self.model is not None else {}
                for k, v in tail["buffers"].items():
                    bufs[k].copy_(v)
                for k, v in self.extra.items():
                    v.load_state_dict(tail["extra"][k])
                self._set_hparams(tail["hparams"])
                break
            rt.put(rt.keys.catchup(g), {**rec, "applied": t, "time": time.time()})
        while rt.prebuilt(g) is None:  # the group is built once every member joined it
            if rt.moved_to_other(g)():
                raise _Requeue()
            if time.monotonic() > deadline:
                raise RecoveryError(f"migration: the group of generation {g} was not built in time")
            time.sleep(0.005)
        rt.register(rank)
        rt.switch_to(g)
        rt.put(rt.keys.ready(g, rank), {"incarnation": self.incarnation, "switched": self.committed,
                                        "time": time.time(), **self._stream_info})  # fmt: skip
        log.info("migration: switched in", extra={"rank": rank, "generation": g, "step": self.committed})

    def _load_state(self, state: dict[str, Any]) -> None:
        if self.model is not None:
            self.model.load_state_dict(state["model"])
        if self.optimizer is not None and self._zero is None:
            self.optimizer.load_state_dict(state["optimizer"])
        for k, v in self.extra.items():
            v.load_state_dict(state["extra"][k])

    # -- spare standby ----------------------------------------------------------------------
    def _register_signature(self) -> None:
        rt = self.runtime
        rt.put(
            rt.keys.prefix + f"signatures/{self.rank}",
            {"incarnation": self.incarnation, "signature": self.signature()},
        )

    def _standby(self) -> None:
        import socket

        import psutil

        rt = self.runtime
        self._warm_s = time.monotonic() - self._started
        info = {
            "incarnation": self.incarnation, "host": socket.gethostname(), "pid": os.getpid(),
            "state": "warm", "signature": self.signature(), "warmup_s": self._warm_s,
            "peak_rss_mb": psutil.Process().memory_info().rss / 2**20,
        }  # fmt: skip
        keeper = self._spare_keeper = rt.rdzv.register(rt.keys.spare(self.spare_id), info, self.incarnation,
                                                       rt._on_lost)  # fmt: skip
        rt.start_server()
        log.info("spare warm", extra={"spare": self.spare_id, "warmup_s": round(self._warm_s, 3)})
        t_warm = time.monotonic()
        key = rt.keys.assignment(self.spare_id)
        while True:
            try:
                raw = wait_for(rt.client, key, lambda s: s.get(key), 60.0, "a claim",
                               abort=rt.fenced.is_set)  # fmt: skip
                break
            except TimeoutError:
                continue
            except InterruptedError:
                rt.check_fenced()
        a = decode(raw)
        self._standby_info = {
            "warmup_s": self._warm_s, "warm_rss_mb": info["peak_rss_mb"],
            "claim_rss_mb": psutil.Process().memory_info().rss / 2**20, "waited_s": time.monotonic() - t_warm,
            "process_start": psutil.Process().create_time(), "claimed_at": time.time(),
        }  # fmt: skip
        if a.get("stop"):
            keeper.stop(revoke=True)
            log.info("spare stopped on request", extra={"spare": self.spare_id})
            raise _Stop()
        if a.get("refused"):
            keeper.stop(revoke=True)
            raise ConfigError(f"spare {self.spare_id} refused by the job: {a['refused']}")
        raise _Activate(int(a["generation"]), int(a["rank"]), bool(a.get("migration")))

    def _requeue(self) -> None:
        """Back to standby after an aborted migration: drop the claim, warm up again."""
        rt = self.runtime
        log.info("migration aborted: back to standby", extra={"spare": self.spare_id})
        if self._spare_keeper is not None:
            self._spare_keeper.stop(revoke=True)
            self._spare_keeper = None
        rt.client.delete(rt.keys.assignment(self.spare_id))
        if rt.keeper is not None:
            rt.keeper.stop(revoke=True)
            rt.keeper = None
        retire(rt.pg)
        rt.pg, rt.rank, rt.gen, rt._pre = None, None, 0, None
        self._reset_user_state()
        self._joining = None
        self.rank = int(os.environ.get(ENV_RANK, "0"))
        self._started = time.monotonic()

    def write_final(self) -> None:
        rt = self.runtime
        rec = {"incarnation": self.incarnation, "steps": self.committed + 1, "digest": self.state_digest(),
               "commits": self._commits, "generation": rt.gen, "role": self.role,
               "joined_at_step": self._loaded_step}  # fmt: skip
        if self._standby_info:
            rec["standby"] = self._standby_info
        rec["peak_rss_mb"] = _peak_rss_mb()
        if self._zero is not None:  # the report checks each mirror against its owner's shard
            rec["shard_digest"] = digest(self._zero.own.tensors_for_digest())
            if self._zero.mirror is not None:
                rec["mirror_of"] = self._zero.mirror.shard
                rec["mirror_digest"] = digest(self._zero.mirror.tensors_for_digest())
        rt.put(rt.keys.final(self.rank), rec)

    def _finish(self) -> None:
        if self.runtime is None:
            return
        self.write_final()
        self.runtime.wait_result(self)


def _peak_rss_mb() -> float:
    """This process's peak resident memory (Linux reports ru_maxrss in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def elastic(seed: int = 0, timeouts: Timeouts | None = None) -> Callable:
    """Wrap a training function `fn(ctx, *args, **kwargs)`.

    Outside `livemig run` (no LIVEMIG_ROLE) the function runs as a single
    local process, so the same script works without livemig's launcher.
    """

    def deco(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            who = os.environ.get(ENV_RANK) or os.environ.get(ENV_SPARE_ID, "")
            logs.setup(role=f"{os.environ.get(ENV_ROLE, 'local')}:{who}")
            ctx = None
            try:
                ctx = Context(seed, timeouts)
                while True:  # a spare: standby -> claimed -> (an aborted migration: standby again)
                    try:
                        result = fn(ctx, *args, **kwargs)
                        break
                    except _Activate as act:
                        log.info("claimed", extra={"rank": act.rank, "generation": act.generation,
                                                   "migration": act.migration})  # fmt: skip
                        ctx._reset_user_state()
                        ctx.rank, ctx._joining = act.rank, act
                    except _Requeue:
                        ctx._requeue()
                ctx._finish()
                return result
            except _Released:
                return None
            except _Stop:
                return None
            except FencedError as exc:
                print(f"livemig: {exc}", file=sys.stderr, flush=True)
                os._exit(exc.exit_code)  # touch nothing: this process was replaced
            except LivemigError as exc:
                print(f"livemig: error: {exc}", file=sys.stderr, flush=True)
                os._exit(exc.exit_code)
            finally:
                if ctx is not None and ctx.runtime is not None:
                    retire(ctx.runtime.pg)
                    ctx.runtime.pg = None
                    ctx.runtime.close()
                release_all()

        return wrapper

    return deco
