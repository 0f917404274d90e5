"""The kinds of parallelism a member runs (base.py: the protocol; one file a kind).

`ctx.register()` picks one with `pick`: FSDP2 when the model's parameters are DTensors from
`fully_shard`, ZeRO-1 for `sharding="zero1"`, plain data parallel otherwise, or the user's own
`Strategy` subclass given as `ctx.register(..., strategy=cls)`.
"""

from __future__ import annotations

import os
from typing import Any

from livemig.config import ENV_ZERO1_MIRROR
from livemig.errors import ConfigError
from livemig.runtime.strategies.base import Strategy, StrategyHost
from livemig.runtime.strategies.fsdp2 import Fsdp2
from livemig.runtime.strategies.replicated import Replicated
from livemig.runtime.strategies.zero1_sharded import Zero1

__all__ = ["Fsdp2", "Replicated", "Strategy", "StrategyHost", "Zero1", "check_sharding", "new_reducer", "pick"]


def check_sharding(sharding: str | None, optimizer: Any, fsdp: bool) -> None:
    """ctx.register(sharding=...) names a kind this package has (before anything is registered);
    `fsdp`: the model is sharded by fully_shard already."""
    if fsdp and sharding is not None:
        raise ConfigError(f"ctx.register(sharding={sharding!r}): the model is already sharded by fully_shard; "
                          "leave sharding unset")  # fmt: skip
    if sharding not in (None, "zero1"):
        raise ConfigError(f"ctx.register(sharding={sharding!r}): expected None or 'zero1'")
    if sharding and optimizer is None:
        raise ConfigError("ctx.register(sharding='zero1') needs the optimizer whose state it shards")


def new_reducer(params: list, world: int, sharding: str | None, runtime: Any) -> Any:
    """The gradient buckets of a kind that averages them (comm/reducer.py); ZeRO-1's are cut
    into one slice a rank (reduce-scattered on NCCL, allreduced and sliced on gloo)."""
    from livemig.comm.reducer import GradReducer

    zero = sharding == "zero1"
    scatter = False
    if zero:
        from livemig.comm.zero1 import reduce_mode

        scatter = reduce_mode(runtime.backend if runtime else "gloo") == "reduce_scatter"
    return GradReducer(params, shard_world=world if zero else 0, scatter=scatter, world=world)


def pick(host: StrategyHost, *, fsdp: bool, sharding: str | None, mirror: bool | None, custom: Any = None) -> Strategy:
    """The strategy of a registration: FSDP2 if `fsdp` (the model is sharded by fully_shard),
    ZeRO-1 for sharding="zero1" where the member averages gradients (`host.reducer`), the
    user's `custom` Strategy subclass, else plain data parallel. The registry's layout becomes
    the strategy's (runtime/registry.py, Layout)."""
    strategy = _pick(host, fsdp, sharding, mirror, custom)
    host.reg.layout = strategy.layout
    return strategy


def _pick(host: StrategyHost, fsdp: bool, sharding: str | None, mirror: bool | None, custom: Any) -> Strategy:
    if custom is not None:
        if not (isinstance(custom, type) and issubclass(custom, Strategy)):
            raise ConfigError(f"ctx.register(strategy={custom!r}): expected a subclass of livemig.Strategy")
        if fsdp or sharding is not None:
            raise ConfigError("ctx.register(strategy=...) takes the place of sharding= and fully_shard: give one")
        return custom(host)
    if fsdp:
        return Fsdp2(host, host.fsdp2)
    if sharding == "zero1" and host.reducer is not None:
        from livemig.comm.zero1 import Zero1 as Shards

        if mirror is None:
            mirror = os.environ.get(ENV_ZERO1_MIRROR, "1") not in ("0", "false", "no")
        reg = host.reg
        assert reg.optimizer is not None  # check_sharding refused sharding="zero1" without one
        return Zero1(host, Shards(host.reducer, reg.params, reg.optimizer, host.rank, host.world_size, mirror))
    return Replicated(host)
