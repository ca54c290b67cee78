"""What a process of each role would run with, from this environment (``specsplit config
[ROLE]``): its settings objects (specsplit.config, brokers.settings, the models') plus the
values derived from them."""

from __future__ import annotations

from brokers.metrics import instance_slot, metrics_port
from brokers.settings import SERVICES, MetricsSettings, RouterSettings
from specsplit.api.settings import ApiSettings
from specsplit.config import OrchestratorSettings, ProducerSettings, WorkerSettings
from specsplit.models.settings import ModelSettings, model_dtype

ROLES = ("router", "draft", "target", "pair", "orchestrator", "produce", "api")


def effective_settings(role: str) -> dict:
    """What a process of ``role`` would run with, from this environment, as JSON-ready data:
    its settings objects plus the values derived from them (model dtype and device, backend
    threads, addresses). ``specsplit config [ROLE]`` prints it."""
    if role == "router":
        return {service: {**RouterSettings(service=service).model_dump(mode="json"),
                          **metrics_effective(f"router_{service}")} for service in SERVICES}
    if role == "pair":  # a draft and a target worker in one process: each one's view
        return {service: effective_settings(service) for service in ("draft", "target")}
    if role in ("draft", "target"):
        from specsplit.backends import build_backend  # torch: only this role's report loads it

        worker, models = WorkerSettings(), ModelSettings()
        device = getattr(models, f"{role}_device")
        backend = build_backend(role, device, worker)
        return {
            "worker": worker.model_dump(mode="json"),
            "models": models.model_dump(mode="json"),
            "effective": {
                "identity": worker.identity(role), "router_backend": worker.backend(role),
                "model": getattr(models, f"{role}_model") or f"preset {models.preset}",
                "dtype": backend.load_dtype(model_dtype(role, models)), "device": device,
                **backend.describe(), **metrics_effective(role),
            },
        }
    if role == "orchestrator":
        s = OrchestratorSettings()
        spec = s.specpv_spec()
        return {"orchestrator": s.model_dump(mode="json"),
                "effective": {"tree": s.tree().model_dump(mode="json"),
                              "specpv": spec.model_dump(mode="json") if spec else None,
                              **metrics_effective(role)}}
    if role == "produce":
        return {"produce": ProducerSettings().model_dump(mode="json")}
    if role == "api":
        s = ApiSettings()
        return {"api": s.model_dump(mode="json"), "effective": {"url": f"http://{s.api_host}:{s.bind_port()}/v1"}}
    raise ValueError(f"unknown role {role!r}; roles: {', '.join(ROLES)}")


def metrics_effective(role: str) -> dict:
    """The metrics settings a process of ``role`` (this honcho instance) reads, and the URL it
    serves (None: off)."""
    s = MetricsSettings()
    try:
        port = metrics_port(s, role, instance_slot())
    except ValueError as exc:  # the process would log it and serve no metrics
        return {"metrics": s.model_dump(mode="json"), "metrics_url": None, "metrics_error": str(exc)}
    return {"metrics": s.model_dump(mode="json"),
            "metrics_url": f"http://{s.metrics_host}:{port}/metrics" if port else None}
