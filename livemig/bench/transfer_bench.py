"""`livemig bench transfer`: livemig's state transfer next to the raw link.

In one run, interleaved R times: (a) the raw link, a plain TCP stream of the
same byte count over loopback between two processes, received with
`recv_into` into one pre-allocated buffer (what `ratio_to_link` divides by),
and a zmq PUSH/PULL of it for reference; (b) livemig's
pull of a synthetic state of M MB (tensors of mixed sizes and dtypes, like a
model plus optimizer) from S source processes into pre-allocated tensors;
(c) the checksum's own speed. Receiver peak extra memory is read from the
kernel (VmHWM after resetting it via /proc/self/clear_refs), over the RSS
with the destination tensors already allocated and touched. Each side's CPU
seconds per GB, for the link and for the pull, say whether the pull is bound
by the host's cores rather than by livemig (`cpu_bound_ratio`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

import torch
import zmq

from livemig.bench import proc_cpu_s
from livemig.config import ENV_VERIFIERS
from livemig.transfer import protocol as P
from livemig.transfer.channel import verifiers
from livemig.transfer.puller import pull

SECRET = b"bench-secret"


def synthetic_state(mb: int) -> dict[str, torch.Tensor]:
    """Deterministic tensors of mixed sizes/dtypes totalling ~mb MiB."""
    sizes = [16 << 20, 4 << 20, 64 << 10, 4 << 10, 33 << 20, 1 << 20, 8 << 20, 512]
    out: dict[str, torch.Tensor] = {}
    total, i = 0, 0
    target = mb << 20
    while total < target:
        n = min(sizes[i % len(sizes)], target - total)
        dtype = torch.bfloat16 if i % 3 == 2 else torch.float32
        numel = max(1, n // (2 if dtype == torch.bfloat16 else 4))
        out[f"t{i}"] = torch.full((numel,), float(i % 7), dtype=dtype)
        total += numel * (2 if dtype == torch.bfloat16 else 4)
        i += 1
    return out


def _serve(mb: int) -> None:
    from livemig.transfer.server import StateServer

    state = synthetic_state(mb)
    srv = StateServer("bench", SECRET)
    srv.publish(1, "state", lambda: (0, state))
    print(srv.addr, flush=True)
    sys.stdin.read()  # until the parent closes our stdin


def _from_memory(mb: int) -> memoryview:
    """The link's bytes: as many as the state's, all in memory. A 4 MiB buffer sent again
    and again would stay in the CPU's cache, a link no state transfer has."""
    n = (mb << 20) // P.CHUNK_BYTES * P.CHUNK_BYTES
    return memoryview(bytearray(os.urandom(1 << 20)) * (n >> 20))


def _push(port: int, mb: int) -> None:
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.PUSH)
    buf = _from_memory(mb)
    s.connect(f"tcp://127.0.0.1:{port}")
    for off in range(0, len(buf), P.CHUNK_BYTES):
        s.send(buf[off : off + P.CHUNK_BYTES], copy=False)
    s.send(b"")
    s.close(linger=-1)
    ctx.term()  # flush: exiting with zero-copy frames in flight frees their memory under zmq


def _tcp_push(port: int, mb: int) -> None:
    import socket

    buf = _from_memory(mb)
    conn = socket.create_connection(("127.0.0.1", port))
    for off in range(0, len(buf), P.CHUNK_BYTES):
        conn.sendall(buf[off : off + P.CHUNK_BYTES])
    conn.close()


class Cpu:
    """CPU seconds per GB moved, each side, of one transfer: where the time goes when
    the transfer is CPU-bound (on a loopback bench both sides share the host's cores)."""

    def __init__(self, send_s: float, recv_s: float, nbytes: int, wall_s: float) -> None:
        self.send = send_s / (nbytes / 1e9)
        self.recv = recv_s / (nbytes / 1e9)
        self.wall = wall_s / (nbytes / 1e9)
        self.measurable = send_s + recv_s >= 0.1  # ten ticks of the kernel's accounting, at least


def tcp_link_once(mb: int, cpu: list[Cpu] | None = None) -> float:
    """The raw link: a TCP stream of mb MiB received with recv_into into a touched buffer."""
    import socket

    lsock = socket.create_server(("127.0.0.1", 0))
    dest = memoryview(bytearray((mb << 20) // P.CHUNK_BYTES * P.CHUNK_BYTES))  # zero-filled: touched
    p = _spawn("--role", "tcp-push", "--port", str(lsock.getsockname()[1]), "--size-mb", str(mb))
    conn, _ = lsock.accept()
    got = conn.recv_into(dest)
    t0, first = time.perf_counter(), got
    send0, recv0 = proc_cpu_s(p.pid), time.process_time()
    while got < len(dest):  # MSG_WAITALL: one call per chunk, the fastest raw receive measured
        k = conn.recv_into(dest[got:], min(P.CHUNK_BYTES, len(dest) - got), socket.MSG_WAITALL)
        if not k:
            break
        got += k
    dt = time.perf_counter() - t0
    if cpu is not None:
        cpu.append(Cpu(proc_cpu_s(p.pid) - send0, time.process_time() - recv0, got - first, dt))
    conn.close()
    lsock.close()
    p.wait()
    return (got - first) / dt / 1e9


def _spawn(*args: str, encrypt: bool = False, n_verifiers: str | None = None) -> subprocess.Popen:
    env = dict(os.environ, **{P.ENV_ENCRYPT: "1" if encrypt else "0"})
    if n_verifiers is not None:
        env[ENV_VERIFIERS] = n_verifiers
    return subprocess.Popen([sys.executable, "-m", "livemig.bench.transfer_bench", *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)  # fmt: skip


def link_once(mb: int) -> float:
    ctx = zmq.Context.instance()
    pull_sock = ctx.socket(zmq.PULL)
    port = pull_sock.bind_to_random_port("tcp://127.0.0.1")
    p = _spawn("--role", "push", "--port", str(port), "--size-mb", str(mb))
    first = pull_sock.recv(copy=False)
    t0 = time.perf_counter()
    nbytes = len(first.buffer)
    while True:
        f = pull_sock.recv(copy=False)
        if not len(f.buffer):
            break
        nbytes += len(f.buffer)
    dt = time.perf_counter() - t0
    p.wait()
    pull_sock.close(0)
    # the first chunk's time is not measured: scale to the bytes after it
    return (nbytes - P.CHUNK_BYTES) / dt / 1e9


def _status_mb(field: str) -> float:
    """A memory figure (VmRSS, VmHWM) of this process from /proc, in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def livemig_once(addrs: list[str], mb: int, encrypt: bool = False, n_verifiers: str | None = None,
                 sources: Sequence[int] = (), cpu: list[Cpu] | None = None) -> tuple[float, float]:  # fmt: skip
    """One pull in a fresh receiver process, so its peak memory is its own. `sources`:
    the serving processes' pids, whose CPU time over the pull goes into `cpu`."""
    p = _spawn("--role", "recv", "--size-mb", str(mb), "--addrs", ",".join(addrs), encrypt=encrypt,
               n_verifiers=n_verifiers)  # fmt: skip
    send0 = sum(proc_cpu_s(pid) for pid in sources)  # the sources idle until the pull starts
    out, _ = p.communicate(timeout=600)
    r = json.loads(out.decode().strip().splitlines()[-1])
    if cpu is not None:
        cpu.append(Cpu(sum(proc_cpu_s(pid) for pid in sources) - send0, r["cpu_s"], r["nbytes"], r["seconds"]))
    return r["gbps"], r["extra_mb"]


def _recv(addrs: list[str], mb: int) -> None:
    template = synthetic_state(mb)
    dests = [torch.zeros_like(t) for t in template.values()]  # allocated and touched
    del template
    base = _status_mb("VmRSS")
    reset = _reset_hwm()
    verifiers()  # calibrated at a spare's warm-up, not in its pull
    t0, c0 = time.perf_counter(), time.process_time()
    got = pull(addrs, "bench", SECRET, 1, "state", 30.0, lambda i, m: dests[i])
    dt, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    extra = (_status_mb("VmHWM") - base) if reset else float("nan")
    print(json.dumps({"gbps": got.nbytes / dt / 1e9, "extra_mb": extra, "seconds": dt, "cpu_s": cpu_s,
                      "nbytes": got.nbytes}), flush=True)  # fmt: skip


def checksum_gbps(template: dict[str, torch.Tensor]) -> float:
    bufs = [t.reshape(-1).view(torch.uint8).numpy() for t in template.values()]
    total = sum(b.nbytes for b in bufs)
    key = P.reply_key(SECRET)
    t0 = time.perf_counter()
    for i, b in enumerate(bufs):
        for off in range(0, b.nbytes, P.CHUNK_BYTES):
            P.chunk_mac(P.chunk_key(key, 1, "state", 0, i), b[off : off + P.CHUNK_BYTES])
    return total / (time.perf_counter() - t0) / 1e9


# -- a CUDA state, both ends on the device (issue 49; scripts/gpu_check.sh's transfer check) --
def _cuda_state(mb: int) -> dict[str, torch.Tensor]:
    return {k: v.to("cuda") for k, v in synthetic_state(mb).items()}


def _serve_cuda(mb: int) -> None:
    from livemig.transfer.server import StateServer

    state = _cuda_state(mb)
    srv = StateServer("bench", SECRET)
    srv.publish(1, "state", lambda: (0, state))
    print(srv.addr, flush=True)
    sys.stdin.read()


def cuda_transfer(mb: int, repeat: int) -> tuple[str, str]:
    """A CUDA state of `mb` MiB served by another process and pulled into CUDA tensors
    `repeat` times (also `livemig bench transfer --device cuda`)."""
    if not torch.cuda.is_available():
        return "SKIP", f"no CUDA device (torch {torch.__version__}, built with CUDA {torch.version.cuda or 'none'})"
    p = subprocess.Popen([sys.executable, "-m", "livemig.bench.transfer_bench", "--role", "serve-cuda",
                          "--size-mb", str(mb)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        addr = (p.stdout.readline() if p.stdout else "").strip()
        if not addr:
            return "FAIL", "the serving process printed no address"
        want = _cuda_state(mb)
        times = []
        for _ in range(max(1, repeat)):
            dest = {k: torch.empty_like(v) for k, v in want.items()}
            names = list(dest)
            torch.cuda.synchronize()
            got = pull(addr, "bench", SECRET, 1, "state", timeout=60,
                       alloc=lambda i, meta, d=dest, n=names: d[n[i]])  # fmt: skip
            torch.cuda.synchronize()
            times.append(got.seconds)
            if not all(torch.equal(dest[k], want[k]) for k in want):
                return "FAIL", "the pulled CUDA state differs from the served one"
        gbps = got.nbytes / min(times) / 1e9
        return "PASS", (f"{got.nbytes / 2**20:.0f} MiB CUDA -> CUDA bit-exact, {gbps:.2f} GB/s (best of {len(times)}); "
                        f"host staging: {got.nbytes / 2**20:.0f} MiB on each side")  # fmt: skip
    finally:
        if p.stdin:
            p.stdin.close()
        p.wait(timeout=30)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-mb", type=int, default=1024, help="state size in MiB (default 1024)")
    p.add_argument("--sources", type=int, default=1, help="source processes (default 1)")
    p.add_argument("--repeat", type=int, default=3, help="interleaved repetitions (default 3)")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--encrypt", action="store_true",
                   help="also pull over zmq CURVE (LIVEMIG_TRANSFER_ENCRYPT=1), interleaved: its cost")  # fmt: skip
    p.add_argument("--verifiers", default="",
                   help="comma-separated LIVEMIG_TRANSFER_VERIFIERS values (e.g. 0,2) pulled too, interleaved: "
                        "a row each, next to the default's")  # fmt: skip
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cuda: a CUDA state served and pulled into CUDA tensors (livemig/bench/gpu_check.py): "
                        "bit-exact, GB/s, the host memory staged")  # fmt: skip


def run(a: argparse.Namespace) -> int:
    if a.device == "cuda":
        status, detail = cuda_transfer(a.size_mb, a.repeat)
        print(f"{status} transfer --device cuda: {detail}")
        return 0 if status == "PASS" else 1
    template = synthetic_state(a.size_mb)
    servers = [_spawn("--role", "serve", "--size-mb", str(a.size_mb)) for _ in range(a.sources)]
    enc_servers = [_spawn("--role", "serve", "--size-mb", str(a.size_mb), encrypt=True)
                   for _ in range(a.sources if a.encrypt else 0)]  # fmt: skip
    servers += enc_servers
    try:
        addrs = [s.stdout.readline().decode().strip() for s in servers[: a.sources]]
        enc_addrs = [s.stdout.readline().decode().strip() for s in enc_servers]
        t0 = time.perf_counter()
        pull(addrs, "bench", SECRET, 1, "state", 60.0, lambda i, m: None)  # warm: snapshot hashes
        warm_s = time.perf_counter() - t0
        if enc_addrs:
            livemig_once(enc_addrs, a.size_mb, encrypt=True)  # warm its snapshot too
        links, zlinks, ours, extras, encs = [], [], [], [], []
        link_cpu: list[Cpu] = []
        our_cpu: list[Cpu] = []
        pids = [s.pid for s in servers[: a.sources]]
        modes: dict[str, list[float]] = {v.strip(): [] for v in a.verifiers.split(",") if v.strip()}
        for _ in range(a.repeat):
            links.append(tcp_link_once(a.size_mb, link_cpu))
            zlinks.append(link_once(a.size_mb))
            g, extra = livemig_once(addrs, a.size_mb, sources=pids, cpu=our_cpu)
            ours.append(g)
            extras.append(extra)
            for v, got in modes.items():
                got.append(livemig_once(addrs, a.size_mb, n_verifiers=v)[0])
            if enc_addrs:
                encs.append(livemig_once(enc_addrs, a.size_mb, encrypt=True)[0])
        ck = checksum_gbps(template)
    finally:
        for s in servers:
            s.stdin.close()
            s.terminate()
            s.wait()
    res = {
        "size_mb": a.size_mb,
        "sources": a.sources,
        "tensors": len(template),
        "link_gbps": statistics.median(links),
        "zmq_link_gbps": statistics.median(zlinks),
        "livemig_gbps": statistics.median(ours),
        "ratio_to_link": statistics.median(o / link for o, link in zip(ours, links, strict=True)),
        "checksum_gbps": ck,
        "receiver_peak_extra_mb": max(extras),
        "first_pull_with_snapshot_s": warm_s,
        "window": P.WINDOW,
        "chunk_mb": P.CHUNK_BYTES / 2**20,
        "samples": {
            "link_gbps": links,
            "zmq_link_gbps": zlinks,
            "livemig_gbps": ours,
            "receiver_peak_extra_mb": extras,
        },
    }
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1

    def med(rows: list[Cpu], f: str) -> float:
        return statistics.median(getattr(r, f) for r in rows)

    res["cpu_s_per_gb"] = {
        "link": {"send": med(link_cpu, "send"), "recv": med(link_cpu, "recv")},
        "livemig": {"send": med(our_cpu, "send"), "recv": med(our_cpu, "recv")},
    }
    # the most any schedule of livemig's measured CPU work reaches against the link's wall
    # time, when both sides share this host's cores (a loopback bench): a bound, not a forecast
    # (None where the transfer was too short for the kernel's CPU accounting, 10 ms ticks)
    bounds = [k.wall / ((o.send + o.recv) / cores) for k, o in zip(link_cpu, our_cpu, strict=True) if o.measurable]
    res["cpu_bound_ratio"] = statistics.median(bounds) if bounds else None
    res["cores"] = cores
    res["verifiers"] = verifiers()  # what the default ("auto" unless set) chose here
    res["verifier_rows"] = {v: {"gbps": statistics.median(got),
                                "ratio_to_link": statistics.median(o / k for o, k in zip(got, links, strict=True))}
                            for v, got in modes.items()}  # fmt: skip
    if encs:
        res["encrypted_gbps"] = statistics.median(encs)
        res["encrypted_ratio_to_plain"] = statistics.median(e / o for e, o in zip(encs, ours, strict=True))
        res["samples"]["encrypted_gbps"] = encs
    print(f"transfer of {a.size_mb} MiB ({len(template)} tensors) from {a.sources} source(s), "
          f"{a.repeat} interleaved runs (GB/s = 1e9 bytes/s)")  # fmt: skip
    spread = f"min {min(links):.2f} max {max(links):.2f}"
    print(f"  link_gbps               {res['link_gbps']:.2f}   (raw TCP recv_into, {spread})")
    print(f"  zmq_link_gbps           {res['zmq_link_gbps']:.2f}   (raw zmq PUSH/PULL, for reference)")
    print(f"  livemig_gbps            {res['livemig_gbps']:.2f}   (min {min(ours):.2f} max {max(ours):.2f})")
    print(f"  ratio_to_link           {res['ratio_to_link']:.2f}   (verifier threads: {res['verifiers']})")
    for v, row in res["verifier_rows"].items():
        print(f"    {ENV_VERIFIERS}={v}: {row['gbps']:.2f} GB/s, ratio_to_link {row['ratio_to_link']:.2f}")
    c = res["cpu_s_per_gb"]
    print(
        f"  cpu_s_per_gb            link: send {c['link']['send']:.2f} recv {c['link']['recv']:.2f}; "
        f"livemig: send {c['livemig']['send']:.2f} recv {c['livemig']['recv']:.2f}"
    )
    bound = "n/a" if res["cpu_bound_ratio"] is None else f"{res['cpu_bound_ratio']:.2f}"
    print(f"  cpu_bound_ratio         {bound}   (the most livemig's CPU work allows against "
          f"the link when both sides share {cores} core(s))")  # fmt: skip
    print(f"  checksum_gbps           {ck:.2f}   (chunk MAC: AES-GMAC, one thread)")
    print(f"  receiver_peak_extra_mb  {res['receiver_peak_extra_mb']:.1f}")
    if encs:
        print(f"  encrypted_gbps          {res['encrypted_gbps']:.2f}   (zmq CURVE; min {min(encs):.2f} "
              f"max {max(encs):.2f})")  # fmt: skip
        print(f"  encrypted_ratio_to_plain {res['encrypted_ratio_to_plain']:.2f}")
    print(f"  first pull incl. source snapshot hashing: {warm_s:.3f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--role", choices=["serve", "serve-cuda", "push", "tcp-push", "recv"], required=True)
    p.add_argument("--addrs", default="")
    p.add_argument("--size-mb", type=int, default=1024)
    p.add_argument("--port", type=int)
    a = p.parse_args()
    if a.role == "serve-cuda":
        _serve_cuda(a.size_mb)
    elif a.role == "serve":
        _serve(a.size_mb)
    elif a.role == "recv":
        _recv(a.addrs.split(","), a.size_mb)
    elif a.role == "tcp-push":
        _tcp_push(a.port, a.size_mb)
    else:
        _push(a.port, a.size_mb)
