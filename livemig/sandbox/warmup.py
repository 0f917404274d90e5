"""The spare's sandboxed warm-up: the user's real loop body against a group of one.

A collaborator of api.Engine (`engine.sandbox`): it owns the world-of-one group
while the warm-up runs; what it reads and resets of the step's state is named in
`SandboxHost`, the part of the Engine it may touch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, Protocol

import torch

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
    current: int | None
    st: StepState
    reducer: Any
    scaler: Any

    strategy: Any  # the kind of parallelism (runtime/strategies/): its warm-up update

    @property
    def params(self) -> list[torch.nn.Parameter]: ...


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
                h.current = step
                torch.manual_seed(step_seed(h.seed, step, h.rank))
                yield step
                if h.committed != step:
                    raise ConfigError(f"step {step} ended without ctx.step(): it is the commit point")
        finally:
            self.pg = None
            h.current, h.committed, h.st.commits = None, -1, []
            h.st.avg = None

    def step(self, t: int) -> None:
        """ctx.step() of a shadow iteration: the update of a world of one."""
        h = self._host
        h.reg.ensure_grads()
        h.strategy.warmup_step(t, self.pg)
