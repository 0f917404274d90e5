"""Reconfigurable process groups and fault-aware collectives.

A group is built directly from a c10d store namespaced by generation
(`PrefixStore(f"gen{g}", TCPStore)`), so it can be rebuilt inside a running
process. Builds and collectives run asynchronously and the caller polls
them, so a wait can end early when the generation moves on (the
coordinator fenced a hung peer) instead of sitting out the full timeout.

Broken groups are never destroyed while a gloo thread may still be inside a
collective on them: a retired group waits in a graveyard until no operation
of it can still run (its last collective completed: at once; otherwise once
the collective timeout, after which gloo itself ends any pending operation,
has passed since it was retired), then it is shut down and its sockets
closed; `release_all()` drops what is left before the interpreter shuts down
(a gloo group with a dead peer alive at exit aborts the process). So sockets
and file descriptors do not grow with each recovery.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from livemig.config import ENV_HOST, buddy_stride, is_host_port

log = logging.getLogger("livemig.comm")

_GRAVEYARD: list[tuple[Any, float]] = []  # (group, monotonic time after which no operation can run)
_GRAVE_LOCK = threading.Lock()
# Gradient buckets as DDP sizes them: a small first bucket (the last layers' gradients,
# ready first in backward) so communication starts early, then 25 MiB ones. With one
# 32 MiB bucket the reference model's whole gradient went out after backward ended and
# its allreduce did not overlap backward at all (a quarter of the step waiting on it).
FIRST_BUCKET_BYTES = 1 << 20
BUCKET_BYTES = 25 << 20


class CollectiveAborted(RuntimeError):
    """A collective or build was abandoned: peer failure, timeout, or a new generation."""


def store_for(addr: str, gen: int, timeout: timedelta) -> dist.Store:
    if not is_host_port(addr):
        raise CollectiveAborted(f"generation {gen}'s store address {addr!r} is not host:port")
    host, port = addr.rsplit(":", 1)
    tcp = dist.TCPStore(host, int(port), is_master=False, timeout=timeout, wait_for_workers=False)
    return dist.PrefixStore(f"gen{gen}", tcp)


def _gloo(store: dist.Store, rank: int, world: int, timeout: timedelta) -> Any:
    """A gloo group on the device of this process's --host address ($LIVEMIG_HOST), so peers
    on other hosts reach it (simulated hosts share one hostname); GLOO_SOCKET_IFNAME wins."""
    if not _named_host():
        return dist.ProcessGroupGloo(store, rank, world, timeout)
    return dist.ProcessGroupGloo(store, rank, world, gloo_options(timeout))


def _named_host() -> str:
    """$LIVEMIG_HOST where gloo should bind to it ("" where GLOO_SOCKET_IFNAME decides)."""
    return "" if os.environ.get("GLOO_SOCKET_IFNAME") else os.environ.get(ENV_HOST, "")


def gloo_options(timeout: timedelta) -> Any:
    """gloo's options for a group on this process's device: the --host address's, else gloo's
    default (comm/communicator.py's reconfigurable objects take these too)."""
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch's own, not in its stubs
    opts._timeout = timeout
    host = _named_host()
    dev = dist.ProcessGroupGloo.create_device(hostname=host) if host else dist.ProcessGroupGloo.create_default_device()
    opts._devices = [dev]
    return opts


def nccl_options(timeout: timedelta) -> Any:  # pragma: no cover - needs GPUs
    """NCCL's options, with livemig's exact-mode NCCL settings in the environment first
    (device.py `nccl_exact_env`: NCCL reads them when a communicator is made)."""
    from livemig.device import nccl_exact_env

    nccl_exact_env()
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return opts


def bind_to_device(pg: Any) -> Any:  # pragma: no cover - needs GPUs
    """`pg` bound to this process's device (`bound_device_id`: its communicator is made on that
    device, which nccl2 needs). Unverified on a GPU."""
    from livemig.device import training_device

    dev = training_device()
    if dev.type == "cuda" and hasattr(pg, "bound_device_id"):
        pg.bound_device_id = dev
    return pg


def _nccl(store: dist.Store, rank: int, world: int, timeout: timedelta) -> Any:  # pragma: no cover - needs GPUs
    return bind_to_device(dist.ProcessGroupNCCL(store, rank, world, nccl_options(timeout)))


_ABANDONED_BUILDS: list[threading.Thread] = []  # builds given up on, maybe still inside gloo's constructor


def exit_past_abandoned_builds() -> None:
    """A build given up on (an aborted migration's background build) may still be blocked
    in gloo's C++ constructor when the process ends; the interpreter's teardown then closes
    its store under it and the C++ runtime aborts the process (SIGABRT, "terminate called
    without an active exception": a spare seen in a CI run, after its job ended). Called on
    a clean way out of a worker or spare: if such a build is still running at exit, the
    process leaves with os._exit (logs and stdio flushed first), with 1 if an uncaught
    exception got to sys.excepthook meanwhile, else the status the script last gave
    `sys.exit` (atexit cannot see the exit status, so `sys.exit` records it), else 0. A
    bare `raise SystemExit(n)` is not seen: it leaves with 0. Other atexit handlers
    registered before this call are skipped then."""
    if not any(t.is_alive() for t in _ABANDONED_BUILDS):
        return
    import atexit
    import sys

    failed: list[bool] = []
    status: list[object] = []
    previous, previous_exit = sys.excepthook, sys.exit

    def hook(*exc: Any) -> None:
        failed.append(True)
        previous(*exc)

    def record_exit(arg: Any = None) -> None:
        status[:] = [arg]
        previous_exit(arg)

    def leave() -> None:
        if any(t.is_alive() for t in _ABANDONED_BUILDS):
            logging.shutdown()
            for f in (sys.stdout, sys.stderr):
                try:
                    f.flush()
                except Exception:  # noqa: BLE001 - a closed stream
                    pass
            os._exit(1 if failed else _exit_code(status[0] if status else None))

    sys.excepthook = hook
    sys.exit = record_exit  # type: ignore[assignment]
    atexit.register(leave)


def _exit_code(arg: object) -> int:
    """The process's exit status for `sys.exit(arg)`, as the interpreter computes it."""
    if arg is None:
        return 0
    if isinstance(arg, int):
        return arg & 0xFF
    return 1  # a message (the interpreter printed it already)


def build_group(
    store_addr: str, gen: int, rank: int, world: int, timeout: timedelta,
    backend: str = "gloo", should_abort: Callable[[], bool] | None = None,
) -> Any:  # fmt: skip
    """Build the group of generation `gen`; raises CollectiveAborted if aborted."""

    def make() -> Any:
        store = store_for(store_addr, gen, timeout)
        if backend == "nccl":  # pragma: no cover - needs GPUs
            return _nccl(store, rank, world, timeout)
        return _gloo(store, rank, world, timeout)

    return _abortable(make, f"generation {gen}", timeout, should_abort)


def build_subgroup(
    store: dist.Store, what: str, rank: int, world: int, timeout: timedelta,
    backend: str = "gloo", should_abort: Callable[[], bool] | None = None,
) -> Any:  # fmt: skip
    """A group on a prefix of a generation's store (a device-mesh dimension: comm/torch_group.py)."""

    def make() -> Any:
        if backend == "nccl":  # pragma: no cover - needs GPUs
            return _nccl(store, rank, world, timeout)
        return _gloo(store, rank, world, timeout)

    return _abortable(make, what, timeout, should_abort)


def build_endpoints(
    store_addr: str, gen: int, ranks: list[int], world: int, timeout: timedelta,
    should_abort: Callable[[], bool] | None = None,
) -> dict[int, Any]:  # fmt: skip
    """A shrunk job's full-width gloo group of generation `gen` (`world` ranks, prefix "full"),
    of which this process holds every rank in `ranks`: its own and the lost ones it carries.

    Why: a sum reduced by gloo over the N ranks of the fault-free group has its bits; the
    same sum over fewer processes (the carrier adding its ranks' gradients first) has
    others. With one endpoint per rank the carrier takes part in the very algorithm of the
    full group, so a shrunk step's average is the fault-free one bit for bit (the ranks'
    inputs being the same). Each endpoint is built in a thread of its own with a store
    client of its own (gloo's constructor blocks until every rank connected, and one
    TCPStore client is not shared between threads); raises CollectiveAborted."""
    boxes: dict[int, dict[str, Any]] = {r: {} for r in ranks}

    def work(r: int) -> None:
        try:
            store = dist.PrefixStore("full", store_for(store_addr, gen, timeout))
            boxes[r]["pg"] = _gloo(store, r, world, timeout)
        except Exception as exc:  # noqa: BLE001
            boxes[r]["err"] = exc

    threads = [threading.Thread(target=work, args=(r,), name=f"livemig-build-full{r}", daemon=True) for r in ranks]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout.total_seconds()

    def give_up(why: str) -> CollectiveAborted:
        _ABANDONED_BUILDS.extend(t for t in threads if t.is_alive())
        for box in boxes.values():
            retire(box.get("pg"))
        return CollectiveAborted(f"build of generation {gen}'s full-width group {why}")

    while any(t.is_alive() for t in threads):
        for t in threads:
            t.join(0.005)
        if should_abort is not None and should_abort():
            raise give_up("abandoned: generation moved on")
        if time.monotonic() > deadline:
            raise give_up(f"timed out after {timeout}")
    errs = [f"rank {r}: {box['err']}" for r, box in boxes.items() if "err" in box]
    if errs:
        raise give_up("failed: " + "; ".join(errs))
    return {r: box["pg"] for r, box in boxes.items()}


def generation_store(store_addr: str, gen: int, timeout: timedelta) -> dist.Store:
    """Generation `gen`'s store, as its group's build sees it."""
    return store_for(store_addr, gen, timeout)


def _abortable(make: Callable[[], Any], what: str, timeout: timedelta,
               should_abort: Callable[[], bool] | None) -> Any:  # fmt: skip
    """Run a group build in a thread (gloo's constructor blocks until every peer connects)
    that the caller may give up on: the generation moved on, or the timeout passed."""
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["pg"] = make()
        except Exception as exc:  # noqa: BLE001
            box["err"] = exc

    t = threading.Thread(target=work, name=f"livemig-build-{what.replace(' ', '')}", daemon=True)
    t.start()
    deadline = time.monotonic() + timeout.total_seconds()
    while t.is_alive():
        t.join(0.005)
        if should_abort is not None and should_abort():
            _ABANDONED_BUILDS.append(t)
            raise CollectiveAborted(f"build of {what} abandoned: generation moved on")
        if time.monotonic() > deadline:
            _ABANDONED_BUILDS.append(t)
            raise CollectiveAborted(f"build of {what} timed out after {timeout}")
    if "err" in box:
        raise CollectiveAborted(f"build of {what} failed: {box['err']}")
    return box["pg"]


def retire(pg: Any, idle: bool = False, timeout: timedelta | None = None) -> None:
    """Put a replaced or broken group in the graveyard (module doc). idle: no operation of it
    can be pending (its last collective completed): shut down at once. Otherwise after
    `timeout` (default: the collective timeout, $LIVEMIG_COLLECTIVE_TIMEOUT) plus a margin."""
    if pg is None:
        return
    if not idle and device_of(pg) is not None:  # pragma: no cover - needs GPUs
        _abort_nccl(pg)
        return
    if timeout is None:
        from livemig.config import Timeouts

        timeout = Timeouts.from_env().collective
    safe = time.monotonic() + (0.0 if idle else timeout.total_seconds() + 5.0)
    with _GRAVE_LOCK:
        _GRAVEYARD.append((pg, safe))
    sweep()


def _abort_nccl(pg: Any) -> None:  # pragma: no cover - needs GPUs
    """An NCCL group that may have a kernel waiting on a lost peer is aborted now, in a thread
    of its own: a kernel never times out the way a gloo wait does, and aborting a generation's
    communicators one after another, each waiting for the last, can hang (pytorch/pytorch#119797),
    so each abort starts at once and none waits for another. Unverified on a GPU."""

    def abort() -> None:
        try:
            getattr(pg, "abort", getattr(pg, "shutdown", lambda: None))()
        except Exception as exc:  # noqa: BLE001 - already broken: its references go anyway
            log.debug("NCCL abort failed", extra={"err": str(exc)})

    threading.Thread(target=abort, name="livemig-nccl-abort", daemon=True).start()


def sweep() -> int:
    """Shut down the groups in the graveyard that no operation can still use; returns how many."""
    now = time.monotonic()
    with _GRAVE_LOCK:
        due = [pg for pg, safe in _GRAVEYARD if safe <= now]
        _GRAVEYARD[:] = [(pg, safe) for pg, safe in _GRAVEYARD if safe > now]
    for pg in due:  # no gc.collect(): shutdown closed the sockets, and a full collection
        _shutdown(pg)  # (~0.2 s with torch loaded) would sit in a planned migration's pause
    return len(due)


def _shutdown(pg: Any) -> None:
    try:
        pg.shutdown()  # closes its pairs' sockets now, not when the last reference goes
    except Exception as exc:  # noqa: BLE001 - an already broken group: its references go anyway
        log.debug("group shutdown failed", extra={"err": str(exc)})


def release_all() -> None:
    """Before exit: shut down what may be; a group that may still be inside a collective
    is dropped and collected (destroyed before the interpreter's teardown, see the
    module doc). The collection runs only then: at a clean end it costs ~0.2 s."""
    sweep()
    with _GRAVE_LOCK:
        busy = bool(_GRAVEYARD)
        _GRAVEYARD.clear()
    if busy:
        gc.collect()


# the group classes whose collectives take device tensors only (absent from a CPU build)
_NCCL_KINDS = tuple(k for k in (getattr(dist, "ProcessGroupNCCL", None), getattr(dist, "ProcessGroupNCCL2", None)) if k)


def device_of(pg: Any) -> torch.device | None:
    """The device a group's collectives need their tensors on: CUDA for NCCL, None (any:
    gloo takes host and CUDA tensors) otherwise."""
    if _NCCL_KINDS and isinstance(pg, _NCCL_KINDS):  # pragma: no cover - needs GPUs
        return torch.device("cuda", torch.cuda.current_device())
    return None


def _placed(pg: Any, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """`tensors` where `pg` can reduce them: themselves, or device copies for NCCL (a control
    tensor or a flag made on the host); `_back` copies the results into the originals."""
    dev = device_of(pg)
    if dev is None:
        return tensors
    return [t if t.device == dev else t.to(dev) for t in tensors]  # pragma: no cover - needs GPUs


def _back(originals: list[torch.Tensor], placed: list[torch.Tensor]) -> None:
    for o, p in zip(originals, placed, strict=True):
        if p is not o:  # pragma: no cover - needs GPUs
            o.copy_(p)


def allreduce_sum(pg: Any, flats: list[torch.Tensor], timeout: timedelta,
                  should_abort: Callable[[], bool] | None = None) -> None:  # fmt: skip
    """Sum-allreduce every flat bucket in place; raises CollectiveAborted."""
    if pg is None:
        raise CollectiveAborted("no process group: this member is between generations")
    placed = _placed(pg, flats)
    works = [pg.allreduce([flat]) for flat in placed]
    wait_all(works, timeout, should_abort)
    _back(flats, placed)


def allreduce_mean(
    pg: Any, flats: list[torch.Tensor], world: int, timeout: timedelta,
    should_abort: Callable[[], bool] | None = None,
) -> None:  # fmt: skip
    """Sum-allreduce every flat bucket in place, then divide by `world`; raises CollectiveAborted."""
    allreduce_sum(pg, flats, timeout, should_abort)
    for flat in flats:
        flat.div_(world)


class _Waiter(threading.Thread):
    """A thread that blocks in gloo's `wait()` (GIL released) for the waits of one calling
    thread that wait_all does not poll (long ones, and works that run only inside wait()),
    instead of a thread started per collective. One per calling thread, not
    per process: waits of two threads (ranks sharing a process in tests, a side thread's
    collective) must not queue behind each other, since one may only finish after the
    other's caller goes on. A caller that gives up on a wait (timeout, generation moved on)
    leaves its waiter blocked in it, possibly for good, so it is abandoned and the next wait
    gets a fresh one; a forked child gets its own. It ends soon after its caller's thread
    does, so short-lived calling threads do not pile up idle waiters."""

    IDLE_CHECK_S = 2.0

    def __init__(self) -> None:
        super().__init__(daemon=True, name="livemig-collective")
        self.pid = os.getpid()
        self.owner = threading.current_thread()
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.start()

    def run(self) -> None:
        while True:
            try:
                works, done, box = self.jobs.get(timeout=self.IDLE_CHECK_S)
            except queue.Empty:
                if self.owner.is_alive():
                    continue
                return
            try:
                for w in works:
                    w.wait()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                box["err"] = exc
            done.set()


_waiters = threading.local()


def _the_waiter() -> _Waiter:
    waiter = getattr(_waiters, "waiter", None)
    if waiter is None or waiter.pid != os.getpid():
        waiter = _waiters.waiter = _Waiter()
    return waiter


def _abandon() -> None:
    """A wait was given up on: this thread's waiter may never come back from it; its next wait gets a new one."""
    _waiters.waiter = None


# How a wait looks at its works: every POLL_S[i][1] seconds once it has waited POLL_S[i][0],
# short first (most collectives of a step finish within milliseconds); a wait still pending
# after HANDOFF_S (a slow peer, a hang) is handed to the waiter thread, which blocks in
# wait() and costs no CPU however long it takes. Why poll: a thread blocked in gloo's wait()
# is woken by gloo's thread from another CPU, and that cross-CPU wake-up made a loop of
# small all-reduces 1.8x slower than polling every 100-200 us here (2 gloo ranks on 2 vCPUs,
# 8 all-reduces of 256 KiB with a matmul between: 19.3 ms blocked in wait(), 10.6 polling;
# the hand-off to a waiter thread 16.3); under FSDP2's ~20 collectives a step it was most of
# livemig's step-time overhead against torch FSDP2 (docs/benchmarks.md).
POLL_S = ((0.0, 1e-4), (0.02, 5e-4))
HANDOFF_S = 0.5
CHECK_S = 0.05  # the abort check and the watchdog deadline: this often


def wait_all(works: list[Any], timeout: timedelta, should_abort: Callable[[], bool] | None = None,
             poll: bool = True) -> None:  # fmt: skip
    """Wait for the works without spinning: polled from the calling thread (the GIL released
    in each short sleep) while the wait is short, then handed to the waiter thread; either
    way woken every CHECK_S to check `should_abort` and the watchdog deadline. Works already
    completed are waited inline. poll=False: works that only run inside their wait() (gloo's
    reduce-scatter and send/recv report is_completed() False until then) go to the waiter at
    once; a work like that polled by mistake costs HANDOFF_S, never a hang. gloo's timed
    `wait(t)` is not used to slice the wait: when it runs out under FSDP2's collectives gloo
    closes the pairs ("Application timeout caused pair closure")."""
    start = time.monotonic()
    deadline, check_at = start + timeout.total_seconds(), start + CHECK_S
    pending = [w for w in works if not w.is_completed()] if poll else list(works)
    handoff = start + (HANDOFF_S if poll else 0.0)
    while pending:
        now = time.monotonic()
        if now >= handoff:
            _wait_in_waiter(works, deadline, timeout, should_abort)
            return
        if now >= check_at:
            check_at = now + CHECK_S
            _check(should_abort, now, deadline, timeout)
        waited = now - start
        time.sleep(next(every for after, every in reversed(POLL_S) if waited >= after))
        pending = [w for w in pending if not w.is_completed()]
    _finish(works)


def _check(should_abort: Callable[[], bool] | None, now: float, deadline: float, timeout: timedelta) -> None:
    if should_abort is not None and should_abort():
        raise CollectiveAborted("collective abandoned: generation moved on")
    if now > deadline:
        raise CollectiveAborted(f"collective timed out after {timeout} (watchdog)")


def _finish(works: list[Any]) -> None:
    """wait() on completed works: returns at once, or raises what the collective failed with."""
    try:
        for w in works:
            w.wait()
    except Exception as exc:  # noqa: BLE001 - reported as every failed collective is
        raise CollectiveAborted(f"collective failed: {first_line(exc)}") from exc


def first_line(exc: BaseException) -> str:
    """What a failed collective says, in one line a log or the run's error can carry."""
    return str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__


def _wait_in_waiter(works: list[Any], deadline: float, timeout: timedelta,
                    should_abort: Callable[[], bool] | None) -> None:  # fmt: skip
    """The waiter thread blocks in wait() (GIL released); the caller sleeps on an Event."""
    done = threading.Event()
    box: dict[str, BaseException] = {}
    _the_waiter().jobs.put((works, done, box))
    while not done.wait(CHECK_S):
        try:
            _check(should_abort, time.monotonic(), deadline, timeout)
        except CollectiveAborted:
            _abandon()
            raise
    if "err" in box:
        raise CollectiveAborted(f"collective failed: {first_line(box['err'])}") from box["err"]


def broadcast_tensors(
    pg: Any, tensors: list[torch.Tensor], root: int, timeout: timedelta,
    should_abort: Callable[[], bool] | None = None,
) -> None:  # fmt: skip
    """Overwrite `tensors` in place with `root`'s, one flat buffer per dtype (a model's
    hundreds of tensors in a few collectives); raises CollectiveAborted."""
    if pg is None:
        raise CollectiveAborted("no process group: this member is between generations")
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            by_dtype.setdefault(t.dtype, []).append(t)
    flats = [(ts, torch.cat([t.detach().reshape(-1) for t in ts])) for ts in by_dtype.values()]
    dev = device_of(pg)
    if dev is not None:  # pragma: no cover - needs GPUs
        flats = [(ts, f.to(dev)) for ts, f in flats]
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    try:
        works = [pg.broadcast([flat], opts) for _, flat in flats]
    except Exception as exc:  # noqa: BLE001 - a broken group refuses at launch
        raise CollectiveAborted(f"collective failed at launch: {first_line(exc)}") from exc
    wait_all(works, timeout, should_abort)
    with torch.no_grad():
        for ts, flat in flats:
            at = 0
            for t in ts:
                t.copy_(flat[at : at + t.numel()].view_as(t))
                at += t.numel()


_RING_TAG = 7301  # send/recv tags of the local-state ring, apart from any user tag


def ring_exchange(
    pg: Any, blob: torch.Tensor, rank: int, world: int, timeout: timedelta,
    should_abort: Callable[[], bool] | None = None,
) -> torch.Tensor:  # fmt: skip
    """Send `blob` (uint8) to rank+s and return what rank-s sent (s: config.buddy_stride):
    each rank's local state mirrored on its buddy. Sizes first, so a blob may change size.
    The ring runs where the group can send (device_of: NCCL's device, else host memory:
    gloo's send/recv take CPU tensors, and a mirror held in host memory spares the device's);
    the blob received is returned on the host."""
    if pg is None:
        raise CollectiveAborted("no process group: this member is between generations")
    dev = device_of(pg) or torch.device("cpu")
    if blob.device != dev:
        blob = blob.to(dev)
    s = buddy_stride(world)
    right, left = (rank + s) % world, (rank - s) % world
    size_out = torch.tensor([blob.numel()], dtype=torch.int64, device=dev)
    size_in = torch.zeros(1, dtype=torch.int64, device=dev)
    buf = torch.empty(0, dtype=torch.uint8, device=dev)
    for tag, out in ((_RING_TAG, size_out), (_RING_TAG + 1, blob)):
        if tag != _RING_TAG:
            buf = torch.empty(int(size_in[0]), dtype=torch.uint8, device=dev)
        dst = size_in if tag == _RING_TAG else buf
        try:  # a broken group refuses at launch
            works = [pg.send([out], right, tag), pg.recv([dst], left, tag)]
        except Exception as exc:  # noqa: BLE001
            raise CollectiveAborted(f"collective failed at launch: {first_line(exc)}") from exc
        wait_all(works, timeout, should_abort, poll=False)  # send/recv run in wait()
    return buf.cpu()
