"""A coordinator pass reads the whole job prefix as one Snapshot: typed accessors
that never fail on what a member (or anyone with access to etcd) wrote.

A value that does not decode, or that decodes but lacks a field the coordinator
reads (or carries one of the wrong type), is logged once and ignored, like
garbage: a pass must never fail on it again and again (docs/reliability.md).
"""

from __future__ import annotations

import logging
from typing import Any

from livemig.rdzv.client import KV, decode
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
    "progress": {"step": (int,)},
    "final": {"incarnation": (str,)},
    "config": {"signature": (list,)},
    "report": {"incarnation": (str,), "committed": (int, type(None))},
    "ready": {"incarnation": (str,)},
    "catchup": {"incarnation": (str,), "applied": (int,), "loaded": (int,), "time": _NUM},
    "errors": {"incarnation": (str,)},
}
_logged: set[tuple[str, int]] = set()  # (key, length) of ignored values: logged once each


def _num(v: Any, default: float = 0.0) -> float:
    """A number read from a member's record, or `default` for anything else."""
    return float(v) if isinstance(v, _NUM) and not isinstance(v, bool) else default


def _kind(key: str) -> str:
    parts = key.split("/")  # '', 'livemig', job, kind, ...
    if len(parts) < 4:
        return ""
    if parts[3] == "recovery" and len(parts) >= 6:
        return parts[5]
    return parts[3]


def _safe_decode(key: str, raw: bytes) -> Any:
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


class Snapshot:
    """All keys of the job at one revision, with typed accessors."""

    def __init__(self, kvs: list[KV], rdzv: Rendezvous) -> None:
        self.kv = {kv.key: kv for kv in kvs}
        self.keys = rdzv.keys
        raw = self.kv.get(self.keys.membership)
        self.m = Membership.from_bytes(raw.value if raw else None)

    def get(self, key: str) -> Any:
        kv = self.kv.get(key)
        return _safe_decode(key, kv.value) if kv else None

    def under(self, prefix: str) -> dict[str, Any]:
        out = {k[len(prefix) :]: _safe_decode(k, v.value) for k, v in self.kv.items() if k.startswith(prefix)}
        return {k: v for k, v in out.items() if isinstance(v, dict)}

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
        if member.role == "spare" and member.spare_id:  # claimed, not yet registered as member
            sp = self.get(self.keys.spare(member.spare_id))
            return bool(sp and sp.get("incarnation") == member.incarnation)
        return False
