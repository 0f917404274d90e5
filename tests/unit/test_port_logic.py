"""What the real-scripts work rests on, piece by piece: tuples survive the wire, the update
a migrating spare repeats is the one the optimizer applied (clip, GradScaler skip), the
start-up sync over a real gloo group, the fault gate over a real socket."""

from __future__ import annotations

import copy
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from livemig.comm.group import build_group, retire
from livemig.errors import ConfigError
from livemig.fault_gate import Gate, GateServer, gated, plan_env
from livemig.faults import parse_fault
from livemig.runtime.registry import Registry
from livemig.runtime.start_sync import check_replicas, sync_start
from livemig.state import pack, unpack


def _types(a, b, path="") -> None:
    """Recursively: tensors by torch.equal, dtype and shape; every other leaf and key by type and ==."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            assert type(k) is type(next(x for x in b if x == k)), f"{path}: key {k!r}"
            _types(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _types(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def test_state_comes_back_with_the_types_it_left_with():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), amsgrad=True)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    tree = {"opt": opt.state_dict(), "odd": {1: (None, True, 2, 2.5, "s", b"b", [(1,), []]), "k": ()}}
    back = unpack(pack(tree))
    _types(tree, back)
    fresh = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters())
    fresh.load_state_dict(back["opt"])
    assert type(fresh.param_groups[0]["betas"]) is tuple


def _trio(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**6, growth_interval=1)
    reg = Registry()
    reg.set(model, opt, {"scaler": scaler})
    return model, opt, scaler, reg


@pytest.mark.parametrize("overflow", [False, True], ids=["clipped-step", "skipped-step"])
def test_a_catching_up_spare_repeats_the_update_the_optimizer_applied(overflow):
    model, opt, scaler, reg = _trio()
    twin = copy.deepcopy((model, opt, scaler))
    treg = Registry()
    treg.set(twin[0], twin[1], {"scaler": twin[2]})
    for step in range(4):
        loss = model(torch.randn(5, 6)).pow(2).mean() * 50
        if overflow and step == 2:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)  # changes .grad after the average
        applied: list = []
        reg.step_optimizer(scaler, applied)
        assert applied[0]["stepped"] is not (overflow and step == 2)
        treg.apply_step(applied[0])
    for a, b in zip(model.parameters(), twin[0].parameters(), strict=True):
        assert torch.equal(a, b)
    _types(opt.state_dict(), twin[1].state_dict())
    assert scaler.state_dict() == twin[2].state_dict()
    if overflow:
        assert scaler.get_scale() != 2.0**6 * 2**4  # it backed off once


def test_an_unregistered_scaler_is_refused_with_one_line():
    _, _, _, reg = _trio()
    with pytest.raises(ConfigError, match="register the GradScaler as an extra"):
        reg.extra_state_of(torch.amp.GradScaler("cpu"))


def _two_ranks(work):
    """Run work(rank, pg) on two ranks of a real gloo group, one thread each."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    out, errs = {}, []

    def one(r: int) -> None:
        pg = build_group(f"127.0.0.1:{store.port}", 1, r, 2, timedelta(seconds=20))
        try:
            out[r] = work(r, pg)
        except Exception as exc:  # noqa: BLE001 - reported below
            errs.append(exc)
        finally:
            retire(pg, idle=True)

    ts = [threading.Thread(target=one, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    return out, errs


def test_start_up_sync_makes_every_replica_rank_0s_and_the_step_0_check_names_a_divergent_rank():
    regs = {}
    for r in range(2):
        torch.manual_seed(100 + r)  # a per-rank seed, as DDP scripts have
        m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1).double())
        reg = Registry()
        reg.set(m, torch.optim.SGD(m.parameters(), lr=0.1), {})
        regs[r] = reg
    want = {k: v.clone() for k, v in regs[0].model.state_dict().items()}
    assert not torch.equal(regs[1].model[0].weight, want["0.weight"])

    synced = {}

    def work(r, pg):
        sync_start(regs[r], pg, r, timedelta(seconds=20))
        check_replicas(regs[r], pg, r, 2, timedelta(seconds=20))  # equal: passes
        synced[r] = {k: v.clone() for k, v in regs[r].model.state_dict().items()}
        if r == 1:
            with torch.no_grad():
                regs[r].model[0].bias.add_(1)
        check_replicas(regs[r], pg, r, 2, timedelta(seconds=20))

    _, errs = _two_ranks(work)
    for k, v in synced[1].items():  # parameters, BatchNorm buffers, the float64 layer: rank 0's
        assert torch.equal(v, want[k]) and v.dtype == want[k].dtype, k
    line = "the parameters differ between rank 0 and rank 1 after step 0"
    assert len(errs) == 2 and all(line in str(e) for e in errs)


def test_fault_gate_holds_the_rank_until_the_agent_answers():
    faults = [parse_fault("kill:rank=1:step=11"), parse_fault("kill:rank=0:step=3:during=build"),
              parse_fault("coordinator-kill:step=5"), parse_fault("kill:rank=1:step=2:during=allreduce"),
              parse_fault("hang:rank=0:step=4:after=2")]  # fmt: skip
    assert [gated(f) for f in faults] == [True, False, True, False, False]
    server = GateServer(lambda: None)
    try:
        gate = Gate({"LIVEMIG_FAULT_GATE": server.path, "LIVEMIG_FAULT_PLAN": plan_env(faults)})
        assert gate.wants(1, 11) and gate.wants(0, 5) and gate.wants(1, 5) and not gate.wants(0, 11)
        with pytest.raises(ConfigError, match="kill of rank 1 at step 11 would never land: the job runs steps 0..9"):
            gate.check_total(10)
        gate.check_total(12)
        done = threading.Event()
        t = threading.Thread(target=lambda: (gate.wait(1, 11, "inc"), done.set()))
        t.start()
        arrivals = []
        for _ in range(200):
            arrivals += server.take()
            if arrivals:
                break
            done.wait(0.01)
        assert [(a.rank, a.step, a.incarnation) for a in arrivals] == [(1, 11, "inc")]
        assert not done.wait(0.2), "the rank went on before the agent's word"
        server.release(arrivals[0])
        assert done.wait(5)
        t.join(5)
    finally:
        server.close()


def test_an_onward_gate_stops_its_rank_at_every_boundary_from_its_step_until_the_agent_says_end():
    """`during=migrated`: the target stops at each boundary from S on (the agent answers at once
    while the migration runs, or lands the fault), and stops no more once told "end"."""
    f = parse_fault("kill:rank=0:step=5:during=migrated")
    assert gated(f) and not gated(parse_fault("kill:rank=0:step=5:during=commit"))
    server = GateServer(lambda: None)
    try:
        gate = Gate({"LIVEMIG_FAULT_GATE": server.path, "LIVEMIG_FAULT_PLAN": plan_env([f])})
        assert not gate.wants(0, 4) and gate.wants(0, 5) and gate.wants(0, 9) and not gate.wants(1, 9)
        assert gate.only_onward(0, 9)
        for word, step in ((b"go", 6), (b"end", 7)):
            t = threading.Thread(target=gate.wait, args=(0, step, "inc"))
            t.start()
            arrivals = []
            for _ in range(500):
                arrivals += server.take()
                if arrivals:
                    break
                time.sleep(0.01)
            assert [(a.rank, a.step) for a in arrivals] == [(0, step)]
            server.release(arrivals[0], word)
            t.join(5)
            assert not t.is_alive()
        assert not gate.wants(0, 8), "told 'end', the rank stops at no more boundaries"
    finally:
        server.close()
