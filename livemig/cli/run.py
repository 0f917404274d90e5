"""`livemig run`: its flags, the run (agent/launcher.py), the fault-free reference of
`--verify`, and the summary printed at the end."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from dataclasses import replace
from datetime import timedelta
from typing import Any

from livemig import logs
from livemig.agent import report
from livemig.agent.drain import DRAIN_GRACE_S, STOPPED_EXIT, sigterm_default
from livemig.agent.jobs import refuse_duplicate, state_dir
from livemig.agent.launcher import run
from livemig.agent.run_config import RunConfig
from livemig.config import ENV_FOLLOW_LAG, ENV_SHRUNK_BOUND, ENV_STEP_PRINTS, ENV_VERIFY_DIR, Timeouts
from livemig.errors import ConfigError, LivemigError
from livemig.faults import IN_PROCESS_DURING, KINDS, PHASE_DURING, USAGE, parse_plan
from livemig.rdzv.security import add_arguments as add_security_arguments

OVERSUBSCRIBE = 4  # processes per core above which `livemig run` warns (each one is a Python with torch)


def print_summary(rep: dict[str, Any], reference: str | None = None) -> None:
    res = rep["result"] or {}
    median = rep["step_time_s_median"]
    median_s = f", median step {median * 1e3:.0f} ms" if median else ""  # none measured: not "0 ms"
    lines = [f"livemig: job {rep['job']} {res.get('state', '?')}"
             f"{': ' + res['reason'] if res.get('reason') else ''}; {rep['steps_completed']} steps in "
             f"{rep['wall_s']:.1f}s{median_s}"]  # fmt: skip
    for r in rep["recoveries"]:
        phases = "  ".join(f"{k} {v:.3f}" for k, v in r["phases"].items())
        what = f"recovery of rank {r['rank']}" if r["rank"] is not None else "rebuild of the group"
        fresh = [x for x in r.get("spares") or [] if x.startswith("fresh-")]  # started by the agent at the failure
        warm = [x for x in r.get("spares") or [] if x not in fresh]
        parts = ([f"spare {', '.join(warm)}"] if warm else []) + ([f"a fresh process ({', '.join(fresh)})"]
                                                                   if fresh else [])  # fmt: skip
        onto = " onto " + " and ".join(parts) if parts else ""
        how = f"{r['bytes_streamed'] / 2**20:.1f} MiB streamed"
        if r.get("path") == "follower":  # --follow: the spare held the group's state (runtime/follow.py)
            how += " (a follow spare: it held the parameters and optimizer state)"
        if r.get("kind") == "shrink":
            carried = ", ".join(f"rank {v} by {c}" for v, c in r["carried"].items())
            onto = (f"{onto}, the rest by the survivors (carried: {carried})" if r.get("spares") else
                    f" by the survivors (carried: {carried})")  # fmt: skip
            how = f"{'too few' if r.get('spares') else 'no'} spares: shrunk, same samples and global batch"
        if r.get("kind") == "restart":
            how = (f"cold restart from the checkpoint of step {r['from_step']}, {r['steps_redone']} step(s) "
                   f"redone ({r['lost_s']:.2f} s lost in all)")  # fmt: skip
        lines += [f"{what}{onto} (generation {r['generation']}): downtime {r['downtime_s']:.2f} s; {how}",
                  f"  phases (s): {phases}"]  # fmt: skip
        if r.get("downtime_note"):
            lines.append(f"  downtime: {r['downtime_note']}")
    if rep["recoveries"]:
        lines.append(
            "  (downtime = first group-wide commit after the recovery - last one before it - one median "
            "step; the phases time the fault to that commit, so they also hold the step's own work)"
        )
        if rep.get("spares_left") == 0:
            then = ("its agent would have started a fresh process" if rep.get("checkpoints")
                    else "failed the job")  # fmt: skip
            lines.append(f"  no spare of this run was left: a further failure would have waited --spare-wait, "
                         f"then {then}")  # fmt: skip
    sh = rep.get("shrunk")
    if sh and sh.get("degraded_steps"):
        cost = f", {sh['degraded_step_cost']:.2f}x the full-width step" if sh.get("degraded_step_cost") else ""
        lines.append(f"shrunk: {sh['physical_world_size']} processes ran the {sh['virtual_world_size']} ranks for "
                     f"the last {sh['degraded_steps']} step(s){cost}")  # fmt: skip
    if rep.get("rank_digests"):
        lines.append(f"state digest {rep['state_digest'][:16]}…  replicas identical: "
                     f"{'yes' if rep['replicas_identical'] else 'no'}")  # fmt: skip
    else:  # the digest of nothing, and "identical: no", would say something false
        lines.append("no final state: no rank finished the job")
    if rep.get("faults_not_fired"):
        lines.append(f"planned fault(s) that never fired (the run ended first): {', '.join(rep['faults_not_fired'])}")
    if reference is not None and (rep.get("result") or {}).get("state") == "failed":
        lines.append("bit-identical: not compared: the job failed")
    elif reference is not None:
        same = rep.get("bit_identical", reference == rep["state_digest"])
        differ = rep.get("ranks_differing", [])
        where = f"; rank(s) {differ} differ from the same rank of the fault-free run" if differ else ""
        if rep.get("exact_as"):
            where = f"; {rep['exact_as']}"
        lines.append(f"bit-identical: {'yes' if same else 'no'} (every rank's final state vs the same rank of "
                     f"a fault-free run{where})")  # fmt: skip
        dv = rep.get("diverged")
        if dv:
            lines.append(f"verify: first difference at step {dv['step']} on rank {dv['rank']}: {dv['why']}")
        if sh and not same:  # the GPU path's shrink (no full-width group: docs/architecture.md, Shrink)
            b = rep.get("shrunk_bound")
            held = (f"; every rank's parameters within {b['bound']:g} x max|param| of the fault-free run's: "
                    f"{'yes' if b['within'] else 'no'} (largest {b['max_rel']:.2g}, {b['ranks']} ranks, the "
                    f"carried ones' written by their carriers; {ENV_SHRUNK_BOUND})") if b else ""  # fmt: skip
            lines.append("verify: the job ran shrunk: where no full-width group held the carried ranks (NCCL, "
                         "LIVEMIG_SHRINK_DROP) its average summed the same gradients in another order, so bits may "
                         f"differ (docs/architecture.md, Shrink); on gloo they should not{held}")  # fmt: skip
        if rep.get("faults_not_fired"):
            lines.append("verify: not shown: the fault plan did not run in full, so nothing was recovered from it")
    logs.say(*lines)  # one write: agents sharing a pipe do not cut into each other's summary


def _files_here(limit: int = 5000) -> dict[str, int]:
    """Files under the working directory and their modification times (hidden directories and
    __pycache__ skipped; at most `limit` entries): what a --verify reference run wrote."""
    out: dict[str, int] = {}
    mine = os.path.realpath(state_dir())  # livemig's own logs and records, if they are under it
    own = {mine, *(os.path.join(mine, d) for d in ("runs", "jobs", "tls"))}  # it may be the working directory
    for root, dirs, files in os.walk("."):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"
                   and os.path.realpath(os.path.join(root, d)) not in own]  # fmt: skip
        for name in files:
            path = os.path.join(root, name)
            try:
                out[os.path.relpath(path)] = os.stat(path).st_mtime_ns
            except OSError:
                continue
            if len(out) >= limit:
                return out
    return out


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run a training script with workers, spares and a coordinator")
    p.add_argument("--nproc", type=int, help="workers on one node (the world size): --nnodes 1 --nproc-per-node N")
    p.add_argument("--nnodes", type=int, default=1, help="nodes of the job: one agent each, same command (default 1)")
    p.add_argument("--nproc-per-node", type=int, help="workers on each node (global rank = node rank x this + i)")
    p.add_argument("--node-rank", default="auto", help="this node's rank, or auto: the first free one (default)")
    p.add_argument("--node-leases", action="store_true", default=None,
                   help="this node's workers register under the agent's lease: one keep-alive per node at etcd's "
                        "leader instead of one per rank (large jobs; default $LIVEMIG_NODE_LEASES=1; "
                        "docs/reliability.md)")  # fmt: skip
    p.add_argument("--launch-id", default=None, metavar="ID",
                   help="one identity for every agent one launch starts (a Kubernetes Job's uid; default "
                        "$LIVEMIG_LAUNCH_ID): an agent of it arriving after its run finished exits 0 with the run "
                        "instead of starting a new one")  # fmt: skip
    p.add_argument("--host", help="address other hosts reach this node at (default $LIVEMIG_HOST, else the "
                                  "local address of the route to etcd; 127.0.0.1 with a local etcd)")  # fmt: skip
    p.add_argument("--spares", type=int, default=0, help="warm spares to start (default 0)")
    p.add_argument("--follow", type=int, default=0, metavar="K",
                   help="of the spares, K follow the job's state step by step, so that taking a lost rank streams "
                        "only its own state (plain data parallel; default 0; docs/operations.md)")  # fmt: skip
    p.add_argument("--follow-lag", type=int, default=None, metavar="N",
                   help="a follower more than N steps behind drops to warm standby (default 4; "
                        "$LIVEMIG_FOLLOW_LAG; give the same on every node)")  # fmt: skip
    p.add_argument("--coordinators", type=int, default=1, help="coordinator candidates (default 1)")
    p.add_argument("--job", default="", help="job name (default: the script's name)")
    p.add_argument("--etcd", help="etcd endpoints; default: start an embedded etcd for this run")
    p.add_argument("--etcd-bin", help="etcd binary for the embedded etcd")
    p.add_argument("--etcd-members", type=int, default=1, help="embedded etcd cluster size (default 1; 3 for HA)")
    add_security_arguments(p)
    p.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="PLAN",
        help=f"a fault plan, {USAGE}; KIND: {', '.join(KINDS)}; a kill's WHEN inside a step: "
        f"{'|'.join(IN_PROCESS_DURING)}, in a recovery: {'|'.join(PHASE_DURING)} (livemig/faults.py); repeatable",
    )
    p.add_argument("--report", help="write the run report (JSON) here")
    p.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics of the job on this port (0: any free "
        "one; needs pip install 'livemig[metrics]'; default off; docs/operations.md, Metrics)",
    )
    p.add_argument(
        "--checkpoint-dir",
        help="write checkpoints of every rank's state here in the background "
        "(torch.distributed.checkpoint; docs/operations.md, Checkpoints)",
    )
    p.add_argument("--checkpoint-every", type=int, help="checkpoint every N steps (needs --checkpoint-dir)")
    p.add_argument("--checkpoint-interval", type=float, metavar="SECONDS",
                   help="or checkpoint every SECONDS (the ranks agree every 10 steps whether one is due)")  # fmt: skip
    p.add_argument("--checkpoint-keep", type=int, default=2, help="complete checkpoints kept (default 2)")
    p.add_argument("--max-restarts", type=int, default=None,
                   help="cold restarts from the newest checkpoint when live recovery cannot serve a "
                        "failure (default 3; needs --checkpoint-dir)")  # fmt: skip
    p.add_argument("--recovery", choices=("live", "cold"), default="live",
                   help="cold: no live recovery, every failure restarts from the newest checkpoint (to "
                        "measure or rehearse the cold path; needs --checkpoint-dir)")  # fmt: skip
    p.add_argument("--resume-from", metavar="DIR",
                   help="start from the newest complete checkpoint in DIR (same script; skipped "
                        "damaged ones are named)")  # fmt: skip
    p.add_argument("--events", help="append the job's events here, one JSON line each (docs/operations.md, Events)")
    p.add_argument(
        "--verify",
        action="store_true",
        help="also run the job without faults or spares and compare final state digests",
    )
    p.add_argument("--log-every", type=int, default=10, help="print progress every N steps (default 10)")
    p.add_argument("--lease-ttl", type=float, help="lease TTL seconds (default 5, or $LIVEMIG_LEASE_TTL)")
    p.add_argument(
        "--collective-timeout",
        type=float,
        help="watchdog timeout of a collective / group build, s (default 30)",
    )
    p.add_argument("--spare-wait", type=float, help="wait this long for a warm spare, s (default 60)")
    p.add_argument("--min-nproc", type=int, default=None,
                   help="with no warm spare, train on the survivors while at least this many ranks remain: "
                        "they run the lost ranks' steps too, same samples and global batch (default: the "
                        "world size, no shrink; data parallel and ZeRO-1, not FSDP2; docs/architecture.md, "
                        "Shrink)")  # fmt: skip
    p.add_argument(
        "--shrink-wait",
        type=float,
        default=None,
        help="wait this long for a warm spare before shrinking, s (default 5)",
    )
    p.add_argument("--max-wall", type=float, default=3600.0, help="abort the run after this long, s")
    p.add_argument("--on-sigterm", choices=("drain", "stop"), default=None,
                   help="SIGTERM to this node's agent of a job of several nodes: drain (hand its ranks to "
                        "spares elsewhere, or shrink within --min-nproc, and exit 0) or stop the job; default "
                        "drain under Slurm or Kubernetes (from their environment), else stop")  # fmt: skip
    p.add_argument(
        "--drain-grace",
        type=float,
        default=DRAIN_GRACE_S,
        help=f"s a drain may take before the job is stopped as before (default {DRAIN_GRACE_S:.0f})",
    )
    p.add_argument("--on-error", default="",
                   help="an exception in the training function: fail (default: end the job at once, no spare "
                        "used) or replace:N (recover on a spare, at most N times); $LIVEMIG_ON_ERROR")  # fmt: skip
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(fn=cmd_run)


def checkpoint_settings(a: argparse.Namespace) -> Any:
    """--checkpoint-dir/-every/-keep as checkpoints.Settings (None: no checkpoints); refused
    with one line where the directory cannot be one."""
    from livemig.checkpoint_dir import Settings

    every, interval = a.checkpoint_every, a.checkpoint_interval
    if a.checkpoint_dir is None:
        if every is not None or interval is not None:
            raise ConfigError("--checkpoint-every/--checkpoint-interval need --checkpoint-dir DIR, where the "
                              "checkpoints go")  # fmt: skip
        return None
    if (every is None) == (interval is None):
        raise ConfigError("--checkpoint-dir needs one of --checkpoint-every N (steps) or --checkpoint-interval "
                          "SECONDS")  # fmt: skip
    if every is not None and every < 1:
        raise ConfigError(f"--checkpoint-every {every}: expected 1 or more steps")
    if interval is not None and not interval > 0:
        raise ConfigError(f"--checkpoint-interval {interval:g}: expected seconds above 0")
    if a.max_restarts is not None and a.max_restarts < 0:
        raise ConfigError(f"--max-restarts {a.max_restarts}: expected 0 or more")
    if a.checkpoint_keep < 1:
        raise ConfigError(f"--checkpoint-keep {a.checkpoint_keep}: keep 1 or more")
    return Settings(os.path.abspath(a.checkpoint_dir), every or 0, a.checkpoint_keep, interval or 0.0)


def cmd_run(a: argparse.Namespace) -> int:
    logs.stacks_on_sigquit()
    t = Timeouts.from_env()
    t = replace(
        t,
        lease_ttl=timedelta(seconds=a.lease_ttl) if a.lease_ttl else t.lease_ttl,
        collective=timedelta(seconds=a.collective_timeout) if a.collective_timeout else t.collective,
        spare_wait=timedelta(seconds=a.spare_wait) if a.spare_wait else t.spare_wait,
    )
    if t.spare_wait_s < t.spare_wait.total_seconds():
        print(f"livemig: warning: --spare-wait/LIVEMIG_SPARE_WAIT {t.spare_wait.total_seconds():g}s is not below "
              f"LIVEMIG_RECOVERY_TIMEOUT {t.recovery.total_seconds():g}s: a spare is waited for "
              f"{t.spare_wait_s:g}s, so the job fails saying no spare came before its members give up",
              file=sys.stderr)  # fmt: skip
    if (a.nproc is None) == (a.nproc_per_node is None):
        raise ConfigError("give --nproc N (one node) or --nnodes NN --nproc-per-node P")
    if a.nproc is not None and a.nnodes != 1:
        raise ConfigError("--nproc is one node's world: with --nnodes, give --nproc-per-node")
    world = a.nproc if a.nproc is not None else a.nnodes * a.nproc_per_node
    if a.node_rank == "auto":
        node_rank = None
    elif a.node_rank.isdigit():
        node_rank = int(a.node_rank)
    else:
        raise ConfigError(f"--node-rank {a.node_rank!r}: expected a number or auto")
    if a.min_nproc is not None and not 1 <= a.min_nproc <= world:
        raise ConfigError(f"--min-nproc {a.min_nproc}: expected 1..{world} (the world size)")
    if a.shrink_wait is not None and a.shrink_wait < 0:
        raise ConfigError(f"--shrink-wait {a.shrink_wait:g}: expected 0 or more seconds")
    if a.follow_lag is not None:
        if a.follow_lag < 1:
            raise ConfigError(f"--follow-lag {a.follow_lag}: expected 1 or more steps")
        os.environ[ENV_FOLLOW_LAG] = str(a.follow_lag)  # the workers' feeds and the followers read it
    cfg = RunConfig(script=a.script, args=a.args, nproc=world, spares=a.spares, follow=a.follow, nnodes=a.nnodes,
                    node_rank=node_rank, host=a.host,
                    coordinators=a.coordinators, job=a.job, etcd=a.etcd, etcd_bin=a.etcd_bin,
                    etcd_members=a.etcd_members,
                    faults=parse_plan(a.fault), report=a.report, timeouts=t,
                    log_every=a.log_every, max_wall=a.max_wall, on_error=a.on_error,
                    metrics_port=a.metrics_port, events=a.events, checkpoint=checkpoint_settings(a),
                    resume_from=a.resume_from, max_restarts=a.max_restarts, recovery=a.recovery,
                    min_nproc=a.min_nproc, shrink_wait=a.shrink_wait,
                    on_sigterm=a.on_sigterm or sigterm_default(), drain_grace=a.drain_grace,
                    **({"launch_id": a.launch_id} if a.launch_id is not None else {}),
                    **({"node_leases": True} if a.node_leases else {}))  # fmt: skip
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if cfg.nproc_per_node + cfg.spares > OVERSUBSCRIBE * cores:
        print(f"livemig: warning: {cfg.nproc_per_node} workers and {cfg.spares} spare(s) on {cores} core(s) of this "
              "host: steps will crawl and timeouts may fire (fewer per node, or more nodes)",
              file=sys.stderr)  # fmt: skip

    def verify() -> dict[str, Any]:
        """The fault-free reference: the whole world as local processes with an embedded etcd,
        each rank's mirror where the job has it (the buddy on the next node)."""
        print("livemig: reference run without faults or spares ...", flush=True)
        ref_cfg = RunConfig(script=a.script, args=a.args, nproc=world, job=cfg.job + "-ref",
                            etcd=a.etcd if a.nnodes == 1 else None, etcd_bin=a.etcd_bin, timeouts=t, quiet=True,
                            max_wall=a.max_wall, buddy_stride=cfg.nproc_per_node if a.nnodes > 1 else 0)  # fmt: skip
        ref = run(ref_cfg)
        if (ref["result"] or {}).get("state") == "interrupted":
            raise KeyboardInterrupt()  # the CLI's one line and exit 130; the reference left nothing behind
        if (ref["result"] or {}).get("state") != "done":
            raise LivemigError(f"the fault-free reference run failed: {ref['result']}")
        return ref

    if not a.etcd:
        refuse_duplicate(cfg.job)  # before the reference run, not after it
    # one node: the reference first (as before); several: after the job, on this node, so that
    # no agent holds the others up while they wait to join
    if a.verify:
        os.environ[ENV_STEP_PRINTS] = (
            "1"  # both runs fingerprint every step: a mismatch names where (runtime/prints.py)
        )
    before = _files_here() if a.verify and a.nnodes == 1 else {}
    values = tempfile.mkdtemp(prefix="livemig-verify-") if a.verify and a.nnodes == 1 else ""
    try:
        return _run_and_verify(a, cfg, world, verify, before, values)
    finally:
        if values:
            shutil.rmtree(values, ignore_errors=True)


def _run_and_verify(a: argparse.Namespace, cfg: RunConfig, world: int, verify: Any, before: dict[str, int],
                    values: str) -> int:  # fmt: skip
    """The reference (--verify, one node), the run, the comparison, the summary; `values`: where
    both runs write each rank's final values (a shrunk run's bound)."""
    reference = None
    if values:
        os.environ[ENV_VERIFY_DIR] = os.path.join(values, "ref")
    ref = verify() if a.verify and a.nnodes == 1 else None
    if values:
        os.environ[ENV_VERIFY_DIR] = os.path.join(values, "run")
    written = sorted(k for k, v in _files_here().items() if before.get(k) != v) if ref is not None else []
    if written:
        print(f"livemig: warning: the reference run wrote {', '.join(written[:3])}{' ...' if len(written) > 3 else ''} "
              "under the working directory: a script that loads its own file at start (a snapshot it resumes "
              "from) would start the faulted run from the reference's; give each run its own path",
              file=sys.stderr)  # fmt: skip
    rep = run(cfg)
    if a.verify and a.nnodes > 1:
        ref = verify()
    if ref is not None:
        reference = ref["state_digest"]
    if reference is not None:
        rep["reference_digest"] = reference
        rep["bit_identical"] = reference == rep["state_digest"]
        rep["ranks_differing"] = report.differing_ranks(ref["rank_digests"], rep["rank_digests"])
        if not rep["bit_identical"] and ref is not None:
            rep["diverged"] = report.divergence(ref.get("step_prints") or {}, rep.get("step_prints") or {},
                                                rep.get("faults_injected") or [])  # fmt: skip
        if not rep["bit_identical"] and rep.get("shrunk") and values:
            rep["shrunk_bound"] = shrunk_bound(os.path.join(values, "ref"), os.path.join(values, "run"), world)
            if zero1_shrunk_exact(rep, ref, rep["shrunk_bound"]):
                rep["bit_identical"], rep["exact_as"] = True, ZERO1_SHRUNK_EXACT
                rep["ranks_differing"], rep["diverged"] = [], None
            elif rep.get("diverged"):  # expected there: not a rank's unregistered state
                rep["diverged"]["why"] = (
                    "the job ran shrunk: its average sums the same gradients in another order "
                    "than the fault-free run's, so bits part from the first shrunk step on"
                )
    if a.report:
        with open(a.report, "w") as f:
            json.dump(rep, f, indent=2)
    print_summary(rep, reference)
    if (rep["result"] or {}).get("state") == "interrupted":
        return 130  # as a shell reports a process ended by Ctrl-C
    if (rep["result"] or {}).get("state") == "stopped":  # the whole job stopped at a checkpoint (agent/drain.py)
        where = cfg.checkpoint.dir if cfg.checkpoint is not None else "--checkpoint-dir"
        print(f"livemig: stopped at the checkpoint of step {rep['result'].get('step')} in {where}: run the job "
              "again with the same --checkpoint-dir to resume there", file=sys.stderr)  # fmt: skip
        return STOPPED_EXIT
    ok = (rep["result"] or {}).get("state") in ("done", "drained")  # drained: this node left, the job goes on
    if not ok and (rep["result"] or {}).get("traceback"):
        print(rep["result"]["traceback"], file=sys.stderr)  # a bug in the training function
    elif not ok and (rep["result"] or {}).get("log_tail"):
        print(rep["result"]["log_tail"], file=sys.stderr)
    exact = rep.get("bit_identical", True) or bool((rep.get("shrunk_bound") or {}).get("within"))
    verified = exact and not (a.verify and rep.get("faults_not_fired"))
    return 0 if ok and verified else 1


ZERO1_SHRUNK_EXACT = ("ended shrunk: the model, every optimizer shard by index, each mirror and every rank's "
                      "parameters and buffers equal the fault-free run's; its ranks hold other mirrors than at "
                      "full width")  # fmt: skip


def zero1_shrunk_exact(rep: dict[str, Any], ref: dict[str, Any], bound: dict[str, Any] | None) -> bool:
    """Is a ZeRO-1 job that ended shrunk exact? Its rank digests cannot say: a carrier holds the
    carried rank's shard and the mirrors sit on other ranks than at full width. Exact when the
    model, every optimizer shard by index (the job's ZeRO-1 digest), each mirror equal to its
    shard, and every rank's values (written by its carrier for a carried rank) are the fault-free
    run's."""
    z, zref = rep.get("zero1") or {}, ref.get("zero1") or {}
    return bool((rep.get("shrunk") or {}).get("carried") and z and z.get("state_digest") == zref.get("state_digest")
                and z.get("mirrors_exact") and bound is not None and bound["max_rel"] == 0)  # fmt: skip


SHRUNK_BOUND = 1e-6  # docs/architecture.md, "Shrink": a shrunk average sums the same gradients in another order


def _bound() -> float:
    raw = os.environ.get(ENV_SHRUNK_BOUND, str(SHRUNK_BOUND))
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"{ENV_SHRUNK_BOUND}={raw!r}: expected a number (a relative bound, e.g. 1e-6)") from None


def shrunk_bound(ref_dir: str, run_dir: str, world: int) -> dict[str, Any] | None:
    """A shrunk run against its reference, rank by rank (each carried rank's values written by its
    carrier): the largest |run - ref| over max|ref|, and whether every rank is within the bound.
    None when a rank's values are missing on either side (a run on several nodes)."""
    import torch

    bound, worst = _bound(), 0.0
    for r in range(world):
        paths = [os.path.join(d, f"final-{r}.pt") for d in (ref_dir, run_dir)]
        if not all(os.path.exists(p) for p in paths):
            return None
        want, got = (torch.load(p, weights_only=True) for p in paths)
        if want.shape != got.shape:
            return {"within": False, "max_rel": float("inf"), "bound": bound, "ranks": world}
        scale = float(want.abs().max()) if want.numel() else 0.0
        diff = float((got - want).abs().max()) if want.numel() else 0.0
        worst = max(worst, diff / scale if scale > 0 else diff)
    return {"within": worst <= bound, "max_rel": worst, "bound": bound, "ranks": world}
