"""A member's side of the recovery protocol (worker, or a claimed spare).

The Context (api.py) owns the tensors; this module owns everything a
member says to etcd and how it follows the coordinator's generations:

    follow(min_gen):
      RECOVERING  -> report (last committed step, averaged step held)
      FORMING/BUILDING -> catch up to the agreed boundary (fetch the averaged
                   gradient, or for a spare pull the state), serve state if a
                   source, build the group (phase 1), write ready
      COMMITTED   -> swap to the new group, stop serving (phase 2)
      FAILED      -> RecoveryError;   fenced -> FencedError

Every put goes through `Rendezvous.fenced_put`, so a fenced or stale
member's writes are refused by etcd.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch.distributed as dist

from livemig.comm import communicator, torch_group
from livemig.comm import group as groups
from livemig.comm.group import CollectiveAborted, generation_store
from livemig.config import (
    ENV_ETCD,
    ENV_HOST,
    ENV_JOB,
    ENV_NODE_LEASE_FILE,
    ENV_SHRINK_DROP,
    Timeouts,
    node_host,
    node_rank,
)
from livemig.device import default_backend
from livemig.errors import ConfigError, EtcdUnavailableError, FencedError, RecoveryError
from livemig.rdzv.client import EtcdClient, conform, encode, through_outage
from livemig.rdzv.lease import LeaseKeeper, NodeLease
from livemig.rdzv.membership import GenState, Membership, Rendezvous
from livemig.rdzv.watch import PrefixWatch, wait_for
from livemig.runtime.progress import Progress
from livemig.transfer.server import StateServer

log = logging.getLogger("livemig.member")


class Callbacks(Protocol):
    """What MemberRuntime calls back on the member it moves between generations (api.Engine):
    the state to report to the coordinator, the catch-up to the agreed boundary, what to
    serve to peers, and what to redo after a switch outside a step."""

    def committed_step(self) -> int | None: ...  # the last step applied here (None: a spare holding no state)

    def avg_step(self) -> int | None: ...  # the step whose averaged gradient is held

    def mirrored_steps(self) -> list[int]: ...  # boundaries of the left neighbour's local state held

    def resumed_step(self) -> int | None: ...  # the checkpoint boundary loaded here, if no step ran since

    def catch_up(self, m: Membership) -> dict[str, Any] | None: ...  # reach m's resume step; what streamed

    def serve(self, m: Membership) -> None: ...  # publish what generation m's members may pull from here

    def stage_layout(self, m: Membership) -> None: ...  # ZeRO-1: pull the shards m's layout adds here

    def switch_layout(self, m: Membership) -> None: ...  # ZeRO-1: m committed, hold its layout's shards

    def after_switch(self) -> None: ...  # a new group followed outside a step (ZeRO-1: gather again)

    def write_final(self) -> None: ...  # record the final state again (the job may end in this group)


class MemberRuntime:
    def __init__(self, incarnation: str, timeouts: Timeouts | None = None) -> None:
        etcd = os.environ.get(ENV_ETCD)
        job = os.environ.get(ENV_JOB)
        if not etcd or not job:
            raise ConfigError(
                f"{ENV_ETCD} and {ENV_JOB} are not set: start training with `livemig run` "
                "or a spare with `livemig-spare start`"
            )
        self.timeouts = timeouts or Timeouts.from_env()
        self.client = EtcdClient(etcd, self.timeouts.etcd)
        self.rdzv = Rendezvous(self.client, job, self.timeouts)
        self.keys = self.rdzv.keys
        self.job = job
        self.incarnation = incarnation
        self.host = os.environ.get(ENV_HOST, "127.0.0.1")
        self.backend = default_backend()  # $LIVEMIG_BACKEND, else NCCL on a CUDA host, gloo otherwise
        # how a generation's groups are formed and retired (comm/communicator.py, $LIVEMIG_COMM)
        self.comm: communicator.Communicator = communicator.pick(self.backend)
        self.fenced = threading.Event()
        self.fence_reason = ""
        self._cond = threading.Condition()
        self.m = Membership()
        self.pg: Any = None
        self._pre: tuple[int, dict] | None = None  # (generation, box) of a background build
        self.gen = 0  # generation whose group we train in
        self.rank: int | None = None
        self.carried: dict[int, int] = {}  # the group's: virtual rank -> its carrier (a shrunk job)
        # a shrunk group's full-width gloo group: rank -> this process's endpoint (its own rank and
        # those it carries), so a shrunk step reduces as the fault-free group does ({}: none)
        self.full: dict[int, Any] = {}
        self.keeper: LeaseKeeper | NodeLease | None = None
        self.spare_keeper: LeaseKeeper | NodeLease | None = None  # a spare's registration while in standby
        self.server: StateServer | None = None
        self.store: Any = None  # rank 0's c10d store for the first generation (register)
        kv, rev = self.client.get_with_revision(self.keys.membership)
        self.m = self._lazy(kv.value if kv else None)
        self._watch = PrefixWatch(self.client, self.keys.membership, self._on_membership, rev + 1)
        # `livemig inject wedge|break` asks this process (keys.inject_self): taken at a boundary
        self.injected: str | None = None
        self.corrupt_asked = False  # `livemig inject corrupt`: the next chunk this member serves is altered
        inject_key = self.keys.inject_self(incarnation)
        self._inject_watch = PrefixWatch(self.client, inject_key, lambda ev: self._on_inject(inject_key, ev), rev + 1)
        # what the coordinator reads between generations: commits, waits, busy flags (runtime/progress.py)
        self.report = Progress(incarnation, self._write_progress, lambda: (self.rank, self.gen, self.m))

    # -- etcd plumbing -----------------------------------------------------------------
    def secret(self) -> bytes:
        kv = wait_for(
            self.client, self.keys.secret, lambda s: s.get(self.keys.secret),
            self.timeouts.recovery.total_seconds(), "the job secret (is a coordinator running?)",
        )  # fmt: skip
        return kv

    def start_server(self) -> StateServer:
        if self.server is None:
            self.server = StateServer(self.job, self.secret(), self.host)
        return self.server

    @property
    def serving(self) -> StateServer:
        """The state server a registered member publishes on (registration started it)."""
        if self.server is None:
            raise RecoveryError("this member has no state server: it never registered as a member")
        return self.server

    def _on_membership(self, events: list) -> None:
        for e in events:
            if e.kind == "put":
                m = self._lazy(e.value)
                with self._cond:
                    self.m = m
                    self._cond.notify_all()

    def _lazy(self, head: bytes | None) -> Membership:
        """The head this member watches; the rows it uses (its own, a source's) are read when
        first used, refused once this process is fenced (rdzv/roster.py)."""
        m = Membership.from_bytes(head)
        return self.rdzv.lazy(m, self.incarnation, on_fenced=lambda: self.mark_fenced(
            f"fenced in generation {m.generation} (a read of the member table was refused)"))  # fmt: skip

    def _on_inject(self, key: str, events: list) -> None:
        for e in events:
            if e.key == key and e.kind == "put":
                req = conform(e.value, {"kind": (str,)})
                if req is not None and req["kind"] in ("wedge", "break"):
                    self.injected = req["kind"]
                elif req is not None and req["kind"] == "corrupt":
                    self.corrupt_asked = True  # taken when this member next serves (runtime/self_faults.py)

    def take_injected(self) -> str | None:
        """The fault `livemig inject` asked of this process, once; its key goes, which is the
        command's acknowledgement."""
        kind, self.injected = self.injected, None
        if kind is not None:
            try:
                self.client.delete(self.keys.inject_self(self.incarnation))
            except EtcdUnavailableError:
                pass  # the command then says it was not acknowledged; the fault lands anyway
        return kind

    def back_to_standby(self) -> None:
        """A spare whose migration was aborted: no group, no rank, no background build."""
        self.pg, self.rank, self.gen, self._pre = None, None, 0, None
        self._retire_full()

    def on_lost(self, reason: str) -> None:
        self.mark_fenced(f"lease lost ({reason})")

    def mark_fenced(self, reason: str) -> None:
        self.fence_reason = reason
        self.fenced.set()
        if self.server is not None:
            self.server.fence()
        with self._cond:
            self._cond.notify_all()

    def check_fenced(self) -> None:
        if self.fenced.is_set():
            raise FencedError(f"incarnation {self.incarnation} must stop: {self.fence_reason}")

    def moved_on(self) -> bool:
        """True when the job left the group we train in (a planned migration in
        progress, or an aborted one, keeps it)."""
        return self.fenced.is_set() or (self.m.generation > self.gen and not self.keeps_group(self.m))

    def keeps_group(self, m: Membership) -> bool:
        """Does generation `m` let members of our group go on training in it?"""
        if m.state == GenState.MIGRATING:
            return m.migration.get("from_gen") == self.gen
        return m.state == GenState.COMMITTED and m.continues == self.gen and self.pg is not None

    # -- planned migration: phase 1 in the background ---------------------------------------
    def prebuild(self, m: Membership, rank: int) -> None:
        """Build generation m's group in a thread while training goes on in ours."""
        g = m.generation
        if self._pre is not None and self._pre[0] == g:
            return
        box: dict[str, Any] = {}
        self._pre = (g, box)

        def work() -> None:
            t0 = time.monotonic()
            try:
                pg = self.comm.form(m.store, g, rank, m.world_size, self.timeouts.collective,
                                    should_abort=lambda: self.fenced.is_set() or self.m.generation > g)  # fmt: skip
                try:
                    box["built"] = self._build_mesh(m, rank, pg)  # FSDP2: the device mesh's groups too
                except Exception:
                    self.comm.retire(pg, idle=True)
                    raise
                box["pg"] = pg  # last: prebuilt() answers once every group is built
                self.put(self.keys.ready(g, rank), {"incarnation": self.incarnation, "built": True,
                                                    "build_s": time.monotonic() - t0, "time": time.time(),
                                                    **self.comm.stats()})  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - an abandoned build: the migration was aborted
                box["err"] = exc
                log.info("background build abandoned", extra={"generation": g, "why": str(exc)})

        threading.Thread(target=work, name=f"livemig-prebuild-g{g}", daemon=True).start()

    def prebuilt(self, g: int) -> Any:
        """The group built in the background for generation g, or None if not (yet) there."""
        if self._pre is None or self._pre[0] != g:
            return None
        return self._pre[1].get("pg")

    def switch_to(self, g: int) -> None:
        """Phase 2 of a planned migration: train in the prebuilt group of g from now on."""
        pg = self.prebuilt(g)
        if pg is None:
            raise CollectiveAborted(f"no prebuilt group for generation {g}")
        self.comm.retire(self.pg, idle=True)  # a step boundary: its last collective completed
        built = self._pre[1].get("built") if self._pre is not None else None
        if built:  # the device mesh's groups (FSDP2) train on this generation's from now on too
            for old in torch_group.swap_built(built, g):
                self.comm.retire(old, idle=True)
        self.pg, self.gen, self._pre = pg, g, None
        self._retire_full()  # a shrunk job's steps then reduce within the bound (runtime/virtual.py)
        log.info("switched group (planned migration)", extra={"generation": g})

    def moved_to_other(self, generation: int) -> Callable[[], bool]:
        """A check that turns true once the job leaves `generation` (or we are fenced)."""
        return lambda: self.fenced.is_set() or self.m.generation != generation

    def wait_membership(self, pred: Callable[[Membership], bool], what: str) -> Membership:
        deadline = time.monotonic() + self.timeouts.recovery.total_seconds()
        with self._cond:
            while True:
                self.check_fenced()
                if pred(self.m):
                    return self.m
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RecoveryError(
                        f"waited {self.timeouts.recovery.total_seconds():.0f}s for {what}; "
                        "is the coordinator running? (LIVEMIG_RECOVERY_TIMEOUT)"
                    )
                self._cond.wait(min(left, 0.5))

    def register(self, rank: int, host_store: bool = False) -> None:
        """Register as the live holder of `rank` (refused if fenced). host_store: also serve
        a c10d store for the first generation's build (the coordinator's own starts later)."""
        self.rank = rank
        info = {"incarnation": self.incarnation, "host": node_host(), "pid": os.getpid(),
                "addr": self.start_server().addr, "rank": rank, "state": "running", "node": node_rank()}  # fmt: skip
        if host_store:
            if self.store is None:
                self.store = dist.TCPStore(self.host, 0, is_master=True, wait_for_workers=False,
                                           timeout=self.timeouts.collective)  # fmt: skip
            info["store"] = f"{self.host}:{self.store.port}"
        node_lease = os.environ.get(ENV_NODE_LEASE_FILE) or None  # --node-leases: the agent's lease, shared
        if node_lease:
            info["lease"] = "node"  # the coordinator deletes the key at a fence instead of revoking the lease
        if self.keeper is not None:
            self.keeper.stop(revoke=True)
        try:
            self.keeper = self.rdzv.register(self.keys.member(rank), info, self.incarnation, self.on_lost,
                                             node_lease_file=node_lease)  # fmt: skip
        except FencedError as exc:
            self.mark_fenced(str(exc))
            raise
        if self.spare_keeper is not None:  # a claimed spare is a member now: its spare key goes
            self.spare_keeper.stop(revoke=True)
            self.spare_keeper = None

    def put(self, key: str, value: dict, retry: bool = True) -> None:
        """A fenced put; while etcd is unreachable it is retried up to the outage budget
        (a report, a ready record or the final record must land once etcd is back)."""

        def once() -> None:
            self.rdzv.fenced_put(None, self.incarnation, key, encode(value))

        try:
            if retry:
                through_outage(once, self.timeouts.etcd_outage.total_seconds(), f"a write of {key}", self.fenced.is_set)
            else:
                once()
        except FencedError as exc:
            self.mark_fenced(str(exc))
            raise

    def _write_progress(self, item: dict) -> None:
        """One progress record out (no retry: the next one replaces it); never once fenced."""
        if self.rank is not None and not self.fenced.is_set():
            self.put(self.keys.progress(self.rank), item, retry=False)

    # -- the protocol ---------------------------------------------------------------------
    def follow(self, min_gen: int, member: Callbacks) -> Membership:
        """Move into the newest committed generation >= min_gen, reporting and moving
        `member`'s state through its callbacks."""
        reported: set[int] = set()
        while True:
            m = self.wait_membership(
                lambda m: m.generation >= min_gen or m.state in (GenState.FAILED, GenState.DONE),
                f"generation >= {min_gen}",
            )
            if m.state == GenState.FAILED:
                raise RecoveryError(f"job failed: {m.reason}")
            if m.state == GenState.MIGRATING or (m.state == GenState.COMMITTED and m.continues):
                if self.pg is not None and self.keeps_group(m):
                    return m  # our group goes on (an aborted migration)
                self._wait_change(m)  # the coordinator resolves the migration first
                continue
            if m.rank_of(self.incarnation, self.rank) is None:  # DONE included: the job finished without us
                if self.rdzv.is_fenced(self.incarnation):
                    self.mark_fenced(f"fenced in generation {m.generation}")
                    self.check_fenced()
                if m.state == GenState.RECOVERING:  # not (yet) given a rank: wait
                    self._wait_change(m)
                    continue
                self.mark_fenced(f"not a member of generation {m.generation}")
                self.check_fenced()
            if m.state == GenState.DONE or (m.state == GenState.COMMITTED and m.generation == self.gen):
                return m
            if m.state == GenState.RECOVERING:
                if m.generation not in reported:
                    rank = m.rank_of(self.incarnation, self.rank)
                    assert rank is not None  # a member of m: the branch above returned or raised otherwise
                    self.put(self.keys.report(m.generation, rank), {
                        "incarnation": self.incarnation, "committed": member.committed_step(),
                        "avg_step": member.avg_step(), "mirrors": member.mirrored_steps(),
                        "resumed": member.resumed_step(),
                        "time": time.time()})  # fmt: skip
                    reported.add(m.generation)
                self._wait_change(m)
                continue
            if m.state in (GenState.FORMING, GenState.BUILDING):
                self._build(m, member)
                continue
            self._wait_change(m)

    def _wait_change(self, m: Membership) -> None:
        self.wait_membership(
            lambda x: (x.generation, x.state, x.nonce) != (m.generation, m.state, m.nonce),
            f"the coordinator to move past generation {m.generation} ({m.state})",
        )

    def _build(self, m: Membership, member: Callbacks) -> None:
        g, rank = m.generation, m.rank_of(self.incarnation, self.rank)
        assert rank is not None
        if self.rank != rank or self.keeper is None:
            self.register(rank)
        try:
            stream = member.catch_up(m) or {}
        except CollectiveAborted as exc:  # the generation moved on mid-transfer: follow it
            log.info("catch-up abandoned", extra={"generation": g, "why": str(exc)})
            self.check_fenced()
            return
        member.serve(m)
        try:
            member.stage_layout(m)  # after serving: members that pull from each other serve first
        except CollectiveAborted as exc:
            log.info("shard hand-over abandoned", extra={"generation": g, "why": str(exc)})
            self.check_fenced()
            return
        t0 = time.monotonic()
        try:
            pg = self.comm.form(
                m.store, g, m.group_rank(rank), m.group_size, self.timeouts.collective,
                should_abort=lambda: self.fenced.is_set() or self.m.generation != g,
            )  # fmt: skip
        except CollectiveAborted as exc:
            log.info("group build abandoned", extra={"generation": g, "why": str(exc)})
            self.check_fenced()
            if self.m.generation == g:
                self._wait_change(m)
            return
        built: list = []
        try:
            built = self._build_mesh(m, rank, pg)
            full = self._build_full(m, rank)
        except CollectiveAborted as exc:
            what = "full-width group" if built else "device-mesh"
            log.info(f"{what} build abandoned", extra={"generation": g, "why": str(exc)})
            self.comm.retire(pg)
            for _, inner in built[1:]:
                self.comm.retire(inner)
            self.check_fenced()
            if self.m.generation == g:
                self._wait_change(m)
            return
        self.put(self.keys.ready(g, rank), {
            "incarnation": self.incarnation, "build_s": time.monotonic() - t0,
            "time": time.time(), **stream, **self.comm.stats()})  # fmt: skip
        committed = self.wait_membership(
            lambda x: x.generation != g or x.state == GenState.COMMITTED,
            f"phase 2 (commit) of generation {g}",
        )
        if committed.generation == g and committed.state == GenState.COMMITTED:
            self.comm.retire(self.pg)
            if built:  # the device mesh's groups (FSDP2) train on this generation's too
                for old in torch_group.swap_built(built, g):
                    self.comm.retire(old)
            member.switch_layout(committed)
            self.pg, self.gen, self.carried = pg, g, dict(committed.carried)
            self._retire_full()
            self.full = full
            if self.server is not None:
                self.server.withdraw()
            log.info("switched group", extra={"generation": g, "rank": rank})
        else:
            self.comm.retire(pg, idle=True)  # built, never used: the generation moved on before its commit
            for _, inner in built[1:]:
                self.comm.retire(inner, idle=True)
            for ep in full.values():
                groups.retire(ep, idle=True)

    def _build_full(self, m: Membership, rank: int) -> dict[int, Any]:
        """Phase 1 for a shrunk generation's full-width group (comm/group.py build_endpoints):
        every member builds its own rank's endpoint, a carrier also those of the ranks it
        carries. Only on gloo: one NCCL communicator cannot hold two ranks on one GPU, so the
        GPU path's shrink reduces over the survivors, within the bound (docs/architecture.md);
        LIVEMIG_SHRINK_DROP's average is over the survivors by definition."""
        if not m.carried or self.backend != "gloo" or os.environ.get(ENV_SHRINK_DROP) == "1":
            return {}
        g = m.generation
        mine = [rank, *sorted(v for v, c in m.carried.items() if c == rank)]
        t0 = time.monotonic()
        full = groups.build_endpoints(m.store, g, mine, m.world_size, self.timeouts.collective,
                                      should_abort=lambda: self.fenced.is_set() or self.m.generation != g)  # fmt: skip
        built_s = round(time.monotonic() - t0, 3)
        log.info("full-width group built", extra={"generation": g, "ranks": mine, "build_s": built_s})
        return full

    def _retire_full(self) -> None:
        """The full-width group goes with the group it was built beside (its last collective
        completed with the step that used it, or the generation moved on: not idle then)."""
        for ep in self.full.values():
            groups.retire(ep)
        self.full = {}

    def _build_mesh(self, m: Membership, rank: int, pg: Any) -> list:
        """Phase 1 for the device mesh's groups (comm/torch_group.py): one communicator per
        mesh group this rank is in, on generation m's store; [] without a mesh."""
        if not torch_group.active():
            return []
        g = m.generation
        store = generation_store(m.store, g, self.timeouts.collective)

        def build(name: str, st: Any, r: int, n: int) -> Any:
            return self.comm.form_sub(st, name, g, r, n, self.timeouts.collective,
                                      should_abort=lambda: self.fenced.is_set() or self.m.generation != g)  # fmt: skip

        return torch_group.build_inners(store, rank, pg, build)

    def wait_result(self, member: Callbacks) -> Membership:
        """After the last step: stay a member (serving, rebuilding) until DONE."""
        while True:
            m = self.wait_membership(
                lambda x: (
                    x.state in (GenState.DONE, GenState.FAILED)
                    or (x.generation != self.gen and not self.keeps_group(x))
                ),
                "the job to finish",
            )
            if m.state == GenState.DONE:
                return m
            m = self.follow(self.gen + 1, member)
            if m.state == GenState.DONE:
                return m
            member.after_switch()  # e.g. ZeRO-1: gather the parameters in the new group
            member.write_final()

    def close(self) -> None:
        self._watch.cancel()
        self._inject_watch.cancel()
        if self.keeper is not None:
            self.keeper.stop(revoke=False)
        if self.server is not None:
            self.server.close()
