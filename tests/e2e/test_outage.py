"""An etcd outage is ridden through: every embedded etcd member SIGSTOPped for 3 x the
lease TTL mid-run. Training goes on in the current group (steps are committed during
the outage), no rank is fenced, leases that expired meanwhile are re-attached, and the
final state is bit-identical to a fault-free run. A worker killed during the outage is
recovered once etcd is back, exactly."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import explain
from tests.e2e.test_exact_state import run_script

TTL = 2  # livemig_run passes --lease-ttl 2
STEPS = 100
ARGS = ("--model", "cnn")
OUTAGE = f"etcd-stop:step=8:resume={3 * TTL}"


@pytest.fixture(scope="module")
def reference(stateful_reference):
    return stateful_reference(2, ARGS, STEPS)


def outage_run(tmp_path, faults, env: dict | None = None):
    return run_script(tmp_path, 2, spares=1, faults=faults, args=ARGS, job="o", steps=STEPS,
                      env={"STATEFUL_STEP_SLEEP": "0.1", **(env or {})})  # fmt: skip


def assert_same_state(run, ranks, reference):
    ref_report, ref_ranks = reference
    assert run.rc == 0, explain(run)
    assert run.report["steps_completed"] == STEPS, explain(run)
    assert run.report["state_digest"] == ref_report["state_digest"], explain(run)
    assert ranks == ref_ranks


def test_training_goes_on_through_an_etcd_outage(tmp_path, reference):
    run, ranks = outage_run(tmp_path, (OUTAGE,))
    assert_same_state(run, ranks, reference)
    (outage,) = run.report["etcd_outages"]
    assert outage["seconds"] >= 3 * TTL
    assert outage["steps_committed"] >= 10, outage  # the group trained on while etcd was stopped
    assert run.report["recoveries"] == [], explain(run)
    assert not [e for e in run.report["timeline"] if e["phase"] in ("detect", "fence")], explain(run)
    codes = {p["name"]: p["exit_code"] for p in run.report["processes"]}
    assert codes["worker-0"] == codes["worker-1"] == 0, codes
    assert codes["spare-0"] in (0, -15), codes  # warm all along (its lease re-attached): exits at the end


def test_a_worker_killed_during_an_outage_is_recovered_once_etcd_is_back(tmp_path, reference):
    # armed at rank 1's step 7: rank 1's progress of step 8 may still be on its way to etcd when
    # any rank's step 8 stops etcd (then the kill would arm only after the outage)
    run, ranks = outage_run(tmp_path, (OUTAGE, "kill:rank=1:step=7:after=2"))
    assert_same_state(run, ranks, reference)
    (outage,) = run.report["etcd_outages"]
    kill = next(f for f in run.report["faults_injected"] if f["kind"] == "kill")
    assert outage["start"] < kill["time"] < outage["end"], run.report["faults_injected"]
    (rec,) = run.report["recoveries"]
    assert rec["rank"] == 1
    detect = next(e for e in run.report["timeline"] if e["phase"] == "detect")
    assert detect["time"] >= outage["end"] - 0.5  # found once etcd answered again, not before
    assert detect["time"] - outage["end"] < 3.0, detect  # and at once then: the agent's report
