"""The pipeline's Prometheus metrics, registered in the agent's own registry (``Metrics.registry``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 900)


class PromRemediationMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.runs = Counter("nodeagent_remediations", "GPU remediations by action and result.",
                            ["action", "result"], registry=registry)
        self.run_seconds = Histogram("nodeagent_remediation_duration_seconds",
                                     "Fault to end of the remediation (back in service or given up), by action.",
                                     ["action"], buckets=_BUCKETS, registry=registry)
        self.steps = Counter("nodeagent_remediation_steps", "Remediation steps by step and result.",
                             ["step", "result"], registry=registry)
        self.step_seconds = Histogram("nodeagent_remediation_step_duration_seconds",
                                      "Time taken by one remediation step.", ["step"], buckets=_BUCKETS,
                                      registry=registry)

    def step(self, step: str, result: str, seconds: float) -> None:
        self.steps.labels(step, result).inc()
        self.step_seconds.labels(step).observe(seconds)

    def run(self, action: str, result: str, seconds: float) -> None:
        self.runs.labels(action, result).inc()
        self.run_seconds.labels(action).observe(seconds)
