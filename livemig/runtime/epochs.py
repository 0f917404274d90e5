"""`for epoch in ctx.epochs(E, steps_per_epoch):` with `for step in ctx.steps():` inside: the
port of torchrun's `for epoch in range(E): sampler.set_epoch(epoch); for batch in loader:`.

The steps are the job's global steps (epoch k's are [k*S, (k+1)*S)), so everything that counts
steps (the fault plan, checkpoints, the report) is unchanged. What the form adds is where an
entry of the function starts: the resume step is known before the first epoch is yielded
(runtime/entry.py), and a process entering the function again (a claimed spare, a cold restart,
a migration, an FSDP2 redo) starts at the epoch that holds it, so the code around an epoch's
steps runs once per epoch and rank, on the process that holds the rank there: `set_epoch`, an
evaluation, rank 0's snapshot. A claimed spare that replays the step before its resume step
starts at that step's epoch (when that step ends an epoch, the code after it runs again on the
spare: it sees the same state as the first time, so a snapshot it writes is the same file). Its
collectives are answered from the rank's record until the process runs a step of its own
(runtime/preloop.py, segments "e<k>" and "t<k>").
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from livemig.errors import ConfigError


@dataclass
class EpochPlan:
    """Where ctx.epochs() is: the epoch whose body runs, and whether its ctx.steps() ran."""

    epochs: int
    spe: int  # steps per epoch
    epoch: int = -1
    start: int = 0  # the first step this entry of the function runs
    replay: bool = False  # a claimed spare replays step start - 1, in that step's epoch
    warmup: bool = False  # a spare in standby: epoch 0's ctx.steps() is its warm-up
    running: bool = False
    ran: bool = False


class EpochLoop:
    """Owned by api.Engine, one per entry of the function: ctx.epochs() and the ctx.steps()
    inside it."""

    def __init__(self, host: Any) -> None:  # api.Engine (a StepLoop)
        self.h = host
        self.plan: EpochPlan | None = None

    def begin(self, epochs: int, steps_per_epoch: int) -> Iterator[int]:
        e, spe = int(epochs), int(steps_per_epoch)
        if e < 0 or spe < 1:
            raise ConfigError(f"ctx.epochs({epochs!r}, {steps_per_epoch!r}): give the number of epochs (>= 0) "
                              "and the steps of one epoch (>= 1: len(loader) for a loader of this rank's "
                              "batches)")  # fmt: skip
        self.plan = EpochPlan(e, spe)
        return self._epochs(self.plan)

    def _epochs(self, plan: EpochPlan) -> Iterator[int]:
        h = self.h
        total = plan.epochs * plan.spe
        start, replay = h.entry.start(total)
        if start is None:  # standby: the warm-up runs in epoch 0's body (in its ctx.steps())
            plan.warmup, plan.epoch = True, 0
            yield 0
            raise ConfigError("the body of `for epoch in ctx.epochs(...)` must run `for step in ctx.steps():`")
        plan.start, plan.replay = start, replay
        # A process entering the function again at an epoch's first step starts at the epoch before
        # it, with no step: the code after that epoch's steps may be where the others wait for it
        # (a collective there lost its rank), and it sees the state the rank saw there.
        first = max(start - 1, 0) if h.joining is not None else start
        for epoch in range(first // plan.spe if start < total else plan.epochs, plan.epochs):
            plan.epoch, plan.ran = epoch, False
            h.preloop.segment(f"e{epoch}")  # the code before this epoch's steps
            yield epoch
            if not plan.ran:
                raise ConfigError(f"epoch {epoch}'s body ended without running `for step in ctx.steps():` to "
                                  "its end: every epoch runs all its steps")  # fmt: skip
        h.preloop.leave()
        h.migration.at_boundary()  # the switch was voted at the last step
        h.pull.after_switch()

    def steps(self, total: int | None) -> Iterator[int]:
        """ctx.steps() inside an epoch: the epoch's global steps, from the resume step."""
        h, plan = self.h, self.plan
        assert plan is not None
        if plan.epoch < 0 or plan.ran or plan.running:
            raise ConfigError("ctx.steps() inside ctx.epochs() runs once per epoch, in the epoch's body")
        if total is not None and int(total) != plan.spe:
            raise ConfigError(f"ctx.steps({total}) in epoch {plan.epoch} of ctx.epochs(..., {plan.spe}): an "
                              f"epoch has {plan.spe} steps; call ctx.steps() without a count inside "
                              "ctx.epochs()")  # fmt: skip
        plan.running = True
        e, spe = plan.epoch, plan.spe
        if plan.warmup:
            yield from h.sandbox.shadow(spe)
            h.standby.wait_for_claim()  # raises Activate
        h.preloop.leave()
        if plan.replay and h.st.replay is not None and h.st.replay.step // spe == e:
            plan.replay = False
            yield from h.boundary.replay_step()
        yield from h.run(max(plan.start, e * spe), (e + 1) * spe)
        plan.ran, plan.running = True, False
        h.preloop.segment(f"t{e}")  # the code after this epoch's steps
