"""Data loaders in the elastic loop: `ctx.batches(loader)`.

The loader's `batch_sampler` is a `livemig.data.ElasticSampler`; this places it
at the step the loop runs at (the resume step after a recovery, the replayed
step in a spare), with this process's rank and world size, and creates the
loader's iterator only then. Loader workers start with `forkserver` (a forked
copy of a process holding an etcd/gRPC client is not safe; `spawn` works too,
`fork` is refused). A spare keeps the loader of its warm-up, workers running:
once claimed, the user's function builds a new loader, and if it is the same
(dataset type and length, sampler settings, worker count) the warm one is
used instead, so activation does not wait for workers to start.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from livemig.config import Role
from livemig.data import ElasticSampler
from livemig.errors import ConfigError

if TYPE_CHECKING:
    from livemig.runtime.control import Activate
    from livemig.runtime.virtual import VirtualRanks

log = logging.getLogger("livemig.runtime.batches")


def _shape(loader: Any) -> tuple:
    ds = loader.dataset
    return (type(ds).__name__, len(ds), loader.batch_sampler.config(), loader.num_workers)


def _check(loader: Any) -> None:
    if not isinstance(loader.batch_sampler, ElasticSampler):
        raise ConfigError(
            "ctx.batches(loader): the loader's batch_sampler must be a livemig.data.ElasticSampler "
            "(DataLoader(dataset, batch_sampler=ElasticSampler(len(dataset), batch_size, seed), ...))"
        )
    if loader.num_workers > 0:
        ctx = loader.multiprocessing_context
        method = ctx.get_start_method() if ctx is not None else None
        if method == "fork":
            raise ConfigError(
                "ctx.batches(loader): loader workers must not fork a process that holds an etcd (gRPC) client: "
                "use multiprocessing_context='forkserver' or 'spawn'"
            )
        if method is None:
            import multiprocessing as mp

            fs = mp.get_context("forkserver")
            fs.set_forkserver_preload(["torch"])  # workers fork from a server that imported torch once
            loader.multiprocessing_context = fs


class BatchesHost(Protocol):
    """What ctx.batches reads of its member (api.Engine's fields) as the loop moves."""

    role: Role
    world_size: int
    joining: Activate | None
    current: int | None
    virtual: VirtualRanks

    @property
    def warming_up(self) -> bool: ...


class Batches:
    """Owned by api.Engine: a spare's warm loaders (workers running) kept from standby.
    Reads the context's step, rank and world size as the loop moves."""

    def __init__(self, ctx: BatchesHost) -> None:
        self._ctx = ctx
        self._warm: dict[tuple, Any] = {}

    def batches(self, loader: Any) -> Iterator[Any]:
        _check(loader)
        ctx = self._ctx
        if ctx.role == Role.SPARE and ctx.joining is not None:
            warm = self._warm.get(_shape(loader))
            if warm is not None:
                log.info("using the loader warmed up in standby", extra={"workers": warm.num_workers})
                loader = warm
        elif ctx.role == Role.SPARE and loader.num_workers > 0 and loader.persistent_workers:
            self._warm[_shape(loader)] = loader  # standby: keep it, workers and all
        return self._feed(loader)

    def _feed(self, loader: Any) -> Iterator[Any]:
        ctx = self._ctx
        it, expect = None, None
        while True:
            step = ctx.current
            if step is None:
                raise ConfigError("next(ctx.batches(loader)) called outside `for step in ctx.steps(...)`")
            rank = ctx.virtual.rank  # a carried rank's body reads that rank's batch
            if it is None or (step, rank) != expect:  # first use, or the loop moved (a replay, a warm-up, a
                local = ctx.warming_up  # carried rank's body in a shrunk job: runtime/virtual.py)
                loader.batch_sampler.place(step, 0 if local else rank, 1 if local else ctx.world_size)
                it = iter(loader)
            yield next(it)
            expect = (step + 1, rank)
