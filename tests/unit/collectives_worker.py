"""One rank of tests/unit/test_collectives.py: every public torch.distributed collective called
the way user code calls it, on plain gloo (`init_process_group("gloo")`) or on livemig's groups
(comm/torch_group.py over gloo); prints what each returned (or the error it raised) as JSON."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

T = timedelta(seconds=60)


def _val(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return [str(x.dtype), list(x.shape), x.detach().reshape(-1).tolist()]
    if isinstance(x, dict):
        return {str(k): _val(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_val(v) for v in x]
    return x


def calls(rank: int, world: int) -> dict[str, Callable[[], Any]]:
    def t(*vals: float) -> torch.Tensor:
        return torch.tensor(vals, dtype=torch.float32)

    def all_reduce(op: Any) -> Callable[[], Any]:
        def f() -> Any:
            x = t(rank + 1.0, 2.0 * rank)
            dist.all_reduce(x, op=op)
            return x

        return f

    def all_gather() -> Any:
        out = [torch.zeros(2) for _ in range(world)]
        dist.all_gather(out, t(rank, -rank))
        return out

    def all_gather_into_tensor() -> Any:
        out = torch.zeros(2 * world)
        dist.all_gather_into_tensor(out, t(rank, rank + 0.5))
        return out

    def reduce_scatter_tensor() -> Any:
        out = torch.zeros(2)
        dist.reduce_scatter_tensor(out, torch.arange(2.0 * world) * (rank + 1))
        return out

    def reduce_scatter() -> Any:
        out = torch.zeros(2)
        dist.reduce_scatter(out, [t(i, rank) for i in range(world)])
        return out

    def all_to_all_single() -> Any:
        out = torch.zeros(world)
        dist.all_to_all_single(out, torch.arange(float(world)) + 10 * rank)
        return out

    def all_to_all() -> Any:
        out = [torch.zeros(1) for _ in range(world)]
        dist.all_to_all(out, [t(10 * rank + i) for i in range(world)])
        return out

    def broadcast() -> Any:
        x = t(rank, rank)
        dist.broadcast(x, src=world - 1)
        return x

    def gather() -> Any:
        out = [torch.zeros(1) for _ in range(world)] if rank == 0 else None
        dist.gather(t(rank * 3.0), out, dst=0)
        return out

    def scatter() -> Any:
        out = torch.zeros(1)
        dist.scatter(out, [t(i + 100.0) for i in range(world)] if rank == 0 else None, src=0)
        return out

    def reduce() -> Any:
        x = t(rank + 1.0)
        dist.reduce(x, dst=0)
        return x if rank == 0 else None

    def objects() -> Any:
        b = [{"cfg": "from rank 0", "lr": 0.1}] if rank == 0 else [None]
        dist.broadcast_object_list(b, src=0)
        g: list[Any] = [None] * world
        dist.all_gather_object(g, ("rank", rank))
        go: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object({"r": rank}, go, dst=0)
        so: list[Any] = [None]
        dist.scatter_object_list(so, [f"to {i}" for i in range(world)] if rank == 0 else None, src=0)
        return [b, g, go, so]

    def barrier() -> Any:
        dist.barrier()
        return "ok"

    def send_recv() -> Any:
        right, left = (rank + 1) % world, (rank - 1) % world
        got = torch.zeros(1)
        if rank % 2 == 0:
            dist.send(t(rank), right)
            dist.recv(got, left)
        else:
            dist.recv(got, left)
            dist.send(t(rank), right)
        return got

    def batch_isend_irecv() -> Any:
        right, left = (rank + 1) % world, (rank - 1) % world
        got = torch.zeros(2)
        ops = [dist.P2POp(dist.isend, t(rank, 7.0), right), dist.P2POp(dist.irecv, got, left)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        return got

    def monitored_barrier() -> Any:
        dist.monitored_barrier(timeout=T)
        return "ok"

    def fsdp2_full() -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
        mesh = init_device_mesh("cpu", (world,))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        full = [p.full_tensor() for p in model.parameters()]  # type: ignore[operator]
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        h = hashlib.sha256(b"".join(v.numpy().tobytes() for v in sd.values())).hexdigest() if sd else ""
        return [full, sorted(sd), h]

    out: dict[str, Callable[[], Any]] = {
        "all_reduce_sum": all_reduce(dist.ReduceOp.SUM), "all_reduce_max": all_reduce(dist.ReduceOp.MAX),
        "all_reduce_product": all_reduce(dist.ReduceOp.PRODUCT), "all_reduce_avg": all_reduce(dist.ReduceOp.AVG),
        "all_gather": all_gather, "all_gather_into_tensor": all_gather_into_tensor,
        "reduce_scatter_tensor": reduce_scatter_tensor, "reduce_scatter": reduce_scatter,
        "all_to_all_single": all_to_all_single, "all_to_all": all_to_all, "broadcast": broadcast,
        "gather": gather, "scatter": scatter, "reduce": reduce, "objects": objects, "barrier": barrier,
        "send_recv": send_recv, "batch_isend_irecv": batch_isend_irecv, "monitored_barrier": monitored_barrier,
        "fsdp2_full_state_dict": fsdp2_full,
    }  # fmt: skip
    return out


def main() -> None:
    mode, rank, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=T)
    if mode == "plain":
        dist.init_process_group("gloo", store=dist.PrefixStore("plain", store), rank=rank, world_size=world, timeout=T)
    else:
        from livemig.comm import torch_group

        torch_group.install(dist.PrefixStore("livemig", store), rank, world, T)
    results: dict[str, Any] = {}
    for name, fn in calls(rank, world).items():
        try:
            results[name] = ["ok", _val(fn())]
        except BaseException as exc:  # noqa: BLE001 - what the call raised is the result (StepAborted too)
            results[name] = ["error", type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else ""]
            dist.barrier()  # re-align the ranks after a call that failed on some only
    print(json.dumps({"rank": rank, "results": results}), flush=True)
    dist.barrier()
    # Leave without the interpreter's teardown: with gloo's and the store's threads still up, a
    # C++ destructor at exit aborted one rank now and then ("terminate called without an
    # active exception", CI on torch 2.13 and 2.14) after its results were printed.
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
