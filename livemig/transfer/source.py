"""A source of a state pull (transfer/puller.py, transfer/channel.py)."""

from __future__ import annotations

import collections
import socket
import time
from typing import Any

import zmq

from livemig.transfer import protocol as P


class Source:
    """One peer a pull reads from: its control socket (requests and replies), its data
    channel while chunks stream, and what it has served. Its own module: the pull
    (puller.py) and the data channel (channel.py) both use it, and neither imports the other's
    private parts."""

    def __init__(self, ctx: zmq.Context, addr: str, secret: bytes, send_timeout: float = 3.0) -> None:
        self.addr = addr
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # a DEALER's send blocks until a connection completes its handshake: bound it (a
        # CURVE server never completes one with a plaintext client)
        self.sock.setsockopt(zmq.SNDTIMEO, max(1, int(send_timeout * 1000)))
        P.secure_client(self.sock, secret)  # CURVE when LIVEMIG_TRANSFER_ENCRYPT=1
        self.sock.connect(addr)
        self.queue: collections.deque[int] = collections.deque()
        self.inflight: dict[int, float] = {}
        self.last_reply = time.monotonic()
        self.bad = 0
        self.served = 0
        self.error = ""
        self.gone = False  # its refusal said the item was withdrawn for good
        self.nonces: dict[int, bytes] = {}  # outstanding request -> its nonce (-1: the header)
        self.conn: socket.socket | None = None  # the data channel, while chunks stream
        self.data_port: int | None = None  # from this source's own (authenticated) header

    def request(self, job: str, secret: bytes, gen: int, item: str, op: str, **kw: Any) -> None:
        body, nonce = P.request_body(job, gen, item, op, **kw)
        self.nonces[int(kw.get("seq", -1))] = nonce
        self.sock.send_multipart([P.mac(secret, body), body])

    def reply(self, key: bytes) -> tuple[dict | None, bool]:
        """The next reply's meta (None if it is not an authentic answer to one of our
        requests) and whether a data frame follows. The tag is checked against the nonce
        of the request the reply names (the header: -1)."""
        raw = self.sock.recv()
        got = self.sock.recv() if self.sock.getsockopt(zmq.RCVMORE) else b""
        more = bool(self.sock.getsockopt(zmq.RCVMORE))
        try:
            meta = P.unpack(raw)
        except Exception:  # noqa: BLE001 - garbage on the wire
            return None, more
        if not isinstance(meta, dict):
            return None, more
        seq = meta.get("seq", -1) if meta.get("ok") else None
        cands = [self.nonces[seq]] if isinstance(seq, int) and seq in self.nonces else list(self.nonces.values())
        if any(P.tag_ok(key, n, raw, got) for n in cands):
            return meta, more
        if not meta.get("ok") and P.tag_ok(key, b"", raw, got):
            return meta, more  # a request the server could not read back (its nonce unknown to it)
        return None, more

    def data_addr(self) -> tuple[str, int]:
        """The data channel's address: the host this source was reached at, its header's port."""
        host = self.addr.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
        return host, int(self.data_port or 0)

    def close(self) -> None:
        self.sock.close(0)
        if self.conn is not None:
            P.shut(self.conn)
            self.conn.close()
