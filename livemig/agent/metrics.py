"""Prometheus metrics of a job, served by its agent (`--metrics-port`).

Job-wide figures are read from the job's etcd keys when a scrape comes, not kept
up to date in the training path: a job nobody scrapes pays nothing, and every
agent of a job (each node's `livemig run`, each `livemig-spare start`) answers
for the whole job, so any one of them is enough to scrape. The members add what
the figures need to their progress records only while it is on
(config.ENV_METRICS, set by the agent): their group's first commit, the last
one before it, and their median step.

Downtime is the run report's definition (agent/report.py): the first
group-wide commit after a recovery minus the last one before it, minus one
median step. It is observed once every rank of the new group has committed.

The metric names, types and labels are listed in METRICS and in
docs/operations.md, "Metrics" (a test checks the page against both).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from livemig.agent.report import KINDS, migrations, recoveries
from livemig.coordinator.timeline import PHASES, events_of
from livemig.errors import ConfigError
from livemig.rdzv.client import KV, EtcdClient, conform
from livemig.rdzv.keys import JobKeys
from livemig.rdzv.membership import Membership

log = logging.getLogger("livemig.agent.metrics")


# Seconds: a recovery is ~0.2 s, a slow one a few s, a cold path minutes.
BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

# name -> (type, labels, help): the page's families, as docs/operations.md lists them.
METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "livemig_generation": ("gauge", (), "the job's current generation"),
    "livemig_world_size": ("gauge", (), "ranks of the job"),
    "livemig_members": ("gauge", ("host",), "members of the current generation, by host"),
    "livemig_spares_warm": ("gauge", ("host",), "warm spares registered for the job, by host"),
    "livemig_recoveries": ("counter", ("kind", "outcome"), "recoveries and planned migrations, by kind and outcome"),
    "livemig_downtime_seconds": ("histogram", ("kind",), "downtime of each completed recovery (run report definition)"),
    "livemig_recovery_phase_seconds": ("histogram", ("kind", "phase"), "each phase of each completed recovery"),
    "livemig_lost_seconds": ("counter", ("kind",), "downtime summed over the recoveries measured"),
    "livemig_bytes_streamed": ("counter", ("kind",), "state bytes streamed into spares"),
    "livemig_fenced": ("counter", (), "processes fenced"),
    "livemig_steps_committed": ("counter", (), "steps every rank committed"),
    "livemig_step_seconds": ("gauge", (), "median step time (the slowest rank's)"),
    "livemig_goodput_ratio": ("gauge", (), "committed steps x median step / wall time from launch to the last commit"),
    "livemig_etcd_request_seconds": ("histogram", (), "latency of this agent's etcd calls"),
    "livemig_etcd_errors": ("counter", (), "this agent's etcd calls that failed or had to be retried"),
    "livemig_scrape_errors": ("counter", (), "scrapes whose job figures could not be read (etcd away)"),
}

_NUM = (int, float)


def group_commits(records: dict[int, dict], world_size: int) -> dict[int, list[tuple[int, float]]]:
    """generation -> its group-wide [(step, time)] around its start, from the members'
    `around` fields, once every rank reported the group: the first step every rank committed
    in it and the step before, each at its last rank's commit. A survivor may finish the
    step in flight inside the new group (its first step there is one earlier than the
    spare's): that step is the one before, not the group's first."""
    by_gen: dict[int, list[list]] = {}
    for rec in records.values():
        a = rec.get("around")
        if isinstance(a, list) and len(a) == 3 and isinstance(a[0], int):
            by_gen.setdefault(a[0], []).append(a)
    out: dict[int, list[tuple[int, float]]] = {}
    for g, arounds in by_gen.items():
        if len(arounds) < world_size:
            continue  # a rank has not committed in this group yet: no figure yet
        firsts = [a[2] for a in arounds if _pair(a[2])]
        if len(firsts) < world_size:
            continue
        at: dict[int, float] = {}
        for pair in [*firsts, *(a[1] for a in arounds if _pair(a[1]))]:
            at[int(pair[0])] = max(at.get(int(pair[0]), 0.0), float(pair[1]))
        first = int(max(f[0] for f in firsts))
        out[g] = [(s, at[s]) for s in (first - 1, first) if s in at]
    return out


def _pair(x: Any) -> bool:
    return isinstance(x, list) and len(x) == 2 and all(isinstance(v, _NUM) for v in x)


class JobMetrics:
    """The collector: one pass over the job's keys per scrape. It remembers what the
    keys forget (a pruned progress record's `around`, a recovery already measured)."""

    def __init__(self, keys: JobKeys, snapshot: Callable[[], dict[str, KV]], client: EtcdClient | None = None,
                 launched_at: float | None = None) -> None:  # fmt: skip
        self.keys = keys
        self.snapshot = snapshot  # the job's keys: the agent's watch-fed mirror, or a read of etcd
        self.client = client  # whose call statistics are this agent's etcd figures
        self.launched_at = launched_at
        self._gens: dict[int, list[tuple[int, float]]] = {}
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
                fig = {}
            fig["livemig_scrape_errors"] = [((), self._scrape_errors)]
            fig.update(self._etcd_figures())
        yield from families(fig)

    def figures(self) -> dict[str, Any]:
        by_key = self.snapshot()
        keys = self.keys
        raw = by_key.get(keys.membership)
        m = Membership.from_bytes(raw.value if raw else None)
        world = m.world_size
        members = Counter(mem.host or "unknown" for mem in m.members.values())
        spares: Counter[str] = Counter()
        records: dict[int, dict] = {}
        for k, kv in by_key.items():
            if k.startswith(keys.spares_prefix):
                rec = conform(kv.value, {"state": (str,)}, {"host": (str,)})
                if rec is not None and rec["state"] == "warm":
                    spares[rec.get("host", "unknown")] += 1
            elif k.startswith(keys.progress_prefix) and k[len(keys.progress_prefix) :].isdigit():
                rec = conform(kv.value, {"step": (int,), "time": _NUM}, {"around": (list,), "step_s": _NUM})
                if rec is not None:
                    records[int(k[len(keys.progress_prefix) :])] = rec
        self._gens.update(group_commits(records, world))
        commits = sorted(p for pts in self._gens.values() for p in pts)
        steps_s = [r["step_s"] for r in records.values() if "step_s" in r]
        median = max(steps_s) if steps_s else 0.0  # the slowest rank sets the group's pace
        events = events_of(by_key, keys)
        recs = recoveries(events, commits, median)
        migs = migrations(events, commits, median)
        counts: dict[tuple[str, str], int] = {}
        downtime: dict[str, list[float]] = {k: [] for k in KINDS}
        phases: dict[tuple[str, str], list[float]] = {}
        streamed = dict.fromkeys(KINDS, 0.0)
        for r in recs:  # a failure's recovery is listed once its new generation committed
            counts[("failure", "done")] = counts.get(("failure", "done"), 0) + 1
            streamed["failure"] += r["bytes_streamed"]
            if r.get("generation") in self._gens:  # every rank committed in the new group: measured
                downtime["failure"].append(r["downtime_s"])
                for ph in PHASES:
                    phases.setdefault(("failure", ph), []).append(r["phases"].get(ph, 0.0))
        for mg in migs:
            counts[("migration", mg["outcome"])] = counts.get(("migration", mg["outcome"]), 0) + 1
            streamed["migration"] += mg.get("bytes_streamed", 0)
            if mg["outcome"] == "done" and mg.get("pause_s") is not None:
                downtime["migration"].append(mg["pause_s"])
            for ph, v in mg.get("phases", {}).items():
                phases.setdefault(("migration", ph), []).append(v)
        steps = min(r["step"] for r in records.values()) + 1 if len(records) >= max(world, 1) else 0
        last_commit = max((r["time"] for r in records.values()), default=None)
        start = self.launched_at
        if start is None and commits:
            start = commits[0][1]
        goodput = None
        if start is not None and last_commit is not None and last_commit > start and median > 0:
            goodput = min(1.0, steps * median / (last_commit - start))
        return {
            "livemig_generation": [((), m.generation)],
            "livemig_world_size": [((), world)],
            "livemig_members": [((h,), n) for h, n in sorted(members.items())],
            "livemig_spares_warm": [((h,), n) for h, n in sorted(spares.items())],
            "livemig_recoveries": [((k, o), n) for (k, o), n in sorted(counts.items())],
            "livemig_downtime_seconds": [((k,), v) for k, v in downtime.items()],
            "livemig_recovery_phase_seconds": [(lbl, v) for lbl, v in sorted(phases.items())],
            "livemig_lost_seconds": [((k,), sum(v)) for k, v in downtime.items()],
            "livemig_bytes_streamed": [((k,), v) for k, v in streamed.items()],
            "livemig_fenced": [((), sum(len(e.get("fenced") or [None]) for e in events if e["phase"] == "fence"))],
            "livemig_steps_committed": [((), steps)],
            "livemig_step_seconds": [((), median)] if median else [],
            "livemig_goodput_ratio": [((), goodput)] if goodput is not None else [],
        }

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
