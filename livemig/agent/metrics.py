"""Prometheus metrics of a job, served by its agent (`--metrics-port`).

Job-wide figures are read from the job's etcd keys when a scrape comes, not kept
up to date in the training path: a job nobody scrapes pays nothing, and every
agent of a job (each node's `livemig run`, each `livemig-spare start`) answers
for the whole job, so any one of them is enough to scrape. The members add
their median step to their progress records only while it is on
(config.ENV_METRICS, set by the agent).

Downtime, lost time and goodput are the run report's, computed by its functions
(agent/report.py `recoveries`, `goodput`, over the leader's `measured` events,
coordinator/timeline.py): a recovery is observed
once every rank of the new group has committed, with figures that never change
after, so every counter and histogram only grows.

The metric names, types and labels are listed in METRICS and in
docs/operations.md, "Metrics" (a test checks the page against both).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from livemig.agent.report import KINDS, first_commit, goodput, migrations, recoveries
from livemig.coordinator.timeline import PHASES, events_of, measurements
from livemig.errors import ConfigError
from livemig.rdzv.client import KV, EtcdClient, conform
from livemig.rdzv.keys import JobKeys
from livemig.rdzv.membership import GenState, Membership

log = logging.getLogger("livemig.agent.metrics")
_ENDED = (GenState.DONE, GenState.FAILED)


# Seconds: a recovery is ~0.2 s, a slow one a few s, a cold path minutes.
BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

# name -> (type, labels, help): the page's families, as docs/operations.md lists them.
METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "livemig_generation": ("gauge", (), "the job's current generation"),
    "livemig_world_size": ("gauge", (), "ranks of the job"),
    "livemig_members": ("gauge", ("host",), "members of the current generation, by host"),
    "livemig_spares_warm": ("gauge", ("host",), "warm spares registered for the job, by host"),
    "livemig_warm_spares": ("gauge", (), "warm spares of the job, also when none (absent once the job ended)"),
    "livemig_follow_spares": ("gauge", ("state",), "follow spares by state: following, attaching, warm (dropped), ..."),
    "livemig_follow_drops": (
        "counter",
        (),
        "times a follow spare fell more than --follow-lag behind and dropped to warm",
    ),
    "livemig_recoveries": ("counter", ("kind", "outcome"), "recoveries and planned migrations, by kind and outcome"),
    "livemig_downtime_seconds": ("histogram", ("kind",), "downtime of each completed recovery (run report definition)"),
    "livemig_recovery_phase_seconds": ("histogram", ("kind", "phase"), "each phase of each completed recovery"),
    "livemig_lost_seconds": ("counter", ("kind",), "time lost: downtime, steps trained again, migration pauses"),
    "livemig_bytes_streamed": ("counter", ("kind",), "state bytes streamed into spares"),
    "livemig_fenced": ("counter", (), "processes fenced"),
    "livemig_steps_committed": ("counter", (), "steps every rank committed"),
    "livemig_step_seconds": ("gauge", (), "median step time (the slowest rank's)"),
    "livemig_goodput_ratio": ("gauge", (), "share of launch to last commit neither start-up nor lost"),
    "livemig_etcd_request_seconds": ("histogram", (), "latency of this agent's etcd calls"),
    "livemig_etcd_errors": ("counter", (), "this agent's etcd calls that failed or had to be retried"),
    "livemig_scrape_errors": ("counter", (), "scrapes whose job figures could not be read (etcd away)"),
}

_NUM = (int, float)
OUTCOMES = ("done", "aborted")  # a recovery or migration is counted once, when it ends either way


class JobMetrics:
    """The collector: one pass over the job's keys per scrape. A recovery is observed once,
    when its figures are final (its new group's every rank committed: the leader's `measured`
    event, coordinator/timeline.py, which the report reads too), and never again, so counters and
    histograms only grow, whatever the keys forget later (a pruned progress record, an archived
    event)."""

    def __init__(self, keys: JobKeys, snapshot: Callable[[], dict[str, KV]], client: EtcdClient | None = None,
                 launched_at: float | None = None) -> None:  # fmt: skip
        self.keys = keys
        self.snapshot = snapshot  # the job's keys: the agent's watch-fed mirror, or a read of etcd
        self.client = client  # whose call statistics are this agent's etcd figures
        self.launched_at = launched_at
        self._meas: dict[int, dict[str, Any]] = {}  # generation -> its `measured` event's figures
        self._drops: dict[str, int] = {}  # follow spare -> its drops, the most seen
        self._seen: set[tuple[str, Any]] = set()  # the recoveries, migrations and fences observed
        self._counts = {(k, o): 0 for k in KINDS for o in OUTCOMES}
        self._downtime: dict[str, list[float]] = {k: [] for k in KINDS}
        self._phases: dict[tuple[str, str], list[float]] = {("failure", ph): [] for ph in PHASES}
        self._streamed = dict.fromkeys(KINDS, 0.0)
        self._lost = dict.fromkeys(KINDS, 0.0)
        self._fenced = 0
        self._steps = 0
        self._scrape_errors = 0
        self._lock = threading.Lock()

    def describe(self) -> list:
        return []  # no pre-registration pass over etcd (prometheus_client asks when registering)

    def collect(self) -> Iterator[Any]:
        with self._lock:
            try:
                fig = self.figures()
            except Exception as exc:  # noqa: BLE001 - an etcd outage must not break the page
                self._scrape_errors += 1
                log.warning("metrics: job figures not read", extra={"why": str(exc)[:200]})
                fig = self._counters()
            fig["livemig_scrape_errors"] = [((), self._scrape_errors)]
            fig.update(self._etcd_figures())
        yield from families(fig)

    def figures(self) -> dict[str, Any]:
        by_key = self.snapshot()
        keys = self.keys
        m = Membership.from_kvs(by_key, keys)
        world = m.world_size
        members = Counter(mem.host or "unknown" for mem in m.members.values())
        spares: Counter[str] = Counter()
        following: Counter[str] = Counter()
        records: dict[int, dict] = {}
        for k, kv in by_key.items():
            if k.startswith(keys.spares_prefix):
                rec = conform(kv.value, {"state": (str,)}, {"host": (str,)})
                if rec is not None and rec["state"] == "warm":
                    spares[rec.get("host", "unknown")] += 1
            elif k.startswith(keys.follow_prefix):  # a follow spare's status (runtime/follow.py)
                rec = conform(kv.value, {"state": (str,)}, {"drops": (int,)})
                if rec is not None:
                    following[rec["state"]] += rec["state"] not in ("claimed", "stopped")
                    sid = k[len(keys.follow_prefix) :]
                    self._drops[sid] = max(self._drops.get(sid, 0), rec.get("drops", 0))  # only grows
            elif k.startswith(keys.progress_prefix) and k[len(keys.progress_prefix) :].isdigit():
                rec = conform(kv.value, {"step": (int,), "time": _NUM}, {"step_s": _NUM})
                if rec is not None:
                    records[int(k[len(keys.progress_prefix) :])] = rec
        events = events_of(by_key, keys)
        self._meas.update(measurements(events))  # kept: archived events may drop out of the archive
        steps_s = [r["step_s"] for r in records.values() if "step_s" in r]
        median = max(steps_s) if steps_s else 0.0  # the slowest rank sets the group's pace
        commits = sorted({p for f in self._meas.values() for p in (f["before"], f["after"]) if p is not None})
        self._observe(recoveries(events, commits, median, self._meas), migrations(events, commits, median, self._meas))
        for ev in events:
            key = ("fence", (ev.get("generation"), ev["time"]))
            if ev["phase"] == "fence" and key not in self._seen:
                self._seen.add(key)
                self._fenced += len(ev.get("fenced") or [None])
        if len(records) >= max(world, 1):
            self._steps = max(self._steps, min(r["step"] for r in records.values()) + 1)
        last_commit = max((r["time"] for r in records.values()), default=None)
        first = first_commit(self._meas, commits)
        gp = goodput(self.launched_at if self.launched_at is not None else first, first, last_commit,
                     sum(self._lost.values()))  # fmt: skip
        return {
            "livemig_generation": [((), m.generation)],
            "livemig_world_size": [((), world)],
            "livemig_members": [((h,), n) for h, n in sorted(members.items())],
            "livemig_spares_warm": [((h,), n) for h, n in sorted(spares.items())],
            "livemig_warm_spares": [((), sum(spares.values()))] if m.state not in _ENDED else [],
            "livemig_follow_spares": [((s,), n) for s, n in sorted(following.items()) if n],
            "livemig_follow_drops": [((), sum(self._drops.values()))],
            **self._counters(),
            "livemig_step_seconds": [((), median)] if median else [],
            "livemig_goodput_ratio": [((), gp)] if gp is not None else [],
        }

    def _counters(self) -> dict[str, Any]:
        """What only grows: exported from the first scrape, at 0 for every kind and outcome."""
        return {
            "livemig_recoveries": [((k, o), n) for (k, o), n in sorted(self._counts.items())],
            "livemig_downtime_seconds": [((k,), v) for k, v in self._downtime.items()],
            "livemig_recovery_phase_seconds": [(lbl, v) for lbl, v in sorted(self._phases.items())],
            "livemig_lost_seconds": [((k,), v) for k, v in self._lost.items()],
            "livemig_bytes_streamed": [((k,), v) for k, v in self._streamed.items()],
            "livemig_fenced": [((), self._fenced)],
            "livemig_steps_committed": [((), self._steps)],
        }

    def _observe(self, recs: list[dict], migs: list[dict]) -> None:
        for r in recs:  # listed once its new generation committed; observed once it is measured
            key = ("recovery", r.get("generation"))
            if key in self._seen or r.get("generation") not in self._meas:
                continue
            self._seen.add(key)
            kind = r["kind"] if r["kind"] in KINDS else KINDS[0]
            self._counts[(kind, "done")] += 1
            self._streamed[kind] += r["bytes_streamed"]
            self._downtime[kind].append(r["downtime_s"])
            self._lost[kind] += r.get("lost_s", r["downtime_s"])
            for ph, v in r["phases"].items():
                self._phases.setdefault((kind, ph), []).append(v)
        for mg in migs:
            key = ("migration", mg.get("generation"))
            done = mg["outcome"] == "done" and mg.get("pause_s") is not None and mg.get("generation") in self._meas
            if key in self._seen or not (done or mg["outcome"] == "aborted"):
                continue
            self._seen.add(key)
            self._counts[("migration", mg["outcome"])] += 1
            self._streamed["migration"] += mg.get("bytes_streamed", 0)
            if done:
                self._downtime["migration"].append(mg["pause_s"])
                self._lost["migration"] += mg["pause_s"]
            for ph, v in mg.get("phases", {}).items():
                self._phases.setdefault(("migration", ph), []).append(v)

    def _etcd_figures(self) -> dict[str, Any]:
        if self.client is None:
            return {}
        st = self.client.stats
        return {"livemig_etcd_request_seconds": [((), st.histogram())], "livemig_etcd_errors": [((), st.errors)]}


def families(fig: dict[str, Any]) -> Iterator[Any]:
    """prometheus_client metric families of the figures (name -> [(label values, value)];
    a histogram's value is a list of observations, or (buckets, sum) already counted)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    for name, (kind, labels, doc) in METRICS.items():
        if name not in fig:
            continue
        if kind == "gauge":
            fam: Any = GaugeMetricFamily(name, doc, labels=list(labels))
            for lbl, v in fig[name]:
                fam.add_metric(list(lbl), float(v))
        elif kind == "counter":
            fam = CounterMetricFamily(name, doc, labels=list(labels))
            for lbl, v in fig[name]:
                fam.add_metric(list(lbl), float(v))
        else:
            fam = HistogramMetricFamily(name, doc, labels=list(labels))
            for lbl, v in fig[name]:
                buckets, total = v if isinstance(v, tuple) else bucketed(v)
                fam.add_metric(list(lbl), buckets, total)
        yield fam


def bucketed(values: list[float]) -> tuple[list[tuple[str, float]], float]:
    """Cumulative histogram buckets of the observations (BUCKETS, then +Inf) and their sum."""
    out = [(str(b), float(sum(1 for x in values if x <= b))) for b in BUCKETS]
    return [*out, ("+Inf", float(len(values)))], float(sum(values))


class MetricsServer:
    """One HTTP endpoint (/metrics) for one agent; stopped with the agent."""

    def __init__(self, collector: JobMetrics, port: int, addr: str = "0.0.0.0") -> None:  # noqa: S104 - scraped from other hosts
        try:
            from prometheus_client import CollectorRegistry, start_http_server
        except ImportError as exc:
            raise ConfigError("--metrics-port needs prometheus_client: pip install 'livemig[metrics]'") from exc
        registry = CollectorRegistry(auto_describe=False)
        registry.register(collector)
        try:
            self._server, self._thread = start_http_server(port, addr, registry=registry)
        except OSError as exc:
            raise ConfigError(f"--metrics-port {port}: cannot listen ({exc.strerror}); pick a free port") from exc
        self.port = self._server.server_address[1]
        log.info("metrics served", extra={"port": self.port, "addr": addr})

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=2)
