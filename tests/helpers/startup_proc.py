"""A DDP-style script that uses torch.distributed before its loop, as ported scripts do.

Before `ctx.steps()` it checks the default group answers livemig's rank and world, broadcasts
a config drawn by rank 0 alone (`broadcast_object_list`), waits at a barrier and all-gathers a
per-rank draw; the loop's data depends on both answers, so a process entering the function
again (a claimed spare, a cold restart, a migration) that received anything else diverges.
--resume DIR loads the model with DCP before the loop, as torchrun scripts resume from their
own checkpoint; --save DIR writes one with DCP after the loop (rank 0 coordinates).
--more-on-reentry makes one more collective before the loop in a process that was not a
worker from the start: livemig must refuse it with one line.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

import livemig
from livemig.state import digest as state_digest

WIDTH = 16


def digest(sd: dict[str, torch.Tensor]) -> str:
    return state_digest([sd[k] for k in sorted(sd)])[:16]


@livemig.elastic(seed=0)
def train(ctx: livemig.Context, a: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    assert dist.is_initialized(), "no default process group"
    standby = os.environ.get("LIVEMIG_ROLE") == "spare" and dist.get_world_size() == 1  # warms up as a world of one
    assert dist.get_rank() == ctx.rank and (standby or dist.get_world_size() == ctx.world_size), dist.get_rank()
    torch.manual_seed(1337 + ctx.rank)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    if a.resume and os.path.exists(os.path.join(a.resume, ".metadata")):
        import torch.distributed.checkpoint as dcp

        sd = {"model": model.state_dict()}
        dcp.load(sd, checkpoint_id=a.resume)
        model.load_state_dict(sd["model"])
    cfg: list = [{"shift": float(torch.rand(())), "scale": 0.5 + float(torch.rand(()))}] if ctx.rank == 0 else [None]
    dist.broadcast_object_list(cfg, src=0)
    dist.barrier()
    mine = torch.rand(4)
    everyone = [torch.empty(4) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    mix = torch.stack(everyone).sum(0)
    if a.more_on_reentry and os.environ.get("LIVEMIG_ROLE") == "spare":
        dist.barrier()
    ctx.register(model=model, optimizer=opt, sync_start=not a.resume)
    shift, scale = cfg[0]["shift"], cfg[0]["scale"]
    for step in ctx.steps(a.steps):
        g = livemig.batch_generator(step, ctx.rank, ctx.world_size)
        x = torch.randn(8, WIDTH, generator=g) * scale + shift
        y = torch.randn(8, 1, generator=g) + mix[step % 4]
        torch.nn.functional.mse_loss(model(x), y).backward()
        ctx.step()
        ctx.log(step=step)  # a metric named like a field of livemig's progress record
        time.sleep(float(os.environ.get("STARTUP_SLEEP", "0")))  # room for a migration; changes no state
    if a.save:
        import torch.distributed.checkpoint as dcp

        dcp.save({"model": model.state_dict()}, checkpoint_id=a.save)
    if a.out:
        rec = {"rank": ctx.rank, "model": digest(model.state_dict()), "cfg": cfg[0], "mix": mix.tolist()}
        with open(os.path.join(a.out, f"rank{ctx.rank}.json"), "w") as f:
            json.dump(rec, f)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--resume", default="")
    p.add_argument("--save", default="")
    p.add_argument("--out", default="")
    p.add_argument("--more-on-reentry", action="store_true")
    train(p.parse_args())
