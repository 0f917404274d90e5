"""Faults a worker injects into itself, for tests and `--fault ...:during=...`.

The member's one seam for test faults: the step protocol calls `SelfFaults` at named points
(`at`, `at_commit_point`, `at_boundary`, `stall_after_snapshot`, `during_checkpoint`,
`corrupt_next_serve`) and nothing else of the member knows about faults. The fault plan's gate
(livemig/fault_gate.py) lives here too: both are the plan reaching into the step. Outside the
member, the state server's `Hooks` (transfer/server.py) is the seam a test or this class sets,
and the agent's FaultDriver (agent/fault_driver.py) carries out the plan's process-level faults.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from livemig.config import ENV_SELF_FAULT, Role
from livemig.fault_gate import Gate
from livemig.faults import SelfFault, parse_self_fault

if TYPE_CHECKING:
    from livemig.runtime.member import MemberRuntime

log = logging.getLogger("livemig.runtime.self_faults")


class FaultsHost(Protocol):
    """What the test faults and the fault plan's gate read of their member (api.Engine's fields)."""

    role: Role
    rank: int
    incarnation: str
    runtime: MemberRuntime  # None outside `livemig run` (and until api.Engine makes it): tested before use

    @property
    def warming_up(self) -> bool: ...


class SelfFaults:
    """Owned by api.Engine: the pending self-fault and the plan's gate. Reads the
    context's rank, runtime and warming_up when a point is reached (a spare's rank changes
    when it is claimed)."""

    def __init__(self, ctx: FaultsHost) -> None:
        self._ctx = ctx
        raw = os.environ.get(ENV_SELF_FAULT)
        self.fault: SelfFault | None = parse_self_fault(raw) if raw else None
        self.gate = Gate({} if ctx.role == Role.LOCAL else None)
        self._dying = False  # a kill in flight (during=<collective>) whose timer has not fired yet

    def _due(self, kind: str, t: int, at: str | None = None) -> SelfFault | None:
        f = self.fault
        if f is None or f.kind != kind or f.step != t or self._ctx.role != Role.WORKER:
            return None
        return f if at is None or f.at == at else None

    def at(self, t: int, at: str) -> None:
        """Point `at` of step t: a break, a wedge or a kill planned for it lands now."""
        if self._dying:  # a kill planned inside a collective lands before this rank's next point at
            os.kill(os.getpid(), signal.SIGKILL)  # the latest (a loaded host fires the timer late)
        if at == "allreduce" and self._due("selfbreak", t):
            from livemig.comm.group import CollectiveAborted

            self.fault = None  # once: the rebuilt group's collective goes through
            log.warning("test fault: the collective fails as on a broken socket", extra={"step": t})
            raise CollectiveAborted("collective failed: test fault (connection reset, every peer reachable)")
        if self._due("selfwedge", t, at):
            log.warning("test fault: the training thread blocks forever", extra={"step": t, "at": at})
            threading.Event().wait()  # a deadlock: only the lease and progress threads go on
        if self._due("selfkill", t, at):
            if at in ("before_commit", "after_step"):
                os.kill(os.getpid(), signal.SIGKILL)
            # Die while our collective is in flight: peers may or may not complete it. A timer
            # that fires late (a loaded host) must not let the kill drift past this rank's
            # commit point: the next point of the step kills at once (_dying).
            self._dying = True
            threading.Timer(0.002, os.kill, (os.getpid(), signal.SIGKILL)).start()

    def during_checkpoint(self, step: int) -> None:
        """`kill:rank=R:step=S:during=checkpoint`: rank R dies in its checkpoint writer once
        the part of boundary S is staged and written, before it is durable (no marker)."""
        if self._due("selfkill", step, "checkpoint"):
            log.warning("test fault: killed while writing a checkpoint", extra={"step": step})
            os.kill(os.getpid(), signal.SIGKILL)

    def at_commit_point(self, t: int, what: str) -> None:
        """The test faults of the commit point: a kill after the collective, or its result dropped."""
        self.at(t, "before_commit")
        if self._due("drop_avg", t):
            from livemig.comm.group import CollectiveAborted

            self.fault = None
            raise CollectiveAborted(f"test fault: {what} dropped")

    def at_boundary(self, step: int) -> None:
        """After `step` is committed and its boundary kept, before step+1 starts: the plan's
        agent-side fault for this step, then a `livemig inject wedge|break` taken."""
        ctx = self._ctx
        if self.gate.wants(ctx.rank, step) and ctx.runtime is not None and not ctx.warming_up:
            if self.gate.only_onward(ctx.rank, step):
                self.gate.wait(ctx.rank, step, ctx.incarnation)
            else:
                # Marked busy, so the coordinator does not take the wait for the agent for a hang.
                ctx.runtime.report.set_busy(True)
                try:
                    self.gate.wait(ctx.rank, step, ctx.incarnation)
                finally:
                    ctx.runtime.report.set_busy(False)
        if ctx.runtime is not None and ctx.runtime.injected is not None:
            self._take_injected(step)

    def _take_injected(self, step: int) -> None:
        """`livemig inject wedge|break` (asked through etcd, runtime.take_injected): lands in
        the next step as the plan's `wedge:step=S` / `break:step=S` would."""
        kind = self._ctx.runtime.take_injected()
        if kind is None or self._ctx.role != Role.WORKER:
            return
        log.warning("fault injection: taken at the step boundary", extra={"kind": kind, "step": step + 1})
        self.fault = SelfFault("selfwedge", step + 1, "compute") if kind == "wedge" else SelfFault(
            "selfbreak", step + 1, "allreduce")  # fmt: skip

    def stall_after_snapshot(self, group_at: Callable[[int, float], bool]) -> None:
        """`spare-hang:during=snapshot:resume=S`: a migrating spare stalls S seconds once its
        snapshot is loaded (a starved host), so the group runs ahead of what it can replay;
        with `ahead=K` until `group_at(K, S)` returns (the group committed K steps past the
        snapshot, or S seconds passed), so the catch-up is K steps long however slow the host's
        steps are. A snapshot the group has left behind already (`group_at` False: on a loaded
        host the stream took longer than the steps the source keeps) is not stalled on: the
        fault waits for the newer snapshot the spare loads next."""
        f = self.fault
        if f is not None and f.kind == "selfstall" and f.at == "snapshot":
            if f.ahead:
                if not group_at(f.ahead, f.seconds):
                    log.warning("test fault: the snapshot is behind the group already; the stall waits for the next")
                    return
                self.fault = None
                log.warning("test fault: the spare stalled after loading its snapshot", extra={"ahead": f.ahead})
                return
            self.fault = None
            log.warning("test fault: the spare stalls after loading its snapshot", extra={"seconds": f.seconds})
            time.sleep(f.seconds)

    def corrupt_next_serve(self, server: Any) -> None:
        """`livemig inject corrupt --rank R` (or the plan's `corrupt:rank=R`): the first chunk
        this survivor serves in the recovery being served is corrupted, so the spare's checksum
        refuses it and pulls from another peer. Asked through the watch the member keeps for
        injections (runtime/member.py), so a run without one reads nothing from etcd here."""
        rt = self._ctx.runtime
        if not rt.corrupt_asked:
            return
        rt.corrupt_asked = False
        rt.client.delete(rt.keys.inject_self(self._ctx.incarnation))  # the command's acknowledgement
        server.hooks.corrupt_next = True
        log.warning("fault injection: the first chunk served will be corrupted", extra={"rank": self._ctx.rank})
