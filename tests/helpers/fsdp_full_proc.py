"""An FSDP2 script that uses full state dicts the way torch's FSDP2 example does (issue 50):
it unshards the model before its loop (`DTensor.full_tensor()`, every rank) and, every
--save-every steps after ctx.step(), gathers `get_model_state_dict(full_state_dict=True,
cpu_offload=True)` on every rank; rank 0 appends the step and the gathered state's digest to
--out/saves.jsonl. A recovery must leave the same file as the fault-free run."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import livemig
from livemig.data import ElasticSampler
from livemig.state import digest as state_digest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
from fsdp2_lm import corpus, lr_at, sharded  # noqa: E402 - the example's model, from its directory


def digest(sd: dict[str, torch.Tensor]) -> str:
    return state_digest([sd[k] for k in sorted(sd)])[:16]


@livemig.elastic()
def train(ctx: livemig.Context, a: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    shard = max(1, ctx.world_size // a.replicate)
    mesh = ctx.init_device_mesh("cpu", (a.replicate, shard), mesh_dim_names=("replicate", "shard"))
    model = sharded(mesh, a.width, 1)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}  # unsharded before the loop, to inspect it
    opt = torch.optim.AdamW(model.parameters(), lr=lr_at(0, a.steps), weight_decay=0.1)
    ctx.register(model=model, optimizer=opt)
    ds = corpus(8 * a.steps * max(ctx.world_size, 1))
    batches = ctx.batches(torch.utils.data.DataLoader(ds, batch_sampler=ElasticSampler(len(ds), 8, seed=7)))
    for step in ctx.steps(a.steps):
        x, y = next(batches)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, a.steps)
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        ctx.clip_grad_norm_(1.0)
        ctx.step()
        if step % a.save_every == a.save_every - 1:
            sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if ctx.rank == 0 and not ctx.warming_up and a.out:
                with open(os.path.join(a.out, "saves.jsonl"), "a") as f:
                    f.write(json.dumps({"step": step, "digest": digest(sd), "start": digest(full)}) + "\n")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--replicate", type=int, default=2)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--out", default="")
    train(p.parse_args())
