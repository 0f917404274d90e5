"""What a member is made of: the fields api.Engine sets, which the step loop (runtime/loop.py
StepLoop) reads and its collaborators see through their typed *Host protocols.

Declared once, here, so that a type checker checks every use (each used to rely on "the
attributes Engine.__init__ sets", which no tool could see), and so that a reader finds in one
place what state a member carries between steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from livemig.comm.reducer import GradReducer
    from livemig.config import Role, Timeouts
    from livemig.runtime.boundary import Boundary
    from livemig.runtime.checkpoint import Checkpointer
    from livemig.runtime.control import Activate
    from livemig.runtime.entry import Entry
    from livemig.runtime.epochs import EpochLoop
    from livemig.runtime.follow import Feed, Follower
    from livemig.runtime.fsdp2_mesh import Fsdp2
    from livemig.runtime.lazy_init import LazyInit
    from livemig.runtime.member import MemberRuntime
    from livemig.runtime.migration import Migration
    from livemig.runtime.preloop import PreLoop
    from livemig.runtime.prints import StepPrints
    from livemig.runtime.pull import StatePull
    from livemig.runtime.registry import Registry
    from livemig.runtime.self_faults import SelfFaults
    from livemig.runtime.standby import Standby
    from livemig.runtime.step_state import StepState
    from livemig.runtime.strategies.base import Strategy
    from livemig.runtime.virtual import VirtualRanks
    from livemig.sandbox.warmup import Sandbox


class MemberFields:
    """A member's fields (set by api.Engine) and its views of the registered state."""

    # who it is
    seed: int
    role: Role
    incarnation: str
    timeouts: Timeouts
    runtime: MemberRuntime  # None outside `livemig run` (a local process): tested before use
    rank: int
    world_size: int
    spare_id: str
    joining: Activate | None  # the claim (or cold restart, FSDP2 redo) the function was entered again for
    # what was registered and how it trains
    reg: Registry
    reducer: GradReducer | None
    strategy: Strategy
    scaler: Any  # the torch.amp.GradScaler of the ctx.step() in progress
    grad_views: bool
    # where it is
    committed: int  # the last step whose optimizer update is applied here
    current: int | None  # the step being run (between yield and ctx.step())
    steps_called: bool  # ctx.steps() ran in this entry of the function (a second call is refused)
    loaded_step: int | None  # a spare: the resume step of the state it loaded
    stream_info: dict[str, Any]  # what the last pull streamed (the report's stream phase)
    step_t0: float
    st: StepState
    _last_metrics: dict[str, float]
    _total: int
    _no_grad_said: bool
    # its collaborators
    boundary: Boundary
    pull: StatePull
    migration: Migration
    feed: Feed  # a worker's feed of its updates to follow spares (runtime/follow.py)
    follower: Follower  # a follow spare's side: survives the function's re-entry
    lazy: LazyInit  # a claimed spare's build without its random fills (runtime/lazy_init.py)
    virtual: VirtualRanks
    sandbox: Sandbox
    standby: Standby
    faults: SelfFaults
    ckpt: Checkpointer
    fsdp2: Fsdp2
    preloop: PreLoop
    prints: StepPrints
    entry: Entry
    epoch_loop: EpochLoop

    # -- the registered state (runtime/registry.py) ------------------------------------------
    @property
    def model(self) -> torch.nn.Module | None:
        return self.reg.model

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.reg.optimizer

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return self.reg.params

    def signature(self) -> list:
        return self.reg.signature() + self.strategy.signature()

    @property
    def warming_up(self) -> bool:
        """True while a spare runs its sandboxed warm-up iterations (as rank 0 of a world
        of one, or with FSDP2 alone in a world of the job's size: runtime/fsdp2_mesh.py;
        nothing survives them): guard side effects with
        `if not ctx.warming_up and ctx.rank == 0:`."""
        return self.sandbox.active
