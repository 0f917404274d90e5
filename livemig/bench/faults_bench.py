"""`livemig bench faults`: the reliability matrix, run, not claimed.

Each case runs the reference workload (examples/mlp.py, shrunk to two
layers so a case takes seconds) under `livemig run` with a fault plan, and
checks: the job completed every step, the final state digest equals the
fault-free run's with the same world size, the expected recoveries
happened, and the case's own expectation (a fenced process exited by
itself, a corrupted chunk was refetched, ...). tests/faults runs the same
cases.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from livemig.agent.launcher import run
from livemig.agent.run_config import RunConfig
from livemig.config import Role, Timeouts
from livemig.faults import parse_fault
from livemig.references import References

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MLP = os.path.join(ROOT, "examples", "mlp.py")
STEPS = 40
WORKLOAD = ["--steps", str(STEPS), "--layers", "2", "--batch", "32"]


def _log_of(rep: dict, name: str) -> str:
    for p in rep.get("processes", []):
        if p["name"] == name:
            try:
                with open(p["log"]) as f:
                    return f.read()
            except OSError:
                return ""
    return ""


def _exit(rep: dict, name: str) -> int | None:
    return next((p["exit_code"] for p in rep.get("processes", []) if p["name"] == name), None)


@dataclass
class Case:
    name: str
    what: str
    nproc: int
    spares: int
    faults: list[str]
    recoveries: tuple[int, int] = (1, 1)  # allowed range
    coordinators: int = 1
    etcd_members: int = 1
    lease_ttl: float = 2.0  # 1 s proved too tight while five processes import torch on 2 cores
    check: Callable[[dict], str] | None = None  # returns "" if fine, else what went wrong
    slow: bool = False  # skipped by CI's quick subset (LIVEMIG_FAULTS_QUICK=1)
    needs_root: bool = False  # network namespaces: root and iproute2
    tags: list[str] = field(default_factory=list)
    script: str = MLP
    args: list[str] = field(default_factory=lambda: list(WORKLOAD))


def _fenced_self_stop(rep: dict) -> str:
    code = _exit(rep, "worker-1")
    log = _log_of(rep, "worker-1")
    if code != 3 or "must stop" not in log:
        return f"cut-off worker exited {code}, expected 3 with 'must stop' in its log"
    return ""


def _refetched(rep: dict) -> str:
    logs = "".join(_log_of(rep, p["name"]) for p in rep.get("processes", []) if p["role"] == Role.SPARE)
    return "" if "chunk failed its checksum; refetching" in logs else "no corrupted chunk was detected"


def _spare_replaced(rep: dict) -> str:
    dead = [p for p in rep.get("processes", []) if p["role"] == Role.SPARE and p["exit_code"] == -9]
    return "" if dead else "no claimed spare was killed (the fault did not land)"


def _coordinator_took_over(rep: dict) -> str:
    dead = [p for p in rep.get("processes", []) if p["role"] == Role.COORDINATOR and p["exit_code"] == -9]
    return "" if dead else "the leader coordinator was not killed"


MATRIX: list[Case] = [
    Case("kill_between_steps", "SIGKILL a worker between steps", 2, 1, ["kill:rank=1:step=8"]),
    Case("kill_in_collective", "SIGKILL a worker inside a collective", 2, 1,
         ["kill:rank=1:step=8:during=allreduce"]),
    Case("hang_fenced", "SIGSTOP a worker past its lease; SIGCONT: it stops itself", 2, 1,
         ["hang:rank=1:step=6:resume=4"], check=_fenced_self_stop),
    Case("source_killed_streaming", "SIGKILL a source peer while it streams to the spare", 3, 2,
         ["kill:rank=2:step=8", "kill:rank=0:step=8:during=stream"], recoveries=(1, 2)),
    Case("spare_killed_streaming", "SIGKILL the claimed spare during the transfer", 2, 2,
         ["kill:rank=1:step=8", "spare-kill:step=8:during=stream"], check=_spare_replaced),
    *[Case(f"coordinator_killed_{ph}", f"SIGKILL the leader coordinator at phase {ph}", 2, 1,
           ["kill:rank=1:step=8", f"coordinator-kill:step=8:during={ph}"], coordinators=2,
           check=_coordinator_took_over, slow=ph in ("fence", "commit"))
      for ph in ("fence", "claim", "build", "commit")],
    Case("etcd_member_killed_training", "SIGKILL 1 of 3 etcd members during training", 2, 1,
         ["etcd-kill:member=0:step=5"], recoveries=(0, 0), etcd_members=3, lease_ttl=3.0),
    Case("etcd_member_killed_recovery", "SIGKILL 1 of 3 etcd members during a recovery", 2, 1,
         ["kill:rank=1:step=8", "etcd-kill:member=1:step=8:during=claim"], etcd_members=3, lease_ttl=3.0,
         slow=True),
    Case("two_at_once", "two workers fail at once, two spares", 3, 2,
         ["kill:rank=1:step=8", "kill:rank=2:step=8"], recoveries=(1, 2)),
    Case("corrupt_chunk", "a transfer chunk corrupted in flight", 2, 1,
         ["corrupt:rank=0:step=0", "kill:rank=1:step=8"], check=_refetched),
    Case("partition", "cut a worker off peers and etcd (own netns, veth down); heal: it stops itself", 2, 1,
         ["partition:rank=1:step=8:heal=4"], check=_fenced_self_stop, needs_root=True),
    Case("slow_worker", "a worker made 3x slower (no failure: nothing to recover)", 2, 0,
         ["slow:rank=1:step=4:factor=3"], recoveries=(0, 0)),
]  # fmt: skip


def run_case(case: Case, refs: References) -> dict[str, Any]:
    t = Timeouts(lease_ttl=timedelta(seconds=case.lease_ttl), collective=timedelta(seconds=30),
                 recovery=timedelta(seconds=60), spare_wait=timedelta(seconds=15))  # fmt: skip
    cfg = RunConfig(script=case.script, args=case.args, nproc=case.nproc, spares=case.spares,
                    coordinators=case.coordinators, etcd_members=case.etcd_members,
                    job=f"f-{case.name[:40]}-{uuid.uuid4().hex[:4]}", timeouts=t, quiet=True,
                    faults=[parse_fault(f) for f in case.faults], max_wall=300)  # fmt: skip
    t0 = time.monotonic()
    rep = run(cfg)
    wall = time.monotonic() - t0
    ref = refs.get(case.nproc, case.script, case.args).digest
    done = (rep["result"] or {}).get("state") == "done"
    notes = []
    if not done:
        notes.append(f"result {rep['result']}")
    want_steps = int(case.args[case.args.index("--steps") + 1])
    if rep["steps_completed"] != want_steps:
        notes.append(f"{rep['steps_completed']}/{want_steps} steps")
    identical = rep["state_digest"] == ref and rep["replicas_identical"]
    if not identical:
        notes.append("final state differs from the fault-free run")
    n = len(rep["recoveries"])
    lo, hi = case.recoveries
    if not lo <= n <= hi:
        notes.append(f"{n} recoveries, expected {lo}..{hi}")
    missing = [f for f in case.faults if not parse_fault(f).in_process  # a worker kills itself: not the agent
               and not any(i["kind"] == f.split(":")[0] for i in rep.get("faults_injected", []))]  # fmt: skip
    if missing:
        notes.append(f"fault(s) not injected: {missing}")
    if case.check and done:
        extra = case.check(rep)
        if extra:
            notes.append(extra)
    downtime = max((r["downtime_s"] for r in rep["recoveries"]), default=None)
    injected_at = ", ".join(f"{i['kind']}@{i['step']}{'/' + i['during'] if i.get('during') else ''}"
                            for i in rep.get("faults_injected", []))  # fmt: skip
    return {
        "case": case.name, "what": case.what, "injected_at": injected_at or "in-process",
        "recovered": done, "steps_completed": rep["steps_completed"], "bit_identical": identical,
        "recoveries": n, "downtime_s": downtime, "wall_s": wall, "ok": not notes,
        "notes": "; ".join(notes), "report": rep,
    }  # fmt: skip


STATEFUL = os.path.join(ROOT, "examples", "stateful.py")


def exact_grid() -> list[Case]:
    """The exactness grid (`--grid exact`): examples/stateful.py (buffers, local= state,
    LR and weight-decay schedules stepped after ctx.step()) on both paths, both model
    kinds, 2 and 3 ranks, a kill in each phase a fault plan reaches, inside the LR
    warm-up (step 3) and after it (step 9), and a planned migration after steps 2 and 5;
    every rank compared with the same rank of the fault-free run.
    tests/e2e/test_exact_state.py runs a sample of it."""
    cases = []
    for nproc in (2, 3):
        for sharding in ("", "zero1"):
            for model in ("cnn", "transformer"):
                points = ["", "allreduce", "before_commit", "after_step"] + (["gather"] if sharding else [])
                for during in points:
                    for step in (3, 9):
                        rank = (step + len(during)) % nproc
                        fault = f"kill:rank={rank}:step={step}" + (f":during={during}" if during else "")
                        args = ["--steps", "16", "--model", model] + (["--sharding", sharding] if sharding else [])
                        name = f"exact-{nproc}-{sharding or 'dp'}-{model}-{during or 'between'}-{step}"
                        cases.append(Case(name, f"kill rank {rank} at {during or 'a boundary'} of step {step}",
                                          nproc, 1, [fault], script=STATEFUL, args=args))  # fmt: skip
                for step in (2, 5):  # the same grid for a planned migration
                    rank = step % nproc
                    args = ["--steps", "16", "--model", model] + (["--sharding", sharding] if sharding else [])
                    cases.append(Case(f"exact-{nproc}-{sharding or 'dp'}-{model}-migrate-{step}",
                                      f"migrate rank {rank} after step {step}", nproc, 1,
                                      [f"migrate:rank={rank}:step={step}"], recoveries=(0, 0),
                                      script=STATEFUL, args=args, check=_migration_done))  # fmt: skip
    return cases


def _migration_done(rep: dict) -> str:
    outcomes = [m.get("outcome") for m in rep.get("migrations") or []]
    return "" if outcomes == ["done"] else f"migration outcomes {outcomes}, expected one done"


def _migration_recorded(rep: dict) -> str:
    migs = rep.get("migrations") or []
    if not migs:
        return "no planned migration was recorded (the migrate fault did not land)"
    return ""


def migration_grid() -> list[Case]:
    """Failures inside a planned migration (`--grid migration`): a worker of the group, or
    the spare moving in, killed while the spare loads its snapshot, as it catches up, or
    at a step in the middle of it. The migration may complete or be given up; either way
    the job must end with every step and the fault-free state, with a second spare for
    the failure. 120 steps of examples/mlp.py: long enough for a warm spare to move in."""
    args = ["--steps", "120", "--layers", "2", "--batch", "32"]
    move = "migrate:rank=1:step=24"  # after the start-up target's warm spare (before step 20)
    plans = [
        ("peer-killed-at-snapshot", "kill the other worker as the spare loads its snapshot", 2,
         [move, "kill:rank=0:step=24:during=snapshot"]),
        ("peer-killed-at-catchup", "kill the other worker as the spare has caught up", 2,
         [move, "kill:rank=0:step=24:during=catchup"]),
        ("incoming-killed-at-catchup", "kill rank 1's incoming holder as it has caught up", 2,
         [move, "kill:rank=1:step=24:during=catchup"]),
        ("peer-killed-mid-migration", "kill a worker 3 steps into the migration, 3 ranks", 3,
         [move, "kill:rank=2:step=27"]),
    ]  # fmt: skip
    return [Case(f"migration-{name}", what, nproc, 2, faults, recoveries=(1, 2), check=_migration_recorded, args=args)
            for name, what, nproc, faults in plans]  # fmt: skip


PORT = os.path.join(ROOT, "examples", "ddp_port.py")
SEQ_STEPS = 60


def _sequence(seed: int) -> tuple[int, list[str], str, list[str]]:
    """One seeded sequence of failures and migrations: (world size, fault plan, description,
    extra script arguments). Plain data parallel, or ZeRO-1 (`--sharding zero1`) in about a
    third of the seeds. Up to three events, 9-13 steps apart (the next lands once the last is
    resolved, whatever the spares' warm-up), among: a kill, a kill inside the step's allreduce, a
    kill after the average with the killed rank's mirror losing the average (one survivor a step
    behind, the lost rank's local state on it: the split the matrix's quick row once hung on), a
    hang (SIGSTOP: found by its lease), a planned migration, kills of two ranks on consecutive
    steps, a kill of the spare claimed by the recovery a kill started, as it pulls the state. Only
    what the spares can serve: a second rank killed inside that recovery would take a rank's local
    state with its mirror (both ranks of the pair are neighbours in a world of 2 or 3), which no
    live path recovers; a rank carries at most one in-process fault (faults.parse_plan)."""
    import random

    rnd = random.Random(seed)
    nproc = rnd.choice((2, 3))
    extra = ["--sharding", "zero1"] if rnd.random() < 0.35 else []
    faults, what, step = [], [], rnd.randint(4, 10)
    inproc: set[int] = set()
    while step < SEQ_STEPS - 8 and len(what) < 3:
        kind = rnd.choice(("kill", "kill", "hang", "migrate", "migrate", "consecutive", "in-recovery",
                           "in-collective", "split-commit"))  # fmt: skip
        r, other = rnd.sample(range(nproc), 2)
        mirror = (r + 1) % nproc
        if (kind == "in-collective" and r in inproc) or (kind == "split-commit" and {r, mirror} & inproc):
            kind = "kill"
        if kind == "consecutive":
            faults += [f"kill:rank={r}:step={step}", f"kill:rank={other}:step={step + 1}"]
        elif kind == "in-recovery":  # the spare claimed for r killed as it pulls r's state: another takes r
            faults += [f"kill:rank={r}:step={step}", f"spare-kill:step={step}:during=stream"]
        elif kind == "in-collective":
            faults.append(f"kill:rank={r}:step={step}:during=allreduce")
            inproc.add(r)
        elif kind == "split-commit":
            faults += [f"kill:rank={r}:step={step}:during=before_commit", f"drop_avg:rank={mirror}:step={step}"]
            inproc |= {r, mirror}
        else:
            faults.append(f"{kind}:rank={r}:step={step}")
        what.append(f"{kind}@{step}")
        step += rnd.randint(9, 13)
    return nproc, faults, ("zero1: " if extra else "") + " ".join(what), extra


def _sequence_landed(rep: dict) -> str:
    """A migration may be given up for a failure that lands inside it, never for want of time."""
    late = [m for m in rep.get("migrations") or [] if "finished first" in str(m.get("aborted", ""))]
    return "a migration was given up: the job finished first" if late else ""


def sequences_grid(seeds: int = 20) -> list[Case]:
    """Seeded random sequences (`--grid sequences --seeds N`) of kills (between steps, inside
    the allreduce, after it with the mirror a step behind), hangs and planned migrations on
    examples/ddp_port.py (per-rank seed, accumulation, clipping, a hand-set lr, a prefetched
    batch under local=), plain or ZeRO-1, each checked bit-identical with the fault-free run;
    one spare per event that uses one."""
    args = ["--steps", str(SEQ_STEPS), "--step-ms", "20"]
    cases = []
    for seed in range(seeds):
        nproc, faults, what, extra = _sequence(seed)
        spares = len(faults)  # each fault takes at most one spare (an aborted migration gives its back)
        cases.append(Case(f"sequence-{seed}", what, nproc, spares, faults, recoveries=(0, len(faults)),
                          script=PORT, args=[*args, *extra], check=_sequence_landed))  # fmt: skip
    return cases


FSDP2_LM = os.path.join(ROOT, "examples", "fsdp2_lm.py")


def fsdp2_grid() -> list[Case]:
    """The FSDP2 grid (`--grid fsdp2`): examples/fsdp2_lm.py (TinyGPT, clipping, warm-up +
    cosine lr by hand, a DataLoader) under HSDP 2 x 2 with one spare: kills between steps and
    inside each FSDP2 collective, a SIGSTOP hang found by its lease, a wedged training thread, a
    broken link, a planned migration, two kills in one run, bf16 mixed precision and
    reshard_after_forward=False; plain FSDP over 3 ranks (the shard from its mirror): a kill, a
    kill inside a reduce-scatter, a migration. Every case bit-identical to its fault-free run."""
    hsdp = ["--steps", "20"]
    cases = [Case("fsdp2-kill-between", "kill rank 3 between steps", 4, 1, ["kill:rank=3:step=6"])]
    for i, during in enumerate(("fsdp_allgather", "fsdp_reduce_scatter", "replicate_allreduce", "clip_norm")):
        cases.append(Case(f"fsdp2-kill-{during}", f"kill rank {i} inside a {during} of step 6", 4, 1,
                          [f"kill:rank={i}:step=6:during={during}"]))  # fmt: skip
    cases += [
        Case("fsdp2-hang", "SIGSTOP rank 2 past its lease; SIGCONT: it stops itself", 4, 1,
             ["hang:rank=2:step=6:resume=4"]),
        Case("fsdp2-wedge", "rank 1's training thread blocks (lease alive): found by its progress", 4, 1,
             ["wedge:rank=1:step=6"]),
        Case("fsdp2-break", "rank 2's collective of step 6 fails as on a broken socket", 4, 1,
             ["break:rank=2:step=6"]),
        Case("fsdp2-migrate", "migrate rank 1 after step 3", 4, 1, ["migrate:rank=1:step=3"],
             recoveries=(0, 0), check=_migration_done),
        Case("fsdp2-two-kills", "kill rank 0 at step 4 and rank 3 at step 12, two spares", 4, 2,
             ["kill:rank=0:step=4", "kill:rank=3:step=12"], recoveries=(2, 2)),
        Case("fsdp2-bf16-kill", "MixedPrecisionPolicy(bf16): kill rank 1 inside a reduce-scatter", 4, 1,
             ["kill:rank=1:step=6:during=fsdp_reduce_scatter"], args=[*hsdp, "--mp", "bf16"]),
        Case("fsdp2-no-reshard-kill", "reshard_after_forward=False: kill rank 2 inside an all-gather", 4, 1,
             ["kill:rank=2:step=6:during=fsdp_allgather"], args=[*hsdp, "--no-reshard"]),
    ]  # fmt: skip
    plain = [*hsdp, "--replicate", "1"]
    cases += [
        Case("fsdp-plain-kill", "plain FSDP, 3 ranks: kill rank 1 (its shard from the mirror)", 3, 1,
             ["kill:rank=1:step=6"], args=plain),
        Case("fsdp-plain-kill-reduce-scatter", "plain FSDP: kill rank 2 inside a reduce-scatter", 3, 1,
             ["kill:rank=2:step=6:during=fsdp_reduce_scatter"], args=plain),
        Case("fsdp-plain-migrate", "plain FSDP: migrate rank 0 after step 3", 3, 1, ["migrate:rank=0:step=3"],
             recoveries=(0, 0), check=_migration_done, args=plain),
    ]  # fmt: skip
    for c in cases:
        c.script = FSDP2_LM
        if c.args == list(WORKLOAD):
            c.args = list(hsdp)
    return cases


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cases", help="comma-separated case names (default: all)")
    p.add_argument(
        "--grid",
        choices=["reliability", "matrix", "exact", "migration", "sequences", "fsdp2"],
        default="reliability",
        help="reliability: the reliability matrix (default); matrix: each kind of parallelism (plain DP, ZeRO-1, "
        "FSDP2, HSDP) through each recovery path, as one table (--quick: one job per row); "
        "exact: the exactness grid on examples/stateful.py; "
        "migration: failures inside a planned migration; sequences: seeded random sequences of kills, "
        "hangs and migrations on examples/ddp_port.py; fsdp2: kills, hangs, broken links and migrations of "
        "examples/fsdp2_lm.py under HSDP and plain FSDP",
    )
    p.add_argument("--seeds", type=int, default=20, help="--grid sequences: how many seeds (0..N-1; default 20)")
    p.add_argument("--quick", action="store_true", help="--grid matrix: one job per row, three faults in it")
    p.add_argument("--rows", help="--grid matrix: comma-separated rows (default: all)")
    p.add_argument("--columns", help="--grid matrix: comma-separated columns (default: all)")
    p.add_argument("--json", help="write the table (and each run's report) here")


def run_matrix(a: argparse.Namespace) -> int:
    grid = getattr(a, "grid", "reliability")
    if grid == "matrix":  # livemig/bench/matrix_grid.py
        from livemig.bench.matrix_grid import run_grid

        return run_grid(bool(getattr(a, "quick", False)), getattr(a, "rows", None), getattr(a, "columns", None),
                        a.json)  # fmt: skip
    every = {"exact": exact_grid, "migration": migration_grid, "fsdp2": fsdp2_grid,
             "sequences": lambda: sequences_grid(getattr(a, "seeds", 20))}.get(grid, lambda: MATRIX)()  # fmt: skip
    if grid == "exact":  # steps long enough for an agent's kill "after step S" to land mid-run
        os.environ.setdefault("STATEFUL_STEP_SLEEP", "0.05")
    cases = every
    if a.cases:
        want = set(a.cases.split(","))
        unknown = want - {c.name for c in every}
        if unknown:
            raise SystemExit(f"unknown case(s) {sorted(unknown)}; known: {', '.join(c.name for c in every)}")
        cases = [c for c in every if c.name in want]
    where = tempfile.mkdtemp(prefix="livemig-refs-")
    try:
        refs = References(where)  # the tests' cache too (livemig/references.py)
        rows = []
        for c in cases:
            print(f"  {c.name} ...", flush=True)
            rows.append(run_case(c, refs))
    finally:
        shutil.rmtree(where, ignore_errors=True)
    print(f"\n{'case':<30} {'injected at':<44} {'recovered':<9} {'steps':>5} {'bit-identical':<13} "
          f"{'downtime_s':>10}  notes")  # fmt: skip
    for r in rows:
        dt = "-" if r["downtime_s"] is None else f"{r['downtime_s']:.2f}"
        print(f"{r['case']:<30} {r['injected_at'][:44]:<44} {'yes' if r['recovered'] else 'NO':<9} "
              f"{r['steps_completed']:>5} {'yes' if r['bit_identical'] else 'NO':<13} {dt:>10}  "
              f"{r['notes'] or 'ok'}")  # fmt: skip
    failed = [r["case"] for r in rows if not r["ok"]]
    print(f"\n{len(rows) - len(failed)} passed, {len(failed)} failed" + (f": {', '.join(failed)}" if failed else ""))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2, default=str)
    return 1 if failed else 0
