"""`livemig-spare`: hot-spare daemons on standby nodes.

    livemig-spare start --job J [--etcd URL] [--pool P] [--id ID] SCRIPT [ARGS...]
    livemig-spare status --job J [--etcd URL] [--json]
    livemig-spare stop --job J [--etcd URL] (--id ID | --all)

`start` runs SCRIPT as a spare in the foreground (use your process
supervisor, or `--detach`): the decorator builds the model, registers the
spare as warm under a lease and blocks until the coordinator claims it. In
the foreground `livemig-spare` is the spare's agent (livemig/agent/children.py): it
reports its death at once and kills it if it is fenced and does not exit
(a wedged spare-turned-member); `--detach` runs this same agent in the
background (its own session, output in a log file), so detached spares keep it.
`stop` asks an unclaimed spare to exit through etcd, so it works for spares
on any host; a claimed spare is a member and is not stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from datetime import timedelta

from livemig import logs
from livemig.agent.children import Child
from livemig.agent.jobs import resolve, state_dir
from livemig.agent.nodes import default_host
from livemig.agent.spare_agent import StandbyAgent
from livemig.checkpoint_dir import run_checkpoint_env
from livemig.config import (
    ENV_BUDDY_STRIDE,
    ENV_ETCD,
    ENV_FOLLOW,
    ENV_FOLLOW_LAG,
    ENV_HOST,
    ENV_INCARNATION,
    ENV_JOB,
    ENV_METRICS,
    ENV_PARENT_PID,
    ENV_ROLE,
    ENV_SPARE_ID,
    ENV_WORLD_SIZE,
    Role,
    Timeouts,
    make_interruptible,
    stride_of,
    validate_job_name,
)  # fmt: skip
from livemig.errors import ConfigError, EtcdUnavailableError, LivemigError
from livemig.rdzv.client import EtcdClient, decode
from livemig.rdzv.keys import JobKeys
from livemig.rdzv.membership import new_incarnation
from livemig.rdzv.security import add_arguments as add_security_arguments
from livemig.rdzv.security import apply_arguments as apply_security_arguments
from livemig.rdzv.watch import wait_for
from livemig.rdzv.writes import put_if_absent


def _client(a: argparse.Namespace) -> tuple[EtcdClient, str]:
    job = validate_job_name(a.job)
    etcd, security = resolve(job, a.etcd)
    security.apply_to_environ()  # the spares this starts present the same credentials
    return EtcdClient(etcd, timedelta(seconds=a.etcd_timeout), security), etcd


def _detach(a: argparse.Namespace) -> int:
    """--detach: this command again, without --detach, in its own session with its output in
    a log file: the spares keep an agent (it kills a fenced spare that hangs, reports deaths)."""
    argv = list(a.raw_argv)
    cut = argv.index(a.script)  # --detach is an option of ours, before the script and its arguments
    argv = [x for x in argv[:cut] if x != "--detach"] + argv[cut:]
    path = os.path.join(state_dir(), "spares", f"{a.job}-{int(time.time())}-{os.getpid()}.log")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "ab") as f:
        p = subprocess.Popen([sys.executable, "-m", "livemig.spare_pool.cli", *argv], stdout=f,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    print(f"livemig-spare: {a.count} spare(s) for job {a.job} under agent pid {p.pid} (stop it with kill {p.pid}); "
          f"log {path}")  # fmt: skip
    return 0


def _wait_run(client: EtcdClient, etcd: str, a: argparse.Namespace) -> bytes:
    """The job's run key, once an agent of the job has written it: a spare may be started
    before the job (a batch script), so this waits --wait-job, announced once."""
    keys = JobKeys(a.job)
    deadline = time.monotonic() + a.wait_job
    announced = False
    while True:  # etcd may come up with the job (a batch script): wait for it too
        try:
            kv = client.get(keys.run, timedelta(seconds=min(a.etcd_timeout, 2.0)))
            if kv is not None:
                return kv.value
            if not announced:
                logs.say(f"livemig-spare: waiting for job {a.job} on etcd {etcd}, up to {a.wait_job:.0f} s "
                         "(--wait-job)")  # fmt: skip
                announced = True
            left = deadline - time.monotonic()
            if left <= 0:
                raise ConfigError(f"job {a.job} did not start on etcd {etcd} within {a.wait_job:.0f} s: is its "
                                  "`livemig run` started, under that name (--job)?")  # fmt: skip
            return wait_for(client, keys.run, lambda s: s.get(keys.run), left, f"job {a.job} to start")
        except TimeoutError:
            continue  # the deadline's line, above
        except EtcdUnavailableError:
            if not announced:
                logs.say(f"livemig-spare: etcd {etcd} does not answer; waiting for it and job {a.job}, "
                         f"up to {a.wait_job:.0f} s (--wait-job)")  # fmt: skip
                announced = True
            if time.monotonic() > deadline:
                raise ConfigError(f"etcd {etcd} did not answer within {a.wait_job:.0f} s: is it running, "
                                  "and is --etcd its client URL?") from None  # fmt: skip
            time.sleep(0.5)


def cmd_start(a: argparse.Namespace) -> int:
    logs.stacks_on_sigquit()
    if not os.path.isfile(a.script):
        raise ConfigError(f"training script {a.script!r} not found")
    if a.count < 1 or (a.id and a.count > 1):  # before any wait
        raise ConfigError("--count must be >= 1, and --id names a single spare (--count 1)")
    client, etcd = _client(a)
    if a.detach:  # an etcd that does not answer is said here, not later in a log nobody reads
        try:
            client.get(JobKeys(a.job).run, timedelta(seconds=a.etcd_timeout))
        except EtcdUnavailableError:
            raise ConfigError(f"etcd {etcd} does not answer: is it running, and is --etcd its client URL?") from None
        return _detach(a)
    keys = JobKeys(a.job)
    raw = _wait_run(client, etcd, a)
    run = decode(raw) or {}
    world = a.world_size or int(run.get("nnodes", 1)) * int(run.get("nproc_per_node", 0))
    if world < 1:
        raise ConfigError(f"job {a.job}'s run names no world size; pass --world-size")
    host = a.host or (default_host(etcd) if not etcd.startswith("http://127.") else "")
    stride = stride_of(run)
    ident = host or socket.gethostname()
    children = []
    for _ in range(a.count):
        sid = a.id or f"{a.pool}-{ident}-{uuid.uuid4().hex[:6]}"
        env = dict(os.environ)
        env.update(Timeouts.from_env().to_env())
        env.update({ENV_ETCD: etcd, ENV_JOB: a.job, ENV_ROLE: Role.SPARE, ENV_SPARE_ID: sid,
                    ENV_WORLD_SIZE: str(world)})  # fmt: skip
        if host:
            env[ENV_HOST] = host
        if a.follow:
            env[ENV_FOLLOW] = "1"  # keep the job's state step by step (runtime/follow.py)
        if a.follow_lag is not None:
            env[ENV_FOLLOW_LAG] = str(a.follow_lag)
        env[ENV_PARENT_PID] = str(os.getpid())  # its own session (a kill reaches its group only): exits with us
        if a.metrics_port is not None or run.get("metrics"):  # a claimed spare is a member: its figures
            env[ENV_METRICS] = "1"
        env.update(run_checkpoint_env(run))  # a claimed spare writes its part of the run's checkpoints
        if stride > 1:  # the job's buddies are on the next node: mirror as its members do
            env[ENV_BUDDY_STRIDE] = str(stride)
        env[ENV_INCARNATION] = new_incarnation(Role.SPARE, host or None)
        argv = [sys.executable, a.script, *a.args]
        logs.say(f"spare {sid}: standby for job {a.job} (world size {world})")
        proc = subprocess.Popen(argv, env=env, start_new_session=True)
        children.append(Child(f"spare {sid}", Role.SPARE, env[ENV_INCARNATION], proc, ""))

    def stop(*_: object) -> None:
        raise KeyboardInterrupt

    server = None
    if a.metrics_port is not None:  # the whole job's figures, read from etcd at each scrape
        from livemig.agent.metrics import JobMetrics, MetricsServer

        def snapshot() -> dict:
            kvs, _ = client.get_prefix(keys.prefix)
            return {kv.key: kv for kv in kvs}

        created = run.get("created")
        launched = float(created) if isinstance(created, int | float) else None
        server = MetricsServer(JobMetrics(keys, snapshot, client, launched_at=launched), a.metrics_port)
        logs.say(f"livemig-spare: metrics of job {a.job} on port {server.port}")
    old = signal.signal(signal.SIGTERM, stop)  # a SIGTERM stops the spares as Ctrl-C does
    try:
        return StandbyAgent(client, keys, children).run()  # agent/spare_agent.py
    finally:
        signal.signal(signal.SIGTERM, old)
        if server is not None:
            server.stop()


def cmd_status(a: argparse.Namespace) -> int:
    from livemig.cli.status import collect

    client, _ = _client(a)
    spares = collect(client, a.job)["spares"]
    if a.json:
        print(json.dumps(spares, indent=2))
        return 0
    from livemig.cli.status import follow_text

    print(f"{'SPARE':<32} {'STATE':<9} {'WARMUP_S':>8} {'DEVICE_MB':>9}  {'HOST':<16} {'PID':>7}  CLAIM  FOLLOW")
    for s in spares:
        w = "-" if s["warmup_s"] is None else f"{s['warmup_s']:.2f}"
        dev = "-" if s.get("device_mb") is None else f"{s['device_mb']:.0f}"
        claim = s["claim"] or "-"
        print(f"{s['id']:<32} {s['state'] or '-':<9} {w:>8} {dev:>9}  {s['host'] or '-':<16} {s['pid'] or 0:>7}  "
              f"{claim}  {follow_text(s.get('follow'))}")  # fmt: skip
    if not spares:
        print("(no spares registered)")
    return 0


def cmd_stop(a: argparse.Namespace) -> int:
    client, _ = _client(a)
    keys = JobKeys(a.job)
    kvs, _ = client.get_prefix(keys.spares_prefix)
    ids = [kv.key[len(keys.spares_prefix) :] for kv in kvs]
    targets = ids if a.all else [a.id]
    if not a.all and a.id not in ids:
        raise ConfigError(f"no spare {a.id!r} in job {a.job}; see `livemig-spare status --job {a.job}`")
    stopped = 0
    for sid in targets:
        if put_if_absent(client, keys.assignment(sid), {"stop": True, "time": time.time()}):
            stopped += 1
        else:
            print(f"spare {sid} is claimed (a member now): not stopped", file=sys.stderr)
    print(f"asked {stopped} spare(s) to stop")
    return 0 if stopped == len(targets) else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="livemig-spare", description="hot-spare daemons for livemig jobs")
    p.add_argument("--log-level", default=None)
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--job", required=True)
        sp.add_argument("--etcd", help="etcd endpoints (default: $LIVEMIG_ETCD or the local run of --job)")
        sp.add_argument("--etcd-timeout", type=float, default=5.0)
        add_security_arguments(sp)

    s = sub.add_parser("start", help="run SCRIPT as a warm spare of the job")
    common(s)
    s.add_argument("--pool", default="spare", help="pool label, prefix of the spare id (default spare)")
    s.add_argument("--id", help="spare id (default POOL-HOST-RANDOM)")
    s.add_argument("--world-size", type=int, help="default: read from the job's config in etcd")
    s.add_argument("--wait-job", type=float, default=300.0, help="wait this long for the job to form, s")
    s.add_argument("--detach", action="store_true",
                   help="run in the background (the spares with their agent), log to a file")  # fmt: skip
    s.add_argument("--count", type=int, default=1, help="spares to run on this host (default 1)")
    s.add_argument("--follow", action="store_true",
                   help="follow the job's state step by step: taking a lost rank then streams only its own "
                        "state (plain data parallel; docs/operations.md, Follow spares)")  # fmt: skip
    s.add_argument("--follow-lag", type=int, default=None, metavar="N",
                   help="drop to warm standby when more than N steps behind (default 4; the job's workers read "
                        "theirs from `livemig run --follow-lag`)")  # fmt: skip
    s.add_argument(
        "--metrics-port",
        type=int,
        help="serve the job's Prometheus metrics on this port (default off; docs/operations.md, Metrics)",
    )
    s.add_argument("--host", help="address other hosts reach this one at (default $LIVEMIG_HOST, else the local "
                                  "address of the route to etcd)")  # fmt: skip
    s.add_argument("script")
    s.add_argument("args", nargs=argparse.REMAINDER)
    s.set_defaults(fn=cmd_start)

    st = sub.add_parser("status", help="list the job's spares")
    common(st)
    st.add_argument("--json", action="store_true")
    st.set_defaults(fn=cmd_status)

    sp = sub.add_parser("stop", help="ask unclaimed spares to exit")
    common(sp)
    g = sp.add_mutually_exclusive_group(required=True)
    g.add_argument("--id")
    g.add_argument("--all", action="store_true")
    sp.set_defaults(fn=cmd_stop)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    make_interruptible()  # Ctrl-C / kill -INT stop it, even started as a background job
    raw = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(raw)
    a.raw_argv = raw
    logs.setup(a.log_level, role="spare-cli")
    try:
        apply_security_arguments(a)  # flags -> environment: the spares it starts inherit them
        return int(a.fn(a) or 0)
    except LivemigError as exc:
        print(f"livemig-spare: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except TimeoutError as exc:
        print(f"livemig-spare: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
