"""Faults that land on their step, however fast the steps are.

An agent-side fault with `step=S` (kill, hang, slow, corrupt, partition, link,
migrate; and, without a rank, etcd-kill, etcd-stop, coordinator-kill, spare-kill,
spare-hang) used to be carried out once the agent *saw* rank R's progress record
of S: with steps of a few ms that record arrives many steps late. Now the process
holding rank R (any rank, for a fault without one) stops at the boundary after it
commits S, before it starts S+1, and asks its agent over a local socket; the
agent carries the fault out and answers "go" (a killed process never hears it).
A planned migration holds the rank until the coordinator has claimed a spare for
it (or refused), so the migration starts from step S whatever the spares' warm-up.

Only processes this agent started hear of its gates (LIVEMIG_FAULT_GATE names the
socket, LIVEMIG_FAULT_PLAN the plan); a run without a fault plan has no gate and
pays nothing. A fault with `after=` or `during=<phase>` keeps its own timing (no
gate). A gate the agent does not answer within LIVEMIG_FAULT_GATE_TIMEOUT (default
20 s; keep it below --collective-timeout, which the other ranks wait under) is
passed with a warning. The plan also lets every worker refuse, before step 0, a
fault whose step the job never reaches.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from livemig.config import ENV_FAULT_GATE, ENV_FAULT_PLAN, ENV_GATE_TIMEOUT
from livemig.errors import ConfigError
from livemig.faults import Fault

log = logging.getLogger("livemig.fault_gate")

GATED_KINDS = ("kill", "hang", "slow", "corrupt", "partition", "link", "migrate",
               "etcd-kill", "etcd-stop", "coordinator-kill", "spare-kill", "spare-hang")  # fmt: skip


def gate_timeout() -> float:
    raw = os.environ.get(ENV_GATE_TIMEOUT, "20")
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"{ENV_GATE_TIMEOUT}={raw!r} is not a number of seconds") from None


def onward(f: Fault) -> bool:
    """Does this fault's target stop at every boundary from step S on until the fault lands
    (`during=migrated`: it lands at a boundary, whichever step the migration ends at)? The
    agent answers "go" while the condition does not hold, and "end" once no such fault waits."""
    return (f.kind in GATED_KINDS and f.phase == "migrated" and f.rank is not None and not f.in_process
            and f.after == 0)  # fmt: skip


def gated(f: Fault) -> bool:
    """Does this fault stop its target at the boundary after step S (or, onward, after S or later)?"""
    return f.kind in GATED_KINDS and not f.in_process and (not f.phase or onward(f)) and f.after == 0


def plan_env(faults: list[Fault]) -> str:
    """LIVEMIG_FAULT_PLAN: what a worker needs to gate and to check the plan's steps."""
    return json.dumps([{"kind": f.kind, "rank": f.rank, "step": f.step, "during": f.during, "gate": gated(f),
                        "onward": onward(f)} for f in faults])  # fmt: skip


@dataclass
class Arrival:
    """A process waiting at a gate."""

    conn: socket.socket
    rank: int
    step: int
    incarnation: str
    since: float


class GateServer:
    """The agent's end: a Unix socket in a fresh short directory (a filesystem path, not
    the abstract namespace, so a worker in a network namespace of its own reaches it)."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._dir = tempfile.mkdtemp(prefix="livemig-gate-")
        self.path = os.path.join(self._dir, "s")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.path)
        self._sock.listen(64)
        self._lock = threading.Lock()
        self._arrivals: list[Arrival] = []
        self._wake = wake
        self._closed = False
        threading.Thread(target=self._accept, name="livemig-fault-gate", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._read, args=(conn,), daemon=True, name="livemig-fault-gate-conn").start()

    def _read(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(5.0)
            line = conn.makefile("rb").readline(4096)
            msg = json.loads(line)
            arr = Arrival(conn, int(msg["rank"]), int(msg["step"]), str(msg.get("incarnation", "")), time.monotonic())
        except (OSError, ValueError, KeyError, TypeError):
            conn.close()
            return
        with self._lock:
            self._arrivals.append(arr)
        self._wake()

    def take(self) -> list[Arrival]:
        with self._lock:
            out, self._arrivals = self._arrivals, []
        return out

    @staticmethod
    def release(arr: Arrival, word: bytes = b"go") -> None:
        """Let the waiting process go on; `end`: and stop at no more onward boundaries."""
        with contextlib.suppress(OSError):
            arr.conn.sendall(word + b"\n")
        with contextlib.suppress(OSError):
            arr.conn.close()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.close()
        for arr in self.take():
            self.release(arr)
        shutil.rmtree(self._dir, ignore_errors=True)


class Gate:
    """The worker's end, built from the environment its agent gave it."""

    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.path = env.get(ENV_FAULT_GATE, "")
        try:
            self.plan: list[dict[str, Any]] = json.loads(env.get(ENV_FAULT_PLAN) or "[]")
        except ValueError:
            raise ConfigError(f"{ENV_FAULT_PLAN} is not the JSON livemig run writes") from None
        self._steps = {(p["rank"], p["step"]) for p in self.plan if p.get("gate") and not p.get("onward")}
        self._onward: dict[int, int] = {}  # rank -> the first step it stops at every boundary from
        for p in self.plan:
            if p.get("gate") and p.get("onward"):
                self._onward[p["rank"]] = min(p["step"], self._onward.get(p["rank"], p["step"]))

    def check_total(self, total: int) -> None:
        """A fault the job never reaches measures nothing: refused before step 0."""
        for p in self.plan:
            if p["step"] >= total:
                who = f" of rank {p['rank']}" if p["rank"] is not None else ""
                raise ConfigError(
                    f"the fault plan's {p['kind']}{who} at step {p['step']} would never land: the job runs "
                    f"steps 0..{total - 1} (ctx.steps({total})); give a step below {total}"
                )

    def wants(self, rank: int, step: int) -> bool:
        if not self.path:
            return False
        return (rank, step) in self._steps or (None, step) in self._steps or step >= self._onward.get(rank, step + 1)

    def only_onward(self, rank: int, step: int) -> bool:
        """A boundary only an onward fault stops at: answered at once (or the fault lands), so
        the member is not marked busy for it (two urgent progress records a step)."""
        return (rank, step) not in self._steps and (None, step) not in self._steps

    def wait(self, rank: int, step: int, incarnation: str) -> None:
        """Tell the agent we are at the boundary after `step`; return once it says go."""
        limit = gate_timeout()
        t0 = time.monotonic()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(limit)
                s.connect(self.path)
                s.sendall(json.dumps({"rank": rank, "step": step, "incarnation": incarnation}).encode() + b"\n")
                reply = s.makefile("rb").readline(16)
        except OSError as exc:
            log.warning("fault gate: no word from the agent; going on",
                        extra={"step": step, "rank": rank, "why": str(exc)})  # fmt: skip
            return
        if reply.strip() == b"end":  # no onward fault of the plan waits for this rank any more
            self._onward.pop(rank, None)
        elif reply.strip() != b"go":
            log.warning("fault gate: the agent closed the gate without a word; going on", extra={"step": step})
            return
        log.info("fault gate passed", extra={"step": step, "rank": rank, "waited_s": round(time.monotonic() - t0, 4)})
