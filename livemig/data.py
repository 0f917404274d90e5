"""Deterministic data and randomness derived from (seed, step, rank).

A spare that takes rank r at step s must read exactly the batch, and draw
exactly the random numbers, that rank r would have: so nothing about the
data position or the RNG lives only in the dead process. `ctx.steps()`
reseeds torch's global generator from `step_seed(seed, step, rank)` before
every step for the same reason.
"""

from __future__ import annotations

import hashlib

import torch


def step_seed(seed: int, step: int, rank: int, stream: str = "") -> int:
    h = hashlib.blake2b(f"{seed}:{step}:{rank}:{stream}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


_ACCELERATED: bool | None = None


def seed_step(seed: int) -> None:
    """`torch.manual_seed` for each step, without its cost where there is no accelerator:
    on a CPU-only host it also queues a lazy CUDA seeding that formats a stack trace
    every call (~1 % of a step on the reference workload). The CPU generator gets the
    same seed either way, so the random streams are the same."""
    global _ACCELERATED
    if _ACCELERATED is None:
        mps = getattr(torch.backends, "mps", None)
        xpu = getattr(torch, "xpu", None)
        _ACCELERATED = bool(torch.cuda.is_available() or (mps is not None and mps.is_available())
                            or (xpu is not None and xpu.is_available()))  # fmt: skip
    if _ACCELERATED:
        torch.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


def batch_generator(step: int, rank: int, world_size: int = 0, seed: int = 0) -> torch.Generator:
    """A generator for rank `rank`'s batch of step `step` (world_size kept for
    samplers that shard a dataset: index = step * world_size + rank)."""
    g = torch.Generator()
    g.manual_seed(step_seed(seed, step, rank, "data"))
    return g


class ElasticSampler(torch.utils.data.Sampler):
    """A batch sampler over a map-style dataset whose batches are a function of
    (seed, epoch, step, rank, world size) alone, so a spare taking rank r at step s
    reads exactly what rank r would have, and a resumed iteration neither drops
    nor repeats a sample.

    Each epoch is a permutation of the dataset seeded from (seed, epoch)
    (`shuffle=False`: in order); global step k of an epoch covers the
    permutation's slots [k*W*B, (k+1)*W*B) and rank r reads the r-th run of B
    of them. The last partial step of an epoch is dropped (every rank must
    take part in every step). Use it as a DataLoader's `batch_sampler` and
    iterate the loader through `ctx.batches(loader)`, which places the
    sampler at the step, rank and world size the loop runs at. The dataset
    must be the same on every rank: only the sampler depends on the rank.

    It takes torch DistributedSampler's `shuffle`, `seed` and `drop_last` (only True: every
    rank takes part in every step) and has its `set_epoch`, which a port may keep: the epoch
    is the global step's (step // steps per epoch), so set_epoch changes nothing. Its rank and
    world size are torch.distributed's default group's from the start (livemig's, under
    `livemig run`), so `len(loader)` is the per-rank number of batches of an epoch before the
    loop as in it.
    """

    def __init__(self, dataset_len: int, batch_size: int, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = True) -> None:  # fmt: skip
        if batch_size < 1 or dataset_len < batch_size:
            raise ValueError(f"ElasticSampler: batch_size {batch_size} must be in 1..dataset_len ({dataset_len})")
        if not drop_last:
            raise ValueError("ElasticSampler: drop_last=False is not supported: the last partial step of an epoch "
                             "is dropped, as every rank must take part in every step")  # fmt: skip
        self.n, self.batch_size, self.seed, self.shuffle = dataset_len, batch_size, seed, shuffle
        self.rank, self.world_size, self.start = 0, 1, 0
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.epoch = 0  # what set_epoch was told (the batches follow the global step)
        self._perm: tuple[int, torch.Tensor] | None = None

    def set_epoch(self, epoch: int) -> None:
        """DistributedSampler's call, kept in a port: the epoch is the global step's already."""
        self.epoch = int(epoch)

    def config(self) -> tuple:
        return (self.n, self.batch_size, self.seed, self.shuffle)

    def place(self, start: int, rank: int, world_size: int) -> None:
        """Where the next iteration starts: global step `start`, as `rank` of `world_size`."""
        if self.n < batch_size_total(self.batch_size, world_size):
            raise ValueError(
                f"ElasticSampler: {self.n} samples cannot fill one step of {world_size} x {self.batch_size}"
            )
        self.start, self.rank, self.world_size = start, rank, world_size

    def place_in_epoch(self, epoch: int, k: int, rank: int, world_size: int) -> None:
        """Step `k` of epoch `epoch` (`ctx.epochs()` counts the epochs), as `rank` of `world_size`."""
        self.place(0, rank, world_size)
        self.start = epoch * self.steps_per_epoch() + k

    def steps_per_epoch(self) -> int:
        return self.n // batch_size_total(self.batch_size, self.world_size)

    def _order(self, epoch: int) -> torch.Tensor:
        if self._perm is None or self._perm[0] != epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(step_seed(self.seed, epoch, -1, "epoch"))
                self._perm = (epoch, torch.randperm(self.n, generator=g))
            else:
                self._perm = (epoch, torch.arange(self.n))
        return self._perm[1]

    def indices(self, step: int) -> list[int]:
        """Rank `self.rank`'s batch at global step `step`."""
        spe = self.steps_per_epoch()
        epoch, k = divmod(step, spe)
        at = (k * self.world_size + self.rank) * self.batch_size
        return self._order(epoch)[at : at + self.batch_size].tolist()

    def __iter__(self):  # noqa: ANN204 - an infinite stream of batches from `start`
        step = self.start
        while True:
            yield self.indices(step)
            step += 1

    def __len__(self) -> int:
        return self.steps_per_epoch()


def batch_size_total(batch: int, world: int) -> int:
    return batch * max(1, world)
