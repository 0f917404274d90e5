"""A coordinator pass reads the whole job prefix as one Snapshot: typed accessors
that never fail on what a member (or anyone with access to etcd) wrote.

A value that does not decode, or that decodes but lacks a field the coordinator
reads (or carries one of the wrong type), is logged once and ignored, like
garbage: a pass must never fail on it again and again (docs/reliability.md).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
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


class Decoded:
    """Decoded values across passes, by key and mod revision: a pass decodes only the
    keys that changed since the last one (at 10,000 ranks a pass otherwise decoded
    every registration and progress record, and the member table, 5 times a second).
    Values are shared between passes: the coordinator never mutates what it reads."""

    def __init__(self) -> None:
        self.values: dict[str, tuple[int, Any]] = {}
        self.table: tuple[int, Membership] | None = None  # (the head's mod revision, the table)
        self.rows: dict = {}  # the member rows, decoded once per change (roster.assemble)

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


def node_of(reg: dict) -> int | None:
    """The node rank a registration names (None: a spare of a standby host, or older records)."""
    n = reg.get("node")
    return n if isinstance(n, int) and not isinstance(n, bool) else None


class Snapshot:
    """All keys of the job at one revision, with typed accessors."""

    def __init__(self, kvs: list[KV] | dict[str, KV], rdzv: Rendezvous, cache: Decoded | None = None) -> None:
        self.kv = kvs if isinstance(kvs, dict) else {kv.key: kv for kv in kvs}
        self.keys = rdzv.keys
        self._cache = cache if cache is not None else Decoded()
        self._cache.forget_gone(self.kv)
        self._under: dict[str, list[str]] | None = None
        self.m = self._table()

    def _table(self) -> Membership:
        """The head and the rows as one table, assembled again only when the head changed
        (every change of visible rows writes the head) and only the changed rows decoded: a
        pass at 10,000 ranks would otherwise decode every row 5 times a second. A table whose
        rows do not yet match the head's digest (a mirror between the events of one write) is
        used, not kept: the next pass assembles it again."""
        head = self.kv.get(self.keys.membership)
        if head is None:
            return Membership.from_bytes(None)
        if self._cache.table is not None and self._cache.table[0] == head.mod_revision:
            return self._cache.table[1]
        rows = [(r, self.kv[k].value) for k in self.keys_under(self.keys.roster_prefix)
                if (r := row_rank(self.keys, k)) is not None]  # fmt: skip
        m = Membership.from_bytes(head.value)
        members, digest = roster.assemble(m.generation, rows, self._cache.rows)
        m.members = roster.Roster(members)
        if m.rows_match(len(members), digest):
            self._cache.table = (head.mod_revision, m)
        return m

    def get(self, key: str) -> Any:
        kv = self.kv.get(key)
        return self._cache.get(kv, safe_decode) if kv else None

    def under(self, prefix: str) -> dict[str, Any]:
        out = {k[len(prefix) :]: self._cache.get(self.kv[k], safe_decode) for k in self.keys_under(prefix)}
        return {k: v for k, v in out.items() if isinstance(v, dict)}

    def keys_under(self, prefix: str) -> list[str]:
        """Keys under `prefix`, from an index by the keys' parent folder built once per
        pass (a scan of every key per call was the pass's cost at 10,000 ranks; so was
        the scan for a folder with no keys, such as errors/ in a healthy job)."""
        if self._under is None:
            self._under = {}
            for k in self.kv:
                self._under.setdefault(k[: k.rfind("/") + 1], []).append(k)
        if prefix.endswith("/"):
            deeper = [p for p in self._under if p != prefix and p.startswith(prefix)]
            return self._under.get(prefix, []) + [k for p in deeper for k in self._under[p]]
        return [k for k in self.kv if k.startswith(prefix)]

    def dead(self, members: Mapping[int, Member], grace: bool = False) -> list[int]:
        """The ranks of `members` that alive() calls dead, without its key building and
        lookups for the many that registered as themselves (a pass's largest cost at
        10,000 ranks); any other goes through alive() itself."""
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
        recovery with no address to pull from."""
        out = {}
        for r, mem in members.items():
            reg = self.get(self.keys.member(r)) or {}
            if reg.get("incarnation") == mem.incarnation and isinstance(reg.get("addr"), str):
                got = (reg["addr"], reg.get("host", mem.host), reg.get("pid", mem.pid), node_of(reg))
                if got != (mem.addr, mem.host, mem.pid, mem.node):  # the same object where nothing changed:
                    mem = replace(mem, addr=got[0], host=got[1], pid=got[2], node=got[3])  # 10,000 copies a pass
            out[r] = mem
        return out

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
