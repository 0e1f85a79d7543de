"""The API's read routes: `/metrics`, `/healthz` and the GETs under `/v1/`. Each serves
the hub's latest state or a provider's in-memory view (control/actions.py read
providers) and never touches hardware. `/healthz` is always open; the others need a token
when the daemon listens beyond loopback without `api.open_reads` (control/access.py)."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.responses import Response

from gpuguard.control.access import known_gpu, need, read_access
from gpuguard.sinks.metrics import CONTENT_TYPE
from gpuguard.sinks.status import status_document
from gpuguard.state.audit import jsonable

router = APIRouter()
read = [Depends(read_access)]


@router.get("/metrics", include_in_schema=False, dependencies=read)
async def get_metrics(request: Request) -> Response:
    # on the loop, not the thread pool: the render formats memory only (2-10 ms, blocks
    # served as rendered when unchanged), and a worker thread would hold the GIL for it
    # anyway, plus two thread handoffs a scrape
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE)


@router.get("/healthz")
def healthz(request: Request) -> dict[str, Any]:
    hub = request.app.state.hub
    last = hub.last_poll.get("gpu")
    doc: dict[str, Any] = {"ok": hub.poll_fresh(), "last_poll": last}
    state = getattr(request.app.state, "state_health", None)
    if state is not None:  # telemetry runs without it; audited actions do not
        doc["state_dir"] = state().to_dict()
    return doc


@router.get("/v1/status", dependencies=read)
def get_status(request: Request) -> dict[str, Any]:
    doc = status_document(request.app.state.hub)
    doc["pending_confirm"] = {g: p.to_dict() for g, p in request.app.state.confirm.pending.items()}
    return doc


@router.get("/v1/gpus", dependencies=read)
def get_gpus(request: Request) -> list[dict[str, Any]]:
    snap = request.app.state.hub.snapshot
    return [g.to_dict() for g in snap.gpus] if snap else []


@router.get("/v1/gpus/{gpu}", dependencies=read)
def get_gpu(gpu: str, request: Request) -> dict[str, Any]:
    name = known_gpu(request, gpu)
    return request.app.state.hub.snapshot.gpu(name).to_dict()


@router.get("/v1/events", dependencies=read)
def get_events(
    request: Request,
    since: float | None = Query(None, description="unix time; events at or after it"),
    limit: int = Query(1000, ge=1, le=10000, description="the newest N"),
) -> list[dict[str, Any]]:
    return [e.to_dict() for e in request.app.state.hub.recent_events(since)][-limit:]


def _provided(request: Request, name: str) -> Any:
    (fn,) = need(request.app.state.actions, name)
    doc = fn()
    if doc is None:  # the provider runs but has nothing yet (first walk, first scan)
        raise HTTPException(503, detail=f"{name}: not available yet; try again in a few seconds")
    return doc


@router.get("/v1/engines", dependencies=read)
def get_engines(request: Request) -> list[dict[str, Any]]:
    return jsonable(list(_provided(request, "engines")))


@router.get("/v1/incidents", dependencies=read)
def get_incidents(request: Request) -> list[dict[str, Any]]:
    return jsonable(list(_provided(request, "incidents")))


@router.get("/v1/profiles", dependencies=read)
def get_profiles(request: Request) -> list[dict[str, Any]]:
    return jsonable(list(_provided(request, "profiles")))


@router.get("/v1/pcie", dependencies=read)
def get_pcie(request: Request) -> dict[str, Any]:
    return jsonable(_provided(request, "pcie"))


@router.get("/v1/power", dependencies=read)
def get_power(request: Request) -> dict[str, Any]:
    return jsonable(_provided(request, "power"))


@router.get("/v1/config", dependencies=read)
def get_config(request: Request) -> dict[str, Any]:
    view = request.app.state.config_view
    if view is None:
        raise HTTPException(501, detail="this server was started without a config")
    return view()
