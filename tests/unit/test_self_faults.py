"""The fault plan's in-flight kills land inside the step they were planned for (CI budget: <1 s)."""

from __future__ import annotations

import signal
from types import SimpleNamespace

from livemig.config import ENV_SELF_FAULT, Role
from livemig.runtime import self_faults


def test_a_kill_in_flight_lands_at_the_next_point_of_the_step_when_its_timer_is_late(monkeypatch):
    """A loaded host fires the 2 ms timer late: the kill must not drift past the rank's
    commit point (an FSDP2 rank killed "during clip_norm" that commits and leaves its step
    is a different fault, one whose local state may be lost)."""
    kills: list[int] = []
    timers: list[tuple] = []

    class LateTimer:
        def __init__(self, delay, fn, args):
            timers.append((delay, fn, args))

        def start(self) -> None:  # never fires: the timer thread is starved
            pass

    monkeypatch.setenv(ENV_SELF_FAULT, "selfkill:step=6:at=clip_norm")
    monkeypatch.setattr(self_faults.threading, "Timer", LateTimer)
    monkeypatch.setattr(self_faults.os, "kill", lambda pid, sig: kills.append(sig))
    f = self_faults.SelfFaults(SimpleNamespace(role=Role.WORKER))
    f.at(5, "clip_norm")
    f.at(6, "fsdp_allgather")
    assert kills == [] and timers == []  # not due yet
    f.at(6, "clip_norm")
    assert len(timers) == 1 and kills == []  # armed, in flight
    f.at(6, "allreduce")  # the commit vote's point: the kill lands here at the latest
    assert kills == [signal.SIGKILL]
