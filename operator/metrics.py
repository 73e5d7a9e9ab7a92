"""Prometheus metrics of the operator, in their own registry (several operators may run in one test process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.reconciles = Counter("grstack_operator_reconcile_total", "Reconcile passes",
                                  ["kind", "result"], registry=self.registry)
        self.reconcile_seconds = Histogram("grstack_operator_reconcile_seconds", "Duration of a reconcile pass",
                                           ["kind"], registry=self.registry)
        self.pods_created = Counter("grstack_operator_pods_created_total", "Worker pods created",
                                    registry=self.registry)
        self.pods_deleted = Counter("grstack_operator_pods_deleted_total", "Worker pods deleted",
                                    registry=self.registry)
        self.restarts = Counter("grstack_operator_gang_restarts_total", "Whole-gang restarts of training jobs",
                                registry=self.registry)
        self.jobs = Gauge("grstack_operator_training_jobs", "Training jobs by state", ["state"],
                          registry=self.registry)
        self.services_ready = Gauge("grstack_operator_ranking_services_ready",
                                    "Ranking services whose Ready condition is True", registry=self.registry)
        self.leader = Gauge("grstack_operator_leader", "1 while this replica leads (always 1 when standalone)",
                            registry=self.registry)
        self.leader.set(1)
        self._job_states: dict[tuple[str, str], str] = {}
        self._services: dict[tuple[str, str], bool] = {}

    def job_state(self, key: tuple[str, str], state: str | None) -> None:
        if state is None:
            self._job_states.pop(key, None)
        else:
            self._job_states[key] = state
        counts: dict[str, int] = {}
        for value in self._job_states.values():
            counts[value] = counts.get(value, 0) + 1
        for state_name in ("Created", "Running", "Restarting", "Succeeded", "Failed", "Suspended"):
            self.jobs.labels(state_name).set(counts.get(state_name, 0))

    def job_state_of(self, key: tuple[str, str]) -> str | None:
        return self._job_states.get(key)

    def service_ready(self, key: tuple[str, str], ready: bool | None) -> None:
        if ready is None:
            self._services.pop(key, None)
        else:
            self._services[key] = ready
        self.services_ready.set(sum(self._services.values()))

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        start_http_server(port, addr=addr, registry=self.registry)
