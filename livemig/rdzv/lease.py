"""Leases with a keep-alive thread that tells its owner when the lease is lost.

A lease is lost when etcd says it is gone (TTL <= 0 on renewal: it expired
while we were stopped, or it was revoked by a fence), or when we could not
renew it for a whole TTL (etcd unreachable: it has expired by now as far as
the cluster is concerned).

With an outage budget (members and spares: docs/reliability.md, "etcd
outages") an unreachable etcd is ridden through instead: the owner keeps
working for up to the budget, and when etcd answers again a lease that
expired meanwhile is replaced by a new one and the owner's keys re-attached
(`reattach`, a fenced write: a process fenced meanwhile learns it there).
Only a lease that expired while etcd *did* answer us, or a budget spent, is
lost: a stopped process has seen no failed call, so it is still fenced. A
renewal that hung in flight for half a TTL (a cut link healed before the
client's own timeout: no failed call either) counts as an outage.
"""

from __future__ import annotations

import logging
import os
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
        outage_budget_s: float | None = None,
        reattach: Callable[[int], None] | None = None,
    ) -> None:
        self.client = client
        self.ttl_s = int(ttl_s)
        self.on_lost = on_lost
        self.name = name
        self.lease_id = client.grant(self.ttl_s)
        self._stop = threading.Event()
        self._revoke_on_stop = False
        self._swap = threading.Lock()  # lease_id against stop(): a re-attached lease is revoked too
        self.lost = threading.Event()
        self.lost_reason = ""
        self.outage_budget_s = outage_budget_s
        self.reattach = reattach
        self.outages = 0  # outages ridden through (the lease re-attached or kept)
        self._last_ok = time.monotonic()
        self._failed = False  # a renewal failed since the last one that succeeded
        self._thread = threading.Thread(target=self._run, name=f"livemig-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        interval = max(0.1, self.ttl_s / 3)
        while not self._stop.wait(interval):
            t0 = time.monotonic()
            try:
                ttl = self.client.keepalive_once(self.lease_id)
                if self.client.last_failure >= t0:  # answered only after failed tries: an outage ended
                    self._failed = True
                elif time.monotonic() - t0 > self.ttl_s / 2:  # the call itself hung on the network
                    self._failed = True  # (a cut healed before the client's timeout): an outage too
            except EtcdUnavailableError as exc:
                out_for = time.monotonic() - self._last_ok
                if not self._failed and self.outage_budget_s is not None:
                    log.warning("etcd unreachable: riding through", extra={"lease": self.name, "err": str(exc)})
                self._failed = True
                budget = self.ttl_s if self.outage_budget_s is None else self.outage_budget_s
                if out_for > budget:
                    what = "the outage budget" if self.outage_budget_s is not None else "the lease TTL"
                    self._lose(f"could not reach etcd for {out_for:.0f}s ({what}): {exc}")
                    return
                continue
            if self._stop.is_set():  # stopped while this renewal was in flight (stop() may have revoked
                return  # the lease under it): neither a loss (see _lose) nor a lease to re-attach
            if self._failed and self.outage_budget_s is not None:
                if not self._after_outage(ttl):
                    return
                continue
            # A stopped process resumed after its TTL: the clock says so even
            # if etcd has not yet reaped the lease.
            if ttl <= 0 or time.monotonic() - self._last_ok > self.ttl_s + interval:
                self._lose("lease expired" if ttl <= 0 else "renewal came too late")
                return
            self._last_ok = time.monotonic()

    def _after_outage(self, ttl: int) -> bool:
        """etcd answers again after failed renewals: keep or re-attach the lease."""
        out_for = time.monotonic() - self._last_ok
        if ttl <= 0:
            if self.reattach is None:
                self._lose("lease expired during an etcd outage")
                return False
            try:
                new = self.client.grant(self.ttl_s)
                self.reattach(new)
            except EtcdUnavailableError:
                return True  # etcd went away again: still in the outage
            except Exception as exc:  # noqa: BLE001 - FencedError: replaced meanwhile
                self._lose(f"could not re-register after an etcd outage: {exc}")
                return False
            with self._swap:
                self.lease_id = new
                stopped, revoke = self._stop.is_set(), self._revoke_on_stop
            if stopped:  # stop() ran during the re-attach and revoked the lease it saw, the old one
                if revoke:
                    self._revoke(new)
                return False
        self._failed = False
        self._last_ok = time.monotonic()
        self.outages += 1
        log.warning("etcd reachable again", extra={"lease": self.name, "outage_s": round(out_for, 2),
                                                   "reattached": ttl <= 0})  # fmt: skip
        return True

    def _lose(self, reason: str) -> None:
        if self._stop.is_set():  # its owner stopped it (and may have revoked it): nothing is lost
            return
        self.lost_reason = reason
        self.lost.set()
        log.warning("lease lost", extra={"lease": self.name, "reason": reason})
        if self.on_lost is not None:
            try:
                self.on_lost(reason)
            except Exception:  # noqa: BLE001
                log.exception("on_lost callback failed")

    def stop(self, revoke: bool = True) -> None:
        with self._swap:
            self._stop.set()
            self._revoke_on_stop = revoke
            lease = self.lease_id
        if revoke and not self.lost.is_set():
            self._revoke(lease)

    def _revoke(self, lease: int) -> None:
        try:
            self.client.revoke(lease)
        except EtcdUnavailableError:
            pass  # unreachable: it expires after its TTL


def _lease_in(path: str) -> int | None:
    """The lease id in the agent's file, None while there is none (yet) or it cannot be read."""
    try:
        with open(path) as f:
            raw = f.read().strip()
    except OSError:
        return None
    return int(raw) if raw.isdigit() else None


def read_node_lease(path: str, timeout_s: float) -> int:
    """The node lease id its agent wrote to `path` (--node-leases), waiting up to timeout_s for
    it: a single node's workers start before the agent has its etcd and its lease."""
    deadline = time.monotonic() + timeout_s
    while True:
        lease = _lease_in(path)
        if lease is not None:
            return lease
        if time.monotonic() > deadline:
            raise TimeoutError(f"no node lease in {path} after {timeout_s:.0f}s: is this node's agent running "
                               "(livemig run --node-leases)?")  # fmt: skip
        time.sleep(0.05)


def write_node_lease(path: str, lease_id: int) -> None:
    """Atomically: a worker reading it sees the old id or the new one, never half of one."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(str(lease_id))
    os.replace(tmp, path)


class NodeLease:
    """A registration under the node agent's lease instead of a lease of the process's own
    (--node-leases: one keep-alive per node, not per rank, at etcd's leader). It has a
    LeaseKeeper's face for its owner; its thread sends nothing to etcd: the agent keeps the
    lease alive, and after an etcd outage that outlived it writes the new lease's id to the
    file, where this registration sees it and puts its key again (`reattach`, a fenced write:
    a process fenced meanwhile learns it there, as with a lease of its own). The agent also
    deletes the key when the process dies or stays stopped for a TTL (what the lease's
    expiry did), and the coordinator deletes it at a fence instead of revoking the lease the
    node's other processes share (the fenced process learns of its fence from the member
    table)."""

    POLL_S = 0.25  # a local stat(); a re-attach is seen within it

    def __init__(self, client: EtcdClient, key: str, value: bytes, lease_id: int, path: str,
                 reattach: Callable[[int], None], on_lost: Callable[[str], None] | None = None) -> None:  # fmt: skip
        self.client = client
        self.key = key
        self.value = value
        self.lease_id = lease_id
        self.path = path
        self.reattach = reattach
        self.on_lost = on_lost
        self.lost = threading.Event()
        self.lost_reason = ""
        self.outages = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="livemig-node-lease", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        seen = None
        while not self._stop.wait(self.POLL_S):
            try:
                st = os.stat(self.path)
            except OSError:
                continue
            if (st.st_mtime_ns, st.st_ino) == seen or (lease := _lease_in(self.path)) is None:
                continue
            if lease == self.lease_id:
                seen = (st.st_mtime_ns, st.st_ino)
                continue
            try:
                self.reattach(lease)
            except EtcdUnavailableError:
                continue  # etcd went away again: the next poll tries again
            except Exception as exc:  # noqa: BLE001 - FencedError: replaced meanwhile
                if not self._stop.is_set():
                    self.lost_reason = f"could not re-register under the node's new lease: {exc}"
                    self.lost.set()
                    if self.on_lost is not None:
                        self.on_lost(self.lost_reason)
                return
            self.lease_id, seen = lease, (st.st_mtime_ns, st.st_ino)
            self.outages += 1
            log.warning("re-registered under the node's new lease", extra={"key": self.key, "lease": lease})

    def stop(self, revoke: bool = True) -> None:
        """revoke: drop the key (only while it is still ours, as put); else leave it to the
        agent (a process that exits has its key deleted by the agent that reaps it)."""
        self._stop.set()
        if not revoke:
            return
        t = self.client.txn_ops
        try:
            self.client.txn([t.value(self.key) == self.value], [t.delete(self.key)])
        except EtcdUnavailableError:
            pass  # the agent deletes it when this process exits
