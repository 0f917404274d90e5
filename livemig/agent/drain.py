"""A drain: SIGTERM to one node's agent of a job of several nodes (`--on-sigterm drain`).

SIGTERM is what an orchestrator sends first when a node goes away with a grace period: Slurm
preemption or `scontrol requeue` (KillWait, 30 s by default), a Kubernetes drain, eviction or
scale-down (terminationGracePeriodSeconds, 30 s). Ending the whole job there is what live
recovery exists to avoid. So the agent hands its node's ranks to the rest of the job and
leaves: it announces the drain (`drains/<node>`: its ranks), checks that the job can do
without them (warm spares of other agents for every rank of every node draining now, or a
shrink within `--min-nproc`; its own spares leave with it), then stops its coordinator
candidate (which resigns the lead at once if it held it: no lease-length wait) and its workers
and spares, and reports the workers gone as it reports any lost child. The leader recovers
them in one generation change, as a failure that needs no detection: spares claimed and
streamed into from the live replicas (or the survivors carry them), bit-identical as every
recovery. The agent exits 0 once its ranks run elsewhere in a committed generation, within
`--drain-grace` (default 25 s, under both orchestrators' 30 s).

When the whole job is told to stop (every node with ranks drains within SETTLE_S, as Slurm's
time limit, preemption, `scancel` and `scontrol requeue` and a Kubernetes Job's deletion do)
or cannot do without the node (no spare and no shrink allowed; several nodes draining with
too few spares), the job stops at a checkpoint when it has a `--checkpoint-dir`: the agent
writes `keys.stop`, the members agree on a step inside its collective, write one checkpoint of
its boundary and leave (runtime/stop.py); every agent exits with STOPPED_EXIT, and the job run
again with the same --checkpoint-dir resumes from it, exactly. Without a checkpoint directory,
on a second SIGTERM, or once the grace runs out: the agent stops the job as before
(interrupted, report written).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import TYPE_CHECKING, Any, Protocol

from livemig.config import ENV_HOST, Role
from livemig.rdzv.client import EtcdClient, conform, decode, encode
from livemig.rdzv.keys import JobKeys
from livemig.rdzv.membership import GenState, Membership
from livemig.rdzv.requests import request_stop

if TYPE_CHECKING:
    from livemig.agent.children import Child
    from livemig.agent.run_config import RunConfig


class Node(Protocol):
    """What a drain uses of its agent (agent/launcher.py Launcher)."""

    client: EtcdClient | None
    keys: JobKeys
    cfg: RunConfig
    children: list[Child]
    node_rank: int
    net_env: dict[str, str]

    def say(self, msg: str) -> None: ...


log = logging.getLogger("livemig.agent.drain")

DRAIN_GRACE_S = 25.0  # --drain-grace default: under Slurm's KillWait and Kubernetes' grace period (30 s)
STOPPED_EXIT = 75  # the agents' exit status once the whole job stopped at a checkpoint (EX_TEMPFAIL: run again)
SETTLE_S = 1.0  # how long a drain waits for other nodes' drains sent by the same signal to show


def sigterm_default(env: dict[str, str] | None = None) -> str:
    """--on-sigterm's default: drain under Slurm or Kubernetes (their environment says so),
    where SIGTERM means "this node is going away", else stop (a person's kill)."""
    e = os.environ if env is None else env
    return "drain" if e.get("SLURM_JOB_ID") or e.get("KUBERNETES_SERVICE_HOST") else "stop"


class Drain:
    """One agent's drain: requested by the signal handler, carried out by the agent loop."""

    def __init__(self, launcher: Node, grace_s: float) -> None:
        self.launcher = launcher
        self.grace_s = grace_s
        self.requested_at: float | None = None  # monotonic time of the SIGTERM
        self.sent_at: float | None = None  # the drain key written (after SETTLE_S: decided)
        self.left_at: float | None = None  # the node's processes stopped
        self.ranks: dict[int, str] = {}  # rank -> incarnation of this node's members when it left
        self.stopping = False  # the whole job stops at a checkpoint instead (runtime/stop.py)

    def request(self) -> bool:
        """The signal handler: True if this SIGTERM starts a drain (False: stop as before)."""
        if self.requested_at is not None:
            return False  # a second SIGTERM: stop now
        self.requested_at = time.monotonic()
        return True

    @property
    def active(self) -> bool:
        return self.requested_at is not None

    def step(self, by_key: dict[str, Any]) -> dict[str, Any] | None:
        """One pass of the agent loop while draining: the job's result for this agent once its
        ranks run elsewhere; KeyboardInterrupt (today's stop) when the job cannot do without
        them or the grace ran out."""
        la = self.launcher
        assert self.requested_at is not None and la.client is not None
        now = time.monotonic()
        if now - self.requested_at > self.grace_s:
            log.error("drain not done within the grace; stopping", extra={"grace_s": self.grace_s})
            la.say(f"livemig: node {la.node_rank}: drain not done within {self.grace_s:.0f}s; stopping the job")
            raise KeyboardInterrupt()
        m = Membership.from_kvs(by_key, la.keys)
        if self.sent_at is None:
            mine = {c.incarnation for c in la.children if c.role in (Role.WORKER, Role.SPARE) and c.proc.poll() is None}
            self.ranks = {r: mem.incarnation for r, mem in m.members.items() if mem.incarnation in mine}
            host = la.net_env.get(ENV_HOST, "")
            la.client.put(la.keys.drain(la.node_rank), encode({"node": la.node_rank, "ranks": sorted(self.ranks),
                                                              "host": host, "time": time.time()}))  # fmt: skip
            self.sent_at = now
            la.say(f"livemig: node {la.node_rank}: SIGTERM: draining rank(s) {sorted(self.ranks)} onto the rest "
                   f"of the job (a second SIGTERM stops the job)")  # fmt: skip
            return None
        if self.stopping:
            return None  # the job's result ("stopped") ends this agent as any other's
        if self.left_at is None:
            if now - self.sent_at < SETTLE_S:
                return None
            why = self._cannot(la.client, m)
            if why and self._stop_job(why):
                return None
            if why:
                la.say(f"livemig: node {la.node_rank}: cannot drain ({why}) and no --checkpoint-dir to stop at; "
                       "stopping the job")  # fmt: skip
                log.warning("cannot drain; stopping", extra={"why": why})
                raise KeyboardInterrupt()
            self._leave()
            self.left_at = now
            return None
        if m.state == GenState.COMMITTED and not (set(self.ranks.values()) & {x.incarnation for x in
                                                                              m.members.values()}):  # fmt: skip
            took = round(time.monotonic() - self.requested_at, 3)
            la.say(f"livemig: node {la.node_rank}: drained in {took}s: rank(s) {sorted(self.ranks)} run elsewhere "
                   f"(generation {m.generation})")  # fmt: skip
            log.info("drained", extra={"s": took, "generation": m.generation})
            return {"state": "drained", "reason": f"node {la.node_rank} drained on SIGTERM", "drain_s": took,
                    "generation": m.generation, "time": time.time()}  # fmt: skip
        return None

    def _stop_job(self, why: str) -> bool:
        """Ask the whole job to stop at a checkpoint (module doc); False without a
        --checkpoint-dir (nothing to stop at: today's stop)."""
        la = self.launcher
        if la.cfg.checkpoint is None or la.client is None:
            return False
        request_stop(la.client, la.keys, why, la.node_rank)
        self.stopping = True
        la.say(f"livemig: node {la.node_rank}: SIGTERM: {why}: the job stops at a checkpoint of its next step in "
               f"{la.cfg.checkpoint.dir} (a second SIGTERM stops at once)")  # fmt: skip
        log.warning("the whole job stops at a checkpoint", extra={"why": why})
        return True

    def _cannot(self, client: Any, m: Membership) -> str:
        """Why the job cannot do without every node draining now ('' if it can); every node
        that runs ranks draining at once is the whole job told to stop."""
        la = self.launcher
        kvs, _ = client.get_prefix(la.keys.drains_prefix)
        drains = [d for d in (conform(kv.value, {"ranks": (list,)}, {"host": (str,), "node": (int,)}) for kv in kvs)
                  if d]  # fmt: skip
        leaving = {r for d in drains for r in d["ranks"] if isinstance(r, int)}
        if not leaving:
            return ""
        nodes = {mem.node for mem in m.members.values()}
        if nodes <= {d.get("node") for d in drains}:
            return f"every node of the job is draining ({len(nodes)})"
        # spares that stay: not this node's own (they leave with it); a spare agent told by the
        # same signal withdraws its spares at once (agent/spare_agent.py), within SETTLE_S
        own = {c.incarnation for c in la.children}
        kvs, _ = client.get_prefix(la.keys.spares_prefix)
        warm = 0
        for kv in kvs:
            rec = decode(kv.value) if kv.value else None
            if isinstance(rec, dict) and rec.get("state") == "warm" and rec.get("incarnation") not in own:
                warm += 1
        if warm >= len(leaving):
            return ""
        floor = la.cfg.min_nproc
        left = len(m.members) - len(leaving)
        if floor is not None and left >= floor and warm == 0:
            return ""
        n = len(drains)
        return f"{len(leaving)} rank(s) of {n} draining node(s), {warm} warm spare(s) elsewhere" + (
            f", --min-nproc {floor} allows no shrink to {left}" if floor is not None else ", no --min-nproc"
        )

    def _leave(self) -> None:
        """Stop this node's processes: the coordinator candidate first (it resigns the lead on
        SIGTERM), then workers and spares at once (SIGKILL: the job recovers them; a worker that
        finished its step in between changes nothing, every recovery is exact)."""
        la = self.launcher
        for c in la.children:
            if c.proc.poll() is not None:
                continue
            sig = signal.SIGTERM if c.role == Role.COORDINATOR else signal.SIGKILL
            try:
                os.killpg(c.proc.pid, signal.SIGCONT)
                os.killpg(c.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        log.info("node left", extra={"ranks": sorted(self.ranks)})
