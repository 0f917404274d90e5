"""A thin, honest wrapper over pyetcd.

It adds only what every caller needs: endpoint parsing with clear errors,
failover across cluster members with one deadline per call, msgpack values,
and `EtcdUnavailableError` (one line naming the endpoints and the timeout)
instead of raw gRPC exceptions.

Retrying a transaction after an ambiguous failure can report "compare
failed" for a write that did land; callers of CAS re-read and check, which
is what they must do after any lost race anyway.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar
from urllib.parse import urlsplit

import grpc
import msgpack
import pyetcd
from pyetcd import exceptions as etcd_exc

from livemig.errors import ConfigError, EtcdUnavailableError

log = logging.getLogger("livemig.rdzv.client")
T = TypeVar("T")

_RETRYABLE = (
    etcd_exc.ConnectionFailedError,
    etcd_exc.ConnectionTimeoutError,
    etcd_exc.NoServerAvailableError,
    etcd_exc.InternalServerError,
    grpc.RpcError,
)


def encode(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def prefix_end(prefix: str) -> bytes:
    """The range end that selects every key starting with `prefix` (etcd's convention)."""
    b = bytearray(prefix.encode())
    b[-1] += 1
    return bytes(b)


def decode(raw: bytes | None) -> Any:
    if raw is None:
        return None
    return msgpack.unpackb(raw, raw=False, strict_map_key=False)


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"http://{self.host}:{self.port}"


def parse_endpoints(urls: str | Iterable[str]) -> list[Endpoint]:
    """Parse `http://h:p[,http://h:p...]`; raise ConfigError on anything else."""
    items = urls.split(",") if isinstance(urls, str) else list(urls)
    items = [u.strip() for u in items if u.strip()]
    if not items:
        raise ConfigError("no etcd endpoint given: pass --etcd http://HOST:PORT[,...]")
    out = []
    for u in items:
        parts = urlsplit(u if "://" in u else f"http://{u}")
        try:
            port = parts.port
        except ValueError:
            port = None
        if parts.scheme == "https":
            raise ConfigError(
                f"etcd URL {u!r} uses https, which livemig does not support yet: use http:// on a trusted network"
            )
        if (
            parts.scheme != "http"
            or not parts.hostname
            or port is None
            or parts.path
            not in (
                "",
                "/",
            )
        ):
            raise ConfigError(f"malformed etcd URL {u!r}: expected http://HOST:PORT, several separated by commas")
        out.append(Endpoint(parts.hostname, port))
    return out


@dataclass(frozen=True)
class KV:
    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    version: int
    lease: int


class EtcdClient:
    """One client per process (gRPC is not fork-safe: spawn, never fork).

    timeout bounds each public call as a whole, across every endpoint tried.
    """

    def __init__(
        self,
        endpoints: str | Iterable[str] | list[Endpoint],
        timeout: timedelta = timedelta(seconds=5),
    ) -> None:
        if isinstance(endpoints, list) and endpoints and isinstance(endpoints[0], Endpoint):
            self.endpoints = list(endpoints)
        else:
            self.endpoints = parse_endpoints(endpoints)  # type: ignore[arg-type]
        self.timeout = timeout
        # Per-RPC limit: short enough that a member without quorum does not
        # eat the whole budget before we fail over to the next one.
        rpc = max(0.5, min(2.0, timeout.total_seconds() / 3))
        self._raw = pyetcd.MultiEndpointEtcd3Client(
            endpoints=[pyetcd.Endpoint(e.host, e.port, secure=False, time_retry=0.3) for e in self.endpoints],
            timeout=rpc,
            failover=True,
        )
        self.txn_ops = self._raw.transactions
        # Monotonic times of the last failed RPC and the last answer: the coordinator's
        # outage grace and the members' outage budget read them (docs/reliability.md).
        self.last_failure = -1e18
        self.last_success = time.monotonic()

    @property
    def raw(self) -> pyetcd.MultiEndpointEtcd3Client:
        return self._raw

    def describe(self) -> str:
        return ",".join(str(e) for e in self.endpoints)

    def close(self) -> None:
        try:
            self._raw.close()
        except Exception:  # noqa: BLE001 - closing a dead channel
            pass

    # -- the retry loop ------------------------------------------------------------
    def call(self, what: str, fn: Callable[[], T], timeout: timedelta | None = None) -> T:
        """Run `fn` until it succeeds or the deadline passes, failing over."""
        limit = (timeout or self.timeout).total_seconds()
        deadline = time.monotonic() + limit
        last: Exception | None = None
        while True:
            try:
                out = fn()
                self.last_success = time.monotonic()
                return out
            except _RETRYABLE as exc:
                last = exc
                self.last_failure = time.monotonic()
                self.mark_failed()
            if time.monotonic() + 0.05 >= deadline:
                break
            time.sleep(0.05)
        reason = type(last).__name__ if last else "timeout"
        raise EtcdUnavailableError(
            f"etcd {what} failed: no answer from {self.describe()} within {limit:.1f}s "
            f"({reason}; is etcd running, and does the cluster have quorum?)"
        )

    def mark_failed(self) -> None:
        """Make the next call try another endpoint (pyetcd's failover hook)."""
        try:
            ep = self._raw.endpoint_in_use
            if ep is not None and ep.in_use:
                ep.fail()
            self._raw._clear_old_stubs()
        except Exception:  # noqa: BLE001
            pass

    # -- key/value -------------------------------------------------------------------
    def get(self, key: str) -> KV | None:
        def op() -> KV | None:
            resp = self._raw.get_response(key)
            if resp.count < 1:
                return None
            return _kv(resp.kvs[0])

        return self.call(f"get {key}", op)

    def get_with_revision(self, key: str) -> tuple[KV | None, int]:
        """The key and the store revision it was read at (to watch from)."""

        def op() -> tuple[KV | None, int]:
            resp = self._raw.get_response(key)
            kv = _kv(resp.kvs[0]) if resp.count else None
            return kv, resp.header.revision

        return self.call(f"get {key}", op)

    def get_prefix(self, prefix: str, timeout: timedelta | None = None) -> tuple[list[KV], int]:
        def op() -> tuple[list[KV], int]:
            resp = self._raw.get_prefix_response(prefix)
            return [_kv(kv) for kv in resp.kvs], resp.header.revision

        return self.call(f"get {prefix}*", op, timeout)

    def put(self, key: str, value: bytes, lease: int | None = None) -> None:
        self.call(f"put {key}", lambda: self._raw.put(key, value, lease=lease))

    def delete(self, key: str) -> None:
        self.call(f"delete {key}", lambda: self._raw.delete(key))

    def delete_prefix(self, prefix: str) -> None:
        self.call(f"delete {prefix}*", lambda: self._raw.delete_prefix(prefix))

    def txn(self, compare: list, success: list, failure: list | None = None) -> tuple[bool, list]:
        return self.call("transaction", lambda: self._raw.transaction(compare, success, failure or []))

    # -- leases --------------------------------------------------------------------------
    def grant(self, ttl_s: int) -> int:
        return self.call("lease grant", lambda: self._raw.lease(ttl_s).id)

    def revoke(self, lease_id: int) -> None:
        def op() -> None:
            try:
                self._raw.revoke_lease(lease_id)
            except grpc.RpcError as exc:  # already expired: fine
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    raise

        self.call("lease revoke", op)

    def keepalive_once(self, lease_id: int) -> int:
        """Renew once; returns the remaining TTL (<= 0 means the lease is gone)."""

        def op() -> int:
            resps = list(self._raw.refresh_lease(lease_id))
            return resps[0].TTL if resps else 0

        return self.call("lease keep-alive", op)

    def revision(self) -> int:
        return self.get_with_revision("/")[1]


def _kv(kv: Any) -> KV:
    return KV(
        key=kv.key.decode(),
        value=kv.value,
        mod_revision=kv.mod_revision,
        create_revision=kv.create_revision,
        version=kv.version,
        lease=kv.lease,
    )
