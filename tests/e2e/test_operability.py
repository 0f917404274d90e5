"""What an operator reads from a running job: the Prometheus endpoint (--metrics-port), the
events file (--events) and `livemig report --plot`. CI budget: one ~20 s run with a kill and a
planned migration (the fault-free reference is shared with test_outage.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request

from livemig.agent.metrics import METRICS
from livemig.rdzv.embedded import free_port
from tests.e2e.conftest import REPO, RUN_ENV, STATEFUL

STEPS = 100
ARGS = ("--model", "cnn")  # test_outage.py's reference
FIELDS = {"schema", "job", "event", "time", "generation", "rank", "host", "incarnation"}


def scrape(port: int, texts: list[str] | None = None) -> dict[str, float] | None:
    """The page as {sample name with labels: value}, parsed by prometheus_client's parser
    (a histogram's buckets under their `le`); the raw page appended to `texts`."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return None
    if texts is not None:
        texts[:] = [text]
    out = {}
    for fam in text_string_to_metric_families(text):
        assert fam.name.removesuffix("_total") in METRICS, fam.name  # every family on the page is documented
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def counters(page: dict[str, float]) -> dict[str, float]:
    """The samples of the page that must never go down: counters and histograms."""
    grow = {n for n, (kind, _, _) in METRICS.items() if kind != "gauge"}
    return {k: v for k, v in page.items() if k.split("{")[0].removesuffix("_total").rsplit("_", 1)[0] in grow
            or k.split("{")[0].removesuffix("_total") in grow}  # fmt: skip


def test_metrics_and_events_of_a_recovery_mid_run(tmp_path, stateful_reference):
    ref_report, _ = stateful_reference(2, ARGS, STEPS)
    port, events, report = free_port(), tmp_path / "events.jsonl", tmp_path / "report.json"
    cmd = [sys.executable, "-m", "livemig.cli", "run", "--nproc", "2", "--spares", "2", "--job", "ops",
           "--report", str(report), "--lease-ttl", "2", "--metrics-port", str(port), "--events", str(events),
           "--fault", "kill:rank=1:step=20", "--fault", "migrate:rank=0:step=50", STATEFUL, "--steps", str(STEPS),
           *ARGS]  # fmt: skip
    env = {**os.environ, "LIVEMIG_STATE_DIR": str(tmp_path), **RUN_ENV, "STATEFUL_STEP_SLEEP": "0.05"}
    p = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)  # fmt: skip
    pages: list[dict[str, float]] = []
    last_text: list[str] = []
    try:
        deadline = time.monotonic() + 180
        while p.poll() is None and time.monotonic() < deadline:
            page = scrape(port, last_text)
            if page is not None:
                pages.append(page)
            time.sleep(0.1)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, 9)
            p.wait()
    rep = json.loads(report.read_text())
    assert p.returncode == 0, out[-2000:] + err[-3000:]
    # metrics on changes nothing of the model: the same state as the fault-free run
    assert rep["state_digest"] == ref_report["state_digest"] and rep["steps_completed"] == STEPS, out

    # Prometheus can trust it: from the first page, every counter and histogram is there at 0 for each
    # kind and outcome the alert rules use, and never goes down from one scrape to the next
    first = counters(pages[0])
    assert first["livemig_recoveries_total{kind=failure,outcome=done}"] == 0.0, first
    assert first["livemig_downtime_seconds_count{kind=failure}"] == 0.0, first
    assert first["livemig_downtime_seconds_bucket{kind=failure,le=5.0}"] == 0.0, first
    assert pages[0]["livemig_warm_spares{}"] >= 0, pages[0]
    for prev, cur in zip(pages, pages[1:], strict=False):
        down = {k: (v, counters(cur).get(k)) for k, v in counters(prev).items() if counters(cur).get(k, -1) < v}
        assert not down, down
    done = "livemig_recoveries_total{kind=failure,outcome=done}"
    before = [pg for pg in pages if pg.get("livemig_generation{}") == 1.0 and pg.get("livemig_steps_committed_total{}")]
    measured = "livemig_downtime_seconds_count{kind=failure}"
    after = [pg for pg in pages if pg.get(measured) == 1.0 and pg["livemig_steps_committed_total{}"] < STEPS]
    assert before and after, (len(pages), pages[-1:] if pages else None)
    b, a = before[-1], after[0]
    assert b.get(done, 0.0) == 0.0 and b["livemig_downtime_seconds_count{kind=failure}"] == 0.0, b
    assert sum(v for k, v in b.items() if k.startswith("livemig_spares_warm{")) == 2.0, b  # the warm spares
    assert sum(v for k, v in b.items() if k.startswith("livemig_members{")) == 2.0, b
    # the recovery counter and the downtime histogram moved once the new group committed, before the result
    assert a["livemig_generation{}"] == 2.0 and a[done] == 1.0, a
    (r,) = rep["recoveries"]
    # the phases are the timeline's, as in the report; the downtime is the report's definition over the
    # members' own commit stamps (rank 0's before it migrated reach the report through its spare's record)
    for ph in ("detect", "fence", "agree", "claim", "commit"):
        assert abs(a[f"livemig_recovery_phase_seconds_sum{{kind=failure,phase={ph}}}"] - r["phases"][ph]) < 1e-3, ph
    # one computation (the leader's `measured` event): the endpoint's downtime is the report's, to the bit
    assert a["livemig_downtime_seconds_sum{kind=failure}"] == r["downtime_s"], (a, r)
    assert rep["members"]["0"]["first_commit"][0] > 50, rep["members"]  # the migrated-in spare's own first
    assert a["livemig_fenced_total{}"] == 1.0 and a["livemig_bytes_streamed_total{kind=failure}"] > 0, a
    assert 0 < a["livemig_goodput_ratio{}"] <= 1 and a["livemig_step_seconds{}"] > 0, a
    assert a["livemig_etcd_request_seconds_count{}"] > 0, a

    lines = [json.loads(x) for x in events.read_text().splitlines()]
    assert all(FIELDS <= set(ev) and ev["job"] == "ops" for ev in lines), lines
    assert [ev["time"] for ev in lines] == sorted(ev["time"] for ev in lines)
    phases = [ev["event"] for ev in lines if ev["generation"] == 2]
    order = ["detect", "fence", "agree", "claim", "stream", "build", "commit"]
    assert [x for x in phases if x in order] == order, phases
    detect = next(ev for ev in lines if ev["event"] == "detect")
    assert detect["rank"] == 1 and re.match(r"worker-", detect["incarnation"] or ""), detect  # the lost worker
    claim = next(ev for ev in lines if ev["event"] == "claim")
    assert (claim["incarnation"] or "").startswith("spare-"), claim  # the spare that took rank 1
    assert lines[-1]["event"] == "job_state" and lines[-1]["state"] == "done", lines[-1]
    assert any(ev["event"] == "spare_registered" for ev in lines), lines
    # the planned migration: counted, its pause observed, its phases in the events
    (mig,) = rep["migrations"]
    assert mig["outcome"] == "done", mig
    assert any(pg.get("livemig_recoveries_total{kind=migration,outcome=done}") == 1.0 for pg in pages), pages[-1]
    # the last page before the agent stopped: the run's final figures are the report's
    z = pages[-1]
    assert z["livemig_downtime_seconds_sum{kind=migration}"] == mig["pause_s"], (z, mig)
    lost = z["livemig_lost_seconds_total{kind=failure}"] + z["livemig_lost_seconds_total{kind=migration}"]
    assert abs(lost - rep["lost_s"]) < 1e-6, (lost, rep["lost_s"])
    assert abs(z["livemig_goodput_ratio{}"] - rep["goodput"]) < 0.01, (z, rep["goodput"])
    if shutil.which("promtool"):  # the live page as Prometheus' own linter reads it
        c = subprocess.run(["promtool", "check", "metrics"], input=last_text[0], capture_output=True, text=True,
                           timeout=30)  # fmt: skip
        assert c.returncode == 0, c.stdout + c.stderr
    assert {"request", "switch"} <= {ev["event"] for ev in lines}, lines

    # `livemig report --plot`: the same run for a person, and a timeline that opens as a PNG
    png = tmp_path / "timeline.png"
    r = subprocess.run([sys.executable, "-m", "livemig.cli", "report", str(report), "--plot", str(png)],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "recovery (failure) of rank 1 onto" in r.stdout and "migration of rank 0" in r.stdout, r.stdout
    assert "goodput" in r.stdout and f"{STEPS} steps" in r.stdout, r.stdout
    import matplotlib.image

    img = matplotlib.image.imread(str(png))
    assert img.shape[0] > 100 and img.shape[1] > 500, img.shape
