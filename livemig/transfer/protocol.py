"""Wire format of state transfer (zmq multipart, msgpack, raw bytes; no pickle).

Request:  [mac, body]       body = msgpack {op, job, gen, item, ...}
          mac = HMAC-SHA256(job secret, body): unauthenticated requests are refused.
Reply to "header": [msgpack {ok, step, gen, skeleton, tensors, chunk, crcs, digest}]
Reply to "chunk":  [msgpack {ok, seq}, raw bytes of the chunk]
Error replies:     [msgpack {ok: False, error: "..."}]

A chunk is (tensor index, byte offset, length); the plan is derived from
the tensor sizes and the chunk size alone, so sender and receiver agree on
it without sending it.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

import msgpack

CHUNK_BYTES = 4 << 20


def pack(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(raw: bytes) -> dict:
    return msgpack.unpackb(raw, raw=False, strict_map_key=False)


def mac(secret: bytes, body: bytes) -> bytes:
    return hmac.new(secret, body, hashlib.sha256).digest()


def verify(secret: bytes, body: bytes, tag: bytes) -> bool:
    return hmac.compare_digest(mac(secret, body), tag)


@dataclass(frozen=True)
class Chunk:
    tensor: int
    offset: int
    length: int


def plan(sizes: list[int], chunk: int = CHUNK_BYTES) -> list[Chunk]:
    out = []
    for i, n in enumerate(sizes):
        for off in range(0, n, chunk):
            out.append(Chunk(i, off, min(chunk, n - off)))
    return out


def combine(crcs: list[int]) -> str:
    """Digest of the whole state from its chunk checksums, in plan order."""
    h = hashlib.sha256()
    for c in crcs:
        h.update(c.to_bytes(4, "little"))
    return h.hexdigest()
