"""State to and from peers at a step boundary, during a recovery.

A survivor reports its last committed step, reaches the agreed boundary
(fetching a peer's completed average if it missed it) and serves its state;
a claimed spare pulls the state (and ZeRO-1 shards from their holders).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from livemig.comm.group import CollectiveAborted
from livemig.config import Role, buddy_stride
from livemig.errors import RecoveryError, TransferError
from livemig.rdzv.membership import Membership
from livemig.runtime.control import _Activate
from livemig.runtime.step_state import Averaged, Replay
from livemig.state import unpack
from livemig.transfer import items
from livemig.transfer.client import pull

log = logging.getLogger("livemig.runtime.pull")


class StatePull:
    """Mixed into api.Engine; relies on the attributes Engine.__init__ sets."""

    def committed_step(self) -> int | None:
        if self.role == Role.SPARE and self._loaded_step is None:
            return None  # holds no state yet
        return self.committed

    def mirrored_steps(self) -> list[int]:
        """Boundaries of the left neighbour's local state held here (the coordinator checks
        that a lost rank's replay can find its boundary)."""
        return sorted(self._st.mirrored)

    def resumed_step(self) -> int | None:
        """The checkpoint boundary this member loaded, while it is still its last commit: every
        rank's own state of that boundary is then in the checkpoint (a spare needs no mirror)."""
        r = self._ckpt.resumed
        return r if r is not None and r == self.committed else None

    def avg_step(self) -> int | None:
        if self.reg.fsdp is not None:  # FSDP2: the step whose reduced gradient shards are complete here
            return self._fsdp.voted
        return self._st.avg.step if self._st.avg else None

    def catch_up(self, m: Membership) -> dict[str, Any] | None:
        """Reach the agreed boundary (resume_step) of generation m."""
        if m.restart:
            return self._restart_from(m)
        if m.resume_step is None:
            return None
        if self.reg.fsdp is not None:
            return self._fsdp.catch_up(m)
        target = m.resume_step - 1  # last step that must be committed here
        if self.committed_step() == target:
            return self._stream_info if self.role == Role.SPARE else None
        if self.committed_step() is None or (self.role == Role.SPARE and self._current is None):
            return self._pull_state(m)
        if self.committed == target - 1 and self._current == target:
            if self._zero is None:
                self._fetch_avg(m, target)
            elif self._st.avg is not None and self._st.avg.step == target:
                self._commit(target, self._st.avg.flats)  # a peer passed the barrier: finish the step alone
                log.info("finished a step a peer committed, from the slices held here", extra={"step": target})
            else:
                raise RecoveryError(f"rank {self.rank} does not hold the gradient slices of step {target}")
            return None
        raise RecoveryError(
            f"rank {self.rank} committed step {self.committed} and cannot reach the agreed resume step {m.resume_step}"
        )

    def serve(self, m: Membership) -> None:
        if self.reg.fsdp is not None:
            return self._fsdp.serve(m)
        srv = self.runtime.server
        if srv is None or m.resume_step is None or self.committed_step() != m.resume_step - 1:
            return
        # Parameters and optimizer as of our last commit; for the spare's replay of that
        # step (runtime/loop.py), the parameters before it and the boundary before it.
        st = self._st
        replay = {"boundary": st.boundaries.get(self.committed - 1), "before": st.before.get(self.committed),
                  "uses_sync": st.uses_sync} if self._replays else {}  # fmt: skip
        if self._replays and self._ckpt.resumed == self.committed:  # no step ran since the load: nothing to
            replay["resumed"] = self._ckpt.resume_path  # replay, the spare loads its rank's part of it
        srv.publish(m.generation, items.STATE, lambda: (self.committed + 1, {**self.state_obj(), **replay}))
        left = (self.rank - buddy_stride(self.world_size)) % self.world_size
        if self._st.mirrored.get(self.committed - 1) is not None:  # the left neighbour's local state
            blob = self._st.mirrored[self.committed - 1]
            srv.publish(m.generation, items.local(left), lambda: (self.committed + 1, {"blob": blob}))
        key = self.runtime.keys.inject_corrupt(self.rank)
        if self.runtime.client.get(key) is not None:  # fault injection (`livemig inject corrupt`)
            self.runtime.client.delete(key)
            srv.hooks.corrupt_next = True
            log.warning("fault injection: the first chunk served will be corrupted", extra={"rank": self.rank})
        if self._zero is not None:  # every shard held: a spare's, and a survivor's whose layout changes
            for sh in self._zero.held():
                srv.publish(m.generation, items.zshard(sh.shard), lambda sh=sh: (self.committed + 1, sh.state()))
        elif self._st.avg is not None and self._st.avg.step == self.committed:
            avg = self._st.avg
            srv.publish(m.generation, items.AVG, lambda: (avg.step, {"flat": avg.flats}))

    def stage_layout(self, m: Membership) -> None:
        """ZeRO-1: pull the shards generation m's layout gives this member that it does not
        hold (a shrink hands a lost rank's shard to its carrier and moves mirrors; a grow
        hands shards back), from the members serving them (serve above). Kept aside until m
        commits (switch_layout): a generation abandoned before its commit changes nothing."""
        z = self._zero
        if z is None:
            return
        need = z.stage(m.carried)
        me = m.rank_of(self.incarnation)
        for s in need:
            where, part = self._pull_any(m, items.zshard(s), ranks=[r for r in m.members if r != me])
            if part.step != self.committed + 1:
                raise RecoveryError(f"shard {s} from {where} is at step {part.step}, this rank at {self.committed + 1}")
            z.adopt(s, part.state)
            log.info("optimizer shard adopted for a new layout",
                     extra={"shard": s, "source": where, "generation": m.generation, "carried": m.carried})  # fmt: skip

    def switch_layout(self, m: Membership) -> None:
        """Generation m committed: ZeRO-1 holds the shards of its layout from now on."""
        if self._zero is not None:
            self._zero.switch(m.carried)

    def _sources(self, m: Membership, ranks: list[int] | None = None) -> list[str]:
        ranks = m.sources if ranks is None else ranks
        return [m.members[r].addr for r in ranks if r in m.members and m.members[r].addr and r != self.rank]

    def _pull_any(self, m: Membership, item: str, alloc: Callable | None = None,
                  ranks: list[int] | None = None) -> Any:  # fmt: skip
        """Pull `item`, striped over every source (or `ranks`), retrying until the recovery deadline."""
        secret = self.runtime.secret()
        deadline = time.monotonic() + self.timeouts.recovery.total_seconds()
        last = ""
        while time.monotonic() < deadline:
            if self.runtime.m.generation != m.generation:
                raise CollectiveAborted("generation moved on during the transfer")
            addrs = self._sources(m, ranks)
            if not addrs:
                want = m.sources if ranks is None else ranks
                last = (f"no source of ranks {sorted(want)} has a state server address in generation "
                        f"{m.generation}'s table (members: {sorted(m.members)})")  # fmt: skip
            else:
                moved = self.runtime.moved_to_other(m.generation)
                try:
                    got = pull(addrs, self.runtime.job, secret, m.generation, item,
                               self.timeouts.collective.total_seconds(), alloc, abort=moved)  # fmt: skip
                    return ",".join(got.sources_used), got
                except TransferError as exc:
                    if moved():
                        raise CollectiveAborted("generation moved on during the transfer") from exc
                    last = str(exc)
            time.sleep(0.02)
        raise RecoveryError(f"could not pull {item} from the sources of generation {m.generation}: {last}")

    def _fetch_avg(self, m: Membership, t: int) -> None:
        _, got = self._pull_any(m, items.AVG)
        if got.step != t:
            raise RecoveryError(f"source holds the average of step {got.step}, need {t}")
        assert self._reducer is not None
        self._reducer.write_back(got.state["flat"])  # same canonical bucket layout as the source
        log.info("fetched the averaged gradient of a step a peer completed", extra={"step": t})
        # ctx.sync_gradients()/step() take it from here: the user's code between the two
        # still runs once, and the commit is the usual one.
        self._st.fetched = Averaged(t, got.state["flat"])

    def _into_model(self) -> Callable[[int, dict], torch.Tensor | None]:
        """A transfer destination for a state object: its first tensors, the model's,
        are received in place into the spare's own parameters."""
        model_tensors = list(self.model.state_dict().values()) if self.model is not None else []

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
        if self._joining is None or self._joining.generation != m.generation:
            raise _Activate(m.generation, self.rank, restart=True)
        if self._ckpt.resumed is not None and self._ckpt.resume_path == m.restart["path"] and \
                self.committed == self._ckpt.resumed:  # fmt: skip
            return self._stream_info
        from livemig.runtime.checkpoint import load

        t0 = time.monotonic()
        step, _ = load(self, m.restart["path"])
        self.committed = step
        if self.role == Role.SPARE:
            self._loaded_step = step + 1
        self._ckpt.resumed, self._ckpt.resume_path = step, m.restart["path"]
        self._at_boundary(step)  # what a later recovery needs of this boundary
        self._stream_info = {"stream_s": time.monotonic() - t0, "bytes": 0, "source": f"checkpoint {m.restart['path']}"}
        log.info("restarted from a checkpoint", extra={"step": step, "generation": m.generation})
        return self._stream_info

    def _pull_state(self, m: Membership) -> dict[str, Any]:
        t0 = time.monotonic()
        addr, got = self._pull_any(m, items.STATE, self._into_model())
        self.reg.load_state(got.state)
        nbytes = got.nbytes
        if self._zero is not None:  # the shards m's layout gives us (ours, the one we mirror), from their holders
            z = self._zero
            for s in z.stage(m.carried, every=True):
                where, part = self._pull_any(m, items.zshard(s), ranks=[r for r in m.members if r != self.rank])
                if part.step != got.step:
                    raise RecoveryError(f"shard {s} from {where} is at step {part.step}, state at {got.step}")
                z.adopt(s, part.state)
                nbytes += part.nbytes
                addr += f",{where}"
            z.switch(m.carried)
        self.committed = got.step - 1
        self._loaded_step = got.step
        if self.committed >= 0 and self._replays and got.state.get("resumed"):
            # The job resumed from a checkpoint of this very boundary and no step ran since:
            # rank r's own state of it is its part there (runtime/checkpoint.py), no replay.
            from livemig.runtime.checkpoint import load

            load(self, got.state["resumed"])
            self._at_boundary(self.committed)
        elif self.committed >= 0 and self._replays:  # replay step resume-1 (runtime/loop.py, _replay_step)
            st = got.state
            if st.get("boundary") is None or st.get("before") is None:
                raise RecoveryError(f"the source holds no snapshot of the boundary before step {self.committed}")
            local = None
            if self.reg.has_local and self.world_size > 1:
                buddy = (self.rank + buddy_stride(self.world_size)) % self.world_size
                where, part = self._pull_any(m, items.local(self.rank), ranks=[buddy])
                if part.step != got.step:
                    raise RecoveryError(f"the local state of rank {self.rank} on rank {buddy} is of boundary "
                                        f"{part.step - 2}, the replay needs {got.step - 2}")  # fmt: skip
                local = unpack(part.state["blob"])
                nbytes += part.nbytes
                addr += f",{where}"
            avg = None
            if st.get("uses_sync") and self._zero is None:  # the replayed sync_gradients() returns it
                where, part = self._pull_any(m, items.AVG)
                if part.step != self.committed:
                    raise RecoveryError(f"source holds the average of step {part.step}, need {self.committed}")
                avg = part.state["flat"]
                nbytes += part.nbytes
            self._st.replay = Replay(self.committed, unpack(st["boundary"]), local, st["before"], avg, st["extra"])
        self._stream_info = {"stream_s": time.monotonic() - t0, "bytes": nbytes, "source": addr}
        log.info("state loaded", extra={"resume_step": got.step, "bytes": got.nbytes,
                                        "seconds": round(got.seconds, 4)})  # fmt: skip
        return self._stream_info
