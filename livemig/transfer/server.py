"""Serves a member's registered state to spares (and averaged gradients to
peers that missed them), from a background thread.

Consistency: the owner calls `publish(gen, item, provider)` only while it is
paused at a step boundary inside a recovery, and `withdraw()` before it
trains on; a request for any other generation or item is refused. So the
bytes served are exactly the boundary state, without a copy.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import zmq

from livemig.device import HostStager
from livemig.errors import WithdrawnError
from livemig.state import flatten, tensor_meta
from livemig.transfer import gmac
from livemig.transfer import protocol as P

log = logging.getLogger("livemig.transfer.server")

MAX_DATA_CONNECTIONS = 64  # concurrent data-channel peers (a recovery has a handful)
DATA_IDLE_S = 60.0  # a data connection with no request for this long is closed
SNAPSHOT_THREADS = 8  # threads hashing a served snapshot's chunk MACs (at most the cores)

# provider() -> (step, state object to flatten)
Provider = Callable[[], tuple[int, Any]]


class _Snapshot:
    def __init__(self, step: int, obj: Any, key: bytes, gen: int, item: str) -> None:
        self.tensors: list[torch.Tensor] = []
        self.skeleton = flatten(obj, self.tensors)
        self.step = step
        # device tensors are staged to host memory once, chunk by chunk (device.py): the
        # chunks' MACs and the bytes sent are the host copy's
        stager = HostStager()
        self.bytes = [stager.to_host(t.contiguous()) for t in self.tensors]
        self.chunks = P.plan([b.numel() for b in self.bytes])
        keys = [P.chunk_key(key, gen, item, step, i) for i in range(len(self.chunks))]
        views = [self.view(c) for c in self.chunks]
        threads = min(SNAPSHOT_THREADS, os.cpu_count() or 1, len(self.chunks)) if gmac.releases_gil() else 1
        if threads > 1:  # the recovery waits for these MACs: hash on the cores a paused worker leaves idle
            with concurrent.futures.ThreadPoolExecutor(threads, "livemig-snapshot") as ex:
                self.macs = list(ex.map(P.chunk_mac, keys, views))
        else:
            self.macs = [P.chunk_mac(k, v) for k, v in zip(keys, views, strict=True)]

    def view(self, c: P.Chunk) -> memoryview:
        return memoryview(self.bytes[c.tensor][c.offset : c.offset + c.length].numpy())  # type: ignore[arg-type]  # numpy's stubs omit __buffer__


GONE_KEEP = 64  # withdrawn item names remembered


class Hooks:
    """The state server's fault hooks, the one place a fault reaches the server: set by tests on
    a server object and by the member's SelfFaults (`livemig inject corrupt`, runtime/
    self_faults.py), never by the environment. All off, they cost one check per chunk."""

    def __init__(self) -> None:
        self.corrupt: set[int] = set()  # chunk seqs sent once with one byte flipped
        self.corrupt_next = False  # the next chunk served, whichever it is
        self.after_chunk: Callable[[int], None] | None = None  # called with the count of chunks served


class StateServer:
    def __init__(self, job: str, secret: bytes, host: str = "127.0.0.1") -> None:
        self.hooks = Hooks()
        self.served_chunks = 0
        self.job = job
        self.secret = secret
        self.key = P.reply_key(secret)
        self._seen: dict[bytes, float] = {}  # request nonces within the skew window: replays are refused
        self._ctx: Any = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_REQUEST_BYTES)  # a larger frame drops its sender
        self._sock.setsockopt(zmq.RCVHWM, 4 * P.WINDOW)  # outstanding requests queued per connection
        P.secure_server(self._sock, secret)  # CURVE when LIVEMIG_TRANSFER_ENCRYPT=1
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.addr = f"tcp://{host}:{port}"
        self._lock = threading.Lock()
        self._items: dict[str, tuple[int, Provider]] = {}
        self.wanted: set[str] = set()  # items a peer asked for that were not served
        self._gone: dict[str, None] = {}  # the last items withdrawn one by one (a late peer is told)
        self._snaps: dict[tuple[int, str], _Snapshot] = {}
        self._fenced = False
        self._stop = threading.Event()
        self._handling = threading.Lock()  # _handle's state (replay window, hooks) across channels
        self._conns: set[socket.socket] = set()
        self._data: socket.socket | None = None
        self.data_port: int | None = None  # advertised in the header; None: chunks over zmq (CURVE)
        if not P.encrypted():
            self._data = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
            self.data_port = self._data.getsockname()[1]
            threading.Thread(target=self._accept, name="livemig-transfer-data", daemon=True).start()
        self._thread = threading.Thread(target=self._run, name="livemig-transfer", daemon=True)
        self._thread.start()

    # -- owner API ----------------------------------------------------------------
    def publish(self, gen: int, item: str, provider: Provider) -> None:
        with self._lock:
            self._items[item] = (gen, provider)
            self._gone.pop(item, None)
            self._snaps = {k: v for k, v in self._snaps.items() if k[1] != item}

    def withdraw(self, item: str | None = None, gone: bool = True) -> None:
        """Stop serving `item` (None: every item); a peer asking for it again is told it is gone,
        unless `gone` is False (it may be asked for, and published, again: a follower's snapshot)."""
        with self._lock:
            if item is None:
                self._items.clear()
                self._snaps.clear()
            else:
                if self._items.pop(item, None) is not None and gone:
                    self._gone[item] = None
                    while len(self._gone) > GONE_KEEP:
                        del self._gone[next(iter(self._gone))]
                self._snaps = {k: v for k, v in self._snaps.items() if k[1] != item}

    def refuse(self, item: str) -> None:
        """Answer `item` as withdrawn from now on (an update older than a migration keeps,
        asked for by a spare that fell behind: it would otherwise wait for it for ever)."""
        with self._lock:
            self.wanted.discard(item)
            if item not in self._items:
                self._gone[item] = None
                while len(self._gone) > GONE_KEEP:
                    del self._gone[next(iter(self._gone))]

    def fence(self) -> None:
        """Never serve again: this process was replaced."""
        self._fenced = True
        self.withdraw()

    def close(self) -> None:
        self._stop.set()
        if self._data is not None:
            self._data.close()
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for c in conns:
            P.shut(c)
        self._thread.join(timeout=2)

    # -- serving -----------------------------------------------------------------------
    def _snapshot(self, gen: int, item: str) -> _Snapshot:
        with self._lock:
            if self._fenced:
                raise PermissionError("this member is fenced and serves no state")
            if item in self._gone:  # a peer that fell behind: waiting will not bring it back
                # it existed and will not come back: the refusal says so in a field ("gone")
                raise WithdrawnError(f"item {item!r} is no longer served (withdrawn)")
            if item not in self._items:
                self.wanted.add(item)  # authenticated: the owner may produce it (planned migration)
                raise LookupError(f"item {item!r} is not being served now")
            g, provider = self._items[item]
            if gen != g:
                raise PermissionError(f"stale or unknown generation {gen} (serving generation {g})")
            snap = self._snaps.get((gen, item))
            if snap is None:
                step, obj = provider()
                snap = self._snaps[(gen, item)] = _Snapshot(step, obj, self.key, gen, item)
            return snap

    def _check(self, frames: list[bytes]) -> tuple[dict | None, bytes, str]:
        """(request, nonce, error): an authenticated, fresh, never-seen request, else why not."""
        if len(frames) != 2 or not P.verify(self.secret, frames[1], frames[0]):
            return None, b"", "authentication failed: wrong job secret"
        try:
            req = P.unpack(frames[1])
        except Exception:  # noqa: BLE001 - msgpack raises several types; authenticated but malformed
            return None, b"", "malformed request"
        nonce = req.get("nonce") if isinstance(req, dict) else None
        sent = req.get("time") if isinstance(req, dict) else None
        if not isinstance(nonce, bytes) or len(nonce) != 16 or not isinstance(sent, int | float):
            return None, b"", "request without nonce and time (an older livemig?)"
        now = time.time()
        if abs(now - sent) > P.MAX_SKEW_S:
            return None, nonce, f"stale request: {now - sent:+.0f}s from this host's clock (max {P.MAX_SKEW_S:g}s)"
        if nonce in self._seen:
            return None, nonce, "replayed request refused"
        self._seen[nonce] = now
        if len(self._seen) > 100_000 or next(iter(self._seen.values())) < now - 2 * P.MAX_SKEW_S:
            self._seen = {k: t for k, t in self._seen.items() if t >= now - 2 * P.MAX_SKEW_S}
        return req, nonce, ""

    def _reply(self, nonce: bytes, meta: dict, data: object = None) -> list[Any]:
        raw = P.pack(meta)
        return [raw, P.tag(self.key, nonce, raw)] + ([data] if data is not None else [])

    def _handle(self, frames: list[bytes]) -> list[Any]:
        req, nonce, why = self._check(frames)
        if req is None:
            log.warning("refused transfer request", extra={"why": why, "frames": len(frames)})
            return self._reply(nonce, {"ok": False, "error": why})
        if req.get("job") != self.job:
            return self._reply(nonce, {"ok": False, "error": f"wrong job {req.get('job')!r}"})
        try:
            snap = self._snapshot(int(req["gen"]), str(req["item"]))
        except (PermissionError, LookupError, WithdrawnError) as exc:
            return self._reply(nonce, {"ok": False, "error": str(exc), "gone": isinstance(exc, WithdrawnError)})
        if req["op"] == "header":
            return self._reply(nonce, {
                "ok": True,
                "step": snap.step,
                "gen": req["gen"],
                "skeleton": snap.skeleton,
                "tensors": [tensor_meta(t) for t in snap.tensors],
                "chunk": P.CHUNK_BYTES,
                "macs": snap.macs,
                "digest": P.combine(snap.macs),
                "data": self.data_port,
            })  # fmt: skip
        if req["op"] == "chunk":
            seq = int(req["seq"])
            if not 0 <= seq < len(snap.chunks):
                return self._reply(nonce, {"ok": False, "error": f"no chunk {seq}"})
            self.served_chunks += 1
            if self.hooks.after_chunk is not None:
                self.hooks.after_chunk(self.served_chunks)  # a test's source dying mid-transfer
            data: memoryview | bytes = snap.view(snap.chunks[seq])
            if seq in self.hooks.corrupt or self.hooks.corrupt_next:
                self.hooks.corrupt.discard(seq)
                self.hooks.corrupt_next = False
                flipped = bytearray(data)
                flipped[len(flipped) // 2] ^= 0xFF
                data = bytes(flipped)
            return self._reply(nonce, {"ok": True, "seq": seq}, data)
        return self._reply(nonce, {"ok": False, "error": f"unknown op {req['op']!r}"})

    def _serve(self, frames: list[bytes]) -> list[Any]:
        with self._handling:
            try:
                return self._handle(frames)
            except Exception as exc:  # noqa: BLE001 - one bad request must not stop serving
                log.exception("transfer request failed")
                return self._reply(b"", {"ok": False, "error": f"server error: {exc}"})

    # -- the data channel: TCP, replies sent from the tensors' memory -------------------
    def _accept(self) -> None:
        assert self._data is not None
        while not self._stop.is_set():
            try:
                conn, peer = self._data.accept()
            except OSError:
                return
            with self._lock:
                if len(self._conns) >= MAX_DATA_CONNECTIONS or self._stop.is_set():
                    log.warning("data connection refused: too many open", extra={"peer": str(peer)})
                    conn.close()
                    continue
                self._conns.add(conn)
            threading.Thread(target=self._connection, args=(conn,), name="livemig-transfer-conn", daemon=True).start()

    def _connection(self, conn: socket.socket) -> None:
        """Answer one peer's requests in order until it closes, breaks the framing, or idles."""
        conn.settimeout(DATA_IDLE_S)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while not self._stop.is_set():
                head = P.recv_exact(conn, P.REQ_HEAD.size)  # OSError when the peer closes: below
                n_mac, n_body = P.REQ_HEAD.unpack(head)
                if n_mac + n_body > P.MAX_REQUEST_BYTES:
                    log.warning("oversized data-channel request; connection closed", extra={"bytes": n_mac + n_body})
                    return
                raw = P.recv_exact(conn, n_mac + n_body)
                reply = self._serve([raw[:n_mac], raw[n_mac:]])
                data = reply[2] if len(reply) > 2 else b""
                _sendv(conn, [P.REP_HEAD.pack(len(reply[0]), len(reply[1]), len(memoryview(data))), reply[0],
                              reply[1], data])  # fmt: skip
        except OSError:
            return  # the peer went away, or idled past DATA_IDLE_S
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            ident, *frames = self._sock.recv_multipart(copy=True)
            self._sock.send_multipart([ident, *self._serve(frames)], copy=False)
        self._sock.close(0)


def _sendv(conn: socket.socket, parts: list[Any]) -> None:
    """Send every part with as few `sendmsg` calls as the kernel allows (no joined copy)."""
    views = [memoryview(p).cast("B") for p in parts if len(memoryview(p))]
    while views:
        sent = conn.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]
