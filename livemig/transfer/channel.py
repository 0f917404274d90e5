"""The data channel of a pull: one plain TCP connection per source and a thread
each, whose `recv_into` writes a chunk's bytes from the kernel straight into the
destination tensor; each chunk's MAC is checked in line by its receiving thread or by
a pool of verifier threads (`verifiers()`). puller.py holds the pull itself (headers,
striping, the zmq path for encrypted transfers) and calls `tcp_stream`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from livemig.config import ENV_VERIFIERS
from livemig.errors import TransferError
from livemig.transfer import gmac
from livemig.transfer import protocol as P

if TYPE_CHECKING:
    from livemig.transfer.source import Source

log = logging.getLogger("livemig.transfer.puller")  # the pull's component, as before

MAX_BAD_CHUNKS = 3  # bad chunks (or failed replies) before a source is dropped
HASH_PIECE = 512 << 10  # received, then hashed while cache-hot
FAST_HASH_GBPS = 4.0  # a core hashing this fast keeps up with the stream in line (see verifiers())
_calibrated: list[float] = []


def hash_gbps() -> float:
    """This process's chunk MAC speed on one thread, GB/s (measured once, ~2-10 ms)."""
    if not _calibrated:
        buf, key = bytes(8 << 20), bytes(32)
        P.chunk_mac(key, buf)  # warm: the buffer's pages mapped, the cipher's code loaded
        t0 = time.perf_counter()
        P.chunk_mac(key, buf)
        _calibrated.append(len(buf) / max(time.perf_counter() - t0, 1e-9) / 1e9)
    return _calibrated[0]


def verifiers() -> int:
    """How many threads check chunk MACs on the data channel; 0: each receiving thread
    hashes its chunk in line, piece by piece while cache-hot. Hashing in line costs no
    thread hand-off and no second pass over memory, and wins where one core hashes much
    faster than the link delivers (measured on 2 cores with BLAKE3 at 5.5 GB/s: in line
    0.80 of the link, a verifier thread less). Where hashing is slower, a pool hashing
    received chunks while the next ones arrive wins (BLAKE3 at 1.5 GB/s against a
    2.5 GB/s link: in line ~0.35 of the link, 2 verifiers ~0.5); the MAC (gmac.py)
    releases the GIL, so verifiers hash in parallel. Where it cannot (no libcrypto: the
    `cryptography` fallback holds the GIL) more than one verifier adds nothing.
    $LIVEMIG_TRANSFER_VERIFIERS sets the count; "auto" (the default) measures the hash
    once and takes 0 at FAST_HASH_GBPS or more, else min(4, cores), or 1 without libcrypto."""
    raw = os.environ.get(ENV_VERIFIERS, "auto").strip().lower()
    if raw in ("", "auto"):
        if hash_gbps() >= FAST_HASH_GBPS:
            return 0
        return min(4, os.cpu_count() or 1) if gmac.releases_gil() else 1
    try:
        n = int(raw)
    except ValueError:
        raise TransferError(f"{ENV_VERIFIERS}={raw!r}: expected a thread count (0: hash in line) or auto") from None
    if not 0 <= n <= 64:
        raise TransferError(f"{ENV_VERIFIERS}={n}: expected 0 to 64 threads (0: hash in line) or auto")
    return n


class _Shared:
    """What the data-channel threads of one pull share, under `cv`."""

    def __init__(self, n: int, alive: list[Source], dropped: list[str],
                 pool: concurrent.futures.ThreadPoolExecutor | None = None) -> None:  # fmt: skip
        self.pool = pool  # verifier threads, or None: each receiving thread hashes in line
        self.cv = threading.Condition()
        self.done = [False] * n
        self.receiving: set[int] = set()  # chunks a thread is writing into place now
        self.remaining = n
        self.refetched = 0
        self.error = ""
        self.alive = alive
        self.dropped = dropped
        self.moved = time.monotonic()  # the last chunk verified or source dropped

    def over(self) -> bool:
        return bool(self.error) or not self.remaining

    def drop(self, s: Source, inflight: collections.deque, why: str) -> None:
        """Hand `s`'s outstanding and queued chunks to the others (caller holds `cv`)."""
        if s not in self.alive:
            return
        s.error = why
        log.warning("transfer source dropped", extra={"source": s.addr, "why": why})
        self.alive.remove(s)
        self.dropped.append(s.addr)
        self.moved = time.monotonic()
        orphans = sorted({q for q, _ in inflight} | set(s.queue))
        inflight.clear()
        s.queue.clear()
        if not self.alive:
            self.error = self.error or f"transfer failed: every source dropped ({'; '.join(self.dropped)}; last: {why})"
        else:
            for k, seq in enumerate(c for c in orphans if not self.done[c]):
                self.alive[k % len(self.alive)].queue.append(seq)
        self.cv.notify_all()

    def next_chunks(self, s: Source, room: int) -> list[int]:
        """Up to `room` chunks for `s`: its own queue, else the tail of the longest other queue."""
        out: list[int] = []
        while len(out) < room:
            if not s.queue:
                donor = max((x for x in self.alive if x is not s), key=lambda x: len(x.queue), default=None)
                if donor is None or len(donor.queue) < 2:
                    break
                s.queue.append(donor.queue.pop())
            seq = s.queue.popleft()
            if not self.done[seq]:
                out.append(seq)
        return out


def tcp_stream(alive: list[Source], chunks: list[P.Chunk], auth: P.ChunkAuth, views: list, job: str,
                secret: bytes, gen: int, item: str, stall: float, dropped: list[str],
                abort: Callable[[], bool] | None = None) -> int:  # fmt: skip
    """Chunks over the data channel, a thread per source; returns how many were refetched."""
    n_verify = verifiers()
    pool = concurrent.futures.ThreadPoolExecutor(n_verify, "livemig-verify") if n_verify else None
    sh = _Shared(len(chunks), alive, dropped, pool)
    args = (sh, chunks, auth, views, job, secret, gen, item, stall)
    workers = [threading.Thread(target=_tcp_worker, args=(s, *args), name="livemig-pull", daemon=True)
               for s in list(alive)]  # fmt: skip
    for w in workers:
        w.start()
    try:
        while True:
            with sh.cv:
                if sh.over():
                    break
                sh.cv.wait(0.05)
                if time.monotonic() - sh.moved > 2 * stall + 1.0:  # a safety net: a source times out sooner
                    sh.error = f"transfer stalled: {sh.remaining} chunk(s) left, none verified in {2 * stall + 1:.1f}s"
                    break
            if abort is not None and abort():
                with sh.cv:
                    sh.error = sh.error or "transfer aborted: the generation moved on"
                break
    finally:
        with sh.cv:
            sh.error = sh.error or ("" if not sh.remaining else "transfer stopped")
            sh.cv.notify_all()
            conns = [s.conn for s in alive if s.conn is not None]
        for c in conns:
            P.shut(c)  # wakes a worker blocked in recv
        for w in workers:
            w.join(timeout=stall + 1.0)
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)  # no verifier reads the destination after we return
    if sh.remaining:
        raise TransferError(sh.error)
    return sh.refetched


def _tcp_worker(s: Source, sh: _Shared, chunks: list[P.Chunk], auth: P.ChunkAuth, views: list, job: str,
                secret: bytes, gen: int, item: str, stall: float) -> None:  # fmt: skip
    key = auth.key  # the reply key, derived once per pull
    inflight: collections.deque[tuple[int, bytes]] = collections.deque()  # (seq, nonce), in request order
    try:
        conn = socket.create_connection(s.data_addr(), timeout=stall)
    except OSError as exc:
        with sh.cv:
            sh.drop(s, inflight, f"source {s.addr} data channel unreachable: {exc}")
        return
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    _blocking_with_timeout(conn, stall)
    with sh.cv:
        s.conn = conn
    why = ""
    try:
        while True:
            with sh.cv:
                while True:
                    if sh.over() or s not in sh.alive:
                        return
                    if s.error:  # a verifier found its last bad chunk
                        why = s.error
                        return
                    fresh = sh.next_chunks(s, P.WINDOW - len(inflight))
                    if fresh or inflight:
                        break
                    sh.cv.wait(0.05)
            frames = []
            for seq in fresh:  # in `inflight` before any send: a failed send hands them all on
                body, nonce = P.request_body(job, gen, item, "chunk", seq=seq)
                mac = P.mac(secret, body)
                frames.append(P.REQ_HEAD.pack(len(mac), len(body)) + mac + body)
                inflight.append((seq, nonce))
            if frames:
                conn.sendall(b"".join(frames))
            seq, nonce = inflight[0]
            why = _tcp_reply(conn, key, nonce, seq, chunks, auth, views, sh, s)
            if why:
                return
            inflight.popleft()
    except TimeoutError:
        why = f"source {s.addr} stalled for {stall:.1f}s"
    except OSError as exc:
        why = f"source {s.addr} closed the data connection ({exc.__class__.__name__})"
    finally:
        with sh.cv:
            if why:
                sh.drop(s, inflight, why)


def _tcp_reply(conn: socket.socket, key: bytes, nonce: bytes, seq: int, chunks: list[P.Chunk], auth: P.ChunkAuth,
               views: list, sh: _Shared, s: Source) -> str:  # fmt: skip
    """Read the reply to chunk `seq` into its place and verify it; why the source must go, or ""."""
    head = P.recv_exact(conn, P.REP_HEAD.size)
    n_meta, n_tag, n_data = P.REP_HEAD.unpack(head)
    if n_meta > P.MAX_META_BYTES or n_tag != P.TAG_BYTES:
        return f"source {s.addr} broke the data channel's framing"
    raw = P.recv_exact(conn, n_meta + n_tag)
    meta_raw, got = raw[:n_meta], raw[n_meta:]
    if not (P.tag_ok(key, nonce, meta_raw, got) or P.tag_ok(key, b"", meta_raw, got)):
        log.error("unauthenticated transfer reply dropped", extra={"source": s.addr})
        return f"source {s.addr} sent a reply that failed authentication"
    try:
        meta = P.unpack(meta_raw)
    except Exception:  # noqa: BLE001 - authenticated yet malformed: not a livemig server
        meta = None
    if not isinstance(meta, dict):
        return f"source {s.addr} sent a malformed reply"
    if not meta.get("ok"):
        return f"source {s.addr} refused: {meta.get('error')}"
    c = chunks[seq]
    if meta.get("seq") != seq or n_data != c.length:
        return f"source {s.addr} answered chunk {meta.get('seq')} with {n_data} bytes for chunk {seq} ({c.length})"
    with sh.cv:  # one receiver at a time writes a chunk's place, and none after it verified
        dup = sh.done[seq] or seq in sh.receiving
        if not dup:
            sh.receiving.add(seq)
    if dup:  # a chunk another source delivered (or is delivering) meanwhile: read past it
        P.recv_exact(conn, memoryview(bytearray(c.length)))
        return ""
    dest = memoryview(views[c.tensor][c.offset : c.offset + c.length]).cast("B")
    if sh.pool is not None:
        try:
            P.recv_exact(conn, dest)
        except BaseException:
            with sh.cv:
                sh.receiving.discard(seq)
            raise
        try:
            sh.pool.submit(_verify_pooled, dest, auth, seq, sh, s)
        except RuntimeError:  # the pull is over (its pool shut down): nothing to verify for
            with sh.cv:
                sh.receiving.discard(seq)
            return "the pull ended"
        return ""
    try:
        mac = _recv_hashed(conn, dest, auth.hasher(seq))
    except BaseException:
        with sh.cv:
            sh.receiving.discard(seq)
        raise
    return _checked(mac, seq, auth, sh, s)


def _verify_pooled(dest: memoryview, auth: P.ChunkAuth, seq: int, sh: _Shared, s: Source) -> None:
    """A verifier thread: the chunk is in place; its place stays claimed (`receiving`)
    until its MAC is checked, so no other copy of it lands there meanwhile."""
    try:
        mac = auth.mac(seq, dest)
    except Exception as exc:  # noqa: BLE001 - never lose a chunk silently: refetch it
        log.warning("chunk verification failed", extra={"seq": seq, "err": str(exc)})
        mac = b""
    why = _checked(mac, seq, auth, sh, s)
    if why:
        with sh.cv:
            s.error = s.error or why  # its receiving thread drops it at its next turn
            sh.cv.notify_all()


def _checked(mac: bytes, seq: int, auth: P.ChunkAuth, sh: _Shared, s: Source) -> str:
    """Mark chunk `seq` verified, or hand it to another source; why `s` must go, or "".
    Its place is released (`receiving`) under the same lock: released first, another
    source's copy could start landing there before `done` is set, and then overwrite
    bytes that count as verified."""
    with sh.cv:
        sh.receiving.discard(seq)
        if sh.done[seq]:
            return ""
        if auth.ok(seq, mac):
            sh.done[seq] = True
            s.served += 1
            sh.remaining -= 1
            sh.moved = time.monotonic()
            if not sh.remaining:
                sh.cv.notify_all()
            return ""
        s.bad += 1
        sh.refetched += 1
        log.warning("chunk failed its checksum; refetching", extra={"seq": seq, "source": s.addr})
        others = [x for x in sh.alive if x is not s] or [s]
        others[seq % len(others)].queue.appendleft(seq)
        sh.cv.notify_all()
    return f"source {s.addr} sent {s.bad} corrupted chunks" if s.bad >= MAX_BAD_CHUNKS else ""


def _recv_hashed(conn: socket.socket, dest: memoryview, h: gmac.Gmac) -> bytes:
    """Receive into `dest` piece by piece, hashing each piece while it is still in the
    CPU's cache: the chunk's MAC costs no second pass over memory. (Measured on 2 cores:
    faster than hashing the whole chunk afterwards, and than a verifier thread.)"""
    base = gmac.address(dest) if h.native else None  # looked up once: `dest` lives through the loop
    for off in range(0, len(dest), HASH_PIECE):
        piece = dest[off : off + HASH_PIECE]
        P.recv_exact(conn, piece)
        if base is None:
            h.update(piece)
        else:
            h.update_at(base + off, len(piece))
    return h.digest()


def _blocking_with_timeout(conn: socket.socket, seconds: float) -> None:
    """A blocking socket whose calls give up after `seconds` (SO_RCVTIMEO/SO_SNDTIMEO):
    unlike Python's own timeout (a non-blocking socket), a blocking one lets
    MSG_WAITALL fill a whole chunk in one call."""
    conn.settimeout(None)
    tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
