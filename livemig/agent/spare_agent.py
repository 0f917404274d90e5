"""The agent of a standby host's spares (`livemig-spare start`): the same watch as
`livemig run`'s agent (agent/child_watch.py ChildWatch), over only the keys a spare's
agent needs.

It sleeps on what can change its work (agent/child_watch.py Wakeup): a spare's exit (a
pidfd each), a fence key written or removed, the job's result. A dead spare is
reported at once, a fenced spare that does not exit is killed after FENCED_KILL_S,
its fence key goes once it is reaped, and every spare stops when the job was
interrupted. Between changes it ticks at IDLE_TICK_S (the fenced-kill clock) and
reads no etcd: two watch-fed mirrors (the job's fence keys and its result key)
replace a read per spare per tick.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from typing import Any

from livemig.agent.child_watch import IDLE_TICK_S, ChildWatch, Wakeup
from livemig.agent.children import Child, kill_group, killed_wait_s
from livemig.config import Timeouts
from livemig.errors import EtcdUnavailableError, LivemigError
from livemig.logs import say
from livemig.rdzv.client import EtcdClient, conform
from livemig.rdzv.keys import JobKeys
from livemig.rdzv.watch import PrefixMirror

log = logging.getLogger("livemig.agent")


class _NoPlan:
    """A standby host runs no fault plan: nothing of its spares is stopped by one."""

    @staticmethod
    def stopped_by_plan(_child: Child) -> bool:
        return False

    @staticmethod
    def died(_child: Child, _code: int) -> None:
        """No in-process fault of a plan was armed here (agent/fault_driver.py)."""


class StandbyAgent:
    """Supervises the spares one `livemig-spare start` started until they all exited
    (or the job was interrupted, or SIGTERM/Ctrl-C). `run()` returns the first non-zero
    exit code (a signal as a shell reports it: 128 + n), else 0."""

    faults = _NoPlan()
    node_lease_file = ""  # its spares keep leases of their own (--node-leases is the workers')

    def __init__(self, client: EtcdClient, keys: JobKeys, children: list[Child], grace_s: float = 10.0) -> None:
        self.client = client
        self.keys = keys
        self.children = children
        self.grace_s = grace_s  # how long a spare told to stop has before it is killed
        self.watch = ChildWatch(self)
        self._wake = Wakeup()
        self._mirrors: list[PrefixMirror] = []
        self._outage = False

    def say(self, msg: str) -> None:
        say(msg)

    def run(self) -> int:
        """KeyboardInterrupt (Ctrl-C, or SIGTERM as the command maps it) stops the spares."""
        try:
            if why := self._loop():
                say(f"livemig-spare: job {self.keys.job} ended ({why}): its spares exit")
                self.stop_children()
                return 0
            if ended := self._ended():  # the spares saw the job's end themselves: say it too
                say(f"livemig-spare: job {self.keys.job} ended ({ended}): its spares exited")
        except KeyboardInterrupt:
            self.withdraw()
            self.stop_children()
            return 130
        finally:
            for m in self._mirrors:
                m.cancel()
            self._wake.close()
        self._report_deaths(min(10.0, Timeouts.from_env().etcd_outage.total_seconds()))
        bad = [c.proc.returncode for c in self.children if c.proc.returncode != 0]
        return (bad[0] if bad[0] >= 0 else 128 - bad[0]) if bad else 0

    def _loop(self) -> str:
        """Until every spare exited ('') or the job was interrupted (its reason)."""
        while any(c.proc.poll() is None for c in self.children):
            try:
                if not self._mirrors:  # made once etcd answers (it may be away when we start)
                    self._mirrors = self._mirror()
                by_key: dict[str, Any] = {}
                for m in self._mirrors:
                    by_key.update(m.by_key()[0])
                if why := self._interrupted(by_key):
                    return why
                self.watch.reap()
                self.watch.kill_fenced(by_key)
                self.watch.forget_fenced(by_key)
                if self._outage:
                    log.info("etcd answers again", extra={"job": self.keys.job})
                self._outage = False
            except EtcdUnavailableError as exc:  # an outage: the spares ride it through, and so do we
                if not self._outage:
                    log.warning("etcd unreachable; the spares' agent keeps watching them", extra={"err": str(exc)})
                self._outage = True
            self._wake.wait(self.children, IDLE_TICK_S)
        return ""

    def _mirror(self) -> list[PrefixMirror]:
        """The two mirrors this agent reads, each change a wake-up; none if etcd is away."""
        poke = self._wake.poke
        fences = PrefixMirror(self.client, self.keys.fenced_prefix, lambda _e: poke())
        try:
            result = PrefixMirror(self.client, self.keys.result, lambda _e: poke(), range_end=self.keys.result + "\0")
        except BaseException:
            fences.cancel()
            raise
        return [fences, result]

    def _interrupted(self, by_key: dict[str, Any]) -> str:
        """The reason, if the job's run was interrupted (Ctrl-C of a `livemig run`): its
        spares, claimed ones included, have nothing left to serve."""
        kv = by_key.get(self.keys.result)
        res = conform(kv.value, {"state": (str,)}) if kv is not None else None
        if res is not None and res["state"] == "interrupted":
            return str(res.get("reason") or "interrupted")
        return ""

    def _ended(self) -> str:
        """The job's end state, once it has one ('' if not, or etcd is gone with the job)."""
        try:
            kv = self.client.get(self.keys.result)
        except LivemigError:
            return ""
        res = conform(kv.value, {"state": (str,)}) if kv is not None else None
        return str(res["state"]) if res is not None else ""

    def _report_deaths(self, within_s: float) -> None:
        """The spares that died after the last pass: reported, their fence keys dropped.
        A clean exit needs neither (and the job's etcd may be gone with the job); etcd
        gets `within_s` at most, since the spare's lease tells the same a little later."""
        deadline = time.monotonic() + within_s
        while True:
            try:
                self.watch.reap()
                for c in self.children:
                    if c.proc.returncode not in (0, None):
                        self.client.delete(self.keys.fenced(c.incarnation))
                return
            except EtcdUnavailableError:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.5)

    def withdraw(self) -> None:
        """Take this agent's unclaimed spares out of the pool before they stop (a node drained,
        Ctrl-C): a claim in flight compares the spare's record, so none is claimed as it dies,
        and none is offered to a recovery for a lease TTL after it is gone."""
        mine = {c.incarnation for c in self.children}
        try:
            kvs, _ = self.client.get_prefix(self.keys.spares_prefix)
            for kv in kvs:
                rec = conform(kv.value, {"incarnation": (str,)}, {"state": (str,)})
                if rec is not None and rec["incarnation"] in mine and rec.get("state") != "claimed":
                    self.client.delete(kv.key)
        except LivemigError as exc:  # etcd away: their leases end them
            log.info("spares not withdrawn", extra={"err": str(exc)})

    def stop_children(self) -> None:
        """SIGTERM each spare's process group (SIGCONT first: a stopped one could not
        exit), then SIGKILL what is left after grace_s."""
        for c in self.children:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(c.proc.pid, signal.SIGCONT)
                os.killpg(c.proc.pid, signal.SIGTERM)
        for c in self.children:
            try:
                c.proc.wait(timeout=self.grace_s)
            except subprocess.TimeoutExpired:
                kill_group(c.proc.pid, c.name)
                with contextlib.suppress(subprocess.TimeoutExpired):  # bounded, as the launcher's stop
                    c.proc.wait(timeout=killed_wait_s())
