"""Process groups torch knows, whose communicator livemig swaps at a generation change.

FSDP2 (`fully_shard`) and DeviceMesh take their groups from torch.distributed: a mesh needs a
default process group (DeviceMesh asks `get_rank()` of it) and each mesh dimension is a group
torch created and named. livemig's own groups (comm/group.py) are gloo backends built from a
generation's store, one per generation, which torch has never heard of. This module bridges
the two the way issue 32 asks, keeping the objects FSDP2 holds stable and swapping what is
under them:

- `install()` registers a c10d backend named "livemig" (`dist.Backend.register_backend`,
  public) and calls `dist.init_process_group("livemig", ...)` once per process; torch then
  creates the default group and every mesh sub-group through our creator, which returns a
  `SwappableGroup`: a Python `dist.ProcessGroup` whose collectives delegate to an inner
  backend (a gloo group of the current generation; NCCL is the same call on a device).
- `swap_all(build)` gives every such group a new inner backend for a new generation (its
  store, the same ranks): DeviceMesh, the DTensors' placements and FSDP2's state keep their
  group objects, user code keeps its mesh.

What this rests on besides public API, pinned by tests/unit/test_torch_group.py (a torch
upgrade that changes it fails there, loudly): a creator that returns a `dist.ProcessGroup`
subclass is used as the group itself (torch's "PythonProcessGroup" path in
`_new_process_group_helper`); such a group's `group_name` must be answered by the subclass
(the C++ name is never set on that path); FSDP2's collectives call the group's
`all_gather_single` / `reduce_scatter_single` (torch 2.13), delegated to the gloo backend's
`_allgather_base` / `_reduce_scatter_base`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

BACKEND = "livemig"
_lock = threading.Lock()
_groups: list[SwappableGroup] = []  # every group torch created through us, default first
_registered = False


class SwappableGroup(dist.ProcessGroup):
    """A torch process group with a replaceable communicator underneath."""

    def __init__(self, rank: int, size: int, ranks: list[int], name: str, inner: Any) -> None:
        super().__init__(rank, size)
        self.ranks = ranks  # global ranks, in group-rank order
        self.inner = inner
        self._name = name
        self.generation = 0

    # the name torch gives the group (DeviceMesh keys its dimensions by it)
    @property
    def group_name(self) -> str:  # type: ignore[override]
        return self._name

    def _set_group_name(self, name: str) -> None:
        self._name = name

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return BACKEND

    def swap(self, inner: Any, generation: int) -> None:
        """Trains on `inner` from the next collective on (called between steps)."""
        self.inner, self.generation = inner, generation

    # -- the collectives, delegated ---------------------------------------------------------
    def allreduce(self, *a: Any, **k: Any) -> Any:
        return self.inner.allreduce(*a, **k)

    def allreduce_coalesced(self, *a: Any, **k: Any) -> Any:
        return self.inner.allreduce_coalesced(*a, **k)

    def allgather(self, *a: Any, **k: Any) -> Any:
        return self.inner.allgather(*a, **k)

    def _allgather_base(self, *a: Any, **k: Any) -> Any:
        return self.inner._allgather_base(*a, **k)

    def allgather_into_tensor_coalesced(self, *a: Any, **k: Any) -> Any:
        return self.inner.allgather_into_tensor_coalesced(*a, **k)

    def all_gather_single(self, out: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> Any:
        return self.inner._allgather_base(out, inp)

    def reduce_scatter(self, *a: Any, **k: Any) -> Any:
        return self.inner.reduce_scatter(*a, **k)

    def _reduce_scatter_base(self, *a: Any, **k: Any) -> Any:
        return self.inner._reduce_scatter_base(*a, **k)

    def reduce_scatter_tensor_coalesced(self, *a: Any, **k: Any) -> Any:
        return self.inner.reduce_scatter_tensor_coalesced(*a, **k)

    def reduce_scatter_single(self, out: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> Any:
        o = dist.ReduceScatterOptions()
        o.reduceOp = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        return self.inner._reduce_scatter_base(out, inp, o)

    def broadcast(self, *a: Any, **k: Any) -> Any:
        return self.inner.broadcast(*a, **k)

    def allgather_coalesced(self, *a: Any, **k: Any) -> Any:
        return self.inner.allgather_coalesced(*a, **k)

    def barrier(self, *a: Any, **k: Any) -> Any:
        return self.inner.barrier(*a, **k)


def gloo_inner(store: dist.Store, rank: int, size: int, timeout: timedelta) -> Any:
    """The default inner communicator: a gloo backend on `store`."""
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _creator(opts: Any, _backend_opts: Any) -> SwappableGroup:
    ranks = list(opts.global_ranks_in_group) or list(range(opts.group_size))
    inner = _factory["fn"](opts.store, opts.group_rank, opts.group_size, opts.timeout)
    g = SwappableGroup(opts.group_rank, opts.group_size, ranks, str(opts.group_id), inner)
    with _lock:
        _groups.append(g)
    return g


_factory: dict[str, Callable[..., Any]] = {"fn": gloo_inner}


def install(store: dist.Store, rank: int, world: int, timeout: timedelta,
            inner: Callable[[dist.Store, int, int, timedelta], Any] = gloo_inner) -> SwappableGroup:  # fmt: skip
    """Make torch.distributed's default group a SwappableGroup over `store` (once per
    process; a second call returns the same group): from here on `init_device_mesh`,
    `new_group` and `fully_shard` work on groups whose communicator livemig owns."""
    global _registered
    with _lock:
        if not _registered:
            dist.Backend.register_backend(BACKEND, _creator, extended_api=True, devices=["cpu", "cuda"])
            _registered = True
        _factory["fn"] = inner
    if not dist.is_initialized():
        dist.init_process_group(BACKEND, store=store, rank=rank, world_size=world, timeout=timeout)
    default = dist.distributed_c10d._get_default_group()
    if not isinstance(default, SwappableGroup):
        raise RuntimeError("torch.distributed was initialised by someone else: livemig cannot own its groups")
    return default


def groups() -> list[SwappableGroup]:
    with _lock:
        return list(_groups)


def swap_all(store_for: Callable[[SwappableGroup], dist.Store], rank: int, generation: int,
             timeout: timedelta, inner: Callable[..., Any] | None = None) -> None:  # fmt: skip
    """A new generation: every group this process is in gets a new communicator over the
    store `store_for(group)` (each group its own prefix), the same ranks. Every member of a
    group must swap it (the builds rendezvous in the store)."""
    make = inner or _factory["fn"]
    for g in groups():
        if rank not in g.ranks:
            continue
        g.swap(make(store_for(g), g.ranks.index(rank), len(g.ranks), timeout), generation)
