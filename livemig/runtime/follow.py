"""Follow spares: a warm spare that keeps the replicated state of the job, so that taking a
lost rank streams only that rank's own state.

A follower (`livemig run --follow K`, `livemig-spare start --follow`) picks one member of
the job, its feeder, and asks it for a snapshot; from then on the feeder publishes each
step's update (the averaged gradient, or what its optimizer really applied: clipped, a
GradScaler's skip) on its state server, and the follower, in a thread beside its standby,
applies it with the same optimizer: the update a planned migration's spare replays
(runtime/migration.py), so the follower's parameters and optimizer state are the group's,
bit for bit, a few milliseconds after each commit. Claimed for a lost rank while it holds
the group's last commit, it moves that state into the objects the user's function registers
again (parameters swapped in, the optimizer's state taken by reference: no copy) and pulls
only what is not replicated: the boundary's extras and hyperparameters, the lost rank's own
state from its mirror (runtime/strategies/replicated.py, `adopt`).

The feed costs the training step nothing it waits for: the feeder publishes references to
buffers it keeps anyway (the reducer keeps `lag + 2` sets of buckets instead of 2 while it
feeds, the memory cost), its server thread sends them, and the follower pulls at its own
pace. A follower more than `LIVEMIG_FOLLOW_LAG` steps behind finds the update withdrawn:
it drops to plain warm standby, says so, and follows again after `LIVEMIG_FOLLOW_RETRY_S`.
A follower claimed while behind catches up from the stream as any spare does.

Plain data parallel only (Strategy.follows): a follower of a ZeRO-1 or FSDP2 job stays a
plain warm spare and says so once.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from livemig.config import ENV_FOLLOW, ENV_FOLLOW_LAG, ENV_FOLLOW_RETRY, ENV_SPARE_ID, Role
from livemig.errors import ConfigError, TransferError, WithdrawnError
from livemig.rdzv.membership import GenState
from livemig.state import flatten, unflatten
from livemig.transfer import items
from livemig.transfer.puller import pull

if TYPE_CHECKING:
    from livemig.runtime.member import MemberRuntime
    from livemig.runtime.registry import Registry
    from livemig.runtime.strategies.base import Strategy

log = logging.getLogger("livemig.runtime.follow")

FEED_GEN = 0  # feed items belong to no generation: a follower keeps its feeder across recoveries
DEFAULT_LAG = 4
DEFAULT_RETRY_S = 30.0
PULL_TIMEOUT_S = 2.0  # one feed pull's header exchange (a dead feeder is found by the membership)
DRAIN_TIMEOUT_S = 0.25  # the same once claimed: the claim waits for it
POLL_MIN_S, POLL_MAX_S = 0.002, 0.025  # asking for an update not yet published: first and longest wait
LAGS_KEPT = 100_000  # the updates whose lag the final record summarises (the newest)
STATUS_EVERY_S = 1.0  # the follower's status key is written at most this often (and on a change)


def _number(name: str, default: float, kind: type = float) -> Any:
    raw = os.environ.get(name, "")
    try:
        value = kind(raw) if raw else kind(default)
    except ValueError:
        raise ConfigError(f"{name}={raw!r}: expected a number") from None
    if value < 0:
        raise ConfigError(f"{name}={raw!r}: expected a number >= 0")
    return value


def lag_summary(lags: list[float]) -> dict[str, float]:
    """A follower's lag behind its feeder, from each update's publish (just after the group's
    commit) to its apply here, in ms: percentiles over the updates applied (wall clocks of two
    processes: on two hosts their offset is in it)."""
    if not lags:
        return {"n": 0}
    s = sorted(lags)

    def pct(q: float) -> float:
        return round(1000 * s[min(len(s) - 1, int(q * len(s)))], 2)

    return {"n": len(s), "p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99), "max": round(1000 * s[-1], 2)}


def follow_lag() -> int:
    """Steps a follower may fall behind before it drops to warm standby (--follow-lag)."""
    return max(1, _number(ENV_FOLLOW_LAG, DEFAULT_LAG, int))


def feeder_rank(spare_id: str, ranks: list[int]) -> int | None:
    """The rank a follower follows: spread over the ranks by the spare's id (several followers
    load several feeders), counted from the last rank (rank 0 often does more: saving, logging)."""
    if not ranks:
        return None
    ordered = sorted(ranks)
    return ordered[-1 - zlib.crc32(spare_id.encode()) % len(ordered)]


class FeedHost(Protocol):
    runtime: MemberRuntime
    role: Role
    committed: int
    reg: Registry
    reducer: Any
    strategy: Strategy


class Feed:
    """The feeder's side, on every worker: idle until a follower asks this worker for a snapshot."""

    def __init__(self, host: FeedHost) -> None:
        self.h = host
        self.keep = follow_lag() + 1  # updates kept published: a follower further behind drops
        self.first: int | None = None  # the first step fed (the snapshot's boundary is first - 1)
        self.newest: int | None = None
        self._snap_step: int | None = None

    def tick(self) -> None:
        """At a step boundary: serve a snapshot a follower asked for, answer as withdrawn the
        updates a follower asks for that are no longer kept."""
        h = self.h
        rt = h.runtime
        if h.role != Role.WORKER or rt is None or rt.server is None or not h.strategy.follows:
            return
        srv = rt.server
        if self.newest is not None:
            for w in list(srv.wanted):
                k = items.step_of_feed(w)
                if k is not None and k <= self.newest - self.keep:
                    srv.refuse(w)
        if items.FEED_SNAPSHOT not in srv.wanted:
            return
        srv.wanted.discard(items.FEED_SNAPSHOT)
        tensors: list[torch.Tensor] = []
        skel = flatten(h.reg.state_obj(), tensors)
        snap = unflatten(skel, [x.clone() for x in tensors])  # training goes on: serve a copy
        step = h.committed + 1
        srv.publish(FEED_GEN, items.FEED_SNAPSHOT, lambda: (step, snap))
        self._snap_step = step
        if self.first is None:
            self.first = step
        if h.reducer is not None:
            h.reducer.keep_at_least(self.keep + 1)  # fed averages are the buckets themselves
        log.info("feed: snapshot served to a follower", extra={"step": step})

    def serving(self, t: int) -> bool:
        """Does this worker feed step t's update to followers?"""
        return self.first is not None and t >= self.first

    def serve(self, t: int, item: dict[str, Any]) -> None:
        """Publish step t's update as a migrating spare replays it (Handover.replay_update)."""
        h = self.h
        srv = h.runtime.serving
        if h.reducer is not None:
            h.reducer.keep_at_least(self.keep + 1)  # a migration resolved meanwhile set it back to 2
        # hparams now: user code sets the next step's lr; the time: the follower's lag (record)
        fed = {**item, "hparams": h.reg.hparams(), "final": False, "published_at": time.time()}
        srv.publish(FEED_GEN, items.feed_step(t), lambda: (t, fed))
        log.debug("feed: published", extra={"step": t})
        srv.withdraw(items.feed_step(t - self.keep))
        srv.wanted.discard(items.feed_step(t))
        self.newest = t
        if self._snap_step is not None and t >= self._snap_step + self.keep:
            srv.withdraw(items.FEED_SNAPSHOT, gone=False)  # loaded by now, or asked for again
            self._snap_step = None


class FollowerHost(Protocol):
    runtime: MemberRuntime
    role: Role
    committed: int
    reg: Registry
    strategy: Strategy
    boundary: Any
    st: Any


class Follower:
    """The spare's side: a thread that keeps the first entry's registered objects at the
    group's last commit while the spare waits for a claim (see the module doc). Survives the
    function's re-entry (api.Engine keeps it apart from the user's state) so that the claimed
    spare can take what it holds."""

    def __init__(self, host: FollowerHost) -> None:
        self.h = host
        self.enabled = os.environ.get(ENV_FOLLOW, "") in ("1", "true", "yes")
        self.lag = follow_lag()
        self.retry_s = _number(ENV_FOLLOW_RETRY, DEFAULT_RETRY_S)
        self.spare_id = os.environ.get(ENV_SPARE_ID, "")
        self.state = "off"  # off, attaching, following, warm (dropped), unsupported
        self.step = -1  # the last step applied here
        self.reason = ""
        self.drops = 0
        self.applied = 0
        self.lags: collections.deque[float] = collections.deque(maxlen=LAGS_KEPT)  # publish -> applied, s
        self.held: Registry | None = None  # the first entry's objects, kept through the claim
        self.before: list[torch.Tensor] | None = None  # the parameters before step `step` (the replay's)
        self._feeder: tuple[str, str] | None = None  # (incarnation, address)
        self._secret: bytes | None = None
        self._poll = POLL_MIN_S
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._said = 0.0
        self._retry_at = 0.0
        self.took_over = False  # this spare took a rank with what it followed (no stream)

    # -- the standby's side -----------------------------------------------------------------
    def start(self) -> None:
        """Follow from now until `halt` (a claim, or the job's end)."""
        h = self.h
        if not self.enabled or h.runtime is None or h.role != Role.SPARE:
            return
        if not h.strategy.follows:
            self._set("unsupported", f"a {h.strategy.name} job: follow mode covers plain data parallel; warm standby")
            log.warning("follow: this job's parallelism is not followed; the spare stays warm",
                        extra={"strategy": h.strategy.name})  # fmt: skip
            return
        self.held, self.step, self.before = None, -1, None
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="livemig-follow", daemon=True)
        self._thread.start()

    def halt(self, hold: bool) -> None:
        """Stop following (claimed: `hold` keeps what was applied for the take-over)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=60)
            self._thread = None
        if hold and self.state == "following":
            self.held = self.h.reg
        else:
            self.release()
        if self.enabled and self.state not in ("off", "unsupported"):
            self._set("claimed" if hold else "stopped", "")  # no longer a follower (the fault plan reads it)

    def holds(self, step: int) -> bool:
        """Does this follower hold the group's state after `step` (a take-over needs no stream)?"""
        if self.h.boundary.replays and self.before is None:  # the replay's parameters: no step applied yet
            return False
        return self.held is not None and self.step == step

    def release(self, needed: int | None = None) -> None:
        """Drop what was followed (`needed`: the step a take-over needed, for the log line)."""
        if needed is not None and self.enabled and self.h.strategy.follows:
            log.warning("follow: claimed while not current; the state streams as to a warm spare",
                        extra={"held": self.held is not None, "step": self.step, "needed": needed,
                               "state": self.state, "reason": self.reason})  # fmt: skip
        self.held, self.before = None, None

    def move_into(self, reg: Registry) -> None:
        """The held parameters and optimizer state become those of the objects registered by
        the function entered again: tensors swapped in, nothing copied."""
        old = self.held
        assert old is not None and old.model is not None and reg.model is not None
        new_sd, old_sd = reg.model.state_dict(keep_vars=True), old.model.state_dict(keep_vars=True)
        with torch.no_grad():
            for k, v in new_sd.items():
                v.data = old_sd[k].data
        if reg.optimizer is not None and old.optimizer is not None:
            reg.optimizer.load_state_dict(old.optimizer.state_dict())  # the same tensors, by reference
        self.held = None
        self.took_over = True

    def catch_up_to(self, step: int, deadline: float, abort: Callable[[], bool]) -> bool:
        """After move_into, on the claimed entry's objects: apply the feed's updates up to `step`
        (a planned migration's start, runtime/migration.py follow_in). False where the feed
        withdrew one, `abort` says so (the migration was resolved otherwise: a failure), or the
        deadline passed (a feeder that died and is not replaced)."""
        drops = self.drops
        try:
            while self.step < step:
                if self._next(drain=True):
                    continue
                if self.drops > drops or abort() or time.monotonic() > deadline:
                    return False
                time.sleep(0.005)  # not published yet: the feeder commits it shortly
            return True
        finally:
            self._set("claimed", "")

    # -- the thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self.state == "warm" and time.monotonic() < self._retry_at:
                    self._stop.wait(0.2)
                    continue
                feeder = self._pick()
                if feeder is None:
                    self._set("attaching", "no member to follow yet")
                    self._stop.wait(0.05)
                    continue
                if self.state != "following" or self._feeder != feeder:
                    self._feeder = feeder
                    self._attach()
                else:
                    self._next()
            # claimed: the updates the feeder published meanwhile (the group's last commit was
            # likely made while the claim travelled), each asked once
            while self.state == "following" and self._feeder_alive() and self._next(drain=True):
                pass
        except Exception as exc:  # noqa: BLE001 - a follower's failure is not the job's: warm standby
            log.exception("follow: stopped; the spare stays warm")
            self._set("warm", f"follow failed: {exc}")
            self.held = None

    def _pick(self) -> tuple[str, str] | None:
        """The member this follower follows: one of the committed generation's, spread over the
        members by the spare's id, kept while it stays a member."""
        rt = self.h.runtime
        m = rt.m
        if m.state != GenState.COMMITTED or not m.members:
            return self._feeder if self._feeder and self.state == "following" else None
        live = {mem.incarnation: mem.addr for mem in m.members.values() if mem.addr}
        if self._feeder is not None and self._feeder[0] in live:
            return self._feeder
        r = feeder_rank(self.spare_id, [r for r, mem in m.members.items() if mem.addr])
        if r is None:
            return None
        return m.members[r].incarnation, m.members[r].addr

    def _feeder_alive(self) -> bool:
        """Is the feeder a member of the generation being formed (not the rank this spare replaces)?"""
        m = self.h.runtime.m
        return self._feeder is not None and any(mem.incarnation == self._feeder[0] for mem in m.members.values())

    def _pull(self, item: str, alloc: Any = None, drain: bool = False) -> Any:
        rt = self.h.runtime
        assert self._feeder is not None
        if self._secret is None:
            self._secret = rt.secret()
        wait = DRAIN_TIMEOUT_S if drain else PULL_TIMEOUT_S
        return pull(self._feeder[1], rt.job, self._secret, FEED_GEN, item, wait, alloc,
                    abort=None if drain else self._stop.is_set)  # fmt: skip

    def _attach(self) -> None:
        h = self.h
        self._set("attaching", f"asking {self._feeder[1] if self._feeder else '?'} for a snapshot")
        while not self._stop.is_set():
            try:
                got = self._pull(items.FEED_SNAPSHOT, h.strategy.handover.snapshot_alloc())
                break
            except TransferError:
                if self._pick() != self._feeder:
                    return  # the feeder left: pick another
                self._stop.wait(0.01)  # asked for: served at the feeder's next boundary
        else:
            return
        h.strategy.handover.load_snapshot(got.state)
        self.step = h.committed = got.step - 1
        self.before = None
        self._set("following", "")
        log.info("follow: following", extra={"feeder": self._feeder[1] if self._feeder else "",
                                             "step": self.step, "bytes": got.nbytes})  # fmt: skip

    def _next(self, drain: bool = False) -> bool:
        """Apply the next step's update if it is published (True)."""
        h = self.h
        t = self.step + 1
        try:
            got = self._pull(items.feed_step(t), drain=drain)
        except WithdrawnError:
            self._drop(f"more than {self.lag} steps behind the job at step {t}")
            return False
        except TransferError as exc:
            log.debug("follow: update not served yet", extra={"step": t, "why": str(exc)})
            if drain:
                return False
            if self._pick() != self._feeder:
                self._feeder = None
                self._set("attaching", "the feeder left the job")
                return False
            self._set(self.state, self.reason)  # the status stays fresh while the group waits (about once a second)
            # not published yet (the group has not committed it): ask again soon, backing off to
            # POLL_MAX_S, since each ask is a request the feeder's server answers beside training
            self._stop.wait(self._poll)
            self._poll = min(POLL_MAX_S, self._poll * 2)
            return False
        if h.boundary.replays:  # a take-over replays step `step`: from the parameters before it
            with torch.no_grad():
                if self.before is None:
                    self.before = [p.detach().clone() for p in h.reg.params]
                else:
                    for b, p in zip(self.before, h.reg.params, strict=True):
                        b.copy_(p)
        h.reg.set_hparams(got.state["hparams"])
        h.strategy.handover.replay_update(t, got.state)
        self.step = t
        self.applied += 1
        if not drain:  # a drain after a claim measures the claim, not the follower
            self.lags.append(time.time() - float(got.state.get("published_at", time.time())))
        self._poll = POLL_MIN_S
        self._set("following", "")
        log.debug("follow: applied", extra={"step": t, "seconds": round(got.seconds, 4)})
        return True

    def _drop(self, why: str) -> None:
        self.drops += 1
        self._retry_at = time.monotonic() + self.retry_s
        self.before = None
        log.warning("follow: dropped to warm standby", extra={"reason": why, "retry_s": self.retry_s})
        self._set("warm", why)

    def _set(self, state: str, reason: str) -> None:
        changed = state != self.state or reason != self.reason
        self.state, self.reason = state, reason
        now = time.monotonic()
        if not changed and now - self._said < STATUS_EVERY_S:
            return
        self._said = now
        rt = self.h.runtime
        rec = {"state": state, "reason": reason, "step": self.step, "drops": self.drops, "applied": self.applied,
               "feeder": self._feeder[1] if self._feeder else "", "time": time.time()}  # fmt: skip
        try:
            rt.put(rt.keys.follow(self.spare_id), rec, retry=False)
        except Exception:  # noqa: BLE001 - status only: an etcd hiccup must not stop the follower
            log.debug("follow: status not written", exc_info=True)

    def record(self) -> dict[str, Any]:
        """What the final record says of the follow mode (report and bench read it)."""
        return {
            "state": self.state,
            "step": self.step,
            "drops": self.drops,
            "applied": self.applied,
            "took_over": self.took_over,
            "lag_ms": lag_summary(list(self.lags)),
        }
