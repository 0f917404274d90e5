"""`livemig bench overhead --sharding fsdp2` and `bench downtime --sharding fsdp2`: livemig's FSDP2
path next to the same model, mesh and data in torch FSDP2 under torchrun (examples/fsdp2_lm.py
and examples/fsdp2_baseline.py), measured side by side in interleaved rounds: this machine is
shared and noisy, so only the ratios of one run are read, never an absolute time alone.

The workload: a GPT-style model (examples/fsdp2_lm.py) under HSDP (replicate 2 x shard 2 on the
default 4 workers; plain FSDP on an odd count). The common workload flags keep their meaning;
with --sharding fsdp2 their defaults become 4 workers, width 128, 4 layers (and `overhead`'s
3 rounds of 60 steps 5 of 30).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Any

from livemig.bench.downtime_bench import ROOT, ratio_line, run_ddp, run_livemig, summarise, table_row

LM = os.path.join(ROOT, "examples", "fsdp2_lm.py")
BASELINE = os.path.join(ROOT, "examples", "fsdp2_baseline.py")
MIRROR_ON = {"LIVEMIG_FSDP2_MIRROR": "1"}
SPARE_MESH_OFF = {"LIVEMIG_SPARE_MESH": "0"}


def _workload(a: argparse.Namespace, overhead: bool = False) -> list[str]:
    """The common flags' fsdp2 defaults (a 4-rank HSDP job sized for 2 cores), then the script's flags."""
    defaults = {"workers": (2, 4), "width": (1024, 128), "layers": (8, 4)}
    if overhead:  # the target is read from the median of 5 interleaved pairs
        defaults |= {"repeat": (3, 5), "steps": (60, 30)}
    for k, (common, ours) in defaults.items():
        if getattr(a, k) == common:
            setattr(a, k, ours)
    replicate = 2 if a.workers >= 4 and a.workers % 2 == 0 else 1
    return ["--steps", str(a.steps), "--width", str(a.width), "--layers", str(a.layers),
            "--replicate", str(replicate)]  # fmt: skip


def run_overhead(a: argparse.Namespace) -> int:
    """Step time against torch FSDP2 with the same model and mesh: without and with the mirror,
    and with MixedPrecisionPolicy(bf16) and reshard_after_forward=False on both sides."""
    base = _workload(a, overhead=True)
    a.spares, a.fail_at, a.ckpt_every = 0, 0, 0
    variants = {"": [], " bf16": ["--mp", "bf16"], " no-reshard": ["--no-reshard"]}
    runs: dict[str, Any] = {}
    for tag, flags in variants.items():
        w = base + flags
        runs[f"torch FSDP2{tag}"] = lambda w=w: run_ddp(a, False, w, script=BASELINE)
        runs[f"livemig{tag}"] = lambda w=w: run_livemig(a, False, w, script=LM)
        if not tag:
            runs["livemig + mirror"] = lambda w=w: run_livemig(a, False, w, MIRROR_ON, script=LM)
    times: dict[str, list[float]] = {k: [] for k in runs}
    mirror_mb: list[float] = []
    for r in range(a.repeat):
        print(f"  round {r + 1}/{a.repeat} ...", flush=True)
        for name, fn in runs.items():
            res = fn()
            if not res.get("ok", True) or not res.get("median_step_s"):
                raise SystemExit(f"livemig bench overhead: the {name!r} run failed (steps {res.get('steps')})")
            times[name].append(res["median_step_s"])
            if (res.get("fsdp2") or {}).get("mirror_mb_per_rank"):
                mirror_mb.append(res["fsdp2"]["mirror_mb_per_rank"])
    print(f"steady-state step time, examples/fsdp2_lm.py {' '.join(base)} on {a.workers} workers, "
          f"{a.repeat} interleaved rounds, median (min-max)")  # fmt: skip
    for name, xs in times.items():
        print(table_row(name, xs))
    pairs = [("livemig / FSDP2 (<= 1.05)", "livemig", "torch FSDP2"),
             ("mirror / FSDP2", "livemig + mirror", "torch FSDP2"),
             ("mirror / livemig", "livemig + mirror", "livemig"),
             ("bf16: livemig / FSDP2", "livemig bf16", "torch FSDP2 bf16"),
             ("no-reshard: livemig / FSDP2", "livemig no-reshard", "torch FSDP2 no-reshard")]  # fmt: skip
    out: dict[str, Any] = {"step_s": times, "ratios": {}, "workload": base}
    print("ratios (median of the rounds' pairs)")
    for label, x, y in pairs:
        line, med = ratio_line(label, times[x], times[y])
        print(line)
        out["ratios"][label] = med
    if mirror_mb:
        out["mirror_mb_per_rank"] = statistics.median(mirror_mb)
        print(f"the mirror's memory per rank: {out['mirror_mb_per_rank']:.2f} MiB (one more shard of parameters "
              "and AdamW state)")  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


def run_downtime(a: argparse.Namespace) -> int:
    """A rank SIGKILLed after --fail-at: livemig's live recovery onto a spare against torchrun
    restarting the whole job from its newest DCP checkpoint (every --ckpt-every steps)."""
    w = _workload(a)
    if not 0 <= a.fail_at < a.steps - 1:
        raise SystemExit("livemig bench downtime: need 0 <= --fail-at < --steps - 1")
    approaches = {
        "fault_free": lambda: run_livemig(a, False, w, script=LM),
        "torch_fsdp2": lambda: run_ddp(a, False, w, script=BASELINE),
        "livemig": lambda: run_livemig(a, True, w, script=LM),
        "restart_dcp": lambda: run_ddp(a, True, w, script=BASELINE),
        # a planned migration of rank 1 at --fail-at: its pause is the downtime column (issue 52 item 5)
        "migration": lambda: run_livemig(a, "migrate", w, script=LM),
    }
    if getattr(a, "spare_mesh_ab", False):  # the spare's warm-up on a mesh of one, as before (fsdp2_mesh.py)
        approaches["livemig_mesh1"] = lambda: run_livemig(a, True, w, SPARE_MESH_OFF, script=LM)
        approaches["migration_mesh1"] = lambda: run_livemig(a, "migrate", w, SPARE_MESH_OFF, script=LM)
    samples: dict[str, list[dict]] = {k: [] for k in approaches}
    for r in range(a.repeat):
        for name, fn in approaches.items():
            print(f"  round {r + 1}/{a.repeat}: {name} ...", flush=True)
            samples[name].append(fn())
    pairs = [("livemig", "fault_free"), ("restart_dcp", "torch_fsdp2"), ("migration", "fault_free")]
    pairs += [(x, "fault_free") for x in ("livemig_mesh1", "migration_mesh1") if x in samples]
    for i in range(a.repeat):
        for faulted, free in pairs:
            row, ref = samples[faulted][i], samples[free][i]
            row["lost_s"] = row["wall_s"] - ref["wall_s"]
            row["bit_identical"] = bool(row["digest"]) and row["digest"] == ref["digest"]
    print(f"\nworkload: examples/fsdp2_lm.py {' '.join(w)} on {a.workers} workers, rank 1 SIGKILLed after step "
          f"{a.fail_at}; restart loads DCP checkpoints written every {a.ckpt_every}; {a.repeat} interleaved "
          "rounds; median (min-max)")  # fmt: skip
    summary = summarise(samples, width=12)
    ratio = None
    if summary["restart_dcp"]["downtime_s"] and summary["livemig"]["downtime_s"] is not None:
        ratio = summary["livemig"]["downtime_s"] / summary["restart_dcp"]["downtime_s"]
        print(f"livemig downtime / restart downtime: {ratio:.3f}")
    for warm, one in (("livemig", "livemig_mesh1"), ("migration", "migration_mesh1")):
        if one in samples:  # the spare warmed on the job's mesh against one warmed on a mesh of one
            num, den = ([x["downtime_s"] or 0.0 for x in samples[k]] for k in (warm, one))
            line, _ = ratio_line(f"{warm}: job's mesh / mesh of one", num, den)
            print(line)
    for name in [x for x in ("livemig", "migration", "livemig_mesh1", "migration_mesh1") if x in samples]:
        phases = {k: statistics.median([x["phases"].get(k, 0.0) for x in samples[name]])
                  for k in (samples[name][0].get("phases") or {})}  # fmt: skip
        if phases:
            print(f"{name} phases (median s): " + "  ".join(f"{k} {v:.3f}" for k, v in phases.items()))
    mig = samples["migration"]
    if any(x.get("downtime_s") is None for x in mig):  # aborted: the job ended before the spare switched in
        print("planned migration: not finished in some rounds (the job ended first): give it more --steps")
    pauses = [x["downtime_s"] for x in mig if x.get("downtime_s") is not None]
    steps = [x["median_step_s"] for x in mig if x.get("median_step_s")]
    if pauses and steps:
        pause, step = statistics.median(pauses), statistics.median(steps)
        print(f"planned migration pause: {pause:.3f} s = {pause / step:.1f} median steps of {step * 1000:.0f} ms "
              "(target <= 3 median steps)")  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"summary": summary, "samples": samples, "downtime_ratio": ratio, "workload": w}, f,
                      indent=2, default=str)  # fmt: skip
    return 0
