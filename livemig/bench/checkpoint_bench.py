"""`livemig bench checkpoint`: what background checkpoints cost the training loop.

One invocation runs, interleaved round by round (A B C D A B C D ...) so that machine noise
hits all alike, the same workload (examples/mlp.py, or mlp_zero1.py with --sharding zero1):

- livemig: checkpoints off;
- livemig + checkpoints: `--checkpoint-every N` into a fresh directory (staged on the
  training thread, written by a thread with torch.distributed.checkpoint, fsynced);
- plain DDP: the same loop under torchrun (examples/ddp_baseline.py);
- DDP + torch.save: rank 0 saves model and optimizer every N steps on the training thread
  (as users write it; not fsynced, so cheaper than a durable write).

The figure that counts is the amortised step time, (last commit - first commit) / (steps - 1):
it holds every stall a checkpoint causes. Its ratio to the same loop without checkpoints is the
cost (the issue's target: <= 1.03 for livemig at N = 50 with 2 workers). The steps whose
interval overlaps a write in flight (report `checkpoints.writes`) are reported apart: on a
machine with fewer cores than workers + writers, they are where the writer's CPU shows.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from typing import Any

from livemig.bench.downtime_bench import (
    add_sharding_argument,
    add_workload_arguments,
    run_ddp,
    run_livemig,
    workload_args,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_arguments(p, steps=300)
    p.add_argument("--every", type=int, default=50, help="checkpoint every N steps (default 50)")
    p.add_argument("--keep", type=int, default=2, help="--checkpoint-keep of the livemig row (default 2)")
    add_sharding_argument(p, "examples/mlp_zero1.py; the DDP rows use ZeroRedundancyOptimizer")
    p.add_argument("--dir", help="where the checkpoints go (default: a temporary directory, removed after)")
    p.add_argument("--json", help="write every figure and raw sample here")


def overlap_split(commits: list[list[float]], writes: list[list[float]]) -> tuple[list[float], list[float]]:
    """The step intervals (between consecutive group-wide commits) that overlap a write in
    flight, and the others."""
    over, clear = [], []
    for (_, a), (_, b) in zip(commits, commits[1:], strict=False):
        hit = any(lo < b and hi > a for _, lo, hi in writes)
        (over if hit else clear).append(b - a)
    return over, clear


def _ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.1f}" if xs else "-"


def run(a: argparse.Namespace) -> int:
    from livemig.checkpoint_dir import Settings

    if a.every < 1 or a.steps < 2 * a.every:
        raise SystemExit("livemig bench checkpoint: need --every >= 1 and --steps >= 2 x --every")
    workload = workload_args(a)
    a.spares, a.fail_at, a.ckpt_every = 0, 0, a.every
    root = a.dir or tempfile.mkdtemp(prefix="livemig-bench-ckpt-")
    n = {"i": 0}

    def with_checkpoints() -> dict[str, Any]:
        n["i"] += 1
        d = f"{root}/run-{n['i']}"
        try:
            return run_livemig(a, False, workload, checkpoint=Settings(d, a.every, a.keep))
        finally:
            if not a.dir:
                shutil.rmtree(d, ignore_errors=True)

    approaches = {
        "livemig": lambda: run_livemig(a, False, workload),
        "livemig + checkpoints": with_checkpoints,
        "plain DDP": lambda: run_ddp(a, False, workload),
        "DDP + torch.save": lambda: run_ddp(a, False, workload, ckpt_every=a.every),
    }
    samples: dict[str, list[dict]] = {k: [] for k in approaches}
    try:
        for r in range(a.repeat):
            for name, fn in approaches.items():
                print(f"  round {r + 1}/{a.repeat}: {name} ...", flush=True)
                samples[name].append(fn())
    finally:
        if not a.dir:
            shutil.rmtree(root, ignore_errors=True)
    script = "mlp_zero1" if a.sharding == "zero1" else "mlp"
    print(f"\nworkload: examples/{script}.py, {a.workers} workers, {a.steps} steps, a checkpoint every {a.every} "
          f"steps; {a.repeat} interleaved rounds; median (min-max) over rounds")  # fmt: skip
    print(f"{'approach':<24} {'amortised ms':>22} {'median step ms':>16}  ok")
    summary: dict[str, Any] = {}
    for name, rows in samples.items():
        am = [x["amortised_step_s"] for x in rows]
        med = [x["median_step_s"] for x in rows]
        ok = all(x.get("ok") for x in rows)
        print(f"{name:<24} {statistics.median(am) * 1e3:>8.1f} ({min(am) * 1e3:.1f}-{max(am) * 1e3:.1f})"
              f"{statistics.median(med) * 1e3:>16.1f}  {'yes' if ok else 'NO'}")  # fmt: skip
        summary[name] = {"amortised_step_s": statistics.median(am), "median_step_s": statistics.median(med),
                         "all_ok": ok}  # fmt: skip
    ratios = {}
    for label, x, y in (("livemig checkpoints / off", "livemig + checkpoints", "livemig"),
                        ("DDP torch.save / off", "DDP + torch.save", "plain DDP")):  # fmt: skip
        rs = [p["amortised_step_s"] / q["amortised_step_s"] for p, q in zip(samples[x], samples[y], strict=True)
              if q["amortised_step_s"]]  # fmt: skip
        ratios[label] = statistics.median(rs) if rs else None
        if rs:
            print(f"  {label:<28} {statistics.median(rs):.3f} ({min(rs):.3f}-{max(rs):.3f})")
    print("  (amortised: every stall counted; target <= 1.03 for livemig at --every 50 with 2 workers)")
    over, clear, stage, waited, complete = [], [], [], [], []
    for x in samples["livemig + checkpoints"]:
        ck = x.get("checkpoints") or {}
        o, c = overlap_split(x.get("commit_times") or [], ck.get("writes") or [])
        over += o
        clear += c
        stage.append(ck.get("stage_s_max", 0.0))
        waited.append(ck.get("wait_s_total", 0.0))
        complete.append(len(ck.get("steps") or []))
    print(f"livemig + checkpoints: steps overlapping a write {_ms(over)} ms (median of {len(over)}), "
          f"the others {_ms(clear)} ms (of {len(clear)}); staging at most "
          f"{max(stage, default=0.0) * 1e3:.0f} ms on the training thread; waited for a previous write "
          f"{max(waited, default=0.0):.2f} s; complete checkpoints per run {complete}")  # fmt: skip
    # Within a run, the steps a write overlapped against the others: the cost with the noise
    # between runs taken out (staging is in these intervals too: it ends where the write starts).
    est = None
    if over and clear:
        base = statistics.median(clear)
        est = (sum(over) - len(over) * base) / (len(over) + len(clear)) / base
        print(f"  estimated amortised cost from the overlapping steps: {est * 100:+.1f} % "
              "(their excess over the median of the others, spread over all steps)")  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": vars(a) | {"fn": None}, "summary": summary, "ratios": ratios, "estimated_cost": est,
                       "overlapping_step_s": over, "other_step_s": clear, "stage_s_max": stage,
                       "complete_per_run": complete,
                       "samples": {k: [{kk: vv for kk, vv in x.items() if kk != "commit_times"} for x in v]
                                   for k, v in samples.items()}}, f, indent=2, default=str)  # fmt: skip
    return 0
