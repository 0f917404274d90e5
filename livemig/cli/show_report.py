"""`livemig report FILE [--plot out.png]`: a run report (`livemig run --report`) for a person.

Prints the run (steps, wall, goodput), each recovery and planned migration with its phases,
and draws a timeline: per rank, its committed steps as bars over time, each recovery's
phases as coloured spans, the spare's arrival. Matplotlib is an optional extra
(`pip install 'livemig[bench]'`).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from livemig.errors import ConfigError

# one colour per phase, the same in every chart (recovery, then migration phases)
PHASE_COLOURS = {"detect": "#d62728", "fence": "#ff7f0e", "agree": "#bcbd22", "claim": "#9467bd",
                 "stream": "#1f77b4", "build": "#17becf", "commit": "#2ca02c", "resume": "#8c564b",
                 "request": "#e377c2", "catchup": "#1f77b4", "switch": "#2ca02c"}  # fmt: skip


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("report", help="print a run report (--report FILE) readably; --plot draws its timeline")
    s.add_argument("file", help="a run report written by livemig run --report")
    s.add_argument("--plot", help="write a PNG timeline here (needs matplotlib: pip install 'livemig[bench]')")
    s.set_defaults(fn=cmd_report)


def load(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            rep = json.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read the report {path!r}: {exc.strerror}") from None
    except ValueError as exc:
        raise ConfigError(f"{path!r} is not JSON ({exc}): expected a report from livemig run --report") from None
    if not isinstance(rep, dict) or not {"job", "steps_completed", "recoveries"} <= set(rep):
        raise ConfigError(f"{path!r} is not a run report (no job, steps_completed, recoveries): livemig run --report")
    return rep


def goodput(rep: dict[str, Any]) -> float | None:
    """Committed steps x median step / wall time from launch to the last commit (the wall
    time less the teardown after the last commit, when the report has both ends); a report
    that has its own (agent/report.py `goodput`, the metrics endpoint's figure) gives that."""
    if isinstance(rep.get("goodput"), int | float):
        return float(rep["goodput"])
    wall, step, n = rep.get("wall_s") or 0.0, rep.get("step_time_s_median") or 0.0, rep.get("steps_completed") or 0
    if not wall or not step:
        return None
    window, last = rep.get("commit_window"), rep.get("timeline") or []
    end = max((e.get("time", 0.0) for e in last), default=None)
    if window and end and end > window[1]:
        wall = max(step, wall - (end - window[1]))
    return min(1.0, n * step / wall)


def text(rep: dict[str, Any]) -> str:
    res = rep.get("result") or {}
    g = goodput(rep)
    lines = [
        f"job {rep['job']}: {res.get('state', 'unknown')}; {rep['steps_completed']} steps in "
        f"{rep.get('wall_s', 0.0):.1f} s, median step {rep.get('step_time_s_median', 0.0) * 1e3:.0f} ms, "
        f"world size {rep.get('world_size')}" + (f", goodput {g:.1%}" if g is not None else ""),
    ]
    if res.get("reason"):
        lines.append(f"  reason: {res['reason']}")
    for r in rep["recoveries"]:
        onto = f" onto {', '.join(r['spares'])}" if r.get("spares") else ""
        ph = "  ".join(f"{k} {v:.3f}" for k, v in r.get("phases", {}).items())
        held = " (a follow spare: it held the state)" if r.get("path") == "follower" else ""
        lines += [f"recovery ({r.get('kind', 'failure')}) of rank {r.get('rank')}{onto}, generation "
                  f"{r.get('generation')}: downtime {r.get('downtime_s', 0.0):.3f} s, "
                  f"{r.get('bytes_streamed', 0) / 2**20:.1f} MiB streamed{held}", f"  phases (s): {ph}"]  # fmt: skip
    for m in rep.get("migrations", []):
        ph = "  ".join(f"{k} {v:.3f}" for k, v in m.get("phases", {}).items())
        pause = f"pause {m['pause_s']:.3f} s" if m.get("pause_s") is not None else "no pause measured"
        lines += [f"migration of rank {m.get('rank')} ({m.get('reason') or 'requested'}): {m.get('outcome')}, "
                  f"{pause}, {m.get('bytes_streamed', 0) / 2**20:.1f} MiB streamed", f"  phases (s): {ph}"]  # fmt: skip
    if not rep["recoveries"] and not rep.get("migrations"):
        lines.append("no recovery and no migration")
    lines.append(f"state digest {str(rep.get('state_digest', ''))[:16]}…  replicas identical: "
                 f"{'yes' if rep.get('replicas_identical') else 'no'}")  # fmt: skip
    return "\n".join(lines)


def spans(rep: dict[str, Any]) -> list[tuple[str, float, float, int | None]]:
    """(phase, start, end, rank) of every recovery and migration, in wall time: the
    timeline's stamps, each phase ending where the next begins."""
    out: list[tuple[str, float, float, int | None]] = []
    events = sorted(rep.get("timeline") or [], key=lambda e: e.get("time", 0.0))
    commits = dict((int(s), t) for s, t in rep.get("commit_times") or [])
    for r in rep["recoveries"]:
        g = r.get("generation")
        evs = [e for e in events if e.get("generation") == g]
        start = next((e.get("fault_time") for e in evs if e.get("phase") == "detect"), None)
        t = start if start is not None else (evs[0]["time"] if evs else None)
        if t is None:
            continue
        for ph, d in r.get("phases", {}).items():
            if d > 0:
                out.append((ph, t, t + d, r.get("rank")))
                t += d
    for m in rep.get("migrations", []):
        evs = {e["phase"]: e["time"] for e in events if e.get("generation") == m.get("generation") and "phase" in e}
        t = evs.get("request")
        for ph, d in m.get("phases", {}).items():
            if t is not None and d > 0:
                out.append((ph, t, t + d, m.get("rank")))
                t += d
        step = m.get("switch_step")
        if step in commits and step + 1 in commits:
            out.append(("switch", commits[step], commits[step + 1], m.get("rank")))
    return out


def plot(rep: dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'livemig[bench]'") from None
    commits = sorted((int(s), float(t)) for s, t in rep.get("commit_times") or [])
    world = int(rep.get("world_size") or 1)
    if not commits:
        raise ConfigError("the report holds no commit times to draw (the run committed no step)")
    t0 = commits[0][1]
    members = rep.get("members") or {}
    median = float(rep.get("step_time_s_median") or 0.0)
    # a step is the time between two group-wide commits; a gap a recovery or a pause holds is not one
    bars = [(a - t0, b - a) for (_, a), (_, b) in zip(commits, commits[1:], strict=False)
            if not median or b - a <= 3 * median]  # fmt: skip
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.6 * world))
    for rank in range(world):
        first = (members.get(str(rank)) or {}).get("first_commit")
        since = float(first[1]) if isinstance(first, list) and len(first) == 2 else t0
        ax.broken_barh(bars, (rank - 0.35, 0.7), facecolors=["#c7c7c7", "#a0a0a0"] * (len(bars) // 2 + 1),
                       edgecolor="none")  # fmt: skip
        joined = (members.get(str(rank)) or {}).get("joined_at_step")
        if joined and since > t0:
            ax.axvline(since - t0, ymin=0, ymax=1, color="black", lw=0.6, ls=":")
            ax.annotate("spare arrives", (since - t0, rank + 0.4), fontsize=7)
    seen: set[str] = set()
    for ph, a, b, rank in spans(rep):
        rows = [rank] if isinstance(rank, int) else list(range(world))
        for r in rows:
            ax.broken_barh([(a - t0, b - a)], (r - 0.45, 0.9), facecolors=PHASE_COLOURS.get(ph, "#7f7f7f"),
                           alpha=0.85, label=None if ph in seen else ph)  # fmt: skip
            seen.add(ph)
    ax.set_yticks(range(world), [f"rank {r}" for r in range(world)])
    ax.set_xlabel("seconds since the first commit (grey: committed steps; colours: recovery phases)")
    ax.set_title(f"livemig job {rep['job']}: {rep['steps_completed']} steps, "
                 f"{len(rep['recoveries'])} recoveries, {len(rep.get('migrations', []))} migrations")  # fmt: skip
    if seen:
        ax.legend(loc="upper left", fontsize=7, ncol=min(8, len(seen)))
    ax.set_ylim(-0.6, world - 0.4 + 0.6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cmd_report(a: argparse.Namespace) -> int:
    rep = load(a.file)
    print(text(rep))
    if a.plot:
        plot(rep, a.plot)
        print(f"timeline written to {a.plot}")
    return 0
