"""Wire format of state transfer (zmq multipart, msgpack, raw bytes; no pickle).

Request:  [mac, body]   body = msgpack {op, job, gen, item, seq?, nonce, time}
          mac = HMAC-SHA256(job secret, body). The server refuses a request whose MAC
          is wrong, whose time is more than MAX_SKEW_S away from its clock, or whose
          nonce it has seen within that window (a replay); requests over
          MAX_REQUEST_BYTES are dropped by zmq itself (MAXMSGSIZE).
Reply:    [meta, tag]          header and error replies
          [meta, tag, data]    a chunk (the data frame last: received in place)
          tag = keyed BLAKE3(reply key, nonce || meta): bound to the request's nonce,
          so a reply can be neither forged nor replayed into another request.
Header meta: {ok, step, gen, skeleton, tensors, chunk, macs, digest, data}.

Data channel (chunks; `data` in the header is its TCP port on the server's host,
absent when the transfer is encrypted): a plain TCP connection per source, the
same requests and replies as above, framed so the receiver can read a chunk's
bytes with `recv_into` straight from the kernel into the destination tensor
(zmq copies each message once more out of its own buffer):
  request  REQ_HEAD (mac length, body length) + mac + body
  reply    REP_HEAD (meta length, tag length, data length) + meta + tag + data
The server sends a reply with one `sendmsg` of its parts, the data a view of
the served tensor (no copy in user space). A frame whose lengths break the
limits below ends the connection; requests are answered in order.

Each chunk's data is authenticated by `macs[seq]` from the (authenticated) header,
computed once per served snapshot: AES-256-GMAC (the tag of AES-GCM over no
plaintext, the chunk as associated data) under a one-time key, keyed BLAKE3 of
(gen, item, step, seq) under the reply key. GMAC is a Wegman-Carter MAC: secure
while its key tags one message, which the key's derivation gives (one snapshot
per generation and item); sources that hold the same bytes compute the same MAC,
so the digest vote below still compares them. It runs ~3x faster than keyed
BLAKE3 on a core with AES-NI (docs/benchmarks.md, transfer), and the receiver
hashes every byte it pulls. A MAC over a non-cryptographic checksum would not
authenticate the data (xxh3 collides on purpose-built input), so the data itself
is hashed with the key; a chunk that does not match is refetched from another
source, and the state is returned only when every chunk matched. The whole-state
digest is sha256 over the chunk MACs in plan order. The reply key is derived from
the job secret (never the secret itself).

Encryption (LIVEMIG_TRANSFER_ENCRYPT=1, the same on every host of the job): zmq
CURVE. The server's key pair is derived from the job secret, so every holder of
the job's credentials knows the server's public key and nobody else can play
the server; each client connects with a fresh key pair. The MACs above stay:
CURVE hides the data, the MACs bind it to the job and the request.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import time
from dataclasses import dataclass

import blake3
import msgpack

from livemig.config import ENV_ENCRYPT
from livemig.transfer import gmac

CHUNK_BYTES = 4 << 20
WINDOW = 4  # outstanding chunk requests per source
MAX_SKEW_S = 60.0  # a request's time may differ this much from the server's clock (hosts' clocks)
MAX_REQUEST_BYTES = 64 << 10  # zmq drops a peer that sends a larger message to a state server
TAG_BYTES = 16
REQ_HEAD = struct.Struct(">II")
REP_HEAD = struct.Struct(">III")
MAX_META_BYTES = 1 << 20  # a chunk reply's meta is tens of bytes; more is not a livemig server


def encrypted() -> bool:
    return os.environ.get(ENV_ENCRYPT, "0").strip().lower() in ("1", "true", "yes", "on")


def curve_server_keys(secret: bytes) -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys of every state server of the job: any 32 bytes are a
    Curve25519 secret key, so one derived from the job secret serves."""
    import zmq
    from zmq.utils import z85

    sk = z85.encode(blake3.blake3(b"livemig curve server", key=hashlib.sha256(secret).digest()).digest(32))
    return zmq.curve_public(sk), sk


def secure_server(sock: object, secret: bytes) -> None:
    import zmq

    if encrypted():
        _, sk = curve_server_keys(secret)
        sock.setsockopt(zmq.CURVE_SERVER, 1)  # type: ignore[attr-defined]
        sock.setsockopt(zmq.CURVE_SECRETKEY, sk)  # type: ignore[attr-defined]


def secure_client(sock: object, secret: bytes) -> None:
    import zmq

    if encrypted():
        pk, _ = curve_server_keys(secret)
        public, own = zmq.curve_keypair()
        sock.setsockopt(zmq.CURVE_SERVERKEY, pk)  # type: ignore[attr-defined]
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)  # type: ignore[attr-defined]
        sock.setsockopt(zmq.CURVE_SECRETKEY, own)  # type: ignore[attr-defined]


def pack(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(raw: bytes) -> dict:
    return msgpack.unpackb(raw, raw=False, strict_map_key=False)


def mac(secret: bytes, body: bytes) -> bytes:
    return hmac.new(secret, body, hashlib.sha256).digest()


def verify(secret: bytes, body: bytes, tag: bytes) -> bool:
    return hmac.compare_digest(mac(secret, body), tag)


def request_body(job: str, gen: int, item: str, op: str, **kw: object) -> tuple[bytes, bytes]:
    """(body, nonce) of a fresh request: a random nonce and the sender's time."""
    nonce = os.urandom(16)
    return pack({"op": op, "job": job, "gen": gen, "item": item, "nonce": nonce, "time": time.time(), **kw}), nonce


def reply_key(secret: bytes) -> bytes:
    """The 32-byte BLAKE3 key of replies and chunk MACs, derived from the job secret."""
    return blake3.blake3(secret, derive_key_context="livemig 2026 state transfer reply key").digest()


def tag(key: bytes, nonce: bytes, meta: bytes) -> bytes:
    return blake3.blake3(nonce + meta, key=key).digest(TAG_BYTES)


def tag_ok(key: bytes, nonce: bytes, meta: bytes, got: bytes) -> bool:
    return hmac.compare_digest(tag(key, nonce, meta), got)


def chunk_key(key: bytes, gen: int, item: str, step: int, seq: int) -> bytes:
    """The one-time GMAC key of chunk `seq` of the state served as (gen, item, step)."""
    return blake3.blake3(pack(["livemig chunk", gen, item, step, seq]), key=key).digest(32)


def chunk_mac(ckey: bytes, buf: object) -> bytes:
    """AES-256-GMAC of a chunk's bytes under its one-time key (`chunk_key`)."""
    return gmac.gmac(ckey, buf)


class ChunkAuth:
    """What a pull checks each chunk against: the MACs of the authenticated header,
    under the one-time keys of the state it names (gen, item, step)."""

    def __init__(self, key: bytes, gen: int, item: str, step: int, macs: list[bytes]) -> None:
        self.key, self.gen, self.item, self.step, self.macs = key, gen, item, step, macs

    def ckey(self, seq: int) -> bytes:
        return chunk_key(self.key, self.gen, self.item, self.step, seq)

    def mac(self, seq: int, buf: object) -> bytes:
        return chunk_mac(self.ckey(seq), buf)

    def hasher(self, seq: int) -> gmac.Gmac:
        """`mac` fed piece by piece (a receiving thread hashes each piece while cache-hot)."""
        return gmac.Gmac(self.ckey(seq))

    def ok(self, seq: int, mac: bytes) -> bool:
        return hmac.compare_digest(mac, bytes(self.macs[seq]))


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


def stripes(n_chunks: int, n_sources: int) -> list[range]:
    """Contiguous, near-equal ranges of chunk indices, one per source."""
    return [range(i * n_chunks // n_sources, (i + 1) * n_chunks // n_sources) for i in range(n_sources)]


def combine(macs: list[bytes]) -> str:
    """Digest of the whole state from its chunk MACs, in plan order."""
    h = hashlib.sha256()
    for c in macs:
        h.update(bytes(c))
    return h.hexdigest()


def recv_exact(conn: socket.socket, into: int | memoryview) -> bytes:
    """Fill `into` (or n fresh bytes) from the connection; OSError if it closes first,
    TimeoutError if nothing arrives within the socket's timeout."""
    buf = memoryview(bytearray(into)) if isinstance(into, int) else into
    got = 0
    while got < len(buf):
        try:
            k = conn.recv_into(buf[got:], len(buf) - got, socket.MSG_WAITALL)
        except BlockingIOError as exc:  # SO_RCVTIMEO ran out
            raise TimeoutError("no data within the timeout") from exc
        if not k:
            raise ConnectionResetError("closed by the peer")
        got += k
    return bytes(buf) if isinstance(into, int) else b""


def shut(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
