"""The HTTP surface of the daemon (FastAPI on uvicorn, same process and event loop):
`/metrics`, `/healthz` and the JSON control API under `/v1/`. Read endpoints serve the
hub's latest state and never touch hardware."""
from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, HTTPException, Query
from fastapi.responses import JSONResponse, Response

from gpuguard import __version__
from gpuguard.sinks.metrics import CONTENT_TYPE, MetricsSink
from gpuguard.state.hub import Hub


def status_document(hub: Hub) -> dict[str, Any]:
    snap = hub.snapshot
    gpus = [g.to_dict() for g in snap.gpus] if snap else []
    return {
        "version": __version__,
        "time": time.time(),
        "last_poll": dict(hub.last_poll),
        "gpus": gpus,
        "summary": summary_line(hub),
    }


def summary_line(hub: Hub) -> str:
    snap = hub.snapshot
    if snap is None:
        return "starting: no poll yet"
    up = sum(1 for g in snap.gpus if g.up)
    down = [g.name for g in snap.gpus if not g.up]
    line = f"{up}/{len(snap.gpus)} GPUs up"
    if down:
        line += f"; down: {', '.join(down)}"
    return line


def build_app(hub: Hub, metrics: MetricsSink) -> FastAPI:
    app = FastAPI(title="gpuguard", version=__version__, docs_url=None, redoc_url=None)
    app.state.hub = hub
    app.state.metrics = metrics

    @app.get("/metrics", include_in_schema=False)
    def get_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        last = hub.last_poll.get("gpu")
        return {"ok": last is not None, "last_poll": last}

    @app.get("/v1/status")
    def get_status() -> dict[str, Any]:
        return status_document(hub)

    @app.get("/v1/gpus")
    def get_gpus() -> list[dict[str, Any]]:
        snap = hub.snapshot
        return [g.to_dict() for g in snap.gpus] if snap else []

    @app.get("/v1/gpus/{gpu}")
    def get_gpu(gpu: str) -> dict[str, Any]:
        snap = hub.snapshot
        g = snap.gpu(gpu) if snap else None
        if g is None:
            raise HTTPException(404, detail=f"no GPU named {gpu!r}")
        return g.to_dict()

    @app.get("/v1/events")
    def get_events(since: float | None = Query(None, description="unix time")) -> list[dict[str, Any]]:
        return [e.to_dict() for e in hub.recent_events(since)]

    return app
