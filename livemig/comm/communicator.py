"""The generation switch's communicator seam: how a generation's groups are formed, and what
becomes of the groups they replace.

Two implementations, chosen per process by $LIVEMIG_COMM (`livemig run --comm`):

- `SwapComm` ("swap", the default): a new backend per generation, built from the generation's
  store (comm/group.py `build_group`); the replaced one goes to the graveyard (`retire`).
  Runs on every torch livemig admits, over gloo and the legacy ProcessGroupNCCL.
- `ReconfigureComm` ("reconfigure"): torch's experimental reconfigure API (torch >= 2.14:
  `ProcessGroupGloo(..., enable_reconfigure)`, `get_reconfigure_handle`, `reconfigure`). A
  process keeps a few backend objects per group it is in ("slot": the generation's group, and
  each device-mesh dimension by its name) and re-forms one with the new membership: each
  member publishes its object's handle in the generation's store, reads the others' in rank
  order (a list: rank = position, so a spare takes the lost rank's index) and reconfigures.

What the reconfigure implementation has to work around (found in a spike on torch 2.14.1 and
held by tests/unit/test_communicator.py):
- a backend object rendezvouses through the store it was created with, for ever: members
  created on different stores never meet, and livemig's generations use different stores
  (rank 0's for the first, the coordinator's after; a new leader starts another). So each
  object is created on a `_Movable` store that is pointed at the generation's store before
  each re-form.
- handles must be unique: an object's handle carries its creation rank, so every object is
  created with a random 30-bit rank (its world of one is never used).
- a re-form of an object that a thread is still inside (a collective abandoned when the
  generation moved on, blocked until gloo's own timeout) works, but the blocked thread stays
  and aborts the process at exit. An object is therefore re-formed only once no operation of
  it can still run: at once after an idle retire (a planned migration's switch at a step
  boundary), otherwise after the collective timeout, as the graveyard does; in between a slot
  gets a second object. A slot holds one or two objects in practice (three after a failure
  during a recovery).
- the rank bookkeeping torch keeps for registered groups (`get_process_group_ranks`) is not
  updated by a reconfigure: livemig's objects are never registered with torch; the groups
  user code sees are comm/torch_group.py's SwappableGroups, whose ranks livemig keeps.

With the NCCL backend the objects are nccl2's (ProcessGroupNCCL2, NCCL >= 2.28; torch 2.15's
default "nccl", present in 2.14): only livemig's side is shared with gloo (the handle exchange,
the slots, the retire rule); nccl2 itself tears its communicator down and bootstraps a new one
at each re-form. Unverified on a GPU; refused with one line where the torch has no nccl2.
"""

from __future__ import annotations

import gc
import logging
import os
import random
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch.distributed as dist

from livemig.comm import group as comm_group
from livemig.comm.group import CollectiveAborted, first_line, wait_all
from livemig.config import ENV_COMM
from livemig.errors import ConfigError

log = logging.getLogger("livemig.comm")

CHOICES = ("swap", "reconfigure")
DEFAULT = "swap"  # why: docs/architecture.md, "Communicators" (the measurements)
POLL_S = 0.002  # how often a re-form looks for its peers' handles


def nccl2_available() -> bool:
    """Has the installed torch nccl2 (ProcessGroupNCCL2: reconfigurable NCCL, NCCL >= 2.28)?"""
    return reconfigure_available() and hasattr(dist, "ProcessGroupNCCL2")


def reconfigure_available() -> bool:
    """Has the installed torch the reconfigure API on gloo (2.14 and later)?"""
    opts = getattr(dist.ProcessGroupGloo, "_Options", None)
    return (
        opts is not None
        and hasattr(opts(), "enable_reconfigure")
        and hasattr(dist.ProcessGroupGloo, "reconfigure")
        and hasattr(dist.distributed_c10d, "ReconfigureOptions")
    )


class Communicator(Protocol):
    """What the runtime asks of a generation switch (runtime/member.py)."""

    name: str

    def form(self, store_addr: str, gen: int, rank: int, world: int, timeout: timedelta,
             should_abort: Callable[[], bool] | None = None) -> Any:  # fmt: skip
        """Generation `gen`'s group (phase 1); raises CollectiveAborted."""
        ...

    def form_sub(self, store: dist.Store, slot: str, gen: int, rank: int, world: int, timeout: timedelta,
                 should_abort: Callable[[], bool] | None = None) -> Any:  # fmt: skip
        """A device-mesh dimension's group of a generation, on `store` (its prefix of the
        generation's store); `slot` names the group the same way in every generation."""
        ...

    def retire(self, pg: Any, idle: bool = False, timeout: timedelta | None = None) -> None:
        """A group that no collective will be submitted to again; idle: none can still run."""
        ...

    def release(self) -> None:
        """Before the process exits (comm/group.py `release_all`'s duty for what it holds)."""
        ...

    def stats(self) -> dict[str, Any]:
        """For the generation's ready record (the timeline's `build` event)."""
        ...


def pick(backend: str = "gloo", choice: str | None = None) -> Communicator:
    """The communicator $LIVEMIG_COMM asks for; a choice the installed torch or the backend
    cannot honour is refused at once, never quietly replaced by the other."""
    choice = (choice if choice is not None else os.environ.get(ENV_COMM, "")) or DEFAULT
    if choice not in CHOICES:
        raise ConfigError(f"{ENV_COMM}={choice!r}: expected one of {', '.join(CHOICES)}")
    if choice == "swap":
        return SwapComm(backend)
    return ReconfigureComm(backend)


class SwapComm:
    """A new backend per generation; the replaced one to the graveyard (comm/group.py)."""

    name = "swap"

    def __init__(self, backend: str = "gloo") -> None:
        self.backend = backend
        self.builds = 0

    def form(self, store_addr: str, gen: int, rank: int, world: int, timeout: timedelta,
             should_abort: Callable[[], bool] | None = None) -> Any:  # fmt: skip
        pg = comm_group.build_group(store_addr, gen, rank, world, timeout, self.backend, should_abort)
        self.builds += 1
        return pg

    def form_sub(self, store: dist.Store, slot: str, gen: int, rank: int, world: int, timeout: timedelta,
                 should_abort: Callable[[], bool] | None = None) -> Any:  # fmt: skip
        what = f"generation {gen}'s mesh group {slot}"
        pg = comm_group.build_subgroup(store, what, rank, world, timeout, self.backend, should_abort)
        self.builds += 1
        return pg

    def retire(self, pg: Any, idle: bool = False, timeout: timedelta | None = None) -> None:
        comm_group.retire(pg, idle, timeout)

    def release(self) -> None:
        comm_group.release_all()

    def stats(self) -> dict[str, Any]:
        return {"comm": self.name, "builds": self.builds}


class _Movable(dist.Store):
    """A store whose target moves: a reconfigurable backend keeps the store it was created
    with, and each generation's rendezvous lives in that generation's store (module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.target: Any = None

    def _to(self) -> Any:
        if self.target is None:
            raise CollectiveAborted("a reconfigurable group used its store before a generation pointed it anywhere")
        return self.target

    def set(self, key: str, value: Any) -> None:
        self._to().set(key, value)

    def get(self, key: str) -> bytes:
        return self._to().get(key)

    def add(self, key: str, amount: int) -> int:
        return self._to().add(key, amount)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._to().compare_set(key, expected, desired)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self._to().wait(keys)
        else:
            self._to().wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return self._to().check(keys)

    def delete_key(self, key: str) -> bool:
        return self._to().delete_key(key)

    def num_keys(self) -> int:
        return self._to().num_keys()

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._to().multi_get(keys)

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._to().multi_set(keys, values)

    def append(self, key: str, value: Any) -> None:
        self._to().append(key, value)


@dataclass
class _Object:
    """One reconfigurable backend of a slot, and whether a generation may re-form it."""

    pg: Any
    store: _Movable
    slot: str
    in_use: bool = True
    safe_at: float = 0.0  # monotonic time after which no operation of it can still run
    forms: int = 0


class ReconfigureComm:
    """torch's reconfigure API over gloo: a slot's objects re-formed, never rebuilt (module doc)."""

    name = "reconfigure"

    def __init__(self, backend: str = "gloo") -> None:
        if backend not in ("gloo", "nccl"):
            raise ConfigError(f"{ENV_COMM}=reconfigure runs on gloo or NCCL ({backend} asked): use {ENV_COMM}=swap")
        if backend == "nccl" and reconfigure_available() and not nccl2_available():
            raise ConfigError(
                f"{ENV_COMM}=reconfigure with NCCL needs nccl2 (ProcessGroupNCCL2), which this torch lacks: "
                f"use {ENV_COMM}=swap"
            )
        if not reconfigure_available():
            import torch

            raise ConfigError(
                f"{ENV_COMM}=reconfigure needs torch 2.14 or later (installed: {torch.__version__}): "
                f"use {ENV_COMM}=swap or upgrade torch"
            )
        self.backend = backend
        self._lock = threading.Lock()
        self._slots: dict[str, list[_Object]] = {}
        self._by_pg: dict[int, _Object] = {}
        self.reconfigures = 0  # re-forms that completed
        self.created = 0  # objects created (a slot's first, or one while the others may be busy)
        # the generation's group last formed was an object that had trained in an earlier one
        self.reused = False

    # -- the slot's objects -----------------------------------------------------------------
    def _new(self, slot: str, timeout: timedelta) -> _Object:
        if self.backend == "nccl":  # pragma: no cover - needs a GPU
            return self._new_nccl2(slot, timeout)
        opts = comm_group.gloo_options(timeout)
        opts.enable_reconfigure = True
        store = _Movable()
        # a random creation rank: the handle carries it, and handles must differ (module doc)
        pg = dist.ProcessGroupGloo(store, random.getrandbits(30), 1, opts)
        obj = _Object(pg, store, slot)
        self.created += 1
        return obj

    def _new_nccl2(self, slot: str, timeout: timedelta) -> _Object:  # pragma: no cover - needs a GPU
        """An nccl2 object: its communicator is made at the first reconfigure, on this process's
        device. The handle exchange, slots and retire rule are the gloo objects'. Unverified."""
        opts = comm_group.nccl_options(timeout)
        opts.enable_reconfigure = True  # type: ignore[attr-defined, unused-ignore]  # 2.14+
        store = _Movable()
        nccl2 = dist.ProcessGroupNCCL2  # type: ignore[attr-defined, unused-ignore]  # 2.14+
        pg = comm_group.bind_to_device(nccl2(store, random.getrandbits(30), 1, opts))
        self.created += 1
        return _Object(pg, store, slot)

    def _take(self, slot: str, timeout: timedelta) -> _Object:
        now = time.monotonic()
        with self._lock:
            for obj in self._slots.get(slot, []):
                if not obj.in_use and obj.safe_at <= now:
                    obj.in_use = True
                    return obj
            obj = self._new(slot, timeout)
            self._slots.setdefault(slot, []).append(obj)
            self._by_pg[id(obj.pg)] = obj
            return obj

    def _put_back(self, obj: _Object, idle: bool, timeout: timedelta) -> None:
        with self._lock:
            obj.in_use = False
            obj.safe_at = time.monotonic() + (0.0 if idle else timeout.total_seconds() + 5.0)

    # -- the seam -----------------------------------------------------------------------------
    def form(self, store_addr: str, gen: int, rank: int, world: int, timeout: timedelta,
             should_abort: Callable[[], bool] | None = None) -> Any:  # fmt: skip
        store = comm_group.store_for(store_addr, gen, timeout)
        return self._reform("world", store, gen, rank, world, timeout, should_abort, f"generation {gen}")

    def form_sub(self, store: dist.Store, slot: str, gen: int, rank: int, world: int, timeout: timedelta,
                 should_abort: Callable[[], bool] | None = None) -> Any:  # fmt: skip
        what = f"generation {gen}'s mesh group {slot}"
        return self._reform(f"tg/{slot}", store, gen, rank, world, timeout, should_abort, what)

    def _reform(self, slot: str, store: dist.Store, gen: int, rank: int, world: int, timeout: timedelta,
                should_abort: Callable[[], bool] | None, what: str) -> Any:  # fmt: skip
        obj = self._take(slot, timeout)
        ns = dist.PrefixStore(f"rc/{slot}", store)
        obj.store.target = ns
        try:
            mine = obj.pg.get_reconfigure_handle()
            ns.set(f"h/{rank}", mine)
            handles = _gather(ns, world, time.monotonic() + timeout.total_seconds(), should_abort, what)
            if handles[rank] != mine or len(set(handles)) != world:
                raise CollectiveAborted(f"re-form of {what}: the members' reconfigure handles are not unique")
            opts = dist.distributed_c10d.ReconfigureOptions()  # type: ignore[attr-defined, unused-ignore]  # 2.14+
            opts.uuid = (gen << 16) | (zlib.crc32(slot.encode()) & 0xFFFF)
            opts.handles = handles
            opts.timeout = timeout
            try:
                work = obj.pg.reconfigure(opts)
            except Exception as exc:  # noqa: BLE001 - refused at once (a bad handle list)
                raise CollectiveAborted(f"re-form of {what} refused: {first_line(exc)}") from exc
            wait_all([work], timeout, should_abort)
        except BaseException:
            self._put_back(obj, idle=False, timeout=timeout)  # it may be half re-formed: let it rest
            raise
        obj.forms += 1
        with self._lock:
            self.reconfigures += 1
            if slot == "world":
                self.reused = obj.forms > 1
        log.debug("re-formed", extra={"slot": slot, "generation": gen, "rank": rank, "world": world})
        return obj.pg

    def retire(self, pg: Any, idle: bool = False, timeout: timedelta | None = None) -> None:
        if pg is None:
            return
        obj = self._by_pg.get(id(pg))
        if obj is None or obj.pg is not pg:  # not one of ours (a standby's world of one)
            comm_group.retire(pg, idle, timeout)
            return
        if timeout is None:
            from livemig.config import Timeouts

            timeout = Timeouts.from_env().collective
        self._put_back(obj, idle, timeout)

    def release(self) -> None:
        """Shut down the objects no operation can still use; drop and collect the others
        (comm/group.py `release_all`: a gloo group with a thread inside at exit aborts)."""
        now = time.monotonic()
        with self._lock:
            objs = [o for objs in self._slots.values() for o in objs]
            self._slots.clear()
            self._by_pg.clear()
        busy = False
        for o in objs:
            if o.in_use or o.safe_at > now:
                busy = True
                continue
            try:
                o.pg.shutdown()
            except Exception as exc:  # noqa: BLE001 - a group never formed or already broken
                log.debug("reconfigurable group shutdown failed", extra={"err": str(exc)})
        del objs
        comm_group.release_all()
        if busy:
            gc.collect()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"comm": self.name, "reconfigures": self.reconfigures, "created": self.created,
                    "reused": self.reused}  # fmt: skip


def _gather(store: dist.Store, world: int, deadline: float, should_abort: Callable[[], bool] | None,
            what: str) -> list[str]:  # fmt: skip
    """Every member's handle in rank order, waiting for the missing ones without blocking in
    the store (the wait ends early when the generation moves on)."""
    keys = [f"h/{r}" for r in range(world)]
    while not store.check(keys):
        if should_abort is not None and should_abort():
            raise CollectiveAborted(f"re-form of {what} abandoned: generation moved on")
        if time.monotonic() > deadline:
            raise CollectiveAborted(f"re-form of {what} timed out waiting for the members' handles")
        time.sleep(POLL_S)
    return [store.get(k).decode() for k in keys]
