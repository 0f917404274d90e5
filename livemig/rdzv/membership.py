"""Generation CAS, the member table, and fencing.

The generation number (key `generation`, decimal) is the fencing token.
It changes only in a transaction that compares its current value, and the
same transaction writes the new member table (one msgpack value, so even a
table for thousands of ranks stays within etcd's 128-op / 1.5 MiB limits)
and the fenced incarnations. Every state-changing call of a worker or spare
presents (generation, incarnation); a stale generation or a fenced
incarnation makes the transaction's compare fail and the caller gets
`FencedError` / `StaleGenerationError`.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from livemig.config import ENV_HOST, Role, Timeouts
from livemig.errors import CorruptStateError, FencedError, StaleGenerationError
from livemig.rdzv.client import EtcdClient, decode, encode
from livemig.rdzv.keys import JobKeys
from livemig.rdzv.lease import LeaseKeeper

log = logging.getLogger("livemig.rdzv.membership")


def new_incarnation(role: str, host: str | None = None) -> str:
    """A process's identity for fencing: unique per process start. The host part is --host
    where given (simulated hosts share one hostname), else the hostname."""
    host = host or os.environ.get(ENV_HOST) or socket.gethostname()
    return f"{role}-{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class GenState(StrEnum):
    """Life cycle of one generation, moved only by the coordinator.

        FORMING ──► COMMITTED ──(failure: fence, g+1)──► RECOVERING
                        ▲                                     │ agree + claim
                        └──────── COMMITTED ◄── BUILDING ◄────┘
        any ──► FAILED (recovery impossible)   COMMITTED ──► DONE

    FORMING: initial workers build the first group. RECOVERING: a member was
    fenced; survivors report their last committed step. BUILDING: the resume
    step is agreed and a spare claimed; the spare streams state and every
    member builds the group (phase 1). COMMITTED: phase 2, members switch.

    Planned migration (no failure): COMMITTED g ──► g+1 MIGRATING ──► COMMITTED.
    During MIGRATING the members keep training in g's group while the spare
    catches up and everyone builds g+1's group in the background; the switch
    step is agreed inside a training collective. An aborted migration moves
    to g+2 COMMITTED with `continues = g` (same table, same group).
    """

    FORMING = "forming"
    RECOVERING = "recovering"
    BUILDING = "building"
    COMMITTED = "committed"
    FAILED = "failed"
    DONE = "done"
    MIGRATING = "migrating"


@dataclass
class Member:
    rank: int
    incarnation: str
    host: str = ""
    pid: int = 0
    addr: str = ""  # state-transfer endpoint, tcp://host:port
    role: str = Role.WORKER  # or Role.SPARE for a claimed spare
    spare_id: str = ""
    node: int | None = None  # node rank of the agent that started it (None: a standby host's spare)

    @classmethod
    def from_dict(cls, d: dict) -> Member:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


_ROLES: list[str] = [Role.WORKER, Role.SPARE]


def _pack_members(members: dict[int, Member]) -> dict:
    """The table's members, compact: one value holds every rank, and etcd refuses a request
    over 1.5 MiB. Rows of values (no field names), hosts once in a table, and the parts of
    the incarnation and the address that repeat the host left out: ~45 bytes a rank instead
    of ~135 (10,000 ranks with real host names: tests/rdzv/test_membership.py)."""
    hosts: dict[str, int] = {}
    rows = []
    for r in sorted(members):
        m = members[r]
        h = hosts.setdefault(m.host, len(hosts))
        mid = f"-{m.host}-"
        pre, sep, suf = m.incarnation.partition(mid)
        inc: Any = [_ROLES.index(pre) if pre in _ROLES else pre, suf] if sep and m.host else m.incarnation
        at = f"tcp://{m.host}:"
        port = m.addr[len(at) :]
        addr: Any = int(port) if m.host and m.addr.startswith(at) and port.isdigit() and port[0] != "0" else m.addr
        role: Any = _ROLES.index(m.role) if m.role in _ROLES else m.role
        rows.append([int(r), inc, h, m.pid, addr, role, m.spare_id, m.node])
    return {"v": 2, "hosts": list(hosts), "rows": rows}


def _unpack_members(raw: Any) -> dict[int, Member]:
    if not (isinstance(raw, dict) and raw.get("v") == 2):  # the plain form: {rank: {field: value}}
        return {int(r): Member.from_dict(m) for r, m in raw.items()}
    hosts = raw["hosts"]
    out = {}
    for rank, inc, h, pid, addr, role, spare_id, node in raw["rows"]:
        host = hosts[h]
        if isinstance(inc, list):
            pre = _ROLES[inc[0]] if isinstance(inc[0], int) else inc[0]
            inc = f"{pre}-{host}-{inc[1]}"
        if isinstance(addr, int):
            addr = f"tcp://{host}:{addr}"
        role = _ROLES[role] if isinstance(role, int) else role
        if not all(isinstance(x, str) for x in (inc, host, addr, role, spare_id)) or not isinstance(pid, int):
            raise ValueError(f"member row of rank {rank} has a field of the wrong type")
        out[int(rank)] = Member(int(rank), inc, host, pid, addr, role, spare_id, node)
    return out


@dataclass
class Membership:
    generation: int = 0
    state: str = GenState.FORMING.value
    world_size: int = 0
    members: dict[int, Member] = field(default_factory=dict)
    store: str = ""  # host:port of the TCPStore the group of this generation builds from
    resume_step: int | None = None
    sources: list[int] = field(default_factory=list)  # ranks holding the boundary state
    kind: str = ""  # "failure" | "migration" | "restart" | "shrink" | "" (initial)
    failed_rank: int | None = None
    fenced: list[str] = field(default_factory=list)
    reason: str = ""
    leader: str = ""
    updated: float = 0.0
    nonce: str = ""  # unique per write: tells an ambiguous retry that it landed
    # planned migration: rank, from_gen, leaving (incarnation), leaving_member, addr, phase, ...
    migration: dict = field(default_factory=dict)
    continues: int = 0  # an aborted migration's generation: members keep the group of this one
    # the cold path (kind "restart"): {"path": the checkpoint's step directory, "step": its boundary}
    restart: dict = field(default_factory=dict)
    restarts: int = 0  # cold restarts so far (--max-restarts), carried from generation to generation
    # a shrunk job (--min-nproc): virtual rank -> the member that runs its loop body too (runtime/virtual.py)
    carried: dict[int, int] = field(default_factory=dict)
    # the job is stopping (runtime/stop.py): {"reason", "time"}; the members vote inside a step's
    # collective, checkpoint its boundary and leave; DONE with it set is a stop, not the end
    stop: dict = field(default_factory=dict)

    @property
    def trains(self) -> bool:
        """The job formed and has not ended: it trains, recovers or migrates."""
        return self.generation >= 1 and self.state not in (GenState.DONE, GenState.FAILED)

    @property
    def group_gen(self) -> int:
        """The generation whose process group members of this one train in."""
        return self.continues or self.generation

    @property
    def group_size(self) -> int:
        """The ranks of this generation's process group: the world, or the survivors of a
        shrunk job (its virtual ranks are run by them and take no place in the group)."""
        return len(self.members) if self.carried else self.world_size

    def group_rank(self, rank: int) -> int:
        """`rank`'s place in the process group: the rank itself, or in a shrunk job its
        index among the members."""
        return sorted(self.members).index(rank) if self.carried else rank

    def to_bytes(self) -> bytes:
        # asdict() would first copy every Member into a dict only to be packed again
        d = {f: (_pack_members(self.members) if f == "members" else getattr(self, f))
             for f in self.__dataclass_fields__}  # fmt: skip
        return encode(d)

    @classmethod
    def from_bytes(cls, raw: bytes | None) -> Membership:
        if not raw:
            return cls()
        try:
            d = decode(raw)
            d["members"] = _unpack_members(d.get("members", {}))
            d["carried"] = {int(k): int(v) for k, v in (d.get("carried") or {}).items()}
            return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})
        except Exception as exc:  # noqa: BLE001 - msgpack, a missing field, a wrong type
            raise CorruptStateError(
                f"the job's membership table in etcd is not a valid record ({type(exc).__name__}): its state is "
                "corrupt and nothing can be decided from it; this run ends, start a new one"
            ) from None

    def rank_of(self, incarnation: str) -> int | None:
        for r, m in self.members.items():
            if m.incarnation == incarnation:
                return r
        return None


class Rendezvous:
    """A job's view of etcd: membership, fencing, registrations."""

    def __init__(self, client: EtcdClient, job: str, timeouts: Timeouts | None = None) -> None:
        self.client = client
        self.keys = JobKeys(job)
        self.timeouts = timeouts or Timeouts.from_env()
        self.t = client.txn_ops

    # -- reads ---------------------------------------------------------------------
    def read(self) -> Membership:
        """The current membership; generation 0 means the job has not formed."""
        kv = self.client.get(self.keys.membership)
        return Membership.from_bytes(kv.value if kv else None)

    def generation(self) -> int:
        kv = self.client.get(self.keys.generation)
        return int(kv.value) if kv else 0

    def is_fenced(self, incarnation: str) -> bool:
        return self.client.get(self.keys.fenced(incarnation)) is not None

    # -- compare building blocks ---------------------------------------------------------
    def gen_is(self, generation: int) -> Any:
        if generation == 0:
            return self.t.version(self.keys.generation) == 0
        return self.t.value(self.keys.generation) == str(generation)

    def not_fenced(self, incarnation: str) -> Any:
        return self.t.version(self.keys.fenced(incarnation)) == 0

    # -- coordinator writes ------------------------------------------------------------------
    def commit_change(
        self,
        expected: int,
        new: Membership,
        fence: Iterable[str] = (),
        guard: Iterable[Any] = (),
        extra: Iterable[Any] = (),
    ) -> bool:
        """Generation `expected` -> `expected + 1`, the new table and fences, atomically.

        guard: more compares (the leader check); extra: more puts. Returns
        False if someone else changed the generation first (re-read and retry).
        """
        new.generation = expected + 1
        fence = list(fence)
        new.fenced = fence
        new.updated = now = time.time()
        new.nonce = uuid.uuid4().hex
        ops = [
            self.t.put(self.keys.generation, str(expected + 1)),
            self.t.put(self.keys.membership, new.to_bytes()),
        ]
        for inc in fence:
            ops.append(
                self.t.put(
                    self.keys.fenced(inc),
                    encode({"generation": expected + 1, "time": now, "reason": new.reason}),
                )
            )
        ok, _ = self.client.txn([self.gen_is(expected), *guard], ops + list(extra))
        if not ok:
            # A retry after a lost reply sees its own write as a failed compare.
            ok = self.read().nonce == new.nonce
        if ok:
            log.info(
                "generation committed",
                extra={"generation": expected + 1, "state": new.state, "fenced": fence},
            )
        return ok

    def update(self, m: Membership, guard: Iterable[Any] = (), extra: Iterable[Any] = ()) -> bool:
        """Rewrite the table of the *current* generation (state transitions)."""
        m.updated = time.time()
        m.nonce = uuid.uuid4().hex
        ok, _ = self.client.txn(
            [self.gen_is(m.generation), *guard],
            [self.t.put(self.keys.membership, m.to_bytes()), *extra],
        )
        return ok or self.read().nonce == m.nonce

    # -- fenced writes of members ----------------------------------------------------------
    def check(self, generation: int, incarnation: str) -> None:
        """Raise if `incarnation` is fenced or `generation` is not current."""
        if self.is_fenced(incarnation):
            raise FencedError(f"incarnation {incarnation} is fenced: it was replaced in the job and must stop")
        current = self.generation()
        if current != generation:
            raise StaleGenerationError(f"stale generation {generation} (current is {current}): re-read the membership")

    def fenced_put(
        self, generation: int | None, incarnation: str, key: str, value: bytes, lease: int | None = None
    ) -> None:
        """Put `key` only if the caller is not fenced (and, if given, `generation` is current)."""
        compare = [self.not_fenced(incarnation)]
        if generation is not None:
            compare.append(self.gen_is(generation))
        ok, _ = self.client.txn(compare, [self.t.put(key, value, lease)])
        if not ok:
            self.check(generation if generation is not None else self.generation(), incarnation)
            raise StaleGenerationError(f"write of {key} refused: generation changed meanwhile")

    def register(
        self,
        key: str,
        value: dict,
        incarnation: str,
        on_lost: Callable[[str], None] | None = None,
        ttl_s: int | None = None,
    ) -> LeaseKeeper:
        """Put `value` at `key` under a kept-alive lease; refused if fenced.

        The registration rides through an etcd outage up to the outage budget:
        if its lease expired meanwhile, `value` (the same dict: owners keep it
        current) is put again under a new lease, unless we were fenced."""

        def reattach(lease: int) -> None:
            self.fenced_put(None, incarnation, key, encode(value), lease=lease)

        keeper = LeaseKeeper(self.client, ttl_s or self.timeouts.lease_ttl_s, on_lost, name=key.rsplit("/", 2)[-2],
                             outage_budget_s=self.timeouts.etcd_outage.total_seconds(), reattach=reattach)  # fmt: skip
        try:
            self.fenced_put(None, incarnation, key, encode(value), lease=keeper.lease_id)
        except Exception:
            keeper.stop(revoke=True)
            raise
        return keeper
