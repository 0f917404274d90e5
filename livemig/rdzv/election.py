"""Coordinator leader election on one key under a lease.

One leader at a time: the key is created only if absent (create_revision
== 0) and lives under the leader's lease. A standby watches the key and
campaigns when it is deleted, so it takes over within one lease TTL of the
old leader's death. Every coordinator write carries `guard()`, a compare on
the key's value, so a deposed leader's writes are refused by etcd itself.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from livemig.errors import NotLeaderError
from livemig.rdzv.client import EtcdClient
from livemig.rdzv.keys import JobKeys
from livemig.rdzv.lease import LeaseKeeper
from livemig.rdzv.watch import wait_for

log = logging.getLogger("livemig.rdzv.election")


class LeaderElection:
    def __init__(
        self,
        client: EtcdClient,
        job: str,
        candidate: str,
        ttl_s: int,
        on_lost: Callable[[str], None] | None = None,
    ) -> None:
        self.client = client
        self.keys = JobKeys(job)
        self.candidate = candidate
        self.ttl_s = ttl_s
        self.on_lost = on_lost
        self.keeper: LeaseKeeper | None = None
        self.is_leader = threading.Event()

    def try_acquire(self) -> bool:
        if self.keeper is None or self.keeper.lost.is_set():
            self.keeper = LeaseKeeper(self.client, self.ttl_s, self._lost, name="leader")
        t = self.client.txn_ops
        ok, _ = self.client.txn(
            [t.create(self.keys.leader) == 0],
            [t.put(self.keys.leader, self.candidate.encode(), self.keeper.lease_id)],
        )
        if ok:
            self.is_leader.set()
            log.info("became leader", extra={"candidate": self.candidate})
        return ok

    def campaign(self, timeout: float | None = None, stop: Callable[[], bool] | None = None,
                 waiting: Callable[[], None] | None = None) -> None:  # fmt: skip
        """Block until this candidate leads (TimeoutError after `timeout`); `waiting` runs at
        each failed try (a standby candidate's preparation for taking over)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.try_acquire():
            if waiting is not None:
                waiting()
            left = 3600.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.candidate} did not become leader within {timeout}s")
            try:
                wait_for(
                    self.client,
                    self.keys.leader,
                    lambda s: self.keys.leader not in s,
                    timeout=min(left, self.ttl_s + 1.0),
                    what="leader key to be free",
                    abort=stop,
                )
            except TimeoutError:
                pass

    def guard(self) -> Any:
        """Compare to put in every coordinator transaction."""
        if not self.is_leader.is_set():
            raise NotLeaderError(f"{self.candidate} is not the leader")
        return self.client.txn_ops.value(self.keys.leader) == self.candidate

    def leader(self) -> str | None:
        kv = self.client.get(self.keys.leader)
        return kv.value.decode() if kv else None

    def _lost(self, reason: str) -> None:
        self.is_leader.clear()
        if self.on_lost:
            self.on_lost(reason)

    def resign(self) -> None:
        self.is_leader.clear()
        if self.keeper is not None:
            self.keeper.stop(revoke=True)
            self.keeper = None  # a new term needs a new lease: the revoked one cannot carry the key
