"""FSDP2 and HSDP under livemig: the device mesh, the step's commit, and recovery by re-entry.

`ctx.init_device_mesh` builds torch's DeviceMesh over groups livemig owns (comm/torch_group.py):
their communicators are swapped at every generation change, so the mesh object and every
group FSDP2 holds stay the same. `fully_shard` then works as usual; `ctx.register` recognises
the DTensor parameters (this module's `Fsdp2` serves the engine for them).

A step under FSDP2 communicates inside the user's code (the forward's all-gathers, the
backward's reduce-scatters and the replicate all-reduce, the clip's norm), so a failure there
cannot be finished in place the way the plain path finishes its one average: the collective
raises `StepAborted` (a BaseException), the decorator catches it above the user's function,
the member joins the recovery (its parameters and optimizer shards are those of its last
boundary: nothing was stepped), and the function is entered again, as a claimed spare enters
it. Code before the loop and the failed step's code before `ctx.step()` run again; the state
of the boundary is put back into the rebuilt model and optimizer from memory (no checkpoint);
code after `ctx.step()` has run exactly once per committed step. A rank that had every
collective of the step complete (it voted to commit) and lost only the commit vote finishes the
step in the recovery instead, like the plain path. The lost rank's shard comes from a replica
peer holding the same shard (HSDP); its rank-local state from its mirror (exchanged at each
boundary, so there is no replay: docs/architecture.md, "FSDP2 and HSDP").
"""

from __future__ import annotations

import logging
import math
import os
from typing import TYPE_CHECKING, Any, Protocol

import torch

from livemig.comm import torch_group
from livemig.comm.group import CollectiveAborted
from livemig.config import ENV_FSDP2_MIRROR, ENV_SPARE_MESH, Role
from livemig.errors import ConfigError
from livemig.runtime.control import Activate
from livemig.runtime.fsdp2_mirror import ShardMirror
from livemig.state import is_dtensor

if TYPE_CHECKING:
    from livemig.config import Timeouts
    from livemig.runtime.member import MemberRuntime
    from livemig.runtime.registry import Registry
    from livemig.runtime.self_faults import SelfFaults
    from livemig.runtime.step_state import StepState

log = logging.getLogger("livemig.runtime.fsdp2_mesh")


def units(model: torch.nn.Module) -> list[str]:
    """The modules fully_shard wrapped, by name ("" is the root): a spare must wrap the same."""
    from torch.distributed.fsdp import FSDPModule

    return [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]


def shard_of(rank: int, shape: list[int]) -> int:
    """The shard index of `rank` in a mesh of `shape` (rank-major: the last dimension shards)."""
    return rank % shape[-1]


def shard_peers(rank: int, shape: list[int]) -> list[int]:
    """The other ranks that hold the same shard (its replicas along the other dimensions)."""
    world, s = math.prod(shape), shape[-1]
    return [r for r in range(world) if r != rank and r % s == rank % s]


# What a DeviceMesh holds of its process's rank (torch 2.10+): the rest is its value.
_REBOUND = ("_dim_group_names", "_pg_registry", "_rank", "_coordinate_on_dim", "_flatten_mapping")


def rebind_mesh(warm: Any, real: Any) -> bool:
    """Make `warm` (a mesh equal to `real` by value, built in a standby world as another
    rank) answer as `real` does: its groups, rank and coordinate. DTensor specs cached during
    a warm-up hold `warm`; after this they name the real groups. False where this torch's
    DeviceMesh lacks the fields: DTensor's sharding caches are cleared instead (correct, the
    warm-up's gain lost)."""
    if warm == real and all(hasattr(real, a) and hasattr(warm, a) for a in _REBOUND):
        for a in _REBOUND:
            setattr(warm, a, getattr(real, a))
        return True
    from torch.distributed.tensor import debug

    clear = getattr(debug, "_clear_sharding_prop_cache", None)
    if clear is not None:
        clear()
    return False


class MeshHost(Protocol):
    """What the FSDP2 mesh owner uses of its member (api.Engine's fields): who it is, where the
    step is, and joining a recovery when a collective inside the user's code fails."""

    role: Role
    rank: int
    world_size: int
    timeouts: Timeouts
    runtime: MemberRuntime  # None outside `livemig run`: tested before use
    joining: Activate | None
    reg: Registry
    committed: int
    current: int | None
    loaded_step: int | None
    st: StepState
    faults: SelfFaults

    @property
    def warming_up(self) -> bool: ...

    def join_recovery(self, t: int | None, exc: BaseException) -> None: ...


class Fsdp2:
    """The FSDP2 mesh owner: owned by api.Engine and kept across the function's re-entries (the
    mesh, the shards' mirror and the boundary a redo starts from must survive them). The step,
    recovery and migration of an FSDP2 job are its strategy's (runtime/strategies/fsdp2.py),
    over the state held here."""

    def __init__(self, host: MeshHost) -> None:
        self.h = host
        self.mesh: Any = None
        self.shape: list[int] = []  # the shape the script asked for (a standby mesh is all ones)
        self._key: tuple | None = None
        self.voted: int | None = None  # the step whose every collective completed here (its vote sent)
        self.stash: Any = None  # the registry of the function's previous entry, until its state is moved
        self.pending = ""  # a StepAborted caught above the function: the recovery to join
        self.want_mirror = False  # mirror the left neighbour's shard (fsdp2_mirror.py)
        self.mirror: ShardMirror | None = None  # kept across re-entries, as the shards are
        self.units: list[str] = []  # the modules fully_shard wrapped ("" is the root)
        self.warm: Any = None  # a standby's mesh of the job's shape, until the claim rebinds it

    # -- the mesh ---------------------------------------------------------------------------
    def init_device_mesh(self, device_type: str, mesh_shape: tuple[int, ...],
                         mesh_dim_names: tuple[str, ...] | None = None) -> Any:  # fmt: skip
        h = self.h
        try:
            shape = tuple(int(x) for x in mesh_shape)
        except (TypeError, ValueError):
            raise ConfigError(f"ctx.init_device_mesh: mesh_shape={mesh_shape!r} is not a tuple of ints") from None
        if not shape or any(x < 1 for x in shape) or len(shape) > 2:
            raise ConfigError(f"ctx.init_device_mesh: mesh_shape={shape}: expected 1 or 2 positive sizes "
                              "((shard,) for FSDP, (replicate, shard) for HSDP)")  # fmt: skip
        names = tuple(mesh_dim_names) if mesh_dim_names else None
        # A spare in standby warms up on the job's mesh shape, alone in it (`_may_warm_shaped`); a
        # local run, and a spare that cannot, train as a world of one (sandbox/warmup.py)
        standby = h.role == Role.SPARE and h.joining is None
        one = h.role == Role.LOCAL or standby
        if not one and math.prod(shape) != h.world_size:
            raise ConfigError(f"ctx.init_device_mesh({shape}): the mesh has {math.prod(shape)} ranks but the job "
                              f"has {h.world_size}: make the sizes multiply to --nproc")  # fmt: skip
        shaped = standby and self._may_warm_shaped(shape)
        key = (device_type, shape, names, "shaped" if shaped else one)
        if self.mesh is not None and self._key == key:
            return self.mesh  # entered again: the same mesh object, its groups swapped underneath
        from torch.distributed.device_mesh import init_device_mesh

        if shaped:
            torch_group.install_standby(0, h.world_size, h.timeouts.collective)
            torch_group.set_guard(None, h.timeouts.collective, before=self._before_collective)
            self.mesh = self.warm = init_device_mesh(device_type, shape, mesh_dim_names=names)
        else:
            world, rank = (1, 0) if one else (h.world_size, h.rank)
            torch_group.install_unformed(rank, world, h.timeouts.collective)
            abort = h.runtime.moved_on if (h.runtime is not None and not one) else None
            torch_group.set_guard(abort, h.timeouts.collective, before=self._before_collective,
                                  on_wait=self.waiting if abort is not None else None)  # fmt: skip
            self.mesh = init_device_mesh(device_type, (1,) * len(shape) if one else shape, mesh_dim_names=names)
            if not one and self.warm is not None:
                self._rebind_warm(self.mesh)
        if len(shape) == 2:
            self.mesh.get_group(0).role = "replicate"
        self.shape, self._key = list(shape), key
        return self.mesh

    # -- a spare's warm-up on the job's mesh ------------------------------------------------
    # DTensor's first use of each (op, input specs) runs its sharding propagation, cached by
    # value: the mesh's ranks, shape, device type and dimension names, not the local rank
    # (docs/benchmarks.md, "Where an FSDP2 recovery's and migration's time goes"). A spare that
    # warmed up on a mesh of one missed every entry of the job's mesh, and its first step in
    # the group paid them inside the survivors' wait (clip + optimizer step: 0.3-0.9 s). So a
    # spare in standby installs the job's world alone (comm/torch_group.py install_standby:
    # collectives loop back) as rank 0 and builds the job's mesh shape: the warm-up fills the
    # caches for it. A hit hands back specs holding that warm mesh object, whose groups and
    # coordinate are rank 0's, and the spare is claimed as another rank: at the claim the warm
    # object takes the real mesh's rank-dependent fields (`_rebind_warm`), so every cached
    # spec names the claimed rank's groups. Where that cannot be done (a torch whose DeviceMesh
    # lacks the fields), the caches are cleared instead: correct, and the warm-up's gain lost.
    def _may_warm_shaped(self, shape: tuple[int, ...]) -> bool:
        """Warm up on the job's mesh shape? Not when turned off ($LIVEMIG_SPARE_MESH=0), for a
        job of one, or when the function created groups of its own before the mesh (a
        standby world would replace them)."""
        if os.environ.get(ENV_SPARE_MESH, "1").strip().lower() in ("0", "false", "no"):
            return False
        world = self.h.world_size
        return world > 1 and math.prod(shape) == world and len(torch_group.groups()) <= 1

    def _rebind_warm(self, real: Any) -> None:
        """The claim: the warm mesh object becomes the claimed rank's (see above)."""
        warm, self.warm = self.warm, None
        if rebind_mesh(warm, real):
            log.info("the warm-up's mesh rebound to the claimed rank", extra={"rank": self.h.rank})
        else:
            log.info("the warm-up's mesh could not be rebound: DTensor's caches cleared", extra={"rank": self.h.rank})

    def waiting(self, begins: bool) -> None:
        """A wait inside FSDP2's collectives: the hang detection's input, as the plain path's
        wait in its average (runtime/member.py enter_collective). A rank whose training thread
        is stuck never waits, so its peers' waits name it."""
        rt, t = self.h.runtime, self.h.current
        if rt is None or t is None or self.h.warming_up:
            return
        if begins:
            rt.report.enter_collective(t)
        else:
            rt.report.leave_collective()

    def _before_collective(self, kind: str) -> None:
        """The fault plan's `during=fsdp_allgather|fsdp_reduce_scatter|replicate_allreduce|clip_norm`."""
        h = self.h
        if h.current is not None and not h.warming_up:
            h.faults.at(h.current, kind)

    # -- registration -----------------------------------------------------------------------
    @staticmethod
    def sharded(model: torch.nn.Module | None) -> bool:
        """Are the model's parameters DTensors (sharded by fully_shard)?"""
        return model is not None and any(is_dtensor(p) for p in model.parameters())

    def check_register(self, model: torch.nn.Module | None, mirror: bool | None) -> bool:
        """Is `model` sharded by fully_shard (DTensor parameters)? Refuses what cannot be served."""
        if not self.sharded(model):
            return False
        if mirror is None:  # plain FSDP keeps one copy of each shard: mirrored unless turned off
            raw = os.environ.get(ENV_FSDP2_MIRROR, "")  # (a 1-D mesh, or one whose replicate size is 1)
            mirror = raw not in ("0", "false", "no") if raw else (len(self.shape) == 1 or self.shape[0] == 1)
        self.want_mirror = bool(mirror) and self.h.world_size > 1
        if not self.shape:
            raise ConfigError(
                "ctx.register: the model is sharded (DTensor parameters) on a mesh livemig does not "
                "own: build it with mesh = ctx.init_device_mesh(...), then fully_shard(..., mesh=mesh)"
            )
        return True

    def registered(self, fsdp: bool) -> None:
        """The modules fully_shard wrapped, for the signature (a spare must wrap the same)."""
        model = self.h.reg.model
        self.units = (
            units(model) if fsdp and model is not None else []
        )  # the strategy's signature (strategies/fsdp2.py)

    # -- redo by re-entry -----------------------------------------------------------------
    def caused(self, exc: BaseException) -> bool:
        """Was an exception out of the user's function a consequence of a failed collective
        (DTensor's functional collectives may wrap StepAborted in a RuntimeError)?"""
        from livemig.errors import LivemigError

        if isinstance(exc, LivemigError):  # the recovery itself failed (the job failed, fenced): not the step's
            return False
        return isinstance(exc, torch_group.StepAborted) or (
            bool(torch_group.GUARD.poisoned) and self.h.runtime is not None
        )

    def take(self, exc: BaseException) -> bool:
        """An exception out of the user's function: a failed collective's (the recovery to join
        is then pending: True), or not (False: the caller raises it on)."""
        if not self.caused(exc):
            return False
        why = str(exc).splitlines()[0][:200] if str(exc) else "a collective failed"
        if not self.units:  # plain data parallel, ZeRO-1: only FSDP2 redoes a step by entering the function again
            raise ConfigError(
                f"a torch.distributed collective your code made inside the loop failed ({why}): a peer was lost, "
                "or the call differs between ranks (shape, op, order); on the plain and ZeRO-1 paths only "
                "ctx.step()'s own average recovers from a lost peer: make such collectives before ctx.steps() "
                "or after the loop"
            )
        self.pending = why
        return True

    def recover(self) -> Activate:
        """Above the user's function, after a failed collective: join the recovery, then
        enter the function again to redo the step from the boundary held here."""
        h = self.h
        why, self.pending = self.pending, ""
        t = h.current
        log.warning("a collective of the step failed; redoing the step in the new group",
                    extra={"step": t, "generation": h.runtime.gen, "why": why})  # fmt: skip
        h.join_recovery(t, CollectiveAborted(why))
        return Activate(h.runtime.gen, h.rank, redo=True)

    def keep(self) -> tuple:
        """What survives the re-entry: the previous registry (its state moves into the new
        one), the step records and the last commit."""
        h = self.h
        return h.reg, h.st, h.committed, h.loaded_step

    def restore(self, kept: tuple) -> None:
        h = self.h
        self.stash, h.st, h.committed, h.loaded_step = kept

    # -- planned migration (runtime/migration.py) ---------------------------------------------
