"""Pulls a peer's served state into the caller's tensors.

The header gives the skeleton, tensor metadata and one CRC32 per chunk;
chunks are then requested with a window of outstanding requests (no
stop-and-wait), checked, and copied straight into the destination tensor.
A source that refuses, stalls past `timeout` or sends a bad chunk fails the
pull with TransferError; the caller tries the next source.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from livemig.errors import TransferError
from livemig.state import as_bytes, dtype_of, unflatten
from livemig.transfer import protocol as P

log = logging.getLogger("livemig.transfer.client")

WINDOW = 4


@dataclass
class Pulled:
    step: int
    state: Any
    nbytes: int
    seconds: float
    digest: str


# alloc(index, meta) -> destination tensor (pre-allocated by the caller, or None to allocate)
Alloc = Callable[[int, dict], torch.Tensor | None]


def pull(
    addr: str, job: str, secret: bytes, gen: int, item: str, timeout: float,
    alloc: Alloc | None = None,
) -> Pulled:  # fmt: skip
    t0 = time.monotonic()
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    try:

        def send(op: str, **kw: Any) -> None:
            body = P.pack({"op": op, "job": job, "gen": gen, "item": item, **kw})
            sock.send_multipart([P.mac(secret, body), body])

        def recv() -> list[zmq.Frame]:
            if not sock.poll(int(timeout * 1000)):
                raise TransferError(f"source {addr} did not answer within {timeout:.1f}s")
            frames = sock.recv_multipart(copy=False)
            meta = P.unpack(frames[0].bytes)
            if not meta.get("ok"):
                raise TransferError(f"source {addr} refused: {meta.get('error')}")
            frames[0] = meta  # type: ignore[call-overload]
            return frames

        send("header")
        header = recv()[0]
        metas = header["tensors"]
        dests: list[torch.Tensor] = []
        for i, m in enumerate(metas):
            t = alloc(i, m) if alloc else None
            if t is None:
                t = torch.empty(m["shape"], dtype=dtype_of(m["dtype"]))
            elif list(t.shape) != list(m["shape"]) or str(t.dtype).removeprefix("torch.") != m["dtype"]:
                raise TransferError(
                    f"tensor {i}: source has {m['dtype']}{tuple(m['shape'])}, destination {t.dtype}{tuple(t.shape)}"
                )
            dests.append(t)
        views = [as_bytes(t) for t in dests]
        chunks = P.plan([m["nbytes"] for m in metas], header["chunk"])
        crcs = header["crcs"]
        if len(crcs) != len(chunks) or P.combine(crcs) != header["digest"]:
            raise TransferError(f"source {addr} sent an inconsistent header")
        nxt, done = 0, 0
        while done < len(chunks):
            while nxt < len(chunks) and nxt - done < WINDOW:
                send("chunk", seq=nxt)
                nxt += 1
            meta, data = recv()
            seq = meta["seq"]
            c = chunks[seq]
            buf = data.buffer
            if len(buf) != c.length or zlib.crc32(buf) != crcs[seq]:
                raise TransferError(f"chunk {seq} from {addr} failed its checksum")
            views[c.tensor][c.offset : c.offset + c.length].numpy()[:] = memoryview(buf)
            done += 1
        state = unflatten(header["skeleton"], dests)
        nbytes = sum(m["nbytes"] for m in metas)
        return Pulled(header["step"], state, nbytes, time.monotonic() - t0, header["digest"])
    finally:
        sock.close(0)
