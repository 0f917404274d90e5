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


def batch_generator(step: int, rank: int, world_size: int = 0, seed: int = 0) -> torch.Generator:
    """A generator for rank `rank`'s batch of step `step` (world_size kept for
    samplers that shard a dataset: index = step * world_size + rank)."""
    g = torch.Generator()
    g.manual_seed(step_seed(seed, step, rank, "data"))
    return g


def shard_indices(step: int, rank: int, world_size: int, batch: int, dataset_len: int) -> list[int]:
    """Indices of rank's batch at `step` in a dataset walked in order."""
    start = (step * world_size + rank) * batch
    return [(start + i) % dataset_len for i in range(batch)]
