"""First contact: a script that fails before it trains ends `livemig run` at once, with
the reason on screen, instead of waiting for --max-wall (issue 30, item 1). CI budget ~25 s."""

from __future__ import annotations

import os
import time

import pytest

from tests.e2e.conftest import REPO, explain, livemig_run

BROKEN = os.path.join(REPO, "tests", "helpers", "broken")


@pytest.mark.parametrize(
    "script,line,bound",
    [
        ("syntax_error.py.txt", "SyntaxError: ", 10),
        ("raises_at_import.py", "RuntimeError: boom at import", 10),
        # the worker imports torch and builds its model first: a little longer on 2 busy cores
        ("never_trains.py", "returned without running `for step in ctx.steps(n)`", 15),
    ],
    ids=["syntax-error", "raises-at-import", "never-trains"],
)
def test_a_script_that_fails_before_training_ends_the_run_at_once(tmp_path, script, line, bound):
    t0 = time.monotonic()
    run = livemig_run(tmp_path, 2, spares=1, script=os.path.join(BROKEN, script), workload=[], timeout=120)
    took = time.monotonic() - t0
    assert run.rc != 0, explain(run)
    assert line in run.stdout + run.stderr, explain(run)
    assert took < bound, f"took {took:.1f}s"
    if script != "never_trains.py":  # that one ends through the worker's own error, as a misuse does
        assert "before the job formed" in run.stdout, explain(run)
        assert "no final state: no rank finished the job" in run.stdout
