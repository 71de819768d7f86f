"""The gateway's /metrics: every replica's Prometheus text (the single server's metrics.py) with a
`replica` label, the same series summed over replicas without one (counters, histogram buckets and the
load gauges all add up), `selfspec_replica_up` per replica, then the gateway's own routing counters."""

from __future__ import annotations

from collections import defaultdict

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families


def merge(texts: dict[str, str | None], own: CollectorRegistry) -> bytes:
    """texts: replica name -> its metrics text, or None when it could not report (shown as down)."""
    families: dict[str, Metric] = {}
    totals: dict[str, dict[tuple, float]] = defaultdict(lambda: defaultdict(float))
    for replica, text in texts.items():
        for parsed in text_string_to_metric_families(text or ""):
            family = families.setdefault(parsed.name, Metric(parsed.name, parsed.documentation, parsed.type))
            for s in parsed.samples:
                if s.name.endswith("_created"):  # a creation time: meaningless summed, and per replica too noisy
                    continue
                family.add_sample(s.name, {"replica": replica, **s.labels}, s.value)
                totals[parsed.name][(s.name, tuple(sorted(s.labels.items())))] += s.value
    for name, family in families.items():  # totals first, then each replica's series
        summed = [(sample, dict(labels), value) for (sample, labels), value in totals[name].items()]
        family.samples[:0] = [family.samples[0]._replace(name=n, labels=lab, value=v) for n, lab, v in summed]
    up = Metric("selfspec_replica_up", "1 if the replica reported its metrics, else 0", "gauge")
    for replica, text in texts.items():
        up.add_sample("selfspec_replica_up", {"replica": replica}, 0.0 if text is None else 1.0)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot([up, *families.values()]))
    return generate_latest(registry) + generate_latest(own)


class _Snapshot:
    """A collector that hands out families already built."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families
