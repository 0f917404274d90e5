"""The CLI's bad-input paths: one clear line on stderr, non-zero exit."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "livemig.cli", *args], capture_output=True, text=True, timeout=timeout)


def one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one error line, got: {err!r}"
    return lines[0]


def test_unreachable_etcd_names_endpoint_and_timeout():
    t0 = time.monotonic()
    r = run_cli("status", "--job", "j", "--etcd", "http://127.0.0.1:9", "--etcd-timeout", "1")
    assert r.returncode == 2
    line = one_line(r.stderr)
    assert "http://127.0.0.1:9" in line and "1.0s" in line
    assert time.monotonic() - t0 < 15


@pytest.mark.parametrize("url", ["foo:bar", "http://", "ftp://h:1", "http://h:notaport", "http://h"])
def test_malformed_url(url):
    r = run_cli("status", "--job", "j", "--etcd", url)
    assert r.returncode == 2
    assert "etcd URL" in one_line(r.stderr)


@pytest.mark.parametrize("job", ["bad/name", "", "-x", "a" * 80, "sp ace"])
def test_invalid_job_name(job):
    r = run_cli("status", f"--job={job}", "--etcd", "http://127.0.0.1:9")
    assert r.returncode == 2
    assert "invalid job name" in one_line(r.stderr)


def test_unknown_job_without_etcd(tmp_path, monkeypatch):
    monkeypatch.setenv("LIVEMIG_STATE_DIR", str(tmp_path))
    monkeypatch.delenv("LIVEMIG_ETCD", raising=False)
    r = run_cli("status", "--job", "nosuchjob")
    assert r.returncode == 2
    assert "--etcd" in one_line(r.stderr)


def test_status_reads_job_keys(etcd):
    from livemig.rdzv.client import EtcdClient
    from livemig.rdzv.membership import Member, Membership, Rendezvous

    rdzv = Rendezvous(EtcdClient(etcd.endpoints), "statusjob")
    rdzv.commit_change(0, Membership(world_size=1, state="committed", members={0: Member(0, "worker-h-1-x", "h", 1)}))
    r = run_cli("status", "--job", "statusjob", "--etcd", etcd.endpoints, "--json")
    assert r.returncode == 0, r.stderr
    import json

    info = json.loads(r.stdout)
    assert info["generation"] == 1 and info["members"][0]["incarnation"] == "worker-h-1-x"
    assert info["members"][0]["state"] == "missing"  # no live registration
    r = run_cli("status", "--job", "statusjob", "--etcd", etcd.endpoints)
    assert "generation 1" in r.stdout


def test_stop_and_drain_write_their_requests_and_status_shows_them(etcd):
    """`livemig stop` and `livemig drain` (with --wait 0: the request only; their outcome is
    tested end to end in tests/e2e/test_stop.py and test_nodes.py): the keys the agents and the
    coordinator act on, `livemig status` saying so, and one line for what cannot be acted on."""
    import json

    from livemig.rdzv.client import EtcdClient, decode, encode
    from livemig.rdzv.keys import JobKeys
    from livemig.rdzv.membership import Member, Membership, Rendezvous

    client = EtcdClient(etcd.endpoints)
    keys = JobKeys("stopjob")
    Rendezvous(client, "stopjob").commit_change(0, Membership(world_size=1, state="committed", members={
        0: Member(0, "worker-h-1-x", "h", 1, node=0)}))  # fmt: skip
    client.put(keys.node(0), encode({"host": "h", "pid": 1}))
    client.put(keys.run, encode({"nnodes": 2, "nproc_per_node": 1, "run_id": "r"}))
    common = ("--job", "stopjob", "--etcd", etcd.endpoints, "--wait", "0")
    r = run_cli("drain", *common, "--node", "3")
    assert r.returncode == 2 and "node 3 of job stopjob has no agent running" in one_line(r.stderr), r.stderr
    r = run_cli("drain", *common, "--node", "0")
    assert r.returncode == 0 and client.get(keys.drain_request(0)) is not None, r.stderr
    r = run_cli("stop", *common, "--reason", "maintenance")
    assert r.returncode == 0 and decode(client.get(keys.stop).value)["reason"] == "maintenance", r.stderr
    r = run_cli("stop", *common)
    assert r.returncode == 0 and "asked already" in r.stdout, r.stdout  # the first reason stands
    info = json.loads(run_cli("status", "--job", "stopjob", "--etcd", etcd.endpoints, "--json").stdout)
    assert info["nodes"][0]["draining"] and info["stopping"]["reason"] == "maintenance", info
    text = run_cli("status", "--job", "stopjob", "--etcd", etcd.endpoints).stdout
    assert "stopping at a checkpoint of the next step: maintenance" in text and "draining" in text, text
    r = run_cli("stop", "--job", "nosuch", "--etcd", etcd.endpoints)
    assert r.returncode == 2 and "not in this etcd" in one_line(r.stderr), r.stderr


def test_status_watch_refreshes_in_place_on_a_terminal_and_stops_on_ctrl_c(etcd):
    """--watch under a pseudo-terminal redraws in place until Ctrl-C (exit 0 within 1 s);
    without a terminal it prints one block per refresh and ends with the job."""
    import pty
    import select
    import signal

    from livemig.rdzv.client import EtcdClient, encode
    from livemig.rdzv.keys import JobKeys
    from livemig.rdzv.membership import Member, Membership, Rendezvous

    client = EtcdClient(etcd.endpoints)
    Rendezvous(client, "watchjob").commit_change(
        0, Membership(world_size=1, state="committed", members={0: Member(0, "worker-h-1-x", "h", 1)})
    )
    cmd = [
        sys.executable,
        "-m",
        "livemig.cli",
        "status",
        "--job",
        "watchjob",
        "--etcd",
        etcd.endpoints,
        "--watch",
        "0.2",
    ]
    master, slave = pty.openpty()
    p = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=subprocess.PIPE, start_new_session=True)
    os.close(slave)
    out, deadline = b"", time.monotonic() + 30
    try:
        while out.count(b"\x1b[H\x1b[2J") < 3 and time.monotonic() < deadline:
            if select.select([master], [], [], 0.5)[0]:
                out += os.read(master, 65536)
        assert out.count(b"\x1b[H\x1b[2J") >= 3 and b"generation 1" in out, out[-500:]
        p.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        rc = p.wait(timeout=10)
        assert rc == 0 and time.monotonic() - t0 < 1.0, (rc, p.stderr.read())
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stderr.close()
        os.close(master)
    # no terminal: a block per refresh, and the watch ends with the job (its result)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        seen, deadline = "", time.monotonic() + 30  # three refreshes (however slowly it starts), then the end
        while seen.count("job watchjob  generation 1") < 3 and time.monotonic() < deadline:
            seen += p.stdout.readline()
        client.put(JobKeys("watchjob").result, encode({"state": "done", "time": time.time()}))
        rest, err = p.communicate(timeout=30)
        out = seen + rest
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 0, err
    assert "\x1b[" not in out and out.count("job watchjob  generation 1") >= 3, out
    assert out.rstrip().endswith("Ctrl-C to stop)") and "result: {" in out, out[-300:]
    client.close()


def test_status_of_a_job_that_is_not_there_says_so(etcd):
    r = run_cli("status", "--job", "typo", "--etcd", etcd.endpoints)
    assert r.returncode == 2
    assert "no job 'typo' in etcd" in one_line(r.stderr)


@pytest.mark.parametrize(
    "cmd", [["inject", "kill", "--rank", "0"], ["migrate", "--rank", "0"]], ids=["inject", "migrate"]
)
def test_inject_and_migrate_for_a_missing_job_end_at_once(etcd, cmd):
    from livemig.rdzv.client import EtcdClient

    t0 = time.monotonic()
    r = run_cli(*cmd, "--job", "nosuchjob", "--etcd", etcd.endpoints)
    assert r.returncode == 2 and time.monotonic() - t0 < 5
    assert "job nosuchjob is not in this etcd" in one_line(r.stderr)
    from livemig.rdzv.keys import JobKeys

    kvs, _ = EtcdClient(etcd.endpoints).get_prefix(JobKeys("nosuchjob").prefix)
    assert not kvs, "a request key was left behind"


def test_livemig_spare_start_announces_its_wait_once_and_ends_in_one_line(etcd, tmp_path):
    """A spare may start before its job (a batch script): the wait stays, but is said once,
    with its bound, and ends naming what was not found. --count 0 is refused before it."""
    script = os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples", "mlp.py"
    )
    spare = [sys.executable, "-m", "livemig.spare_pool.cli", "start", "--etcd", etcd.endpoints, "--job", "later"]
    t0 = time.monotonic()
    r = subprocess.run([*spare, "--count", "0", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and time.monotonic() - t0 < 5 and "--count must be >= 1" in one_line(r.stderr)
    r = subprocess.run([*spare, "--wait-job", "2", script], capture_output=True, text=True, timeout=60)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert out.count("waiting for job later on etcd") == 1 and "up to 2 s (--wait-job)" in out, out
    assert "livemig-spare: error: job later did not start on etcd" in r.stderr, r.stderr


def test_the_summary_is_one_write(monkeypatch):
    """Agents of a job often share one stdout pipe (srun), unbuffered in containers: a
    summary written line by line, or a line and its newline apart, interleaves with the
    other agent's (a CI run saw "... mslivemig: job ... done" on one line)."""
    import sys

    from livemig.cli.run import print_summary

    class Recorder:
        def __init__(self) -> None:
            self.writes: list[str] = []

        def write(self, s: str) -> int:
            self.writes.append(s)
            return len(s)

        def flush(self) -> None:
            pass

    rec = Recorder()
    monkeypatch.setattr(sys, "stdout", rec)
    rep = {"job": "j", "result": {"state": "done"}, "steps_completed": 30, "wall_s": 10.0,
           "step_time_s_median": 0.071, "state_digest": "ab" * 32, "replicas_identical": True,
           "recoveries": [{"rank": 1, "generation": 2, "downtime_s": 0.2, "bytes_streamed": 2**20,
                           "phases": {"detect": 0.01}}]}  # fmt: skip
    print_summary(rep, reference="ab" * 32)
    assert len(rec.writes) == 1
    lines = rec.writes[0].splitlines()
    assert lines[0] == "livemig: job j done; 30 steps in 10.0s, median step 71 ms"
    assert lines[3].startswith("  (downtime = first group-wide commit after the recovery")
    assert rec.writes[0].endswith("\n") and len(lines) == 6 and lines[-1].startswith("bit-identical: yes")


def test_bench_help_answers_without_importing_torch():
    p = subprocess.run([sys.executable, "-c", "import sys\nfrom livemig.cli import main\ntry:\n    main(['bench', "
                        "'--help'])\nexcept SystemExit:\n    pass\nprint('torch' in sys.modules)"],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert p.stdout.strip().splitlines()[-1] == "False", p.stdout + p.stderr
    assert "faults" in p.stdout and "downtime" in p.stdout


def _kinds_missing(kinds, command: str, start: str, end: str) -> list[str]:
    """Kinds absent, as whole words, from `livemig COMMAND --help` or from the README's
    text between `start` and `end`."""
    import os
    import re

    help_text = " ".join(run_cli(command, "--help").stdout.split())
    readme = open(
        os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "README.md")
    ).read()
    part = " ".join(readme[readme.index(start) :].split(end)[0].split())
    out = []
    for kind in kinds:
        word = rf"(?<![\w-]){re.escape(kind)}(?![\w-])"
        out += [f"{kind} missing from {command} --help"] if not re.search(word, help_text) else []
        out += [f"{kind} missing from the README"] if not re.search(word, part) else []
    return out


def test_every_fault_kind_is_in_run_help_and_the_readme():
    from livemig.faults import KINDS

    missing = _kinds_missing(KINDS, "run", "Fault plans:", "(docs/reliability.md")
    assert not missing, missing


def test_inject_kinds_agree_with_its_help_and_the_readme():
    """Every kind `livemig inject` accepts is in its --help and in the README's inject line."""
    from livemig.cli.inject import CLI_KINDS

    missing = _kinds_missing(CLI_KINDS, "inject", "- `livemig inject KIND", "- `livemig-spare start")
    assert not missing, missing
    assert run_cli("run", "--log-level", "INFO", "--help").returncode == 0  # as docs/operations.md says


def test_livemig_etcd_refuses_a_busy_port_in_one_line():
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t0 = time.monotonic()
        p = run_cli("etcd", "--client-port", str(port), "--peer-port", str(port + 1))
    assert p.returncode == 2 and time.monotonic() - t0 < 5, p
    assert f"127.0.0.1:{port} (client port) is in use" in one_line(p.stderr)
    assert "serving" not in p.stdout


def test_prune_runs_keeps_the_newest_and_the_recent(tmp_path):
    import os
    import time

    from livemig.agent.jobs import prune_runs

    old = time.time() - 3600
    for i in range(5):
        d = tmp_path / f"job-{i}"
        d.mkdir()
        (d / "worker-0.log").write_text("x")
        if i < 4:  # job-4 was written just now: a live run, kept whatever its rank
            os.utime(d / "worker-0.log", (old + i, old + i))
            os.utime(d, (old + i, old + i))
    prune_runs(str(tmp_path), keep=2)
    assert sorted(os.listdir(tmp_path)) == ["job-3", "job-4"]


@pytest.mark.parametrize(
    "plan,line",
    [
        ("hang:rank=0:step=3:resume=-3", "resume= and heal= seconds and member= must be >= 0"),
        ("etcd-kill:member=4:step=3", "etcd-kill:member=4 needs an embedded cluster holding that member"),
    ],
    ids=["negative-resume", "etcd-member"],
)
def test_a_fault_plan_is_refused_whole_before_anything_starts(plan, line, tmp_path):
    script = os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples", "mlp.py"
    )
    env = dict(os.environ, LIVEMIG_STATE_DIR=str(tmp_path))
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "livemig.cli", "run", "--nproc", "2", "--fault", plan, script],
                       capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
    assert r.returncode == 2 and time.monotonic() - t0 < 5, r
    assert line in one_line(r.stderr)
    assert not (tmp_path / "runs").exists(), "something started"


def test_the_summary_names_a_fresh_process_and_where_a_verify_parted(capsys):
    """A process the agent started at the failure is not a warm spare; a --verify mismatch
    names its first step and rank (agent/report.py divergence)."""
    from livemig.agent.report import divergence
    from livemig.cli.run import print_summary

    faults = [{"kind": "kill", "rank": 1, "step": 6}]
    ref = {"0": [[s, f"a{s}"] for s in range(10)], "1": [[s, f"b{s}"] for s in range(10)]}
    got = {"0": [[s, f"a{s}" if s < 8 else "x"] for s in range(10)], "1": [[s, f"b{s}"] for s in range(7, 10)]}
    dv = divergence(ref, got, faults)
    assert (dv["step"], dv["rank"], dv["first_fault_step"]) == (8, 0, 6), dv
    assert "2 step(s) after the fault of rank(s) [1] at step 6" in dv["why"]
    got["1"][0][1] = "y"  # rank 1's first recorded step (7) differs: earlier than rank 0's
    assert divergence(ref, got, faults)["step"] == 7
    got0 = {"0": [[0, "z"], *ref["0"][1:]], "1": ref["1"]}
    assert "is the model seeded?" in divergence(ref, got0, faults)["why"]
    assert divergence(ref, {"0": ref["0"], "1": ref["1"]}, faults) is None
    assert "before any fault" in divergence(ref, {"0": [[3, "q"]]}, faults)["why"]

    rep = {"job": "j", "result": {"state": "done"}, "steps_completed": 30, "wall_s": 10.0,
           "step_time_s_median": 0.071, "state_digest": "cd" * 32, "replicas_identical": True,
           "recoveries": [{"rank": 1, "generation": 2, "downtime_s": 0.2, "bytes_streamed": 2**20,
                           "spares": ["fresh-1"], "phases": {"detect": 0.01}}],
           "diverged": dv}  # fmt: skip
    print_summary(rep, reference="ab" * 32)
    out = capsys.readouterr().out
    assert "recovery of rank 1 onto a fresh process (fresh-1) (generation 2)" in out, out
    assert "onto spare" not in out
    assert "verify: first difference at step 8 on rank 0: diverged at step 8" in out, out
