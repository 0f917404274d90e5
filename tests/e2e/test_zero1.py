"""ZeRO-1 recovery end to end: a killed rank's optimizer shard comes back
exactly from its live mirror. Central assertion: the final state (the
replicated model plus every rank's shard) equals the fault-free zero1 run's,
every step completed, and every mirror equals the shard it mirrors."""

from __future__ import annotations

import os
import signal

import pytest

from tests.e2e.conftest import MLP_ZERO1, REPO, STEPS, explain, livemig_run, rank_files
from tests.e2e.test_recovery import assert_exact


def zrun(tmp_path, nproc: int, spares: int, faults: tuple[str, ...], **kw):
    return livemig_run(tmp_path, nproc, spares=spares, faults=faults, script=MLP_ZERO1, **kw)


def assert_zero1_exact(run, reference: str, recoveries: int) -> None:
    assert_exact(run, reference, recoveries)
    z = run.report["zero1"]
    assert z["mirrored"] and z["mirrors_exact"], z


def test_zero1_kill_between_steps(tmp_path, reference_digest):
    ref = reference_digest(2, MLP_ZERO1)
    run = zrun(tmp_path, 2, 1, ("kill:rank=1:step=8",))
    assert_zero1_exact(run, ref, 1)
    # the spare pulled the model and both of its shards (its own from the mirror, rank 0)
    assert run.report["recoveries"][0]["bytes_streamed"] > 0


def test_zero1_kill_inside_reduce_scatter(tmp_path, reference_digest):
    """The reduce-scatter + exchange path (NCCL's default; gloo allreduces by default)."""
    env = {"LIVEMIG_ZERO1_REDUCE": "reduce_scatter"}
    ref = reference_digest(3, MLP_ZERO1, env)
    run = zrun(tmp_path, 3, 1, ("kill:rank=1:step=8:during=allreduce",), env=env)
    assert_zero1_exact(run, ref, 1)


def test_zero1_kill_inside_the_gradient_allreduce(tmp_path, reference_digest):
    ref = reference_digest(3, MLP_ZERO1)
    run = zrun(tmp_path, 3, 1, ("kill:rank=0:step=5:during=allreduce",))
    assert_zero1_exact(run, ref, 1)


def test_zero1_buddy_killed_after_barrier_peer_finishes_from_its_slices(tmp_path, reference_digest):
    """Rank 2 (the mirror of shard 1) dies after the barrier of step 8, before
    it updated; rank 1 loses the barrier's result (drop), rank 0 commits step 8.
    The job must resume at 9 with rank 1 finishing step 8 from the gradient
    slices it holds, and the spare must rebuild rank 2's shard from its mirror
    on rank 0 and the mirror of shard 1 from rank 1."""
    ref = reference_digest(3, MLP_ZERO1)
    run = zrun(tmp_path, 3, 1, ("kill:rank=2:step=8:during=before_commit", "drop_avg:rank=1:step=8"))
    assert_zero1_exact(run, ref, 1)
    agree = [e for e in run.report["timeline"] if e["phase"] == "agree"]
    assert agree[0]["resume_step"] == 9, agree


def test_zero1_rank_and_its_mirror_killed_together_fails_naming_the_shard(tmp_path):
    run = zrun(tmp_path, 3, 2, ("kill:rank=1:step=6", "kill:rank=2:step=6"), timeout=120)
    assert run.rc != 0, explain(run)
    res = run.report["result"]
    assert res["state"] == "failed", explain(run)
    assert "optimizer shard 1 is lost: its owner rank 1 and its mirror rank 2 both failed" in res["reason"]
    assert "optimizer shard 1 is lost" in run.stdout + run.stderr
    procs = {p["name"]: p for p in run.report["processes"]}
    assert procs["worker-1"]["exit_code"] == -signal.SIGKILL
    assert run.report["steps_completed"] < STEPS


def test_zero1_two_non_adjacent_ranks_killed_together(tmp_path, reference_digest):
    """Ranks 0 and 2 of 4: each lost shard still has its mirror (ranks 1 and 3)."""
    ref = reference_digest(4, MLP_ZERO1)
    run = zrun(tmp_path, 4, 2, ("kill:rank=0:step=6", "kill:rank=2:step=6"), timeout=300)
    assert run.rc == 0, explain(run)
    assert run.report["state_digest"] == ref, explain(run)
    assert run.report["steps_completed"] == STEPS and run.report["replicas_identical"], explain(run)
    assert run.report["zero1"]["mirrors_exact"]
    assert {r["rank"] for r in run.report["recoveries"]} <= {0, 2} and run.report["recoveries"], explain(run)


PORT = os.path.join(REPO, "examples", "ddp_port.py")


def _port(tmp_path, name: str, zero1: bool, faults: tuple[str, ...] = (), spares: int = 0, env=None,
          steps: int = 16, more: tuple[str, ...] = ()):  # fmt: skip
    """examples/ddp_port.py on 3 ranks with a GradScaler whose loss overflows every 4th step
    (rank 0's), unscale + clip, accumulation, the lr set by hand, a prefetched batch."""
    out = tmp_path / f"out-{name}"
    out.mkdir()
    args = [
        *more,
        "--steps",
        str(steps),
        "--amp",
        "--inf-every",
        "4",
        "--out",
        str(out),
        *(["--sharding", "zero1"] if zero1 else []),
    ]
    run = livemig_run(tmp_path, 3, spares=spares, faults=faults, script=PORT, job=name, env=env, workload=args)
    assert run.rc == 0, explain(run)
    return run, rank_files(out)


@pytest.mark.parametrize(
    "mode,faults",
    [
        # a kill inside the parameters' gather (step committed), then the buddy of rank 1 killed
        # after the average while rank 1 loses it: nobody passed the barrier, rank 1 redoes the
        # average with the spare and rank 0 sends its kept gradient again
        ("allreduce", ("kill:rank=0:step=6:during=gather", "kill:rank=2:step=11:during=before_commit",
                       "drop_avg:rank=1:step=11")),
        ("reduce_scatter", ("kill:rank=0:step=5:during=allreduce", "kill:rank=1:step=10")),
    ],
    ids=["allreduce", "reduce_scatter"],
)  # fmt: skip
def test_zero1_with_clipping_and_a_gradscaler_is_ddp_and_survives_kills_exactly(tmp_path, mode, faults):
    """Issue 52, item 1: a DDP port that clips and uses a GradScaler runs with
    sharding='zero1'. The whole average is taken (the global norm from every shard),
    each shard steps with its slice of the clipped, unscaled gradient, and an overflow
    skips every shard and mirror: on gloo's allreduce path the model, the scaler and every
    step's norm equal plain data parallel's bit for bit. Killed twice, rank by rank equal
    to the fault-free zero1 run. CI ~90 s each."""
    env = {"LIVEMIG_ZERO1_REDUCE": mode}
    _, want = _port(tmp_path, "ref", True, env=env)
    norms = [float(n) for _, n in want[0]["norms"]]
    assert any(n > 0.5 for n in norms if n == n and n != float("inf")), norms  # the clip bit (max norm 0.5)
    assert any(n != n or n == float("inf") for n in norms), norms  # and the scaler skipped steps
    if mode == "allreduce":  # reduce-scatter sums in another order: equal to itself only
        _, ddp = _port(tmp_path, "ddp", False)
        for r in range(3):
            assert [want[r][k] for k in ("model", "scaler", "norms", "carry")] == [
                ddp[r][k] for k in ("model", "scaler", "norms", "carry")], r  # fmt: skip
    run, got = _port(tmp_path, "k", True, faults=faults, spares=2, env=env)
    assert len(run.report["recoveries"]) == 2 and run.report["steps_completed"] == 16, explain(run)
    assert run.report["zero1"]["mirrors_exact"], run.report["zero1"]
    for r in range(3):
        assert [got[r][k] for k in ("model", "optimizer", "scaler", "carry")] == [
            want[r][k] for k in ("model", "optimizer", "scaler", "carry")], r  # fmt: skip
    killed = {int(f.split("rank=")[1].split(":")[0]) for f in faults if f.startswith("kill")}
    for r in set(range(3)) - killed:  # a survivor saw every step's norm, as in the fault-free run
        assert got[r]["norms"] == want[r]["norms"], r


def test_zero1_planned_migration_with_clipping_and_a_gradscaler_is_exact(tmp_path):
    """Issue 52, item 1: a ZeRO-1 rank moves to a spare by planned migration (its shard and
    the one it mirrors handed over, each step repeated from the slices they stepped with and
    the gathered parameters, the scaler's skips and scale included); the spare is stalled
    past the 8 updates the leaving worker keeps, so it loads a newer snapshot; a kill later
    is recovered by the second spare. Rank by rank equal to the fault-free run. CI ~40 s."""
    more = ("--step-ms", "30")  # steps long enough for the spares to warm up before the end
    ref_run, want = _port(tmp_path, "ref", True, steps=60, more=more)
    faults = (
        "migrate:rank=1:step=8",
        "spare-hang:during=snapshot:ahead=12:resume=120",
        "kill:rank=2:step=48:during=migrated",
    )
    run, got = _port(tmp_path, "m", True, faults=faults, spares=2, steps=60, more=more)
    assert run.report["steps_completed"] == 60 and run.report["replicas_identical"], explain(run)
    (mig,) = run.report["migrations"]
    assert mig["outcome"] == "done" and mig["rank"] == 1 and mig["resyncs"] >= 1, mig
    assert mig["switch_step"] >= 8, mig
    assert [r["rank"] for r in run.report["recoveries"]] == [2], explain(run)
    assert run.report["zero1"]["mirrors_exact"], run.report["zero1"]
    assert run.report["zero1"]["state_digest"] == ref_run.report["zero1"]["state_digest"], explain(run)
    assert run.report["rank_digests"] == ref_run.report["rank_digests"], explain(run)
    for r in range(3):
        assert [got[r][k] for k in ("model", "optimizer", "scaler", "carry")] == [
            want[r][k] for k in ("model", "optimizer", "scaler", "carry")], r  # fmt: skip
    codes = {p["name"]: p["exit_code"] for p in run.report["processes"]}
    assert codes["worker-1"] == 0, explain(run)  # the leaving worker was released, not fenced
