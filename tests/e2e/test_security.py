"""A job on an external etcd with TLS, client certificates and password auth, whose user
holds the job's role only (scripts/etcd-job-user.sh): livemig needs nothing outside
/livemig/<job>/, and another job's credentials reach nothing of it."""

from __future__ import annotations

from datetime import timedelta

import pytest

from livemig.errors import EtcdAccessError
from livemig.rdzv.client import EtcdClient
from livemig.rdzv.embedded import EtcdCluster
from livemig.rdzv.keys import JobKeys
from tests.e2e.conftest import STEPS, explain, livemig_run
from tests.helpers.etcd_auth import enable_auth, job_user


@pytest.fixture
def auth_etcd():
    with EtcdCluster(size=1, tls=True) as cluster:
        enable_auth(cluster)
        yield cluster


def test_a_kill_on_an_etcd_with_auth_and_the_job_role_only_recovers_exactly(tmp_path, auth_etcd, reference_digest):
    job = "secure"
    sec = job_user(auth_etcd, job, tmp_path)
    other = job_user(auth_etcd, "other", tmp_path)
    creds = ("--etcd", auth_etcd.endpoints, "--etcd-ca", sec.ca, "--etcd-cert", sec.cert, "--etcd-key", sec.key,
             "--etcd-user", sec.user, "--etcd-password-file", sec.password_file)  # fmt: skip
    run = livemig_run(tmp_path, 2, spares=1, faults=("kill:rank=1:step=10",), extra=creds, job=job)
    assert run.rc == 0, explain(run)
    assert run.report["steps_completed"] == STEPS and len(run.report["recoveries"]) == 1, explain(run)
    assert run.report["state_digest"] == reference_digest(2), "not bit-identical to the fault-free run"
    keys = JobKeys(job)
    mine = EtcdClient(auth_etcd.endpoints, timedelta(seconds=5), sec)
    assert mine.get(keys.secret) is not None  # the transfer key: readable with the job's credentials
    theirs = EtcdClient(auth_etcd.endpoints, timedelta(seconds=5), other)
    for read in (lambda: theirs.get(keys.secret), lambda: theirs.get_prefix(keys.prefix),
                 lambda: theirs.get(keys.membership)):  # fmt: skip
        with pytest.raises(EtcdAccessError, match="permission denied"):
            read()
