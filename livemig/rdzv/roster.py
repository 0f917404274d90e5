"""The member table as per-rank rows: what a generation change writes and what a reader reads.

The table used to be one value holding every rank, written whole on each change and received
whole by every member: 0.4 MiB at 10,000 ranks (4 GB out of etcd for one failure), over
etcd's 1.5 MiB request limit at 100,000. Now the membership key holds a small head
(generation, state, world size, a row count and a digest) and each rank has a row of its own
(`JobKeys.row`); a change writes the rows it changes and the head, and a member reads the
head and only the rows it needs (its own, a source's address).

A row holds up to two *versions*, each tagged with the generation it was written for: the
newest version of an earlier generation (the base) and, when the row changed, the version of
the generation being written. A reader of generation g takes the newest version tagged <= g.
That is what lets a change of more rows than one etcd transaction holds (128 operations by
default) stay atomic: its rows are staged first, in batches each compared on the current
generation and the leader's key, tagged g+1 and so invisible to readers of g; the head's
transaction then makes them visible all at once. A staging abandoned by a deposed leader
leaves versions tagged g+1 that the next leader's own change for g+1 replaces (it rewrites
every row whose stored value is not the one it intends). docs/protocol.md, "The member
table", has the keys and the argument.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import msgpack

from livemig.config import Role
from livemig.errors import CorruptStateError, StaleGenerationError

_ROLES: list[str] = [Role.WORKER, Role.SPARE]


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


# operations per transaction this module plans for: etcd's default --max-txn-ops is 128, and the
# committing transaction also carries the head, the generation, claims and the caller's extras
TXN_OPS = 100
# a lazy roster reads single rows until this many, then the whole table in one range read
SINGLE_READS = 8


def pack_row(m: Member) -> list:
    """One rank's row, compact: the parts of the incarnation and the address that repeat the
    host left out, the role as an index (~40 bytes with real host names instead of ~135)."""
    mid = f"-{m.host}-"
    pre, sep, suf = m.incarnation.partition(mid)
    inc: Any = [_ROLES.index(pre) if pre in _ROLES else pre, suf] if sep and m.host else m.incarnation
    at = f"tcp://{m.host}:"
    port = m.addr[len(at) :]
    addr: Any = int(port) if m.host and m.addr.startswith(at) and port.isdigit() and port[0] != "0" else m.addr
    role: Any = _ROLES.index(m.role) if m.role in _ROLES else m.role
    return [inc, m.host, m.pid, addr, role, m.spare_id, m.node]


def unpack_row(rank: int, row: Any) -> Member:
    inc, host, pid, addr, role, spare_id, node = row
    if not isinstance(host, str):
        raise ValueError(f"member row of rank {rank} has a host of the wrong type")
    if isinstance(inc, list):
        pre = _ROLES[inc[0]] if isinstance(inc[0], int) else inc[0]
        inc = f"{pre}-{host}-{inc[1]}"
    if isinstance(addr, int):
        addr = f"tcp://{host}:{addr}"
    role = _ROLES[role] if isinstance(role, int) else role
    if not all(isinstance(x, str) for x in (inc, addr, role, spare_id)) or not isinstance(pid, int):
        raise ValueError(f"member row of rank {rank} has a field of the wrong type")
    if node is not None and not isinstance(node, int):
        raise ValueError(f"member row of rank {rank} has a node of the wrong type")
    return Member(int(rank), inc, host, pid, addr, role, spare_id, node)


# -- versions ------------------------------------------------------------------------------------
Versions = list  # [[tag, row or None], ...], tags ascending, at most two


def decode_versions(raw: bytes) -> Versions:
    v = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    if not (isinstance(v, list) and 1 <= len(v) <= 2
            and all(isinstance(x, list) and len(x) == 2 and isinstance(x[0], int) for x in v)):  # fmt: skip
        raise ValueError("a member row is not a list of tagged versions")
    return v


def encode_versions(v: Versions) -> bytes:
    return msgpack.packb(v, use_bin_type=True)


def newest(v: Versions, generation: int) -> tuple[int, Any] | None:
    """The version a reader of `generation` sees, (tag, row or None for "no member"); None
    when every version is newer (the row changed twice since: the reader is stale)."""
    best = None
    for tag, row in v:
        if tag <= generation:
            best = (tag, row)
    return best


def visible(v: Versions, generation: int) -> tuple[bool, Any]:
    """`newest` as (seen, row): (False, None) for a stale reader."""
    got = newest(v, generation)
    return (True, got[1]) if got is not None else (False, None)


def planned(v: Versions | None, tag: int, row: list | None) -> Versions | None:
    """The versions to store so that readers of `tag` see `row` and readers of earlier
    generations what they saw: the newest version tagged < tag kept as the base. None: the
    stored value is already right (no write)."""
    got = newest(v or [], tag - 1)
    base = list(got) if got is not None else None
    if base is not None and base[1] == row:
        want = [base]
    elif base is None and row is None:
        want = [] if not v else [[tag, None]]
    else:
        want = ([base] if base is not None else []) + [[tag, row]]
    if want == (v or []):
        return None
    return want


# -- digest ---------------------------------------------------------------------------------------
_MASK = (1 << 64) - 1


def row_hash(rank: int, row: list | None) -> int:
    if row is None:
        return 0
    h = hashlib.blake2b(msgpack.packb([rank, row], use_bin_type=True), digest_size=8).digest()
    return int.from_bytes(h, "big")


def digest(rows: Mapping[int, list]) -> int:
    """Order-free sum of the rows' hashes: a change updates it in O(rows changed), and a reader
    that read every row checks it against the head to know it saw one table, not a mix."""
    return sum(row_hash(r, row) for r, row in rows.items()) & _MASK


class Roster(MutableMapping[int, Member]):
    """The members of a generation by rank: all of them (the coordinator, the agents, which read
    every row anyway) or loaded on demand through `loader` (a member, which reads the rows it
    uses: its own, a source's). Iterating a lazy roster loads every row, once."""

    def __init__(
        self,
        rows: Mapping[int, Member] | None = None,
        loader: Callable[[list[int] | None], dict[int, Member]] | None = None,
    ) -> None:
        self._rows: dict[int, Member] = dict(rows or {})
        self._loader = loader
        self._absent: set[int] = set()
        self._singles = 0

    def _load_all(self) -> None:
        if self._loader is not None:
            self._rows = self._loader(None)
            self._loader = None

    def _load(self, rank: int) -> None:
        if self._loader is None or rank in self._rows or rank in self._absent:
            return
        self._singles += 1
        if self._singles > SINGLE_READS:
            self._load_all()
            return
        got = self._loader([rank])
        if rank in got:
            self._rows[rank] = got[rank]
        else:
            self._absent.add(rank)

    def __getitem__(self, rank: int) -> Member:
        self._load(rank)
        return self._rows[rank]

    def __contains__(self, rank: object) -> bool:
        if isinstance(rank, int) and not isinstance(rank, bool):
            self._load(rank)
        return rank in self._rows

    def __iter__(self) -> Iterator[int]:
        self._load_all()
        return iter(self._rows)

    def __len__(self) -> int:
        self._load_all()
        return len(self._rows)

    def __setitem__(self, rank: int, m: Member) -> None:
        self._load_all()
        self._rows[rank] = m

    def __delitem__(self, rank: int) -> None:
        self._load_all()
        del self._rows[rank]

    def __repr__(self) -> str:
        return f"Roster({self._rows!r}{', lazy' if self._loader else ''})"

    def loaded_rows(self) -> dict[int, Member] | None:
        """The rows as a plain dict (read only) when all are held, for loops that compare
        tables at dict speed; None for a lazy roster."""
        return self._rows if self._loader is None else None


def rows_of(members: Mapping[int, Member]) -> dict[int, list]:
    return {int(r): pack_row(m) for r, m in members.items()}


class RowWriter:
    """What the leader last stored, so that a change costs what it changes: the stored versions
    of every row (read once, then kept from its own writes, which are the only writes of rows
    while it leads) and each rank's packed row and hash by the member it packed. Forgotten on
    any write whose outcome is not known to be its own (a failed compare, an error): the next
    change reads the rows again, junk of an abandoned staging included."""

    def __init__(
        self, read_stored: Callable[[], tuple[dict[int, Versions], int]], modified_since: Callable[[int], int]
    ) -> None:
        self._read_stored = read_stored
        self._modified_since = modified_since
        self._stored: dict[int, Versions] | None = None
        self._rev = 0  # the etcd revision at which _stored was the rows' value
        self._packed: dict[int, tuple[Member, list, int]] = {}
        # rank -> (member, its stored versions) found in need of no write: a single version of
        # that member's row, tagged below any later change's tag, stays right for every later
        # tag while neither object changes (identity), so planning costs what changed
        self._clean: dict[int, tuple[Member, Versions, int]] = {}

    def forget(self) -> None:
        self._stored = None
        self._clean = {}

    def _row(self, rank: int, m: Member) -> tuple[list, int]:
        hit = self._packed.get(rank)
        if hit is not None and (hit[0] is m or hit[0] == m):
            return hit[1], hit[2]
        row = pack_row(m)
        h = row_hash(rank, row)
        self._packed[rank] = (m, row, h)
        return row, h

    def plan(self, tag: int, members: Mapping[int, Member]) -> tuple[dict[int, Versions], dict]:
        """The rows to write for readers of `tag` to see `members` ({rank: versions}), and the
        head's `rows` record (count, digest)."""
        if self._stored is not None and self._modified_since(self._rev):
            self._stored = None  # another leader wrote rows since (this process led before, then lost it)
        if self._stored is None:
            self._stored, self._rev = self._read_stored()
        stored = self._stored
        writes: dict[int, Versions] = {}
        total = 0
        clean = self._clean
        for r, m in members.items():
            r = int(r)
            hit = clean.get(r)
            v0 = stored.get(r)
            if hit is not None and hit[0] is m and hit[1] is v0 and v0 is not None and v0[0][0] < tag:
                total += hit[2]
                continue
            row, h = self._row(r, m)
            total += h
            v = planned(v0, tag, row)
            if v is not None:
                writes[r] = v
            elif v0 is not None and len(v0) == 1 and v0[0][0] < tag:
                clean[r] = (m, v0, h)
        for r in stored.keys() - set(members):
            v = planned(stored[r], tag, None)
            if v is not None:
                writes[r] = v
        return writes, {"n": len(members), "digest": total & _MASK}

    def wrote(self, writes: Mapping[int, Versions], revision: int) -> None:
        """`writes` are stored, the last of them at `revision` (0: not known: read again)."""
        if self._stored is not None and revision > 0:
            self._stored.update(writes)
            self._rev = revision
        else:
            self._stored = None


RowCache = dict  # rank -> (stored value, its versions, {tag: (Member, row hash)}): rows decoded once per change


def _visible_member(
    rank: int, raw: bytes, generation: int, cache: RowCache | None
) -> tuple[Member | None, int, int | None]:
    """Row `rank` as a reader of `generation` sees it: (its member or None, its hash, the
    lowest tag of a version not yet visible or None). Errors as `assemble` says."""
    try:
        hit = cache.get(rank) if cache is not None else None
        if hit is None or hit[0] != raw:
            by_tag: dict[int, tuple[Member, int]] = {}
            hit = (raw, decode_versions(raw), by_tag)
            if cache is not None:
                cache[rank] = hit
        seen = newest(hit[1], generation)
        if seen is None:
            raise StaleGenerationError(f"member row {rank} changed after generation {generation}: re-read")
        later = min((t for t, _ in hit[1] if t > generation), default=None)
        tag, row = seen
        if row is None:
            return None, 0, later
        got = hit[2].get(tag)
        if got is None:
            got = hit[2][tag] = (unpack_row(rank, row), row_hash(rank, row))
        return got[0], got[1], later
    except StaleGenerationError:
        raise
    except Exception as exc:  # noqa: BLE001 - msgpack, a wrong shape or type
        raise CorruptStateError(
            f"the job's member row of rank {rank} in etcd is not a valid record ({type(exc).__name__}): its "
            "state is corrupt and nothing can be decided from it; this run ends, start a new one"
        ) from None


def assemble(generation: int, raw_rows: Iterable[tuple[int, bytes]]) -> tuple[dict[int, Member], int]:
    """Every member of `generation` from the stored rows (rank, value): the members and the
    digest of their rows. A row no version of which is visible means the table moved on while
    it was read: StaleGenerationError. A value that is not a row: CorruptStateError. A reader
    that assembles again and again keeps an `Assembler` instead."""
    members: dict[int, Member] = {}
    total = 0
    for rank, raw in raw_rows:
        member, h, _ = _visible_member(rank, raw, generation, None)
        if member is not None:
            members[rank] = member
            total += h
    return members, total & _MASK


class Assembler:
    """The table a reader that follows every change (the coordinator's passes) assembles again
    at each new head from the rows whose visible version may differ from the last assembly's:
    rows stored anew since (`stored`), and rows holding a version tagged after the last
    assembly's generation and at most the new one (staged rows made visible by the head). Any
    other row's newest version <= the new generation is the one it had: the same member. At
    10,000 ranks a whole assembly was ~20 ms of each of a recovery's three head changes."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget everything: the next `assemble` reads every row `stored` since."""
        self.raw: dict[int, bytes] = {}
        self.cache: RowCache = {}
        self.members: dict[int, Member] = {}
        self.hashes: dict[int, int] = {}
        self.total = 0
        self.generation: int | None = None
        self.pending: dict[int, int] = {}  # rank -> the lowest tag of a version not yet visible
        self.dirty: set[int] = set()

    def stored(self, rank: int, raw: bytes | None) -> None:
        """Row `rank`'s stored value now (None: deleted); the same value as before changes nothing."""
        if self.raw.get(rank) == raw:
            return
        if raw is None:
            self.raw.pop(rank, None)
        else:
            self.raw[rank] = raw
        self.dirty.add(rank)

    def assemble(self, generation: int) -> tuple[dict[int, Member], int]:
        """As module `assemble` over every stored row, from the rows that may differ alone."""
        if self.generation is None or generation < self.generation:
            again: Iterable[int] = sorted(self.raw)
            self.members, self.hashes, self.total, self.pending = {}, {}, 0, {}
        else:
            again = self.dirty | {r for r, t in self.pending.items() if t <= generation}
        self.generation = None  # until this assembly is complete: an error leaves it to start over
        added = False
        for r in again:
            self.total -= self.hashes.pop(r, 0)
            self.pending.pop(r, None)
            raw = self.raw.get(r)
            if raw is None:
                self.cache.pop(r, None)
                self.members.pop(r, None)
                continue
            member, h, later = _visible_member(r, raw, generation, self.cache)
            if later is not None:
                self.pending[r] = later
            if member is None:
                self.members.pop(r, None)
                continue
            added = added or r not in self.members
            self.members[r] = member  # an existing rank keeps its place
            self.hashes[r] = h
            self.total += h
        if added:
            self.members = dict(sorted(self.members.items()))
        self.dirty = set()
        self.generation = generation
        return dict(self.members), self.total & _MASK
