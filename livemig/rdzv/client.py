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

import bisect
import logging
import threading
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

from livemig.config import ENV_PASSWORD_FILE, ENV_USER
from livemig.errors import ConfigError, EtcdAccessError, EtcdUnavailableError
from livemig.rdzv.security import EtcdSecurity

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


_NUMBER = (int, float)
MAX_MESSAGE_BYTES = 512 << 20  # the largest etcd answer a client accepts (a range read of a big job)


def conform(raw: bytes | Any, need: dict[str, tuple], may: dict[str, tuple] | None = None) -> dict | None:
    """A record as a reader may use it, or None: `raw` (bytes, or an already decoded
    value) must be a dict with every `need` field of its types; a `may` field of another
    type is dropped, so `.get` answers None. Anyone with access to etcd can write any
    value under a job's prefix: readers outside the coordinator's pass use this."""
    try:
        value = decode(raw) if isinstance(raw, bytes | None) else raw
    except Exception:  # noqa: BLE001 - msgpack raises several types
        return None
    if not isinstance(value, dict):
        return None

    def ok(v: Any, types: tuple) -> bool:
        return isinstance(v, types) and not (isinstance(v, bool) and bool not in types)

    if any(f not in value or not ok(value[f], t) for f, t in need.items()):
        return None
    opt = may or {}
    return {k: v for k, v in value.items() if isinstance(k, str) and (k not in opt or ok(v, opt[k]))}


def through_outage(call: Callable[[], T], budget_s: float, what: str, give_up: Callable[[], bool] = lambda: False) -> T:
    """`call()`, retried while etcd is unreachable for up to `budget_s` (the outage
    budget): a spare that finishes warming up during an outage registers once etcd
    answers instead of exiting. Refusals (EtcdAccessError) and fences are not retried."""
    deadline = time.monotonic() + budget_s
    while True:
        try:
            return call()
        except EtcdUnavailableError:
            if give_up() or time.monotonic() > deadline:
                raise
            log.warning("etcd unreachable; retrying", extra={"what": what})
            time.sleep(0.5)


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int
    secure: bool = False

    def __str__(self) -> str:
        return f"{'https' if self.secure else 'http'}://{self.host}:{self.port}"


def parse_endpoints(urls: str | Iterable[str]) -> list[Endpoint]:
    """Parse `http(s)://h:p[,...]`; raise ConfigError on anything else (mixed schemes too)."""
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
        if (
            parts.scheme not in ("http", "https")
            or not parts.hostname
            or port is None
            or parts.path
            not in (
                "",
                "/",
            )
        ):
            raise ConfigError(
                f"malformed etcd URL {u!r}: expected https://HOST:PORT (or http://), several separated by commas"
            )
        out.append(Endpoint(parts.hostname, port, parts.scheme == "https"))
    if len({e.secure for e in out}) > 1:
        raise ConfigError(f"etcd URLs {urls!r} mix http:// and https://: one cluster speaks one of them")
    return out


@dataclass(frozen=True)
class KV:
    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    version: int
    lease: int


def txn_revision(resps: list) -> int:
    """The revision a transaction's writes made (every operation's header carries it)."""
    for r in resps:
        which = r.WhichOneof("response") if hasattr(r, "WhichOneof") else None
        if which in ("response_put", "response_delete_range"):
            return int(getattr(r, which).header.revision)
    return 0


class CallStats:
    """Latency and failures of a client's calls, for its process's metrics endpoint
    (agent/metrics.py): a clock read and a bucket search per call, counted always."""

    BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

    def __init__(self) -> None:
        self.counts = [0] * (len(self.BUCKETS) + 1)
        self.total_s = 0.0
        self.errors = 0  # attempts that failed (retried or not)
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        i = bisect.bisect_left(self.BUCKETS, seconds)
        with self._lock:
            self.counts[i] += 1
            self.total_s += seconds

    def failed(self) -> None:
        with self._lock:
            self.errors += 1

    def histogram(self) -> tuple[list[tuple[str, float]], float]:
        """Cumulative Prometheus buckets and the sum."""
        with self._lock:
            counts, total = list(self.counts), self.total_s
        out, acc = [], 0
        for b, c in zip([*map(str, self.BUCKETS), "+Inf"], counts, strict=True):
            acc += c
            out.append((b, float(acc)))
        return out, total


class EtcdClient:
    """One client per process (gRPC is not fork-safe: spawn, never fork).

    timeout bounds each public call as a whole, across every endpoint tried.
    """

    def __init__(
        self,
        endpoints: str | Iterable[str] | list[Endpoint],
        timeout: timedelta = timedelta(seconds=5),
        security: EtcdSecurity | None = None,
    ) -> None:
        if isinstance(endpoints, list) and endpoints and isinstance(endpoints[0], Endpoint):
            self.endpoints = list(endpoints)
        else:
            self.endpoints = parse_endpoints(endpoints)  # type: ignore[arg-type]
        self.timeout = timeout
        # the environment carries the credentials to every process (rdzv/security.py)
        self.security = security if security is not None else EtcdSecurity.from_env()
        self.security.check()
        secure = self.endpoints[0].secure
        if self.security.tls and not secure:
            raise ConfigError(
                f"etcd TLS files are set ({', '.join(self.security.to_env())}) but the etcd URL "
                f"{self.describe()} is plaintext: use https://"
            )
        creds = self.security.credentials() if secure else None
        # Per-RPC limit: short enough that a member without quorum does not
        # eat the whole budget before we fail over to the next one.
        rpc = max(0.5, min(2.0, timeout.total_seconds() / 3))
        # gRPC refuses answers over 4 MiB by default: a whole job prefix at 10,000 ranks
        # (registrations, reports, signatures) is larger
        opts = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                # a refused connect (etcd still starting, a member restarting) is retried after
                # 0.1-1 s, not gRPC's default 1-120 s: processes start while etcd comes up
                ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000)]  # fmt: skip
        self._raw = pyetcd.MultiEndpointEtcd3Client(
            endpoints=[
                pyetcd.Endpoint(e.host, e.port, secure=secure, creds=creds, time_retry=0.3, opts=opts)
                for e in self.endpoints
            ],
            timeout=rpc,
            failover=True,
        )
        self.txn_ops = self._raw.transactions
        # Password auth: a token taken lazily (etcd may not be up yet) inside the retry
        # loop, and taken again when etcd says it expired (simple tokens die after
        # --auth-token-ttl of disuse, JWTs at their expiry).
        self._password: str | None = self.security.password() if self.security.user else None
        self._token: str | None = None
        self._auth_lock = threading.Lock()
        self.reauths = 0
        # Monotonic times of the last failed RPC and the last answer: the coordinator's
        # outage grace and the members' outage budget read them (docs/reliability.md).
        self.last_failure = -1e18
        self.last_success = time.monotonic()
        # writes issued through this client (successful or not), the newest etcd revision
        # one of them made, and how many made a revision unknown here (a failed call, a
        # delete): a reader of a watch-fed mirror waits until the mirror holds its own
        # writes, or reads etcd itself when it cannot know (read-your-writes; coordinator.py)
        self.writes = 0
        self.write_revision = 0
        self.unknown_writes = 0
        self.stats = CallStats()

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
        """Run `fn` until it succeeds or the deadline passes, failing over.

        etcd's refusals (permission, bad password) end the call at once with
        EtcdAccessError; an expired token is renewed and the call retried."""
        limit = (timeout or self.timeout).total_seconds()
        deadline = time.monotonic() + limit
        last: Exception | None = None
        t0 = time.monotonic()
        while True:
            try:
                if self._password is not None and self._token is None:
                    self._authenticate()
                out = fn()
                self.last_success = time.monotonic()
                self.stats.observe(self.last_success - t0)
                return out
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                if code == grpc.StatusCode.UNAUTHENTICATED and self._password is not None:
                    self._drop_token()  # expired or revoked: take a new one on the next try
                    last = exc
                elif code == grpc.StatusCode.PERMISSION_DENIED and not self.security.user:
                    raise EtcdAccessError(
                        f"etcd refused {what}: permission denied to an unauthenticated client (auth is on: set "
                        f"{ENV_USER} and {ENV_PASSWORD_FILE}, or --etcd-user and --etcd-password-file)"
                    ) from None
                elif code == grpc.StatusCode.PERMISSION_DENIED:
                    raise EtcdAccessError(
                        f"etcd refused {what} for user {self.security.user}: permission denied (the job's etcd "
                        "role must grant readwrite on its /livemig/<job>/ prefix: scripts/etcd-job-user.sh)"
                    ) from None
                elif code == grpc.StatusCode.UNAUTHENTICATED:
                    raise EtcdAccessError(
                        f"etcd at {self.describe()} requires authentication for {what}: set {ENV_USER} and "
                        f"{ENV_PASSWORD_FILE} (or --etcd-user/--etcd-password-file)"
                    ) from None
                else:
                    last = exc
                    self.last_failure = time.monotonic()
                    self.stats.failed()
                    self.mark_failed()
            except _RETRYABLE as exc:
                last = exc
                self.last_failure = time.monotonic()
                self.stats.failed()
                self.mark_failed()
            if time.monotonic() + 0.05 >= deadline:
                break
            time.sleep(0.05)
        reason = type(last).__name__ if last else "timeout"
        details = last.details() if isinstance(last, grpc.RpcError) and hasattr(last, "details") else ""
        if details:
            reason += f": {str(details).splitlines()[0][:160]}"
        raise EtcdUnavailableError(
            f"etcd {what} failed: no answer from {self.describe()} within {limit:.1f}s "
            f"({reason}; is etcd running{', with TLS' if self.endpoints[0].secure else ''}, "
            "and does the cluster have quorum?)"
        )

    def _authenticate(self) -> None:
        """Take a token for the user; every later RPC (watch streams opened later too) sends it."""
        from pyetcd import etcdrpc

        with self._auth_lock:
            if self._token is not None:
                return
            try:
                resp = self._raw.authstub.Authenticate(
                    etcdrpc.AuthenticateRequest(name=self.security.user, password=self._password),
                    self._raw.timeout,
                )
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                details = str(exc.details() if hasattr(exc, "details") else exc)
                if code == grpc.StatusCode.FAILED_PRECONDITION and "not enabled" in details:
                    log.warning("etcd auth is not enabled: the user and password are not used",
                                extra={"endpoints": self.describe()})  # fmt: skip
                    self._password = None
                    return
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise EtcdAccessError(
                        f"etcd refused the login of user {self.security.user!r} ({details}): "
                        f"check {ENV_USER} and the password file {self.security.password_file}"
                    ) from None
                raise
            self._token = resp.token
            self._raw.metadata = (("token", resp.token),)
            self._raw.call_credentials = None  # metadata works on plain and TLS channels alike
            self.reauths += 1
            log.debug("etcd token taken", extra={"user": self.security.user, "count": self.reauths})

    def _drop_token(self) -> None:
        with self._auth_lock:
            self._token = None
            self._raw.metadata = None
            # the cached watch stream carries the old token; its watches re-establish (watch.py)
            self._raw._clear_old_stubs()

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
    def get(self, key: str, timeout: timedelta | None = None) -> KV | None:
        def op() -> KV | None:
            resp = self._raw.get_response(key)
            if resp.count < 1:
                return None
            return _kv(resp.kvs[0])

        return self.call(f"get {key}", op, timeout)

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

    def get_range(self, start: str, end: str, timeout: timedelta | None = None) -> tuple[list[KV], int]:
        """Every key in [start, end), and the revision it was read at."""

        def op() -> tuple[list[KV], int]:
            resp = self._raw.get_range_response(start, end)
            return [_kv(kv) for kv in resp.kvs], resp.header.revision

        return self.call(f"get [{start}, {end})", op, timeout)

    def _wrote(self, revision: int) -> None:
        """A write issued (counted as unknown until then) made `revision` (0: not known)."""
        if revision > 0:
            self.unknown_writes -= 1
            self.write_revision = max(self.write_revision, revision)

    def _issue(self) -> None:
        self.writes += 1
        self.unknown_writes += 1

    def put(self, key: str, value: bytes, lease: int | None = None) -> None:
        self._issue()
        resp = self.call(f"put {key}", lambda: self._raw.put(key, value, lease=lease))
        self._wrote(getattr(getattr(resp, "header", None), "revision", 0))

    def delete(self, key: str) -> None:
        self._issue()
        self.call(f"delete {key}", lambda: self._raw.delete(key))

    def delete_prefix(self, prefix: str) -> None:
        self._issue()
        self.call(f"delete {prefix}*", lambda: self._raw.delete_prefix(prefix))

    def txn(self, compare: list, success: list, failure: list | None = None) -> tuple[bool, list]:
        self._issue()
        ok, resps = self.call("transaction", lambda: self._raw.transaction(compare, success, failure or []))
        if not (success if ok else failure):
            self.unknown_writes -= 1  # the branch taken had no operation: nothing written
        else:
            self._wrote(txn_revision(resps))
        return ok, resps

    def modified_since(self, prefix: str, revision: int) -> int:
        """Whether a key under `prefix` was written after `revision`: 1 or 0 (one key name at
        most comes back; etcd's count would ignore the revision filter)."""

        def op() -> int:
            resp = self._raw.get_prefix_response(prefix, keys_only=True, limit=1, min_mod_revision=revision + 1)
            return len(resp.kvs)

        return self.call(f"count {prefix}*", op)

    def read_txn(self, compare: list, reads: list) -> tuple[bool, list]:
        """Range reads (`txn_ops.get`) taken together at one revision, only if `compare` holds:
        (ok, one list of (value, meta) per read). Counted as no write."""
        ok, resps = self.call("read transaction", lambda: self._raw.transaction(compare, reads, []))
        return ok, resps

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

    def revision(self, key: str) -> int:
        """The store's revision, read through `key` (a key the caller may read: with a
        job's role, nothing outside its prefix is)."""
        return self.get_with_revision(key)[1]


def _kv(kv: Any) -> KV:
    return KV(
        key=kv.key.decode(),
        value=kv.value,
        mod_revision=kv.mod_revision,
        create_revision=kv.create_revision,
        version=kv.version,
        lease=kv.lease,
    )
