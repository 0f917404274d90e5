"""The user's view: `@livemig.elastic()` and `Context`.

A worker runs the user's function once. A spare runs it in standby: the
model and optimizer are built (warm process, allocator, kernels), then
`ctx.steps()` blocks until the coordinator claims the spare for a rank; the
function is then unwound and entered again with that rank, so everything
user code derives from `ctx.rank` before the loop is exactly what a worker
started with that rank would have; the streamed state is loaded and the loop
starts at the agreed step.

This file is the facade: `Context` holds the user's verbs only; the `Engine` behind
it is the step loop (runtime/loop.py) over the member's fields, and assembles its
collaborators from livemig/runtime/ and livemig/sandbox/.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from livemig import logs
from livemig.comm.group import CollectiveAborted, exit_past_abandoned_builds, release_all
from livemig.comm.reducer import GradReducer
from livemig.comm.torch_group import StepAborted
from livemig.config import (
    ENV_GRAD_VIEWS,
    ENV_INCARNATION,
    ENV_RANK,
    ENV_ROLE,
    ENV_SPARE_ID,
    ENV_WORLD_SIZE,
    Role,
    Timeouts,
    exit_with_parent,
    fast_exit,
)  # fmt: skip
from livemig.errors import ConfigError, FencedError, LivemigError
from livemig.rdzv.membership import new_incarnation
from livemig.runtime.batches import Batches
from livemig.runtime.boundary import Boundary
from livemig.runtime.bugs import exit_on_bug
from livemig.runtime.checkpoint import Checkpointer
from livemig.runtime.control import Activate, Halted, Released, Requeue, Stop
from livemig.runtime.entry import Entry
from livemig.runtime.epochs import EpochLoop
from livemig.runtime.follow import Feed, Follower
from livemig.runtime.fsdp2_mesh import Fsdp2
from livemig.runtime.lazy_init import LazyInit
from livemig.runtime.loop import StepLoop
from livemig.runtime.migration import Migration
from livemig.runtime.preloop import PreLoop
from livemig.runtime.prints import StepPrints
from livemig.runtime.pull import StatePull
from livemig.runtime.registry import Registry
from livemig.runtime.self_faults import SelfFaults
from livemig.runtime.standby import Standby
from livemig.runtime.step_state import StepState
from livemig.runtime.stop import JobStop
from livemig.runtime.strategies import Replicated, Strategy, check_sharding, new_reducer, pick
from livemig.runtime.virtual import VirtualRanks
from livemig.sandbox.warmup import Sandbox

log = logging.getLogger("livemig.api")


class Engine(StepLoop):  # over the member's fields (runtime/member_fields.py)
    """The member behind a `Context`: the step loop over the state set here, and its
    collaborators. MemberRuntime calls back its state pull (runtime/pull.py, Callbacks)."""

    def __init__(self, seed: int = 0, timeouts: Timeouts | None = None) -> None:
        self.seed = seed
        raw = os.environ.get(ENV_ROLE, Role.LOCAL)
        if raw not in (Role.WORKER, Role.SPARE, Role.LOCAL):
            raise ConfigError(f"{ENV_ROLE}={raw!r}: expected worker or spare")
        self.role = Role(raw)
        self.incarnation = os.environ.get(ENV_INCARNATION) or new_incarnation(self.role)
        self.timeouts = timeouts or Timeouts.from_env()
        self.runtime: Any = None
        self.rank = int(os.environ.get(ENV_RANK, "0"))
        self.world_size = int(os.environ.get(ENV_WORLD_SIZE, "1"))
        self.spare_id = os.environ.get(ENV_SPARE_ID, "")
        self.joining: Activate | None = None
        self.follower = Follower(self)  # a follow spare keeps the group's state (runtime/follow.py)
        self.lazy = LazyInit()  # a claimed spare builds its model without the random fills (runtime/lazy_init.py)
        self.standby = Standby(self)  # a spare's standby; every member's final record (runtime/standby.py)
        self.sandbox = Sandbox(self)  # a spare's warm-up against a group of one (sandbox/warmup.py)
        self._batches = Batches(self)  # ctx.batches (runtime/batches.py)
        self.fsdp2 = Fsdp2(self)  # FSDP2's mesh and what survives the function's re-entries (runtime/fsdp2_mesh.py)
        self._no_grad_said = False  # ctx.step() with no backward: said once (loop.check_backward)
        self.reset_user_state()
        self.faults = SelfFaults(self)  # test faults and the fault plan's gate (runtime/self_faults.py)
        self.ckpt = Checkpointer(self)  # background checkpoints, --resume-from (runtime/checkpoint.py)
        self.boundary = Boundary(self)  # the boundary rule and a spare's replay (runtime/boundary.py)
        self.prints = StepPrints(self)  # per-step fingerprints for --verify (runtime/prints.py)
        self.halt = JobStop(self)  # a whole-job stop: a checkpoint at an agreed boundary (runtime/stop.py)
        self.boundary.listeners += [self.ckpt.at_boundary, self.faults.at_boundary, self.prints.at_boundary,
                                    self.halt.at_boundary]  # fmt: skip
        self.pull = StatePull(self)  # a recovery's state movement: MemberRuntime's callbacks (runtime/pull.py)
        self.preloop = PreLoop(self)  # collectives before the loop: live, recorded, answered (runtime/preloop.py)
        if self.role != Role.LOCAL:
            from livemig.runtime.member import MemberRuntime

            exit_with_parent()
            self.runtime = MemberRuntime(self.incarnation, self.timeouts)

    def reset_user_state(self) -> None:
        old = getattr(self, "reducer", None)  # unset on the first call, from __init__
        if old is not None:
            old.remove()
        self.reg = Registry()
        self.reducer: GradReducer | None = None
        self.strategy: Strategy = Replicated(self)  # the kind of parallelism; ctx.register() picks it
        self.committed = -1  # last step whose optimizer update is applied here
        self.current: int | None = None  # step being run (between yield and ctx.step())
        self.steps_called = False  # ctx.steps() (or ctx.epochs()) runs once per entry of the function
        self.epoch_loop = EpochLoop(self)  # ctx.epochs() and the ctx.steps() inside it (runtime/epochs.py)
        self.entry = Entry(self)  # where this entry's loop starts (runtime/entry.py)
        self.st = StepState()  # the step protocol's records between steps (runtime/step_state.py)
        self._last_metrics: dict[str, float] = {}
        self._total = 0
        self.loaded_step: int | None = None
        self.stream_info: dict[str, Any] = {}
        self.migration = Migration(self)  # planned migration, both sides (runtime/migration.py)
        self.feed = Feed(self)  # this worker's updates, fed to follow spares (runtime/follow.py)
        self.step_t0 = 0.0
        self.scaler: Any = None  # the GradScaler of the ctx.step() in progress
        self.grad_views = os.environ.get(ENV_GRAD_VIEWS, "1") != "0"  # strategies/replicated.py, views_safe
        self.virtual = VirtualRanks(self)  # the lost ranks this one runs in a shrunk job (runtime/virtual.py)

    @property
    def generation(self) -> int:
        return self.runtime.gen if self.runtime else 0

    # -- registration --------------------------------------------------------------------
    def register(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 sharding: str | None = None, mirror: bool | None = None,
                 local: dict[str, Any] | None = None, sync_start: bool = True, strategy: type[Strategy] | None = None,
                 **extra: Any) -> None:  # fmt: skip
        """Name what moves on migration: anything with state_dict/load_state_dict.

        Extras (`**extra`, e.g. scheduler=sched) are replicated: a spare takes them from any
        peer. `local={name: obj}` is rank-local state (a data position, a per-rank RNG),
        mirrored on the next rank every step so a spare taking rank r gets r's own; buffers
        are rank-local too. sharding="zero1" shards the optimizer state (comm/zero1.py; the
        optimizer is a template); a model sharded by fully_shard is recognised by its
        DTensor parameters (runtime/strategies/fsdp2.py). Shards are mirrored on the next rank unless
        mirror=False, without which a lost shard cannot be recovered. At formation every
        rank takes rank 0's model and optimizer state, as DDP does, unless sync_start=False
        (step 0 then checks the replicas are equal). `strategy=` a livemig.Strategy subclass
        runs a kind of parallelism of the user's own (runtime/strategies/base.py). What cannot
        stream is refused here.
        """
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(model, DistributedDataParallel):
            raise ConfigError("ctx.register(model=DistributedDataParallel(...)): register the module itself "
                              "(model = Net(), or ddp.module): livemig averages the gradients, and DDP's own "
                              "averaging would run on top of it, outside any recovery")  # fmt: skip
        check_sharding(sharding, optimizer, fsdp=self.fsdp2.sharded(model))
        fsdp = self.fsdp2.check_register(model, mirror)  # FSDP2: DTensor parameters
        self.reg.set(model, optimizer, extra, local)
        self.reg.sync_start = bool(sync_start)
        self.fsdp2.registered(fsdp)
        if self.reducer is not None:
            self.reducer.remove()
        self.reducer = None
        if self.params and self.role != Role.LOCAL and not fsdp:  # FSDP2 reduces the gradients itself
            self.reducer = new_reducer(self.params, self.world_size, sharding, self.runtime)
        self.strategy = pick(self, fsdp=fsdp, sharding=sharding, mirror=mirror, custom=strategy)

    def init_device_mesh(self, device_type: str, mesh_shape: tuple[int, ...],
                         mesh_dim_names: tuple[str, ...] | None = None) -> Any:  # fmt: skip
        """torch's `init_device_mesh` over groups livemig owns, for `fully_shard(m, mesh=mesh)`:
        (shard,) is FSDP, (replicate, shard) HSDP; the same object across recoveries (runtime/fsdp2_mesh.py)."""
        return self.fsdp2.init_device_mesh(device_type, mesh_shape, mesh_dim_names)

    def batches(self, loader: Any) -> Iterator[Any]:
        """Iterate `loader` from the step the loop runs at: call next() on the result
        once per step inside `for step in ctx.steps(...)`."""
        return self._batches.batches(loader)

    def checkpoints(self, dir: str, every: int | None = None, interval: float | None = None, keep: int = 2) -> None:
        """Write background checkpoints of the registered state, as `livemig run --checkpoint-dir
        DIR --checkpoint-every N` (or `--checkpoint-interval SECONDS`) would; call it before
        ctx.steps(). The command line wins where it gives a directory; outside `livemig run`
        nothing is written (runtime/checkpoint.py)."""
        if self.current is not None:
            raise ConfigError("ctx.checkpoints(...) is called before ctx.steps(), not inside the loop")
        self.ckpt.set_from_script(dir, every, interval, keep, local=self.role == Role.LOCAL)

    def log(self, **metrics: float) -> None:
        """Metrics shown in `livemig run`'s progress lines (e.g. loss=...); ignored
        during a spare's warm-up."""
        if self.warming_up:
            return
        self._last_metrics = {k: float(v) for k, v in metrics.items()}


def _verb(name: str) -> Callable:
    """A Context method that is the engine's, with its signature and docstring."""
    impl = getattr(Engine, name)

    def verb(self: Context, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._engine, name)(*args, **kwargs)

    return functools.update_wrapper(verb, impl)


def _read(name: str, doc: str) -> property:
    return property(lambda self: getattr(self._engine, name), doc=doc)


class Context:
    """What the training function sees: the README's verbs and where this process stands.

    rank, world_size: this process's place in the job (a spare in standby sees rank 0
    until it is claimed). generation: the membership generation whose process group it
    trains in. role: worker, spare or local (outside `livemig run`). Nothing else is on
    it: the runtime's callbacks live on the Engine behind it (tests/unit/test_layers.py
    holds the set).
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    register = _verb("register")
    init_device_mesh = _verb("init_device_mesh")
    steps = _verb("steps")
    epochs = _verb("epochs")
    batches = _verb("batches")
    no_sync = _verb("no_sync")
    sync_gradients = _verb("sync_gradients")
    clip_grad_norm_ = _verb("clip_grad_norm_")
    step = _verb("step")
    busy = _verb("busy")
    checkpoints = _verb("checkpoints")
    log = _verb("log")
    rank = property(lambda self: self._engine.virtual.rank, doc="This process's rank; a shrunk job's carried one's.")
    world_size = _read("world_size", "The number of ranks training.")
    generation = _read("generation", "The membership generation whose process group this process trains in.")
    role = _read("role", "worker, spare or local (a plain process outside `livemig run`).")
    warming_up = _read("warming_up", Engine.warming_up.__doc__ or "")


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
            clean = False  # the job ended and this member saw it: nothing of its group is pending
            try:
                ctx = Engine(seed, timeouts)
                user = Context(ctx)
                while True:  # a spare: standby -> claimed -> (an aborted migration: standby again)
                    try:
                        if ctx.fsdp2.pending:  # FSDP2: a collective failed inside the function
                            raise ctx.fsdp2.recover()
                        ctx.preloop.enter()  # torch.distributed's default group, from the function's first line
                        ctx.lazy.enter(ctx.role, ctx.joining)
                        try:
                            result = fn(user, *args, **kwargs)
                        finally:
                            ctx.lazy.finish()
                        # the final record, then the job's end; a cold restart ordered meanwhile
                        # (a rank lost in the last steps) enters the function again from here too
                        ctx.standby.finish()
                        break
                    except Activate as act:
                        ctx.standby.activate(act)  # entered again: claimed, a cold restart, an FSDP2 redo
                    except Requeue:
                        ctx.standby.requeue()
                    except Halted:  # the job stops at a checkpoint (runtime/stop.py): no user code after the loop
                        result = None
                        ctx.standby.finish()
                        break
                    except (StepAborted, Exception) as exc:
                        if not ctx.fsdp2.take(exc):  # FSDP2: a failed collective unwound the function
                            raise
                clean = True
                fast_exit(ctx.role)
                exit_past_abandoned_builds()
                return result
            except (Released, Stop):
                exit_past_abandoned_builds()
                return None
            except FencedError as exc:
                print(f"livemig: {exc}", file=sys.stderr, flush=True)
                os._exit(exc.exit_code)  # touch nothing: this process was replaced
            except LivemigError as exc:
                if isinstance(exc, ConfigError):
                    exit_on_bug(ctx, exc)  # a misuse every rank repeats: not a node failure
                print(f"livemig: error: {exc}", file=sys.stderr, flush=True)
                os._exit(exc.exit_code)
            except Exception as exc:
                if isinstance(exc, CollectiveAborted):
                    raise
                exit_on_bug(ctx, exc)  # the training function raised: end the job, keep the spares
            finally:
                if ctx is not None and ctx.runtime is not None:
                    ctx.runtime.comm.retire(ctx.runtime.pg, idle=clean)
                    ctx.runtime.pg = None
                    ctx.runtime.close()
                    ctx.runtime.comm.release()
                release_all()

        return wrapper

    return deco
