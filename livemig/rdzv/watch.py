"""Watches that survive an etcd member failover without losing events.

pyetcd delivers a stream error to the callback and forgets the watch. We
remember the last revision delivered and re-create the watch from the next
one on whichever endpoint answers, so no event is skipped or repeated. If
the revision was compacted meanwhile, the owner gets `resync()`: re-read.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pyetcd import events as etcd_events
from pyetcd import exceptions as etcd_exc

from livemig.rdzv.client import KV, EtcdClient

log = logging.getLogger("livemig.rdzv.watch")


@dataclass(slots=True)
class WatchEvent:
    kind: str  # "put" or "delete"
    key: str
    value: bytes
    mod_revision: int
    create_revision: int = 0
    version: int = 0
    lease: int = 0


class PrefixWatch:
    """Calls `callback(list[WatchEvent])` for every change under `prefix`, or in
    [prefix, range_end) when range_end is given.

    start_revision: first revision to deliver (usually read revision + 1).
    """

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        callback: Callable[[list[WatchEvent]], None],
        start_revision: int | None = None,
        on_resync: Callable[[], None] | None = None,
        range_end: str | None = None,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.range_end = range_end
        self.callback = callback
        self.on_resync = on_resync
        self.last_revision = (start_revision - 1) if start_revision else 0
        self.reconnects = 0
        self._lock = threading.Lock()
        self._stopped = False
        self._watch_id: Any = None
        self._gen = 0
        self._establish()

    def _establish(self) -> None:
        while not self._stopped:
            with self._lock:
                self._gen += 1
                gen = self._gen
            start = self.last_revision + 1 if self.last_revision else None
            try:
                self._watch_id = self.client.call(f"watch {self.prefix}", functools.partial(self._add, gen, start))
                return
            except etcd_exc.RevisionCompactedError:
                self._resync()
            except Exception as exc:  # noqa: BLE001 - keep trying until stopped
                log.warning("watch re-establish failed", extra={"prefix": self.prefix, "err": str(exc)})
                time.sleep(0.2)

    def _add(self, gen: int, start: int | None) -> Any:
        cb = functools.partial(self._on_response, gen)
        if self.range_end is not None:
            return self.client.raw.add_watch_callback(self.prefix, cb, range_end=self.range_end, start_revision=start)
        return self.client.raw.add_watch_prefix_callback(self.prefix, cb, start_revision=start)

    def _resync(self) -> None:
        self.last_revision = self.client.revision(self.prefix)
        if self.on_resync:
            self.on_resync()

    def _on_response(self, gen: int, resp: Any) -> None:
        if gen != self._gen or self._stopped:
            return
        if resp is None or isinstance(resp, Exception):
            if isinstance(resp, etcd_exc.RevisionCompactedError):
                self._resync()
            else:
                self.client.mark_failed()
            self.reconnects += 1
            log.info(
                "watch stream broke; resuming",
                extra={"prefix": self.prefix, "from_revision": self.last_revision + 1},
            )
            threading.Thread(target=self._establish, daemon=True, name="livemig-watch").start()
            return
        out = []
        last = self.last_revision
        for ev in resp.events:
            # The protobuf KeyValue itself: pyetcd's event answers each field through a Python
            # __getattr__, most of a flood's per-event cost (10,000 reports at a recovery).
            raw = getattr(ev, "_event", None)
            kv = raw.kv if raw is not None else ev
            rev = kv.mod_revision
            if rev <= last:
                continue  # already delivered before a reconnect
            if isinstance(ev, etcd_events.DeleteEvent):
                out.append(WatchEvent("delete", kv.key.decode(), kv.value, rev))
            else:
                out.append(WatchEvent("put", kv.key.decode(), kv.value, rev, kv.create_revision, kv.version, kv.lease))
        if out:
            self.last_revision = max(e.mod_revision for e in out)
            try:
                self.callback(out)
            except Exception:  # noqa: BLE001
                log.exception("watch callback failed", extra={"prefix": self.prefix})

    def cancel(self) -> None:
        self._stopped = True
        try:
            if self._watch_id is not None:
                self.client.raw.cancel_watch(self._watch_id)
        except Exception:  # noqa: BLE001
            pass


class PrefixMirror:
    """Every key under a prefix, kept in memory by a watch, so a reader that looks often
    (the coordinator, every pass) reads no etcd: one full read at the start and after a
    watch gap (compaction), then each change applied as it comes.

    revision: the newest mod revision applied (a lower bound of how current it is).
    on_change(events) runs after each batch is applied ([] after a full re-read).
    range_end: mirror [prefix, range_end) instead of every key under prefix.
    track_changes: also collect the keys changed since the last `by_key_changes` (one reader:
    the coordinator's passes, which update what they derived from the keys by these alone).
    lend: `view_changes` hands that one reader the mirror's own dict, not a copy (at 10,000
    ranks a pass copied ~60,000 keys, at 100,000 ~500,000: most of a steady pass's cost); the
    watch then queues its events and the next `view_changes`, in the reader's thread, applies
    them, so the dict never changes while the reader's pass uses it."""

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        on_change: Callable[[list[WatchEvent]], None] | None = None,
        range_end: str | None = None,
        track_changes: bool = False,
        lend: bool = False,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.range_end = range_end
        self.on_change = on_change
        self._lock = threading.Lock()
        self._track = track_changes
        self._changed: set[str] | None = None  # None: everything may have changed (a full read)
        self._lend = lend
        self._queued: list[WatchEvent] = []  # lend: events received, applied at the next view
        kvs, rev = self._read()
        self._kv: dict[str, KV] = {kv.key: kv for kv in kvs}
        self.revision = max((kv.mod_revision for kv in kvs), default=0)
        self._watch = PrefixWatch(client, prefix, self._apply, start_revision=rev + 1, on_resync=self._reload,
                                  range_end=range_end)  # fmt: skip

    def _read(self) -> tuple[list[KV], int]:
        if self.range_end is None:
            return self.client.get_prefix(self.prefix)
        return self.client.get_range(self.prefix, self.range_end)

    def _apply(self, events: list[WatchEvent]) -> None:
        with self._lock:
            if self._lend:
                self._queued.extend(events)
                for e in events:
                    self.revision = max(self.revision, e.mod_revision)
            else:
                self._put(events)
            if self._track and self._changed is not None:
                self._changed.update(e.key for e in events)
        if self.on_change is not None:
            self.on_change(events)

    def _put(self, events: list[WatchEvent], into: dict[str, KV] | None = None) -> None:
        kv = self._kv if into is None else into
        for e in events:
            if e.kind == "put":
                kv[e.key] = KV(e.key, e.value, e.mod_revision, e.create_revision, e.version, e.lease)
            else:
                kv.pop(e.key, None)
            self.revision = max(self.revision, e.mod_revision)

    def _reload(self) -> None:
        kvs, _ = self._read()
        with self._lock:
            self._kv = {kv.key: kv for kv in kvs}  # a new dict: one lent out stays as it was
            self._queued = [e for e in self._queued if e.mod_revision > max((kv.mod_revision for kv in kvs),
                                                                            default=0)]  # fmt: skip
            self.revision = max([self.revision, *(kv.mod_revision for kv in kvs)])
            self._changed = None
        if self.on_change is not None:
            self.on_change([])

    def _settle(self) -> None:
        """(lend, under the lock, in the reader's thread) apply the queued events."""
        if self._queued:
            queued, self._queued = self._queued, []
            self._put(queued)

    def kvs(self) -> tuple[list[KV], int]:
        with self._lock:
            if not self._queued:
                return list(self._kv.values()), self.revision
        kv, rev = self.by_key()
        return list(kv.values()), rev

    def by_key(self) -> tuple[dict[str, KV], int]:
        """A copy of the mirror by key (one dict copy: no list and no dict to rebuild). A
        lending mirror's queued events go into the copy, not into the dict its reader holds
        (this may be another thread)."""
        with self._lock:
            return self._copy(), self.revision

    def _copy(self) -> dict[str, KV]:
        """(under the lock) the mirror by key, queued events applied to the copy only."""
        out = dict(self._kv)
        if self._queued:
            self._put(self._queued, into=out)
        return out

    def view_changes(self) -> tuple[dict[str, KV], int, set[str] | None]:
        """(lend) `by_key_changes` without the copy: the mirror's own dict, which its one reader
        must not change and which stays as it is until that reader's next call."""
        assert self._lend, "view_changes needs PrefixMirror(lend=True)"
        with self._lock:
            self._settle()
            changed, self._changed = self._changed, set() if self._track else None
            return self._kv, self.revision, changed

    def by_key_changes(self) -> tuple[dict[str, KV], int, set[str] | None]:
        """`by_key` and the keys changed since the last call (None: since the mirror was read
        whole, or for the first call): taken at once, so the copy is the last one's plus them."""
        with self._lock:
            out = self._copy()
            changed, self._changed = self._changed, set() if self._track else None
            return out, self.revision, changed

    def cancel(self) -> None:
        self._watch.cancel()


def wait_for(
    client: EtcdClient,
    prefix: str,
    predicate: Callable[[dict[str, bytes]], Any],
    timeout: float,
    what: str = "",
    abort: Callable[[], bool] | None = None,
) -> Any:
    """Block until `predicate(state)` is truthy; returns its value.

    state maps every key under `prefix` to its value, kept current by a watch
    started at the read revision, so no change between read and watch is lost.
    Raises TimeoutError naming `what` after `timeout` seconds; `abort` is
    polled and, when true, ends the wait with InterruptedError.
    """
    kvs, rev = client.get_prefix(prefix)
    state = {kv.key: kv.value for kv in kvs}
    cond = threading.Condition()

    def on_events(events: list[WatchEvent]) -> None:
        with cond:
            for e in events:
                if e.kind == "put":
                    state[e.key] = e.value
                else:
                    state.pop(e.key, None)
            cond.notify_all()

    def on_resync() -> None:
        fresh, _ = client.get_prefix(prefix)
        with cond:
            state.clear()
            state.update({kv.key: kv.value for kv in fresh})
            cond.notify_all()

    deadline = time.monotonic() + timeout
    watch = None
    try:
        with cond:
            result = predicate(dict(state))
            if result:
                return result
        watch = PrefixWatch(client, prefix, on_events, start_revision=rev + 1, on_resync=on_resync)
        with cond:
            while True:
                result = predicate(dict(state))
                if result:
                    return result
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"timed out after {timeout:.1f}s waiting for {what or prefix}")
                if abort is not None and abort():
                    raise InterruptedError(f"wait for {what or prefix} aborted")
                cond.wait(min(left, 0.2))
    finally:
        if watch is not None:
            watch.cancel()
