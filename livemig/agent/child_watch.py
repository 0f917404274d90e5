"""The agent's watch of its children (`livemig run`): report a dead child to etcd at
once, kill a fenced child that cannot see its fence, drop the fence keys of reaped
children, note when spares are warm, print progress lines. Composed by
agent/launcher.py's Launcher, which owns the children, the client and the keys.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import time
from typing import TYPE_CHECKING, Any

from livemig.agent.children import fenced_too_long, kill_group, report_death
from livemig.config import Role
from livemig.rdzv.client import conform
from livemig.rdzv.membership import Membership
from livemig.rdzv.writes import delete_if_unchanged

if TYPE_CHECKING:
    from livemig.agent.children import Agent, Child

log = logging.getLogger("livemig.agent.child_watch")

FINE_TICK_S = 0.02  # the agent's tick while a fault plan runs (step triggers, SIGSTOP duty cycles)
IDLE_TICK_S = 0.25  # its tick otherwise: fence kills, progress lines, the job's end
PROBE_S = 1.0  # how often an idle agent reads etcd once to notice an outage


class Wakeup:
    """What the agent loop sleeps on between passes: a change in etcd (poke(), from the
    mirror's callback), a child's exit (one pidfd per running child), or its tick. A
    dead child is then reported at once instead of at the next tick, and an idle job
    costs the agent (and etcd) a few passes a second instead of 50."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._pidfds: dict[int, int] = {}  # pid -> pidfd of a child not reaped yet
        self.exits_seen = hasattr(os, "pidfd_open")  # else a child's exit is seen at the tick

    def poke(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):  # full: a wake-up is pending anyway
            os.write(self._w, b"\0")

    def _fds(self, children: list[Any]) -> list[int]:
        live = {c.proc.pid for c in children if c.proc.returncode is None}
        for pid in [p for p in self._pidfds if p not in live]:
            os.close(self._pidfds.pop(pid))
        for pid in live - self._pidfds.keys():
            if not self.exits_seen:
                break
            try:
                self._pidfds[pid] = os.pidfd_open(pid)
            except OSError:  # no pidfd support, or the pid is gone: exits are seen at the fine tick from now on
                self.exits_seen = False
        return [self._r, *self._pidfds.values()]

    def wait(self, children: list[Any], timeout: float) -> None:
        """Sleep up to timeout, less if something changed; drain the pokes."""
        fds = self._fds(children)
        if not self.exits_seen:
            timeout = min(timeout, FINE_TICK_S)
        ready, _, _ = select.select(fds, [], [], max(0.0, timeout))
        if self._r in ready:
            with contextlib.suppress(BlockingIOError, OSError):
                while os.read(self._r, 4096):
                    pass

    def close(self) -> None:
        for fd in [self._r, self._w, *self._pidfds.values()]:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._pidfds.clear()


class ChildWatch:
    """What an agent watches of its children (see the module doc). It owns what it
    remembers (fences first seen, spares warm, the progress line); the children, the
    client and the keys are its agent's."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self._fenced_seen: dict[str, float] = {}  # incarnation -> when its fence was first seen
        self._killed: set[str] = set()  # incarnations kill_fenced SIGKILLed (said once)
        self.spares_warm: dict[str, float] = {}  # spare id -> when it first reported warm (wall time)
        self._progress_cache: dict[str, tuple[int, dict | None]] = {}  # key -> (mod revision, record)
        self._last_print = -1
        self._t_print = 0.0  # the wall time of the last printed step's commit (its record's)
        self._stopped: dict[str, float] = {}  # --node-leases: incarnation -> when first seen stopped
        self._dropped: set[str] = set()  # --node-leases: incarnations whose registration this agent deleted

    def note_warm_spares(self, by_key: dict) -> None:
        """When each spare of the job first reported warm (the report's `spares_warm`)."""
        for k, kv in by_key.items():
            if k.startswith(self.agent.keys.spares_prefix) and k not in self.spares_warm:
                rec = conform(kv.value, {"state": (str,)}, {"warm_at": (float,)})
                if rec is not None and rec["state"] == "warm":
                    self.spares_warm[k[len(self.agent.keys.spares_prefix) :]] = rec.get("warm_at", time.time())

    def is_member(self, c: Child, by_key: dict) -> bool:
        m = Membership.from_kvs(by_key, self.agent.keys)
        return m.rank_of(c.incarnation, c.rank) is not None

    def reap(self) -> None:
        """Report a child that died to etcd at once: the fast detection path."""
        assert self.agent.client is not None
        for c in self.agent.children:
            code = c.proc.poll()
            if code is None or c.reported or c.role == Role.COORDINATOR:
                continue
            if code == 0:
                c.reported = True
                continue
            if c.died_at is None:
                c.died_at = time.time()
            report_death(self.agent.client, self.agent.keys, c.incarnation, c.name, code, c.died_at)
            self.drop_registration(c)  # in an etcd outage it raises: both are tried again once etcd answers
            c.reported = True
            self.agent.faults.died(c, code)  # an in-process kill of the fault plan landed

    def drop_registration(self, c: Child) -> None:
        """--node-leases: a worker's key lives under this agent's lease, so its death or stop
        does not end it: delete it here (what its own lease's expiry did), only while it is
        still that worker's (a replacement's key under the same rank stays)."""
        if not self.agent.node_lease_file or c.role != Role.WORKER or c.rank is None or c.incarnation in self._dropped:
            return
        client, key = self.agent.client, self.agent.keys.member(c.rank)
        assert client is not None
        kv = client.get(key)
        if kv is not None and (conform(kv.value, {"incarnation": (str,)}) or {}).get("incarnation") == c.incarnation:
            delete_if_unchanged(client, kv)
            log.warning("registration dropped", extra={"child": c.name, "rank": c.rank})
        self._dropped.add(c.incarnation)

    def stopped(self) -> None:
        """--node-leases: a worker stopped (SIGSTOP: its state T in /proc) for a lease TTL loses
        its registration, as its own lease expired under the stop before: the recovery
        starts as soon as it did without node leases."""
        if not self.agent.node_lease_file:
            return
        now = time.monotonic()
        ttl = self.agent.cfg.timeouts.lease_ttl_s
        for c in self.agent.children:
            if c.role != Role.WORKER or c.proc.poll() is not None or c.incarnation in self._dropped:
                continue
            if self.agent.faults.slowing(c):
                self._stopped.pop(c.incarnation, None)
                continue
            try:
                with open(f"/proc/{c.proc.pid}/stat", "rb") as f:
                    state = f.read().rsplit(b")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state not in (b"T", b"t"):
                self._stopped.pop(c.incarnation, None)
            elif now - self._stopped.setdefault(c.incarnation, now) >= ttl:
                self.drop_registration(c)

    def cannot_form(self, by_key: dict) -> str:
        """Why the job can never start ('' while it can): one of our workers exited before
        the job formed (a syntax error, an exception at import, a script that never
        reaches ctx.steps()). Forming needs every rank's worker, and no spare stands in
        before the job has state, so the run ends now instead of at --max-wall."""
        raw = by_key.get(self.agent.keys.membership)
        if raw is not None and Membership.from_bytes(raw.value).generation > 0:
            return ""  # formed (or forming): a death is a recovery's business now
        for c in self.agent.children:
            code = c.proc.poll() if c.role == Role.WORKER else None
            if code is None:
                continue
            if code == 0:
                return (f"{c.name} returned before the job formed: its training function ended without "
                        "running `for step in ctx.steps(n)` (is the @livemig.elastic function called?)")  # fmt: skip
            why = f"signal {-code}" if code < 0 else f"exit code {code}"
            last = _last_error(c.log_path)
            return (f"{c.name} exited ({why}) before the job formed: the script fails before it trains"
                    f"{': ' + last if last else ''} ({c.log_path})")  # fmt: skip
        return ""

    def kill_fenced(self, by_key: dict) -> None:
        """A fenced worker or spare still running after FENCED_KILL_S is wedged (its training
        thread cannot see the fence): kill it, so no replaced process lingers."""
        for c in self.agent.children:
            if c.role == Role.COORDINATOR or c.proc.poll() is not None:
                continue
            if by_key.get(self.agent.keys.fenced(c.incarnation)) is None:
                continue
            if self.agent.faults.stopped_by_plan(c):
                self._fenced_seen.pop(c.incarnation, None)  # stopped by a fault plan: its clock starts once resumed
                continue
            if fenced_too_long(self._fenced_seen, c.incarnation):
                # killed once, said once: it stays unreaped (poll) for a pass or more after SIGKILL
                kill_group(c.proc.pid, c.name, say=c.incarnation not in self._killed)
                self._killed.add(c.incarnation)

    def forget_fenced(self, by_key: dict) -> None:
        """A fence key exists to refuse a zombie's writes; once this agent has reaped the
        process it can write nothing, so the key goes (a bounded etcd footprint)."""
        assert self.agent.client is not None
        for c in self.agent.children:
            if c.proc.poll() is not None and c.reported and self.agent.keys.fenced(c.incarnation) in by_key:
                self.agent.client.delete(self.agent.keys.fenced(c.incarnation))

    def progress(self, by_key: dict) -> None:
        """Print a progress line every --log-every steps of the slowest rank. Each record is
        decoded once per change (by mod revision), not every tick; one that is not a progress
        record (anyone with etcd access can write one) is skipped."""
        steps = {}
        cache = self._progress_cache
        for k, kv in by_key.items():
            if k.startswith(self.agent.keys.progress_prefix):
                hit = cache.get(k)
                if hit is None or hit[0] != kv.mod_revision:
                    hit = cache[k] = (kv.mod_revision, conform(kv.value, {"step": (int,)}, {
                        "generation": (int,), "loss": (float,), "time": (float, int)}))  # fmt: skip
                if hit[1] is not None:
                    steps[k] = hit[1]
        if not steps:
            return
        low = min(s["step"] for s in steps.values())
        window = self.agent.cfg.log_every
        if (low + 1) // window > (self._last_print + 1) // window:
            # the rate from the slowest rank's own commit times (its record's wall time), not from
            # when this agent saw the records: watch events arrive in bursts, and a burst read
            # 801 steps/s for 6 ms steps. A rate needs two lines: the first would count start-up.
            now = max((float(s.get("time") or 0.0) for s in steps.values() if s["step"] == low), default=0.0)
            rate = ((low - self._last_print) / (now - self._t_print)
                    if self._last_print >= 0 and now > self._t_print > 0 else None)  # fmt: skip
            loss = steps.get(self.agent.keys.progress(0), {}).get("loss")
            gen = max(s.get("generation", 0) for s in steps.values())
            loss_s = f"  loss {loss:.5f}" if isinstance(loss, float) else ""
            rate_s = f"  {rate:.2f} steps/s" if rate is not None else ""
            self.agent.say(f"step {low + 1:>6}{loss_s}{rate_s}  generation {gen}")
            self._last_print, self._t_print = low, now


def _last_error(path: str) -> str:
    """The line of a child's log that says what failed (livemig's "error:" line, else the last
    line of a traceback), so the run's one line names the cause, not only the log."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            lines = [x.strip() for x in f.read().decode(errors="replace").splitlines() if x.strip()]
    except OSError:
        return ""
    mine = [x for x in lines if x.startswith("livemig: error:")]
    line = mine[-1][len("livemig: error:") :].strip() if mine else (lines[-1] if lines else "")
    return line[:300]
