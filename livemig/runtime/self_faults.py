"""Faults a worker injects into itself, for tests and `--fault ...:during=...`.

The one seam for test hooks: the step protocol calls `_maybe_self_fault`
and `_drop_avg` at named points and nothing else of it knows about faults.
"""

from __future__ import annotations

import logging
import os

from livemig.config import Role

log = logging.getLogger("livemig.runtime.self_faults")


class SelfFaults:
    """Mixed into api.Context; relies on the attributes Context.__init__ sets."""

    def _maybe_self_fault(self, t: int, at: str) -> None:
        f = self._self_fault
        if f and f[0] == "selfbreak" and f[1] == t and at == "allreduce" and self.role == Role.WORKER:
            from livemig.comm.group import CollectiveAborted

            self._self_fault = None  # once: the rebuilt group's collective goes through
            log.warning("test fault: the collective fails as on a broken socket", extra={"step": t})
            raise CollectiveAborted("collective failed: test fault (connection reset, every peer reachable)")
        if f and f[0] == "selfwedge" and f[1] == t and f[2] == at and self.role == Role.WORKER:
            import threading

            log.warning("test fault: the training thread blocks forever", extra={"step": t, "at": at})
            threading.Event().wait()  # a deadlock: only the lease and progress threads go on
        if f and f[0] == "selfkill" and f[1] == t and f[2] == at and self.role == Role.WORKER:
            import signal
            import threading

            if at in ("before_commit", "after_step"):
                os.kill(os.getpid(), signal.SIGKILL)
            # Die while our collective is in flight: peers may or may not complete it.
            threading.Timer(0.002, os.kill, (os.getpid(), signal.SIGKILL)).start()

    def _at_gate(self, step: int) -> None:
        """A fault plan's agent-side fault lands here, after `step` is committed and its
        boundary kept, before step+1 starts (livemig/fault_gate.py): wait for the agent.
        Marked busy, so the coordinator does not take the wait for a hang."""
        if self.runtime is None or self.warming_up:
            return
        self.runtime.set_busy(True)
        try:
            self._gate.wait(self.rank, step, self.incarnation)
        finally:
            self.runtime.set_busy(False)

    def _take_injected(self, step: int) -> None:
        """`livemig inject wedge|break` (asked through etcd, runtime.take_injected): lands in
        the next step as the plan's `wedge:step=S` / `break:step=S` would."""
        kind = self.runtime.take_injected()
        if kind is None or self.role != Role.WORKER:
            return
        log.warning("fault injection: taken at the step boundary", extra={"kind": kind, "step": step + 1})
        at = "compute" if kind == "wedge" else "allreduce"
        self._self_fault = ("selfwedge" if kind == "wedge" else "selfbreak", step + 1, at, 10.0)

    def _stall_after_snapshot(self) -> None:
        """`spare-hang:during=snapshot:resume=S`: a migrating spare stalls S seconds once its
        snapshot is loaded (a starved host), so the group runs ahead of what it can replay."""
        f = self._self_fault
        if f and f[0] == "selfstall" and f[2] == "snapshot":
            import time

            self._self_fault = None
            log.warning("test fault: the spare stalls after loading its snapshot", extra={"seconds": f[3]})
            time.sleep(f[3])

    def _drop_avg(self, t: int) -> bool:
        f = self._self_fault
        if f and f[0] == "drop_avg" and f[1] == t and self.role == Role.WORKER:
            self._self_fault = None
            return True
        return False

    def _at_commit_point(self, t: int, what: str) -> None:
        """The test faults of the commit point: a kill after the collective, or its result dropped."""
        self._maybe_self_fault(t, "before_commit")
        if self._drop_avg(t):
            from livemig.comm.group import CollectiveAborted

            raise CollectiveAborted(f"test fault: {what} dropped")
