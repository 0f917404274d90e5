"""Collectives before the loop: run live when the job starts, answered from a record when the
function is entered again.

Scripts use torch.distributed from the moment they have it: a config broadcast from rank 0, a
barrier, a checkpoint loaded with DCP, an FSDP2 model unsharded to inspect it. Under livemig the
job's first generation forms only in `ctx.steps()` (the coordinator needs every rank's model
signature first), and a process entering the function again (a claimed spare, a survivor of a
cold restart or of an FSDP2 redo, a spare migrating in) runs that code alone, while its peers
are in their loops. So the default group and every group the script creates exist from the
first line of the function (`enter`), and their collectives before the loop are served by mode:

- a worker's first entry ("record"): each group gets a start-up communicator on rank 0's c10d
  store the first time it is used (`_boot`); every completed collective's results are
  recorded, and the record is published in etcd as the rank enters `ctx.steps()` (`leave`);
- a process entering the function again ("answer"): each collective is answered, in order,
  from the record of the rank it enters as (held here if it held that rank, else read from
  etcd), so every rank ends exactly where the fault-free run did; a call the record cannot
  answer (more calls, another op or group, other shapes) is refused with one line;
- a spare in standby and a local run: a world of one, collectives run live.

The code around each epoch's steps under `ctx.epochs()` (set_epoch, an evaluation's all_reduce,
rank 0's snapshot) is the same shape: every rank runs it live, it is recorded as a segment of the
rank's record ("e3" before epoch 3's steps, "t3" after them), and a process entering the function
again answers the segments it runs before its first step of its own (the epoch it resumes in)
from the record, as it does the code before the loop. Segments after the first are published as
the rank enters an epoch's steps or the next epoch.

The record is capped (LIVEMIG_PRELOOP_MAX_MB, default 1 MiB per rank: it is an etcd value);
a script that gathers more outside its steps (an unshard of a large model) is told so at that call.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from livemig.comm import group as comm_group
from livemig.comm import torch_group
from livemig.comm.group import CollectiveAborted
from livemig.config import ENV_PRELOOP_MAX_MB, Role, env_mib
from livemig.errors import ConfigError, RecoveryError
from livemig.rdzv.client import decode

if TYPE_CHECKING:
    from livemig.comm.torch_group import SwappableGroup

log = logging.getLogger("livemig.runtime.preloop")
# Collectives whose results are the same on every rank: a call the lost rank made but had not
# published yet is answered from a peer's record.
_SAME_ON_EVERY_RANK = frozenset({"allreduce", "allreduce_coalesced", "allgather", "_allgather_base",
                                 "allgather_into_tensor_coalesced", "all_gather_single", "broadcast",
                                 "allgather_coalesced", "barrier", "monitored_barrier"})  # fmt: skip
_BOOT_PREFIX = "livemig-preloop"


def pack_tensor(t: torch.Tensor) -> list:
    """[dtype, shape, bytes] of a tensor's value, on any device (msgpack, no pickle)."""
    c = t.detach().to("cpu").contiguous()
    raw = c.reshape(-1).view(torch.uint8).numpy().tobytes() if c.numel() else b""
    return [str(c.dtype).removeprefix("torch."), list(c.shape), raw]


def unpack_tensor(rec: list) -> torch.Tensor:
    dtype, shape, raw = getattr(torch, rec[0]), list(rec[1]), rec[2]
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


class PreLoop:
    """The collectives of one process's user code before its loop (module doc); owned by the
    Engine and kept across the function's entries (the record is this rank's)."""

    def __init__(self, host: Any) -> None:
        self.h = host
        self.mode = ""  # "record", "answer" or "" (live, or inside the loop)
        self.calls: list[dict] | None = []  # the record of `rank`: None until read from etcd
        self.rank: int | None = None  # whose record `calls` is
        self.nbytes = 0
        self.cursor = 0  # the next call an entry answers
        self.boot_default: Any = None  # the default group's start-up communicator (retired at formation)
        self.seg = "start"  # the segment of the function the calls are in ("start", "e<epoch>", "t<epoch>")
        self.live = False  # this entry ran a step of its own: every rank runs what follows, live
        self.published = 0  # how many of `calls` etcd holds
        self.retry: dict | None = None  # {"s": segment, "at": call}: a failed call this rank makes again
        self._peer: dict | None = None  # a peer's record, read once per segment answered
        self._said_shrunk = False

    # -- the function's entries ----------------------------------------------------------
    def enter(self) -> None:
        """Before the user's function runs: the default group exists, and its collectives (and
        every group's) are served by this entry's mode."""
        h = self.h
        one = h.role == Role.LOCAL or (h.role == Role.SPARE and h.joining is None)
        if one and dist.is_initialized() and not torch_group.groups():
            return  # a local script that initialised torch.distributed itself: its groups
        rank, world = (0, 1) if one else (h.rank, h.world_size)
        if not (one and torch_group.standby_world()):  # a standby's world of the job's shape stays (fsdp2_mesh.py)
            torch_group.install_unformed(rank, world, h.timeouts.collective)
        if not one and h.runtime is not None and torch_group.GUARD.should_abort is None:
            # a wait in user code's collectives is the hang detection's input, as FSDP2's are
            torch_group.set_guard(h.runtime.moved_on, h.timeouts.collective, on_wait=h.fsdp2.waiting)
        self._untap()
        self.seg, self.live = "start", False
        if one:
            return
        if h.joining is None:  # a worker's first entry: the job forms in ctx.steps()
            self.mode, self.calls, self.rank, self.nbytes, self.published = "record", [], h.rank, 0, 0
            torch_group.TAP.record, torch_group.TAP.boot = self._record, self._boot
        else:
            if self.rank != h.rank:
                self.calls, self.rank, self.nbytes, self.published = None, h.rank, 0, 0  # read from etcd when needed
            self.mode, self.cursor = "answer", 0
            torch_group.TAP.answer = self._answer

    def leave(self) -> None:
        """ctx.steps() (or an epoch's steps) starts: collectives run in the job's groups from
        here on. A segment after the first is published now; the first is published by a
        worker's first entry once it has registered (`publish`)."""
        self._close_segment()
        self.mode = ""
        if self.seg != "start":
            self.publish()

    def segment(self, name: str) -> None:
        """ctx.epochs() moves outside the steps: the code before epoch k's steps ("e<k>") or
        after them ("t<k>"). Answered from the record in a process entering the function again
        until it runs a step of its own; recorded (and published) everywhere else."""
        h = self.h
        if h.role == Role.LOCAL or (h.role == Role.SPARE and h.joining is None) or h.runtime is None:
            return  # a world of one: collectives run as they are
        self._close_segment()
        if self.seg != "start":
            self.publish()
        self.seg, self.cursor, self._peer = name, 0, None
        if h.joining is not None and not self.live:
            self.mode = "answer"
            torch_group.TAP.answer = self._answer
        else:
            self._go_live()

    def _go_live(self) -> None:
        """Record from here on; a call that fails joins the recovery and is made again."""
        self.mode, self.live = "record", True
        tap = torch_group.TAP
        tap.answer, tap.record, tap.rejoin = None, self._record, self._rejoin

    def _rejoin(self, g: SwappableGroup, name: str, exc: BaseException) -> None:
        """A call of the code around an epoch's steps failed (a peer lost): join the recovery,
        then the call is made again in the new generation. The process that takes the lost rank
        runs this code too (it starts at this epoch, runtime/epochs.py); the record says at which
        call the others wait, so it answers the calls before it and makes this one live."""
        h = self.h
        if h.fsdp2.units or h.runtime is None:  # FSDP2 redoes by entering the function again
            raise exc
        self.retry = {"s": self.seg, "at": len(self._segment_calls())}
        self.publish(force=True)
        log.warning(f"torch.distributed {name} {self._where()} failed: joining the recovery, then making it "
                    "again in the new generation", extra={"rank": h.rank, "why": str(exc)[:200]})  # fmt: skip
        h.join_recovery(None, CollectiveAborted(str(exc)))
        self.retry = None

    def _close_segment(self) -> None:
        if self.mode == "answer" and self.calls is not None:
            n = len(self._segment_calls())
            if self.cursor < n:
                log.warning(f"fewer collectives {self._where()} than the rank made when it ran it first",
                            extra={"rank": self.rank, "answered": self.cursor, "recorded": n})  # fmt: skip
        self._untap()

    def publish(self, force: bool = False) -> None:
        """This rank's record, for a process that enters the function as this rank later."""
        calls = self.calls or []
        if not force and len(calls) <= self.published:
            return
        rt = self.h.runtime
        rec: dict[str, Any] = {"calls": calls, "bytes": self.nbytes}
        if self.retry is not None:
            rec["retry"] = self.retry
        rt.put(rt.keys.preloop(self.h.rank), rec)
        self.published = len(calls)
        log.info("collectives outside the steps recorded", extra={"calls": len(calls), "bytes": self.nbytes})

    def _where(self) -> str:
        if self.seg == "start":
            return "before ctx.steps()"
        return f"{'before' if self.seg[0] == 'e' else 'after'} epoch {self.seg[1:]}'s steps"

    def _segment_calls(self) -> list[dict]:
        return [c for c in self._calls() if c.get("s", "start") == self.seg]

    def register(self) -> None:
        """Register this worker's rank (once): rank 0's registration serves the store the
        start-up communicators and the first generation rendezvous in."""
        if self.h.runtime.rank is None:
            self.h.runtime.register(self.h.rank, host_store=self.h.rank == 0)

    def formed(self) -> None:
        """The job's first generation is in: the start-up communicators are done with (the
        generation's build replaced the mesh groups' ones and retired them; the default
        group's is retired here)."""
        if self.boot_default is not None:
            self.h.runtime.comm.retire(self.boot_default, idle=True)
            self.boot_default = None

    def _untap(self) -> None:
        tap = torch_group.TAP
        tap.record = tap.answer = tap.boot = tap.rejoin = None

    # -- record ------------------------------------------------------------------------------
    def _record(self, g: SwappableGroup, name: str, outs: list[torch.Tensor]) -> None:
        packed = [pack_tensor(t) for t in outs]
        self.nbytes += sum(len(p[2]) for p in packed)
        cap = env_mib(ENV_PRELOOP_MAX_MB, "1")
        if self.nbytes > cap:
            said = os.environ.get(ENV_PRELOOP_MAX_MB, "1")
            raise ConfigError(
                f"torch.distributed {name} {self._where()}: the results of this rank's collectives outside the "
                f"steps reach {self.nbytes / 2**10:.1f} KiB, over {ENV_PRELOOP_MAX_MB}={said} MiB (they are recorded "
                "for a process that enters the function again): move large collectives into the steps or raise the cap"
            )
        if self.seg != "start" and self.h.virtual.degraded() and not self._said_shrunk:
            self._said_shrunk = True
            log.warning(f"torch.distributed {name} {self._where()} in a shrunk job ran over the live processes "
                        "only, not over every rank: its result differs from a full-width run's",
                        extra={"rank": self.h.rank})  # fmt: skip
        self._calls().append({"g": g.group_name, "op": name, "t": packed, "s": self.seg})
        if self.seg != "start":  # the job formed: published call by call (a rank lost in the next one)
            self.publish()

    def _boot(self, g: SwappableGroup) -> Any:
        """A start-up communicator for group `g` (its first collective before the job formed),
        on a prefix of rank 0's store; the peers build theirs at their first use of `g`."""
        h = self.h
        rt = h.runtime
        self.register()
        wait = h.timeouts.recovery  # the ranks reach their first collective at their own pace
        store = dist.PrefixStore(f"{_BOOT_PREFIX}/{g.group_name}", self._store(wait.total_seconds()))
        try:
            inner = comm_group.build_subgroup(store, f"start-up group {g.group_name}", g.ranks.index(h.rank),
                                              len(g.ranks), wait, rt.comm.backend, rt.fenced.is_set)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - the one line names what did not come
            raise RecoveryError(
                f"the collectives before ctx.steps() could not start on group {g.group_name}: "
                f"{comm_group.first_line(exc)} (every rank of the group must make the same calls before its loop; "
                f"waited {wait.total_seconds():.0f}s, LIVEMIG_RECOVERY_TIMEOUT)"
            ) from None
        if g is torch_group.groups()[0]:  # the mesh groups' are retired by the first generation's build
            self.boot_default = inner
        return inner

    def _store(self, wait_s: float) -> dist.Store:
        """Rank 0's c10d store (it serves it from its registration)."""
        rt = self.h.runtime
        if self.h.rank == 0:
            return rt.store
        deadline = time.monotonic() + wait_s
        while True:
            kv = rt.client.get(rt.keys.member(0))
            rec = decode(kv.value) if kv is not None else None
            addr = rec.get("store") if isinstance(rec, dict) else None
            if addr:
                host, port = str(addr).rsplit(":", 1)
                return dist.TCPStore(host, int(port), is_master=False, timeout=self.h.timeouts.collective)
            if time.monotonic() > deadline:
                raise RecoveryError(f"rank 0 did not register within {wait_s:.0f}s, so the collectives before "
                                    "ctx.steps() cannot start: is rank 0 running? "
                                    "(LIVEMIG_RECOVERY_TIMEOUT)")  # fmt: skip
            time.sleep(0.05)

    # -- answer ------------------------------------------------------------------------------
    def _answer(self, g: SwappableGroup, name: str, outs: list[torch.Tensor]) -> bool:
        """Answer the call from the rank's record (True), or, where the other ranks wait to make it
        again after the rank was lost there, make it live with them (False)."""
        calls = self._segment_calls()
        i, r, where = self.cursor, self.rank, self._where()
        at = self._peers_wait_at()
        if at is not None and i >= at:
            log.info(f"the other ranks make this call {where} again: made live",
                     extra={"rank": r, "call": i + 1, "op": name})  # fmt: skip
            self._go_live()
            return False
        if i >= len(calls) and at is not None and self._peer is not None:
            theirs = [c for c in self._peer.get("calls") or [] if c.get("s", "start") == self.seg]
            if i < len(theirs) and theirs[i]["op"] in _SAME_ON_EVERY_RANK:  # the lost rank had not published it
                calls = calls + [theirs[i]]
        rule = (f"the code {where} must make the same collectives on every entry of the function (a process "
                "entering it again is answered from what the rank received when it ran there first)")  # fmt: skip
        if i >= len(calls):
            raise ConfigError(f"torch.distributed {name} {where}, entering the function again as "
                              f"rank {r}: call {i + 1}, but rank {r} made {len(calls)} there; {rule}")  # fmt: skip
        c = calls[i]
        shapes = [list(t.shape) for t in outs]
        if c["g"] != g.group_name or c["op"] != name or shapes != [list(x[1]) for x in c["t"]]:
            raise ConfigError(f"torch.distributed {name} on group {g.group_name} {shapes} {where}, entering "
                              f"the function again as rank {r}: call {i + 1} of rank {r} there was {c['op']} on "
                              f"group {c['g']} {[list(x[1]) for x in c['t']]}; {rule}")  # fmt: skip
        with torch.no_grad():
            for t, rec in zip(outs, c["t"], strict=True):
                t.copy_(unpack_tensor(rec))
        self.cursor += 1
        return True

    def _peers_wait_at(self) -> int | None:
        """The call of this segment the other ranks wait to make again (they lost this rank in
        it), from a peer's record, read once a segment; None: they are past the segment."""
        h = self.h
        if self.seg == "start" or h.runtime is None or h.world_size < 2 or self.rank is None:
            return None
        if self._peer is None:
            rt = h.runtime
            kv = rt.client.get(rt.keys.preloop((self.rank + 1) % h.world_size))
            rec = decode(kv.value) if kv is not None else None
            self._peer = rec if isinstance(rec, dict) else {}
        retry = self._peer.get("retry")
        if isinstance(retry, dict) and retry.get("s") == self.seg:
            return int(retry.get("at", 0))
        return None

    def _calls(self) -> list[dict]:
        if self.calls is None:
            rt = self.h.runtime
            kv = rt.client.get(rt.keys.preloop(self.rank)) if rt is not None else None
            rec = decode(kv.value) if kv is not None else None
            self.calls = list(rec.get("calls") or []) if isinstance(rec, dict) else []
            self.nbytes = int(rec.get("bytes") or 0) if isinstance(rec, dict) else 0
            self.published = len(self.calls)
            log.info("collectives before the loop answered from the record",
                     extra={"rank": self.rank, "calls": len(self.calls)})  # fmt: skip
        return self.calls
