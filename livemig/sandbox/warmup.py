"""The spare's sandboxed warm-up: the user's real loop body against a group of one."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

from livemig.comm.group import allreduce_mean
from livemig.data import step_seed
from livemig.errors import ConfigError

log = logging.getLogger("livemig.sandbox.warmup")


class SandboxWarmup:
    """Mixed into api.Engine; relies on the attributes Engine.__init__ sets."""

    def _shadow(self, total: int) -> Iterator[int]:
        """Run the user's loop body K times against a world-of-one group.

        Warms the allocator, autograd, kernels, the optimizer's state
        allocation, gloo and the data path. Nothing survives: on activation
        the user's function is entered again and builds everything anew."""
        from livemig.sandbox import shadow_steps, world_of_one

        k = min(shadow_steps(), total)
        if k == 0:
            return
        self._sandbox_pg = world_of_one(self.timeouts.collective)
        try:
            for step in range(k):
                self._current = step
                torch.manual_seed(step_seed(self.seed, step, self.rank))
                yield step
                if self.committed != step:
                    raise ConfigError(f"step {step} ended without ctx.step(): it is the commit point")
        finally:
            self._sandbox_pg = None
            self._current, self.committed, self._commits = None, -1, []
            self._avg = None

    def _sandbox_step(self, t: int) -> None:
        self._ensure_grads()
        if self._zero is not None:  # no peers: this rank's slices of the local gradient
            red = self._reducer
            flats = red.flatten()
            allreduce_mean(self._sandbox_pg, flats, 1, self.timeouts.collective)
            own = [f.chunk(self.world_size)[self._zero.own.shard].clone() for f in flats]
            mirror = [f.chunk(self.world_size)[self._zero.mirror.shard].clone()
                      for f in flats] if self._zero.mirror else None  # fmt: skip
            self._zero.update(own, mirror)
            for p in self._params:
                p.grad = None
            self.committed = t
            return
        if self._reducer is not None:
            flats = self._reducer.flatten()
            allreduce_mean(self._sandbox_pg, flats, 1, self.timeouts.collective)
            self._reducer.write_back(flats)
        self.reg.step_optimizer(self._scaler)
        self.committed = t
