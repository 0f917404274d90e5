"""`livemig bench downtime` and `livemig bench overhead`.

One invocation runs every approach on the same workload, interleaved
(A B C D A B C D ...) so machine noise hits all alike:

- fault_free: `livemig run` without faults;
- plain_ddp: the same loop in plain DDP under torchrun (examples/ddp_baseline.py);
- livemig: SIGKILL of rank 1 after the failure step, warm spare;
- restart: torchrun --max-restarts with the c10d rendezvous, the DDP script
  checkpointing every K steps and resuming from the latest; same SIGKILL;
- cold: livemig with live recovery off (--recovery cold), background checkpoints every
  K steps: the same SIGKILL restarts from the newest, the survivors in place;
- shrink: no spare, --min-nproc N-1: the survivors carry rank 1 (runtime/virtual.py);
- torchft_style: the same shrink with torchft's semantics (LIVEMIG_SHRINK_DROP=1): rank 1's
  batches are dropped and the average is over the survivors, so the global batch shrinks and
  the run is not the configured one (torchft itself is not installed here: the row measures
  its semantics on livemig's mechanism, so the two differ only in what they train on).

Lost time = wall minus the fault-free twin's wall (fault_free for livemig,
plain_ddp for restart). Downtime = first step committed after the recovery that
was not committed before it, minus the last commit before it, minus one
median step (the run report's definition; restart's rows are per rank, so
its last commit before the kill is the killed rank's own).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Any

from livemig.agent.launcher import run
from livemig.agent.run_config import RunConfig
from livemig.config import ENV_SHRINK_DROP
from livemig.faults import parse_fault
from livemig.rdzv.embedded import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MLP = os.path.join(ROOT, "examples", "mlp.py")
MLP_ZERO1 = os.path.join(ROOT, "examples", "mlp_zero1.py")
DDP = os.path.join(ROOT, "examples", "ddp_baseline.py")


def run_livemig(a: argparse.Namespace, fault: bool | str, workload: list[str],
                env: dict | None = None, metrics: bool = False, checkpoint: Any = None,
                recovery: str = "live", script: str | None = None, shrink: bool = False,
                follow: int = 0) -> dict[str, Any]:  # fmt: skip
    """fault: True = SIGKILL rank 1 after --fail-at; "migrate" = planned migration of rank 1 there.
    metrics: serve --metrics-port and scrape it once a second (15x Prometheus' usual rate)."""
    zero1 = getattr(a, "sharding", "none") == "zero1"
    old = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})  # the launcher passes its environment on to the workers
    cfg = RunConfig(
        script=script or (MLP_ZERO1 if zero1 else MLP), args=workload,
        nproc=a.workers, spares=0 if shrink else a.spares, follow=follow,  # an idle spare in fault_free too
        min_nproc=a.workers - 1 if shrink else None, shrink_wait=0.0 if shrink else None,  # no spare: carried
        job=f"bench-{uuid.uuid4().hex[:6]}", quiet=True, max_wall=a.run_timeout,
        faults=[parse_fault(f"{'migrate' if fault == 'migrate' else 'kill'}:rank=1:step={a.fail_at}")] if fault else [],
        checkpoint=checkpoint, recovery=recovery,
    )  # fmt: skip
    stop = threading.Event()
    if metrics:
        from livemig.rdzv.embedded import free_port

        cfg.metrics_port = free_port()
        threading.Thread(target=_scrape_every, args=(cfg.metrics_port, 1.0, stop), daemon=True).start()
    t0 = time.monotonic()
    try:
        rep = run(cfg)
    finally:
        stop.set()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    wall = time.monotonic() - t0
    rec = rep["recoveries"][0] if rep["recoveries"] else {}
    if fault == "migrate":
        mig = rep["migrations"][0] if rep["migrations"] else {}
        rec = {"downtime_s": mig.get("pause_s"), "phases": mig.get("phases", {})}
    window = rep.get("commit_window") or [0.0, 0.0]
    return {
        "wall_s": wall, "steps": rep["steps_completed"], "digest": rep["state_digest"],
        "amortised_step_s": (window[1] - window[0]) / max(1, rep["steps_completed"] - 1),
        "commit_times": rep.get("commit_times", []), "checkpoints": rep.get("checkpoints"),
        "median_step_s": rep["step_time_s_median"], "downtime_s": rec.get("downtime_s"),
        "phases": rec.get("phases", {}), "ok": (rep["result"] or {}).get("state") == "done",
        "kind": rec.get("kind"), "steps_redone": rec.get("steps_redone"),
        "bytes_streamed": rec.get("bytes_streamed"), "path": rec.get("path"),
        "fsdp2": rep.get("fsdp2"), "shrunk": rep.get("shrunk"),
        "peak_rss_mb": max((x.get("peak_rss_mb", 0.0) for x in rep.get("members", {}).values()), default=0.0),
        "rss_by_rank": {r: x.get("peak_rss_mb") for r, x in sorted(rep.get("members", {}).items())},
        "follow_lag_ms": [x["follow"]["lag_ms"] for x in rep.get("members", {}).values()
                          if (x.get("follow") or {}).get("lag_ms", {}).get("n")],  # each follower's (runtime/follow.py)
    }  # fmt: skip


def commit_times(out: str) -> list[tuple[int, float, int, int]]:
    """Every commit the baseline's ranks logged: (step, wall time, rank, pid)."""
    rows = []
    for path in glob.glob(os.path.join(out, "progress-*")):
        rank = int(path.rsplit("-", 1)[1])
        with open(path) as f:
            for line in f:
                d = json.loads(line)
                rows.append((d["step"], d["time"], rank, d["pid"]))
    return rows


def kill_tree(p: subprocess.Popen) -> None:
    """SIGKILL a baseline and everything it started: torchrun starts its workers in sessions of
    their own, so a kill of its process group alone left them training (a bench stopped early)."""
    import psutil

    try:
        tree = [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    for proc in tree:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    p.wait()


def run_ddp(a: argparse.Namespace, fault: bool, workload: list[str], ckpt_every: int = 0,
            script: str | None = None) -> dict[str, Any]:  # fmt: skip
    """ckpt_every: torch.save every N steps on rank 0 without a fault (bench checkpoint).
    script: another torchrun baseline with the same flags (examples/fsdp2_baseline.py)."""
    out = tempfile.mkdtemp(prefix="livemig-ddp-")
    args = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(a.workers),
            "--max-restarts", "3" if fault else "0", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{free_port()}", script or DDP, *workload, "--out-dir", out]  # fmt: skip
    if script is None and getattr(a, "sharding", "none") == "zero1":
        args.append("--zero1")
    if fault or ckpt_every:
        args += ["--ckpt-dir", out, "--ckpt-every", str(ckpt_every or a.ckpt_every)]
    t0 = time.monotonic()
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    kill_t = None
    deadline = time.monotonic() + a.run_timeout
    try:
        while p.poll() is None and time.monotonic() < deadline:
            if fault and kill_t is None:
                rows = [r for r in commit_times(out) if r[2] == 1 and r[0] >= a.fail_at]
                if rows:
                    kill_t = time.time()
                    try:
                        os.kill(rows[0][3], signal.SIGKILL)
                    except ProcessLookupError:  # it finished first: no fault landed
                        kill_t = None
                        break
            time.sleep(0.01)
    finally:
        if p.poll() is None:
            kill_tree(p)
    wall = time.monotonic() - t0
    rows = commit_times(out)
    by_step: dict[int, list[float]] = {}
    for step, t, _, _ in rows:
        by_step.setdefault(step, []).append(t)
    # ok = every step committed and the final state written; torchrun's own exit code
    # (teardown races of the agent store) is kept for reference, not judged.
    res: dict[str, Any] = {"wall_s": wall, "torchrun_rc": p.returncode}
    try:
        final = _final(out)
        res["digest"], res["steps"] = final["digest"], final["steps"]
    except (OSError, KeyError, ValueError):
        res["digest"], res["steps"] = "", 0
    res["ok"] = res["steps"] == a.steps
    res["commit_times"] = [[st, min(v)] for st, v in sorted(by_step.items())]  # each step's first commit
    first_commit = sorted(t for _, t in res["commit_times"])
    gaps = [b - a for a, b in zip(first_commit, first_commit[1:], strict=False)]
    res["median_step_s"] = statistics.median(gaps) if gaps else 0.0
    res["amortised_step_s"] = (first_commit[-1] - first_commit[0]) / (len(first_commit) - 1) if gaps else 0.0
    if fault and kill_t is not None:
        # Progress before the restart is whatever the first processes committed, also just after
        # the kill: a survivor can finish the step the killed rank had already contributed to,
        # and counting that commit as the restart's would read a downtime of zero (a loaded CI
        # run did). The restart's progress is a step past that, committed by a new process.
        first = {rank: min((t, pid) for _, t, r, pid in rows if r == rank) for _, _, rank, _ in rows}
        old_pids = {pid for _, pid in first.values()}  # each rank's process in the first attempt
        before = [t for _, t, _, pid in rows if pid in old_pids]
        done_before = max((s for s, _, _, pid in rows if pid in old_pids), default=-1)
        after_any = [t for _, t, _, pid in rows if t > kill_t and pid not in old_pids]  # restarted processes
        after_new = [t for s, t, _, pid in rows if pid not in old_pids and s > done_before]
        last_before = max(before) if before else kill_t
        if after_new:
            res["downtime_s"] = max(0.0, min(after_new) - last_before - res["median_step_s"])
            restart = (min(after_any) - kill_t) if after_any else 0.0
            res["phases"] = {"detect+restart": restart, "redo": max(0.0, min(after_new) - kill_t - restart)}
            res["steps_redone"] = len({s for s, _, _, pid in rows if pid not in old_pids and s <= done_before})
    return res


def _final(out: str) -> dict[str, Any]:
    """The baseline's final record: rank 0's (the whole replicated state), or one per rank
    (sharded state: each rank's local shards), combined in rank order."""
    one = os.path.join(out, "final.json")
    if os.path.exists(one):
        with open(one) as f:
            return json.load(f)
    parts = sorted(glob.glob(os.path.join(out, "final-*.json")), key=lambda p: int(p.rsplit("-", 1)[1][:-5]))
    if not parts:
        raise OSError(f"no final record in {out}")
    finals = []
    for p in parts:
        with open(p) as f:
            finals.append(json.load(f))
    h = hashlib.sha256("".join(x["digest"] for x in finals).encode())
    return {"digest": h.hexdigest(), "steps": min(x["steps"] for x in finals)}


def _fmt(xs: list[float]) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


def add_workload_arguments(p: argparse.ArgumentParser, steps: int) -> None:
    """The reference workload and the rounds, as every side-by-side bench takes them."""
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=64, help="samples per rank and step (default 64)")
    p.add_argument("--run-timeout", type=float, default=300.0, help="abandon one run after this long, s")


def workload_args(a: argparse.Namespace) -> list[str]:
    """The example script's arguments for that workload."""
    return ["--steps", str(a.steps), "--width", str(a.width), "--layers", str(a.layers), "--batch", str(a.batch)]


def add_sharding_argument(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--sharding", choices=("none", "zero1", "fsdp2"), default="none",
                   help=f"zero1: {what}; fsdp2: examples/fsdp2_lm.py under HSDP against torch FSDP2 "
                   "(bench/fsdp2_bench.py)")  # fmt: skip


def add_downtime_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_arguments(p, steps=40)
    p.add_argument("--spares", type=int, default=1)
    p.add_argument("--fail-at", type=int, default=25, help="kill rank 1 after this step (default 25)")
    p.add_argument("--ckpt-every", type=int, default=10, help="restart's checkpoint interval (default 10)")
    add_sharding_argument(p, "examples/mlp_zero1.py; DDP rows use torch's ZeroRedundancyOptimizer")
    p.add_argument("--json", help="write every figure and raw sample here")
    p.add_argument("--plot", help="write a PNG of the phase breakdown (needs matplotlib)")
    p.add_argument(
        "--follow",
        action="store_true",
        help="follow spares against plain warm spares, side by side, over --widths (bench/follow_bench.py)",
    )
    p.add_argument(
        "--widths", default="", help="with --follow: model widths to sweep, e.g. 1024,2048 (default --width)"
    )
    p.add_argument("--spare-mesh-ab", action="store_true",
                   help="with --sharding fsdp2: the kill and the migration also with LIVEMIG_SPARE_MESH=0 (the "
                   "spare warmed on a mesh of one), side by side, and their ratios")  # fmt: skip


def run_downtime(a: argparse.Namespace) -> int:
    if a.workers < 2 or not 0 <= a.fail_at < a.steps - 1:
        raise SystemExit("livemig bench downtime: need --workers >= 2 and 0 <= --fail-at < --steps - 1")
    workload = workload_args(a)
    approaches = {
        "fault_free": lambda: run_livemig(a, False, workload),
        "plain_ddp": lambda: run_ddp(a, False, workload),
        "livemig": lambda: run_livemig(a, True, workload),
        "restart": lambda: run_ddp(a, True, workload),
    }
    if a.sharding != "zero1":  # planned migration of rank 1 at --fail-at: its pause is the downtime column
        approaches["migration"] = lambda: run_livemig(a, "migrate", workload)
    # no spare: the survivors carry rank 1 (--min-nproc N-1, --shrink-wait 0); with ZeRO-1 its shard too
    approaches["shrink"] = lambda: run_livemig(a, True, workload, shrink=True)
    approaches["torchft_style"] = lambda: run_livemig(a, True, workload, {ENV_SHRINK_DROP: "1"}, shrink=True)
    if a.fail_at >= a.ckpt_every:  # a checkpoint exists before the kill: the cold path has one to restart from
        approaches["cold"] = lambda: _cold_row(a, workload)
    else:
        print(f"cold row skipped: --fail-at {a.fail_at} comes before the first checkpoint (--ckpt-every "
              f"{a.ckpt_every}), so the job would fail, as it should")  # fmt: skip
    samples: dict[str, list[dict]] = {k: [] for k in approaches}
    for r in range(a.repeat):
        for name, fn in approaches.items():
            print(f"  round {r + 1}/{a.repeat}: {name} ...", flush=True)
            samples[name].append(fn())
    for i in range(a.repeat):
        lm, ff = samples["livemig"][i], samples["fault_free"][i]
        lm["lost_s"] = lm["wall_s"] - ff["wall_s"]
        lm["bit_identical"] = lm["digest"] == ff["digest"]
        rs, dd = samples["restart"][i], samples["plain_ddp"][i]
        rs["lost_s"] = rs["wall_s"] - dd["wall_s"]
        rs["bit_identical"] = rs["digest"] == dd["digest"]
        for name in ("migration", "cold", "shrink", "torchft_style"):
            if name in samples:
                row = samples[name][i]
                row["lost_s"] = row["wall_s"] - ff["wall_s"]
                row["bit_identical"] = row["digest"] == ff["digest"]
    script = "mlp_zero1" if a.sharding == "zero1" else "mlp"
    print(f"\nworkload: examples/{script}.py, {a.workers} workers, {a.steps} steps, rank 1 SIGKILLed after step "
          f"{a.fail_at}; restart checkpoints every {a.ckpt_every}; {a.repeat} interleaved rounds; "
          "median (min-max)")  # fmt: skip
    summary = summarise(samples)
    lost_ratio = None
    if summary["restart"]["lost_s"] and summary["livemig"]["lost_s"] is not None:
        lost_ratio = summary["livemig"]["lost_s"] / summary["restart"]["lost_s"]
        print(f"livemig lost / restart lost: {lost_ratio:.3f}")
    phases = {k: statistics.median([x["phases"].get(k, 0.0) for x in samples["livemig"]])
              for k in (samples["livemig"][0].get("phases") or {})}  # fmt: skip
    if phases:
        print("livemig phases (median s): " + "  ".join(f"{k} {v:.3f}" for k, v in phases.items()))
    if "migration" in samples:
        pauses = [x["downtime_s"] for x in samples["migration"] if x.get("downtime_s") is not None]
        if pauses:
            print(f"planned migration pause (switch step over a median step): {statistics.median(pauses):.3f} s "
                  f"(target <= 0.25); rows: 'migration' (downtime column = pause)")  # fmt: skip
    degraded = {name: _degraded(samples.get(name, [])) for name in ("shrink", "torchft_style")}
    if degraded["shrink"]:
        steps, cost = degraded["shrink"]
        print(f"shrink (no spare, --min-nproc {a.workers - 1}, --shrink-wait 0: the downtime is the mechanism's): "
              f"{a.workers - 1} processes carry {a.workers} ranks for {steps:.0f} step(s), step time {cost:.2f}x "
              f"full width; same samples and global batch, bit-identical: {summary['shrink']['bit_identical']} "
              "(gloo: a full-width group, one endpoint per rank carried)")  # fmt: skip
    if degraded["torchft_style"]:
        steps, cost = degraded["torchft_style"]
        print(f"torchft_style (the same shrink, torchft's semantics: LIVEMIG_SHRINK_DROP=1): {steps:.0f} degraded "
              f"step(s) at {cost:.2f}x full width's step time, {steps * a.batch:.0f} samples of rank 1 dropped "
              f"(--batch {a.batch} per rank), global batch {a.workers - 1}/{a.workers} of the configured one "
              "while degraded: a different model (bit-identical: no)")  # fmt: skip
    cold = [x for x in samples.get("cold", []) if x.get("kind") == "restart"]
    if cold:
        ph = {k: statistics.median([x["phases"].get(k, 0.0) for x in cold]) for k in cold[0]["phases"]}
        print(f"cold (--recovery cold: restart from livemig's checkpoint every {a.ckpt_every} steps, survivors "
              f"in place, {statistics.median([x['steps_redone'] or 0 for x in cold]):.0f} step(s) redone): "
              + "  ".join(f"{k} {v:.3f}" for k, v in ph.items()))  # fmt: skip
    if not _has_torchft():
        print("torchft itself: not measured (not installed); torchft_style is its semantics on livemig's mechanism")
    else:
        print("torchft itself: installed, but a row running it is not implemented; torchft_style is its semantics")
    result = {"config": vars(a) | {"fn": None}, "summary": summary, "samples": samples,
              "livemig_lost_over_restart_lost": lost_ratio, "livemig_phases_median": phases}  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    if a.plot:
        _plot(a.plot, samples)
    return 0


def _degraded(rows: list[dict]) -> tuple[float, float] | None:
    """(degraded steps, step time degraded / full) over a shrink row's rounds."""
    shr = [x["shrunk"] for x in rows if x.get("shrunk")]
    if not shr:
        return None
    costs = [x["degraded_step_cost"] for x in shr if x.get("degraded_step_cost")]
    return statistics.median([x["degraded_steps"] for x in shr]), statistics.median(costs) if costs else float("nan")


def summarise(samples: dict[str, list[dict]], width: int = 13) -> dict[str, dict[str, Any]]:
    """Print one row per approach (median (min-max) of its rounds) and return the medians,
    whether every round finished (`all_ok`) and how many were bit-identical."""
    print(f"{'approach':<{width}} {'wall_s':>18} {'lost_s':>18} {'downtime_s':>18} {'step_ms':>8}  bit-identical")
    summary: dict[str, dict[str, Any]] = {}
    for name, rows in samples.items():
        col = {k: [x.get(k) for x in rows] for k in ("wall_s", "lost_s", "downtime_s", "median_step_s")}
        ident = [x.get("bit_identical") for x in rows]
        ident_s = "-" if ident[0] is None else ("yes" if all(ident) else f"{sum(map(bool, ident))}/{len(ident)}")
        step_ms = statistics.median([x or 0.0 for x in col["median_step_s"]]) * 1e3
        print(f"{name:<{width}} {_fmt(col['wall_s']):>18} {_fmt(col['lost_s']):>18} {_fmt(col['downtime_s']):>18} "
              f"{step_ms:>8.0f}  {ident_s}")  # fmt: skip
        summary[name] = {k: (statistics.median([v for v in vs if v is not None]) if any(
            v is not None for v in vs) else None) for k, vs in col.items()}  # fmt: skip
        summary[name]["all_ok"] = all(x.get("ok") for x in rows)
        summary[name]["bit_identical"] = ident_s
    return summary


def _cold_row(a: argparse.Namespace, workload: list[str]) -> dict[str, Any]:
    """livemig with live recovery off: the kill restarts the job from its newest background
    checkpoint (every --ckpt-every steps, as restart's), the survivors in place."""
    from livemig.checkpoint_dir import Settings

    d = tempfile.mkdtemp(prefix="livemig-bench-cold-")
    try:
        return run_livemig(a, True, workload, checkpoint=Settings(d, a.ckpt_every), recovery="cold")
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _has_torchft() -> bool:
    try:
        import torchft  # type: ignore[import-not-found]  # noqa: F401

        return True
    except ImportError:
        return False


def _plot(path: str, samples: dict[str, list[dict]]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("livemig bench: --plot needs matplotlib (pip install 'livemig[bench]'); no chart written")
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    names = ["livemig", "restart"]
    for i, name in enumerate(names):
        rows = [x for x in samples[name] if x.get("phases")]
        if not rows:
            continue
        keys = list(rows[0]["phases"])
        bottom = 0.0
        for k in keys:
            v = statistics.median([x["phases"].get(k, 0.0) for x in rows])
            ax.bar(i, v, bottom=bottom, label=f"{name}: {k}")
            if v > 0.05:
                ax.text(i, bottom + v / 2, f"{k} {v:.2f}s", ha="center", va="center", fontsize=7)
            bottom += v
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("seconds from the fault to the first new step")
    ax.set_title("Recovery time by phase (median of rounds)")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"chart written to {path}")


def add_overhead_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_arguments(p, steps=60)
    add_sharding_argument(p, "also time ZeRO-1 without its mirror, and DDP with ZeroRedundancyOptimizer")
    p.add_argument("--metrics", action="store_true",
                   help="also time livemig with --metrics-port on, scraped once a second")  # fmt: skip
    p.add_argument(
        "--follow",
        type=int,
        default=0,
        metavar="K",
        help="also time livemig with K follow spares against K plain warm spares (runtime/follow.py)",
    )
    p.add_argument("--json")


def _scrape_every(port: int, period: float, stop: threading.Event) -> None:
    import urllib.request

    while not stop.wait(period):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                r.read()
        except OSError:
            pass  # not up yet, or gone


def table_row(name: str, xs: list[float]) -> str:
    return f"  {name:<24} {statistics.median(xs) * 1e3:7.1f} ms  ({min(xs) * 1e3:.1f}-{max(xs) * 1e3:.1f})"


def ratio_line(name: str, num: list[float], den: list[float]) -> tuple[str, float]:
    rs = [x / y if y else float("nan") for x, y in zip(num, den, strict=True)]
    med = statistics.median(rs)
    return f"  {name:<24} {med:7.3f}     ({min(rs):.3f}-{max(rs):.3f})", med


def run_overhead(a: argparse.Namespace) -> int:
    """Median step times measured side by side, interleaved round by round."""
    workload = workload_args(a)
    a.spares, a.fail_at, a.ckpt_every = 0, 0, 0
    zero1 = a.sharding == "zero1"
    plain = argparse.Namespace(**{**vars(a), "sharding": "none"})
    runs: dict[str, Any] = {"livemig": lambda: run_livemig(plain, False, workload),
                            "plain DDP": lambda: run_ddp(plain, False, workload)}  # fmt: skip
    if a.metrics:
        runs["livemig, metrics on"] = lambda: run_livemig(plain, False, workload, metrics=True)
    if a.follow:  # the feed's cost: the same spares, following or not
        spared = argparse.Namespace(**{**vars(plain), "spares": a.follow})
        runs[f"livemig, {a.follow} warm spare(s)"] = lambda: run_livemig(spared, False, workload)
        runs[f"livemig, {a.follow} follower(s)"] = lambda: run_livemig(spared, False, workload, follow=a.follow)
    if zero1:
        runs["livemig zero1 + mirror"] = lambda: run_livemig(a, False, workload)
        runs["livemig zero1, no mirror"] = lambda: run_livemig(a, False, workload, {"LIVEMIG_ZERO1_MIRROR": "0"})
        runs["DDP + ZeroRedundancyOpt"] = lambda: run_ddp(a, False, workload)
    times: dict[str, list[float]] = {k: [] for k in runs}
    rss: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(a.repeat):
        print(f"  round {r + 1}/{a.repeat} ...", flush=True)
        for name, fn in runs.items():
            res = fn()
            times[name].append(res["median_step_s"])
            if res.get("peak_rss_mb"):
                rss[name].append(res["peak_rss_mb"])
    print(f"steady-state step time, {a.workers} workers, {a.steps} steps, {a.repeat} interleaved rounds, "
          "median (min-max)")  # fmt: skip
    for name, xs in times.items():
        print(table_row(name, xs))
    out: dict[str, Any] = {"step_s": times, "ratios": {}}
    pairs = [("livemig / DDP", "livemig", "plain DDP")]
    if a.metrics:
        pairs.append(("metrics on / off", "livemig, metrics on", "livemig"))
    if a.follow:
        pairs.append((f"{a.follow} follower(s) / warm spare(s)", f"livemig, {a.follow} follower(s)",
                      f"livemig, {a.follow} warm spare(s)"))  # fmt: skip
    if zero1:
        pairs += [("zero1+mirror / zero1", "livemig zero1 + mirror", "livemig zero1, no mirror"),
                  ("zero1+mirror / DDP", "livemig zero1 + mirror", "plain DDP"),
                  ("zero1 / DDP+ZeRO", "livemig zero1, no mirror", "DDP + ZeroRedundancyOpt")]  # fmt: skip
    print("ratios")
    for label, x, y in pairs:
        line, med = ratio_line(label, times[x], times[y])
        print(line)
        out["ratios"][label] = med
    measured = {k: statistics.median(v) for k, v in rss.items() if v}
    if measured:  # livemig rows only: the DDP script does not report it
        out["peak_rss_mb_per_rank"] = measured
        print("peak RSS per rank (MiB, measured, largest rank): "
              + "  ".join(f"{k} {v:.0f}" for k, v in measured.items()))  # fmt: skip
    if zero1:
        from livemig.comm.zero1 import reduce_mode

        out["memory_mb_per_rank"] = mem = zero1_memory(a.width, a.layers, a.workers, reduce_mode("gloo"))
        print("memory per rank (MiB, fp32, AdamW): " + "  ".join(f"{k} {v:.1f}" for k, v in mem.items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


def zero1_memory(width: int, layers: int, world: int, mode: str) -> dict[str, float]:
    """Training-state MiB per rank, from the reference model's size: parameters and
    gradients are whole on every rank; AdamW's two moments (and, for the shard,
    the master values) are 1/N; the mirror is exactly one more such shard. The
    mirror's traffic: one slice per step after a reduce-scatter, none in allreduce mode."""
    p = layers * (width * width + width) * 4 / 2**20
    shard = 3 * p / world  # values + exp_avg + exp_avg_sq
    sent = p / world if mode == "reduce_scatter" else 0.0
    return {"params": p, "grads": p, "ddp_adamw_state": 2 * p, "zero1_own_shard": shard,
            "zero1_mirror_shard": shard, "mirror_mb_sent_per_step": sent}  # fmt: skip
