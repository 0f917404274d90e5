"""Where training tensors live, and the few operations that differ by device.

livemig has one code path for every device: buckets, shards, mirrors and control tensors
are made on the device of the parameters they belong to, and the only device-specific work
is here: which device and backend a process trains with, and staging device memory to the host
(a state transfer's bytes, MACs and digests are computed on host memory) and back. On a
CPU each of these is the identity or a no-op, which is what the CPU suite runs; the CUDA
branches are marked and, until `scripts/gpu_check.sh` has passed on a GPU, unverified
(README, "GPUs").

Staging (`HostStager`): a device tensor's bytes are copied to the host in chunks through a
small ring of pinned buffers on a side stream that first waits for the training stream's
work so far; the training stream itself never waits longer than one chunk's copy, and the
extra memory is `depth` chunks of pinned host memory (`peak_bytes`), whatever the state's size.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from livemig.config import ENV_BACKEND, ENV_NCCL_EXACT
from livemig.state import as_bytes

STAGE_CHUNK_BYTES = 8 << 20  # one staged copy; the transfer's own chunk (transfer/protocol.py) is 4 MiB
STAGE_DEPTH = 4  # pinned buffers in the ring: copies in flight while earlier chunks are consumed


def local_rank() -> int:
    """This process's index on its node: LIVEMIG_LOCAL_RANK, else torchrun's LOCAL_RANK, else 0."""
    for name in ("LIVEMIG_LOCAL_RANK", "LOCAL_RANK"):
        v = os.environ.get(name, "")
        if v.isdigit():
            return int(v)
    return 0


def training_device(params: Sequence[torch.Tensor] | None = None) -> torch.device:
    """The device a process trains on: its parameters' (the model's device), else
    `cuda:LOCAL_RANK` where CUDA is available, else the CPU."""
    if params:
        return params[0].device
    if torch.cuda.is_available():  # pragma: no cover - needs a GPU
        return torch.device("cuda", local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def default_backend(device: torch.device | None = None) -> str:
    """$LIVEMIG_BACKEND, else NCCL for a process that trains on CUDA and gloo otherwise.
    gloo with CUDA tensors works too (several ranks sharing one GPU in a test)."""
    chosen = os.environ.get(ENV_BACKEND, "")
    if chosen:
        return chosen
    dev = device if device is not None else training_device()
    return "nccl" if dev.type == "cuda" else "gloo"


# NCCL picks an algorithm and protocol per communicator and message size; a re-formed
# communicator (another generation, other peers) may pick others and sum in another order. In
# exact mode livemig pins one of each (ring, simple: what NCCL uses for large all-reduces) unless
# the user set them; LIVEMIG_NCCL_EXACT=0 leaves NCCL free (faster small messages, not exact).
NCCL_EXACT = {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}


def nccl_exact_env() -> dict[str, str]:
    """Set NCCL's algorithm and protocol for exact mode where the user did not (read by NCCL
    when a communicator is made, so before the first); returns what was set."""
    if os.environ.get(ENV_NCCL_EXACT, "1") == "0":
        return {}
    done = {}
    for k, v in NCCL_EXACT.items():
        if k not in os.environ:
            os.environ[k] = done[k] = v
    return done


def device_reserved_mb() -> float:
    """The device memory this process's caching allocator holds (a warm spare's warm-up: the
    model, the optimizer's state, the shadow iterations' activations), 0 where CUDA was never
    initialised."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0.0
    return torch.cuda.memory_reserved() / 2**20  # pragma: no cover - needs a GPU


def is_host(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


class HostStager:
    """Device memory to the host and back in bounded chunks (module doc). `force=True` runs
    the same chunked path on CPU tensors: the logic is tested without a GPU."""

    def __init__(self, chunk_bytes: int | None = None, depth: int = STAGE_DEPTH, force: bool = False) -> None:
        self.chunk_bytes = max(1, chunk_bytes or STAGE_CHUNK_BYTES)
        self.depth = max(1, depth)
        self.force = force
        self._ring: list[torch.Tensor] = []
        self.copies = 0  # chunk copies made (out and in)
        self.peak_bytes = 0  # the pinned host memory the ring holds

    def needed(self, t: torch.Tensor) -> bool:
        return self.force or not is_host(t)

    def _buffers(self, device: torch.device) -> list[torch.Tensor]:
        if not self._ring:
            pin = device.type == "cuda"
            self._ring = [torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=pin) for _ in range(self.depth)]
            self.peak_bytes = self.chunk_bytes * self.depth
        return self._ring

    def chunks(self, t: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        """(offset, host bytes) of `t`'s flat bytes, chunk by chunk, up to `depth` copies in
        flight; a host chunk is valid until the next one is asked for (consume it first)."""
        src = as_bytes(t)
        ring = self._buffers(t.device)
        with _side_stream(t.device) as wait:
            pending: list[tuple[int, torch.Tensor, Any]] = []
            for i, at in enumerate(range(0, src.numel(), self.chunk_bytes)):
                n = min(self.chunk_bytes, src.numel() - at)
                buf = ring[i % self.depth][:n]
                buf.copy_(src[at : at + n], non_blocking=not is_host(t))
                self.copies += 1
                pending.append((at, buf, _event(t.device)))
                if len(pending) == self.depth or at + n >= src.numel():
                    for off, b, ev in pending:
                        wait(ev)
                        yield off, b
                    pending = []

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of `t` (its flat bytes: uint8), made chunk by chunk; a host tensor that
        needs no staging is returned as its own byte view (no copy)."""
        if not self.needed(t):
            return as_bytes(t)
        dst = torch.empty(t.numel() * t.element_size(), dtype=torch.uint8)
        for at, chunk in self.chunks(t):
            dst[at : at + chunk.numel()].copy_(chunk)
        return dst

    def from_host(self, host: torch.Tensor, dest: torch.Tensor) -> None:
        """Copy host bytes (uint8, dest's size) into `dest` on its device, chunk by chunk
        through the ring (pinned memory: the copies are asynchronous), then wait for them."""
        dst = as_bytes(dest)
        if not self.needed(dest):
            dst.copy_(host)
            return
        ring = self._buffers(dest.device)
        with _side_stream(dest.device) as wait:
            events: list[Any] = []
            for i, at in enumerate(range(0, dst.numel(), self.chunk_bytes)):
                n = min(self.chunk_bytes, dst.numel() - at)
                slot = i % self.depth
                if len(events) > slot and events[slot] is not None:
                    wait(events[slot])  # the buffer's previous copy has left it
                buf = ring[slot][:n]
                buf.copy_(host[at : at + n])
                dst[at : at + n].copy_(buf, non_blocking=not is_host(dest))
                self.copies += 1
                ev = _event(dest.device)
                if len(events) > slot:
                    events[slot] = ev
                else:
                    events.append(ev)
            for ev in events:
                wait(ev)


@contextlib.contextmanager
def _side_stream(device: torch.device) -> Iterator[Any]:
    """A stream for staging copies that waits for the current stream's work first; yields a
    wait(event) that blocks the host until a copy recorded by that event is done."""
    if device.type != "cuda":
        yield lambda ev: None
        return
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        yield lambda ev: ev.synchronize()
    current.wait_stream(side)


def _event(device: torch.device) -> Any:
    if device.type != "cuda":
        return None
    ev = torch.cuda.Event()  # pragma: no cover - needs a GPU
    ev.record()  # pragma: no cover
    return ev  # pragma: no cover
