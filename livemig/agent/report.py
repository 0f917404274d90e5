"""The run report (`--report FILE`): one format read by the README demo,
tests and benchmarks, and the one definition of a recovery's figures, which the
metrics endpoint (agent/metrics.py) computes with the same functions.

Downtime of a recovery = the new group's first group-wide commit, minus the
last group-wide commit before it (a step the survivors finish after the fault
is work done, not lost), minus the median step before the recovery (the step
that would have run anyway). A step is committed group-wide when its last rank
commits it. Every member notes, at its first commit in each generation, its
last commit before and its median step until then (runtime/progress.py); the
leader turns the members' notes into a `measured` event once every member
committed in the new group (coordinator/timeline.py `measured`), so the figures
are final when first seen, need nothing that happens later in the run, and the
report and the metrics endpoint read the same ones. Lost time = downtime, plus the
steps a cold restart trains again, plus a planned migration's pause. Goodput =
the share of the wall time from launch to the last commit that was neither
start-up (up to the first commit) nor lost.
"""

from __future__ import annotations

import hashlib
import statistics
import time
from typing import Any

from livemig.coordinator.timeline import PHASES, measurements, read_events
from livemig.rdzv.client import EtcdClient, conform
from livemig.rdzv.keys import JobKeys
from livemig.rdzv.membership import Membership, Rendezvous

_NUM = (int, float)
# Recovery kinds: one set for the report's recoveries and migrations, the events and the metrics'
# `kind` label (docs/operations.md): "restart" is the cold path (a restart from a checkpoint,
# coordinator/cold.py); "shrink" a failure the survivors absorbed with no spare, "grow" a spare taking
# a carried rank back (runtime/virtual.py).
KINDS = ("failure", "migration", "restart", "shrink", "grow")
COMMIT_TIMES = 200  # group-wide commits listed in the report (runtime/loop.py COMMITS_KEPT per member)
# A final record as the report reads it (conform(): anything else under final/ is skipped).
FINAL_NEED = {"steps": (int,), "digest": (str,)}
FINAL_MAY = {"digests": (dict,), "shard_digest": (str,), "mirror_digest": (str,), "mirror_of": (int,),
             "commits": (list,), "role": (str,), "joined_at_step": (int,), "standby": (dict,), "follow": (dict,),
             "peak_rss_mb": _NUM, "inherited_to": (int,), "checkpoints": (dict,), "carried_by": (int,)}  # fmt: skip


def goodput(launched: float | None, first: float | None, last: float | None, lost_s: float) -> float | None:
    """The share of the wall time from launch to the last commit that trained: not start-up
    (launch to the first commit), not lost to recoveries and migrations (module doc)."""
    if launched is None or first is None or last is None or last <= launched:
        return None
    return round(max(0.0, min(1.0, (last - first - lost_s) / (last - launched))), 6)


def first_commit(meas: dict[int, dict[str, Any]], commits: list[tuple[int, float]]) -> float | None:
    """The job's first group-wide commit: its first generation's, as measured (the final records
    keep only their last commits), else the earliest commit the records kept."""
    if meas:
        return float(meas[min(meas)]["after"][1])
    return commits[0][1] if commits else None


def lost_seconds(recs: list[dict], migs: list[dict]) -> float:
    """Time lost to recoveries and planned migrations (module doc)."""
    return sum(r.get("lost_s", r["downtime_s"]) for r in recs) + sum(m.get("pause_s") or 0.0 for m in migs)


def read_finals(client: EtcdClient, keys: JobKeys) -> dict[str, dict]:
    kvs, _ = client.get_prefix(keys.final_prefix)
    out = {}
    for kv in kvs:
        rank, f = kv.key[len(keys.final_prefix) :], conform(kv.value, FINAL_NEED, FINAL_MAY)
        if f is not None and rank.isdigit():
            f["digests"] = {k: v for k, v in f.get("digests", {}).items() if isinstance(v, str)}
            out[rank] = f
    return out


def _group_commits(finals: dict[str, Any]) -> list[tuple[int, float]]:
    by_step: dict[int, float] = {}
    for f in finals.values():
        for c in f.get("commits", []):
            if isinstance(c, list | tuple) and len(c) == 2 and all(isinstance(x, _NUM) for x in c):
                step, t = c
                by_step[int(step)] = max(by_step.get(int(step), 0.0), float(t))
    return sorted(by_step.items())


def build(client: EtcdClient, job: str, world_size: int, wall_s: float,
          outages: list[tuple[float, float]] | None = None,
          spares_warm: dict[str, float] | None = None, launched_at: float | None = None) -> dict[str, Any]:  # fmt: skip
    """outages: (start, end) wall times of injected etcd outages: the steps the group
    committed inside each are reported (training must go on while etcd is away).
    spares_warm: spare id -> when it reported warm; reported with the steps committed by then.
    launched_at: when the job was launched (default: wall_s ago), for the goodput."""
    launched = launched_at if launched_at is not None else time.time() - wall_s
    keys = JobKeys(job)
    finals = read_finals(client, keys)
    commits = _group_commits(finals)
    gaps = [b - a for (s, a), (u, b) in zip(commits, commits[1:], strict=False) if u == s + 1]  # adjacent steps
    median_step = statistics.median(gaps) if gaps else 0.0
    shards = sharded_state(finals)
    ranks = rank_digests(finals)
    replicated = {r: f.get("digests", {}).get("replicated", f["digest"]) for r, f in finals.items()}
    events = read_events(client, keys)
    result = client.get(keys.result)
    table = Rendezvous(client, keys.job).read()
    meas = measurements(events)
    recs, migs = recoveries(events, commits, median_step, meas), migrations(events, commits, median_step, meas)
    return {
        "job": job,
        "world_size": world_size,
        "result": conform(result.value, {}) if result else None,
        # no final records (a failed or interrupted run): the steps every rank had committed
        "steps_completed": min(f["steps"] for f in finals.values())
        if finals
        else committed_steps(client, keys, world_size),
        "wall_s": wall_s,
        "step_time_s_median": median_step,
        "state_digest": job_digest(ranks),
        "rank_digests": ranks,
        **(
            {"step_prints": {r: f["step_prints"] for r, f in finals.items() if isinstance(f.get("step_prints"), list)}}
            if any("step_prints" in f for f in finals.values())
            else {}
        ),  # fmt: skip
        "replicas_identical": _replicas_identical(
            finals,
            replicated,  # a carried rank's record is its carrier's
            world_size - len([v for v in table.carried if str(v) not in finals]),
        )
        and (not shards or shards["mirrors_exact"]),
        **({("fsdp2" if any("fsdp_shard" in f for f in finals.values()) else "zero1"): shards} if shards else {}),
        **({"checkpoints": checkpoints_of(finals)} if any("checkpoints" in f for f in finals.values()) else {}),
        "members": {
            r: {
                "role": f.get("role"),
                "joined_at_step": f.get("joined_at_step"),
                # this process's own first commit (a migrated-in spare's record starts with the leaving worker's)
                "first_commit": next((c for c in _group_commits({r: f}) if c[0] > f.get("inherited_to", -1)), None),
                **({"standby": f["standby"]} if "standby" in f else {}),
                **({"follow": f["follow"]} if "follow" in f else {}),  # a follow spare's (runtime/follow.py)
                **({"peak_rss_mb": f["peak_rss_mb"]} if "peak_rss_mb" in f else {}),
            }
            for r, f in sorted(finals.items())
        }
        if finals
        else members_of(table),
        # wall times of the group's first and last committed step (start-up and teardown)
        "commit_window": [commits[0][1], commits[-1][1]] if commits else None,
        # [step, wall time] of the last group-wide commits (the final records keep no more)
        "commit_times": [[st, t] for st, t in commits[-COMMIT_TIMES:]],
        "spares_warm": {
            k: {"warm_at": t, "steps_committed": sum(1 for _, c in commits if c <= t)}
            for k, t in sorted((spares_warm or {}).items())
        },
        "recoveries": recs,
        "migrations": migs,
        "lost_s": round(lost_seconds(recs, migs), 4),
        "goodput": goodput(
            launched, commits[0][1] if commits else None, commits[-1][1] if commits else None, lost_seconds(recs, migs)
        ),  # fmt: skip
        "timeline": events,
        "nodes": nodes_of(table),
        **({"shrunk": shrunk(table, events, commits)} if any(e["phase"] == "shrink" for e in events) else {}),
        **({"etcd_outages": [_outage(a, b, commits) for a, b in outages]} if outages else {}),
    }


def _median_gap(commits: list[tuple[int, float]]) -> float | None:
    gaps = [b - a for (s, a), (u, b) in zip(commits, commits[1:], strict=False) if u == s + 1]
    return round(statistics.median(gaps), 6) if gaps else None


def shrunk(table: Membership, events: list[dict], commits: list[tuple[int, float]]) -> dict[str, Any]:
    """A job that ended shrunk (runtime/virtual.py): who carries whom, the steps trained at
    less than full width, and the step time then against the steps before the first shrink."""
    first = next((ev.get("resume_step") for ev in events if ev["phase"] == "shrink"), None)
    first = first if isinstance(first, int) else 0
    # back to full width: the commit of the last grow that left nothing carried
    grown = [ev["generation"] for ev in events if ev["phase"] == "grow"] if not table.carried else []
    last = grown[-1] if grown else None
    until = max((ev["time"] for ev in events if ev["phase"] == "commit" and ev.get("generation") == last),
                default=float("inf"))  # fmt: skip
    before = [c for c in commits if c[0] < first]
    during = [c for c in commits if c[0] >= first and c[1] <= until]
    full, degraded = _median_gap(before), _median_gap(during)
    return {
        "physical_world_size": len(table.members),
        "virtual_world_size": table.world_size,
        "carried": dict(sorted(table.carried.items())),
        "degraded_from_step": first,
        "degraded_steps": len(during),
        "step_time_s_full": full,
        "step_time_s_degraded": degraded,
        "degraded_step_cost": round(degraded / full, 3) if full and degraded else None,
        "grew_back": bool(grown),
    }


def checkpoints_of(finals: dict[int, dict]) -> dict[str, Any]:
    """The run's checkpoints from every rank's records (runtime/checkpoint.py): those every
    rank wrote, the failed writes (a checkpoint failure is not a job failure: it is counted
    here), the time the training thread spent staging and waiting, and the step resumed from."""
    recs = {r: f["checkpoints"] for r, f in finals.items() if isinstance(f.get("checkpoints"), dict)}
    per_step: dict[int, list[bool]] = {}
    staged, waited = [], []
    spans: dict[int, list[float]] = {}  # step: [staged at, the last rank's write done] (bench checkpoint)
    for rec in recs.values():
        for row in rec.get("records") or []:
            if isinstance(row, list) and len(row) >= 5 and isinstance(row[0], int):
                per_step.setdefault(row[0], []).append(row[4] is True)
                staged.append(float(row[2] or 0))
                waited.append(float(row[5] or 0) if len(row) > 5 else 0.0)
                at = float(row[1] or 0)
                end = at + float(row[2] or 0) + float(row[3] or 0)
                cur = spans.setdefault(row[0], [at, end])
                cur[0], cur[1] = min(cur[0], at), max(cur[1], end)
    complete = sorted(s for s, oks in per_step.items() if len(oks) == len(recs) and all(oks))
    resumed = {rec.get("resumed") for rec in recs.values()} - {None}
    return {"steps": complete, "failed": sum(int(rec.get("failed") or 0) for rec in recs.values()),
            "stage_s_max": round(max(staged, default=0.0), 4), "wait_s_total": round(sum(waited), 4),
            "resumed_from": min(resumed) if resumed else None,
            "writes": [[st, round(a, 4), round(b, 4)] for st, (a, b) in sorted(spans.items())]}  # fmt: skip


def committed_steps(client: EtcdClient, keys: JobKeys, world_size: int) -> int:
    """Steps committed by every rank, from the members' progress records: what a run that
    ended without final records got done."""
    kvs, _ = client.get_prefix(keys.progress_prefix)
    steps = {}
    for kv in kvs:
        rank, rec = kv.key[len(keys.progress_prefix) :], conform(kv.value, {"step": (int,)})
        if rec is not None and rank.isdigit():
            steps[int(rank)] = rec["step"] + 1
    return min(steps.values()) if len(steps) == world_size else 0


def empty(job: str, world_size: int, wall_s: float) -> dict[str, Any]:
    """The report of a run whose etcd could not be read (interrupted before it answered, or
    gone): the same keys, nothing measured."""
    return {"job": job, "world_size": world_size, "result": None, "steps_completed": 0, "wall_s": wall_s,
            "step_time_s_median": 0.0, "state_digest": job_digest({}), "rank_digests": {},
            "replicas_identical": False, "members": {}, "commit_window": None, "commit_times": [], "spares_warm": {},
            "recoveries": [], "migrations": [], "timeline": [], "nodes": []}  # fmt: skip


def members_of(m: Membership) -> dict[str, dict[str, Any]]:
    """The members of a run no rank finished (failed, interrupted): who held each rank in
    the last table, with nothing measured."""
    return {str(r): {"role": str(mem.role), "joined_at_step": None, "first_commit": None}
            for r, mem in sorted(m.members.items())}  # fmt: skip


def nodes_of(m: Membership) -> list[dict[str, Any]]:
    """Where the final generation's ranks run: one row per (node rank, host); a rank taken
    over by a spare of a standby host has node_rank None."""
    rows: dict[tuple, list[int]] = {}
    for r, mem in sorted(m.members.items()):
        rows.setdefault((mem.node, mem.host), []).append(r)
    return [{"node_rank": n, "host": h, "ranks": ranks} for (n, h), ranks in rows.items()]


def _outage(start: float, end: float, commits: list[tuple[int, float]]) -> dict[str, Any]:
    inside = [s for s, t in commits if start <= t <= end]
    return {"start": start, "end": end, "seconds": end - start, "steps_committed": len(inside),
            "steps": [inside[0], inside[-1]] if inside else None}  # fmt: skip


def _replicas_identical(finals: dict[str, dict], replicated: dict[str, str], world_size: int) -> bool:
    """Every rank holds the same replicated state; under FSDP2, every rank of each shard's
    group holds the same shard (its replicas along the mesh's replicate dimension)."""
    if len(replicated) != world_size:
        return False
    groups: dict[Any, set[str]] = {}
    for r, f in finals.items():
        groups.setdefault(f.get("fsdp_shard"), set()).add(replicated[r])
    return all(len(v) == 1 for v in groups.values())


def rank_digests(finals: dict[str, dict]) -> dict[str, str]:
    """One digest per rank over everything it holds: parameters, optimizer (values and
    param-group hyperparameters), extras, buffers, local=, and its ZeRO-1 shard and mirror."""
    out = {}
    for r in sorted(finals, key=int):
        f = finals[r]
        d = f.get("digests", {})
        parts = [d.get("replicated", f["digest"]), d.get("local", ""), f.get("shard_digest", ""),
                 f.get("mirror_digest", "")]  # fmt: skip
        out[r] = hashlib.sha256("|".join(parts).encode()).hexdigest()
    return out


def job_digest(ranks: dict[str, str]) -> str:
    """The whole job's state: every rank's digest, in rank order."""
    h = hashlib.sha256()
    for r in sorted(ranks, key=int):
        h.update(f"{r}:{ranks[r]};".encode())
    return h.hexdigest()


def divergence(reference: dict[str, list], got: dict[str, list], faults: list[dict]) -> dict[str, Any] | None:
    """Where a faulted run first parted from its fault-free reference (runtime/prints.py):
    the first step whose fingerprint differs on some rank, among the steps both runs recorded
    for that rank (a replacement's record starts where it joined), and why that may be. None
    when no recorded step differs (or nothing was recorded)."""
    first: tuple[int, int] | None = None
    for r in sorted(set(reference) & set(got), key=int):
        ref = {int(s): fp for s, fp in reference[r]}
        for s, fp in got[r]:
            if int(s) in ref and ref[int(s)] != fp and (first is None or (int(s), int(r)) < first):
                first = (int(s), int(r))
                break
    if first is None:
        return None
    step, rank = first
    steps = [f["step"] for f in faults if isinstance(f.get("step"), int)]
    fault = min(steps) if steps else None
    if fault is None or step <= fault:
        why = ("the reference itself differs from step 0: is the model seeded? does the script load a file at "
               "start (its own snapshot, written by the other run)?") if step == 0 else (
               f"the runs differ from step {step}, before any fault: something the state depends on is not "
               "deterministic (an unseeded random source, the time, a file that changed)")  # fmt: skip
    else:
        lost = sorted({f["rank"] for f in faults if f.get("step") == fault and f.get("rank") is not None})
        who = f" of rank(s) {lost}" if lost else ""
        why = (f"diverged at step {step}, {step - fault} step(s) after the fault{who} at step {fault}: state that "
               "moves with a rank not registered (ctx.register(..., local={...})), or read from a copy cached "
               "before the loop?")  # fmt: skip
    return {"step": step, "rank": rank, "first_fault_step": fault, "why": why}


def differing_ranks(reference: dict[str, str], got: dict[str, str]) -> list[int]:
    """Ranks whose final state differs from the same rank of a reference run."""
    return sorted(int(r) for r in set(reference) | set(got) if reference.get(r) != got.get(r))


def sharded_state(finals: dict[str, dict]) -> dict[str, Any] | None:
    """ZeRO-1: the job's state is the replicated model plus every rank's shard;
    each mirror must equal the shard it mirrors (bit for bit)."""
    if not finals or not all("shard_digest" in f for f in finals.values()):
        return None
    ranks = sorted(finals, key=int)
    h = hashlib.sha256(finals[ranks[0]]["digest"].encode())
    for r in ranks:
        h.update(finals[r]["shard_digest"].encode())

    def owner(f: dict) -> dict:
        return finals.get(str(f.get("mirror_of")), {})

    bad = [
        r
        for r in ranks
        if "mirror_of" in finals[r] and finals[r].get("mirror_digest") != owner(finals[r]).get("shard_digest")
    ]
    mirror_mb = [f["mirror_mb"] for f in finals.values() if "mirror_mb" in f]
    return {"state_digest": h.hexdigest(), "mirrors_exact": not bad, "mirror_mismatch_ranks": bad,
            "mirrored": any("mirror_of" in f for f in finals.values()),
            **({"mirror_mb_per_rank": max(mirror_mb)} if mirror_mb else {})}  # fmt: skip


def _claimed(ev: dict) -> list[str]:
    """The spares a claim event names (the timeline is etcd data: anything else is none)."""
    spares = ev.get("spares")
    return [str(x) for x in spares] if isinstance(spares, list) else []


def migrations(events: list[dict], commits: list[tuple[int, float]], median_step: float,
               meas: dict[int, dict[str, Any]] | None = None) -> list[dict]:  # fmt: skip
    """Planned migrations (kind "migration"): phases, and the pause of the switch step.

    pause_s: how much longer the first step in the new group took than a
    median step (its commit minus the switch step's commit, minus the median)."""
    out: list[dict] = []
    by_gen: dict[int, dict[str, Any]] = {}
    for ev in events:
        g = ev.get("generation")
        if ev["phase"] == "request":
            by_gen[g] = {"kind": KINDS[1], "rank": ev.get("rank"), "reason": ev.get("reason", ""),
                         "generation": g, "t": {"request": ev["time"]}, "bytes_streamed": 0}  # fmt: skip
        elif g in by_gen:
            cur = by_gen[g]
            cur["t"].setdefault(ev["phase"], ev["time"])
            if ev["phase"] == "claim":
                cur["spares"] = _claimed(ev)
            elif ev["phase"] == "stream":
                cur["bytes_streamed"] += ev.get("bytes", 0)
                cur["snapshot_s"] = ev.get("seconds", 0.0)
                src = ev.get("source")
                cur["path"] = "follower" if src == "follower" else "stream"  # runtime/migration.py follow_in
                cur["resyncs"] = int(ev.get("resyncs") or 0)  # newer snapshots loaded after falling behind
            elif ev["phase"] == "catchup":
                cur["lag_at_switch_vote"] = ev.get("lag")
            elif ev["phase"] == "switch":
                cur["switch_step"] = ev.get("step")
                cur["resyncs"] = max(int(cur.get("resyncs") or 0), int(ev.get("resyncs") or 0))
            elif ev["phase"] == "abort":
                cur["aborted"] = ev.get("reason", "")
            elif ev["phase"] == "ended":  # a failure during the migration ended it (moved or not)
                if ev.get("state") == "done":
                    cur["ended_by_failure"] = ev.get("reason", "")
                else:
                    cur["aborted"] = ev.get("reason", "")
    at = dict(commits)
    for cur in by_gen.values():
        t = cur.pop("t")
        seq = [(k, t[k]) for k in ("request", "claim", "stream", "catchup", "switch", "commit") if k in t]
        cur["phases"] = {name: round(max(0.0, b - a), 4) for (_, a), (name, b) in zip(seq, seq[1:], strict=False)}
        done = "commit" in t or "ended_by_failure" in cur
        cur["outcome"] = "aborted" if "aborted" in cur else ("done" if done else "incomplete")
        step = cur.get("switch_step")
        m = (meas or {}).get(cur["generation"])
        if m is not None and m["before"] is not None and cur["outcome"] == "done":  # the one definition
            gap = m["after"][1] - m["before"][1]
            cur["pause_s"] = round(max(0.0, gap - (m["step_s"] if m["step_s"] is not None else median_step)), 4)
            cur["switch_step_s"] = round(gap, 4)
        elif step is not None and step in at and step + 1 in at:
            cur["pause_s"] = round(max(0.0, at[step + 1] - at[step] - median_step), 4)
            cur["switch_step_s"] = round(at[step + 1] - at[step], 4)
        out.append(cur)
    return out


def recoveries(events: list[dict], commits: list[tuple[int, float]], median_step: float,
               meas: dict[int, dict[str, Any]] | None = None) -> list[dict]:  # fmt: skip
    """Each recovery, its kind, phases and downtime (module doc). meas: `measured`; a recovery
    whose new generation it holds is measured from it, else from the group-wide commits."""
    out: list[dict] = []
    cur: dict[str, Any] | None = None
    last_fault: float | None = None
    grows = {ev.get("generation"): ev.get("rank") for ev in events if ev["phase"] == "grow"}
    for ev in events:
        ph = ev["phase"]
        if ph == "fault":
            last_fault = ev["time"]
        elif ph == "detect" and cur is None:
            fault_t = last_fault if last_fault is not None and last_fault <= ev["time"] else ev["time"]
            cur = {"kind": KINDS[0], "rank": (ev.get("ranks") or [None])[0], "t": {"fault": fault_t,
                   "detect": ev["time"]}, "bytes_streamed": 0, "stream_s": 0.0}  # fmt: skip
            last_fault = None
            if ev.get("generation") in grows:  # a spare took a carried rank back (its event comes first)
                cur["kind"], cur["rank"] = KINDS[4], grows[ev["generation"]]
        elif cur is not None and ph == "restart":  # the cold path took this failure
            cur["kind"] = KINDS[2]
            cur["restart"] = {"from_step": ev.get("step"), "steps_redone": ev.get("redone"),
                              "checkpoint": ev.get("path"), "reason": ev.get("reason", "")}  # fmt: skip
        elif cur is not None and ph == "shrink":  # no spare: the survivors carry the lost rank(s)
            cur["kind"] = KINDS[3]
            cur["carried"] = {int(k): v for k, v in (ev.get("carried") or {}).items()}
            cur["t"].setdefault("wait", ev["time"])  # the wait for a spare (--spare-wait) ends here, not in build
        elif cur is not None and ph == "fresh":  # the agents started fresh processes for the lost ranks
            cur["fresh"] = ev.get("ranks") or []
        elif cur is not None and ph in PHASES:
            if ph == "stream":
                cur["bytes_streamed"] += ev.get("bytes", 0)
                if ev.get("follower") is True:  # a follow spare took the rank (runtime/follow.py)
                    cur["followers"] = cur.get("followers", 0) + 1
                cur["stream_s"] = max(cur["stream_s"], ev.get("seconds", 0.0))
            cur["t"].setdefault(ph, ev["time"])
            cur["generation"] = ev.get("generation")
            if ph == "claim":
                cur["spares"] = _claimed(ev)
            if ph == "commit":
                out.append(_finish(cur, commits, median_step, (meas or {}).get(cur.get("generation"))))
                cur = None
    return out


def _finish(cur: dict, commits: list[tuple[int, float]], median_step: float, m: dict | None) -> dict:
    t = cur["t"]
    # The group's progress before the recovery: every step committed group-wide before the new
    # generation committed. A kill lands after the killed rank commits a step; the survivors may
    # commit that step a few ms later, after the fault. Counting only commits before the fault
    # then charged one whole extra step to the downtime in about half the demo runs (0.35 s
    # instead of 0.21 s: the report read bimodal by exactly one step).
    before = [c for _, c in commits if c <= t["commit"]]
    after = [c for _, c in commits if c > t["commit"]]
    last_before = before[-1] if before else t["fault"]
    first_after = after[0] if after else t["commit"]
    if m is not None:  # measured by the members (`measured`): the figures the metrics endpoint has too
        first_after = m["after"][1]
        last_before = m["before"][1] if m["before"] is not None else last_before
        median_step = m["step_s"] if m["step_s"] is not None else median_step
    if t["fault"] - last_before > max(median_step, 0.0) + 0.05:
        # the group was idle before the fault: a fault plan held the rank at its step's gate
        # (with --follow, until the followers held that step): the failure starts at the fault
        last_before = t["fault"]
    t["resume"] = first_after
    order = ["fault", "detect", "fence", "agree", "wait", "claim", "build", "commit", "resume"]
    seen = [(k, t[k]) for k in order if k in t]
    phases = {}
    for (_, a), (name, b) in zip(seen, seen[1:], strict=False):
        phases[name] = max(0.0, b - a)
    # The claimed spare streams inside the build window: split it out.
    if "build" in phases:
        phases["stream"] = min(cur["stream_s"], phases["build"])
        phases["build"] -= phases["stream"]
    keys = list(PHASES)
    if "wait" in phases:  # a shrink: the wait for a spare before it (--spare-wait), its own phase
        keys.insert(keys.index("claim"), "wait")
    phases = {k: round(phases.get(k, 0.0), 4) for k in keys}
    downtime, note = first_after - last_before - median_step, None
    if downtime <= 0:  # the gap was no longer than a median step: a noisy step time hid the pause
        # (issue 54: a loaded machine reported 0.0). The members waited at least from the
        # fence to the commit: the coordinator's own time of it is the figure then, said so.
        downtime = t["commit"] - t.get("fence", t.get("detect", t["fault"]))
        note = ("the steps around the recovery took no longer than the median step (a noisy step time): "
                "the coordinator's fence-to-commit time instead")  # fmt: skip
        if downtime <= 0:
            note = "not measurable: the recovery left no gap in the commits and no fence-to-commit time"
    out = {
        "kind": cur["kind"],
        "rank": cur["rank"],
        "generation": cur.get("generation"),
        "downtime_s": round(max(0.0, downtime), 4),
        "phases": phases,
        "bytes_streamed": cur["bytes_streamed"],
        "spares": cur.get("spares", []),  # the spare(s) that took the lost rank(s)
    }
    if cur["kind"] == KINDS[0] and cur.get("spares"):  # how the spares got the state: streamed, or followed
        out["path"] = "follower" if cur.get("followers", 0) >= len(cur["spares"]) else "stream"
    if note is not None:
        out["downtime_note"] = note
    if "carried" in cur:
        out["carried"] = cur["carried"]  # virtual rank -> the survivor that runs its steps too
    if cur.get("fresh"):
        out["fresh_processes"] = cur["fresh"]  # no spare: the agents started these ranks afresh
    if "restart" in cur:  # the steps after the checkpoint are trained again: lost time too
        rs = cur["restart"]
        redone = rs.get("steps_redone") or 0
        out.update(rs, lost_s=round(out["downtime_s"] + redone * median_step, 4))
        out["phases"] = restart_phases(phases)
    return out


def restart_phases(p: dict[str, float]) -> dict[str, float]:
    """A cold restart's phases in its own words, the same total: detect; stop (fence the lost
    ranks, decide the cold path, stop the survivors' steps); start (the lost rank's process:
    a warm spare claimed at once, or a fresh process the agent starts for it, forked, its
    script run to the loop and registered, which is most of a cold restart on a host with no
    spare); load (the slowest member's read of its checkpoint part, where a live recovery
    streams); resume (the group rebuilt, up to the first step after the checkpoint's)."""
    return {"detect": p["detect"], "stop": round(p["fence"] + p["agree"], 4), "start": p["claim"],
            "load": p["stream"], "resume": round(p["build"] + p["commit"] + p["resume"], 4)}  # fmt: skip
