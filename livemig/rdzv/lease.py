"""Leases with a keep-alive thread that tells its owner when the lease is lost.

A lease is lost when etcd says it is gone (TTL <= 0 on renewal: it expired
while we were stopped or partitioned, or it was revoked by a fence), or when
we could not renew it for a whole TTL (etcd unreachable: it has expired by
now as far as the cluster is concerned).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from livemig.errors import EtcdUnavailableError
from livemig.rdzv.client import EtcdClient

log = logging.getLogger("livemig.rdzv.lease")


class LeaseKeeper:
    def __init__(
        self,
        client: EtcdClient,
        ttl_s: int,
        on_lost: Callable[[str], None] | None = None,
        name: str = "lease",
    ) -> None:
        self.client = client
        self.ttl_s = int(ttl_s)
        self.on_lost = on_lost
        self.name = name
        self.lease_id = client.grant(self.ttl_s)
        self._stop = threading.Event()
        self.lost = threading.Event()
        self.lost_reason = ""
        self._last_ok = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"livemig-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        interval = max(0.1, self.ttl_s / 3)
        while not self._stop.wait(interval):
            try:
                ttl = self.client.keepalive_once(self.lease_id)
            except EtcdUnavailableError as exc:
                if time.monotonic() - self._last_ok > self.ttl_s:
                    self._lose(f"could not renew for {self.ttl_s}s: {exc}")
                    return
                continue
            # A stopped process resumed after its TTL: the clock says so even
            # if etcd has not yet reaped the lease.
            if ttl <= 0 or time.monotonic() - self._last_ok > self.ttl_s + interval:
                self._lose("lease expired" if ttl <= 0 else "renewal came too late")
                return
            self._last_ok = time.monotonic()

    def _lose(self, reason: str) -> None:
        self.lost_reason = reason
        self.lost.set()
        log.warning("lease lost", extra={"lease": self.name, "reason": reason})
        if self.on_lost is not None:
            try:
                self.on_lost(reason)
            except Exception:  # noqa: BLE001
                log.exception("on_lost callback failed")

    def stop(self, revoke: bool = True) -> None:
        self._stop.set()
        if revoke and not self.lost.is_set():
            try:
                self.client.revoke(self.lease_id)
            except EtcdUnavailableError:
                pass
