"""What an epoch loop ported from DDP meets (issue 50): ElasticSampler takes DistributedSampler's
arguments and its set_epoch, reads its rank and world size from the default group from the start
(so len(loader) is per rank before the loop), and a second ctx.steps() in one run of the
function is refused with one line instead of fencing the job."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch.distributed as dist

from livemig.data import ElasticSampler


def test_elastic_sampler_takes_distributed_samplers_arguments_and_set_epoch(monkeypatch):
    s = ElasticSampler(64, 4, seed=3, shuffle=True, drop_last=True)
    first = [s.indices(k) for k in range(3)]
    s.set_epoch(5)  # the epoch follows the global step: nothing changes
    assert [s.indices(k) for k in range(3)] == first and s.epoch == 5
    with pytest.raises(ValueError, match="drop_last=False is not supported"):
        ElasticSampler(64, 4, drop_last=False)
    assert len(s) == 16  # a world of one: 64 samples, 4 a batch
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    per_rank = ElasticSampler(64, 4)
    assert (per_rank.rank, per_rank.world_size, len(per_rank)) == (1, 2, 8)  # per rank, before any placement


def test_a_second_ctx_steps_is_refused_with_one_line(tmp_path):
    script = tmp_path / "epochs.py"
    script.write_text(
        textwrap.dedent("""
        import torch, livemig

        @livemig.elastic()
        def train(ctx):
            model = torch.nn.Linear(2, 1)
            ctx.register(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
            for epoch in range(2):
                for step in ctx.steps(3):
                    model(torch.ones(1, 2)).sum().backward()
                    ctx.step()

        train()
    """)
    )
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "ctx.steps() was called a second time in one run of the function (once per epoch?)" in p.stderr, p.stderr


def test_a_model_left_wrapped_in_ddp_is_refused_at_register(tmp_path):
    script = tmp_path / "ddp.py"
    script.write_text(
        textwrap.dedent("""
        import torch, livemig
        from torch.nn.parallel import DistributedDataParallel

        @livemig.elastic()
        def train(ctx):
            model = DistributedDataParallel(torch.nn.Linear(2, 1))  # left in a port
            ctx.register(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))

        train()
    """)
    )
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "ctx.register(model=DistributedDataParallel(...)): register the module itself" in p.stderr, p.stderr
