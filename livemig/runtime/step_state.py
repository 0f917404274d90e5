"""The step's records, typed: what one part of the step protocol leaves for another.

Each was a positional tuple read as `x[2]` across the runtime's files; a named field
says which part wrote it and which reads it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
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
    stop: bool = False  # a member voted the whole-job stop (runtime/stop.py): the group stops after this step


@dataclass
class Replay:
    """A spare's replay of step resume-1 (runtime/boundary.py, replay_step): loaded by the
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
    Boundary.mirror_local sends to the right neighbour (runtime/boundary.py)."""

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
    newest: int | None = None  # the newest step whose update it served

    def serves(self, t: int) -> bool:
        """Does this worker serve step t's update to the catching-up spare?"""
        return self.gen is not None and self.step is not None and t >= self.step


@dataclass
class StepState:
    """What the step protocol (runtime/loop.py, pull.py, strategies/) keeps between steps,
    owned by the Engine and made anew when the user's function is entered again. The
    boundary rule (docs/architecture.md): snapshots of step boundaries, newest last."""

    avg: Averaged | None = None  # averaged gradient of the last commit
    commits: list[list[float]] = field(default_factory=list)  # [step, wall time] of this rank's commits
    commit_gen: int = -1  # generation changes seen by the commits (record_commit)
    gen_steps: list[int] = field(default_factory=list)
    boundaries: dict[int, Any] = field(default_factory=dict)  # step -> packed extras + hyperparameters after step
    mirrored: dict[int, Any] = field(default_factory=dict)  # boundary step -> left neighbour's packed local state
    local_blob: LocalBlob | None = None  # this rank's packed local state of the last boundary
    before: dict[int, list] = field(default_factory=dict)  # step -> parameters before its update
    replay: Replay | None = None  # a spare's replay of step resume-1 (runtime/boundary.py)
    uses_sync: bool = False  # the loop body called ctx.sync_gradients(): a replay needs the average
    user_synced: int | None = None  # the last step whose body called ctx.sync_gradients()
    synced: Synced | None = None  # what the step's average left for the commit
    fetched: Averaged | None = None  # a step's average a recovery fetched from a peer
    inherited_to: int = -1  # a migrated-in spare: the last of the leaving worker's commits in `commits`

    def record_commit(self, t: int, gen: int, kept: int) -> None:
        """This rank committed step t in generation `gen`. The final record stays bounded (etcd
        refuses a request over 1.5 MiB, near 100k steps of commit times): the last `kept`
        commits and those within a few steps of each generation change, which is all the
        report reads."""
        self.commits.append([t, time.time()])
        if gen != self.commit_gen:
            self.commit_gen = gen
            self.gen_steps.append(int(t))
        if len(self.commits) <= 2 * kept:
            return
        last = self.commits[-1][0]
        self.commits = [c for c in self.commits
                        if c[0] > last - kept or any(abs(c[0] - g) <= 5 for g in self.gen_steps)]  # fmt: skip
