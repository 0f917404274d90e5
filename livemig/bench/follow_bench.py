"""`livemig bench downtime --follow`: follow spares against plain warm spares, side by side.

For each model width (examples/mlp.py: 8 x Linear(W, W), AdamW: 12 W^2 bytes x 8 of state),
each round runs the same kill of rank 1 after --fail-at with a plain warm spare (`warm`) and
with a follow spare (`follow`, `--follow 1`: runtime/follow.py), interleaved, plus one
fault-free run per width for bit-identity. The fault plan lands the kill once the follower
holds the step (agent/fault_driver.py), so `follow` measures the follower's path; a row whose
recovery streamed anyway (the follower was behind) says so in its `path` column.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
from typing import Any

from livemig.bench.downtime_bench import run_livemig, workload_args


def _state_mib(width: int, layers: int) -> float:
    """Parameters and AdamW's two moments, fp32 (the bias rows included)."""
    params = layers * (width * width + width)
    return params * 4 * 3 / 2**20


def _med(rows: list[dict], key: str) -> float | None:
    vals = [x[key] for x in rows if x.get(key) is not None]
    return statistics.median(vals) if vals else None


def run_follow(a: argparse.Namespace) -> int:
    if a.workers < 2 or not 0 <= a.fail_at < a.steps - 1:
        raise SystemExit("livemig bench downtime --follow: need --workers >= 2 and 0 <= --fail-at < --steps - 1")
    widths = [int(w) for w in a.widths.split(",") if w.strip()] if a.widths else [a.width]
    results: dict[str, Any] = {}
    for width in widths:
        b = copy.copy(a)
        b.width = width
        b.spares = max(1, a.spares)
        work = workload_args(b)
        mib = _state_mib(width, a.layers)
        print(f"width {width} ({mib:.0f} MiB of parameters and optimizer state per replica) ...", flush=True)
        ref = run_livemig(b, False, work)
        rows: dict[str, list[dict]] = {"warm": [], "follow": []}
        for r in range(a.repeat):
            for name in rows:
                print(f"  round {r + 1}/{a.repeat}: {name} ...", flush=True)
                row = run_livemig(b, True, work, follow=1 if name == "follow" else 0)
                row["bit_identical"] = row["digest"] == ref["digest"]
                rows[name].append(row)
        results[str(width)] = {"state_mib": mib, "fault_free": ref, **rows}
    print(f"\nworkload: examples/mlp.py, {a.workers} workers, {a.layers} layers, {a.steps} steps, rank 1 SIGKILLed "
          f"after step {a.fail_at} with one spare: plain warm (warm) or following (follow); {a.repeat} interleaved "
          "rounds; medians")  # fmt: skip
    print(f"{'state MiB':>9} {'mode':<7} {'downtime_s':>10} {'stream_s':>9} {'agree_s':>8} {'build_s':>8} "
          f"{'MiB streamed':>12} {'peak RSS MiB':>12}  path      bit-identical")  # fmt: skip
    base = None
    for width in widths:
        res = results[str(width)]
        for name in ("warm", "follow"):
            rows = res[name]
            ph = {k: statistics.median([x["phases"].get(k, 0.0) for x in rows]) for k in ("stream", "agree", "build")}
            down = _med(rows, "downtime_s")
            streamed = _med(rows, "bytes_streamed") or 0.0
            paths = sorted({str(x.get("path")) for x in rows})
            ident = (
                "yes"
                if all(x["bit_identical"] for x in rows)
                else f"{sum(x['bit_identical'] for x in rows)}/{len(rows)}"
            )
            res[f"{name}_median"] = {"downtime_s": down, "phases": ph, "bytes_streamed": streamed}
            print(f"{res['state_mib']:>9.0f} {name:<7} {down or 0.0:>10.3f} {ph['stream']:>9.3f} {ph['agree']:>8.3f} "
                  f"{ph['build']:>8.3f} {streamed / 2**20:>12.2f} {_med(rows, 'peak_rss_mb') or 0.0:>12.0f}  "
                  f"{','.join(paths):<9} {ident}")  # fmt: skip
        if base is None:
            base = res["follow_median"]["downtime_s"]
    print("peak RSS per process, MiB (each rank's final record; the recovered rank's is the spare that took it):")
    for width in widths:
        res = results[str(width)]
        for name in ("warm", "follow"):
            row = res[name][0] if res[name] else {}
            by = "  ".join(f"rank {r} {v:.0f}" for r, v in (row.get("rss_by_rank") or {}).items() if v is not None)
            print(f"{res['state_mib']:>9.0f} {name:<7} {by}")
    print("follower lag behind its feeder, publish -> applied (ms; each follow run's follower, median over runs):")
    for width in widths:
        res = results[str(width)]
        lags = [lag for x in res["follow"] for lag in x.get("follow_lag_ms", [])]
        if not lags:
            print(f"{res['state_mib']:>9.0f}  (no update applied)")
            continue
        q = {k: statistics.median([lag[k] for lag in lags]) for k in ("p50", "p90", "p99", "max")}
        res["follow_lag_ms"] = q
        print(
            f"{res['state_mib']:>9.0f}  p50 {q['p50']:.1f}  p90 {q['p90']:.1f}  p99 {q['p99']:.1f}  "
            f"max {q['max']:.1f}  ({sum(lag['n'] for lag in lags)} updates)"
        )
    if base and len(widths) > 1:
        last = results[str(widths[-1])]["follow_median"]["downtime_s"]
        if last is not None:
            print(f"follow downtime at {results[str(widths[-1])]['state_mib']:.0f} MiB / at "
                  f"{results[str(widths[0])]['state_mib']:.0f} MiB: {last / base:.2f} (target <= 1.2)")  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": vars(a) | {"fn": None}, "results": results}, f, indent=2, default=str)
    return 0
