"""Pure logic: fault plans, the report's downtime arithmetic, timeouts."""

from __future__ import annotations

import pathlib
from datetime import timedelta

import pytest

from livemig.agent.report import recoveries
from livemig.config import Timeouts
from livemig.errors import ConfigError
from livemig.faults import SelfFault, parse_fault, parse_plan, parse_self_fault


def test_two_in_process_faults_for_one_rank_are_refused():
    # the worker carries one (LIVEMIG_SELF_FAULT): the first used to be dropped without a word
    with pytest.raises(ConfigError, match="rank 1 already has the in-process fault 'kill:rank=1:step=4:during=gather'"):
        parse_plan(["kill:rank=1:step=4:during=gather", "drop_avg:rank=1:step=8"])
    assert len(parse_plan(["kill:rank=1:step=4:during=gather", "drop_avg:rank=2:step=8", "kill:rank=1:step=9"])) == 3


def test_parse_fault():
    f = parse_fault("kill:rank=1:step=10:during=allreduce")
    assert (f.kind, f.rank, f.step, f.during, f.in_process) == ("kill", 1, 10, "allreduce", True)
    assert parse_fault("hang:rank=0:step=3:resume=2.5").resume_after == 2.5
    stall = parse_fault("spare-hang:during=snapshot:ahead=5:resume=30")
    assert parse_self_fault(stall.self_spec()) == SelfFault("selfstall", 0, "snapshot", 30.0, 5)
    for bad in (
        "spare-hang:ahead=2",  # ahead= is a catch-up length: a migrating spare's stall only
        "spare-hang:during=snapshot:ahead=-1",
        "explode:rank=1:step=1",
        "kill:rank=x:step=1",
        "kill:step=1",
        "kill:rank=1:step=1:zz=1",
        "kill:rank=1:step=1:during=later",
        "kill:rank=1:step=1:resume=3",
    ):
        with pytest.raises(ConfigError, match="bad fault"):
            parse_fault(bad)


def test_every_grid_of_the_faults_bench_is_well_formed():
    """`livemig bench faults --grid G` runs for minutes before it reaches a case: a plan that
    does not parse, or a rank the case's world lacks, must fail here instead."""
    from livemig.bench.faults_bench import MATRIX, exact_grid, migration_grid, sequences_grid

    for grid in (MATRIX, exact_grid(), migration_grid(), sequences_grid(40)):
        assert len({c.name for c in grid}) == len(grid)
        for c in grid:
            parse_plan(list(c.faults))  # one in-process fault per rank
            for plan in c.faults:
                f = parse_fault(plan)
                assert f.rank is None or 0 <= f.rank < c.nproc, (c.name, plan)
            assert "--steps" in c.args and c.spares >= 0, c.name
            steps = int(c.args[c.args.index("--steps") + 1])
            assert all(parse_fault(p).step < steps for p in c.faults), c.name  # else refused before step 0


def test_downtime_and_phases():
    commits = [(s, 100.0 + s * 0.1) for s in range(10)] + [(s, 103.0 + s * 0.1) for s in range(10, 20)]
    ev = [
        {"phase": "fault", "time": 101.0, "generation": 1},
        {"phase": "detect", "time": 101.05, "generation": 2, "ranks": [1]},
        {"phase": "fence", "time": 101.06, "generation": 2},
        {"phase": "agree", "time": 101.07, "generation": 2},
        {"phase": "claim", "time": 101.08, "generation": 2},
        {"phase": "stream", "time": 101.1, "generation": 2, "bytes": 100, "seconds": 0.2},
        {"phase": "build", "time": 101.5, "generation": 2},
        {"phase": "commit", "time": 101.6, "generation": 2},
    ]
    (r,) = recoveries(ev, commits, 0.1)
    # last commit before the recovery: step 9 at 100.9; first after: step 10 at 104.0
    assert r["downtime_s"] == pytest.approx(104.0 - 100.9 - 0.1)
    assert r["phases"]["detect"] == pytest.approx(0.05)
    assert r["phases"]["stream"] == pytest.approx(0.2)
    assert r["phases"]["build"] == pytest.approx(0.42 - 0.2)
    assert r["phases"]["resume"] == pytest.approx(104.0 - 101.6)
    assert r["bytes_streamed"] == 100 and r["rank"] == 1
    # The survivors commit the step in flight after the fault (the killed rank had committed it):
    # that step was done, not lost, so the downtime starts at its commit.
    late = [(s, t) for s, t in commits if s != 9] + [(9, 101.02)]
    (r,) = recoveries(ev, sorted(late), 0.1)
    assert r["downtime_s"] == pytest.approx(104.0 - 101.02 - 0.1)
    # The same failure served by the cold path: its own phases, the same total, the steps redone
    cold = [*ev[:4], {"phase": "restart", "time": 101.075, "generation": 2, "step": 4, "redone": 5,
                      "path": "/ck/step_0000000004", "reason": "shard lost"}, *ev[4:]]  # fmt: skip
    (c,) = recoveries(cold, commits, 0.1)
    assert c["kind"] == "restart" and c["from_step"] == 4 and c["steps_redone"] == 5, c
    assert list(c["phases"]) == ["detect", "stop", "start", "load", "resume"], c
    raw = recoveries(ev, commits, 0.1)[0]["phases"]
    assert c["phases"]["stop"] == pytest.approx(raw["fence"] + raw["agree"])
    assert c["phases"]["load"] == pytest.approx(0.2)
    assert c["phases"]["start"] == pytest.approx(raw["claim"])  # a fresh process started for the lost rank
    assert sum(c["phases"].values()) == pytest.approx(sum(recoveries(ev, commits, 0.1)[0]["phases"].values()))
    assert c["lost_s"] == pytest.approx(c["downtime_s"] + 5 * 0.1)
    # A shrink: the wait for a spare (--spare-wait) ends at the shrink's decision, its own phase,
    # not folded into build
    shrink = [*ev[:4], {"phase": "shrink", "time": 106.07, "generation": 2, "carried": {"1": 0}},
              {"phase": "build", "time": 106.2, "generation": 2},
              {"phase": "commit", "time": 106.3, "generation": 2}]  # fmt: skip
    late_commits = [(s, 100.0 + s * 0.1) for s in range(10)] + [(s, 107.0 + s * 0.1) for s in range(10, 20)]
    (sh,) = recoveries(shrink, late_commits, 0.1)
    assert sh["kind"] == "shrink" and sh["phases"]["wait"] == pytest.approx(5.0), sh
    assert sh["phases"]["build"] == pytest.approx(0.13), sh
    # A pause hidden by a noisy step time (the gap no longer than the median step): never 0.0,
    # the coordinator's fence-to-commit time instead, and the report says why (issue 54)
    tight = [(s, 100.0 + s * 0.1) for s in range(20)]
    (n,) = recoveries(ev, tight, 0.5)
    assert n["downtime_s"] == pytest.approx(101.6 - 101.06) and "fence-to-commit" in n["downtime_note"], n
    assert "downtime_note" not in recoveries(ev, commits, 0.1)[0]


def test_timeouts_from_env(monkeypatch):
    monkeypatch.setenv("LIVEMIG_LEASE_TTL", "1.5")
    assert Timeouts.from_env().lease_ttl_s == 2
    monkeypatch.setenv("LIVEMIG_COLLECTIVE_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="LIVEMIG_COLLECTIVE_TIMEOUT"):
        Timeouts.from_env()


def test_a_pass_decodes_only_what_changed_and_under_matches_a_scan():
    """The coordinator's Snapshot reuses values decoded in earlier passes (by key and mod
    revision) and lists a folder from an index: same answers as decoding and scanning."""
    from unittest import mock

    from livemig.coordinator import snapshot as S
    from livemig.rdzv.client import KV, encode
    from livemig.rdzv.keys import JobKeys

    keys = JobKeys("j")
    rdzv = mock.Mock(keys=keys)

    def kvs(rev: int, step: int) -> dict:
        out = {}
        for r in range(50):
            k = keys.member(r)
            out[k] = KV(k, encode({"incarnation": f"i{r}", "host": "h", "pid": r, "addr": "a"}), 5, 5, 1, 0)
            k = keys.progress(r)
            out[k] = KV(k, encode({"step": step}), rev, 5, 1, 0)
            k = keys.ready(3, r)
            out[k] = KV(k, encode({"incarnation": f"i{r}"}), 5, 5, 1, 0)
        k = keys.prefix + "odd"  # a key of its own folder level
        out[k] = KV(k, encode({"x": 1}), 5, 5, 1, 0)
        return out

    cache = S.Decoded()
    calls = []
    real = S.safe_decode

    def counting(key, raw):
        calls.append(key)
        return real(key, raw)

    with mock.patch.object(S, "safe_decode", counting):
        a = S.Snapshot(kvs(10, 1), rdzv, cache)
        assert a.get(keys.progress(7))["step"] == 1 and a.get(keys.member(3))["pid"] == 3
        first = len(calls)
        b = S.Snapshot(kvs(11, 2), rdzv, cache)  # progress changed, registrations did not
        assert b.get(keys.progress(7))["step"] == 2 and b.get(keys.member(3))["pid"] == 3
        assert calls[first:] == [keys.progress(7)], calls[first:]
    for prefix in (keys.prefix, keys.recovery_prefix(3) + "ready/", keys.prefix + "members/", keys.prefix + "o",
                   keys.errors_prefix, keys.recovery_prefix(3)):  # fmt: skip
        scan = {k[len(prefix) :] for k in b.kv if k.startswith(prefix)}
        assert set(b.keys_under(prefix)) == {prefix + k for k in scan}, prefix
    assert len(b.under(keys.recovery_prefix(3) + "ready/")) == 50


def test_a_pass_kept_up_to_date_by_changed_keys_answers_as_one_made_anew():
    """The coordinator's passes update what they derived (the folder index, `under`, `dead`,
    `registered`, the flagged progress records) from each pass's changed keys alone: after
    any sequence of puts, re-puts, garbage and deletes, and of new tables (a member replaced, a
    rank gone, an older member object back, the same members in a new object: `dead` and the
    incarnation index are carried across tables by member identity), every answer equals a
    Snapshot made from the same keys with nothing kept; a pass whose changes are not known
    (None) starts over. The kept one reads lent dicts joined (snapshot.Joined), as passes do."""
    import random
    from unittest import mock

    from livemig.coordinator import snapshot as S
    from livemig.rdzv.client import KV, encode
    from livemig.rdzv.keys import JobKeys
    from livemig.rdzv.membership import Member

    keys = JobKeys("j")
    rdzv = mock.Mock(keys=keys)
    rnd = random.Random(7)
    n = 12
    members = {r: Member(r, f"i{r}", "h", r, "a") for r in range(n)}
    members[n - 1] = Member(n - 1, "sp", "h", 0, "", role="spare", spare_id="s0")  # claimed, not registered
    kvs: dict = {}
    rev = [0]

    def value() -> object:
        inc = rnd.choice(["sp", f"i{rnd.randrange(n)}"])
        return rnd.choice([{"incarnation": inc, "host": "h", "pid": 1, "addr": "a2", "committed": 3, "step": 4,
                            "time": 1.0},
                           {"step": 5, "incarnation": "i1", "waiting_step": 6, "group": 0, "time": 2.0},
                           {"step": 5, "incarnation": "i2", "busy": True, "time": 2.0},
                           {"step": 5, "unreachable": [1], "time": 2.0}, {"step": 5, "time": 2.0}, b"\xc1",
                           {"x": 1}])  # fmt: skip

    folders = [keys.members_prefix, keys.suspects_prefix, keys.fenced_prefix, keys.spares_prefix,
               keys.recovery_prefix(2) + "report/", keys.recovery_prefix(2) + "ready/",
               keys.progress_prefix]  # fmt: skip
    incs = [mem.incarnation for mem in members.values()]
    names = {keys.suspects_prefix: [*incs, "x/y"], keys.fenced_prefix: incs, keys.spares_prefix: ["s0", "s1"]}
    cache = S.Decoded()
    changes: set | None = None
    lent_control: dict = {}
    lent_progress: dict = {}
    gone: dict = {}
    for step in range(1200):
        for _ in range(rnd.randrange(0, 6)):
            folder = rnd.choice(folders)
            k = folder + rnd.choice(names.get(folder, [*map(str, range(n)), "x/y"]))
            rev[0] += 1
            if rnd.random() < 0.4:
                kvs.pop(k, None)
            else:  # a registration mostly as the table's member, so that a suspicion or fence decides
                v = value()
                name = k[len(keys.members_prefix) :]
                ours = name.isdigit() and int(name) < n - 1 and int(name) in members  # not the claimed spare
                if k.startswith(keys.members_prefix) and ours and rnd.random() < 0.8:
                    v = {"incarnation": members[int(name)].incarnation, "host": "h", "pid": 1, "addr": "a3"}
                elif k.startswith(keys.spares_prefix) and rnd.random() < 0.5:
                    v = {"incarnation": "sp", "state": "warm"}  # the claimed spare's own record
                kvs[k] = KV(k, v if isinstance(v, bytes) else encode(v), rev[0], 1, 1, 0)
            if changes is not None:
                changes.add(k)
        # the kept pass reads the mirrors' own dicts (lent, changed in place between passes, as
        # PrefixMirror(lend=True) does) joined, not merged; the new one a plain copy
        for k in {*lent_control, *lent_progress} - kvs.keys():
            lent_control.pop(k, None)
            lent_progress.pop(k, None)
        for k, kv in kvs.items():
            (lent_progress if k.startswith(keys.progress_prefix) else lent_control)[k] = kv
        kept = S.Snapshot(S.Joined(lent_control, lent_progress), rdzv, cache, changes)
        anew = S.Snapshot(dict(kvs), rdzv)
        for prefix in (*folders, keys.recoveries_prefix, keys.prefix):
            assert sorted(kept.keys_under(prefix)) == sorted(anew.keys_under(prefix)), (step, prefix)
            assert kept.under(prefix) == anew.under(prefix), (step, prefix)
        grace = step % 100 >= 80  # the outage grace, now and then (one memo: a pass asks with one value)
        assert kept.dead(members, grace) == anew.dead(members, grace), step
        assert kept.registered(members) == anew.registered(members), step
        assert kept.flagged_progress() == anew.flagged_progress(), step
        for folder in folders[4:6]:  # the reports and ready records a recovery counts
            assert kept.count_matching(folder, members) == anew.count_matching(folder, members), (step, folder)
        if step % 7 == 6:  # a new table (the others' member objects kept, as roster.Assembler does):
            r = rnd.randrange(n - 1)
            x = rnd.random()
            if x < 0.5:  # one member replaced by another process
                members = {**members, r: Member(r, f"i{r}-{step}", "h", r, "a")}
                incs.append(members[r].incarnation)
            elif x < 0.7 and r in members:  # a rank gone (a shrink)
                members = {q: m for q, m in members.items() if q != r}
            elif x < 0.85 and r in gone:  # an older member object back (an abort restores its table)
                members = {**members, r: gone[r]}
            else:  # the same members, a new table object
                members = dict(members)
            for q, m in members.items():
                gone.setdefault(q, m)
        changes = None if step % 37 == 36 else set()  # now and then a full read


def test_the_table_assembled_from_the_changed_rows_is_the_table_assembled_whole():
    """roster.Assembler (the coordinator's table at each head) re-reads only the rows stored
    anew and those holding a version that the new generation makes visible: after any sequence
    of row writes (a base and a staged version, a removed member, junk tagged ahead), deletes
    and generation steps, it returns what assembling every row gives, members in rank order,
    digest and errors included."""
    import random

    from livemig.errors import StaleGenerationError
    from livemig.rdzv import roster
    from livemig.rdzv.membership import Member

    rnd = random.Random(11)
    rows: dict[int, bytes] = {}
    a = roster.Assembler()
    g = 1
    for step in range(2000):
        for _ in range(rnd.randrange(0, 4)):
            r = rnd.randrange(16)
            if rnd.random() < 0.15:
                rows.pop(r, None)
            else:
                tags = sorted(rnd.sample(range(max(0, g - 2), g + 3), rnd.choice([1, 2])))
                member = [None if rnd.random() < 0.2 else Member(r, f"i{rnd.randrange(3)}", "h", r, "a") for _ in tags]
                rows[r] = roster.encode_versions(
                    [[t, m and roster.pack_row(m)] for t, m in zip(tags, member, strict=True)]
                )
            a.stored(r, rows.get(r))
        if rnd.random() < 0.3:
            g += rnd.choice([1, 1, 2])
        try:
            want = roster.assemble(g, sorted(rows.items()))
        except StaleGenerationError:
            try:
                a.assemble(g)
            except StaleGenerationError:
                continue
            raise AssertionError(f"step {step}: the whole assembly is stale, the kept one is not") from None
        got = a.assemble(g)
        assert got == want and list(got[0]) == list(want[0]), step
        if step % 300 == 299:
            a.reset()
            for r, raw in rows.items():
                a.stored(r, raw)


def test_the_rows_a_kept_writer_plans_are_those_a_new_one_plans():
    """roster.RowWriter keeps, across changes, each rank found in need of no write (member and
    stored versions, by identity) and skips it while both stay: after any sequence of tables
    (members kept as the same objects, replaced by equal or different ones, removed, added),
    older objects back, writes landed or lost, and tags that advance or repeat, it plans the writes and the head's
    count and digest a writer made anew over the same stored rows plans."""
    import random

    from livemig.rdzv import roster
    from livemig.rdzv.membership import Member

    rnd = random.Random(5)
    store: dict[int, list] = {}
    rev = [0]
    kept = roster.RowWriter(lambda: ({r: v for r, v in store.items()}, rev[0]), lambda _rev: 0)
    members: dict[int, Member] = {r: Member(r, f"i{r}", "h", r, "a") for r in range(12)}
    history: dict[int, list[Member]] = {}
    tag = 1
    for step in range(1500):
        members = dict(members)
        for _ in range(rnd.randrange(0, 4)):
            r = rnd.randrange(16)
            x = rnd.random()
            if x < 0.15:
                members.pop(r, None)
            elif x < 0.3 and history.get(r):  # an older object back (a migration's abort restores its table)
                members[r] = rnd.choice(history[r])
            elif x < 0.45 and r in members:  # an equal member, another object
                old = members[r]
                members[r] = Member(r, old.incarnation, old.host, old.pid, old.addr)
            else:
                members[r] = Member(r, f"i{rnd.randrange(4)}", "h", r, "a")
        for r, m in members.items():
            history.setdefault(r, []).append(m)
        tag += rnd.choice([0, 1, 1, 2])
        fresh = roster.RowWriter(lambda: ({r: v for r, v in store.items()}, rev[0]), lambda _rev: 0)
        want = fresh.plan(tag, members)
        got = kept.plan(tag, members)
        assert got == want, step
        if rnd.random() < 0.1:
            kept.forget()  # a write whose outcome is not known
        elif got[0]:
            store.update(got[0])
            rev[0] += 1
            kept.wrote(got[0], rev[0])


def test_dead_agrees_with_alive_member_by_member():
    """Snapshot.dead (the pass's fast loop) must call dead exactly the ranks alive() does:
    registered as itself, suspected, fenced, unregistered (with and without the outage
    grace), registered as another process, a claimed spare (registered as a spare or not),
    a garbage suspect record."""
    from unittest import mock

    from livemig.coordinator import snapshot as S
    from livemig.rdzv.client import KV, encode
    from livemig.rdzv.keys import JobKeys
    from livemig.rdzv.membership import Member

    keys = JobKeys("j")
    rdzv = mock.Mock(keys=keys)
    kv: dict = {}

    def put(k: str, v: object) -> None:
        kv[k] = KV(k, v if isinstance(v, bytes) else encode(v), 7, 7, 1, 0)

    members = {r: Member(r, f"i{r}", "h", r, "a") for r in range(8)}
    members[6] = Member(6, "sp6", "h", 6, "", role="spare", spare_id="s6")
    members[7] = Member(7, "sp7", "h", 7, "", role="spare", spare_id="s7")
    for r in (0, 1, 2, 3):
        put(keys.member(r), {"incarnation": f"i{r}", "host": "h", "pid": r, "addr": "a"})
    put(keys.suspect("i1"), {"time": 1.0})
    put(keys.fenced("i2"), {})
    put(keys.suspect("i3"), b"\xc1garbage")  # ignored like garbage: not a suspicion
    put(keys.member(5), {"incarnation": "someone-else", "host": "h", "pid": 9, "addr": "a"})
    put(keys.spare("s6"), {"incarnation": "sp6"})
    put(keys.spare("s7"), {"incarnation": "other"})
    snap = S.Snapshot(kv, rdzv)
    for grace in (False, True):
        want = [r for r, mem in members.items() if not snap.alive(r, mem, grace)]
        assert snap.dead(members, grace) == want, grace
    assert snap.dead(members, False) == [1, 2, 4, 5, 7]
    assert snap.dead(members, True) == [1, 2, 5]  # ranks 4 and 7 have no registration: grace


def test_store_addresses_read_from_etcd_are_validated():
    from livemig.comm.group import CollectiveAborted, store_for
    from livemig.config import is_host_port

    assert is_host_port("127.0.0.1:29500") and is_host_port("[::1]:5")
    assert not any(is_host_port(v) for v in ("host", "h:0", ":5", "h:99999", "h:x", 5, None))
    with pytest.raises(CollectiveAborted, match="not host:port"):
        store_for("no-port", 3, timedelta(seconds=1))


def test_progress_writes_keep_to_the_job_budget_and_the_newest_record_wins(monkeypatch):
    """A member commits every 2 ms; with a budget of 100 writes a second for a world of
    4 it writes at most one record per 40 ms, and the record it writes is the newest."""
    import threading
    import time
    import types

    import pytest

    from livemig.config import progress_budget
    from livemig.errors import ConfigError
    from livemig.runtime.progress import Progress

    monkeypatch.setenv("LIVEMIG_PROGRESS_BUDGET", "100")
    writes: list[tuple[float, int]] = []
    stop = threading.Event()

    def write(item: dict) -> None:
        if not stop.is_set():  # as a fenced member's: nothing more goes out
            writes.append((time.monotonic(), item["step"]))

    rt = Progress("inc", write, lambda: (0, 1, types.SimpleNamespace(world_size=4)))
    t0 = time.monotonic()
    step = 0
    while time.monotonic() - t0 < 1.0:
        rt._queue({"step": step})
        step += 1
        time.sleep(0.002)
    time.sleep(0.1)
    stop.set()  # the loop writes nothing more
    assert step > 100
    gaps = [b[0] - a[0] for a, b in zip(writes, writes[1:], strict=False)]
    assert 10 <= len(writes) <= 30 and min(gaps) >= 0.039, (len(writes), min(gaps))
    assert writes[-1][1] == step - 1  # the last commit reached etcd
    monkeypatch.setenv("LIVEMIG_PROGRESS_BUDGET", "0")
    with pytest.raises(ConfigError, match="LIVEMIG_PROGRESS_BUDGET='0' must be > 0"):
        progress_budget()


def test_a_failure_report_goes_out_at_once_outside_the_progress_budget(monkeypatch):
    """One write per 0.4 s (world 4, budget 10): a failed collective's report, queued right
    after a commit's write (and after a newer commit that waits its turn), is written at
    once (the coordinator starts a recovery on it)."""
    import threading
    import time
    import types

    from livemig.runtime.progress import Progress

    writes: list[tuple[float, dict]] = []
    wrote = threading.Event()
    stop = threading.Event()

    def write(item: dict) -> None:
        if not stop.is_set():
            writes.append((time.monotonic(), item))
            wrote.set()

    monkeypatch.setenv("LIVEMIG_PROGRESS_BUDGET", "10")
    rt = Progress("inc", write, lambda: (0, 1, types.SimpleNamespace(world_size=4)))
    try:
        rt._queue({"step": 1})
        assert wrote.wait(5)
        wrote.clear()
        rt._queue({"step": 2})  # waits for the budget
        time.sleep(0.05)
        rt._queue({"step": 2, "failed_step": 3, "error": "peer gone"})
        assert wrote.wait(5)
        assert writes[1][1]["failed_step"] == 3 and writes[1][0] - writes[0][0] < 0.3, writes
    finally:
        stop.set()


def test_a_sampled_member_sends_its_first_commit_in_a_group_at_once_and_every_steps_compute_time(monkeypatch):
    """At scale a member writes one record per world / budget seconds (here 1 s): its first
    commit in a new group still goes out at once (it measures the recovery), never as a
    field of the record, and the records written carry the compute time of every step since
    the last one written (the straggler hook judges windows of consecutive steps)."""
    import threading
    import time
    import types

    from livemig.runtime.progress import Progress

    monkeypatch.setenv("LIVEMIG_PROGRESS_BUDGET", "4")
    monkeypatch.setenv("LIVEMIG_STRAGGLER_FACTOR", "1.5")
    writes: list[tuple[float, dict]] = []
    wrote = threading.Event()
    stop = threading.Event()
    gen = [1]

    def write(item: dict) -> None:
        if not stop.is_set():
            writes.append((time.monotonic(), item))
            wrote.set()

    rt = Progress("inc", write, lambda: (0, gen[0], types.SimpleNamespace(world_size=4)))
    try:
        step = 0
        t0 = time.monotonic()
        while time.monotonic() - t0 < 2.6:  # ~3 writes at one a second
            rt.commit(step, compute_s=0.001 * step)
            step += 1
            time.sleep(0.01)
        assert 2 <= len(writes) <= 4, len(writes)
        seen = sorted({p[0] for _, item in writes for p in item["compute_recent"]})
        assert seen == list(range(seen[0], writes[-1][1]["step"] + 1)) and seen[0] == 0, seen  # no step missed
        assert all("_first" not in item for _, item in writes)
        wrote.clear()
        assert wrote.wait(3)  # the last commit of group 1 is written: the next may go out a second later
        wrote.clear()
        n = len(writes)
        gen[0] = 2  # a new group: its first commit is not held back by the budget
        at = time.monotonic()
        rt.commit(step, compute_s=0.001)
        assert wrote.wait(5)
        assert time.monotonic() - at < 0.5 and writes[n][1]["note"][0] == 2, writes[n:]
    finally:
        stop.set()


def test_link_attribution_rule():
    """Who a round of link reports (reporter -> peers it cannot reach) replaces."""
    from livemig.coordinator.checks import link_victims

    assert link_victims({}) == ([], 0)
    assert link_victims({0: [], 1: []}) == ([], 0)  # failures naming nobody: a rebuild, not a victim
    # a lost node holding ranks 2 and 3: both silent, both named by everyone: replaced together
    assert link_victims({0: [2, 3], 1: [2, 3]}) == ([2, 3], 2)
    # a cut between two reporters (each names the other): the higher rank goes
    assert link_victims({0: [1], 1: [0]}) == ([1], 1)
    # one silent rank named by most, another by fewer: only the first
    assert link_victims({0: [3], 1: [3], 2: [3, 1]}) == ([3], 3)
    # a silent rank and a reporter named equally often: the silent one (it did not report)
    assert link_victims({0: [2, 1], 1: [2], 3: [1]}) == ([2], 2)


def test_a_lost_nodes_ranks_are_held_back_together():
    """Leases of one node's ranks expire one after the other: every rank of the node waits
    for the last one's settle, then all go in one fence; other nodes are not held."""
    from livemig.coordinator.coordinator import held_by_node

    node = {2: 1, 3: 1, 0: 0}
    # rank 3's lease went first (t=0), rank 2's at t=1.4; settle 1.5 s
    assert held_by_node({3: 0.0}, {3: 1}, 1.0, 1.5) == {3}
    assert held_by_node({3: 0.0, 2: 1.4}, node, 1.6, 1.5) == {2, 3}  # rank 3's own settle is over
    assert held_by_node({3: 0.0, 2: 1.4}, node, 2.95, 1.5) == set()  # both fenced together
    # a rank whose agent reported it (not lease-only) on a held node waits with it
    assert held_by_node({3: 0.0}, {2: 1, 3: 1}, 1.0, 1.5) == {2, 3}
    # a spare of a standby host (no node) is never held
    assert held_by_node({5: 0.0}, {5: None}, 0.1, 1.5) == set()


def test_a_reference_is_shared_only_by_runs_with_the_same_settings(monkeypatch):
    """The shared fault-free cache (livemig/references.py): where files go does not
    split it; any LIVEMIG_* setting, argument, world size or other env entry does."""
    from livemig.references import References

    monkeypatch.delenv("LIVEMIG_BUDDY_STRIDE", raising=False)
    base = References.key(2, "examples/mlp.py", ["--steps", "4"], {"LIVEMIG_LOG_LEVEL": "INFO"})
    monkeypatch.setenv("LIVEMIG_STATE_DIR", "/somewhere/else")
    assert References.key(2, "examples/mlp.py", ["--steps", "4"], {"LIVEMIG_LOG_LEVEL": "INFO"}) == base
    assert References.key(2, "examples/mlp.py", ["--steps", "4"], {"LIVEMIG_LOG_LEVEL": "INFO",
                                                                  "LIVEMIG_STATE_DIR": "/x"}) == base  # fmt: skip
    others = [References.key(3, "examples/mlp.py", ["--steps", "4"], {"LIVEMIG_LOG_LEVEL": "INFO"}),
              References.key(2, "examples/mlp.py", ["--steps", "5"], {"LIVEMIG_LOG_LEVEL": "INFO"}),
              References.key(2, "examples/stateful.py", ["--steps", "4"], {"LIVEMIG_LOG_LEVEL": "INFO"}),
              References.key(2, "examples/mlp.py", ["--steps", "4"], {"LIVEMIG_LOG_LEVEL": "INFO", "X": "1"}),
              References.key(2, "examples/mlp.py", ["--steps", "4"], {"LIVEMIG_LOG_LEVEL": "DEBUG"})]  # fmt: skip
    monkeypatch.setenv("LIVEMIG_BUDDY_STRIDE", "2")  # set in the caller's environment, not its env=
    others.append(References.key(2, "examples/mlp.py", ["--steps", "4"], {"LIVEMIG_LOG_LEVEL": "INFO"}))
    assert len({base, *others}) == len(others) + 1


def test_the_straggler_hook_judges_windows_of_steps_all_ranks_have_once():
    """coordinator/checks.py: the ranks' records carry their last steps' compute times, so
    a pass that sees rank 0 at step 9 and rank 1 at step 7 still judges the windows ending
    at steps 6 and 7 (with both ranks' own times of those steps), each window once; a rank
    is slow by the median of its window, so one slow step of a healthy rank (descheduled
    on a loaded machine) flags nothing, and a straggler slow in most steps is flagged."""
    from livemig.coordinator.checks import compute_times, judge_windows

    r0 = compute_times({"step": 9, "compute_s": 0.01, "compute_recent": [[s, 0.01] for s in range(2, 10)]})
    r1 = compute_times({"step": 7, "compute_s": 0.05, "compute_recent": [[4, 0.05], [5, 0.01], [6, 0.05], [7, 0.05]]})
    got = judge_windows({0: r0, 1: r1}, 5, 0, 2.5, 3)
    assert [(s, r) for s, r, _, _ in got] == [(6, 0), (6, 1), (7, 0), (7, 1)]
    assert [med for _, r, _, med in got if r == 1] == [0.01, 0.01]  # 2 of 3 steps slow: its median is
    assert all(med is None for _, r, _, med in got if r == 0)
    assert judge_windows({0: r0, 1: r1}, 7, 0, 2.5, 3) == []  # nothing new in common
    assert judge_windows({0: r0, 1: r1}, 5, 6, 2.5, 3) == []  # no window starts before `first`
    assert judge_windows({0: r0}, -1, 0, 2.5, 3) == []  # one rank has no median to compare with
    # a healthy rank's one slow step among a straggler's fast ones (its SIGSTOP landed in its waits)
    hiccup = {0: {4: 0.01, 5: 0.2, 6: 0.01}, 1: {4: 0.01, 5: 0.01, 6: 0.08}}
    assert all(med is None for *_, med in judge_windows(hiccup, 0, 0, 2.5, 3))
    # three ranks: each compared with the median of the others' medians; a missing step skips its windows
    three = {0: {5: 0.01, 6: 0.01}, 1: {5: 0.012, 6: 0.011}, 2: {5: 0.04, 6: 0.05}}
    assert [(s, r) for s, r, _, med in judge_windows(three, 0, 0, 2.5, 2) if med] == [(6, 2)]
    del three[1][5]
    assert judge_windows(three, 0, 0, 2.5, 2) == []
    # anyone with etcd access may write a progress record: what is not a [step, seconds] pair is skipped
    assert compute_times({"step": "x", "compute_recent": [["a", 1], [3], "z", [4, "q"]]}) == {4: 0.0}


def test_every_metric_is_documented_and_a_generation_is_measured_once_every_member_noted_it():
    """docs/operations.md lists each family the endpoint serves; a generation's downtime is
    measured only once every member committed in its group, and hostile notes are skipped."""
    import os

    from livemig.agent.metrics import METRICS, bucketed
    from livemig.coordinator.timeline import measured, measurements

    doc = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "operations.md")).read()
    for name, (kind, _, _) in METRICS.items():
        assert f"`{name}{'_total' if kind == 'counter' else ''}`" in doc, name
    notes = {0: [[2, [20, 100.0], [21, 100.4], 0.1]], 1: [[2, None, [21, 100.5], None]]}
    assert measured(notes, 2) == {2: {"before": (20, 100.0), "after": (21, 100.5), "step_s": 0.1}}
    assert measured({0: notes[0]}, 2) == {}  # rank 1 has not committed in generation 2 yet
    # a survivor finished the step in flight inside the new group: that step is the one before
    late = {0: [[2, [19, 99.9], [20, 100.2], 0.2]], 1: [[2, None, [21, 100.5]]]}
    assert measured(late, 2) == {2: {"before": (20, 100.2), "after": (21, 100.5), "step_s": 0.2}}
    hostile = {0: "x", 1: [[2, "a", ["b", 1]]], 2: [[None, None, None]]}
    assert measured(hostile, 3) == {}  # type: ignore[arg-type]
    ev = [{"phase": "measured", "generation": 2, "time": 1.0, "before": [20, 100.0], "after": [21, 100.5],
           "step_s": 0.1}, {"phase": "measured", "generation": 3, "time": 1.0, "after": "x"}]  # fmt: skip
    assert measurements(ev) == {2: {"before": (20, 100.0), "after": (21, 100.5), "step_s": 0.1}}
    buckets, total = bucketed([0.2, 3.0])
    assert dict(buckets)["0.25"] == 1.0 and dict(buckets)["+Inf"] == 2.0 and total == 3.2


def test_checkpoint_settings_round_trip_and_what_a_run_record_may_carry(tmp_path):
    """Settings go to the children as environment and come back equal; a run record's
    settings (for `livemig-spare start` on another host) pass only under their own names and
    only when valid; every/interval are one or the other."""
    from livemig.checkpoint_dir import ENV_DIR, Settings, run_checkpoint_env

    for s in (Settings(str(tmp_path), 5, 3), Settings(str(tmp_path), 0, 2, 30.0, probe=4)):
        assert Settings.from_env(s.to_env()) == s
        rec = {"checkpoint": {**s.to_env(), "PATH": "/evil", "LD_PRELOAD": "x"}}
        assert run_checkpoint_env(rec) == s.to_env()
    assert run_checkpoint_env({}) == {} and run_checkpoint_env({"checkpoint": "x"}) == {}
    assert run_checkpoint_env({"checkpoint": {ENV_DIR: str(tmp_path)}}) == {}  # neither every nor interval
    assert Settings(str(tmp_path), 5).due(4) and not Settings(str(tmp_path), 5).due(5)
    assert Settings(str(tmp_path), 0, interval=1.0, probe=4).probes(3)
    for bad in ({"every": 5, "interval": 1.0}, {"every": 0}, {"every": 5, "keep": 0}):
        with pytest.raises(ConfigError):
            Settings(str(tmp_path), **bad)


def test_a_checkpoint_of_another_format_is_refused_a_damaged_one_skipped(tmp_path, caplog):
    """choose(): an incomplete or corrupt checkpoint is skipped with a line naming it, for the
    previous one; one of another format version stops the choice with one line."""
    import json

    from livemig.checkpoint_dir import FORMAT, FormatError, choose, mark_done, publish_if_complete

    for step in (4, 9):
        part = tmp_path / f"step_{step:010d}" / "rank_00000"
        part.mkdir(parents=True)
        (part / "data").write_bytes(b"x" * 100)
        mark_done(str(tmp_path), step, 0, {"world": 1})
        assert publish_if_complete(str(tmp_path), step, 1, {"signature": "s"}, keep=5)
    (tmp_path / "step_0000000014").mkdir()  # a write cut short: no manifest
    (tmp_path / "step_0000000009" / "rank_00000" / "data").write_bytes(b"y" * 100)  # same size, other bytes
    assert choose(str(tmp_path))[0] == 4
    assert "step_0000000009" in caplog.text and "corrupt" in caplog.text
    man = tmp_path / "step_0000000004" / "manifest.json"
    man.write_text(json.dumps({**json.loads(man.read_text()), "format": FORMAT + 1}))
    with pytest.raises(FormatError, match=f"has format {FORMAT + 1}, this livemig reads {FORMAT}"):
        choose(str(tmp_path))


def test_the_progress_rate_comes_from_the_commit_times_not_from_when_they_were_seen():
    """Progress records reach the agent in bursts: two lines printed 2 ms apart once read
    801 steps/s for 6 ms steps. The rate is the slowest rank's steps over its commit times."""
    from types import SimpleNamespace

    from livemig.agent.child_watch import ChildWatch
    from livemig.rdzv.client import encode
    from livemig.rdzv.keys import JobKeys

    said: list[str] = []
    keys = JobKeys("j")
    agent = SimpleNamespace(keys=keys, cfg=SimpleNamespace(log_every=10), say=said.append)
    w = ChildWatch(agent)  # type: ignore[arg-type]
    rev = iter(range(1, 100))

    def seen(step: int, t: float) -> None:  # both ranks at `step`, committed at wall time t
        w.progress({keys.progress(r): SimpleNamespace(value=encode({"step": step, "time": t + r * 0.001}),
                                                      mod_revision=next(rev)) for r in (0, 1)})  # fmt: skip

    seen(9, 1000.0)
    seen(19, 1000.06)  # ten 6 ms steps, whenever the agent happens to read them
    assert said[0].startswith("step     10") and "steps/s" not in said[0], said
    assert "166.67 steps/s" in said[1], said  # 10 steps / 0.06 s


def test_stale_run_directories_of_dead_processes_are_removed_and_nothing_else(tmp_path):
    """A launcher killed by SIGKILL leaves its embedded etcd's data dir (livemig-etcd-XXXXXXXX-PID)
    in the shared temp dir: the next run removes it, never a live process's, never one not ours."""
    import os
    import subprocess

    from livemig.agent.jobs import prune_stale_dirs

    dead = subprocess.Popen(["true"])
    dead.wait()
    names = {f"livemig-etcd-abcd1234-{dead.pid}": False, f"livemig-etcd-abcd1234-{os.getpid()}": True,
             f"livemig-etcd-e0-{dead.pid}": True, f"other-app-{dead.pid}": True}  # fmt: skip
    for n in names:
        (tmp_path / n).mkdir()
    prune_stale_dirs(str(tmp_path), r"livemig-etcd-[a-z0-9_]{8}-\d+")
    assert {n: (tmp_path / n).exists() for n in names} == names


def test_sigterm_drains_under_an_orchestrator_and_a_second_one_stops():
    """--on-sigterm's default follows the environment (Slurm, Kubernetes: drain; a shell: stop),
    and only the first SIGTERM starts a drain: the second one stops the job as before."""
    from livemig.agent.drain import Drain, sigterm_default

    assert sigterm_default({"SLURM_JOB_ID": "42"}) == "drain"
    assert sigterm_default({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}) == "drain"
    assert sigterm_default({}) == "stop"
    d = Drain(None, 25.0)  # type: ignore[arg-type]
    assert not d.active and d.request() and d.active
    assert not d.request()  # the second SIGTERM: stop now


def test_a_fault_held_at_its_gate_counts_from_the_fault_and_a_follower_path_is_reported():
    """With --follow a fault plan holds the rank at its step's gate until the followers hold the
    step (agent/fault_driver.py): the group is idle then, which is no downtime of the failure."""
    commits = [(s, 100.0 + s * 0.1) for s in range(10)] + [(s, 103.0 + s * 0.1) for s in range(10, 20)]
    ev = [
        {"phase": "fault", "time": 102.0, "generation": 1},  # held 1.1 s after the commit of step 9
        {"phase": "detect", "time": 102.05, "generation": 2, "ranks": [1]},
        {"phase": "fence", "time": 102.06, "generation": 2},
        {"phase": "agree", "time": 102.07, "generation": 2},
        {"phase": "claim", "time": 102.08, "generation": 2, "spares": ["spare-0"]},
        {"phase": "stream", "time": 102.1, "generation": 2, "bytes": 300, "seconds": 0.01, "follower": True},
        {"phase": "build", "time": 102.2, "generation": 2},
        {"phase": "commit", "time": 102.3, "generation": 2},
    ]
    (r,) = recoveries(ev, commits, 0.1)
    assert r["downtime_s"] == pytest.approx(104.0 - 102.0 - 0.1), r
    assert r["path"] == "follower" and r["bytes_streamed"] == 300, r
    ev[5] = {**ev[5], "follower": False}
    assert recoveries(ev, commits, 0.1)[0]["path"] == "stream"


def test_followers_spread_over_the_ranks_and_are_bounded_by_the_spares():
    from livemig.agent.run_config import RunConfig
    from livemig.errors import ConfigError
    from livemig.runtime.follow import feeder_rank

    mlp = str(pathlib.Path(__file__).resolve().parents[2] / "examples" / "mlp.py")
    assert feeder_rank("spare-0", []) is None
    assert feeder_rank("spare-0", [2, 0, 1]) == feeder_rank("spare-0", [0, 1, 2])  # order-free, stable
    picks = {feeder_rank(f"spare-{i}", [0, 1, 2, 3]) for i in range(16)}
    assert len(picks) >= 3, picks  # several followers load several feeders
    with pytest.raises(ConfigError, match="--follow 2"):
        RunConfig(script=mlp, args=[], nproc=2, spares=1, follow=2)
    assert RunConfig(script=mlp, args=[], nproc=2, spares=1, follow=1).follow == 1


def test_a_follow_spares_status_reads_in_a_few_words():
    from livemig.cli.status import follow_text

    assert follow_text(None) == "-"
    assert follow_text({"state": "following", "step": 41}) == "following @ step 41"
    assert follow_text({"state": "warm", "reason": "more than 4 steps behind the job at step 9"}) == (
        "warm (more than 4 steps behind the job at step 9)"
    )


def test_the_spare_wait_ends_before_the_members_recovery_wait():
    """A spare wait not below the recovery timeout would let the members give up first: the job
    then failed 'waited Ns for the coordinator …' with 'no surviving member holds the training
    state', not with the spare it lacked. The coordinator waits at most 0.8 x the recovery
    timeout."""
    t = Timeouts(recovery=timedelta(seconds=25), spare_wait=timedelta(seconds=60))
    assert t.spare_wait_s == 20.0
    assert Timeouts().spare_wait_s == 60.0  # the defaults (120 s, 60 s) are kept as they are
    assert Timeouts(recovery=timedelta(seconds=60)).spare_wait_s == 48.0


def test_a_fault_during_migrated_lands_once_the_migration_has_its_outcome():
    """`during=migrated` is a condition, not a step: it waits while a migration is queued or
    in flight (MIGRATING), and holds once its outcome is written, whatever step that was."""
    from livemig.agent.fault_driver import migration_settled, phase_reached
    from livemig.rdzv.client import KV, encode
    from livemig.rdzv.keys import JobKeys
    from livemig.rdzv.membership import GenState, Membership

    keys = JobKeys("j")
    f = parse_fault("kill:rank=0:step=13:during=migrated")
    assert f.phase == "migrated" and not f.in_process

    def kvs(state: GenState, request: bool, result: bool) -> dict:
        out = {keys.membership: KV(keys.membership, Membership(state=state, world_size=2).to_bytes(), 1, 1, 1, 0)}
        if request:
            out[keys.migrate_request] = KV(keys.migrate_request, encode({"id": "a", "rank": 1}), 2, 2, 1, 0)
        if result:
            out[keys.migrate_result] = KV(keys.migrate_result, encode({"id": "a", "state": "done"}), 3, 3, 1, 0)
        return out

    assert not migration_settled(keys, kvs(GenState.COMMITTED, True, False))  # queued
    assert not migration_settled(keys, kvs(GenState.MIGRATING, False, False))  # in flight
    assert not migration_settled(keys, kvs(GenState.MIGRATING, False, True))  # an older outcome, one in flight
    assert not migration_settled(keys, kvs(GenState.COMMITTED, True, True))  # an older outcome, one queued
    assert not migration_settled(keys, kvs(GenState.COMMITTED, False, False))  # none asked yet
    assert migration_settled(keys, kvs(GenState.COMMITTED, False, True))
    assert migration_settled(keys, kvs(GenState.RECOVERING, False, True))  # ended by a failure
    assert phase_reached(keys, f, kvs(GenState.COMMITTED, False, True), since=1e12)  # not a matter of time


def test_a_migration_a_failure_ended_is_reported_done_or_aborted_not_incomplete():
    """The coordinator's failure-during-migration path writes an 'ended' event with the
    outcome it wrote to migrate_result; the report took only 'commit' or 'abort' before and
    called such a migration 'incomplete'."""
    from livemig.agent.report import migrations

    def ev(phase: str, t: float, **kw: object) -> dict:
        return {"phase": phase, "generation": 5, "time": t, **kw}

    base = [ev("request", 1.0, rank=1), ev("claim", 1.1, spares=["s"]), ev("stream", 1.5, bytes=10)]
    aborted = migrations([*base, ev("ended", 2.0, state="aborted", reason="a failure during the migration")], [],
                         0.1)  # fmt: skip
    assert aborted[0]["outcome"] == "aborted" and "failure" in aborted[0]["aborted"]
    moved = migrations([*base, ev("ended", 2.0, state="done", reason="a failure during the migration")], [], 0.1)
    assert moved[0]["outcome"] == "done"
    assert migrations(base, [], 0.1)[0]["outcome"] == "incomplete"
