"""`livemig bench faults --grid matrix`: every kind of parallelism through every recovery
path, measured, as one table (docs/reliability.md, "The matrix").

Each cell is a short job of `livemig run` (a subprocess: the path a user runs) with one
fault plan, judged against the fault-free run of the same script, arguments and world size
(run once per row and kept): **exact** (every rank's final state bit for bit; a ZeRO-1 job
that ends shrunk: the model, every optimizer shard by index, each mirror equal to its shard and
every rank's parameters and buffers, as its mirrors sit elsewhere), **within X**
(a shrunk job: every rank within the shrink bound, X the largest relative difference),
**refused** (livemig declined with one line, printed under the table), **failed** (the job
failed, lost steps, or differs beyond the bound), **n/a** (the row's script has no such
loop feature). A cell is a claim checked, never assumed: a grid row's path that is not run
says so.

Rows: examples/ddp_port.py (a ported DDP loop: accumulation, clipping, the lr set by hand,
a prefetched batch, BatchNorm buffers) on 3 ranks, plain and `--sharding zero1`;
examples/fsdp2_lm.py as plain FSDP 1x3 and HSDP 2x2. The resume column needs a script
without rank-local state (BatchNorm buffers have no rule to another world size: that
refusal is documented), so plain and ZeRO-1 resume examples/mlp.py and mlp_zero1.py.

`--quick` (the CI test of the cells): one job per row with three faults (a kill inside a
collective, a planned migration, a kill), a spare for each, judged exact or not.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field, replace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EX = os.path.join(ROOT, "examples")
PORT, FSDP2_LM = os.path.join(EX, "ddp_port.py"), os.path.join(EX, "fsdp2_lm.py")
MLP, MLP_ZERO1 = os.path.join(EX, "mlp.py"), os.path.join(EX, "mlp_zero1.py")
COLUMNS = ("kill", "in-collective kill", "hang", "migration", "shrink", "grow back", "cold restart",
           "resume other world", "GradScaler")  # fmt: skip
# "not supported" lines and configuration refusals: livemig declining, not failing
REFUSALS = ("not supported", "ConfigError", "no rule to map", "not resharded")


@dataclass
class Row:
    name: str
    script: str
    nproc: int
    args: list[str]
    collective: str  # where the in-collective kill lands (faults.IN_PROCESS_DURING)
    resume_script: str
    resume_args: list[str]  # the checkpointing run's (N ranks)
    resume_again: list[str]  # the resumed run's (N - 1 ranks)
    amp: list[str] | None = None  # the GradScaler column's extra arguments; None: the script has none
    quick: list[str] | None = None  # --quick's arguments when they differ (a longer job)


STEPS = 40
PORT_ARGS = ["--steps", str(STEPS), "--step-ms", "50"]  # spares warm before a migration lands
FSDP_ARGS = ["--steps", "24"]
FSDP_QUICK = ["--steps", "36"]  # a migration at step 12 done before the kill at 30 also on a loaded machine
MLP_ARGS = ["--steps", "8", "--layers", "2", "--batch", "32"]
AMP = ["--amp", "--inf-every", "4"]  # a GradScaler whose loss overflows every 4th step (rank 0's)
PLAIN_FSDP = ["--steps", "8", "--replicate", "1"]
ROWS = [
    Row("plain DP", PORT, 3, PORT_ARGS, "allreduce", MLP, MLP_ARGS, MLP_ARGS, AMP),
    Row("ZeRO-1", PORT, 3, [*PORT_ARGS, "--sharding", "zero1"], "allreduce", MLP_ZERO1, MLP_ARGS, MLP_ARGS, AMP),
    Row("FSDP2 1x3", FSDP2_LM, 3, [*FSDP_ARGS, "--replicate", "1"], "fsdp_reduce_scatter", FSDP2_LM,
        PLAIN_FSDP, PLAIN_FSDP, quick=[*FSDP_QUICK, "--replicate", "1"]),
    Row("HSDP 2x2", FSDP2_LM, 4, FSDP_ARGS, "fsdp_allgather", FSDP2_LM, ["--steps", "8"], PLAIN_FSDP,  # -> 1x3
        quick=FSDP_QUICK),
]  # fmt: skip


@dataclass
class Cell:
    row: str
    column: str
    verdict: str = ""  # exact, within, refused, failed, n/a
    detail: str = ""  # the bound's figure, the refusal's line, what failed
    wall_s: float = 0.0
    downtimes: list[float] = field(default_factory=list)


class Runner:
    """Runs jobs under one temporary directory and keeps each fault-free reference (its report
    and each rank's final values, LIVEMIG_VERIFY_DIR) by script, arguments and world size."""

    def __init__(self, where: str, timeout: float) -> None:
        self.where = where
        self.timeout = timeout
        self.refs: dict[tuple, tuple[dict, str]] = {}

    def job(self, script: str, args: list[str], nproc: int, spares: int = 0, faults: tuple[str, ...] = (),
            flags: tuple[str, ...] = ()) -> tuple[dict, str, float]:  # fmt: skip
        """(report, the directory of each rank's final values, wall seconds) of one job."""
        name = f"m{uuid.uuid4().hex[:8]}"
        values, report = os.path.join(self.where, name), os.path.join(self.where, f"{name}.json")
        cmd = [sys.executable, "-m", "livemig.cli", "run", "--nproc", str(nproc), "--spares", str(spares),
               "--job", name, "--report", report, "--lease-ttl", "2", *flags]  # fmt: skip
        for f in faults:
            cmd += ["--fault", f]
        env = {**os.environ, "LIVEMIG_VERIFY_DIR": values, "LIVEMIG_STATE_DIR": self.where,
               "LIVEMIG_RECOVERY_TIMEOUT": os.environ.get("LIVEMIG_RECOVERY_TIMEOUT", "60")}  # fmt: skip
        if spares == 0 and "--min-nproc" in flags:  # a job that cannot shrink fails with its reason, not
            env["LIVEMIG_SPARE_WAIT"] = "10"  # after the members' own recovery wait
        t0 = time.monotonic()
        # its own session: a job past the timeout is killed with every process it started
        p = subprocess.Popen([*cmd, script, *args], env=env, cwd=self.where, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        try:
            p.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            return {"result": {"state": "failed", "reason": f"no end in {self.timeout:.0f} s"}}, values, self.timeout
        finally:
            if p.poll() is None:  # interrupted: take the job down with us
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        try:
            with open(report) as f:
                rep = json.load(f)
        except (OSError, ValueError):
            rep = {"result": {"state": "failed", "reason": "no report written"}}
        return rep, values, time.monotonic() - t0

    def grow_job(self, script: str, args: list[str], nproc: int, fault: str) -> tuple[dict, str, float]:
        """A job whose spare starts only when the fault lands (RunConfig.cold_spares, in this
        process: the CLI has no flag for it), so the survivors shrink at once and the spare,
        warm a few seconds later, takes the carried rank back."""
        from datetime import timedelta

        from livemig.agent.launcher import run
        from livemig.agent.run_config import RunConfig
        from livemig.config import Timeouts
        from livemig.faults import parse_fault

        values = os.path.join(self.where, f"g{uuid.uuid4().hex[:8]}")
        t = replace(Timeouts.from_env(), lease_ttl=timedelta(seconds=2))
        cfg = RunConfig(script=script, args=args, nproc=nproc, spares=1, job=f"g{uuid.uuid4().hex[:8]}",
                        faults=[parse_fault(fault)], timeouts=t, quiet=True, max_wall=self.timeout,
                        cold_spares=True, min_nproc=nproc - 1, shrink_wait=0.0)  # fmt: skip
        old = {k: os.environ.get(k) for k in ("LIVEMIG_VERIFY_DIR", "LIVEMIG_STATE_DIR")}
        os.environ.update({"LIVEMIG_VERIFY_DIR": values, "LIVEMIG_STATE_DIR": self.where})
        t0 = time.monotonic()
        try:
            rep = run(cfg)
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        return rep, values, time.monotonic() - t0

    def reference(self, script: str, args: list[str], nproc: int) -> tuple[dict, str]:
        key = (script, tuple(args), nproc)
        if key not in self.refs:
            rep, values, _ = self.job(script, args, nproc)
            if (rep.get("result") or {}).get("state") != "done":
                raise SystemExit(f"the fault-free reference of {os.path.basename(script)} {' '.join(args)} "
                                 f"on {nproc} ranks failed: {rep.get('result')}")  # fmt: skip
            self.refs[key] = (rep, values)
        return self.refs[key]


def refusal(rep: dict) -> str:
    """The line livemig declined a cell's path with, '' if it did not."""
    for m in rep.get("migrations") or []:
        if m.get("outcome") == "rejected":
            return str(m.get("reason") or m.get("aborted") or "migration rejected")
    reason = str((rep.get("result") or {}).get("reason") or "")
    if not any(r in reason for r in REFUSALS):
        return ""
    inner = re.search(r"\(no shrink: (.*)\)$", reason)  # a job that waited for a spare since it could not shrink
    return inner.group(1) if inner else re.sub(r"^rank \d+ before training: ConfigError: ", "", reason)


def judge(rep: dict, values: str, ref: dict, ref_values: str, world: int, steps: int) -> tuple[str, str]:
    """(verdict, detail) of one job against its reference (see the module doc)."""
    from livemig.cli.run import shrunk_bound, zero1_shrunk_exact

    refused = refusal(rep)
    if refused:
        return "refused", refused
    res = rep.get("result") or {}
    if res.get("state") != "done":
        return "failed", str(res.get("reason") or res)[:160]
    if rep.get("steps_completed") != steps:
        return "failed", f"{rep.get('steps_completed')}/{steps} steps"
    if rep.get("faults_not_fired"):
        return "failed", f"fault(s) that never fired: {rep['faults_not_fired']}"
    same = rep.get("state_digest") == ref.get("state_digest") and rep.get("rank_digests") == ref.get("rank_digests")
    if same and (rep.get("zero1") or {}).get("state_digest") == (ref.get("zero1") or {}).get("state_digest"):
        return "exact", ""
    if not rep.get("shrunk"):
        return "failed", "final state differs from the fault-free run"
    bound = shrunk_bound(ref_values, values, world)
    if bound is None:
        return "failed", "shrunk, and a rank's final values are missing: not compared"
    if zero1_shrunk_exact(rep, ref, bound):
        return "exact", ""
    if bound["within"]:
        return "within", f"{bound['max_rel']:.1e}"
    return "failed", f"shrunk: {bound['max_rel']:.1e} over the {bound['bound']:.0e} bound"


def steps_of(args: list[str]) -> int:
    return int(args[args.index("--steps") + 1])


def cell_plan(row: Row, column: str, ckpt: str) -> tuple[list[str], int, tuple[str, ...], tuple[str, ...]] | None:
    """(script arguments, spares, faults, run flags) of one cell; None: n/a."""
    n1 = str(row.nproc - 1)
    if column == "kill":
        return row.args, 1, ("kill:rank=1:step=6",), ()
    if column == "in-collective kill":
        return row.args, 1, (f"kill:rank=1:step=6:during={row.collective}",), ()
    if column == "hang":
        return row.args, 1, ("hang:rank=1:step=6:resume=4",), ()
    if column == "migration":
        return row.args, 1, ("migrate:rank=1:step=6",), ()
    if column == "shrink":
        return row.args, 0, ("kill:rank=1:step=6",), ("--min-nproc", n1, "--shrink-wait", "0")
    if column == "grow back":  # the spare starts at the kill: shrunk at once, grown back once it is warm
        return row.args, 1, ("kill:rank=1:step=6",), ("--min-nproc", n1, "--shrink-wait", "0")
    if column == "cold restart":
        return row.args, 0, ("kill:rank=1:step=9",), ("--recovery", "cold", "--checkpoint-dir", ckpt,
                                                       "--checkpoint-every", "4")  # fmt: skip
    if column == "GradScaler":
        return None if row.amp is None else ([*row.args, *row.amp], 1, ("kill:rank=1:step=6",), ())
    raise ValueError(column)


def run_cell(runner: Runner, row: Row, column: str) -> Cell:
    cell = Cell(row.name, column)
    ckpt = tempfile.mkdtemp(prefix="ckpt-", dir=runner.where)
    if column == "resume other world":
        return resume_cell(runner, row, cell, ckpt)
    plan = cell_plan(row, column, ckpt)
    if plan is None:
        cell.verdict, cell.detail = "n/a", f"{os.path.basename(row.script)} has no {column}"
        return cell
    args, spares, faults, flags = plan
    ref, ref_values = runner.reference(row.script, args, row.nproc)
    if column == "grow back":
        rep, values, cell.wall_s = runner.grow_job(row.script, args, row.nproc, faults[0])
    else:
        rep, values, cell.wall_s = runner.job(row.script, args, row.nproc, spares, faults, flags)
    cell.verdict, cell.detail = judge(rep, values, ref, ref_values, row.nproc, steps_of(args))
    kinds = [r.get("kind") for r in rep.get("recoveries") or []]
    if column == "grow back" and cell.verdict in ("exact", "within") and "grow" not in kinds:
        cell.verdict, cell.detail = "failed", f"not grown back (recoveries {kinds})"
    if column == "migration" and cell.verdict == "exact":
        done = [m for m in rep.get("migrations") or [] if m.get("outcome") == "done"]
        if not done:
            cell.verdict, cell.detail = "failed", f"no migration done: {rep.get('migrations')}"
        cell.downtimes = [float(m.get("pause_s") or 0.0) for m in done]
    else:
        cell.downtimes = [float(r.get("downtime_s") or 0.0) for r in rep.get("recoveries") or []]
    return cell


def resume_cell(runner: Runner, row: Row, cell: Cell, ckpt: str) -> Cell:
    """A checkpointed run of N ranks resumed on N-1 (HSDP 2x2 on 1x3): after the load every
    rank's parameters equal the checkpointing run's final ones; FSDP2's shards, re-cut for the
    new mesh, joined whole equal the checkpoint's (the resumed run writes its re-cut state at
    once into its own --checkpoint-dir), optimizer state included."""
    import torch

    from livemig.checkpoint_dir import newest_step, step_dir

    args = row.resume_args
    first, vals_a, _ = runner.job(row.resume_script, args, row.nproc, 0, (),
                                  ("--checkpoint-dir", ckpt, "--checkpoint-every", "4"))  # fmt: skip
    if (first.get("result") or {}).get("state") != "done":
        cell.verdict, cell.detail = "failed", f"the checkpointing run: {first.get('result')}"
        return cell
    again = ckpt + "-again"
    flags = ("--resume-from", ckpt, "--checkpoint-dir", again, "--checkpoint-every", "4")
    rep, vals_b, cell.wall_s = runner.job(row.resume_script, row.resume_again, row.nproc - 1, 0, (), flags)
    refused = refusal(rep)
    if refused:
        cell.verdict, cell.detail = "refused", refused
        return cell
    if (rep.get("result") or {}).get("state") != "done":
        cell.verdict, cell.detail = "failed", str((rep.get("result") or {}).get("reason"))[:160]
        return cell
    if row.resume_script == FSDP2_LM:  # shards re-cut: compare the whole tensors
        from livemig.runtime.strategies.fsdp2_shards import whole_of_checkpoint

        step = newest_step(ckpt)
        if step is None or newest_step(again) != step:
            cell.verdict, cell.detail = "failed", f"the resumed run wrote no re-cut checkpoint of step {step}"
            return cell
        (pa, oa), (pb, ob) = whole_of_checkpoint(step_dir(ckpt, step)), whole_of_checkpoint(step_dir(again, step))
        same = len(pa) == len(pb) and all(torch.equal(x, y) for x, y in zip(pa, pb, strict=False))
        same = same and oa.keys() == ob.keys() and all(torch.equal(torch.as_tensor(v), torch.as_tensor(ob[k]))
                                                       for k, v in oa.items())  # fmt: skip
        cell.verdict = "exact" if same else "failed"
        cell.detail = "" if same else "the re-cut shards differ from the checkpoint's"
        return cell
    want = torch.load(os.path.join(vals_a, "final-0.pt"), weights_only=True)
    for r in range(row.nproc - 1):
        got = torch.load(os.path.join(vals_b, f"final-{r}.pt"), weights_only=True)
        if not torch.equal(got, want):
            cell.verdict, cell.detail = "failed", f"rank {r}'s parameters after the load differ"
            return cell
    cell.verdict = "exact"
    return cell


def quick_cell(runner: Runner, row: Row) -> Cell:
    """--quick: one job per row, three faults, a spare for each (the last rank migrates: no
    replica of a killed rank's shard moves meanwhile)."""
    cell = Cell(row.name, "quick: kill in a collective, migration, kill")
    args = row.quick or row.args
    steps = steps_of(args)
    # The last kill lands once the migration has its outcome (during=migrated), not at a fixed later
    # step: on a loaded host the spare's catch-up can outlast any fixed number of steps (an FSDP2
    # row's kill at step 30 once landed inside it, and the migration ended by the failure).
    faults = (f"kill:rank=1:step=4:during={row.collective}", f"migrate:rank={row.nproc - 1}:step={steps // 3}",
              f"kill:rank=0:step={steps // 3 + 1}:during=migrated")  # fmt: skip
    ref, ref_values = runner.reference(row.script, args, row.nproc)
    rep, values, cell.wall_s = runner.job(row.script, args, row.nproc, 3, faults)
    cell.verdict, cell.detail = judge(rep, values, ref, ref_values, row.nproc, steps)
    migs = [m.get("outcome") for m in rep.get("migrations") or []]
    if cell.verdict == "exact" and (migs != ["done"] or len(rep.get("recoveries") or []) != 2):
        cell.verdict, cell.detail = "failed", f"migrations {migs}, recoveries {len(rep.get('recoveries') or [])}"
    cell.downtimes = [float(r.get("downtime_s") or 0.0) for r in rep.get("recoveries") or []]
    return cell


def print_table(cells: list[Cell], columns: list[str]) -> None:
    rows = list(dict.fromkeys(c.row for c in cells))
    by = {(c.row, c.column): c for c in cells}
    width = max(12, *(len(c) for c in columns))

    def show(c: Cell | None) -> str:
        if c is None:
            return "-"
        return f"within {c.detail}" if c.verdict == "within" else c.verdict

    print("\n" + f"{'':<10} " + " ".join(f"{c:<{width}}" for c in columns))
    for r in rows:
        print(f"{r:<10} " + " ".join(f"{show(by.get((r, c))):<{width}}" for c in columns))
    notes = [c for c in cells if c.detail and c.verdict != "within"]
    for c in notes:
        print(f"  {c.row} / {c.column}: {c.verdict}: {c.detail}")


def run_grid(quick: bool, rows: str | None = None, columns: str | None = None, json_out: str | None = None,
             timeout: float = 300.0) -> int:  # fmt: skip
    """Run the matrix (or its --quick form); exit 1 if any cell failed."""
    pick_rows = [r for r in ROWS if not rows or r.name in rows.split(",")]
    pick_cols = [c for c in COLUMNS if not columns or c in columns.split(",")]
    where = tempfile.mkdtemp(prefix="livemig-matrix-")
    runner = Runner(where, timeout)
    cells: list[Cell] = []
    try:
        for row in pick_rows:
            todo = [None] if quick else pick_cols
            for col in todo:
                print(f"  {row.name} / {col or 'quick'} ...", flush=True)
                shrink = next((c for c in cells if c.row == row.name and c.column == "shrink"), None)
                if col == "grow back" and shrink is not None and shrink.verdict == "refused":
                    cells.append(Cell(row.name, col, "refused", f"no shrink to grow back from: {shrink.detail}"))
                else:
                    cells.append(quick_cell(runner, row) if col is None else run_cell(runner, row, col))
                c = cells[-1]
                print(f"    {c.verdict}{': ' + c.detail if c.detail else ''} ({c.wall_s:.0f} s)", flush=True)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    print_table(cells, [cells[0].column] if quick and cells else pick_cols)
    if json_out:
        with open(json_out, "w") as f:
            json.dump([c.__dict__ for c in cells], f, indent=2)
    failed = [f"{c.row} / {c.column}" for c in cells if c.verdict == "failed"]
    print(f"\n{len(cells)} cells: " + ", ".join(f"{v} {sum(c.verdict == v for c in cells)}"
                                             for v in ("exact", "within", "refused", "n/a", "failed")))  # fmt: skip
    return 1 if failed else 0
