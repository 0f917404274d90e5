"""ZeRO-1: the optimizer state sharded over data-parallel ranks, mirrored on a buddy.

Layout. The gradient buckets of comm/reducer.py (reverse parameter order,
each padded to a multiple of the world size N) are cut into N equal slices;
rank r owns slice r of every bucket: the master values of those elements
and the optimizer state for them. A step is

    reduce-scatter each bucket  -> rank r holds g_r, the averaged slice r
    exchange: send g_r to r+1   -> rank r also holds g_{r-1}
       (or, LIVEMIG_ZERO1_REDUCE=allreduce, the default on gloo: allreduce each
        bucket and slice g_r and g_{r-1} out of it; no exchange)
    barrier (1-element allreduce)
    update own shard r with g_r, and the mirror of shard r-1 with g_{r-1}
    all-gather the updated slices -> full parameters on every rank

Mirror. Rank (r+1) mod N keeps an exact copy of shard r (values and
optimizer state) by applying the same update to it with the same gradient
slice: one extra shard of memory, one extra slice sent per step, and one
extra shard of optimizer arithmetic. See docs/architecture.md for why this
beats copying the state after each step or erasure coding.

Why the barrier. A rank updates only after every rank holds the gradient
slices it needs: if any survivor completed the barrier, every rank had
entered it, so every survivor can finish the step on its own (the update is
applied from the slices it holds), and the slice of a dead rank r lives on at
r+1 (which received g_r) and r-1 (which owns g_{r-1}). If no survivor
completed it, nobody updated and the step is redone. The all-gather comes
after the update: if it fails, the step is committed (every shard updated
on its owner and mirror) and the new group only repeats the all-gather.

Only element-wise optimizers are sharded (the update of an element depends
on that element alone): Adam, AdamW, SGD, ... Optimizers that look at whole
tensors (LBFGS, Adafactor, Muon) are refused at registration.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from livemig.comm.group import CollectiveAborted, device_of, wait_all
from livemig.comm.reducer import GradReducer
from livemig.config import ENV_REDUCE, buddy_stride, zero1_layout
from livemig.errors import ConfigError, RecoveryError

log = logging.getLogger("livemig.zero1")

SYNC_SKIP = ("params", "foreach")  # our choice of implementation is kept when hyperparameters follow the template


def reduce_mode(backend: str) -> str:
    """gloo's reduce-scatter and allgather are slower than its allreduce (measured for 32 MiB
    on 2 ranks here: 30.9 and 30.4 ms vs 22.5 ms), so on gloo the average is allreduced and
    sliced; NCCL's reduce-scatter moves half the bytes of an allreduce."""
    import os

    mode = os.environ.get(ENV_REDUCE) or ("reduce_scatter" if backend == "nccl" else "allreduce")
    if mode not in ("allreduce", "reduce_scatter"):
        raise ConfigError(f"{ENV_REDUCE}={mode!r}: expected allreduce or reduce_scatter")
    return mode


ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adagrad", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop", "Adadelta", "ASGD")


@dataclass(frozen=True)
class Piece:
    """A run of one shard's elements in one bucket that belong to one param group."""

    bucket: int
    start: int  # offset within the shard's slice of the bucket
    length: int
    group: int  # index into the user's optimizer param_groups


def shard_pieces(red: GradReducer, group_of: list[int], shard: int, sizes: list[int] | None = None) -> list[Piece]:
    """The pieces of `shard`: its slice of every bucket, split where the param group changes
    (`sizes`: the shard sizes of another world size, for resharding a checkpoint)."""
    out: list[Piece] = []
    for b, idx in enumerate(red.layout):
        s = (sizes or red.shard_sizes)[b]
        lo, hi = shard * s, (shard + 1) * s
        for i in idx:
            a = red.offset[i]
            e = a + red.params[i].numel()
            x, y = max(a, lo), min(e, hi)
            if x >= y:
                continue
            g = group_of[i]
            last = out[-1] if out else None
            if last and last.bucket == b and last.group == g and lo + last.start + last.length == x:
                out[-1] = Piece(b, last.start, last.length + (y - x), g)
            else:
                out.append(Piece(b, x - lo, y - x, g))
    return out


class ShardState:
    """One shard's master values and the optimizer that updates them."""

    def __init__(self, red: GradReducer, group_of: list[int], template: torch.optim.Optimizer, shard: int) -> None:
        self.shard = shard
        self.template = template
        self.red, self.group_of = red, group_of
        self.pieces = shard_pieces(red, group_of, shard)
        init = red.param_flats()
        self.values = [f[shard * s : (shard + 1) * s].clone() for f, s in zip(init, red.shard_sizes, strict=True)]
        self.tensors = [self.values[p.bucket][p.start : p.start + p.length] for p in self.pieces]
        self.group_ids = sorted({p.group for p in self.pieces})
        groups = []
        for g in self.group_ids:
            hp = {k: v for k, v in template.param_groups[g].items() if k != "params"}
            if hp.get("foreach") is None and not hp.get("fused"):
                hp["foreach"] = True  # few large flat pieces: the multi-tensor path is 2.5x faster on CPU
            groups.append({"params": [t for t, p in zip(self.tensors, self.pieces, strict=True) if p.group == g], **hp})
        cls: Any = type(template)  # the template's class: its hyperparameters come with each group
        self.opt = cls(groups) if groups else None

    def update(self, grads: list[torch.Tensor]) -> None:
        """Apply one step with the averaged slices `grads` (one per bucket)."""
        if self.opt is None:
            return
        for g, group in zip(self.group_ids, self.opt.param_groups, strict=True):
            for k, v in self.template.param_groups[g].items():  # follow LR schedulers on the template
                if k not in SYNC_SKIP:
                    group[k] = v
        for t, p in zip(self.tensors, self.pieces, strict=True):
            t.grad = grads[p.bucket][p.start : p.start + p.length]
        self.opt.step()
        for t in self.tensors:
            t.grad = None

    def state(self) -> dict[str, Any]:
        return {"shard": self.shard, "values": self.values, "optimizer": self.opt.state_dict() if self.opt else {}}

    def load(self, obj: dict[str, Any]) -> None:
        if int(obj["shard"]) != self.shard:
            raise ConfigError(f"received optimizer shard {obj['shard']}, expected {self.shard}")
        for dst, src in zip(self.values, obj["values"], strict=True):
            dst.copy_(src)
        if self.opt is not None:
            self.opt.load_state_dict(obj["optimizer"])

    def load_resharded(self, parts: list[dict[str, Any]]) -> None:
        """This shard cut from the shards of another world size (len(parts) ranks, a
        checkpoint's): the buckets' layout does not depend on the world size, only where each
        shard's slice of them starts, so every element lands where it was; optimizer scalars
        (a step count) are equal over a param group's pieces and taken from the first."""
        world = len(parts)
        sizes = [-(-n // world) for n in self.red.sizes]
        full = [torch.zeros(max(s * world, n), dtype=d, device=self.red.device)  # room for the old and the new padding
                for s, n, d in zip(sizes, self.red.padded, self.red.dtypes, strict=True)]  # fmt: skip
        elems: dict[tuple[int, str, int], torch.Tensor] = {}  # (group, key, bucket): the whole bucket
        scalars: dict[tuple[int, str], torch.Tensor] = {}
        stateless: set[bool] = set()
        for k, obj in enumerate(parts):
            if int(obj["shard"]) != k:
                raise ConfigError(f"checkpoint part {k} holds optimizer shard {obj['shard']}")
            for b, v in enumerate(obj["values"]):
                full[b][k * sizes[b] : k * sizes[b] + v.numel()].copy_(v)
            pieces = shard_pieces(self.red, self.group_of, k, sizes)
            ordered = [p for g in sorted({p.group for p in pieces}) for p in pieces if p.group == g]
            state = (obj.get("optimizer") or {}).get("state", {})
            for i, p in enumerate(ordered):
                st = state.get(i, state.get(str(i)))
                stateless.add(not st)
                for key, t in (st or {}).items():
                    if not isinstance(t, torch.Tensor) or t.dim() == 0:
                        scalars.setdefault((p.group, key), t)
                        continue
                    dst = elems.get((p.group, key, p.bucket))
                    if dst is None:
                        dst = torch.zeros(full[p.bucket].numel(), dtype=t.dtype, device=self.red.device)
                        elems[(p.group, key, p.bucket)] = dst
                    at = k * sizes[p.bucket] + p.start
                    dst[at : at + p.length].copy_(t)
        if len(stateless) > 1:
            raise ConfigError("the checkpoint's optimizer shards are partly without state: cannot reshard them")
        own = self.red.shard_sizes
        for b, v in enumerate(self.values):
            v.copy_(full[b][self.shard * own[b] : self.shard * own[b] + v.numel()])
        if self.opt is None or stateless == {True}:
            return
        sd = self.opt.state_dict()
        ordered = [p for g in self.group_ids for p in self.pieces if p.group == g]
        new_state: dict[int, dict[str, Any]] = {}
        for i, p in enumerate(ordered):
            at = self.shard * own[p.bucket] + p.start
            st = {key: t.clone() for (g, key), t in scalars.items() if g == p.group}
            for (g, key, b), t in elems.items():
                if g == p.group and b == p.bucket:
                    st[key] = t[at : at + p.length].clone()
            new_state[i] = st
        self.opt.load_state_dict({"state": new_state, "param_groups": sd["param_groups"]})

    def tensors_for_digest(self) -> list[torch.Tensor]:
        from livemig.state import flatten

        out: list[torch.Tensor] = []
        flatten(self.state(), out)
        return out


def _forbid_step(*_: Any, **__: Any) -> None:
    raise ConfigError("with sharding='zero1' the optimizer is stepped by ctx.step(), not by user code")


class Zero1:
    """The shards this rank holds (its own, its mirror of rank - stride; in a shrunk job those
    zero1_layout gives it) and the collectives of a step."""

    def __init__(self, red: GradReducer, params: list[torch.nn.Parameter], template: torch.optim.Optimizer,
                 rank: int, world: int, mirror: bool = True) -> None:  # fmt: skip
        name = type(template).__name__
        if name not in ELEMENTWISE:
            raise ConfigError(
                f"sharding='zero1' needs an element-wise optimizer ({', '.join(ELEMENTWISE)}); "
                f"{name} updates whole tensors: use sharding=None"
            )
        pid = {id(p): g for g, grp in enumerate(template.param_groups) for p in grp["params"]}
        missing = [i for i, p in enumerate(params) if id(p) not in pid]
        if missing:
            raise ConfigError(f"sharding='zero1': {len(missing)} trainable parameter(s) are not in the optimizer")
        self.red, self.rank, self.world = red, rank, world
        self.template = template
        self.group_of = [pid[id(p)] for p in red.params]
        self.stride = buddy_stride(world)  # we mirror the shard of rank - stride (on another node)
        self.mirroring = mirror and world > 1
        self.carried: dict[int, int] = {}  # the layout's: virtual rank -> its carrier (a shrunk job)
        self.layout = zero1_layout(world, {}, self.stride, self.mirroring)
        self.shards = {s: ShardState(red, self.group_of, template, s) for s in self._held(self.layout)}
        self._staged: dict[int, ShardState] = {}
        self._gather: list[torch.Tensor] | None = None
        template.step = _forbid_step  # type: ignore[method-assign,assignment]  # the template never steps

    def reset_values(self) -> None:
        """Every held shard's master values from the parameters as they are now: after the
        start-up sync made them rank 0's (runtime/start_sync.py), since the shards were cut
        from this rank's own initial parameters at registration (a per-rank seed makes those
        differ, and each mirror then from its owner)."""
        flats = self.red.param_flats()
        for s, sh in self.shards.items():
            for v, f, n in zip(sh.values, flats, self.red.shard_sizes, strict=True):
                v.copy_(f[s * n : (s + 1) * n])

    # -- which shards ----------------------------------------------------------------------
    def _held(self, layout: dict[int, tuple[int, int | None]]) -> list[int]:
        return sorted(s for s, (o, m) in layout.items() if self.rank in (o, m))

    def owned(self) -> list[int]:
        return sorted(s for s, (o, _) in self.layout.items() if o == self.rank)

    def mirrored(self) -> list[int]:
        return sorted(s for s, (_, m) in self.layout.items() if m == self.rank)

    @property
    def own(self) -> ShardState:
        return self.shards[self.rank]

    @property
    def mirror(self) -> ShardState | None:
        """The full-width mirror (of rank - stride), when this rank holds it as a mirror."""
        s = (self.rank - self.stride) % self.world
        return self.shards.get(s) if self.layout[s][1] == self.rank else None

    @property
    def shrunk(self) -> bool:
        return bool(self.carried)

    def held(self) -> list[ShardState]:
        return [self.shards[s] for s in self._held(self.layout)]

    def stage(self, carried: dict[int, int], every: bool = False) -> list[int]:
        """The shards the layout of `carried` gives this rank that it does not hold (every:
        all it gives, a spare's, which holds none yet): to be pulled (`adopt`) before that
        generation's group commits."""
        self._staged = {}
        new = zero1_layout(self.world, carried, self.stride, self.mirroring)
        return [s for s in self._held(new) if every or s not in self.shards]

    def adopt(self, shard: int, state: dict[str, Any]) -> None:
        sh = ShardState(self.red, self.group_of, self.template, shard)
        sh.load(state)
        self._staged[shard] = sh

    def switch(self, carried: dict[int, int]) -> None:
        """The generation of `carried` committed: hold its layout's shards (the staged ones
        joining), drop the others."""
        layout = zero1_layout(self.world, carried, self.stride, self.mirroring)
        keep = self._held(layout)
        self.shards.update({s: sh for s, sh in self._staged.items() if s in keep})
        gone = [s for s in keep if s not in self.shards]
        if gone:
            raise RecoveryError(f"rank {self.rank} holds no copy of optimizer shard(s) {gone} of its new layout")
        self.shards = {s: self.shards[s] for s in keep}
        self.layout, self.carried, self._staged = layout, dict(carried), {}
        self._gather = None

    # -- the collectives of one step ----------------------------------------------------
    def slices(self, pg: Any, reduced: list[torch.Tensor], timeout: timedelta,
               abort: Any) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:  # fmt: skip
        """(g_r, g_{r-1}) from the reducer's output: exchanged after a reduce-scatter,
        sliced out of an allreduced average."""
        if self.red.scatter:
            return reduced, self.exchange(pg, reduced, timeout, abort)
        own = [f.chunk(self.world)[self.rank] for f in reduced]
        mirror = [f.chunk(self.world)[self.mirror.shard] for f in reduced] if self.mirror is not None else None
        return own, mirror

    def slices_of(self, full: list[torch.Tensor]) -> Any:
        """The slices of every shard held, cut out of a whole averaged gradient in bucket
        layout (a step whose average the user took: ctx.sync_gradients, clipping, a
        GradScaler), no collective: (own, mirror) at full width, ({shard: slices}, None) while
        shrunk (Zero1.update takes either)."""
        if self.shrunk:
            return self.slices_shrunk(full), None
        own = [f.chunk(self.world)[self.rank] for f in full]
        mirror = [f.chunk(self.world)[self.mirror.shard] for f in full] if self.mirror is not None else None
        return own, mirror

    def whole(self, pg: Any, slices: list[torch.Tensor], timeout: timedelta, abort: Any) -> list[torch.Tensor]:
        """The whole average out of the reduce-scattered slices (an all-gather into fresh
        buckets): what ctx.sync_gradients() hands the user in reduce-scatter mode."""
        if pg is None:
            raise CollectiveAborted("no process group: this member is between generations")
        dev = self.red.device
        outs = [torch.empty(n, dtype=d, device=dev) for n, d in zip(self.red.padded, self.red.dtypes, strict=True)]
        try:
            works = [pg.allgather([list(o.chunk(self.world))], [s]) for o, s in zip(outs, slices, strict=True)]
        except Exception as exc:  # noqa: BLE001 - a broken group refuses the launch
            raise CollectiveAborted(f"collective failed at launch: {exc}") from exc
        wait_all(works, timeout, abort)
        return outs

    def exchange(self, pg: Any, own: list[torch.Tensor], timeout: timedelta, abort: Any) -> list[torch.Tensor] | None:
        """Send our averaged slices to the next rank, receive the previous rank's."""
        if self.mirror is None:
            return None
        if pg is None:
            raise CollectiveAborted("no process group: this member is between generations")
        got = [torch.empty_like(g) for g in own]
        nxt, prv = (self.rank + self.stride) % self.world, (self.rank - self.stride) % self.world
        works = []
        for b, (g, r) in enumerate(zip(own, got, strict=True)):
            works.append(pg.send([g], nxt, b))
            works.append(pg.recv([r], prv, b))
        wait_all(works, timeout, abort, poll=False)  # send/recv run in wait()
        return got

    @staticmethod
    def barrier(pg: Any, timeout: timedelta, abort: Any, *votes: float) -> list[float]:
        """Every member holds the step's averaged slices; returns the sums of the members'
        `votes` (a whole-job stop, runtime/stop.py; a planned migration's switch), the same on
        every member."""
        if pg is None:
            raise CollectiveAborted("no process group: this member is between generations")
        ctl = torch.tensor([*votes] or [0.0], device=device_of(pg))
        wait_all([pg.allreduce([ctl])], timeout, abort)
        return [float(v) for v in ctl]

    def update(self, own: Any, mirror: list[torch.Tensor] | None = None, part: str = "all") -> None:
        """Step the shards held with their averaged slices: (own, mirror) at full width, or
        one dict {shard: slices} (`slices_shrunk`); part "owned" / "mirrored" steps those only."""
        if own is None:  # a step a GradScaler skipped (inf/nan): no shard moves, on any rank
            return
        held = own if isinstance(own, dict) else {self.rank: own, **(
            {self.mirror.shard: mirror} if self.mirror is not None else {})}  # fmt: skip
        ids = {"all": self._held(self.layout), "owned": self.owned(), "mirrored": self.mirrored()}[part]
        for s in ids:
            if held.get(s) is None:
                raise CollectiveAborted(f"no gradient slice for optimizer shard {s}")
            self.shards[s].update(held[s])

    def slices_shrunk(self, summed: list[torch.Tensor]) -> dict[int, list[torch.Tensor]]:
        """A shrunk job's slices of every shard held, out of the allreduced average (no
        reduce-scatter: N shards do not cut over fewer processes)."""
        return {s: [f.chunk(self.world)[s] for f in summed] for s in self._held(self.layout)}

    def gather(self, pg: Any, timeout: timedelta, abort: Any, meanwhile: Callable[[], None] | None = None) -> None:
        """All-gather the owners' slices into the full parameters; `meanwhile` runs
        while the gather is in flight (the mirror's update: it needs no parameters)
        and always runs, even when the gather cannot start."""
        if self.shrunk:
            return self._gather_shrunk(pg, timeout, abort, meanwhile)
        vals = self.own.values
        if self._gather is None:
            dev = self.red.device
            pads = zip(self.red.padded, vals, strict=True)
            self._gather = [torch.zeros(n, dtype=v.dtype, device=dev) for n, v in pads]
        outs = self._gather
        try:
            works = _launch(pg, lambda: [pg.allgather([list(f.chunk(self.world))], [v])
                                         for f, v in zip(outs, vals, strict=True)], meanwhile)  # fmt: skip
            wait_all(works, timeout, abort)
        except CollectiveAborted:
            self._gather = None  # an abandoned gloo op may still write into it
            raise
        self.red.write_params(self._gather)

    def _gather_shrunk(self, pg: Any, timeout: timedelta, abort: Any, meanwhile: Callable[[], None] | None) -> None:
        """The all-gather of a shrunk job: each process sends the shards it owns in k slots
        (k: the most any process owns; unused slots are zeros), and every process places
        each slot where its shard goes (the layout says whose is which)."""
        members = sorted({o for o, _ in self.layout.values()})
        owned = {p: sorted(s for s, (o, _) in self.layout.items() if o == p) for p in members}
        k = max(len(v) for v in owned.values())
        sizes = self.red.shard_sizes
        dev = self.red.device
        kinds = list(zip(sizes, self.red.dtypes, strict=True))
        outs = [[torch.empty(k * n, dtype=d, device=dev) for _ in members] for n, d in kinds]

        def launch() -> list:
            works = []
            for b, n in enumerate(sizes):
                mine = torch.zeros(k * n, dtype=self.red.dtypes[b], device=dev)
                for j, s in enumerate(owned[self.rank]):
                    mine[j * n : (j + 1) * n].copy_(self.shards[s].values[b])
                works.append(pg.allgather([outs[b]], [mine]))
            return works

        wait_all(_launch(pg, launch, meanwhile), timeout, abort)  # fresh buffers: nothing to forget on a failure
        full = [torch.zeros(n, dtype=d, device=dev) for n, d in zip(self.red.padded, self.red.dtypes, strict=True)]
        for b, n in enumerate(sizes):
            for i, p in enumerate(members):
                for j, s in enumerate(owned[p]):
                    full[b][s * n : (s + 1) * n].copy_(outs[b][i][j * n : (j + 1) * n])
        self.red.write_params(full)


def _launch(pg: Any, launch: Callable[[], list], meanwhile: Callable[[], None] | None) -> list:
    """Launch an all-gather; `meanwhile` runs while it is in flight (the mirrors' update: it
    needs no parameters) and always runs, even when the launch fails."""
    works, err = [], None
    try:
        if pg is None:
            raise CollectiveAborted("no process group: this member is between generations")
        works = launch()
    except CollectiveAborted as exc:
        err = exc
    except Exception as exc:  # noqa: BLE001 - a broken group refuses the launch
        err = CollectiveAborted(f"collective failed at launch: {exc}")
    if meanwhile is not None:
        meanwhile()
    if err is not None:
        raise err
    return works
