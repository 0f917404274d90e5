"""Gradient averaging in fixed buckets, overlapped with backward.

Buckets follow the parameters in reverse order (the order backward produces
their gradients). A post-accumulate-grad hook copies each gradient into its
bucket's flat buffer; when a bucket is full its allreduce is launched while
backward goes on, as DDP does. As DDP does, each gradient is divided by the
world size on its way into the bucket (one pass: no division of the sums
afterwards), so the buckets' sum is the average. `.grad` itself is never
reduced in place: the averaged buckets are written back only after every
bucket completed, so a failed collective leaves `.grad` untouched and the
step can be redone. Written back as views (`write_back(..., views=True)`)
when nothing may change `.grad` before the optimizer reads it: no copy.

The bucket layout is the one canonical layout: the overlapped first attempt,
a retry in a new group, and a fetched average all use it, so the summation
order (and so the bits) never depends on which path a step took.

Sharded mode (ZeRO-1, `shard_world` > 0): each bucket is padded to a
multiple of the world size so it cuts into equal slices, and is either
reduce-scattered (`scatter=True`: rank r receives only the averaged slice r)
or allreduced as usual (every rank keeps the whole average and slices it;
see comm/zero1.py for when each is used).

Gradient accumulation: wrap all but the last micro-batch's backward in
`ctx.no_sync()`, as with DDP. A gradient that changes after its bucket was
launched (a second backward outside no_sync) is refused with one line: the
overlapped buckets would otherwise hold half an accumulation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch

from livemig.comm.group import BUCKET_BYTES, FIRST_BUCKET_BYTES, CollectiveAborted, allreduce_sum, wait_all
from livemig.errors import ConfigError


def bucket_layout(params: Sequence[torch.Tensor], bucket_bytes: int = BUCKET_BYTES,
                  first_bytes: int = FIRST_BUCKET_BYTES) -> list[list[int]]:  # fmt: skip
    """Buckets in parameter order, one dtype each: a bucket of mixed fp32 and bf16
    gradients would be averaged in one of the two (losing precision, or bits that
    depend on the path). A parameter of another dtype goes to its dtype's open
    bucket, so interleaved dtypes do not make many small buckets. The first bucket
    closes at `first_bytes` (it is launched while backward still runs). The layout
    depends on the parameters alone: every rank, and a spare, computes the same."""
    layout: list[list[int]] = []
    open_: dict[torch.dtype, tuple[list[int], int]] = {}
    for i, p in enumerate(params):
        cur, size = open_.get(p.dtype, ([], 0))
        cur.append(i)
        size += p.numel() * p.element_size()
        if size >= (bucket_bytes if layout else first_bytes):
            layout.append(cur)
            open_.pop(p.dtype, None)
        else:
            open_[p.dtype] = (cur, size)
    layout += [cur for cur, _ in open_.values()]
    return layout


def _grad(p: torch.Tensor) -> torch.Tensor:
    """The parameter's gradient, which the caller made sure exists (the post-accumulate hook
    fired, or ensure_grads() gave zeros to a parameter backward did not reach)."""
    g = p.grad
    if g is None:
        raise RuntimeError("a parameter in the gradient buckets has no .grad (ensure_grads() was not called)")
    return g


class GradReducer:
    def __init__(self, params: list[torch.nn.Parameter], shard_world: int = 0, scatter: bool = True,
                 world: int = 1) -> None:  # fmt: skip
        self.params = list(reversed(params))
        self.world = world  # the divisor applied on the way into the buckets
        self.shard_world = shard_world
        self.scatter = bool(shard_world) and scatter
        self.layout = bucket_layout(self.params)
        self.bucket_of = {i: b for b, idx in enumerate(self.layout) for i in idx}
        self.offset: dict[int, int] = {}
        for idx in self.layout:
            off = 0
            for i in idx:
                self.offset[i] = off
                off += self.params[i].numel()
        self.sizes = [sum(self.params[i].numel() for i in idx) for idx in self.layout]
        self.dtypes = [self.params[idx[0]].dtype for idx in self.layout]
        # buckets live with the parameters (`.grad` may be a view of one: device.py's one code path)
        self.device = self.params[0].device if self.params else torch.device("cpu")
        w = max(shard_world, 1)
        self.padded = [-(-n // w) * w for n in self.sizes]  # room for equal slices per rank
        self.shard_sizes = [n // w for n in self.padded]
        self._sets: list[list[torch.Tensor] | None] = [None, None]
        self._out_sets: list[list[torch.Tensor] | None] = [None, None]
        self._flip = 0
        self.sync = False  # inside ctx.no_sync(): copy nothing, launch nothing
        self._armed = False
        self._works: list[Any] = []  # this step's bucket works (arm() sets one slot per bucket)
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(self.params)]

    # -- per step ----------------------------------------------------------------------
    def arm(self, pg: Any) -> None:
        """Start overlapping for one step on group `pg` (None: no overlap)."""
        self._pg = pg
        self._armed = pg is not None
        self._flip = (self._flip + 1) % 2 if self.scatter else (self._flip + 1) % len(self._sets)
        fi = 0 if self.scatter else self._flip  # scattered: the kept average is the slice, not the bucket
        flats = self._sets[fi]
        if flats is None:
            flats = self._sets[fi] = self._alloc(self.padded)
        self._flats: list[torch.Tensor] = flats
        if self.scatter:
            # the averaged slices are kept until the next step's commit: double-buffered too
            outs = self._out_sets[self._flip]
            if outs is None:
                outs = self._out_sets[self._flip] = self._alloc(self.shard_sizes)
            self._outs: list[torch.Tensor] = outs
        self._filled = [False] * len(self.params)
        self._count = [0] * len(self.layout)
        self._works = [None] * len(self.layout)
        self._dirty = False
        self._launch_error: BaseException | None = None

    def keep(self, n: int) -> None:
        """Rotate over n sets of buckets (default 2): a completed average stays
        untouched for n-1 further steps (a leaving worker serves its last ones
        to a catching-up spare without copying them)."""
        n = max(2, n)
        if n > len(self._sets):
            self._sets += [None] * (n - len(self._sets))
        elif n < len(self._sets):
            self._sets = self._sets[:n]
            self._flip %= n

    def keep_at_least(self, n: int) -> None:
        """keep(n) unless more sets are kept already (a migration's and a feed's needs add up to the larger)."""
        if n > len(self._sets):
            self.keep(n)

    def _alloc(self, sizes: list[int]) -> list[torch.Tensor]:
        return [torch.zeros(n, dtype=dt, device=self.device)
                for n, dt in zip(sizes, self.dtypes, strict=True)]  # padding stays zero  # fmt: skip

    def disarm(self) -> None:
        self._armed = False

    def abandon(self) -> None:
        """This step's collectives were given up on (a peer hung or failed, the generation
        moved on) while gloo may still be inside one: a hung peer that wakes up before the
        collective timeout completes it, and the survivor's gloo thread then writes the sum
        into these buckets, possibly steps later, when the rotation has handed them to
        another step's average (a survivor's final state differed from the fault-free run:
        test_hung_worker_is_fenced_and_stops_itself, the hang_fenced fault case). So the
        buckets of an unfinished work are forgotten, never reused: the work keeps them
        alive until its group is shut down (comm/group.py's graveyard), and the next step
        that would take them allocates new ones."""
        self._armed = False
        if not any(w is not None and w is not False and not w.is_completed() for w in self._works):
            return
        self._sets = [None if s is self._flats else s for s in self._sets]
        if self.scatter:
            self._out_sets = [None if s is self._outs else s for s in self._out_sets]
        self._works = [None] * len(self.layout)

    def _hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            if not self._armed or self.sync or p.grad is None:
                return
            b = self.bucket_of[i]
            if self._works[b] is not None:
                self._dirty = True  # accumulated again after launch
                return
            self._copy_in(i)
            if self._count[b] == len(self.layout[b]):
                self._launch(b)

        return hook

    def _copy_in(self, i: int) -> None:
        p = self.params[i]
        b = self.bucket_of[i]
        off = self.offset[i]
        dst = self._flats[b][off : off + p.numel()]
        if self.world > 1:
            torch.div(_grad(p).reshape(-1), self.world, out=dst)  # pre-divided, as DDP's buckets
        else:
            dst.copy_(_grad(p).reshape(-1))
        if not self._filled[i]:
            self._filled[i] = True
            self._count[b] += 1

    def _launch(self, b: int) -> None:
        try:
            if self.scatter:
                chunks = list(self._flats[b].chunk(self.shard_world))
                self._works[b] = self._pg.reduce_scatter([self._outs[b]], [chunks])
            else:
                self._works[b] = self._pg.allreduce([self._flats[b]])
        except Exception as exc:  # noqa: BLE001 - surfaced by finish()
            self._launch_error = exc
            self._works[b] = False

    def finish(self, world: int, timeout: timedelta, should_abort: Callable[[], bool],
               control: torch.Tensor | None = None) -> list[torch.Tensor]:  # fmt: skip
        """Complete the overlapped reduction; returns the averaged buckets
        (in sharded mode: this rank's averaged slice of each bucket). `world` must be
        the reducer's own (the divisor its buckets were filled with).

        `control` (a small tensor) is averaged in the same round, after the
        buckets: members vote through it (planned migration's switch step)."""
        self._armed = False
        if world != self.world:
            raise ValueError(f"finish(world={world}) on a reducer that divides by {self.world}")
        if self._launch_error is not None:
            raise CollectiveAborted(f"collective failed at launch: {self._launch_error}")
        if self._dirty:  # the same on every rank: the same code ran
            raise ConfigError(
                "a second backward() ran after this step's gradients were being averaged (gradient "
                "accumulation without ctx.no_sync()): wrap all but the last micro-batch's backward in "
                "`with ctx.no_sync():`"
            )
        else:
            for i in range(len(self.params)):
                if not self._filled[i]:
                    self._copy_in(i)
            for b, w in enumerate(self._works):
                if w is None:
                    self._launch(b)
            if self._launch_error is not None:
                raise CollectiveAborted(f"collective failed at launch: {self._launch_error}")
            try:
                ctl = [self._pg.allreduce([control])] if control is not None else []
            except Exception as exc:  # noqa: BLE001 - a broken group
                raise CollectiveAborted(f"collective failed at launch: {exc}") from exc
            wait_all(self._works + ctl, timeout, should_abort, poll=not self.scatter)  # reduce-scatter runs in wait()
            flats = self._outs if self.scatter else self._flats
        if control is not None:
            control.div_(world)
        return flats

    # -- synchronous paths (retry in a new group, fetched average) ------------------------------
    def flatten(self, world: int = 1) -> list[torch.Tensor]:
        """The local gradients in the bucket layout, divided by `world` as the overlapped
        path fills its buckets (the same bits: a retry sums what the first attempt would)."""
        return self._flat(lambda i: _grad(self.params[i]), world)

    def flatten_grads(self, grads: Sequence[torch.Tensor | None], world: int = 1) -> list[torch.Tensor]:
        """flatten() of gradients held aside (a shrunk job's carried body: runtime/virtual.py),
        given in the parameters' order; None is a zero gradient, as ensure_grads() makes it."""
        if len(grads) != len(self.params):
            raise ValueError(f"{len(grads)} gradients for {len(self.params)} parameters")
        rev = list(reversed(grads))  # self.params is in backward's order

        def grad(i: int) -> torch.Tensor:
            x = rev[i]
            return torch.zeros_like(self.params[i]) if x is None else x

        return self._flat(grad, world)

    def _flat(self, grad: Callable[[int], torch.Tensor], world: int) -> list[torch.Tensor]:
        """Parameter i's gradient `grad(i)` in the padded bucket layout, divided by `world`."""
        flats = self._padded([torch.cat([grad(i).reshape(-1) for i in idx]) for idx in self.layout])
        if world > 1:
            for f in flats:
                f.div_(world)
        return flats

    def _padded(self, flats: list[torch.Tensor]) -> list[torch.Tensor]:
        return [f if f.numel() == n else torch.nn.functional.pad(f, (0, n - f.numel()))
                for f, n in zip(flats, self.padded, strict=True)]  # fmt: skip

    def reduce(self, pg: Any, flats: list[torch.Tensor], timeout: timedelta,
               should_abort: Callable[[], bool] | None = None) -> list[torch.Tensor]:  # fmt: skip
        """Synchronous reduction of `flats` (from flatten(world): pre-divided; a retry in a
        new group): the averaged buckets, or in sharded mode freshly allocated averaged slices."""
        if not self.scatter:
            allreduce_sum(pg, flats, timeout, should_abort)
            return flats
        if pg is None:
            raise CollectiveAborted("no process group: this member is between generations")
        outs = self._alloc(self.shard_sizes)
        works = [pg.reduce_scatter([o], [list(f.chunk(self.shard_world))]) for o, f in zip(outs, flats, strict=True)]
        wait_all(works, timeout, should_abort, poll=False)  # a reduce-scatter runs in wait()
        return outs

    def write_back(self, flats: list[torch.Tensor], views: bool = False) -> None:
        """The averaged buckets into `.grad`: copied, or (views=True) `.grad` made a view
        of the bucket, which saves a pass over every gradient. Views only where nothing
        writes `.grad` before zero_grad() drops it: the buckets are the average kept for
        a peer's recovery and served to a migrating spare, and must stay the average."""
        for idx, flat in zip(self.layout, flats, strict=True):
            off = 0
            for i in idx:
                p = self.params[i]
                n = p.numel()
                if views and p.is_contiguous():  # (a channels-last weight keeps its own layout)
                    p.grad = flat[off : off + n].view_as(p)
                else:
                    grad = _grad(p)
                    grad.copy_(flat[off : off + n].view_as(grad))
                off += n

    def write_params(self, flats: list[torch.Tensor]) -> None:
        """Copy gathered (padded) buckets into the parameters themselves."""
        with torch.no_grad():
            for idx, flat in zip(self.layout, flats, strict=True):
                off = 0
                for i in idx:
                    p = self.params[i]
                    p.copy_(flat[off : off + p.numel()].view_as(p))
                    off += p.numel()

    def param_flats(self) -> list[torch.Tensor]:
        """The parameters' values in the padded bucket layout."""
        with torch.no_grad():
            return self._padded([torch.cat([self.params[i].detach().reshape(-1) for i in idx]) for idx in self.layout])

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
