"""The GPU checks behind `scripts/gpu_check.sh`: one line per check, PASS / FAIL / SKIP.

Written for a machine with a GPU, no network and a torch nobody may replace: it imports only
what is installed (the script puts livemig's other dependencies on the path from a folder of
wheels), starts real jobs with `python -m livemig.cli run`, and never installs anything. A
check the host cannot run prints `SKIP <name>: <reason>`; the exit status is 1 if any check
failed, else 0.

    python -m livemig.bench.gpu_check [--quick] [--only NAME ...]

Checks (README, "GPUs"; docs/benchmarks.md records the last run):
  setup     no GPU needed: livemig and its dependencies import, the bundled etcd serves a
            write and a read (the folder of wheels was complete)
  transfer  a CUDA state pulled from a server process into CUDA tensors: bit-exact, GB/s,
            the host memory staged on each side
  plain     2 workers + 1 spare on one GPU (CUDA tensors over gloo), rank 1 killed: --verify
  zero1     the same with ZeRO-1 (examples/mlp_zero1.py)
  fsdp2     HSDP 2x2 on one GPU (examples/fsdp2_lm.py --device cuda), a kill: --verify
  nccl      an NCCL world of one formed, aborted within a bound, formed again; nccl2's presence
  warmup    warm vs cold activation of a spare, on the GPU (`livemig bench warmup` with --device)
  multi     with 2+ GPUs: an NCCL job (one rank per GPU) with a kill and a migration
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
CHECKS = ("setup", "transfer", "plain", "zero1", "fsdp2", "nccl", "warmup", "multi")


def _cuda() -> str:  # also transfer_bench's
    """'' when CUDA is usable, else why not."""
    if not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__}, built with CUDA {torch.version.cuda or 'none'})"
    return ""


def check_setup(a: argparse.Namespace) -> tuple[str, str]:
    from livemig.rdzv.client import EtcdClient
    from livemig.rdzv.embedded import EtcdCluster, find_etcd_binary

    binary = find_etcd_binary()
    with tempfile.TemporaryDirectory(prefix="livemig-gpu-etcd-") as root:
        with EtcdCluster(root=root) as etcd:
            etcd.wait_healthy(20)
            c = EtcdClient(etcd.endpoints)
            c.put("/gpu-check", b"ok")
            got = c.get("/gpu-check")
            c.close()
    if got is None or got.value != b"ok":
        return "FAIL", "the bundled etcd did not return what was written"
    return "PASS", f"livemig imports, etcd ({binary}) wrote and read a key"


# -- transfer ---------------------------------------------------------------------------------
def check_transfer(a: argparse.Namespace) -> tuple[str, str]:
    from livemig.bench.transfer_bench import cuda_transfer

    return cuda_transfer(64 if a.quick else 512, 2 if a.quick else 3)


# -- jobs ---------------------------------------------------------------------------------------
def _job(script: str, args: list[str], nproc: int, spares: int, faults: list[str], env: dict[str, str],
         timeout: float) -> tuple[str, str]:  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="livemig-gpu-") as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "livemig.cli", "run", "--nproc", str(nproc), "--spares", str(spares),
               "--verify", "--report", str(report), *sum((["--fault", f] for f in faults), []),
               str(REPO / script), *args]  # fmt: skip
        full = {**os.environ, "LIVEMIG_STATE_DIR": tmp, **env}
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full, cwd=tmp)
        except subprocess.TimeoutExpired:
            return "FAIL", f"the job did not end within {timeout:.0f}s"
        out = p.stdout + p.stderr
        line = next((x.strip() for x in out.splitlines() if "bit-identical" in x), "")
        if p.returncode != 0 or "bit-identical: yes" not in line:
            tail = " | ".join(x.strip() for x in out.splitlines()[-3:])
            return "FAIL", f"exit {p.returncode}: {line or tail}"[:400]
        rep = json.loads(report.read_text()) if report.exists() else {}
        rec = (rep.get("recoveries") or [{}])[0]
        return "PASS", f"{line}; downtime {rec.get('downtime_s', '?')} s"


MLP_ARGS = ["--steps", "20", "--width", "512", "--layers", "4", "--device", "cuda"]


def _one_gpu_kill(script: str, args: list[str], nproc: int, step: int, timeout: float) -> tuple[str, str]:
    """A job whose ranks share the one GPU (CUDA tensors over gloo) and a spare; rank 1 killed."""
    why = _cuda()
    if why:
        return "SKIP", why
    return _job(script, args, nproc, 1, [f"kill:rank=1:step={step}"], {"LIVEMIG_BACKEND": "gloo"}, timeout)


def check_plain(a: argparse.Namespace) -> tuple[str, str]:
    return _one_gpu_kill("examples/mlp.py", MLP_ARGS, 2, 10, 150)


def check_zero1(a: argparse.Namespace) -> tuple[str, str]:
    return _one_gpu_kill("examples/mlp_zero1.py", MLP_ARGS, 2, 10, 150)


def check_fsdp2(a: argparse.Namespace) -> tuple[str, str]:
    return _one_gpu_kill("examples/fsdp2_lm.py", ["--steps", "12", "--replicate", "2", "--device", "cuda"], 4, 6, 180)


def check_nccl(a: argparse.Namespace) -> tuple[str, str]:
    why = _cuda()
    if why:
        return "SKIP", why
    import torch.distributed as dist

    if not dist.is_nccl_available():
        return "SKIP", f"torch {torch.__version__} was built without NCCL"
    from datetime import timedelta

    t = timedelta(seconds=30)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=t)
    figures = []
    for round_ in (1, 2):
        t0 = time.monotonic()
        pg = dist.ProcessGroupNCCL(dist.PrefixStore(f"r{round_}", store), 0, 1, dist.ProcessGroupNCCL.Options())
        x = torch.ones(4, device="cuda")
        pg.allreduce([x]).wait()
        torch.cuda.synchronize()
        formed = time.monotonic() - t0
        if not torch.equal(x, torch.ones(4, device="cuda")):
            return "FAIL", "an all-reduce over a world of one changed its input"
        t1 = time.monotonic()
        done = threading.Event()

        def abort(g: object = pg, ev: threading.Event = done) -> None:
            getattr(g, "abort", getattr(g, "shutdown", lambda: None))()
            ev.set()

        threading.Thread(target=abort, daemon=True).start()
        if not done.wait(10.0):
            return "FAIL", f"round {round_}: the abort did not return within 10 s"
        figures.append(f"formed {formed * 1e3:.0f} ms, aborted {(time.monotonic() - t1) * 1e3:.0f} ms")
    from livemig.comm.communicator import ReconfigureComm, nccl2_available

    ver = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "?"
    if not nccl2_available():
        return "PASS", f"NCCL {ver}: " + "; then ".join(figures) + "; nccl2 absent from this torch"
    rc = ReconfigureComm("nccl")  # livemig's reconfigure communicator over nccl2: a world of one, re-formed
    forms = []
    for g in (1, 2, 3):
        t0 = time.monotonic()
        pg = rc.form(f"127.0.0.1:{store.port}", g, 0, 1, t)
        x = torch.full((4,), 2.0, device="cuda")
        pg.allreduce([x]).wait()
        torch.cuda.synchronize()
        forms.append(time.monotonic() - t0)
        if not torch.equal(x, torch.full((4,), 2.0, device="cuda")):
            return "FAIL", f"nccl2 re-form {g}: an all-reduce over a world of one changed its input"
        rc.retire(pg, idle=True)
    st = rc.stats()
    rc.release()
    ms = ", ".join(f"{x * 1e3:.0f}" for x in forms)
    return "PASS", (
        f"NCCL {ver}: "
        + "; then ".join(figures)
        + f"; nccl2 re-formed 3 times through livemig's communicator ({ms} ms, {st['created']} object)"
    )


def check_warmup(a: argparse.Namespace) -> tuple[str, str]:
    why = _cuda()
    if why:
        return "SKIP", why
    with tempfile.TemporaryDirectory(prefix="livemig-gpu-") as tmp:
        out = Path(tmp) / "warmup.json"
        cmd = [sys.executable, "-m", "livemig.cli", "bench", "warmup", "--device", "cuda", "--repeat", "1",
               "--steps", "20", "--fail-at", "10", "--width", "1024", "--layers", "8", "--json", str(out)]  # fmt: skip
        env = {**os.environ, "LIVEMIG_BACKEND": "gloo", "LIVEMIG_STATE_DIR": tmp}
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env, cwd=tmp)
        if p.returncode != 0 or not out.exists():
            return "FAIL", f"exit {p.returncode}: " + " | ".join((p.stdout + p.stderr).strip().splitlines()[-2:])
        r = json.loads(out.read_text())
    return "PASS", (f"warm activation {r['warm_activation_s']:.3f} s, cold {r['cold_activation_s']:.3f} s, "
                    f"warm/cold {r['warm_over_cold']:.3f} (target <= 0.1)")  # fmt: skip


def check_multi(a: argparse.Namespace) -> tuple[str, str]:
    why = _cuda()
    if why:
        return "SKIP", why
    if torch.cuda.device_count() < 2:
        return "SKIP", f"{torch.cuda.device_count()} GPU: an NCCL job needs one rank per GPU"
    return _job("examples/mlp.py", MLP_ARGS, 2, 1, ["kill:rank=1:step=8", "migrate:rank=0:step=14"],
                {"LIVEMIG_BACKEND": "nccl"}, 180)  # fmt: skip


RUN: dict[str, Callable[[argparse.Namespace], tuple[str, str]]] = {
    "setup": check_setup, "transfer": check_transfer, "plain": check_plain, "zero1": check_zero1, "fsdp2": check_fsdp2,
    "nccl": check_nccl, "warmup": check_warmup, "multi": check_multi,
}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m livemig.bench.gpu_check")
    p.add_argument("--quick", action="store_true", help="smaller transfers and fewer repeats (<= 2 minutes)")
    p.add_argument("--only", nargs="*", choices=CHECKS, help="run these checks only")
    a = p.parse_args(argv)
    print(f"gpu_check: torch {torch.__version__}, python {sys.version.split()[0]}, "
          f"CUDA {'available: ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'unavailable'}",
          flush=True)  # fmt: skip
    failed = 0
    for name in a.only or CHECKS:
        t0 = time.monotonic()
        try:
            status, detail = RUN[name](a)
        except Exception as exc:  # noqa: BLE001 - one check's crash is its FAIL line, not the run's end
            status, detail = "FAIL", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:400]
        failed += status == "FAIL"
        print(f"{status} {name}: {detail} ({time.monotonic() - t0:.1f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
