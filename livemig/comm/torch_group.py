"""Process groups torch knows, whose communicator livemig swaps at a generation change.

FSDP2 (`fully_shard`) and DeviceMesh take their groups from torch.distributed: a mesh needs a
default process group (DeviceMesh asks `get_rank()` of it) and each mesh dimension is a group
torch created and named. livemig's own groups (comm/group.py) are gloo backends built from a
generation's store, one per generation, which torch has never heard of. This module bridges
the two the way issue 32 asks, keeping the objects FSDP2 holds stable and swapping what is
under them:

- `install()` registers a c10d backend named "livemig" (`dist.Backend.register_backend`,
  public) and calls `dist.init_process_group("livemig", ...)` once per process; torch then
  creates the default group and every mesh sub-group through our creator, which returns a
  `SwappableGroup`: a Python `dist.ProcessGroup` whose collectives delegate to an inner
  backend (a gloo group of the current generation; NCCL is the same call on a device).
- `swap_all(build)` gives every such group a new inner backend for a new generation (its
  store, the same ranks): DeviceMesh, the DTensors' placements and FSDP2's state keep their
  group objects, user code keeps its mesh.

What this rests on besides public API, pinned by tests/unit/test_torch_group.py (a torch
upgrade that changes it fails there, loudly): a creator that returns a `dist.ProcessGroup`
subclass is used as the group itself (torch's "PythonProcessGroup" path in
`_new_process_group_helper`); such a group's `group_name` must be answered by the subclass
(the C++ name is never set on that path); FSDP2's collectives call the group's
`all_gather_single` / `reduce_scatter_single` (torch 2.13), delegated to the gloo backend's
`_allgather_base` / `_reduce_scatter_base`; a `dist._Work` subclass returned by such a group
is what `work.wait()` runs, also when torch's functional collectives (DTensor's redistribute,
the gradient clip's norm) wait on it from C++, and a BaseException raised in it reaches the
caller as itself (through autograd's hooks too).

Failures: every collective's work is a `_GuardedWork` whose wait polls livemig's abort check
(the generation moved on: a peer was fenced) and watchdog, as livemig's own collectives do
(comm/group.py). A failed or abandoned collective poisons the generation's groups and raises
`StepAborted`, a BaseException the runtime catches above the user's function (runtime/
fsdp2.py); every later collective of the poisoned generation raises it at once, so the
user's code cannot go on with half-gathered parameters; the next swap clears the poison.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

BACKEND = "livemig"
_lock = threading.Lock()
_groups: list[SwappableGroup] = []  # every group torch created through us, default first
_registered = False


class StepAborted(BaseException):
    """A collective under FSDP2 failed or was abandoned (a peer lost, the generation moved on):
    the step cannot complete in this generation. A BaseException, so a user's `except
    Exception` does not swallow it; the runtime unwinds the user's function with it."""


class _Guard:
    """What every SwappableGroup's wait checks: set by the runtime that owns the groups."""

    def __init__(self) -> None:
        self.should_abort: Callable[[], bool] | None = None
        self.timeout = timedelta(seconds=60)
        self.on_fail: Callable[[str], None] | None = None
        self.poisoned = ""  # why this generation's groups cannot be used ("" while they can)
        self.before: Callable[[str], None] | None = None  # the fault plan's in-collective kill points
        self.kind = ""  # what the collectives now running are for ("clip_norm" inside ctx.clip_grad_norm_)
        # told as each wait begins (True) and ends (False): the coordinator's hang detection reads
        # which ranks wait in a collective (a rank whose training thread is stuck never waits)
        self.on_wait: Callable[[bool], None] | None = None

    def fail(self, why: str) -> None:
        first = not self.poisoned
        self.poisoned = self.poisoned or why
        if first and self.on_fail is not None:
            self.on_fail(why)
        raise StepAborted(self.poisoned)

    def check(self) -> None:
        if self.poisoned:
            raise StepAborted(self.poisoned)


GUARD = _Guard()


def set_guard(should_abort: Callable[[], bool] | None, timeout: timedelta,
              on_fail: Callable[[str], None] | None = None,
              before: Callable[[str], None] | None = None,
              on_wait: Callable[[bool], None] | None = None) -> None:  # fmt: skip
    """The runtime's abort check, watchdog and failure report for every wait of our groups,
    `before(kind)`, called as each collective is submitted (kind: fsdp_allgather,
    fsdp_reduce_scatter, replicate_allreduce, clip_norm, other), and `on_wait(begins)`."""
    GUARD.should_abort, GUARD.timeout, GUARD.on_fail, GUARD.before = should_abort, timeout, on_fail, before
    GUARD.on_wait = on_wait


class _GuardedWork(dist._Work):
    """An inner backend's work whose wait ends early when the generation moves on."""

    def __init__(self, inner: Any, poll: bool) -> None:
        super().__init__()
        self.inner = inner
        self.poll = poll  # False: the work runs only inside its wait() (gloo's reduce-scatter)

    def wait(self, timeout: Any = None) -> bool:
        from livemig.comm.group import CollectiveAborted, wait_all

        GUARD.check()
        told = GUARD.on_wait
        if told is not None:
            told(True)
        try:
            wait_all([self.inner], GUARD.timeout, GUARD.should_abort, poll=self.poll)
        except CollectiveAborted as exc:
            GUARD.fail(str(exc))
        finally:
            if told is not None:
                told(False)
        return True

    def is_completed(self) -> bool:
        return bool(self.inner.is_completed())

    def is_success(self) -> bool:
        return bool(self.inner.is_success())

    def get_future(self) -> Any:
        return self.inner.get_future()


class _Unformed:
    """The inner backend of a group the job has not formed yet. Before the job's first
    generation, a worker's collectives run on a start-up communicator `TAP.boot` builds
    (runtime/preloop.py); without one (a group created inside the loop) the call is refused."""

    def __init__(self) -> None:
        self.group: SwappableGroup | None = None

    def __getattr__(self, name: str) -> Any:
        g = self.group
        if TAP.boot is not None and g is not None:
            inner = TAP.boot(g)
            g.swap(inner, 0)
            return getattr(inner, name)
        from livemig.errors import ConfigError

        where = f"group {g.group_name}" if g is not None else "a group"
        raise ConfigError(f"torch.distributed {name} on {where} before the job gave it a communicator: a group "
                          "created inside the loop (dist.new_group, ctx.init_device_mesh) gets one at the next "
                          "recovery only; create groups before ctx.steps()")  # fmt: skip


class _Tap:
    """How the runtime sees the collectives of user code outside its steps (runtime/preloop.py):
    `record(group, name, outputs)` after each completed one, `answer(group, name, outputs)`
    instead of running one (a process entering the function again; False: run this one, the
    peers meet it), `boot(group)` a start-up communicator for a group the job has not formed
    yet, `rejoin(group, name, why)` after a recorded one failed once the job formed (it joins
    the recovery; the call is then made again in the new generation). All None: collectives
    run as they are."""

    def __init__(self) -> None:
        self.record: Callable[[SwappableGroup, str, list[torch.Tensor]], None] | None = None
        self.answer: Callable[[SwappableGroup, str, list[torch.Tensor]], bool] | None = None
        self.boot: Callable[[SwappableGroup], Any] | None = None
        self.rejoin: Callable[[SwappableGroup, str, BaseException], None] | None = None


TAP = _Tap()


class _Done(dist._Work):
    """The work of a collective that completed already (recorded, or answered from a record)."""

    def __init__(self, outputs: list[torch.Tensor]) -> None:
        super().__init__()
        self.outputs = outputs

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def get_future(self) -> Any:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self.outputs)
        return fut


# Where each collective's results land, by its positional arguments: "list" the first argument
# (a list of tensors), "lists" the first argument's lists, "one" the first argument (a tensor),
# "" nothing (a barrier, a send). torch calls a Python group's collectives positionally.
_OUTPUTS = {
    "allreduce": "list", "allreduce_coalesced": "list", "allgather": "lists", "_allgather_base": "one",
    "allgather_into_tensor_coalesced": "list", "all_gather_single": "one", "reduce_scatter": "list",
    "_reduce_scatter_base": "one", "reduce_scatter_tensor_coalesced": "list", "reduce_scatter_single": "one",
    "broadcast": "list", "allgather_coalesced": "lists", "barrier": "", "alltoall": "list", "alltoall_base": "one",
    "gather": "lists", "scatter": "list", "reduce": "list", "send": "", "recv": "list", "recv_anysource": "list",
    "monitored_barrier": "",
}  # fmt: skip


def outputs_of(name: str, a: tuple) -> list[torch.Tensor]:
    """The tensors collective `name` called with positional arguments `a` writes its results into."""
    how = _OUTPUTS[name]
    if not how or not a:
        return []
    if how == "one":
        return [a[0]]
    if how == "lists":
        return [t for sub in a[0] for t in sub]
    return list(a[0])


REJOINS = 3  # a collective outside the steps made again after this many recoveries at most


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, list | tuple):
        return [t for y in x for t in _tensors(y)]
    return []


def _tapped(g: SwappableGroup, name: str, a: tuple, submit: Callable[[], Any]) -> Any:
    """A collective through the tap: answered from the record, or run (and recorded once complete)."""
    if TAP.answer is not None:
        outs = outputs_of(name, a)
        if TAP.answer(g, name, outs):
            return _Done(outs)
    if TAP.record is None:
        return submit()
    # What a failed attempt may have half-written (gloo reduces in place): put back before it is made again.
    kept = [(t, t.detach().clone()) for t in _tensors(a)] if TAP.rejoin is not None else []
    for attempt in range(REJOINS + 1):
        try:
            submit().wait()
            break
        except StepAborted as exc:
            if TAP.boot is None:  # the job formed (code around an epoch's steps): join the recovery, again
                if TAP.rejoin is None or attempt == REJOINS:
                    raise
                with torch.no_grad():
                    for t, was in kept:
                        t.copy_(was)
                TAP.rejoin(g, name, exc)
                continue
            from livemig.errors import RecoveryError  # a start-up communicator: nothing to recover yet

            GUARD.poisoned = ""
            why = f"torch.distributed {name} before ctx.steps() failed before the job formed: {exc}"
            raise RecoveryError(why) from None
    outs = outputs_of(name, a)
    if TAP.record is not None:
        TAP.record(g, name, outs)
    return _Done(outs)


# What a lost peer, a closed connection or a timeout says when a submission fails (gloo's
# transport, c10d's store and network errors); anything else raised at submission is the
# caller's error (an unsupported op, a wrong shape) and reaches the caller as itself.
_LINK_WORDS = ("connection", "closed", "reset by peer", "timed out", "timeout", "broken pipe", "pair",
               "socket", "abort", "peer", "econnrefused", "unreachable")  # fmt: skip


def is_link_failure(exc: BaseException) -> bool:
    """Does an error raised while submitting a collective mean the group is broken (a recovery),
    rather than that the call was wrong (the caller's bug: the group can go on)?"""
    net = tuple(e for e in (getattr(dist, "DistNetworkError", None), getattr(dist, "DistStoreError", None)) if e)
    if net and isinstance(exc, net):
        return True
    msg = str(exc).lower()
    return any(w in msg for w in _LINK_WORDS)


class _AllOf:
    """Several backend works as one (a coalesced call gloo has no single op for): complete when
    all are, waited in order."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def is_success(self) -> bool:
        return all(w.is_success() for w in self.works)

    def wait(self, timeout: Any = None) -> bool:
        for w in self.works:
            w.wait()
        return True

    def get_future(self) -> Any:
        return torch.futures.collect_all([w.get_future() for w in self.works])


def _run(kind: str, inner_call: Callable[[], Any], poll: bool | None = None) -> _GuardedWork:
    """Submit through the guard; a reduce-scatter's work (and a point-to-point one) is waited
    without polling (on gloo it runs only inside its wait(): comm/group.py wait_all)."""
    GUARD.check()
    if GUARD.before is not None:
        GUARD.before(GUARD.kind or kind)
    try:
        work = inner_call()
    except StepAborted:
        raise
    except Exception as exc:  # noqa: BLE001 - a broken pair raises at submission too
        from livemig.comm.group import first_line

        if not is_link_failure(exc):
            raise  # the caller's: an op the backend lacks, a wrong shape; the group is sound
        GUARD.fail(f"collective failed: {first_line(exc)}")
    return _GuardedWork(work, poll=kind != "fsdp_reduce_scatter" if poll is None else poll)


def _delegated(name: str, kind: str = "other", poll: bool | None = None) -> Callable[..., Any]:
    """A SwappableGroup method that submits the inner communicator's `name` through the tap
    (runtime/preloop.py) and the guard. kind: the fault point it is ("allreduce": the group's
    role says, `_allreduce_kind`); poll=False: its work is waited without polling (gloo runs
    it inside wait())."""

    def call(self: SwappableGroup, *a: Any, **k: Any) -> Any:
        what = self._allreduce_kind() if kind == "allreduce" else kind
        return _tapped(self, name, a, lambda: _run(what, lambda: getattr(self.inner, name)(*a, **k), poll=poll))

    call.__name__ = name
    return call


class SwappableGroup(dist.ProcessGroup):
    """A torch process group with a replaceable communicator underneath."""

    def __init__(self, rank: int, size: int, ranks: list[int], name: str, inner: Any) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # torch's (rank, size) constructor, absent from its stubs
        self.ranks = ranks  # global ranks, in group-rank order
        self.inner = inner
        self._name = name
        self.generation = 0
        self.role = ""  # "replicate": HSDP's replica dimension (its all-reduce is a fault point)

    # the name torch gives the group (DeviceMesh keys its dimensions by it)
    @property
    def group_name(self) -> str:  # type: ignore[override]
        return self._name

    def _set_group_name(self, name: str) -> None:
        self._name = name

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return BACKEND

    def _get_backend(self, device: Any = None) -> Any:
        """The communicator now under the group, for torch code that asks a group for its
        backend on a device (torch 2.14's `batch_isend_irecv` reads its `supports_coalescing`;
        a Python group has no backend registered per device, and torch raised "No backend type
        associated with device type cpu")."""
        return self.inner

    def _allreduce_kind(self) -> str:
        return "replicate_allreduce" if self.role == "replicate" else "other"

    def swap(self, inner: Any, generation: int) -> None:
        """Trains on `inner` from the next collective on (called between steps)."""
        self.inner, self.generation = inner, generation

    # -- the collectives, delegated ---------------------------------------------------------
    allreduce = _delegated("allreduce", "allreduce")
    allreduce_coalesced = _delegated("allreduce_coalesced", "allreduce")
    allgather = _delegated("allgather")
    _allgather_base = _delegated("_allgather_base", "fsdp_allgather")

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:  # fmt: skip
        """gloo has no coalesced all-gather into tensors (a full state dict, DTensor.full_tensor
        of several): one `_allgather_base` per pair, waited as one."""
        pairs = list(zip(outputs, inputs, strict=True))

        def submit() -> Any:
            return _run("fsdp_allgather", lambda: _AllOf([self.inner._allgather_base(o, i) for o, i in pairs]))

        return _tapped(self, "allgather_into_tensor_coalesced", (outputs,), submit)

    def all_gather_single(self, out: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> Any:
        return _tapped(
            self,
            "all_gather_single",
            (out,),
            lambda: _run("fsdp_allgather", lambda: self.inner._allgather_base(out, inp)),
        )

    reduce_scatter = _delegated("reduce_scatter", "fsdp_reduce_scatter")
    _reduce_scatter_base = _delegated("_reduce_scatter_base", "fsdp_reduce_scatter")

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:  # fmt: skip
        """As allgather_into_tensor_coalesced: one `_reduce_scatter_base` per pair."""
        o = dist.ReduceScatterOptions()
        o.reduceOp = opts.reduceOp if opts is not None else dist.ReduceOp.SUM  # type: ignore[assignment, unused-ignore]  # SUM converts (stubs differ by torch)
        pairs = list(zip(outputs, inputs, strict=True))

        def submit() -> Any:
            inner = self.inner
            return _run("fsdp_reduce_scatter", lambda: _AllOf([inner._reduce_scatter_base(x, y, o) for x, y in pairs]))

        return _tapped(self, "reduce_scatter_tensor_coalesced", (outputs,), submit)

    def reduce_scatter_single(self, out: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> Any:
        o = dist.ReduceScatterOptions()
        o.reduceOp = opts.reduceOp if opts is not None else dist.ReduceOp.SUM  # type: ignore[assignment, unused-ignore]  # SUM converts (stubs differ by torch)
        return _tapped(
            self,
            "reduce_scatter_single",
            (out,),
            lambda: _run("fsdp_reduce_scatter", lambda: self.inner._reduce_scatter_base(out, inp, o)),
        )

    broadcast = _delegated("broadcast")
    allgather_coalesced = _delegated("allgather_coalesced")
    barrier = _delegated("barrier")
    # the collectives gloo runs inside their wait(): waited unpolled
    alltoall = _delegated("alltoall", poll=False)
    alltoall_base = _delegated("alltoall_base", poll=False)
    gather = _delegated("gather", poll=False)
    scatter = _delegated("scatter", poll=False)
    reduce = _delegated("reduce", poll=False)
    send = _delegated("send", poll=False)
    recv = _delegated("recv", poll=False)
    recv_anysource = _delegated("recv_anysource", poll=False)

    def monitored_barrier(self, *a: Any, **k: Any) -> Any:
        def run() -> Any:
            GUARD.check()  # synchronous in gloo: it returns once every rank reached it, or raises
            return self.inner.monitored_barrier(*a, **k)

        def done() -> _Done:  # synchronous: complete once run returns
            run()
            return _Done([])

        if TAP.answer is not None or TAP.record is not None:
            return _tapped(self, "monitored_barrier", a, done)
        return run()


class _Loopback:
    """The inner backend of a spare's standby world at the job's size (`install_standby`):
    every collective completes at once, as if every peer held what this rank holds (a
    gather repeats the input, a reduce-scatter keeps this rank's chunk, a reduction leaves
    the tensor as it is). The user's loop body then runs its DTensor code on the job's mesh
    shape with no peer, which fills DTensor's sharding-propagation caches for that shape
    (runtime/fsdp2_mesh.py); the values are thrown away with the warm-up."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> _Done:
        return _Done(list(tensors))

    allreduce_coalesced = allreduce

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> _Done:
        return _Done(list(tensors))

    reduce = allreduce

    def barrier(self, opts: Any = None) -> _Done:
        return _Done([])

    def monitored_barrier(self, *a: Any, **k: Any) -> None:
        return None

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> _Done:
        """Every rank's input is this rank's. Also `gather`: a non-root has no outputs, and nothing lands."""
        with torch.no_grad():
            for outs, inp in zip(outputs, inputs, strict=False):
                for o in outs:
                    o.copy_(inp)
        return _Done([t for outs in outputs for t in outs])

    allgather_coalesced = gather = allgather

    def _allgather_base(self, out: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> _Done:
        with torch.no_grad():
            for chunk in out.chunk(self.size):
                chunk.copy_(inp.reshape(chunk.shape))
        return _Done([out])

    def _reduce_scatter_base(self, out: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> _Done:
        with torch.no_grad():
            out.copy_(inp.chunk(self.size)[self.rank].reshape(out.shape))
        return _Done([out])

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> _Done:
        with torch.no_grad():
            for o, parts in zip(outputs, inputs, strict=True):
                o.copy_(parts[self.rank])
        return _Done(list(outputs))

    def alltoall_base(self, out: torch.Tensor, inp: torch.Tensor, *a: Any) -> _Done:
        with torch.no_grad():
            out.copy_(inp.reshape(out.shape))
        return _Done([out])

    def __getattr__(self, name: str) -> Any:
        if name not in _OUTPUTS:
            raise AttributeError(name)

        def refused(*a: Any, **k: Any) -> Any:
            raise RuntimeError(f"torch.distributed {name} has no peer in a spare's warm-up on the job's mesh: "
                               "guard it with `if not ctx.warming_up:`")  # fmt: skip

        return refused


def loopback_inner(store: dist.Store, rank: int, size: int, timeout: timedelta) -> Any:
    """The inner communicator of every group of a spare's standby world (`_Loopback`)."""
    return _Loopback(rank, size)


def gloo_inner(store: dist.Store, rank: int, size: int, timeout: timedelta) -> Any:
    """The default inner communicator: a gloo backend on `store`."""
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _lazy_inner(store: dist.Store, rank: int, size: int, timeout: timedelta) -> Any:
    """A group of one works at once (a spare's standby, a local run); a larger one waits for
    the job to form (the runtime swaps its generation's communicator in, `build_inners`)."""
    return gloo_inner(store, rank, size, timeout) if size == 1 else _Unformed()


def _creator(opts: Any, _backend_opts: Any) -> SwappableGroup:
    ranks = list(opts.global_ranks_in_group) or list(range(opts.group_size))
    inner = _factory["fn"](opts.store, opts.group_rank, opts.group_size, opts.timeout)
    with _lock:
        # Named by its ranks (and how many groups of the same ranks came before), not by torch's
        # counter: a spare that rebuilt its world must find the survivors' stores by name.
        twins = sum(1 for g in _groups if g.ranks == ranks)
        g = SwappableGroup(opts.group_rank, opts.group_size, ranks, f"{'-'.join(map(str, ranks))}.{twins}", inner)
        if isinstance(inner, _Unformed):
            inner.group = g
        _groups.append(g)
    return g


_factory: dict[str, Callable[..., Any]] = {"fn": gloo_inner}


def install(store: dist.Store, rank: int, world: int, timeout: timedelta,
            inner: Callable[[dist.Store, int, int, timedelta], Any] = gloo_inner) -> SwappableGroup:  # fmt: skip
    """Make torch.distributed's default group a SwappableGroup over `store` (once per
    process and world size; a second call returns the same group, one at another world size
    replaces it: a spare's standby world of one, then the job's): from here on
    `init_device_mesh`, `new_group` and `fully_shard` work on groups whose communicator
    livemig owns."""
    global _registered
    with _lock:
        if not _registered:
            dist.Backend.register_backend(BACKEND, _creator, extended_api=True, devices=["cpu", "cuda"])
            _registered = True
        _factory["fn"] = inner
    if dist.is_initialized():
        default = dist.distributed_c10d._get_default_group()
        if not isinstance(default, SwappableGroup):
            raise RuntimeError("torch.distributed was initialised by someone else: livemig cannot own its groups")
        if default.size() == world and default.rank() == rank and not standby_world():
            return default  # (a standby world is always replaced: its groups have no peers)
        dist.destroy_process_group()
        with _lock:
            _groups.clear()
    dist.init_process_group(BACKEND, store=store, rank=rank, world_size=world, timeout=timeout)
    default = dist.distributed_c10d._get_default_group()
    assert isinstance(default, SwappableGroup)
    return default


def install_unformed(rank: int, world: int, timeout: timedelta) -> SwappableGroup:
    """`install` before the job formed: the groups exist (DeviceMesh and fully_shard can be
    built) and get their communicators at the job's first generation."""
    return install(dist.HashStore(), rank, world, timeout, inner=_lazy_inner)


def install_standby(rank: int, world: int, timeout: timedelta) -> SwappableGroup:
    """A spare in standby: the job's world size, this process alone in it (`_Loopback`), so
    the mesh and DTensor code of its warm-up have the job's shape. Replaced by the job's
    world when the spare is claimed."""
    return install(dist.HashStore(), rank, world, timeout, inner=loopback_inner)


def standby_world() -> bool:
    """Is the default group a standby world (`install_standby`)?"""
    g = groups()
    return bool(g) and isinstance(g[0].inner, _Loopback)


def groups() -> list[SwappableGroup]:
    with _lock:
        return list(_groups)


def active() -> bool:
    """Does this process train over torch groups livemig owns (is there a group to swap)?"""
    return bool(groups()) and dist.is_initialized() and groups()[0].size() > 1 and not standby_world()


def build_inners(store: dist.Store, rank: int, default_inner: Any,
                 build: Callable[[str, dist.Store, int, int], Any]) -> list[tuple[SwappableGroup, Any]]:  # fmt: skip
    """Phase 1 of a generation: a communicator for each group this rank is in, the default
    group's being `default_inner` (livemig's own group of the generation: the same ranks in
    the same order), the others built by `build(store, group_rank, group_size)` on a prefix of
    the generation's store named after the group (`build(name, store, group_rank, group_size)`).
    Every rank builds its groups in the order
    torch created them, the same on every rank, so the builds cannot wait on each other in a
    cycle."""
    out: list[tuple[SwappableGroup, Any]] = []
    for i, g in enumerate(groups()):
        if rank not in g.ranks:
            continue
        if i == 0:
            out.append((g, default_inner))
            continue
        st = dist.PrefixStore(f"tg/{g.group_name}", store)
        out.append((g, build(g.group_name, st, g.ranks.index(rank), len(g.ranks))))
    return out


def swap_built(built: list[tuple[SwappableGroup, Any]], generation: int) -> list[Any]:
    """Phase 2: train on the built communicators from the next collective on; returns the
    replaced ones besides the default group's (the caller retires them)."""
    old = []
    for i, (g, inner) in enumerate(built):
        if i > 0 and not isinstance(g.inner, _Unformed):
            old.append(g.inner)
        g.swap(inner, generation)
    GUARD.poisoned = ""
    return old


def swap_all(store_for: Callable[[SwappableGroup], dist.Store], rank: int, generation: int,
             timeout: timedelta, inner: Callable[..., Any] | None = None) -> None:  # fmt: skip
    """A new generation: every group this process is in gets a new communicator over the
    store `store_for(group)` (each group its own prefix), the same ranks. Every member of a
    group must swap it (the builds rendezvous in the store)."""
    make = inner or _factory["fn"]
    for g in groups():
        if rank not in g.ranks:
            continue
        g.swap(make(store_for(g), g.ranks.index(rank), len(g.ranks), timeout), generation)
    GUARD.poisoned = ""
