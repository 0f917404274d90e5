"""What a member tells the coordinator between generations, off the training thread: its
last commit (with the step times the hang and straggler checks read), how long it has waited
in a collective, whether it is busy (`ctx.busy()`), and, when a collective fails, which peers
it cannot reach (docs/reliability.md). The coordinator acts on these records; the training
thread only hands them over (the newest replaces one not yet written)."""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from livemig.config import ENV_HANG_TIMEOUT, ENV_PROBE_TIMEOUT, metrics_on, progress_budget, straggler_settings

if TYPE_CHECKING:
    from livemig.rdzv.membership import Membership

log = logging.getLogger("livemig.member")
COMPUTE_KEPT = 8  # steps of compute times a record repeats from before the last one written (a pass may miss one)
COMPUTE_MAX = 256  # and at most this many in all: the steps since the last written record, at scale
# the fields a progress record may carry besides the commit's own arguments: a user metric of one
# of these names is kept as user_<name> (Progress.commit)
_OWN = frozenset({"compute_recent", "note", "step_s", "busy", "waiting_step", "waited_s", "hang_timeout",
                  "group", "unreachable", "failed_step", "error"})  # fmt: skip


_FIRST = "_first"  # marks a member's first commit in a group, in the queue only: never written


def _urgent(item: dict) -> bool:
    """A failed collective, a long wait, a busy flag or a member's first commit in a new group:
    the coordinator acts on these (a recovery, the hang check, the recovery's measure), so they
    go out at once, outside the progress budget."""
    return "failed_step" in item or "waiting_step" in item or "busy" in item or _FIRST in item


class Progress:
    """One member's progress records (see the module doc). `write` puts one record in etcd (a
    fenced put: refused once the member was replaced); `where` says where the
    member stands now: (its rank or None before it registers, the generation whose group it
    trains in, the newest membership it saw)."""

    def __init__(self, incarnation: str, write: Callable[[dict], None],
                 where: Callable[[], tuple[int | None, int, Membership]]) -> None:  # fmt: skip
        self.incarnation = incarnation
        self._write = write
        self._where = where
        self._q: queue.Queue = queue.Queue(maxsize=1)
        self._budget = progress_budget()  # a bad LIVEMIG_PROGRESS_BUDGET fails the member here
        self._last_item: dict | None = None  # the last progress record (a commit)
        self._step_times: list[float] = []  # seconds between the last commits
        # [step, forward+backward s] of the last COMPUTE_KEPT steps, only for a straggler hook that is on: it
        # would near double every progress write of a job that has none (a bad setting fails here, as above)
        self._compute_recent: list[list[float]] | None = [] if straggler_settings()[0] > 0 else None
        # how each recovery is measured (coordinator/measure.py, the report's and the metrics
        # endpoint's one definition): [generation, the last commit before this group as [step, time]
        # or None, this group's first commit, the median step before this group or None], sent
        # with every progress record of the generation (~60 bytes)
        self._metrics = metrics_on()  # the endpoint's median step too (agent/metrics.py)
        self._around: list | None = None
        self._waiting: tuple[int, float, bool] | None = None  # (step, since, reported) in a collective
        self._busy = False
        self._written_step = -1  # the step of the last record written (the progress thread's)
        threading.Thread(target=self._loop, daemon=True, name="livemig-progress").start()

    def commit(self, step: int, metrics: dict[str, float] | None = None, **info: Any) -> None:
        """Publish the last committed step off the training thread (latest wins). `metrics`:
        the user's (ctx.log); one named like a field of the record (ctx.log(step=...)) keeps its
        value under user_<name>, never replacing the field."""
        gen = self._where()[1]
        now = time.time()
        first = self._around is None or self._around[0] != gen
        if first:
            prev = self._last_item
            before = round(sorted(self._step_times)[len(self._step_times) // 2], 6) if self._step_times else None
            self._around = [gen, [prev["step"], prev["time"]] if prev else None, [step, now], before]
        if self._last_item is not None:
            self._step_times = [*self._step_times[-19:], now - self._last_item["time"]]
        item = {"step": step, "time": now, "incarnation": self.incarnation, **info}
        item = {**{(f"user_{k}" if k in item or k in _OWN else k): v for k, v in (metrics or {}).items()}, **item}
        if self._compute_recent is not None and "compute_s" in info:  # the straggler hook judges each step:
            since = self._written_step - COMPUTE_KEPT  # every step since the last record written goes out
            kept = [p for p in self._compute_recent if p[0] > since][-(COMPUTE_MAX - 1) :]
            self._compute_recent = [*kept, [step, round(info["compute_s"], 6)]]
            item["compute_recent"] = self._compute_recent
        item["note"] = self._around
        if self._metrics:
            if self._step_times:
                item["step_s"] = round(sorted(self._step_times)[len(self._step_times) // 2], 6)
        self._last_item = item
        self._queue({**item, _FIRST: True} if first else item)

    def _queue(self, item: dict) -> None:
        try:
            old = self._q.get_nowait()
            if _FIRST in old and _FIRST not in item:  # a newer record replaces it: as urgent
                item = {**item, _FIRST: True}
        except queue.Empty:
            pass
        self._q.put_nowait(item)

    # -- what the coordinator's hang detection reads (docs/reliability.md) -----------------
    def hang_timeout(self) -> float:
        """LIVEMIG_HANG_TIMEOUT, else max(5 s, 10 x this member's median step time)."""
        raw = os.environ.get(ENV_HANG_TIMEOUT, "")
        if raw:
            return float(raw)
        times = sorted(self._step_times)
        return max(5.0, 10 * times[len(times) // 2]) if times else 5.0

    def enter_collective(self, step: int) -> None:
        """The training thread waits in step `step`'s collective from now on."""
        if self._waiting is None or self._waiting[0] != step:
            self._waiting = (step, time.monotonic(), False)

    def leave_collective(self) -> None:
        self._waiting = None

    def set_busy(self, busy: bool) -> None:
        """`with ctx.busy():` a legitimately long pause (a checkpoint): never a hang."""
        self._busy = busy
        if self._last_item is not None or busy:
            self._queue({**(self._last_item or {"step": -1, "time": time.time(), "incarnation": self.incarnation}),
                         "busy": busy})  # fmt: skip

    def _anomaly(self) -> dict | None:
        """A wait in a collective longer than a quarter of the hang timeout: reported once."""
        w = self._waiting
        if w is None or w[2]:
            return None
        waited = time.monotonic() - w[1]
        limit = self.hang_timeout()
        if waited < limit / 4:
            return None
        self._waiting = (w[0], w[1], True)
        base = self._last_item or {"step": w[0] - 1, "time": time.time(), "incarnation": self.incarnation}
        return {**base, "waiting_step": w[0], "waited_s": waited, "hang_timeout": limit, "busy": self._busy,
                "group": self._where()[1], "unreachable": self.unreachable_peers()}  # fmt: skip

    # -- what the coordinator's link attribution reads (docs/reliability.md) -------------
    def unreachable_peers(self) -> list[int]:
        """Ranks of our group whose state server does not accept a TCP connection within
        LIVEMIG_PROBE_TIMEOUT (default 1 s): every peer in a world of up to 64, else the
        32 nearest on each side of the ring. Each peer is probed from its own thread."""
        me, gen, m = self._where()
        if me is None or m.group_gen != gen:
            return []
        ranks = sorted(r for r in m.members if r != me)
        if len(ranks) > 64:
            n = m.world_size
            near = {(me + d) % n for d in range(-32, 33) if d}
            ranks = [r for r in ranks if r in near]
        timeout = float(os.environ.get(ENV_PROBE_TIMEOUT, "") or 1.0)
        down: list[int] = []

        def probe(r: int) -> None:
            host, _, port = m.members[r].addr.removeprefix("tcp://").rpartition(":")
            try:
                socket.create_connection((host, int(port)), timeout=timeout).close()
            except (OSError, ValueError):
                down.append(r)

        threads = [threading.Thread(target=probe, args=(r,), daemon=True) for r in ranks if m.members[r].addr]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout + 0.5)
        return sorted(down)

    def collective_failed(self, step: int | None, why: str) -> None:
        """Our collective failed while the job did not move on: tell the coordinator what we
        know (the peers we cannot reach), off the training thread, which goes on to wait for
        the recovery (the coordinator decides who is replaced, or rebuilds the group)."""
        if step is None:
            return
        gen = self._where()[1]
        base = self._last_item or {"step": step - 1, "time": time.time(), "incarnation": self.incarnation}

        def report() -> None:
            self._queue({**base, "failed_step": step, "group": gen, "error": why[:200],
                         "unreachable": self.unreachable_peers()})  # fmt: skip

        threading.Thread(target=report, daemon=True, name="livemig-probe").start()

    def _loop(self) -> None:
        next_at = 0.0
        while True:
            try:
                item = self._q.get(timeout=0.25)
            except queue.Empty:
                item = self._anomaly()
                if item is None:
                    continue
            rest = next_at - time.monotonic()
            while rest > 0 and not _urgent(item):  # the job's write budget (config.progress_budget)
                try:  # a newer record replaces this one; an urgent one ends the wait
                    item = self._q.get(timeout=rest)
                except queue.Empty:
                    break
                rest = next_at - time.monotonic()
            if _FIRST in item:
                item = {k: v for k, v in item.items() if k != _FIRST}
            try:
                self._write(item)
                if isinstance(item.get("step"), int):
                    self._written_step = item["step"]
            except Exception:  # noqa: BLE001 - progress is advisory
                log.debug("progress write failed", exc_info=True)
            next_at = time.monotonic() + max(self._where()[2].world_size, 1) / self._budget
