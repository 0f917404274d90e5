"""The alert rules livemig ships, checked and unit-tested by Prometheus' own promtool
(deploy/prometheus/livemig-rules.test.yaml: each rule firing and not firing). promtool comes
with Debian's `prometheus` package; .ci/run installs it when it runs as root, and with
LIVEMIG_CI_STRICT=1 a missing promtool fails instead of skipping."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from livemig.agent.metrics import METRICS

REPO = os.path.join(os.path.dirname(__file__), "..", "..")
RULES = os.path.join(REPO, "deploy", "prometheus", "livemig-rules.yaml")


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        if os.environ.get("LIVEMIG_CI_STRICT") == "1":
            pytest.fail("promtool is missing and LIVEMIG_CI_STRICT=1: apt-get install prometheus")
        pytest.skip("promtool not installed (Debian: apt-get install prometheus)")
    return path


def test_the_shipped_alert_rules_pass_promtools_checks_and_their_unit_tests():
    tool = promtool()
    for args in (["check", "rules", RULES], ["test", "rules", RULES.replace(".yaml", ".test.yaml")]):
        r = subprocess.run([tool, *args], capture_output=True, text=True, timeout=60, cwd=os.path.dirname(RULES))
        assert r.returncode == 0, r.stdout + r.stderr


def test_the_rules_use_only_metrics_the_endpoint_serves_and_the_docs_name_each_alert():
    import re

    import yaml

    rules = yaml.safe_load(open(RULES))["groups"][0]["rules"]
    served = set(METRICS) | {f"{n}_total" for n, (k, _, _) in METRICS.items() if k == "counter"}
    served |= {f"{n}_{s}" for n, (k, _, _) in METRICS.items() if k == "histogram" for s in ("bucket", "count", "sum")}
    doc = open(os.path.join(REPO, "docs", "operations.md")).read()
    for rule in rules:
        used = set(re.findall(r"\blivemig_[a-z_]+", rule["expr"]))
        assert used and used <= served, (rule["alert"], used - served)
        assert f"`{rule['alert']}`" in doc, rule["alert"]
