"""State transfer over real zmq sockets: exact bytes, auth, generation, checksums."""

from __future__ import annotations

import pytest
import torch
import zmq

from livemig.errors import TransferError
from livemig.state import first_mismatch, flatten, signature, unflatten
from livemig.transfer import protocol as P
from livemig.transfer.client import pull
from livemig.transfer.server import StateServer


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


def test_corrupted_chunk_detected(served, monkeypatch):
    srv, *_ = served
    orig = StateServer._handle

    def corrupt(self, frames):
        reply = orig(self, frames)
        if len(reply) == 2:
            data = bytearray(bytes(reply[1]))
            data[7] ^= 0xFF
            reply[1] = bytes(data)
        return reply

    monkeypatch.setattr(StateServer, "_handle", corrupt)
    with pytest.raises(TransferError, match="failed its checksum"):
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
