"""`livemig bench startup`: the time a job spends outside training, next to torchrun.

Each row is a whole command line started as a fresh process, as a user starts it, on
the reference workload (examples/mlp.py; torchrun runs examples/ddp_baseline.py, the
same loop in plain DDP), interleaved round by round so machine noise hits all alike:

- start-up: from launching the command to the group's first committed step;
- teardown: from the last committed step to the command's exit;
- livemig --spares 1 also reports how many steps were committed when its spare
  reported warm (it starts with the workers, and competes with them for the CPUs
  of this machine while it warms up).

Commit times are wall-clock times written by the workers (livemig: the run report's
commit_window; DDP: its progress files), so the two sides are measured alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from livemig.bench.downtime_bench import DDP, MLP, add_workload_arguments, commit_times, kill_tree, workload_args
from livemig.rdzv.embedded import free_port


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_arguments(p, steps=40)
    p.add_argument("--json", help="write every figure and raw sample here")


def _wait(p: subprocess.Popen, timeout: float) -> float:
    """Wait for the command to exit; returns the wall time it did (killed at the timeout)."""
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(p)
    return time.time()


def run_livemig(a: argparse.Namespace, spares: int) -> dict[str, Any]:
    out = tempfile.mkdtemp(prefix="livemig-startup-")
    report = os.path.join(out, "report.json")
    argv = [sys.executable, "-m", "livemig.cli", "run", "--nproc", str(a.workers), "--spares", str(spares),
            "--report", report, MLP, *workload_args(a)]  # fmt: skip
    t0 = time.time()
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    end = _wait(p, a.run_timeout)
    try:
        with open(report) as f:
            rep = json.load(f)
    except (OSError, ValueError):
        return {"ok": False, "rc": p.returncode}
    window = rep.get("commit_window") or [None, None]
    res: dict[str, Any] = {"ok": p.returncode == 0 and rep.get("steps_completed") == a.steps, "rc": p.returncode,
                           "wall_s": end - t0, "steps": rep.get("steps_completed")}  # fmt: skip
    if window[0] is not None:
        res["startup_s"], res["teardown_s"] = window[0] - t0, end - window[1]
    warm = [w["steps_committed"] for w in (rep.get("spares_warm") or {}).values()]
    if spares:
        res["spare_warm_after_steps"] = min(warm) if warm else None  # None: never warm
    return res


def run_torchrun(a: argparse.Namespace) -> dict[str, Any]:
    out = tempfile.mkdtemp(prefix="livemig-startup-ddp-")
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(a.workers),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", DDP, *workload_args(a),
            "--out-dir", out]  # fmt: skip
    t0 = time.time()
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    end = _wait(p, a.run_timeout)
    times = [t for _, t, _, _ in commit_times(out)]
    steps = len({s for s, _, _, _ in commit_times(out)})
    res: dict[str, Any] = {"ok": steps == a.steps, "rc": p.returncode, "wall_s": end - t0, "steps": steps}
    if times:
        res["startup_s"], res["teardown_s"] = min(times) - t0, end - max(times)
    return res


def _col(rows: list[dict], key: str) -> list[float]:
    return [r[key] for r in rows if r.get(key) is not None]


def _fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})" if xs else "-"


def run(a: argparse.Namespace) -> int:
    rows: dict[str, Any] = {
        "torchrun": lambda: run_torchrun(a),
        "livemig --spares 0": lambda: run_livemig(a, 0),
        "livemig --spares 1": lambda: run_livemig(a, 1),
    }
    samples: dict[str, list[dict]] = {k: [] for k in rows}
    for r in range(a.repeat):
        for name, fn in rows.items():
            print(f"  round {r + 1}/{a.repeat}: {name} ...", flush=True)
            samples[name].append(fn())
    print(f"\nworkload: examples/mlp.py, {a.workers} workers, {a.steps} steps, {a.repeat} interleaved rounds; "
          "seconds, median (min-max)")  # fmt: skip
    print(f"{'command':<20} {'start-up':>17} {'teardown':>17} {'outside training':>17} {'wall':>18}  ok")
    summary: dict[str, Any] = {}
    for name, rs in samples.items():
        outside = [r["startup_s"] + r["teardown_s"] for r in rs if "startup_s" in r]
        ok = sum(1 for r in rs if r.get("ok"))
        print(f"{name:<20} {_fmt(_col(rs, 'startup_s')):>17} {_fmt(_col(rs, 'teardown_s')):>17} "
              f"{_fmt(outside):>17} {_fmt(_col(rs, 'wall_s')):>18}  {ok}/{len(rs)}")  # fmt: skip
        summary[name] = {k: statistics.median(v) if v else None for k, v in
                         (("startup_s", _col(rs, "startup_s")), ("teardown_s", _col(rs, "teardown_s")),
                          ("outside_s", outside), ("wall_s", _col(rs, "wall_s")))}  # fmt: skip
        summary[name]["all_ok"] = ok == len(rs)
    ratios = {}
    base = samples["torchrun"]
    for name in ("livemig --spares 0", "livemig --spares 1"):
        for key in ("startup_s", "teardown_s"):
            rs = [x[key] / y[key] for x, y in zip(samples[name], base, strict=True)
                  if x.get(key) is not None and y.get(key)]  # fmt: skip
            if rs:
                ratios[f"{name} / torchrun {key[:-2]}"] = statistics.median(rs)
    print("ratios (per round, median; <= 1 is no worse than torchrun)")
    for k, v in ratios.items():
        print(f"  {k:<42} {v:.3f}")
    warm = [r["spare_warm_after_steps"] for r in samples["livemig --spares 1"]]
    print("livemig --spares 1: steps committed when the spare reported warm: "
          + ", ".join("never" if w is None else str(w) for w in warm) + " (target: before step 20)")  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": vars(a) | {"fn": None}, "summary": summary, "ratios": ratios, "samples": samples},
                      f, indent=2, default=str)  # fmt: skip
    return 0 if all(s["all_ok"] for s in summary.values()) else 1
