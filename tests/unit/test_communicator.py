"""comm/communicator.py on real gloo and a real TCPStore, members as threads of one process
(each with its own communicator, as separate processes have): a generation re-formed with a
new member in a lost one's rank, a re-form onto the same objects, ranks reassigned by
position, an abandoned re-form, and the choices that are refused."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from livemig.comm import communicator
from livemig.comm.group import CollectiveAborted
from livemig.errors import ConfigError

T = timedelta(seconds=20)
needs_api = pytest.mark.skipif(
    not communicator.reconfigure_available(), reason="the installed torch has no reconfigure API (2.14+)"
)


@pytest.fixture
def store_addr():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=T)
    yield f"127.0.0.1:{master.port}"
    del master


def _form_all(store_addr: str, gen: int, comms: dict[int, communicator.Communicator]) -> dict[int, object]:
    """Every member forms generation `gen` (rank -> its communicator) at once; rank -> group."""
    out: dict[int, object] = {}
    errs: list[BaseException] = []

    def one(rank: int, comm: communicator.Communicator) -> None:
        try:
            out[rank] = comm.form(store_addr, gen, rank, len(comms), T)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errs.append(exc)

    threads = [threading.Thread(target=one, args=(r, c)) for r, c in comms.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errs, errs
    return out


def _sums(groups: dict[int, object]) -> dict[int, list[float]]:
    """An all-reduce of (rank + 1) on every member, run concurrently."""
    res: dict[int, list[float]] = {}

    def one(rank: int, pg) -> None:
        t = torch.full((3,), float(rank + 1))
        pg.allreduce([t]).wait()
        res[rank] = t.tolist()

    threads = [threading.Thread(target=one, args=(r, pg)) for r, pg in groups.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return res


@needs_api
def test_a_new_member_takes_the_lost_ranks_index_and_idle_objects_are_reformed_not_rebuilt(store_addr):
    a, b, c = (communicator.ReconfigureComm() for _ in range(3))
    g1 = _form_all(store_addr, 1, {0: a, 1: b, 2: c})
    assert _sums(g1) == {r: [6.0] * 3 for r in range(3)}
    assert [g1[r].rank() for r in range(3)] == [0, 1, 2]

    # rank 1 lost inside a collective: the survivors retire their group as possibly busy, and a
    # new process (its own communicator) takes index 1 of generation 2
    a.retire(g1[0])
    c.retire(g1[2])
    d = communicator.ReconfigureComm()
    g2 = _form_all(store_addr, 2, {0: a, 1: d, 2: c})
    assert _sums(g2) == {r: [6.0] * 3 for r in range(3)}
    assert g2[0] is not g1[0] and a.stats()["created"] == 2  # the busy one rests; a second object
    assert a.stats()["reconfigures"] == 2 and not a.stats()["reused"]

    # a switch at a step boundary (idle): generation 3 re-forms the very objects of generation 2,
    # with ranks 0 and 2 swapped by the handles' order
    for comm, pg in ((a, g2[0]), (d, g2[1]), (c, g2[2])):
        comm.retire(pg, idle=True)
    g3 = _form_all(store_addr, 3, {2: a, 1: d, 0: c})
    assert g3[2] is g2[0] and g3[0] is g2[2] and g3[1] is g2[1]
    assert g3[2].rank() == 2 and g3[0].rank() == 0
    assert _sums(g3) == {r: [6.0] * 3 for r in range(3)}
    assert a.stats() == {"comm": "reconfigure", "reconfigures": 3, "created": 2, "reused": True}
    for comm in (a, c, d, b):
        comm.release()


@needs_api
def test_a_reform_whose_peer_never_comes_is_abandoned_when_the_generation_moves_on(store_addr):
    a = communicator.ReconfigureComm()
    moved = threading.Event()
    threading.Timer(0.3, moved.set).start()
    t0 = time.monotonic()
    with pytest.raises(CollectiveAborted, match="abandoned: generation moved on"):
        a.form(store_addr, 1, 0, 2, T, should_abort=moved.is_set)
    assert time.monotonic() - t0 < 5
    # the abandoned object rests; the next generation gets another (and a peer that comes forms)
    b = communicator.ReconfigureComm()
    g = _form_all(store_addr, 2, {0: a, 1: b})
    assert _sums(g) == {0: [3.0] * 3, 1: [3.0] * 3}
    assert a.stats()["created"] == 2
    a.release()
    b.release()


def test_the_choices_that_cannot_be_honoured_are_refused_with_one_line(monkeypatch):
    with pytest.raises(ConfigError, match="LIVEMIG_COMM='bogus': expected one of swap, reconfigure"):
        communicator.pick("gloo", "bogus")
    monkeypatch.setenv(communicator.ENV_COMM, "")
    assert communicator.pick("gloo").name == "swap"
    if communicator.reconfigure_available():
        with pytest.raises(ConfigError, match="runs on gloo or NCCL"):
            communicator.pick("mpi", "reconfigure")
        if not communicator.nccl2_available():
            with pytest.raises(ConfigError, match="needs nccl2"):
                communicator.pick("nccl", "reconfigure")
        assert communicator.pick("gloo", "reconfigure").name == "reconfigure"
    else:
        with pytest.raises(ConfigError, match="needs torch 2.14 or later"):
            communicator.pick("gloo", "reconfigure")
