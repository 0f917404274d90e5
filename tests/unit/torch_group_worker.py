"""One rank of tests/unit/test_torch_group.py: FSDP2 (or HSDP) trained on livemig-owned torch
groups, the communicator swapped for a new generation's half-way (or not), then a digest."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from livemig.comm import torch_group

T = timedelta(seconds=60)


def train(mesh, rank: int, swap_at: int | None, store: dist.Store) -> tuple[str, float]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(6):
        if step == swap_at:  # a new generation: new communicators, the same group objects
            torch_group.swap_all(lambda grp: dist.PrefixStore(f"gen2/{grp.group_name}", store), rank, 2, T)
        loss = model(torch.randn(8, 16, generator=g)).pow(2).mean()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.to_local().detach().numpy().tobytes())
    return h.hexdigest(), float(norm)


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=T)
    default = torch_group.install(dist.PrefixStore("gen1", store), rank, world, T)
    shape, names = ((2, 2), ("replicate", "shard")) if world == 4 else ((world,), ("shard",))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    plain = train(mesh, rank, None, store)
    before = sorted({grp.generation for grp in torch_group.groups()})
    swapped = train(mesh, rank, 3, store)  # the same job, its communicators swapped after step 2
    sums = {}
    for name in names:  # every mesh dimension answers after the swap
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=mesh.get_group(name))
        sums[name] = float(t)
    out = {"rank": rank, "plain": plain, "swapped": swapped, "sums": sums, "before": before,
           "generations": sorted({grp.generation for grp in torch_group.groups()}),
           "default_is_ours": isinstance(default, torch_group.SwappableGroup),
           "mesh_groups_ours": all(isinstance(mesh.get_group(n), torch_group.SwappableGroup)
                                   for n in names)}  # fmt: skip
    print(json.dumps(out), flush=True)
    dist.barrier()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown: see collectives_worker.py


if __name__ == "__main__":
    main()
