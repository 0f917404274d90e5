"""The registered state: validation at register(), signatures, boundary and local state."""

from __future__ import annotations

import pytest
import torch

from livemig.coordinator.sharding import first_mismatch
from livemig.errors import ConfigError
from livemig.runtime.registry import Registry
from livemig.state import pack, unpack


class Holder:
    def __init__(self, value) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, sd: dict) -> None:
        self.value = sd["value"]


def _reg(opt_cls=torch.optim.AdamW, **kw) -> Registry:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    r = Registry()
    r.set(m, opt_cls(m.parameters(), lr=0.1), kw.pop("extra", {}), kw.pop("local", None))
    return r


def test_unstreamable_state_is_refused_at_register_naming_the_entry():
    with pytest.raises(ConfigError, match=r"ctx.register: registered state at meter.value holds a object") as e:
        _reg(local={"meter": Holder(object())})
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"ctx.register\(sched=...\): a int has no state_dict"):
        _reg(extra={"sched": 3})


def test_a_model_without_trainable_parameters_gets_one_clear_line():
    m = torch.nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ConfigError, match="has no trainable parameters") as e:
        Registry().set(m, None, {})
    assert "\n" not in str(e.value)


def test_the_same_name_cannot_be_replicated_and_local():
    with pytest.raises(ConfigError, match="both as an extra and under local="):
        _reg(extra={"x": Holder(1)}, local={"x": Holder(2)})


def test_signature_covers_optimizer_extras_and_locals():
    job = _reg(extra={"sched": Holder(1)}, local={"sampler": Holder(0)}).signature()
    other_opt = _reg(torch.optim.SGD, extra={"sched": Holder(1)}, local={"sampler": Holder(0)}).signature()
    assert "AdamW" in first_mismatch(job, other_opt) and "SGD" in first_mismatch(job, other_opt)
    no_local = _reg(extra={"sched": Holder(1)}).signature()
    assert "sampler" in first_mismatch(job, no_local)
    assert first_mismatch(job, _reg(extra={"sched": Holder(5)}, local={"sampler": Holder(9)}).signature()) is None


def test_buffers_are_local_and_parameters_replicated():
    r = _reg(local={"s": Holder(3)})
    assert r.buffer_names == ["1.running_mean", "1.running_var", "1.num_batches_tracked"]
    before = r.digests()
    r.model[1].running_mean.add_(1)  # a forward on this rank's data
    after = r.digests()
    assert after["replicated"] == before["replicated"] and after["local"] != before["local"]
    snap = unpack(r.pack_local())
    r.model[1].running_mean.zero_()
    r.local["s"].value = 7
    r.load_local(snap)
    assert r.digests() == after and r.local["s"].value == 3


def test_boundary_keeps_hyperparameters_and_their_types():
    r = _reg(torch.optim.Adam, extra={"sched": Holder(4)})
    snap = unpack(r.pack_boundary())
    r.optimizer.param_groups[0]["lr"] = 5.0
    r.extra["sched"].value = 0
    r.load_boundary(snap)
    g = r.optimizer.param_groups[0]
    assert g["lr"] == 0.1 and isinstance(g["betas"], tuple) and r.extra["sched"].value == 4


def test_pack_is_a_deep_copy():
    t = torch.arange(4.0)
    blob = pack({"t": t, "n": [1, "a"]})
    t.add_(1)
    assert torch.equal(unpack(blob)["t"], torch.arange(4.0)) and unpack(blob)["n"] == [1, "a"]


def test_warming_up_and_log_during_warm_up(monkeypatch):
    from livemig.api import Context, Engine

    monkeypatch.delenv("LIVEMIG_ROLE", raising=False)
    eng = Engine()
    ctx = Context(eng)
    assert ctx.warming_up is False and ctx.role == "local" and ctx.rank == 0 and ctx.world_size == 1
    ctx.log(loss=1.0)
    eng.sandbox.pg = object()  # as inside a spare's shadow iterations
    assert ctx.warming_up is True
    ctx.log(loss=2.0)
    assert eng._last_metrics == {"loss": 1.0}


def test_final_record_commit_times_stay_bounded():
    """100k steps and two generation changes: the commit list stays small and keeps
    what the report reads (the steps around each change, the last ones)."""
    from livemig.rdzv.client import encode
    from livemig.runtime.loop import COMMITS_KEPT
    from livemig.runtime.step_state import StepState

    st, gen = StepState(), 1
    for t in range(100_000):
        if t in (40_000, 70_000):
            gen += 1
        st.record_commit(t, gen, COMMITS_KEPT)
    steps = [c[0] for c in st.commits]
    assert len(steps) <= 2 * COMMITS_KEPT + 33 and steps[-1] == 99_999
    assert {39_999, 40_000, 40_001, 70_000, 70_001}.issubset(steps)
    assert len(encode({"commits": st.commits})) < 20_000
