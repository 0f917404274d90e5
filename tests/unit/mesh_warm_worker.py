"""One rank of tests/unit/test_torch_group.py's warm-mesh test: HSDP 2x2 on livemig-owned
groups; with `warm`, the last rank first runs the training alone in a standby world as rank 0
(runtime/fsdp2_mesh.py, a spare's warm-up on the job's mesh), then joins the real world as
itself with its warm mesh rebound. Prints the digest, the first real step's time and what the
rebound mesh answers."""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(__file__))
from torch_group_worker import train  # noqa: E402

from livemig.comm import torch_group  # noqa: E402
from livemig.runtime.fsdp2_mesh import rebind_mesh  # noqa: E402

T = timedelta(seconds=60)
SHAPE, NAMES = (2, 2), ("replicate", "shard")


def main() -> None:
    mode, rank, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(1)
    warm = None
    if mode == "warm" and rank == world - 1:  # a spare in standby: alone, as rank 0 of the job's world
        torch_group.install_standby(0, world, T)
        assert torch_group.standby_world() and not torch_group.active()
        warm = init_device_mesh("cpu", SHAPE, mesh_dim_names=NAMES)
        train(warm, 0, None, dist.HashStore())
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=T)
    torch_group.install(dist.PrefixStore("gen1", store), rank, world, T)
    assert not torch_group.standby_world()
    mesh = init_device_mesh("cpu", SHAPE, mesh_dim_names=NAMES)
    out: dict = {"rank": rank, "rebound": None}
    if warm is not None:
        out["rebound"] = rebind_mesh(warm, mesh)
        out["coordinate"] = list(warm.get_coordinate())
        out["groups"] = {n: warm.get_group(n).ranks for n in NAMES}
    t0 = time.perf_counter()
    out["digest"] = train(mesh, rank, None, store)
    out["train_s"] = time.perf_counter() - t0
    print(json.dumps(out), flush=True)
    dist.barrier()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
