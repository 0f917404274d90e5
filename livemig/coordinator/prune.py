"""A bounded etcd footprint: what a committed generation no longer needs is removed.

Without it a job's prefix grows with every recovery (each generation's reports and
ready records, its timeline keys, the assignment of each claimed spare, suspects of
processes that were never members) while etcd's request limit and memory do not.
The rule, applied by the leader in a COMMITTED generation g (never while a
migration is open, so nothing in flight is touched), in one guarded transaction:

- recovery/<h>/ for h < g: the protocol records of finished generations;
- timeline/<h>/ for h < g: folded into one `timeline-archive` value (bounded by
  coordinator/timeline.ARCHIVE_EVENTS), so reports still show every recovery;
- assignments/<spare> of spares that are registered members of g: read once, at
  the claim, by a spare that has since joined;
- suspects/<incarnation> of processes outside g's table: every suspect of a member
  is consumed by its fence before a generation can be COMMITTED.

fenced/<incarnation> keys stay: they are what refuses a zombie's writes. The agent
that started a process removes its key once it has reaped it (agent/child_watch.py), as only
it knows that the process can no longer write.
"""

from __future__ import annotations

from typing import Any

from livemig.config import Role
from livemig.coordinator.timeline import fold
from livemig.rdzv.client import decode
from livemig.rdzv.keys import JobKeys
from livemig.rdzv.writes import Delete, Op, Put


def _generation(rest: str) -> int | None:
    head = rest.split("/", 1)[0]
    return int(head) if head.isdigit() else None


MAX_OPS = 100  # per transaction (etcd's default limit is 128): a backlog takes several passes


def stale_ops(snap: Any, keys: JobKeys) -> list[Op]:
    """The deletes (and the archive's put) that prune `snap` (a coordinator Snapshot of a COMMITTED
    generation), at most MAX_OPS; empty when there is nothing to remove. The
    timeline keys folded into the archive are deleted in the same transaction."""
    m = snap.m
    g = m.generation
    folded: list[Op] = []  # deletes of the timeline keys whose events go to the archive
    events: list[dict] = []
    other: list[Op] = []
    old_gens: set[int] = set()
    # by folder: a generation's folders name it, so the reports and ready records of the current
    # one (two per rank) are never read; a sort of every key cost a pass ~10 ms at 10,000 ranks
    for folder in snap.folders_under(keys.recoveries_prefix):
        h = _generation(folder[len(keys.recoveries_prefix) :])
        if h is not None and h < g:
            old_gens.add(h)
    for folder in sorted(snap.folders_under(keys.timeline_prefix)):
        h = _generation(folder[len(keys.timeline_prefix) :])
        if h is None or h >= g:
            continue
        for key in sorted(snap.keys_in(folder)):
            if len(folded) >= MAX_OPS // 2:
                break
            try:
                ev = decode(snap.kv[key].value)
            except Exception:  # noqa: BLE001 - garbage: dropped with its key
                ev = None
            if isinstance(ev, dict) and isinstance(ev.get("time"), int | float):
                events.append(ev)
            folded.append(Delete(key))
    suspects = sorted(snap.keys_under(keys.suspects_prefix))
    incarnations = {mem.incarnation for mem in m.members.values()} if suspects else set()
    for key in suspects:
        if key[len(keys.suspects_prefix) :] not in incarnations:
            other.append(Delete(key))
    for h in sorted(old_gens):
        p = keys.recovery_prefix(h)
        other.append(Delete(p, prefix=True))
    for r, mem in m.members.items() if snap.keys_under(keys.assignments_prefix) else ():
        if mem.role != Role.SPARE or not mem.spare_id or keys.assignment(mem.spare_id) not in snap.kv:
            continue
        reg = snap.get(keys.member(r))
        if reg and reg.get("incarnation") == mem.incarnation:
            other.append(Delete(keys.assignment(mem.spare_id)))
    ops: list[Op] = []
    if folded:
        archive = snap.kv.get(keys.timeline_archive)
        try:
            current = decode(archive.value) if archive else None
        except Exception:  # noqa: BLE001 - a garbage archive is replaced
            current = None
        archived = fold(current if isinstance(current, dict) else None, events)
        ops = [Put(keys.timeline_archive, archived), *folded]
    return ops + other[: MAX_OPS - len(ops)]
