"""Data loaders in the elastic loop: `ctx.batches(loader)`.

The loader's `batch_sampler` is a `livemig.data.ElasticSampler`, or (inside `ctx.epochs()`)
its `sampler` is a torch `DistributedSampler` the script built as under torchrun. This places
the sampler at the step the loop runs at (the resume step after a recovery, the replayed step
in a spare), with this process's rank and world size (a carried rank's in a shrunk job), and
creates the loader's iterator only then: an ElasticSampler at its global step, a
DistributedSampler at the epoch the script set (`set_epoch`) and the step's offset in it, its
first indices skipped without loading their samples. Loader workers start with `forkserver` (a forked
copy of a process holding an etcd/gRPC client is not safe; `spawn` works too,
`fork` is refused). A spare keeps the loader of its warm-up, workers running:
once claimed, the user's function builds a new loader, and if it is the same
(dataset type and length, sampler settings, worker count) the warm one is
used instead, so activation does not wait for workers to start.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch

from livemig.config import Role
from livemig.data import ElasticSampler
from livemig.errors import ConfigError

if TYPE_CHECKING:
    from livemig.runtime.control import Activate
    from livemig.runtime.epochs import EpochLoop
    from livemig.runtime.virtual import VirtualRanks

log = logging.getLogger("livemig.runtime.batches")


def _distributed(loader: Any) -> Any:
    """The loader's torch DistributedSampler, or None."""
    from torch.utils.data import BatchSampler
    from torch.utils.data.distributed import DistributedSampler

    s = getattr(loader, "sampler", None)
    if isinstance(s, DistributedSampler) and isinstance(loader.batch_sampler, BatchSampler):
        return s
    return None


def _shape(loader: Any) -> tuple:
    ds = loader.dataset
    d = _distributed(loader)
    how = loader.batch_sampler.config() if d is None else (d.shuffle, d.seed, d.drop_last, loader.batch_size)
    return (type(ds).__name__, len(ds), how, loader.num_workers)


def _check(loader: Any) -> None:
    if not isinstance(loader.batch_sampler, ElasticSampler) and _distributed(loader) is None:
        raise ConfigError(
            "ctx.batches(loader): the loader's batch_sampler must be a livemig.data.ElasticSampler "
            "(DataLoader(dataset, batch_sampler=ElasticSampler(len(dataset), batch_size, seed), ...)), or its "
            "sampler a torch DistributedSampler iterated inside `for epoch in ctx.epochs(...)`"
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
    epoch_loop: EpochLoop

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
        dist_sampler = _distributed(loader)
        it, expect = None, None
        while True:
            step = ctx.current
            if step is None:
                raise ConfigError("next(ctx.batches(loader)) called outside `for step in ctx.steps(...)`")
            rank = ctx.virtual.rank  # a carried rank's body reads that rank's batch
            plan = ctx.epoch_loop.plan
            epoch, k = (plan.epoch, step - plan.epoch * plan.spe) if plan is not None else (-1, step)
            if it is None or (epoch, step, rank) != expect:  # first use, or the loop moved (an epoch, a replay,
                local = ctx.warming_up  # a warm-up, a carried rank's body in a shrunk job: runtime/virtual.py)
                r, w = (0, 1) if local else (rank, ctx.world_size)
                if dist_sampler is not None:
                    if plan is None:
                        raise ConfigError("ctx.batches(loader) with a DistributedSampler: iterate it inside "
                                          "`for epoch in ctx.epochs(E, len(loader))`, with sampler.set_epoch(epoch) "
                                          "as under torchrun (or use livemig.data.ElasticSampler)")  # fmt: skip
                    place_distributed(loader, dist_sampler, k, r, w)
                elif plan is not None:  # the epoch is ctx.epochs()'s, the step its offset in it
                    loader.batch_sampler.place_in_epoch(epoch, k, r, w)
                else:
                    loader.batch_sampler.place(step, r, w)
                # A new iterator draws its workers' base seed from the global RNG, a warm persistent
                # loader's reset draws none: the step's random stream (dropout) must not depend on
                # which one this process has (a spare claimed at step 0 on the loader it warmed in
                # standby drew nothing where the worker it replaces drew once, and differed).
                with torch.random.fork_rng(devices=[]):
                    it = iter(loader)
            try:
                batch = next(it)
            except StopIteration:
                raise ConfigError(f"ctx.batches(loader) ran out at step {step} (step {k} of epoch {epoch}): the loader "
                                  f"has {len(loader)} batches an epoch; give ctx.epochs() at most that many steps "
                                  "an epoch") from None  # fmt: skip
            yield batch
            expect = (epoch, step + 1, rank)


class _From:
    """A sampler iterated from its `skip`-th index: a DistributedSampler resumed mid-epoch, its
    batches before the resume step never loaded. Its length stays the epoch's (len(loader))."""

    def __init__(self, base: Any, skip: int) -> None:
        self.base, self.skip = base, skip

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(iter(self.base), self.skip, None)

    def __len__(self) -> int:
        return len(self.base)


def place_distributed(loader: Any, sampler: Any, k: int, rank: int, world: int) -> None:
    """The user's DistributedSampler as `rank` of `world` (what it would compute from the default
    group; a carried rank's in a shrunk job), iterated from step `k` of the epoch it was set to."""
    if (sampler.rank, sampler.num_replicas) != (rank, world):
        n = len(sampler.dataset)  # as DistributedSampler.__init__ sizes a rank's share
        per = math.ceil((n - world) / world) if sampler.drop_last and n % world else math.ceil(n / world)
        sampler.rank, sampler.num_replicas, sampler.num_samples, sampler.total_size = rank, world, per, per * world
    loader.batch_sampler.sampler = _From(sampler, k * loader.batch_size)
