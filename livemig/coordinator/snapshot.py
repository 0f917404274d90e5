"""A coordinator pass reads the whole job prefix as one Snapshot: typed accessors
that never fail on what a member (or anyone with access to etcd) wrote.

A value that does not decode, or that decodes but lacks a field the coordinator
reads (or carries one of the wrong type), is logged once and ignored, like
garbage: a pass must never fail on it again and again (docs/reliability.md).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import replace
from typing import Any

from livemig.config import Role
from livemig.rdzv import roster
from livemig.rdzv.client import KV, decode
from livemig.rdzv.keys import row_rank
from livemig.rdzv.membership import Member, Membership, Rendezvous

log = logging.getLogger("livemig.coordinator")

_NUM = (int, float)
# The fields the coordinator reads without a default, by the key's place under the job's
# prefix (its first segment, or recovery/<g>/<what>). A value without them, or with one of
# the wrong type, is ignored like garbage: a pass must never fail on it again and again.
_REQUIRED: dict[str, dict[str, tuple]] = {
    "members": {"incarnation": (str,), "host": (str,), "pid": (int,), "addr": (str,)},
    "signatures": {"incarnation": (str,), "signature": (list,)},
    "suspects": {"time": _NUM},
    "spares": {"incarnation": (str,)},
    "~progress": {"step": (int,)},
    "final": {"incarnation": (str,)},
    "config": {"signature": (list,)},
    "report": {"incarnation": (str,), "committed": (int, type(None))},
    "ready": {"incarnation": (str,)},
    "catchup": {"incarnation": (str,), "applied": (int,), "loaded": (int,), "time": _NUM},
    "errors": {"incarnation": (str,)},
}
_logged: set[tuple[str, int]] = set()  # (key, length) of ignored values: logged once each


def as_number(v: Any, default: float = 0.0) -> float:
    """A number read from a member's record, or `default` for anything else."""
    return float(v) if isinstance(v, _NUM) and not isinstance(v, bool) else default


def _kind(key: str) -> str:
    parts = key.split("/")  # '', 'livemig', job, kind, ...
    if len(parts) < 4:
        return ""
    if parts[3] == "recovery" and len(parts) >= 6:
        return parts[5]
    return parts[3]


def safe_decode(key: str, raw: bytes) -> Any:
    """A malformed value under the job's prefix, or one that decodes but lacks a field the
    coordinator reads, is logged once and ignored, never fatal."""
    try:
        value = decode(raw)
    except Exception:  # noqa: BLE001 - msgpack raises several types
        value = None
    if not isinstance(value, dict) and value is not None:
        value = None
    why = "malformed" if value is None and raw else ""
    if value is not None:
        need = _REQUIRED.get(_kind(key), {})
        bad = [f for f, types in need.items()
               if f not in value or not isinstance(value[f], types) or isinstance(value[f], bool)]  # fmt: skip
        if bad:
            value, why = None, f"lacks field(s) {', '.join(bad)}"
    if why and (key, len(raw)) not in _logged:
        if len(_logged) < 10_000:
            _logged.add((key, len(raw)))
        log.error("ignoring a malformed value", extra={"key": key, "bytes": len(raw), "why": why})
    return value


def _folder(key: str) -> str:
    return key[: key.rfind("/") + 1]


class Decoded:
    """What passes derive from the job's keys, kept from pass to pass and updated by each
    pass's changed keys alone: the decoded values (by key and mod revision), the member table,
    the keys by folder, and memos of whole results (Snapshot.under, dead, registered, the
    progress records that carry a flag). At 10,000 ranks a pass otherwise decoded and indexed
    every key of the job (~60,000) and checked every member 5 times a second: a pass cost
    grew with N, and so did each recovery phase, which waits for one or two passes.
    Values are shared between passes: the coordinator never mutates what it reads.

    Each pass is numbered (`passes`); a memo holds the pass it was made in and is reused while
    no folder it read was touched since (`changed_since`). A pass whose changed keys are not
    known (a full read, the first pass) rebuilds the index and drops every memo."""

    def __init__(self) -> None:
        self.values: dict[str, tuple[int, Any]] = {}
        self.table: tuple[int, Membership] | None = None  # (the head's mod revision, the table)
        self.rows = roster.Assembler()  # the member rows, re-read only where they changed
        self.passes = 0
        self.rebuilt = 0  # the last pass that indexed every key anew
        self.folders: dict[str, dict[str, None]] = {}  # keys by parent folder, in the mirror's order
        self.touched: dict[str, int] = {}  # folder -> the last pass that changed a key in it
        self.changed: dict[str, list[str]] = {}  # this pass's changed keys by folder
        self.memo: dict[Any, tuple] = {}  # (what, args) -> (pass made, ...)

    def get(self, kv: KV, decode_fn: Any) -> Any:
        hit = self.values.get(kv.key)
        if hit is not None and hit[0] == kv.mod_revision:
            return hit[1]
        value = decode_fn(kv.key, kv.value)
        self.values[kv.key] = (kv.mod_revision, value)
        return value

    def forget_gone(self, live: Mapping[str, KV]) -> None:
        if len(self.values) > 2 * len(live) + 1000:
            self.values = {k: v for k, v in self.values.items() if k in live}

    def begin(self, kvs: Mapping[str, KV], changes: set[str] | None) -> None:
        """A new pass over `kvs`; `changes`: the keys that differ from the last pass's (None:
        not known, everything is indexed again)."""
        self.passes += 1
        self.changed = {}
        if len(self.memo) > 64:  # memos of finished generations' folders: made again if asked
            self.memo = {}
        if changes is None or len(self.touched) > 10_000:  # folders of long-pruned generations
            self.rebuilt = self.passes
            self.folders, self.touched, self.memo = {}, {}, {}
            for k in kvs:
                self.folders.setdefault(_folder(k), {})[k] = None
            return
        for k in sorted(changes):  # keys new in one pass: in a fixed order
            f = _folder(k)
            if k in kvs:
                self.folders.setdefault(f, {})[k] = None  # a changed value keeps its place
            elif (keys := self.folders.get(f)) is not None:
                keys.pop(k, None)
                if not keys:
                    del self.folders[f]
            self.touched[f] = self.passes
            self.changed.setdefault(f, []).append(k)

    def follows(self, made: int) -> bool:
        """This pass's changed keys are all that differ from pass `made`'s keys: `made` was the
        last pass and this one is no rebuild (a memo of `made` can be updated from them)."""
        return made == self.passes - 1 and self.rebuilt < self.passes

    def changed_since(self, prefixes: tuple[str, ...], made: int) -> bool:
        """Whether a key under any of `prefixes` (folders, ending in '/') changed after pass `made`."""
        if self.rebuilt > made:
            return True
        return any(at > made and f.startswith(prefixes) for f, at in self.touched.items())


class Joined(Mapping[str, KV]):
    """The control keys and the progress records of one pass as one read-only mapping, without
    merging them into a new dict (the mirrors lend their own dicts: PrefixMirror(lend=True));
    the two hold disjoint keys. `get` is the hot path: one or two dict lookups."""

    __slots__ = ("control", "progress")

    def __init__(self, control: dict[str, KV], progress: dict[str, KV]) -> None:
        self.control = control
        self.progress = progress

    def get(self, key: str, default: Any = None) -> Any:
        kv = self.control.get(key)
        return kv if kv is not None else self.progress.get(key, default)

    def __getitem__(self, key: str) -> KV:
        kv = self.control.get(key)
        return kv if kv is not None else self.progress[key]

    def __contains__(self, key: object) -> bool:
        return key in self.control or key in self.progress

    def __iter__(self) -> Iterator[str]:
        yield from self.control
        yield from self.progress

    def __len__(self) -> int:
        return len(self.control) + len(self.progress)


def changed_members(before: Mapping[int, Member], after: Mapping[int, Member]) -> set[int]:
    """The ranks of `after` whose member is not the very object `before` holds (new ranks
    included): what a table assembled from changed rows changed (roster.Assembler keeps the
    member objects of rows it did not re-read), compared by identity at dict speed."""
    b = (before.loaded_rows() if isinstance(before, roster.Roster) else None) or before
    a = (after.loaded_rows() if isinstance(after, roster.Roster) else None) or after
    get = b.get
    return {r for r, m in a.items() if get(r) is not m}


def node_of(reg: dict) -> int | None:
    """The node rank a registration names (None: a spare of a standby host, or older records)."""
    n = reg.get("node")
    return n if isinstance(n, int) and not isinstance(n, bool) else None


class Snapshot:
    """All keys of the job at one revision, with typed accessors. `changes`: the keys that
    differ from the last Snapshot made with the same `cache` (the coordinator's mirrors collect
    them); None when not known: what the cache derived is then made anew (see Decoded)."""

    def __init__(self, kvs: list[KV] | Mapping[str, KV], rdzv: Rendezvous, cache: Decoded | None = None,
                 changes: set[str] | None = None) -> None:  # fmt: skip
        self.kv: Mapping[str, KV] = {kv.key: kv for kv in kvs} if isinstance(kvs, list) else kvs
        self.keys = rdzv.keys
        self._cache = cache if cache is not None else Decoded()
        self._cache.begin(self.kv, changes)
        self._cache.forget_gone(self.kv)
        self._rows_stored()
        self.m = self._table()

    @property
    def pass_no(self) -> int:
        """This pass's number: a memo of the caller's made now is valid while `unchanged_since`."""
        return self._cache.passes

    def unchanged_since(self, prefixes: tuple[str, ...], made: int) -> bool:
        """No key under `prefixes` (folders) changed after pass `made` (see Decoded)."""
        return not self._cache.changed_since(prefixes, made)

    def _rows_stored(self) -> None:
        """Tell the table's assembler which rows changed in this pass (every row after a
        full read)."""
        c, rp = self._cache, self.keys.roster_prefix
        keys: Iterable[str] = c.changed.get(rp, ())
        if c.rebuilt == c.passes:  # every row, and the ones no longer there: those that differ are re-read
            keys = [*c.folders.get(rp, {}), *(self.keys.row(r) for r in c.rows.raw)]
        for k in keys:
            r = row_rank(self.keys, k)
            if r is not None:
                kv = self.kv.get(k)
                c.rows.stored(r, kv.value if kv is not None else None)

    def progress_changed(self, made: int) -> list[tuple[int, Any]] | None:
        """The progress records (rank, record or None: gone) changed in this pass, for a caller
        that read them all in pass `made`, the last one; None if it must read them all again."""
        c, pp = self._cache, self.keys.progress_prefix
        if not c.follows(made):
            return None
        return [(int(k[len(pp) :]), self.get(k)) for k in c.changed.get(pp, ()) if k[len(pp) :].isdigit()]

    def _table(self) -> Membership:
        """The head and the rows as one table, assembled again only when the head changed
        (every change of visible rows writes the head) and then only from the rows that
        changed (roster.Assembler): a pass at 10,000 ranks would otherwise decode every row 5
        times a second. A table whose rows do not yet match the head's digest (a mirror between
        the events of one write) is used, not kept: the next pass assembles it again."""
        head = self.kv.get(self.keys.membership)
        if head is None:
            return Membership.from_bytes(None)
        if self._cache.table is not None and self._cache.table[0] == head.mod_revision:
            return self._cache.table[1]
        m = Membership.from_bytes(head.value)
        members, digest = self._cache.rows.assemble(m.generation)
        m.members = roster.Roster(members)
        if m.rows_match(len(members), digest):
            self._cache.table = (head.mod_revision, m)
        return m

    def get(self, key: str) -> Any:
        kv = self.kv.get(key)
        return self._cache.get(kv, safe_decode) if kv else None

    def under(self, prefix: str) -> dict[str, Any]:
        """The records under the folder `prefix` that decode to a dict, by the rest of their
        key: made once and then updated by the changed keys alone while passes come one after
        another (a report or ready folder of 10,000 ranks is read by every pass of a recovery)."""
        c = self._cache
        hit = c.memo.get(("under", prefix))
        if hit is not None and not c.changed_since((prefix,), hit[0]):
            out = hit[1]
        elif hit is not None and c.follows(hit[0]):
            out = hit[1]
            for f, keys in c.changed.items():
                if f.startswith(prefix):
                    for k in keys:
                        v = self.get(k)
                        if isinstance(v, dict):
                            out[k[len(prefix) :]] = v
                        else:
                            out.pop(k[len(prefix) :], None)
        else:
            out = {k[len(prefix) :]: self._cache.get(self.kv[k], safe_decode) for k in self.keys_under(prefix)}
            out = {k: v for k, v in out.items() if isinstance(v, dict)}
        c.memo[("under", prefix)] = (c.passes, out)
        return dict(out)

    def keys_under(self, prefix: str) -> list[str]:
        """Keys under `prefix`, from the index by parent folder that each pass updates with its
        changed keys (a scan of every key per call, then an index built per pass, were a pass's
        largest costs at 10,000 ranks)."""
        folders = self._cache.folders
        if prefix.endswith("/"):
            deeper = [p for p in folders if p != prefix and p.startswith(prefix)]
            return [*folders.get(prefix, ()), *(k for p in deeper for k in folders[p])]
        return [k for k in self.kv if k.startswith(prefix)]

    def folders_under(self, prefix: str) -> list[str]:
        """The folders (key prefixes ending in '/') under the folder `prefix` that hold keys, itself included."""
        return [p for p in self._cache.folders if p.startswith(prefix)]

    def keys_in(self, folder: str) -> list[str]:
        """The keys directly in `folder` (not in a folder below it)."""
        return list(self._cache.folders.get(folder, ()))

    def flagged_progress(self) -> dict[int, dict]:
        """The progress records, by rank, that carry something the checks act on (a failed or
        long-waited collective, unreachable peers, a busy pause): the few the hang and link
        checks need to read, kept up to date from the changed records alone."""
        c = self._cache
        pp = self.keys.progress_prefix
        hit = c.memo.get("flagged")
        if hit is not None and c.follows(hit[0]):
            out = hit[1]
            keys: Iterable[str] = c.changed.get(pp, ())
        else:
            out, keys = {}, c.folders.get(pp, {})
        for k in keys:
            rest = k[len(pp) :]
            if not rest.isdigit():
                continue
            p = self.get(k)
            if isinstance(p, dict) and ("failed_step" in p or "waiting_step" in p or p.get("unreachable")
                                        or p.get("busy")):  # fmt: skip
                out[int(rest)] = p
            else:
                out.pop(int(rest), None)
        c.memo["flagged"] = (c.passes, out)
        return dict(out)

    def _affected(self, members: Mapping[int, Member], folders: tuple[str, ...], made: int) -> set[int] | None:
        """The ranks of `members` whose answer may differ from pass `made`'s, the last one: those
        a changed key under `folders` names (members/<rank>; suspects/ and fenced/<incarnation>;
        spares/<spare id>). None: not known (a full read, or `made` was not the last pass)."""
        c, k = self._cache, self.keys
        if not c.follows(made):
            return None
        changed = [key for f, keys in c.changed.items() if f.startswith(folders) for key in keys]
        if not changed:
            return set()
        by = self._by(members)
        out: set[int] = set()
        for key in changed:
            if key.startswith(k.members_prefix):
                rest = key[len(k.members_prefix) :]
                if rest.isdigit() and int(rest) in members:
                    out.add(int(rest))
            elif key.startswith((k.suspects_prefix, k.fenced_prefix)):
                out.update(by[0].get(key[key.index("/", len(k.prefix)) + 1 :], ()))
            elif key.startswith(k.spares_prefix):
                out.update(by[1].get(key[len(k.spares_prefix) :], ()))
        return {r for r in out if r in members}

    def _by(self, members: Mapping[int, Member]) -> tuple[dict[str, set[int]], dict[str, set[int]]]:
        """Incarnation and spare id -> ranks, for `_affected`: made once, then carried from table
        to table by adding the ranks whose member is a new object (`changed_members`); entries
        of members gone stay (a superset: `_affected` keeps only ranks of the table), until
        they outnumber the table, when it is made anew."""
        hit = self._cache.memo.get("by")
        if hit is not None and hit[0] is members:
            return hit[1], hit[2]
        diff = None if hit is None or hit[3] > 2 * len(members) + 1000 else changed_members(hit[0], members)
        incs: dict[str, set[int]] = {} if diff is None else hit[1]  # type: ignore[index]
        sids: dict[str, set[int]] = {} if diff is None else hit[2]  # type: ignore[index]
        size = 0 if diff is None else hit[3]  # type: ignore[index]
        for r in members if diff is None else diff:
            mem = members[r]
            incs.setdefault(mem.incarnation, set()).add(r)
            size += 1
            if mem.spare_id:
                sids.setdefault(mem.spare_id, set()).add(r)
        self._cache.memo["by"] = (members, incs, sids, size)
        return incs, sids

    def dead(self, members: Mapping[int, Member], grace: bool = False) -> list[int]:
        """The ranks of `members` that alive() calls dead, without its key building and
        lookups for the many that registered as themselves (a pass's largest cost at
        10,000 ranks); any other goes through alive() itself. Kept from pass to pass: while
        neither the table nor a registration, suspect, fence or spare key changed, as it was;
        else, after the last pass, only the ranks the changed keys name are looked at again."""
        k = self.keys
        watched = (k.members_prefix, k.suspects_prefix, k.fenced_prefix, k.spares_prefix)
        hit = self._cache.memo.get("dead")
        out: set[int] | None = None
        if hit is not None and hit[3] is grace:
            again: set[int] | None = set()
            if self._cache.changed_since(watched, hit[0]):
                again = self._affected(members, watched, hit[0])
            if again is not None:
                out = hit[1]
                if hit[2] is not members:  # a new table: its ranks with a new member object too
                    again |= changed_members(hit[2], members)
                    out = {r for r in out if r in members}
                for r in again:
                    if self._dead_one(r, members[r], grace):
                        out.add(r)
                    else:
                        out.discard(r)
        if out is None:
            out = set(self._dead(members, grace))
        self._cache.memo["dead"] = (self.pass_no, out, members, grace)
        return [r for r in members if r in out] if out else []

    def _dead_one(self, r: int, mem: Member, grace: bool) -> bool:
        inc = mem.incarnation
        if self.get(self.keys.suspect(inc)) is not None or self.keys.fenced(inc) in self.kv:
            return True
        reg = self.get(self.keys.member(r))
        if reg is not None and reg.get("incarnation") == inc:
            return False
        return not self.alive(r, mem, grace)

    def _dead(self, members: Mapping[int, Member], grace: bool) -> list[int]:
        sp, fp = self.keys.suspects_prefix, self.keys.fenced_prefix
        suspects = {k[len(sp) :] for k in self.keys_under(sp) if self.get(k) is not None}
        fenced = {k[len(fp) :] for k in self.keys_under(fp)}
        out = []
        for r, mem in members.items():
            inc = mem.incarnation
            if inc in suspects or inc in fenced:
                out.append(r)
                continue
            kv = self.kv.get(self.keys.member(r))
            reg = self._cache.get(kv, safe_decode) if kv is not None else None
            if reg is not None and reg.get("incarnation") == inc:
                continue
            if not self.alive(r, mem, grace):
                out.append(r)
        return out

    def registered(self, members: Mapping[int, Member]) -> dict[int, Member]:
        """`members` with the address, host and pid each live holder registered under its
        rank. A claimed spare's are known only once it registers (after its pull, or at
        a migration's switch): a table that carries on without them leaves a later
        recovery with no address to pull from. Kept from pass to pass like `dead`."""
        watched = (self.keys.members_prefix,)
        hit = self._cache.memo.get("registered")
        again: Iterable[int] = members
        out: dict[int, Member] = {}
        if hit is not None and hit[2] is members:
            if not self._cache.changed_since(watched, hit[0]):
                again, out = (), hit[1]
            elif (affected := self._affected(members, watched, hit[0])) is not None:
                again, out = affected, hit[1]
        for r in again:
            mem = members[r]
            reg = self.get(self.keys.member(r)) or {}
            if reg.get("incarnation") == mem.incarnation and isinstance(reg.get("addr"), str):
                got = (reg["addr"], reg.get("host", mem.host), reg.get("pid", mem.pid), node_of(reg))
                if got != (mem.addr, mem.host, mem.pid, mem.node):  # the same object where nothing changed:
                    mem = replace(mem, addr=got[0], host=got[1], pid=got[2], node=got[3])  # 10,000 copies a pass
            out[r] = mem
        self._cache.memo["registered"] = (self.pass_no, out, members)
        return dict(out)

    def count_matching(self, folder: str, members: Mapping[int, Member]) -> int:
        """How many ranks of `members` have a record `folder`<rank> that names their incarnation
        (a report, a ready record): what a recovery waits for, counted once and then updated
        from the changed records alone while passes come one after another."""
        c = self._cache
        hit = c.memo.get(("matching", folder))
        # counted anew: the ranks with a record (a recovery's first pass has few), not every member
        present = (key[len(folder) :] for key in self.keys_under(folder))
        again: Iterable[int] = [int(x) for x in present if x.isdigit() and int(x) in members]
        out: set[int] = set()
        if hit is not None and hit[2] is members:
            if not c.changed_since((folder,), hit[0]):
                again, out = (), hit[1]
            elif c.follows(hit[0]):
                rests = (key[len(folder) :] for key in c.changed.get(folder, ()))
                again, out = [int(x) for x in rests if x.isdigit() and int(x) in members], hit[1]
        for r in again:
            v = self.get(folder + str(r))
            if isinstance(v, dict) and v.get("incarnation") == members[r].incarnation:
                out.add(r)
            else:
                out.discard(r)
        c.memo[("matching", folder)] = (c.passes, out, members)
        return len(out)

    def alive(self, rank: int, member: Member, grace: bool = False) -> bool:
        """grace: a missing registration is not a death (the coordinator itself just
        lost etcd, so leases may have expired under live members; they re-register)."""
        if self.get(self.keys.suspect(member.incarnation)) is not None:
            return False
        if self.kv.get(self.keys.fenced(member.incarnation)) is not None:
            return False
        reg = self.get(self.keys.member(rank))
        if reg and reg.get("incarnation") == member.incarnation:
            return True
        if grace and not reg:
            return True
        if member.role == Role.SPARE and member.spare_id:  # claimed, not yet registered as member
            sp = self.get(self.keys.spare(member.spare_id))
            return bool(sp and sp.get("incarnation") == member.incarnation)
        return False
