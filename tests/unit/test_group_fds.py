"""Retired process groups are shut down and their sockets closed: the open file
descriptors of a member do not grow with generation switches (issue 19)."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch.distributed as dist

from tests.conftest import REPO

HELPER = os.path.join(REPO, "tests", "helpers", "switch_proc.py")
SWITCHES = 10


def _switch(procs, idle: bool) -> list[dict]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    addr = f"127.0.0.1:{store.port}"
    ps = [procs.spawn([sys.executable, HELPER, str(r), "2", addr, str(SWITCHES), "idle" if idle else "busy"])
          for r in range(2)]  # fmt: skip
    out = []
    for p in ps:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr.decode()[-2000:]
        out.append(json.loads(stdout.decode().strip().splitlines()[-1]))
    return out


def test_ten_generation_switches_do_not_leak_file_descriptors(procs):
    for rank in _switch(procs, idle=True):
        fds = rank["fds"]
        assert fds[-1] <= fds[1] + 2, f"open fds grew across switches: {fds}"
        assert rank["graveyard"] == 0


def test_a_group_that_may_be_busy_waits_for_the_timeout_before_it_is_closed(procs):
    """Retired without `idle` (a collective may still be inside it): kept, not shut down."""
    for rank in _switch(procs, idle=False):
        assert rank["graveyard"] == SWITCHES - 1
        assert rank["fds"][-1] > rank["fds"][1] + 4, rank["fds"]  # the sockets stay: that is the cost


@pytest.fixture(autouse=True)
def _no_host(monkeypatch):
    monkeypatch.delenv("LIVEMIG_HOST", raising=False)
