"""Pulls a served state from one or more peers, striped, pipelined, verified.

1. Ask every source for the header. Sources must agree on the state digest
   (replicas of one boundary); a source that disagrees with the majority is
   dropped.
2. Split the chunk plan into contiguous stripes, one per source, and pull
   them in parallel from a single thread (one DEALER socket per source,
   `WINDOW` requests outstanding on each: no stop-and-wait).
3. Chunks travel over the data channel (protocol.py; received in channel.py): one plain TCP connection
   per source and a thread each, whose `recv_into` writes a chunk's bytes
   from the kernel straight into the destination tensor, then checks them
   against the header's keyed MAC
   (protocol.py). Every reply's tag is checked against the nonce of the
   request it answers. A bad chunk or a forged reply is refetched from another
   source; a source that errors, sends bad data repeatedly, or stalls past
   `timeout` is dropped and its outstanding and remaining chunks go to the
   others; a source whose stripe is done takes chunks from the end of the
   longest queue, so a slow source never holds up a pull. Encrypted transfers
   (CURVE) have no data channel: their chunks come over the zmq socket, received
   with `recv_into` out of zmq's buffer, `WINDOW` outstanding per source from
   one thread.
4. The state is returned only when every chunk verified: a caller never
   sees (or commits) a half-loaded state.

Peak extra memory on the receiver: the kernel's socket buffers over TCP; over
zmq what it holds between arrival and `recv_into`, at most WINDOW x CHUNK_BYTES
per source.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from livemig.device import HostStager
from livemig.errors import TransferError, WithdrawnError
from livemig.state import as_bytes, dtype_of, unflatten
from livemig.transfer import protocol as P
from livemig.transfer.channel import MAX_BAD_CHUNKS, tcp_stream
from livemig.transfer.source import Source

log = logging.getLogger("livemig.transfer.puller")


@dataclass
class Pulled:
    step: int
    state: Any
    nbytes: int
    seconds: float
    digest: str
    sources_used: list[str] = field(default_factory=list)
    refetched: int = 0


# alloc(index, meta) -> destination tensor (pre-allocated by the caller, or None to allocate)
Alloc = Callable[[int, dict], torch.Tensor | None]


def pull(
    addrs: str | list[str], job: str, secret: bytes, gen: int, item: str, timeout: float,
    alloc: Alloc | None = None, abort: Callable[[], bool] | None = None, stall: float | None = None,
) -> Pulled:  # fmt: skip
    """Pull `item` of generation `gen`; raises TransferError if it cannot complete.

    timeout bounds the header exchange; `stall` (default min(timeout, 3 s))
    is how long a source may leave chunk requests unanswered before it is
    dropped (zmq does not report a dead peer; a 4 MiB chunk takes ms).
    `abort` is polled every 50 ms and ends the pull (the generation moved on)."""
    t0 = time.monotonic()
    addrs = [addrs] if isinstance(addrs, str) else list(dict.fromkeys(addrs))
    if not addrs:
        raise TransferError("no source to pull from")
    ctx: Any = zmq.Context.instance()
    stall_s = min(timeout, 3.0) if stall is None else stall
    sources = [Source(ctx, a, secret, stall_s) for a in addrs]
    dropped: list[str] = []
    try:
        header, alive = _headers(sources, job, secret, gen, item, timeout, dropped, stall_s, abort)
        metas = header["tensors"]
        dests = _destinations(metas, alloc)
        # a destination on a device lands in host memory first, then is copied in (device.py)
        stager = HostStager()
        landing = [torch.empty(t.numel() * t.element_size(), dtype=torch.uint8, pin_memory=t.is_cuda)
                   if stager.needed(t) else as_bytes(t) for t in dests]  # fmt: skip
        views = [b.numpy() for b in landing]
        chunks = P.plan([m["nbytes"] for m in metas], header["chunk"])
        macs = header["macs"]
        if len(macs) != len(chunks) or P.combine(macs) != header["digest"] or not isinstance(header["step"], int):
            raise TransferError(f"source {alive[0].addr} sent an inconsistent header")
        auth = P.ChunkAuth(P.reply_key(secret), gen, item, header["step"], macs)
        for src, rng in zip(alive, P.stripes(len(chunks), len(alive)), strict=True):
            src.queue.extend(rng)
        if not P.encrypted() and all(s.data_port for s in alive):
            refetched = tcp_stream(alive, chunks, auth, views, job, secret, gen, item, stall_s, dropped, abort)
        else:
            refetched = _stream(alive, chunks, auth, views, job, secret, gen, item, stall_s, dropped, abort)
        for t, host in zip(dests, landing, strict=True):
            if stager.needed(t):
                stager.from_host(host, t)
        state = unflatten(header["skeleton"], dests)
        return Pulled(
            header["step"], state, sum(m["nbytes"] for m in metas), time.monotonic() - t0,
            header["digest"], [s.addr for s in alive if s.served], refetched,
        )  # fmt: skip
    finally:
        for s in sources:
            s.close()


def _headers(sources: list[Source], job: str, secret: bytes, gen: int, item: str, timeout: float,
             dropped: list[str], stall: float = 3.0, abort: Callable[[], bool] | None = None,
             ) -> tuple[dict, list[Source]]:  # fmt: skip
    """Headers from every source; once one answered, the others get `stall` more seconds."""
    key = P.reply_key(secret)
    asked = []
    for s in sources:
        try:
            s.request(job, secret, gen, item, "header")
            asked.append(s)
        except zmq.Again:
            s.error = f"did not take a request within {stall:.1f}s (no connection, or its handshake failed)"
    headers: dict[str, dict] = {}
    poller = zmq.Poller()
    for s in asked:
        poller.register(s.sock, zmq.POLLIN)
    deadline = time.monotonic() + timeout
    pending = {s.sock: s for s in asked}
    while pending and time.monotonic() < deadline:
        if abort is not None and abort():
            raise TransferError("transfer aborted: the generation moved on")
        for sock, _ in poller.poll(50):
            s = pending.pop(sock)
            poller.unregister(sock)
            meta, more = s.reply(key)
            _drain(sock, more)  # a data frame with a header reply: not ours to keep
            if meta is None:
                s.error = (
                    "authentication failed: its reply is not signed with this job's secret (forged? wrong secret?)"
                )
                log.error("unauthenticated transfer reply", extra={"source": s.addr})
            elif meta.get("ok") and isinstance(meta.get("macs"), list):
                headers[s.addr] = meta
                port = meta.get("data")
                s.data_port = port if isinstance(port, int) and 0 < port < 65536 else None
                deadline = min(deadline, time.monotonic() + stall)
            else:
                s.error = f"refused: {meta.get('error')}"
                s.gone = meta.get("gone") is True
    for s in pending.values():
        s.error = f"did not answer within {timeout:.1f}s"
    ok = [s for s in sources if s.addr in headers]
    if not ok:
        why = "no source served the state: " + "; ".join(f"source {s.addr} {s.error}" for s in sources)
        raise WithdrawnError(why) if all(s.gone for s in sources) else TransferError(why)
    votes = collections.Counter(headers[s.addr]["digest"] for s in ok)
    digest = votes.most_common(1)[0][0]
    for s in ok:
        if headers[s.addr]["digest"] != digest:
            log.error("source disagrees on the state digest; dropped", extra={"source": s.addr})
            dropped.append(s.addr)
    alive = [s for s in ok if headers[s.addr]["digest"] == digest]
    return headers[alive[0].addr], alive


def _drain(sock: zmq.Socket, more: bool) -> None:
    """Read past the remaining frames of a reply."""
    while more:
        sock.recv()
        more = bool(sock.getsockopt(zmq.RCVMORE))


def _destinations(metas: list[dict], alloc: Alloc | None) -> list[torch.Tensor]:
    dests = []
    for i, m in enumerate(metas):
        t = alloc(i, m) if alloc else None
        if t is None:
            t = torch.empty(m["shape"], dtype=dtype_of(m["dtype"]))
        elif list(t.shape) != list(m["shape"]) or str(t.dtype).removeprefix("torch.") != m["dtype"]:
            raise TransferError(
                f"tensor {i}: source has {m['dtype']}{tuple(m['shape'])}, destination {t.dtype}{tuple(t.shape)}"
            )
        dests.append(t)
    return dests


def _stream(alive: list[Source], chunks: list[P.Chunk], auth: P.ChunkAuth, views: list, job: str,
            secret: bytes, gen: int, item: str, timeout: float, dropped: list[str],
            abort: Callable[[], bool] | None = None) -> int:  # fmt: skip
    key = auth.key  # the reply key, derived once per pull
    remaining = len(chunks)
    done = [False] * len(chunks)
    refetched = 0
    poller = zmq.Poller()
    by_sock = {s.sock: s for s in alive}
    for s in alive:
        poller.register(s.sock, zmq.POLLIN)

    def drop(s: Source, why: str) -> None:
        s.error = why
        log.warning("transfer source dropped", extra={"source": s.addr, "why": why})
        poller.unregister(s.sock)
        del by_sock[s.sock]
        alive.remove(s)
        dropped.append(s.addr)
        orphans = sorted(set(s.inflight) | set(s.queue))
        s.inflight.clear()
        s.queue.clear()
        if not alive:
            raise TransferError(f"transfer failed: every source dropped ({'; '.join(dropped)}; last: {why})")
        for k, seq in enumerate(c for c in orphans if not done[c]):
            alive[k % len(alive)].queue.append(seq)

    while remaining:
        if abort is not None and abort():
            raise TransferError("transfer aborted: the generation moved on")
        now = time.monotonic()
        for s in list(alive):
            while s.queue and len(s.inflight) < P.WINDOW:
                seq = s.queue.popleft()
                if done[seq]:
                    continue
                if not s.inflight:
                    s.last_reply = now  # the stall clock runs only while requests are outstanding
                try:
                    s.request(job, secret, gen, item, "chunk", seq=seq)
                except zmq.Again:
                    s.queue.appendleft(seq)
                    drop(s, f"source {s.addr} did not take a request within {timeout:.1f}s")
                    break
                s.inflight[seq] = now
            if s.inflight and now - s.last_reply > timeout:
                drop(s, f"source {s.addr} stalled for {timeout:.1f}s")
        for sock, _ in poller.poll(50):
            got = by_sock.get(sock)
            if got is None:
                continue
            s = got
            meta, more = s.reply(key)
            s.last_reply = time.monotonic()
            said = meta.get("seq") if meta is not None else None
            if meta is None or (meta.get("ok") and not (isinstance(said, int) and 0 <= said < len(chunks))):
                _drain(sock, more)  # the rest of a forged reply: never written anywhere
                s.bad += 1
                log.error("unauthenticated transfer reply dropped", extra={"source": s.addr})
                if s.bad >= MAX_BAD_CHUNKS:
                    drop(s, f"source {s.addr} sent {s.bad} replies that failed authentication")
                continue
            if not meta.get("ok") or not isinstance(said, int):
                drop(s, f"source {s.addr} refused: {meta.get('error')}")
                continue
            seq = said
            c = chunks[seq]
            if done[seq] or seq not in s.inflight:  # a duplicate, or a chunk not asked of s: never into place
                _drain(sock, more)  # (its bytes would overwrite a verified chunk)
                s.inflight.pop(seq, None)
                s.nonces.pop(seq, None)
                continue
            dest = views[c.tensor][c.offset : c.offset + c.length]
            n = sock.recv_into(dest) if more else -1
            s.inflight.pop(seq, None)
            s.nonces.pop(seq, None)
            if n != c.length or not auth.ok(seq, auth.mac(seq, dest)):
                s.bad += 1
                refetched += 1
                log.warning("chunk failed its checksum; refetching", extra={"seq": seq, "source": s.addr})
                others = [x for x in alive if x is not s] or [s]
                others[seq % len(others)].queue.appendleft(seq)
                if s.bad >= MAX_BAD_CHUNKS:
                    drop(s, f"source {s.addr} sent {s.bad} corrupted chunks")
                continue
            done[seq] = True
            s.served += 1
            remaining -= 1
    return refetched
