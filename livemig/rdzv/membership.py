"""Generation CAS, the member table, and fencing.

The generation number (key `generation`, decimal) is the fencing token.
It changes only in a transaction that compares its current value, and the
same transaction writes the new member table's head, the rows that changed
(rdzv/roster.py: rows beyond one transaction are staged before it, invisible
until the head lands) and the fenced incarnations. Every state-changing call of a worker or spare
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
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from livemig.config import ENV_HOST, Timeouts
from livemig.errors import CorruptStateError, FencedError, StaleGenerationError
from livemig.rdzv import roster
from livemig.rdzv.client import EtcdClient, decode, encode, prefix_end, txn_revision
from livemig.rdzv.keys import JobKeys, row_rank
from livemig.rdzv.lease import LeaseKeeper, NodeLease, read_node_lease
from livemig.rdzv.roster import Member

log = logging.getLogger("livemig.rdzv.membership")
_READ_TRIES = 5


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


def _runs(ranks: list[int]) -> Any:
    """A list of ranks as [first, last] runs when that is shorter (every holding rank of a
    10,000-rank job is two numbers, not 10,000): the head stays small whatever N is."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return {"runs": runs} if 2 * len(runs) < len(ranks) else list(ranks)


def _unruns(raw: Any) -> list[int]:
    if isinstance(raw, dict):
        return [r for a, b in raw["runs"] for r in range(int(a), int(b) + 1)]
    return [int(r) for r in raw or []]


@dataclass
class Membership:
    generation: int = 0
    state: str = GenState.FORMING.value
    world_size: int = 0
    # by rank: a plain dict where the coordinator builds a table, a Roster where one was read
    # (rdzv/roster.py: the rows live under their own keys, not in the head)
    members: MutableMapping[int, Member] = field(default_factory=dict)
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
    # the table's rows as the head states them (set by the writer): how many, and their digest
    # (roster.digest), which a reader of every row checks to know it saw one table
    rows: dict = field(default_factory=dict)

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
        """The head: every field but the members, which are rows of their own (JobKeys.row);
        rank lists as runs, so its size does not grow with the world."""
        d = {f: getattr(self, f) for f in self.__dataclass_fields__ if f != "members"}
        d["sources"] = _runs(self.sources)
        return encode(d)

    @classmethod
    def from_bytes(cls, raw: bytes | None) -> Membership:
        """The head alone (its `members` empty: the rows are read with it, `assemble`, or lazily)."""
        if not raw:
            return cls()
        try:
            d = decode(raw)
            d.pop("members", None)
            d["sources"] = _unruns(d.get("sources"))
            d["carried"] = {int(k): int(v) for k, v in (d.get("carried") or {}).items()}
            m = cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})
            if not isinstance(m.generation, int) or not isinstance(m.rows, dict):
                raise TypeError("generation or rows")
            return m
        except Exception as exc:  # noqa: BLE001 - msgpack, a missing field, a wrong type
            raise CorruptStateError(
                f"the job's membership table in etcd is not a valid record ({type(exc).__name__}): its state is "
                "corrupt and nothing can be decided from it; this run ends, start a new one"
            ) from None

    @classmethod
    def assemble(cls, head: bytes | None, rows: Iterable[tuple[int, bytes]], check: bool = True) -> Membership:
        """Head and every row, as read together (one transaction, or a watch's cache of the job):
        the whole table. check: the rows' count and digest must be the head's (they are when
        the reads were atomic; a watch cache between a staged batch and its head may not be)."""
        m = cls.from_bytes(head)
        if not head:
            return m
        members, digest = roster.assemble(m.generation, rows)
        if check and not m.rows_match(len(members), digest):
            raise CorruptStateError(
                f"the job's member rows in etcd do not match its head of generation {m.generation} "
                f"({len(members)} rows, the head says {m.rows.get('n')}): its state is corrupt; this run ends, "
                "start a new one"
            )
        m.members = roster.Roster(members)
        return m

    def rows_match(self, n: int, digest: int) -> bool:
        """Whether `n` rows of that digest are the rows this head states (a head of before the
        rows were counted states none: anything matches)."""
        return not self.rows or (n == self.rows.get("n") and digest == self.rows.get("digest"))

    @classmethod
    def from_kvs(cls, by_key: Mapping[str, Any], keys: JobKeys) -> Membership:
        """The table from a cache of the job's keys (an agent's or a command's watch of the job)."""
        head = by_key.get(keys.membership)
        rows = [(r, kv.value) for k, kv in by_key.items() if (r := row_rank(keys, k)) is not None]
        return cls.assemble(head.value if head is not None else None, rows, check=False)

    def rank_of(self, incarnation: str, hint: int | None = None) -> int | None:
        """The rank `incarnation` holds. hint: the rank it probably holds (its own last rank),
        checked first, so that a member of a lazily read table reads one row, not all."""
        if hint is not None and hint in self.members and self.members[hint].incarnation == incarnation:
            return hint
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
        self.rows = roster.RowWriter(
            self._stored_rows, lambda rev: client.modified_since(self.keys.roster_prefix, rev)
        )  # what this process, when it leads, last stored

    # -- reads ---------------------------------------------------------------------
    def read(self) -> Membership:
        """The current membership, every row, read in one transaction; generation 0 means the
        job has not formed."""
        t = self.t
        for attempt in range(_READ_TRIES):
            rows = t.get(self.keys.roster_prefix, prefix_end(self.keys.roster_prefix))
            _, resps = self.client.read_txn([], [t.get(self.keys.membership), rows])
            head = resps[0][0][0] if resps[0] else None
            try:
                return Membership.assemble(head, self._ranked(resps[1]))
            except CorruptStateError:
                # rows of the current generation rewritten in batches (an update of more rows
                # than one transaction holds) read between two batches: the head follows
                if attempt == _READ_TRIES - 1:
                    raise
                time.sleep(0.05 * (attempt + 1))
        raise AssertionError("unreachable")

    def _ranked(self, kvs: list) -> list[tuple[int, bytes]]:
        """(rank, value) of the row keys among a read transaction's (value, meta) results."""
        out = []
        for value, meta in kvs:
            r = row_rank(self.keys, meta.key.decode() if isinstance(meta.key, bytes) else meta.key)
            if r is not None:
                out.append((r, value))
        return out

    def read_head(self) -> Membership:
        """The head alone, its members read when first used (`lazy`)."""
        kv = self.client.get(self.keys.membership)
        m = Membership.from_bytes(kv.value if kv else None)
        return self.lazy(m)

    def lazy(
        self, m: Membership, incarnation: str | None = None, on_fenced: Callable[[], None] | None = None
    ) -> Membership:
        """`m` (a head) with its members read from etcd when first used: the rows a member uses.
        on_fenced: called before a refused read raises (the process learns it is fenced first)."""

        def load(ranks: list[int] | None) -> dict[int, Member]:
            try:
                return self.read_rows(m.generation, ranks, incarnation)
            except FencedError:
                if on_fenced is not None:
                    on_fenced()
                raise

        m.members = roster.Roster(loader=load)
        return m

    def read_rows(self, generation: int, ranks: list[int] | None, incarnation: str | None = None) -> dict[int, Member]:
        """The rows of `ranks` (None: every row) as generation `generation` has them. With
        `incarnation`: refused (FencedError) once it is fenced, so a replaced process cannot
        act on a table it is no longer part of. A row changed twice since `generation`:
        StaleGenerationError (the reader is behind; it re-reads the head)."""
        t = self.t
        if ranks is None or len(ranks) > roster.TXN_OPS:
            ops = [t.get(self.keys.roster_prefix, prefix_end(self.keys.roster_prefix))]
        else:
            ops = [t.get(self.keys.row(r)) for r in ranks]
        compare = [self.not_fenced(incarnation)] if incarnation else []
        ok, resps = self.client.read_txn(compare, ops)
        if not ok:
            raise FencedError(f"incarnation {incarnation} is fenced: it was replaced in the job and must stop")
        kvs = [kv for r in resps for kv in r]
        members, _ = roster.assemble(generation, self._ranked(kvs))
        return members if ranks is None else {r: members[r] for r in ranks if r in members}

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
    def _stored_rows(self) -> tuple[dict[int, list], int]:
        """Every row's stored versions (the writer diffs against them, junk of an abandoned
        staging included), and the revision they were read at."""
        kvs, rev = self.client.get_prefix(self.keys.roster_prefix)
        out: dict[int, list] = {}
        for kv in kvs:
            r = row_rank(self.keys, kv.key)
            if r is not None:
                try:
                    out[r] = roster.decode_versions(kv.value)
                except Exception:  # noqa: BLE001 - a corrupt row is rewritten whole
                    out[r] = [[-1, "corrupt"]]
        return out, rev

    def _row_writes(self, tag: int, new: Membership) -> tuple[dict[int, list], list[Any]]:
        """The rows that make readers of `tag` see `new`'s members and readers of earlier
        generations what they saw, as versions and as puts; sets the head's row count and digest."""
        writes, new.rows = self.rows.plan(tag, new.members)
        return writes, [self.t.put(self.keys.row(r), roster.encode_versions(v)) for r, v in sorted(writes.items())]

    def _write(self, compare: list[Any], rows: list[Any], head_ops: list[Any], extra: list[Any]) -> tuple[bool, int]:
        """`rows`, then the head's transaction: (whether it landed, the revision it made). Rows
        that do not fit one transaction with the head are staged first in batches, each
        compared as the head is (`compare`): tagged with the generation being written, they
        stay invisible until the head lands."""
        room = max(0, roster.TXN_OPS - len(head_ops) - len(extra))
        staged, last = (rows[: len(rows) - room], rows[len(rows) - room :]) if len(rows) > room else ([], rows)
        for i in range(0, len(staged), roster.TXN_OPS):
            ok, _ = self.client.txn(compare, staged[i : i + roster.TXN_OPS])
            if not ok:
                return False, 0
        if staged:
            log.info("member rows staged", extra={"rows": len(staged)})
        ok, resps = self.client.txn(compare, [*last, *head_ops, *extra])
        return ok, txn_revision(resps) if ok else 0

    def commit_change(
        self,
        expected: int,
        new: Membership,
        fence: Iterable[str] = (),
        guard: Iterable[Any] = (),
        extra: Iterable[Any] = (),
    ) -> bool:
        """Generation `expected` -> `expected + 1`: the head, the rows that change and the fences,
        atomically (docs/protocol.md, "The member table").

        guard: more compares (the leader check); extra: more puts. Returns
        False if someone else changed the generation first (re-read and retry).
        """
        new.generation = expected + 1
        fence = list(fence)
        new.fenced = fence
        new.updated = now = time.time()
        new.nonce = uuid.uuid4().hex
        compare = [self.gen_is(expected), *guard]
        writes, rows = self._row_writes(expected + 1, new)
        record = encode({"generation": expected + 1, "time": now, "reason": new.reason})
        fences = [self.t.put(self.keys.fenced(inc), record) for inc in fence]
        head = [self.t.put(self.keys.generation, str(expected + 1)), self.t.put(self.keys.membership, new.to_bytes())]
        # fences that do not fit are staged with the rows: a fence is never lifted, and only a
        # process the leader decided is lost is fenced, so fencing it early changes no outcome
        ok = self._wrote(writes, lambda: self._write(compare, [*rows, *fences], head, list(extra)), new.nonce)
        if ok:
            log.info(
                "generation committed",
                extra={"generation": expected + 1, "state": new.state, "fenced": fence, "rows": len(rows)},
            )
        return ok

    def _head_nonce(self) -> str:
        kv = self.client.get(self.keys.membership)
        return Membership.from_bytes(kv.value if kv else None).nonce

    def update(self, m: Membership, guard: Iterable[Any] = (), extra: Iterable[Any] = ()) -> bool:
        """Rewrite the table of the *current* generation (state transitions): the head and the
        rows that changed."""
        m.updated = time.time()
        m.nonce = uuid.uuid4().hex
        writes, rows = self._row_writes(m.generation, m)
        head = [self.t.put(self.keys.membership, m.to_bytes())]
        return self._wrote(writes, lambda: self._write([self.gen_is(m.generation), *guard], rows, head, list(extra)),
                           m.nonce)  # fmt: skip

    def _wrote(self, writes: dict[int, list], write: Callable[[], tuple[bool, int]], nonce: str) -> bool:
        """Run `write`; keep the writer's record of the rows only when they are known stored, and
        at which revision (a staging cut short, another leader's change, a lost reply, an
        error: they are read again)."""
        try:
            ok, rev = write()
            if not ok:
                # A retry after a lost reply sees its own write as a failed compare.
                ok, rev = self._head_nonce() == nonce, 0
        except BaseException:
            self.rows.forget()
            raise
        if ok:
            self.rows.wrote(writes, rev)
        else:
            self.rows.forget()
        return ok

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
        node_lease_file: str | None = None,
    ) -> LeaseKeeper | NodeLease:
        """Put `value` at `key` under a kept-alive lease; refused if fenced.

        The registration rides through an etcd outage up to the outage budget:
        if its lease expired meanwhile, `value` (the same dict: owners keep it
        current) is put again under a new lease, unless we were fenced.
        node_lease_file: put it under the node agent's lease instead (--node-leases;
        rdzv/lease.py NodeLease), whose id the agent wrote there."""
        if node_lease_file:
            raw = encode(value)
            lease = read_node_lease(node_lease_file, self.timeouts.recovery.total_seconds())
            self.fenced_put(None, incarnation, key, raw, lease=lease)
            return NodeLease(self.client, key, raw, lease, node_lease_file,
                             lambda new: self.fenced_put(None, incarnation, key, raw, lease=new), on_lost)  # fmt: skip

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
