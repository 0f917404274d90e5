"""A coordinator pass reads the whole job prefix as one Snapshot: typed accessors
that never fail on what a member (or anyone with access to etcd) wrote.

A value that does not decode, or that decodes but lacks a field the coordinator
reads (or carries one of the wrong type), is logged once and ignored, like
garbage: a pass must never fail on it again and again (docs/reliability.md).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
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

    def forget_gone(self, live: dict[str, KV]) -> None:
        if len(self.values) > 2 * len(live) + 1000:
            self.values = {k: v for k, v in self.values.items() if k in live}

    def begin(self, kvs: dict[str, KV], changes: set[str] | None) -> None:
        """A new pass over `kvs`; `changes`: the keys that differ from the last pass's (None:
        not known, everything is indexed again)."""
        self.passes += 1
        self.changed = {}
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

    def changed_since(self, prefixes: tuple[str, ...], made: int) -> bool:
        """Whether a key under any of `prefixes` (folders, ending in '/') changed after pass `made`."""
        if self.rebuilt > made:
            return True
        return any(at > made and f.startswith(prefixes) for f, at in self.touched.items())


def node_of(reg: dict) -> int | None:
    """The node rank a registration names (None: a spare of a standby host, or older records)."""
    n = reg.get("node")
    return n if isinstance(n, int) and not isinstance(n, bool) else None


class Snapshot:
    """All keys of the job at one revision, with typed accessors. `changes`: the keys that
    differ from the last Snapshot made with the same `cache` (the coordinator's mirrors collect
    them); None when not known: what the cache derived is then made anew (see Decoded)."""

    def __init__(self, kvs: list[KV] | dict[str, KV], rdzv: Rendezvous, cache: Decoded | None = None,
                 changes: set[str] | None = None) -> None:  # fmt: skip
        self.kv = kvs if isinstance(kvs, dict) else {kv.key: kv for kv in kvs}
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

    def _memo(self, what: Any, prefixes: tuple[str, ...], *same: Any) -> Any:
        """A memo made in an earlier pass with the same `same` (compared by identity), valid
        while no key under `prefixes` changed since; None if there is none."""
        hit = self._cache.memo.get(what)
        if hit is None or len(hit) != len(same) + 2 or any(a is not b for a, b in zip(hit[2:], same, strict=True)):
            return None
        return hit[1] if self.unchanged_since(prefixes, hit[0]) else None

    def _rows_stored(self) -> None:
        """Tell the table's assembler which rows changed in this pass (every row after a
        full read)."""
        c, rp = self._cache, self.keys.roster_prefix
        keys: Iterable[str] = c.changed.get(rp, ())
        if c.rebuilt == c.passes:
            c.rows.reset()
            keys = c.folders.get(rp, {})
        for k in keys:
            r = row_rank(self.keys, k)
            if r is not None:
                kv = self.kv.get(k)
                c.rows.stored(r, kv.value if kv is not None else None)

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
        if hit is not None and hit[0] >= c.rebuilt and not c.changed_since((prefix,), hit[0]):
            out = hit[1]
        elif hit is not None and hit[0] == c.passes - 1 and c.rebuilt < c.passes:
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

    def flagged_progress(self) -> dict[int, dict]:
        """The progress records, by rank, that carry something the checks act on (a failed or
        long-waited collective, unreachable peers, a busy pause): the few the hang and link
        checks need to read, kept up to date from the changed records alone."""
        c = self._cache
        pp = self.keys.progress_prefix
        hit = c.memo.get("flagged")
        if hit is not None and hit[0] == c.passes - 1 and c.rebuilt < c.passes:
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

    def dead(self, members: Mapping[int, Member], grace: bool = False) -> list[int]:
        """The ranks of `members` that alive() calls dead, without its key building and
        lookups for the many that registered as themselves (a pass's largest cost at
        10,000 ranks); any other goes through alive() itself. Kept from pass to pass while
        neither the table nor a registration, suspect, fence or spare key changed."""
        k = self.keys
        watched = (k.members_prefix, k.suspects_prefix, k.fenced_prefix, k.spares_prefix)
        hit = self._memo("dead", watched, members, grace)
        if hit is not None:
            return list(hit)
        out = self._dead(members, grace)
        self._cache.memo["dead"] = (self.pass_no, out, members, grace)
        return list(out)

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
        hit = self._memo("registered", (self.keys.members_prefix,), members)
        if hit is not None:
            return dict(hit)
        out = {}
        for r, mem in members.items():
            reg = self.get(self.keys.member(r)) or {}
            if reg.get("incarnation") == mem.incarnation and isinstance(reg.get("addr"), str):
                got = (reg["addr"], reg.get("host", mem.host), reg.get("pid", mem.pid), node_of(reg))
                if got != (mem.addr, mem.host, mem.pid, mem.node):  # the same object where nothing changed:
                    mem = replace(mem, addr=got[0], host=got[1], pid=got[2], node=got[3])  # 10,000 copies a pass
            out[r] = mem
        self._cache.memo["registered"] = (self.pass_no, out, members)
        return dict(out)

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
