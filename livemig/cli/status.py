"""`livemig status`: read a job's keys and show them (table or JSON)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import timedelta
from typing import Any

from livemig.config import validate_job_name
from livemig.errors import ConfigError
from livemig.rdzv.client import EtcdClient, conform
from livemig.rdzv.keys import JobKeys
from livemig.rdzv.membership import GenState, Membership
from livemig.rdzv.security import add_arguments as add_security_arguments


def add_etcd_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--etcd",
        help="etcd endpoints https://HOST:PORT[,...] (default: $LIVEMIG_ETCD, or the local run of --job)",
    )
    add_security_arguments(p)
    p.add_argument(
        "--etcd-timeout",
        type=float,
        default=5.0,
        help="seconds an etcd call may take, failover included (default 5)",
    )


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("status", help="show a job's generation, members, spares and leader")
    s.add_argument("--job", required=True)
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.add_argument("--watch", type=float, nargs="?", const=1.0, metavar="SECONDS",
                   help="refresh every SECONDS (default 1) until the job ends or Ctrl-C: in place on a "
                        "terminal, else one block (with --json one line) per refresh")  # fmt: skip
    add_etcd_arguments(s)
    s.set_defaults(fn=cmd_status)


def cmd_status(a: argparse.Namespace) -> int:
    from livemig.agent.jobs import connect

    job = validate_job_name(a.job)
    if a.watch is not None and not 0.05 <= a.watch <= 3600:
        raise ConfigError(f"--watch {a.watch}: expected seconds between 0.05 and 3600")
    client = connect(job, a.etcd, timedelta(seconds=a.etcd_timeout))
    try:
        if a.watch is None:
            print(render(collect(client, job), a.json))
            return 0
        return watch(client, job, a.watch, a.json)
    finally:
        client.close()


def watch(client: EtcdClient, job: str, every: float, as_json: bool) -> int:
    """Refresh until the job has a result or Ctrl-C (exit 0 either way, at once: the
    sleep is the only wait besides one bounded etcd read)."""
    tty = sys.stdout.isatty()
    try:
        while True:
            info = collect(client, job)
            if as_json:
                text = json.dumps(_jsonable(info), sort_keys=True, default=repr)
            else:
                text = render(info, False)
                stamp = time.strftime("%H:%M:%S", time.localtime(info["read_at"]))
                text = f"{text}\n(every {every:g} s, {stamp}; Ctrl-C to stop)"
            if tty and not as_json:
                sys.stdout.write("\x1b[H\x1b[2J" + text + "\n")  # home, clear: in place
            else:
                sys.stdout.write(text + ("\n" if as_json else "\n\n"))
            sys.stdout.flush()
            if info["result"]:
                return 0
            time.sleep(every)
    except KeyboardInterrupt:
        return 0


def follow_text(f: dict | None) -> str:
    """A follow spare's status in a word or two: `following @ step S`, `warm (why)`, ..."""
    if not f:
        return "-"
    if f["state"] == "following":
        return f"following @ step {f.get('step', '?')}"
    why = f" ({f['reason']})" if f.get("reason") else ""
    return f"{f['state']}{why}"


def collect(client: EtcdClient, job: str) -> dict[str, Any]:
    keys = JobKeys(job)
    kvs, _ = client.get_prefix(keys.prefix)
    if not kvs:
        raise ConfigError(f"no job {job!r} in etcd at {client.describe()}: check the name (--job), or --etcd")
    by_key = {kv.key: kv for kv in kvs}
    m = Membership.from_kvs(by_key, keys)
    members = []
    for rank in sorted(m.members):
        mem = m.members[rank]
        reg = by_key.get(keys.member(rank))
        live = conform(reg.value, {}, {"state": (str,), "incarnation": (str,)}) if reg else None
        prog = by_key.get(keys.progress(rank))
        progress = (conform(prog.value, {}, {"step": (int,)}) if prog else None) or {}
        alive = bool(live and live.get("incarnation") == mem.incarnation)
        members.append(
            {
                "rank": rank,
                "host": mem.host,
                "pid": mem.pid,
                "incarnation": mem.incarnation,
                "state": (live or {}).get("state", "running") if alive else "missing",
                "step": progress.get("step"),
            }
        )
    spares = []
    for kv in kvs:
        if kv.key.startswith(keys.spares_prefix):
            s = conform(kv.value, {}, {"state": (str,), "host": (str,), "pid": (int,), "warmup_s": (int, float),
                                       "claim": (dict,), "device_mb": (int, float)})  # fmt: skip
            if s is None:
                continue
            sid = kv.key[len(keys.spares_prefix) :]
            fol = by_key.get(keys.follow(sid))  # a follow spare's own status (runtime/follow.py)
            follow = (
                conform(fol.value, {"state": (str,)}, {"step": (int,), "reason": (str,), "drops": (int,)})
                if fol
                else None
            )
            spares.append(
                {
                    "id": sid,
                    "follow": follow,
                    "state": s.get("state"),
                    "host": s.get("host"),
                    "pid": s.get("pid"),
                    "warmup_s": s.get("warmup_s"),
                    "device_mb": s.get("device_mb"),
                    "claim": s.get("claim"),
                }
            )
    nodes = []
    for kv in kvs:
        rest = kv.key[len(keys.nodes_prefix) :]
        if kv.key.startswith(keys.nodes_prefix) and rest.isdigit():
            n = conform(kv.value, {}, {"host": (str,), "pid": (int,)}) or {}
            ranks = [x["rank"] for x in members if m.members[x["rank"]].node == int(rest)]
            drain = by_key.get(keys.drain(int(rest)))  # SIGTERM or `livemig drain` (agent/drain.py)
            draining = bool(drain) or keys.drain_request(int(rest)) in by_key
            nodes.append({"node_rank": int(rest), "host": n.get("host"), "pid": n.get("pid"), "ranks": ranks,
                          "draining": draining})  # fmt: skip
    run = by_key.get(keys.run)
    leader = by_key.get(keys.leader)
    result = by_key.get(keys.result)
    mig_res = by_key.get(keys.migrate_result)
    return {
        "job": job,
        "generation": m.generation,
        # an ended run whose table never said so (interrupted: the agent writes the result)
        "state": (conform(result.value, {"state": (str,)}) or {}).get("state", m.state)
        if result is not None and m.state not in (GenState.DONE, GenState.FAILED)
        else m.state,
        "world_size": m.world_size,
        # a shrunk job (--min-nproc): processes training, and who runs each lost rank's steps
        "physical_world_size": len(m.members) if m.carried else m.world_size,
        "carried": {str(v): c for v, c in sorted(m.carried.items())},
        "members": members,
        "spares": spares,
        "run": conform(run.value, {}, {"nnodes": (int,), "nproc_per_node": (int,), "run_id": (str,)}) if run else None,
        "nodes": sorted(nodes, key=lambda n: n["node_rank"]),
        "leader": leader.value.decode(errors="replace") if leader else None,
        "fenced": sorted(k[len(keys.fenced_prefix) :] for k in by_key if k.startswith(keys.fenced_prefix)),
        "result": conform(result.value, {}) if result else None,
        "migration": {k: m.migration.get(k) for k in ("rank", "phase", "reason", "spare")} if m.migration else None,
        # a whole-job stop asked (`stop` key) or under way (the table's mark): runtime/stop.py
        "stopping": m.stop or (conform(by_key[keys.stop].value, {}) if keys.stop in by_key else None) or None,
        "last_migration": conform(mig_res.value, {}) if mig_res else None,
        "last_recovery": _last_recovery(by_key, keys),
        "read_at": time.time(),
    }


def _last_recovery(by_key: dict, keys: JobKeys) -> dict[str, Any] | None:
    """The last failure's recovery from the timeline: rank, generation and the phases up
    to its commit (the run report adds the resume and the downtime, from commit times)."""
    from livemig.agent.report import recoveries
    from livemig.coordinator.timeline import events_of

    recs = recoveries(events_of(by_key, keys), [], 0.0)
    if not recs:
        return None
    r = recs[-1]
    phases = {k: v for k, v in r["phases"].items() if k != "resume"}
    if r["kind"] == "restart":  # which path served it (docs/reliability.md)
        path = f"cold restart from the checkpoint of step {r.get('from_step')}, {r.get('steps_redone')} step(s) redone"
    else:
        path = "live, " + ("fresh process(es) from the agents" if r.get("fresh_processes") else "a warm spare")
    return {"rank": r["rank"], "generation": r["generation"], "spares": r["spares"], "phases": phases,
            "bytes_streamed": r["bytes_streamed"], "path": path}  # fmt: skip


def _jsonable(v: Any) -> Any:
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_jsonable(x) for x in v]
    return v


def render(info: dict[str, Any], as_json: bool) -> str:
    if as_json:
        # default=repr: a value someone wrote in etcd may hold bytes, or keys of mixed types
        return json.dumps(_jsonable(info), indent=2, sort_keys=True, default=repr)
    lines = [
        f"job {info['job']}  generation {info['generation']}  state {info['state']}  "
        f"world {info['world_size']}  leader {info['leader'] or '-'}",
    ]
    if info.get("carried"):
        who = ", ".join(f"rank {v} by rank {c}" for v, c in info["carried"].items())
        lines.append(f"shrunk: {info['physical_world_size']} processes run the {info['world_size']} ranks ({who})")
    if info["result"]:
        lines.append(f"result: {info['result']}")
    if info.get("stopping") and not info["result"]:
        lines.append(f"stopping at a checkpoint of the next step: {info['stopping'].get('reason', '')}")
    mig = info.get("migration")
    if mig and mig.get("phase") != "done":
        lines.append(f"migration of rank {mig['rank']} onto {mig['spare']}: {mig['phase']} ({mig['reason']})")
    last = info.get("last_migration")
    if last:
        lines.append(f"last migration: rank {last.get('rank')} {last.get('state')}"
                     + (f" ({last['reason']})" if last.get("reason") else ""))  # fmt: skip
    rec = info.get("last_recovery")
    if rec:
        ph = "  ".join(f"{k} {v:.3f}" for k, v in rec["phases"].items())
        onto = f" onto {', '.join(rec['spares'])}" if rec["spares"] else ""
        lines.append(f"last recovery: rank {rec['rank']}{onto} (generation {rec['generation']}, "
                     f"{rec.get('path', 'live')}): {ph} s")  # fmt: skip
    lines.append(f"{'RANK':>4}  {'STATE':<9} {'STEP':>6}  {'HOST':<16} {'PID':>7}  INCARNATION")
    for m in info["members"]:
        step = "-" if m["step"] is None else str(m["step"])
        lines.append(f"{m['rank']:>4}  {m['state']:<9} {step:>6}  {m['host']:<16} {m['pid']:>7}  {m['incarnation']}")
    if not info["members"]:
        lines.append("  (no members: the job has not formed)")
    run = info.get("run") or {}
    if run.get("nnodes", 1) > 1:
        lines.append(f"{'NODE':>4}  {'HOST':<16} {'PID':>7}  RANKS   (run {run.get('run_id')}, {run.get('nnodes')} "
                     f"nodes x {run.get('nproc_per_node')})")  # fmt: skip
        for n in info["nodes"]:
            drain = "  draining" if n.get("draining") else ""
            lines.append(f"{n['node_rank']:>4}  {n['host'] or '-':<16} {n['pid'] or 0:>7}  {n['ranks']}{drain}")
    lines.append(f"{'SPARE':<28} {'STATE':<9} {'WARMUP_S':>8}  {'HOST':<16} {'PID':>7}  FOLLOW")
    for s in info["spares"]:
        w = "-" if s["warmup_s"] is None else f"{s['warmup_s']:.2f}"
        state, host = s["state"] or "-", s["host"] or "-"
        lines.append(f"{s['id']:<28} {state:<9} {w:>8}  {host:<16} {s['pid'] or 0:>7}  {follow_text(s.get('follow'))}")
    if not info["spares"]:
        lines.append("  (no spares)")
    return "\n".join(lines)
