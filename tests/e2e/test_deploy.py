"""The deployment examples: deploy/kubernetes/ manifests validated against the
Kubernetes schema (kubernetes-validate, strict) with their livemig command lines parsed
by livemig's own parsers; deploy/slurm/*.sbatch run with a stand-in srun that starts
each task in a simulated host (network namespaces): a job over two nodes with spares in
their own allocation, to completion. Not run on a real Slurm or Kubernetes cluster."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess

import pytest
import yaml

from tests.e2e.conftest import REPO

K8S = os.path.join(REPO, "deploy", "kubernetes")
SLURM = os.path.join(REPO, "deploy", "slurm")
SAMPLE = {"$(POD_IP)": "10.1.2.3", "$(JOB_COMPLETION_INDEX)": "1"}


def _docs() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(glob.glob(os.path.join(K8S, "*.yaml"))):
        with open(path) as f:
            out += [(os.path.basename(path), d) for d in yaml.safe_load_all(f) if d]
    return out


def test_kubernetes_manifests_validate_against_the_schema():
    import kubernetes_validate

    docs = _docs()
    assert {d["kind"] for _, d in docs} >= {"Service", "StatefulSet", "Job", "PodDisruptionBudget"}
    for _, d in docs:
        kubernetes_validate.validate(d, kubernetes_validate.latest_version(), strict=True)  # raises if invalid


def test_kubernetes_commands_are_livemig_command_lines():
    from livemig.cli import build_parser
    from livemig.spare_pool.cli import build_parser as spare_parser

    seen = set()
    for name, d in _docs():
        spec = d.get("spec", {})
        pod = spec.get("template", {}).get("spec", {})
        for c in pod.get("containers", []):
            cmd = [SAMPLE.get(x, x) for x in c["command"]]
            parser = {"livemig": build_parser(with_benches=False), "livemig-spare": spare_parser()}[cmd[0]]
            a = parser.parse_args(cmd[1:])
            seen.add((cmd[0], a.command))
            if a.command == "run":  # --nnodes must match the Job's parallelism
                assert int(a.nnodes) == spec["completions"] == spec["parallelism"], name
    assert seen == {("livemig", "etcd"), ("livemig", "run"), ("livemig-spare", "start")}, seen


def test_kubernetes_jobs_survive_a_lost_pod_and_use_only_what_livemig_reads():
    """The workers' Job gives a lost index a replacement (which joins as spares and exits 0)
    instead of failing on the first lost pod; the spares end with the job (a Job, not a
    restarting Deployment); the grace covers the drain; every LIVEMIG_ variable the manifests
    set is one livemig reads, and every Secret and volume they mount is declared."""
    import re

    src = ""
    for root, _, files in os.walk(os.path.join(REPO, "livemig")):
        for f in files:
            if f.endswith(".py"):
                src += open(os.path.join(root, f)).read()
    jobs = {d["metadata"]["name"]: d for _, d in _docs() if d["kind"] == "Job"}
    workers = jobs["livemig-gpt"]["spec"]
    assert "backoffLimit" not in workers and workers["backoffLimitPerIndex"] >= 1, workers
    assert workers["podReplacementPolicy"] == "Failed", workers
    # every pod of the Job carries its uid as the launch: a replacement arriving as the job ends exits 0
    env = {e["name"]: e for e in workers["template"]["spec"]["containers"][0]["env"]}
    uid = env["LIVEMIG_LAUNCH_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert uid == "metadata.labels['batch.kubernetes.io/controller-uid']", uid
    assert not [d for _, d in _docs() if d["kind"] == "Deployment"]  # it restarted spares for ever
    for name, d in [*jobs.items()]:
        pod = d["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] >= 30, name
        vols = {v["name"] for v in pod["volumes"]}
        for c in pod["containers"]:
            cmd = c["command"]
            if "--drain-grace" in cmd:
                assert float(cmd[cmd.index("--drain-grace") + 1]) < pod["terminationGracePeriodSeconds"], name
            assert {m["name"] for m in c["volumeMounts"]} <= vols, name
            assert any(m["mountPath"] == "/dev/shm" for m in c["volumeMounts"]), name
            for e in c.get("env", []):
                if e["name"].startswith("LIVEMIG_"):
                    assert re.search(rf'"{e["name"]}"', src), f"{name}: {e['name']} is read by nothing in livemig"
            port = str(c["ports"][0]["containerPort"])
            assert d["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == port, name
            assert cmd[cmd.index("--metrics-port") + 1] == port, name


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"), reason="needs root and iproute2 (netns)")
def test_slurm_batch_scripts_run_a_job_over_two_nodes_with_spares(tmp_path):
    from livemig.agent.netns import Hosts

    fake = os.path.join(REPO, "tests", "helpers", "fake_slurm")
    train = os.path.join(REPO, "examples", "mlp.py")
    with Hosts(3) as hosts:
        base = dict(os.environ, PATH=fake + os.pathsep + os.environ["PATH"], PYTHONPATH=REPO,
                    TRAIN=train, LIVEMIG_JOB="slurm-test", FAKE_SLURM_STATE=str(tmp_path),
                    FAKE_SLURM_NETNS=",".join(f"{a}={n}" for a, n in zip(hosts.addrs, hosts.names, strict=True)),
                    LIVEMIG_RUN_ARGS="--lease-ttl 2", TMPDIR=str(tmp_path))  # fmt: skip
        etcd = f"http://{hosts.addrs[0]}:2379"  # where livemig.sbatch starts it: the first node
        shared = tmp_path / "shared" / "slurm-test.etcd"  # a shared file system's path: the spares find etcd
        shared.parent.mkdir()
        base["LIVEMIG_ETCD_FILE"] = str(shared)
        spares = subprocess.Popen(  # first: they wait for etcd's address, then the job, and are warm when it forms
            ["bash", os.path.join(SLURM, "spares.sbatch"), "--steps", "30", "--layers", "2", "--batch", "32"],
            env=dict(base, SLURM_JOB_ID="43", SLURM_NNODES="1", SLURM_JOB_NODELIST=hosts.addrs[2],
                     SPARES_PER_NODE="2"),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
        workers = subprocess.Popen(
            ["bash", os.path.join(SLURM, "livemig.sbatch"), "--steps", "30", "--layers", "2", "--batch", "32"],
            env=dict(base, SLURM_JOB_ID="42", SLURM_NNODES="2", SLURM_JOB_NODELIST=",".join(hosts.addrs[:2])),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
        out = workers.stdout.readline()
        if not out.startswith(f"livemig: job slurm-test on 2 nodes, etcd {etcd}"):
            os.killpg(workers.pid, 9)
            pytest.fail(out + workers.stdout.read()[-3000:])
        try:
            rest, _ = workers.communicate(timeout=240)
            sp_out, _ = spares.communicate(timeout=60)
        finally:
            for p in (workers, spares):
                if p.poll() is None:
                    os.killpg(p.pid, 9)
        out += rest
        assert workers.returncode == 0, out[-3000:]
        done = [line for line in out.splitlines() if line.startswith("livemig: job slurm-test done; 30 steps")]
        assert len(done) == 2, out[-3000:]  # both agents saw the job through
        assert spares.returncode == 0, sp_out[-2000:]  # the spares exited when the job ended
        assert "livemig-spare: job slurm-test ended (done)" in sp_out, sp_out[-2000:]  # and said so
        assert f"livemig-spares: job slurm-test, etcd {etcd}" in sp_out, sp_out[-2000:]  # found from the file
        assert (tmp_path / "comment-42").read_text() == f"livemig-etcd={etcd}"  # and in the job's Comment
        assert not glob.glob(os.path.join(str(tmp_path), "livemig-etcd-*")), os.listdir(tmp_path)  # etcd's data gone
        assert sp_out.count("standby for job slurm-test") == 2, sp_out[-2000:]
