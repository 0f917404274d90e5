"""The agent loop's sleep (agent/child_watch.py Wakeup): a child's exit and a poke end it at
once; otherwise it lasts its tick. And the standby host's agent built on it
(agent/spare_agent.py). Real child processes and a real etcd, no fakes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import pytest

from livemig.agent.child_watch import Wakeup
from livemig.agent.children import Child
from livemig.agent.spare_agent import StandbyAgent
from livemig.config import Role
from livemig.rdzv.client import EtcdClient, encode
from livemig.rdzv.keys import JobKeys


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


# -- the standby host's agent (agent/spare_agent.py): real etcd, real child processes --------------


def _spare(name: str, code: str) -> Child:
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    return Child(name, Role.SPARE, f"inc-{name}", proc, "")


def _run_agent(agent: StandbyAgent) -> tuple[threading.Thread, dict]:
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("rc", agent.run()), daemon=True)
    t.start()
    return t, out


@pytest.fixture
def job(etcd):
    client = EtcdClient(etcd.endpoints, timedelta(seconds=4))
    keys = JobKeys(f"standby-{time.monotonic_ns()}")
    made: list[Child] = []
    yield client, keys, made
    for c in made:
        if c.proc.poll() is None:
            os.killpg(c.proc.pid, signal.SIGKILL)
        c.proc.wait(timeout=10)
    client.close()


def test_a_standby_agent_reports_a_dead_spare_at_once_and_returns_its_code(job):
    """Budget: ~2 s. A spare that dies is a suspect in etcd within a pass (a pidfd wakes the
    agent), its fence key goes once reaped, and `livemig-spare start` exits with its code."""
    client, keys, made = job
    made += [_spare("a", "import time; time.sleep(0.5); raise SystemExit(3)"), _spare("b", "pass")]
    client.put(keys.fenced("inc-a"), b"{}")
    agent = StandbyAgent(client, keys, made)
    t, out = _run_agent(agent)
    t.join(timeout=15)
    assert out.get("rc") == 3
    sus = client.get(keys.suspect("inc-a"))
    assert sus is not None and b"exit code 3" in sus.value
    assert client.get(keys.suspect("inc-b")) is None  # a clean exit is no death
    assert client.get(keys.fenced("inc-a")) is None


def test_a_standby_agent_kills_a_fenced_spare_that_does_not_exit(job, monkeypatch):
    """Budget: ~2 s. A spare that cannot see its fence is killed FENCED_KILL_S after the
    fence key appears (the watch wakes the agent; its tick runs the clock)."""
    monkeypatch.setenv("LIVEMIG_FENCED_KILL_S", "0.5")
    client, keys, made = job
    made.append(_spare("w", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"))
    agent = StandbyAgent(client, keys, made)
    t, out = _run_agent(agent)
    time.sleep(0.3)
    t0 = time.monotonic()
    client.put(keys.fenced("inc-w"), b"{}")
    t.join(timeout=15)
    assert out.get("rc") == 128 + signal.SIGKILL and time.monotonic() - t0 < 3.0
    assert client.get(keys.fenced("inc-w")) is None


def test_a_standby_agent_stops_its_spares_when_the_job_was_interrupted(job):
    """Budget: ~1 s. A `livemig run` interrupted (Ctrl-C) ends its standby hosts' spares too."""
    client, keys, made = job
    made.append(_spare("s", "import time; time.sleep(60)"))
    agent = StandbyAgent(client, keys, made, grace_s=5)
    t, out = _run_agent(agent)
    time.sleep(0.3)
    client.put(keys.result, encode({"state": "interrupted", "reason": "Ctrl-C"}))
    t.join(timeout=15)
    assert out.get("rc") == 0 and made[0].proc.poll() == -signal.SIGTERM


def test_a_standby_agent_ends_even_when_a_killed_spares_exit_never_reaches_it(job, monkeypatch):
    """Budget: ~2 s. A spare forked by a zygote is known gone only when the zygote says so; a
    zygote gone or wedged must not keep the agent from ending: the wait after SIGKILL is bounded
    (LIVEMIG_KILLED_WAIT_S)."""
    monkeypatch.setenv("LIVEMIG_KILLED_WAIT_S", "0.5")
    client, keys, made = job
    code = "import signal as s, time; s.signal(s.SIGTERM, s.SIG_IGN); print('ready', flush=True); time.sleep(60)"
    real = subprocess.Popen([sys.executable, "-c", code], start_new_session=True, stdout=subprocess.PIPE)
    made.append(Child("z", Role.SPARE, "inc-z", real, ""))
    assert real.stdout.readline() == b"ready\n"  # SIGTERM ignored from now on (a loaded machine starts it late)
    real.stdout.close()

    class Unheard:  # the agent's handle of a child whose exit is never reported (a wedged zygote)
        pid, args, returncode = real.pid, real.args, None

        def poll(self) -> None:
            return None

        def wait(self, timeout: float | None = None) -> int:
            time.sleep(timeout if timeout is not None else 3600)
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)

    made[0].proc = Unheard()
    try:
        agent = StandbyAgent(client, keys, made, grace_s=0.3)
        t, out = _run_agent(agent)
        time.sleep(0.3)
        t0 = time.monotonic()
        client.put(keys.result, encode({"state": "interrupted", "reason": "Ctrl-C"}))
        t.join(timeout=15)
        assert out.get("rc") == 0 and time.monotonic() - t0 < 5.0, out
        assert real.wait(timeout=5) == -signal.SIGKILL  # the spare itself was killed
    finally:
        made[0].proc = real  # the fixture's clean-up sees the real process
