"""Shared fixtures: real etcd servers, cleaned up even when a test fails."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from livemig.rdzv.embedded import EtcdCluster
from livemig.references import References

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
logging.getLogger("livemig").setLevel(logging.INFO)


@pytest.fixture(scope="session")
def references(tmp_path_factory, request) -> References:
    """The session's fault-free reference runs, one per key (livemig/references.py):
    every test and the faults matrix ask this one cache. Under pytest-xdist each worker
    is a session of its own, so the store sits in the run's shared base directory (the
    parent of the worker's), where its flocks make one run per key for all workers."""
    if not hasattr(request.config, "workerinput"):  # not an xdist worker
        return References(tmp_path_factory.mktemp("refs"))
    return References(tmp_path_factory.getbasetemp().parent / "refs")


@pytest.fixture(autouse=True)
def _own_state_dir(tmp_path, monkeypatch) -> None:
    """Every test's runs keep their job files and logs in the test's own directory, never
    the machine's default: two tests at once (pytest-xdist) would otherwise see each
    other's job of the same name as a live duplicate."""
    monkeypatch.setenv("LIVEMIG_STATE_DIR", str(tmp_path / "livemig-state"))


@pytest.fixture(scope="module")
def etcd() -> Iterator[EtcdCluster]:
    with EtcdCluster(size=1) as cluster:
        yield cluster


@pytest.fixture
def etcd3() -> Iterator[EtcdCluster]:
    with EtcdCluster(size=3) as cluster:
        yield cluster


class Procs:
    """Child processes in their own process groups; all killed at teardown."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def spawn(self, args: list[str], env: dict | None = None, **kw) -> subprocess.Popen:
        full_env = dict(os.environ)
        full_env["PYTHONPATH"] = REPO + os.pathsep + full_env.get("PYTHONPATH", "")
        full_env.update(env or {})
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        p = subprocess.Popen(args, env=full_env, start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def python(self, *args: str, **kw) -> subprocess.Popen:
        return self.spawn([sys.executable, *args], **kw)

    def cleanup(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            for f in (p.stdout, p.stderr):
                if f:
                    f.close()


@pytest.fixture
def procs() -> Iterator[Procs]:
    p = Procs()
    try:
        yield p
    finally:
        p.cleanup()


def pytest_collection_modifyitems(config, items) -> None:
    """Every test under tests/e2e/ and tests/faults/ runs real jobs: marked `e2e`. A test
    marked `alone` (a timing guard a test beside it spoils) is skipped where xdist runs tests
    side by side: `pytest -n 0 -m alone` runs it, as .ci/run does after the suite."""
    beside = int(getattr(config, "workerinput", {}).get("workercount", 1)) > 1  # an xdist worker with a peer
    for item in items:
        if {"e2e", "faults"} & set(item.path.parent.parts[-1:]):
            item.add_marker(pytest.mark.e2e)
        if beside and item.get_closest_marker("alone"):
            item.add_marker(pytest.mark.skip(reason="runs alone: `python -m pytest -n 0 -m alone` (.ci/run does)"))
