"""`livemig bench warmup`: what a warm spare saves at activation.

Side by side, interleaved round by round, the same job and the same SIGKILL:

- cold: no spare runs before the failure; a fresh spare process is started at
  the moment of the kill (no shadow iterations). cold_activation_s = its
  first committed step minus its process start: imports, model build,
  back-end init, registration, claim, state load, group build, first step.
- warm: a spare started with the job, warmed (model, optimizer, shadow
  iterations, gloo) and waiting. warm_activation_s = its first committed step
  minus the claim, minus the state stream (the stream is the same bytes for
  both and is measured by `bench transfer`).

Also reported: the warm spare's resident memory when it reported warm and
when it was claimed (it must not grow while it waits). Target: warm <= 0.1 x cold.
"""

from __future__ import annotations

import argparse
import json
import statistics
import uuid
from typing import Any

from livemig.agent.launcher import run
from livemig.agent.run_config import RunConfig
from livemig.bench.downtime_bench import MLP, add_workload_arguments, workload_args
from livemig.config import Role
from livemig.faults import parse_fault


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_arguments(p, steps=40)
    p.add_argument("--fail-at", type=int, default=25, help="kill rank 1 after this step (default 25)")
    p.add_argument("--json", help="write every figure and raw sample here")
    p.add_argument("--device", default="cpu", help="examples/mlp.py's --device: cpu (default) or cuda")


def _one(a: argparse.Namespace, cold: bool) -> dict[str, Any]:
    cfg = RunConfig(script=MLP, args=[*workload_args(a), "--device", a.device],
                    nproc=a.workers, spares=1, job=f"warm-{uuid.uuid4().hex[:6]}", quiet=True,
                    max_wall=a.run_timeout, cold_spares=cold,
                    faults=[parse_fault(f"kill:rank=1:step={a.fail_at}")])  # fmt: skip
    rep = run(cfg)
    out: dict[str, Any] = {"ok": (rep["result"] or {}).get("state") == "done", "digest": rep["state_digest"]}
    spare = next((m for m in rep["members"].values() if m["role"] == Role.SPARE), None)
    rec = rep["recoveries"][0] if rep["recoveries"] else None
    if spare is None or rec is None or not spare.get("first_commit"):
        out["ok"] = False
        return out
    first = float(spare["first_commit"][1])
    sb = spare.get("standby", {})
    claim = next(e["time"] for e in rep["timeline"] if e["phase"] == "claim")
    stream = next((e.get("seconds", 0.0) for e in rep["timeline"] if e["phase"] == "stream"), 0.0)
    out.update(
        downtime_s=rec["downtime_s"],
        stream_s=stream,
        **{k: sb.get(k) for k in ("warmup_s", "warm_rss_mb", "claim_rss_mb", "waited_s")},
    )
    if cold:
        out["activation_s"] = first - float(sb["process_start"])
    else:
        out["activation_s"] = first - claim - stream
    return out


def run_warmup(a: argparse.Namespace) -> int:
    if a.workers < 2 or not 0 <= a.fail_at < a.steps - 1:
        raise SystemExit("livemig bench warmup: need --workers >= 2 and 0 <= --fail-at < --steps - 1")
    samples: dict[str, list[dict]] = {"cold": [], "warm": []}
    for r in range(a.repeat):
        for name in samples:
            print(f"  round {r + 1}/{a.repeat}: {name} spare ...", flush=True)
            samples[name].append(_one(a, name == "cold"))
    ok = {k: [x for x in v if x.get("ok")] for k, v in samples.items()}
    if not ok["cold"] or not ok["warm"]:
        print("livemig bench warmup: a run failed; see the JSON samples")
        return 1

    def med(k: str, name: str) -> float:
        return statistics.median(x[k] for x in ok[name])

    cold, warm = med("activation_s", "cold"), med("activation_s", "warm")
    ratios = [w["activation_s"] / c["activation_s"] for w, c in zip(ok["warm"], ok["cold"], strict=False)]
    growth = [x["claim_rss_mb"] - x["warm_rss_mb"] for x in ok["warm"]]
    print(f"\nworkload: examples/mlp.py ({a.layers} x {a.width}), {a.workers} workers, rank 1 SIGKILLed after "
          f"step {a.fail_at}; {a.repeat} interleaved rounds, median")  # fmt: skip
    print(f"  cold_activation_s   {cold:7.3f}   (fresh process at the failure: start .. first committed step)")
    print(f"  warm_activation_s   {warm:7.3f}   (warm spare: claim .. first committed step, stream excluded)")
    print(f"  warm / cold         {statistics.median(ratios):7.3f}   (target <= 0.1)")
    print(f"  downtime_s          cold {med('downtime_s', 'cold'):.3f}   warm {med('downtime_s', 'warm'):.3f}")
    print(
        f"  warm spare memory   {med('warm_rss_mb', 'warm'):.1f} MiB when warm, "
        f"{med('claim_rss_mb', 'warm'):.1f} MiB at claim after waiting {med('waited_s', 'warm'):.1f} s "
        f"(growth {statistics.median(growth):+.1f} MiB)"
    )
    result = {"cold_activation_s": cold, "warm_activation_s": warm, "warm_over_cold": statistics.median(ratios),
              "spare_rss_growth_mb": statistics.median(growth), "samples": samples}  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
