"""runtime/preloop.py's pure logic: the record's tensor form, where each collective's results
land, the answers a process entering the function again gets, and the refusals (one line).
The live paths (a worker's start-up groups, a spare answered from etcd) run in
tests/e2e/test_startup.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from livemig.comm import torch_group
from livemig.config import ENV_PRELOOP_MAX_MB
from livemig.errors import ConfigError
from livemig.runtime.preloop import PreLoop, pack_tensor, unpack_tensor


@pytest.mark.parametrize(
    "t",
    [torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.tensor(3.5, dtype=torch.bfloat16),
     torch.tensor([True, False]), torch.empty(0, 4), torch.arange(5, dtype=torch.int64)[::2]],
)  # fmt: skip
def test_a_recorded_tensor_comes_back_bit_for_bit(t):
    back = unpack_tensor(pack_tensor(t))
    assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)


def test_the_outputs_of_each_collective_are_where_torch_writes_them():
    a, b, c = torch.zeros(1), torch.zeros(2), torch.zeros(3)
    assert torch_group.outputs_of("broadcast", ([a, b], None)) == [a, b]
    assert torch_group.outputs_of("allgather", ([[a, b], [c]], [a])) == [a, b, c]
    assert torch_group.outputs_of("_allgather_base", (c, a)) == [c]
    assert torch_group.outputs_of("barrier", (None,)) == []
    assert torch_group.outputs_of("send", ([a], 1, 0)) == []
    assert torch_group.outputs_of("gather", ([], [a])) == []  # a non-root rank receives nothing
    assert set(torch_group._OUTPUTS) >= {n for n in dir(torch_group.SwappableGroup) if n in torch_group._OUTPUTS}


def _host():
    return SimpleNamespace(rank=1, runtime=None)


def _recorded(calls):
    """A PreLoop holding rank 1's record of `calls` ([(group, op, [tensors])])."""
    pl = PreLoop(_host())
    g = {}
    for name, op, ts in calls:
        g.setdefault(name, SimpleNamespace(group_name=name))
        pl._record(g[name], op, ts)
    pl.rank, pl.mode, pl.cursor = 1, "answer", 0
    return pl, g


def test_an_entry_again_is_answered_in_order_and_refused_where_it_differs():
    cfg, mine = torch.tensor([7, 8, 9], dtype=torch.uint8), torch.tensor([0.25, 0.5])
    pl, g = _recorded([("0-1.0", "broadcast", [cfg]), ("0-1.0", "barrier", []), ("0-1.0", "allgather", [mine, mine])])
    out = torch.zeros(3, dtype=torch.uint8)
    pl._answer(g["0-1.0"], "broadcast", [out])
    assert torch.equal(out, cfg)
    pl._answer(g["0-1.0"], "barrier", [])
    with pytest.raises(ConfigError, match=r"call 3 of rank 1 there was allgather on group 0-1.0 \[\[2\], \[2\]\]"):
        pl._answer(g["0-1.0"], "allgather", [torch.zeros(3), torch.zeros(3)])  # other shapes
    got = [torch.zeros(2), torch.zeros(2)]
    pl._answer(g["0-1.0"], "allgather", got)
    assert all(torch.equal(x, mine) for x in got)
    with pytest.raises(ConfigError, match="call 4, but rank 1 made 3 there") as e:
        pl._answer(g["0-1.0"], "barrier", [])
    assert "\n" not in str(e.value)


def test_another_op_or_group_is_refused():
    pl, g = _recorded([("0-1.0", "barrier", [])])
    with pytest.raises(ConfigError, match="call 1 of rank 1 there was barrier on group 0-1.0"):
        pl._answer(SimpleNamespace(group_name="0-1.0"), "allreduce", [torch.zeros(1)])
    with pytest.raises(ConfigError, match="was barrier on group 0-1.0"):
        pl._answer(SimpleNamespace(group_name="0.1"), "barrier", [])


def test_the_record_is_capped_with_one_line(monkeypatch):
    monkeypatch.setenv(ENV_PRELOOP_MAX_MB, "0.001")  # ~1 KiB
    pl = PreLoop(_host())
    g = SimpleNamespace(group_name="0-1.0")
    pl._record(g, "broadcast", [torch.zeros(100)])  # 400 B
    with pytest.raises(ConfigError, match=f"over {ENV_PRELOOP_MAX_MB}=0.001 MiB") as e:
        pl._record(g, "all_gather_single", [torch.zeros(1000)])
    assert "\n" not in str(e.value)
    monkeypatch.setenv(ENV_PRELOOP_MAX_MB, "lots")
    with pytest.raises(ConfigError, match="is not a number of MiB"):
        pl._record(g, "barrier", [])
