"""An FSDP2 rank's shards and how they move: this rank's part (parameters and optimizer state as
local shards), the mirror of its left neighbour's, what a spare or a migrating spare loads, a
checkpoint's part, and the boundary a redo moves into the re-registered objects. The FSDP2
strategy (strategies/fsdp2.py) decides when; this says how, over the state the mesh owner keeps
across the function's re-entries (runtime/fsdp2_mesh.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from livemig.comm.group import ring_exchange
from livemig.config import left_of
from livemig.errors import ConfigError, RecoveryError
from livemig.runtime.fsdp2_mirror import ShardMirror, shard_digest
from livemig.runtime.step_state import LocalBlob
from livemig.state import to_local, unpack

if TYPE_CHECKING:
    from livemig.runtime.fsdp2_mesh import Fsdp2 as MeshOwner
    from livemig.runtime.strategies.base import StrategyHost

log = logging.getLogger("livemig.runtime.strategies.fsdp2")


def dtensors(params: Sequence[torch.Tensor]) -> list[Any]:
    """The registered parameters as what they are under FSDP2: DTensors (`to_local`,
    `device_mesh`, `placements`), which torch's stubs type as plain Parameters."""
    return list(params)


def piece(whole: torch.Tensor, shards: int, k: int) -> torch.Tensor:
    """Shard k of `shards` of a whole tensor as fully_shard cuts it (Shard(0): torch.chunk
    along dim 0, the trailing shards empty when dim 0 has fewer rows than shards)."""
    chunks = torch.chunk(whole, shards, dim=0)
    return chunks[k].clone() if k < len(chunks) else whole[whole.shape[0] :].clone()


def recut(parts: Sequence[dict[str, Any]], shards: int, k: int) -> dict[str, Any]:
    """Shard k of `shards` of the state whose shards 0..S-1 are `parts` (one replica's
    checkpoint parts: {"params": [local], "optimizer": local state dict}): each parameter,
    and each optimizer tensor shaped like its parameter's shard, is its old shards joined
    along dim 0 and cut again; the rest (Adam's step count) is the same on every shard."""

    def whole(ts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(ts, dim=0) if ts[0].dim() > 0 else ts[0]

    def cut(ts: list[torch.Tensor]) -> torch.Tensor:
        return piece(whole(ts), shards, k) if ts[0].dim() > 0 else ts[0].clone()

    n = len(parts[0]["params"])
    params = [cut([p["params"][i] for p in parts]) for i in range(n)]
    opts = [p["optimizer"] for p in parts]
    if not opts[0]:
        return {"params": params, "optimizer": {}}
    state: dict[int, dict[str, Any]] = {}
    for i, st0 in opts[0].get("state", {}).items():
        i = int(i)
        sts = [o["state"].get(i, o["state"].get(str(i))) for o in opts]
        if any(st is None for st in sts):
            raise RecoveryError(f"the checkpoint's shards disagree on the optimizer state of parameter {i}")
        out = {}
        for key, v in st0.items():
            vs = [st[key] for st in sts]
            shard_shaped = (
                isinstance(v, torch.Tensor)
                and v.dim() > 0
                and all(
                    isinstance(x, torch.Tensor) and x.shape == p["params"][i].shape
                    for x, p in zip(vs, parts, strict=True)
                )
            )
            out[key] = cut(vs) if shard_shaped else (v.clone() if isinstance(v, torch.Tensor) else v)
        state[i] = out
    return {"params": params, "optimizer": {"state": state, "param_groups": opts[0]["param_groups"]}}


def whole_of_checkpoint(step_dir: str) -> tuple[list[torch.Tensor], dict[tuple[int, str], torch.Tensor]]:
    """An FSDP2 checkpoint's parameters and optimizer state as whole tensors (one replica's
    parts joined along dim 0): what a checkpoint re-cut for another mesh must hold unchanged
    (tests/e2e/test_fsdp2.py, bench faults --grid matrix's resume column)."""
    import json
    import os
    import warnings

    from livemig.checkpoint_dir import MANIFEST, part_name
    from livemig.runtime.checkpoint import read_part

    warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")

    with open(os.path.join(step_dir, MANIFEST)) as f:
        shards = int(json.load(f)["layout"]["mesh"][-1])
    parts = [read_part(os.path.join(step_dir, part_name(r)), {}, ["fsdp"])[1]["fsdp"] for r in range(shards)]
    whole = recut(parts, 1, 0)  # one shard of one: the parts joined, as the re-cut joins them
    state = whole["optimizer"].get("state") or {}
    return whole["params"], {(int(i), key): v for i, st in state.items() for key, v in st.items()}


class Shards:
    """This rank's FSDP2 shards (see the module doc)."""

    def __init__(self, host: StrategyHost, owner: MeshOwner) -> None:
        self.h = host
        self.owner = owner

    def part(self) -> dict[str, Any]:
        """This rank's part of a checkpoint (runtime/checkpoint.py): its local shards of the
        parameters and of the optimizer state, at the boundary."""
        return self.own()

    def load_part(self, mine: dict[str, Any], part_of: Callable[[int], dict[str, Any]]) -> None:
        """A checkpoint's shards into this rank's (the same mesh, the same rank), and a fresh
        mirror of the left neighbour's from its part: a mirror kept from before the restart
        holds a later boundary than the one loaded."""
        self.load({"params": mine["params"], "optimizer": mine["optimizer"]})
        self.owner.mirror = None
        if self.owner.want_mirror:
            self.make_mirror(part_of(self.left()))

    def load_recut(self, old_shape: Sequence[int], part_of: Callable[[int], dict[str, Any]]) -> None:
        """A checkpoint's shards of another mesh (`old_shape`) cut for this one, and the
        mirror of the left neighbour's shard cut alike. Every rank reads one replica's parts
        (ranks 0..S-1 hold shards 0..S-1: the last dimension shards) and keeps its piece."""
        from torch.distributed.tensor import Replicate, Shard

        from livemig.runtime.fsdp2_mesh import shard_of

        params = dtensors(self.h.reg.params)
        for i, p in enumerate(params):  # fully_shard's default; a shard_placement_fn may cut another dim
            *rest, last = p.placements
            if not (isinstance(last, Shard) and last.dim == 0 and all(isinstance(x, Replicate) for x in rest)):
                raise ConfigError(f"parameter {i} is placed {tuple(p.placements)}, and only fully_shard's dim-0 "
                                  "shards are re-cut for another mesh: resume the checkpoint on the mesh that "
                                  "wrote it")  # fmt: skip
        parts = [part_of(r) for r in range(int(old_shape[-1]))]
        shape = list(self.owner.shape)
        mine = recut(parts, shape[-1], shard_of(self.h.rank, shape))
        for i, (p, v) in enumerate(zip(params, mine["params"], strict=True)):
            if p.to_local().shape != v.shape:
                raise ConfigError(f"parameter {i}: its shard here is {list(p.to_local().shape)}, the checkpoint's "
                                  f"re-cut gives {list(v.shape)}: the model is wrapped otherwise than fully_shard's "
                                  "dim-0 shards; resume it on the mesh that wrote it")  # fmt: skip
        self.load(mine)
        self.owner.mirror = None
        if self.owner.want_mirror:
            self.make_mirror(recut(parts, shape[-1], shard_of(self.left(), shape)))

    def setup_mirror(self) -> None:
        """Each rank takes a copy of its left neighbour's shard as the job forms (ring exchange)."""
        h = self.h
        if not self.owner.want_mirror or self.owner.mirror is not None or h.runtime is None or h.runtime.pg is None:
            return
        from livemig.state import pack

        got = ring_exchange(h.runtime.pg, pack(self.own()), h.rank, h.world_size, h.timeouts.collective,
                            h.runtime.moved_on)  # fmt: skip
        self.make_mirror(unpack(got))

    def make_mirror(self, state: dict[str, Any]) -> None:
        h = self.h
        left = self.left()
        assert h.reg.optimizer is not None  # a mirror is of the optimizer's shard too
        self.owner.mirror = ShardMirror(left, state, h.reg.optimizer)
        log.info("mirroring the shard of the left neighbour",
                 extra={"of": left, "mib": round(self.owner.mirror.nbytes() / 2**20, 2)})  # fmt: skip

    def left(self) -> int:
        """The rank whose shard (and local state) this rank mirrors (its right neighbour mirrors ours)."""
        h = self.h
        return left_of(h.rank, h.world_size)

    def own(self) -> dict[str, Any]:
        reg = self.h.reg
        return {"params": [p.to_local() for p in dtensors(reg.params)],
                "optimizer": to_local(reg.optimizer.state_dict()) if reg.optimizer is not None else {}}  # fmt: skip

    def final(self) -> dict[str, Any]:
        """What the final record adds: this rank's shard digest, and its mirror's."""
        if self.owner.mirror is None:
            return {}
        return {"shard_digest": shard_digest(self.h.reg.params, self.h.reg.optimizer),
                "mirror_of": self.owner.mirror.of, "mirror_digest": self.owner.mirror.digest(),
                "mirror_mb": round(self.owner.mirror.nbytes() / 2**20, 3)}  # fmt: skip

    def load_stash(self) -> None:
        """The re-entered function registered a new model and optimizer: give them the state
        of the last boundary, held by the previous ones (nothing of the failed step was
        applied: the optimizer steps only after the vote)."""
        h, old = self.h, self.owner.stash
        self.owner.stash = None
        new = h.reg
        if old is None:
            raise RecoveryError("the step is redone but the state of its boundary is gone")
        with torch.no_grad():
            for po, pn in zip(dtensors(old.params), dtensors(new.params), strict=True):
                pn.to_local().copy_(po.to_local())
                pn.grad = None
        if old.optimizer is not None and new.optimizer is not None:
            olds = old.opt_params()
            for i, pn in enumerate(new.opt_params()):
                st = old.optimizer.state.get(olds[i])
                if st:
                    new.optimizer.state[pn] = st
        self.load_boundary(h.committed)
        self.owner.voted = None
        log.info("state of the boundary moved into the re-entered function", extra={"step": h.committed})

    def load_boundary(self, c: int) -> None:
        h = self.h
        blob = h.st.boundaries.get(c)
        if blob is not None:
            h.reg.load_boundary(unpack(blob))
        if h.reg.has_local and h.st.local_blob is not None and h.st.local_blob.step == c:
            h.reg.load_local(unpack(h.st.local_blob.blob))

    def state(self) -> dict[str, Any]:
        """This rank's shards (parameters, optimizer) and its boundary: what a spare taking a
        rank of the same shard loads."""
        h = self.h
        reg = h.reg
        opt = to_local(reg.optimizer.state_dict()) if reg.optimizer is not None else {}
        return {"params": [p.to_local() for p in dtensors(reg.params)], "optimizer": opt,
                "boundary": h.st.boundaries.get(h.committed)}  # fmt: skip

    def migration_state(self) -> dict[str, Any]:
        """The leaving rank's snapshot at a boundary: its shards, its mirror of the left
        neighbour's, the boundary. The spare replays the following steps on copies of them
        (no collectives: it is not in the group yet)."""
        return {"own": self.own(), "mirror": self.owner.mirror.state() if self.owner.mirror is not None else None,
                "boundary": self.h.st.boundaries.get(self.h.committed)}  # fmt: skip

    def replayers(self, snap: dict[str, Any]) -> list[ShardMirror | None]:
        """The spare's copies of the leaving rank's shard and of its mirror, stepped as the
        mirror steps (fsdp2_mirror.py: bit-identical to the owner's update)."""
        h = self.h
        assert h.reg.optimizer is not None  # a migration replays the optimizer's update
        own = ShardMirror(h.rank, snap["own"], h.reg.optimizer)
        left = self.left()
        mirror = ShardMirror(left, snap["mirror"], h.reg.optimizer) if snap.get("mirror") else None
        if snap.get("boundary") is not None:
            h.reg.load_boundary(unpack(snap["boundary"]))
        return [own, mirror]

    def replay(self, reps: list[ShardMirror | None], t: int, item: dict[str, Any]) -> None:
        """Step t of the leaving rank, from the gradient shard it stepped with (after its
        clip) and its hyperparameters; its mirror's from the left neighbour's gradient."""
        own, mirror = reps
        assert own is not None
        own.hold(t, item["own"])
        own.step(t, item["hparams"])
        if mirror is not None:
            if item.get("left") is None:
                raise RecoveryError(f"the leaving rank served no gradient of step {t} for its shard mirror")
            mirror.hold(t, item["left"])
            mirror.step(t, item["hparams"])

    def take_over(self, reps: list[ShardMirror | None], tail: dict[str, Any]) -> None:
        """At the switch: the replayed shard into the model and optimizer, the replayed mirror
        kept, and the boundary's records (the leaving rank's local state, and its copy of the
        left neighbour's) so that a failure right after the switch still finds them."""
        h = self.h
        own, mirror = reps
        assert own is not None
        self.load({**own.state(), "boundary": None})
        self.owner.mirror = mirror
        self.owner.voted = None
        c = h.committed
        h.st.boundaries[c] = h.reg.pack_boundary()
        if h.reg.has_local:
            h.st.local_blob = LocalBlob(c, h.reg.pack_local())
            if tail.get("mirrored") is not None:
                h.st.mirrored[c] = tail["mirrored"]

    def load(self, state: dict[str, Any]) -> None:
        """A peer's shards into this rank's (the same shard of the same model)."""
        from torch.distributed.tensor import DTensor

        reg = self.h.reg
        with torch.no_grad():
            for p, v in zip(dtensors(reg.params), state["params"], strict=True):
                p.to_local().copy_(v)
        if reg.optimizer is not None and state["optimizer"]:
            sd = state["optimizer"]
            params = dtensors(reg.opt_params())
            per: dict[Any, Any] = {}
            for i, st in sd["state"].items():
                p = params[int(i)]
                loc = p.to_local()
                per[int(i)] = {k: DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                               if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == loc.shape else v
                               for k, v in st.items()}  # fmt: skip
            reg.optimizer.load_state_dict({"state": per, "param_groups": sd["param_groups"]})
        if state.get("boundary") is not None:
            reg.load_boundary(unpack(state["boundary"]))
