"""The gradient reducer on a real 3-rank gloo group (threads of this process): the
overlapped path (buckets filled pre-divided during backward) and the retry path
(flatten + sum in a new group) give the same bits, also for a world that is not a
power of two; views written back are the buckets themselves and stay the average
through an optimizer step."""

from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from livemig.comm.group import allreduce_sum
from livemig.comm.reducer import GradReducer

T = timedelta(seconds=20)
WORLD = 3


def _model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Tanh(), torch.nn.Linear(300, 9))


def _backward(m: torch.nn.Module, rank: int) -> None:
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(16, 64, generator=g), torch.randn(16, 9, generator=g)
    torch.nn.functional.mse_loss(m(x), y).backward()


def _rank(rank: int, store: dist.Store, m: torch.nn.Module, out: dict) -> None:
    params = list(m.parameters())
    red = GradReducer(params, world=WORLD)
    pg = dist.ProcessGroupGloo(dist.PrefixStore("r", store), rank, WORLD, T)
    red.arm(pg)
    _backward(m, rank)
    local = [p.grad.clone() for p in params]
    overlapped = [f.clone() for f in red.finish(WORLD, T, lambda: False)]
    for p, g in zip(params, local, strict=True):  # as a retry finds .grad: untouched
        assert torch.equal(p.grad, g)
    retried = red.flatten(WORLD)
    allreduce_sum(pg, retried, T)
    red.write_back(retried, views=True)
    kept = [f.clone() for f in retried]
    torch.optim.AdamW(params, lr=0.1).step()
    out[rank] = (overlapped, retried, kept, local, [p.grad for p in params])


def test_overlapped_and_retried_averages_are_the_same_bits_and_views_stay_the_average():
    store = dist.HashStore()
    out: dict = {}
    models = [_model() for _ in range(WORLD)]
    threads = [threading.Thread(target=_rank, args=(r, store, models[r], out)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert set(out) == set(range(WORLD))
    for r in range(WORLD):
        overlapped, retried, kept, local, grads = out[r]
        assert all(torch.equal(a, b) for a, b in zip(overlapped, retried, strict=True)), f"rank {r}"
        assert all(torch.equal(a, b) for a, b in zip(retried, kept, strict=True)), "the step changed the average"
        flat = retried[0]
        lo, hi = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
        assert lo <= grads[-1].data_ptr() < hi  # .grad is a view of the bucket: no copy
    # the average is DDP's: each rank's gradient divided by the world size, then summed
    ref = [sum((out[r][3][i] / WORLD for r in range(WORLD)), torch.zeros_like(out[0][3][i]))
           for i in range(len(out[0][3]))]  # fmt: skip
    got = out[0][4]
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(ref, got, strict=True))


class _Work:
    """A gloo work stand-in: wait() returns once `release` is set (at once without one)."""

    def __init__(self, release: threading.Event | None = None) -> None:
        self.release = release

    def wait(self) -> None:
        if self.release is not None:
            self.release.wait()

    def is_completed(self) -> bool:  # one with a release completes as it is waited on
        return self.release is not None and self.release.is_set()


def test_completed_works_are_waited_without_the_waiter_and_their_errors_surface():
    """group.wait_all: works already completed (FSDP2's prefetched all-gathers) skip the
    hand-off to the waiter thread; a failed one still raises CollectiveAborted with its
    first line; one not completed still goes to the waiter (its abort check works)."""
    import pytest

    from livemig.comm import group
    from livemig.comm.group import CollectiveAborted, wait_all

    class Failed(_Work):
        def wait(self) -> None:
            raise RuntimeError("Connection closed by peer [10.0.0.2]:1234\nmore")

    done = threading.Event()
    done.set()
    seen: list = []

    def caller() -> None:
        wait_all([_Work(done), _Work(done)], timedelta(seconds=5))
        seen.append(getattr(group._waiters, "waiter", None))
        try:
            wait_all([Failed(done)], timedelta(seconds=5))
        except CollectiveAborted as exc:
            seen.append(str(exc))

    t = threading.Thread(target=caller)
    t.start()
    t.join(5)
    assert seen == [None, "collective failed: Connection closed by peer [10.0.0.2]:1234"]
    pending = threading.Event()
    try:
        with pytest.raises(CollectiveAborted, match="generation moved on"):
            wait_all([_Work(pending)], timedelta(seconds=5), should_abort=lambda: True)
    finally:
        pending.set()


def test_a_wait_given_up_on_does_not_hold_up_the_next_one():
    """wait_all's waiter thread may stay blocked in a wait its caller gave up on (a
    hung collective): the next wait must get a fresh waiter, not queue behind it."""
    import time

    import pytest

    from livemig.comm.group import CollectiveAborted, wait_all

    stuck = threading.Event()
    try:
        with pytest.raises(CollectiveAborted, match="timed out"):
            wait_all([_Work(stuck)], timedelta(seconds=0.2))
        t0 = time.monotonic()
        wait_all([_Work()], timedelta(seconds=5))
        assert time.monotonic() - t0 < 1.0
        with pytest.raises(CollectiveAborted, match="generation moved on"):
            wait_all([_Work(stuck)], timedelta(seconds=5), should_abort=lambda: True)
        wait_all([_Work(), _Work()], timedelta(seconds=5))
    finally:
        stuck.set()


def test_waits_of_two_threads_do_not_queue_behind_each_other():
    """Two ranks in threads of one process (as the zero1 and reducer tests run them): thread
    A waits on a collective that completes only after thread B's own wait returns and B goes
    on. A waiter shared by the process would take A's wait first and hold B's behind it:
    a deadlock until the watchdog (seen in CI)."""
    import time

    from livemig.comm.group import wait_all

    b_went_on = threading.Event()
    a_queued = threading.Event()
    errors: list[BaseException] = []

    def a() -> None:
        try:
            a_queued.set()
            wait_all([_Work(b_went_on)], timedelta(seconds=5))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def b() -> None:
        try:
            a_queued.wait(5)
            time.sleep(0.1)  # A's wait is queued first
            wait_all([_Work()], timedelta(seconds=5))
            b_went_on.set()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            b_went_on.set()

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors, errors
    assert time.monotonic() - t0 < 2.0


def test_a_waiter_ends_after_its_calling_thread():
    """One waiter per calling thread: short-lived callers must not leave idle waiters behind."""

    from livemig.comm import group
    from livemig.comm.group import wait_all

    mine: list[threading.Thread] = []

    def caller() -> None:
        wait_all([_Work()], timedelta(seconds=5))
        mine.append(group._waiters.waiter)

    t = threading.Thread(target=caller)
    t.start()
    t.join(5)
    assert mine and mine[0].is_alive()
    mine[0].join(group._Waiter.IDLE_CHECK_S * 3)
    assert not mine[0].is_alive()


def test_an_abandoned_build_still_running_at_exit_leaves_with_the_right_code():
    """A gloo build given up on may still run in C++ at exit, where teardown made the process
    abort (SIGABRT) in CI. exit_past_abandoned_builds leaves with os._exit instead: 0 on a
    clean end, 1 after an uncaught exception, the script's own sys.exit status, output
    flushed either way, teardown skipped."""
    import subprocess
    import sys

    script = """
import atexit, sys, threading
from livemig.comm import group
atexit.register(lambda: sys.stdout.write("teardown"))  # skipped: the process leaves before teardown
t = threading.Thread(target=threading.Event().wait, daemon=True)
t.start()
group._ABANDONED_BUILDS.append(t)
group.exit_past_abandoned_builds()
sys.stdout.write("flushed")
if sys.argv[1] == "raise":
    raise RuntimeError("after the job")
if sys.argv[1] == "exit":
    sys.exit(3)
if sys.argv[1] == "message":
    sys.exit("bad input")
"""
    ok = subprocess.run([sys.executable, "-c", script, "clean"], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and ok.stdout == "flushed", ok.stderr
    bad = subprocess.run([sys.executable, "-c", script, "raise"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and bad.stdout == "flushed" and "after the job" in bad.stderr
    code = subprocess.run([sys.executable, "-c", script, "exit"], capture_output=True, text=True, timeout=60)
    assert code.returncode == 3 and code.stdout == "flushed", code.stderr
    msg = subprocess.run([sys.executable, "-c", script, "message"], capture_output=True, text=True, timeout=60)
    assert msg.returncode == 1 and "bad input" in msg.stderr, msg.stderr


def test_buckets_of_an_abandoned_collective_are_never_reused():
    """A survivor gives up on a step's collective while a hung peer is stopped inside it;
    the peer wakes up before the collective timeout and completes it, and gloo writes the
    sum into the survivor's buckets. Those buckets must not be a later step's: after
    abandon() the rotation allocates new ones (the old work keeps its own alive), so a
    late completion changes nothing the survivor still uses (the hang_fenced CI failure)."""
    import pytest

    from livemig.comm.group import CollectiveAborted

    store = dist.HashStore()
    models = [_model() for _ in range(2)]
    woke = threading.Event()
    peer_done = threading.Event()
    pgs: dict = {}

    def peer() -> None:  # rank 1: in the group, but "stopped" until `woke`
        pg = dist.ProcessGroupGloo(dist.PrefixStore("a", store), 1, 2, T)
        pgs[1] = pg
        red = GradReducer(list(models[1].parameters()), world=2)
        woke.wait(30)
        red.arm(pg)
        _backward(models[1], 1)
        red.finish(2, T, lambda: False)
        peer_done.set()

    t = threading.Thread(target=peer)
    t.start()
    try:
        pg = dist.ProcessGroupGloo(dist.PrefixStore("a", store), 0, 2, T)
        params = list(models[0].parameters())
        red = GradReducer(params, world=2)
        red.arm(pg)
        _backward(models[0], 0)  # the buckets' allreduces launch; the peer is not there
        abandoned = list(red._flats)
        with pytest.raises(CollectiveAborted, match="moved on"):
            red.finish(2, T, lambda: True)
        red.abandon()
        for _ in range(len(red._sets)):  # every set of the rotation, the abandoned one's turn included
            red.arm(None)
            assert all(f.data_ptr() != a.data_ptr() for f in red._flats for a in abandoned)
        before, mine = [f.clone() for f in red._flats], [a.clone() for a in abandoned]
        woke.set()  # the peer completes the old collective into the abandoned buckets
        assert peer_done.wait(30)
        assert any(not torch.equal(a, b) for a, b in zip(abandoned, mine, strict=True))  # the late write landed
        assert all(torch.equal(f, b) for f, b in zip(red._flats, before, strict=True))
    finally:
        woke.set()
        t.join(60)


def test_waits_on_real_gloo_poll_short_collectives_and_hand_lazy_ones_to_the_waiter():
    """group.wait_all on a real 2-rank gloo group (threads): an all-reduce is polled from the
    caller's thread (no waiter thread is started for it); send/recv, which gloo runs only
    inside wait() (pinned here: is_completed() stays False until then), complete through the
    waiter with poll=False at once, and polled by mistake after HANDOFF_S, never a hang; the
    abort check works while polling (a peer that never joins)."""
    import time

    import pytest

    from livemig.comm import group
    from livemig.comm.group import HANDOFF_S, CollectiveAborted, wait_all

    store = dist.HashStore()
    out: dict = {}
    go = threading.Barrier(2)

    def rank(r: int) -> None:
        pg = dist.ProcessGroupGloo(dist.PrefixStore("w", store), r, 2, T)
        t = torch.full((1024,), float(r + 1))
        if r == 1:
            time.sleep(0.05)  # rank 0 waits: not completed at its first look
        wait_all([pg.allreduce([t])], T)
        out[f"sum{r}"] = float(t[0])
        out[f"waiter{r}"] = getattr(group._waiters, "waiter", None)
        peer, buf = 1 - r, torch.zeros(4)
        go.wait()
        works = [pg.send([torch.full((4,), float(r))], peer, 1), pg.recv([buf], peer, 1)]
        time.sleep(0.2)
        out[f"lazy{r}"] = any(w.is_completed() for w in works)  # gloo: runs only in wait()
        t0 = time.monotonic()
        wait_all(works, T, poll=False)
        out[f"quick{r}"] = time.monotonic() - t0
        out[f"got{r}"] = float(buf[0])
        go.wait()
        t0 = time.monotonic()
        wait_all([pg.send([torch.ones(4)], peer, 2), pg.recv([buf], peer, 2)], T)  # polled by mistake
        out[f"mistaken{r}"] = time.monotonic() - t0
        go.wait()
        if r == 0:  # rank 1 never joins this one
            t0 = time.monotonic()
            with pytest.raises(CollectiveAborted, match="generation moved on"):
                wait_all([pg.allreduce([t])], T, should_abort=lambda: time.monotonic() - t0 > 0.1)
            out["aborted_after"] = time.monotonic() - t0

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert out.get("sum0") == out.get("sum1") == 3.0
    assert out["waiter0"] is None and out["waiter1"] is None  # polled: no hand-off
    assert out["lazy0"] is False and out["lazy1"] is False
    assert out["got0"] == 1.0 and out["got1"] == 0.0 and out["quick0"] < HANDOFF_S
    assert HANDOFF_S * 0.9 <= out["mistaken0"] < HANDOFF_S + 5
    assert 0.1 <= out["aborted_after"] < HANDOFF_S


def test_a_carrier_holding_two_endpoints_reduces_the_full_groups_bits():
    """A shrunk job's full-width group (comm/group.py build_endpoints): 4 ranks of which one
    caller holds ranks 0 and 3 (a carrier), the others one each. Each bucket's allreduce
    gives the bits of the same allreduce in a group of 4 separate ranks, and they differ from
    the survivors' sum (the carrier adding its two ranks first): why a shrunk step reduces
    this way. flatten_grads() of gradients held aside equals flatten() of the same in .grad."""
    from livemig.comm.group import build_endpoints, retire

    world = 4
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    addr = f"127.0.0.1:{master.port}"
    models = [_model() for _ in range(world)]
    reducers = [GradReducer(list(m.parameters()), world=world) for m in models]
    for r, m in enumerate(models):
        _backward(m, r)
    grads = [[p.grad.clone() for p in m.parameters()] for m in models]
    ins = [red.flatten(world) for red in reducers]
    assert all(torch.equal(a, b) for a, b in zip(reducers[3].flatten_grads(grads[3], world), ins[3], strict=True))

    def reduce_in(gen: int, holders: list[list[int]]) -> dict[int, list[torch.Tensor]]:
        got: dict[int, list[torch.Tensor]] = {}

        def member(ranks: list[int]) -> None:
            eps = build_endpoints(addr, gen, ranks, world, T)
            flats = {r: [f.clone() for f in ins[r]] for r in ranks}
            works = [eps[r].allreduce([f]) for r in ranks for f in flats[r]]
            for w in works:
                w.wait()
            got.update(flats)
            for ep in eps.values():
                retire(ep, idle=True)

        threads = [threading.Thread(target=member, args=(h,)) for h in holders]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        return got

    separate = reduce_in(1, [[0], [1], [2], [3]])
    carried = reduce_in(2, [[0, 3], [1], [2]])
    assert set(separate) == set(carried) == set(range(world))
    for r in range(world):
        assert all(torch.equal(a, b) for a, b in zip(separate[r], carried[r], strict=True)), f"rank {r}"
    # what a carrier summing its two ranks first gets: other bits (3 processes, one sum each)
    pre = [[f.clone() for f in ins[0]], [f.clone() for f in ins[1]], [f.clone() for f in ins[2]]]
    for a, b in zip(pre[0], ins[3], strict=True):
        a.add_(b)
    survivors = [sum(x) for x in zip(*pre, strict=True)]
    assert not all(torch.equal(a, b) for a, b in zip(survivors, separate[0], strict=True))
