"""torch.distributed before the loop (issue 50): the default group from the function's first
line, and collectives before `ctx.steps()` that still hold when the function is entered again.

tests/helpers/startup_proc.py checks `dist.get_rank()`/`get_world_size()`, broadcasts rank 0's
config, waits at a barrier and all-gathers per-rank draws before its loop, and its data depends
on what it received; a claimed spare, a migrating spare and a cold restart's processes enter
it again and are answered from what the rank received when the job started
(runtime/preloop.py). Each run is held to the fault-free run's state and files, rank by rank.
"""

from __future__ import annotations

import os

from tests.e2e.conftest import REPO, explain, livemig_run, rank_files, reference_of

STARTUP = os.path.join(REPO, "tests", "helpers", "startup_proc.py")
STEPS = 20


def _work(out, *extra: str) -> list[str]:
    return ["--steps", str(STEPS), "--out", str(out), *extra]


def _same(run, ref, got: dict[int, dict], want: dict[int, dict]) -> None:
    rep = run.report
    assert run.rc == 0 and rep["result"]["state"] == "done", explain(run)
    assert rep["steps_completed"] == STEPS, explain(run)
    assert rep["state_digest"] == ref.digest, "final state differs from the fault-free run\n" + explain(run)
    assert got == want, explain(run)


def test_collectives_before_the_loop_hold_through_a_kill_a_migration_and_a_cold_restart(tmp_path, references):
    ref = reference_of(references, 2, STARTUP, _work("{out}"))
    want = rank_files(ref.out)
    assert len(want) == 2 and want[0]["cfg"] == want[1]["cfg"] and want[0]["mix"] == want[1]["mix"], want

    out = tmp_path / "live"
    out.mkdir()
    faults = ("kill:rank=1:step=6", "migrate:rank=0:step=12")
    run = livemig_run(tmp_path, 2, spares=2, faults=faults, script=STARTUP, job="live", workload=_work(out),
                      env={"STARTUP_SLEEP": "0.1"})  # fmt: skip
    _same(run, ref, rank_files(out), want)
    assert [r["kind"] for r in run.report["recoveries"]] == ["failure"], explain(run)
    assert [m["outcome"] for m in run.report["migrations"]] == ["done"], explain(run)
    logs = run.stdout + run.stderr
    assert "Default process group has not been initialized" not in logs

    out = tmp_path / "cold"
    out.mkdir()
    ck = ("--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "4", "--recovery", "cold")
    run = livemig_run(tmp_path, 2, faults=("kill:rank=1:step=10",), script=STARTUP, job="cold",
                      workload=_work(out), extra=ck)  # fmt: skip
    _same(run, ref, rank_files(out), want)
    assert [r["kind"] for r in run.report["recoveries"]] == ["restart"], explain(run)


def test_a_reentry_that_makes_other_collectives_before_the_loop_gets_one_line(tmp_path):
    out = tmp_path / "more"
    out.mkdir()
    run = livemig_run(tmp_path, 2, spares=1, faults=("kill:rank=1:step=5",), script=STARTUP, job="more",
                      workload=_work(out, "--more-on-reentry"), timeout=120)  # fmt: skip
    text = run.stdout + run.stderr
    assert run.rc != 0, explain(run)
    assert "the code before ctx.steps() must make the same collectives on every entry" in text, explain(run)
    assert "is the coordinator running" not in text, explain(run)


def test_a_job_started_from_an_earlier_runs_checkpoint_recovers_a_kill_a_shrink_and_a_cold_restart(
    tmp_path, references
):
    """The torchrun pattern: the script loads the model with DCP before its loop (here from a fault-free
    run's checkpoint), then broadcasts, barriers and all-gathers. A kill (the spare enters the function
    again: its DCP load and collectives are answered from rank 1's record), then a second kill with no
    spare left (the job shrinks: rank 0's body carried by rank 1), and, in a second job, a cold restart;
    each ends with the state of the same resumed run without faults."""
    saved = reference_of(references, 2, STARTUP, ["--steps", "6", "--save", "{out}/ck"])
    ck = str(saved.out / "ck")
    ref = reference_of(references, 2, STARTUP, _work("{out}", "--resume", ck))

    out = tmp_path / "shrunk"
    out.mkdir()
    run = livemig_run(tmp_path, 2, spares=1, faults=("kill:rank=1:step=5", "kill:rank=0:step=12"), script=STARTUP,
                      job="resumed", workload=_work(out, "--resume", ck), env={"STARTUP_SLEEP": "0.05"},
                      extra=("--min-nproc", "1", "--shrink-wait", "1"))  # fmt: skip
    rep = run.report
    assert run.rc == 0 and rep["result"]["state"] == "done" and rep["steps_completed"] == STEPS, explain(run)
    assert [r["kind"] for r in rep["recoveries"]] == ["failure", "shrink"], explain(run)
    assert rep["state_digest"] == ref.digest, "final state differs from the resumed fault-free run\n" + explain(run)
    want = rank_files(ref.out)
    assert rank_files(out)[1] == want[1], explain(run)  # the carrier's own; rank 0's body ran in it

    out = tmp_path / "cold"
    out.mkdir()
    ck_dir = ("--checkpoint-dir", str(tmp_path / "ck2"), "--checkpoint-every", "4", "--recovery", "cold")
    run = livemig_run(tmp_path, 2, faults=("kill:rank=0:step=10",), script=STARTUP, job="resumedcold",
                      workload=_work(out, "--resume", ck), extra=ck_dir)  # fmt: skip
    _same(run, ref, rank_files(out), want)
    assert [r["kind"] for r in run.report["recoveries"]] == ["restart"], explain(run)


COMPILED = os.path.join(REPO, "tests", "helpers", "compiled_proc.py")


def test_a_model_compiled_before_the_loop_recovers_exactly_when_the_function_runs_again(tmp_path, references):
    """torch.compile before the loop: the claimed spare compiled the model in standby and compiles it
    again in the same process when it enters the function as rank 1; the compiled module itself is
    registered. The final state equals the fault-free run's."""
    work = ["--steps", "20", "--register-compiled"]
    ref = reference_of(references, 2, COMPILED, work)
    run = livemig_run(tmp_path, 2, spares=1, faults=("kill:rank=1:step=8",), script=COMPILED, job="compiled",
                      workload=work)  # fmt: skip
    assert run.rc == 0 and run.report["steps_completed"] == 20, explain(run)
    assert [r["kind"] for r in run.report["recoveries"]] == ["failure"], explain(run)
    assert run.report["state_digest"] == ref.digest, "final state differs from the fault-free run\n" + explain(run)
