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
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from livemig.comm import torch_group
from livemig.comm.group import CollectiveAborted, allreduce_sum, ring_exchange
from livemig.config import ENV_FSDP2_MIRROR, Role, buddy_stride
from livemig.errors import ConfigError, RecoveryError
from livemig.rdzv.membership import Membership
from livemig.runtime.control import Activate
from livemig.runtime.fsdp2_mirror import ShardMirror, grads_blob, shard_digest
from livemig.runtime.step_state import LocalBlob
from livemig.state import is_dtensor, to_local, unpack
from livemig.transfer import items

log = logging.getLogger("livemig.runtime.fsdp2")


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


class Fsdp2:
    """Owned by api.Engine, kept across the function's re-entries (the mesh must survive them)."""

    def __init__(self, host: Any) -> None:
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
        # A spare in standby and a local run train as a world of one (sandbox/warmup.py)
        one = h.role == Role.LOCAL or (h.role == Role.SPARE and h.joining is None)
        if not one and math.prod(shape) != h.world_size:
            raise ConfigError(f"ctx.init_device_mesh({shape}): the mesh has {math.prod(shape)} ranks but the job "
                              f"has {h.world_size}: make the sizes multiply to --nproc")  # fmt: skip
        key = (device_type, shape, names, one)
        if self.mesh is not None and self._key == key:
            return self.mesh  # entered again: the same mesh object, its groups swapped underneath
        world, rank = (1, 0) if one else (h.world_size, h.rank)
        torch_group.install_unformed(rank, world, h.timeouts.collective)
        abort = h.runtime.moved_on if (h.runtime is not None and not one) else None
        torch_group.set_guard(abort, h.timeouts.collective, before=self._before_collective,
                              on_wait=self._waiting if abort is not None else None)  # fmt: skip
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh(device_type, (1,) * len(shape) if one else shape, mesh_dim_names=names)
        if len(shape) == 2:
            self.mesh.get_group(0).role = "replicate"
        self.shape, self._key = list(shape), key
        return self.mesh

    def _waiting(self, begins: bool) -> None:
        """A wait inside FSDP2's collectives: the hang detection's input, as the plain path's
        wait in its average (runtime/member.py enter_collective). A rank whose training thread
        is stuck never waits, so its peers' waits name it."""
        rt, t = self.h.runtime, self.h.current
        if rt is None or t is None or self.h.warming_up:
            return
        if begins:
            rt.enter_collective(t)
        else:
            rt.leave_collective()

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
        reg = self.h.reg
        self.units = units(reg.model) if fsdp else []  # the strategy's signature (runtime/strategies/fsdp2.py)

    # -- start-up ---------------------------------------------------------------------------
    def sync_start(self) -> None:
        """Replicas along `replicate` start from replica 0's shards (as DDP's broadcast), the
        buffers from rank 0: a script that seeds per rank still trains one model."""
        reg = self.h.reg
        with torch.no_grad():
            if len(self.shape) == 2 and self.shape[0] > 1:
                rep = self.mesh.get_group(0)
                for p in reg.params:
                    dist.broadcast(p.to_local(), group=rep, group_src=0)
            if reg.model is not None:
                for b in reg.model.buffers():
                    if not is_dtensor(b):
                        dist.broadcast(b, src=0)

    def shards(self) -> dict[str, Any]:
        """This rank's part of a checkpoint (runtime/checkpoint.py): its local shards of the
        parameters and of the optimizer state, at the boundary."""
        return self._own()

    def load_shards(self, mine: dict[str, Any], part_of: Callable[[int], dict[str, Any]]) -> None:
        """A checkpoint's shards into this rank's (the same mesh, the same rank), and a fresh
        mirror of the left neighbour's from its part: a mirror kept from before the restart
        holds a later boundary than the one loaded."""
        self.load_state({"params": mine["params"], "optimizer": mine["optimizer"]})
        self.mirror = None
        if self.want_mirror:
            self._make_mirror(part_of(self._left()))

    def setup_mirror(self) -> None:
        """Each rank takes a copy of its left neighbour's shard as the job forms (ring exchange)."""
        h = self.h
        if not self.want_mirror or self.mirror is not None or h.runtime is None or h.runtime.pg is None:
            return
        from livemig.state import pack

        got = ring_exchange(h.runtime.pg, pack(self._own()), h.rank, h.world_size, h.timeouts.collective,
                            h.runtime.moved_on)  # fmt: skip
        self._make_mirror(unpack(got))

    def _make_mirror(self, state: dict[str, Any]) -> None:
        h = self.h
        left = self._left()
        self.mirror = ShardMirror(left, state, h.reg.optimizer)
        log.info("mirroring the shard of the left neighbour",
                 extra={"of": left, "mib": round(self.mirror.nbytes() / 2**20, 2)})  # fmt: skip

    def _left(self) -> int:
        """The rank whose shard (and local state) this rank mirrors (its right neighbour mirrors ours)."""
        h = self.h
        return (h.rank - buddy_stride(h.world_size)) % h.world_size

    def _own(self) -> dict[str, Any]:
        reg = self.h.reg
        return {"params": [p.to_local() for p in reg.params],
                "optimizer": to_local(reg.optimizer.state_dict()) if reg.optimizer is not None else {}}  # fmt: skip

    def final(self) -> dict[str, Any]:
        """What the final record adds: this rank's shard digest, and its mirror's."""
        if self.mirror is None:
            return {}
        return {"shard_digest": shard_digest(self.h.reg.params, self.h.reg.optimizer),
                "mirror_of": self.mirror.of, "mirror_digest": self.mirror.digest(),
                "mirror_mb": round(self.mirror.nbytes() / 2**20, 3)}  # fmt: skip

    # -- the step ---------------------------------------------------------------------------
    def no_sync(self, on: bool) -> None:
        model = self.h.reg.model
        mods = [model] if hasattr(model, "set_requires_gradient_sync") else [
            m for m in model.modules() if hasattr(m, "set_requires_gradient_sync")]  # fmt: skip
        for m in mods:
            m.set_requires_gradient_sync(not on)

    def clip_grad_norm_(self, max_norm: float, norm_type: float) -> torch.Tensor:
        torch_group.GUARD.check()
        torch_group.GUARD.kind = "clip_norm"
        try:
            return torch.nn.utils.clip_grad_norm_(self.h.params, max_norm, norm_type)
        finally:
            torch_group.GUARD.kind = ""

    def step(self, t: int) -> None:
        """The commit point: one vote over the job's group that every rank's collectives of
        step t completed, then the local optimizer step on this rank's shards."""
        h = self.h
        torch_group.GUARD.check()  # a collective of this step failed: never commit it
        if h.runtime is None or h.world_size == 1:
            h.commit(t, None)
            return
        ctl = torch.tensor([1.0, h.migration.vote()])  # [commit, planned migration: switch after t]
        try:
            h.runtime.check_fenced()
            h.runtime.enter_collective(t)
            if self.mirror is not None:  # the gradient shard to its mirror, before anyone commits
                got = ring_exchange(h.runtime.pg, grads_blob(h.reg.params), h.rank, h.world_size,
                                    h.timeouts.collective, h.runtime.moved_on)  # fmt: skip
                self.mirror.hold(t, got)
            self.voted = t
            h.faults.at(t, "allreduce")
            allreduce_sum(h.runtime.pg, [ctl], h.timeouts.collective, h.runtime.moved_on)
            h.faults.at_commit_point(t, "the commit vote")
            h.runtime.leave_collective()
        except CollectiveAborted as exc:
            h.join_recovery(t, exc)
            if h.committed == t:  # a peer committed: finished from the shards held here (catch_up)
                return
            raise Activate(h.runtime.gen, h.rank, redo=True) from None
        switch = float(ctl[1]) == h.world_size
        if h.migration.serving(t):  # a leaving rank: what its optimizer steps with, to the spare catching up
            left = self.mirror.grads[1] if self.mirror is not None and self.mirror.grads is not None else None
            h.migration.serve_shard(t, grads_blob(h.reg.params), left, switch)
        self._commit_shards(t)
        h.migration.after_commit(t, switch)

    def _commit_shards(self, t: int) -> None:
        self.h.commit(t, None)
        if self.mirror is not None:
            self.mirror.step(t, self.h.reg.hparams())

    def at_boundary(self, step: int) -> None:
        """Keep the boundary (extras, hyperparameters, this rank's local state) and send the
        local state to the right neighbour now: a spare taking a rank lost before the next
        boundary starts from it, with no replay (the replay of the plain path would need the
        mesh's collectives)."""
        h = self.h
        st = h.st
        st.boundaries[step] = h.reg.pack_boundary()
        st.boundaries.pop(step - 2, None)
        if not h.reg.has_local:
            return
        st.local_blob = LocalBlob(step, h.reg.pack_local())
        if h.runtime is None or h.world_size < 2 or h.runtime.pg is None or h.warming_up:
            return
        try:
            got = ring_exchange(h.runtime.pg, st.local_blob.blob, h.rank, h.world_size, h.timeouts.collective,
                                h.runtime.moved_on)  # fmt: skip
        except CollectiveAborted as exc:  # between steps: nothing to redo, go on in the new group
            h.join_recovery(None, exc)
            return
        st.mirrored[step] = got
        st.mirrored.pop(step - 2, None)

    # -- recovery ---------------------------------------------------------------------------
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
        self.pending = str(exc).splitlines()[0][:200] if str(exc) else "a collective failed"
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

    def load_stash(self) -> None:
        """The re-entered function registered a new model and optimizer: give them the state
        of the last boundary, held by the previous ones (nothing of the failed step was
        applied: the optimizer steps only after the vote)."""
        h, old = self.h, self.stash
        self.stash = None
        new = h.reg
        if old is None:
            raise RecoveryError("the step is redone but the state of its boundary is gone")
        with torch.no_grad():
            for po, pn in zip(old.params, new.params, strict=True):
                pn.to_local().copy_(po.to_local())
                pn.grad = None
        if old.optimizer is not None and new.optimizer is not None:
            olds = old.opt_params()
            for i, pn in enumerate(new.opt_params()):
                st = old.optimizer.state.get(olds[i])
                if st:
                    new.optimizer.state[pn] = st
        self._load_boundary(h.committed)
        self.voted = None
        log.info("state of the boundary moved into the re-entered function", extra={"step": h.committed})

    def _load_boundary(self, c: int) -> None:
        h = self.h
        blob = h.st.boundaries.get(c)
        if blob is not None:
            h.reg.load_boundary(unpack(blob))
        if h.reg.has_local and h.st.local_blob is not None and h.st.local_blob.step == c:
            h.reg.load_local(unpack(h.st.local_blob.blob))

    def state(self) -> dict[str, Any]:
        """This rank's shards (parameters, optimizer) and its boundary: what a spare taking a
        rank of the same shard loads."""
        h = self.h
        reg = h.reg
        opt = to_local(reg.optimizer.state_dict()) if reg.optimizer is not None else {}
        return {"params": [p.to_local() for p in reg.params], "optimizer": opt,
                "boundary": h.st.boundaries.get(h.committed)}  # fmt: skip

    def serve(self, m: Membership) -> None:
        h = self.h
        srv = h.runtime.server
        if srv is None or m.resume_step is None or h.committed_step() != m.resume_step - 1:
            return
        c, state = h.committed, self.state()
        srv.publish(m.generation, items.STATE, lambda: (c + 1, state))
        left = self._left()
        blob = h.st.mirrored.get(c)
        if blob is not None:
            srv.publish(m.generation, items.local(left), lambda: (c + 1, {"blob": blob}))
        if self.mirror is not None:
            mstate = self.mirror.state()
            srv.publish(m.generation, items.fshard(self.mirror.of), lambda: (c + 1, mstate))

    def catch_up(self, m: Membership) -> dict[str, Any] | None:
        h = self.h
        assert m.resume_step is not None  # the caller (runtime/pull.py catch_up) returned before otherwise
        target = m.resume_step - 1
        if h.committed_step() == target:
            return h.stream_info if h.role == Role.SPARE else None
        if h.committed_step() is None or (h.role == Role.SPARE and h.current is None):
            return self._pull(m)
        if h.committed == target - 1 and h.current == target and self.voted == target:
            self._commit_shards(target)  # every collective of it completed here; a peer committed it
            log.info("finished a step a peer committed, from the shards held here", extra={"step": target})
            return None
        raise RecoveryError(f"rank {h.rank} committed step {h.committed} and cannot reach the agreed resume "
                            f"step {m.resume_step}")  # fmt: skip

    def _pull(self, m: Membership) -> dict[str, Any]:
        import time

        h = self.h
        t0 = time.monotonic()
        peers = [r for r in shard_peers(h.rank, self.shape) if r in m.sources]
        stride = buddy_stride(h.world_size)
        buddy, left = (h.rank + stride) % h.world_size, (h.rank - stride) % h.world_size
        if peers:  # HSDP: a replica of the same shard
            addr, got = h.pull_any(m, items.STATE, ranks=peers)
        elif self.want_mirror and buddy in m.sources:  # its mirror, on the right neighbour
            addr, got = h.pull_any(m, items.fshard(h.rank), ranks=[buddy])
            _, rest = h.pull_any(m, items.STATE, ranks=[buddy])  # the boundary (extras, hyperparameters)
            got.state["boundary"] = rest.state.get("boundary")
        else:
            raise RecoveryError(f"no survivor holds FSDP2 shard {shard_of(h.rank, self.shape)} of rank {h.rank}")
        self.load_state(got.state)
        h.committed = got.step - 1
        h.loaded_step = got.step
        nbytes = got.nbytes
        if self.want_mirror:  # our own mirror: the left neighbour's shard, from it
            where, own = h.pull_any(m, items.STATE, ranks=[left])
            if own.step != got.step:
                raise RecoveryError(f"rank {left}'s shard is of boundary {own.step - 1}, need {got.step - 1}")
            self._make_mirror(own.state)
            nbytes += own.nbytes
            addr += f",{where}"
        if h.reg.has_local and h.world_size > 1:
            where, part = h.pull_buddy_local(m, got.step, "the spare", 1)
            h.reg.load_local(unpack(part.state["blob"]))
            nbytes += part.nbytes
            addr += f",{where}"
        h.st.boundaries[h.committed] = h.reg.pack_boundary()
        if h.reg.has_local:
            h.st.local_blob = LocalBlob(h.committed, h.reg.pack_local())
        h.stream_info = {"stream_s": time.monotonic() - t0, "bytes": nbytes, "source": addr}
        log.info("shards loaded", extra={"resume_step": got.step, "bytes": nbytes, "source": addr})
        return h.stream_info

    # -- planned migration (runtime/migration.py) ---------------------------------------------
    def migration_state(self) -> dict[str, Any]:
        """The leaving rank's snapshot at a boundary: its shards, its mirror of the left
        neighbour's, the boundary. The spare replays the following steps on copies of them
        (no collectives: it is not in the group yet)."""
        return {"own": self._own(), "mirror": self.mirror.state() if self.mirror is not None else None,
                "boundary": self.h.st.boundaries.get(self.h.committed)}  # fmt: skip

    def replayers(self, snap: dict[str, Any]) -> list[ShardMirror | None]:
        """The spare's copies of the leaving rank's shard and of its mirror, stepped as the
        mirror steps (fsdp2_mirror.py: bit-identical to the owner's update)."""
        h = self.h
        own = ShardMirror(h.rank, snap["own"], h.reg.optimizer)
        left = self._left()
        mirror = ShardMirror(left, snap["mirror"], h.reg.optimizer) if snap.get("mirror") else None
        if snap.get("boundary") is not None:
            h.reg.load_boundary(unpack(snap["boundary"]))
        return [own, mirror]

    def replay(self, reps: list[ShardMirror | None], t: int, item: dict[str, Any]) -> None:
        """Step t of the leaving rank, from the gradient shard it stepped with (after its
        clip) and its hyperparameters; its mirror's from the left neighbour's gradient."""
        own, mirror = reps
        assert own is not None
        own.hold(t, item["own"])
        own.step(t, item["hparams"])
        if mirror is not None:
            if item.get("left") is None:
                raise RecoveryError(f"the leaving rank served no gradient of step {t} for its shard mirror")
            mirror.hold(t, item["left"])
            mirror.step(t, item["hparams"])

    def take_over(self, reps: list[ShardMirror | None], tail: dict[str, Any]) -> None:
        """At the switch: the replayed shard into the model and optimizer, the replayed mirror
        kept, and the boundary's records (the leaving rank's local state, and its copy of the
        left neighbour's) so that a failure right after the switch still finds them."""
        h = self.h
        own, mirror = reps
        assert own is not None
        self.load_state({**own.state(), "boundary": None})
        self.mirror = mirror
        self.voted = None
        c = h.committed
        h.st.boundaries[c] = h.reg.pack_boundary()
        if h.reg.has_local:
            h.st.local_blob = LocalBlob(c, h.reg.pack_local())
            if tail.get("mirrored") is not None:
                h.st.mirrored[c] = tail["mirrored"]

    def load_state(self, state: dict[str, Any]) -> None:
        """A peer's shards into this rank's (the same shard of the same model)."""
        from torch.distributed.tensor import DTensor

        reg = self.h.reg
        with torch.no_grad():
            for p, v in zip(reg.params, state["params"], strict=True):
                p.to_local().copy_(v)
        if reg.optimizer is not None and state["optimizer"]:
            sd = state["optimizer"]
            params = reg.opt_params()
            per: dict[Any, Any] = {}
            for i, st in sd["state"].items():
                p = params[int(i)]
                loc = p.to_local()
                per[int(i)] = {k: DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                               if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == loc.shape else v
                               for k, v in st.items()}  # fmt: skip
            reg.optimizer.load_state_dict({"state": per, "param_groups": sd["param_groups"]})
        if state.get("boundary") is not None:
            reg.load_boundary(unpack(state["boundary"]))
