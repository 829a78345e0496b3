"""Prometheus metrics of one job, in the text exposition format: ``onward metrics`` prints them (for the
node-exporter textfile collector) and the dashboard serves them at ``GET /metrics``.

Everything is read from the store at the moment of the call, through ``status_dict`` (the numbers of
``onward status --json``) and ``Store.totals`` (counters kept in the store, so they survive worker restarts
and agree between every host that reads the same store). Each call builds a fresh ``CollectorRegistry``
with one collector: no global state, no ``prometheus_client`` default registry, nothing left running.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .proc import seen_live
from .status import status_dict
from .store.base import STATES

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from .store.base import Store



def metrics_text(store: Store) -> bytes:
    """The job's metrics, as Prometheus text exposition format (UTF-8). Every series carries ``job``."""
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_JobCollector(store))
    data: bytes = generate_latest(registry)
    return data


class _JobCollector:
    """Reads the store once per scrape (``collect``), never in between."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def describe(self) -> list[Metric]:
        return []  # nothing to check at registration; collect() is only called per scrape

    def collect(self) -> Iterator[Metric]:
        report = status_dict(self.store)
        totals = self.store.totals()
        yield from job_metrics(report, totals)


def job_metrics(report: dict[str, Any], totals: Any) -> Iterator[Metric]:
    """The metric families for one status report and the store's totals (``Store.totals``)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    job = str(report.get("job") or "default")
    tasks = GaugeMetricFamily("onward_tasks", "Tasks in each state.", labels=["job", "state"])
    for state in STATES:  # every state, 0 when no task is in it: a series never vanishes from a graph
        tasks.add_metric([job, state], int(report.get(state, 0) or 0))
    yield tasks

    counters = (
        ("onward_task_completions", "Tasks completed (done), over the job's life.", totals.completions),
        ("onward_task_failed_attempts", "Attempts that failed (retried or not).", totals.failed_attempts),
        ("onward_task_failures", "Tasks that failed for good (attempts used up).", totals.final_failures),
        ("onward_task_cancellations", "Tasks cancelled.", totals.cancelled),
        ("onward_worker_restarts", "Worker restarts journaled by onward supervise.", totals.restarts),
        ("onward_step_replays", "Durable steps replayed from the store instead of run again.", totals.step_replays),
    )
    for name, doc, value in counters:
        counter = CounterMetricFamily(name, doc, labels=["job"])  # exposed with the _total suffix
        counter.add_metric([job], int(value))
        yield counter

    ages = [t["age"] for t in report["tasks_running"] if t.get("age") is not None]
    oldest = GaugeMetricFamily("onward_running_task_oldest_age_seconds",
                               "Age of the oldest running attempt (0 when none runs).", labels=["job"])
    oldest.add_metric([job], max(ages, default=0.0))
    yield oldest

    heartbeat = GaugeMetricFamily("onward_worker_heartbeat_age_seconds",
                                  "Seconds since each live worker's last heartbeat.",
                                  labels=["job", "worker", "host", "pid"])
    for w in report["workers"]:
        # Live as workers_alive counts them: alive by their pid here, by a heartbeat under a minute elsewhere.
        # A worker on another host that died without a word was exported for ever (its age growing), a new
        # series for each such death; its death shows in workers_alive.
        if seen_live(w["alive"], w["heartbeat_age"]):
            heartbeat.add_metric([job, str(w["id"]), str(w["host"]), str(w["pid"])], float(w["heartbeat_age"]))
    yield heartbeat

    alive = GaugeMetricFamily("onward_workers_alive", "Workers alive (working on the job).", labels=["job"])
    alive.add_metric([job], int(report["workers_alive"]))
    yield alive

    paused = GaugeMetricFamily("onward_paused", "1 while the job is paused (no new claims), else 0.",
                               labels=["job"])
    paused.add_metric([job], 1 if report.get("paused") else 0)
    yield paused
