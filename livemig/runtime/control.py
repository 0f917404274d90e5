"""Control-flow signals that unwind the user's function (BaseException, so a
user's `except Exception` never swallows them)."""

from __future__ import annotations


class Activate(BaseException):
    """Unwinds the user's function in a spare once it is claimed, and in every survivor of
    a cold restart (restart=True: it is entered again to load the checkpoint in place), and in a
    survivor of an FSDP2 recovery (redo=True: the failed step is redone from the boundary held
    in memory, runtime/strategies/fsdp2.py)."""

    def __init__(self, generation: int, rank: int, migration: bool = False, restart: bool = False,
                 redo: bool = False) -> None:  # fmt: skip
        self.generation, self.rank, self.migration, self.restart = generation, rank, migration, restart
        self.redo = redo


class Stop(BaseException):
    """A standby spare was asked to exit (`livemig-spare stop`)."""


class Released(BaseException):
    """This worker's rank moved to a spare (planned migration): exit cleanly."""


class Requeue(BaseException):
    """The migration this spare was claimed for was aborted: back to standby."""


class Halted(BaseException):
    """The whole job stops after step `step` (runtime/stop.py): its checkpoint is written;
    this member writes its final record and waits for the job's end, running no user code
    after the loop (a final save or evaluation belongs to a job that finished)."""

    def __init__(self, step: int) -> None:
        self.step = step
