"""The spare's sandboxed warm-up: the user's real loop body against a group of one.

A collaborator of api.Engine (`engine._sandbox`): it owns the world-of-one group
while the warm-up runs; what it reads and resets of the step's state is named in
`SandboxHost`, the part of the Engine it may touch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from livemig.comm.group import allreduce_mean
from livemig.config import Timeouts
from livemig.data import step_seed
from livemig.errors import ConfigError
from livemig.runtime.registry import Registry
from livemig.runtime.step_state import StepState

log = logging.getLogger("livemig.sandbox.warmup")


class SandboxHost(Protocol):
    """What the warm-up uses of its Engine: who it is, what was registered, and the
    step's state it runs and afterwards throws away."""

    timeouts: Timeouts
    seed: int
    rank: int
    world_size: int
    reg: Registry
    committed: int
    _current: int | None
    _st: StepState
    _reducer: Any
    _scaler: Any

    @property
    def _zero(self) -> Any: ...

    @property
    def _params(self) -> list[torch.nn.Parameter]: ...

    def _ensure_grads(self) -> None: ...


class Sandbox:
    """A spare's shadow iterations (see the module doc)."""

    def __init__(self, host: SandboxHost) -> None:
        self._host = host
        self.pg: Any = None  # the world-of-one group, while the warm-up runs

    @property
    def active(self) -> bool:
        return self.pg is not None

    def shadow(self, total: int) -> Iterator[int]:
        """Run the user's loop body K times against a world-of-one group.

        Warms the allocator, autograd, kernels, the optimizer's state
        allocation, gloo and the data path. Nothing survives: on activation
        the user's function is entered again and builds everything anew."""
        from livemig.sandbox import shadow_steps, world_of_one

        h = self._host
        k = min(shadow_steps(), total)
        if k == 0:
            return
        self.pg = world_of_one(h.timeouts.collective)
        try:
            for step in range(k):
                h._current = step
                torch.manual_seed(step_seed(h.seed, step, h.rank))
                yield step
                if h.committed != step:
                    raise ConfigError(f"step {step} ended without ctx.step(): it is the commit point")
        finally:
            self.pg = None
            h._current, h.committed, h._st.commits = None, -1, []
            h._st.avg = None

    def step(self, t: int) -> None:
        """ctx.step() of a shadow iteration: the update of a world of one."""
        h = self._host
        h._ensure_grads()
        zero = h._zero
        if zero is not None:  # no peers: this rank's slices of the local gradient
            flats = h._reducer.flatten()
            allreduce_mean(self.pg, flats, 1, h.timeouts.collective)
            own = [f.chunk(h.world_size)[zero.own.shard].clone() for f in flats]
            mirror = [f.chunk(h.world_size)[zero.mirror.shard].clone() for f in flats] if zero.mirror else None
            zero.update(own, mirror)
            for p in h._params:
                p.grad = None
            h.committed = t
            return
        if h._reducer is not None:
            flats = h._reducer.flatten()
            allreduce_mean(self.pg, flats, 1, h.timeouts.collective)
            h._reducer.write_back(flats)
        h.reg.step_optimizer(h._scaler)
        h.committed = t
