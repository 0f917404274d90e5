"""FSDP2 and HSDP: parameters sharded by torch's `fully_shard` over the mesh livemig owns.

The step communicates inside the user's code (forward all-gathers, backward reduce-scatters),
so the strategy's own step is only the commit vote; a failure inside FSDP2's collectives
unwinds the user's function and redoes the step (runtime/fsdp2_mesh.py, `Fsdp2`, owns the mesh
and what must survive the function's re-entries). Where the rank's shards are and how they move
(its part, its mirror, what a spare or a checkpoint loads) is `Shards` (strategies/fsdp2_shards.py).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from livemig.comm import torch_group
from livemig.comm.group import CollectiveAborted, allreduce_sum, device_of, ring_exchange
from livemig.config import SHARDING_ENTRY, buddy_of
from livemig.errors import ConfigError, RecoveryError
from livemig.runtime.control import Activate
from livemig.runtime.fsdp2_mesh import shard_of, shard_peers
from livemig.runtime.fsdp2_mirror import grads_blob
from livemig.runtime.registry import Layout
from livemig.runtime.step_state import LocalBlob
from livemig.runtime.strategies.base import Handover, Parts, Strategy, StrategyHost
from livemig.runtime.strategies.fsdp2_shards import Shards, dtensors
from livemig.state import is_dtensor, unpack
from livemig.transfer import items

if TYPE_CHECKING:
    from livemig.rdzv.membership import Membership
    from livemig.runtime.fsdp2_mesh import Fsdp2 as MeshOwner

log = logging.getLogger("livemig.runtime.strategies.fsdp2")


class Fsdp2(Strategy):
    """Parameters sharded by fully_shard (DTensor), on a 1-D (FSDP) or 2-D (HSDP) mesh."""

    name = "fsdp2"
    layout = Layout(params_sharded=True, optimizer_sharded=True)
    switch_at_boundary = True  # collectives user code runs after ctx.step() on the mesh meet the leaving rank

    def __init__(self, host: StrategyHost, owner: MeshOwner) -> None:
        super().__init__(host)
        self.owner = owner
        self.shards = Shards(host, owner)  # where this rank's shards are and how they move
        self.handover = Fsdp2Handover(host, self.shards)
        self.parts = Fsdp2Parts(host, owner, self.shards)

    def signature(self) -> list[list]:
        mirrored = "mirrored" if self.owner.want_mirror else "unmirrored"
        return [[SHARDING_ENTRY, "fsdp2", list(self.owner.shape)],  # the mesh the script asked for
                ["<fsdp2-units>", "fully_shard", list(self.owner.units)],  # the same wrapping
                ["<fsdp2-mirror>", mirrored, []]]  # fmt: skip

    def formed(self) -> None:
        self.shards.setup_mirror()  # each rank's shard mirrored on its right neighbour

    # -- the step ----------------------------------------------------------------------------
    def sync_gradients(self, t: int) -> None:
        """FSDP2 reduced the gradients in backward already."""

    def step(self, t: int) -> None:
        self._vote_and_commit(t)
        self.h.faults.at(t, "after_step")

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """FSDP2's set_requires_gradient_sync(False)."""
        self._requires_sync(True)
        try:
            yield
        finally:
            self._requires_sync(False)

    def warmup_step(self, t: int, pg: Any) -> None:
        h = self.h
        h.reg.step_optimizer(h.scaler)
        h.committed = t

    # -- recovery ------------------------------------------------------------------------------
    def redo_from_stash(self) -> None:
        self.shards.load_stash()

    def avg_step(self) -> int | None:
        return self.owner.voted  # the step whose reduced gradient shards are complete here

    # -- the work, over the state the mesh owner keeps across re-entries (runtime/fsdp2_mesh.py) -----
    def sync_start(self) -> None:
        """Replicas along `replicate` start from replica 0's shards (as DDP's broadcast), the
        buffers from rank 0: a script that seeds per rank still trains one model."""
        reg = self.h.reg
        with torch.no_grad():
            if len(self.owner.shape) == 2 and self.owner.shape[0] > 1:
                rep = self.owner.mesh.get_group(0)
                for p in dtensors(reg.params):
                    dist.broadcast(p.to_local(), group=rep, group_src=0)
            if reg.model is not None:
                for b in reg.model.buffers():
                    if not is_dtensor(b):
                        dist.broadcast(b, src=0)

    def _requires_sync(self, on: bool) -> None:
        model: Any = self.h.reg.model  # FSDPModule(s): set_requires_gradient_sync is FSDP2's
        mods = [model] if hasattr(model, "set_requires_gradient_sync") else [
            m for m in model.modules() if hasattr(m, "set_requires_gradient_sync")]  # fmt: skip
        for m in mods:
            m.set_requires_gradient_sync(not on)

    def clip_grad_norm_(self, max_norm: float, norm_type: float) -> torch.Tensor:
        torch_group.GUARD.check()
        torch_group.GUARD.kind = "clip_norm"
        try:
            return torch.nn.utils.clip_grad_norm_(self.h.reg.params, max_norm, norm_type)
        finally:
            torch_group.GUARD.kind = ""

    def _vote_and_commit(self, t: int) -> None:
        """The commit point: one vote over the job's group that every rank's collectives of
        step t completed, then the local optimizer step on this rank's shards."""
        h = self.h
        torch_group.GUARD.check()  # a collective of this step failed: never commit it
        if h.runtime is None or h.world_size == 1:
            h.commit(t, None)
            return
        # [commit, planned migration: switch after t], where the group reduces (device_of)
        ctl = torch.tensor([1.0, h.migration.vote(), h.halt.vote()], device=device_of(h.runtime.pg))
        try:
            h.runtime.check_fenced()
            h.runtime.report.enter_collective(t)
            if self.owner.mirror is not None:  # the gradient shard to its mirror, before anyone commits
                got = ring_exchange(h.runtime.pg, grads_blob(h.reg.params), h.rank, h.world_size,
                                    h.timeouts.collective, h.runtime.moved_on)  # fmt: skip
                self.owner.mirror.hold(t, got)
            self.owner.voted = t
            h.faults.at(t, "allreduce")
            allreduce_sum(h.runtime.pg, [ctl], h.timeouts.collective, h.runtime.moved_on)
            h.faults.at_commit_point(t, "the commit vote")
            h.runtime.report.leave_collective()
        except CollectiveAborted as exc:
            h.join_recovery(t, exc)
            if h.committed == t:  # a peer committed: finished from the shards held here (catch_up)
                return
            raise Activate(h.runtime.gen, h.rank, redo=True) from None
        switch = float(ctl[1]) == h.world_size
        h.halt.after_commit(t, float(ctl[2]) > 0)  # a whole-job stop after t (runtime/stop.py)
        if h.migration.serving(t):  # a leaving rank: what its optimizer steps with, to the spare catching up
            mirror = self.owner.mirror
            left = mirror.grads[1] if mirror is not None and mirror.grads is not None else None
            h.migration.serve_shard(t, grads_blob(h.reg.params), left, switch)
        self._commit_shards(t)
        h.migration.after_commit(t, switch)

    def _commit_shards(self, t: int) -> None:
        self.h.commit(t, None)
        if self.owner.mirror is not None:
            self.owner.mirror.step(t, self.h.reg.hparams())

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

    def serve(self, m: Membership) -> None:
        h = self.h
        srv = h.runtime.server
        if srv is None or m.resume_step is None or h.pull.committed_step() != m.resume_step - 1:
            return
        c, state = h.committed, self.shards.state()
        srv.publish(m.generation, items.STATE, lambda: (c + 1, state))
        left = self.shards.left()
        blob = h.st.mirrored.get(c)
        if blob is not None:
            srv.publish(m.generation, items.local(left), lambda: (c + 1, {"blob": blob}))
        if self.owner.mirror is not None:
            mstate = self.owner.mirror.state()
            srv.publish(m.generation, items.fshard(self.owner.mirror.of), lambda: (c + 1, mstate))

    def finish_missed(self, m: Membership, t: int) -> bool:
        if self.owner.voted != t:  # some collective of step t did not complete here
            return False
        self._commit_shards(t)  # every collective of it completed here; a peer committed it
        log.info("finished a step a peer committed, from the shards held here", extra={"step": t})
        return True

    def pull_state(self, m: Membership) -> dict[str, Any]:
        """A replica's shard (HSDP) or this rank's mirror (plain FSDP), then its own mirror of
        the left neighbour's shard and its local state from its buddy."""
        h = self.h
        t0 = time.monotonic()
        peers = [r for r in shard_peers(h.rank, self.owner.shape) if r in m.sources]
        buddy, left = buddy_of(h.rank, h.world_size), self.shards.left()
        if peers:  # HSDP: a replica of the same shard
            addr, got = h.pull.pull_any(m, items.STATE, ranks=peers)
        elif self.owner.want_mirror and buddy in m.sources:  # its mirror, on the right neighbour
            addr, got = h.pull.pull_any(m, items.fshard(h.rank), ranks=[buddy])
            _, rest = h.pull.pull_any(m, items.STATE, ranks=[buddy])  # the boundary (extras, hyperparameters)
            got.state["boundary"] = rest.state.get("boundary")
        else:
            raise RecoveryError(f"no survivor holds FSDP2 shard {shard_of(h.rank, self.owner.shape)} of rank {h.rank}")
        self.shards.load(got.state)
        h.committed = got.step - 1
        h.loaded_step = got.step
        nbytes = got.nbytes
        if self.owner.want_mirror:  # our own mirror: the left neighbour's shard, from it
            where, own = h.pull.pull_any(m, items.STATE, ranks=[left])
            if own.step != got.step:
                raise RecoveryError(f"rank {left}'s shard is of boundary {own.step - 1}, need {got.step - 1}")
            self.shards.make_mirror(own.state)
            nbytes += own.nbytes
            addr += f",{where}"
        if h.reg.has_local and h.world_size > 1:
            where, part = h.pull.pull_buddy_local(m, got.step, "the spare", 1)
            h.reg.load_local(unpack(part.state["blob"]))
            nbytes += part.nbytes
            addr += f",{where}"
        h.st.boundaries[h.committed] = h.reg.pack_boundary()
        if h.reg.has_local:
            h.st.local_blob = LocalBlob(h.committed, h.reg.pack_local())
        h.stream_info = {"stream_s": time.monotonic() - t0, "bytes": nbytes, "source": addr}
        log.info("shards loaded", extra={"resume_step": got.step, "bytes": nbytes, "source": addr})
        return h.stream_info


class Fsdp2Handover(Handover):
    """A planned migration hands over the leaving rank's shards and its mirror, and replays
    each step's update from the gradient shard the leaving rank stepped with."""

    def __init__(self, host: StrategyHost, shards: Shards) -> None:
        super().__init__(host)
        self.shards = shards
        self.reps: list = []  # a migrating spare's replayed copies of the shard and its mirror

    def snapshot(self) -> dict[str, Any]:
        return self.shards.migration_state()

    def snapshot_alloc(self) -> Any:
        return None

    def load_snapshot(self, state: dict[str, Any]) -> None:
        self.reps = self.shards.replayers(state)

    def replay_update(self, t: int, item: dict[str, Any]) -> None:
        """The shard's update, from the gradient shard the leaving rank stepped with."""
        self.shards.replay(self.reps, t, item)
        self.h.committed = t

    def take_over(self, tail: dict[str, Any]) -> None:
        self.shards.take_over(self.reps, tail)

    def after_migrate_in(self, step: int) -> None:
        """Kept by the take-over: its boundary exchange ran without this member."""


class Fsdp2Parts(Parts):
    """A rank's parameter shards (and the ones it mirrors) in its checkpoint part and final record."""

    sections = ("fsdp",)

    def __init__(self, host: StrategyHost, owner: MeshOwner, shards: Shards) -> None:
        self.h = host
        self.owner = owner
        self.shards = shards
        self._from_mesh: list[int] = []  # the mesh a checkpoint re-cut at the load was written on

    def checkpoint_part(self, rank: int) -> dict[str, Any]:
        return {"fsdp": self.shards.part()}

    def load_checkpoint_part(self, mine: dict[str, Any], section_of: Callable[[int, str], Any]) -> None:
        """This rank's shards, and the shards it mirrors from their owner's part."""
        self.shards.load_part(mine["fsdp"], lambda r: section_of(r, "fsdp"))

    def layout_record(self) -> dict[str, Any]:
        return {"mesh": list(self.owner.shape)}

    def portable_signature(self, sig: list) -> list:
        """Without the mesh's shape and whether shards are mirrored: a re-cut sets both anew."""
        return [[e[0], e[1], []] if e[0] == SHARDING_ENTRY else e for e in sig if e[0] != "<fsdp2-mirror>"]

    def check_resume_world(self, path: str, world: int, manifest: dict[str, Any]) -> None:
        mesh = (manifest.get("layout") or {}).get("mesh")
        if not mesh:
            raise ConfigError(f"checkpoint {path} holds the FSDP2 shards of {world} ranks but not the mesh they "
                              "were cut on (written before livemig re-cut FSDP2 checkpoints): resume it with "
                              f"--nproc {world} and the same mesh")  # fmt: skip
        self._from_mesh = [int(x) for x in mesh]

    def load_resharded(self, world: int, section_of: Callable[[int, str], Any]) -> None:
        """The shards of the checkpoint's mesh (check_resume_world read it) re-cut for this
        one: a job resumed on fewer or more nodes, or on another (replicate, shard) shape."""
        self.shards.load_recut(self._from_mesh, lambda r: section_of(r, "fsdp"))
        log.info("FSDP2 shards re-cut from the checkpoint's mesh", extra={
            "from_mesh": self._from_mesh, "mesh": list(self.owner.shape), "written_by_ranks": world})  # fmt: skip

    def final_record(self) -> dict[str, Any]:
        """The report compares replicas within each shard's group, and the mirror against the
        shard it mirrors."""
        return {"fsdp_shard": shard_of(self.h.rank, list(self.owner.shape)), **self.shards.final()}
