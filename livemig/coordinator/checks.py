"""The coordinator's checks of a committed generation that are not deaths: hung
ranks, broken links and failed collectives, bugs in user code, replicated extras
that differ, stragglers (docs/reliability.md). Each check reads a snapshot and
returns what it decided (a coordinator/recovery.py `Plan`: suspect, fence, fail,
request a migration) or nothing; the coordinator writes it (`_apply`).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import Counter
from typing import Any

from livemig.config import on_error_policy, straggler_settings
from livemig.coordinator.recovery import Plan
from livemig.coordinator.snapshot import Snapshot, as_number
from livemig.rdzv.keys import JobKeys

log = logging.getLogger("livemig.coordinator")

LINK_GATHER_S = 2.0  # how long link reports are gathered after the first (a probe takes up to 1 s)
MAX_REBUILDS = 2  # group rebuilds for one step whose collective failed naming nobody


def compute_times(progress: dict[str, Any]) -> dict[int, float]:
    """A rank's forward+backward time of each of its last few steps, from its progress
    record (`compute_recent`; a record without it gives its latest step only)."""
    out: dict[int, float] = {}
    for pair in progress.get("compute_recent") or []:
        if isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], int):
            out[pair[0]] = as_number(pair[1])
    if isinstance(progress.get("step"), int) and "compute_s" in progress:
        out[progress["step"]] = as_number(progress["compute_s"])
    return out


def judge_windows(history: dict[int, dict[int, float]], after: int, first: int, factor: float,
                  need: int) -> list[tuple[int, int, float, Any]]:  # fmt: skip
    """Each step after `after` that ends a window of `need` steps (none before `first`)
    every rank has a time for (of two ranks or more), in order, and for each rank: (step,
    rank, the median of its window, the median of the others' window medians if its own
    is over factor x that, else None). A median of windows, not each step on its own: a
    healthy rank descheduled for one step on a loaded machine looked `factor` times
    slower than a straggler whose SIGSTOP had landed in its collective wait that step, and
    requiring every step of a row to be slow let a straggler that was slow in most of
    them go unjudged for 60 steps (CI fresh clones). The progress keys hold only each
    rank's latest record (written latest-wins), so the records carry their last steps'
    times and `history` gathers them over the passes: comparing rank A's step s with
    rank B's step s-1 flagged a healthy rank on a loaded machine."""
    if len(history) < 2:
        return []
    common = set.intersection(*(set(v) for v in history.values()))
    out: list[tuple[int, int, float, Any]] = []
    for step in sorted(x for x in common if x > after and x - need + 1 >= first):
        window = range(step - need + 1, step + 1)
        if not all(w in common for w in window):
            continue  # the coordinator missed some of these steps' records: judged by later windows
        meds = {r: _median([times[w] for w in window]) for r, times in history.items()}
        for r, c in meds.items():
            med = _median([v for q, v in meds.items() if q != r])
            out.append((step, r, c, med if med > 0 and c > factor * med else None))
    return out


def _median(xs: list[float]) -> float:
    """The lower median: with two ranks, the other rank's own figure."""
    xs = sorted(xs)
    return xs[(len(xs) - 1) // 2] if len(xs) % 2 == 0 else xs[len(xs) // 2]


def link_victims(reports: dict[int, list[int]]) -> tuple[list[int], int]:
    """The ranks a round of link reports (reporter -> the peers it cannot reach) replaces,
    and how many reports named them: every rank named most that did not report itself
    (silent: a lost node's ranks, replaced together), else, for a cut between reporters
    (each names the other), the higher rank of those named most. Naming only the higher
    of a lost node's two ranks fenced them in two recoveries (a CI run: the leader's
    node lost, its ranks' leases not yet expired). ([], 0) when nobody is named."""
    counts = Counter(x for named in reports.values() for x in named)
    if not counts:
        return [], 0
    top = max(counts.values())
    tops = [r for r, c in counts.items() if c == top]
    return sorted(r for r in tops if r not in reports) or [max(tops)], top


class Checks:
    """The checks, and what they remember between passes (waits, links, rebuilds, bugs,
    the straggler hook's window). They read the job's keys (`keys`) and write nothing."""

    def __init__(self, keys: JobKeys) -> None:
        self.keys = keys
        self.bug_time = 0.0  # when the bug that ended the job was raised (the result's raised_at)
        self._extras_checked = False
        self._waits: dict[tuple[int, int, int], float] = {}  # (generation, rank, step) -> wait start here
        self._busy_seen: dict[tuple[int, int], float] = {}  # (generation, rank) -> last seen inside ctx.busy()
        self._straggler_gen, self._straggler_from = -1, 0  # the straggler hook's group and first judged step
        self._straggler_judged = -1  # the last step it judged
        self._bugs_seen: set[str] = set()  # incarnations whose bug was recorded (--on-error replace:N)
        self._times: dict[int, dict[int, float]] = {}  # straggler hook: rank -> {step: compute_s} gathered
        self._link_first: dict[int, float] = {}  # generation -> first link report seen
        self._rebuilds: dict[int, int] = {}  # step -> group rebuilds for it

    def straggler(self, s: Snapshot) -> Plan | None:
        """Off unless LIVEMIG_STRAGGLER_FACTOR is set: request the migration of a rank
        whose median forward+backward time over the last LIVEMIG_STRAGGLER_STEPS steps is
        above factor x the median of the others' (judge_windows)."""
        factor, need = straggler_settings()
        if factor <= 0:
            return None
        m = s.m
        latest = -1
        for r in m.members:
            p = s.get(self.keys.progress(r)) or {}
            times = compute_times(p)
            self._times.setdefault(r, {}).update(times)
            latest = max(latest, max(times, default=-1))
        if self._straggler_gen != m.generation:  # a new group: judge it afresh, after it settled
            self._straggler_gen, self._straggler_from = m.generation, latest + need
            self._straggler_judged = -1
            self._times = {r: self._times.get(r, {}) for r in m.members}
        after = max(self._straggler_judged, self._straggler_from - 1, 0)
        decided = None
        for step, r, c, med in judge_windows(self._times, after, self._straggler_from, factor, need):
            self._straggler_judged = max(self._straggler_judged, step)
            if med is None:
                continue
            why = f"straggler: median forward+backward {c:.3f}s over {need} steps > {factor:g} x the others' {med:.3f}s"
            req = {"id": secrets.token_hex(4), "rank": r, "time": time.time(), "reason": why}
            log.warning("straggler detected; migration requested", extra={"rank": r, "reason": req["reason"]})
            decided = Plan("request", request=req)
            break
        keep = max(self._straggler_judged, latest - 4 * need) - need  # what a later window can still need
        for times in self._times.values():
            for st in [x for x in times if x <= keep]:
                del times[st]
        return decided

    def extras_differ(self, s: Snapshot) -> str:
        """Replicated extras must be equal on every rank (a spare takes them from any
        peer): each worker's digests of them after step 0, compared once all are in."""
        if self._extras_checked:
            return ""
        checks = s.under(self.keys.extras_check_prefix)
        if len(checks) < s.m.world_size:
            return ""
        self._extras_checked = True
        ref = checks.get("0", {}).get("digests", {})
        for r in sorted(checks, key=lambda x: int(x) if x.isdigit() else -1):
            for name, d in (checks[r].get("digests") or {}).items():
                if ref.get(name) == d:
                    continue
                if name in ("<parameters>", "<optimizer>"):
                    what = "the parameters" if name == "<parameters>" else "the optimizer state"
                    return (
                        f"{what} differ between rank 0 and rank {r} after step 0: every rank must apply "
                        "the same update to the same replicas (rank 0's at start); find the code that changes "
                        "them on one rank only (before ctx.step(), or a hand-set hyperparameter that depends "
                        "on the rank), or with ctx.register(sync_start=False) build equal replicas"
                    )
                return (
                    f"the extra {name!r} differs between rank 0 and rank {r} after step 0: a spare would "
                    f"take another rank's; register per-rank state under local={{{name!r}: ...}}"
                )
        return ""

    def links(self, s: Snapshot) -> Plan | None:
        """Collective failures attributed (docs/reliability.md, "Broken links"). A member
        whose collective failed, or has waited in it for a quarter of the hang timeout,
        reports the peers it cannot reach (a TCP connect to their state servers). Once
        every member reported, or LINK_GATHER_S after the first report, the ranks named by
        the most reports that did not report themselves are replaced, else the higher of
        those named most. Failures that name nobody
        rebuild the group with the same members, at most MAX_REBUILDS times for one step;
        then the job fails with the collective's error. None if nothing is decided. Only
        records that carry a flag are read (Snapshot.flagged_progress): the others name nobody."""
        m = s.m
        reports: dict[int, tuple[bool, list[int], dict]] = {}
        for r, p in sorted(s.flagged_progress().items()):
            mem = m.members.get(r)
            if mem is None or p.get("incarnation") != mem.incarnation or p.get("group") != m.group_gen:
                continue
            failed = isinstance(p.get("failed_step"), int)
            named = [x for x in p.get("unreachable") or [] if isinstance(x, int) and x in m.members and x != r]
            if failed or named:
                reports[r] = (failed, named, p)
        if not reports:
            return None
        first = self._link_first.setdefault(m.generation, time.monotonic())
        if len(reports) < len(m.members) and time.monotonic() - first < LINK_GATHER_S:
            return None
        victims, top = link_victims({r: named for r, (_, named, _) in reports.items()})
        if victims:
            suspects = []
            for victim in victims:
                by = sorted(r for r, (_, named, _) in reports.items() if victim in named)
                suspects.append((victim, f"broken link: rank(s) {by} cannot reach rank {victim}'s host "
                                         f"({top} of {len(reports)} reports)"))  # fmt: skip
            seen = {r: v[1] for r, v in reports.items()}
            log.warning("broken link: rank(s) suspected", extra={"ranks": victims, "reports": seen})
            event = {"ranks": victims, "reports": {str(r): named for r, named in seen.items()}}
            return Plan("suspect", suspects=tuple(suspects), events=(("link", event),))
        failing = {r: p for r, (f, _, p) in reports.items() if f}
        if not failing:
            return None  # waits with every peer reachable: the hang check judges them
        step = max(p["failed_step"] for p in failing.values())
        error = next(iter(failing.values())).get("error", "")
        n = self._rebuilds.get(step, 0)
        if n >= MAX_REBUILDS:
            why = (f"the collective of step {step} failed {n + 1} times with every peer reachable "
                   f"(last error: {error}); check the network between the workers")  # fmt: skip
            return Plan("fail", reason=why)
        self._rebuilds[step] = n + 1
        why = f"rebuild: the collective of step {step} failed with every peer reachable ({error})"
        return Plan("fence", reason=why, events=(("rebuild", {"step": step, "error": error}),))

    def hung(self, s: Snapshot) -> Plan | None:
        """Progress-based hang detection (docs/reliability.md): when every other member
        has waited in step W's collective for longer than the hang timeout and a rank
        has not entered it (its training thread is stuck while its lease lives on), or
        is stuck in an older step's, that rank is suspected, as if its agent had seen
        it die; the recovery then fences it and its agent kills it. A rank inside
        `ctx.busy()` is never suspected. The wait is measured on this coordinator's
        clock from what each member reported (`waited_s`), so host clocks do not matter.
        Only records that carry a flag are read until someone waits (Snapshot.flagged_progress)."""
        m = s.m
        flagged = {r: p for r, p in s.flagged_progress().items() if r in m.members}
        now = time.monotonic()
        for r, p in flagged.items():  # a rank is given the whole hang timeout again after a busy pause
            if p.get("busy"):
                self._busy_seen[(m.generation, r)] = now
        waiting = {r: p for r, p in sorted(flagged.items()) if isinstance(p.get("waiting_step"), int)
                   and p.get("incarnation") == m.members[r].incarnation}  # fmt: skip
        if not waiting or len(waiting) == len(m.members) and len({p["waiting_step"] for p in waiting.values()}) == 1:
            return None
        w = max(p["waiting_step"] for p in waiting.values())
        waiters = [r for r, p in waiting.items() if p["waiting_step"] == w]
        started = []
        for r in waiters:
            key = (m.generation, r, w)
            if key not in self._waits:
                self._waits[key] = now - as_number(waiting[r].get("waited_s"))
            started.append(self._waits[key])
        limit = max(as_number(waiting[r].get("hang_timeout"), 5.0) for r in waiters)
        waited = now - max(started)
        prog = {r: flagged.get(r) or s.get(self.keys.progress(r)) or {} for r in m.members}
        suspects = [r for r in m.members if r not in waiters and not prog[r].get("busy")
                    and now - self._busy_seen.get((m.generation, r), -1e18) >= limit]  # fmt: skip
        if not suspects or waited < limit:
            return None
        why = f"hung: rank(s) {waiters} waited {waited:.1f}s in step {w}'s collective (hang timeout {limit:.1f}s)"
        log.warning("hung rank(s) suspected", extra={"ranks": suspects, "step": w, "waited_s": round(waited, 2)})
        return Plan("suspect", suspects=tuple((r, why) for r in suspects),
                    events=(("hang", {"ranks": suspects, "step": w, "waited_s": waited}),))  # fmt: skip

    def bug(self, s: Snapshot) -> tuple[str, str] | None:
        """A member's recorded bug (runtime/bugs.py) that ends the job: (reason, traceback).
        Under --on-error replace:N the process exit is recovered like any other, N times."""
        m = s.m
        errors = [e for inc, e in s.under(self.keys.errors_prefix).items()
                  if m.generation == 0 or m.rank_of(inc) is not None or inc in self._bugs_seen]  # fmt: skip
        if not errors:
            return None
        policy, retries = on_error_policy()
        self._bugs_seen.update(e.get("incarnation", "") for e in errors)
        if policy == "replace" and len(self._bugs_seen) <= retries:
            return None
        e = min(errors, key=lambda x: (x.get("step") if isinstance(x.get("step"), int) else -1, x.get("rank", 0)))
        where = f"at step {e['step']}" if isinstance(e.get("step"), int) else "before training"
        if e.get("misuse") is True:  # livemig refused what the script asked: a retry repeats it
            reason = f"rank {e.get('rank')} {where}: {e.get('error', '?')}"
        else:
            reason = (f"rank {e.get('rank')} raised {e.get('error', '?')} {where}: a bug in the training function "
                      "ends the job (no spare is used; `--on-error replace:N` retries on spares)")  # fmt: skip
        if policy == "replace":
            reason += f"; {retries} retries used"
        self.bug_time = float(e.get("time", 0.0) or 0.0)
        return reason, str(e.get("traceback", ""))
