"""Where an entry of the training function starts its loop (`ctx.steps()` or `ctx.epochs()`),
by why it was entered: a worker forming the job, a cold restart, an FSDP2 redo, a spare in
standby (its warm-up, then its claim), claimed, or migrated in.

The function is entered once per role a process takes (runtime/standby.py): the first step it
runs is the agreed resume step, found here before any step is yielded, so `ctx.epochs()` can
start at the epoch that holds it (runtime/epochs.py).
"""

from __future__ import annotations

from typing import Any

from livemig.comm.group import CollectiveAborted
from livemig.config import Role
from livemig.errors import ConfigError
from livemig.rdzv.membership import GenState


class Entry:
    """Owned by api.Engine: the start of one entry's loop."""

    def __init__(self, host: Any) -> None:  # api.Engine (a StepLoop)
        self.h = host

    def check(self, what: str) -> None:
        """ctx.steps() or ctx.epochs() may start: something is registered, and no loop ran in
        this entry of the function."""
        h = self.h
        if h.model is None and h.optimizer is None:
            raise ConfigError(f"call ctx.register(model=..., optimizer=...) before {what}")
        if h.steps_called:
            raise ConfigError(
                f"{what} was called a second time in one run of the function (once per epoch?): for an epoch "
                "loop, write `for epoch in ctx.epochs(E, steps_per_epoch): ... for step in ctx.steps():`, or call "
                'ctx.steps(total) once and take the epoch as step // steps_per_epoch (README, "Epochs")'
            )

    def start(self, total: int) -> tuple[int | None, bool]:
        """Where this entry of the function starts, by why it was entered: a cold restart, an
        FSDP2 redo, a worker forming the job, a spare (None: in standby; its warm-up, then its
        claim; claimed or migrated in). Returns the first step to run and whether a claimed
        spare replays the step before it first (runtime/boundary.py)."""
        h = self.h
        joining = h.joining
        h.lazy.loop_starts()  # a spare's warm-up: its random fills are recorded up to here (runtime/lazy_init.py)
        h.preloop.leave()  # the collectives before the loop (runtime/preloop.py)
        if joining is not None and joining.restart:  # the cold path: loaded in place (runtime/pull.py)
            m = h.runtime.follow(joining.generation, h.pull)
            return (total if m.state == GenState.DONE else h.committed + 1), False
        if joining is not None and joining.redo:  # FSDP2: redo from the boundary held here
            h.strategy.redo_from_stash()
            return h.committed + 1, False
        if h.role == Role.WORKER:
            h.faults.gate.check_total(total)  # a fault plan's step the job never reaches: refused now
            h.preloop.register()
            h.preloop.publish()
            h.standby.register_signature()
            h.runtime.follow(1, h.pull)
            h.preloop.formed()
            resumed = h.ckpt.resume()  # --resume-from: this rank's part of the chosen checkpoint
            if resumed is not None:
                h.committed = resumed
                h.ckpt.at_boundary(resumed)  # resharded: written at once (runtime/checkpoint.py)
            elif h.reg.sync_start and h.world_size > 1 and h.runtime.pg is not None:
                try:  # DDP's start-up broadcast, never after a load: the replicas hold the job's state then
                    h.strategy.sync_start()
                except CollectiveAborted as exc:
                    # A member lost during the sync: the survivors go on with what they hold (a
                    # broadcast that completed only in part is caught by the step-0 replica check).
                    h.join_recovery(None, exc)
            h.strategy.formed()  # what is mirrored from now on (FSDP2: each rank's shard on its right neighbour)
            h.boundary.keep(h.committed)  # the state every rank starts from
            return h.committed + 1, False
        if h.role != Role.SPARE:
            h.boundary.keep(-1)
            return 0, False
        if joining is None:
            return None, False
        if joining.migration:
            h.migration.migrate_in()
            start = h.committed + 1
            h.strategy.handover.after_migrate_in(h.committed)  # the leaving worker's, handed over at the switch
            return start, False
        m = h.runtime.follow(joining.generation, h.pull)
        h.lazy.finish()  # the state is loaded (runtime/lazy_init.py)
        if m.state == GenState.DONE:
            return total, False
        return h.committed + 1, h.st.replay is not None
