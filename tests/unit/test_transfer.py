"""State transfer over real zmq sockets: exact bytes, auth, generation, checksums."""

from __future__ import annotations

import os
import socket
import threading

import pytest
import torch
import zmq

from livemig.coordinator.sharding import first_mismatch
from livemig.errors import TransferError
from livemig.state import flatten, signature, unflatten
from livemig.transfer import channel
from livemig.transfer import protocol as P
from livemig.transfer.puller import pull
from livemig.transfer.server import StateServer
from tests.helpers.source_proc import make_state

HELPER = os.path.join(os.path.dirname(__file__), "..", "helpers", "source_proc.py")


@pytest.fixture
def served():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1100, 1000), torch.nn.ReLU(), torch.nn.Linear(1000, 3))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 1100)).sum().backward()
    opt.step()
    srv = StateServer("job", b"secret")
    srv.publish(5, "state", lambda: (11, {"model": model.state_dict(), "optimizer": opt.state_dict()}))
    yield srv, model, opt
    srv.close()


def test_pull_is_exact_and_in_place(served):
    srv, model, opt = served
    dest = torch.nn.Sequential(torch.nn.Linear(1100, 1000), torch.nn.ReLU(), torch.nn.Linear(1000, 3))
    targets = list(dest.state_dict().values())
    got = pull(srv.addr, "job", b"secret", 5, "state", 5.0, lambda i, m: targets[i] if i < len(targets) else None)
    assert got.step == 11
    for a, b in zip(model.state_dict().values(), dest.state_dict().values(), strict=True):
        assert torch.equal(a, b)  # received straight into dest's parameters
    st = got.state["optimizer"]["state"]
    for k, v in opt.state_dict()["state"].items():
        assert torch.equal(v["exp_avg"], st[k]["exp_avg"]) and torch.equal(v["step"], st[k]["step"])
    assert len(P.plan([4_400_000])) == 2 and got.nbytes > 3 * P.CHUNK_BYTES  # tensors span chunks


def test_chunk_mac_binds_the_bytes_to_their_place_in_one_served_state():
    """A chunk's MAC (GMAC under a one-time key) is the same wherever the same bytes are
    served for the same place (sources agree, so the digest vote compares them), and
    differs for a flipped byte, another key, or the same bytes in another generation,
    item, step or chunk index (so a valid chunk cannot be replayed into another place);
    the receiving thread's piece-by-piece hash equals the one-shot MAC."""
    key, data = P.reply_key(b"secret"), os.urandom((1 << 20) + 5)
    place = (3, "state", 7, 0)
    mac = P.chunk_mac(P.chunk_key(key, *place), data)
    assert len(mac) == P.TAG_BYTES and P.chunk_mac(P.chunk_key(key, *place), data) == mac
    h = P.ChunkAuth(key, *place[:3], [mac]).hasher(place[3])
    for off in range(0, len(data), 333_333):  # pieces that are not multiples of the AES block
        h.update(memoryview(data)[off : off + 333_333])
    assert h.digest() == mac
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 1
    others = [P.chunk_mac(P.chunk_key(key, *place), bytes(flipped)),
              P.chunk_mac(P.chunk_key(P.reply_key(b"other"), *place), data)]  # fmt: skip
    for k in range(4):
        moved = list(place)
        moved[k] = "grad" if k == 1 else moved[k] + 1
        others.append(P.chunk_mac(P.chunk_key(key, *moved), data))
    assert len({mac, *others}) == len(others) + 1
    auth = P.ChunkAuth(key, *place[:3], [mac])
    assert auth.ok(0, auth.mac(0, data)) and not auth.ok(0, auth.mac(0, bytes(flipped)))


@pytest.mark.parametrize("path", ["libcrypto", "cryptography"])
def test_gmac_equals_aes_gcm_on_either_path(path, monkeypatch):
    """The chunk MAC is computed through libcrypto (releasing the GIL) where it loads, else
    by `cryptography`: both must give AES-GCM's tag, whole or in pieces of any size, for
    read-only and writable buffers, or sources and receivers on different paths disagree."""
    import sys

    import numpy as np
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from livemig.transfer import gmac

    if path == "cryptography":
        monkeypatch.setattr(gmac, "_lib", None)
    elif sys.platform.startswith("linux"):
        assert gmac.releases_gil(), "libcrypto did not load: chunk MACs would hold the GIL"
    for n in (0, 1, 15, 16, 17, 4096 + 3, (1 << 20) + 7):
        key, data = os.urandom(32), os.urandom(n)
        want = AESGCM(key).encrypt(bytes(12), b"", data)
        assert gmac.gmac(key, data) == want and gmac.gmac(key, np.frombuffer(bytearray(data), np.uint8)) == want
        h = gmac.Gmac(key)
        for off in range(0, n, 4099):
            h.update(memoryview(data)[off : off + 4099])
        assert h.digest() == want, n
        # as a receiving thread hashes: pieces landing from a socket, by address where it can
        a, b = socket.socketpair()
        sender = threading.Thread(target=a.sendall, args=(data,))
        sender.start()
        dest = memoryview(bytearray(n))
        try:
            assert channel._recv_hashed(b, dest, gmac.Gmac(key)) == want and dest == data, n
        finally:
            sender.join(timeout=10)
            a.close()
            b.close()
    with pytest.raises(ValueError):
        gmac.Gmac(b"short")


def test_a_withdrawn_item_is_told_apart_from_one_not_served_yet(served):
    """A migrating spare that asks for an average its source has withdrawn must start over
    from a newer snapshot (waiting will not bring it back), while one not served yet is
    worth waiting for: the refusal says which in a field, not in its wording."""
    from livemig.errors import WithdrawnError

    srv, *_ = served
    srv.publish(5, "avg/3", lambda: (3, {"avg": torch.ones(4)}))
    assert torch.equal(pull(srv.addr, "job", b"secret", 5, "avg/3", 2.0).state["avg"], torch.ones(4))
    srv.withdraw("avg/3")
    with pytest.raises(WithdrawnError, match="no longer served"):
        pull(srv.addr, "job", b"secret", 5, "avg/3", 2.0)
    with pytest.raises(TransferError, match="not being served now") as not_yet:
        pull(srv.addr, "job", b"secret", 5, "avg/4", 2.0)
    assert not isinstance(not_yet.value, WithdrawnError)
    # an update older than a leaving worker keeps, whose name the server no longer remembers
    # (a spare stalled for more steps than that): asked for, then refused by the owner
    assert "avg/4" in srv.wanted
    srv.refuse("avg/4")
    assert "avg/4" not in srv.wanted
    with pytest.raises(WithdrawnError, match="no longer served"):
        pull(srv.addr, "job", b"secret", 5, "avg/4", 2.0)
    srv.publish(5, "avg/4", lambda: (4, {"avg": torch.zeros(4)}))  # published after all: served
    assert torch.equal(pull(srv.addr, "job", b"secret", 5, "avg/4", 2.0).state["avg"], torch.zeros(4))


def test_a_leaving_worker_refuses_the_updates_it_no_longer_keeps():
    """Migration.refuse_stale: of the updates a spare asked for, those older than the window a
    leaving worker keeps (AVG_KEEP, from its snapshot's step) are refused; newer ones wait."""
    from livemig.runtime.migration import AVG_KEEP, Migration
    from livemig.runtime.step_state import Outgoing
    from livemig.transfer import items

    class Server:
        def __init__(self) -> None:
            self.wanted = {items.step_avg(k) for k in (3, 9, 10, 30, 31)} | {"snapshot/1", "avg"}
            self.refused: list[str] = []

        def refuse(self, item: str) -> None:
            self.wanted.discard(item)
            self.refused.append(item)

    mig = Migration.__new__(Migration)  # its host is not needed for this rule
    srv = Server()
    mig.out = Outgoing(gen=2, step=10, snap="snapshot")
    mig.refuse_stale(srv)
    assert sorted(srv.refused) == ["avg/3", "avg/9"]  # never served: before the snapshot's step
    mig.out.newest = 30 + AVG_KEEP - 1  # keeps 30..37
    mig.refuse_stale(srv)
    assert sorted(srv.refused) == ["avg/10", "avg/3", "avg/9"] and srv.wanted == {
        "avg/30",
        "avg/31",
        "snapshot/1",
        "avg",
    }
    assert items.step_of_avg("avg/12") == 12 and items.step_of_avg("avg") is None
    assert items.step_of_avg("snapshot/3") is None


def test_wrong_secret_refused(served):
    srv, *_ = served
    with pytest.raises(TransferError, match="authentication failed"):
        pull(srv.addr, "job", b"nope", 5, "state", 2.0)


def test_stale_generation_refused(served):
    srv, *_ = served
    with pytest.raises(TransferError, match="stale or unknown generation 4"):
        pull(srv.addr, "job", b"secret", 4, "state", 2.0)


def test_fenced_server_serves_nothing(served):
    srv, *_ = served
    srv.fence()
    with pytest.raises(TransferError, match="fenced"):
        pull(srv.addr, "job", b"secret", 5, "state", 2.0)


@pytest.mark.parametrize("verifiers", ["0", "2"])
def test_corrupted_chunk_refetched_and_exact(served, monkeypatch, verifiers):
    """Hashed in line by the receiving thread, or by a pool of verifier threads."""
    monkeypatch.setenv("LIVEMIG_TRANSFER_VERIFIERS", verifiers)
    srv, model, _ = served
    srv.hooks.corrupt = {0, 3}
    got = pull(srv.addr, "job", b"secret", 5, "state", 5.0)
    assert got.refetched == 2
    for a, b in zip(model.state_dict().values(), got.state["model"].values(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("verifiers", ["0", "2"])
def test_source_corrupting_everything_is_dropped(served, monkeypatch, verifiers):
    monkeypatch.setenv("LIVEMIG_TRANSFER_VERIFIERS", verifiers)
    srv, *_ = served
    orig = StateServer._handle

    def corrupt(self, frames):
        reply = orig(self, frames)
        if len(reply) == 3:  # [meta, tag, data]: the data of a chunk
            data = bytearray(bytes(reply[2]))
            data[len(data) // 2] ^= 0xFF  # chunks may be shorter than 8 bytes
            reply[2] = bytes(data)
        return reply

    monkeypatch.setattr(StateServer, "_handle", corrupt)
    with pytest.raises(TransferError, match="every source dropped.*corrupted chunks"):
        pull(srv.addr, "job", b"secret", 5, "state", 2.0)


def test_silent_source_times_out():
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(TransferError, match="did not answer within 0.3s"):
            pull(f"tcp://127.0.0.1:{port}", "job", b"s", 1, "state", 0.3)
    finally:
        sock.close(0)


def test_flatten_roundtrip_and_no_pickle():
    obj = {"a": torch.arange(3), "b": [1, 2.5, "x", None, (torch.ones(2), {"c": True})]}
    tensors: list = []
    skel = flatten(obj, tensors)
    back = unflatten(P.unpack(P.pack(skel)), tensors)
    assert torch.equal(back["a"], obj["a"]) and back["b"][4][1] == {"c": True}
    with pytest.raises(Exception, match="cannot stream without pickle"):
        flatten({"x": object()}, [])


def test_signature_mismatch_names_first_difference():
    a = signature(torch.nn.Linear(4, 3).state_dict())
    b = signature(torch.nn.Linear(4, 2).state_dict())
    assert first_mismatch(a, b) == "entry 0: job has weight float32(3, 4), spare has weight float32(2, 4)"
    assert first_mismatch(a, a) is None
    assert "only the job has bias" in first_mismatch(a, a[:1])


def _equal_state(a, b) -> None:
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert v.dtype == b[k].dtype and v.shape == b[k].shape and torch.equal(v, b[k]), k
        else:
            assert v == b[k], k


def test_mixed_dtypes_odd_sizes_striped_over_two_processes(procs):
    srcs = [procs.python(HELPER, "--mb", "20") for _ in range(2)]
    addrs = [p.stdout.readline().decode().strip() for p in srcs]
    got = pull(addrs, "job", b"s3cret", 1, "state", 10.0)
    _equal_state(make_state(20), got.state)
    assert sorted(got.sources_used) == sorted(addrs), "both sources should serve a stripe"


def test_source_killed_mid_transfer_completes_from_the_other(procs):
    dying = procs.python(HELPER, "--mb", "40", "--die-after", "2")
    healthy = procs.python(HELPER, "--mb", "40")
    addrs = [dying.stdout.readline().decode().strip(), healthy.stdout.readline().decode().strip()]
    got = pull(addrs, "job", b"s3cret", 1, "state", 2.0)
    _equal_state(make_state(40), got.state)
    assert dying.wait(timeout=10) == 9, "the dying source should have exited mid-transfer"
    assert got.sources_used == [addrs[1]] or addrs[1] in got.sources_used


def test_every_source_dead_fails_clearly(procs):
    dying = procs.python(HELPER, "--mb", "20", "--die-after", "1")
    addr = dying.stdout.readline().decode().strip()
    with pytest.raises(TransferError, match="every source dropped.*closed the data connection"):
        pull([addr], "job", b"s3cret", 1, "state", 1.0)


def test_request_of_another_job_refused(served):
    """A spare of another job (same secret by accident, other job name) gets nothing."""
    srv, *_ = served
    with pytest.raises(TransferError, match="wrong job 'other'"):
        pull(srv.addr, "other", b"secret", 5, "state", 2.0)


def _req(secret: bytes, **over) -> list[bytes]:
    body, _ = P.request_body("job", 5, "state", "header")
    if over:
        d = P.unpack(body)
        d.update(over)
        body = P.pack(d)
    return [P.mac(secret, body), body]


def test_hostile_frames_are_survived_then_a_pull_is_exact(served):
    """Thousands of random, truncated, oversized, unauthenticated, stale and replayed
    frames: the server answers or drops each, stays up, and then serves an exact pull."""
    import random
    import time

    srv, model, _ = served
    rng = random.Random(7)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(srv.addr)
    good = _req(b"secret")
    frames: list[list[bytes]] = [good, good]  # the second is a replay
    for _ in range(2000):
        kind = rng.randrange(6)
        if kind == 0:
            frames.append([rng.randbytes(rng.randrange(0, 300)) for _ in range(rng.randrange(1, 4))])
        elif kind == 1:
            frames.append([good[0], good[1][: rng.randrange(len(good[1]))]])  # truncated
        elif kind == 2:
            frames.append(_req(b"wrong"))
        elif kind == 3:
            frames.append(_req(b"secret", time=time.time() - 3600))  # stale
        elif kind == 4:
            frames.append([P.mac(b"secret", b"\xc1garbage"), b"\xc1garbage"])  # authenticated garbage
        else:
            frames.append(_req(b"secret", nonce=b"short"))
    for f in frames:
        sock.send_multipart(f)
    answered, deadline = 0, time.monotonic() + 30
    while answered < len(frames) and time.monotonic() < deadline:
        if sock.poll(1000):
            sock.recv_multipart()
            answered += 1
    big = ctx.socket(zmq.DEALER)  # oversized: zmq drops the peer, the server carries on
    big.setsockopt(zmq.LINGER, 0)
    big.connect(srv.addr)
    big.send_multipart([b"x", b"y" * (P.MAX_REQUEST_BYTES + 1)])
    time.sleep(0.2)
    sock.close(0)
    big.close(0)
    assert answered == len(frames), answered  # each hostile request answered with a refusal
    got = pull(srv.addr, "job", b"secret", 5, "state", 5.0)
    for a, b in zip(model.state_dict().values(), got.state["model"].values(), strict=True):
        assert torch.equal(a, b)


def test_a_replayed_request_is_refused(served):
    srv, *_ = served
    key = P.reply_key(b"secret")
    req = _req(b"secret")
    nonce = P.unpack(req[1])["nonce"]
    metas = []
    for _ in range(2):
        reply = srv._handle(req)
        assert P.tag_ok(key, nonce, reply[0], reply[1])
        metas.append(P.unpack(reply[0]))
    assert metas[0]["ok"] and not metas[1]["ok"] and "replayed" in metas[1]["error"], metas


def _liar_dropped_honest_serves(liar: StateServer, srv: StateServer, model, why: str) -> None:
    """Pulled from both, the state is exact and only the honest source served; alone, the
    liar's pull fails naming `why`."""
    try:
        got = pull([liar.addr, srv.addr], "job", b"secret", 5, "state", 5.0)
        assert got.sources_used == [srv.addr]
        for a, b in zip(model.state_dict().values(), got.state["model"].values(), strict=True):
            assert torch.equal(a, b)
        with pytest.raises(TransferError, match=why):
            pull(liar.addr, "job", b"secret", 5, "state", 2.0)
    finally:
        liar.close()


def test_a_forged_reply_is_never_loaded(served, monkeypatch):
    """A source whose replies are not signed with the job's key (a man in the middle,
    a peer without the secret) is dropped; the pull takes the state from an honest one."""
    srv, model, opt = served
    liar = StateServer("job", b"secret")
    liar.publish(5, "state", lambda: (11, {"model": model.state_dict(), "optimizer": opt.state_dict()}))
    liar.key = P.reply_key(b"not the job's secret")  # its tags and MACs are forgeries
    _liar_dropped_honest_serves(liar, srv, model, "authentication failed")


class _Tap:
    """A TCP relay that keeps every byte a server sends: what an eavesdropper sees."""

    def __init__(self, target: str) -> None:
        import socket
        import threading

        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self.seen = bytearray()
        self._lsock = socket.create_server(("127.0.0.1", 0))
        self.addr = f"tcp://127.0.0.1:{self._lsock.getsockname()[1]}"
        self._target = (host, int(port))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        while True:
            try:
                a, _ = self._lsock.accept()
            except OSError:
                return
            b = socket.create_connection(self._target)
            threading.Thread(target=self._pump, args=(a, b, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(b, a, True), daemon=True).start()

    def _pump(self, src, dst, keep: bool) -> None:
        while True:
            try:
                data = src.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                for s in (src, dst):
                    s.close()
                return
            if keep:
                self.seen += data
            dst.sendall(data)

    def close(self) -> None:
        self._lsock.close()


@pytest.mark.parametrize("encrypt", ["0", "1"])
def test_encryption_hides_the_state_on_the_wire(monkeypatch, encrypt):
    """LIVEMIG_TRANSFER_ENCRYPT=1: zmq CURVE with the server's keys derived from the job
    secret. The pull stays exact; the bytes on the wire no longer hold the weights."""
    monkeypatch.setenv(P.ENV_ENCRYPT, encrypt)
    marker = torch.arange(1 << 16, dtype=torch.int64) * 7919 + 12345  # recognisable bytes
    srv = StateServer("job", b"secret")
    srv.publish(5, "state", lambda: (3, {"w": marker.clone()}))
    tap = _Tap(srv.addr)
    if srv.data_port:  # plaintext: chunks take the data channel, tapped too
        data_tap = _Tap(f"tcp://127.0.0.1:{srv.data_port}")
        data_tap.seen = tap.seen
        srv.data_port = int(data_tap.addr.rsplit(":", 1)[1])
    assert (srv.data_port is None) == (encrypt == "1"), "an encrypted server has no plaintext data channel"
    try:
        got = pull(tap.addr, "job", b"secret", 5, "state", 5.0)
        assert torch.equal(got.state["w"], marker)
        needle = marker[1000:1064].numpy().tobytes()
        assert (needle in bytes(tap.seen)) == (encrypt == "0")
        if encrypt == "1":  # a client without the job secret cannot even complete the handshake
            with pytest.raises(TransferError):
                pull(srv.addr, "job", b"other-secret", 5, "state", 1.5)
            monkeypatch.setenv(P.ENV_ENCRYPT, "0")  # nor can a plaintext one, and it is not left hanging
            import time

            for _ in range(3):  # its send once blocked for good on the handshake that never completes
                t0 = time.monotonic()
                with pytest.raises(TransferError):
                    pull(srv.addr, "job", b"secret", 5, "state", 1.5)
                assert time.monotonic() - t0 < 5.0
    finally:
        tap.close()
        srv.close()


def _frame(secret: bytes, **over) -> bytes:
    mac, body = _req(secret, **over)
    return P.REQ_HEAD.pack(len(mac), len(body)) + mac + body


def _read_reply(conn) -> tuple[dict, bytes, bytes, bytes]:
    n_meta, n_tag, n_data = P.REP_HEAD.unpack(P.recv_exact(conn, P.REP_HEAD.size))
    raw = P.recv_exact(conn, n_meta + n_tag + n_data)
    return P.unpack(raw[:n_meta]), raw[:n_meta], raw[n_meta : n_meta + n_tag], raw[n_meta + n_tag :]


def test_data_channel_refuses_replays_and_closes_on_broken_framing(served):
    """The TCP data channel keeps the zmq channel's rules: a replayed request is refused,
    a request of the wrong secret is refused, an oversized or garbage frame ends that
    connection only; the server then serves an exact pull."""
    import random
    import socket

    srv, model, _ = served
    key = P.reply_key(b"secret")
    conn = socket.create_connection(("127.0.0.1", srv.data_port), timeout=5)
    frame = _frame(b"secret", op="chunk", seq=0)
    nonce = P.unpack(frame[P.REQ_HEAD.size + 32 :])["nonce"]
    conn.sendall(frame + frame + _frame(b"wrong", op="chunk", seq=1))
    first, raw, tag, data = _read_reply(conn)
    assert first["ok"] and first["seq"] == 0 and len(data) == P.CHUNK_BYTES and P.tag_ok(key, nonce, raw, tag)
    replay, raw, tag, data = _read_reply(conn)
    assert not replay["ok"] and "replayed" in replay["error"] and not data and P.tag_ok(key, nonce, raw, tag)
    wrong, *_ = _read_reply(conn)
    assert not wrong["ok"] and "authentication failed" in wrong["error"]
    conn.sendall(P.REQ_HEAD.pack(P.MAX_REQUEST_BYTES, 1))  # over the size limit: connection closed
    assert conn.recv(1) == b""
    conn.close()
    rng = random.Random(3)
    for _ in range(50):  # garbage: each connection ends without bringing the server down
        c = socket.create_connection(("127.0.0.1", srv.data_port), timeout=5)
        try:
            c.sendall(rng.randbytes(rng.randrange(1, 400)))
            c.shutdown(socket.SHUT_WR)
            while c.recv(1 << 16):  # a refusal if the garbage framed a request, then the close
                pass
        except OSError:
            pass  # the server closed first (a length over the limit), our garbage unread
        c.close()
    got = pull(srv.addr, "job", b"secret", 5, "state", 5.0)
    for a, b in zip(model.state_dict().values(), got.state["model"].values(), strict=True):
        assert torch.equal(a, b)


def test_a_forged_chunk_reply_on_the_data_channel_drops_its_source(served, monkeypatch):
    """A source whose chunk replies carry a bad tag (a man in the middle on the data
    channel) is dropped at its first reply; its chunks come from the honest source."""
    srv, model, opt = served
    liar = StateServer("job", b"secret")
    liar.publish(5, "state", lambda: (11, {"model": model.state_dict(), "optimizer": opt.state_dict()}))
    orig = StateServer._handle

    def forge(self, frames):
        reply = orig(self, frames)
        if self is liar and len(reply) == 3:
            reply[1] = bytes(P.TAG_BYTES)
        return reply

    monkeypatch.setattr(StateServer, "_handle", forge)
    _liar_dropped_honest_serves(liar, srv, model, "failed authentication")


def test_a_slow_source_does_not_hold_up_the_pull(procs, monkeypatch):
    """Work stealing: a source that answers each chunk late ends up serving fewer chunks;
    the fast one takes from the end of its queue."""
    slow = StateServer("job", b"s3cret")
    state = make_state(80)
    slow.publish(1, "state", lambda: (7, state))
    orig = StateServer._handle

    def lag(self, frames):
        if self is slow:
            import time

            time.sleep(0.3)
        return orig(self, frames)

    monkeypatch.setattr(StateServer, "_handle", lag)
    fast = procs.python(HELPER, "--mb", "80")
    addrs = [slow.addr, fast.stdout.readline().decode().strip()]
    try:
        got = pull(addrs, "job", b"s3cret", 1, "state", 5.0)
        _equal_state(state, got.state)
        tensors: list = []
        flatten(state, tensors)
        n = len(P.plan([t.numel() * t.element_size() for t in tensors]))
        # without stealing it would serve its whole stripe (n // 2); the fast source takes
        # at least 3 of them (not WINDOW + 1 exactly: on 2 busy cores the fast one may lag)
        assert slow.served_chunks <= n // 2 - 3, (slow.served_chunks, n)
    finally:
        slow.close()


def test_a_chunk_being_received_or_verified_is_never_overwritten():
    """The data channel writes a chunk's bytes straight into the destination, so a
    second copy of one chunk (two sources answering it) must never land there: while
    another source's thread receives it, or after it verified, an authentic reply for
    it is read past. Checked on a real socket pair with a correctly tagged reply."""
    import socket
    import threading

    from livemig.transfer import channel as C
    from livemig.transfer.source import Source

    key, nonce = P.reply_key(b"secret"), b"n" * 16
    chunk = P.Chunk(0, 0, 4096)
    dest = torch.zeros(4096, dtype=torch.uint8)
    good = torch.arange(4096, dtype=torch.int64).remainder(251).to(torch.uint8)
    dest.copy_(good)
    src = Source(zmq.Context.instance(), "tcp://127.0.0.1:1", b"secret")
    try:
        sh = C._Shared(1, [src], [])
        for state in ("receiving", "done"):
            if state == "receiving":
                sh.receiving.add(0)
            else:
                sh.receiving.clear()
                sh.done[0] = True
            a, b = socket.socketpair()
            meta = P.pack({"ok": True, "seq": 0})
            frame = P.REP_HEAD.pack(len(meta), P.TAG_BYTES, chunk.length) + meta + P.tag(key, nonce, meta)
            sender = threading.Thread(target=a.sendall, args=(frame + bytes(chunk.length),))  # zeros: a stale copy
            sender.start()
            auth = P.ChunkAuth(key, 1, "state", 0, [P.chunk_mac(P.chunk_key(key, 1, "state", 0, 0), good.numpy())])
            why = C._tcp_reply(b, key, nonce, 0, [chunk], auth, [dest.numpy()], sh, src)
            sender.join(10)
            a.close()
            b.close()
            assert why == "" and torch.equal(dest, good), state
    finally:
        src.close()


def test_verifier_count_is_checked_with_one_line(served, monkeypatch):
    from livemig.transfer import gmac
    from livemig.transfer.channel import FAST_HASH_GBPS, hash_gbps, verifiers

    monkeypatch.setenv("LIVEMIG_TRANSFER_VERIFIERS", "auto")
    slow = min(4, os.cpu_count() or 1) if gmac.releases_gil() else 1  # a GIL-holding MAC: one verifier
    assert verifiers() == (0 if hash_gbps() >= FAST_HASH_GBPS else slow)
    monkeypatch.setenv("LIVEMIG_TRANSFER_VERIFIERS", "3")
    assert verifiers() == 3
    srv, *_ = served
    for bad in ("many", "-1"):
        monkeypatch.setenv("LIVEMIG_TRANSFER_VERIFIERS", bad)
        with pytest.raises(TransferError, match="LIVEMIG_TRANSFER_VERIFIERS=.*expected"):
            pull(srv.addr, "job", b"secret", 5, "state", 2.0)
