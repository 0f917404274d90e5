"""livemig/device.py: the chunked staging every device tensor of a transfer goes through,
run here on CPU tensors with `force=True` (the same loop, ring and offsets a CUDA tensor
takes; the stream and pinned-memory calls are the only parts left to a GPU), and the
device and backend a process picks."""

from __future__ import annotations

import pytest
import torch

from livemig import device


@pytest.mark.parametrize("numel,chunk,depth", [(1000, 64, 4), (1000, 4000, 2), (17, 8, 1), (0, 64, 3), (4096, 1024, 4)])
def test_staging_out_and_back_in_is_bit_exact_in_bounded_chunks(numel, chunk, depth):
    g = torch.Generator().manual_seed(numel)
    src = torch.randn(numel, generator=g, dtype=torch.float32)
    st = device.HostStager(chunk_bytes=chunk, depth=depth, force=True)
    host = st.to_host(src)
    assert host.dtype == torch.uint8 and host.numel() == src.numel() * 4
    assert torch.equal(
        host.view(torch.float32) if numel else host, src.view(torch.uint8).view(torch.float32) if numel else host
    )
    assert st.copies == -(-host.numel() // chunk) and st.peak_bytes <= chunk * depth
    dest = torch.zeros_like(src)
    st.from_host(host, dest)
    assert torch.equal(dest, src)
    assert st.peak_bytes <= chunk * depth  # the ring, whatever the tensor's size


def test_a_host_tensor_needs_no_staging_and_is_not_copied():
    t = torch.arange(10, dtype=torch.int64)
    st = device.HostStager()
    b = st.to_host(t)
    assert b.data_ptr() == t.data_ptr() and st.copies == 0 and st.peak_bytes == 0


def test_the_chunks_cover_the_tensor_in_order():
    t = torch.arange(100, dtype=torch.uint8)
    st = device.HostStager(chunk_bytes=30, depth=2, force=True)
    got = [(at, c.clone()) for at, c in st.chunks(t)]
    assert [at for at, _ in got] == [0, 30, 60, 90]
    assert torch.equal(torch.cat([c for _, c in got]), t)


def test_the_backend_follows_the_device_unless_the_environment_names_one(monkeypatch):
    monkeypatch.delenv("LIVEMIG_BACKEND", raising=False)
    assert device.default_backend(torch.device("cpu")) == "gloo"
    assert device.default_backend(torch.device("cuda", 0)) == "nccl"
    monkeypatch.setenv("LIVEMIG_BACKEND", "gloo")
    assert device.default_backend(torch.device("cuda", 0)) == "gloo"
    assert device.training_device([torch.nn.Parameter(torch.zeros(2))]) == torch.device("cpu")


def test_the_local_rank_comes_from_livemig_then_torchrun(monkeypatch):
    monkeypatch.delenv("LIVEMIG_LOCAL_RANK", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert device.local_rank() == 3
    monkeypatch.setenv("LIVEMIG_LOCAL_RANK", "1")
    assert device.local_rank() == 1


def test_a_state_transfer_through_the_staging_path_is_bit_exact(monkeypatch):
    """Every tensor taken as a device tensor (HostStager.needed forced): the server stages it to
    the host before its MACs, the puller lands it on the host and copies it in, chunk by chunk
    through the ring; the destinations end equal to the source, in place."""
    from livemig.transfer.puller import pull
    from livemig.transfer.server import StateServer

    monkeypatch.setattr(device.HostStager, "needed", lambda self, t: True)
    monkeypatch.setattr(device, "STAGE_CHUNK_BYTES", 1 << 20)  # several chunks per tensor
    g = torch.Generator().manual_seed(3)
    state = {"w": torch.randn(700, 1100, generator=g), "b": torch.randn(13, generator=g).to(torch.bfloat16),
             "n": torch.arange(5, dtype=torch.int64), "e": torch.empty(0)}  # fmt: skip
    srv = StateServer("job", b"secret")
    try:
        srv.publish(2, "state", lambda: (7, state))
        dest = {k: torch.zeros_like(v) for k, v in state.items()}
        names = list(dest)
        got = pull(srv.addr, "job", b"secret", 2, "state", 5.0, lambda i, m: dest[names[i]])
    finally:
        srv.close()
    assert got.step == 7
    for k, v in state.items():
        assert torch.equal(dest[k], v), k


def test_exact_mode_pins_nccls_algorithm_and_protocol_unless_the_user_did(monkeypatch):
    for k in ("NCCL_ALGO", "NCCL_PROTO", "LIVEMIG_NCCL_EXACT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("NCCL_PROTO", "LL128")  # the user's own choice stays
    assert device.nccl_exact_env() == {"NCCL_ALGO": "Ring"}
    import os

    assert os.environ["NCCL_ALGO"] == "Ring" and os.environ["NCCL_PROTO"] == "LL128"
    monkeypatch.delenv("NCCL_ALGO")
    monkeypatch.setenv("LIVEMIG_NCCL_EXACT", "0")
    assert device.nccl_exact_env() == {} and "NCCL_ALGO" not in os.environ
