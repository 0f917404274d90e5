"""Leading: the election, the pass loop and a new leader's take-over.

A coordinator process campaigns for the job's leader key (rdzv/election.py); once it leads,
it reads the job's keys into a snapshot, pass after pass (woken by a watch, at least every
0.2 s), and hands each to its `Driver` (coordinator/coordinator.py), which decides and writes
one move of the generation's state machine. A leader that loses its lease (a stall longer
than the TTL), whose key was taken, or that meets an etcd outage while taking the lead steps
down and campaigns again: it may lead again, continuing from the state in etcd.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import Protocol

from livemig.coordinator.snapshot import Decoded, Joined, Snapshot
from livemig.errors import CorruptStateError, EtcdUnavailableError, NotLeaderError
from livemig.rdzv.client import EtcdClient, encode
from livemig.rdzv.election import LeaderElection
from livemig.rdzv.keys import JobKeys
from livemig.rdzv.membership import GenState, Rendezvous
from livemig.rdzv.watch import PrefixMirror
from livemig.rdzv.writes import put_if_absent

log = logging.getLogger("livemig.coordinator")
FULL_READ_S = 5.0  # a pass reads etcd itself at least this often, whatever the mirror says
FULL_READ_SHARE = 0.05  # ... or less often: the safety net's reads take at most this share of the time
PASS_REST_MAX_S = 0.1  # the most a pass rests after itself (as long as it took), for the watch to keep up
FLOOD_EVENTS = 16  # control-key events during one pass that make it a flood: only then does the next wait
MIRROR_WAIT_S = 0.5  # how long a pass waits for the mirror to hold the coordinator's own writes


class Driver(Protocol):
    """What the leader drives (coordinator.Coordinator): one move per pass."""

    def takeover(self) -> None: ...  # a new leader's first look: in-flight builds and migrations
    def standby(self) -> None: ...  # a candidate that does not lead: be ready to take over

    def run_pass(self, s: Snapshot) -> None: ...  # one pass over a snapshot of the job's keys

    def stepped_down(self) -> None: ...  # forget what the passes remembered of this leadership


class Leader:
    """One coordinator process's leadership of a job (see the module doc)."""

    def __init__(self, client: EtcdClient, rdzv: Rendezvous, election: LeaderElection, driver: Driver) -> None:
        self.client = client
        self.rdzv = rdzv
        self.keys: JobKeys = rdzv.keys
        self.election = election
        self.driver = driver
        self.id = election.candidate
        self.wake = threading.Event()
        self.events = 0  # control-key events the watch delivered (counted by its thread)
        self.stop = threading.Event()
        # passes read a watch-fed mirror of the job's keys (_read); counted in the log at the end
        self.reads = {"mirror": 0, "full": 0}
        self._decoded = Decoded()  # values decoded in earlier passes, by key and mod revision
        self._unknown_seen = -1
        self._progress: PrefixMirror | None = None  # members' progress records, while leading
        self._floor = 0
        self._full_at = -1e18
        self._full_every = FULL_READ_S  # grows with what a full read costs (100,000 ranks: ~0.5 s)
        self._woken = False  # this pass answers a change (not the 0.2 s timer)
        # the last pass's keys came from the mirrors: this pass's changed keys are what the
        # mirrors collected since (Snapshot keeps what it derived up to date from them alone)
        self._continuous = False

    def lost(self, reason: str) -> None:
        """The election's callback: the lease behind the leader key is gone."""
        log.error("lost leadership; stopping", extra={"reason": reason})
        self.stop.set()
        self.wake.set()

    def run(self) -> str:
        """Lead until the job is done or failed; returns its final state."""
        while True:
            try:
                state = self._lead()
            except (EtcdUnavailableError, InterruptedError) as exc:  # an outage (or a candidate lease lost
                # while campaigning): the election decides who leads after it
                log.warning("etcd unavailable while taking the lead; campaigning again", extra={"err": str(exc)})
                state = "deposed"
                time.sleep(0.2)
            except CorruptStateError as exc:  # the table only leaders write: end the run plainly
                log.error("job failed", extra={"reason": str(exc)})
                res = {"state": str(GenState.FAILED), "reason": str(exc), "generation": -1, "time": time.time()}
                self.client.put(self.keys.result, encode(res))
                self.election.resign()
                return GenState.FAILED
            if state != "deposed":
                return state
            log.warning("stepped down; campaigning again")
            self.stop.clear()
            self.driver.stepped_down()

    def _lead(self) -> str:
        self.election.campaign(stop=self.stop.is_set, waiting=self.driver.standby)
        # The job's secret, made once, and never again once the job has a result: an agent
        # interrupted on an external etcd deletes it as it ends the job, and a coordinator of
        # another node that takes the lead a moment later must not bring it back.
        put_if_absent(self.client, self.keys.secret, secrets.token_bytes(32),
                      unless=[self.keys.result])  # fmt: skip
        self.driver.takeover()
        # Two mirrors: the job's control keys, whose changes wake a pass, and the members'
        # progress records on a connection of their own (its own gRPC stream and thread), so
        # a burst of 10,000 of them never stands between a pass and a report or a registration.
        mirror = PrefixMirror(self.client, self.keys.prefix, self._on_change, range_end=self.keys.control_end,
                              track_changes=True, lend=True)  # fmt: skip
        progress_client = EtcdClient(self.client.endpoints, self.client.timeout, self.client.security)
        try:
            self._progress = PrefixMirror(progress_client, self.keys.progress_prefix, track_changes=True, lend=True)
            self._continuous = False
            while not self.stop.is_set():
                try:
                    kvs, changes = self._read(mirror)
                except EtcdUnavailableError as exc:  # failover in progress; the lease decides leadership
                    log.warning("etcd unavailable; retrying", extra={"err": str(exc)})
                    continue
                started, events = time.monotonic(), self.events
                snap = Snapshot(kvs, self.rdzv, self._decoded, changes)
                if snap.m.state in (GenState.DONE, GenState.FAILED) and snap.get(self.keys.result):
                    return snap.m.state
                lk = snap.kv.get(self.keys.leader)
                if lk is None or lk.value != self.id.encode():
                    # Deleted or taken over (an operator, a restore): every guarded write would
                    # now fail, pass after pass; step down and let the election decide.
                    log.warning("the leader key is no longer ours; stepping down")
                    return "deposed"
                try:
                    self.driver.run_pass(snap)
                except NotLeaderError:
                    return "deposed"
                except Exception:  # noqa: BLE001 - a bad pass (odd input, etcd failover) must not end the job
                    log.exception("coordinator pass failed; retrying")
                    time.sleep(0.1)
                # A flood came in during the pass: rest as long as it took (at most
                # PASS_REST_MAX_S) before the next. In a flood (10,000 reports) passes otherwise
                # ran back to back and the watch thread, which must take the GIL back for every
                # response, fell a second behind etcd. A few changes (a fault landing during a
                # long pass) are met at once: resting for them made a fault at 4,000 ranks wait
                # a whole pass more before its fence.
                if self.wake.is_set() and self.events - events >= FLOOD_EVENTS:
                    self.stop.wait(min(time.monotonic() - started, PASS_REST_MAX_S))
                self._woken = self.wake.wait(0.2)
                self.wake.clear()
            return "deposed"
        finally:
            mirror.cancel()
            if self._progress is not None:
                self._progress.cancel()
            progress_client.close()
            log.info("coordinator passes", extra=dict(self.reads))
            self.election.resign()

    def _on_change(self, events: list) -> None:
        """Wake a pass for a change of the control keys (members' per-step progress is not
        among them: the passes run every 0.2 s anyway, which is all the hang and straggler
        checks need)."""
        self.events += len(events)  # one writer (the watch thread); the pass only reads it
        self.wake.set()

    def _read(self, mirror: PrefixMirror) -> tuple[Joined, set[str] | None]:
        """The job's keys for one pass: the control keys from the watch-fed mirror once it
        holds this coordinator's own writes (their revision, from etcd's answers; its next
        pass must see them), else from etcd itself: after a write whose revision is unknown
        (a failed call), when the mirror does not reach the revision within MIRROR_WAIT_S,
        when it lags the last full read, and about every FULL_READ_S (a safety net, less often
        where a read costs more than FULL_READ_SHARE of that); the
        progress records from their own mirror (the coordinator never writes them). With them,
        the keys changed since the last pass's read: None where that is not known (a full read
        now or then, a read that failed in between)."""
        now = time.monotonic()
        continuous, self._continuous = self._continuous, False  # until this read is done
        kvs, rev, changes = mirror.view_changes()  # the mirror's own dict: read only, this pass
        deadline = now + MIRROR_WAIT_S
        while rev < self.client.write_revision and time.monotonic() < deadline:
            time.sleep(0.002)  # the watch delivers our own write in about a millisecond
            kvs, rev, more = mirror.view_changes()
            changes = None if changes is None or more is None else changes | more
        fresh = rev >= max(self._floor, self.client.write_revision)
        # The safety net's read (~0.25 s at 10,000 ranks) waits for a pass of the timer, not
        # one that answers a change (a fault), unless changes have kept coming for 3 x as long.
        since = now - self._full_at
        due = since >= self._full_every and (not self._woken or since >= 3 * self._full_every)
        if self.client.unknown_writes == self._unknown_seen and fresh and not due:
            self.reads["mirror"] += 1
        else:
            self._unknown_seen = self.client.unknown_writes
            t0 = time.monotonic()
            got, _ = self.client.get_range(self.keys.prefix, self.keys.control_end)
            kvs = {kv.key: kv for kv in got}
            self._floor = max((kv.mod_revision for kv in got), default=0)
            self._full_at = now
            # the next safety-net read no sooner than its cost allows (the pass's rebuild after
            # it is of the same order): 5 s up to ~10,000 ranks, ~10 s per 0.5 s read beyond
            self._full_every = max(FULL_READ_S, (time.monotonic() - t0) / FULL_READ_SHARE)
            self.reads["full"] += 1
            changes = None
        progress: dict = {}
        if self._progress is not None:
            progress, _, more = self._progress.view_changes()
            changes = None if changes is None or more is None else changes | more
        if not continuous:
            changes = None
        self._continuous = True
        return Joined(kvs, progress), changes
