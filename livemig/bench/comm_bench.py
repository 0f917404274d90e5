"""`livemig bench comm`: the two communicators side by side (comm/communicator.py).

In one run, interleaved: (a) forming a generation of N members (threads of this process, each
with its own communicator, on a real TCPStore and gloo): `swap` builds a new backend each time,
`reconfigure` re-forms one it holds; (b) the reference kill (examples/mlp.py, 2 workers, 1
spare, rank 1 SIGKILLed) under each, its downtime and `build` phase from the report. Prints
the medians and reconfigure / swap. Needs torch >= 2.14 (the reconfigure API).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
import uuid
from datetime import timedelta
from typing import Any

from livemig.config import ENV_COMM

KINDS = ("swap", "reconfigure")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--members", type=int, nargs="+", default=[4, 8], help="group sizes to form (default 4 8)")
    p.add_argument("--forms", type=int, default=10, help="generations formed per size and kind per round")
    p.add_argument("--repeat", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--kills", type=int, default=3, help="kill runs per kind, interleaved (0: none)")
    p.add_argument("--json", help="write every figure and raw sample here")


def _forms(addr: str, kind: str, world: int, gens: range) -> list[float]:
    import torch

    from livemig.comm import communicator

    comms = [communicator.pick("gloo", kind) for _ in range(world)]
    pgs: list[Any] = [None] * world
    times = []
    t = timedelta(seconds=60)
    for g in gens:
        t0 = time.monotonic()

        def one(r: int, gen: int = g) -> None:
            pgs[r] = comms[r].form(addr, gen, r, world, t)

        threads = [threading.Thread(target=one, args=(r,)) for r in range(world)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        times.append(time.monotonic() - t0)
        works = [pg.allreduce([torch.ones(1)]) for pg in pgs]
        for w in works:
            w.wait()
        for c, pg in zip(comms, pgs, strict=True):
            c.retire(pg, idle=True)
    for c in comms:
        c.release()
    return times


def _kill(kind: str) -> dict[str, Any]:
    from livemig.agent.launcher import run
    from livemig.agent.run_config import RunConfig
    from livemig.bench.downtime_bench import MLP
    from livemig.faults import parse_fault

    before = os.environ.get(ENV_COMM)
    os.environ[ENV_COMM] = kind  # the workers and the spare inherit it
    try:
        cfg = RunConfig(script=MLP, args=["--steps", "40"], nproc=2, spares=1, job=f"comm-{uuid.uuid4().hex[:6]}",
                        quiet=True, max_wall=300, faults=[parse_fault("kill:rank=1:step=20")])  # fmt: skip
        rep = run(cfg)
    finally:
        if before is None:
            os.environ.pop(ENV_COMM, None)
        else:
            os.environ[ENV_COMM] = before
    rec = (rep.get("recoveries") or [{}])[0]
    build = next((e for e in rep.get("timeline", []) if e["phase"] == "build"), {})
    return {"ok": (rep.get("result") or {}).get("state") == "done" and bool(rec), "downtime_s": rec.get("downtime_s"),
            "build_s": (rec.get("phases") or {}).get("build"), "comm": build.get("comm"),
            "reconfigures": build.get("reconfigures"), "digest": rep.get("state_digest")}  # fmt: skip


def run_comm(a: argparse.Namespace) -> int:
    import torch.distributed as dist

    from livemig.comm.communicator import reconfigure_available

    if not reconfigure_available():
        import torch

        raise SystemExit(f"livemig bench comm: torch {torch.__version__} has no reconfigure API (2.14 and later)")
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    addr = f"127.0.0.1:{master.port}"
    forms: dict[int, dict[str, list[float]]] = {n: {k: [] for k in KINDS} for n in a.members}
    gen = 1
    for r in range(a.repeat):
        for n in a.members:
            for kind in KINDS:
                forms[n][kind] += _forms(addr, kind, n, range(gen, gen + a.forms))
                gen += a.forms
        print(f"  round {r + 1}/{a.repeat}: forms done", flush=True)
    kills: dict[str, list[dict]] = {k: [] for k in KINDS}
    for r in range(a.kills):
        for kind in KINDS:
            print(f"  kill {r + 1}/{a.kills}: {kind} ...", flush=True)
            kills[kind].append(_kill(kind))
    print(f"\nforming a generation (gloo, members as threads; {a.repeat} rounds x {a.forms} forms, median):")
    result: dict[str, Any] = {"forms": {}, "kills": kills}
    for n in a.members:
        s, rc = statistics.median(forms[n]["swap"]), statistics.median(forms[n]["reconfigure"])
        result["forms"][n] = {"swap_s": s, "reconfigure_s": rc, "ratio": rc / s, "samples": forms[n]}
        print(f"  {n:3d} members   swap {s * 1e3:7.1f} ms   reconfigure {rc * 1e3:7.1f} ms   ratio {rc / s:5.2f}")
    if a.kills:
        print("the reference kill (examples/mlp.py, 2 workers + 1 spare), median:")
        for kind in KINDS:
            ok = [x for x in kills[kind] if x["ok"]]
            if not ok:
                print(f"  {kind}: every run failed")
                continue
            down = statistics.median(x["downtime_s"] for x in ok)
            build = statistics.median(x["build_s"] for x in ok)
            result[f"{kind}_downtime_s"] = down
            print(f"  {kind:12s} downtime {down:.3f} s   build {build:.3f} s   ({len(ok)}/{len(kills[kind])} ok)")
        digests = {x["digest"] for k in KINDS for x in kills[k] if x["ok"]}
        print(f"  final state equal across every run: {'yes' if len(digests) == 1 else 'no'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return 0
