"""A whole-job stop at a checkpoint, and the job run again resuming there (issue 51).

What Slurm's time limit, preemption, `scancel` or a requeue, and `livemig stop`, ask of a
job: the ranks agree on a step inside its collective, write one checkpoint of its boundary
and exit (75); the same command run again with the same --checkpoint-dir resumes there by
itself and ends equal, rank by rank, to a run that never stopped. Each kind of parallelism
votes in its own collective (the gradient average, the ZeRO-1 barrier, the FSDP2 commit
vote), so each is checked, with a kill recovered from a spare before the stop in the same
job. The netns version (SIGTERM to every agent of a two-node job) is in test_nodes.py.

CI budget: ~2 min (three stopped runs and their resumptions; the references are shared).
"""

from __future__ import annotations

import os

import pytest

from livemig.checkpoint_dir import FINISHED, step_name
from tests.e2e.conftest import MLP_ZERO1, REPO, STEPS, WORKLOAD, explain, livemig_run, rank_files, reference_of
from tests.e2e.test_real_scripts import PORT, port_work
from tests.e2e.test_real_scripts import STEPS as PORT_STEPS

FSDP_PORT = os.path.join(REPO, "tests", "helpers", "fsdp_port.py")
FSDP_STEPS = 14  # tests/e2e/test_fsdp2.py's: the same reference

# kind -> (script, ranks, steps, workload with {out}, the kill recovered before the stop)
CASES = {
    # steps padded to 30 ms: the stop asked at step 20 lands well before the last step also on
    # a loaded machine (at 5 ms, once, the leader's mark reached the members 19 steps later)
    "ddp-port": (PORT, 2, PORT_STEPS, port_work((), 30, "{out}"), "kill:rank=1:step=5"),
    "zero1": (MLP_ZERO1, 3, STEPS, WORKLOAD, "kill:rank=2:step=4"),
    # padded to 60 ms for the same reason (unpadded, a loaded CI ran all 14 steps before the stop's mark)
    "hsdp": (
        FSDP_PORT,
        4,
        FSDP_STEPS,
        ["--steps", str(FSDP_STEPS), "--out", "{out}", "--step-ms", "60"],
        "kill:rank=3:step=3",
    ),
}


@pytest.mark.parametrize("kind", list(CASES))
def test_a_stopped_job_run_again_resumes_at_its_checkpoint_exactly(tmp_path, references, kind):
    script, nproc, steps, work, kill = CASES[kind]
    # the port's step padding (a sleep) changes no state: the port tests' reference, without it
    unpadded = work[: work.index("--step-ms")] + work[work.index("--step-ms") + 2 :] if "--step-ms" in work else work
    ref = reference_of(references, nproc, script, port_work((), 0, "{out}") if kind == "ddp-port" else unpadded)
    ck = tmp_path / "ck"
    cli = ("--checkpoint-dir", str(ck), "--checkpoint-every", "1000")
    stop_at = steps // 2

    def run(job_dir: str, faults: tuple[str, ...], spares: int):
        out = tmp_path / job_dir
        out.mkdir()
        wl = [w.replace("{out}", str(out)) for w in work]
        return livemig_run(tmp_path, nproc, spares=spares, faults=faults, script=script, job=f"stop-{kind}",
                           extra=cli, workload=wl, timeout=300), out  # fmt: skip

    stopped, out = run("out-stopped", (kill, f"stop:step={stop_at}"), 1)
    res = stopped.report.get("result") or {}
    assert stopped.rc == 75 and res.get("state") == "stopped", explain(stopped)
    assert stop_at <= res["step"] < steps - 1, res
    assert [r["kind"] for r in stopped.report["recoveries"]] == ["failure"], explain(stopped)
    assert "run the job again with the same --checkpoint-dir" in stopped.stderr, stopped.stderr[-2000:]
    assert not list(out.glob("rank*.json")), "user code after the loop ran in a stopped job"
    assert sorted(n for n in os.listdir(ck) if n.startswith("step_")) == [step_name(res["step"])]

    again, out = run("out-again", (), 0)
    assert again.rc == 0, explain(again)
    assert f"resuming from {ck / step_name(res['step'])}" in again.stdout + again.stderr, explain(again)
    assert again.report["steps_completed"] == steps and again.report["replicas_identical"], explain(again)
    assert again.report["rank_digests"] == ref.report["rank_digests"], explain(again)
    if kind != "zero1":  # the ports dump every rank's state: equal part by part
        ref_ranks, ranks = rank_files(ref.out), rank_files(out)
        assert set(ranks) == set(ref_ranks)
        for r, want in ref_ranks.items():
            assert ranks[r]["model"] == want["model"] and ranks[r]["optimizer"] == want["optimizer"], r
    # it finished: run once more, it starts afresh instead of resuming a checkpoint it went past
    assert (ck / FINISHED).exists()
