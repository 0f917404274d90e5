"""What an epoch loop ported from DDP meets (issue 50): ElasticSampler takes DistributedSampler's
arguments and its set_epoch, reads its rank and world size from the default group from the start
(so len(loader) is per rank before the loop), and a second ctx.steps() in one run of the
function is refused with one line instead of fencing the job."""

from __future__ import annotations

import json
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


def _run_local(tmp_path, body: str) -> subprocess.CompletedProcess:
    script = tmp_path / "local_epochs.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)


_EPOCHS_SCRIPT = """
    import json, sys, torch, livemig
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    @livemig.elastic()
    def train(ctx):
        ds = TensorDataset(torch.arange(40))
        sampler = DistributedSampler(ds, shuffle=True, seed=5)
        loader = DataLoader(ds, batch_size=4, sampler=sampler)
        model = torch.nn.Linear(1, 1)
        ctx.register(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        got, want = [], []
        for epoch in ctx.epochs(3, len(loader)):
            sampler.set_epoch(epoch)
            want += [b[0].tolist() for b in loader]  # the loader as torchrun iterates it
            for step, (ids,) in zip(ctx.steps(STEPS_ARG), ctx.batches(loader), strict=False):
                got.append((epoch, step, ids.tolist()))
                model(ids.float()[:, None]).sum().backward()
                ctx.step()
            if MISSING:
                break
        print(json.dumps({"got": got, "want": want}))

    train()
"""


def test_ctx_epochs_with_a_distributed_sampler_reads_what_the_loader_reads(tmp_path):
    """A local run (a world of one): ctx.epochs counts global steps over the epochs and
    ctx.batches reads, epoch by epoch, exactly the batches the loader gives after set_epoch."""
    p = _run_local(tmp_path, _EPOCHS_SCRIPT.replace("STEPS_ARG", "").replace("MISSING", "False"))
    assert p.returncode == 0, p.stderr
    rec = json.loads(p.stdout.strip().splitlines()[-1])
    assert [(e, s) for e, s, _ in rec["got"]] == [(s // 10, s) for s in range(30)]
    assert [ids for _, _, ids in rec["got"]] == rec["want"]


def test_ctx_epochs_misuse_is_refused_with_one_line(tmp_path):
    p = _run_local(tmp_path, _EPOCHS_SCRIPT.replace("STEPS_ARG", "7").replace("MISSING", "False"))
    assert p.returncode != 0
    assert "ctx.steps(7) in epoch 0 of ctx.epochs(..., 10): an epoch has 10 steps" in p.stderr, p.stderr
    body = _EPOCHS_SCRIPT.replace("STEPS_ARG", "10").replace("MISSING", "False")
    body = body.replace("for epoch in ctx.epochs(3, len(loader)):", "for epoch in [0]:")
    p = _run_local(tmp_path, body)
    assert p.returncode != 0
    assert "a DistributedSampler: iterate it inside `for epoch in ctx.epochs(E, len(loader))`" in p.stderr, p.stderr
    body = _EPOCHS_SCRIPT.replace("STEPS_ARG", "").replace("MISSING", "False")
    body = body.replace("for step, (ids,) in zip(", "for step, (ids,) in [] and zip(")
    p = _run_local(tmp_path, body)
    assert p.returncode != 0
    assert "epoch 0's body ended without running `for step in ctx.steps():` to its end" in p.stderr, p.stderr
