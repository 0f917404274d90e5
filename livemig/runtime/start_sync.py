"""DDP's start-up guarantee: the replicas a job forms with are rank 0's.

DDP broadcasts rank 0's parameters and buffers when it wraps a model, so DDP
scripts commonly seed per rank (`torch.manual_seed(1337 + rank)`) before
building it and still train one model. livemig does the same once, when a job
forms from scratch (generation 1, before step 0): the model's state (parameters
and buffers; the buffers are rank-local afterwards) and the optimizer's state
tensors, if it has any, become rank 0's. Never after a state load: a spare, a
recovery or a migration brings state that is already the job's. ZeRO-1 syncs
the model only, then cuts its shards' master values again from the synced
parameters (Zero1.reset_values: they were cut from this rank's own at
registration, so a per-rank seed left each mirror unequal to its owner).
`ctx.register(..., sync_start=False)` opts out; the step-0 check of the
replicated digests (coordinator/checks.py) then still fails a job whose ranks
differ.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import msgpack
import torch

from livemig.comm.group import allreduce_sum, broadcast_tensors
from livemig.errors import ConfigError
from livemig.runtime.registry import OPTIMIZER_CHECK, PARAMS_CHECK, Registry
from livemig.state import flatten, tensor_meta

log = logging.getLogger("livemig.runtime.start_sync")


def _start_state(reg: Registry) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """What the sync overwrites: the live tensors (writing them writes the model and the
    optimizer), with their skeleton so every rank can check it holds the same layout."""
    tree: dict[str, Any] = {"model": reg.model.state_dict() if reg.model is not None else {}}
    if reg.optimizer is not None and not reg.layout.optimizer_in_shards:
        tree["optimizer"] = reg.optimizer.state_dict()["state"]
    tensors: list[torch.Tensor] = []
    skel = flatten(tree, tensors)
    return {"skel": skel, "metas": [tensor_meta(t) for t in tensors]}, tensors


def _fingerprint(layout: dict[str, Any]) -> int:
    raw = hashlib.sha256(msgpack.packb(layout, use_bin_type=True, default=str)).digest()
    return int.from_bytes(raw[:7], "little")  # fits an int64 tensor


def sync_start(reg: Registry, pg: Any, rank: int, timeout: timedelta,
               should_abort: Callable[[], bool] | None = None) -> int:  # fmt: skip
    """Make this rank's model (and optimizer state) rank 0's; returns the bytes synced.
    Every rank first checks it holds rank 0's layout (names, dtypes, shapes), so a
    mismatch is one line on every rank rather than a broadcast of the wrong sizes."""
    t0 = time.monotonic()
    layout, tensors = _start_state(reg)
    fp = torch.tensor([_fingerprint(layout)], dtype=torch.int64)
    theirs = fp.clone()
    broadcast_tensors(pg, [theirs], 0, timeout, should_abort)
    bad = torch.tensor([0 if int(theirs[0]) == int(fp[0]) else 1], dtype=torch.int64)
    allreduce_sum(pg, [bad], timeout, should_abort)
    if int(bad[0]):
        raise ConfigError(
            f"the registered model and optimizer state differ in layout (names, dtypes, shapes) between "
            f"rank 0 and {int(bad[0])} other rank(s) at start: every rank must build the same model and optimizer"
        )
    broadcast_tensors(pg, tensors, 0, timeout, should_abort)
    nbytes = sum(t.nbytes for t in tensors)
    log.info("start-up sync: replicas made equal to rank 0's",
             extra={"rank": rank, "bytes": nbytes, "seconds": round(time.monotonic() - t0, 4)})  # fmt: skip
    return nbytes


def check_replicas(reg: Registry, pg: Any, rank: int, world: int, timeout: timedelta,
                   should_abort: Callable[[], bool] | None = None,
                   digests: dict[str, str] | None = None) -> None:  # fmt: skip
    """At the first boundary, in the group the job formed with: is every rank's replicated
    state (parameters, optimizer, extras) still rank 0's? Two small collectives, once per
    job; a difference is one line on every rank, before step 1 runs on diverged replicas."""
    mine = reg.replica_digests() if digests is None else digests
    names = sorted(mine)
    fps = torch.tensor([int(mine[n][:14], 16) for n in names], dtype=torch.int64)
    ref = fps.clone()
    broadcast_tensors(pg, [ref], 0, timeout, should_abort)
    differs = torch.zeros(len(names), world, dtype=torch.int64)
    differs[:, rank] = (fps != ref).to(torch.int64)
    allreduce_sum(pg, [differs], timeout, should_abort)
    for i, name in enumerate(names):
        ranks = [r for r in range(world) if int(differs[i, r])]
        if not ranks:
            continue
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        if name in (PARAMS_CHECK, OPTIMIZER_CHECK):
            what = "the parameters differ" if name == PARAMS_CHECK else "the optimizer state differs"
            raise ConfigError(
                f"{what} between rank 0 and {who} after step 0: every rank must apply the same "
                "update to the same replicas (rank 0's at start); find the code that changes them on one rank "
                "only (before ctx.step(), or a hand-set hyperparameter that depends on the rank)"
            )
        raise ConfigError(
            f"the extra {name!r} differs between rank 0 and {who} after step 0: a spare would take "
            f"another rank's; register per-rank state under local={{{name!r}: ...}}"
        )
