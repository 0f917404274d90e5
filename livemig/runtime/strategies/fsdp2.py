"""FSDP2 and HSDP: parameters sharded by torch's `fully_shard` over the mesh livemig owns.

The step communicates inside the user's code (forward all-gathers, backward reduce-scatters),
so the strategy's own step is only the commit vote; a failure inside FSDP2's collectives
unwinds the user's function and redoes the step (runtime/fsdp2.py, `Fsdp2`, which owns the
mesh across the function's re-entries and does the work this strategy is asked for).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from livemig.config import SHARDING_ENTRY
from livemig.errors import ConfigError
from livemig.runtime.registry import Layout
from livemig.runtime.strategies.base import Strategy, StrategyHost

if TYPE_CHECKING:
    from livemig.rdzv.membership import Membership
    from livemig.runtime.fsdp2 import Fsdp2 as MeshOwner


class Fsdp2(Strategy):
    """Parameters sharded by fully_shard (DTensor), on a 1-D (FSDP) or 2-D (HSDP) mesh."""

    name = "fsdp2"
    layout = Layout(params_sharded=True, optimizer_sharded=True)
    switch_at_boundary = True  # collectives user code runs after ctx.step() on the mesh meet the leaving rank
    uses_reducer = False  # FSDP2 reduces the gradients in backward

    def __init__(self, host: StrategyHost, mesh: MeshOwner) -> None:
        super().__init__(host)
        self.mesh = mesh
        self._reps: list = []  # a migrating spare's replayed copies of the shard and its mirror

    def signature(self) -> list[list]:
        mirrored = "mirrored" if self.mesh.want_mirror else "unmirrored"
        return [[SHARDING_ENTRY, "fsdp2", list(self.mesh.shape)],  # the mesh the script asked for
                ["<fsdp2-units>", "fully_shard", list(self.mesh.units)],  # the same wrapping
                ["<fsdp2-mirror>", mirrored, []]]  # fmt: skip

    def sync_start(self) -> None:
        self.mesh.sync_start()

    def formed(self) -> None:
        self.mesh.setup_mirror()  # each rank's shard mirrored on its right neighbour

    # -- the step ----------------------------------------------------------------------------
    def sync_gradients(self, t: int) -> None:
        """FSDP2 reduced the gradients in backward already."""

    def step(self, t: int) -> None:
        self.mesh.step(t)
        self.h.faults.at(t, "after_step")

    def clip_grad_norm_(self, max_norm: float, norm_type: float) -> torch.Tensor:
        """DTensor gradients: torch's clip all-reduces the norm over the mesh."""
        return self.mesh.clip_grad_norm_(max_norm, norm_type)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """FSDP2's set_requires_gradient_sync(False)."""
        self.mesh.no_sync(True)
        try:
            yield
        finally:
            self.mesh.no_sync(False)

    def warmup_step(self, t: int, pg: Any) -> None:
        h = self.h
        h.reg.step_optimizer(h.scaler)
        h.committed = t

    # -- the boundary ------------------------------------------------------------------------
    def at_boundary(self, step: int) -> None:
        self.mesh.at_boundary(step)

    def after_migrate_in(self, step: int) -> None:
        """Kept by the take-over: its boundary exchange ran without this member."""

    # -- recovery ------------------------------------------------------------------------------
    def redo_from_stash(self) -> None:
        self.mesh.load_stash()

    def avg_step(self) -> int | None:
        return self.mesh.voted  # the step whose reduced gradient shards are complete here

    def catch_up(self, m: Membership) -> dict[str, Any] | None:
        return self.mesh.catch_up(m)

    def serve(self, m: Membership) -> None:
        self.mesh.serve(m)

    def shrink_refusal(self) -> str:
        return "shrinking an FSDP2 job is not supported yet"

    # -- planned migration -----------------------------------------------------------------
    def migration_snapshot(self) -> dict[str, Any]:
        return self.mesh.migration_state()

    def snapshot_alloc(self) -> Any:
        return None

    def load_snapshot(self, state: dict[str, Any]) -> None:
        self._reps = self.mesh.replayers(state)

    def replay_update(self, t: int, item: dict[str, Any]) -> None:
        """The shard's update, from the gradient shard the leaving rank stepped with."""
        self.mesh.replay(self._reps, t, item)
        self.h.committed = t

    def take_over(self, tail: dict[str, Any]) -> None:
        self.mesh.take_over(self._reps, tail)

    # -- checkpoints ---------------------------------------------------------------------------
    def checkpoint_part(self, rank: int) -> dict[str, Any]:
        return {"fsdp": self.mesh.shards()}

    def checkpoint_sections(self) -> list[str]:
        return ["fsdp"]

    def load_checkpoint_part(self, mine: dict[str, Any], section_of: Callable[[int, str], Any]) -> None:
        """This rank's shards, and the shards it mirrors from their owner's part."""
        self.mesh.load_shards(mine["fsdp"], lambda r: section_of(r, "fsdp"))

    def check_resume_world(self, path: str, world: int) -> None:
        raise ConfigError(f"checkpoint {path} holds the FSDP2 shards of {world} ranks; this run has "
                          f"{self.h.world_size}, and FSDP2 shards are not resharded to another world size yet: "
                          f"resume it with --nproc {world} and the same mesh")  # fmt: skip

    # -- the final record -------------------------------------------------------------------
    def final_record(self) -> dict[str, Any]:
        """The report compares replicas within each shard's group, and the mirror against the
        shard it mirrors."""
        from livemig.runtime.fsdp2 import shard_of

        return {"fsdp_shard": shard_of(self.h.rank, list(self.mesh.shape)), **self.mesh.final()}
