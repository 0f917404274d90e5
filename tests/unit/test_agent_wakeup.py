"""The agent loop's sleep (agent/watch.py Wakeup): a child's exit and a poke end it at
once; otherwise it lasts its tick. Real child processes, no fakes."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import pytest

from livemig.agent.watch import Wakeup


@dataclass
class _Kid:
    proc: subprocess.Popen


@pytest.fixture
def kids():
    started: list[_Kid] = []

    def start(seconds: float) -> _Kid:
        k = _Kid(subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"]))
        started.append(k)
        return k

    yield start
    for k in started:
        if k.proc.poll() is None:
            k.proc.kill()
        k.proc.wait(timeout=10)


@pytest.fixture
def w():
    wake = Wakeup()
    yield wake
    wake.close()


def test_a_child_exit_ends_the_wait_at_once(kids, w):
    if not w.exits_seen:
        pytest.skip("no pidfd on this kernel: exits are seen at the fine tick")
    long, short = kids(30), kids(0.3)
    time.sleep(0.2)  # both running when the wait starts
    t0 = time.monotonic()
    w.wait([long, short], 5.0)
    took = time.monotonic() - t0
    assert short.proc.poll() is not None and long.proc.poll() is None
    assert took < 2.0, f"the wait lasted {took:.2f}s after a child exited"
    # reaped children are dropped: the next wait is the tick again, not an instant return
    t0 = time.monotonic()
    w.wait([long, short], 0.3)
    assert time.monotonic() - t0 >= 0.25


def test_a_poke_ends_the_wait_and_is_drained(kids, w):
    k = kids(30)
    threading.Timer(0.2, w.poke).start()
    t0 = time.monotonic()
    w.wait([k], 5.0)
    assert time.monotonic() - t0 < 2.0
    for _ in range(100):  # many pokes make one wake-up, and leave nothing behind
        w.poke()
    w.wait([k], 0.0)
    t0 = time.monotonic()
    w.wait([k], 0.3)
    assert time.monotonic() - t0 >= 0.25


def test_without_events_the_wait_lasts_its_tick(kids, w):
    k = kids(30)
    t0 = time.monotonic()
    w.wait([k], 0.4)
    took = time.monotonic() - t0
    assert 0.35 <= took < 2.0 if w.exits_seen else took < 2.0
