"""The recovery timeline: one event per phase, written once, read by tests,
logs and `livemig bench` alike."""

from __future__ import annotations

import logging
import time
from typing import Any

from livemig.rdzv.client import EtcdClient, conform
from livemig.rdzv.keys import JobKeys
from livemig.rdzv.writes import Put, Writes

log = logging.getLogger("livemig.timeline")

# Phases of a recovery, in order (names as in the design brief).
PHASES = ("detect", "fence", "agree", "claim", "stream", "build", "commit", "resume")


class Timeline:
    """The leader's timeline writer: each event a `Put`, written in the transaction of the
    state change it records (rdzv/writes.py), or on its own by `record`."""

    def __init__(self, keys: JobKeys, writes: Writes) -> None:
        self.keys = keys
        self.writes = writes
        self._seq = int(time.time() * 1000) % 1_000_000

    def op(self, generation: int, phase: str, at: float | None = None, **details: Any) -> Put:
        """The put of one event, to commit in the same transaction as the state change it records."""
        ev = {"phase": phase, "generation": generation, "time": at or time.time(), **details}
        self._seq += 1
        return Put(self.keys.timeline(generation, self._seq, phase), ev)

    def record(self, generation: int, phase: str, at: float | None = None, **details: Any) -> None:
        """One event on its own (guarded by the leadership, as every leader write)."""
        self.writes.record(self.op(generation, phase, at, **details))
        log.info("phase", extra={"phase": phase, "generation": generation})


# Events kept in the archive value: with ~10 events a recovery, the last ~100 recoveries.
ARCHIVE_EVENTS = 1000


# what a reader of an event relies on; other fields are read with .get (conform())
EVENT_NEED = {"phase": (str,), "time": (int, float)}
EVENT_MAY = {"generation": (int,), "ranks": (list,), "bytes": (int, float), "seconds": (int, float),
             "rank": (int,), "step": (int,), "reason": (str,)}  # fmt: skip


def read_events(client: EtcdClient, keys: JobKeys) -> list[dict[str, Any]]:
    kvs, _ = client.get_prefix(keys.timeline_prefix)
    return _decoded(client.get(keys.timeline_archive), [kv.value for kv in kvs])


def events_of(by_key: dict[str, Any], keys: JobKeys) -> list[dict[str, Any]]:
    """read_events over a snapshot of the job's keys (an agent's watch-fed mirror): no read of etcd."""
    new = [kv.value for k, kv in by_key.items() if k.startswith(keys.timeline_prefix)]
    return _decoded(by_key.get(keys.timeline_archive), new)


def _decoded(archive: Any, values: list) -> list[dict[str, Any]]:
    """The archived events and the live ones, each as a reader relies on it, in time order."""
    old = (conform(archive.value, {"events": (list,)}) or {}).get("events", []) if archive else []
    events = [conform(e, EVENT_NEED, EVENT_MAY) for e in [*old, *values]]
    return sorted([e for e in events if e is not None], key=lambda e: e["time"])


def fold(archive: dict[str, Any] | None, events: list[dict[str, Any]]) -> dict[str, Any]:
    """The archive with `events` added, the oldest dropped past ARCHIVE_EVENTS (counted)."""
    old = list((archive or {}).get("events", []))
    merged = sorted([*old, *events], key=lambda e: e.get("time", 0.0))
    dropped = int((archive or {}).get("dropped", 0)) + max(0, len(merged) - ARCHIVE_EVENTS)
    return {"events": merged[-ARCHIVE_EVENTS:], "dropped": dropped}


def _pair(x: Any) -> bool:
    return isinstance(x, list) and len(x) == 2 and all(isinstance(v, (int, float)) for v in x)


def measured(notes: dict[int, list], need: int) -> dict[int, dict[str, Any]]:
    """generation -> {"before": (step, time) | None, "after": (step, time), "step_s": float | None}
    from each rank's notes ([generation, last commit before or None, first commit, median step
    before or None], runtime/progress.py), for each generation every one of `need` ranks noted:
    the first step every rank committed in it and the step before, each at its last rank's
    commit; the slowest rank's median step before. A survivor may finish the step in flight
    inside the new group (its first step there is one earlier than the spare's): that step is
    the one before, not the group's first. Malformed notes (etcd data) are skipped."""
    by_gen: dict[int, dict[int, list]] = {}
    for rank, rows in notes.items():
        for a in rows if isinstance(rows, list) else []:
            if isinstance(a, list) and len(a) in (3, 4) and isinstance(a[0], int) and _pair(a[2]):
                by_gen.setdefault(a[0], {})[rank] = a
    out: dict[int, dict[str, Any]] = {}
    for g, rows_of in by_gen.items():
        if len(rows_of) < need:
            continue  # a rank has not committed in this group yet: no figure yet
        arounds = list(rows_of.values())
        at: dict[int, float] = {}
        for pair in [*(a[2] for a in arounds), *(a[1] for a in arounds if _pair(a[1]))]:
            at[int(pair[0])] = max(at.get(int(pair[0]), 0.0), float(pair[1]))
        first = int(max(a[2][0] for a in arounds))
        befores = [float(a[3]) for a in arounds if len(a) == 4 and isinstance(a[3], (int, float))]
        out[g] = {"before": (first - 1, at[first - 1]) if first - 1 in at else None, "after": (first, at[first]),
                  "step_s": max(befores) if befores else None}  # fmt: skip
    return out


def measurements(events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """generation -> its `measured` figures (as `measured` gives them), from the leader's events."""
    out: dict[int, dict[str, Any]] = {}
    for ev in events:
        after, before, g = ev.get("after"), ev.get("before"), ev.get("generation")
        if ev["phase"] == "measured" and isinstance(g, int) and _pair(after) and (before is None or _pair(before)):
            st = ev.get("step_s")
            out[g] = {"before": tuple(before) if before else None, "after": tuple(after or ()),
                      "step_s": float(st) if isinstance(st, int | float) else None}  # fmt: skip
    return out
