"""The spare's standby and activation, and the member's final record.

A warm spare registers under its spare key and waits for a claim; a claim
unwinds the user's function (`Activate`) so it is entered again with the
assigned rank. An aborted migration puts it back to standby (`requeue`).

A collaborator of api.Engine (`engine.standby`): it owns what the standby
measured (when the process or its last requeue started, how the spare waited);
what it uses of the Engine is named in `StandbyHost`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

import torch

from livemig.config import ENV_RANK, ENV_VERIFY_DIR, Role, node_host, node_rank
from livemig.device import device_reserved_mb
from livemig.errors import ConfigError, EtcdUnavailableError
from livemig.rdzv.client import decode, through_outage
from livemig.rdzv.watch import PrefixWatch, wait_for
from livemig.runtime.control import Activate, Stop
from livemig.runtime.step_state import StepState
from livemig.state import flatten
from livemig.transfer.channel import verifiers

if TYPE_CHECKING:
    from livemig.runtime.member import Callbacks, MemberRuntime
    from livemig.runtime.strategies.base import Strategy

log = logging.getLogger("livemig.runtime.standby")


def _result_exists(rt: Any) -> bool:
    try:
        return rt.client.get(rt.keys.result) is not None
    except EtcdUnavailableError:  # an outage: the lease rides it through, and so does the wait
        return False


class StandbyHost(Protocol):
    """What the standby and the final record use of their Engine."""

    runtime: MemberRuntime  # typed so its calls are checked; None outside `livemig run`, tested before use
    rank: int
    incarnation: str
    spare_id: str
    role: Role
    committed: int
    reg: Any
    st: StepState
    loaded_step: int | None
    joining: Any
    ckpt: Any
    fsdp2: Any  # the FSDP2 mesh owner: what survives a redo's re-entry (runtime/fsdp2_mesh.py)
    prints: Any  # per-step fingerprints for --verify (runtime/prints.py)
    halt: Any  # a whole-job stop (runtime/stop.py): the final record says where it stopped
    strategy: Strategy
    virtual: Any  # a shrunk job's carried ranks (runtime/virtual.py): their final records are written here
    follower: Any  # a follow spare's side (runtime/follow.py): started and halted by the standby

    @property
    def pull(self) -> Callbacks: ...  # runtime/pull.py StatePull: MemberRuntime's callbacks while the job may recover

    def signature(self) -> list: ...

    def reset_user_state(self) -> None: ...


class Standby:
    """A spare's standby, and every member's signature and final records (see the module doc)."""

    def __init__(self, host: StandbyHost) -> None:
        self._host = host
        self.started = time.monotonic()  # the process, or its last requeue: the warm-up's start
        self.info: dict[str, float] = {}  # how the spare waited: the final record's, bench warmup reads it
        self._final_written = False

    def register_signature(self) -> None:
        h = self._host
        rt = h.runtime
        ckpt = h.ckpt.settings.dir if h.ckpt.settings else None  # the cold path's (ctx.checkpoints)
        rec = {"incarnation": h.incarnation, "signature": h.signature(), "checkpoint_dir": ckpt}
        rt.put(rt.keys.signature(h.rank), rec)

    def wait_for_claim(self) -> NoReturn:
        """Register as warm and wait for a claim: raises Activate (or Stop when the job
        ended or asked this spare to stop)."""
        import psutil

        h = self._host
        rt = h.runtime
        verifiers()  # the hash speed that picks the pull's verifiers is measured now, not in a recovery
        warm_s = time.monotonic() - self.started
        info = {
            "incarnation": h.incarnation, "host": node_host(), "pid": os.getpid(), "node": node_rank(),
            "state": "warm", "signature": h.signature(), "warmup_s": warm_s, "warm_at": time.time(),
            "peak_rss_mb": psutil.Process().memory_info().rss / 2**20,
            # what its warm-up holds on the device (the caching allocator's reserve): 0 on a CPU
            "device_mb": device_reserved_mb(),
            "follow": h.follower.enabled and h.strategy.follows,  # the coordinator claims a follower first
        }  # fmt: skip
        budget = rt.timeouts.etcd_outage.total_seconds()  # warm during an outage: register once etcd is back
        keeper = rt.spare_keeper = through_outage(
            lambda: rt.rdzv.register(rt.keys.spare(h.spare_id), info, h.incarnation, rt.on_lost),
            budget, "spare registration", rt.fenced.is_set)  # fmt: skip
        rt.start_server()
        h.follower.start()  # --follow: keep the group's state from a member's feed meanwhile (runtime/follow.py)
        log.info("spare warm", extra={"spare": h.spare_id, "warmup_s": round(warm_s, 3)})
        t_warm = time.monotonic()
        key = rt.keys.assignment(h.spare_id)
        ended = threading.Event()  # the job's result: a spare that was not needed exits at once
        result, rev = through_outage(lambda: rt.client.get_with_revision(rt.keys.result), budget, "the job's result")
        if result is not None:
            ended.set()
        watch = PrefixWatch(rt.client, rt.keys.result, lambda ev: ended.set(), rev + 1)
        raw = None
        try:
            while True:
                try:
                    raw = wait_for(rt.client, key, lambda s: s.get(key), 2.0, "a claim",
                                   abort=lambda: rt.fenced.is_set() or ended.is_set())  # fmt: skip
                    break
                except (TimeoutError, InterruptedError):
                    rt.check_fenced()
                    if ended.is_set() or _result_exists(rt):
                        keeper.stop(revoke=True)
                        log.info("the job ended: spare exits", extra={"spare": h.spare_id})
                        raise Stop() from None
                except EtcdUnavailableError:  # an outage: stay warm, the lease rides it through
                    time.sleep(0.5)
        finally:
            watch.cancel()
            if raw is None:
                h.follower.halt(hold=False)
        a = decode(raw)
        # claimed for a lost rank or a planned migration: what the follower applied is kept for the take-over
        h.follower.halt(hold=not (a.get("stop") or a.get("refused")))
        self.info = {
            "warmup_s": warm_s, "warm_rss_mb": info["peak_rss_mb"],
            "claim_rss_mb": psutil.Process().memory_info().rss / 2**20, "waited_s": time.monotonic() - t_warm,
            "process_start": psutil.Process().create_time(), "claimed_at": time.time(),
        }  # fmt: skip
        if a.get("stop"):
            keeper.stop(revoke=True)
            log.info("spare stopped on request", extra={"spare": h.spare_id})
            raise Stop()
        if a.get("refused"):
            keeper.stop(revoke=True)
            raise ConfigError(f"spare {h.spare_id} refused by the job: {a['refused']}")
        raise Activate(int(a["generation"]), int(a["rank"]), bool(a.get("migration")))

    def requeue(self) -> None:
        """Back to standby after an aborted migration: drop the claim, warm up again."""
        h = self._host
        rt = h.runtime
        log.info("migration aborted: back to standby", extra={"spare": h.spare_id})
        if rt.spare_keeper is not None:
            rt.spare_keeper.stop(revoke=True)
            rt.spare_keeper = None
        rt.client.delete(rt.keys.assignment(h.spare_id))
        if rt.keeper is not None:
            rt.keeper.stop(revoke=True)
            rt.keeper = None
        rt.comm.retire(rt.pg)
        rt.back_to_standby()
        h.reset_user_state()
        h.joining = None
        h.rank = int(os.environ.get(ENV_RANK, "0"))
        self.started = time.monotonic()

    def activate(self, act: Activate) -> None:
        """The function is entered again with `act`'s rank: a claimed spare, a survivor of a cold
        restart (its commits stay its own) or of an FSDP2 redo (the boundary's state moves
        into the rebuilt model: runtime/strategies/fsdp2.py)."""
        h = self._host
        log.info("claimed", extra={"rank": act.rank, "generation": act.generation,
                                   "migration": act.migration, "restart": act.restart, "redo": act.redo})  # fmt: skip
        if act.restart:
            self.withdraw_final()  # the job is not done until it is written again
        commits = (h.st.commits, h.st.gen_steps) if act.restart else None
        kept = h.fsdp2.keep() if act.redo else None
        h.reset_user_state()
        h.rank, h.joining = act.rank, act
        if commits is not None:
            h.st.commits, h.st.gen_steps = commits
        if kept is not None:
            h.fsdp2.restore(kept)

    def write_final(self) -> None:
        h = self._host
        rt = h.runtime
        rec = {"incarnation": h.incarnation, "steps": h.committed + 1, "digest": h.reg.state_digest(),
               "digests": h.reg.digests(),
               "commits": h.st.commits, "generation": rt.gen, "role": h.role,
               "joined_at_step": h.loaded_step}  # fmt: skip
        if self.info:
            rec["standby"] = self.info
        if h.follower.enabled:
            rec["follow"] = h.follower.record()
        if h.st.inherited_to >= 0:  # commits up to this step are the leaving worker's (planned migration)
            rec["inherited_to"] = h.st.inherited_to
        rec["peak_rss_mb"] = _peak_rss_mb()
        if h.prints.items:  # --verify: where two runs parted (runtime/prints.py)
            rec["step_prints"] = h.prints.items
        if h.ckpt.settings is not None or h.ckpt.resumed is not None:
            rec["checkpoints"] = h.ckpt.final()
        rec.update(h.halt.final())  # a whole-job stop: the step it checkpointed (runtime/stop.py)
        parts = h.strategy.parts.final_record()  # shard and mirror digests, for the report's checks
        rec.update(parts)
        rt.put(rt.keys.final(h.rank), rec)
        self._final_written = True
        self._write_values(h.rank)
        for v in h.virtual.carried():  # a shrunk job's carried ranks: their state is held here
            with h.virtual.as_rank(v, h.committed):
                carried = {"incarnation": h.incarnation, "steps": h.committed + 1, "digest": h.reg.state_digest(),
                           "digests": h.reg.digests(), "generation": rt.gen, "role": "carried",
                           "carried_by": h.rank, **h.strategy.parts.final_record_of(v)}  # fmt: skip
                rt.put(rt.keys.final(v), carried)
                self._write_values(v)

    def _write_values(self, rank: int) -> None:
        """--verify: this rank's parameters and buffers as one float64 vector, where the command
        asks for them (LIVEMIG_VERIFY_DIR), for a shrunk run's bound (cli/run.py)."""
        where = os.environ.get(ENV_VERIFY_DIR, "")
        if not where:
            return
        tensors: list[torch.Tensor] = []
        s = self._host.reg.state_obj()
        flatten(s["model"], tensors)
        flat = [t.detach().reshape(-1).to("cpu", torch.float64) for t in tensors if t.is_floating_point()]
        vec = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.float64)
        os.makedirs(where, exist_ok=True)
        tmp = os.path.join(where, f".final-{rank}.pt.tmp")
        torch.save(vec, tmp)
        os.replace(tmp, os.path.join(where, f"final-{rank}.pt"))

    def withdraw_final(self) -> None:
        """A cold restart after this member wrote its final record: a record no incarnation
        owns takes its place, so the coordinator does not see the job done before this member
        trained the redone steps again and wrote it anew."""
        h = self._host
        if self._final_written and h.runtime is not None:
            h.runtime.put(h.runtime.keys.final(h.rank), {"incarnation": "", "withdrawn": True})
            self._final_written = False

    def finish(self) -> None:
        """The training function returned: the final record, then the job's end."""
        h = self._host
        if h.runtime is None:
            return
        if h.role == Role.WORKER and h.runtime.keeper is None:  # never registered: ctx.steps() never ran
            raise ConfigError(
                "the training function returned without running `for step in ctx.steps(n)`: a worker "
                "trains inside that loop (is the loop there, and reached?)"
            )
        h.ckpt.wait()  # a part half-written when the process ends would never complete
        self.write_final()
        h.runtime.wait_result(h.pull)  # the recovery's callbacks: the job may recover again meanwhile


def _peak_rss_mb() -> float:
    """This process's peak resident memory (Linux reports ru_maxrss in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
