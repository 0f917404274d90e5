"""The job's events as JSON lines (`livemig run --events FILE`), for a log pipeline.

Each is one event of the coordinator's timeline (coordinator/timeline.py: every
phase of a recovery or a planned migration, fence, claim, a job state change),
or a spare's registration seen in the job's keys, with the member it concerns
resolved from the membership table: a pipeline ingests them without parsing
prose. The same record goes to the agent's log at INFO (logger `livemig.events`).
The fields are documented in docs/operations.md, "Events".
"""

from __future__ import annotations

import json
import logging
import time
from typing import IO, Any

from livemig.coordinator.timeline import events_of
from livemig.rdzv.client import KV, conform
from livemig.rdzv.keys import JobKeys
from livemig.rdzv.membership import Membership

log = logging.getLogger("livemig.events")

SCHEMA = 1  # the version of the record's fields
# events about the member a new generation replaces: its host and incarnation are the old table's
LOST_PHASES = ("detect", "fence")


HOLD_S = 1.0  # an event is written once this much older than now: stamps of other processes arrive late


class EventLog:
    """Writes each event once, in time order, as the agent's watch brings it. Events carry the
    stamps of the processes they come from (a spare's warm_at, a suspect's detection) and can
    reach this agent after a later one: each waits HOLD_S before it is written, in order with
    whatever arrived meanwhile; the job's end writes the rest."""

    def __init__(self, path: str | None, job: str, keys: JobKeys) -> None:
        self.job, self.keys = job, keys
        self._out: IO[str] | None = open(path, "a", encoding="utf-8") if path else None  # noqa: SIM115 - the run's
        self._seen: set[tuple] = set()
        self._spares: set[str] = set()
        self._tables: dict[int, Membership] = {}  # generation -> the last table of it seen
        self._ended = False
        self._mark = -1  # the newest mod revision of the keys events come from, at the last emit
        self._held: list[dict[str, Any]] = []  # read, not yet written (HOLD_S)

    def emit(self, by_key: dict[str, KV]) -> int:
        """Write the events not written yet; returns how many. Nothing is decoded when none of
        the keys events come from changed since the last call (the agent calls it every tick)."""
        k = self.keys
        mark = max((kv.mod_revision for key, kv in by_key.items() if key.startswith(k.timeline_prefix)
                    or key.startswith(k.spares_prefix) or key in (k.result, k.timeline_archive, k.membership)),
                   default=0)  # fmt: skip
        if mark == self._mark:
            return self._write()
        self._mark = mark
        m = Membership.from_kvs(by_key, self.keys)
        self._tables[m.generation] = m
        new = []
        for ev in events_of(by_key, self.keys):
            ident = (ev.get("generation"), ev["phase"], ev["time"])
            if ident not in self._seen:
                self._seen.add(ident)
                new.append(self.record(ev, m))
        for k, kv in by_key.items():
            if k.startswith(self.keys.spares_prefix) and k not in self._spares:
                rec = conform(kv.value, {"state": (str,)}, {"host": (str,), "incarnation": (str,), "warm_at": (float,)})
                if rec is not None and rec["state"] == "warm":
                    self._spares.add(k)
                    new.append({"schema": SCHEMA, "job": self.job, "event": "spare_registered",
                                "time": rec.get("warm_at", time.time()), "generation": m.generation, "rank": None,
                                "host": rec.get("host"), "incarnation": rec.get("incarnation"),
                                "spare_id": k[len(self.keys.spares_prefix) :]})  # fmt: skip
        res = by_key.get(self.keys.result)
        if res is not None and not self._ended:
            r = conform(res.value, {"state": (str,)}, {"reason": (str,), "time": (int, float)})
            if r is not None:
                self._ended = True
                new.append({"schema": SCHEMA, "job": self.job, "event": "job_state", "state": r["state"],
                            "reason": r.get("reason", ""), "time": r.get("time", time.time()),
                            "generation": m.generation, "rank": None, "host": None, "incarnation": None})  # fmt: skip
        self._held += new
        return self._write(everything=self._ended)

    def _write(self, everything: bool = False) -> int:
        """The held events older than HOLD_S (all of them at the job's end), in time order."""
        if not self._held:
            return 0
        cut = float("inf") if everything else time.time() - HOLD_S
        self._held.sort(key=lambda r: r["time"])
        out = [r for r in self._held if r["time"] <= cut]
        self._held = self._held[len(out) :]
        for rec in out:
            line = json.dumps(rec, sort_keys=True, separators=(",", ":"))
            if self._out is not None:
                self._out.write(line + "\n")
            log.info("event", extra={"event": line})
        if out and self._out is not None:
            self._out.flush()
        return len(out)

    def record(self, ev: dict[str, Any], m: Membership) -> dict[str, Any]:
        """A timeline event with the member it concerns: the rank it names (or the first of
        `ranks`), and that rank's host and incarnation: for a failure's detect and fence
        (the generation that replaces it), the member of the table before; else the
        event's own generation's member."""
        rank = ev.get("rank")
        if rank is None and isinstance(ev.get("ranks"), list) and ev["ranks"]:
            rank = ev["ranks"][0]
        g = ev.get("generation")
        table = m
        if isinstance(g, int):
            if ev["phase"] in LOST_PHASES:
                older = [x for x in self._tables if x < g]
                table = self._tables[max(older)] if older else m
            else:
                table = self._tables.get(g, m)
        mem = table.members.get(rank) if isinstance(rank, int) else None
        details = {k: v for k, v in ev.items() if k not in ("phase", "time", "generation", "rank")}
        return {"schema": SCHEMA, "job": self.job, "event": ev["phase"], "time": ev["time"],
                "generation": ev.get("generation"), "rank": rank, "host": mem.host if mem else None,
                "incarnation": mem.incarnation if mem else None, **details}  # fmt: skip

    def close(self) -> None:
        self._write(everything=True)
        if self._out is not None:
            self._out.close()
            self._out = None
