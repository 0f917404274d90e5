"""Epochs as torchrun scripts write them (issue 50): `for epoch in ctx.epochs(E, len(loader))`,
`sampler.set_epoch(epoch)`, a torch `DistributedSampler` the script built, and between epochs an
evaluation all-reduced over the default group and rank 0's snapshot (tests/helpers/epochs_proc.py).

One job takes a kill at the last step of epoch 0 (the survivor is inside the evaluation's
all-reduce when its peer goes: it joins the recovery and makes the call again with the spare,
which starts at epoch 0's end), a planned migration in epoch 1 and a kill in the middle of epoch
1; a cold restart resumes from a checkpoint at an epoch boundary. Each is held to the fault-free
run: the final state, the samples each (epoch, rank, step) read, and every snapshot file.
"""

from __future__ import annotations

import json
import os

from tests.e2e.conftest import REPO, explain, livemig_run, rank_files, reference_of

EPOCHS = os.path.join(REPO, "tests", "helpers", "epochs_proc.py")
STEPS = 36  # 3 epochs of 96 samples, 2 ranks, 4 a batch: 12 steps an epoch


def samples(out) -> dict[tuple[int, int, int], list[int]]:
    """(epoch, rank, step) -> the sample ids read, over every process that ran the job (a step
    read twice, by a lost process and by the one that took its rank, read the same)."""
    seen: dict[tuple[int, int, int], list[int]] = {}
    for f in out.glob("samples-*.jsonl"):
        for line in f.read_text().splitlines():
            epoch, rank, step, ids = json.loads(line)
            assert seen.setdefault((epoch, rank, step), ids) == ids, (epoch, rank, step)
    return seen


def snapshots(out) -> dict[str, dict]:
    return {f.name: json.loads(f.read_text()) for f in out.glob("snap*.json")}


def _same(run, ref, out) -> None:
    rep = run.report
    assert run.rc == 0 and rep["result"]["state"] == "done", explain(run)
    assert rep["steps_completed"] == STEPS, explain(run)
    assert rep["state_digest"] == ref.digest, "final state differs from the fault-free run\n" + explain(run)
    assert rank_files(out) == rank_files(ref.out), explain(run)
    assert samples(out) == samples(ref.out), "the samples an (epoch, rank) read differ\n" + explain(run)
    assert snapshots(out) == snapshots(ref.out), explain(run)


def test_an_epoch_loop_with_a_distributed_sampler_recovers_exactly(tmp_path, references):
    ref = reference_of(references, 2, EPOCHS, ["--out", "{out}"])
    want = samples(ref.out)
    assert len(want) == STEPS * 2 and {e for e, _, _ in want} == {0, 1, 2}, sorted(want)[:4]
    assert len(snapshots(ref.out)) == 3

    out = tmp_path / "live"
    out.mkdir()
    faults = ("kill:rank=0:step=11", "migrate:rank=1:step=15", "kill:rank=1:step=20:during=migrated")
    run = livemig_run(tmp_path, 2, spares=3, faults=faults, script=EPOCHS, job="live",
                      workload=["--out", str(out)], env={"EPOCHS_SLEEP": "0.05"})  # fmt: skip
    _same(run, ref, out)
    assert [r["kind"] for r in run.report["recoveries"]] == ["failure", "failure"], explain(run)
    assert [m["outcome"] for m in run.report["migrations"]] == ["done"], explain(run)
    logs = run.stdout + run.stderr + "".join(open(p).read() for p in (tmp_path / "runs").glob("live-*/*.log"))
    assert "allreduce after epoch 0's steps failed: joining the recovery" in logs, explain(run)

    out = tmp_path / "cold"
    out.mkdir()
    ck = ("--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "12", "--recovery", "cold")
    run = livemig_run(tmp_path, 2, faults=("kill:rank=0:step=26",), script=EPOCHS, job="cold",
                      workload=["--out", str(out)], extra=ck)  # fmt: skip
    _same(run, ref, out)
    assert [r["kind"] for r in run.report["recoveries"]] == ["restart"], explain(run)
