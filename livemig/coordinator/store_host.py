"""The coordinator's c10d store, in a process of its own.

Groups are built from a torch TCPStore, and hosting one costs `import torch` (~1.5 CPU s).
Imported inside the coordinator, that import held its interpreter for as long, just when
the job's first steps run and an early fault or migration needs a quick pass; so the store
lives here, started by the coordinator once training runs (coordinator.py, `_start_store`).

Protocol: prints `port <N>` on stdout once the store listens, then serves until its standard
input closes (the coordinator exited, however it exited) or it is terminated.

    python -m livemig.coordinator.store_host --host 127.0.0.1 --timeout 30
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from livemig.config import is_host_port
from livemig.errors import LivemigError
from livemig.rdzv.membership import GenState, Member, Membership

log = logging.getLogger("livemig.coordinator")
STANDBY_POLL_S = 0.5  # a candidate that does not lead: how often it looks whether the job trains yet


class StoreHost:
    """This leader's c10d store process, and which store a generation builds from. It owns
    the process and what is known of it; the coordinator asks it for addresses."""

    def __init__(self, host: str, keys: Any, timeouts: Any) -> None:
        self.host, self.keys, self.timeouts = host, keys, timeouts
        self.store: subprocess.Popen | None = None  # up: it printed its port
        self._store_addr = ""
        self._store_thread: threading.Thread | None = None
        self._store_err = ""
        self._store_starting: subprocess.Popen | None = None  # the process until it reports its port
        self._start_lock = threading.Lock()
        self._watcher: threading.Thread | None = None  # start_once_trained's

    # -- the c10d store -----------------------------------------------------------------------
    # Groups are built from a c10d TCPStore, and hosting one costs `import torch` (~1.5 CPU s).
    # At start-up that would compete with the workers' own imports for the CPUs, and inside
    # this process it would hold the interpreter while the first steps' passes run: so the
    # first generation builds from the store rank 0 hosts (its record's "store"), and this
    # leader's own runs in a child process (store_host.py) started once training runs; a
    # later generation uses it once it is up, rank 0's until then (for_generation).
    def start(self) -> None:
        with self._start_lock:  # the leader's pass and a standby candidate's watcher (coordinator.standby)
            self._start()

    def _start(self) -> None:
        if self.store is not None and self.store.poll() is not None:  # it died: a new one
            log.warning("c10d store process exited; starting another", extra={"code": self.store.returncode})
            self.store, self._store_thread = None, None
        if self.store is not None or self._store_thread is not None:
            return
        proc = subprocess.Popen(
            [sys.executable, "-m", "livemig.coordinator.store_host", "--host", self.host,
             "--timeout", str(self.timeouts.collective.total_seconds())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )  # fmt: skip
        self._store_starting = proc  # stopped at exit even while it still imports torch (_stop_store)

        def wait_port() -> None:
            line = proc.stdout.readline().decode().split() if proc.stdout else []
            if len(line) == 2 and line[0] == "port" and line[1].isdigit():
                self._store_addr = f"{self.host}:{line[1]}"
                self.store = proc
                log.info("c10d store up", extra={"store": self._store_addr})
            else:  # reported by store_addr, in the pass that needs it; the next one tries again
                self._store_err = f"store host exited with code {proc.wait()}"
                self._store_thread = None

        self._store_thread = threading.Thread(target=wait_port, daemon=True, name="livemig-c10d-store")
        self._store_thread.start()

    @property
    def starting(self) -> bool:
        return self._store_thread is not None and self.store is None

    def start_once_trained(self, read: Callable[[], Membership]) -> None:
        """Start the store once the job trains (`read`: the job's table), from a thread that polls
        it twice a second until then: a coordinator candidate that does not lead, so that a
        takeover finds its store up (coordinator.standby). Once per StoreHost."""
        if self._watcher is not None:
            return

        def watch() -> None:
            while self.store is None and not self.starting:
                try:
                    m: Membership | None = read()
                except LivemigError:
                    m = None  # etcd away: the next try
                if m is not None and m.state in (GenState.DONE, GenState.FAILED):
                    return
                if m is not None and m.generation >= 1 and m.state == GenState.COMMITTED:
                    self.start()
                    return
                time.sleep(STANDBY_POLL_S)

        self._watcher = threading.Thread(target=watch, daemon=True, name="livemig-standby-store")
        self._watcher.start()

    def stop(self) -> None:
        """The store process, up or still starting: one that has not printed its port yet
        would otherwise outlive us until its torch import ends and it sees stdin closed."""
        proc = self.store or getattr(self, "_store_starting", None)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.store = None
        self._store_starting = None

    @property
    def addr(self) -> str:
        """host:port of this leader's store, waited for if it is still starting (at most the
        collective timeout)."""
        self.start()
        if self.store is None:
            t = self._store_thread
            if t is not None:
                t.join(self.timeouts.collective.total_seconds())
            if self.store is None:
                raise LivemigError(f"the coordinator could not start its c10d store on {self.host}: "
                                   f"{self._store_err or 'timed out'}")  # fmt: skip
        return self._store_addr

    def for_generation(self, s: Any, members: dict[int, Member]) -> str:
        """The store a new generation builds from: this leader's own once it is made; until
        then (the first seconds of a job) rank 0's, if rank 0 is still the process serving
        it, so an early recovery or migration does not wait for the store process to start."""
        if self.store is None or self.store.poll() is not None:
            rec = s.get(self.keys.member(0)) or {}
            mem = members.get(0)
            if mem is not None and mem.incarnation == rec.get("incarnation") and is_host_port(rec.get("store")):
                return rec["store"]
        return self.addr


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m livemig.coordinator.store_host")
    p.add_argument("--host", default="127.0.0.1", help="address members reach the store at")
    p.add_argument("--timeout", type=float, default=30.0, help="the store's operation timeout, s")
    a = p.parse_args(argv)
    import torch.distributed as dist

    store = dist.TCPStore(a.host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=a.timeout))
    try:
        print(f"port {store.port}", flush=True)
    except BrokenPipeError:  # the coordinator ended (the job did) before the store was up
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0
    sys.stdin.read()  # returns at EOF: the coordinator is gone
    return 0


if __name__ == "__main__":
    sys.exit(main())
