"""The reconfigure communicator (comm/communicator.py, LIVEMIG_COMM=reconfigure, torch >= 2.14):
every generation's group re-formed through torch's reconfigure API instead of a new backend,
carrying a kill, a planned migration and a shrink (plain data parallel) and an HSDP mesh
(FSDP2) across generations, exact where the swap is exact.

Each test asserts that the path was really taken: the timeline's build events name the
communicator and count the re-forms, and a survivor trained again on an object it had trained
on before (`reused`). On a torch without the API the choice fails the job at once with its
line instead of quietly using the swap.

CI budget: ~2 min (a plain job with three faults, an HSDP job with two, one short refusal; the
HSDP reference is test_fsdp2.py's, cached).
"""

from __future__ import annotations

import os

import pytest

from livemig.comm.communicator import reconfigure_available
from tests.e2e.conftest import REPO, explain, livemig_run, rank_files, reference_of
from tests.e2e.test_shrink import finals_of, samples_of

RECONFIGURE = {"LIVEMIG_COMM": "reconfigure"}
needs_api = pytest.mark.skipif(not reconfigure_available(), reason="the installed torch has no reconfigure API (2.14+)")

SHRINK_SCRIPT = os.path.join(REPO, "tests", "helpers", "shrink_proc.py")
FSDP_PORT = os.path.join(REPO, "tests", "helpers", "fsdp_port.py")


def _builds(run) -> list[dict]:
    return [e for e in run.report.get("timeline", []) if e["phase"] == "build"]


@needs_api
def test_a_kill_a_migration_and_a_shrink_through_reconfigure_read_the_fault_free_samples(tmp_path, references):
    """Plain data parallel, 3 workers, 2 spares: rank 1 killed at step 6 (a spare takes it),
    rank 0 migrated to the other spare at step 12, rank 2 killed at step 20 with no spare
    left: the survivors carry it (shrink). Every (step, rank)
    reads the fault-free run's samples, and the parameters end within the shrink bound
    (test_shrink.py's; bit-identical up to the shrink)."""
    steps = 30
    ref = reference_of(references, 3, SHRINK_SCRIPT, ["--steps", str(steps), "--dump", "{out}"])
    dump = tmp_path / "dump"
    dump.mkdir()
    run = livemig_run(tmp_path, 3, spares=2, job="rcplain", script=SHRINK_SCRIPT, env=RECONFIGURE,
                      faults=("kill:rank=1:step=6", "migrate:rank=0:step=12", "kill:rank=2:step=20:during=migrated"),
                      extra=("--min-nproc", "2", "--shrink-wait", "0.5"),
                      workload=["--steps", str(steps), "--dump", str(dump)])  # fmt: skip
    assert run.rc == 0, explain(run)
    assert run.report["steps_completed"] == steps, explain(run)
    kinds = [r["kind"] for r in run.report["recoveries"]]
    assert len(kinds) == 2 and kinds[-1] == "shrink", explain(run)
    assert len(run.report.get("migrations", [])) == 1, explain(run)
    builds = _builds(run)
    assert len(builds) >= 2 and all(b.get("comm") == "reconfigure" for b in builds), builds
    # every member of every generation re-formed (at least one re-form each), and in the shrink's
    # generation the survivors re-formed objects that had trained before (retired at the switch)
    assert all(b["reconfigures"] > 0 for b in builds) and builds[-1]["reused"] >= 1, builds
    assert samples_of(dump) == samples_of(ref.out)
    finals, want = finals_of(dump), finals_of(ref.out)
    assert set(finals) == {0, 1}, finals.keys()
    for r, f in finals.items():
        top = max(abs(v) for vals in want[r]["state"].values() for v in vals)
        pairs = ((a, b) for k, vals in want[r]["state"].items() for a, b in zip(vals, f["state"][k], strict=True))
        worst = max(abs(a - b) for a, b in pairs)
        assert worst <= 1e-6 * top, f"rank {r}: max |param - fault-free| {worst:.3g} > 1e-6 x {top:.3g}"


@needs_api
def test_hsdp_through_a_migration_and_a_kill_on_reconfigured_groups_is_exact(tmp_path, references):
    """HSDP (replicate 2, shard 2): rank 1 migrates to a spare at step 3, rank 0 is killed at
    step 11; every mesh dimension is re-formed in both generation changes. Bit-identical rank by
    rank to the fault-free run, and the kill's generation re-forms the objects the migration
    retired at its switch (the same backend objects train again)."""
    steps = 14
    ref = reference_of(references, 4, FSDP_PORT, ["--steps", str(steps), "--out", "{out}"])
    out = tmp_path / "out"
    out.mkdir()
    run = livemig_run(tmp_path, 4, spares=2, job="rchsdp", script=FSDP_PORT, env=RECONFIGURE, timeout=300,
                      faults=("migrate:rank=1:step=3", "kill:rank=0:step=11:during=migrated"),
                      workload=["--steps", str(steps), "--step-ms", "150", "--out", str(out)])  # fmt: skip
    assert run.rc == 0, explain(run)
    assert run.report["steps_completed"] == steps and run.report["replicas_identical"], explain(run)
    assert len(run.report["recoveries"]) == 1, explain(run)
    ranks, want = rank_files(out), rank_files(ref.out)
    for r, w in want.items():
        for part in ("model", "optimizer", "carry", "sums"):
            assert ranks[r][part] == w[part], f"rank {r}'s {part} differs from the fault-free run's"
    assert run.report["rank_digests"] == ref.report["rank_digests"], explain(run)
    (build,) = _builds(run)
    assert build["comm"] == "reconfigure" and build["reused"] >= 1, build


@pytest.mark.skipif(reconfigure_available(), reason="the installed torch has the reconfigure API")
def test_reconfigure_asked_of_a_torch_without_it_fails_at_once_with_its_line(tmp_path):
    run = livemig_run(tmp_path, 2, job="rcno", env=RECONFIGURE, workload=["--steps", "4"], timeout=120)
    assert run.rc != 0
    assert "LIVEMIG_COMM=reconfigure needs torch 2.14 or later" in (run.stderr + run.stdout), explain(run)
