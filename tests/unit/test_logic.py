"""Pure logic: fault plans, the report's downtime arithmetic, timeouts."""

from __future__ import annotations

import pytest

from livemig.config import Timeouts
from livemig.errors import ConfigError
from livemig.faults import parse_fault
from livemig.report import recoveries


def test_parse_fault():
    f = parse_fault("kill:rank=1:step=10:during=allreduce")
    assert (f.kind, f.rank, f.step, f.during, f.in_process) == ("kill", 1, 10, "allreduce", True)
    assert parse_fault("hang:rank=0:step=3:resume=2.5").resume_after == 2.5
    for bad in (
        "explode:rank=1:step=1",
        "kill:rank=x:step=1",
        "kill:step=1",
        "kill:rank=1:step=1:zz=1",
        "kill:rank=1:step=1:during=later",
        "kill:rank=1:step=1:resume=3",
    ):
        with pytest.raises(ConfigError, match="bad fault"):
            parse_fault(bad)


def test_downtime_and_phases():
    commits = [(s, 100.0 + s * 0.1) for s in range(10)] + [(s, 103.0 + s * 0.1) for s in range(10, 20)]
    ev = [
        {"phase": "fault", "time": 101.0, "generation": 1},
        {"phase": "detect", "time": 101.05, "generation": 2, "ranks": [1]},
        {"phase": "fence", "time": 101.06, "generation": 2},
        {"phase": "agree", "time": 101.07, "generation": 2},
        {"phase": "claim", "time": 101.08, "generation": 2},
        {"phase": "stream", "time": 101.1, "generation": 2, "bytes": 100, "seconds": 0.2},
        {"phase": "build", "time": 101.5, "generation": 2},
        {"phase": "commit", "time": 101.6, "generation": 2},
    ]
    (r,) = recoveries(ev, commits, 0.1)
    # last commit before the fault: step 9 at 100.9; first after: step 10 at 104.0
    assert r["downtime_s"] == pytest.approx(104.0 - 100.9 - 0.1)
    assert r["phases"]["detect"] == pytest.approx(0.05)
    assert r["phases"]["stream"] == pytest.approx(0.2)
    assert r["phases"]["build"] == pytest.approx(0.42 - 0.2)
    assert r["phases"]["resume"] == pytest.approx(104.0 - 101.6)
    assert r["bytes_streamed"] == 100 and r["rank"] == 1


def test_timeouts_from_env(monkeypatch):
    monkeypatch.setenv("LIVEMIG_LEASE_TTL", "1.5")
    assert Timeouts.from_env().lease_ttl_s == 2
    monkeypatch.setenv("LIVEMIG_COLLECTIVE_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="LIVEMIG_COLLECTIVE_TIMEOUT"):
        Timeouts.from_env()
