"""The protocol of a kind of parallelism: what the member's step loop, its recovery and its
planned migration ask of the way the registered state is laid out and kept in step.

`ctx.register()` picks one strategy (runtime/strategies/__init__.py, `pick`); every place that
used to ask "is this ZeRO-1? FSDP2?" asks the strategy instead. Each hook's docstring is the
contract; `Replicated` (plain data parallel) is the reference implementation, `Zero1`
(sharded optimizer state) and `Fsdp2` (parameters sharded by `fully_shard`) override what
their layout changes. A new kind of parallelism is one more subclass: registered through
`ctx.register(..., strategy=MyStrategy)`, it needs no edit elsewhere.

The device (CPU or GPU) is not a kind of parallelism: every strategy runs on either.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from livemig.config import Role
from livemig.errors import RecoveryError
from livemig.runtime.registry import Layout

if TYPE_CHECKING:
    from livemig.comm.reducer import GradReducer
    from livemig.config import Timeouts
    from livemig.rdzv.membership import Membership
    from livemig.runtime.checkpoint import Checkpointer
    from livemig.runtime.fsdp2_mesh import Fsdp2 as MeshOwner
    from livemig.runtime.member import MemberRuntime
    from livemig.runtime.registry import Registry
    from livemig.runtime.self_faults import SelfFaults
    from livemig.runtime.step_state import StepState
    from livemig.runtime.stop import JobStop
    from livemig.runtime.virtual import VirtualRanks
    from livemig.sandbox.warmup import Sandbox


class MigrationSide(Protocol):
    """What a step asks of the planned migration in progress (runtime/migration.py, Migration):
    the switch vote, and the leaving worker's serving of each step's update."""

    def vote(self) -> float: ...

    def serving(self, t: int) -> bool: ...

    def serve_avg(self, t: int, flats: list[torch.Tensor], final: bool) -> None: ...

    def serve_applied(self, t: int, applied: list, final: bool) -> None: ...

    def serve_shard(self, t: int, own: torch.Tensor, left: torch.Tensor | None, final: bool) -> None: ...

    def serve_item(self, t: int, item: dict[str, Any], final: bool) -> None: ...

    def after_commit(self, t: int, switch: bool) -> None: ...


class BoundarySide(Protocol):
    """What a step asks of the boundary rule (runtime/boundary.py, Boundary)."""

    @property
    def replays(self) -> bool: ...

    def keep(self, step: int) -> None: ...

    def replaying(self, t: int) -> bool: ...

    def keep_before(self, t: int) -> None: ...

    def mirror_local(self, t: int) -> None: ...


class PullSide(Protocol):
    """What a recovery's catch-up asks of the state pull (runtime/pull.py, StatePull)."""

    def committed_step(self) -> int | None: ...

    def pull_any(self, m: Membership, item: str, alloc: Callable | None = None,
                 ranks: list[int] | None = None) -> Any: ...  # fmt: skip

    def pull_buddy_local(self, m: Membership, step: int, who: str, back: int) -> tuple[str, Any]: ...

    def into_model(self) -> Callable[[int, dict], torch.Tensor | None]: ...


class FeedSide(Protocol):
    """A worker's feed of its updates to follow spares (runtime/follow.py Feed)."""

    def serving(self, t: int) -> bool: ...

    def serve(self, t: int, item: dict[str, Any]) -> None: ...


class FollowerSide(Protocol):
    """A follow spare's held state (runtime/follow.py Follower)."""

    before: list[torch.Tensor] | None

    def holds(self, step: int) -> bool: ...

    def release(self, needed: int | None = None) -> None: ...

    def move_into(self, reg: Registry) -> None: ...


class LazySide(Protocol):
    """A claimed spare's deferred random fills (runtime/lazy_init.py LazyInit)."""

    def finish(self, overwritten: list[torch.Tensor] | None = None) -> None: ...


class StrategyHost(Protocol):
    """What a strategy uses of its member (api.Engine): its fields (runtime/member_fields.py),
    its collaborators (the boundary rule, the state pull, ...), and the step loop's commit and
    recovery (runtime/loop.py StepLoop). Checked by mypy where ctx.register() hands the Engine over."""

    role: Role
    rank: int
    world_size: int
    incarnation: str
    timeouts: Timeouts
    runtime: MemberRuntime  # None outside `livemig run`: tested before use
    reg: Registry
    reducer: GradReducer | None
    scaler: Any
    grad_views: bool
    committed: int
    current: int | None
    loaded_step: int | None
    stream_info: dict[str, Any]
    step_t0: float
    st: StepState
    virtual: VirtualRanks
    joining: Any  # the claim the function was entered again for (runtime/control.py Activate)

    @property
    def migration(self) -> MigrationSide: ...

    @property
    def feed(self) -> FeedSide: ...

    @property
    def follower(self) -> FollowerSide: ...

    @property
    def lazy(self) -> LazySide: ...

    faults: SelfFaults
    halt: JobStop  # a whole-job stop: its vote rides on the step's collective (runtime/stop.py)
    sandbox: Sandbox
    ckpt: Checkpointer
    fsdp2: MeshOwner

    @property
    def warming_up(self) -> bool: ...

    @property
    def boundary(self) -> BoundarySide: ...

    @property
    def pull(self) -> PullSide: ...

    def sync_gradients(self) -> None: ...

    def check_backward(self, step: int) -> None: ...

    def commit(self, t: int, avg: list | None, replay: bool = False, mirror_only: bool = False,
               applied: list | None = None, **info: float) -> None: ...  # fmt: skip

    def join_recovery(self, t: int | None, exc: BaseException) -> None: ...


class Strategy:
    """One kind of parallelism over one member (`host`: the Engine behind `Context`).

    The hooks fall into four groups, in the order a run meets them: registration and start-up,
    the step (average, clip, update, commit), the boundary, and recovery (report, serve, catch
    up, change the layout). What a planned migration hands over is its `handover`, what a
    rank keeps apart (checkpoint sections, final-record digests) its `parts`. A hook a kind
    does not need keeps the base's behaviour, which is plain data parallel's."""

    #: The name in the job's signature (what a spare must match) and in logs.
    name: ClassVar[str] = "abstract"
    #: Can a rank of this kind move to a spare by planned migration (runtime/migration.py)?
    migrates: ClassVar[bool] = True
    #: Can a follow spare keep this kind's state from one member's feed (runtime/follow.py)?
    follows: ClassVar[bool] = False
    # pull_state writes every tensor of the model's state_dict whole, or fails: the random fills
    # of the claimed entry's build need not run for them (runtime/lazy_init.py)
    pull_loads_model: ClassVar[bool] = False
    #: Does a staying member move to the migration's group at the boundary after the switch
    #: step (True: collectives user code runs after ctx.step() still meet the leaving rank) or
    #: right after the switch step's commit (False)?
    switch_at_boundary: ClassVar[bool] = False
    #: How the registered state is laid out over the ranks (runtime/registry.py).
    layout: ClassVar[Layout] = Layout()

    def __init__(self, host: StrategyHost) -> None:
        self.h = host
        #: The state a planned migration hands from the leaving worker to the spare (a kind
        #: whose layout changes it sets its own in its __init__).
        self.handover: Handover = Handover(host)
        #: The pieces of a rank's state kept apart from the replicated ones (its shards): its
        #: checkpoint sections and its final record's digests.
        self.parts: Parts = Parts()

    # -- registration and start-up ---------------------------------------------------------
    def signature(self) -> list[list]:
        """Entries added to the registered state's signature: a spare must lay out the state
        the same way as the job (coordinator/sharding.py reads them)."""
        return []

    def sync_start(self) -> None:
        """DDP's start-up broadcast: every replica takes rank 0's state as the job forms."""
        raise NotImplementedError

    def formed(self) -> None:
        """The job formed and the start-up sync ran: set up what is mirrored from now on."""

    # -- the step ----------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Before the user's body of a step: arm what overlaps with its backward (the gradient
        buckets' average, launched as each bucket fills)."""
        h = self.h
        if h.reducer is not None:
            h.reducer.arm(h.runtime.pg)

    def sync_gradients(self, t: int) -> None:
        """ctx.sync_gradients() at step t: the averaged gradient written to `.grad`."""
        raise NotImplementedError

    def step(self, t: int) -> None:
        """ctx.step() at step t for a member of a group of several: average (unless done),
        update, commit. Fault-aware: a failed collective joins the recovery and either
        finishes step t or redoes it, so user code around ctx.step() runs once."""
        raise NotImplementedError

    def clip_grad_norm_(self, max_norm: float, norm_type: float) -> torch.Tensor:
        """ctx.clip_grad_norm_(): clip the averaged gradient by its global norm."""
        self.h.sync_gradients()
        return torch.nn.utils.clip_grad_norm_(self.h.reg.params, max_norm, norm_type)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally (DDP's no_sync)."""
        red = self.h.reducer
        if red is None:
            yield
            return
        red.sync = True
        try:
            yield
        finally:
            red.sync = False

    def apply_update(self, avg: list | None, mirror_only: bool, applied: list | None) -> None:
        """The optimizer update of a commit, from the step's averaged gradient `avg`."""
        self.h.reg.step_optimizer(self.h.scaler, applied)

    def regather(self) -> None:
        """Before a step and after a switch outside one: make the parameters whole again if
        this kind keeps them in pieces between collectives (ZeRO-1)."""

    def warmup_step(self, t: int, pg: Any) -> None:
        """ctx.step() of a spare's sandboxed shadow iteration, against a world-of-one group `pg`."""
        from livemig.comm.group import allreduce_mean

        h = self.h
        if h.reducer is not None:
            flats = h.reducer.flatten()
            allreduce_mean(pg, flats, 1, h.timeouts.collective)
            h.reducer.write_back(flats)
        h.reg.step_optimizer(h.scaler)
        h.committed = t

    # -- the boundary ------------------------------------------------------------------------
    def at_boundary(self, step: int) -> None:
        """All user code of `step` ran: keep what a spare resuming after it needs."""
        raise NotImplementedError

    # -- recovery ------------------------------------------------------------------------------
    def redo_from_stash(self) -> None:
        """The function was entered again to redo a step whose collective failed inside user
        code (FSDP2): the state of the last boundary moves into the re-registered objects."""
        raise RecoveryError(f"a {self.name} job never redoes a step by entering the function again")

    def avg_step(self) -> int | None:
        """The step whose completed average (or reduced gradient shards) is held here: the
        coordinator's agreement reads it to tell whether a peer can finish a step."""
        avg = self.h.st.avg
        return avg.step if avg else None

    def catch_up(self, m: Membership) -> dict[str, Any] | None:
        """Reach generation m's agreed boundary (m.resume_step - 1 committed here): a spare
        pulls the state (`pull_state`), a survivor that missed the last commit finishes it
        (`finish_missed`). Returns what streamed (a spare's) or None."""
        h = self.h
        assert m.resume_step is not None  # the caller (runtime/pull.py catch_up) returned before otherwise
        target = m.resume_step - 1  # last step that must be committed here
        if h.pull.committed_step() == target:
            # what this spare streamed when it was claimed into m (a spare claimed in an earlier
            # generation is a survivor here: its old figures would count twice in the report)
            joined_now = h.role == Role.SPARE and (h.joining is None or h.joining.generation == m.generation)
            return h.stream_info if joined_now else None
        if h.pull.committed_step() is None or (h.role == Role.SPARE and h.current is None):
            if not (self.follows and h.follower.holds(target)):  # a follower's take-over finishes after its swap
                # the build's deferred fills run before the pull writes, but for what it writes whole
                model = h.reg.model if self.pull_loads_model else None
                h.lazy.finish(overwritten=list(model.state_dict().values()) if model is not None else None)
            return self.pull_state(m)
        if h.committed == target - 1 and h.current == target and self.finish_missed(m, target):
            return None
        raise RecoveryError(
            f"rank {h.rank} committed step {h.committed} and cannot reach the agreed resume step {m.resume_step}"
        )

    def pull_state(self, m: Membership) -> dict[str, Any]:
        """A spare's pull of the state at m's boundary (and what its first step needs); returns
        what streamed (the report's stream phase)."""
        raise NotImplementedError

    def finish_missed(self, m: Membership, t: int) -> bool:
        """A peer committed step t, this member did not: finish it from what is held here or
        fetched (True), or say it cannot (False: the catch-up fails with its line)."""
        raise NotImplementedError

    def serve(self, m: Membership) -> None:
        """Publish what generation m's new members may pull from this survivor."""
        raise NotImplementedError

    def stage_layout(self, m: Membership) -> None:
        """Pull the pieces generation m's layout gives this member that it does not hold (kept
        aside until m commits): nothing unless this kind shards state over the ranks."""

    def switch_layout(self, m: Membership) -> None:
        """Generation m committed: hold its layout's pieces from now on."""


class Handover:
    """A planned migration's state, from the leaving worker to the spare catching up
    (runtime/migration.py): plain data parallel's, the whole registered state and each
    step's update replayed; a kind that shards the state hands over its shards instead."""

    def __init__(self, host: StrategyHost) -> None:
        self.h = host

    def snapshot(self) -> dict[str, Any]:
        """The leaving worker's snapshot at a boundary: what the catching-up spare loads."""
        return self.h.reg.state_obj()

    def snapshot_alloc(self) -> Any:
        """Where a migrating spare receives the snapshot's tensors (the model's: in place)."""
        return self.h.pull.into_model()

    def load_snapshot(self, state: dict[str, Any]) -> None:
        """A migrating spare loads the leaving worker's snapshot."""
        self.h.reg.load_state(state)

    def replay_update(self, t: int, item: dict[str, Any]) -> None:
        """A migrating spare applies the leaving worker's update of step t: the update as it
        was applied (clipped, unscaled or skipped), or the average the optimizer stepped with."""
        h = self.h
        if "stepped" in item:
            h.reg.apply_step(item)
            h.committed, h.st.avg = t, None
            return
        h.reg.ensure_grads()
        if h.reducer is not None:
            h.reducer.write_back(item["flat"])
        h.commit(t, None, replay=True)

    def take_over(self, tail: dict[str, Any]) -> None:
        """At the switch, after the leaving worker's local state and boundary are loaded."""

    def after_migrate_in(self, step: int) -> None:
        """The spare switched in at boundary `step`: the leaving worker's boundary records
        (handed over at the switch) become this member's."""
        self.h.boundary.keep(step)


class Parts:
    """The pieces of a rank's state a kind keeps apart from the replicated ones (ZeRO-1's
    optimizer shard, FSDP2's parameter shards), where they leave the step protocol: the
    rank's checkpoint part (runtime/checkpoint.py) and its final record (runtime/standby.py).
    Plain data parallel has none."""

    #: The sections checkpoint_part adds, read back from a rank's own part.
    sections: ClassVar[tuple[str, ...]] = ()

    def checkpoint_part(self, rank: int) -> dict[str, Any]:
        """The sections this kind adds to rank `rank`'s checkpoint part (its shards)."""
        return {}

    def load_checkpoint_part(self, mine: dict[str, Any], section_of: Callable[[int, str], Any]) -> None:
        """This rank's sections of a checkpoint of the same world size (`section_of(r, name)`
        reads another rank's, for what this rank mirrors)."""

    def layout_record(self) -> dict[str, Any]:
        """How this kind lays its shards out beyond the world size (FSDP2: the mesh), kept in
        a checkpoint's manifest: a run laid out otherwise re-cuts the shards at the load."""
        return {}

    def portable_signature(self, sig: list) -> list:
        """The registered state's signature without what a re-cut changes (FSDP2: the mesh's
        shape): a checkpoint resumes under another layout only if these agree."""
        return sig

    def check_resume_world(self, path: str, world: int, manifest: dict[str, Any]) -> None:
        """A checkpoint written by `world` ranks laid out as its manifest says is resumed at
        another world size or layout: refuse it with one line if this kind cannot map it."""

    def load_resharded(self, world: int, section_of: Callable[[int, str], Any]) -> None:
        """This rank's sections cut from a checkpoint of `world` ranks (another world size)."""

    def final_record(self) -> dict[str, Any]:
        """What the final record adds for the run report's checks (shard and mirror digests)."""
        return {}

    def final_record_of(self, rank: int) -> dict[str, Any]:
        """The same for a rank this member carries in a shrunk job (its carrier holds its pieces)."""
        return {}
