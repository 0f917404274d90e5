"""The step's records, typed: what one part of the step protocol leaves for another.

Each was a positional tuple read as `x[2]` across the runtime's files; a named field
says which part wrote it and which reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Averaged:
    """A step's averaged gradient buckets: the last commit's (served to a peer's recovery
    and a migrating spare) or one a recovery fetched from a peer that completed the step.
    ZeRO-1 holds [own slice, mirror slice]."""

    step: int
    flats: list


@dataclass
class Synced:
    """What the step's average (ctx.sync_gradients(), or ctx.step() itself) leaves for
    the commit: the buckets (None in a world of one), the planned-migration switch vote
    and the forward+backward seconds the straggler hook reads."""

    step: int
    flats: list | None
    switch: bool = False
    compute_s: float = 0.0


@dataclass
class Replay:
    """A spare's replay of step resume-1 (runtime/loop.py, _replay_step): loaded by the
    state pull, run by the loop. `before` are the parameters the step started from,
    `after` (set when the replay starts) those put back at its ctx.step(); `extra` the
    source's committed extras of the step (a GradScaler's state)."""

    step: int
    boundary: Any
    local: Any
    before: list
    avg: list | None
    extra: dict
    after: list | None = None


@dataclass
class LocalBlob:
    """This rank's packed local state (buffers, local=) of one boundary: what
    _mirror_local sends to the right neighbour."""

    step: int
    blob: Any


@dataclass
class Outgoing:
    """A leaving worker's side of a planned migration (runtime/migration.py): the
    migration generation it serves (None: none), the step its snapshot was taken
    before, the snapshot item it serves now, and, once the switch was voted, the
    generation to leave for at the next boundary."""

    gen: int | None = None
    step: int | None = None
    snap: str | None = None
    leaving: int | None = None

    def serves(self, t: int) -> bool:
        """Does this worker serve step t's update to the catching-up spare?"""
        return self.gen is not None and self.step is not None and t >= self.step
