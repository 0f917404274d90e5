"""Exact state, rank by rank: buffers, rank-local state, schedulers after ctx.step().

examples/stateful.py carries what real scripts carry: BatchNorm buffers (or a small
transformer with tied embeddings and dropout), a warm-up + cosine LR schedule and a
weight-decay schedule stepped after ctx.step(), a per-rank data sampler and a
per-rank metric accumulator under `local=`. Each recovery must end with every
rank's state (parameters, buffers, optimizer, hyperparameters, extras, local
state, ZeRO-1 shards) equal to the same rank of a fault-free run, and with the
sample ids every rank consumed equal too (the sampler's state holds them).
"""

from __future__ import annotations

import os

import pytest

from tests.e2e.conftest import REPO, STATEFUL, explain, livemig_run, rank_files

STEPS = 16


def run_script(tmp_path, nproc, spares=0, faults=(), args=(), env=None, job="s", steps=STEPS):
    dump = tmp_path / f"dump-{job}"
    dump.mkdir()
    # 50 ms a step: an agent's kill "after step S" lands while the job still runs (a CNN step is ~10 ms)
    env = {"STATEFUL_DUMP": str(dump), "STATEFUL_STEP_SLEEP": "0.05", **(env or {})}
    run = livemig_run(tmp_path, nproc, spares=spares, faults=faults, script=STATEFUL, job=job,
                      workload=["--steps", str(steps), *args], env=env)  # fmt: skip
    return run, rank_files(dump)


@pytest.fixture(scope="session")
def reference(stateful_reference):
    return lambda nproc, args=(), steps=STEPS: stateful_reference(nproc, args, steps)


def assert_rank_by_rank(run, ranks, ref):
    ref_report, ref_ranks = ref
    assert run.rc == 0, explain(run)
    assert run.report["steps_completed"] == ref_report["steps_completed"], explain(run)
    assert run.report["recoveries"] or run.report["migrations"], "no fault was recovered from"
    assert run.report["replicas_identical"], explain(run)
    for r, want in ref_ranks.items():  # readable first: which part of which rank differs
        diff = {k: (want[k], ranks[r][k]) for k in want if ranks[r][k] != want[k]}
        assert not diff, f"rank {r} differs from the fault-free run's rank {r}: {str(diff)[:600]}"
    assert run.report["rank_digests"] == ref_report["rank_digests"], explain(run)
    assert run.report["state_digest"] == ref_report["state_digest"]


CASES = [
    # (world, fault, args): kills in each phase a fault plan reaches, both model kinds, both paths
    (2, "kill:rank=1:step=9", ()),  # between steps: the BatchNorm CNN of the issue
    (3, "kill:rank=2:step=5:during=allreduce", ()),
    (2, "kill:rank=0:step=3:during=after_step", ("--model", "transformer")),  # in the LR warm-up
    # rank 1's mirror (rank 2) misses step 8's commit: it still serves rank 1's local state
    (3, ("kill:rank=1:step=8:during=before_commit", "drop_avg:rank=2:step=8"), ("--model", "transformer")),
    (2, "kill:rank=1:step=9:during=gather", ("--model", "transformer", "--sharding", "zero1")),
    (3, "kill:rank=2:step=3:during=after_step", ("--model", "transformer", "--sharding", "zero1")),
    (3, "kill:rank=1:step=7", ("--sharding", "zero1")),
]


@pytest.mark.parametrize("nproc,fault,args", CASES,
                         ids=[f"{n}-{f if isinstance(f, str) else '+'.join(f)}-{'-'.join(a) or 'cnn'}"
                              for n, f, a in CASES])  # fmt: skip
def test_recovery_is_exact_rank_by_rank(tmp_path, reference, nproc, fault, args):
    run, ranks = run_script(tmp_path, nproc, spares=1, faults=(fault,) if isinstance(fault, str) else fault, args=args)
    assert_rank_by_rank(run, ranks, reference(nproc, args))


MIGRATIONS = [(3, "migrate:rank=0:step=2", ())]  # the kill grid's shape on the plain path (bench: --grid exact)


@pytest.mark.parametrize("nproc,fault,args", MIGRATIONS, ids=[f"{n}-{f}" for n, f, _ in MIGRATIONS])
def test_planned_migration_is_exact_rank_by_rank(tmp_path, reference, nproc, fault, args):
    """BatchNorm buffers, local= sampler and meter, LR and weight-decay schedules after ctx.step():
    the migration starts at step 2 (the fault gate holds rank 0 until a spare is claimed)."""
    run, ranks = run_script(tmp_path, nproc, spares=1, faults=(fault,), args=args, job="mg")
    assert [m["outcome"] for m in run.report["migrations"]] == ["done"], explain(run)
    assert_rank_by_rank(run, ranks, reference(nproc, args))


def test_planned_migration_carries_local_state(tmp_path, reference):
    # Enough steps left that the migration completes before the job does, even on a loaded machine.
    args, steps = ("--model", "transformer"), 150
    run, ranks = run_script(tmp_path, 2, spares=1, faults=("migrate:rank=1:step=3",), args=args, steps=steps)
    assert [m["outcome"] for m in run.report["migrations"]] == ["done"], explain(run)
    assert_rank_by_rank(run, ranks, reference(2, args, steps))


def test_verify_names_the_rank_whose_local_state_differs(tmp_path):
    """A recovered rank whose local state is planted to differ: --verify must say no, naming it."""
    import subprocess
    import sys

    # 50 ms a step, as run_script: the agent's kill "after step 5" must land before a 10-step job ends
    env = dict(os.environ, LIVEMIG_STATE_DIR=str(tmp_path), STATEFUL_PLANT="1", STATEFUL_STEP_SLEEP="0.05")
    p = subprocess.run([sys.executable, "-m", "livemig.cli", "run", "--nproc", "2", "--spares", "1", "--job", "pl",
                        "--lease-ttl", "2", "--fault", "kill:rank=1:step=5", "--verify", STATEFUL, "--steps", "10"],
                       capture_output=True, text=True, timeout=240, env=env, cwd=REPO)  # fmt: skip
    assert p.returncode == 1, p.stdout + p.stderr
    assert "bit-identical: no" in p.stdout and "rank(s) [1] differ" in p.stdout, p.stdout


def test_per_rank_state_registered_as_an_extra_is_refused(tmp_path):
    """A metric accumulator registered as a replicated extra differs per rank: the job
    fails after step 0 saying to register it under local=, instead of a spare silently
    taking another rank's."""
    run, _ = run_script(tmp_path, 2, args=("--steps", "6"), env={"STATEFUL_METER_AS_EXTRA": "1"}, job="x")
    res = run.report["result"]
    assert run.rc != 0 and res["state"] == "failed", explain(run)
    assert "the extra 'meter' differs between rank 0 and rank 1" in res["reason"] and "local=" in res["reason"]


def test_a_rank_and_its_local_mirror_lost_together_fails_naming_it(tmp_path):
    """Ranks 1 and 2 of 3 killed together: rank 1's local state lived on rank 2 only."""
    run, _ = run_script(tmp_path, 3, spares=2, faults=("kill:rank=1:step=6", "kill:rank=2:step=6"), job="lost")
    res = run.report["result"]
    assert run.rc != 0 and res["state"] == "failed", explain(run)
    assert "rank 1's local state (buffers, local=) of step" in res["reason"], res["reason"]
    assert "its mirror rank 2 failed too" in res["reason"]
