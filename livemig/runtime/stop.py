"""A whole-job stop: one checkpoint at a boundary every member agreed on, then exit.

When the whole job is told to stop (every node drained by the same signal, as Slurm's time
limit, preemption, `scancel` and `scontrol requeue` do, or a drain that no spare and no
`--min-nproc` can cover: agent/drain.py), ending the processes where they stand would lose
every step since the last periodic checkpoint. So the coordinator marks the committed table
(`Membership.stop`); each member adds its vote (1.0 once it saw the mark) to its next step's
collective: the gradient average's control tensor, the ZeRO-1 barrier, the FSDP2 commit vote.
The sum is the same on every member, so all learn in the same step t that the group stops
after it, even those that had not seen the mark yet. At t's boundary, after all user code of
t, each member writes its part of a checkpoint of t and waits until it is durable, writes its
final record with `stopped: t`, and waits for the job's end; the coordinator ends the job
once every member did (DONE, result "stopped"), and the agents exit with STOPPED_EXIT. A
restarted or requeued job with the same `--checkpoint-dir` resumes at t + 1, exactly.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from livemig.runtime.control import Halted

log = logging.getLogger("livemig.runtime.stop")


class StopHost(Protocol):
    """What the stop uses of its Engine."""

    runtime: Any  # MemberRuntime (None outside `livemig run`)
    ckpt: Any  # runtime/checkpoint.py Checkpointer
    rank: int


class JobStop:
    """This member's side of a whole-job stop (module doc)."""

    def __init__(self, host: StopHost) -> None:
        self.h = host
        self.at: int | None = None  # the step the group agreed to stop after
        self.written = False  # this rank's part of the stop's checkpoint is durable

    def vote(self) -> float:
        """1.0 once this member saw the job's stop mark."""
        rt = self.h.runtime
        return 1.0 if rt is not None and rt.m.stop else 0.0

    def after_commit(self, t: int, stop: bool) -> None:
        """Step t committed; `stop`: some member voted for the stop in its collective."""
        if stop and self.at is None:
            self.at = t

    def at_boundary(self, step: int) -> None:
        """The boundary's last listener: at the agreed step, the checkpoint, then leave."""
        if self.at != step:
            return
        self.written = self.h.ckpt.write_now(step)
        if self.written:
            log.warning("stopped: checkpoint of this boundary written", extra={"step": step, "rank": self.h.rank})
        else:  # the newest complete checkpoint stays the one a restart resumes from
            log.error("stopped without this rank's checkpoint of the boundary", extra={"step": step,
                                                                                      "rank": self.h.rank})  # fmt: skip
        raise Halted(step)

    def final(self) -> dict[str, Any]:
        """What the final record says of the stop (nothing when the job ran to its end)."""
        return {} if self.at is None else {"stopped": self.at, "stop_checkpoint": self.written}
