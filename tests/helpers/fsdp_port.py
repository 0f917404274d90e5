"""An FSDP2 / HSDP training loop written the way users port theirs (tests/e2e/test_fsdp2.py).

From the DDP-port grid: a per-rank seed before the model is built (the start-up sync makes
the replicas along `replicate` equal), accumulation under ctx.no_sync(), clipping through
ctx.clip_grad_norm_, the learning rate set by hand, a batch prefetched for the next step under
local=, a LayerNorm-free model with a running-statistics buffer (BatchNorm), rank 0 saving
every few steps. Dumps each rank's local shards, optimizer state, buffers and carry (typed,
as examples/ddp_port.py), which mesh object every entry of the function got, and an all-reduce
over each mesh dimension after the last step.

--spare-root-only: a spare wraps only the root module (fully_shard once), to be refused.
--stateless: no rank-local state (no BatchNorm buffers, the batch fetched in its step).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import livemig

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
from ddp_port import Carry, lr_at, typed  # noqa: E402

WIDTH, MICRO = 16, 4
ENTRIES: list[list] = []  # every entry of the function in this process: [role, rank, mesh id, mesh size]


class Net(torch.nn.Module):
    def __init__(self, stateless: bool = False) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(WIDTH, 2 * WIDTH)
        # running statistics: per-rank buffers (--stateless: none)
        self.norm = torch.nn.Identity() if stateless else torch.nn.BatchNorm1d(2 * WIDTH)
        self.mid = torch.nn.Linear(2 * WIDTH, WIDTH)
        self.out = torch.nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(torch.tanh(self.norm(self.inp(x))))))


@livemig.elastic(seed=0)
def train(ctx: livemig.Context, a: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(1337 + ctx.rank)  # as DDP scripts do
    shape = (a.replicate, ctx.world_size // a.replicate) if a.replicate > 1 else (ctx.world_size,)
    names = ("replicate", "shard") if a.replicate > 1 else ("shard",)
    mesh = ctx.init_device_mesh("cpu", shape, mesh_dim_names=names)
    ENTRIES.append([ctx.role, ctx.rank, id(mesh), mesh.size()])
    model = Net(a.stateless)
    if not (a.spare_root_only and ctx.role == "spare"):
        fully_shard(model.inp, mesh=mesh)
        fully_shard(model.mid, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    carry = Carry()
    ctx.register(model=model, optimizer=opt, local={} if a.stateless else {"carry": carry})

    def get_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = livemig.batch_generator(step, ctx.rank, ctx.world_size)
        return torch.randn(a.accum, MICRO, WIDTH, generator=g), torch.randn(a.accum, MICRO, 1, generator=g)

    for step in ctx.steps(a.steps):
        t0 = time.monotonic()
        if carry.batch is None or a.stateless:
            carry.batch = get_batch(step)
        x, y = carry.batch
        for group in opt.param_groups:
            group["lr"] = lr_at(step, a.steps, a.lr)
        for k in range(a.accum):
            with ctx.no_sync() if k < a.accum - 1 else contextlib.nullcontext():
                loss = torch.nn.functional.mse_loss(model(x[k]), y[k]) / a.accum
                loss.backward()
        carry.batch = get_batch(step + 1)  # prefetched for the next iteration
        ctx.clip_grad_norm_(a.clip)
        ctx.step()
        ctx.log(loss=float(loss) * a.accum)
        if step % 5 == 0 and ctx.rank == 0 and not ctx.warming_up and a.out:
            with ctx.busy():
                torch.save({"step": step, "loss": float(loss)}, os.path.join(a.out, "progress.pt"))
        if a.step_ms:
            time.sleep(max(0.0, a.step_ms / 1000 - (time.monotonic() - t0)))
    if ctx.warming_up or not a.out:
        return
    sums = {}
    for name in names:  # every mesh dimension answers in the final generation, the spare included
        t = torch.tensor([float(ctx.rank + 1)])
        dist.all_reduce(t, group=mesh.get_group(name))
        sums[name] = float(t)
    sd = {k: (v.to_local() if hasattr(v, "to_local") else v) for k, v in model.state_dict().items()}
    osd = opt.state_dict()
    osd = {"state": {i: {k: (v.to_local() if hasattr(v, "to_local") else v) for k, v in s.items()}
                     for i, s in osd["state"].items()}, "param_groups": osd["param_groups"]}  # fmt: skip
    rec = {"model": typed(sd), "optimizer": typed(osd), "carry": typed(carry.state_dict()),
           "entries": ENTRIES, "sums": sums, "mesh_id": id(mesh)}  # fmt: skip
    with open(os.path.join(a.out, f"rank{ctx.rank}.json"), "w") as f:
        json.dump(rec, f)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--replicate", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--clip", type=float, default=0.5)
    p.add_argument("--step-ms", type=float, default=0.0)
    p.add_argument("--spare-root-only", action="store_true")
    p.add_argument("--stateless", action="store_true", help="no rank-local state: no BatchNorm, no prefetch carry")
    p.add_argument("--out", default="")
    train(p.parse_args())


if __name__ == "__main__":
    main()
