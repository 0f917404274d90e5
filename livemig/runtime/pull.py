"""State to and from peers at a step boundary, during a recovery: the member's side of
runtime.member.Callbacks, which MemberRuntime calls back as it follows a generation.

A survivor reports its last committed step, reaches the agreed boundary
(fetching a peer's completed average if it missed it) and serves its state;
a claimed spare pulls the state (and ZeRO-1 shards from their holders). What is
pulled, and from whom, is the strategy's (runtime/strategies/); the transfer
itself (striped over the sources, retried until the recovery deadline) is here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from livemig.comm.group import CollectiveAborted
from livemig.config import Role, buddy_of
from livemig.errors import RecoveryError, TransferError
from livemig.rdzv.membership import Membership
from livemig.runtime.control import Activate
from livemig.transfer import items
from livemig.transfer.puller import pull

if TYPE_CHECKING:
    from livemig.config import Timeouts
    from livemig.runtime.boundary import Boundary
    from livemig.runtime.checkpoint import Checkpointer
    from livemig.runtime.member import MemberRuntime
    from livemig.runtime.registry import Registry
    from livemig.runtime.standby import Standby
    from livemig.runtime.step_state import StepState
    from livemig.runtime.strategies.base import Strategy

log = logging.getLogger("livemig.runtime.pull")


class PullHost(Protocol):
    """What the state pull reads and sets of its member (api.Engine's fields, runtime/member_fields.py)."""

    role: Role
    rank: int
    world_size: int
    timeouts: Timeouts
    runtime: MemberRuntime
    joining: Activate | None
    reg: Registry
    strategy: Strategy
    committed: int
    current: int | None
    loaded_step: int | None
    stream_info: dict[str, Any]
    st: StepState
    ckpt: Checkpointer
    standby: Standby
    boundary: Boundary
    faults: Any  # these two and signature(): the cold path's load takes a checkpoint.CheckpointHost
    virtual: Any

    def signature(self) -> list: ...


class StatePull:
    """One member's side of a recovery's state movement (runtime.member.Callbacks)."""

    def __init__(self, host: PullHost) -> None:
        self.h = host

    def committed_step(self) -> int | None:
        if self.h.role == Role.SPARE and self.h.loaded_step is None:
            return None  # holds no state yet
        return self.h.committed

    def mirrored_steps(self) -> list[int]:
        """Boundaries of the left neighbour's local state held here (the coordinator checks
        that a lost rank's replay can find its boundary)."""
        return sorted(self.h.st.mirrored)

    def resumed_step(self) -> int | None:
        """The checkpoint boundary this member loaded, while it is still its last commit: every
        rank's own state of that boundary is then in the checkpoint (a spare needs no mirror)."""
        r = self.h.ckpt.resumed
        return r if r is not None and r == self.h.committed else None

    def avg_step(self) -> int | None:
        return self.h.strategy.avg_step()

    def catch_up(self, m: Membership) -> dict[str, Any] | None:
        """Reach the agreed boundary (resume_step) of generation m."""
        if m.restart:
            return self._restart_from(m)
        if m.resume_step is None:
            return None
        return self.h.strategy.catch_up(m)

    def serve(self, m: Membership) -> None:
        self.h.strategy.serve(m)

    def stage_layout(self, m: Membership) -> None:
        """Pull the pieces generation m's layout gives this member (ZeRO-1's shards), kept aside
        until m commits (switch_layout): a generation abandoned before its commit changes nothing."""
        self.h.strategy.stage_layout(m)

    def switch_layout(self, m: Membership) -> None:
        """Generation m committed: the strategy holds its layout's pieces from now on."""
        self.h.strategy.switch_layout(m)

    def after_switch(self) -> None:
        """A new group followed outside a step: make the parameters whole again (ZeRO-1)."""
        self.h.strategy.regather()

    def write_final(self) -> None:
        """Record the final state again: the job may end in the group just followed."""
        self.h.standby.write_final()

    def _sources(self, m: Membership, ranks: list[int] | None = None) -> list[str]:
        ranks = m.sources if ranks is None else ranks
        return [m.members[r].addr for r in ranks if r in m.members and m.members[r].addr and r != self.h.rank]

    def pull_any(self, m: Membership, item: str, alloc: Callable | None = None,
                  ranks: list[int] | None = None) -> Any:  # fmt: skip
        """Pull `item`, striped over every source (or `ranks`), retrying until the recovery deadline."""
        secret = self.h.runtime.secret()
        deadline = time.monotonic() + self.h.timeouts.recovery.total_seconds()
        last = ""
        while time.monotonic() < deadline:
            if self.h.runtime.m.generation != m.generation:
                raise CollectiveAborted("generation moved on during the transfer")
            addrs = self._sources(m, ranks)
            if not addrs:
                want = m.sources if ranks is None else ranks
                last = (f"no source of ranks {sorted(want)} has a state server address in generation "
                        f"{m.generation}'s table (members: {sorted(m.members)})")  # fmt: skip
            else:
                moved = self.h.runtime.moved_to_other(m.generation)
                try:
                    got = pull(addrs, self.h.runtime.job, secret, m.generation, item,
                               self.h.timeouts.collective.total_seconds(), alloc, abort=moved)  # fmt: skip
                    return ",".join(got.sources_used), got
                except TransferError as exc:
                    if moved():
                        raise CollectiveAborted("generation moved on during the transfer") from exc
                    last = str(exc)
            time.sleep(0.02)
        raise RecoveryError(f"could not pull {item} from the sources of generation {m.generation}: {last}")

    def into_model(self) -> Callable[[int, dict], torch.Tensor | None]:
        """A transfer destination for a state object: its first tensors, the model's,
        are received in place into the spare's own parameters."""
        model_tensors = list(self.h.reg.model.state_dict().values()) if self.h.reg.model is not None else []

        def alloc(i: int, meta: dict) -> torch.Tensor | None:
            if i < len(model_tensors) and list(model_tensors[i].shape) == meta["shape"]:
                return model_tensors[i]
            return None

        return alloc

    def _restart_from(self, m: Membership) -> dict[str, Any]:
        """The cold path (coordinator/cold.py): every member of m loads the checkpoint at
        m.restart, the survivors in place. A member inside the user's loop is unwound first
        and enters the function again (as a claimed spare does), so the code before the loop
        and the loop itself start from the checkpoint's boundary; this runs again then."""
        if self.h.joining is None or self.h.joining.generation != m.generation:
            raise Activate(m.generation, self.h.rank, restart=True)
        if self.h.ckpt.resumed is not None and self.h.ckpt.resume_path == m.restart["path"] and \
                self.h.committed == self.h.ckpt.resumed:  # fmt: skip
            return self.h.stream_info
        from livemig.runtime.checkpoint import load

        t0 = time.monotonic()
        step, _ = load(self.h, m.restart["path"])
        self.h.committed = step
        if self.h.role == Role.SPARE:
            self.h.loaded_step = step + 1
        self.h.ckpt.resumed, self.h.ckpt.resume_path = step, m.restart["path"]
        self.h.boundary.keep(step)  # what a later recovery needs of this boundary
        where = f"checkpoint {m.restart['path']}"
        self.h.stream_info = {"stream_s": time.monotonic() - t0, "bytes": 0, "source": where}
        log.info("restarted from a checkpoint", extra={"step": step, "generation": m.generation})
        return self.h.stream_info

    def pull_buddy_local(self, m: Membership, step: int, who: str, back: int) -> tuple[str, Any]:
        """This rank's own local state (buffers, local=) from its mirror on the buddy rank, as
        served for resume step `step`; the mirror holds boundary `step - back` (the plain path's
        replay starts a step earlier than FSDP2's take-over)."""
        buddy = buddy_of(self.h.rank, self.h.world_size)
        where, part = self.pull_any(m, items.local(self.h.rank), ranks=[buddy])
        if part.step != step:
            raise RecoveryError(f"the local state of rank {self.h.rank} on rank {buddy} is of boundary "
                                f"{part.step - back}, {who} needs {step - back}")  # fmt: skip
        return where, part
